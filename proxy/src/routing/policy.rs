//! The routing policies: `round_robin`, `least_load`, `session`, `consistent_hash` (bounded loads)
//! and `prefix_affinity` (the cost in mod.rs).
//!
//! | policy | pick |
//! |---|---|
//! | `round_robin` | the next healthy replica in turn |
//! | `least_load` | fewest requests in flight; ties by rendezvous hash of the request |
//! | `session` | rendezvous hash of the session key over healthy replicas (stable when others come and go); no key: least load |
//! | `consistent_hash` | walk a hash ring (`VNODES` points per replica) from the request's key and take the first replica whose in-flight count is under `ceil(c · (total + 1) / healthy)`, c = `BOUND` (Mirrokni et al., consistent hashing with bounded loads): proxies that share nothing agree on most picks. The key is the session, else the prompt's first block past its last branch point: the deepest of its first `BRANCH_DEPTH` blocks that recent prompts have continued in `BRANCHES` or more ways (a shared system prompt's end), so conversations that share a system prompt still spread, and every turn of one keeps its key |
//! | `prefix_affinity` | argmin of the token cost over healthy replicas, matched depths from the approximate index |
//! | `kv_events` | the same cost, matched depths from the engines' KV events (kv_index.rs), falling back per replica to the approximate index |

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use foldhash::fast::RandomState;
use headroom_workload::BlockHash;
use smallvec::SmallVec;

use super::kv_index::{KvIndex, StreamState};
use super::{
    BackendId, BackendView, NoBackend, Pick, PrefixIndex, RouteRequest, RoutingPolicy, healthy,
    rendezvous,
};

/// Ring points per replica.
pub const VNODES: usize = 64;
/// Load bound factor c of consistent hashing with bounded loads.
pub const BOUND: f64 = 1.25;
/// Distinct continuations after which a block counts as a branch point (the end of a prefix many
/// prompts share).
pub const BRANCHES: usize = 4;
/// How deep into a prompt branch points are looked for, in blocks.
pub const BRANCH_DEPTH: usize = 512;
/// Blocks whose continuations are remembered; past it that memory starts again (the branch points
/// found stay known, up to the same number).
pub const BRANCH_MEMORY: usize = 1 << 18;

fn least_loaded_by<'a>(
    candidates: &[&'a BackendView],
    key: u64,
    load: impl Fn(&BackendView) -> f64,
) -> &'a BackendView {
    // Lowest load; among equal loads the highest rendezvous score, so ties spread by request.
    let mut best = candidates[0];
    for &b in &candidates[1..] {
        let (lb, lbest) = (load(b), load(best));
        if lb < lbest || (lb == lbest && rendezvous(key, b.key) > rendezvous(key, best.key)) {
            best = b;
        }
    }
    best
}

/// Each healthy replica in turn.
#[derive(Debug, Default)]
pub struct RoundRobin {
    /// Per replica id, the turn at which it was last picked (0: never). The pick is the healthy
    /// candidate picked least recently, so every set of candidates a request may have (a pool,
    /// the replicas serving one model, a shadow's candidate pool) takes turns on its own: one
    /// shared counter stepped by every pick would let two interleaved sets starve each other's
    /// replicas.
    last: Mutex<LastPicked>,
}

#[derive(Debug, Default)]
struct LastPicked {
    turn: u64,
    at: Vec<u64>,
}

impl RoutingPolicy for RoundRobin {
    fn name(&self) -> &'static str {
        "round_robin"
    }

    fn select(&self, _req: &RouteRequest<'_>, fleet: &[BackendView]) -> Result<Pick, NoBackend> {
        let h = healthy(fleet)?;
        let mut last = self.last.lock().unwrap_or_else(|e| e.into_inner());
        let at = |id: usize, last: &LastPicked| last.at.get(id).copied().unwrap_or(0);
        let b = h
            .iter()
            .min_by_key(|b| (at(b.id, &last), b.id))
            .expect("healthy() returns at least one replica");
        last.turn += 1;
        let turn = last.turn;
        if last.at.len() <= b.id {
            last.at.resize(b.id + 1, 0);
        }
        last.at[b.id] = turn;
        Ok(Pick {
            backend: b.id,
            matched_tokens: 0,
        })
    }
}

/// Fewest requests in flight.
#[derive(Debug, Default)]
pub struct LeastLoad;

