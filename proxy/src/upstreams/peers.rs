//! Other proxies' work in flight on each replica, shared over the admin listeners: each proxy serves
//! its own per-replica counts at `/peers/load`, pushes them to every peer when they change, polls
//! every peer's, and routing adds the peers' work to its own.
//!
//! ```text
//! foreign(b) = Σ over peers p heard from within expire_ms of  work_p(b)
//! work_p(b)  = (requests, uncached prefill tokens not yet done, sequences decoding) p has on b
//! ```
//!
//! | parameter | meaning | default |
//! |---|---|---|
//! | `peers.addresses` | the peers' admin listeners; a name resolving to several addresses means each | none |
//! | `peers.interval_ms` | time between polls: how late a peer's new work is seen when a push is lost | 100 |
//! | `peers.push_interval_ms` | after a change in its own work a proxy pushes its report at once, then at most once per this (0: polls only) | 5 |
//! | `peers.timeout_ms` | a slower poll fails | 250 |
//! | `peers.expire_ms` | a peer not heard from for this long counts no more | 1000 |
//!
//! Why the peers' own listeners rather than a shared store: nothing new to run, and no single point
//! of failure. A peer that stops answering costs its share of the picture after `expire_ms`, never
//! the routing. Why push as well as poll: proxies behind one Service place a burst's requests at
//! the same moment, and a poll shows each only the work of earlier bursts; a push reaches the
//! others a loopback or network round trip after the dispatch. Polls stay, so a lost push costs at
//! most one interval, and every report carries a per-process sequence number, so an older report
//! (a slow poll) never replaces a newer one (a push). Each address is polled on its own, so a peer that hangs delays no other; names are
//! resolved again every [`RESOLVE_EVERY`], keeping the last addresses while a lookup fails.
//! Replicas are matched by URL, so every proxy must name them alike. Each proxy reports only the
//! requests it sent, so nothing is counted twice; it recognises its own report (a headless Service
//! lists every pod, itself included) by a random per-process id and skips it.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::net::SocketAddr;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use headroom_config::serve::PeersConfig;
use serde::{Deserialize, Serialize};
use tokio::sync::watch;

use super::Fleet;

/// What one proxy has in flight on one replica (also a sum of several proxies').
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Work {
    /// Requests in flight.
    pub in_flight: u32,
    /// Uncached prompt tokens of those requests that have not produced a first token.
    pub pending_prefill_tokens: u64,
    /// Those requests past their first token.
    pub decoding: u32,
}

impl Work {
    /// Adds another proxy's work; saturating, since the numbers come from the network.
    fn add(&mut self, o: &Work) {
        self.in_flight = self.in_flight.saturating_add(o.in_flight);
        self.pending_prefill_tokens = self
            .pending_prefill_tokens
            .saturating_add(o.pending_prefill_tokens);
        self.decoding = self.decoding.saturating_add(o.decoding);
    }
}

/// One replica's line in a [`LoadReport`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BackendWork {
    /// The replica's URL as configured (how peers match replicas).
    pub url: String,
    /// The reporting proxy's work on it.
    #[serde(flatten)]
    pub work: Work,
}

/// `GET /peers/load` on the admin listener, and the body of a push (`POST /peers/load`): this
/// proxy's own work on each replica.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LoadReport {
    /// The reporting process's id (random per process), so a proxy skips its own report.
    pub proxy: u64,
    /// Increases with every report a process makes, so a receiver keeps the newest (0: unknown,
    /// always taken).
    #[serde(default)]
    pub seq: u64,
    /// One line per replica.
    pub backends: Vec<BackendWork>,
}

impl LoadReport {
    /// The report of `fleet`'s own counts, by the proxy `proxy`.
    pub fn of(proxy: u64, fleet: &Fleet) -> Self {
        // The number and the reading are taken under one lock, so a higher number always holds a
        // later reading (a poll's report and a push's are built concurrently).
        static SEQ: Mutex<u64> = Mutex::new(0);
        let mut seq = SEQ.lock().unwrap_or_else(|e| e.into_inner());
        *seq += 1;
        Self {
            proxy,
            seq: *seq,
            backends: fleet
                .backends
                .iter()
                .map(|b| {
                    let l = b.load();
                    BackendWork {
                        url: b.url.clone(),
                        work: Work {
                            in_flight: l.in_flight,
                            pending_prefill_tokens: l.pending_prefill_tokens,
                            decoding: l.decoding,
                        },
                    }
                })
                .collect(),
        }
    }
}

/// What was last heard from one peer, in this fleet's replica order.
#[derive(Debug, Clone)]
struct Heard {
    at: Instant,
    from: SocketAddr,
    seq: u64,
    work: Vec<Work>,
}

