//! `headroom serve`: builds the proxy from its config, binds the proxy and admin listeners, and runs
//! the accept loop (pingora's HTTP proxy engine on headroom's own listener, so port 0 works and
//! tests run in-process), the health probes and the engine-metrics scraper until stopped.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::http::StatusCode;
use axum::response::IntoResponse;
use axum::routing::get;
use headroom_config::serve::ServeConfig;
use headroom_workload::engine_tokenizer::EngineTokenizer;
use headroom_workload::inspect::{Chain, InspectConfig, VllmChain};
use headroom_workload::vllm_hash::{SaltKeys, VllmHasher};
use pingora::connectors::ConnectorOptions;
use pingora::connectors::http::Connector;
use pingora::listeners::tls::Acceptor as TlsAcceptor;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::admission::Admission;
use crate::admission::cap::{CapParams, Change, Feedback};
use crate::app::Headroom;
use crate::client_conn::{ClientConn, ConnLimits};
use crate::lifecycle::Lifecycle;
use crate::routing::{
    BackendId, ConsistentHash, KvEvents, KvIndex, LeastLoad, PrefixAffinity, PrefixIndex,
    RoundRobin, RoutingPolicy, Session,
};
use crate::telemetry::Metrics;
use crate::telemetry::capture::Capture;
use crate::telemetry::stats::Stats;
use crate::upstreams::health::{OnRoutable, OnScrape, probe_loop, scrape_loop};
use crate::upstreams::kv_events::{EventSource, subscribe_loop};
use crate::upstreams::peers::{
    Heeded, LoadReport, OnPoll, OnPush, Peers, PushRefused, poll_loop, push_loop,
};
use crate::upstreams::{Backend, Fleet};

/// Why the proxy could not start.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// The config names something unusable (e.g. a backend that does not resolve).
    #[error("{0}")]
    Config(String),
    /// The trace capture file could not be opened.
    #[error(transparent)]
    Capture(#[from] crate::telemetry::capture::CaptureError),
    /// A listener could not be bound.
    #[error("cannot listen on {addr}: {error}")]
    Bind {
        /// The address.
        addr: String,
        /// Why (in the message, not a separate source: printed once in an error chain).
        error: std::io::Error,
    },
}

/// A running proxy.
pub struct ServeHandle {
    /// Where clients connect.
    pub addr: SocketAddr,
    /// Where `/metrics`, `/healthz` and `/readyz` are served.
    pub admin_addr: SocketAddr,
    /// The proxy's metrics.
    pub metrics: Arc<Metrics>,
    /// The `/stats` windows.
    pub stats: Arc<Stats>,
    /// The `/stats` windows of shadow copies.
    pub shadow_stats: Arc<Stats>,
    /// The trace capture, when configured.
    pub capture: Option<Arc<Capture>>,
    /// Open requests and draining.
    pub lifecycle: Arc<Lifecycle>,
    /// This process's id in its reports to peers (`/peers/load`).
    pub proxy_id: u64,
    keys: crate::auth::KeySlot,
    live: watch::Sender<Live>,
    generation: Generation,
    accept_stop: watch::Sender<bool>,
    stop: watch::Sender<bool>,
    tasks: Vec<JoinHandle<()>>,
}

impl std::fmt::Debug for ServeHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServeHandle")
            .field("addr", &self.addr)
            .field("admin_addr", &self.admin_addr)
            .field("open", &self.lifecycle.open())
            .finish_non_exhaustive()
    }
}

impl ServeHandle {
    /// The replicas and their state (of the config now serving).
    pub fn fleet(&self) -> Arc<Fleet> {
        self.generation.live.fleet.clone()
    }

    /// Admission (of the config now serving), when enabled.
    pub fn admission(&self) -> Option<Arc<Admission>> {
        self.generation.live.admission.clone()
    }

    /// Serves `cfg` from now on, without a restart and without touching a request in progress:
    /// new connections get the new config; a keep-alive connection of the old one closes after its
    /// current response; requests already in progress finish on the old one. A replica both
    /// configs name keeps its state (health, ejection, work in flight, admissions, prefix
    /// history, KV event picture: docs/proxy.md#reload).
    /// `listen`, `admin_listen`, `[capture]`, `timeouts.header_read_ms` and `timeouts.keepalive_ms`
    /// need a restart: a change to them is refused, as is
    /// a config that cannot be built; either way the old config keeps serving.
    pub async fn reload(&mut self, cfg: ServeConfig) -> Result<(), ServeError> {
        let old = &self.generation.cfg;
        for (field, same) in [
            ("listen", cfg.listen == old.listen),
            ("admin_listen", cfg.admin_listen == old.admin_listen),
            ("capture", cfg.capture == old.capture),
            // The listeners' connection limits are set when they start.
            (
                "timeouts.header_read_ms",
                cfg.timeouts.header_read_ms == old.timeouts.header_read_ms,
            ),
            (
                "timeouts.keepalive_ms",
                cfg.timeouts.keepalive_ms == old.timeouts.keepalive_ms,
            ),
        ] {
            if !same {
                return Err(ServeError::Config(format!(
                    "{field} cannot change without a restart; the running config is unchanged"
                )));
            }
        }
        let shared = Shared {
            keys: self.keys.clone(),
            metrics: self.metrics.clone(),
            stats: self.stats.clone(),
            shadow_stats: self.shadow_stats.clone(),
            capture: self.capture.clone(),
            lifecycle: self.lifecycle.clone(),
            proxy_id: self.proxy_id,
        };
        let hold = |on: bool| {
            *self
                .generation
                .scrapes_held
                .write()
                .unwrap_or_else(|e| e.into_inner()) = on;
        };
        // Waits for a scrape being acted on to finish; later ones are dropped.
        hold(true);
        let began = std::time::Instant::now();
        let next = Generation::start(Arc::new(cfg), &shared, Some(&self.generation))
            .inspect_err(|_| hold(false))?;
        let built = began.elapsed();
        if let (Some(old), Some(new)) = (&self.generation.live.admission, &next.live.admission) {
            let pairs = next.live.fleet.same_replicas(&self.generation.live.fleet);
            let learned = cap_settings(&self.generation.cfg) == cap_settings(&next.cfg);
            old.hand_over(new, &pairs, learned);
            for (b, (cap, _)) in next.live.fleet.backends.iter().zip(new.slots()) {
                b.set_capacity(cap);
            }
        }
        // The keys first: a connection the new config takes is never checked against old ones.
        self.keys.set(next.keys.clone());
        let _ = self.live.send(next.live.clone());
        let old = std::mem::replace(&mut self.generation, next);
        old.retire();
        tracing::info!(
            // The new config's build runs on the worker that took the reload.
            built_ms = (built.as_secs_f64() * 1e6).round() / 1e3,
            "config reloaded"
        );
        Ok(())
    }

