//! The fleet: each replica's address, health, ejection, the proxy's own in-flight counts (kept by
//! guards released on Drop) and the engine gauges last scraped from it.
//!
//! Health has two inputs. Active probes (`health.rs`) mark a replica unhealthy after
//! `unhealthy_after` failed probes and healthy after `healthy_after` passed ones. Passive ejection
//! takes a replica out for `eject_ms` after `eject_after` consecutive failed requests (connect
//! errors, resets, 5xx; a 4xx is the client's fault and never counts), unless that would eject more
//! than `max_ejected_fraction` of the fleet. Routing sees a replica as healthy when both agree.

pub mod cold_start;
pub mod h1;
pub mod health;
pub mod kv_events;
pub mod peers;

use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::time::Instant;

use headroom_config::serve::{BackendConfig, HealthConfig};
use headroom_workload::engine_metrics::EngineGauges;

use crate::routing::{BackendId, BackendView, Foreign};

/// One replica.
#[derive(Debug)]
pub struct Backend {
    /// Index in the fleet.
    pub id: BackendId,
    /// Name in metrics, logs and the `x-headroom-backend` header.
    pub name: String,
    /// Base URL, `http://host:port`.
    pub url: String,
    /// `host:port`, sent as the `Host` header.
    pub authority: String,
    /// The host the replica's certificate must name, when it is reached over TLS (`https://`).
    pub tls_host: Option<String>,
    /// The address `authority` resolved to last; None until it resolves (the replica counts as
    /// unhealthy until then). Resolved again before every health probe, so a replica that comes
    /// back at a new address (a restarted pod) is followed.
    addr: Mutex<Option<SocketAddr>>,
    /// Stable identity for hashing policies.
    pub key: u64,
    /// `Authorization` value for the engine's own API key (`api_key_env`), when configured.
    pub authorization: Option<http::HeaderValue>,
    probe_healthy: AtomicBool,
    /// A probe has passed since the proxy first saw the replica: until then its health is
    /// presumed (so requests flow at once), not known (so the proxy is not yet ready).
    probed_up: AtomicBool,
    probe_fails: AtomicU32,
    probe_passes: AtomicU32,
    request_fails: AtomicU32,
    /// Milliseconds since the fleet's epoch until which the replica is ejected (0: not ejected).
    ejected_until_ms: AtomicU64,
    /// The replica's latest cold start (first seen or down → first healthy probe, first token).
    pub cold_start: Mutex<cold_start::ColdStart>,
    /// Times this replica was ejected.
    pub ejections: AtomicU64,
    /// Shared with the same replica's entry in the config this one replaced (see
    /// [`Fleet::carry_from`]), so requests still in flight under it keep counting.
    load: Arc<Mutex<Load>>,
    /// The engine's own gauges, as last scraped.
    pub engine: Mutex<Scraped>,
    /// Model names the replica serves (`/v1/models`), once known.
    models: Mutex<Option<Vec<String>>>,
    /// The fleet's [`Fleet::work_changed`].
    work_changed: Arc<tokio::sync::Notify>,
}

/// The proxy's view of the work it sent to a replica, with the time integral of in-flight
/// requests (so mean in-flight over any interval is a difference of two readings).
#[derive(Debug, Clone, Copy)]
struct Load {
    in_flight: u32,
    pending_prefill_tokens: u64,
    decoding: u32,
    since: Instant,
    in_flight_seconds: f64,
    /// The admission cap now (the replica's capacity in sequences), when one is known.
    capacity: Option<u32>,
    /// ∫ capacity dt, and ∫ in-flight dt over the same time (while a capacity is known).
    capacity_seconds: f64,
    capped_in_flight_seconds: f64,
}

/// What the last scrape of a replica found.
#[derive(Debug, Clone, Default)]
pub struct Scraped {
    /// The gauges (all `None` before the first successful scrape).
    pub gauges: EngineGauges,
    /// When the last scrape succeeded.
    pub at: Option<Instant>,
    /// Requests this proxy had in flight to the replica when the scrape answered.
    pub own_in_flight: u32,
    /// When a scrape last found the engine restarted.
    pub last_restart: Option<Instant>,
}

