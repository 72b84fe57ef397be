//! The approximate prefix index: for each replica, the prompt blocks the proxy has sent it
//! recently, sized to the replica's KV capacity with LRU eviction. It answers one question — how
//! many leading blocks of this prompt does each replica probably hold — and never scores.
//!
//! | operation | cost |
//! |---|---|
//! | `overlaps(blocks)` | one hash lookup per matched block (walks the chain once for all replicas) |
//! | `record(replica, blocks)`, `sent`, `finished` | one hash lookup and one list move per block, plus evictions |
//! | eviction | one list pop and one hash lookup per block evicted; a held block is moved to the tail instead |
//! | `forget` | proportional to the replica's entries |
//!
//! Capacity is in blocks: `kv_capacity_tokens / block_tokens` for each replica (from
//! `vllm:cache_config_info`), so the index forgets about as fast as the replica's cache does.
//!
//! It forgets in the engine's order, not in the order prompts were sent: an engine cannot evict the
//! blocks of a request still running, and frees them, as the most recent, when it ends (vLLM's free
//! queue). So a request `sent` holds its blocks (eviction passes over them) until it is
//! `finished`, when they become the replica's most recent. Without that, a long request that runs
//! for tens of seconds while shorter ones arrive is forgotten by the index while its replica still
//! holds it, and the conversation's next turn is routed as if it were cold.
//!
//! Recency is a doubly linked list per replica, its nodes in a slab indexed by `u32`, oldest at the
//! head; the shared block map points each holder at its node, so a touch moves the node to the tail
//! and an eviction pops the head, both O(1) with no pause to tidy up: a 100,000-token prompt is
//! recorded in about a millisecond (routing.md#cost), on the request path and under the index's
//! lock. (An LRU crate keeps its own map per cache; here one map serves every replica, which is
//! what lets `overlaps` answer for all of them in one walk.)

use std::collections::HashMap;

use foldhash::fast::RandomState;
use headroom_workload::BlockHash;
use smallvec::SmallVec;

use super::BackendId;

/// Which replicas hold a block, with its node in each one's recency list (rarely more than two).
type Holders = SmallVec<[(BackendId, u32); 2]>;

/// No node.
const NIL: u32 = u32::MAX;

#[derive(Debug, Clone, Copy)]
struct Node {
    block: BlockHash,
    prev: u32,
    next: u32,
    /// Requests running on the replica with this block (not evictable while any is).
    holds: u32,
}

/// One replica's blocks in recency order, oldest first.
#[derive(Debug)]
struct ReplicaLru {
    /// Blocks it may hold; None until the replica's KV capacity is known (then nothing is evicted,
    /// rather than nothing learned).
    capacity: Option<usize>,
    nodes: Vec<Node>,
    /// Slots of `nodes` free for reuse.
    free: Vec<u32>,
    head: u32,
    tail: u32,
    /// Blocks held (nodes in the list).
    live: usize,
}

impl Default for ReplicaLru {
    fn default() -> Self {
        Self {
            capacity: None,
            nodes: Vec::new(),
            free: Vec::new(),
            head: NIL,
            tail: NIL,
            live: 0,
        }
    }
}

impl ReplicaLru {
    /// Appends `block` as the most recent; returns its node.
    fn push_back(&mut self, block: BlockHash) -> u32 {
        let node = Node {
            block,
            prev: NIL,
            next: NIL,
            holds: 0,
        };
        let i = match self.free.pop() {
            Some(i) => {
                self.nodes[i as usize] = node;
                i
            }
            None => {
                self.nodes.push(node);
                u32::try_from(self.nodes.len() - 1).expect("fewer than 2^32 blocks per replica")
            }
        };
        self.link_back(i);
        self.live += 1;
        i
    }

    /// Links the unlinked node `i` in as the most recent.
    fn link_back(&mut self, i: u32) {
        let node = &mut self.nodes[i as usize];
        node.prev = self.tail;
        node.next = NIL;
        match self.tail {
            NIL => self.head = i,
            t => self.nodes[t as usize].next = i,
        }
        self.tail = i;
    }

    fn unlink(&mut self, i: u32) {
        let Node { prev, next, .. } = self.nodes[i as usize];
        match prev {
            NIL => self.head = next,
            p => self.nodes[p as usize].next = next,
        }
        match next {
            NIL => self.tail = prev,
            n => self.nodes[n as usize].prev = prev,
        }
    }

    /// Makes node `i` the most recent.
    fn touch(&mut self, i: u32) {
        if self.tail == i {
            return;
        }
        self.unlink(i);
        self.link_back(i);
    }