    /// Stops accepting, stops the background loops and waits for them, then flushes the capture.
    pub async fn shutdown(mut self) {
        let _ = self.accept_stop.send(true);
        let _ = self.stop.send(true);
        let _ = self.generation.stop.send(true);
        let tasks = std::mem::take(&mut self.tasks)
            .into_iter()
            .chain(std::mem::take(&mut self.generation.tasks));
        for t in tasks {
            let _ = t.await;
        }
        self.flush_capture().await;
    }

    /// Drains, as at SIGTERM: for `announce` the proxy keeps serving every request (none is
    /// refused) while `/readyz` answers 503 and keep-alive connections close after each
    /// response; then it stops listening and gives open requests up to `grace` to finish; then it
    /// shuts down. Returns how many requests were still open when the grace period ended.
    pub async fn drain(self, announce: Duration, grace: Duration) -> i64 {
        self.lifecycle.start_draining();
        tracing::info!(
            open = self.lifecycle.open(),
            "draining: announcing for {announce:?}"
        );
        tokio::time::sleep(announce).await;
        let _ = self.accept_stop.send(true);
        tracing::info!(open = self.lifecycle.open(), "draining: stopped listening");
        let left = match tokio::time::timeout(grace, self.lifecycle.all_closed()).await {
            Ok(()) => 0,
            Err(_) => {
                // Requests still queued were never sent: they are answered (503, retry
                // elsewhere) rather than cut with the rest.
                let queued = self.lifecycle.waiting();
                let rest = (self.lifecycle.open() - queued).max(0);
                self.lifecycle.close_queue();
                if queued > 0 {
                    let answered =
                        tokio::time::timeout(QUEUE_CLOSE_WAIT, self.lifecycle.open_at_most(rest))
                            .await;
                    tracing::info!(
                        queued,
                        all_answered = answered.is_ok(),
                        "draining: requests still queued answered 503 shutting_down"
                    );
                }
                self.lifecycle.open()
            }
        };
        self.shutdown().await;
        left
    }

    /// Waits until every trace record of a finished request is on disk (at most 10 s).
    pub async fn flush_capture(&self) -> bool {
        let Some(c) = self.capture.clone() else {
            return true;
        };
        tokio::task::spawn_blocking(move || c.flush(Duration::from_secs(10)))
            .await
            .unwrap_or(false)
    }
}

/// How long a shutdown waits for the requests it took out of the queue to be answered.
const QUEUE_CLOSE_WAIT: Duration = Duration::from_secs(1);

/// What lives across reloads (the handle's public fields).
struct Shared {
    /// The API keys of the config now serving, read by every config's requests: a request that
    /// arrives on a connection accepted before a reload is checked against the keys of now.
    keys: crate::auth::KeySlot,
    metrics: Arc<Metrics>,
    stats: Arc<Stats>,
    shadow_stats: Arc<Stats>,
    capture: Option<Arc<Capture>>,
    lifecycle: Arc<Lifecycle>,
    proxy_id: u64,
}

/// What the listeners and the admin endpoints read of the config now serving.
#[derive(Clone)]
struct Live {
    cfg: Arc<ServeConfig>,
    app: Arc<Headroom>,
    policy: Arc<dyn RoutingPolicy>,
    fleet: Arc<Fleet>,
    admission: Option<Arc<Admission>>,
    kv_index: Option<Arc<Mutex<KvIndex>>>,
    shadows: Option<Arc<crate::shadow::Shadows>>,
}

/// Everything one config builds: the application and the replicas' state, with the background
/// loops that keep that state (health probes, metric scrapes, KV event subscribers).
struct Generation {
    cfg: Arc<ServeConfig>,
    live: Live,
    /// This config's API keys: the ones every request is checked against once it serves.
    keys: Option<Arc<crate::auth::Keys>>,
    /// Set when a newer config replaces this one: its keep-alive connections then close.
    retired: Arc<std::sync::atomic::AtomicBool>,
    /// Set while a newer config is being built from this one's state: this config's scrapes are
    /// then dropped unread, so a restart the scrape finds is counted and acted on once, by the
    /// config that carries the state on (cleared again when the new config fails to start). A
    /// scrape holds it to read while it acts, so setting it waits for that scrape to finish.
    scrapes_held: Arc<std::sync::RwLock<bool>>,
    stop: watch::Sender<bool>,
    tasks: Vec<JoinHandle<()>>,
}

/// The routing policy named in the config, and the exact prefix index the `kv_events` policy
/// reads (which the event subscribers fill).
pub fn build_policy(cfg: &ServeConfig) -> (Arc<dyn RoutingPolicy>, Option<Arc<Mutex<KvIndex>>>) {
    let r = &cfg.routing;
    let affinity = || {
        let mut index = PrefixIndex::new();
        if let Some(blocks) = r.index_blocks {
            for i in 0..cfg.backends.len() {
                index.set_capacity(i, blocks as usize);
            }
        }
        let mut p = PrefixAffinity::new(index);
        p.decode_weight = r.decode_weight;
        p.recompute_weight = r.recompute_weight;
        p.spread_tokens = r.spread_tokens as f64;
        p
    };
    match r.policy.as_str() {
        "round_robin" => (Arc::new(RoundRobin::default()), None),
        "least_load" => (Arc::new(LeastLoad), None),
        "session" => (Arc::new(Session), None),
        "consistent_hash" => (Arc::new(ConsistentHash::default()), None),
        "kv_events" => {
            let k = &cfg.kv_events;
            let exact = Arc::new(Mutex::new(KvIndex::new(
                cfg.backends.len(),
                Duration::from_millis(k.pending_ttl_ms),
                Duration::from_millis(k.stale_after_ms),
            )));
            (
                Arc::new(KvEvents::new(affinity(), exact.clone())),
                Some(exact),
            )
        }
        _ => (Arc::new(affinity()), None),
    }
}

/// Copies the approximate prefix index's history of every replica `previous` and the new config
/// share (`pairs`: old id, new id) into `policy`'s, when both policies keep one and hash requests
/// the same way (otherwise the old hashes would match nothing).
fn carry_history(
    previous: &Generation,
    pairs: &[(BackendId, BackendId)],
    cfg: &ServeConfig,
    policy: &dyn RoutingPolicy,
) {
    let (Some(old), Some(new)) = (previous.live.policy.history(), policy.history()) else {
        return;
    };
    if hashing(&previous.cfg) != hashing(cfg) {
        tracing::info!("request hashing changed: the prefix index starts empty");
        return;
    }
    old.with_index(|o| {
        new.with_index(|n| {
            for &(from, to) in pairs {
                o.copy_replica(from, n, to);
            }
        });
    });
}

