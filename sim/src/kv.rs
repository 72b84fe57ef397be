//! The KV block pool: fixed-size blocks, reference counts, a prefix cache keyed by block hash, and
//! an LRU free list from which cached blocks are evicted only when their slot is reused (vLLM v1's
//! `BlockPool` and `FreeKVCacheBlockQueue`).
//!
//! | rule | vLLM |
//! |---|---|
//! | block 0 is the null block and never handed out; usable = `num_gpu_blocks − 1` | `BlockPool.null_block` |
//! | usage = 1 − free / (num_gpu_blocks − 1); cached blocks nobody uses count as free | `get_usage` |
//! | a freed request returns its blocks tail first, so its last blocks are evicted first | `free_blocks(reversed(...))` |
//! | a prefix hit takes a cached block back off the free list | `touch` |
//! | a cached block loses its hash only when its slot is reallocated → one `BlockRemoved` per block | `_maybe_evict_cached_block` |
//! | several blocks may hold the same hash (a prompt whose last full block was recomputed); a hit takes any | `cached_block_hash_to_block` |

use std::collections::HashMap;

use headroom_workload::BlockHash;

/// Index of a block in the pool.
pub type BlockId = u32;

const NIL: BlockId = u32::MAX;

pub use headroom_workload::kv_events::KvEvent;

#[derive(Debug, Clone)]
struct Block {
    refs: u32,
    hash: Option<BlockHash>,
    prev: BlockId,
    next: BlockId,
    free: bool,
}

/// The pool of KV blocks of one replica.
#[derive(Debug)]
pub struct BlockPool {
    blocks: Vec<Block>,
    head: BlockId,
    tail: BlockId,
    num_free: usize,
    /// Every block holding each hash (usually one).
    cached: HashMap<BlockHash, Vec<BlockId>>,
    events: Vec<KvEvent>,
    record_events: bool,
}

impl BlockPool {
    /// A pool of `num_gpu_blocks` blocks (including the null block).
    ///
    /// # Panics
    /// With fewer than 2 blocks.
    pub fn new(num_gpu_blocks: usize, record_events: bool) -> Self {
        assert!(num_gpu_blocks >= 2, "a KV pool needs at least 2 blocks");
        let mut pool = Self {
            blocks: vec![
                Block {
                    refs: 0,
                    hash: None,
                    prev: NIL,
                    next: NIL,
                    free: false
                };
                num_gpu_blocks
            ],
            head: NIL,
            tail: NIL,
            num_free: 0,
            cached: HashMap::new(),
            events: Vec::new(),
            record_events,
        };
        for id in 1..num_gpu_blocks as BlockId {
            pool.push_tail(id);
        }
        pool
    }

    /// Blocks that can be handed out (free, cached or not).
    pub fn num_free(&self) -> usize {
        self.num_free
    }

    /// Usable blocks (`num_gpu_blocks − 1`).
    pub fn capacity(&self) -> usize {
        self.blocks.len() - 1
    }

    /// `vllm:kv_cache_usage_perc`, in [0, 1].
    pub fn usage(&self) -> f64 {
        1.0 - self.num_free as f64 / self.capacity() as f64
    }

    /// Distinct hashes currently cached.
    pub fn cached_hashes(&self) -> usize {
        self.cached.len()
    }

    /// The longest prefix of `hashes` that is cached, as block ids.
    pub fn lookup_prefix(&self, hashes: &[BlockHash]) -> Vec<BlockId> {
        hashes
            .iter()
            .map_while(|h| self.cached.get(h).and_then(|ids| ids.first().copied()))
            .collect()
    }

    /// How many of `ids` are on the free list (touching them takes them off it).
    pub fn count_free(&self, ids: &[BlockId]) -> usize {
        ids.iter()
            .filter(|&&id| self.blocks[id as usize].free)
            .count()
    }