    /// Removes and returns the oldest block.
    fn pop_front(&mut self) -> Option<BlockHash> {
        let i = self.head;
        if i == NIL {
            return None;
        }
        self.unlink(i);
        self.free.push(i);
        self.live -= 1;
        Some(self.nodes[i as usize].block)
    }

    /// The blocks held, oldest first.
    fn blocks(&self) -> impl Iterator<Item = BlockHash> + '_ {
        let mut i = self.head;
        std::iter::from_fn(move || {
            (i != NIL).then(|| {
                let n = self.nodes[i as usize];
                i = n.next;
                n.block
            })
        })
    }
}

/// The per-replica LRU sets, with a shared map from block to the replicas holding it.
#[derive(Debug, Default)]
pub struct PrefixIndex {
    /// block → (replica, its node there). Block hashes are already uniform, so a fast
    /// non-cryptographic hasher is enough (foldhash, seeded per process).
    holders: HashMap<BlockHash, Holders, RandomState>,
    replicas: HashMap<BackendId, ReplicaLru>,
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
        self.touch_all(replica, blocks, |_| {});
    }

    /// `replica` was sent this prompt and runs it: its blocks are the most recent and stay until
    /// [`finished`](Self::finished) says the request ended.
    pub fn sent(&mut self, replica: BackendId, blocks: &[BlockHash]) {
        self.touch_all(replica, blocks, |n| n.holds += 1);
    }

    /// The request `sent` with `blocks` ended on `replica`: its blocks are the most recently
    /// freed there (the engine frees them then), and evictable again once no other request
    /// running there holds them. Only blocks the index still has are touched: one it lacks was
    /// forgotten while the request ran (the replica lost its cache), and the engine does not hold
    /// it either.
    pub fn finished(&mut self, replica: BackendId, blocks: &[BlockHash]) {
        let Some(lru) = self.replicas.get_mut(&replica) else {
            return;
        };
        for h in blocks.iter().rev() {
            let node = self
                .holders
                .get(h)
                .and_then(|e| e.iter().find(|(r, _)| *r == replica))
                .map(|&(_, node)| node);
            if let Some(node) = node {
                let n = &mut lru.nodes[node as usize];
                n.holds = n.holds.saturating_sub(1);
                lru.touch(node);
            }
        }
        self.evict(replica);
    }

    /// Makes `blocks` the most recent of `replica` (adding those it lacks), applying `f` to each
    /// one's node, then evicts down to the capacity.
    fn touch_all(
        &mut self,
        replica: BackendId,
        blocks: &[BlockHash],
        mut f: impl FnMut(&mut Node),
    ) {
        let lru = self.replicas.entry(replica).or_default();
        if lru.capacity == Some(0) {
            return;
        }
        // The first block is touched last, so the prompt's tail is evicted before its head.
        for &h in blocks.iter().rev() {
            let node = hold(&mut self.holders, lru, replica, h);
            f(&mut lru.nodes[node as usize]);
        }
        self.evict(replica);
    }

    /// Forgets every block a replica holds (it lost its cache); its capacity stays.
    pub fn forget(&mut self, replica: BackendId) {
        if let Some(lru) = self.replicas.remove(&replica) {
            for h in lru.blocks() {
                drop_holder(&mut self.holders, h, replica);
            }
            if let Some(blocks) = lru.capacity {
                self.set_capacity(replica, blocks);
            }
        }
    }

    /// Copies what `from` holds here into `into` as `to`'s, in the same recency order (a reload
    /// keeps the history of a replica that stays). `to` keeps a capacity it already has, else
    /// takes `from`'s.
    pub fn copy_replica(&self, from: BackendId, into: &mut PrefixIndex, to: BackendId) {
        let Some(old) = self.replicas.get(&from) else {
            return;
        };
        let lru = into.replicas.entry(to).or_default();
        if lru.capacity.is_none() {
            lru.capacity = old.capacity;
        }
        if lru.capacity == Some(0) {
            return;
        }
        for h in old.blocks() {
            hold(&mut into.holders, lru, to, h);
        }
        into.evict(to);
    }

    /// Blocks the index holds for a replica.
    pub fn len(&self, replica: BackendId) -> usize {
        self.replicas.get(&replica).map_or(0, |l| l.live)
    }

    /// Whether the index holds nothing.
    pub fn is_empty(&self) -> bool {
        self.holders.is_empty()
    }

    fn evict(&mut self, replica: BackendId) {
        let Some(lru) = self.replicas.get_mut(&replica) else {
            return;
        };
        // Blocks a running request holds are passed over (moved to the tail, as in use); when
        // every block is held, the index holds more than the capacity until some are released,
        // as the engine would (it preempts instead).
        let mut passed = 0;
        while lru.capacity.is_some_and(|c| lru.live > c) && passed < lru.live {
            let head = lru.head;
            if head == NIL {
                break;
            }
            if lru.nodes[head as usize].holds > 0 {
                lru.touch(head);
                passed += 1;
                continue;
            }
            let Some(h) = lru.pop_front() else {
                break;
            };
            drop_holder(&mut self.holders, h, replica);
        }
    }
}

