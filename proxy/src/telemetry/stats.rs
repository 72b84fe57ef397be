//! Sliding-window latency statistics for `/stats`: exact-to-0.4% percentiles of TTFT, ITL, TPOT,
//! E2E and queue time, and goodput, per pool and class, over the last minute and five minutes.
//!
//! ```text
//! window(W) = merge of the slots whose start is within W of now     slots are SLOT_SECS long
//! goodput_rps(W)    = good requests in the window / W
//! goodput_tok_s(W)  = output tokens of good requests in the window / W
//! ```
//!
//! | parameter | value | why |
//! |---|---|---|
//! | `SLOT_SECS` | 10 | a 1-minute window moves in 10 s steps |
//! | `SLOTS` | 30 | covers the 5-minute window |
//! | significant digits | 2 | percentiles within 0.4% (a bucket's middle); a slot's five histograms stay ~50 KB |
//!
//! Values are recorded in microseconds (1 µs to 1 hour); each measure's maximum is kept exactly. Until a window has been running for its
//! whole length, rates are over the time since the first slot.

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use serde::Serialize;

/// Seconds per slot.
pub const SLOT_SECS: u64 = 10;
/// Slots kept.
pub const SLOTS: usize = 30;
/// The windows `/stats` reports, in seconds.
pub const WINDOWS: &[(&str, u64)] = &[("1m", 60), ("5m", 300)];

const MAX_MICROS: u64 = 3_600_000_000;

/// One finished request, as the statistics need it.
#[derive(Debug, Clone, Default)]
pub struct Finished<'a> {
    /// Completed without error.
    pub completed: bool,
    /// Completed and met its objectives.
    pub good: bool,
    /// Output tokens.
    pub output_tokens: u64,
    /// Prompt tokens.
    pub prompt_tokens: u64,
    /// Arrival to dispatch.
    pub queue: Option<Duration>,
    /// Time to first token.
    pub ttft: Option<Duration>,
    /// Time per output token.
    pub tpot: Option<Duration>,
    /// End to end.
    pub e2e: Option<Duration>,
    /// Inter-token gaps.
    pub itl: &'a [Duration],
}

#[derive(Debug, Clone)]
struct Slot {
    start: u64,
    requests: u64,
    completed: u64,
    good: u64,
    output_tokens: u64,
    good_output_tokens: u64,
    prompt_tokens: u64,
    hists: [Histogram<u32>; 5],
    /// Each measure's largest value in µs, exact (a histogram keeps only its bucket).
    max_us: [u64; 5],
}

const TTFT: usize = 0;
const ITL: usize = 1;
const TPOT: usize = 2;
const E2E: usize = 3;
const QUEUE: usize = 4;
const NAMES: [&str; 5] = ["ttft_ms", "itl_ms", "tpot_ms", "e2e_ms", "queue_ms"];

fn histogram() -> Histogram<u32> {
    // Bounds and digits are constants that hdrhistogram accepts.
    let mut h = Histogram::new_with_bounds(1, MAX_MICROS, 2).expect("valid histogram bounds");
    h.auto(false);
    h
}

impl Slot {
    fn new(start: u64) -> Self {
        Self {
            start,
            requests: 0,
            completed: 0,
            good: 0,
            output_tokens: 0,
            good_output_tokens: 0,
            prompt_tokens: 0,
            hists: std::array::from_fn(|_| histogram()),
            max_us: [0; 5],
        }
    }

    fn record(&mut self, f: &Finished<'_>) {
        let us = |d: Duration| (d.as_micros() as u64).clamp(1, MAX_MICROS);
        self.requests += 1;
        self.completed += u64::from(f.completed);
        self.good += u64::from(f.good);
        self.output_tokens += f.output_tokens;
        self.prompt_tokens += f.prompt_tokens;
        if f.good {
            self.good_output_tokens += f.output_tokens;
        }
        for (i, v) in [
            (TTFT, f.ttft),
            (TPOT, f.tpot),
            (E2E, f.e2e),
            (QUEUE, f.queue),
        ] {
            if let Some(v) = v {
                self.observe(i, us(v));
            }
        }
        for gap in f.itl {
            self.observe(ITL, us(*gap));
        }
    }

    fn observe(&mut self, measure: usize, us: u64) {
        let _ = self.hists[measure].record(us);
        self.max_us[measure] = self.max_us[measure].max(us);
    }
}