impl Scraped {
    /// Requests the engine holds that this proxy did not send (other proxies' work): its running
    /// and waiting gauges minus this proxy's own in-flight count at the scrape, never negative.
    pub fn foreign(&self) -> u32 {
        let g = &self.gauges;
        match (g.running, g.waiting) {
            (None, None) => 0,
            (r, w) => {
                let engine = r.unwrap_or(0.0) + w.unwrap_or(0.0);
                (engine - f64::from(self.own_in_flight)).max(0.0).round() as u32
            }
        }
    }
}

/// A snapshot of a replica's load, for metrics.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LoadReading {
    /// Requests in flight now.
    pub in_flight: u32,
    /// Uncached prompt tokens waiting for their first output.
    pub pending_prefill_tokens: u64,
    /// Requests past their first output.
    pub decoding: u32,
    /// ∫ in-flight dt since start, in request-seconds.
    pub in_flight_seconds: f64,
    /// ∫ capacity dt while a capacity (the admission cap) is known, in sequence-seconds.
    pub capacity_seconds: f64,
    /// ∫ in-flight dt over the same time: over `capacity_seconds`, the replica's utilisation.
    pub capped_in_flight_seconds: f64,
}

impl Backend {
    /// The replica's address as last resolved.
    pub fn addr(&self) -> Option<SocketAddr> {
        *self.addr.lock().expect("addr lock")
    }

    /// Resolves the replica's host name again; keeps the last address when the lookup fails.
    pub async fn resolve(&self) -> Option<SocketAddr> {
        match tokio::net::lookup_host(&self.authority).await {
            Ok(mut addrs) => {
                if let Some(a) = addrs.next() {
                    let mut addr = self.addr.lock().expect("addr lock");
                    if *addr != Some(a) {
                        tracing::info!(backend = %self.name, from = ?*addr, to = %a, "replica address changed");
                        *addr = Some(a);
                    }
                }
            }
            Err(e) => tracing::debug!(backend = %self.name, error = %e, "lookup failed"),
        }
        self.addr()
    }

    fn new(
        id: BackendId,
        cfg: &BackendConfig,
        work_changed: Arc<tokio::sync::Notify>,
    ) -> Result<Self, String> {
        let authority = cfg.authority().to_owned();
        let addr = match authority.to_socket_addrs() {
            Ok(mut addrs) => addrs.next(),
            Err(e) => {
                tracing::warn!(backend = %cfg.url, error = %e, "cannot resolve yet; unhealthy until it resolves");
                None
            }
        };
        let authorization = match &cfg.api_key_env {
            None => None,
            Some(var) => {
                let key = std::env::var(var)
                    .ok()
                    .filter(|k| !k.is_empty())
                    .ok_or_else(|| format!("backend {}: {var} is not set", cfg.url))?;
                let mut v = http::HeaderValue::try_from(format!("Bearer {key}")).map_err(|_| {
                    format!("backend {}: {var} is not a valid header value", cfg.url)
                })?;
                v.set_sensitive(true);
                Some(v)
            }
        };
        Ok(Self {
            id,
            name: cfg.display_name(),
            url: cfg.url.trim_end_matches('/').to_owned(),
            key: xxhash_rust::xxh3::xxh3_64(cfg.url.as_bytes()),
            authorization,
            authority,
            tls_host: cfg.tls().then(|| cfg.host().to_owned()),
            cold_start: Mutex::new(cold_start::ColdStart::new(Instant::now())),
            probe_healthy: AtomicBool::new(addr.is_some()),
            probed_up: AtomicBool::new(false),
            addr: Mutex::new(addr),
            probe_fails: AtomicU32::new(0),
            probe_passes: AtomicU32::new(0),
            request_fails: AtomicU32::new(0),
            ejected_until_ms: AtomicU64::new(0),
            ejections: AtomicU64::new(0),
            load: Arc::new(Mutex::new(Load {
                in_flight: 0,
                pending_prefill_tokens: 0,
                decoding: 0,
                since: Instant::now(),
                in_flight_seconds: 0.0,
                capacity: None,
                capacity_seconds: 0.0,
                capped_in_flight_seconds: 0.0,
            })),
            engine: Mutex::new(Scraped::default()),
            models: Mutex::new(None),
            work_changed,
        })
    }

