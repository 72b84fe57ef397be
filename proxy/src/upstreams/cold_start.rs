//! A replica's cold start, as the proxy sees it: from when it first saw the replica (or saw it go
//! down) to its first passing health probe, and to the first output token it served.
//!
//! ```text
//! begins:   the replica enters the fleet (start, reload), or is judged down (health.unhealthy_after
//!           failing probes in a row) after a probe passed
//! healthy:  first passing probe after it began           → healthy_after = t − began
//! serving:  first output token it served after it began  → first_token_after = t − began
//! ```
//!
//! The probe interval bounds the error of `healthy_after` (a replica that came up just after a
//! probe is seen at the next one); `first_token_after` is exact to the token.

use std::time::{Duration, Instant};

/// The latest cold start of one replica.
#[derive(Debug, Clone)]
pub struct ColdStart {
    /// When the latest cold start began.
    began: Instant,
    /// Whether the last probe passed.
    up: bool,
    healthy_after: Option<Duration>,
    first_token_after: Option<Duration>,
}

impl ColdStart {
    /// A replica first seen at `now`.
    pub fn new(now: Instant) -> Self {
        Self {
            began: now,
            up: false,
            healthy_after: None,
            first_token_after: None,
        }
    }

    /// A health probe's result at `now`.
    pub fn probe(&mut self, passed: bool, now: Instant) {
        match (passed, self.up) {
            (true, false) => {
                if self.healthy_after.is_none() {
                    self.healthy_after = Some(now.saturating_duration_since(self.began));
                }
                self.up = true;
            }
            (false, true) => {
                // Down after being up: a restart (or an outage) begins a new cold start.
                *self = Self::new(now);
            }
            _ => {}
        }
    }

    /// The replica served an output token at `now`.
    pub fn token_served(&mut self, now: Instant) {
        if self.first_token_after.is_none() {
            self.first_token_after = Some(now.saturating_duration_since(self.began));
        }
    }

    /// From the latest cold start's beginning to the first passing probe, once there was one.
    pub fn healthy_after(&self) -> Option<Duration> {
        self.healthy_after
    }

    /// From the latest cold start's beginning to the first token served, once there was one.
    pub fn first_token_after(&self) -> Option<Duration> {
        self.first_token_after
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_slow_start_then_a_restart_are_each_measured() {
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        let mut c = ColdStart::new(t0);
        c.probe(false, at(1_000));
        assert_eq!(c.healthy_after(), None);
        c.probe(true, at(20_000));
        c.probe(true, at(21_000));
        assert_eq!(c.healthy_after(), Some(Duration::from_secs(20)));
        assert_eq!(c.first_token_after(), None);
        c.token_served(at(20_500));
        c.token_served(at(30_000));
        assert_eq!(c.first_token_after(), Some(Duration::from_millis(20_500)));
        // Killed at 40 s, the first failed probe at 41 s, healthy again at 56 s.
        c.probe(false, at(41_000));
        assert_eq!((c.healthy_after(), c.first_token_after()), (None, None));
        c.probe(false, at(42_000));
        c.probe(true, at(56_000));
        c.token_served(at(57_000));
        assert_eq!(c.healthy_after(), Some(Duration::from_secs(15)));
        assert_eq!(c.first_token_after(), Some(Duration::from_secs(16)));
    }

    #[test]
    fn a_replica_up_from_the_start_is_warm_at_once() {
        let t0 = Instant::now();
        let mut c = ColdStart::new(t0);
        c.token_served(t0 + Duration::from_millis(5));
        c.probe(true, t0 + Duration::from_millis(40));
        assert_eq!(c.first_token_after(), Some(Duration::from_millis(5)));
        assert_eq!(c.healthy_after(), Some(Duration::from_millis(40)));
    }
}