/// Percentiles of one measure, in ms.
#[derive(Debug, Clone, Serialize)]
pub struct Quantiles {
    /// Observations.
    pub count: u64,
    /// Median.
    pub p50: f64,
    /// 95th percentile.
    pub p95: f64,
    /// 99th percentile.
    pub p99: f64,
    /// Largest.
    pub max: f64,
}

/// One pool and class over one window.
#[derive(Debug, Clone, Serialize)]
pub struct WindowStats {
    /// Pool.
    pub pool: String,
    /// Class.
    pub class: String,
    /// Seconds the numbers cover (less than the window while it fills).
    pub seconds: f64,
    /// Requests finished.
    pub requests: u64,
    /// Requests completed without error.
    pub completed: u64,
    /// Completed requests that met the class's objectives.
    pub good: u64,
    /// Good requests per second.
    pub goodput_rps: f64,
    /// Output tokens of good requests per second.
    pub goodput_tokens_per_s: f64,
    /// Output tokens per second, good or not.
    pub output_tokens_per_s: f64,
    /// Prompt tokens per second.
    pub prompt_tokens_per_s: f64,
    /// Latency percentiles by measure (`ttft_ms`, `itl_ms`, `tpot_ms`, `e2e_ms`, `queue_ms`).
    pub latency: BTreeMap<&'static str, Quantiles>,
}

#[derive(Debug, Default)]
struct Group {
    slots: Vec<Slot>,
}

/// Sliding windows per (pool, class).
#[derive(Debug)]
pub struct Stats {
    origin: Instant,
    groups: Mutex<BTreeMap<(String, String), Group>>,
}

impl Default for Stats {
    fn default() -> Self {
        Self::new(Instant::now())
    }
}

impl Stats {
    /// Empty statistics whose slots count from `origin`.
    pub fn new(origin: Instant) -> Self {
        Self {
            origin,
            groups: Mutex::new(BTreeMap::new()),
        }
    }

    fn slot_start(&self, now: Instant) -> u64 {
        let secs = now.saturating_duration_since(self.origin).as_secs();
        secs - secs % SLOT_SECS
    }

    /// Records a finished request of `pool` and `class` at `now`.
    pub fn record(&self, pool: &str, class: &str, f: &Finished<'_>, now: Instant) {
        let start = self.slot_start(now);
        let mut groups = self.groups.lock().unwrap_or_else(|e| e.into_inner());
        let g = groups
            .entry((pool.to_owned(), class.to_owned()))
            .or_default();
        let oldest = start.saturating_sub(SLOT_SECS * (SLOTS as u64 - 1));
        g.slots.retain(|s| s.start >= oldest);
        if g.slots.last().is_none_or(|s| s.start != start) {
            g.slots.push(Slot::new(start));
        }
        if let Some(s) = g.slots.last_mut() {
            s.record(f);
        }
    }