    fn with_load<R>(&self, f: impl FnOnce(&mut Load) -> R) -> R {
        let mut l = self.load.lock().unwrap_or_else(|e| e.into_inner());
        let now = Instant::now();
        let dt = (now - l.since).as_secs_f64();
        l.in_flight_seconds += f64::from(l.in_flight) * dt;
        if let Some(cap) = l.capacity {
            l.capacity_seconds += f64::from(cap) * dt;
            l.capped_in_flight_seconds += f64::from(l.in_flight) * dt;
        }
        l.since = now;
        f(&mut l)
    }

    /// The replica's load now.
    pub fn load(&self) -> LoadReading {
        self.with_load(|l| LoadReading {
            in_flight: l.in_flight,
            pending_prefill_tokens: l.pending_prefill_tokens,
            decoding: l.decoding,
            in_flight_seconds: l.in_flight_seconds,
            capacity_seconds: l.capacity_seconds,
            capped_in_flight_seconds: l.capped_in_flight_seconds,
        })
    }

    /// Sets the replica's capacity in sequences (its admission cap; None: unknown or unlimited),
    /// integrated over time for its utilisation.
    pub fn set_capacity(&self, capacity: Option<u32>) {
        self.with_load(|l| l.capacity = capacity);
    }

    /// Records the models the replica serves.
    pub fn set_models(&self, models: Vec<String>) {
        *self.models.lock().unwrap_or_else(|e| e.into_inner()) = Some(models);
    }

    /// Whether the replica serves `model`: `None` while its list is unknown.
    pub fn serves(&self, model: &str) -> Option<bool> {
        let models = self.models.lock().unwrap_or_else(|e| e.into_inner());
        models.as_ref().map(|m| m.iter().any(|x| x == model))
    }

    /// Whether active probes currently pass.
    pub fn probe_healthy(&self) -> bool {
        self.probe_healthy.load(Ordering::Relaxed)
    }
}

/// In-flight accounting for one request on one replica; Drop takes it back whatever way the
/// request ends.
#[derive(Debug)]
pub struct InFlight {
    backend: Arc<Backend>,
    pending_prefill_tokens: u64,
    decoding: bool,
}

impl InFlight {
    /// Counts a request bringing `uncached_prefill_tokens` of prefill to `backend`.
    pub fn new(backend: Arc<Backend>, uncached_prefill_tokens: u64) -> Self {
        backend.with_load(|l| {
            l.in_flight += 1;
            l.pending_prefill_tokens += uncached_prefill_tokens;
        });
        backend.work_changed.notify_one();
        Self {
            backend,
            pending_prefill_tokens: uncached_prefill_tokens,
            decoding: false,
        }
    }

    /// The request produced its first output: its prefill is done, it now decodes.
    pub fn first_output(&mut self) {
        if self.decoding {
            return;
        }
        let pending = std::mem::take(&mut self.pending_prefill_tokens);
        self.backend
            .cold_start
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .token_served(Instant::now());
        self.backend.with_load(|l| {
            l.pending_prefill_tokens -= pending;
            l.decoding += 1;
        });
        self.backend.work_changed.notify_one();
        self.decoding = true;
    }

    /// The replica.
    pub fn backend(&self) -> &Arc<Backend> {
        &self.backend
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        let (pending, decoding) = (self.pending_prefill_tokens, self.decoding);
        self.backend.with_load(|l| {
            l.in_flight -= 1;
            l.pending_prefill_tokens -= pending;
            l.decoding -= u32::from(decoding);
        });
        self.backend.work_changed.notify_one();
    }
}

/// The replicas and their shared health settings.
#[derive(Debug)]
pub struct Fleet {
    /// The replicas, indexed by [`BackendId`].
    pub backends: Vec<Arc<Backend>>,
    health: HealthConfig,
    epoch: Instant,
    /// Whether routing views count other proxies' work on each replica estimated from its gauges
    /// ([`Scraped::foreign`]).
    pub count_foreign: bool,
    /// Other proxies' work as they report it; when set, it is what routing views count.
    pub peers: Option<Arc<peers::Peers>>,
    /// Notified whenever this proxy's own work on a replica changes (a request sent, its first
    /// token, its end), for the push to peers.
    pub work_changed: Arc<tokio::sync::Notify>,
    /// The pools' members (replica ids): the ejection cap holds in each pool as in the fleet.
    pub pools: Vec<Vec<BackendId>>,
}

