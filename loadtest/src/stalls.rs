//! The load generator's own stalls during a run, so that a client-side tail can be told apart from
//! the target's: a thread asks to sleep for a fixed interval again and again and records how much
//! longer each sleep took (jHiccup's method), and the CPU time the hypervisor took from the
//! generator's cores is read from the kernel (steal, Linux only).
//!
//! | number | definition |
//! |---|---|
//! | stall | actual − asked sleep, for sleeps of [`INTERVAL`]: what any of the client's threads waiting on the same cores suffered at that moment |
//! | over 1 ms | stalls longer than 1 ms, their count and their sum |
//! | steal | `steal` ticks of `/proc/stat` summed over the CPUs this process may run on, over the run |
//!
//! A stall hits every stream the client is reading at that moment: one 3 ms stall with 30 streams
//! open adds 3 ms to 30 inter-token gaps, which no proxy or engine in front of the client can see.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use serde::{Deserialize, Serialize};

/// How long each probe sleep asks for.
pub const INTERVAL: Duration = Duration::from_millis(1);
/// Stalls above this are counted and summed.
const LONG: Duration = Duration::from_millis(1);
/// Linux's USER_HZ: `/proc/stat` counts in hundredths of a second on every architecture it runs.
const TICKS_PER_S: f64 = 100.0;

/// What the probe measured over a run.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Stalls {
    /// The asked sleep, ms.
    pub interval_ms: f64,
    /// Probe sleeps measured.
    pub samples: u64,
    /// Stall percentiles and maximum, ms.
    pub p50_ms: f64,
    pub p99_ms: f64,
    pub p999_ms: f64,
    pub max_ms: f64,
    /// Stalls over 1 ms: how many, and their sum in ms.
    pub over_1ms: u64,
    pub over_1ms_total_ms: f64,
    /// CPU time taken by the hypervisor from the cores this process may run on, s (None where
    /// the kernel does not say).
    pub steal_s: Option<f64>,
    /// `steal_s` over those cores' time in the run.
    pub steal_share: Option<f64>,
    /// The CPUs the probe and the steal count cover.
    pub cpus: Option<String>,
}

impl Stalls {
    /// One line for a text summary.
    pub fn line(&self) -> String {
        let mut s = format!(
            "client stalls ({:.0} ms sleeps overshot): p50 {:.3} ms, p99 {:.3} ms, p99.9 {:.3} ms, max {:.3} ms; {} over 1 ms ({:.1} ms in all)",
            self.interval_ms,
            self.p50_ms,
            self.p99_ms,
            self.p999_ms,
            self.max_ms,
            self.over_1ms,
            self.over_1ms_total_ms
        );
        if let (Some(steal), Some(share)) = (self.steal_s, self.steal_share) {
            s.push_str(&format!(
                "; CPU steal on the client's cores ({}): {:.2} s ({:.2}%)",
                self.cpus.as_deref().unwrap_or("all"),
                steal,
                100.0 * share
            ));
        }
        s
    }
}

/// A running probe; [`StallMeter::finish`] stops it and reads the result.
#[derive(Debug)]
pub struct StallMeter {
    stop: Arc<AtomicBool>,
    /// Taken by [`StallMeter::finish`]; a meter dropped without it stops its probe all the same.
    probe: Option<JoinHandle<Histogram<u64>>>,
    started: Instant,
    cpus: Option<Vec<usize>>,
    steal_before: Option<u64>,
}

impl StallMeter {
    /// Starts the probe thread (on whichever of the process's cores the kernel gives it).
    pub fn start() -> std::io::Result<Self> {
        let stop = Arc::new(AtomicBool::new(false));
        let probe = {
            let stop = stop.clone();
            std::thread::Builder::new()
                .name("replay-stalls".into())
                .spawn(move || probe(&stop))?
        };
        let cpus = std::fs::read_to_string("/proc/self/status")
            .ok()
            .and_then(|s| allowed_cpus(&s));
        let steal_before = read_steal(cpus.as_deref());
        Ok(Self {
            stop,
            probe: Some(probe),
            started: Instant::now(),
            cpus,
            steal_before,
        })
    }