/// What a report changed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Heeded {
    /// A peer's report, now counted; `unmatched` of its lines named a replica this proxy does not
    /// have (a URL spelled differently, or another fleet) and were ignored.
    Peer {
        /// Lines ignored.
        unmatched: usize,
    },
    /// This proxy's own report (its address is among the peers'): skipped.
    Own,
    /// A peer's report older than one already heard from it (a slow poll behind a push): skipped.
    Stale,
}

impl Heeded {
    /// Its name in the `result` label of the peer metrics.
    pub fn result(self) -> &'static str {
        match self {
            Self::Peer { unmatched: 0 } => "ok",
            Self::Peer { .. } => "unmatched",
            Self::Own => "self",
            Self::Stale => "stale",
        }
    }
}

/// A peer as `/stats` shows it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PeerState {
    /// Its process id.
    pub proxy: u64,
    /// Where it was last heard from: the address polled, or the source of a push.
    pub address: SocketAddr,
    /// Milliseconds since.
    pub age_ms: u64,
    /// Whether it still counts.
    pub live: bool,
}

/// The peers' work, as last heard. Pure: the poll loop feeds it, routing reads it.
#[derive(Debug)]
pub struct Peers {
    own: u64,
    expire: Duration,
    /// This fleet's replicas: backend ids by URL (a URL listed twice is one engine under two
    /// names: both see its work).
    ids: HashMap<String, Vec<usize>>,
    /// How many backends the fleet lists.
    replicas: usize,
    heard: Mutex<HashMap<u64, Heard>>,
    /// Where the peers were last resolved to, and which of those addresses are this proxy's own.
    addresses: Mutex<Addresses>,
    /// The shared secret pushes carry (`peers.token_env`), and its digest to check theirs by.
    token: Option<(String, [u8; 32])>,
    /// Pushes with the secret are taken from any address (`peers.any_address`).
    any_address: bool,
}

#[derive(Debug, Default)]
struct Addresses {
    all: BTreeSet<SocketAddr>,
    own: HashSet<SocketAddr>,
    /// Peers whose last push failed: no more pushes until a poll of them succeeds (a peer that
    /// refuses, answers 401/404, or runs a build without pushes would otherwise get one per change).
    failing: HashSet<SocketAddr>,
}

impl Peers {
    /// Peers of the proxy `own` in front of the replicas `urls` (by backend id), forgotten
    /// `expire` after they were last heard from.
    pub fn new(own: u64, urls: Vec<String>, expire: Duration) -> Self {
        let replicas = urls.len();
        let mut ids: HashMap<String, Vec<usize>> = HashMap::new();
        for (id, u) in urls.into_iter().enumerate() {
            ids.entry(u.trim_end_matches('/').to_owned())
                .or_default()
                .push(id);
        }
        Self {
            own,
            expire,
            ids,
            replicas,
            heard: Mutex::new(HashMap::new()),
            addresses: Mutex::new(Addresses::default()),
            token: None,
            any_address: false,
        }
    }

    /// Takes over the reports `old` holds (a reload), each report's lines moved to this fleet's
    /// replicas by `pairs` (id in `old`, id here), so the other proxies' work keeps counting until
    /// they next report instead of being zero for a poll interval.
    pub fn carry_from(&self, old: &Peers, pairs: &[(usize, usize)]) {
        let n = self.replicas();
        let old_heard = old.heard.lock().unwrap_or_else(|e| e.into_inner());
        let mut heard = self.heard.lock().unwrap_or_else(|e| e.into_inner());
        for (proxy, h) in old_heard.iter() {
            let mut work = vec![Work::default(); n];
            for &(from, to) in pairs {
                if let (Some(w), Some(slot)) = (h.work.get(from), work.get_mut(to)) {
                    *slot = *w;
                }
            }
            heard.insert(*proxy, Heard { work, ..h.clone() });
        }
        // Which addresses are this proxy's own, and which peers refuse its pushes.
        let from = old.addresses.lock().unwrap_or_else(|e| e.into_inner());
        let mut to = self.addresses.lock().unwrap_or_else(|e| e.into_inner());
        to.own.clone_from(&from.own);
        to.failing.clone_from(&from.failing);
    }

    /// Pushes carry `token` and must carry it to be taken (None: no secret).
    pub fn with_token(mut self, token: Option<String>) -> Self {
        use sha2::Digest;
        self.token = token.map(|t| {
            let digest = sha2::Sha256::digest(t.as_bytes()).into();
            (t, digest)
        });
        self
    }

