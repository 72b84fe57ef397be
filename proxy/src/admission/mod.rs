//! Admission: each replica takes at most its cap of requests at once (`cap.rs`), the proxy queues
//! what does not fit, in priority order with a deadline per class, and refuses with 429 (queue
//! full) or 503 (deadline passed) and a `Retry-After`. Nothing waits unanswered.
//!
//! ```text
//! room(r, req):    in_flight_r < cap_r, and (token budget on) tokens_r + tokens(req) ≤ budget_r
//!                  or nothing in flight on r (a request alone is always admitted);
//!                  tokens(req) = prompt + max_tokens (512 when unset), budget_r = headroom · KV_r
//! claim(req):      its pool's own replicas; reach(req): those and the ones it may borrow
//! acquire(class):  the routing policy picks among the replicas with room that no waiter of
//!                  equal or higher priority claims → a Permit
//!                  else queue full  → Refused(queue_full, 429)
//!                  else wait, woken when a permit is released or a cap rises; at the deadline
//!                       → Refused(queue_timeout, 503)
//!                  or the pick names one replica to wait for (WaitFor: the routing choice, at
//!                  its cap, holds much more of the prompt than any with room): the request
//!                  claims and is woken for that one alone until `until`, then picks anywhere;
//!                  a slot there goes to such a waiter before others of its priority
//! Permit::drop:    the replica's count falls and the next waiter that can take it is woken: one
//!                  that claims it, or borrows it while it is below the borrower's floor; the
//!                  first of the highest priority, or, once that one has waited longer than
//!                  lifo_after, the newest of that priority (adaptive LIFO: under overload the
//!                  requests with the most time left are served and the oldest time out, instead
//!                  of every request waiting nearly its whole deadline)
//! woken, no room:  the wake passes on (at most MAX_PASSES times) to a waiter the woken one does
//!                  not hold back: not of its own pool at its priority or lower
//! leaving queue:   a waiter that leaves (timed out, client gone) wakes one that may now fit
//! replica back:    (a health round finds it routable again) as many waiters as it has room for
//! replica out:     its waiters for it alone (`WaitFor`) pick again at once, as newcomers
//! ```
//!
//! Pools share one queue, but a waiter holds back only the requests that would take a slot on
//! its own pool's replicas: a batch request does not wait behind an interactive one when their
//! pools have no replica in common. Within a pool a waiter that cannot fit (the token budget) keeps
//! its place ahead of smaller requests of its priority or lower, as a queue's head does.
//!
//! The counts are the proxy's own (dispatch decisions cannot wait for scraped metrics), and the
//! permit is a guard: however the request ends, dropping it releases the slot.

pub mod cap;
pub mod context;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use cap::{CapController, CapParams, Change, Feedback};
use tokio::sync::oneshot;

/// Why a request was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// The class's queue is at its bound.
    QueueFull,
    /// The request waited until its class's deadline.
    QueueTimeout,
}

/// Where a request waits: higher priority first, then arrival order.
type WaitKey = (std::cmp::Reverse<i32>, u64);

#[derive(Debug)]
struct Waiter {
    /// Wakes it, saying how many times the wake was passed on before (see [`For::PassedOn`]).
    tx: oneshot::Sender<u8>,
    since: tokio::time::Instant,
    claim: Reach,
    reach: Reach,
    /// A borrowed replica (in `reach`, not `claim`) is usable below this fraction of its cap.
    borrow_below: f64,
    /// Waiting for this replica alone (`Pick::WaitFor`).
    only: Option<usize>,
}

impl Waiter {
    /// Whether it could take a slot on replica `b` now.
    fn can_use(&self, b: usize, s: &Slot) -> bool {
        s.open()
            && (reaches(&self.claim, b)
                || reaches(&self.reach, b)
                    && s.cap
                        .cap()
                        .is_none_or(|c| f64::from(s.in_flight) < self.borrow_below * f64::from(c)))
    }
}

/// Which waiter a wake is for.
#[derive(Debug, Clone, Copy)]
enum For<'a> {
    /// One that can use some replica now.
    Any,
    /// One that can use this replica (it was released, or its cap or budget grew).
    Replica(usize),
    /// A wake passed on by a woken waiter that could not use it: one that can use some replica
    /// and is not held back by the passer (a waiter of the passer's own pool at its priority or
    /// lower waits behind it anyway); `hops` passes so far, at most [`MAX_PASSES`].
    PassedOn {
        claim: &'a [bool],
        priority: i32,
        hops: u8,
    },
}

/// How many times one wake is passed on at most: each pass is a waiter that could not use it.
const MAX_PASSES: u8 = 4;

/// Sent instead of a pass count: the waiter picks again as if it had just come, with no slot
/// handed to it (see [`Admission::replica_out`]).
const PICK_AGAIN: u8 = u8::MAX;

/// A set of replicas, by replica id; empty: every replica.
pub type Reach = Arc<[bool]>;

fn reaches(reach: &[bool], b: usize) -> bool {
    reach.is_empty() || reach.get(b).copied().unwrap_or(false)
}

#[derive(Debug)]
struct Slot {
    cap: CapController,
    in_flight: u32,
    context: context::ContextEstimate,
    /// Prompt + output tokens the admitted requests may come to.
    tokens: u64,
    /// The most `tokens` may reach (None: no token budget).
    token_budget: Option<u64>,
}

/// One replica's admission state, as [`Admission::snapshot`] reads it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SlotState {
    /// The cap (None: unlimited).
    pub cap: Option<u32>,
    /// Requests admitted now.
    pub admitted: u32,
    /// The token budget (None: none).
    pub token_budget: Option<u64>,
    /// Prompt + output tokens the admitted requests may come to.
    pub tokens: u64,
}

/// Every replica's admission state and the queue, read at one instant.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Snapshot {
    /// By replica id.
    pub replicas: Vec<SlotState>,
    /// Requests waiting, by class.
    pub queued: BTreeMap<String, usize>,
}

impl Slot {
    /// A permit for a request of `tokens` was taken here.
    fn take(&mut self, tokens: u64) {
        self.in_flight += 1;
        self.tokens = self.tokens.saturating_add(tokens);
    }

    /// A permit for a request of `tokens` was released here.
    fn release(&mut self, tokens: u64) {
        self.in_flight = self.in_flight.saturating_sub(1);
        self.tokens = self.tokens.saturating_sub(tokens);
    }

    /// Whether one more request could be admitted here now (by the cap, and by the token
    /// budget for the smallest request).
    fn open(&self) -> bool {
        self.cap.fits(self.in_flight) && self.tokens_fit(1)
    }

    /// Whether a request of `tokens` fits the token budget (one alone always does).
    fn tokens_fit(&self, tokens: u64) -> bool {
        self.in_flight == 0
            || self
                .token_budget
                .is_none_or(|b| self.tokens.saturating_add(tokens) <= b)
    }
}

#[derive(Debug)]
struct Inner {
    slots: Vec<Slot>,
    waiters: BTreeMap<WaitKey, Waiter>,
    lifo_after: Duration,
    queued_by_class: BTreeMap<String, usize>,
    next_seq: u64,
    /// Completions per second, smoothed, for Retry-After.
    done_rate: f64,
    last_done: Option<Instant>,
    /// Set once a reload replaced this admission (see [`Admission::hand_over`]).
    successor: Option<Successor>,
}

/// The admission that replaced a retired one, and where each of its replicas went there.
#[derive(Debug)]
struct Successor {
    admission: Arc<Admission>,
    /// Each replica's slot there (None: the new config dropped it).
    slots: Vec<Option<usize>>,
}

impl Inner {
    /// Where a change to replica `b`'s count must also be made: its slot in the admission that
    /// replaced this one, if any.
    fn onward(&self, b: usize) -> Option<(Arc<Admission>, usize)> {
        let s = self.successor.as_ref()?;
        Some((s.admission.clone(), s.slots.get(b).copied().flatten()?))
    }
}

