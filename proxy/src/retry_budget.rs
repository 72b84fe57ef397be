//! Retry budget: retries may add at most a fixed share of the traffic, so a fleet-wide failure is
//! not multiplied by the proxy (Finagle's and Envoy's retry budgets).
//!
//! ```text
//! a retry is allowed  ⇔  retries(W) + 1 ≤ min_retries + ratio · requests(W)
//! ```
//!
//! | symbol | meaning | default |
//! |---|---|---|
//! | `W` | the last `WINDOW_SECS` seconds, in one-second buckets | 10 s |
//! | `requests(W)`, `retries(W)` | client requests forwarded and retries made in `W` | |
//! | `ratio` | `limits.retry_budget_ratio` | 0.2 |
//! | `min_retries` | `limits.retry_budget_min`: retries allowed even at low traffic | 3 |
//!
//! So over any window, upstream attempts ≤ (1 + ratio) · requests + min_retries.

use std::sync::Mutex;
use std::time::Instant;

/// Seconds of history the budget counts.
pub const WINDOW_SECS: u64 = 10;

#[derive(Debug, Clone, Copy, Default)]
struct Bucket {
    second: u64,
    requests: u64,
    retries: u64,
}

/// The budget, shared by every request.
#[derive(Debug)]
pub struct RetryBudget {
    ratio: f64,
    min_retries: u64,
    epoch: Instant,
    buckets: Mutex<[Bucket; WINDOW_SECS as usize]>,
}

impl RetryBudget {
    /// A budget of `min_retries` plus `ratio` of the requests in the window.
    pub fn new(ratio: f64, min_retries: u32) -> Self {
        Self {
            ratio,
            min_retries: u64::from(min_retries),
            epoch: Instant::now(),
            buckets: Mutex::new([Bucket::default(); WINDOW_SECS as usize]),
        }
    }

    /// The bucket of `second`, emptied first if it last held an older second (which is then out
    /// of the window).
    fn current(buckets: &mut [Bucket; WINDOW_SECS as usize], second: u64) -> &mut Bucket {
        let slot = &mut buckets[(second % WINDOW_SECS) as usize];
        if slot.second != second {
            *slot = Bucket {
                second,
                ..Bucket::default()
            };
        }
        slot
    }

    fn second(&self, now: Instant) -> u64 {
        now.saturating_duration_since(self.epoch).as_secs()
    }

    /// Counts a client request.
    pub fn on_request(&self, now: Instant) {
        let second = self.second(now);
        let mut b = self.buckets.lock().unwrap_or_else(|e| e.into_inner());
        Self::current(&mut b, second).requests += 1;
    }

    /// Takes one retry from the budget; false when it is spent.
    pub fn try_retry(&self, now: Instant) -> bool {
        let second = self.second(now);
        let mut b = self.buckets.lock().unwrap_or_else(|e| e.into_inner());
        Self::current(&mut b, second);
        let (requests, retries) = b
            .iter()
            .filter(|x| x.second + WINDOW_SECS > second)
            .fold((0, 0), |(q, r), x| (q + x.requests, r + x.retries));
        let allowed =
            (retries + 1) as f64 <= self.min_retries as f64 + self.ratio * requests as f64;
        if allowed {
            Self::current(&mut b, second).retries += 1;
        }
        allowed
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn retries_stay_within_the_share_of_requests() {
        let budget = RetryBudget::new(0.2, 3);
        let t0 = budget.epoch;
        // Everything fails: each request would retry twice.
        let mut attempts = 0;
        for i in 0..100u64 {
            let now = t0 + Duration::from_millis(i * 50);
            budget.on_request(now);
            attempts += 1;
            for _ in 0..2 {
                if budget.try_retry(now) {
                    attempts += 1;
                }
            }
        }
        // Over the 5 s of traffic (inside one window): ≤ 1.2 · 100 + 3.
        assert!(attempts <= 123, "{attempts}");
        assert!(attempts >= 120, "{attempts}");
    }

    #[test]
    fn the_window_forgets_old_traffic() {
        let budget = RetryBudget::new(0.2, 3);
        let t0 = budget.epoch;
        for _ in 0..3 {
            assert!(budget.try_retry(t0));
        }
        assert!(!budget.try_retry(t0), "min_retries spent");
        // Past the window the old retries no longer count.
        let later = t0 + Duration::from_secs(WINDOW_SECS + 1);
        assert!(budget.try_retry(later));
        // Many requests earn retries.
        for _ in 0..50 {
            budget.on_request(later);
        }
        let earned = (0..20).filter(|_| budget.try_retry(later)).count();
        assert_eq!(earned, 12, "3 + 0.2 · 50 − the 1 already taken");
    }
}
