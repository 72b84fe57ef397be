//! The exact prefix index: for each replica, the blocks its engine says it holds (from its KV
//! events), plus the blocks of requests just sent to it that the engine has not yet reported
//! stored. Tracks each stream's sequence numbers and says how far its picture can be trusted.
//!
//! ```text
//! held(b, h)  = stored(b, h) > removed(b, h)                       from BlockStored / BlockRemoved
//!             ∨ (h ∈ pending(b) ∧ now < dispatched(b, h) + pending_ttl)
//! depth(b)    = leading blocks h_0 … h_k−1 of the prompt with held(b, h_i)
//! state(b)    = missing   not connected to the replica's stream
//!             | stale     a request that should have stored blocks was sent > stale_after ago and no event came since
//!             | live      every event since the engine's cache was last empty has been applied
//!             | partial   connected, but some history is unknown (joined late, or a gap the replay could not fill)
//! ```
//!
//! | parameter | meaning | default |
//! |---|---|---|
//! | `pending_ttl` | how long a sent request's new blocks count as held before the engine confirms them: covers queueing and prefill, so a burst of one new prefix follows its first request | 10 s |
//! | `stale_after` | how long an expected event may be missing before the stream is distrusted | 5 s |
//!
//! Sequence numbers start at 0 in every engine process and grow by one per batch. A batch after
//! the expected one is a gap (to be filled from the replay socket, else the replica's picture is
//! cleared and marked partial: a cleared picture only misses blocks, it never claims evicted
//! ones); a batch before it means the engine restarted with an empty cache.

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

use foldhash::fast::RandomState;
use headroom_workload::BlockHash;
use headroom_workload::kv_events::KvEvent;
use smallvec::SmallVec;

use super::BackendId;

/// How far a replica's picture can be trusted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StreamState {
    /// Not connected to the replica's event stream.
    Missing,
    /// Events stopped arriving when they should have.
    Stale,
    /// Complete since the engine's cache was last empty.
    Live,
    /// Connected, but some of the history is unknown.
    Partial,
}

impl StreamState {
    /// The state's name in metrics and `/stats`.
    pub fn name(self) -> &'static str {
        match self {
            Self::Missing => "missing",
            Self::Stale => "stale",
            Self::Live => "live",
            Self::Partial => "partial",
        }
    }

    /// Every state, in the order of [`StreamState::name`]'s metric labels.
    pub const ALL: [Self; 4] = [Self::Missing, Self::Stale, Self::Live, Self::Partial];
}

/// Where a batch with a given sequence number stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SeqCheck {
    /// The expected one (or the first ever, from 0).
    Next,
    /// Batches `from..seq` were missed.
    Gap {
        /// The first missed sequence number.
        from: u64,
    },
    /// Sequence numbers went backwards: the engine restarted.
    Restarted,
}

/// What applying a batch did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Applied {
    /// Applied in order.
    InOrder,
    /// Already applied (a replay overlapping the live stream); ignored.
    Duplicate,
    /// Applied after batches were lost: the replica's picture was cleared first.
    AfterLoss,
}

/// Counters of one replica's stream.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StreamCounts {
    /// Batches applied.
    pub batches: u64,
    /// Gaps in sequence numbers seen.
    pub gaps: u64,
    /// Gaps that could not be filled (the picture was cleared).
    pub losses: u64,
    /// Engine restarts seen.
    pub restarts: u64,
    /// `AllBlocksCleared` events.
    pub clears: u64,
    /// Removals of blocks the index did not know (expected after a late join).
    pub unknown_removals: u64,
    /// Sent blocks the engine then reported stored.
    pub confirmed: u64,
    /// Sent blocks the engine never reported within `pending_ttl`. Growing while `confirmed`
    /// stays 0 means request-side hashes do not match the engine's.
    pub expired: u64,
}

#[derive(Debug, Default)]
struct Replica {
    next_seq: Option<u64>,
    complete: bool,
    connected: bool,
    /// Oldest dispatch of new blocks not yet followed by any event.
    awaiting_since: Option<Instant>,
    /// Distinct blocks held.
    held: usize,
    /// Blocks sent and not yet confirmed: hash → deadline.
    pending: HashMap<BlockHash, Instant, RandomState>,
    /// (deadline, hash) in dispatch order, for expiry.
    pending_order: VecDeque<(Instant, BlockHash)>,
    /// Sequence number and engine timestamp of the last batch applied, to tell after a
    /// reconnect whether the engine is still the same process.
    last_batch: Option<(u64, f64)>,
    counts: StreamCounts,
}

