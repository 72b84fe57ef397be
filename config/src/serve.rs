//! `headroom serve` configuration: listeners, backends, routing, health, timeouts, limits,
//! measurement (classes and their SLOs) and trace capture.
//! Every field has a default except the backends; `config/examples/headroom.toml` shows them all.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::{FieldError, Validate, check, field_path};

/// Routing policy names accepted in config and on the command line.
pub const POLICIES: &[&str] = &[
    "round_robin",
    "least_load",
    "session",
    "consistent_hash",
    "prefix_affinity",
    "kv_events",
];

/// The whole `headroom serve` config.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ServeConfig {
    /// Address the proxy listens on.
    #[serde(default = "default_listen")]
    pub listen: String,
    /// Address of the admin listener (`/metrics`, `/healthz`, `/readyz`); loopback by default.
    #[serde(default = "default_admin_listen")]
    pub admin_listen: String,
    /// The replicas (at least one; `headroom serve --backends` gives them instead, and then a file
    /// may leave them out).
    #[serde(default)]
    pub backends: Vec<BackendConfig>,
    /// How a replica is picked.
    #[serde(default)]
    pub routing: RoutingConfig,
    /// Active health checks and passive ejection.
    #[serde(default)]
    pub health: HealthConfig,
    /// Engine metrics scraping.
    #[serde(default)]
    pub scrape: ScrapeConfig,
    /// Other proxies in front of the same replicas, whose work in flight routing counts.
    #[serde(default)]
    pub peers: PeersConfig,
    /// Timeouts.
    #[serde(default)]
    pub timeouts: TimeoutConfig,
    /// Request limits and retries.
    #[serde(default)]
    pub limits: LimitConfig,
    /// Passive measurement.
    #[serde(default)]
    pub measure: MeasureConfig,
    /// Traffic classes by name, with their latency objectives.
    #[serde(default = "default_classes")]
    pub classes: BTreeMap<String, ClassConfig>,
    /// Recording every request as a trace.
    #[serde(default)]
    pub capture: CaptureConfig,
    /// Per-replica caps and the queue at the proxy.
    #[serde(default)]
    pub admission: AdmissionConfig,
    /// Replica pools; absent, one pool `default` holds every backend.
    #[serde(default)]
    pub pools: Vec<PoolConfig>,
    /// Listening to the engines' KV events (the `kv_events` policy).
    #[serde(default)]
    pub kv_events: KvEventsConfig,
    /// Who may use the proxy, and which client headers are trusted.
    #[serde(default)]
    pub security: SecurityConfig,
    /// What a terminating proxy does (SIGTERM).
    #[serde(default)]
    pub shutdown: ShutdownConfig,
    /// Logging.
    #[serde(default)]
    pub log: LogConfig,
    /// TLS on the client listener.
    #[serde(default)]
    pub tls: TlsConfig,
    /// TLS to `https://` backends.
    #[serde(default)]
    pub upstream_tls: UpstreamTlsConfig,
    /// Prices, for the cost per million tokens in `/stats`.
    #[serde(default)]
    pub cost: CostConfig,
}

/// TLS on the client listener (rustls; TLS 1.2 and 1.3, HTTP/1.1). Both files or neither.
#[derive(Debug, Clone, PartialEq, Default, Deserialize, Serialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct TlsConfig {
    /// PEM certificate chain, leaf first.
    pub cert: Option<String>,
    /// PEM private key (PKCS#8, PKCS#1 or SEC1).
    pub key: Option<String>,
}

/// TLS to replicas whose URL is `https://` (rustls; TLS 1.2 and 1.3): the replica's certificate is
/// verified against `ca` (else the system's roots) and must name the URL's host.
#[derive(Debug, Clone, PartialEq, Default, Deserialize, Serialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct UpstreamTlsConfig {
    /// PEM file of the CA certificates that sign the replicas' certificates; absent, the system's
    /// trusted roots (and `SSL_CERT_FILE` / `SSL_CERT_DIR`).
    pub ca: Option<String>,
    /// PEM client certificate chain presented to the replicas (mutual TLS); with `key`.
    pub cert: Option<String>,
    /// PEM private key of `cert`.
    pub key: Option<String>,
}

/// What the fleet costs, in any one currency: `/stats` turns it into a cost per million tokens at
/// the measured throughput, beside a managed API's price.
#[derive(Debug, Clone, PartialEq, Default, Deserialize, Serialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct CostConfig {
    /// Price of one replica for an hour (its GPUs and host).
    pub replica_hour: Option<f64>,
    /// A managed API's price per million tokens (prompt and output), for comparison.
    pub managed_per_million_tokens: Option<f64>,
}

/// Logging (the format, text or JSON, is the `--log-format` flag, since it applies from the
/// first line).
#[derive(Debug, Clone, PartialEq, Default, Deserialize, Serialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct LogConfig {
    /// One line per request (target `headroom::access`): request id, route, status, backend,
    /// pool, class, key name, the proxy's own error reason and duration. Never prompt text.
    pub access: bool,
}

/// Draining at SIGTERM: announce, keep serving, then let open requests finish.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct ShutdownConfig {
    /// After SIGTERM the proxy keeps accepting (no request is refused) while `/readyz` answers
    /// 503, keep-alive connections are closed after each response and idle ones at once, so load
    /// balancers and clients take it out of rotation; then it stops listening.
    pub drain_ms: u64,
    /// Then open requests (streams included) get this long to finish before the proxy exits.
    pub grace_ms: u64,
}

impl Default for ShutdownConfig {
    fn default() -> Self {
        // Together within Kubernetes' default terminationGracePeriodSeconds (30 s).
        Self {
            drain_ms: 5_000,
            grace_ms: 20_000,
        }
    }
}

/// Client authentication and the treatment of client-supplied forwarding headers.
#[derive(Debug, Clone, PartialEq, Default, Deserialize, Serialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct SecurityConfig {
    /// API keys clients present as `Authorization: Bearer KEY`; none configured means no key is
    /// asked for (and the client's `Authorization` passes through to the engine).
    pub api_keys: Vec<ApiKeyConfig>,
    /// Keep the client's `X-Forwarded-*`, `Forwarded` and `X-Real-IP` headers (extending
    /// `X-Forwarded-For`); only behind a load balancer that sets them itself.
    pub trust_forwarded_headers: bool,
}

/// One client API key. The config holds its SHA-256 digest or the name of the environment
/// variable that holds it, never the key itself.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ApiKeyConfig {
    /// Name in metrics and logs.
    pub name: String,
    /// Hex SHA-256 of the key (`printf %s "$KEY" | sha256sum`).
    #[serde(default)]
    pub sha256: Option<String>,
    /// Environment variable holding the key.
    #[serde(default)]
    pub env: Option<String>,
    /// Class of every request made with this key (the class header is then ignored).
    #[serde(default)]
    pub class: Option<String>,
    /// Requests per second allowed to this key, on average.
    #[serde(default)]
    pub rate_per_s: Option<f64>,
    /// Requests allowed at once above the average (default: the rate rounded up, at least 1).
    #[serde(default)]
    pub burst: Option<u32>,
}

impl ApiKeyConfig {
    /// The burst the rate limit allows.
    pub fn burst_or_default(&self) -> u32 {
        self.burst
            .unwrap_or_else(|| self.rate_per_s.map_or(1, |r| r.ceil().max(1.0) as u32))
    }
}

/// Whether `s` is 64 hex digits.
fn is_sha256_hex(s: &str) -> bool {
    s.len() == 64 && s.bytes().all(|b| b.is_ascii_hexdigit())
}

/// Checks that the environment variable named `var` is set and not empty.
fn env_is_set(var: &str) -> bool {
    std::env::var(var).is_ok_and(|v| !v.is_empty())
}