impl Fleet {
    /// The fleet of `backends`; a host name that does not resolve yet leaves its replica unhealthy
    /// until a later health probe resolves it.
    pub fn new(backends: &[BackendConfig], health: HealthConfig) -> Result<Self, String> {
        let work_changed = Arc::new(tokio::sync::Notify::new());
        let backends = backends
            .iter()
            .enumerate()
            .map(|(i, b)| Backend::new(i, b, work_changed.clone()).map(Arc::new))
            .collect::<Result<_, _>>()?;
        Ok(Self {
            backends,
            work_changed,
            health,
            epoch: Instant::now(),
            count_foreign: false,
            peers: None,
            pools: Vec::new(),
        })
    }

    /// The replicas `old` and this fleet both have (the same URL), as (id in `old`, id here),
    /// one to one: a URL listed twice pairs its entries of the same name first, then in order.
    pub fn same_replicas(&self, old: &Fleet) -> Vec<(BackendId, BackendId)> {
        let mut taken = vec![false; self.backends.len()];
        let mut pairs = Vec::new();
        for same_name in [true, false] {
            for o in &old.backends {
                if pairs.iter().any(|(p, _)| *p == o.id) {
                    continue;
                }
                let here = self
                    .backends
                    .iter()
                    .find(|b| !taken[b.id] && b.url == o.url && (!same_name || b.name == o.name));
                if let Some(b) = here {
                    taken[b.id] = true;
                    pairs.push((o.id, b.id));
                }
            }
        }
        pairs.sort_unstable();
        pairs
    }

    /// Takes over what this proxy knows of every replica `old` also has (`pairs`, from
    /// [`Self::same_replicas`]: old id, id here), so that a
    /// reload changes the config, not the picture: the count of its work on the replica (shared
    /// from now on, so requests still in flight under `old` keep counting in the routing cost,
    /// the reports to peers and mean in-flight until they end, and their progress still reaches
    /// the peers at once), its health and probe streak (when `[health]` is unchanged: a new probe
    /// path or new thresholds start from the replica being reachable, as at start), what is left
    /// of an ejection, its cold start, its last scrape and its models. Called on a fleet nobody
    /// shares yet.
    ///
    /// # Panics
    /// If the fleet's replicas are already shared.
    pub fn carry_from(&mut self, old: &Fleet, pairs: &[(BackendId, BackendId)]) {
        self.work_changed = old.work_changed.clone();
        let now_ms = self.now_ms();
        for b in &mut self.backends {
            let b = Arc::get_mut(b).expect("a fleet being built is not shared yet");
            b.work_changed = old.work_changed.clone();
            let Some(&(o, _)) = pairs.iter().find(|(_, here)| *here == b.id) else {
                continue;
            };
            let o = &old.backends[o];
            b.load = o.load.clone();
            b.probed_up
                .store(o.probed_up.load(Ordering::Relaxed), Ordering::Relaxed);
            let copy = |from: &AtomicU32, to: &AtomicU32| {
                to.store(from.load(Ordering::Relaxed), Ordering::Relaxed);
            };
            if self.health == old.health {
                // A replica that does not resolve stays unhealthy whatever it was.
                b.probe_healthy
                    .store(b.addr().is_some() && o.probe_healthy(), Ordering::Relaxed);
                copy(&o.probe_fails, &b.probe_fails);
                copy(&o.probe_passes, &b.probe_passes);
            }
            copy(&o.request_fails, &b.request_fails);
            let left = o
                .ejected_until_ms
                .load(Ordering::Relaxed)
                .saturating_sub(old.now_ms());
            if left > 0 {
                b.ejected_until_ms.store(now_ms + left, Ordering::Relaxed);
            }
            b.ejections
                .store(o.ejections.load(Ordering::Relaxed), Ordering::Relaxed);
            *b.cold_start.get_mut().unwrap_or_else(|e| e.into_inner()) = o
                .cold_start
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .clone();
            *b.engine.get_mut().unwrap_or_else(|e| e.into_inner()) =
                o.engine.lock().unwrap_or_else(|e| e.into_inner()).clone();
            *b.models.get_mut().unwrap_or_else(|e| e.into_inner()) =
                o.models.lock().unwrap_or_else(|e| e.into_inner()).clone();
        }
    }