/// The per-replica exact pictures, with a shared map from block to the replicas holding it.
#[derive(Debug)]
pub struct KvIndex {
    /// block → (replica, copies stored there); inline for the usual one or two replicas, hashed
    /// with foldhash (block hashes are already uniform), as in the approximate index.
    holders: HashMap<BlockHash, SmallVec<[(BackendId, u32); 2]>, RandomState>,
    replicas: Vec<Replica>,
    pending_ttl: Duration,
    stale_after: Duration,
}

impl KvIndex {
    /// An index of `replicas` replicas, none connected yet.
    pub fn new(replicas: usize, pending_ttl: Duration, stale_after: Duration) -> Self {
        Self {
            holders: HashMap::default(),
            replicas: (0..replicas).map(|_| Replica::default()).collect(),
            pending_ttl,
            stale_after,
        }
    }

    /// Number of replicas.
    pub fn len(&self) -> usize {
        self.replicas.len()
    }

    /// Whether there are no replicas.
    pub fn is_empty(&self) -> bool {
        self.replicas.is_empty()
    }

    /// The replica's state at `now`.
    pub fn state(&self, r: BackendId, now: Instant) -> StreamState {
        let Some(x) = self.replicas.get(r) else {
            return StreamState::Missing;
        };
        if !x.connected {
            StreamState::Missing
        } else if x
            .awaiting_since
            .is_some_and(|t| now.saturating_duration_since(t) > self.stale_after)
        {
            StreamState::Stale
        } else if x.complete {
            StreamState::Live
        } else {
            StreamState::Partial
        }
    }

    /// Distinct blocks the replica's engine holds, as far as the index knows.
    pub fn held(&self, r: BackendId) -> usize {
        self.replicas.get(r).map_or(0, |x| x.held)
    }

    /// The replica's stream counters.
    pub fn counts(&self, r: BackendId) -> StreamCounts {
        self.replicas.get(r).map(|x| x.counts).unwrap_or_default()
    }

    /// The sequence number the replica's next batch should carry, if any batch was applied.
    pub fn next_seq(&self, r: BackendId) -> Option<u64> {
        self.replicas.get(r).and_then(|x| x.next_seq)
    }

    /// Copies the pictures of the replicas `pairs` names (id here, id in `into`; the latter new)
    /// into `into`: their blocks, their counters and where their streams stand (the next
    /// sequence number and the last batch's timestamp), not connected; with `pending`, also the
    /// blocks sent to them and not yet confirmed (request-side hashes: only while requests are
    /// hashed the same way). A reload keeps the picture of a replica whose event stream stays
    /// the same: the new subscriber's first replay checks that the engine still holds that last
    /// batch and brings the picture up to date from there, instead of rebuilding it from what the
    /// replay buffer still holds. One pass over the blocks held, whatever the number of replicas.
    pub fn copy_replicas(
        &self,
        pairs: &[(BackendId, BackendId)],
        into: &mut KvIndex,
        pending: bool,
    ) {
        let mut target = vec![None; self.replicas.len()];
        for &(from, to) in pairs {
            let (Some(r), Some(t)) = (self.replicas.get(from), into.replicas.get_mut(to)) else {
                continue;
            };
            target[from] = Some(to);
            *t = Replica {
                next_seq: r.next_seq,
                complete: r.complete,
                connected: false,
                awaiting_since: None,
                held: r.held,
                pending: if pending {
                    r.pending.clone()
                } else {
                    HashMap::default()
                },
                pending_order: if pending {
                    r.pending_order.clone()
                } else {
                    VecDeque::new()
                },
                last_batch: r.last_batch,
                counts: r.counts,
            };
        }
        for (h, holders) in &self.holders {
            for &(replica, copies) in holders {
                if let Some(to) = target.get(replica).copied().flatten() {
                    into.holders.entry(*h).or_default().push((to, copies));
                }
            }
        }
    }

    /// Records whether the subscriber is connected to the replica's stream.
    pub fn set_connected(&mut self, r: BackendId, connected: bool) {
        if let Some(x) = self.replicas.get_mut(r) {
            x.connected = connected;
            if !connected {
                x.awaiting_since = None;
            }
        }
    }