    /// The secret this proxy's pushes carry.
    pub fn token(&self) -> Option<&str> {
        self.token.as_ref().map(|(t, _)| t.as_str())
    }

    /// Takes pushes that carry the secret from any address (`peers.any_address`: behind a
    /// service mesh every push arrives from the mesh's own address).
    pub fn from_any_address(mut self, any: bool) -> Self {
        self.any_address = any;
        self
    }

    /// Whether a push from `ip` with this `Authorization` header may be taken: from an address
    /// the peers' names resolved to at the last lookup (any address with `any_address`), and,
    /// with a shared secret, carrying it (compared by digest in constant time). Checked before
    /// the body is read.
    pub fn may_push(
        &self,
        ip: std::net::IpAddr,
        authorization: Option<&[u8]>,
    ) -> Result<(), PushRefused> {
        use sha2::Digest;
        use subtle::ConstantTimeEq;
        let secret_ok = |want: &[u8; 32]| {
            authorization
                .and_then(crate::auth::bearer_token)
                .is_some_and(|t| {
                    let got: [u8; 32] = sha2::Sha256::digest(t).into();
                    bool::from(got.ct_eq(want))
                })
        };
        // Without a secret, `any_address` is refused by validation; it is ignored here too.
        let from_anywhere = self.any_address && self.token.is_some();
        if !from_anywhere && !self.knows(ip) {
            return Err(PushRefused::Unknown);
        }
        match &self.token {
            Some((_, want)) if !secret_ok(want) => Err(PushRefused::Unauthorized),
            _ => Ok(()),
        }
    }

    fn replicas(&self) -> usize {
        self.replicas
    }

    /// Takes in a report heard from `from` at `now`, and forgets the peers expired by then.
    /// Replicas this fleet does not have are ignored; replicas the peer did not report count as
    /// idle on it.
    pub fn heard(&self, from: SocketAddr, report: &LoadReport, now: Instant) -> Heeded {
        let own = report.proxy == self.own;
        let mut work = vec![Work::default(); if own { 0 } else { self.replicas() }];
        let mut unmatched = 0;
        for line in report.backends.iter().filter(|_| !own) {
            match self.ids.get(line.url.trim_end_matches('/')) {
                // A peer that lists the engine twice reports it twice: its work is the sum.
                Some(ids) => {
                    for &id in ids {
                        work[id].add(&line.work);
                    }
                }
                None => unmatched += 1,
            }
        }
        let mut heard = self.heard.lock().unwrap_or_else(|e| e.into_inner());
        heard.retain(|_, h| now.saturating_duration_since(h.at) < self.expire);
        if own {
            return Heeded::Own;
        }
        let last = heard.get(&report.proxy).map_or(0, |h| h.seq);
        if report.seq != 0 && report.seq < last {
            return Heeded::Stale;
        }
        heard.insert(
            report.proxy,
            Heard {
                at: now,
                from,
                seq: report.seq,
                work,
            },
        );
        Heeded::Peer { unmatched }
    }

    /// Records where the peers' names resolve to now.
    pub fn resolved(&self, all: BTreeSet<SocketAddr>) {
        let mut a = self.addresses.lock().unwrap_or_else(|e| e.into_inner());
        a.own.retain(|x| all.contains(x));
        a.failing.retain(|x| all.contains(x));
        a.all = all;
    }

    /// Records what a poll of `addr` found: this proxy's own report, or a peer's (which makes a
    /// peer whose pushes failed a push target again).
    pub fn polled(&self, addr: SocketAddr, heeded: Heeded) {
        let mut a = self.addresses.lock().unwrap_or_else(|e| e.into_inner());
        match heeded {
            Heeded::Own => {
                a.own.insert(addr);
            }
            Heeded::Peer { .. } | Heeded::Stale => {
                a.failing.remove(&addr);
            }
        }
    }

    /// Records that a push to `addr` failed: none more until a poll of it succeeds.
    pub fn push_failed(&self, addr: SocketAddr) {
        let mut a = self.addresses.lock().unwrap_or_else(|e| e.into_inner());
        a.failing.insert(addr);
    }

    /// The addresses to push to: every peer's, less this proxy's own once a poll has found it,
    /// and less those whose last push failed.
    pub fn push_targets(&self) -> Vec<SocketAddr> {
        let a = self.addresses.lock().unwrap_or_else(|e| e.into_inner());
        a.all
            .iter()
            .filter(|x| !a.own.contains(x) && !a.failing.contains(x))
            .copied()
            .collect()
    }

    /// Whether `ip` is one of the addresses the peers' names resolved to at the last lookup.
    fn knows(&self, ip: std::net::IpAddr) -> bool {
        let a = self.addresses.lock().unwrap_or_else(|e| e.into_inner());
        let ip = ip.to_canonical();
        a.all.iter().any(|x| x.ip().to_canonical() == ip)
    }