    fn now_ms(&self) -> u64 {
        self.epoch.elapsed().as_millis() as u64 + 1
    }

    /// Whether `b` is ejected now.
    pub fn is_ejected(&self, b: &Backend) -> bool {
        b.ejected_until_ms.load(Ordering::Relaxed) > self.now_ms()
    }

    /// Whether routing may send to `b`.
    pub fn is_available(&self, b: &Backend) -> bool {
        b.probe_healthy() && !self.is_ejected(b)
    }

    /// The routing snapshot, taken at dispatch time.
    pub fn views(&self) -> Vec<BackendView> {
        let reported = self.peers.as_ref().map(|p| p.foreign(Instant::now()));
        self.backends
            .iter()
            .map(|b| {
                let l = b.load();
                let foreign = if let Some(w) = reported.as_ref().and_then(|r| r.get(b.id)) {
                    Foreign {
                        requests: w.in_flight,
                        decoding: w.decoding,
                        pending_prefill_tokens: w.pending_prefill_tokens,
                    }
                } else if self.count_foreign {
                    let n = b.engine.lock().unwrap_or_else(|e| e.into_inner()).foreign();
                    Foreign {
                        requests: n,
                        decoding: n,
                        pending_prefill_tokens: 0,
                    }
                } else {
                    Foreign::default()
                };
                BackendView {
                    id: b.id,
                    key: b.key,
                    healthy: self.is_available(b),
                    in_flight: l.in_flight,
                    pending_prefill_tokens: l.pending_prefill_tokens,
                    decoding: l.decoding,
                    foreign,
                }
            })
            .collect()
    }

    /// Whether any replica can take requests.
    pub fn any_available(&self) -> bool {
        self.backends.iter().any(|b| self.is_available(b))
    }

    /// Whether any replica can take requests and has shown it: available, and a probe of it has
    /// passed (a fresh proxy presumes its replicas healthy until their first probes say
    /// otherwise; readiness waits for one to say so).
    pub fn any_ready(&self) -> bool {
        self.backends
            .iter()
            .any(|b| b.probed_up.load(Ordering::Relaxed) && self.is_available(b))
    }

    /// A request to `b` succeeded (any status below 500).
    pub fn request_succeeded(&self, b: &Backend) {
        b.request_fails.store(0, Ordering::Relaxed);
    }

    /// A request to `b` failed on the replica's side; returns whether it was ejected.
    pub fn request_failed(&self, b: &Backend) -> bool {
        let fails = b.request_fails.fetch_add(1, Ordering::Relaxed) + 1;
        if fails < self.health.eject_after || self.is_ejected(b) {
            return false;
        }
        // The cap holds in the whole fleet and in each pool the replica is in: a pool's own
        // problem must not empty it either.
        let all: Vec<BackendId> = self.backends.iter().map(|o| o.id).collect();
        let within_cap = |members: &[BackendId]| {
            let ejected = members
                .iter()
                .filter(|&&id| self.is_ejected(&self.backends[id]))
                .count();
            ejected < (members.len() as f64 * self.health.max_ejected_fraction).floor() as usize
        };
        if !within_cap(&all)
            || !self
                .pools
                .iter()
                .filter(|p| p.contains(&b.id))
                .all(|p| within_cap(p))
        {
            return false;
        }
        b.ejected_until_ms
            .store(self.now_ms() + self.health.eject_ms, Ordering::Relaxed);
        b.request_fails.store(0, Ordering::Relaxed);
        b.ejections.fetch_add(1, Ordering::Relaxed);
        tracing::warn!(
            backend = %b.name,
            failures = fails,
            eject_ms = self.health.eject_ms,
            "replica ejected after consecutive failed requests"
        );
        true
    }