/// Copies the exact (KV event) picture of every replica `previous` and the new config share
/// (`pairs`) whose event stream is the same in both configs into `new`, before its subscribers
/// start.
fn carry_events(
    previous: &Generation,
    pairs: &[(BackendId, BackendId)],
    cfg: &ServeConfig,
    new: &Mutex<KvIndex>,
) {
    let Some(old) = &previous.live.kv_index else {
        return;
    };
    // The same publisher, topic and replay socket: without a replay socket there is nothing to
    // check the picture against, and the subscriber drops it anyway.
    let stream = |c: &ServeConfig, id: usize| {
        let b = c.backends.get(id)?;
        Some((
            b.kv_events.clone()?,
            b.kv_events_replay.clone()?,
            c.kv_events.topic.clone(),
        ))
    };
    let pairs: Vec<(usize, usize)> = pairs
        .iter()
        .copied()
        .filter(|&(from, to)| {
            let s = stream(&previous.cfg, from);
            s.is_some() && s == stream(cfg, to)
        })
        .collect();
    if pairs.is_empty() {
        return;
    }
    let pending = hashing(&previous.cfg) == hashing(cfg);
    let old = old.lock().unwrap_or_else(|e| e.into_inner());
    let mut new = new.lock().unwrap_or_else(|e| e.into_inner());
    old.copy_replicas(&pairs, &mut new, pending);
}

/// What a replica's admission cap is derived from: two configs with equal values derive the same
/// cap from the same scrapes, so a reload keeps the learned one.
fn cap_settings(cfg: &ServeConfig) -> impl PartialEq + use<> {
    let a = &cfg.admission;
    (
        (
            a.max_in_flight,
            a.context_tokens,
            a.learn_context,
            a.token_budget,
        ),
        (
            a.headroom,
            a.beta,
            a.soft_beta,
            a.alpha,
            a.kv_high,
            a.kv_raise_below,
        ),
        (a.cooldown_scrapes, a.min_cap, a.max_cap),
    )
}

/// What decides a request's block hashes (see [`inspect_config`]); two configs with equal values
/// hash every request alike.
fn hashing(cfg: &ServeConfig) -> impl PartialEq + use<> {
    let k = &cfg.kv_events;
    let events = cfg.routing.policy == "kv_events";
    (
        cfg.routing.block_tokens,
        events,
        if events {
            k.hash_seed
        } else {
            cfg.routing.hash_seed
        },
        events.then(|| {
            (
                k.hash.clone(),
                k.tokenizer.clone(),
                k.chat_template.clone(),
                k.python_hash_seed.clone(),
                k.salt_keys.clone(),
            )
        }),
    )
}

/// How requests are hashed: the engine's own chain under `kv_events` (so request-side hashes
/// equal the ones the engine publishes), headroom's model-seeded chain otherwise. Loads the
/// model's tokenizer for vLLM's chain.
pub fn inspect_config(cfg: &ServeConfig) -> Result<InspectConfig, ServeError> {
    let k = &cfg.kv_events;
    let events = cfg.routing.policy == "kv_events";
    let chain = match k.hash.as_str() {
        _ if !events => Chain::Headroom,
        "vllm_sha256_cbor" => {
            let path = k.tokenizer.as_deref().unwrap_or_default();
            let tokenizer = EngineTokenizer::load(
                std::path::Path::new(path),
                k.chat_template.as_deref().map(std::path::Path::new),
            )
            .map_err(|e| ServeError::Config(format!("kv_events.tokenizer: {e}")))?;
            let salt = if k.salt_keys == "plain" {
                SaltKeys::Plain
            } else {
                SaltKeys::Tagged
            };
            Chain::Vllm(Arc::new(VllmChain {
                tokenizer,
                hasher: VllmHasher::new(
                    cfg.routing.block_tokens as usize,
                    k.python_hash_seed.as_deref(),
                    salt,
                ),
            }))
        }
        _ => Chain::Sim,
    };
    Ok(InspectConfig {
        block_tokens: cfg.routing.block_tokens,
        max_hashed_tokens: cfg.routing.max_hashed_tokens,
        hash_seed: if events {
            k.hash_seed
        } else {
            cfg.routing.hash_seed
        },
        chain,
    })
}

/// Everything `start` would build from `cfg` short of listening: the TLS files, the tokenizer, the
/// API keys. Returns warnings that do not stop a start (a replica name that does not resolve now).
pub fn preflight(cfg: &ServeConfig) -> Result<Vec<String>, ServeError> {
    tls_acceptor(cfg)?;
    upstream_clients(cfg)?;
    inspect_config(cfg)?;
    crate::auth::Keys::from_config(&cfg.security).map_err(|e| ServeError::Config(e.to_string()))?;
    let mut warnings = Vec::new();
    for b in &cfg.backends {
        use std::net::ToSocketAddrs;
        if let Err(e) = b.authority().to_socket_addrs() {
            warnings.push(format!(
                "backend {}: {} does not resolve now ({e}); it stays unhealthy until it does",
                b.display_name(),
                b.authority()
            ));
        }
    }
    Ok(warnings)
}

/// pingora's own timeouts (the client session's write timeout, a TLS replica's connect timeout)
/// of a second or more run on tokio's timer, as every other timer of the proxy does. On pingora's
/// own ("Timer thread"), the first one started a thread that ticks every 10 ms for the rest of the
/// process: 100 wake-ups a second on an idle proxy, each taking the proxy's core from its worker.
/// A sub-second one configured still runs there, and so does the idle watch of pingora's pool of
/// TLS replica connections: the clock is then started from a thread in the batch scheduling
/// class, whose class it inherits (started from a worker, its ticks preempted the worker relaying
/// streams; in the batch class they wait until the worker next waits for its sockets). Once per
/// process; a clock already running is left as it is.
fn set_up_pingora_timers(cfg: &ServeConfig) {
    pingora::prelude::fast_timeout::set_fast_timeout_to_tokio_threshold(Some(Duration::ZERO));
    let sub_second = [cfg.timeouts.client_write_ms, cfg.timeouts.connect_ms]
        .iter()
        .any(|&ms| ms < 1000);
    if !sub_second && !needs_tls_connector(cfg) {
        return;
    }
    static STARTED: std::sync::Once = std::sync::Once::new();
    STARTED.call_once(|| {
        let started = std::thread::Builder::new()
            .name("headroom-clock".into())
            .spawn(|| {
                headroom_workload::realtime::lower_current_thread();
                // Setting a sub-second timeout starts the clock; this one is never polled, so
                // never armed.
                drop(pingora::prelude::fast_timeout::fast_timeout(
                    Duration::from_millis(1),
                    std::future::ready(()),
                ));
            })
            .map(|t| t.join());
        if !matches!(started, Ok(Ok(()))) {
            tracing::debug!("pingora's clock left to start from a worker");
        }
    });
}