    /// Where a live batch numbered `seq` stands. Counts gaps (a batch behind the expected one may
    /// be a replayed duplicate; [`KvIndex::restarted`] counts restarts).
    pub fn check(&mut self, r: BackendId, seq: u64) -> SeqCheck {
        let Some(x) = self.replicas.get_mut(r) else {
            return SeqCheck::Next;
        };
        let c = match x.next_seq {
            None if seq == 0 => SeqCheck::Next,
            None => SeqCheck::Gap { from: 0 },
            Some(e) if seq == e => SeqCheck::Next,
            Some(e) if seq > e => SeqCheck::Gap { from: e },
            Some(_) => SeqCheck::Restarted,
        };
        if matches!(c, SeqCheck::Gap { .. }) {
            x.counts.gaps += 1;
        }
        c
    }

    /// The engine restarted: its cache is empty and its numbering starts again.
    pub fn restarted(&mut self, r: BackendId) {
        self.forget(r);
        if let Some(x) = self.replicas.get_mut(r) {
            x.counts.restarts += 1;
        }
    }

    /// Continuity with the engine cannot be checked (reconnected without a replay socket): the
    /// picture is dropped and rebuilt from the next batch, partial.
    pub fn forget(&mut self, r: BackendId) {
        self.clear(r);
        if let Some(x) = self.replicas.get_mut(r) {
            x.next_seq = None;
            x.complete = false;
            x.last_batch = None;
            x.pending.clear();
            x.pending_order.clear();
        }
    }

    /// Records the engine timestamp of batch `seq`, just applied.
    pub fn note_batch_ts(&mut self, r: BackendId, seq: u64, ts: f64) {
        if let Some(x) = self.replicas.get_mut(r) {
            if x.next_seq == Some(seq.saturating_add(1)) {
                x.last_batch = Some((seq, ts));
            }
        }
    }

    /// Sequence number and engine timestamp of the last batch applied.
    pub fn last_batch(&self, r: BackendId) -> Option<(u64, f64)> {
        self.replicas.get(r).and_then(|x| x.last_batch)
    }

    /// A replay found the engine has published nothing yet: its cache is empty, and the picture
    /// (empty) is complete.
    pub fn nothing_published(&mut self, r: BackendId) {
        if let Some(x) = self.replicas.get_mut(r) {
            if x.next_seq.is_none() {
                x.next_seq = Some(0);
                x.complete = true;
            }
        }
    }

    /// Applies batch `seq` of replica `r`.
    pub fn apply(&mut self, r: BackendId, seq: u64, events: &[KvEvent]) -> Applied {
        let Some(x) = self.replicas.get_mut(r) else {
            return Applied::Duplicate;
        };
        let outcome = match x.next_seq {
            Some(e) if seq < e => return Applied::Duplicate,
            Some(e) if seq > e => Applied::AfterLoss,
            Some(_) => Applied::InOrder,
            None => {
                // The first batch known: the picture is complete only if it is the engine's first.
                x.complete = seq == 0;
                Applied::InOrder
            }
        };
        if outcome == Applied::AfterLoss {
            x.counts.losses += 1;
            self.clear(r);
            self.replicas[r].complete = false;
        }
        let x = &mut self.replicas[r];
        x.next_seq = Some(seq.saturating_add(1));
        x.counts.batches += 1;
        x.awaiting_since = None;
        for e in events {
            match e {
                KvEvent::BlockStored { block_hashes, .. } => {
                    for &h in block_hashes {
                        self.store(r, h);
                    }
                }
                KvEvent::BlockRemoved { block_hashes } => {
                    for &h in block_hashes {
                        self.remove(r, h);
                    }
                }
                KvEvent::AllBlocksCleared => {
                    self.clear(r);
                    let x = &mut self.replicas[r];
                    x.counts.clears += 1;
                    x.complete = true;
                }
            }
        }
        outcome
    }

    /// Batch `seq` could not be read: the picture would miss its evictions, so it is cleared and
    /// marked partial. Returns false when the batch was an old one (nothing lost).
    pub fn lost(&mut self, r: BackendId, seq: u64) -> bool {
        let Some(x) = self.replicas.get_mut(r) else {
            return false;
        };
        if x.next_seq.is_some_and(|e| seq < e) {
            return false;
        }
        x.next_seq = Some(seq.saturating_add(1));
        x.complete = false;
        x.counts.losses += 1;
        self.clear(r);
        true
    }