    /// Stops the probe and summarizes it.
    pub fn finish(mut self) -> Stalls {
        self.stop.store(true, Ordering::Relaxed);
        let wall = self.started.elapsed().as_secs_f64();
        let steal_after = read_steal(self.cpus.as_deref());
        let h = self
            .probe
            .take()
            .and_then(|p| p.join().ok())
            .unwrap_or_else(histogram);
        let steal_s = self
            .steal_before
            .zip(steal_after)
            .map(|(b, a)| a.saturating_sub(b) as f64 / TICKS_PER_S);
        let ncpus = self.cpus.as_ref().map_or(1, Vec::len).max(1) as f64;
        summarize(&h, steal_s, wall * ncpus, self.cpus.as_deref())
    }
}

impl Drop for StallMeter {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

/// An empty histogram of stalls in µs, up to a minute (`Histogram::new` alone tracks only up to
/// 2,047 µs before it resizes, and a saturating record would clamp longer stalls to that).
fn histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 60_000_000, 3).expect("a histogram")
}

/// Sleeps [`INTERVAL`] until stopped (at least once), recording each overshoot in µs.
fn probe(stop: &AtomicBool) -> Histogram<u64> {
    let mut h = histogram();
    loop {
        let t = Instant::now();
        std::thread::sleep(INTERVAL);
        let over = t.elapsed().saturating_sub(INTERVAL);
        h.saturating_record(over.as_micros() as u64);
        if stop.load(Ordering::Relaxed) {
            return h;
        }
    }
}

fn summarize(
    h: &Histogram<u64>,
    steal_s: Option<f64>,
    cpu_seconds: f64,
    cpus: Option<&[usize]>,
) -> Stalls {
    let ms = |us: u64| us as f64 / 1e3;
    let (over, total) = h
        .iter_recorded()
        .filter(|v| v.value_iterated_to() > LONG.as_micros() as u64)
        .fold((0u64, 0u64), |(n, sum), v| {
            (
                n + v.count_at_value(),
                sum + v.count_at_value() * h.median_equivalent(v.value_iterated_to()),
            )
        });
    Stalls {
        interval_ms: INTERVAL.as_secs_f64() * 1e3,
        samples: h.len(),
        p50_ms: ms(h.value_at_quantile(0.5)),
        p99_ms: ms(h.value_at_quantile(0.99)),
        p999_ms: ms(h.value_at_quantile(0.999)),
        max_ms: ms(h.max()),
        over_1ms: over,
        over_1ms_total_ms: ms(total),
        steal_s,
        steal_share: steal_s.map(|s| s / cpu_seconds.max(1e-9)),
        cpus: cpus.map(cpu_list),
    }
}

/// The CPUs of `Cpus_allowed_list` in a `/proc/<pid>/status` text (`0-3,6`).
fn allowed_cpus(status: &str) -> Option<Vec<usize>> {
    let list = status
        .lines()
        .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))?
        .trim();
    let mut cpus = Vec::new();
    for part in list.split(',').filter(|p| !p.is_empty()) {
        match part.split_once('-') {
            Some((a, b)) => cpus.extend(a.trim().parse::<usize>().ok()?..=b.trim().parse().ok()?),
            None => cpus.push(part.trim().parse().ok()?),
        }
    }
    (!cpus.is_empty()).then_some(cpus)
}

/// `0,1,2,5` → `0-2,5`.
fn cpu_list(cpus: &[usize]) -> String {
    let mut out: Vec<String> = Vec::new();
    let mut i = 0;
    while i < cpus.len() {
        let mut j = i;
        while j + 1 < cpus.len() && cpus[j + 1] == cpus[j] + 1 {
            j += 1;
        }
        out.push(if i == j {
            cpus[i].to_string()
        } else {
            format!("{}-{}", cpus[i], cpus[j])
        });
        i = j + 1;
    }
    out.join(",")
}

