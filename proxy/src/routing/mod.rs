//! Routing: pure, synchronous choice of a replica for a request, from a snapshot of the fleet taken
//! at dispatch time. No I/O here; the data plane fills the snapshot and acts on the pick.
//!
//! The `prefix_affinity` cost, in one unit (tokens of work the new request would wait behind or do):
//!
//! ```text
//! cost(b) = recompute_weight · (prompt_tokens − matched_tokens(b))   uncached prefill it brings
//!         + pending_prefill_tokens(b) + foreign_prefill(b)  prefill already queued on b
//!         + decode_weight · (decoding(b) + foreign_decoding(b))   sequences decoding on b
//! pick    = argmin cost(b) over healthy b, ties by rendezvous hash of the leading block; with
//!           spread_tokens > 0, of the b with cost(b) ≤ min cost + spread_tokens, the one the
//!           rendezvous hash of the last block prefers
//! ```
//!
//! | parameter | meaning | default |
//! |---|---|---|
//! | `matched_tokens(b)` | leading blocks of the prompt the prefix index says b holds × block tokens, at most prompt − 1 | |
//! | `pending_prefill_tokens(b)` | uncached prompt tokens of requests sent to b that have not produced a first token (counted by the proxy) | |
//! | `decoding(b)` | requests on b past their first token (counted by the proxy) | |
//! | `foreign_prefill(b)` | the same for the requests other proxies sent to b, as they last reported it (only with `[peers]`) | 0 |
//! | `foreign_decoding(b)` | other proxies' requests on b past their first token, as they last reported it (`[peers]`); or, estimated, all their requests on b: the engine's running + waiting minus this proxy's own in flight at the last scrape (`routing.foreign_load`) | 0 |
//! | `recompute_weight` | how much a token of prefill the request brings counts against a token already queued: 1 minimises this request's own wait; above 1 also charges the recomputation to the requests that will queue behind it | 2 |
//! | `spread_tokens` | replicas this close to the cheapest count as equally good: spreads simultaneous requests that several proxies place without seeing each other's | 0 |
//! | `decode_weight` | tokens of prefill one decoding sequence is worth per scheduling decision: its per-step KV read at ~2k context costs about what prefilling 5–10 tokens does on an 8B model | 8 |
//!
//! There is no switch between an "affinity mode" and a "load mode": a cached prefix is worth exactly
//! the prefill it saves, and a queue is worth exactly the work in it, so a hot prefix spills to other
//! replicas when its replica's queue costs more than recomputing it there. Cold prompts (no match
//! anywhere) go to the least-loaded replica, with ties spread by hash instead of always the first.

pub mod kv_index;
pub mod policy;
pub mod prefix_index;

pub use kv_index::{KvIndex, StreamState};
pub use policy::{ConsistentHash, KvEvents, LeastLoad, PrefixAffinity, RoundRobin, Session};
pub use prefix_index::PrefixIndex;

use headroom_workload::BlockHash;

/// Index of a replica in the current fleet snapshot.
pub type BackendId = usize;

/// What routing knows about one replica at dispatch time.
#[derive(Debug, Clone, PartialEq)]
pub struct BackendView {
    /// The replica.
    pub id: BackendId,
    /// Stable identity (hash of its address), for hashing policies.
    pub key: u64,
    /// Passing health checks and not ejected.
    pub healthy: bool,
    /// Requests the proxy has in flight to it.
    pub in_flight: u32,
    /// Uncached prompt tokens of its in-flight requests that have not produced a first token.
    pub pending_prefill_tokens: u64,
    /// Its in-flight requests past their first token.
    pub decoding: u32,
    /// Other proxies' work on it (reported by them with `[peers]`, estimated from its gauges with
    /// `routing.foreign_load`, else none).
    pub foreign: Foreign,
}

/// Other proxies' work on one replica.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Foreign {
    /// Their requests on it.
    pub requests: u32,
    /// Of those, the ones past their first token (all of them when estimated from the engine's
    /// gauges, which cannot tell prefill from decode).
    pub decoding: u32,
    /// Uncached prompt tokens of the others that have not produced a first token (known only when
    /// the proxies report to each other).
    pub pending_prefill_tokens: u64,
}