/// Starts the proxy on the current tokio runtime; returns once both listeners are bound.
pub async fn start(cfg: ServeConfig) -> Result<ServeHandle, ServeError> {
    let cfg = Arc::new(cfg);
    let metrics = Arc::new(Metrics::new());
    let shared = Shared {
        keys: crate::auth::KeySlot::default(),
        stats: Arc::new(Stats::default()),
        shadow_stats: Arc::new(Stats::default()),
        capture: Capture::start(&cfg.capture, metrics.capture.clone())?.map(Arc::new),
        lifecycle: Lifecycle::new(metrics.open_requests.clone()),
        proxy_id: crate::upstreams::peers::process_id(),
        metrics,
    };
    let generation = Generation::start(cfg.clone(), &shared, None)?;
    shared.keys.set(generation.keys.clone());
    let tls = tls_acceptor(&cfg)?;

    let bind = |addr: String| async move {
        tokio::net::TcpListener::bind(&addr)
            .await
            .map_err(|error| ServeError::Bind { addr, error })
    };
    let listener = bind(cfg.listen.clone()).await?;
    let admin_listener = bind(cfg.admin_listen.clone()).await?;
    let local = |l: &tokio::net::TcpListener, addr: &str| {
        l.local_addr().map_err(|error| ServeError::Bind {
            addr: addr.to_owned(),
            error,
        })
    };
    let addr = local(&listener, &cfg.listen)?;
    let admin_addr = local(&admin_listener, &cfg.admin_listen)?;

    let (live, live_rx) = watch::channel(generation.live.clone());
    let (stop, stop_rx) = watch::channel(false);
    let mut tasks = Vec::new();
    // A new connection's first header (or TLS handshake) and every later request's header are
    // held to the same deadline, and a kept-alive connection to an idle limit between requests.
    let limits = ConnLimits {
        header: Duration::from_millis(cfg.timeouts.header_read_ms),
        keepalive: Duration::from_millis(cfg.timeouts.keepalive_ms),
        first_header_bytes: cfg.limits.max_header_bytes as usize + 8192,
        slow_headers: shared.metrics.slow_headers_closed.clone(),
        draining: shared.lifecycle.drain_started(),
    };
    // Listening stops on its own signal: a draining proxy still runs everything else.
    let (accept_stop, accept_rx) = watch::channel(false);
    tasks.push(tokio::spawn(accept_loop(
        listener,
        live_rx.clone(),
        limits,
        tls,
        accept_rx,
    )));
    let admin = admin_router(
        shared.lifecycle.clone(),
        shared.metrics.clone(),
        shared.stats.clone(),
        shared.shadow_stats.clone(),
        shared.proxy_id,
        live_rx,
    );
    let mut admin_stop = stop_rx;
    let admin_lifetime = Duration::from_millis(cfg.timeouts.keepalive_ms);
    tasks.push(tokio::spawn(async move {
        let admin = admin.into_make_service_with_connect_info::<PeerAddr>();
        // Each admin connection lives at most `timeouts.keepalive_ms`: a scraper reconnects
        // (cheaply), and an idle or trickling client cannot hold file descriptors the data plane
        // shares. The server has no header or idle timeout of its own to set.
        let admin_listener = AdminListener {
            inner: admin_listener,
            lifetime: admin_lifetime,
        };
        let _ = axum::serve(admin_listener, admin)
            .with_graceful_shutdown(async move {
                let _ = admin_stop.wait_for(|s| *s).await;
            })
            .await;
    }));

    Ok(ServeHandle {
        addr,
        admin_addr,
        metrics: shared.metrics,
        stats: shared.stats,
        shadow_stats: shared.shadow_stats,
        capture: shared.capture,
        lifecycle: shared.lifecycle,
        proxy_id: shared.proxy_id,
        keys: shared.keys,
        live,
        generation,
        accept_stop,
        stop,
        tasks,
    })
}