    /// The live peers' work summed per replica, by backend id.
    pub fn foreign(&self, now: Instant) -> Vec<Work> {
        let mut sum = vec![Work::default(); self.replicas()];
        let heard = self.heard.lock().unwrap_or_else(|e| e.into_inner());
        for h in heard.values().filter(|h| self.live(h, now)) {
            for (s, w) in sum.iter_mut().zip(&h.work) {
                s.add(w);
            }
        }
        sum
    }

    fn live(&self, h: &Heard, now: Instant) -> bool {
        now.saturating_duration_since(h.at) < self.expire
    }

    /// Every peer heard from and not yet forgotten (a peer that expired shows as not live until
    /// the next report heard), by id.
    pub fn states(&self, now: Instant) -> Vec<PeerState> {
        let heard = self.heard.lock().unwrap_or_else(|e| e.into_inner());
        let mut v: Vec<PeerState> = heard
            .iter()
            .map(|(id, h)| PeerState {
                proxy: *id,
                address: h.from,
                age_ms: now.saturating_duration_since(h.at).as_millis() as u64,
                live: self.live(h, now),
            })
            .collect();
        v.sort_by_key(|p| p.proxy);
        v
    }
}

/// Called with each poll's result: `Some` with what the report was, `None` when it failed.
pub type OnPoll = std::sync::Arc<dyn Fn(Option<Heeded>) + Send + Sync>;

/// How often the peers' names are resolved again (pods come and go behind a headless Service).
pub const RESOLVE_EVERY: Duration = Duration::from_secs(1);

/// Polls every peer each `cfg.interval_ms` until `stop` turns true. Each address is polled on its
/// own: one whose last poll is still waiting is skipped this round, and delays no other.
pub async fn poll_loop(
    peers: std::sync::Arc<Peers>,
    cfg: PeersConfig,
    client: reqwest::Client,
    on_poll: OnPoll,
    mut stop: watch::Receiver<bool>,
) {
    if cfg.addresses.is_empty() {
        return;
    }
    let timeout = Duration::from_millis(cfg.timeout_ms);
    let mut resolved: HashMap<&str, (Instant, Vec<SocketAddr>)> = HashMap::new();
    let mut busy: HashSet<SocketAddr> = HashSet::new();
    let mut polls: tokio::task::JoinSet<SocketAddr> = tokio::task::JoinSet::new();
    let mut tick = tokio::time::interval(Duration::from_millis(cfg.interval_ms));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            Some(done) = polls.join_next() => {
                if let Ok(addr) = done {
                    busy.remove(&addr);
                }
                continue;
            }
            _ = stop.changed() => return,
        }
        for name in &cfg.addresses {
            let now = Instant::now();
            let fresh = resolved
                .get(name.as_str())
                .is_some_and(|(at, _)| now.saturating_duration_since(*at) < RESOLVE_EVERY);
            if fresh {
                continue;
            }
            let lookup =
                tokio::time::timeout(timeout, tokio::net::lookup_host(name.as_str())).await;
            let entry = resolved
                .entry(name.as_str())
                .or_insert_with(|| (now, Vec::new()));
            entry.0 = now;
            match lookup {
                Ok(Ok(addrs)) => entry.1 = addrs.collect(),
                Ok(Err(e)) => {
                    tracing::debug!(peer = %name, error = %e, "peer name did not resolve; its last addresses kept");
                    on_poll(None);
                }
                Err(_) => {
                    tracing::debug!(peer = %name, "peer name lookup timed out; its last addresses kept");
                    on_poll(None);
                }
            }
        }
        let targets: BTreeSet<SocketAddr> = resolved
            .values()
            .flat_map(|(_, a)| a.iter().copied())
            .collect();
        peers.resolved(targets.clone());
        for addr in targets {
            if !busy.insert(addr) {
                continue;
            }
            let (client, peers, on_poll) = (client.clone(), peers.clone(), on_poll.clone());
            polls.spawn(async move {
                match poll(&client, addr, timeout).await {
                    Some(r) => {
                        let heeded = peers.heard(addr, &r, Instant::now());
                        peers.polled(addr, heeded);
                        on_poll(Some(heeded));
                    }
                    None => {
                        tracing::debug!(peer = %addr, "peer poll failed");
                        on_poll(None);
                    }
                }
                addr
            });
        }
    }
}