impl RoutingPolicy for LeastLoad {
    fn name(&self) -> &'static str {
        "least_load"
    }

    fn select(&self, req: &RouteRequest<'_>, fleet: &[BackendView]) -> Result<Pick, NoBackend> {
        let h = healthy(fleet)?;
        let b = least_loaded_by(&h, req.hash_key(), |b| {
            f64::from(b.in_flight) + f64::from(b.foreign.requests)
        });
        Ok(Pick {
            backend: b.id,
            matched_tokens: 0,
        })
    }
}

/// Session affinity by rendezvous hashing of the session key.
#[derive(Debug, Default)]
pub struct Session;

impl RoutingPolicy for Session {
    fn name(&self) -> &'static str {
        "session"
    }

    fn select(&self, req: &RouteRequest<'_>, fleet: &[BackendView]) -> Result<Pick, NoBackend> {
        let h = healthy(fleet)?;
        let Some(session) = req.session else {
            return LeastLoad.select(req, fleet);
        };
        let key = xxhash_rust::xxh3::xxh3_64(session.as_bytes());
        let b = h
            .iter()
            .max_by_key(|b| rendezvous(key, b.key))
            .copied()
            .ok_or(NoBackend::NoneHealthy)?;
        Ok(Pick {
            backend: b.id,
            matched_tokens: 0,
        })
    }
}

/// Consistent hashing with bounded loads, keyed past the prompt's last branch point.
#[derive(Debug, Default)]
pub struct ConsistentHash {
    branches: Mutex<Branches>,
}

/// What `consistent_hash` has learned of how prompts continue.
#[derive(Debug, Default)]
struct Branches {
    /// For recently seen blocks, the distinct blocks that followed them (fewer than `BRANCHES`).
    continuations: HashMap<BlockHash, SmallVec<[BlockHash; BRANCHES]>, RandomState>,
    /// Blocks seen continued in `BRANCHES` or more ways: kept when `continuations` starts again,
    /// so keys do not fall back to the first block meanwhile.
    points: std::collections::HashSet<BlockHash, RandomState>,
}

impl ConsistentHash {
    /// The request's key: its session, else the block after the deepest branch point among its
    /// first `BRANCH_DEPTH` blocks (its first block when none is known yet). A prefix shared by
    /// many prompts (a system prompt) branches where it ends, so the key is the first block of
    /// what follows it: one conversation's, the same in each of its turns.
    pub fn key(&self, req: &RouteRequest<'_>) -> u64 {
        if req.session.is_some() || req.blocks.is_empty() {
            return req.hash_key();
        }
        let b = self.branches.lock().unwrap_or_else(|e| e.into_inner());
        let depth = req.blocks.len().min(BRANCH_DEPTH);
        let past_branch = (0..depth.saturating_sub(1))
            .rev()
            .find(|&i| b.points.contains(&req.blocks[i]))
            .map_or(0, |i| i + 1);
        req.blocks[past_branch]
    }

    /// Learns how the request's first `BRANCH_DEPTH` blocks continue.
    fn learn(&self, blocks: &[BlockHash]) {
        let mut guard = self.branches.lock().unwrap_or_else(|e| e.into_inner());
        let b = &mut *guard;
        if b.continuations.len() >= BRANCH_MEMORY {
            b.continuations.clear();
        }
        if b.points.len() >= BRANCH_MEMORY {
            b.points.clear();
        }
        let depth = blocks.len().min(BRANCH_DEPTH);
        for w in blocks[..depth].windows(2) {
            if b.points.contains(&w[0]) {
                continue;
            }
            let next = b.continuations.entry(w[0]).or_default();
            if !next.contains(&w[1]) {
                next.push(w[1]);
            }
            if next.len() >= BRANCHES {
                b.continuations.remove(&w[0]);
                b.points.insert(w[0]);
            }
        }
    }
}

