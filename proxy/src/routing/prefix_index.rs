//! The approximate prefix index: for each replica, the prompt blocks the proxy has sent it
//! recently, sized to the replica's KV capacity with LRU eviction. It answers one question — how
//! many leading blocks of this prompt does each replica probably hold — and never scores.
//!
//! | operation | cost |
//! |---|---|
//! | `overlaps(blocks)` | one hash lookup per matched block (walks the chain once for all replicas) |
//! | `record(replica, blocks)` | one hash lookup and one queue push per block, plus evictions |
//! | eviction | one queue pop and one hash lookup per block evicted (amortised: see below) |
//! | `remove_replica` | proportional to the replica's entries |
//!
//! Capacity is in blocks: `kv_capacity_tokens / block_tokens` for each replica (from
//! `vllm:cache_config_info`), so the index forgets about as fast as the replica's cache does.
//!
//! Recency is a queue of `(tick, block)` in touch order per replica. Touching a block again pushes
//! a new entry and leaves the old one behind as stale (its tick is no longer the block's tick for
//! that replica); eviction pops from the front and skips stale entries, and the queue is compacted
//! when stale entries outnumber live ones. Every operation is then O(1) amortised per block: a
//! 100,000-token prompt is recorded in a fraction of a millisecond (routing.md#cost), on the request
//! path and under the index's lock.

use std::collections::{HashMap, VecDeque};

use foldhash::fast::RandomState;
use headroom_workload::BlockHash;
use smallvec::SmallVec;

use super::BackendId;

/// Which replicas hold a block, with the tick of its last use on each (rarely more than two).
type Holders = SmallVec<[(BackendId, u64); 2]>;

#[derive(Debug, Default)]
struct ReplicaLru {
    /// Blocks it may hold; None until the replica's KV capacity is known (then nothing is evicted,
    /// rather than nothing learned).
    capacity: Option<usize>,
    /// `(tick, block)` in touch order, oldest first, stale entries included.
    queue: VecDeque<(u64, BlockHash)>,
    /// Distinct blocks held (the queue's live entries).
    live: usize,
}

/// The per-replica LRU sets, with a shared map from block to the replicas holding it.
#[derive(Debug, Default)]
pub struct PrefixIndex {
    /// block → (replica, tick of its last use there). Block hashes are already uniform, so a fast
    /// non-cryptographic hasher is enough (foldhash, seeded per process).
    holders: HashMap<BlockHash, Holders, RandomState>,
    replicas: HashMap<BackendId, ReplicaLru>,
    tick: u64,
}

impl PrefixIndex {
    /// An empty index.
    pub fn new() -> Self {
        Self::default()
    }

    /// Sets (or changes) how many blocks a replica can hold; shrinking evicts at once.
    pub fn set_capacity(&mut self, replica: BackendId, blocks: usize) {
        self.replicas.entry(replica).or_default().capacity = Some(blocks);
        self.evict(replica);
    }

    /// For each known replica (in id order), how many leading blocks of `blocks` it holds.
    pub fn overlaps(&self, blocks: &[BlockHash]) -> Vec<(BackendId, usize)> {
        let mut depth: Vec<(BackendId, usize)> = self.replicas.keys().map(|&r| (r, 0)).collect();
        depth.sort_unstable_by_key(|(r, _)| *r);
        // Replicas still matching at the current depth; the walk stops when none is.
        let mut matching: Vec<usize> = (0..depth.len()).collect();
        for (i, h) in blocks.iter().enumerate() {
            let Some(holders) = self.holders.get(h) else {
                break;
            };
            matching.retain(|&k| holders.iter().any(|(r, _)| *r == depth[k].0));
            if matching.is_empty() {
                break;
            }
            for &k in &matching {
                depth[k].1 = i + 1;
            }
        }
        depth
    }

    /// Records that `replica` now holds `blocks` (it was sent this prompt).
    pub fn record(&mut self, replica: BackendId, blocks: &[BlockHash]) {
        let lru = self.replicas.entry(replica).or_default();
        if lru.capacity == Some(0) {
            return;
        }
        // The first block is touched last, so the prompt's tail is evicted before its head.
        for &h in blocks.iter().rev() {
            self.tick += 1;
            let tick = self.tick;
            let entry = self.holders.entry(h).or_default();
            match entry.iter_mut().find(|(r, _)| *r == replica) {
                Some((_, t)) => *t = tick,
                None => {
                    entry.push((replica, tick));
                    lru.live += 1;
                }
            }
            lru.queue.push_back((tick, h));
        }
        self.evict(replica);
        self.compact(replica);
    }

    /// Forgets everything about a replica (it left the fleet or lost its cache).
    pub fn remove_replica(&mut self, replica: BackendId) {
        if let Some(lru) = self.replicas.remove(&replica) {
            for &(tick, h) in &lru.queue {
                if self.tick_of(h, replica) == Some(tick) {
                    self.drop_holder(h, replica);
                }
            }
        }
    }

    /// Blocks the index holds for a replica.
    pub fn len(&self, replica: BackendId) -> usize {
        self.replicas.get(&replica).map_or(0, |l| l.live)
    }

    /// Whether the index holds nothing.
    pub fn is_empty(&self) -> bool {
        self.holders.is_empty()
    }

    /// The tick of `h`'s last use on `replica`, if the replica holds it.
    fn tick_of(&self, h: BlockHash, replica: BackendId) -> Option<u64> {
        self.holders
            .get(&h)?
            .iter()
            .find(|(r, _)| *r == replica)
            .map(|&(_, t)| t)
    }