/// How the proxy follows the engines' KV cache events.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct KvEventsConfig {
    /// How the engine hashes blocks, so request-side hashes equal the ones it publishes:
    /// `headroom` (headroom's simulator: xxh3 chain seeded with `hash_seed`) or
    /// `vllm_sha256_cbor` (vLLM started with `--prefix-caching-hash-algo sha256_cbor`).
    pub hash: String,
    /// The simulator's `--hash-seed` (`headroom`).
    pub hash_seed: u64,
    /// The vLLM engine's `PYTHONHASHSEED`; absent when unset there (vLLM ≥ 0.29 then uses a fixed
    /// default; older versions draw a random one that cannot be matched).
    pub python_hash_seed: Option<String>,
    /// How vLLM keys `cache_salt` into the first block: `tagged` (vLLM ≥ 0.31) or `plain`
    /// (0.10.2–0.30).
    pub salt_keys: String,
    /// The model's `tokenizer.json` (`vllm_sha256_cbor`); `tokenizer_config.json` beside it gives
    /// the chat template and special tokens.
    pub tokenizer: Option<String>,
    /// The chat template the engine uses, when not the tokenizer's own (its `--chat-template`).
    pub chat_template: Option<String>,
    /// Topic prefix subscribed to (the engine's `topic`; empty takes every message).
    pub topic: String,
    /// How long a sent request's new blocks count as held before the engine reports them.
    pub pending_ttl_ms: u64,
    /// How long an expected event may be missing before a replica's stream is distrusted.
    pub stale_after_ms: u64,
    /// How long a replay request may take.
    pub replay_timeout_ms: u64,
}

/// Block hash schemes the proxy can compute the way the engine does.
pub const KV_HASHES: &[&str] = &["headroom", "vllm_sha256_cbor"];

impl Default for KvEventsConfig {
    fn default() -> Self {
        Self {
            hash: "headroom".into(),
            hash_seed: 0,
            python_hash_seed: None,
            salt_keys: "tagged".into(),
            tokenizer: None,
            chat_template: None,
            topic: String::new(),
            pending_ttl_ms: 10_000,
            stale_after_ms: 5_000,
            replay_timeout_ms: 2_000,
        }
    }
}

/// A set of replicas that serves its own classes.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct PoolConfig {
    /// Name in metrics and in `classes.NAME.pool`.
    pub name: String,
    /// Backend names (`backends[].name`, else `host:port`).
    pub backends: Vec<String>,
    /// Pools whose idle capacity requests of this pool may use (they are the first refused there).
    #[serde(default)]
    pub borrow: Vec<String>,
    /// A borrowed replica is used only while its admitted requests are below this fraction of its
    /// cap, so the owner keeps a reserved floor.
    #[serde(default = "default_borrow_below")]
    pub borrow_below: f64,
    /// Mirror a share of this pool's requests to a candidate pool (the client only ever gets this
    /// pool's answer).
    #[serde(default)]
    pub shadow: Option<ShadowConfig>,
}

fn default_borrow_below() -> f64 {
    0.5
}

/// Live shadowing of a pool's traffic to a candidate pool: the copies are sent off the request
/// path, bounded, measured with `shadow="true"`, compared with the primary's output when sampling
/// is deterministic, and discarded.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ShadowConfig {
    /// The candidate pool that receives the copies (it serves no class of its own).
    pub pool: String,
    /// Share of requests mirrored, in (0, 1]; chosen by request id, so proxies agree.
    #[serde(default = "default_shadow_fraction")]
    pub fraction: f64,
    /// Copies in flight at once.
    #[serde(default = "default_shadow_in_flight")]
    pub max_in_flight: u32,
    /// Copies waiting for a slot; one more is dropped (`busy`).
    #[serde(default = "default_shadow_in_flight")]
    pub max_queue: u32,
    /// A copy that waited this long for a slot is dropped (`late`), ms.
    #[serde(default = "default_shadow_wait_ms")]
    pub max_wait_ms: u64,
    /// Compare the outputs of requests with deterministic sampling (temperature 0 or a seed).
    #[serde(default = "default_true")]
    pub compare: bool,
}

fn default_shadow_fraction() -> f64 {
    1.0
}

fn default_shadow_in_flight() -> u32 {
    64
}

fn default_shadow_wait_ms() -> u64 {
    1_000
}

fn default_true() -> bool {
    true
}

/// One replica.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct BackendConfig {
    /// Base URL, `http://host:port` (no path).
    pub url: String,
    /// Name in metrics and logs; the URL's `host:port` when absent.
    #[serde(default)]
    pub name: Option<String>,
    /// The engine's KV event stream (its `--kv-events-config` endpoint as seen from the proxy,
    /// e.g. `tcp://10.0.0.5:5557`), for the `kv_events` policy.
    #[serde(default)]
    pub kv_events: Option<String>,
    /// The engine's replay endpoint (`replay_endpoint`), to fill gaps in the stream.
    #[serde(default)]
    pub kv_events_replay: Option<String>,
    /// Environment variable holding the engine's own `--api-key`: sent to this replica as
    /// `Authorization: Bearer`, in place of whatever the client sent.
    #[serde(default)]
    pub api_key_env: Option<String>,
}

impl BackendConfig {
    /// A replica at `url`, with nothing else configured.
    pub fn at(url: &str) -> Self {
        Self {
            url: url.to_owned(),
            name: None,
            kv_events: None,
            kv_events_replay: None,
            api_key_env: None,
        }
    }

    /// `host:port` of the URL.
    pub fn authority(&self) -> &str {
        self.url
            .strip_prefix("https://")
            .unwrap_or_else(|| self.url.trim_start_matches("http://"))
            .trim_end_matches('/')
    }

    /// Whether the replica is reached over TLS (`https://`).
    pub fn tls(&self) -> bool {
        self.url.starts_with("https://")
    }

    /// The host the replica's certificate must name (the URL's host, without brackets or port).
    pub fn host(&self) -> &str {
        let a = self.authority();
        let host = a.rsplit_once(':').map_or(a, |(h, _)| h);
        host.trim_start_matches('[').trim_end_matches(']')
    }

    /// The backend's name: the configured one, else `host:port`.
    pub fn display_name(&self) -> String {
        self.name
            .clone()
            .unwrap_or_else(|| self.authority().to_owned())
    }
}

/// Routing settings.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct RoutingConfig {
    /// `round_robin`, `least_load`, `session`, `consistent_hash`, `prefix_affinity` or `kv_events`
    /// (docs/routing.md).
    pub policy: String,
    /// Tokens per prefix block (the engine's `--block-size`).
    pub block_tokens: u32,
    /// Prompt tokens hashed at most; longer prompts are routed on their start. The default covers a
    /// 128k-token context whole; raise it to a longer model context (docs/routing.md).
    pub max_hashed_tokens: u32,
    /// Seed mixed into every prefix hash chain.
    pub hash_seed: u64,
    /// Tokens of prefill one decoding sequence is worth in the `prefix_affinity` cost.
    pub decode_weight: f64,
    /// Weight of the prefill a request brings against work already queued (`prefix_affinity`).
    pub recompute_weight: f64,
    /// Replicas whose `prefix_affinity` / `kv_events` cost is within this many tokens of the
    /// cheapest count as equally good, and the request's hash picks among them: several proxies
    /// placing simultaneous requests then spread them instead of all choosing the same replica.
    /// 0: only exact ties (one proxy needs no more).
    pub spread_tokens: u64,
    /// Prefix-index capacity per replica, in blocks; when absent it is read from the replica's
    /// `vllm:cache_config_info` (and unbounded until then).
    pub index_blocks: Option<u64>,
    /// Header whose value is the session key of the `session` policy.
    pub session_header: String,
    /// Count other proxies' work on each replica (its running + waiting gauges minus this
    /// proxy's own in-flight requests at the last scrape) in `least_load`, `prefix_affinity` and
    /// `kv_events`: for several proxies in front of the same replicas.
    pub foreign_load: bool,
}

impl Default for RoutingConfig {
    fn default() -> Self {
        Self {
            policy: "prefix_affinity".into(),
            block_tokens: 16,
            max_hashed_tokens: 131_072,
            hash_seed: 0,
            decode_weight: 8.0,
            recompute_weight: 2.0,
            spread_tokens: 0,
            index_blocks: None,
            session_header: "x-session-id".into(),
            foreign_load: false,
        }
    }
}

/// Health checking and passive ejection.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct HealthConfig {
    /// Path probed on each replica.
    pub path: String,
    /// Time between probes.
    pub interval_ms: u64,
    /// A probe slower than this fails.
    pub timeout_ms: u64,
    /// Consecutive failed probes that mark a replica unhealthy.
    pub unhealthy_after: u32,
    /// Consecutive passed probes that mark it healthy again.
    pub healthy_after: u32,
    /// Consecutive failed requests (connect errors, resets, 5xx; never 4xx) that eject a replica.
    pub eject_after: u32,
    /// How long an ejected replica gets no requests.
    pub eject_ms: u64,
    /// At most this fraction of the fleet, and of each pool, is ejected at once.
    pub max_ejected_fraction: f64,
}