    /// Takes a reference on each block, pulling free ones off the free list.
    pub fn touch(&mut self, ids: &[BlockId]) {
        for &id in ids {
            if self.blocks[id as usize].free {
                self.unlink(id);
            }
            self.blocks[id as usize].refs += 1;
        }
    }

    /// Hands out `n` blocks from the least recently used end, evicting their cached hashes, or
    /// `None` (and changes nothing) when fewer than `n` are free.
    pub fn allocate(&mut self, n: usize) -> Option<Vec<BlockId>> {
        if n > self.num_free {
            return None;
        }
        let mut out = Vec::with_capacity(n);
        for _ in 0..n {
            let id = self.head;
            self.unlink(id);
            let block = &mut self.blocks[id as usize];
            block.refs = 1;
            if let Some(h) = block.hash.take() {
                if let Some(ids) = self.cached.get_mut(&h) {
                    ids.retain(|&b| b != id);
                    if ids.is_empty() {
                        self.cached.remove(&h);
                    }
                }
                if self.record_events {
                    self.events.push(KvEvent::BlockRemoved {
                        block_hashes: vec![h],
                    });
                }
            }
            out.push(id);
        }
        Some(out)
    }

    /// Marks blocks as full and cached under `hashes` (`ids[i]` holds `tokens[i·bs..(i+1)·bs]`).
    pub fn cache_blocks(
        &mut self,
        ids: &[BlockId],
        hashes: &[BlockHash],
        parent: Option<BlockHash>,
        tokens: &[u32],
        block_size: u32,
    ) {
        let mut stored = Vec::with_capacity(ids.len());
        for (&id, &h) in ids.iter().zip(hashes) {
            let block = &mut self.blocks[id as usize];
            if block.hash.is_some() {
                continue;
            }
            block.hash = Some(h);
            self.cached.entry(h).or_default().push(id);
            stored.push(h);
        }
        if self.record_events && !stored.is_empty() {
            self.events.push(KvEvent::BlockStored {
                block_hashes: stored,
                parent_block_hash: parent,
                token_ids: tokens.to_vec(),
                block_size,
            });
        }
    }

    /// Drops one reference on each block, in the order given; blocks reaching zero go to the
    /// most-recently-used end of the free list (callers pass a request's blocks in reverse).
    pub fn release(&mut self, ids: impl IntoIterator<Item = BlockId>) {
        for id in ids {
            let block = &mut self.blocks[id as usize];
            debug_assert!(block.refs > 0, "double free of block {id}");
            block.refs -= 1;
            if block.refs == 0 {
                self.push_tail(id);
            }
        }
    }

    /// Forgets every cached hash of free blocks (vLLM's `reset_prefix_cache`); false when some
    /// blocks are in use, as vLLM refuses then.
    pub fn reset_prefix_cache(&mut self) -> bool {
        if self.num_free != self.capacity() {
            return false;
        }
        self.cached.clear();
        for b in &mut self.blocks {
            b.hash = None;
        }
        if self.record_events {
            self.events.push(KvEvent::AllBlocksCleared);
        }
        true
    }

    /// Takes the events recorded since the last call.
    pub fn take_events(&mut self) -> Vec<KvEvent> {
        std::mem::take(&mut self.events)
    }

    fn push_tail(&mut self, id: BlockId) {
        let tail = self.tail;
        let block = &mut self.blocks[id as usize];
        block.free = true;
        block.prev = tail;
        block.next = NIL;
        if tail == NIL {
            self.head = id;
        } else {
            self.blocks[tail as usize].next = id;
        }
        self.tail = id;
        self.num_free += 1;
    }