/// Makes a permit taken (`taken`) or released on a retired admission count in the admissions that
/// replaced it, newest included: each takes its own lock in turn, so a handover that happens
/// meanwhile either inherited the change already or forwards it.
fn carry_on(mut next: Option<(Arc<Admission>, usize)>, taken: bool, tokens: u64) {
    while let Some((admission, b)) = next.take() {
        let mut g = admission.lock();
        if taken {
            g.slots[b].take(tokens);
        } else {
            g.slots[b].release(tokens);
            wake(&mut g, 1, For::Replica(b));
        }
        next = g.onward(b);
    }
}

/// Where the replica ids of one admission are in another that replaced it (after reloads).
#[derive(Debug, Clone)]
struct Mapping {
    /// `to[id]`: the replica's id in the admission now in use (None: dropped by a reload).
    to: Vec<Option<usize>>,
}

impl Mapping {
    fn identity(n: usize) -> Self {
        Self {
            to: (0..n).map(Some).collect(),
        }
    }

    /// This mapping followed by a reload's (`next[id]`: the id there).
    fn then(&self, next: &[Option<usize>]) -> Self {
        Self {
            to: self
                .to
                .iter()
                .map(|t| t.and_then(|i| next.get(i).copied().flatten()))
                .collect(),
        }
    }

    /// A set of the original ids as ids of the admission now in use, which has `n` replicas.
    fn carry(&self, set: &Reach, n: usize) -> Reach {
        let mut out = vec![false; n];
        for (i, to) in self.to.iter().enumerate() {
            if let (Some(j), true) = (to, reaches(set, i)) {
                if let Some(o) = out.get_mut(*j) {
                    *o = true;
                }
            }
        }
        out.into()
    }
}

/// The fleet's admission state.
#[derive(Debug)]
pub struct Admission {
    inner: Mutex<Inner>,
}

/// One request's slot on one replica; released on drop.
#[derive(Debug)]
pub struct Permit {
    admission: Arc<Admission>,
    backend: usize,
    tokens: u64,
}

impl Drop for Permit {
    fn drop(&mut self) {
        let mut g = self.admission.lock();
        g.slots[self.backend].release(self.tokens);
        let now = Instant::now();
        if let Some(prev) = g.last_done {
            let dt = now.saturating_duration_since(prev).as_secs_f64().max(1e-3);
            g.done_rate = 0.9 * g.done_rate + 0.1 / dt;
        }
        g.last_done = Some(now);
        wake(&mut g, 1, For::Replica(self.backend));
        let onward = g.onward(self.backend);
        drop(g);
        carry_on(onward, false, self.tokens);
    }
}

/// Wakes up to `n` waiters `target` describes: the first of the highest priority, or the newest of
/// that priority once the first has waited longer than `lifo_after`.
fn wake(g: &mut Inner, n: usize, target: For<'_>) {
    for _ in 0..n {
        let Inner {
            slots,
            waiters,
            lifo_after,
            ..
        } = &mut *g;
        let open = |b: usize| slots.get(b).is_some_and(Slot::open);
        let any_open = match target {
            For::Replica(b) => open(b),
            For::Any | For::PassedOn { .. } => slots.iter().any(Slot::open),
        };
        if !any_open {
            return;
        }
        // Waiters of one pool share their sets: they are checked once per run of them.
        let mut last: Option<(*const bool, *const bool, bool)> = None;
        let mut eligible = |key: &WaitKey, w: &Waiter| {
            if let For::PassedOn {
                claim, priority, ..
            } = target
            {
                let held_back = key.0.0 <= priority
                    && (0..slots.len()).any(|b| reaches(claim, b) && reaches(&w.claim, b));
                if held_back {
                    return false;
                }
            }
            let ptrs = (w.claim.as_ptr(), w.reach.as_ptr());
            match last {
                Some((c, r, ok)) if (c, r) == ptrs => ok,
                _ => {
                    let ok = match target {
                        For::Replica(b) => w.can_use(b, &slots[b]),
                        For::Any | For::PassedOn { .. } => {
                            slots.iter().enumerate().any(|(b, s)| w.can_use(b, s))
                        }
                    };
                    last = Some((ptrs.0, ptrs.1, ok));
                    ok
                }
            }
        };
        let Some((&first, w)) = waiters.iter().find(|(k, w)| eligible(k, w)) else {
            return;
        };
        // A slot on the replica a waiter of this priority waits for alone goes to it first: the
        // others could use any replica and lose nothing by taking the next slot elsewhere.
        let only_here = match target {
            For::Replica(b) => waiters
                .range((first.0, 0)..=(first.0, u64::MAX))
                .find(|(k, w)| w.only == Some(b) && eligible(k, w))
                .map(|(k, _)| *k),
            For::Any | For::PassedOn { .. } => None,
        };
        let key = if let Some(k) = only_here {
            k
        } else if w.since.elapsed() > *lifo_after {
            let priority = first.0;
            waiters
                .range((priority, 0)..=(priority, u64::MAX))
                .rev()
                .find(|(k, w)| eligible(k, w))
                .map_or(first, |(k, _)| *k)
        } else {
            first
        };
        let hops = match target {
            For::PassedOn { hops, .. } => hops,
            For::Any | For::Replica(_) => 0,
        };
        if let Some(w) = waiters.remove(&key) {
            // A waiter that timed out meanwhile passes the wake on (see `QueueEntry`).
            let _ = w.tx.send(hops);
        }
    }
}

/// Which replicas a waiter of `priority` or higher claims (all false: none waits).
fn contested(g: &Inner, priority: i32) -> Vec<bool> {
    let mut taken = vec![false; g.slots.len()];
    let mut last: Option<*const bool> = None;
    for w in g
        .waiters
        .range(..=(std::cmp::Reverse(priority), u64::MAX))
        .map(|(_, w)| w)
    {
        if last == Some(w.claim.as_ptr()) {
            continue;
        }
        last = Some(w.claim.as_ptr());
        for (b, t) in taken.iter_mut().enumerate() {
            *t |= reaches(&w.claim, b);
        }
        if taken.iter().all(|t| *t) {
            break;
        }
    }
    taken
}

/// What a request is admitted as.
#[derive(Debug, Clone)]
pub struct Ask<'a> {
    /// Its class (queue accounting).
    pub class: &'a str,
    /// Higher goes first.
    pub priority: i32,
    /// Most requests of the class that may wait.
    pub max_queue: usize,
    /// Longest wait.
    pub timeout: Duration,
    /// Prompt + output tokens it may come to (the token budget's unit).
    pub tokens: u64,
    /// Its pool's own replicas: what it holds back from requests behind it while it waits.
    pub claim: Reach,
    /// Those and the replicas it may borrow: where a release wakes it.
    pub reach: Reach,
    /// A borrowed replica is used below this fraction of its cap.
    pub borrow_below: f64,
}

/// One replica's admission state, as a pick sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Room {
    /// Below its cap.
    pub free: bool,
    /// Permits held.
    pub in_flight: u32,
    /// Its cap (None: unlimited).
    pub cap: Option<u32>,
}

impl Room {
    /// Whether it is below `fraction` of its cap (a borrower's limit).
    pub fn below(&self, fraction: f64) -> bool {
        self.free
            && self
                .cap
                .is_none_or(|c| f64::from(self.in_flight) < fraction * f64::from(c))
    }
}

/// The outcome of a pick under the admission lock.
#[derive(Debug)]
pub enum Pick {
    /// This replica.
    Backend(usize),
    /// Healthy replicas exist but none of those with room suits.
    NoRoom,
    /// Wait for room on this replica alone (the pick prefers it enough, a prefix it holds), until
    /// `until`; then the pick is asked again and may go anywhere.
    WaitFor {
        /// The replica.
        replica: usize,
        /// When the wait for it ends.
        until: tokio::time::Instant,
        /// The replica with room it would take instead (None: none has room): taken at once
        /// when it cannot wait (its class's queue is full, its deadline came, a reload dropped
        /// the replica).
        instead: Option<usize>,
    },
}