impl Default for HealthConfig {
    fn default() -> Self {
        Self {
            path: "/health".into(),
            interval_ms: 2_000,
            timeout_ms: 1_000,
            unhealthy_after: 2,
            healthy_after: 1,
            eject_after: 3,
            eject_ms: 10_000,
            max_ejected_fraction: 0.5,
        }
    }
}

/// Scraping each replica's `/metrics`.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct ScrapeConfig {
    /// Time between scrapes; 0 turns scraping off (and with it the engine gauges, the prefix
    /// index and admission sized from the KV capacity, and restart detection).
    pub interval_ms: u64,
    /// A scrape slower than this is skipped.
    pub timeout_ms: u64,
}

impl Default for ScrapeConfig {
    fn default() -> Self {
        Self {
            interval_ms: 1_000,
            timeout_ms: 1_000,
        }
    }
}

/// Other `headroom serve` processes in front of the same replicas. Each proxy serves its own work
/// in flight per replica (requests, uncached prefill tokens not yet done, sequences decoding) on
/// its admin listener at `/peers/load`, pushes it to every peer when it changes, and polls every
/// peer's; routing adds the peers' work to its own (docs/routing.md, "Several proxies"). Every proxy needs the same backend URLs, and its
/// admin listener reachable by the others.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct PeersConfig {
    /// The other proxies' admin listeners, `host:port`. A name that resolves to several addresses
    /// (a Kubernetes headless Service) means all of them; this proxy's own address may be listed
    /// (it recognises itself and skips it). Empty: no peers.
    pub addresses: Vec<String>,
    /// Time between polls of every peer.
    pub interval_ms: u64,
    /// After its own work changes (a request sent, a first token, a request done) a proxy pushes
    /// its report to every peer at once, then at most once per this many milliseconds while
    /// changes continue. 0: this proxy pushes nothing, and its peers see its new work up to
    /// `interval_ms` late (it still takes their pushes).
    pub push_interval_ms: u64,
    /// A poll or a push slower than this fails.
    pub timeout_ms: u64,
    /// A peer not heard from for this long no longer counts (it stopped, or cannot be reached).
    pub expire_ms: u64,
    /// The environment variable holding a secret the proxies share: pushes carry it
    /// (`Authorization: Bearer`, in the clear: use it on a network you trust) and a push without
    /// it is refused. Pushes are taken only from the addresses the peers' names resolve to, with
    /// or without it, unless `any_address` is set.
    pub token_env: Option<String>,
    /// Take pushes that carry the secret (`token_env`, required) from any address: for a
    /// service mesh, which rewrites source addresses so that every push would otherwise be
    /// refused. The secret then identifies a peer on its own: use it where the secret cannot be
    /// read off the wire (the mesh's mutual TLS).
    pub any_address: bool,
}

impl Default for PeersConfig {
    fn default() -> Self {
        Self {
            addresses: Vec::new(),
            interval_ms: 100,
            push_interval_ms: 5,
            timeout_ms: 250,
            expire_ms: 1_000,
            token_env: None,
            any_address: false,
        }
    }
}

/// Timeouts that suit streaming: a long generation is fine, a silent one is not.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct TimeoutConfig {
    /// Connecting to a replica.
    pub connect_ms: u64,
    /// From sending the request to the response header, and to the first body chunk (queueing and
    /// prefill happen here).
    pub first_byte_ms: u64,
    /// Longest silence between two response chunks, after the first.
    pub idle_ms: u64,
    /// Idle upstream connections are kept this long for reuse. The default (4 s) is below vLLM's
    /// own keep-alive timeout (5 s, `VLLM_HTTP_TIMEOUT_KEEP_ALIVE`), so the proxy lets a connection
    /// go before the engine closes it as a request goes out; raise both together.
    pub pool_idle_ms: u64,
    /// A client that reads nothing of its response for this long (a full TCP window) is dropped
    /// and its upstream request cancelled.
    pub client_write_ms: u64,
    /// A request's whole header must arrive within this: a new connection's from its opening, a
    /// kept-alive connection's next one from its first byte (slowloris).
    pub header_read_ms: u64,
    /// A kept-alive client connection waits at most this long, idle, for its next request; an
    /// admin listener connection lives at most this long.
    pub keepalive_ms: u64,
    /// The whole request body must arrive within this after the header (408 past it); the body is
    /// read before the request waits for admission.
    pub body_read_ms: u64,
}

impl Default for TimeoutConfig {
    fn default() -> Self {
        Self {
            connect_ms: 2_000,
            first_byte_ms: 300_000,
            idle_ms: 60_000,
            pool_idle_ms: 4_000,
            client_write_ms: 30_000,
            header_read_ms: 10_000,
            keepalive_ms: 60_000,
            body_read_ms: 30_000,
        }
    }
}

/// Request limits and retries.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct LimitConfig {
    /// Largest request body accepted (413 above).
    pub max_body_bytes: u64,
    /// Largest request header block (names and values) accepted (431 above).
    pub max_header_bytes: u64,
    /// Most request header fields accepted (431 above).
    pub max_headers: u32,
    /// Longest unfinished server-sent event held between two reads from a replica; past it (a
    /// line that never ends) the stream is cut with an error event. An event that ends within the
    /// read that takes it past the bound (at most 64 KiB more) still passes.
    pub max_event_bytes: u64,
    /// Other replicas tried when one fails before any response byte reached the client.
    pub retries: u32,
    /// Retries may add at most this share of the requests of the last 10 s…
    pub retry_budget_ratio: f64,
    /// …plus this many (so low traffic can still retry).
    pub retry_budget_min: u32,
}

impl Default for LimitConfig {
    fn default() -> Self {
        Self {
            max_body_bytes: 32 << 20,
            max_header_bytes: 64 << 10,
            max_headers: 100,
            max_event_bytes: 1 << 20,
            retries: 2,
            retry_budget_ratio: 0.2,
            retry_budget_min: 3,
        }
    }
}

/// Passive measurement of every request.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct MeasureConfig {
    /// Ask streamed requests for the engine's usage chunk when the client did not, so token counts
    /// are exact; the chunk is removed again before the client sees it.
    pub inject_usage: bool,
    /// Header whose value names the request's class (one of `classes`).
    pub class_header: String,
    /// The class of requests without a known class header.
    pub default_class: String,
}

impl Default for MeasureConfig {
    fn default() -> Self {
        Self {
            inject_usage: true,
            class_header: "x-headroom-class".into(),
            default_class: "default".into(),
        }
    }
}

/// One traffic class.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ClassConfig {
    /// What a good request of the class achieved.
    #[serde(default)]
    pub slo: SloConfig,
    /// Higher is admitted first when replicas are full.
    #[serde(default)]
    pub priority: i32,
    /// Requests of the class that may wait at the proxy; beyond, 429.
    #[serde(default = "default_max_queue")]
    pub max_queue: usize,
    /// Longest wait at the proxy; past it, 503.
    #[serde(default = "default_queue_timeout_ms")]
    pub queue_timeout_ms: u64,
    /// Pool the class is served by (absent: `default`, or the only pool).
    #[serde(default)]
    pub pool: Option<String>,
    /// Requests without a class header whose prompt has at least this many tokens join this class
    /// (the longest threshold that fits wins): very long prompts can take their own pool.
    #[serde(default)]
    pub min_prompt_tokens: Option<u32>,
    /// Requests without a class header for one of these models join this class.
    #[serde(default)]
    pub models: Vec<String>,
    /// Requests without a class header on one of these paths (`/v1/completions`,
    /// `/v1/chat/completions`) join this class.
    #[serde(default)]
    pub paths: Vec<String>,
}

fn default_max_queue() -> usize {
    1024
}

fn default_queue_timeout_ms() -> u64 {
    30_000
}