    fn unlink(&mut self, id: BlockId) {
        let Block { prev, next, .. } = self.blocks[id as usize];
        if prev == NIL {
            self.head = next;
        } else {
            self.blocks[prev as usize].next = next;
        }
        if next == NIL {
            self.tail = prev;
        } else {
            self.blocks[next as usize].prev = prev;
        }
        let block = &mut self.blocks[id as usize];
        block.free = false;
        block.prev = NIL;
        block.next = NIL;
        self.num_free -= 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allocation_fails_whole_when_short() {
        let mut pool = BlockPool::new(5, false);
        assert_eq!(pool.capacity(), 4);
        assert!(pool.allocate(5).is_none());
        assert_eq!(pool.num_free(), 4);
        let got = pool.allocate(4).unwrap();
        assert_eq!(got, vec![1, 2, 3, 4]);
        assert_eq!(pool.usage(), 1.0);
    }

    #[test]
    fn freed_cached_blocks_stay_hittable_until_reused_tail_first() {
        let mut pool = BlockPool::new(5, true);
        let a = pool.allocate(2).unwrap();
        pool.cache_blocks(&a, &[10, 11], None, &[0; 8], 4);
        pool.release(a.iter().rev().copied());
        assert_eq!(pool.usage(), 0.0);
        assert_eq!(pool.lookup_prefix(&[10, 11, 12]), a);
        // Free list order now: 3, 4, then a[1] (id 2), then a[0] (id 1): the unused blocks go first,
        // then the request's last block.
        let b = pool.allocate(3).unwrap();
        assert_eq!(b, vec![3, 4, 2]);
        assert_eq!(pool.lookup_prefix(&[10, 11]), vec![1]);
        let events = pool.take_events();
        assert_eq!(events.len(), 2);
        assert!(
            matches!(&events[0], KvEvent::BlockStored { block_hashes, .. } if block_hashes == &[10, 11])
        );
        assert_eq!(
            events[1],
            KvEvent::BlockRemoved {
                block_hashes: vec![11]
            }
        );
    }

    #[test]
    fn duplicate_hashes_stay_hittable_until_every_copy_is_evicted() {
        let mut pool = BlockPool::new(4, true);
        let a = pool.allocate(1).unwrap();
        let b = pool.allocate(1).unwrap();
        pool.cache_blocks(&a, &[7], None, &[0; 4], 4);
        pool.cache_blocks(&b, &[7], None, &[0; 4], 4);
        pool.release(a.clone());
        pool.release(b.clone());
        pool.take_events();
        // Free list: 3, a, b. Taking two evicts a; b still serves the hash.
        pool.allocate(2).unwrap();
        assert_eq!(pool.lookup_prefix(&[7]), b);
        pool.allocate(1).unwrap();
        assert!(pool.lookup_prefix(&[7]).is_empty());
        let removed: Vec<_> = pool
            .take_events()
            .into_iter()
            .filter(|e| matches!(e, KvEvent::BlockRemoved { .. }))
            .collect();
        assert_eq!(removed.len(), 2, "one BlockRemoved per evicted block");
    }

    #[test]
    fn touching_a_hit_takes_it_off_the_free_list() {
        let mut pool = BlockPool::new(4, false);
        let a = pool.allocate(1).unwrap();
        pool.cache_blocks(&a, &[7], None, &[0; 4], 4);
        pool.release(a.clone());
        let hit = pool.lookup_prefix(&[7]);
        assert_eq!(pool.count_free(&hit), 1);
        pool.touch(&hit);
        assert_eq!(pool.num_free(), 2);
        // The hit block is shared, not reallocated.
        let others = pool.allocate(2).unwrap();
        assert!(!others.contains(&hit[0]));
        assert_eq!(pool.lookup_prefix(&[7]), hit);
    }

    #[test]
    fn reset_needs_an_idle_pool() {
        let mut pool = BlockPool::new(3, true);
        let a = pool.allocate(1).unwrap();
        pool.cache_blocks(&a, &[1], None, &[0; 4], 4);
        assert!(!pool.reset_prefix_cache());
        pool.release(a);
        assert!(pool.reset_prefix_cache());
        assert!(pool.lookup_prefix(&[1]).is_empty());
        assert_eq!(pool.take_events().last(), Some(&KvEvent::AllBlocksCleared));
    }
}
