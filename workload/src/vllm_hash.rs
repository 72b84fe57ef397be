//! vLLM's prefix-cache block hashes as its KV events carry them, computed outside vLLM, for an
//! engine started with `--prefix-caching-hash-algo sha256_cbor`.
//!
//! ```text
//! NONE_HASH = sha256(cbor(seed))                              seed = PYTHONHASHSEED, else "vllm-none-hash"
//! h_i       = sha256(cbor([h_{i−1} or NONE_HASH, [tokens of block i], extra_i]))      full blocks only
//! extra_0   = null | ["salt"] (vLLM 0.10.2–0.30) | [["cache_salt", "salt"]] (≥ 0.31)  extra_i = null for i ≥ 1
//! event     = the last 8 bytes of h_i, big-endian                (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1)
//! cbor      = RFC 8949 deterministic encoding (cbor2 `canonical=True`): shortest heads, definite lengths
//! ```
//!
//! | parameter | meaning |
//! |---|---|
//! | `block_size` | the engine's `--block-size` |
//! | `seed` | the engine's `PYTHONHASHSEED`; unset, vLLM ≥ 0.29 uses `"vllm-none-hash"` (older versions draw random bytes per process, which no one outside can reproduce) |
//! | `salt_keys` | how `cache_salt` enters the first block: `Tagged` (vLLM ≥ 0.31) or `Plain` (0.10.2–0.30) |
//!
//! The token ids are the engine's own: the chat template rendered and tokenized with the model's
//! tokenizer (engine_tokenizer.rs). LoRA and multimodal extra keys are not reproduced (the LoRA
//! key includes the adapter's path on the engine's disk); such requests simply find no match.
//! The default algorithm, `sha256` over Python's pickle, cannot be reproduced outside CPython.
//!
//! The CBOR is written here rather than with a general library: only four item types occur, and
//! a 32k-token prompt hashes 2,048 blocks on the request path. `scripts/vllm_hash_vectors.py`
//! computes the test vectors with the reference library (cbor2).

use sha2::{Digest, Sha256};

use crate::blocks::BlockHash;

/// The unset-`PYTHONHASHSEED` seed of vLLM ≥ 0.29.
pub const DEFAULT_SEED: &str = "vllm-none-hash";

/// How `cache_salt` enters the first block's extra keys.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SaltKeys {
    /// `(("cache_salt", salt),)`: vLLM ≥ 0.31.
    Tagged,
    /// `(salt,)`: vLLM 0.10.2–0.30.
    Plain,
}

/// Hashes token ids into vLLM's chain.
#[derive(Debug, Clone)]
pub struct VllmHasher {
    block_size: usize,
    none_hash: [u8; 32],
    salt_keys: SaltKeys,
}