/// Admission: each replica takes at most its cap of requests at once; the rest wait at the proxy.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct AdmissionConfig {
    /// Cap and queue at all (off: every request goes straight to routing).
    pub enabled: bool,
    /// Starting cap per replica; absent, derived from the engine's KV capacity
    /// (`headroom · KV tokens / context_tokens`) once scraped, unlimited until then.
    pub max_in_flight: Option<u32>,
    /// Tokens per sequence (prompt + output) the derived cap plans for, until `learn_context`
    /// has seen enough requests.
    pub context_tokens: u32,
    /// Plan each replica's cap for the mean context of the last 512 requests it served (once 32
    /// have finished), instead of `context_tokens`; the cap follows the plan when it moves by more
    /// than 10%.
    pub learn_context: bool,
    /// Also bound each replica's tokens in flight: the admitted requests' prompt + `max_tokens`
    /// (512 when unset) stay within `headroom` · its KV tokens, so long requests cannot crowd a
    /// replica past its cache whatever its sequence cap (a request alone is always admitted). For
    /// replicas that serve short and long requests at once (a pool that lends to another, a
    /// long-prompt class); conservative where prompts share a prefix (counted once per request).
    pub token_budget: bool,
    /// Fraction of the KV cache the derived cap plans to fill.
    pub headroom: f64,
    /// Multiplicative cut when the engine preempted.
    pub beta: f64,
    /// Multiplicative cut on an early warning (KV usage ≥ kv_high, engine queue growing).
    pub soft_beta: f64,
    /// Additive raise per quiet scrape while the cap holds work back.
    pub alpha: u32,
    /// KV cache usage that counts as pressure.
    pub kv_high: f64,
    /// The cap is raised only while the KV usage projected for `alpha` more sequences (of the
    /// running ones' mean size) stays at or below this.
    pub kv_raise_below: f64,
    /// Scrapes after a cut before another.
    pub cooldown_scrapes: u32,
    /// Lowest cap.
    pub min_cap: u32,
    /// Highest cap.
    pub max_cap: u32,
    /// Once the oldest waiter of a priority has waited this long, the newest of that priority is
    /// served first (adaptive LIFO).
    pub lifo_after_ms: u64,
    /// Prefill throughput of one replica, tokens/s. A request whose prefix-aware routing choice
    /// (`prefix_affinity`, `kv_events`) is at its cap waits for room there, instead of going at
    /// once to a replica with room, when that replica holds at least `prefix_wait_min_tokens` more
    /// of its prompt; it waits at most as long as prefilling those tokens at this rate would take
    /// elsewhere, then goes wherever there is room. 0: never waits for one replica.
    pub prefill_tokens_per_s: f64,
    /// Cached prompt tokens a request's routing choice must hold beyond the replica it would go to
    /// instead for the request to wait for it (`prefill_tokens_per_s`).
    pub prefix_wait_min_tokens: u32,
}

impl Default for AdmissionConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            max_in_flight: None,
            context_tokens: 2_300,
            learn_context: true,
            token_budget: false,
            headroom: 0.9,
            beta: 0.8,
            soft_beta: 0.95,
            alpha: 2,
            kv_high: 0.95,
            kv_raise_below: 0.85,
            cooldown_scrapes: 2,
            min_cap: 1,
            max_cap: 4_096,
            lifo_after_ms: 500,
            prefill_tokens_per_s: 20_000.0,
            prefix_wait_min_tokens: 2_048,
        }
    }
}

/// Latency objectives; a request is good when it completed and met every one that is set.
#[derive(Debug, Clone, Copy, PartialEq, Deserialize, Serialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct SloConfig {
    /// Time to first token, ms.
    pub ttft_ms: Option<f64>,
    /// Time per output token after the first, ms.
    pub tpot_ms: Option<f64>,
    /// End-to-end time, ms.
    pub e2e_ms: Option<f64>,
}

impl Default for SloConfig {
    fn default() -> Self {
        Self {
            ttft_ms: Some(2_000.0),
            tpot_ms: Some(100.0),
            e2e_ms: None,
        }
    }
}

fn default_classes() -> BTreeMap<String, ClassConfig> {
    BTreeMap::from([(
        "default".to_owned(),
        ClassConfig {
            slo: SloConfig::default(),
            priority: 0,
            max_queue: default_max_queue(),
            queue_timeout_ms: default_queue_timeout_ms(),
            pool: None,
            min_prompt_tokens: None,
            models: Vec::new(),
            paths: Vec::new(),
        },
    )])
}

/// Trace capture: each finished request appended to a JSONL file, off the request path.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct CaptureConfig {
    /// The file written; absent turns capture off. Rotated files get a UTC time suffix.
    pub path: Option<String>,
    /// Fraction of requests recorded (chosen by request id, so several proxies pick the same).
    pub sample: f64,
    /// Rotate when the file reaches this size.
    pub rotate_bytes: u64,
    /// Rotate when the file is this old; 0 never.
    pub rotate_secs: u64,
    /// Rotated files kept; older ones are deleted at each rotation (0: keep all, for a collector
    /// that moves them away).
    pub keep_files: u32,
    /// Records waiting for the writer at most; beyond, records are dropped and counted. The
    /// writer takes them in batches 20 ms apart, so this should hold at least 20 ms of requests.
    pub buffer_records: usize,
    /// Secret that keys the trace's hash ids; absent, a random one per process (ids then match
    /// only within one process's captures).
    pub id_key: Option<String>,
}

impl Default for CaptureConfig {
    fn default() -> Self {
        Self {
            path: None,
            sample: 1.0,
            rotate_bytes: 256 << 20,
            rotate_secs: 3_600,
            keep_files: 0,
            buffer_records: 65_536,
            id_key: None,
        }
    }
}

/// Whether `s` is an HTTP header name (RFC 9110 token characters).
fn is_header_name(s: &str) -> bool {
    !s.is_empty()
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b))
}

fn default_listen() -> String {
    "0.0.0.0:8080".into()
}

fn default_admin_listen() -> String {
    "127.0.0.1:9090".into()
}

/// Whether `s` is `host:port` with a numeric port.
fn is_host_port(s: &str) -> bool {
    s.rsplit_once(':')
        .is_some_and(|(h, p)| !h.is_empty() && !h.contains(['/', ' ']) && p.parse::<u16>().is_ok())
}

impl ServeConfig {
    /// A config with defaults for everything but the backends and the policy.
    pub fn quick(listen: &str, backends: &[String], policy: &str) -> Self {
        Self {
            listen: listen.to_owned(),
            admin_listen: default_admin_listen(),
            backends: backends.iter().map(|u| BackendConfig::at(u)).collect(),
            routing: RoutingConfig {
                policy: policy.to_owned(),
                ..RoutingConfig::default()
            },
            health: HealthConfig::default(),
            scrape: ScrapeConfig::default(),
            peers: PeersConfig::default(),
            timeouts: TimeoutConfig::default(),
            limits: LimitConfig::default(),
            measure: MeasureConfig::default(),
            classes: default_classes(),
            capture: CaptureConfig::default(),
            admission: AdmissionConfig::default(),
            pools: Vec::new(),
            kv_events: KvEventsConfig::default(),
            security: SecurityConfig::default(),
            shutdown: ShutdownConfig::default(),
            log: LogConfig::default(),
            tls: TlsConfig::default(),
            upstream_tls: UpstreamTlsConfig::default(),
            cost: CostConfig::default(),
        }
    }

    /// The pools: the configured ones, else one `default` pool of every backend.
    pub fn pool_list(&self) -> Vec<PoolConfig> {
        if self.pools.is_empty() {
            vec![PoolConfig {
                name: "default".into(),
                backends: self
                    .backends
                    .iter()
                    .map(BackendConfig::display_name)
                    .collect(),
                borrow: Vec::new(),
                borrow_below: default_borrow_below(),
                shadow: None,
            }]
        } else {
            self.pools.clone()
        }
    }

    /// The pool a class is served by.
    pub fn pool_of(&self, class: &str) -> String {
        let pools = self.pool_list();
        self.classes
            .get(class)
            .and_then(|c| c.pool.clone())
            .unwrap_or_else(|| {
                if pools.len() == 1 {
                    pools[0].name.clone()
                } else {
                    "default".into()
                }
            })
    }

    /// Validates a config built in code (files are validated when loaded).
    pub fn validated(self) -> Result<Self, Vec<FieldError>> {
        let mut errors = Vec::new();
        self.validate("", &mut errors);
        if errors.is_empty() {
            Ok(self)
        } else {
            Err(errors)
        }
    }
}

