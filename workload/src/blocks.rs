//! Prefix block hashing: a prompt's token ids cut into full blocks, each hashed with its parent,
//! so two prompts share a block hash exactly when they share every token up to that block's end.
//!
//! ```text
//! h_0 = xxh3_64_with_seed( root  ‖ tokens(block 0) ‖ extra , seed )
//! h_i = xxh3_64_with_seed( h_i−1 ‖ tokens(block i)          , seed )     i ≥ 1
//! ```
//!
//! | symbol | meaning | default |
//! |---|---|---|
//! | `block_size` | tokens per block; partial trailing blocks are never hashed | 16 (vLLM) |
//! | `seed` | hash seed; the simulator's `--hash-seed` | 0 |
//! | `root` | `xxh3_64_with_seed(b"headroom-root", seed)`, the parent of the first block | |
//! | `extra` | bytes mixed into the first block only: model, `cache_salt`, LoRA name | empty |
//! | `tokens(·)` | token ids as little-endian `u32`s | |
//!
//! This mirrors vLLM's chain `h_i = H((h_{i−1}, tokens_i, extra_keys))` in structure. vLLM's own
//! default `H` (sha256 over pickle) cannot be reproduced outside Python; the simulator uses this
//! function, so the proxy computes exactly the hashes a simulated replica stores.

use xxhash_rust::xxh3::xxh3_64_with_seed;

/// One block's hash.
pub type BlockHash = u64;

/// Hashes token sequences into chained block hashes.
#[derive(Debug, Clone, Copy)]
pub struct BlockHasher {
    block_size: usize,
    seed: u64,
    root: BlockHash,
}

impl BlockHasher {
    /// A hasher for `block_size`-token blocks under `seed`.
    ///
    /// # Panics
    /// If `block_size` is zero.
    pub fn new(block_size: usize, seed: u64) -> Self {
        assert!(block_size > 0, "block_size must be positive");
        Self {
            block_size,
            seed,
            root: xxh3_64_with_seed(b"headroom-root", seed),
        }
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// The hash of the block after `parent` (None for the first block) holding `tokens`.
    pub fn hash_block(&self, parent: Option<BlockHash>, tokens: &[u32], extra: &[u8]) -> BlockHash {
        let mut buf = Vec::with_capacity(8 + tokens.len() * 4 + extra.len());
        buf.extend_from_slice(&parent.unwrap_or(self.root).to_le_bytes());
        for t in tokens {
            buf.extend_from_slice(&t.to_le_bytes());
        }
        if parent.is_none() {
            buf.extend_from_slice(extra);
        }
        xxh3_64_with_seed(&buf, self.seed)
    }

    /// Hashes of every full block of `tokens`, continuing the chain in `hashes` (which already holds
    /// the hashes of the first `hashes.len()` blocks). Used to extend a request's chain as it grows.
    pub fn extend(&self, hashes: &mut Vec<BlockHash>, tokens: &[u32], extra: &[u8]) {
        let full = tokens.len() / self.block_size;
        for i in hashes.len()..full {
            let parent = i.checked_sub(1).map(|p| hashes[p]);
            let block = &tokens[i * self.block_size..(i + 1) * self.block_size];
            hashes.push(self.hash_block(parent, block, extra));
        }
    }

    /// Hashes of every full block of `tokens`.
    pub fn hash_all(&self, tokens: &[u32], extra: &[u8]) -> Vec<BlockHash> {
        let mut hashes = Vec::with_capacity(tokens.len() / self.block_size);
        self.extend(&mut hashes, tokens, extra);
        hashes
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_full_blocks_are_hashed() {
        let h = BlockHasher::new(16, 0);
        assert_eq!(h.hash_all(&[1; 15], b"").len(), 0);
        assert_eq!(h.hash_all(&[1; 16], b"").len(), 1);
        assert_eq!(h.hash_all(&[1; 47], b"").len(), 2);
    }

    #[test]
    fn shared_prefixes_share_hashes_until_they_differ() {
        let h = BlockHasher::new(4, 7);
        let a: Vec<u32> = (0..16).collect();
        let mut b = a.clone();
        b[9] = 999;
        let (ha, hb) = (h.hash_all(&a, b""), h.hash_all(&b, b""));
        assert_eq!(ha[..2], hb[..2]);
        assert_ne!(ha[2], hb[2]);
        // The chain carries the difference forward even though block 3 is identical.
        assert_ne!(ha[3], hb[3]);
    }

    #[test]
    fn extra_keys_and_seed_change_every_hash() {
        let t: Vec<u32> = (0..32).collect();
        let base = BlockHasher::new(16, 0).hash_all(&t, b"");
        let salted = BlockHasher::new(16, 0).hash_all(&t, b"salt");
        let reseeded = BlockHasher::new(16, 1).hash_all(&t, b"");
        for i in 0..2 {
            assert_ne!(base[i], salted[i]);
            assert_ne!(base[i], reseeded[i]);
        }
    }

    #[test]
    fn extending_equals_hashing_all_at_once() {
        let h = BlockHasher::new(16, 3);
        let t: Vec<u32> = (0..100).map(|i| i * 7).collect();
        let mut grown = h.hash_all(&t[..40], b"m");
        h.extend(&mut grown, &t, b"m");
        assert_eq!(grown, h.hash_all(&t, b"m"));
    }

    #[test]
    fn independent_test_vectors() {
        // From scripts/block_hash_vectors.py (Python's xxhash package, not this code): the
        // simulator publishes these hashes and the proxy's `kv_events` policy must compute them.
        let tokens: Vec<u32> = (0..32).collect();
        for (seed, extra, want) in [
            (
                0,
                &b""[..],
                [9_271_484_541_775_670_697, 1_598_744_182_686_717_348],
            ),
            (
                42,
                b"",
                [9_942_693_656_855_254_428, 3_202_674_706_577_593_342],
            ),
            (
                0,
                b"salt",
                [10_425_912_787_147_832_549, 15_122_575_491_954_346_351],
            ),
        ] {
            assert_eq!(
                BlockHasher::new(16, seed).hash_all(&tokens, extra),
                want,
                "seed {seed}"
            );
        }
    }
}
