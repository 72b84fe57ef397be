//! Latency summaries: exact-enough percentiles from an HDR histogram (3 significant digits, 1 µs
//! to 1 hour), so a summary of a million samples costs the same as one of ten.

use std::time::Duration;

use hdrhistogram::Histogram;
use serde::Serialize;

/// Percentiles of one latency, in milliseconds.
#[derive(Debug, Clone, Copy, Default, Serialize, PartialEq)]
pub struct Percentiles {
    /// Samples.
    pub count: u64,
    /// Mean.
    pub mean_ms: f64,
    /// Median.
    pub p50_ms: f64,
    /// 90th percentile.
    pub p90_ms: f64,
    /// 95th percentile.
    pub p95_ms: f64,
    /// 99th percentile.
    pub p99_ms: f64,
    /// Largest.
    pub max_ms: f64,
}

/// Accumulates durations.
#[derive(Debug, Clone)]
pub struct LatencyHistogram(Histogram<u64>);

impl Default for LatencyHistogram {
    fn default() -> Self {
        // 1 µs .. 1 h at 3 significant digits: valid bounds, so construction cannot fail.
        Self(Histogram::new_with_bounds(1, 3_600_000_000, 3).expect("valid histogram bounds"))
    }
}

impl LatencyHistogram {
    /// Adds one sample (clamped into the histogram's range).
    pub fn record(&mut self, d: Duration) {
        let us = (d.as_micros() as u64).clamp(1, 3_600_000_000);
        // In range by construction.
        let _ = self.0.record(us);
    }

    /// The summary.
    pub fn percentiles(&self) -> Percentiles {
        if self.0.is_empty() {
            return Percentiles::default();
        }
        let ms = |us: u64| us as f64 / 1e3;
        Percentiles {
            count: self.0.len(),
            mean_ms: self.0.mean() / 1e3,
            p50_ms: ms(self.0.value_at_quantile(0.50)),
            p90_ms: ms(self.0.value_at_quantile(0.90)),
            p95_ms: ms(self.0.value_at_quantile(0.95)),
            p99_ms: ms(self.0.value_at_quantile(0.99)),
            max_ms: ms(self.0.max()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_of_a_uniform_ramp() {
        let mut h = LatencyHistogram::default();
        for ms in 1..=1000 {
            h.record(Duration::from_millis(ms));
        }
        let p = h.percentiles();
        assert_eq!(p.count, 1000);
        assert!((p.p50_ms - 500.0).abs() < 1.0, "{p:?}");
        assert!((p.p99_ms - 990.0).abs() < 1.0, "{p:?}");
        assert!((p.max_ms - 1000.0).abs() < 1.0, "{p:?}");
        assert!((p.mean_ms - 500.5).abs() < 1.0, "{p:?}");
    }

    #[test]
    fn empty_is_all_zero() {
        assert_eq!(
            LatencyHistogram::default().percentiles(),
            Percentiles::default()
        );
    }
}