impl RoutingPolicy for ConsistentHash {
    fn name(&self) -> &'static str {
        "consistent_hash"
    }

    fn record(&self, req: &RouteRequest<'_>, _pick: &Pick) {
        if req.session.is_none() {
            self.learn(req.blocks);
        }
    }

    fn select(&self, req: &RouteRequest<'_>, fleet: &[BackendView]) -> Result<Pick, NoBackend> {
        let h = healthy(fleet)?;
        // The ring is rebuilt from the snapshot: a few hundred points, cheaper than keeping it in
        // sync with health changes, and identical on every proxy that sees the same fleet.
        let mut ring: Vec<(u64, &BackendView)> = Vec::with_capacity(h.len() * VNODES);
        for b in &h {
            for v in 0..VNODES as u64 {
                ring.push((rendezvous(v, b.key), b));
            }
        }
        ring.sort_unstable_by_key(|(p, b)| (*p, b.id));
        let total: u64 = h.iter().map(|b| u64::from(b.in_flight)).sum();
        let bound = (BOUND * (total + 1) as f64 / h.len() as f64).ceil() as u32;
        let key = rendezvous(self.key(req), 0x5eed);
        let start = ring.partition_point(|(p, _)| *p < key);
        let chosen = (0..ring.len())
            .map(|i| ring[(start + i) % ring.len()].1)
            .find(|b| b.in_flight < bound)
            .unwrap_or(ring[start % ring.len()].1);
        Ok(Pick {
            backend: chosen.id,
            matched_tokens: 0,
        })
    }
}

/// Prefix affinity with the one-unit cost of mod.rs, over an approximate prefix index.
#[derive(Debug)]
pub struct PrefixAffinity {
    index: Mutex<PrefixIndex>,
    /// Tokens of prefill one decoding sequence is worth.
    pub decode_weight: f64,
    /// Weight of the uncached prefill the request brings, against work already queued.
    pub recompute_weight: f64,
    /// Replicas whose cost is within this many tokens of the cheapest count as equally good; the
    /// pick among them is by rendezvous hash of the request (0: only exact ties).
    pub spread_tokens: f64,
}

impl Default for PrefixAffinity {
    fn default() -> Self {
        Self::new(PrefixIndex::new())
    }
}

impl PrefixAffinity {
    /// A policy over `index` (whose per-replica capacities the caller sets from engine metrics).
    pub fn new(index: PrefixIndex) -> Self {
        Self {
            index: Mutex::new(index),
            decode_weight: 8.0,
            recompute_weight: 2.0,
            spread_tokens: 0.0,
        }
    }

    /// Runs `f` on the index (to set capacities or forget replicas).
    pub fn with_index<R>(&self, f: impl FnOnce(&mut PrefixIndex) -> R) -> R {
        f(&mut self.index.lock().unwrap_or_else(|e| e.into_inner()))
    }

    /// The cost of sending `req` to `b`, given `b` holds `matched` prompt tokens.
    pub fn cost(&self, req: &RouteRequest<'_>, b: &BackendView, matched: u32) -> f64 {
        self.recompute_weight * f64::from(req.prompt_tokens - matched.min(req.prompt_tokens))
            + (b.pending_prefill_tokens + b.foreign.pending_prefill_tokens) as f64
            + self.decode_weight * (f64::from(b.decoding) + f64::from(b.foreign.decoding))
    }

    /// The healthy replica of least cost, given how many leading blocks each one holds.
    pub fn pick(
        &self,
        req: &RouteRequest<'_>,
        fleet: &[BackendView],
        depth: impl Fn(BackendId) -> usize,
    ) -> Result<Pick, NoBackend> {
        let h = healthy(fleet)?;
        let cap = req.prompt_tokens.saturating_sub(1);
        let matched = |b: &BackendView| -> u32 {
            (depth(b.id) as u64 * u64::from(req.block_tokens)).min(u64::from(cap)) as u32
        };
        // Within the spread, the request's last block decides: many conversations share their
        // first blocks (a system prompt), and a key they share would send them all one way.
        let key = if self.spread_tokens > 0.0 {
            req.blocks.last().copied().unwrap_or_else(|| req.hash_key())
        } else {
            req.hash_key()
        };
        let costs: Vec<f64> = h.iter().map(|b| self.cost(req, b, matched(b))).collect();
        let cheapest = costs.iter().copied().fold(f64::INFINITY, f64::min);
        // Of the replicas within spread_tokens of the cheapest (exact ties when 0), the one the
        // request's rendezvous hash prefers: proxies placing simultaneous requests without seeing
        // each other's then spread them rather than all choosing the same replica.
        let best = h
            .iter()
            .zip(&costs)
            .filter(|(_, c)| **c <= cheapest + self.spread_tokens)
            .map(|(b, _)| *b)
            .max_by_key(|b| rendezvous(key, b.key))
            .expect("the cheapest replica is within the spread");
        Ok(Pick {
            backend: best.id,
            matched_tokens: matched(best),
        })
    }
}