impl VllmHasher {
    /// A hasher for `block_size`-token blocks with the engine's `PYTHONHASHSEED` (None: unset).
    ///
    /// # Panics
    /// If `block_size` is zero.
    pub fn new(block_size: usize, seed: Option<&str>, salt_keys: SaltKeys) -> Self {
        assert!(block_size > 0, "block_size must be positive");
        let mut seed_cbor = Vec::new();
        text(&mut seed_cbor, seed.unwrap_or(DEFAULT_SEED));
        Self {
            block_size,
            none_hash: Sha256::digest(&seed_cbor).into(),
            salt_keys,
        }
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// The event hashes of every full block of `tokens`.
    pub fn hash_all(&self, tokens: &[u32], cache_salt: Option<&str>) -> Vec<BlockHash> {
        let full = tokens.len() / self.block_size;
        let mut out = Vec::with_capacity(full);
        let mut parent = self.none_hash;
        let mut buf = Vec::with_capacity(48 + self.block_size * 5);
        for (i, block) in tokens.chunks_exact(self.block_size).enumerate() {
            buf.clear();
            head(&mut buf, 4, 3);
            head(&mut buf, 2, 32);
            buf.extend_from_slice(&parent);
            head(&mut buf, 4, block.len() as u64);
            for &t in block {
                head(&mut buf, 0, u64::from(t));
            }
            match (i, cache_salt) {
                (0, Some(salt)) => {
                    head(&mut buf, 4, 1);
                    if self.salt_keys == SaltKeys::Tagged {
                        head(&mut buf, 4, 2);
                        text(&mut buf, "cache_salt");
                    }
                    text(&mut buf, salt);
                }
                _ => buf.push(0xf6),
            }
            parent = Sha256::digest(&buf).into();
            out.push(event_hash(&parent));
        }
        out
    }
}

/// The integer a KV event carries for a digest: its last 8 bytes, big-endian.
pub fn event_hash(digest: &[u8; 32]) -> BlockHash {
    let mut last = [0u8; 8];
    last.copy_from_slice(&digest[24..]);
    u64::from_be_bytes(last)
}

/// A CBOR head: major type and argument in the shortest form.
fn head(buf: &mut Vec<u8>, major: u8, n: u64) {
    let m = major << 5;
    match n {
        0..=23 => buf.push(m | n as u8),
        24..=0xff => buf.extend_from_slice(&[m | 24, n as u8]),
        0x100..=0xffff => {
            buf.push(m | 25);
            buf.extend_from_slice(&(n as u16).to_be_bytes());
        }
        0x1_0000..=0xffff_ffff => {
            buf.push(m | 26);
            buf.extend_from_slice(&(n as u32).to_be_bytes());
        }
        _ => {
            buf.push(m | 27);
            buf.extend_from_slice(&n.to_be_bytes());
        }
    }
}

fn text(buf: &mut Vec<u8>, s: &str) {
    head(buf, 3, s.len() as u64);
    buf.extend_from_slice(s.as_bytes());
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn independent_test_vectors() {
        // From scripts/vllm_hash_vectors.py (cbor2 and hashlib, not this code).
        let tokens: Vec<u32> = (0..32).collect();
        // (PYTHONHASHSEED, cache_salt, salt keys, event hashes)
        type Case<'a> = (Option<&'a str>, Option<&'a str>, SaltKeys, [u64; 2]);
        let cases: [Case<'_>; 4] = [
            (
                Some("0"),
                None,
                SaltKeys::Tagged,
                [12_687_895_063_098_490_012, 1_814_341_696_565_857_452],
            ),
            (
                None,
                None,
                SaltKeys::Tagged,
                [2_233_398_808_101_521_225, 17_911_472_383_915_781_900],
            ),
            (
                Some("0"),
                Some("salt"),
                SaltKeys::Plain,
                [8_471_034_540_256_156_344, 17_414_453_070_839_758_398],
            ),
            (
                Some("0"),
                Some("salt"),
                SaltKeys::Tagged,
                [16_153_350_709_269_067_332, 13_597_902_100_275_324_453],
            ),
        ];
        for (seed, salt, keys, want) in cases {
            let h = VllmHasher::new(16, seed, keys);
            assert_eq!(
                h.hash_all(&tokens, salt),
                want,
                "{seed:?} {salt:?} {keys:?}"
            );
            // A partial trailing block is never hashed.
            assert_eq!(h.hash_all(&tokens[..31], salt), want[..1]);
        }
    }

    #[test]
    fn cbor_heads_take_the_shortest_form() {
        let enc = |n| {
            let mut b = Vec::new();
            head(&mut b, 0, n);
            b
        };
        assert_eq!(enc(23), [0x17]);
        assert_eq!(enc(24), [0x18, 24]);
        assert_eq!(enc(255), [0x18, 0xff]);
        assert_eq!(enc(256), [0x19, 1, 0]);
        assert_eq!(enc(128_000), [0x1a, 0, 1, 0xf4, 0]);
        assert_eq!(
            enc(u64::MAX),
            [0x1b, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff]
        );
    }

    #[test]
    fn token_ids_of_a_real_vocabulary_chain_like_the_reference() {
        // Large ids (Llama 3's specials) take the 4-byte head; the chain still runs block by block.
        let h = VllmHasher::new(4, Some("0"), SaltKeys::Tagged);
        let a = h.hash_all(&[128_000, 9906, 1917, 0, 1, 2, 3, 4], None);
        let b = h.hash_all(&[128_000, 9906, 1917, 0, 1, 2, 3, 5], None);
        assert_eq!(a[0], b[0]);
        assert_ne!(a[1], b[1]);
    }
}