/// What routing knows about the request.
#[derive(Debug, Clone, Copy, Default)]
pub struct RouteRequest<'a> {
    /// Chained prefix block hashes of the rendered prompt.
    pub blocks: &'a [BlockHash],
    /// Tokens per block.
    pub block_tokens: u32,
    /// Prompt tokens (estimated when the proxy does not tokenize exactly).
    pub prompt_tokens: u32,
    /// Session affinity key (e.g. a header), when present.
    pub session: Option<&'a str>,
    /// The blocks are headroom's own chain although the engine's was asked for (its tokens could
    /// not be made): they can match only the approximate index, and the engine will never confirm
    /// them.
    pub not_engine_chain: bool,
}

impl RouteRequest<'_> {
    /// A key for hashing policies: the session, else the first block (so prompts that share their
    /// start agree), else 0.
    pub fn hash_key(&self) -> u64 {
        match self.session {
            Some(s) => xxhash_rust::xxh3::xxh3_64(s.as_bytes()),
            None => self.blocks.first().copied().unwrap_or(0),
        }
    }
}

/// The chosen replica.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Pick {
    /// The replica.
    pub backend: BackendId,
    /// Prompt tokens the policy expects the replica to have cached.
    pub matched_tokens: u32,
}

/// Why nothing could be picked.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum NoBackend {
    /// The fleet is empty.
    #[error("no replicas configured")]
    Empty,
    /// Every replica is unhealthy or ejected.
    #[error("no healthy replica")]
    NoneHealthy,
}

/// A routing policy: picks a replica from the fleet snapshot. Policies may keep state (a counter,
/// a prefix index) behind `&self`, so one instance serves all requests.
pub trait RoutingPolicy: Send + Sync + std::fmt::Debug {
    /// The policy's name in config and metrics.
    fn name(&self) -> &'static str;

    /// Picks a replica.
    fn select(&self, req: &RouteRequest<'_>, fleet: &[BackendView]) -> Result<Pick, NoBackend>;

    /// Told after dispatch where the request went, so history-based policies learn (and hold its
    /// blocks as the replica's while it runs).
    fn record(&self, _req: &RouteRequest<'_>, _pick: &Pick) {}

    /// Told that a request [`record`](Self::record)ed on `backend` ended there, however it ended:
    /// the replica has just freed its blocks.
    fn finished(&self, _req: &RouteRequest<'_>, _backend: BackendId) {}

    /// Told how many prefix blocks a replica can hold (from its KV capacity), so history-based
    /// policies forget what the replica must have evicted.
    fn set_capacity(&self, _backend: BackendId, _blocks: usize) {}

    /// Told that a replica lost its prefix cache (its engine restarted), so history-based policies
    /// forget what they sent it; what it can hold stays known.
    fn forget(&self, _backend: BackendId) {}

    /// Blocks the policy's prefix index holds for a replica (history-based policies).
    fn index_blocks(&self, _backend: BackendId) -> Option<usize> {
        None
    }

    /// The approximate prefix index, for policies that keep one (a reload carries its history
    /// over to the next config's policy).
    fn history(&self) -> Option<&PrefixAffinity> {
        None
    }
}

/// The healthy replicas, or why there are none.
pub fn healthy(fleet: &[BackendView]) -> Result<Vec<&BackendView>, NoBackend> {
    if fleet.is_empty() {
        return Err(NoBackend::Empty);
    }
    let h: Vec<&BackendView> = fleet.iter().filter(|b| b.healthy).collect();
    if h.is_empty() {
        Err(NoBackend::NoneHealthy)
    } else {
        Ok(h)
    }
}

/// Rendezvous (highest random weight) score of a key on a replica.
pub fn rendezvous(key: u64, backend_key: u64) -> u64 {
    xxhash_rust::xxh3::xxh3_64_with_seed(&key.to_le_bytes(), backend_key)
}