/// Makes `h` the most recent block of `replica` (whose list is `lru`), adding it if new; returns
/// its node (a free function, so that it can run while the caller holds the replica's list).
fn hold(
    holders: &mut HashMap<BlockHash, Holders, RandomState>,
    lru: &mut ReplicaLru,
    replica: BackendId,
    h: BlockHash,
) -> u32 {
    let entry = holders.entry(h).or_default();
    match entry.iter().find(|(r, _)| *r == replica) {
        Some(&(_, node)) => {
            lru.touch(node);
            node
        }
        None => {
            let node = lru.push_back(h);
            entry.push((replica, node));
            node
        }
    }
}

/// Removes `replica` from the holders of `h` (a free function, so that eviction can call it while
/// it holds the replica's list).
fn drop_holder(
    holders: &mut HashMap<BlockHash, Holders, RandomState>,
    h: BlockHash,
    replica: BackendId,
) {
    if let Some(entry) = holders.get_mut(&h) {
        entry.retain(|(r, _)| *r != replica);
        if entry.is_empty() {
            holders.remove(&h);
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
    fn a_running_request_keeps_its_blocks_and_frees_them_as_the_most_recent() {
        let mut ix = PrefixIndex::new();
        ix.set_capacity(0, 4);
        // A long request runs while shorter ones come and go: the engine cannot evict its blocks.
        ix.sent(0, &[1, 2]);
        ix.record(0, &[3, 4]);
        ix.record(0, &[5, 6]);
        assert_eq!(ix.len(0), 4);
        assert_eq!(depth_of(&ix, &[1, 2], 0), 2, "held while it runs");
        assert_eq!(
            depth_of(&ix, &[3, 4], 0),
            0,
            "the oldest unheld went instead"
        );
        // It ends: its blocks are the most recently freed, so the next eviction takes others.
        ix.finished(0, &[1, 2]);
        ix.record(0, &[7, 8]);
        assert_eq!(depth_of(&ix, &[1, 2], 0), 2);
        assert_eq!(depth_of(&ix, &[5, 6], 0), 0);
        // No longer held, they age out like any others.
        ix.record(0, &[9, 10]);
        assert_eq!(depth_of(&ix, &[1, 2], 0), 0);
    }

    #[test]
    fn a_request_that_ends_after_its_replica_lost_its_cache_adds_nothing_back() {
        let mut ix = PrefixIndex::new();
        ix.set_capacity(0, 8);
        ix.sent(0, &[1, 2, 3]);
        ix.forget(0);
        ix.finished(0, &[1, 2, 3]);
        assert_eq!(ix.len(0), 0);
        assert_eq!(depth_of(&ix, &[1, 2, 3], 0), 0);
        // What was sent after the loss is held and freed as usual.
        ix.sent(0, &[1, 4]);
        ix.finished(0, &[1, 4]);
        assert_eq!(depth_of(&ix, &[1, 4], 0), 2);
        ix.record(0, &[5, 6, 7, 8, 9, 10, 11, 12]);
        assert_eq!(depth_of(&ix, &[1, 4], 0), 0, "freed, it ages out");
    }

    #[test]
    fn a_block_stays_while_any_request_running_with_it_does() {
        let mut ix = PrefixIndex::new();
        ix.set_capacity(0, 3);
        // Two conversations share a system prompt (block 1).
        ix.sent(0, &[1, 2]);
        ix.sent(0, &[1, 3]);
        ix.finished(0, &[1, 2]);
        ix.record(0, &[4, 5]);
        ix.record(0, &[6]);
        assert_eq!(depth_of(&ix, &[1, 3], 0), 2, "the other request still runs");
        assert_eq!(depth_of(&ix, &[1, 2], 0), 1);
        // Held beyond the capacity, the index holds more until they are freed, then evicts.
        ix.sent(0, &[7, 8, 9]);
        assert_eq!(ix.len(0), 5);
        ix.finished(0, &[1, 3]);
        ix.finished(0, &[7, 8, 9]);
        assert_eq!(ix.len(0), 3);
        assert_eq!(
            depth_of(&ix, &[7, 8, 9], 0),
            3,
            "the most recently freed stay"
        );
        // A reload's copy holds nothing: the old index's requests end there.
        ix.sent(0, &[7]);
        let mut new = PrefixIndex::new();
        ix.copy_replica(0, &mut new, 0);
        new.record(0, &[10, 11, 12]);
        assert_eq!(depth_of(&new, &[7], 0), 0);
    }

    #[test]
    fn a_copied_replica_keeps_its_blocks_and_their_recency() {
        let mut old = PrefixIndex::new();
        old.set_capacity(0, 100);
        old.set_capacity(1, 4);
        old.record(1, &[1, 2, 3]);
        old.record(1, &[1, 7]);
        old.record(0, &[9]);
        // Replica 1 of the old index is replica 0 of the new one, which knows no capacity yet.
        let mut new = PrefixIndex::new();
        old.copy_replica(1, &mut new, 0);
        assert_eq!(new.len(0), 4);
        assert_eq!(depth_of(&new, &[1, 2, 3], 0), 3);
        assert_eq!(
            depth_of(&new, &[9], 0),
            0,
            "only replica 1's blocks came over"
        );
        // Its capacity came too, and the order: block 3, the oldest, is the first evicted.
        new.record(0, &[5]);
        assert_eq!(new.len(0), 4);
        assert_eq!(depth_of(&new, &[1, 2, 3], 0), 2);
        assert_eq!(depth_of(&new, &[1, 7], 0), 2);
        // A capacity the new index already has is kept.
        let mut sized = PrefixIndex::new();
        sized.set_capacity(3, 2);
        old.copy_replica(1, &mut sized, 3);
        assert_eq!(sized.len(3), 2);
        assert_eq!(
            depth_of(&sized, &[1, 7], 3),
            2,
            "the most recent blocks stay"
        );
        // A replica the old index never knew copies nothing.
        old.copy_replica(5, &mut sized, 4);
        assert_eq!(sized.len(4), 0);
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
    fn forgetting_a_replica_drops_only_its_blocks_and_keeps_its_capacity() {
        let mut ix = PrefixIndex::new();
        ix.set_capacity(0, 2);
        ix.set_capacity(1, 10);
        ix.record(0, &[1, 2]);
        ix.record(1, &[1, 2]);
        ix.forget(0);
        assert_eq!(ix.overlaps(&[1, 2]), vec![(0, 0), (1, 2)]);
        assert_eq!(ix.len(0), 0);
        // Still two blocks' room: a longer prompt keeps only its head.
        ix.record(0, &[7, 8, 9]);
        assert_eq!(ix.len(0), 2);
        assert_eq!(ix.overlaps(&[7, 8]), vec![(0, 2), (1, 0)]);
        ix.forget(0);
        ix.forget(1);
        assert!(ix.is_empty());
    }

    #[test]
    fn agrees_with_a_naive_model_on_random_workloads() {
        use std::collections::VecDeque;
        let mut ix = PrefixIndex::new();
        let mut naive: Vec<VecDeque<u64>> = vec![VecDeque::new(); 3];
        // Each replica's capacity; forgetting its blocks keeps it.
        let mut caps: Vec<usize> = vec![20; 3];
        for r in 0..3 {
            ix.set_capacity(r, 20);
        }
        let mut x = 12345u64;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        let trim = |q: &mut VecDeque<u64>, cap: usize| {
            while q.len() > cap {
                q.pop_front();
            }
        };
        for _ in 0..5000 {
            let r = (next() % 3) as usize;
            match next() % 100 {
                // The replica's capacity changes (0 included: it holds nothing).
                0..=1 => {
                    let cap = (next() % 30) as usize;
                    ix.set_capacity(r, cap);
                    caps[r] = cap;
                    trim(&mut naive[r], caps[r]);
                }
                2 => {
                    ix.forget(r);
                    naive[r].clear();
                }
                _ => {}
            }
            let len = 1 + (next() % 6) as usize;
            let blocks: Vec<u64> = (0..len).map(|_| next() % 40).collect();
            let depths = ix.overlaps(&blocks);
            for (rep, d) in depths {
                let expect = blocks.iter().take_while(|b| naive[rep].contains(b)).count();
                assert_eq!(d, expect);
            }
            ix.record(r, &blocks);
            if caps[r] != 0 {
                for &b in blocks.iter().rev() {
                    naive[r].retain(|&y| y != b);
                    naive[r].push_back(b);
                }
            }
            trim(&mut naive[r], caps[r]);
            for (rep, q) in naive.iter().enumerate() {
                assert_eq!(ix.len(rep), q.len());
            }
        }
    }
}