    /// Notes that a request whose prompt is `blocks` was sent to `r`: the blocks it does not
    /// already hold count as held until the engine reports them or `pending_ttl` passes.
    pub fn note_dispatch(&mut self, r: BackendId, blocks: &[BlockHash], now: Instant) {
        let ttl = self.pending_ttl;
        if r >= self.replicas.len() {
            return;
        }
        let known = self.exact_depth(r, blocks);
        let x = &mut self.replicas[r];
        while x.pending_order.front().is_some_and(|(d, _)| *d <= now) {
            if let Some((d, h)) = x.pending_order.pop_front() {
                if x.pending.get(&h) == Some(&d) {
                    x.pending.remove(&h);
                    x.counts.expired += 1;
                }
            }
        }
        if known < blocks.len() {
            let deadline = now + ttl;
            for &h in &blocks[known..] {
                x.pending.insert(h, deadline);
                x.pending_order.push_back((deadline, h));
            }
            if x.connected && x.awaiting_since.is_none() {
                x.awaiting_since = Some(now);
            }
        }
    }

    /// For each replica (in id order), how many leading blocks of `blocks` it holds, counting
    /// blocks sent to it that are still pending.
    pub fn depths(&self, blocks: &[BlockHash], now: Instant) -> Vec<usize> {
        (0..self.replicas.len())
            .map(|r| {
                let x = &self.replicas[r];
                blocks
                    .iter()
                    .take_while(|h| {
                        self.holds(r, **h) || x.pending.get(*h).is_some_and(|d| *d > now)
                    })
                    .count()
            })
            .collect()
    }

    fn exact_depth(&self, r: BackendId, blocks: &[BlockHash]) -> usize {
        blocks.iter().take_while(|h| self.holds(r, **h)).count()
    }

    fn holds(&self, r: BackendId, h: BlockHash) -> bool {
        self.holders
            .get(&h)
            .is_some_and(|v| v.iter().any(|(b, _)| *b == r))
    }

    fn store(&mut self, r: BackendId, h: BlockHash) {
        let v = self.holders.entry(h).or_default();
        match v.iter_mut().find(|(b, _)| *b == r) {
            Some((_, n)) => *n += 1,
            None => {
                v.push((r, 1));
                self.replicas[r].held += 1;
            }
        }
        let x = &mut self.replicas[r];
        if x.pending.remove(&h).is_some() {
            x.counts.confirmed += 1;
        }
    }

    fn remove(&mut self, r: BackendId, h: BlockHash) {
        let Some(v) = self.holders.get_mut(&h) else {
            self.replicas[r].counts.unknown_removals += 1;
            return;
        };
        let Some(i) = v.iter().position(|(b, _)| *b == r) else {
            self.replicas[r].counts.unknown_removals += 1;
            return;
        };
        v[i].1 -= 1;
        if v[i].1 == 0 {
            v.swap_remove(i);
            self.replicas[r].held -= 1;
            if v.is_empty() {
                self.holders.remove(&h);
            }
        }
    }