impl ServeConfig {
    fn validate_security(&self, p: &str, e: &mut Vec<FieldError>) {
        let mut names = std::collections::HashSet::new();
        for (i, k) in self.security.api_keys.iter().enumerate() {
            let kp = field_path(p, &format!("security.api_keys[{i}]"));
            check(
                e,
                !k.name.is_empty() && names.insert(k.name.clone()),
                &kp,
                "name",
                &k.name,
                "names must be unique and not empty",
            );
            match (&k.sha256, &k.env) {
                (Some(h), None) => check(
                    e,
                    is_sha256_hex(h),
                    &kp,
                    "sha256",
                    h,
                    "must be the 64 hex digits of the key's SHA-256",
                ),
                (None, Some(var)) => check(
                    e,
                    env_is_set(var),
                    &kp,
                    "env",
                    var,
                    "the environment variable is not set (or empty)",
                ),
                _ => check(
                    e,
                    false,
                    &kp,
                    "sha256",
                    k.sha256.as_deref().unwrap_or("(none)"),
                    "give exactly one of sha256 (the key's digest) or env (a variable holding it)",
                ),
            }
            if let Some(c) = &k.class {
                check(
                    e,
                    self.classes.contains_key(c),
                    &kp,
                    "class",
                    c,
                    "must name a class in [classes]",
                );
            }
            if let Some(r) = k.rate_per_s {
                check(
                    e,
                    r.is_finite() && r > 0.0,
                    &kp,
                    "rate_per_s",
                    r,
                    "must be a positive number of requests per second",
                );
            }
            if let Some(b) = k.burst {
                check(
                    e,
                    k.rate_per_s.is_some() && b >= 1,
                    &kp,
                    "burst",
                    b,
                    "needs rate_per_s, and must be at least 1",
                );
            }
        }
    }
}