/// One peer's report, when it answers in time.
async fn poll(client: &reqwest::Client, addr: SocketAddr, timeout: Duration) -> Option<LoadReport> {
    let url = format!("http://{addr}/peers/load");
    let resp = client.get(url).timeout(timeout).send().await.ok()?;
    if !resp.status().is_success() {
        return None;
    }
    resp.json::<LoadReport>().await.ok()
}

/// Why a push was not taken ([`Peers::may_push`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PushRefused {
    /// Not from a peer's address, and not taken from any address (403).
    Unknown,
    /// With one: the push did not carry it (401).
    Unauthorized,
}

/// What became of one push, as `headroom_peer_pushes_total{direction="sent"}` counts it: the
/// receiving side's own label where it answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pushed {
    /// Taken (204).
    Ok,
    /// 403: the peer takes pushes only from its peers' addresses, and this one is not among them.
    Unknown,
    /// 401: the peer wants a shared secret this proxy does not send.
    Unauthorized,
    /// 404: the peer has no `[peers]`, or runs a build without pushes.
    Refused,
    /// Any other answer, or none in time.
    Failed,
}

impl Pushed {
    fn of(status: Option<http::StatusCode>) -> Self {
        match status.map(|s| s.as_u16()) {
            Some(200..=299) => Self::Ok,
            Some(403) => Self::Unknown,
            Some(401) => Self::Unauthorized,
            Some(404) => Self::Refused,
            _ => Self::Failed,
        }
    }

    /// The metric's `result` label.
    pub fn result(self) -> &'static str {
        match self {
            Self::Ok => "ok",
            Self::Unknown => "unknown",
            Self::Unauthorized => "unauthorized",
            Self::Refused => "refused",
            Self::Failed => "failed",
        }
    }

    /// What an operator should do about it, for the log (None: nothing to say).
    fn advice(self) -> Option<&'static str> {
        match self {
            Self::Ok | Self::Failed => None,
            Self::Unknown => Some(
                "the peer does not take pushes from this proxy's address (403): its \
                 peers.addresses must name this proxy; behind a service mesh, which rewrites \
                 source addresses, set peers.token_env and peers.any_address on every proxy; \
                 polls still carry the news",
            ),
            Self::Unauthorized => Some(
                "the peer wants another shared secret (401): peers.token_env must name the same \
                 secret on every proxy; polls still carry the news",
            ),
            Self::Refused => Some(
                "the peer takes no pushes (404: no [peers], or an older build); polls still carry \
                 the news",
            ),
        }
    }
}

/// Called with each push's result.
pub type OnPush = std::sync::Arc<dyn Fn(Pushed) + Send + Sync>;

/// Pushes this proxy's report to every peer when its own work changes (`fleet.work_changed`): at
/// once after a quiet spell, then at most once per `cfg.push_interval_ms`, so a burst of changes
/// costs one push per interval and its last state always goes out. A peer whose last push is still
/// waiting is skipped, and another round follows when that push ends, so it still gets the latest
/// state. A peer whose push failed gets none until a poll of it succeeds. Returns at once when
/// pushing is off.
pub async fn push_loop(
    peers: std::sync::Arc<Peers>,
    fleet: std::sync::Arc<Fleet>,
    own: u64,
    cfg: PeersConfig,
    client: reqwest::Client,
    on_push: OnPush,
    mut stop: watch::Receiver<bool>,
) {
    if cfg.addresses.is_empty() || cfg.push_interval_ms == 0 {
        return;
    }
    let (timeout, spacing) = (
        Duration::from_millis(cfg.timeout_ms),
        Duration::from_millis(cfg.push_interval_ms),
    );
    let changed = fleet.work_changed.clone();
    // The peer each push in flight goes to, by task (a task that panicked still frees its peer).
    let mut busy: HashMap<tokio::task::Id, SocketAddr> = HashMap::new();
    // Peers skipped while busy: they are owed the state that changed meanwhile.
    let mut owed: HashSet<SocketAddr> = HashSet::new();
    let mut pushes: tokio::task::JoinSet<()> = tokio::task::JoinSet::new();
    let task_id = |done: &Result<(tokio::task::Id, ()), tokio::task::JoinError>| match done {
        Ok((id, ())) => *id,
        Err(e) => e.id(),
    };
    // Each refusing peer's reason, so that the log says it once, not per push: a push taken
    // forgets it, one lost on the way (`Failed`) leaves it.
    let refusals: std::sync::Arc<Mutex<HashMap<SocketAddr, Pushed>>> = Default::default();
    loop {
        tokio::select! {
            _ = changed.notified() => {}
            Some(done) = pushes.join_next_with_id() => {
                if let Some(addr) = busy.remove(&task_id(&done))
                    && owed.remove(&addr)
                {
                    changed.notify_one();
                }
                continue;
            }
            _ = stop.changed() => return,
        }
        // Pushes that ended meanwhile: this round brings their peers up to date.
        while let Some(done) = pushes.try_join_next_with_id() {
            if let Some(addr) = busy.remove(&task_id(&done)) {
                owed.remove(&addr);
            }
        }
        let body = match serde_json::to_vec(&LoadReport::of(own, &fleet)) {
            Ok(b) => bytes::Bytes::from(b),
            Err(_) => continue,
        };
        for addr in peers.push_targets() {
            if busy.values().any(|a| *a == addr) {
                owed.insert(addr);
                continue;
            }
            let (client, body, on_push) = (client.clone(), body.clone(), on_push.clone());
            let (peers, token) = (peers.clone(), peers.token().map(str::to_owned));
            let refusals = refusals.clone();
            let task = pushes.spawn(async move {
                let pushed = push(&client, addr, body, token.as_deref(), timeout).await;
                if pushed != Pushed::Ok {
                    tracing::debug!(peer = %addr, result = pushed.result(), "push to peer not taken; none more until a poll of it succeeds");
                    peers.push_failed(addr);
                }
                let new_reason = {
                    let mut r = refusals.lock().unwrap_or_else(|e| e.into_inner());
                    match pushed {
                        Pushed::Ok => {
                            r.remove(&addr);
                            false
                        }
                        Pushed::Failed => false,
                        refused => r.insert(addr, refused) != Some(refused),
                    }
                };
                if let Some(advice) = pushed.advice().filter(|_| new_reason) {
                    tracing::warn!(peer = %addr, result = pushed.result(), "{advice}");
                }
                on_push(pushed);
            });
            busy.insert(task.id(), addr);
        }
        // Changes during the pause leave the notification set: the next round sends their sum.
        tokio::select! {
            _ = tokio::time::sleep(spacing) => {}
            _ = stop.changed() => return,
        }
    }
}

