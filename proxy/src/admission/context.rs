//! The context a replica's sequences take, learnt from the requests it served, and the cap it plans
//! from the replica's KV capacity.
//!
//! ```text
//! context_r = mean (prompt + output tokens) of the replica's last `window` finished requests,
//!             once `min_samples` have finished; the configured context_tokens until then
//! plan_r    = ⌊headroom · KV_tokens_r / context_r⌋
//! ```
//!
//! | parameter | value | why |
//! |---|---|---|
//! | `window` | 512 requests | recent enough to follow a change of traffic within minutes |
//! | `min_samples` | 32 requests | a mean of fewer is mostly noise |
//!
//! The mean, not a high percentile: the cache holds the sum of the running sequences, and a sum of
//! n sequences is n times their mean whatever the tail. It plans for every sequence at its full
//! length, which a running batch never reaches at once, and the prefix cache shares blocks between
//! sequences: both leave room the feedback loop (`cap.rs`) raises the cap into.

use std::collections::VecDeque;

/// Finished requests the mean is taken over.
pub const WINDOW: usize = 512;
/// Finished requests before the mean replaces the configured context.
pub const MIN_SAMPLES: usize = 32;

/// The recent contexts of one replica's requests.
#[derive(Debug, Clone, Default)]
pub struct ContextEstimate {
    recent: VecDeque<u32>,
    sum: u64,
}

impl ContextEstimate {
    /// A finished request took `tokens` (prompt + output).
    pub fn observe(&mut self, tokens: u32) {
        if tokens == 0 {
            return;
        }
        if self.recent.len() == WINDOW {
            if let Some(old) = self.recent.pop_front() {
                self.sum -= u64::from(old);
            }
        }
        self.recent.push_back(tokens);
        self.sum += u64::from(tokens);
    }

    /// The mean context, once [`MIN_SAMPLES`] requests finished.
    pub fn mean(&self) -> Option<f64> {
        (self.recent.len() >= MIN_SAMPLES).then(|| self.sum as f64 / self.recent.len() as f64)
    }

    /// The context to plan for: the learnt mean, else `configured`.
    pub fn context(&self, configured: f64) -> f64 {
        self.mean().unwrap_or(configured).max(1.0)
    }
}

/// `⌊headroom · kv_tokens / context⌋`.
pub fn plan(headroom: f64, kv_tokens: u64, context: f64) -> u32 {
    (headroom * kv_tokens as f64 / context.max(1.0))
        .floor()
        .clamp(0.0, f64::from(u32::MAX)) as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_mean_takes_over_after_enough_requests_and_follows_the_window() {
        let mut c = ContextEstimate::default();
        for _ in 0..MIN_SAMPLES - 1 {
            c.observe(1_000);
        }
        assert_eq!(c.context(2_300.0), 2_300.0, "too few to judge");
        c.observe(1_000);
        assert_eq!(c.context(2_300.0), 1_000.0);
        // The traffic changes: after a full window of 8k contexts, only they count.
        for _ in 0..WINDOW {
            c.observe(8_000);
        }
        assert_eq!(c.mean(), Some(8_000.0));
        c.observe(0);
        assert_eq!(c.mean(), Some(8_000.0), "an empty answer says nothing");
    }

    #[test]
    fn the_plan_is_the_capacity_notes_cap() {
        // Llama-3.1-8B on one H100: 460,496 KV tokens; at 2,300 tokens a sequence, 90%: 180.
        assert_eq!(plan(0.9, 460_496, 2_300.0), 180);
        assert_eq!(plan(0.9, 460_496, 13_733.0), 30);
        assert_eq!(plan(0.9, 1_000, 0.0), 900);
    }
}