impl Validate for ServeConfig {
    fn validate(&self, p: &str, e: &mut Vec<FieldError>) {
        let addr = "must be host:port, e.g. 127.0.0.1:8080";
        check(
            e,
            is_host_port(&self.listen),
            p,
            "listen",
            &self.listen,
            addr,
        );
        check(
            e,
            is_host_port(&self.admin_listen),
            p,
            "admin_listen",
            &self.admin_listen,
            addr,
        );
        check(
            e,
            !self.backends.is_empty(),
            p,
            "backends",
            "[]",
            "at least one backend is needed (in the file, or from --backends)",
        );
        let mut names = std::collections::HashSet::new();
        for (i, b) in self.backends.iter().enumerate() {
            let bp = field_path(p, &format!("backends[{i}]"));
            let ok = (b.url.starts_with("http://") || b.tls()) && is_host_port(b.authority());
            check(
                e,
                ok,
                &bp,
                "url",
                &b.url,
                "must be http://host:port or https://host:port (no path)",
            );
            let name = b.display_name();
            check(
                e,
                names.insert(name.clone()),
                &bp,
                "name",
                &name,
                "names must be unique",
            );
            for (field, endpoint) in [
                ("kv_events", &b.kv_events),
                ("kv_events_replay", &b.kv_events_replay),
            ] {
                if let Some(ep) = endpoint {
                    let ok = ep
                        .strip_prefix("tcp://")
                        .is_some_and(|a| is_host_port(a) && !a.starts_with('*'));
                    check(
                        e,
                        ok,
                        &bp,
                        field,
                        ep,
                        "must be tcp://host:port of the engine's publisher",
                    );
                }
            }
            check(
                e,
                b.kv_events.is_some() || b.kv_events_replay.is_none(),
                &bp,
                "kv_events_replay",
                b.kv_events_replay.as_deref().unwrap_or(""),
                "needs kv_events (the stream it fills gaps in)",
            );
            if let Some(var) = &b.api_key_env {
                check(
                    e,
                    env_is_set(var),
                    &bp,
                    "api_key_env",
                    var,
                    "the environment variable is not set (or empty)",
                );
            }
        }
        self.validate_security(p, e);
        let cp = field_path(p, "cost");
        for (field, v) in [
            ("replica_hour", self.cost.replica_hour),
            (
                "managed_per_million_tokens",
                self.cost.managed_per_million_tokens,
            ),
        ] {
            if let Some(v) = v {
                check(
                    e,
                    v.is_finite() && v >= 0.0,
                    &cp,
                    field,
                    v,
                    "must be a price ≥ 0",
                );
            }
        }
        let up = field_path(p, "upstream_tls");
        let u = &self.upstream_tls;
        for (field, path) in [("ca", &u.ca), ("cert", &u.cert), ("key", &u.key)] {
            if let Some(path) = path {
                check(
                    e,
                    std::path::Path::new(path).is_file(),
                    &up,
                    field,
                    path,
                    "no such file",
                );
            }
        }
        check(
            e,
            u.cert.is_some() == u.key.is_some(),
            &up,
            if u.cert.is_some() { "key" } else { "cert" },
            "(absent)",
            "a client certificate needs both cert and key",
        );
        let tp = field_path(p, "tls");
        match (&self.tls.cert, &self.tls.key) {
            (None, None) => {}
            (Some(c), Some(k)) => {
                for (field, path) in [("cert", c), ("key", k)] {
                    check(
                        e,
                        std::path::Path::new(path).is_file(),
                        &tp,
                        field,
                        path,
                        "no such file",
                    );
                }
            }
            (c, k) => check(
                e,
                false,
                &tp,
                if c.is_none() { "cert" } else { "key" },
                "(none)",
                &format!(
                    "TLS needs both cert and key (only {} is set)",
                    if k.is_none() { "cert" } else { "key" }
                ),
            ),
        }
        let k = &self.kv_events;
        let kp = field_path(p, "kv_events");
        check(
            e,
            KV_HASHES.contains(&k.hash.as_str()),
            &kp,
            "hash",
            &k.hash,
            &format!("must be one of {}", KV_HASHES.join(", ")),
        );
        check(
            e,
            k.pending_ttl_ms > 0,
            &kp,
            "pending_ttl_ms",
            k.pending_ttl_ms,
            "must be positive",
        );
        check(
            e,
            k.stale_after_ms > 0,
            &kp,
            "stale_after_ms",
            k.stale_after_ms,
            "must be positive",
        );
        check(
            e,
            k.replay_timeout_ms > 0,
            &kp,
            "replay_timeout_ms",
            k.replay_timeout_ms,
            "must be positive",
        );
        if self.routing.policy == "kv_events" {
            check(
                e,
                self.backends.iter().any(|b| b.kv_events.is_some()),
                &field_path(p, "routing"),
                "policy",
                "kv_events",
                "needs backends[].kv_events (the engines' KV event endpoints) on at least one backend",
            );
        }
        let r = &self.routing;
        let rp = field_path(p, "routing");
        check(
            e,
            POLICIES.contains(&r.policy.as_str()),
            &rp,
            "policy",
            &r.policy,
            &format!("must be one of {}", POLICIES.join(", ")),
        );
        check(
            e,
            (1..=1024).contains(&r.block_tokens),
            &rp,
            "block_tokens",
            r.block_tokens,
            "must be 1..=1024 (vLLM uses 16)",
        );
        check(
            e,
            r.max_hashed_tokens >= r.block_tokens,
            &rp,
            "max_hashed_tokens",
            r.max_hashed_tokens,
            "must be at least one block",
        );
        check(
            e,
            r.decode_weight.is_finite() && r.decode_weight >= 0.0,
            &rp,
            "decode_weight",
            r.decode_weight,
            "must be a finite number ≥ 0",
        );
        check(
            e,
            r.recompute_weight.is_finite() && r.recompute_weight > 0.0,
            &rp,
            "recompute_weight",
            r.recompute_weight,
            "must be a finite number > 0",
        );
        check(
            e,
            r.index_blocks != Some(0),
            &rp,
            "index_blocks",
            0,
            "must be positive (leave it out to read it from the replica)",
        );
        check(
            e,
            is_header_name(&r.session_header),
            &rp,
            "session_header",
            &r.session_header,
            "must be a header name (letters, digits and !#$%&'*+-.^_`|~, no spaces)",
        );
        let peers = &self.peers;
        let pp = field_path(p, "peers");
        for (i, a) in peers.addresses.iter().enumerate() {
            check(
                e,
                is_host_port(a),
                &pp,
                &format!("addresses[{i}]"),
                a,
                "must be host:port of another proxy's admin listener",
            );
        }
        check(
            e,
            peers.interval_ms > 0,
            &pp,
            "interval_ms",
            peers.interval_ms,
            "must be positive",
        );
        if let Some(var) = &peers.token_env {
            check(
                e,
                env_is_set(var),
                &pp,
                "token_env",
                var,
                "the environment variable is not set (or empty)",
            );
        }
        check(
            e,
            !peers.any_address || peers.token_env.is_some(),
            &pp,
            "any_address",
            peers.any_address,
            "needs token_env: without a shared secret a push from any address could come from anyone",
        );
        check(
            e,
            peers.push_interval_ms < peers.interval_ms,
            &pp,
            "push_interval_ms",
            peers.push_interval_ms,
            "must be shorter than interval_ms (0 turns pushing off): a push is the quick path, the poll the backstop",
        );
        check(
            e,
            peers.timeout_ms > 0,
            &pp,
            "timeout_ms",
            peers.timeout_ms,
            "must be positive",
        );
        check(
            e,
            peers.expire_ms
                >= peers
                    .interval_ms
                    .saturating_mul(2)
                    .saturating_add(peers.timeout_ms),
            &pp,
            "expire_ms",
            peers.expire_ms,
            "must be at least two poll intervals plus timeout_ms (one slow answer must not drop a live peer)",
        );
        let loopback = |a: &str| {
            a.starts_with("127.") || a.starts_with("localhost:") || a.starts_with("[::1]:")
        };
        check(
            e,
            !loopback(&self.admin_listen) || peers.addresses.iter().all(|a| loopback(a)),
            p,
            "admin_listen",
            &self.admin_listen,
            "peers on other hosts cannot reach a loopback admin listener: listen on an address they can reach (e.g. 0.0.0.0:9090)",
        );
        check(
            e,
            peers.addresses.is_empty() || !r.foreign_load,
            &rp,
            "foreign_load",
            true,
            "set one of routing.foreign_load and peers.addresses: the peers' counts already are the other proxies' work",
        );
        let h = &self.health;
        let hp = field_path(p, "health");
        check(
            e,
            h.path.starts_with('/'),
            &hp,
            "path",
            &h.path,
            "must start with /",
        );
        check(
            e,
            h.interval_ms > 0,
            &hp,
            "interval_ms",
            0,
            "must be positive",
        );
        check(
            e,
            h.timeout_ms > 0,
            &hp,
            "timeout_ms",
            0,
            "must be positive",
        );
        check(
            e,
            h.unhealthy_after > 0,
            &hp,
            "unhealthy_after",
            0,
            "must be ≥ 1",
        );
        check(
            e,
            h.healthy_after > 0,
            &hp,
            "healthy_after",
            0,
            "must be ≥ 1",
        );
        check(e, h.eject_after > 0, &hp, "eject_after", 0, "must be ≥ 1");
        check(
            e,
            (0.0..=1.0).contains(&h.max_ejected_fraction),
            &hp,
            "max_ejected_fraction",
            h.max_ejected_fraction,
            "must be between 0 and 1",
        );
        let t = &self.timeouts;
        let tp = field_path(p, "timeouts");
        for (name, v) in [
            ("connect_ms", t.connect_ms),
            ("first_byte_ms", t.first_byte_ms),
            ("idle_ms", t.idle_ms),
            ("header_read_ms", t.header_read_ms),
            ("keepalive_ms", t.keepalive_ms),
            ("client_write_ms", t.client_write_ms),
            ("body_read_ms", t.body_read_ms),
        ] {
            check(e, v > 0, &tp, name, v, "must be positive");
        }
        check(
            e,
            self.limits.max_body_bytes >= 1024,
            &field_path(p, "limits"),
            "max_body_bytes",
            self.limits.max_body_bytes,
            "must be at least 1024",
        );
        check(
            e,
            self.limits.max_header_bytes >= 1024,
            &field_path(p, "limits"),
            "max_header_bytes",
            self.limits.max_header_bytes,
            "must be at least 1024",
        );
        check(
            e,
            (0.0..=10.0).contains(&self.limits.retry_budget_ratio),
            &field_path(p, "limits"),
            "retry_budget_ratio",
            self.limits.retry_budget_ratio,
            "must be between 0 and 10 (a share of requests)",
        );
        check(
            e,
            self.limits.max_event_bytes >= 4096,
            &field_path(p, "limits"),
            "max_event_bytes",
            self.limits.max_event_bytes,
            "must be at least 4096",
        );
        check(
            e,
            self.limits.max_headers >= 8,
            &field_path(p, "limits"),
            "max_headers",
            self.limits.max_headers,
            "must be at least 8",
        );
        let m = &self.measure;
        let mp = field_path(p, "measure");
        check(
            e,
            is_header_name(&m.class_header),
            &mp,
            "class_header",
            &m.class_header,
            "must be a header name (letters, digits and !#$%&'*+-.^_`|~, no spaces)",
        );
        let names: Vec<&str> = self.classes.keys().map(String::as_str).collect();
        check(
            e,
            self.classes.contains_key(&m.default_class),
            &mp,
            "default_class",
            &m.default_class,
            &format!("must name a class in [classes] ({})", names.join(", ")),
        );
        for (name, c) in &self.classes {
            let kp = field_path(p, &format!("classes.{name}"));
            check(
                e,
                c.queue_timeout_ms > 0,
                &kp,
                "queue_timeout_ms",
                0,
                "must be positive",
            );
            let cp = field_path(p, &format!("classes.{name}.slo"));
            for (field, v) in [
                ("ttft_ms", c.slo.ttft_ms),
                ("tpot_ms", c.slo.tpot_ms),
                ("e2e_ms", c.slo.e2e_ms),
            ] {
                if let Some(v) = v {
                    check(
                        e,
                        v.is_finite() && v > 0.0,
                        &cp,
                        field,
                        v,
                        "must be a positive number of ms",
                    );
                }
            }
        }
        let a = &self.admission;
        let ap = field_path(p, "admission");
        check(
            e,
            a.max_in_flight != Some(0),
            &ap,
            "max_in_flight",
            0,
            "must be positive (leave it out to derive it from the engine)",
        );
        check(
            e,
            a.context_tokens > 0,
            &ap,
            "context_tokens",
            0,
            "must be positive",
        );
        check(
            e,
            a.headroom > 0.0 && a.headroom <= 1.0,
            &ap,
            "headroom",
            a.headroom,
            "must be in (0, 1]",
        );
        check(
            e,
            a.beta > 0.0 && a.beta < 1.0,
            &ap,
            "beta",
            a.beta,
            "must be in (0, 1)",
        );
        check(
            e,
            a.soft_beta > 0.0 && a.soft_beta < 1.0,
            &ap,
            "soft_beta",
            a.soft_beta,
            "must be in (0, 1)",
        );
        check(
            e,
            a.kv_high > 0.0 && a.kv_high <= 1.0,
            &ap,
            "kv_high",
            a.kv_high,
            "must be in (0, 1]",
        );
        check(
            e,
            a.kv_raise_below > 0.0 && a.kv_raise_below <= 1.0,
            &ap,
            "kv_raise_below",
            a.kv_raise_below,
            "must be in (0, 1]",
        );
        check(
            e,
            a.kv_raise_below <= a.kv_high,
            &ap,
            "kv_raise_below",
            a.kv_raise_below,
            "must not exceed kv_high (the cap would rise into the usage that cuts it)",
        );
        check(
            e,
            a.min_cap >= 1 && a.min_cap <= a.max_cap,
            &ap,
            "min_cap",
            a.min_cap,
            "must be at least 1 and at most max_cap",
        );
        check(
            e,
            a.prefill_tokens_per_s == 0.0
                || a.prefill_tokens_per_s.is_finite() && a.prefill_tokens_per_s >= 1.0,
            &ap,
            "prefill_tokens_per_s",
            a.prefill_tokens_per_s,
            "must be 0 (a request never waits for one replica) or a finite number ≥ 1",
        );
        check(
            e,
            a.prefill_tokens_per_s == 0.0 || a.prefix_wait_min_tokens >= 1,
            &ap,
            "prefix_wait_min_tokens",
            a.prefix_wait_min_tokens,
            "must be at least 1 (a request waits for a replica only for cached tokens it would lose elsewhere; prefill_tokens_per_s = 0 turns the wait off)",
        );
        let backend_names: std::collections::HashSet<String> = self
            .backends
            .iter()
            .map(BackendConfig::display_name)
            .collect();
        let pool_names: Vec<String> = self.pool_list().into_iter().map(|x| x.name).collect();
        let mut seen_pools = std::collections::HashSet::new();
        for (i, pool) in self.pools.iter().enumerate() {
            let pp = field_path(p, &format!("pools[{i}]"));
            check(
                e,
                seen_pools.insert(pool.name.clone()),
                &pp,
                "name",
                &pool.name,
                "pool names must be unique",
            );
            check(
                e,
                !pool.backends.is_empty(),
                &pp,
                "backends",
                "[]",
                "a pool needs at least one backend",
            );
            for b in &pool.backends {
                check(
                    e,
                    backend_names.contains(b),
                    &pp,
                    "backends",
                    b,
                    "names no backend (use backends[].name, else host:port)",
                );
            }
            for b in &pool.borrow {
                check(
                    e,
                    pool_names.contains(b) && b != &pool.name,
                    &pp,
                    "borrow",
                    b,
                    "must name another pool",
                );
            }
            check(
                e,
                pool.borrow_below > 0.0 && pool.borrow_below <= 1.0,
                &pp,
                "borrow_below",
                pool.borrow_below,
                "must be in (0, 1]",
            );
            if let Some(s) = &pool.shadow {
                let sp = field_path(&pp, "shadow");
                let target = self.pools.iter().find(|o| o.name == s.pool);
                check(
                    e,
                    target.is_some() && s.pool != pool.name,
                    &sp,
                    "pool",
                    &s.pool,
                    "must name another pool",
                );
                check(
                    e,
                    target.is_none_or(|t| t.shadow.is_none()),
                    &sp,
                    "pool",
                    &s.pool,
                    "a shadow pool does not shadow in turn",
                );
                check(
                    e,
                    target.is_none_or(|t| t.backends.iter().all(|b| !pool.backends.contains(b))),
                    &sp,
                    "pool",
                    &s.pool,
                    "shares replicas with this pool: copies would load the replicas that serve",
                );
                check(
                    e,
                    s.fraction > 0.0 && s.fraction <= 1.0,
                    &sp,
                    "fraction",
                    s.fraction,
                    "must be in (0, 1]",
                );
                check(
                    e,
                    s.max_in_flight >= 1,
                    &sp,
                    "max_in_flight",
                    s.max_in_flight,
                    "at least 1",
                );
            }
        }
        let shadow_pools: Vec<&str> = self
            .pools
            .iter()
            .filter_map(|p| p.shadow.as_ref().map(|s| s.pool.as_str()))
            .collect();
        for (i, pool) in self.pools.iter().enumerate() {
            for b in pool
                .borrow
                .iter()
                .filter(|b| shadow_pools.contains(&b.as_str()))
            {
                check(
                    e,
                    false,
                    &field_path(p, &format!("pools[{i}]")),
                    "borrow",
                    b,
                    "is a shadow pool: its replicas serve no client",
                );
            }
        }
        for (name, class) in &self.classes {
            for path in &class.paths {
                check(
                    e,
                    matches!(path.as_str(), "/v1/completions" | "/v1/chat/completions"),
                    &field_path(p, &format!("classes.{name}")),
                    "paths",
                    path,
                    "must be /v1/completions or /v1/chat/completions (the generation paths)",
                );
            }
            let pool = self.pool_of(name);
            check(
                e,
                pool_names.contains(&pool),
                &field_path(p, &format!("classes.{name}")),
                "pool",
                &pool,
                &if class.pool.is_none() {
                    format!(
                        "is unset, so the pool `default`, which does not exist: name one of the pools ({})",
                        pool_names.join(", ")
                    )
                } else {
                    format!("must name a pool ({})", pool_names.join(", "))
                },
            );
            check(
                e,
                !shadow_pools.contains(&pool.as_str()),
                &field_path(p, &format!("classes.{name}")),
                "pool",
                &pool,
                "is a shadow pool: it serves no class",
            );
        }
        let c = &self.capture;
        let cp = field_path(p, "capture");
        if let Some(path) = &c.path {
            check(e, !path.is_empty(), &cp, "path", "\"\"", "must name a file");
        }
        check(
            e,
            c.sample > 0.0 && c.sample <= 1.0,
            &cp,
            "sample",
            c.sample,
            "must be in (0, 1]",
        );
        check(
            e,
            c.rotate_bytes >= 4096,
            &cp,
            "rotate_bytes",
            c.rotate_bytes,
            "must be at least 4096",
        );
        check(
            e,
            c.buffer_records > 0,
            &cp,
            "buffer_records",
            0,
            "must be ≥ 1",
        );
        if let Some(k) = &c.id_key {
            check(
                e,
                k.len() >= 16,
                &cp,
                "id_key",
                "(secret)",
                "must be at least 16 characters",
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::parse_toml;
    use std::path::Path;

    #[test]
    fn the_example_config_is_valid_and_complete() {
        let text = include_str!("../examples/headroom.toml");
        let c: ServeConfig = parse_toml(text, Path::new("headroom.toml")).unwrap();
        assert_eq!(c.backends.len(), 4);
        // The example spells out every default.
        assert_eq!(c.routing, RoutingConfig::default());
        assert_eq!(c.health, HealthConfig::default());
        assert_eq!(c.timeouts, TimeoutConfig::default());
        assert_eq!(c.limits, LimitConfig::default());
        assert_eq!(c.scrape, ScrapeConfig::default());
        assert_eq!(c.peers, PeersConfig::default());
        assert_eq!(c.measure, MeasureConfig::default());
        assert_eq!(c.classes, default_classes());
        assert_eq!(c.admission, AdmissionConfig::default());
        assert_eq!(c.kv_events, KvEventsConfig::default());
        assert_eq!(c.security, SecurityConfig::default());
        assert_eq!(c.shutdown, ShutdownConfig::default());
        assert_eq!(c.log, LogConfig::default());
        assert_eq!(c.tls, TlsConfig::default());
        assert_eq!(
            c.capture,
            CaptureConfig {
                path: Some("captures/headroom.jsonl".into()),
                ..CaptureConfig::default()
            }
        );
    }

    #[test]
    fn minimal_config_gets_defaults() {
        let c: ServeConfig = parse_toml(
            "[[backends]]\nurl = \"http://127.0.0.1:8000\"\n",
            Path::new("x"),
        )
        .unwrap();
        assert_eq!(c.routing.policy, "prefix_affinity");
        assert_eq!(c.backends[0].display_name(), "127.0.0.1:8000");
        assert_eq!(c.admin_listen, "127.0.0.1:9090");
        assert!(!c.backends[0].tls());
        for (url, authority, host) in [
            (
                "https://vllm-0.vllm:8443",
                "vllm-0.vllm:8443",
                "vllm-0.vllm",
            ),
            ("https://[::1]:8443/", "[::1]:8443", "::1"),
            ("http://127.0.0.1:8000", "127.0.0.1:8000", "127.0.0.1"),
        ] {
            let b = BackendConfig::at(url);
            assert_eq!((b.authority(), b.host()), (authority, host), "{url}");
            assert_eq!(b.tls(), url.starts_with("https"));
        }
    }

    #[test]
    fn errors_name_field_value_and_reason() {
        let text = r#"
listen = "8080"
[[backends]]
url = "https://a:1/v1"
[[backends]]
url = "http://b:2/v1"
[upstream_tls]
cert = "/nonexistent/client.crt"
[routing]
policy = "fastest"
block_tokens = 0
"#;
        let err = parse_toml::<ServeConfig>(text, Path::new("h.toml"))
            .unwrap_err()
            .to_string();
        for want in [
            "listen = 8080: must be host:port",
            "backends[0].url = https://a:1/v1: must be http://host:port or https://host:port",
            "backends[1].url = http://b:2/v1: must be http://host:port",
            "upstream_tls.cert = /nonexistent/client.crt: no such file",
            "upstream_tls.key = (absent): a client certificate needs both cert and key",
            "routing.policy = fastest: must be one of round_robin",
            "routing.block_tokens = 0",
        ] {
            assert!(err.contains(want), "missing {want:?} in\n{err}");
        }
    }

    #[test]
    fn the_prefix_wait_needs_a_prefill_rate_and_a_gain() {
        let with = |admission: &str| {
            parse_toml::<ServeConfig>(
                &format!("[[backends]]\nurl = \"http://127.0.0.1:8000\"\n[admission]\n{admission}"),
                Path::new("h.toml"),
            )
        };
        let err = with("prefill_tokens_per_s = 0.5").unwrap_err().to_string();
        assert!(
            err.contains("admission.prefill_tokens_per_s = 0.5: must be 0"),
            "{err}"
        );
        let err = with("prefix_wait_min_tokens = 0").unwrap_err().to_string();
        assert!(
            err.contains("admission.prefix_wait_min_tokens = 0: must be at least 1"),
            "{err}"
        );
        // Off, the threshold does not matter.
        let c = with("prefill_tokens_per_s = 0\nprefix_wait_min_tokens = 0").unwrap();
        assert_eq!(c.admission.prefill_tokens_per_s, 0.0);
    }

    #[test]
    fn kv_events_needs_endpoints_that_name_the_engine() {
        let text = r#"
[[backends]]
url = "http://127.0.0.1:8001"
[[backends]]
url = "http://127.0.0.1:8002"
kv_events_replay = "tcp://127.0.0.1:5567"
[routing]
policy = "kv_events"
[kv_events]
hash = "pickle"
"#;
        let err = parse_toml::<ServeConfig>(text, Path::new("h.toml"))
            .unwrap_err()
            .to_string();
        for want in [
            "routing.policy = kv_events: needs backends[].kv_events",
            "backends[1].kv_events_replay = tcp://127.0.0.1:5567: needs kv_events",
            "kv_events.hash = pickle: must be one of headroom",
        ] {
            assert!(err.contains(want), "missing {want:?} in\n{err}");
        }
        let wildcard =
            "[[backends]]\nurl = \"http://127.0.0.1:8001\"\nkv_events = \"tcp://*:5557\"\n";
        let err = parse_toml::<ServeConfig>(wildcard, Path::new("h.toml"))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("must be tcp://host:port of the engine's publisher"),
            "{err}"
        );
        let ok = "[[backends]]\nurl = \"http://127.0.0.1:8001\"\nkv_events = \"tcp://10.0.0.5:5557\"\n[routing]\npolicy = \"kv_events\"\n";
        assert!(parse_toml::<ServeConfig>(ok, Path::new("h.toml")).is_ok());
    }

    #[test]
    fn peers_are_admin_addresses_polled_often_and_exclude_the_gauge_estimate() {
        let text = r#"
[[backends]]
url = "http://127.0.0.1:8001"
[routing]
foreign_load = true
[peers]
addresses = ["headroom-admin.default.svc:9090", "http://10.0.0.7:9090"]
interval_ms = 200
push_interval_ms = 200
expire_ms = 500
token_env = "HEADROOM_TEST_UNSET_PEER_TOKEN"
"#;
        let err = parse_toml::<ServeConfig>(text, Path::new("h.toml"))
            .unwrap_err()
            .to_string();
        for want in [
            "peers.addresses[1] = http://10.0.0.7:9090: must be host:port",
            "peers.expire_ms = 500: must be at least two poll intervals plus timeout_ms",
            "peers.push_interval_ms = 200: must be shorter than interval_ms",
            "peers.token_env = HEADROOM_TEST_UNSET_PEER_TOKEN: the environment variable is not set",
            "admin_listen = 127.0.0.1:9090: peers on other hosts cannot reach a loopback admin listener",
            "routing.foreign_load = true: set one of routing.foreign_load and peers.addresses",
        ] {
            assert!(err.contains(want), "missing {want:?} in\n{err}");
        }
        assert!(!err.contains("addresses[0]"), "{err}");
        let ok = "admin_listen = \"0.0.0.0:9090\"\n[[backends]]\nurl = \"http://127.0.0.1:8001\"\n[peers]\naddresses = [\"10.0.0.7:9090\"]\n";
        let c = parse_toml::<ServeConfig>(ok, Path::new("h.toml")).unwrap();
        assert_eq!(
            (
                c.peers.interval_ms,
                c.peers.push_interval_ms,
                c.peers.expire_ms
            ),
            (100, 5, 1_000)
        );
        // Pushes from any address need the shared secret that then identifies a peer.
        let open = format!("{ok}any_address = true\n");
        let err = parse_toml::<ServeConfig>(&open, Path::new("h.toml"))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("peers.any_address = true: needs token_env"),
            "{err}"
        );
    }

    #[test]
    fn api_keys_hold_no_secret_and_name_real_classes() {
        let text = r#"
[[backends]]
url = "http://127.0.0.1:8001"
api_key_env = "HEADROOM_TEST_UNSET_ENGINE_KEY"
[[security.api_keys]]
name = "a"
sha256 = "abc"
[[security.api_keys]]
name = "a"
env = "HEADROOM_TEST_UNSET_CLIENT_KEY"
class = "gold"
rate_per_s = 0
[[security.api_keys]]
name = "both"
burst = 3
"#;
        let err = parse_toml::<ServeConfig>(text, Path::new("h.toml"))
            .unwrap_err()
            .to_string();
        for want in [
            "backends[0].api_key_env = HEADROOM_TEST_UNSET_ENGINE_KEY: the environment variable is not set",
            "security.api_keys[0].sha256 = abc: must be the 64 hex digits",
            "security.api_keys[1].name = a: names must be unique",
            "security.api_keys[1].env = HEADROOM_TEST_UNSET_CLIENT_KEY: the environment variable is not set",
            "security.api_keys[1].class = gold: must name a class",
            "security.api_keys[1].rate_per_s = 0: must be a positive number",
            "security.api_keys[2].sha256 = (none): give exactly one of sha256",
            "security.api_keys[2].burst = 3: needs rate_per_s",
        ] {
            assert!(err.contains(want), "missing {want:?} in\n{err}");
        }
        let ok = format!(
            "[[backends]]\nurl = \"http://127.0.0.1:8001\"\n[[security.api_keys]]\nname = \"k\"\nsha256 = \"{}\"\nrate_per_s = 2.5\n",
            "ab".repeat(32)
        );
        let c = parse_toml::<ServeConfig>(&ok, Path::new("h.toml")).unwrap();
        assert_eq!(c.security.api_keys[0].burst_or_default(), 3);
    }

    #[test]
    fn quick_configs_are_validated_too() {
        let bad = ServeConfig::quick("127.0.0.1:0", &["localhost".into()], "random").validated();
        let errs = bad.unwrap_err();
        assert_eq!(errs.len(), 2, "{errs:?}");
        let ok = ServeConfig::quick("127.0.0.1:0", &["http://127.0.0.1:1".into()], "least_load");
        assert!(ok.validated().is_ok());
    }

    #[test]
    fn pools_must_name_backends_and_classes_must_name_pools() {
        let text = r#"
[[backends]]
url = "http://127.0.0.1:8001"
name = "a"
[[pools]]
name = "interactive"
backends = ["a", "zz"]
borrow = ["interactive"]
[[pools]]
name = "batch"
backends = ["a"]
[classes.default]
pool = "nowhere"
[classes.unset]
paths = ["/v1/nosuch"]
[measure]
class_header = "bad header"
"#;
        let err = parse_toml::<ServeConfig>(text, Path::new("p.toml"))
            .unwrap_err()
            .to_string();
        for want in [
            "pools[0].backends = zz: names no backend",
            "pools[0].borrow = interactive: must name another pool",
            "classes.default.pool = nowhere: must name a pool (interactive, batch)",
            "classes.unset.pool = default: is unset, so the pool `default`, which does not exist",
            "classes.unset.paths = /v1/nosuch: must be /v1/completions or /v1/chat/completions",
            "measure.class_header = bad header: must be a header name",
        ] {
            assert!(err.contains(want), "{want}\n{err}");
        }
        let ok: ServeConfig = parse_toml(
            "[[backends]]\nurl = \"http://127.0.0.1:8001\"\n",
            Path::new("x"),
        )
        .unwrap();
        assert_eq!(ok.pool_of("default"), "default");
        let shadowed = "[[backends]]\nurl = \"http://127.0.0.1:8001\"\n[[backends]]\nurl = \"http://127.0.0.1:8002\"\n\
            [[pools]]\nname = \"live\"\nbackends = [\"127.0.0.1:8001\"]\nborrow = [\"candidate\"]\n\
            shadow = { pool = \"candidate\", fraction = 1.5 }\n\
            [[pools]]\nname = \"candidate\"\nbackends = [\"127.0.0.1:8002\"]\nshadow = { pool = \"live\" }\n\
            [classes.default]\npool = \"live\"\n[classes.other]\npool = \"candidate\"\n";
        let err = parse_toml::<ServeConfig>(shadowed, Path::new("x"))
            .unwrap_err()
            .to_string();
        for want in [
            "pools[0].shadow.fraction = 1.5: must be in (0, 1]",
            "pools[0].shadow.pool = candidate: a shadow pool does not shadow in turn",
            "pools[0].borrow = candidate: is a shadow pool",
            "classes.other.pool = candidate: is a shadow pool",
        ] {
            assert!(err.contains(want), "{want}\n{err}");
        }
        assert_eq!(
            ok.pool_list()[0].backends,
            vec!["127.0.0.1:8001".to_owned()]
        );
    }
}