/// How long a request may wait for its routing choice while that replica is at its cap, when it
/// holds `gain_tokens` more of the prompt than the replica the request would go to instead: as
/// long as prefilling them at `prefill_tokens_per_s` would take there (waiting no longer costs
/// the request nothing it would not pay elsewhere), if they are at least `min_tokens`; never past
/// `timeout`. None: it goes elsewhere at once (`prefill_tokens_per_s` 0: never waits).
pub fn prefix_wait(
    gain_tokens: u32,
    min_tokens: u32,
    prefill_tokens_per_s: f64,
    timeout: Duration,
) -> Option<Duration> {
    (prefill_tokens_per_s > 0.0 && gain_tokens >= min_tokens.max(1)).then(|| {
        Duration::from_secs_f64(
            (f64::from(gain_tokens) / prefill_tokens_per_s).min(timeout.as_secs_f64()),
        )
    })
}

impl Admission {
    /// Admission over `n` replicas whose caps start at `initial` (None: unlimited until the engine
    /// reports its capacity); waiters are served newest first once the oldest has waited
    /// `lifo_after`.
    pub fn new(
        n: usize,
        initial: Option<u32>,
        params: CapParams,
        lifo_after: Duration,
    ) -> Arc<Self> {
        Arc::new(Self {
            inner: Mutex::new(Inner {
                slots: (0..n)
                    .map(|_| Slot {
                        cap: CapController::new(initial, params),
                        in_flight: 0,
                        context: context::ContextEstimate::default(),
                        tokens: 0,
                        token_budget: None,
                    })
                    .collect(),
                waiters: BTreeMap::new(),
                lifo_after,
                queued_by_class: BTreeMap::new(),
                next_seq: 0,
                done_rate: 0.0,
                last_done: None,
                successor: None,
            }),
        })
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Takes a slot: `pick` gets which replicas have room and chooses one (the routing policy,
    /// synchronous, under the lock so that two requests cannot take the same last slot).
    /// `Err(Ok(refusal))` is a refusal; `Err(Err(e))` is `pick`'s own error (no healthy replica).
    pub async fn acquire<E>(
        self: &Arc<Self>,
        ask: &Ask<'_>,
        mut pick: impl FnMut(&[Room]) -> Result<Pick, E>,
    ) -> Result<Permit, Result<Refusal, E>> {
        let deadline = tokio::time::Instant::now() + ask.timeout;
        // Where the request waits: this admission until a reload replaces it, then the one that
        // replaced it (`here` maps this admission's replica ids, which `pick` speaks, to its;
        // None until a reload: the same ids).
        let mut adm = self.clone();
        let mut here: Option<Mapping> = None;
        let (mut claim, mut reach) = (ask.claim.clone(), ask.reach.clone());
        // Our place in the queue, once we have one; dropped on every way out (admitted, refused,
        // timed out, or the client gone while waiting), it leaves the queue.
        let mut entry: Option<QueueEntry<'_>> = None;
        // Woken by a release (with how many times the wake was passed on), or not.
        let mut woken: Option<u8> = None;
        // Moved from a replaced admission's queue: already queued, never refused as queue_full.
        let mut moved = false;
        // The deadline came while it waited for one replica: one more pick, then refused.
        let mut last_chance = false;
        loop {
            let (k, rx, only) = {
                let mut g = adm.lock();
                if let Some(next) = g
                    .successor
                    .as_ref()
                    .map(|s| (s.admission.clone(), s.slots.clone()))
                {
                    // A reload replaced this admission: the request waits in the new one, counted
                    // with the new config's requests, under its caps and in its priority order.
                    if let Some(mut e) = entry.take() {
                        e.armed = false;
                        g.waiters.remove(&e.key);
                        release_queue_entry(&mut g, ask.class);
                        moved = true;
                    }
                    let moved_from = here
                        .take()
                        .unwrap_or_else(|| Mapping::identity(g.slots.len()));
                    drop(g);
                    let n = next.0.lock().slots.len();
                    let mapping = moved_from.then(&next.1);
                    claim = mapping.carry(&ask.claim, n);
                    reach = mapping.carry(&ask.reach, n);
                    here = Some(mapping);
                    if !reach.iter().any(|r| *r) {
                        // The new config dropped every replica this request could go to.
                        return Err(Ok(Refusal::QueueTimeout));
                    }
                    adm = next.0;
                    woken = None;
                    continue;
                }
                // A woken waiter was chosen by the releaser; anyone else takes no slot that a
                // waiter of its priority or higher could use.
                let held_back = if woken.is_some() || g.waiters.is_empty() {
                    None
                } else {
                    Some(contested(&g, ask.priority))
                };
                let mut passed_over = false;
                let id = |i: usize| here.as_ref().map_or(Some(i), |m| m.to[i]);
                let known = here.as_ref().map_or(g.slots.len(), |m| m.to.len());
                let room: Vec<Room> = (0..known)
                    .map(|i| {
                        let Some(b) = id(i) else {
                            // The new config dropped this replica.
                            return Room {
                                free: false,
                                in_flight: 0,
                                cap: Some(0),
                            };
                        };
                        let s = &mut g.slots[b];
                        let mut free = s.cap.has_room(s.in_flight) && s.tokens_fit(ask.tokens);
                        if free && held_back.as_ref().is_some_and(|h| h[b]) {
                            free = false;
                            passed_over = true;
                        }
                        Room {
                            free,
                            in_flight: s.in_flight,
                            cap: s.cap.cap(),
                        }
                    })
                    .collect();
                let picked = match pick(&room) {
                    Err(e) => return Err(Err(e)),
                    Ok(p) => p,
                };
                let here_id = |r: usize| (r < known).then(|| id(r)).flatten();
                // A replica to take now, and a replica to wait for alone (`Pick::WaitFor`), until
                // when.
                let (admit, only) = match picked {
                    Pick::Backend(p) => match here_id(p) {
                        Some(b) => (Some(b), None),
                        None => return Err(Ok(Refusal::QueueTimeout)),
                    },
                    Pick::NoRoom => (None, None),
                    Pick::WaitFor {
                        replica,
                        until,
                        instead,
                    } => {
                        let instead = instead.and_then(here_id);
                        let no_place = entry.is_none()
                            && !moved
                            && g.queued_by_class.get(ask.class).copied().unwrap_or(0)
                                >= ask.max_queue;
                        match here_id(replica) {
                            Some(b) if !no_place && !last_chance => (None, Some((b, until))),
                            // No place in the queue, no time left, or the replica is gone (a
                            // reload dropped it): where there is room now, if anywhere.
                            _ => (instead, None),
                        }
                    }
                };
                if let Some(b) = admit {
                    g.slots[b].take(ask.tokens);
                    if let Some(mut e) = entry.take() {
                        // Left the queue here, under the lock already held.
                        e.armed = false;
                        release_queue_entry(&mut g, ask.class);
                        // Others may fit where this one did not.
                        wake(&mut g, 1, For::Any);
                    }
                    let onward = g.onward(b);
                    drop(g);
                    carry_on(onward, true, ask.tokens);
                    return Ok(Permit {
                        admission: adm.clone(),
                        backend: b,
                        tokens: ask.tokens,
                    });
                }
                // What it holds back from the requests behind it: its pool's replicas, or, waiting
                // for one replica, that one alone.
                let holds: Reach = match only {
                    Some((b, _)) => (0..g.slots.len()).map(|i| i == b).collect(),
                    None => claim.clone(),
                };
                match woken {
                    // Woken for a slot this request cannot use after all (taken meanwhile, or one
                    // its pick refuses: an unhealthy or ejected replica, too few tokens left): the
                    // wake goes on to a waiter this one does not hold back, a few times at most.
                    Some(hops) if hops < MAX_PASSES => wake(
                        &mut g,
                        1,
                        For::PassedOn {
                            claim: &holds,
                            priority: ask.priority,
                            hops: hops + 1,
                        },
                    ),
                    Some(_) => {}
                    // A slot it could have taken is left to a waiter ahead of it: make sure one
                    // is coming for it.
                    None if passed_over => wake(&mut g, 1, For::Any),
                    None => {}
                }
                if last_chance {
                    return Err(Ok(Refusal::QueueTimeout));
                }
                let k = match &entry {
                    Some(e) => e.key,
                    None => {
                        let queued = g.queued_by_class.get(ask.class).copied().unwrap_or(0);
                        if queued >= ask.max_queue && !moved {
                            return Err(Ok(Refusal::QueueFull));
                        }
                        *g.queued_by_class.entry(ask.class.to_owned()).or_default() += 1;
                        let k = (std::cmp::Reverse(ask.priority), g.next_seq);
                        g.next_seq += 1;
                        entry = Some(QueueEntry {
                            admission: adm.clone(),
                            key: k,
                            class: ask.class,
                            armed: true,
                        });
                        k
                    }
                };
                let (tx, rx) = oneshot::channel();
                // Waiting for one replica, it claims and is woken for that one alone: it holds
                // back no request that could go elsewhere.
                let reach = if only.is_some() {
                    holds.clone()
                } else {
                    reach.clone()
                };
                g.waiters.insert(
                    k,
                    Waiter {
                        tx,
                        since: tokio::time::Instant::now(),
                        claim: holds,
                        reach,
                        borrow_below: ask.borrow_below,
                        only: only.map(|(b, _)| b),
                    },
                );
                (k, rx, only)
            };
            let wake_by = only.map_or(deadline, |(_, until)| until.min(deadline));
            match tokio::time::timeout_at(wake_by, rx).await {
                // Told to pick again (its replica left service): a newcomer's pick, no slot.
                Ok(Ok(PICK_AGAIN)) => woken = None,
                Ok(hops) => woken = Some(hops.unwrap_or(0)),
                Err(_) if only.is_some() => {
                    // The wait for one replica is over: the request keeps its place and picks
                    // again, anywhere (at its deadline, once more before it is refused). A wake
                    // that came as the wait ended was for it.
                    let taken = adm.lock().waiters.remove(&k).is_none();
                    woken = taken.then_some(0);
                    last_chance = tokio::time::Instant::now() >= deadline;
                }
                Err(_) => return Err(Ok(Refusal::QueueTimeout)),
            }
        }
    }
    /// Seconds a refused client should wait: the queue ahead over the recent completion rate
    /// (one a second until completions have been timed), between 1 and 60.
    pub fn retry_after(&self) -> u32 {
        let g = self.lock();
        let queued = g.waiters.len() as f64 + 1.0;
        let rate = if g.done_rate <= 0.0 {
            1.0
        } else {
            g.done_rate.max(0.1)
        };
        (queued / rate).ceil().clamp(1.0, 60.0) as u32
    }

    /// Feeds a replica's scrape to its cap; a raised cap wakes waiters.
    pub fn on_feedback(&self, backend: usize, f: Feedback) -> Change {
        let mut g = self.lock();
        let Some(slot) = g.slots.get_mut(backend) else {
            return Change::Held;
        };
        let before = slot.cap.cap();
        slot.cap.admitted = Some(slot.in_flight);
        let change = slot.cap.on_feedback(f);
        if let (Change::Raised, Some(b), Some(a)) = (change, before, slot.cap.cap()) {
            wake(&mut g, (a - b) as usize, For::Replica(backend));
        }
        change
    }

    /// Replica `backend`, which routing could not use (failing its health probes, or ejected),
    /// can be used again: as many waiters as it has room for re-check. Without this, requests
    /// queued while it was out would wait for a release elsewhere, or their deadline, while it
    /// sat idle.
    pub fn replica_back(&self, backend: usize) {
        let mut g = self.lock();
        let Some(s) = g.slots.get(backend) else {
            return;
        };
        let room = s
            .cap
            .cap()
            .map_or(g.waiters.len(), |c| c.saturating_sub(s.in_flight) as usize);
        wake(&mut g, room, For::Replica(backend));
    }

    /// Replica `backend` left service (failing its health probes, or ejected): the requests
    /// waiting for it alone (`Pick::WaitFor`) pick again now, elsewhere, instead of waiting out
    /// their bound for a slot that will not come.
    pub fn replica_out(&self, backend: usize) {
        let mut g = self.lock();
        let stranded: Vec<WaitKey> = g
            .waiters
            .iter()
            .filter(|(_, w)| w.only == Some(backend))
            .map(|(k, _)| *k)
            .collect();
        for k in stranded {
            if let Some(w) = g.waiters.remove(&k) {
                let _ = w.tx.send(PICK_AGAIN);
            }
        }
    }

    /// Sets a replica's token budget (None: none).
    pub fn set_token_budget(&self, backend: usize, budget: Option<u64>) {
        let mut g = self.lock();
        if let Some(s) = g.slots.get_mut(backend) {
            let grew = budget.is_none_or(|b| s.token_budget.is_some_and(|old| b > old));
            s.token_budget = budget;
            if grew {
                wake(&mut g, 1, For::Replica(backend));
            }
        }
    }

    /// Every replica's state and the queue by class, read under one lock: a consistent picture
    /// for `/metrics` and `/stats` (separate reads could pair one moment's admitted count with
    /// another's tokens).
    pub fn snapshot(&self) -> Snapshot {
        let g = self.lock();
        Snapshot {
            replicas: g
                .slots
                .iter()
                .map(|s| SlotState {
                    cap: s.cap.cap(),
                    admitted: s.in_flight,
                    token_budget: s.token_budget,
                    tokens: s.tokens,
                })
                .collect(),
            queued: g.queued_by_class.clone(),
        }
    }

    /// A request the replica served took `tokens` of context (prompt + output).
    pub fn observe_context(&self, backend: usize, tokens: u32) {
        if let Some(s) = self.lock().slots.get_mut(backend) {
            s.context.observe(tokens);
        }
    }

    /// The context the replica's plan uses: its recent requests' mean when `learn` and known, else
    /// `configured`.
    pub fn context(&self, backend: usize, configured: f64, learn: bool) -> f64 {
        match self.lock().slots.get(backend) {
            Some(s) if learn => s.context.context(configured),
            _ => configured,
        }
    }

    /// Feeds a replica's planned cap (`context.rs`) to its cap; a cap that appears or rises wakes
    /// waiters.
    pub fn replan(&self, backend: usize, plan: u32) -> Change {
        let mut g = self.lock();
        let Some(s) = g.slots.get_mut(backend) else {
            return Change::Held;
        };
        let before = s.cap.cap();
        let change = s.cap.replan(plan);
        match (before, s.cap.cap()) {
            // Waiters queued only for lack of room elsewhere re-check.
            (None, Some(_)) => {
                let n = g.waiters.len();
                wake(&mut g, n, For::Any);
            }
            (Some(b), Some(a)) if a > b => wake(&mut g, (a - b) as usize, For::Replica(backend)),
            _ => {}
        }
        change
    }

    /// Each replica's cap (None: unlimited) and admitted count.
    pub fn slots(&self) -> Vec<(Option<u32>, u32)> {
        self.lock()
            .slots
            .iter()
            .map(|s| (s.cap.cap(), s.in_flight))
            .collect()
    }

    /// Hands this admission's counts over to `next`, the admission of the config that replaces
    /// it: for each replica both have (`pairs`: id here, id there), `next` counts the requests
    /// admitted here as its own, and from now on every permit taken or released here is counted
    /// there too, so a reload neither forgets the requests still running under the old config
    /// nor admits a full new set beside them. With `learned`, each such replica's cap, the
    /// context its requests take and its token budget come over too (for unchanged settings the
    /// cap derives from; otherwise they start from the new config). Requests still queued here
    /// move to `next`'s queue, where they wait under its caps and in its priority order beside the
    /// new config's requests.
    pub fn hand_over(
        self: &Arc<Self>,
        next: &Arc<Admission>,
        pairs: &[(usize, usize)],
        learned: bool,
    ) {
        if Arc::ptr_eq(self, next) {
            return;
        }
        let mut g = self.lock();
        if g.successor.is_some() {
            return;
        }
        let mut n = next.lock();
        let mut slots = vec![None; g.slots.len()];
        for &(here, there) in pairs {
            let (Some(from), Some(to)) = (g.slots.get(here), n.slots.get_mut(there)) else {
                continue;
            };
            slots[here] = Some(there);
            to.in_flight += from.in_flight;
            to.tokens = to.tokens.saturating_add(from.tokens);
            if learned {
                to.cap = from.cap.clone();
                to.context = from.context.clone();
                to.token_budget = from.token_budget;
            }
        }
        drop(n);
        g.successor = Some(Successor {
            admission: next.clone(),
            slots,
        });
        // Every request still waiting here moves to the new admission's queue (see `acquire`).
        for (_, w) in std::mem::take(&mut g.waiters) {
            let _ = w.tx.send(0);
        }
    }

    /// Requests waiting, by class.
    pub fn queued(&self) -> BTreeMap<String, usize> {
        self.lock().queued_by_class.clone()
    }
}

/// A request's place in the queue. Dropped while armed (refused, timed out, or its client gone
/// while it waited), it takes its waiter out and, if a wake was already on its way to it, hands
/// that wake to the next in line, so no slot is left unclaimed.
struct QueueEntry<'a> {
    admission: Arc<Admission>,
    key: WaitKey,
    class: &'a str,
    /// Cleared when the request leaves the queue admitted (released under the lock then).
    armed: bool,
}

impl Drop for QueueEntry<'_> {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let mut g = self.admission.lock();
        // Woken but leaving, the wake goes to another waiter; not woken, it may have held others
        // back from a slot that is free now.
        g.waiters.remove(&self.key);
        wake(&mut g, 1, For::Any);
        release_queue_entry(&mut g, self.class);
    }
}