    /// Every group over every window in [`WINDOWS`], at `now`.
    pub fn snapshot(&self, now: Instant) -> BTreeMap<&'static str, Vec<WindowStats>> {
        let current = self.slot_start(now);
        let elapsed = now.saturating_duration_since(self.origin).as_secs_f64();
        let groups = self.groups.lock().unwrap_or_else(|e| e.into_inner());
        let mut out = BTreeMap::new();
        for &(name, secs) in WINDOWS {
            let first = (current + SLOT_SECS).saturating_sub(secs);
            let mut rows = Vec::new();
            for ((pool, class), g) in groups.iter() {
                let slots: Vec<&Slot> = g.slots.iter().filter(|s| s.start >= first).collect();
                if slots.is_empty() {
                    continue;
                }
                // The window runs from its first slot's start (or the origin) to now.
                let seconds = (elapsed - first as f64).clamp(1.0, secs as f64);
                let sum = |f: fn(&Slot) -> u64| slots.iter().map(|s| f(s)).sum::<u64>();
                let mut latency = BTreeMap::new();
                for (i, label) in NAMES.iter().enumerate() {
                    let mut h = histogram();
                    for s in &slots {
                        let _ = h.add(&s.hists[i]);
                    }
                    if h.is_empty() {
                        continue;
                    }
                    // The middle of the value's bucket, not its upper edge: within half a
                    // bucket (0.4%) of the exact percentile either way, instead of up to a whole
                    // bucket above it.
                    let ms = |q: f64| h.median_equivalent(h.value_at_quantile(q)) as f64 / 1e3;
                    latency.insert(
                        *label,
                        Quantiles {
                            count: h.len(),
                            p50: ms(0.50),
                            p95: ms(0.95),
                            p99: ms(0.99),
                            max: slots.iter().map(|s| s.max_us[i]).max().unwrap_or(0) as f64 / 1e3,
                        },
                    );
                }
                rows.push(WindowStats {
                    pool: pool.clone(),
                    class: class.clone(),
                    seconds,
                    requests: sum(|s| s.requests),
                    completed: sum(|s| s.completed),
                    good: sum(|s| s.good),
                    goodput_rps: sum(|s| s.good) as f64 / seconds,
                    goodput_tokens_per_s: sum(|s| s.good_output_tokens) as f64 / seconds,
                    output_tokens_per_s: sum(|s| s.output_tokens) as f64 / seconds,
                    prompt_tokens_per_s: sum(|s| s.prompt_tokens) as f64 / seconds,
                    latency,
                });
            }
            out.insert(name, rows);
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(x: u64) -> Duration {
        Duration::from_millis(x)
    }

    #[test]
    fn windows_hold_what_fell_inside_them() {
        let t0 = Instant::now();
        let stats = Stats::new(t0);
        // 100 good requests with TTFT 1..=100 ms in the first slot, then one bad one four minutes on.
        for i in 1..=100 {
            let f = Finished {
                completed: true,
                good: true,
                output_tokens: 10,
                ttft: Some(ms(i)),
                itl: &[ms(5), ms(7)],
                ..Finished::default()
            };
            stats.record("p", "c", &f, t0 + ms(500));
        }
        let late = t0 + Duration::from_secs(240);
        let bad = Finished {
            completed: true,
            ttft: Some(ms(5000)),
            output_tokens: 3,
            ..Finished::default()
        };
        stats.record("p", "c", &bad, late);
        let snap = stats.snapshot(late + ms(100));
        let five = &snap["5m"][0];
        assert_eq!((five.requests, five.good), (101, 100));
        let ttft = &five.latency["ttft_ms"];
        assert_eq!(ttft.count, 101);
        assert!((ttft.p50 - 51.0).abs() <= 0.6, "{}", ttft.p50);
        assert!((ttft.p99 - 100.0).abs() <= 1.0, "{}", ttft.p99);
        assert!((five.goodput_tokens_per_s - 1000.0 / 240.1).abs() < 0.01);
        assert_eq!(five.latency["itl_ms"].count, 200);
        let one = &snap["1m"][0];
        assert_eq!((one.requests, one.good), (1, 0));
        assert!((one.latency["ttft_ms"].p50 - 5000.0).abs() <= 50.0);
        // Ten minutes later everything has slid out.
        let later = t0 + Duration::from_secs(600);
        stats.record("p", "other", &bad, later);
        let snap = stats.snapshot(later);
        assert_eq!(snap["5m"].len(), 1);
        assert_eq!(snap["5m"][0].class, "other");
    }

    #[test]
    fn percentiles_fall_within_half_a_bucket_of_the_exact_ones() {
        let t0 = Instant::now();
        let stats = Stats::new(t0);
        // 10,000 gaps spread evenly over 10–12 ms: the exact p50 is 11 ms, p99 11.98 ms.
        let gaps: Vec<Duration> = (0..10_000u64)
            .map(|i| Duration::from_nanos(10_000_000 + i * 200))
            .collect();
        let f = Finished {
            completed: true,
            itl: &gaps,
            ..Finished::default()
        };
        stats.record("p", "c", &f, t0);
        let itl = &stats.snapshot(t0)["1m"][0].latency["itl_ms"];
        for (got, exact) in [(itl.p50, 11.0), (itl.p95, 11.9), (itl.p99, 11.98)] {
            // Two significant digits: buckets of 1/128 of the value here, half of that either way.
            assert!(
                (got - exact).abs() <= exact / 256.0,
                "{got} against {exact}"
            );
        }
        // The largest gap is exact to the µs, not its bucket's edge, and the window's maximum is the
        // largest over its slots.
        assert_eq!(itl.max, 11.999);
        let later = Finished {
            completed: true,
            itl: &[Duration::from_micros(10_321)],
            ..Finished::default()
        };
        stats.record("p", "c", &later, t0 + Duration::from_secs(SLOT_SECS));
        let snap = stats.snapshot(t0 + Duration::from_secs(SLOT_SECS));
        assert_eq!(snap["1m"][0].latency["itl_ms"].max, 11.999);
    }
}