fn read_steal(cpus: Option<&[usize]>) -> Option<u64> {
    steal_ticks(&std::fs::read_to_string("/proc/stat").ok()?, cpus)
}

/// Steal ticks (the 8th number of a `cpuN` line) summed over `cpus` (None: the all-CPU line).
fn steal_ticks(stat: &str, cpus: Option<&[usize]>) -> Option<u64> {
    let mut sum = None;
    for line in stat.lines() {
        let mut fields = line.split_whitespace();
        let Some(name) = fields.next() else { continue };
        let Some(id) = name.strip_prefix("cpu") else {
            continue;
        };
        let wanted = match (cpus, id.parse::<usize>()) {
            (None, _) => id.is_empty(),
            (Some(list), Ok(n)) => list.contains(&n),
            (Some(_), Err(_)) => false,
        };
        if wanted {
            let steal: u64 = fields.nth(7)?.parse().ok()?;
            *sum.get_or_insert(0) += steal;
        }
    }
    sum
}

#[cfg(test)]
mod tests {
    use super::*;

    const STAT: &str = "cpu  770283 0 174208 1204164 12994 0 35609 10069 0 0\n\
                        cpu0 374398 0 88040 614071 3864 0 18015 4790 0 0\n\
                        cpu1 395885 0 86167 590092 9129 0 17593 5278 0 0\n\
                        intr 1 2 3\n";

    #[test]
    fn steal_is_summed_over_the_allowed_cpus() {
        assert_eq!(steal_ticks(STAT, None), Some(10069));
        assert_eq!(steal_ticks(STAT, Some(&[1])), Some(5278));
        assert_eq!(steal_ticks(STAT, Some(&[0, 1])), Some(10068));
        assert_eq!(steal_ticks(STAT, Some(&[7])), None);
        assert_eq!(steal_ticks("cpu0 1 2\n", Some(&[0])), None, "too short");
    }

    #[test]
    fn cpu_lists_round_trip() {
        let status = "Name:\theadroom\nCpus_allowed:\t3\nCpus_allowed_list:\t0-2,5\n";
        let cpus = allowed_cpus(status).unwrap();
        assert_eq!(cpus, vec![0, 1, 2, 5]);
        assert_eq!(cpu_list(&cpus), "0-2,5");
        assert_eq!(allowed_cpus("Cpus_allowed_list:\tx\n"), None);
        assert_eq!(allowed_cpus("Name: a\n"), None);
    }

    #[test]
    fn stalls_over_a_millisecond_are_counted_and_summed() {
        let mut h = histogram();
        for _ in 0..990 {
            h.record(60).unwrap();
        }
        for _ in 0..9 {
            h.record(2_000).unwrap();
        }
        h.saturating_record(8_000);
        let s = summarize(&h, Some(0.5), 100.0, Some(&[0]));
        assert_eq!(s.samples, 1000);
        assert_eq!(s.over_1ms, 10);
        assert!((s.over_1ms_total_ms - 26.0).abs() < 0.05, "{s:?}");
        assert!(
            (s.p50_ms - 0.06).abs() < 0.001 && (s.max_ms - 8.0).abs() < 0.01,
            "{s:?}"
        );
        assert_eq!(s.steal_share, Some(0.005));
        assert!(
            s.line().contains("10 over 1 ms (26.0 ms in all)"),
            "{}",
            s.line()
        );
        assert!(s.line().contains("(0): 0.50 s (0.50%)"), "{}", s.line());
    }

    #[test]
    fn the_probe_measures_and_stops() {
        let s = StallMeter::start().unwrap().finish();
        assert!(s.samples >= 1, "{s:?}");
        assert!(s.max_ms >= s.p50_ms);
    }
}