impl RoutingPolicy for PrefixAffinity {
    fn name(&self) -> &'static str {
        "prefix_affinity"
    }

    fn select(&self, req: &RouteRequest<'_>, fleet: &[BackendView]) -> Result<Pick, NoBackend> {
        let depths = self.with_index(|ix| ix.overlaps(req.blocks));
        self.pick(req, fleet, |id| {
            depths.iter().find(|(r, _)| *r == id).map_or(0, |(_, d)| *d)
        })
    }

    fn record(&self, req: &RouteRequest<'_>, pick: &Pick) {
        self.with_index(|ix| ix.sent(pick.backend, req.blocks));
    }

    fn finished(&self, req: &RouteRequest<'_>, backend: BackendId) {
        self.with_index(|ix| ix.finished(backend, req.blocks));
    }

    fn set_capacity(&self, backend: BackendId, blocks: usize) {
        self.with_index(|ix| ix.set_capacity(backend, blocks));
    }

    fn forget(&self, backend: BackendId) {
        self.with_index(|ix| ix.forget(backend));
    }

    fn index_blocks(&self, backend: BackendId) -> Option<usize> {
        Some(self.with_index(|ix| ix.len(backend)))
    }

    fn history(&self) -> Option<&PrefixAffinity> {
        Some(self)
    }
}

/// Prefix affinity fed by the engines' KV events: the same cost as [`PrefixAffinity`], with each
/// replica's matched depth from the exact index while its stream is live, the larger of the exact
/// and approximate depths while it is partial, and the approximate index alone while it is
/// missing or stale. The approximate index keeps learning from every dispatch, so a fallback
/// starts warm.
#[derive(Debug)]
pub struct KvEvents {
    approx: PrefixAffinity,
    exact: Arc<Mutex<KvIndex>>,
}

impl KvEvents {
    /// A policy over `exact` (which the event subscribers fill) and the cost weights of `approx`.
    pub fn new(approx: PrefixAffinity, exact: Arc<Mutex<KvIndex>>) -> Self {
        Self { approx, exact }
    }

    /// The exact index.
    pub fn exact(&self) -> &Arc<Mutex<KvIndex>> {
        &self.exact
    }

    /// Each replica's matched depth and state at `now`.
    pub fn depths(&self, blocks: &[BlockHash], now: Instant) -> Vec<(usize, StreamState)> {
        let mut out: Vec<(usize, StreamState)> = {
            let ix = self.exact.lock().unwrap_or_else(|e| e.into_inner());
            let states = (0..ix.len()).map(|id| ix.state(id, now));
            ix.depths(blocks, now).into_iter().zip(states).collect()
        };
        // The approximate index is walked only when some replica needs it.
        if out.iter().any(|(_, s)| *s != StreamState::Live) {
            let approx = self.approx.with_index(|ix| ix.overlaps(blocks));
            for (id, (d, state)) in out.iter_mut().enumerate() {
                let a = approx.iter().find(|(r, _)| *r == id).map_or(0, |(_, d)| *d);
                *d = match state {
                    StreamState::Live => *d,
                    StreamState::Partial => (*d).max(a),
                    StreamState::Stale | StreamState::Missing => a,
                };
            }
        }
        out
    }
}