    /// Forgets everything the replica holds (not its pending dispatches).
    fn clear(&mut self, r: BackendId) {
        if self.replicas.get(r).is_none_or(|x| x.held == 0) {
            return;
        }
        self.holders.retain(|_, v| {
            v.retain(|(b, _)| *b != r);
            !v.is_empty()
        });
        self.replicas[r].held = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stored(hashes: &[u64]) -> KvEvent {
        KvEvent::BlockStored {
            block_hashes: hashes.to_vec(),
            parent_block_hash: None,
            token_ids: vec![],
            block_size: 16,
        }
    }

    fn removed(hashes: &[u64]) -> KvEvent {
        KvEvent::BlockRemoved {
            block_hashes: hashes.to_vec(),
        }
    }

    fn index(n: usize) -> (KvIndex, Instant) {
        let mut ix = KvIndex::new(n, Duration::from_secs(10), Duration::from_secs(5));
        for r in 0..n {
            ix.set_connected(r, true);
        }
        (ix, Instant::now())
    }

    #[test]
    fn a_copied_replica_keeps_its_picture_and_where_its_stream_stands() {
        let (mut old, now) = index(2);
        old.apply(1, 0, &[stored(&[1, 2, 3])]);
        old.note_batch_ts(1, 0, 17.5);
        old.apply(1, 1, &[stored(&[9]), removed(&[3])]);
        old.note_batch_ts(1, 1, 18.0);
        old.apply(0, 0, &[stored(&[1, 5])]);
        old.note_dispatch(1, &[1, 2, 7], now);
        // Old replica 1 is replica 0 of the new index.
        let mut new = KvIndex::new(1, Duration::from_secs(10), Duration::from_secs(5));
        old.copy_replicas(&[(1, 0)], &mut new, true);
        assert_eq!(new.depths(&[1, 2, 3], now), vec![2]);
        assert_eq!(
            new.depths(&[1, 2, 7], now),
            vec![3],
            "sent, not yet confirmed"
        );
        assert_eq!(
            new.depths(&[1, 5], now),
            vec![1],
            "replica 0's blocks stayed behind"
        );
        assert_eq!(new.held(0), old.held(1));
        assert_eq!(
            (new.next_seq(0), new.last_batch(0)),
            (Some(2), Some((1, 18.0)))
        );
        assert_eq!(new.counts(0), old.counts(1));
        // Not connected until its subscriber is; then as complete as it was.
        assert_eq!(new.state(0, now), StreamState::Missing);
        new.set_connected(0, true);
        assert_eq!(new.state(0, now), old.state(1, now));
        assert_eq!(new.check(0, 2), SeqCheck::Next);
        // Requests hashed another way: what was sent is not carried, what the engine holds is.
        let mut rehashed = KvIndex::new(1, Duration::from_secs(10), Duration::from_secs(5));
        old.copy_replicas(&[(1, 0)], &mut rehashed, false);
        assert_eq!(rehashed.depths(&[1, 2, 7], now), vec![2]);
    }

    #[test]
    fn stores_and_evictions_move_the_matched_depth() {
        let (mut ix, now) = index(2);
        assert_eq!(ix.check(0, 0), SeqCheck::Next);
        ix.apply(0, 0, &[stored(&[1, 2, 3])]);
        ix.apply(1, 0, &[stored(&[1])]);
        assert_eq!(ix.depths(&[1, 2, 3, 4], now), vec![3, 1]);
        ix.apply(0, 1, &[removed(&[2])]);
        // The chain breaks at the evicted block even though a later one is still cached.
        assert_eq!(ix.depths(&[1, 2, 3], now), vec![1, 1]);
        assert_eq!((ix.held(0), ix.held(1)), (2, 1));
        assert_eq!(ix.state(0, now), StreamState::Live);
    }

    #[test]
    fn a_block_stored_twice_stays_until_both_copies_go() {
        let (mut ix, now) = index(1);
        ix.apply(0, 0, &[stored(&[7]), stored(&[7])]);
        ix.apply(0, 1, &[removed(&[7])]);
        assert_eq!(ix.depths(&[7], now), vec![1]);
        ix.apply(0, 2, &[removed(&[7]), removed(&[8])]);
        assert_eq!(ix.depths(&[7], now), vec![0]);
        assert_eq!(ix.counts(0).unknown_removals, 1);
        assert_eq!(ix.held(0), 0);
    }

    #[test]
    fn clearing_empties_one_replica_only() {
        let (mut ix, now) = index(2);
        ix.apply(0, 0, &[stored(&[1, 2])]);
        ix.apply(1, 0, &[stored(&[1, 2])]);
        ix.apply(0, 1, &[KvEvent::AllBlocksCleared]);
        assert_eq!(ix.depths(&[1, 2], now), vec![0, 2]);
        assert_eq!(ix.counts(0).clears, 1);
        assert_eq!(ix.state(0, now), StreamState::Live);
    }

    #[test]
    fn sequence_numbers_tell_gaps_duplicates_and_restarts() {
        let (mut ix, now) = index(1);
        // Joining late: the first batch heard is not the engine's first.
        assert_eq!(ix.check(0, 5), SeqCheck::Gap { from: 0 });
        // A replay that reaches back to 0 makes the picture complete.
        for s in 0..5 {
            assert_eq!(ix.apply(0, s, &[stored(&[s + 100])]), Applied::InOrder);
        }
        assert_eq!(ix.apply(0, 5, &[]), Applied::InOrder);
        assert_eq!(ix.state(0, now), StreamState::Live);
        assert_eq!(ix.apply(0, 3, &[removed(&[100])]), Applied::Duplicate);
        assert_eq!(ix.depths(&[100], now), vec![1]);
        // A gap nothing fills: the picture is cleared and partial from then on.
        assert_eq!(ix.check(0, 9), SeqCheck::Gap { from: 6 });
        assert_eq!(ix.apply(0, 9, &[stored(&[200])]), Applied::AfterLoss);
        assert_eq!(ix.depths(&[100], now), vec![0]);
        assert_eq!(ix.depths(&[200], now), vec![1]);
        assert_eq!(ix.state(0, now), StreamState::Partial);
        // Numbers going backwards: a new engine process with an empty cache.
        assert_eq!(ix.check(0, 0), SeqCheck::Restarted);
        ix.restarted(0);
        assert_eq!(ix.depths(&[200], now), vec![0]);
        assert_eq!(ix.apply(0, 0, &[stored(&[300])]), Applied::InOrder);
        assert_eq!(ix.state(0, now), StreamState::Live);
        let c = ix.counts(0);
        assert_eq!((c.gaps, c.losses, c.restarts), (2, 1, 1));
    }

    #[test]
    fn a_late_join_without_history_is_partial_until_the_cache_is_cleared() {
        let (mut ix, now) = index(1);
        assert_eq!(ix.apply(0, 40, &[stored(&[1])]), Applied::InOrder);
        assert_eq!(ix.state(0, now), StreamState::Partial);
        ix.apply(0, 41, &[KvEvent::AllBlocksCleared]);
        assert_eq!(ix.state(0, now), StreamState::Live);
        let (mut empty, _) = index(1);
        empty.nothing_published(0);
        assert_eq!(empty.state(0, now), StreamState::Live);
        assert_eq!(empty.check(0, 0), SeqCheck::Next);
    }

    #[test]
    fn sent_blocks_count_until_confirmed_or_expired() {
        let (mut ix, t0) = index(2);
        ix.apply(0, 0, &[stored(&[1])]);
        ix.note_dispatch(0, &[1, 2, 3], t0);
        assert_eq!(ix.depths(&[1, 2, 3], t0), vec![3, 0]);
        // Confirmed blocks stay; unconfirmed ones lapse after the TTL.
        ix.apply(0, 1, &[stored(&[2])]);
        let later = t0 + Duration::from_secs(11);
        assert_eq!(ix.depths(&[1, 2, 3], later), vec![2, 0]);
        ix.note_dispatch(0, &[1], later);
        assert!(ix.replicas[0].pending.is_empty());
        let c = ix.counts(0);
        assert_eq!((c.confirmed, c.expired), (1, 1));
    }

    #[test]
    fn a_stream_that_stays_silent_after_a_dispatch_goes_stale() {
        let (mut ix, t0) = index(1);
        ix.apply(0, 0, &[]);
        ix.note_dispatch(0, &[5], t0);
        assert_eq!(ix.state(0, t0 + Duration::from_secs(4)), StreamState::Live);
        assert_eq!(ix.state(0, t0 + Duration::from_secs(6)), StreamState::Stale);
        // Any event shows the stream is alive again.
        ix.apply(0, 1, &[stored(&[5])]);
        assert_eq!(ix.state(0, t0 + Duration::from_secs(6)), StreamState::Live);
        // Dispatching blocks the replica already holds expects nothing.
        ix.note_dispatch(0, &[5], t0);
        assert_eq!(ix.state(0, t0 + Duration::from_secs(60)), StreamState::Live);
        ix.set_connected(0, false);
        assert_eq!(ix.state(0, t0), StreamState::Missing);
    }

    #[test]
    fn the_last_batch_is_remembered_and_forgetting_drops_everything() {
        let (mut ix, now) = index(1);
        ix.apply(0, 0, &[stored(&[1])]);
        ix.note_batch_ts(0, 0, 10.5);
        // A duplicate does not move the remembered batch.
        ix.note_batch_ts(0, 7, 99.0);
        assert_eq!(ix.last_batch(0), Some((0, 10.5)));
        ix.note_dispatch(0, &[1, 2], now);
        ix.forget(0);
        assert_eq!((ix.next_seq(0), ix.last_batch(0)), (None, None));
        assert_eq!(ix.depths(&[1, 2], now), vec![0]);
        assert_eq!(ix.state(0, now), StreamState::Partial);
        // Rebuilt from the next batch heard.
        assert_eq!(ix.apply(0, 12, &[stored(&[5])]), Applied::InOrder);
        assert_eq!(ix.depths(&[5], now), vec![1]);
    }
}