impl Generation {
    /// Builds everything `cfg` describes and starts its background loops. After a reload
    /// (`previous`: the config serving until now), each replica the two configs share keeps its
    /// state ([`Fleet::carry_from`]), and the approximate prefix index keeps its history when
    /// requests are hashed the same way.
    fn start(
        cfg: Arc<ServeConfig>,
        shared: &Shared,
        previous: Option<&Generation>,
    ) -> Result<Self, ServeError> {
        set_up_pingora_timers(&cfg);
        let mut fleet =
            Fleet::new(&cfg.backends, cfg.health.clone()).map_err(ServeError::Config)?;
        // The replicas both configs name (old id, new id): everything carried over follows them.
        let pairs = previous.map_or_else(Vec::new, |p| fleet.same_replicas(&p.live.fleet));
        if let Some(p) = previous {
            fleet.carry_from(&p.live.fleet, &pairs);
        }
        fleet.count_foreign = cfg.routing.foreign_load;
        fleet.pools = crate::app::PoolPlan::all(&cfg)
            .iter()
            .map(|p| (0..p.members.len()).filter(|&i| p.members[i]).collect())
            .collect();
        let peers = (!cfg.peers.addresses.is_empty()).then(|| {
            Arc::new(
                Peers::new(
                    shared.proxy_id,
                    fleet.backends.iter().map(|b| b.url.clone()).collect(),
                    Duration::from_millis(cfg.peers.expire_ms),
                )
                // Validated as set when the config was read.
                .with_token(
                    cfg.peers
                        .token_env
                        .as_ref()
                        .and_then(|v| std::env::var(v).ok()),
                )
                .from_any_address(cfg.peers.any_address),
            )
        });
        if let (Some(p), Some(new)) = (previous, &peers) {
            if let Some(old) = &p.live.fleet.peers {
                new.carry_from(old, &pairs);
            }
        }
        fleet.peers = peers.clone();
        let fleet = Arc::new(fleet);
        let (policy, kv_index) = build_policy(&cfg);
        if let (Some(p), Some(new)) = (previous, &kv_index) {
            carry_events(p, &pairs, &cfg, new);
        }
        // Before any loop of this config starts: a restart the first scrape or event finds must
        // forget what was carried, not be overwritten by it.
        if let Some(p) = previous {
            carry_history(p, &pairs, &cfg, policy.as_ref());
        }
        let index_policy = policy.clone();
        let metrics = &shared.metrics;
        let a = &cfg.admission;
        let admission = a.enabled.then(|| {
            Admission::new(
                cfg.backends.len(),
                a.max_in_flight,
                CapParams {
                    beta: a.beta,
                    soft_beta: a.soft_beta,
                    alpha: a.alpha,
                    kv_high: a.kv_high,
                    kv_raise_below: a.kv_raise_below,
                    cooldown: a.cooldown_scrapes,
                    min_cap: a.min_cap,
                    max_cap: a.max_cap,
                },
                Duration::from_millis(a.lifo_after_ms),
            )
        });
        // Configured caps are capacities from the start; derived ones follow each scrape; without
        // admission there is none (a replica's state may come from a config that had one).
        let caps = admission.as_ref().map(|a| a.slots()).unwrap_or_default();
        for b in &fleet.backends {
            b.set_capacity(caps.get(b.id).and_then(|(cap, _)| *cap));
        }
        let (connector, http) = match previous {
            Some(p) if clients_carry_over(&p.cfg, &cfg) => {
                (p.live.app.connector.clone(), p.live.app.http.clone())
            }
            _ => upstream_clients(&cfg)?,
        };
        let inspect = inspect_config(&cfg)?;
        let recorder = Arc::new(crate::record::Recorder {
            metrics: metrics.clone(),
            stats: shared.stats.clone(),
            shadow_stats: shared.shadow_stats.clone(),
            capture: shared.capture.clone(),
            cfg: cfg.clone(),
            inspect: inspect.clone(),
        });
        let pools = crate::app::PoolPlan::all(&cfg);
        let shadows = crate::shadow::Shadows::new(
            &cfg,
            &pools,
            fleet.clone(),
            policy.clone(),
            http.clone(),
            recorder.clone(),
            inspect.block_tokens,
        );
        let keys = crate::auth::Keys::from_config(&cfg.security)
            .map_err(|e| ServeError::Config(e.to_string()))?
            .map(Arc::new);
        let retired = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let h1_pool = Arc::new(crate::upstreams::h1::Pool::new(
            metrics.upstream_stale_connections.clone(),
        ));
        let headroom = Headroom {
            lifecycle: shared.lifecycle.clone(),
            retired: retired.clone(),
            retry_budget: crate::retry_budget::RetryBudget::new(
                cfg.limits.retry_budget_ratio,
                cfg.limits.retry_budget_min,
            ),
            fleet: fleet.clone(),
            policy: policy.clone(),
            passthrough: LeastLoad,
            metrics: metrics.clone(),
            connector,
            h1_pool: h1_pool.clone(),
            cfg: cfg.clone(),
            inspect,
            inspect_slots: Arc::new(tokio::sync::Semaphore::new(
                std::thread::available_parallelism().map_or(1, usize::from),
            )),
            http: http.clone(),
            recorder,
            shadows: shadows.clone(),
            capture: shared.capture.clone(),
            admission: admission.clone(),
            pools,
            keys: shared.keys.clone(),
            headers: crate::forward::HeaderRules {
                keys: shared.keys.clone(),
                trust_forwarded: cfg.security.trust_forwarded_headers,
                proto: if cfg.tls.cert.is_some() {
                    "https"
                } else {
                    "http"
                },
                class_header: cfg.measure.class_header.to_ascii_lowercase(),
            },
        };
        let app = Arc::new(headroom);

        let (stop, stop_rx) = watch::channel(false);
        let scrapes_held = Arc::new(std::sync::RwLock::new(false));
        let mut tasks = Vec::new();
        tasks.push(tokio::spawn(sweep_loop(h1_pool, stop_rx.clone())));
        if let Some(index) = &kv_index {
            for (id, b) in cfg.backends.iter().enumerate() {
                let Some(endpoint) = &b.kv_events else {
                    continue;
                };
                let src = EventSource {
                    id,
                    name: b.display_name(),
                    endpoint: endpoint.clone(),
                    replay: b.kv_events_replay.clone(),
                    topic: cfg.kv_events.topic.clone(),
                    replay_timeout: Duration::from_millis(cfg.kv_events.replay_timeout_ms),
                    policy: policy.clone(),
                };
                tasks.push(tokio::spawn(subscribe_loop(
                    src,
                    index.clone(),
                    metrics.clone(),
                    stop_rx.clone(),
                )));
            }
        }
        // A replica back in service takes the requests queued while it was out at once, not
        // after the next release elsewhere; one out of service lets go of those waiting for it
        // alone.
        let routable_admission = admission.clone();
        let on_routable: OnRoutable = Arc::new(move |b, routable| {
            tracing::debug!(backend = %b.name, routable, "replica's routability changed");
            match &routable_admission {
                Some(adm) if routable => adm.replica_back(b.id),
                Some(adm) => adm.replica_out(b.id),
                None => {}
            }
        });
        tasks.push(tokio::spawn(probe_loop(
            fleet.clone(),
            cfg.health.clone(),
            http.clone(),
            on_routable,
            stop_rx.clone(),
        )));
        if let Some(peers) = peers {
            let polls = metrics.peer_polls.clone();
            let on_poll: OnPoll = Arc::new(move |heeded| {
                let result = heeded.map_or("failed", Heeded::result);
                polls.with_label_values(&[result]).inc();
            });
            let pushes = metrics.peer_pushes.clone();
            let on_push: OnPush = Arc::new(move |pushed| {
                pushes.with_label_values(&["sent", pushed.result()]).inc();
            });
            tasks.push(tokio::spawn(push_loop(
                peers.clone(),
                fleet.clone(),
                shared.proxy_id,
                cfg.peers.clone(),
                http.clone(),
                on_push,
                stop_rx.clone(),
            )));
            tasks.push(tokio::spawn(poll_loop(
                peers,
                cfg.peers.clone(),
                http.clone(),
                on_poll,
                stop_rx.clone(),
            )));
        }
        let block_tokens = u64::from(cfg.routing.block_tokens);
        let sized_by_config = cfg.routing.index_blocks.is_some();
        let scrape_metrics = metrics.clone();
        let scrape_admission = admission.clone();
        let (plan_context, plan_headroom, learn_context, token_budget) = (
            f64::from(cfg.admission.context_tokens),
            cfg.admission.headroom,
            cfg.admission.learn_context,
            cfg.admission.token_budget,
        );
        let count_change = {
            let metrics = metrics.clone();
            move |b: &Backend, change: Change, reason: &str| {
                let direction = match change {
                    Change::Raised => "raised",
                    Change::Cut => "cut",
                    Change::Held => return,
                };
                metrics
                    .cap_changes
                    .with_label_values(&[&b.name, direction, reason])
                    .inc();
            }
        };
        let on_scrape: OnScrape = Arc::new(move |b, g, restarted| {
            scrape_metrics.engine_scraped(b, g, restarted);
            if restarted {
                policy.forget(b.id);
            }
            if !sized_by_config {
                if let Some(tokens) = g.kv_capacity_tokens() {
                    policy.set_capacity(b.id, (tokens / block_tokens) as usize);
                }
            }
            if let Some(adm) = &scrape_admission {
                if let Some(tokens) = g.kv_capacity_tokens() {
                    // The capacity note's cap, for the context the replica's requests take.
                    let context = adm.context(b.id, plan_context, learn_context);
                    let change = adm.replan(
                        b.id,
                        crate::admission::context::plan(plan_headroom, tokens, context),
                    );
                    count_change(b, change, "context");
                    if token_budget {
                        adm.set_token_budget(b.id, Some((plan_headroom * tokens as f64) as u64));
                    }
                }
                let change = adm.on_feedback(
                    b.id,
                    Feedback {
                        preemptions_total: g.preemptions_total,
                        kv_usage: g.kv_usage,
                        waiting: g.waiting,
                        running: g.running,
                    },
                );
                b.set_capacity(adm.slots().get(b.id).and_then(|(cap, _)| *cap));
                count_change(b, change, "feedback");
            }
        });
        tasks.push(tokio::spawn(scrape_loop(
            fleet.clone(),
            cfg.scrape.clone(),
            http,
            on_scrape,
            scrapes_held.clone(),
            stop_rx,
        )));
        Ok(Self {
            keys,
            cfg: cfg.clone(),
            live: Live {
                cfg,
                app,
                policy: index_policy,
                fleet,
                admission,
                kv_index,
                shadows,
            },
            retired,
            scrapes_held,
            stop,
            tasks,
        })
    }