    fn evict(&mut self, replica: BackendId) {
        let Some(lru) = self.replicas.get_mut(&replica) else {
            return;
        };
        let Some(capacity) = lru.capacity else {
            return;
        };
        while lru.live > capacity {
            let Some((tick, h)) = lru.queue.pop_front() else {
                break;
            };
            let Some(entry) = self.holders.get_mut(&h) else {
                continue;
            };
            // A stale entry: the block was touched again later (or already evicted).
            let Some(at) = entry.iter().position(|&(r, t)| r == replica && t == tick) else {
                continue;
            };
            entry.swap_remove(at);
            if entry.is_empty() {
                self.holders.remove(&h);
            }
            lru.live -= 1;
        }
    }

    /// Drops a replica's stale queue entries once they outnumber its live ones, so the queue stays
    /// within twice the blocks held (each compaction pays for the pushes that made it necessary).
    fn compact(&mut self, replica: BackendId) {
        let Some(lru) = self.replicas.get(&replica) else {
            return;
        };
        if lru.queue.len() <= 2 * lru.live + 64 {
            return;
        }
        let mut queue =
            std::mem::take(&mut self.replicas.get_mut(&replica).expect("present").queue);
        queue.retain(|&(tick, h)| self.tick_of(h, replica) == Some(tick));
        self.replicas.get_mut(&replica).expect("present").queue = queue;
    }

    fn drop_holder(&mut self, h: BlockHash, replica: BackendId) {
        if let Some(entry) = self.holders.get_mut(&h) {
            entry.retain(|(r, _)| *r != replica);
            if entry.is_empty() {
                self.holders.remove(&h);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn depth_of(index: &PrefixIndex, blocks: &[u64], replica: BackendId) -> usize {
        index
            .overlaps(blocks)
            .into_iter()
            .find(|(r, _)| *r == replica)
            .map_or(0, |(_, d)| d)
    }

    #[test]
    fn overlap_is_the_leading_run_per_replica() {
        let mut ix = PrefixIndex::new();
        ix.set_capacity(0, 100);
        ix.set_capacity(1, 100);
        ix.record(0, &[1, 2, 3, 4]);
        ix.record(1, &[1, 2, 9]);
        assert_eq!(ix.overlaps(&[1, 2, 3, 5]), vec![(0, 3), (1, 2)]);
        assert_eq!(ix.overlaps(&[7, 1, 2]), vec![(0, 0), (1, 0)]);
        assert_eq!(ix.overlaps(&[]), vec![(0, 0), (1, 0)]);
        // A replica that holds block 3 but not block 2 does not match past block 1.
        ix.set_capacity(2, 100);
        ix.record(2, &[1, 3]);
        assert_eq!(depth_of(&ix, &[1, 2, 3], 2), 1);
    }

    #[test]
    fn capacity_evicts_least_recently_used_tail_first() {
        let mut ix = PrefixIndex::new();
        ix.set_capacity(0, 4);
        ix.record(0, &[1, 2, 3]);
        ix.record(0, &[1, 7, 8]);
        // 5 distinct blocks, capacity 4: block 3 (the older prompt's tail) went first.
        assert_eq!(ix.len(0), 4);
        assert_eq!(depth_of(&ix, &[1, 2, 3], 0), 2);
        assert_eq!(depth_of(&ix, &[1, 7, 8], 0), 3);
        ix.set_capacity(0, 1);
        assert_eq!(
            depth_of(&ix, &[1, 7], 0),
            1,
            "the most recent head survives"
        );
    }

    #[test]
    fn an_unknown_capacity_learns_without_evicting() {
        let mut ix = PrefixIndex::new();
        ix.record(4, &[1, 2, 3]);
        assert_eq!(ix.overlaps(&[1, 2, 3]), vec![(4, 3)]);
    }

    #[test]
    fn removing_a_replica_forgets_only_it() {
        let mut ix = PrefixIndex::new();
        ix.set_capacity(0, 10);
        ix.set_capacity(1, 10);
        ix.record(0, &[1, 2]);
        ix.record(1, &[1, 2]);
        ix.remove_replica(0);
        assert_eq!(ix.overlaps(&[1, 2]), vec![(1, 2)]);
        ix.remove_replica(1);
        assert!(ix.is_empty());
    }

    #[test]
    fn agrees_with_a_naive_model_on_random_workloads() {
        use std::collections::VecDeque;
        let mut ix = PrefixIndex::new();
        let mut naive: Vec<VecDeque<u64>> = vec![VecDeque::new(); 3];
        let cap = 20;
        for r in 0..3 {
            ix.set_capacity(r, cap);
        }
        let mut x = 12345u64;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        for _ in 0..2000 {
            let r = (next() % 3) as usize;
            let len = 1 + (next() % 6) as usize;
            let blocks: Vec<u64> = (0..len).map(|_| next() % 12).collect();
            let depths = ix.overlaps(&blocks);
            for (rep, d) in depths {
                let expect = blocks.iter().take_while(|b| naive[rep].contains(b)).count();
                assert_eq!(d, expect);
            }
            ix.record(r, &blocks);
            for &b in blocks.iter().rev() {
                naive[r].retain(|&y| y != b);
                naive[r].push_back(b);
            }
            while naive[r].len() > cap {
                naive[r].pop_front();
            }
            assert_eq!(ix.len(r), naive[r].len());
        }
    }
}