impl RoutingPolicy for KvEvents {
    fn name(&self) -> &'static str {
        "kv_events"
    }

    fn select(&self, req: &RouteRequest<'_>, fleet: &[BackendView]) -> Result<Pick, NoBackend> {
        let depths = self.depths(req.blocks, Instant::now());
        self.approx
            .pick(req, fleet, |id| depths.get(id).map_or(0, |(d, _)| *d))
    }

    fn record(&self, req: &RouteRequest<'_>, pick: &Pick) {
        self.approx.record(req, pick);
        if req.not_engine_chain {
            return;
        }
        self.exact
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .note_dispatch(pick.backend, req.blocks, Instant::now());
    }

    fn finished(&self, req: &RouteRequest<'_>, backend: BackendId) {
        self.approx.finished(req, backend);
    }

    fn set_capacity(&self, backend: BackendId, blocks: usize) {
        self.approx.set_capacity(backend, blocks);
    }

    // The exact index hears of a restart from the events themselves (sequence numbers going back,
    // or another engine behind the replay socket on reconnecting); the fallback history is told
    // by the subscriber then, and by the scrape.
    fn forget(&self, backend: BackendId) {
        self.approx.forget(backend);
    }

    fn index_blocks(&self, backend: BackendId) -> Option<usize> {
        self.approx.index_blocks(backend)
    }

    fn history(&self) -> Option<&PrefixAffinity> {
        Some(&self.approx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fleet(n: usize) -> Vec<BackendView> {
        (0..n)
            .map(|id| BackendView {
                id,
                key: xxhash_rust::xxh3::xxh3_64(format!("http://10.0.0.{id}:8000").as_bytes()),
                healthy: true,
                in_flight: 0,
                pending_prefill_tokens: 0,
                decoding: 0,
                foreign: crate::routing::Foreign::default(),
            })
            .collect()
    }

    fn req(blocks: &[u64], prompt: u32) -> RouteRequest<'_> {
        RouteRequest {
            blocks,
            block_tokens: 16,
            prompt_tokens: prompt,
            session: None,
            not_engine_chain: false,
        }
    }

    #[test]
    fn round_robin_cycles_over_healthy_replicas_only() {
        let mut f = fleet(3);
        f[1].healthy = false;
        let rr = RoundRobin::default();
        let picks: Vec<usize> = (0..4)
            .map(|_| rr.select(&req(&[], 1), &f).unwrap().backend)
            .collect();
        assert_eq!(picks, vec![0, 2, 0, 2]);
        for b in &mut f {
            b.healthy = false;
        }
        assert_eq!(rr.select(&req(&[], 1), &f), Err(NoBackend::NoneHealthy));
        assert_eq!(rr.select(&req(&[], 1), &[]), Err(NoBackend::Empty));
    }

    #[test]
    fn round_robin_takes_turns_within_each_set_of_candidates() {
        // A primary pool {0, 1} and a shadow's candidate pool {2, 3}, picked alternately (or
        // two pools, or two models' replicas): each set still alternates.
        let f = fleet(4);
        let only = |ids: &[usize]| {
            let mut v = f.clone();
            for b in &mut v {
                b.healthy = ids.contains(&b.id);
            }
            v
        };
        let (primary, shadow) = (only(&[0, 1]), only(&[2, 3]));
        let rr = RoundRobin::default();
        let picks: Vec<(usize, usize)> = (0..4)
            .map(|_| {
                (
                    rr.select(&req(&[], 1), &primary).unwrap().backend,
                    rr.select(&req(&[], 1), &shadow).unwrap().backend,
                )
            })
            .collect();
        assert_eq!(picks, vec![(0, 2), (1, 3), (0, 2), (1, 3)]);
        // Requests that may only go to replica 2 keep it busy: those that may go anywhere take
        // their turns on the others.
        let single = only(&[2]);
        let everyone = only(&[0, 1, 2, 3]);
        let mut seen = Vec::new();
        for _ in 0..6 {
            rr.select(&req(&[], 1), &single).unwrap();
            seen.push(rr.select(&req(&[], 1), &everyone).unwrap().backend);
        }
        assert_eq!(seen, vec![0, 1, 3, 0, 1, 3]);
    }

    #[test]
    fn least_load_picks_the_emptiest_and_spreads_ties() {
        let mut f = fleet(4);
        f[0].in_flight = 3;
        f[1].in_flight = 1;
        f[2].in_flight = 1;
        f[3].in_flight = 2;
        let mut seen = std::collections::HashSet::new();
        for k in 0..64u64 {
            let blocks = [k];
            let b = LeastLoad.select(&req(&blocks, 10), &f).unwrap().backend;
            assert!(b == 1 || b == 2);
            seen.insert(b);
        }
        assert_eq!(seen.len(), 2, "ties are spread, not always the first");
    }

    #[test]
    fn sessions_stick_and_move_only_when_their_replica_goes() {
        let mut f = fleet(5);
        let pick = |f: &[BackendView], s: &str| {
            Session
                .select(
                    &RouteRequest {
                        session: Some(s),
                        ..req(&[], 1)
                    },
                    f,
                )
                .unwrap()
                .backend
        };
        let before: Vec<usize> = (0..200).map(|i| pick(&f, &format!("user-{i}"))).collect();
        assert_eq!(
            before,
            (0..200)
                .map(|i| pick(&f, &format!("user-{i}")))
                .collect::<Vec<_>>()
        );
        f[2].healthy = false;
        for (i, &b) in before.iter().enumerate() {
            let now = pick(&f, &format!("user-{i}"));
            if b != 2 {
                assert_eq!(now, b, "sessions on healthy replicas do not move");
            } else {
                assert_ne!(now, 2);
            }
        }
    }

    #[test]
    fn consistent_hash_agrees_across_proxies_and_bounds_load() {
        let f = fleet(4);
        let keys: Vec<[u64; 1]> = (0..400u64).map(|k| [k * 7919]).collect();
        // Two proxies that list the fleet in different orders still pick the same replicas.
        let a: Vec<usize> = keys
            .iter()
            .map(|k| {
                ConsistentHash::default()
                    .select(&req(k, 10), &f)
                    .unwrap()
                    .backend
            })
            .collect();
        let reversed: Vec<BackendView> = f.iter().rev().cloned().collect();
        let b: Vec<usize> = keys
            .iter()
            .map(|k| {
                ConsistentHash::default()
                    .select(&req(k, 10), &reversed)
                    .unwrap()
                    .backend
            })
            .collect();
        assert_eq!(a, b);
        // A replica leaving moves only its own keys.
        let mut without = f.clone();
        without[1].healthy = false;
        for (k, &before) in keys.iter().zip(&a) {
            let now = ConsistentHash::default()
                .select(&req(k, 10), &without)
                .unwrap()
                .backend;
            if before != 1 {
                assert_eq!(now, before);
            }
        }
        // Feeding picks back as load never lets a replica exceed the bound.
        let mut f = fleet(4);
        for k in &keys[..100] {
            let p = ConsistentHash::default()
                .select(&req(k, 10), &f)
                .unwrap()
                .backend;
            f[p].in_flight += 1;
            let total: u32 = f.iter().map(|b| b.in_flight).sum();
            let bound = (BOUND * f64::from(total) / 4.0).ceil() as u32 + 1;
            assert!(f[p].in_flight <= bound, "{} > {bound}", f[p].in_flight);
        }
        let max = f.iter().map(|b| b.in_flight).max().unwrap();
        assert!(f64::from(max) <= BOUND * 25.0 + 1.0, "max {max}");
    }

    #[test]
    fn consistent_hash_keys_past_a_shared_system_prompt_and_keeps_a_conversation_together() {
        let f = fleet(4);
        // 40 conversations sharing a 3-block system prompt; each turn extends the last.
        let own = |c: u64| 10_000 + c * 1_000;
        let turn = |c: u64, t: u64| -> Vec<u64> {
            let mut b = vec![1, 2, 3];
            b.extend((0..2 * t).map(|i| own(c) + i));
            b
        };
        let proxy = ConsistentHash::default();
        let pick = |p: &ConsistentHash, blocks: &[u64]| {
            let r = req(blocks, 16 * blocks.len() as u32);
            let pick = p.select(&r, &f).unwrap();
            p.record(&r, &pick);
            pick.backend
        };
        // Before it has seen the system prompt branch, every prompt keys on its first block.
        assert_eq!(proxy.key(&req(&turn(7, 1), 64)), 1);
        let first: Vec<usize> = (0..40).map(|c| pick(&proxy, &turn(c, 1))).collect();
        assert!(first[..4].iter().all(|&b| b == first[0]), "{first:?}");
        // Once it has: each conversation keys on its own first block, in every turn.
        for c in 0..40 {
            assert_eq!(proxy.key(&req(&turn(c, 1), 80)), own(c));
            assert_eq!(proxy.key(&req(&turn(c, 3), 144)), own(c));
        }
        let later: Vec<usize> = (0..40).map(|c| pick(&proxy, &turn(c, 2))).collect();
        let used: std::collections::BTreeSet<usize> = later.iter().copied().collect();
        assert_eq!(used.len(), 4, "conversations spread: {later:?}");
        let again: Vec<usize> = (0..40).map(|c| pick(&proxy, &turn(c, 3))).collect();
        assert_eq!(later, again, "each conversation stays where it went");
        // Another proxy that saw other conversations agrees once it has seen the branch too.
        let other = ConsistentHash::default();
        for c in 100..104 {
            pick(&other, &turn(c, 1));
        }
        assert!((0..40).all(|c| other.key(&req(&turn(c, 2), 112)) == own(c)));
        // Branch points found survive the memory of continuations starting again.
        proxy.branches.lock().unwrap().continuations.clear();
        assert_eq!(proxy.key(&req(&turn(5, 2), 112)), own(5));
        // A session header still decides alone.
        let with_session = RouteRequest {
            session: Some("s1"),
            ..req(&[1, 2, 3, 4_000], 64)
        };
        assert_eq!(proxy.key(&with_session), with_session.hash_key());
    }

    #[test]
    fn prefix_affinity_follows_the_cache_until_the_queue_costs_more() {
        let p = PrefixAffinity {
            recompute_weight: 1.0,
            ..PrefixAffinity::default()
        };
        let f = fleet(3);
        p.with_index(|ix| {
            for b in 0..3 {
                ix.set_capacity(b, 10_000);
            }
        });
        let shared: Vec<u64> = (0..100).collect(); // 1,600 tokens
        let first = p.select(&req(&shared, 1700), &f).unwrap();
        p.record(&req(&shared, 1700), &first);
        // The same prefix again goes where it is cached: 1,599 tokens saved.
        let again = p.select(&req(&shared, 1700), &f).unwrap();
        assert_eq!(again.backend, first.backend);
        assert_eq!(again.matched_tokens, 1600);
        // With 1,000 tokens already queued there it still wins (100 + 1,000 < 1,700)…
        let mut f2 = f.clone();
        f2[first.backend].pending_prefill_tokens = 1000;
        assert_eq!(
            p.select(&req(&shared, 1700), &f2).unwrap().backend,
            first.backend
        );
        // …but with 2,000 queued, recomputing elsewhere is cheaper.
        f2[first.backend].pending_prefill_tokens = 2000;
        assert_ne!(
            p.select(&req(&shared, 1700), &f2).unwrap().backend,
            first.backend
        );
        // Charging recomputation twice (the default) keeps it home until the queue costs
        // 2 × 1,600 more.
        let heavy = PrefixAffinity::default();
        heavy.with_index(|ix| ix.record(first.backend, &shared));
        assert_eq!(
            heavy.select(&req(&shared, 1700), &f2).unwrap().backend,
            first.backend
        );
        f2[first.backend].pending_prefill_tokens = 3300;
        assert_ne!(
            heavy.select(&req(&shared, 1700), &f2).unwrap().backend,
            first.backend
        );
        // Another proxy's queued prefill counts as this proxy's own does…
        let mut f3 = f.clone();
        f3[first.backend].foreign.pending_prefill_tokens = 2000;
        assert_ne!(
            p.select(&req(&shared, 1700), &f3).unwrap().backend,
            first.backend
        );
        // …and its decoding sequences at decode_weight tokens each (8 · 250 > 1,600 saved).
        f3[first.backend].foreign = crate::routing::Foreign {
            requests: 300,
            decoding: 250,
            pending_prefill_tokens: 0,
        };
        assert_ne!(
            p.select(&req(&shared, 1700), &f3).unwrap().backend,
            first.backend
        );
        f3[first.backend].foreign.decoding = 150;
        assert_eq!(
            p.select(&req(&shared, 1700), &f3).unwrap().backend,
            first.backend
        );
    }

    #[test]
    fn spread_tokens_lets_the_hash_choose_among_nearly_as_cheap_replicas() {
        let mut f = fleet(4);
        // Replica 0 is cheapest by 1,000 tokens of queued prefill, the others equal.
        for b in &mut f[1..] {
            b.pending_prefill_tokens = 1000;
        }
        let strict = PrefixAffinity::default();
        let spread = PrefixAffinity {
            spread_tokens: 1500.0,
            ..PrefixAffinity::default()
        };
        let (mut strict_picks, mut spread_picks) = (Vec::new(), Vec::new());
        for k in 0..200u64 {
            let r = req(std::slice::from_ref(&k), 16_000);
            strict_picks.push(strict.select(&r, &f).unwrap().backend);
            spread_picks.push(spread.select(&r, &f).unwrap().backend);
            // The same request always goes to the same replica: a conversation stays together.
            assert_eq!(
                spread.select(&r, &f).unwrap().backend,
                *spread_picks.last().unwrap()
            );
        }
        assert!(
            strict_picks.iter().all(|&b| b == 0),
            "argmin without a spread"
        );
        for b in 0..4 {
            let n = spread_picks.iter().filter(|&&p| p == b).count();
            assert!((25..=75).contains(&n), "replica {b} took {n} of 200");
        }
        // Prompts that share their first block (a system prompt) still spread.
        let mut shared_start = std::collections::HashSet::new();
        for k in 0..50u64 {
            let blocks = [7, k];
            shared_start.insert(spread.select(&req(&blocks, 16_000), &f).unwrap().backend);
        }
        assert_eq!(shared_start.len(), 4);
        // A cached prefix is worth more than the spread: it still decides.
        let blocks: Vec<u64> = (1000..1500).collect(); // 8,000 tokens
        spread.with_index(|ix| {
            (0..4).for_each(|b| ix.set_capacity(b, 10_000));
            ix.record(2, &blocks);
        });
        assert_eq!(spread.select(&req(&blocks, 8100), &f).unwrap().backend, 2);
    }

    #[test]
    fn prefix_affinity_caps_matches_below_the_prompt_and_spreads_cold_prompts() {
        let p = PrefixAffinity::default();
        let f = fleet(4);
        p.with_index(|ix| (0..4).for_each(|b| ix.set_capacity(b, 1000)));
        let blocks = [1u64, 2];
        let pick = p.select(&req(&blocks, 32), &f).unwrap();
        p.record(&req(&blocks, 32), &pick);
        assert_eq!(p.select(&req(&blocks, 32), &f).unwrap().matched_tokens, 31);
        let mut seen = std::collections::HashSet::new();
        for k in 100..200u64 {
            seen.insert(p.select(&req(&[k], 16), &f).unwrap().backend);
        }
        assert_eq!(seen.len(), 4, "cold prompts spread over an idle fleet");
    }

    #[test]
    fn kv_events_trusts_a_live_stream_and_falls_back_when_it_goes_missing() {
        use headroom_workload::kv_events::KvEvent;
        use std::time::Duration;
        let exact = Arc::new(Mutex::new(KvIndex::new(
            2,
            Duration::from_secs(10),
            Duration::from_secs(5),
        )));
        let p = KvEvents::new(PrefixAffinity::default(), exact.clone());
        let blocks = [1, 2, 3, 4];
        {
            let mut ix = exact.lock().unwrap();
            for r in 0..2 {
                ix.set_connected(r, true);
                ix.apply(r, 0, &[]);
            }
            // The engine of replica 0 holds the prefix.
            ix.apply(
                0,
                1,
                &[KvEvent::BlockStored {
                    block_hashes: blocks.to_vec(),
                    parent_block_hash: None,
                    token_ids: vec![],
                    block_size: 16,
                }],
            );
        }
        // The proxy's own history says replica 1 (it sent the prefix there, and the engine
        // evicted it since: the approximate index cannot know).
        p.approx.with_index(|ix| ix.record(1, &blocks));
        let f = fleet(2);
        let pick = p.select(&req(&blocks, 80), &f).unwrap();
        assert_eq!((pick.backend, pick.matched_tokens), (0, 64));
        // Without replica 0's stream, the history is all there is.
        exact.lock().unwrap().set_connected(0, false);
        assert_eq!(p.select(&req(&blocks, 80), &f).unwrap().backend, 1);
        // Sending a new prefix makes the next request with it follow, before any event.
        exact.lock().unwrap().set_connected(0, true);
        let fresh = [9, 10];
        let first = p.select(&req(&fresh, 40), &f).unwrap();
        p.record(&req(&fresh, 40), &first);
        let second = p.select(&req(&fresh, 40), &f).unwrap();
        assert_eq!((second.backend, second.matched_tokens), (first.backend, 32));
        // Blocks of headroom's own chain (the engine's tokens failed) are never expected from
        // the engine: nothing is left pending for it to confirm.
        let other = RouteRequest {
            not_engine_chain: true,
            ..req(&[77, 78], 40)
        };
        let pick = p.select(&other, &f).unwrap();
        p.record(&other, &pick);
        assert_eq!(
            exact.lock().unwrap().depths(&[77, 78], Instant::now()),
            vec![0, 0]
        );
    }
}
