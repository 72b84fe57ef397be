//! The binary's memory allocator (jemalloc) and the `/metrics` gauges that show what it holds.
//!
//! Why not the system's malloc: a proxy relays many long streams, each holding a 64 KiB body
//! buffer (pingora's) among thousands of small allocations. glibc's malloc keeps freed memory in its
//! arenas, so the resident set crept up by megabytes per 10 minutes at a constant load while the live
//! heap stayed flat (a heap profile of the 30-minute soak, docs/reliability.md#soak). jemalloc returns
//! freed pages to the system after a decay time (10 s by default), so the resident set follows the
//! live heap and growth means a leak.
//!
//! | gauge `headroom_allocator_bytes{state=…}` | jemalloc statistic | meaning |
//! |---|---|---|
//! | `allocated` | `stats.allocated` | bytes the program holds: the live heap |
//! | `active` | `stats.active` | pages of the extents those allocations live in |
//! | `resident` | `stats.resident` | pages the allocator has resident (active, dirty not yet returned, metadata) |
//! | `retained` | `stats.retained` | address space kept for reuse, not resident |
//! | `metadata` | `stats.metadata` | the allocator's own bookkeeping |

use prometheus::{
    IntGaugeVec, Opts,
    core::{Collector, Desc},
    proto::MetricFamily,
};
use tikv_jemalloc_ctl::{epoch, stats};

/// Reads one jemalloc statistic.
type ReadStat = fn() -> tikv_jemalloc_ctl::Result<usize>;

#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

/// Reads jemalloc's statistics when `/metrics` is scraped.
#[derive(Debug)]
pub struct AllocatorCollector {
    bytes: IntGaugeVec,
}

impl AllocatorCollector {
    pub fn new() -> Self {
        let bytes = IntGaugeVec::new(
            Opts::new(
                "headroom_allocator_bytes",
                "The memory allocator's view (jemalloc stats): allocated (live heap), active, resident, retained, metadata.",
            ),
            &["state"],
        )
        .expect("valid metric");
        Self { bytes }
    }

    /// Refreshes jemalloc's statistics and the gauges from them. A statistic that cannot be read
    /// keeps its last value rather than failing the scrape.
    fn refresh(&self) {
        // jemalloc caches its statistics until the epoch advances.
        if epoch::advance().is_err() {
            return;
        }
        let reads: [(&str, ReadStat); 5] = [
            ("allocated", stats::allocated::read),
            ("active", stats::active::read),
            ("resident", stats::resident::read),
            ("retained", stats::retained::read),
            ("metadata", stats::metadata::read),
        ];
        for (state, read) in reads {
            if let Ok(v) = read() {
                self.bytes
                    .with_label_values(&[state])
                    .set(i64::try_from(v).unwrap_or(i64::MAX));
            }
        }
    }
}

impl Collector for AllocatorCollector {
    fn desc(&self) -> Vec<&Desc> {
        self.bytes.desc()
    }

    fn collect(&self) -> Vec<MetricFamily> {
        self.refresh();
        self.bytes.collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gauge(c: &AllocatorCollector, state: &str) -> f64 {
        let families = c.collect();
        families[0]
            .get_metric()
            .iter()
            .find(|m| m.get_label()[0].value() == state)
            .map(|m| m.get_gauge().get_value())
            .unwrap_or_else(|| panic!("no {state} gauge"))
    }

    #[test]
    fn the_live_heap_follows_allocations() {
        let c = AllocatorCollector::new();
        let before = gauge(&c, "allocated");
        // black_box: the block must exist, though nothing reads it.
        let block = std::hint::black_box(vec![7u8; 64 << 20]);
        let during = gauge(&c, "allocated");
        assert!(
            during - before > f64::from(48u32 << 20),
            "64 MiB held, allocated went {before} -> {during}"
        );
        assert!(gauge(&c, "resident") >= during - f64::from(16u32 << 20));
        drop(block);
        let after = gauge(&c, "allocated");
        assert!(
            during - after > f64::from(48u32 << 20),
            "64 MiB freed, allocated went {during} -> {after}"
        );
    }
}