    /// Why none of `members` can take a request now, and when one may again (seconds, for a
    /// `Retry-After`): the soonest end of an ejection, else the next health probe.
    pub fn unavailable(&self, members: &[bool]) -> (String, u32) {
        let now = self.now_ms();
        let (mut unhealthy, mut ejected, mut soonest) = (0, 0, None::<u64>);
        for b in self
            .backends
            .iter()
            .filter(|b| members.get(b.id).copied().unwrap_or(false))
        {
            if !b.probe_healthy() {
                unhealthy += 1;
            } else if self.is_ejected(b) {
                ejected += 1;
                let left = b
                    .ejected_until_ms
                    .load(Ordering::Relaxed)
                    .saturating_sub(now);
                soonest = Some(soonest.map_or(left, |s| s.min(left)));
            }
        }
        let wait_ms = soonest.unwrap_or(self.health.interval_ms.max(1));
        let why = match (unhealthy, ejected) {
            (0, 0) => "no replica".to_owned(),
            (u, 0) => format!("{u} unhealthy (failing health probes)"),
            (0, e) => format!("{e} ejected after failed requests"),
            (u, e) => {
                format!("{u} unhealthy (failing health probes), {e} ejected after failed requests")
            }
        };
        (why, wait_ms.div_ceil(1000).clamp(1, 3600) as u32)
    }