fn release_queue_entry(g: &mut Inner, class: &str) {
    if let Some(n) = g.queued_by_class.get_mut(class) {
        *n = n.saturating_sub(1);
        if *n == 0 {
            g.queued_by_class.remove(class);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn admission(n: usize, cap: u32) -> Arc<Admission> {
        Admission::new(
            n,
            Some(cap),
            CapParams::default(),
            Duration::from_secs(3600),
        )
    }

    fn ask(class: &str, priority: i32) -> Ask<'_> {
        Ask {
            class,
            priority,
            max_queue: 2,
            timeout: Duration::from_secs(5),
            tokens: 100,
            claim: Reach::from([]),
            reach: Reach::from([]),
            borrow_below: 1.0,
        }
    }

    /// Picks the first replica with room.
    fn first(room: &[Room]) -> Result<Pick, ()> {
        Ok(room
            .iter()
            .position(|r| r.free)
            .map_or(Pick::NoRoom, Pick::Backend))
    }

    /// A request of `class` and `priority` in a pool of `claim`, borrowing the rest of `reach`.
    fn pooled(class: &str, priority: i32, claim: &[bool], reach: &[bool]) -> Ask<'static> {
        Ask {
            class: if class == "interactive" {
                "interactive"
            } else {
                "batch"
            },
            priority,
            max_queue: 8,
            timeout: Duration::from_secs(5),
            tokens: 100,
            claim: Reach::from(claim),
            reach: Reach::from(reach),
            borrow_below: 1.0,
        }
    }

    /// Picks the first replica with room among `allowed`.
    fn first_of(allowed: &'static [bool]) -> impl FnMut(&[Room]) -> Result<Pick, ()> {
        move |room: &[Room]| {
            Ok(room
                .iter()
                .zip(allowed)
                .position(|(r, ok)| r.free && *ok)
                .map_or(Pick::NoRoom, Pick::Backend))
        }
    }

    const A: &[bool] = &[true, false];
    const B: &[bool] = &[false, true];
    const BOTH: &[bool] = &[true, true];

    #[tokio::test(start_paused = true)]
    async fn a_waiter_holds_back_only_requests_for_its_own_pools_replicas() {
        // Pool A is replica 0, pool B replica 1, one slot each.
        let a = admission(2, 1);
        let held_a = a
            .acquire(&pooled("interactive", 10, A, A), first_of(A))
            .await
            .unwrap();
        let a2 = a.clone();
        let waiting_a = tokio::spawn(async move {
            a2.acquire(&pooled("interactive", 10, A, A), first_of(A))
                .await
        });
        tokio::task::yield_now().await;
        assert_eq!(a.queued().get("interactive"), Some(&1));
        // A lower-priority request of pool B is not held back by the waiter of pool A.
        let held_b = a
            .acquire(&pooled("batch", -10, B, B), first_of(B))
            .await
            .unwrap();
        assert_eq!(held_b.backend, 1);
        // Pool B's next request waits; releasing pool B's replica wakes it, not pool A's waiter,
        // which stays queued for its own replica.
        let a3 = a.clone();
        let waiting_b =
            tokio::spawn(async move { a3.acquire(&pooled("batch", -10, B, B), first_of(B)).await });
        tokio::task::yield_now().await;
        drop(held_b);
        let got_b = waiting_b.await.unwrap().unwrap();
        assert_eq!(got_b.backend, 1);
        assert!(!waiting_a.is_finished());
        drop(held_a);
        assert_eq!(waiting_a.await.unwrap().unwrap().backend, 0);
    }

    #[tokio::test(start_paused = true)]
    async fn a_borrower_that_cannot_use_a_released_slot_passes_the_wake_on() {
        let a = admission(2, 1);
        let held_a = a
            .acquire(&pooled("interactive", 10, A, A), first_of(A))
            .await
            .unwrap();
        let held_b = a
            .acquire(&pooled("batch", 0, B, B), first_of(B))
            .await
            .unwrap();
        // Pool A may borrow replica 1, but its pick declines it (as above a borrow floor);
        // pool B's own request waits behind it at a lower priority.
        let a2 = a.clone();
        let borrower = tokio::spawn(async move {
            a2.acquire(&pooled("interactive", 10, A, BOTH), first_of(A))
                .await
        });
        tokio::task::yield_now().await;
        let a3 = a.clone();
        let own =
            tokio::spawn(async move { a3.acquire(&pooled("batch", 0, B, B), first_of(B)).await });
        tokio::task::yield_now().await;
        assert_eq!(a.queued().values().sum::<usize>(), 2);
        // Replica 1 frees: the borrower is woken first, cannot use it, and hands the wake on.
        drop(held_b);
        assert_eq!(own.await.unwrap().unwrap().backend, 1);
        assert!(!borrower.is_finished());
        drop(held_a);
        assert_eq!(borrower.await.unwrap().unwrap().backend, 0);
    }

    /// Never picks anything (every replica it may use is, say, ejected).
    fn nothing(_: &[Room]) -> Result<Pick, ()> {
        Ok(Pick::NoRoom)
    }

    #[tokio::test(start_paused = true)]
    async fn a_release_wakes_a_waiter_that_can_use_that_replica() {
        // Pool A is replicas 0 and 1 (0 free but refused by A's pick, as an ejected replica is;
        // 1 full), pool B is replica 2 (full). A waits at a higher priority than B.
        let a = admission(3, 1);
        const A2: &[bool] = &[true, true, false];
        const B2: &[bool] = &[false, false, true];
        let held_a = a
            .acquire(&pooled("interactive", 10, A2, A2), |room: &[Room]| {
                Ok::<_, ()>(if room[1].free {
                    Pick::Backend(1)
                } else {
                    Pick::NoRoom
                })
            })
            .await
            .unwrap();
        let held_b = a
            .acquire(
                &pooled("batch", -10, B2, B2),
                first_of(&[false, false, true]),
            )
            .await
            .unwrap();
        let a2 = a.clone();
        let waiting_a = tokio::spawn(async move {
            a2.acquire(&pooled("interactive", 10, A2, A2), nothing)
                .await
        });
        tokio::task::yield_now().await;
        let a3 = a.clone();
        let waiting_b = tokio::spawn(async move {
            a3.acquire(
                &pooled("batch", -10, B2, B2),
                first_of(&[false, false, true]),
            )
            .await
        });
        tokio::task::yield_now().await;
        assert_eq!(a.queued().values().sum::<usize>(), 2);
        // Replica 2 frees: pool B's waiter takes it, though pool A's waits ahead of it.
        drop(held_b);
        assert_eq!(waiting_b.await.unwrap().unwrap().backend, 2);
        drop(held_a);
        waiting_a.abort();
    }

    #[tokio::test(start_paused = true)]
    async fn a_replica_back_in_service_lets_in_the_requests_queued_while_it_was_out() {
        use std::sync::atomic::{AtomicBool, Ordering};
        // Two replicas of one slot each: 0 is out (its pick refuses it, as routing refuses an
        // unhealthy or ejected replica), 1 is taken.
        static ZERO_UP: AtomicBool = AtomicBool::new(false);
        let pick = |room: &[Room]| {
            Ok::<_, ()>(
                room.iter()
                    .enumerate()
                    .position(|(i, r)| r.free && (i != 0 || ZERO_UP.load(Ordering::Relaxed)))
                    .map_or(Pick::NoRoom, Pick::Backend),
            )
        };
        let a = admission(2, 1);
        let held = a.acquire(&ask("interactive", 0), pick).await.unwrap();
        assert_eq!(held.backend, 1);
        let (a2, a3) = (a.clone(), a.clone());
        let first = tokio::spawn(async move { a2.acquire(&ask("interactive", 0), pick).await });
        tokio::task::yield_now().await;
        let second = tokio::spawn(async move { a3.acquire(&ask("interactive", 0), pick).await });
        tokio::task::yield_now().await;
        assert_eq!(a.queued().get("interactive"), Some(&2));
        // Back in service: nothing was released, yet the first in line takes its one slot and the
        // other keeps waiting for room.
        ZERO_UP.store(true, Ordering::Relaxed);
        tokio::task::yield_now().await;
        assert!(!first.is_finished());
        a.replica_back(0);
        let back = first.await.unwrap().unwrap();
        assert_eq!(back.backend, 0);
        tokio::task::yield_now().await;
        assert!(!second.is_finished());
        assert_eq!(a.queued().get("interactive"), Some(&1));
        drop(held);
        assert_eq!(second.await.unwrap().unwrap().backend, 1);
    }

    /// Takes replica 0 when it has room; while it has none, waits for it until `until`, and from
    /// then on takes the first replica with room.
    fn prefers_zero(until: tokio::time::Instant) -> impl FnMut(&[Room]) -> Result<Pick, ()> {
        move |room: &[Room]| {
            if room[0].free {
                Ok(Pick::Backend(0))
            } else if tokio::time::Instant::now() < until {
                Ok(Pick::WaitFor {
                    replica: 0,
                    until,
                    instead: room.iter().position(|r| r.free),
                })
            } else {
                first(room)
            }
        }
    }

    #[test]
    fn a_request_waits_for_its_prefix_as_long_as_prefilling_it_elsewhere_would_take() {
        let timeout = Duration::from_secs(30);
        assert_eq!(
            prefix_wait(20_000, 2_048, 20_000.0, timeout),
            Some(Duration::from_secs(1))
        );
        assert_eq!(
            prefix_wait(2_048, 2_048, 20_000.0, timeout),
            Some(Duration::from_micros(102_400))
        );
        assert_eq!(
            prefix_wait(2_047, 2_048, 20_000.0, timeout),
            None,
            "too little to wait for"
        );
        assert_eq!(
            prefix_wait(0, 0, 20_000.0, timeout),
            None,
            "nothing to wait for"
        );
        assert_eq!(prefix_wait(90_000, 2_048, 0.0, timeout), None, "off");
        assert_eq!(prefix_wait(4_000_000, 2_048, 1.0, timeout), Some(timeout));
    }

    #[tokio::test(start_paused = true)]
    async fn a_request_waiting_for_one_replica_holds_back_no_other_and_goes_elsewhere_after() {
        let a = admission(2, 1);
        let held = a.acquire(&ask("default", 0), first).await.unwrap();
        assert_eq!(held.backend, 0);
        let until = tokio::time::Instant::now() + Duration::from_secs(1);
        let a2 = a.clone();
        let waiting =
            tokio::spawn(async move { a2.acquire(&ask("default", 0), prefers_zero(until)).await });
        tokio::task::yield_now().await;
        assert_eq!(a.queued().values().sum::<usize>(), 1);
        // A request behind it that can go anywhere takes replica 1: the waiter claims only 0.
        let other = a.acquire(&ask("default", 0), first).await.unwrap();
        assert_eq!(other.backend, 1);
        // Replica 0 frees within the wait: the waiter gets it.
        drop(held);
        let home = waiting.await.unwrap().unwrap();
        assert_eq!(home.backend, 0);
        assert!(tokio::time::Instant::now() < until);

        // Both full again; this time replica 1 frees first, and the waiter lets it be until its
        // wait is over, then takes it.
        let start = tokio::time::Instant::now();
        let until = start + Duration::from_secs(1);
        let a2 = a.clone();
        let waiting =
            tokio::spawn(async move { a2.acquire(&ask("default", 0), prefers_zero(until)).await });
        tokio::time::sleep(Duration::from_millis(500)).await;
        drop(other);
        tokio::time::sleep(Duration::from_millis(400)).await;
        assert!(
            !waiting.is_finished(),
            "it waits for replica 0 until its wait ends"
        );
        let elsewhere = waiting.await.unwrap().unwrap();
        assert_eq!(elsewhere.backend, 1);
        assert_eq!(start.elapsed(), Duration::from_secs(1));
        assert_eq!(a.queued().values().sum::<usize>(), 0, "it left the queue");
        drop((home, elsewhere));
        assert_eq!(a.slots(), vec![(Some(1), 0), (Some(1), 0)]);
    }

    #[tokio::test(start_paused = true)]
    async fn a_request_waiting_for_a_replica_that_left_service_goes_elsewhere_at_once() {
        use std::sync::atomic::{AtomicBool, Ordering};
        static ZERO_OUT: AtomicBool = AtomicBool::new(false);
        let start = tokio::time::Instant::now();
        let until = start + Duration::from_secs(10);
        let mut home = prefers_zero(until);
        let pick = move |room: &[Room]| {
            if ZERO_OUT.load(Ordering::Relaxed) {
                // Routing refuses a replica out of service.
                Ok(room
                    .iter()
                    .skip(1)
                    .position(|r| r.free)
                    .map_or(Pick::NoRoom, |i| Pick::Backend(i + 1)))
            } else {
                home(room)
            }
        };
        let a = admission(2, 1);
        let held = a.acquire(&ask("default", 0), first).await.unwrap();
        assert_eq!(held.backend, 0);
        let a2 = a.clone();
        let waiting = tokio::spawn(async move { a2.acquire(&ask("default", 0), pick).await });
        tokio::task::yield_now().await;
        assert_eq!(a.queued().values().sum::<usize>(), 1);
        // Replica 0 fails its probes with the request still on it: the waiter for it takes
        // replica 1 now, not when its wait for replica 0 runs out.
        ZERO_OUT.store(true, Ordering::Relaxed);
        a.replica_out(1);
        tokio::task::yield_now().await;
        assert!(
            !waiting.is_finished(),
            "only waiters for that replica pick again"
        );
        a.replica_out(0);
        let elsewhere = waiting.await.unwrap().unwrap();
        assert_eq!(elsewhere.backend, 1);
        assert_eq!(start.elapsed(), Duration::ZERO);
        assert_eq!(a.queued().values().sum::<usize>(), 0, "it left the queue");
        drop((held, elsewhere));
    }

    #[tokio::test(start_paused = true)]
    async fn a_request_that_cannot_wait_for_its_replica_takes_the_one_with_room() {
        let a = admission(2, 1);
        let on_0 = a.acquire(&ask("default", 0), first).await.unwrap();
        let later = tokio::time::Instant::now() + Duration::from_secs(10);
        // No place in its class's queue: replica 1, at once, not a 429.
        let no_queue = Ask {
            max_queue: 0,
            ..ask("default", 0)
        };
        let on_1 = a.acquire(&no_queue, prefers_zero(later)).await.unwrap();
        assert_eq!(on_1.backend, 1);
        drop(on_1);
        // Its deadline (1 s) comes before the wait would end: at the deadline it takes replica 1,
        // which freed meanwhile, instead of a 503.
        let on_1 = a.acquire(&ask("default", 0), first).await.unwrap();
        let start = tokio::time::Instant::now();
        let short = Ask {
            timeout: Duration::from_secs(1),
            ..ask("default", 0)
        };
        let a2 = a.clone();
        let waiting = tokio::spawn(async move { a2.acquire(&short, prefers_zero(later)).await });
        tokio::time::sleep(Duration::from_millis(500)).await;
        drop(on_1);
        let at_deadline = waiting.await.unwrap().unwrap();
        assert_eq!(at_deadline.backend, 1);
        assert_eq!(start.elapsed(), Duration::from_secs(1));
        // With no room anywhere at the deadline it is refused as before.
        let a3 = a.clone();
        let short = Ask {
            timeout: Duration::from_secs(1),
            ..ask("default", 0)
        };
        let refused = a3.acquire(&short, prefers_zero(later)).await;
        assert_eq!(refused.err(), Some(Ok(Refusal::QueueTimeout)));
        assert_eq!(a.queued().values().sum::<usize>(), 0);
        drop((on_0, at_deadline));
    }

    #[tokio::test(start_paused = true)]
    async fn a_slot_goes_first_to_the_waiter_that_waits_for_that_replica_alone() {
        let a = admission(2, 1);
        let on_0 = a.acquire(&ask("default", 0), first).await.unwrap();
        let on_1 = a.acquire(&ask("default", 0), first).await.unwrap();
        // One request that can go anywhere waits, then one that waits for replica 0 alone.
        let a2 = a.clone();
        let anywhere = tokio::spawn(async move { a2.acquire(&ask("default", 0), first).await });
        tokio::task::yield_now().await;
        let until = tokio::time::Instant::now() + Duration::from_secs(4);
        let a3 = a.clone();
        let for_0 =
            tokio::spawn(async move { a3.acquire(&ask("default", 0), prefers_zero(until)).await });
        tokio::task::yield_now().await;
        assert_eq!(a.queued().values().sum::<usize>(), 2);
        // Replica 0 frees: the one waiting for it gets it, though the other waited longer.
        drop(on_0);
        let home = for_0.await.unwrap().unwrap();
        assert_eq!(home.backend, 0);
        tokio::task::yield_now().await;
        assert!(!anywhere.is_finished());
        drop(on_1);
        assert_eq!(anywhere.await.unwrap().unwrap().backend, 1);
        drop(home);
    }

    #[tokio::test(start_paused = true)]
    async fn a_waiter_that_leaves_lets_in_those_it_held_back() {
        let a = admission(1, 1);
        // A high-priority request that can use nothing waits (until its 1 s deadline) ...
        let a2 = a.clone();
        let stuck = tokio::spawn(async move {
            let mut asked = ask("interactive", 10);
            asked.timeout = Duration::from_secs(1);
            a2.acquire(&asked, nothing).await
        });
        tokio::task::yield_now().await;
        // ... and holds back a lower one from the free slot until it leaves.
        let t0 = tokio::time::Instant::now();
        let held_back = a.acquire(&ask("batch", 0), first).await.unwrap();
        assert_eq!(held_back.backend, 0);
        assert!(t0.elapsed() >= Duration::from_secs(1));
        assert!(t0.elapsed() < Duration::from_secs(2), "{:?}", t0.elapsed());
        assert!(matches!(
            stuck.await.unwrap(),
            Err(Ok(Refusal::QueueTimeout))
        ));
    }

    #[tokio::test(start_paused = true)]
    async fn requests_queued_before_a_reload_wait_under_the_new_caps_and_priorities() {
        let old = admission(1, 1);
        let running = old.acquire(&ask("batch", 0), first).await.unwrap();
        let wait = |a: &Arc<Admission>, priority: i32| {
            let a = a.clone();
            tokio::spawn(async move {
                let mut asked = ask("batch", priority);
                asked.max_queue = 8;
                a.acquire(&asked, first).await
            })
        };
        let low: Vec<_> = (0..3).map(|_| wait(&old, 0)).collect();
        tokio::task::yield_now().await;
        assert_eq!(old.queued().get("batch"), Some(&3));
        // The reload keeps the cap at 1: the three move to the new queue, and a request of higher
        // priority that arrives after them still goes first.
        let new = admission(1, 1);
        old.hand_over(&new, &[(0, 0)], false);
        tokio::task::yield_now().await;
        assert!(old.queued().is_empty());
        assert_eq!(new.queued().get("batch"), Some(&3));
        let high = wait(&new, 10);
        tokio::task::yield_now().await;
        drop(running);
        let h = high.await.unwrap().unwrap();
        assert!(low.iter().all(|l| !l.is_finished()));
        assert_eq!(new.slots(), vec![(Some(1), 1)]);
        // A reload that raises the cap to 3 lets the waiting ones in at once.
        let newer = admission(1, 3);
        new.hand_over(&newer, &[(0, 0)], false);
        let mut low = low.into_iter();
        let mut admitted = Vec::new();
        for l in low.by_ref().take(2) {
            admitted.push(l.await.unwrap().unwrap());
        }
        assert_eq!(newer.slots(), vec![(Some(3), 3)]);
        drop((h, admitted));
        let last = low.next().unwrap().await.unwrap().unwrap();
        assert_eq!(newer.slots(), vec![(Some(3), 1)]);
        drop(last);
        assert_eq!(newer.slots(), vec![(Some(3), 0)]);
    }

    #[tokio::test(start_paused = true)]
    async fn a_full_fleet_queues_by_priority_refuses_past_the_bound_and_releases_on_drop() {
        let a = admission(2, 1);
        let p1 = a.acquire(&ask("batch", 0), first).await.unwrap();
        let p2 = a.acquire(&ask("batch", 0), first).await.unwrap();
        assert_eq!((p1.backend, p2.backend), (0, 1));
        let wait = |class: &'static str, priority: i32| {
            let a = a.clone();
            tokio::spawn(async move { a.acquire(&ask(class, priority), first).await })
        };
        // Both replicas full: a batch request and an interactive one wait; the interactive one is
        // served first although it came second.
        let batch = wait("batch", 0);
        tokio::task::yield_now().await;
        let interactive = wait("interactive", 10);
        tokio::task::yield_now().await;
        assert_eq!(a.queued().values().sum::<usize>(), 2);
        let snap = a.snapshot();
        assert_eq!(snap.queued, a.queued());
        assert_eq!(
            snap.replicas
                .iter()
                .map(|r| (r.cap, r.admitted))
                .collect::<Vec<_>>(),
            a.slots()
        );
        assert!(snap.replicas.iter().all(|r| r.admitted == 1));
        // A third batch request fits in its class's queue (bound 2); a fourth does not.
        let third = wait("batch", 0);
        tokio::task::yield_now().await;
        assert!(matches!(
            a.acquire(&ask("batch", 0), first).await,
            Err(Ok(Refusal::QueueFull))
        ));
        drop(p2);
        let pi = interactive.await.unwrap().unwrap();
        assert_eq!(pi.backend, 1);
        assert!(!batch.is_finished());
        drop(p1);
        let pb = batch.await.unwrap().unwrap();
        assert_eq!(pb.backend, 0);
        // Nobody releases again: the third waits out its deadline and is refused.
        assert!(matches!(
            third.await.unwrap(),
            Err(Ok(Refusal::QueueTimeout))
        ));
        assert!(a.queued().is_empty());
        assert!(a.retry_after() >= 1);
        drop((pi, pb));
        assert_eq!(a.slots(), vec![(Some(1), 0), (Some(1), 0)]);
    }

    /// Each replica's token budget and the tokens its admitted requests may reach.
    fn tokens(a: &Admission) -> Vec<(Option<u64>, u64)> {
        a.snapshot()
            .replicas
            .iter()
            .map(|r| (r.token_budget, r.tokens))
            .collect()
    }

    #[tokio::test(start_paused = true)]
    async fn a_waiter_whose_client_left_or_whose_pick_failed_leaves_the_queue() {
        let a = admission(1, 1);
        let held = a.acquire(&ask("batch", 0), first).await.unwrap();
        // The client goes away while queued: its future is dropped.
        let gone = {
            let a = a.clone();
            tokio::spawn(async move { a.acquire(&ask("batch", 0), first).await })
        };
        tokio::task::yield_now().await;
        assert_eq!(a.queued()["batch"], 1);
        gone.abort();
        let _ = gone.await;
        assert!(a.queued().is_empty(), "{:?}", a.queued());
        // Queued, then woken into a fleet with no healthy replica: refused, and out of the queue.
        let failing = {
            let a = a.clone();
            tokio::spawn(async move {
                let mut calls = 0;
                a.acquire(&ask("batch", 0), move |room: &[Room]| {
                    calls += 1;
                    if calls == 1 { first(room) } else { Err(()) }
                })
                .await
            })
        };
        tokio::task::yield_now().await;
        assert_eq!(a.queued()["batch"], 1);
        drop(held);
        assert!(matches!(failing.await.unwrap(), Err(Err(()))));
        assert!(a.queued().is_empty(), "{:?}", a.queued());
        // Woken, then gone before taking the slot: the wake passes to the next waiter.
        let held = a.acquire(&ask("batch", 0), first).await.unwrap();
        let (first_waiter, second_waiter) = {
            let spawn = || {
                let a = a.clone();
                tokio::spawn(async move { a.acquire(&ask("batch", 0), first).await })
            };
            let f = spawn();
            tokio::task::yield_now().await;
            (f, spawn())
        };
        tokio::task::yield_now().await;
        drop(held); // wakes the first waiter…
        first_waiter.abort(); // …which leaves before it runs
        let _ = first_waiter.await;
        let got = second_waiter.await.unwrap().unwrap();
        assert_eq!(got.backend, 0);
        drop(got);
        assert!(a.queued().is_empty());
        assert_eq!(a.slots(), vec![(Some(1), 0)]);
    }

    #[tokio::test(start_paused = true)]
    async fn slots_come_back_to_zero_and_raised_caps_wake_waiters() {
        let a = admission(1, 1);
        let p = a.acquire(&ask("c", 0), first).await.unwrap();
        let waiter = tokio::spawn({
            let a = a.clone();
            async move { a.acquire(&ask("c", 0), first).await.is_ok() }
        });
        tokio::task::yield_now().await;
        // The cap was binding and the replica is quiet: it rises, and the waiter gets in.
        let quiet = Feedback {
            preemptions_total: Some(0.0),
            kv_usage: Some(0.1),
            waiting: Some(0.0),
            running: None,
        };
        assert_eq!(a.on_feedback(0, quiet), Change::Raised);
        assert!(waiter.await.unwrap());
        drop(p);
        assert_eq!(a.slots(), vec![(Some(3), 0)]);
        // No healthy replica is the picker's error, passed through.
        let err = a.acquire(&ask("c", 0), |_| Err::<Pick, &str>("none")).await;
        assert!(matches!(err, Err(Err("none"))));
    }

    #[tokio::test(start_paused = true)]
    async fn past_lifo_after_the_newest_waiter_goes_first() {
        let a = Admission::new(1, Some(1), CapParams::default(), Duration::from_millis(100));
        let held = a.acquire(&ask("c", 0), first).await.unwrap();
        let wait = |n: u32| {
            let a = a.clone();
            tokio::spawn(async move {
                let p = a.acquire(&ask("c", 0), first).await;
                (n, p)
            })
        };
        let older = wait(1);
        tokio::task::yield_now().await;
        tokio::time::sleep(Duration::from_millis(150)).await;
        let newer = wait(2);
        tokio::task::yield_now().await;
        // The oldest has waited 150 ms > 100 ms: the release goes to the newest.
        drop(held);
        let (n, p) = newer.await.unwrap();
        assert_eq!(n, 2);
        drop(p.unwrap());
        let (n, p) = older.await.unwrap();
        assert_eq!(n, 1);
        assert!(p.is_ok());
    }

    #[tokio::test(start_paused = true)]
    async fn the_token_budget_admits_by_size_and_a_lone_request_always() {
        let a = admission(1, 100);
        a.set_token_budget(0, Some(1_000));
        let sized = |tokens: u64| Ask {
            tokens,
            ..ask("c", 0)
        };
        // Far under the cap of 100 sequences, but 600 + 300 fill 900 of the 1,000 tokens.
        let big = a.acquire(&sized(600), first).await.unwrap();
        let mid = a.acquire(&sized(300), first).await.unwrap();
        assert_eq!(tokens(&a), vec![(Some(1_000), 900)]);
        let a2 = a.clone();
        let waiting = tokio::spawn(async move { a2.acquire(&sized(200), first).await });
        tokio::task::yield_now().await;
        assert_eq!(a.queued().values().sum::<usize>(), 1, "200 more do not fit");
        drop(big);
        let p = waiting.await.unwrap().unwrap();
        assert_eq!(tokens(&a), vec![(Some(1_000), 500)]);
        drop((mid, p));
        // Alone on the replica, a request larger than the whole budget is still served.
        let huge = a.acquire(&sized(5_000), first).await.unwrap();
        drop(huge);
        assert_eq!(tokens(&a), vec![(Some(1_000), 0)]);
        assert_eq!(a.slots(), vec![(Some(100), 0)]);
    }

    #[tokio::test(start_paused = true)]
    async fn a_reload_hands_its_running_requests_to_the_new_admission() {
        // The old config has replicas 0 and 1; the new one keeps old 1 as its 0 and adds one.
        let old = admission(2, 4);
        let kept = |room: &[Room]| -> Result<Pick, ()> {
            Ok(if room[1].free {
                Pick::Backend(1)
            } else {
                Pick::NoRoom
            })
        };
        let running = [
            old.acquire(&ask("c", 0), kept).await.unwrap(),
            old.acquire(&ask("c", 0), kept).await.unwrap(),
        ];
        let elsewhere = old.acquire(&ask("c", 0), first).await.unwrap();
        assert_eq!(elsewhere.backend, 0);
        let new = admission(2, 2);
        old.hand_over(&new, &[(1, 0)], false);
        // The two requests running on the kept replica fill its new cap of 2 (not learned: the
        // cap is the new config's); the dropped replica's request counts nowhere new.
        assert_eq!(new.slots(), vec![(Some(2), 2), (Some(2), 0)]);
        assert_eq!(tokens(&new)[0].1, 200);
        let new2 = new.clone();
        let only_0 = |room: &[Room]| -> Result<Pick, ()> {
            Ok(if room[0].free {
                Pick::Backend(0)
            } else {
                Pick::NoRoom
            })
        };
        let waiting = tokio::spawn(async move { new2.acquire(&ask("c", 0), only_0).await });
        tokio::task::yield_now().await;
        assert_eq!(
            new.queued().values().sum::<usize>(),
            1,
            "the old requests hold the room"
        );
        // One of them ends under the old config: the new one's waiter takes its place.
        let [first_old, second_old] = running;
        drop(first_old);
        let admitted = waiting.await.unwrap().unwrap();
        assert_eq!(new.slots()[0], (Some(2), 2));
        // A request that asks the old admission after the reload (one that was queued there, or
        // raced it) waits in the new one's queue under the new cap, and through a second reload
        // in the newest's.
        let old2 = old.clone();
        let late = tokio::spawn(async move { old2.acquire(&ask("c", 0), kept).await });
        tokio::task::yield_now().await;
        assert_eq!(
            new.queued().values().sum::<usize>(),
            1,
            "moved to the new queue"
        );
        assert_eq!(new.slots()[0], (Some(2), 2), "the new cap holds");
        let newest = admission(1, 8);
        new.hand_over(&newest, &[(0, 0)], true);
        assert_eq!(
            newest.slots(),
            vec![(Some(2), 2)],
            "learned: the cap came over"
        );
        tokio::task::yield_now().await;
        assert_eq!(newest.queued().values().sum::<usize>(), 1, "moved again");
        assert!(new.queued().is_empty());
        drop(second_old);
        let late = late.await.unwrap().unwrap();
        assert_eq!(late.backend, 0);
        assert_eq!(newest.slots(), vec![(Some(2), 2)]);
        drop(late);
        assert_eq!(new.slots()[0], (Some(2), 1));
        assert_eq!(newest.slots(), vec![(Some(2), 1)]);
        drop(admitted);
        assert_eq!(newest.slots(), vec![(Some(2), 0)]);
        assert_eq!(tokens(&newest), vec![(None, 0)]);
        assert_eq!(old.slots(), vec![(Some(4), 1), (Some(4), 0)]);
        drop(elsewhere);
        assert_eq!(newest.slots(), vec![(Some(2), 0)]);
        // A second handover of the same admission changes nothing.
        old.hand_over(&newest, &[(0, 0)], false);
        assert_eq!(newest.slots(), vec![(Some(2), 0)]);
    }
}