    /// Replaced by a newer config: its keep-alive connections close after their current
    /// response, and its background loops stop (requests in progress finish on it).
    fn retire(self) {
        self.retired
            .store(true, std::sync::atomic::Ordering::Release);
        let _ = self.stop.send(true);
    }
}

/// Closes idle upstream connections past their idle time, once a second, until `stop`.
async fn sweep_loop(pool: Arc<crate::upstreams::h1::Pool>, mut stop: watch::Receiver<bool>) {
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    loop {
        tokio::select! {
            _ = tick.tick() => pool.sweep(),
            _ = stop.changed() => return,
        }
    }
}

/// Whether a reload from `old` to `new` keeps the clients it has (the replicas' TLS connector, the
/// probes' and scrapes' HTTP client): building them parses the system's CA bundle, 5–10 ms of the
/// reloading worker's time, during which the streams it relays wait. Only when they would come
/// out the same: the same pool settings, a connector needed by both or neither, and no
/// certificate files named (a reload reads those again, so a rotated certificate is taken).
fn clients_carry_over(old: &ServeConfig, new: &ServeConfig) -> bool {
    let u = &new.upstream_tls;
    let names_files = u.ca.is_some() || u.cert.is_some() || u.key.is_some();
    old.upstream_tls == *u
        && !names_files
        && old.timeouts.pool_idle_ms == new.timeouts.pool_idle_ms
        && needs_tls_connector(old) == needs_tls_connector(new)
}

/// Whether the config names a replica reached over TLS (the only ones pingora's connector serves).
fn needs_tls_connector(cfg: &ServeConfig) -> bool {
    cfg.backends.iter().any(|b| b.tls())
}

/// The data plane's connector and the HTTP client of probes and scrapes, both trusting
/// `[upstream_tls] ca` (else the system's roots) for `https://` replicas and presenting its client
/// certificate when one is set. The files are read here, so a bad one is refused with its reason.
/// The connector only when a replica is reached over TLS: the plaintext ones go through
/// headroom's own client, and building it parses the CA bundle twice (5–9 ms of CPU at each start
/// and reload of a release build, about 60 ms of a debug build's).
fn upstream_clients(
    cfg: &ServeConfig,
) -> Result<(Option<Arc<Connector>>, reqwest::Client), ServeError> {
    let u = &cfg.upstream_tls;
    let bad = |why: String| ServeError::Config(format!("upstream_tls: {why}"));
    let read = |path: &str| std::fs::read(path).map_err(|e| bad(format!("reading {path}: {e}")));
    // Probes and scrapes let an idle connection go when the data plane does, before the engine's
    // own keep-alive timeout closes it under a probe (a probe interval above that timeout would
    // otherwise race the engine's close and fail now and then, counting toward unhealthy).
    let mut http = reqwest::Client::builder()
        .use_rustls_tls()
        .pool_idle_timeout(Duration::from_millis(cfg.timeouts.pool_idle_ms));
    let mut options = ConnectorOptions::new(CONNECTION_POOL_SIZE);
    if let Some(ca) = &u.ca {
        pingora::tls::install_default_crypto_provider();
        let mut store = pingora::tls::RootCertStore::empty();
        pingora::tls::load_ca_file_into_store(ca, &mut store)
            .map_err(|e| bad(format!("{ca} is not a PEM file of CA certificates: {e}")))?;
        if store.is_empty() {
            return Err(bad(format!("{ca} holds no certificate")));
        }
        let roots = reqwest::Certificate::from_pem_bundle(&read(ca)?)
            .map_err(|e| bad(format!("{ca}: {e}")))?;
        http = http.tls_built_in_root_certs(false);
        for root in roots {
            http = http.add_root_certificate(root);
        }
        options.ca_file = Some(ca.clone());
    }
    if let (Some(cert), Some(key)) = (&u.cert, &u.key) {
        pingora::tls::load_certs_and_key_files(cert, key)
            .map_err(|e| bad(format!("reading {cert} and {key}: {e}")))?
            .ok_or_else(|| {
                bad(format!(
                    "{cert} holds no certificate or {key} no private key"
                ))
            })?;
        let mut pem = read(cert)?;
        pem.push(b'\n');
        pem.extend(read(key)?);
        let identity =
            reqwest::Identity::from_pem(&pem).map_err(|e| bad(format!("{cert} and {key}: {e}")))?;
        http = http.identity(identity);
        options.cert_key_file = Some((cert.clone(), key.clone()));
    }
    let http = http
        .build()
        .map_err(|e| ServeError::Config(format!("http client: {e}")))?;
    let connector = needs_tls_connector(cfg).then(|| Arc::new(Connector::new(Some(options))));
    Ok((connector, http))
}

/// Idle upstream connections kept for reuse (pingora's default).
const CONNECTION_POOL_SIZE: usize = 128;

/// The TLS acceptor of `[tls]`, when configured (rustls: TLS 1.2 and 1.3, HTTP/1.1).
fn tls_acceptor(cfg: &ServeConfig) -> Result<Option<Arc<TlsAcceptor>>, ServeError> {
    let (Some(cert), Some(key)) = (&cfg.tls.cert, &cfg.tls.key) else {
        return Ok(None);
    };
    let bad = |why: String| ServeError::Config(format!("tls: {why}"));
    let (chain, private) = pingora::tls::load_certs_and_key_files(cert, key)
        .map_err(|e| bad(format!("reading {cert} and {key}: {e}")))?
        .ok_or_else(|| {
            bad(format!(
                "{cert} holds no certificate or {key} no private key"
            ))
        })?;
    pingora::tls::install_default_crypto_provider();
    let mut server = pingora::tls::ServerConfig::builder_with_protocol_versions(&[
        &pingora::tls::version::TLS12,
        &pingora::tls::version::TLS13,
    ])
    .with_no_client_auth()
    .with_single_cert(chain, private)
    .map_err(|e| bad(format!("{cert} and {key} do not make a certificate: {e}")))?;
    server.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Some(Arc::new(TlsAcceptor::from_server_config(Arc::new(
        server,
    )))))
}