/// One push of this proxy's report, and what the peer made of it.
async fn push(
    client: &reqwest::Client,
    addr: SocketAddr,
    body: bytes::Bytes,
    token: Option<&str>,
    timeout: Duration,
) -> Pushed {
    let mut req = client
        .post(format!("http://{addr}/peers/load"))
        .header(http::header::CONTENT_TYPE, "application/json");
    if let Some(t) = token {
        req = req.bearer_auth(t);
    }
    let answer = req.body(body).timeout(timeout).send().await;
    Pushed::of(answer.ok().map(|r| r.status()))
}

/// A random id for this process, for [`LoadReport::proxy`]: std's randomly keyed hasher (keyed
/// from the OS's randomness) over the clock and a counter.
pub fn process_id() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    static CALLS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let mut h = std::hash::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    h.write_u64(CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed));
    h.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report(proxy: u64, lines: &[(&str, u32, u64, u32)]) -> LoadReport {
        LoadReport {
            proxy,
            seq: 0,
            backends: lines
                .iter()
                .map(
                    |&(url, in_flight, pending_prefill_tokens, decoding)| BackendWork {
                        url: url.into(),
                        work: Work {
                            in_flight,
                            pending_prefill_tokens,
                            decoding,
                        },
                    },
                )
                .collect(),
        }
    }

    fn addr(port: u16) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], port))
    }

    #[test]
    fn an_engine_listed_twice_sums_a_peers_lines_and_shows_on_both_names() {
        // This fleet lists engine a under two names; the peer lists it twice too.
        let urls = vec![
            "http://a:1".into(),
            "http://b:2".into(),
            "http://a:1/".into(),
        ];
        let peers = Peers::new(7, urls, Duration::from_secs(1));
        let t0 = Instant::now();
        let r = report(1, &[("http://a:1", 3, 30, 0), ("http://a:1", 3, 0, 3)]);
        assert_eq!(peers.heard(addr(1), &r, t0), Heeded::Peer { unmatched: 0 });
        let both = Work {
            in_flight: 6,
            pending_prefill_tokens: 30,
            decoding: 3,
        };
        assert_eq!(peers.foreign(t0), vec![both, Work::default(), both]);
    }

    #[test]
    fn live_peers_add_up_per_replica_and_expire() {
        let urls = vec!["http://a:1".to_owned(), "http://b:2".to_owned()];
        let peers = Peers::new(7, urls, Duration::from_millis(1000));
        let t0 = Instant::now();
        let one = report(
            1,
            &[("http://b:2/", 3, 9000, 1), ("http://unknown:9", 5, 5, 5)],
        );
        assert_eq!(
            peers.heard(addr(1), &one, t0),
            Heeded::Peer { unmatched: 1 },
            "the unknown replica is ignored, and counted"
        );
        let two = report(2, &[("http://a:1", 1, 0, 1), ("http://b:2", 2, 100, 2)]);
        peers.heard(addr(2), &two, t0 + Duration::from_millis(600));
        let at = t0 + Duration::from_millis(700);
        assert_eq!(
            peers.foreign(at),
            vec![
                Work {
                    in_flight: 1,
                    pending_prefill_tokens: 0,
                    decoding: 1
                },
                Work {
                    in_flight: 5,
                    pending_prefill_tokens: 9100,
                    decoding: 3
                },
            ]
        );
        // Peer 1 is a second old at 1.0 s: only peer 2 counts, and /stats says so.
        let later = t0 + Duration::from_millis(1000);
        assert_eq!(peers.foreign(later)[1].pending_prefill_tokens, 100);
        let states = peers.states(later);
        assert_eq!(
            states.iter().map(|s| (s.proxy, s.live)).collect::<Vec<_>>(),
            vec![(1, false), (2, true)]
        );
        // A newer report replaces the older one instead of adding to it.
        let two_again = report(2, &[("http://b:2", 1, 10, 0)]);
        peers.heard(addr(3), &two_again, later);
        assert_eq!(
            peers.foreign(later),
            vec![
                Work::default(),
                Work {
                    in_flight: 1,
                    pending_prefill_tokens: 10,
                    decoding: 0
                }
            ]
        );
        assert_eq!(
            peers.states(later).len(),
            1,
            "the expired peer is forgotten"
        );
    }

    #[test]
    fn an_older_report_never_replaces_a_newer_one() {
        let peers = Peers::new(7, vec!["http://a:1".into()], Duration::from_secs(1));
        let now = Instant::now();
        let with_seq = |seq, in_flight| LoadReport {
            seq,
            ..report(1, &[("http://a:1", in_flight, 0, 0)])
        };
        // A push made after the poll's report arrives first.
        assert_eq!(
            peers.heard(addr(1), &with_seq(9, 3), now),
            Heeded::Peer { unmatched: 0 }
        );
        assert_eq!(peers.heard(addr(1), &with_seq(8, 1), now), Heeded::Stale);
        assert_eq!(peers.foreign(now)[0].in_flight, 3);
        assert_eq!(
            peers.heard(addr(1), &with_seq(10, 0), now),
            Heeded::Peer { unmatched: 0 }
        );
        assert_eq!(peers.foreign(now)[0].in_flight, 0);
        // A peer that numbers nothing (0) is always taken.
        peers.heard(addr(1), &with_seq(0, 5), now);
        assert_eq!(peers.foreign(now)[0].in_flight, 5);
    }

    #[test]
    fn pushes_go_to_every_peer_but_this_proxy() {
        let peers = Peers::new(7, vec!["http://a:1".into()], Duration::from_secs(1));
        peers.resolved([addr(1), addr(2), addr(3)].into());
        assert_eq!(peers.push_targets(), vec![addr(1), addr(2), addr(3)]);
        peers.polled(addr(2), Heeded::Own);
        assert_eq!(peers.push_targets(), vec![addr(1), addr(3)]);
        // A peer that refused a push gets none until a poll of it succeeds.
        peers.push_failed(addr(3));
        assert_eq!(peers.push_targets(), vec![addr(1)]);
        peers.polled(addr(3), Heeded::Peer { unmatched: 0 });
        assert_eq!(peers.push_targets(), vec![addr(1), addr(3)]);
        // The name moved: the old own address is forgotten with it.
        peers.resolved([addr(1), addr(4)].into());
        peers.resolved([addr(1), addr(2)].into());
        assert_eq!(peers.push_targets(), vec![addr(1), addr(2)]);
        // Without a secret, pushes are taken from the peers' addresses only.
        assert_eq!(peers.may_push(addr(2).ip(), None), Ok(()));
        assert_eq!(
            peers.may_push("10.1.2.3".parse().unwrap(), None),
            Err(PushRefused::Unknown)
        );
    }

    #[test]
    fn with_a_token_only_pushes_that_carry_it_are_taken() {
        let closed =
            Peers::new(7, vec![], Duration::from_secs(1)).with_token(Some("s3cret".into()));
        closed.resolved([addr(1)].into());
        assert_eq!(closed.token(), Some("s3cret"));
        let mesh: std::net::IpAddr = "127.0.0.6".parse().unwrap(); // Istio's inbound address
        assert_eq!(
            closed.may_push(addr(1).ip(), Some(b"Bearer s3cret")),
            Ok(())
        );
        assert_eq!(
            closed.may_push(addr(1).ip(), Some(b"bearer  s3cret ")),
            Ok(())
        );
        // The secret alone is not enough from an address that is not a peer's...
        assert_eq!(
            closed.may_push(mesh, Some(b"Bearer s3cret")),
            Err(PushRefused::Unknown)
        );
        // ...unless any_address says the network cannot be read (a mesh's mutual TLS).
        let mesh_peers = Peers::new(7, vec![], Duration::from_secs(1))
            .with_token(Some("s3cret".into()))
            .from_any_address(true);
        assert_eq!(mesh_peers.may_push(mesh, Some(b"Bearer s3cret")), Ok(()));
        assert_eq!(
            mesh_peers.may_push(mesh, Some(b"Bearer nope")),
            Err(PushRefused::Unauthorized)
        );
        // any_address without a secret opens nothing.
        let open = Peers::new(7, vec![], Duration::from_secs(1)).from_any_address(true);
        assert_eq!(open.may_push(mesh, None), Err(PushRefused::Unknown));
        for wrong in [
            None,
            Some(&b"Bearer s3cre"[..]),
            Some(b"s3cret"),
            Some(b"Basic s3cret"),
        ] {
            assert_eq!(
                closed.may_push(addr(1).ip(), wrong),
                Err(PushRefused::Unauthorized),
                "{wrong:?}"
            );
        }
    }

    #[test]
    fn a_push_is_labelled_by_what_the_peer_answered() {
        use http::StatusCode;
        let of = |s: Option<u16>| Pushed::of(s.map(|s| StatusCode::from_u16(s).unwrap()));
        assert_eq!(of(Some(204)), Pushed::Ok);
        assert_eq!(of(Some(403)), Pushed::Unknown);
        assert_eq!(of(Some(401)), Pushed::Unauthorized);
        assert_eq!(of(Some(404)), Pushed::Refused);
        assert_eq!(of(Some(500)), Pushed::Failed);
        assert_eq!(of(None), Pushed::Failed);
        assert!(
            Pushed::Unknown
                .advice()
                .unwrap()
                .contains("peers.token_env")
        );
        assert_eq!(Pushed::Failed.advice(), None);
    }

    #[test]
    fn a_reload_keeps_what_the_peers_reported_under_the_new_replica_order() {
        let old = Peers::new(
            7,
            vec!["http://a:1".into(), "http://b:1".into()],
            Duration::from_secs(1),
        );
        let now = Instant::now();
        let mut first = report(8, &[("http://a:1", 2, 200, 1), ("http://b:1", 5, 0, 5)]);
        first.seq = 5;
        assert_eq!(
            old.heard(addr(1), &first, now),
            Heeded::Peer { unmatched: 0 }
        );
        // The new config lists b, then c; a is gone.
        let new = Peers::new(
            7,
            vec!["http://b:1".into(), "http://c:1".into()],
            Duration::from_secs(1),
        );
        new.carry_from(&old, &[(1, 0)]);
        let work = new.foreign(now);
        assert_eq!((work[0].in_flight, work[0].decoding), (5, 5));
        assert_eq!(work[1].in_flight, 0);
        // Its sequence number came too: an older report from that peer is still stale.
        let mut older = report(8, &[("http://b:1", 9, 0, 9)]);
        older.seq = 3;
        assert_eq!(new.heard(addr(1), &older, now), Heeded::Stale);
    }

    #[test]
    fn a_proxy_skips_its_own_report() {
        let peers = Peers::new(7, vec!["http://a:1".into()], Duration::from_secs(1));
        let own = report(7, &[("http://a:1", 4, 400, 0)]);
        let now = Instant::now();
        assert_eq!(peers.heard(addr(1), &own, now), Heeded::Own);
        assert_eq!(peers.foreign(now), vec![Work::default()]);
        assert!(peers.states(now).is_empty());
    }

    #[test]
    fn reports_round_trip_as_json() {
        let r = report(u64::MAX, &[("http://a:1", 1, 2, 3)]);
        let text = serde_json::to_string(&r).unwrap();
        assert_eq!(
            text,
            format!(
                r#"{{"proxy":{},"seq":0,"backends":[{{"url":"http://a:1","in_flight":1,"pending_prefill_tokens":2,"decoding":3}}]}}"#,
                u64::MAX
            )
        );
        assert_eq!(serde_json::from_str::<LoadReport>(&text).unwrap(), r);
        // A report from a build before sequence numbers reads as 0 (always taken).
        let old = text.replace(r#""seq":0,"#, "");
        assert_eq!(serde_json::from_str::<LoadReport>(&old).unwrap(), r);
        assert_ne!(process_id(), process_id());
    }
}