    /// Records one active probe of `b`.
    pub fn probe_result(&self, b: &Backend, passed: bool) {
        let cold_start = |up: bool| {
            b.cold_start
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .probe(up, Instant::now());
        };
        if passed {
            cold_start(true);
            b.probed_up.store(true, Ordering::Relaxed);
            b.probe_fails.store(0, Ordering::Relaxed);
            let passes = b.probe_passes.fetch_add(1, Ordering::Relaxed) + 1;
            if passes >= self.health.healthy_after && !b.probe_healthy.swap(true, Ordering::Relaxed)
            {
                tracing::info!(backend = %b.name, "replica healthy again");
            }
        } else {
            b.probe_passes.store(0, Ordering::Relaxed);
            let fails = b.probe_fails.fetch_add(1, Ordering::Relaxed) + 1;
            if fails >= self.health.unhealthy_after {
                // One slow probe is not a restart; a replica judged down is.
                cold_start(false);
                if b.probe_healthy.swap(false, Ordering::Relaxed) {
                    tracing::warn!(
                        backend = %b.name,
                        failed_probes = fails,
                        "replica unhealthy: it failed its health probes"
                    );
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fleet(n: usize, health: HealthConfig) -> Fleet {
        let cfgs: Vec<BackendConfig> = (0..n)
            .map(|i| BackendConfig::at(&format!("http://127.0.0.1:{}", 9000 + i)))
            .collect();
        Fleet::new(&cfgs, health).unwrap()
    }

    #[test]
    fn a_reloaded_fleet_keeps_what_it_knew_of_the_replicas_it_keeps() {
        let health = HealthConfig {
            eject_after: 1,
            max_ejected_fraction: 1.0,
            ..HealthConfig::default()
        };
        let old = fleet(3, health.clone());
        // Replica 0 is down, replica 1 ejected, replica 2 has a request in flight.
        for _ in 0..health.unhealthy_after {
            old.probe_result(&old.backends[0], false);
        }
        assert!(old.request_failed(&old.backends[1]));
        let running = InFlight::new(old.backends[2].clone(), 500);
        // The new config lists them as 2, 0 and a new one, and drops 1.
        let cfgs: Vec<BackendConfig> = [9002, 9000, 9100]
            .iter()
            .map(|p| BackendConfig::at(&format!("http://127.0.0.1:{p}")))
            .collect();
        let mut new = Fleet::new(&cfgs, health).unwrap();
        let pairs = new.same_replicas(&old);
        assert_eq!(pairs, vec![(0, 1), (2, 0)]);
        new.carry_from(&old, &pairs);
        assert!(!new.backends[1].probe_healthy(), "still down");
        assert!(new.backends[0].probe_healthy() && new.backends[2].probe_healthy());
        assert!((0..3).all(|i| !new.is_ejected(&new.backends[i])));
        assert_eq!(new.views()[0].in_flight, 1);
        assert_eq!(new.views()[0].pending_prefill_tokens, 500);
        // The old request's progress counts in the new fleet, and wakes its pushes.
        use futures_util::FutureExt;
        let _ = new.work_changed.notified().now_or_never(); // the start's notice
        assert!(new.work_changed.notified().now_or_never().is_none());
        drop(running);
        assert_eq!(new.views()[0].in_flight, 0);
        assert!(new.work_changed.notified().now_or_never().is_some());
        // An ejection comes over with what is left of it, whatever [health] now says; health
        // itself starts afresh under new health settings (a fixed probe path must not keep a
        // replica down).
        let cfgs = [9001, 9000].map(|p| BackendConfig::at(&format!("http://127.0.0.1:{p}")));
        let mut again = Fleet::new(&cfgs, HealthConfig::default()).unwrap();
        let pairs = again.same_replicas(&old);
        again.carry_from(&old, &pairs);
        assert!(again.is_ejected(&again.backends[0]));
        assert_eq!(again.backends[0].ejections.load(Ordering::Relaxed), 1);
        assert!(
            again.backends[1].probe_healthy(),
            "new [health]: probed afresh"
        );
    }

    #[test]
    fn a_url_listed_twice_pairs_by_name_then_in_order() {
        let named = |list: &[(&str, &str)]| {
            let cfgs: Vec<BackendConfig> = list
                .iter()
                .map(|(url, name)| BackendConfig {
                    name: Some((*name).into()),
                    ..BackendConfig::at(url)
                })
                .collect();
            Fleet::new(&cfgs, HealthConfig::default()).unwrap()
        };
        let (u, v) = ("http://127.0.0.1:9000", "http://127.0.0.1:9001");
        let old = named(&[(u, "x"), (u, "y"), (v, "z")]);
        let new = named(&[(v, "z2"), (u, "y"), (u, "w")]);
        // y keeps y; x takes the other entry of its URL; z is renamed z2. Nothing pairs twice.
        assert_eq!(new.same_replicas(&old), vec![(0, 2), (1, 1), (2, 0)]);
        let fewer = named(&[(u, "x")]);
        assert_eq!(fewer.same_replicas(&old), vec![(0, 0)]);
    }

    #[test]
    fn foreign_work_is_the_engines_count_beyond_our_own() {
        let scraped = |running, waiting, own| Scraped {
            gauges: EngineGauges {
                running,
                waiting,
                ..EngineGauges::default()
            },
            at: None,
            own_in_flight: own,
            last_restart: None,
        };
        assert_eq!(scraped(Some(7.0), Some(2.0), 4).foreign(), 5);
        // Our requests may be counted by us before the engine sees them: never negative.
        assert_eq!(scraped(Some(1.0), Some(0.0), 3).foreign(), 0);
        assert_eq!(scraped(None, None, 0).foreign(), 0);
        let mut f = fleet(2, HealthConfig::default());
        *f.backends[1].engine.lock().unwrap() = scraped(Some(6.0), None, 0);
        assert_eq!(
            f.views()[1].foreign,
            Foreign::default(),
            "off unless asked for"
        );
        f.count_foreign = true;
        let estimated = Foreign {
            requests: 6,
            decoding: 6,
            pending_prefill_tokens: 0,
        };
        assert_eq!(f.views()[1].foreign, estimated);
        // Peers' reports, when configured, are what counts, prefill and decode apart.
        let urls = f.backends.iter().map(|b| b.url.clone()).collect();
        let peers = Arc::new(peers::Peers::new(
            1,
            urls,
            std::time::Duration::from_secs(1),
        ));
        f.peers = Some(peers.clone());
        assert_eq!(f.views()[1].foreign, Foreign::default());
        let report = peers::LoadReport {
            proxy: 2,
            seq: 1,
            backends: vec![peers::BackendWork {
                url: "http://127.0.0.1:9001".into(),
                work: peers::Work {
                    in_flight: 3,
                    pending_prefill_tokens: 14_000,
                    decoding: 1,
                },
            }],
        };
        peers.heard("127.0.0.1:1".parse().unwrap(), &report, Instant::now());
        let views = f.views();
        assert_eq!(views[0].foreign, Foreign::default());
        assert_eq!(
            views[1].foreign,
            Foreign {
                requests: 3,
                decoding: 1,
                pending_prefill_tokens: 14_000,
            }
        );
    }

    #[test]
    fn in_flight_guards_return_everything_on_drop() {
        let f = fleet(1, HealthConfig::default());
        let b = f.backends[0].clone();
        let mut a = InFlight::new(b.clone(), 100);
        let c = InFlight::new(b.clone(), 50);
        assert_eq!(
            (b.load().in_flight, b.load().pending_prefill_tokens),
            (2, 150)
        );
        a.first_output();
        a.first_output();
        let l = b.load();
        assert_eq!(
            (l.in_flight, l.pending_prefill_tokens, l.decoding),
            (2, 50, 1)
        );
        drop(c);
        drop(a);
        let l = b.load();
        assert_eq!(
            (l.in_flight, l.pending_prefill_tokens, l.decoding),
            (0, 0, 0)
        );
        assert!(l.in_flight_seconds >= 0.0);
    }

    #[test]
    fn ejection_after_consecutive_failures_and_capped() {
        let f = fleet(
            4,
            HealthConfig {
                eject_after: 2,
                max_ejected_fraction: 0.5,
                ..HealthConfig::default()
            },
        );
        let [a, b, c, _] = [0, 1, 2, 3].map(|i| f.backends[i].clone());
        assert!(!f.request_failed(&a));
        f.request_succeeded(&a);
        assert!(!f.request_failed(&a), "a success resets the count");
        assert!(f.request_failed(&a));
        assert!(f.is_ejected(&a) && !f.is_available(&a));
        assert!(!f.request_failed(&b) && f.request_failed(&b));
        // Two of four are out: a third would exceed the cap.
        assert!(!f.request_failed(&c) && !f.request_failed(&c));
        assert!(f.is_available(&c));
        assert_eq!(f.views().iter().filter(|v| v.healthy).count(), 2);
        let (why, wait) = f.unavailable(&[true, true, false, false]);
        assert_eq!(why, "2 ejected after failed requests");
        assert_eq!(wait, HealthConfig::default().eject_ms.div_ceil(1000) as u32);
    }

    #[test]
    fn the_ejection_cap_holds_in_each_pool() {
        let mut f = fleet(
            4,
            HealthConfig {
                eject_after: 1,
                max_ejected_fraction: 0.5,
                ..HealthConfig::default()
            },
        );
        // Pools {0, 1} and {2, 3}: half of the fleet, but all of one pool, may not go.
        f.pools = vec![vec![0, 1], vec![2, 3]];
        let [a, b, c, _] = [0, 1, 2, 3].map(|i| f.backends[i].clone());
        assert!(f.request_failed(&a));
        assert!(!f.request_failed(&b), "the pool's last replica stays");
        assert!(f.request_failed(&c), "another pool's first may go");
        assert!(f.is_available(&b));
    }

    #[test]
    fn probes_flip_health_after_their_thresholds() {
        let f = fleet(
            1,
            HealthConfig {
                unhealthy_after: 2,
                healthy_after: 2,
                ..HealthConfig::default()
            },
        );
        let b = f.backends[0].clone();
        f.probe_result(&b, false);
        assert!(b.probe_healthy());
        f.probe_result(&b, false);
        assert!(!b.probe_healthy() && !f.any_available());
        f.probe_result(&b, true);
        assert!(!b.probe_healthy());
        f.probe_result(&b, true);
        assert!(b.probe_healthy());
    }

    #[tokio::test]
    async fn a_name_that_does_not_resolve_yet_is_unhealthy_until_it_does() {
        let f = Fleet::new(
            &[
                BackendConfig::at("http://no-such-host.invalid:1"),
                BackendConfig::at("http://localhost:1"),
            ],
            HealthConfig::default(),
        )
        .unwrap();
        let (missing, local) = (&f.backends[0], &f.backends[1]);
        assert_eq!(missing.addr(), None);
        assert!(!missing.probe_healthy());
        assert_eq!(missing.resolve().await, None);
        assert!(local.probe_healthy());
        let addr = local.resolve().await.expect("localhost resolves");
        assert!(addr.ip().is_loopback());
        assert_eq!(addr.port(), 1);
    }
}