async fn accept_loop(
    listener: tokio::net::TcpListener,
    live: watch::Receiver<Live>,
    limits: ConnLimits,
    tls: Option<Arc<TlsAcceptor>>,
    mut stop: watch::Receiver<bool>,
) {
    loop {
        let (tcp, peer) = tokio::select! {
            r = listener.accept() => match r {
                Ok(c) => c,
                Err(e) => {
                    // Out of file descriptors and the like: back off instead of spinning.
                    tracing::warn!("accept failed: {e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            // The flag only ever turns true.
            _ = stop.changed() => return,
        };
        let _ = tcp.set_nodelay(true);
        // The config now serving takes the connection (after a reload, the new one).
        let app = live.borrow().app.clone();
        let (shutdown, limits, tls) = (stop.clone(), limits.clone(), tls.clone());
        tokio::spawn(async move {
            use pingora::protocols::{GetSocketDigest, SocketDigest};
            use std::os::fd::AsRawFd;
            // Plaintext: the first header must be read within the budget (and is replayed).
            // TLS: the handshake must finish within it (the header is not readable before).
            let conn = match &tls {
                None => {
                    let mut tcp = tcp;
                    let Some(first) = limits.read_first_header(&mut tcp).await else {
                        return;
                    };
                    ClientConn::plain(tcp, peer, limits, first)
                }
                Some(acceptor) => {
                    let mut stream = pingora::protocols::l4::stream::Stream::from(tcp);
                    // The client's address (X-Forwarded-For) is read from the socket when first
                    // asked.
                    stream.set_socket_digest(SocketDigest::from_raw_fd(stream.as_raw_fd()));
                    let shake = acceptor.tls_handshake(stream);
                    match tokio::time::timeout(limits.header, shake).await {
                        Ok(Ok(s)) => ClientConn::new(Box::new(s), limits, true),
                        Ok(Err(e)) => {
                            tracing::debug!("TLS handshake failed: {e}");
                            return;
                        }
                        Err(_) => {
                            limits.slow_headers.inc();
                            return;
                        }
                    }
                }
            };
            app.serve_connection(Box::new(conn), &shutdown).await;
        });
    }
}

/// The admin listener: every connection it accepts ends after `lifetime` (it then reads as
/// closed by the client, and the server closes it once).
struct AdminListener {
    inner: tokio::net::TcpListener,
    lifetime: Duration,
}

impl axum::serve::Listener for AdminListener {
    type Io = LimitedLife;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        let (io, addr) = axum::serve::Listener::accept(&mut self.inner).await;
        let end = Box::pin(tokio::time::sleep(self.lifetime));
        (LimitedLife { io, end }, addr)
    }

    fn local_addr(&self) -> std::io::Result<Self::Addr> {
        self.inner.local_addr()
    }
}

/// An admin client's address, for the push check.
#[derive(Debug, Clone, Copy)]
struct PeerAddr(SocketAddr);

impl axum::extract::connect_info::Connected<axum::serve::IncomingStream<'_, AdminListener>>
    for PeerAddr
{
    fn connect_info(stream: axum::serve::IncomingStream<'_, AdminListener>) -> Self {
        Self(*stream.remote_addr())
    }
}

/// A connection that reads as ended once its time is up.
struct LimitedLife {
    io: tokio::net::TcpStream,
    end: std::pin::Pin<Box<tokio::time::Sleep>>,
}

impl tokio::io::AsyncRead for LimitedLife {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        use std::future::Future;
        use std::task::Poll;
        if self.end.as_mut().poll(cx).is_ready() {
            return Poll::Ready(Ok(()));
        }
        std::pin::Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl tokio::io::AsyncWrite for LimitedLife {
    fn poll_write(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        std::pin::Pin::new(&mut self.io).poll_write(cx, buf)
    }

    fn poll_flush(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

/// The largest push taken: a report is ~100 bytes per replica.
const PUSH_BODY_LIMIT: usize = 64 * 1024;

/// What the admin listener answers a push it does not take: the status, the `result` label, and
/// what to tell the sender.
type PushAnswer = (StatusCode, &'static str, Option<&'static str>);

/// Whether a peer's push (`POST /peers/load`) may be taken, from its sender and headers alone:
/// decided before a byte of its body is read.
fn admit_push<'a>(
    peers: Option<&'a Peers>,
    from: SocketAddr,
    headers: &http::HeaderMap,
) -> Result<&'a Peers, PushAnswer> {
    let Some(peers) = peers else {
        return Err((
            StatusCode::NOT_FOUND,
            "refused",
            Some("this proxy has no [peers]"),
        ));
    };
    let authorization = headers
        .get(http::header::AUTHORIZATION)
        .map(|v| v.as_bytes());
    match peers.may_push(from.ip(), authorization) {
        Ok(()) => Ok(peers),
        Err(PushRefused::Unknown) => Err((
            StatusCode::FORBIDDEN,
            "unknown",
            Some(
                "pushes are taken from the addresses of peers.addresses only (behind a service \
                 mesh: peers.token_env and peers.any_address)",
            ),
        )),
        Err(PushRefused::Unauthorized) => Err((
            StatusCode::UNAUTHORIZED,
            "unauthorized",
            Some("a push needs the peers' shared secret (peers.token_env)"),
        )),
    }
}

/// Takes an admitted push's body (at most [`PUSH_BODY_LIMIT`] bytes) as a report.
async fn take_push(peers: &Peers, from: SocketAddr, body: axum::body::Body) -> PushAnswer {
    let Ok(body) = axum::body::to_bytes(body, PUSH_BODY_LIMIT).await else {
        return (
            StatusCode::PAYLOAD_TOO_LARGE,
            "invalid",
            Some("a load report is at most 64 KiB"),
        );
    };
    match serde_json::from_slice::<LoadReport>(&body) {
        Ok(report) => {
            let heeded = peers.heard(from, &report, std::time::Instant::now());
            (StatusCode::NO_CONTENT, heeded.result(), None)
        }
        Err(_) => (
            StatusCode::BAD_REQUEST,
            "invalid",
            Some("the body is not a load report"),
        ),
    }
}

fn admin_router(
    lifecycle: Arc<Lifecycle>,
    metrics: Arc<Metrics>,
    stats: Arc<Stats>,
    shadow_stats: Arc<Stats>,
    proxy_id: u64,
    live: watch::Receiver<Live>,
) -> Router {
    let (ready_live, metrics_live, peers_live) = (live.clone(), live.clone(), live.clone());
    let pushed_live = live.clone();
    let pushes = metrics.peer_pushes.clone();
    let stats_metrics = metrics.clone();
    let metrics_stats = stats.clone();
    Router::new()
        .route(
            "/stats",
            get(move || {
                let (metrics, stats) = (stats_metrics.clone(), stats.clone());
                let shadow_stats = shadow_stats.clone();
                let Live {
                    cfg,
                    fleet,
                    admission,
                    kv_index: kv,
                    shadows,
                    ..
                } = live.borrow().clone();
                async move {
                    let mut backends = metrics.backend_stats(&fleet);
                    let mut queued = serde_json::Value::Null;
                    if let Some(a) = &admission {
                        let snapshot = a.snapshot();
                        for (id, (b, r)) in backends.iter_mut().zip(&snapshot.replicas).enumerate()
                        {
                            let context = a.context(
                                id,
                                f64::from(cfg.admission.context_tokens),
                                cfg.admission.learn_context,
                            );
                            b["admission"] = serde_json::json!({
                                "cap": r.cap,
                                "in_flight": r.admitted,
                                "token_budget": r.token_budget,
                                "tokens_in_flight": r.tokens,
                                "context_tokens": context.round(),
                            });
                        }
                        queued = serde_json::json!(snapshot.queued);
                    }
                    if let Some(kv) = &kv {
                        let ix = kv.lock().unwrap_or_else(|e| e.into_inner());
                        let now = std::time::Instant::now();
                        for (id, b) in backends.iter_mut().enumerate() {
                            let c = ix.counts(id);
                            b["kv_events"] = serde_json::json!({
                                "state": ix.state(id, now).name(),
                                "blocks": ix.held(id),
                                "next_seq": ix.next_seq(id),
                                "batches": c.batches,
                                "gaps": c.gaps,
                                "losses": c.losses,
                                "restarts": c.restarts,
                                "clears": c.clears,
                                "unknown_removals": c.unknown_removals,
                                "sent_blocks_confirmed": c.confirmed,
                                "sent_blocks_expired": c.expired,
                            });
                        }
                    }
                    let now = std::time::Instant::now();
                    let windows = stats.snapshot(now);
                    let cost =
                        crate::telemetry::operator::cost(&cfg.cost, fleet.backends.len(), &windows);
                    let shadow = shadows.map(|s| {
                        serde_json::json!({
                            "pools": s.all().iter().map(|x| x.stats(&metrics)).collect::<Vec<_>>(),
                            "windows": shadow_stats.snapshot(now),
                        })
                    });
                    let peers = fleet.peers.as_ref().map(|p| {
                        let foreign = p.foreign(now);
                        for (b, w) in backends.iter_mut().zip(&foreign) {
                            b["peers"] = serde_json::json!(w);
                        }
                        p.states(now)
                    });
                    axum::Json(serde_json::json!({
                        "windows": windows,
                        "backends": backends,
                        "peers": peers,
                        "pools": crate::telemetry::operator::pools(&cfg, &fleet),
                        "cost": cost,
                        "queued": queued,
                        "shadow": shadow,
                    }))
                }
            }),
        )
        .route(
            "/metrics",
            get(move || {
                let (metrics, stats) = (metrics.clone(), metrics_stats.clone());
                let Live {
                    cfg,
                    fleet,
                    admission,
                    kv_index: kv,
                    policy,
                    ..
                } = metrics_live.borrow().clone();
                async move {
                    metrics.refresh(&fleet);
                    metrics.refresh_pools(&cfg);
                    // The windows are merged only when there is a price to put on them.
                    let cost = cfg.cost.replica_hour.and_then(|_| {
                        let windows = stats.snapshot(std::time::Instant::now());
                        crate::telemetry::operator::cost(&cfg.cost, fleet.backends.len(), &windows)
                    });
                    metrics.refresh_cost(cost);
                    metrics.refresh_index(&fleet, policy.as_ref());
                    metrics.refresh_peers(&fleet);
                    if let Some(kv) = &kv {
                        metrics.refresh_kv_events(
                            &fleet,
                            &kv.lock().unwrap_or_else(|e| e.into_inner()),
                        );
                    }
                    if let Some(a) = &admission {
                        let classes: Vec<&str> = cfg.classes.keys().map(String::as_str).collect();
                        metrics.refresh_admission(&fleet, a, &classes);
                    }
                    (
                        [("content-type", "text/plain; version=0.0.4")],
                        metrics.render(),
                    )
                }
            }),
        )
        .route(
            "/peers/load",
            get(move || {
                let fleet = peers_live.borrow().fleet.clone();
                async move { axum::Json(LoadReport::of(proxy_id, &fleet)) }
            })
            .post(
                move |axum::extract::ConnectInfo(PeerAddr(from)): axum::extract::ConnectInfo<
                    PeerAddr,
                >,
                      headers: http::HeaderMap,
                      body: axum::body::Body| {
                    let peers = pushed_live.borrow().fleet.peers.clone();
                    let pushes = pushes.clone();
                    async move {
                        let (status, result, why) =
                            match admit_push(peers.as_deref(), from, &headers) {
                                Ok(peers) => take_push(peers, from, body).await,
                                Err(refused) => refused,
                            };
                        pushes.with_label_values(&["received", result]).inc();
                        match why {
                            None => status.into_response(),
                            Some(why) => (status, format!("{why}\n")).into_response(),
                        }
                    }
                },
            ),
        )
        .route("/healthz", get(|| async { "ok\n" }))
        .route(
            "/readyz",
            get(move || {
                let (fleet, lifecycle) = (ready_live.borrow().fleet.clone(), lifecycle.clone());
                async move {
                    if lifecycle.draining() {
                        (StatusCode::SERVICE_UNAVAILABLE, "draining\n").into_response()
                    } else if fleet.any_ready() {
                        (StatusCode::OK, "ready\n").into_response()
                    } else {
                        (
                            StatusCode::SERVICE_UNAVAILABLE,
                            "no healthy replica (none has passed a probe yet, or all are down)\n",
                        )
                            .into_response()
                    }
                }
            }),
        )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(backends: &[&str]) -> ServeConfig {
        let urls: Vec<String> = backends.iter().map(|u| (*u).to_owned()).collect();
        ServeConfig::quick("127.0.0.1:0", &urls, "least_load")
    }

    #[test]
    fn a_reload_keeps_its_clients_only_when_they_would_come_out_the_same() {
        let old = config(&["http://10.0.0.1:8000"]);
        // Other replicas, another policy: the same clients.
        let mut new = config(&["http://10.0.0.2:8000", "http://10.0.0.3:8000"]);
        new.routing.policy = "round_robin".into();
        assert!(clients_carry_over(&old, &new));

        let mut idle = old.clone();
        idle.timeouts.pool_idle_ms += 1;
        assert!(!clients_carry_over(&old, &idle));

        // A replica over TLS needs a connector the old config never built, and back.
        let tls = config(&["http://10.0.0.1:8000", "https://10.0.0.4:8443"]);
        assert!(!clients_carry_over(&old, &tls));
        assert!(!clients_carry_over(&tls, &old));
        assert!(clients_carry_over(&tls, &tls.clone()));

        // Certificate files are read again at every reload, unchanged names or not: a rotated
        // certificate is taken.
        let mut ca = tls.clone();
        ca.upstream_tls.ca = Some("/etc/headroom/ca.pem".into());
        assert!(!clients_carry_over(&ca, &ca.clone()));
        assert!(!clients_carry_over(&tls, &ca));
    }
}
