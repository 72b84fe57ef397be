//! The proxy's Prometheus metrics (`headroom_` names, base units), and the per-replica gauges that
//! are read from the fleet when `/metrics` is scraped rather than updated on the request path.
//! `stats` keeps the sliding windows behind `/stats`; `capture` writes the trace.

pub mod capture;
pub mod operator;
pub mod stats;

use std::sync::Mutex;

use headroom_workload::engine_metrics::EngineGauges;
use prometheus::{
    Encoder, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, Opts, Registry,
    TextEncoder,
    core::{AtomicF64, GenericCounterVec, GenericGaugeVec},
};

use crate::upstreams::{Backend, Fleet};

type FloatCounterVec = GenericCounterVec<AtomicF64>;
type FloatGaugeVec = GenericGaugeVec<AtomicF64>;

/// Latency buckets in seconds: 1 ms steps where decisions are made, wider in the tail.
pub const LATENCY_BUCKETS: &[f64] = &[
    0.00025, 0.0005, 0.001, 0.002, 0.003, 0.004, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.04,
    0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 15.0,
    20.0, 30.0, 60.0, 120.0, 300.0,
];

/// Every metric the proxy exports.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    /// Requests answered, by route, backend (`none` when the proxy answered) and status.
    pub requests: IntCounterVec,
    /// Requests the proxy answered itself, by reason.
    pub proxy_errors: IntCounterVec,
    /// Attempts retried on another replica, by reason.
    pub retries: IntCounterVec,
    /// Retries not made because the retry budget was spent.
    pub retries_over_budget: IntCounter,
    /// Pooled connections to plaintext replicas that turned out closed once a request was written
    /// to them (the request went again on a new connection).
    pub upstream_stale_connections: IntCounter,
    /// Requests open at the proxy (read, queued, forwarded or being relayed).
    pub open_requests: prometheus::IntGauge,
    /// Connections closed because a request header did not arrive in time.
    pub slow_headers_closed: IntCounter,
    /// Requests made with each client API key, by outcome (`accepted`, `rate_limited`).
    pub key_requests: IntCounterVec,
    /// Requests whose body could not be inspected (routed without prefix information).
    pub uninspectable: IntCounter,
    /// Requests whose engine tokens (chat template, tokenizer) could not be made for
    /// `vllm_sha256_cbor` hashing (routed on headroom's own chain).
    pub engine_tokens_failed: IntCounter,
    /// Routing decisions, by policy and backend.
    pub routed: IntCounterVec,
    /// Polls of peer proxies' work (`[peers]`), by result.
    pub peer_polls: IntCounterVec,
    /// Pushes of work between peer proxies, by direction and result.
    pub peer_pushes: IntCounterVec,
    /// Peer proxies heard from recently enough to count.
    pub peers_live: prometheus::IntGauge,
    /// Work peer proxies report on each replica.
    pub peer_work: FloatGaugeVec,
    /// Prompt tokens of routed generation requests.
    pub routed_prompt_tokens: IntCounter,
    /// Prompt tokens the policy expected the chosen replica to have cached.
    pub routed_matched_tokens: IntCounter,
    /// Arrival to the first output-bearing event, by pool, class and backend.
    pub ttft: HistogramVec,
    /// Gaps between output-bearing events, by pool, class and backend.
    pub itl: HistogramVec,
    /// Time per output token after the first, by pool, class and backend.
    pub tpot: HistogramVec,
    /// Arrival to the end of the response, by pool, class and backend.
    pub e2e: HistogramVec,
    /// Arrival to dispatch (body, inspection, routing; admission once it queues), by pool, class
    /// and backend.
    pub queue: HistogramVec,
    /// Dispatch to the first output-bearing event: the engine's queue and prefill as the proxy
    /// sees them, by pool, class and backend.
    pub prefill: HistogramVec,
    /// Prompt tokens of finished generation requests (usage, else the proxy's count).
    pub prompt_tokens: IntCounterVec,
    /// Output tokens of finished generation requests.
    pub completion_tokens: IntCounterVec,
    /// Finished generation requests by SLO result (`good`, `slow`, `failed`).
    pub slo_requests: IntCounterVec,
    /// Completed requests that missed an objective, by objective.
    pub slo_missed: IntCounterVec,
    /// Requests that completed within their class's objectives.
    pub goodput_requests: IntCounterVec,
    /// Output tokens of good requests.
    pub goodput_tokens: IntCounterVec,
    /// Trace capture counters.
    pub capture: capture::CaptureCounters,
    /// Requests not captured, by reason.
    pub capture_skipped: IntCounterVec,
    /// Requests refused by admission, by pool, class and reason.
    pub refused: IntCounterVec,
    /// Admission cap changes, by backend and direction.
    pub cap_changes: IntCounterVec,
    /// Requests admission sent away from the replica routing chose for them, by pool and why.
    pub displaced: IntCounterVec,
    /// Prompt tokens the replicas routing chose held beyond the ones the displaced requests got.
    pub displaced_matched_tokens: IntCounterVec,
    /// Admitted requests that waited for their routing choice at its cap, by pool.
    pub prefix_waits: IntCounterVec,
    admission: AdmissionGauges,
    /// Time spent routing (inspection excluded).
    pub route_seconds: Histogram,
    /// Time to inspect a generation request's body (parse, render, tokenize, hash), by where it
    /// ran (`worker`, or `blocking_pool` for large bodies, including the wait for a slot there).
    pub inspect_seconds: HistogramVec,
    /// Responses cut by the replica or an idle timeout after they started, by backend.
    pub upstream_cut: IntCounterVec,
    /// Clients that went away before their response finished, by backend.
    pub client_aborts: IntCounterVec,
    backend: BackendGauges,
    /// 1 for each (backend, pool) of the config: joins per-replica series to their pool.
    backend_pool: FloatGaugeVec,
    /// Cost per million tokens at the 5-minute throughput, by which tokens.
    cost: FloatGaugeVec,
    /// Each replica's totals at the last refresh, by URL.
    last: Mutex<std::collections::HashMap<String, BackendTotals>>,
    /// KV event stream counters, by backend.
    pub kv_events: KvEventCounters,
    /// Shadow traffic.
    pub shadow: ShadowMetrics,
}

/// Counters and gauges of the engines' KV event streams.
#[derive(Debug)]
pub struct KvEventCounters {
    /// Batches applied to the exact index.
    pub batches: IntCounterVec,
    /// Gaps in sequence numbers.
    pub gaps: IntCounterVec,
    /// Gaps nothing filled (the replica's picture was cleared and is partial).
    pub losses: IntCounterVec,
    /// Engine restarts seen (sequence numbers going back).
    pub restarts: IntCounterVec,
    /// Messages that could not be decoded.
    pub decode_errors: IntCounterVec,
    /// Events of a type headroom does not know, skipped.
    pub unknown_events: IntCounterVec,
    /// Replay requests, by result (`filled`, `short`: the buffer no longer reached back far
    /// enough, `failed`).
    pub replays: IntCounterVec,
    state: FloatGaugeVec,
    blocks: FloatGaugeVec,
}

#[derive(Debug)]
struct AdmissionGauges {
    cap: FloatGaugeVec,
    admitted: FloatGaugeVec,
    queued: FloatGaugeVec,
    tokens: FloatGaugeVec,
    token_budget: FloatGaugeVec,
}

#[derive(Debug)]
struct BackendGauges {
    cold_start: FloatGaugeVec,
    in_flight: FloatGaugeVec,
    pending_prefill: FloatGaugeVec,
    decoding: FloatGaugeVec,
    healthy: FloatGaugeVec,
    ejected: FloatGaugeVec,
    in_flight_seconds: FloatCounterVec,
    capacity_seconds: FloatCounterVec,
    capped_in_flight_seconds: FloatCounterVec,
    ejections: FloatCounterVec,
    kv_usage: FloatGaugeVec,
    running: FloatGaugeVec,
    waiting: FloatGaugeVec,
    preemptions: FloatCounterVec,
    prefix_queries: FloatCounterVec,
    prefix_hits: FloatCounterVec,
    prefix_hit_ratio: FloatGaugeVec,
    index_blocks: FloatGaugeVec,
    restarts: FloatCounterVec,
}

/// Running totals already exported per replica, so counters advance by differences.
#[derive(Debug, Clone, Default)]
struct BackendTotals {
    /// The name its gauges were last set under.
    name: String,
    in_flight_seconds: f64,
    capacity_seconds: f64,
    capped_in_flight_seconds: f64,
    ejections: f64,
    engine: EngineGauges,
}

impl BackendTotals {
    /// The totals of `b`, by URL: a replica keeps its totals when a reload renames it (its
    /// state carries over), and another URL under an old name is another engine.
    fn of<'a>(
        last: &'a mut std::collections::HashMap<String, BackendTotals>,
        b: &Backend,
    ) -> &'a mut BackendTotals {
        let t = last.entry(b.url.clone()).or_default();
        t.name.clone_from(&b.name);
        t
    }
}

/// Labels of per-request measurements (`shadow`: `true` on a shadow copy's, whose `pool` is the
/// candidate pool).
pub const LABELS: &[&str] = &["pool", "class", "backend", "shadow"];

/// Shadow traffic, by the pool whose requests are mirrored.
#[derive(Debug)]
pub struct ShadowMetrics {
    /// Copies sent to the candidate pool.
    pub sent: IntCounterVec,
    /// Copies not sent, by reason (`busy`, `late`, `no_backend`).
    pub dropped: IntCounterVec,
    /// Copies in flight now.
    pub in_flight: prometheus::IntGaugeVec,
    /// Copies waiting for a slot now.
    pub waiting: prometheus::IntGaugeVec,
    /// Deterministic requests whose outputs were compared, by result (`match`, `mismatch`).
    pub compared: IntCounterVec,
    /// Deterministic copies not compared, by reason (`primary_failed`, `shadow_failed`,
    /// `primary_unknown`, `no_output`).
    pub uncompared: IntCounterVec,
    /// Of mismatches: the first output token that differs.
    pub diverged_at: HistogramVec,
    /// |shadow output tokens − primary output tokens| of compared requests.
    pub length_diff: HistogramVec,
}

impl ShadowMetrics {
    fn new() -> Self {
        let tokens = |name: &str, help: &str| {
            HistogramVec::new(
                HistogramOpts::new(name, help).buckets(vec![
                    0.0, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0,
                    4096.0, 16384.0,
                ]),
                &["pool"],
            )
            .expect("valid metric")
        };
        let gauge = |name: &str, help: &str| {
            prometheus::IntGaugeVec::new(Opts::new(name, help), &["pool"]).expect("valid metric")
        };
        Self {
            sent: counter(
                "headroom_shadow_sent_total",
                "Copies of this pool's requests sent to its shadow pool.",
                &["pool"],
            ),
            dropped: counter(
                "headroom_shadow_dropped_total",
                "Sampled copies not sent, by reason: busy (queue full), late (waited past max_wait_ms), no_backend.",
                &["pool", "reason"],
            ),
            in_flight: gauge(
                "headroom_shadow_in_flight",
                "Copies of this pool's requests in flight to its shadow pool.",
            ),
            waiting: gauge(
                "headroom_shadow_waiting",
                "Copies of this pool's requests waiting for a shadow slot.",
            ),
            compared: counter(
                "headroom_shadow_compared_total",
                "Deterministic requests whose primary and shadow outputs were compared, by result (match, mismatch).",
                &["pool", "result"],
            ),
            uncompared: counter(
                "headroom_shadow_uncompared_total",
                "Deterministic requests whose outputs could not be compared, by reason: primary_failed, shadow_failed, primary_unknown (the primary ended without a record), no_output.",
                &["pool", "reason"],
            ),
            diverged_at: tokens(
                "headroom_shadow_diverged_at_tokens",
                "Mismatched outputs: the first output token (stream event) at which the shadow's differs.",
            ),
            length_diff: tokens(
                "headroom_shadow_length_diff_tokens",
                "Compared outputs: |shadow output tokens - primary output tokens|.",
            ),
        }
    }
}

fn counter(name: &str, help: &str, labels: &[&str]) -> IntCounterVec {
    IntCounterVec::new(Opts::new(name, help), labels).expect("valid metric")
}

fn fgauge(name: &str, help: &str) -> FloatGaugeVec {
    FloatGaugeVec::new(Opts::new(name, help), &["backend"]).expect("valid metric")
}

fn fcounter(name: &str, help: &str) -> FloatCounterVec {
    FloatCounterVec::new(Opts::new(name, help), &["backend"]).expect("valid metric")
}

fn latency(name: &str, help: &str, labels: &[&str]) -> HistogramVec {
    HistogramVec::new(
        HistogramOpts::new(name, help).buckets(LATENCY_BUCKETS.to_vec()),
        labels,
    )
    .expect("valid metric")
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// A registry with every metric registered.
    pub fn new() -> Self {
        let m = Self {
            registry: Registry::new(),
            requests: counter(
                "headroom_requests_total",
                "Requests answered, by route, backend and status.",
                &["route", "backend", "status"],
            ),
            proxy_errors: counter(
                "headroom_proxy_errors_total",
                "Requests the proxy answered itself, by reason.",
                &["reason"],
            ),
            retries: counter(
                "headroom_upstream_retries_total",
                "Attempts retried on another replica before any response byte reached the client.",
                &["reason"],
            ),
            retries_over_budget: IntCounter::new(
                "headroom_retries_over_budget_total",
                "Retries not made because the retry budget (limits.retry_budget_*) was spent; the failure went to the client.",
            )
            .expect("valid metric"),
            upstream_stale_connections: IntCounter::new(
                "headroom_upstream_stale_connections_total",
                "Pooled connections to plaintext replicas that failed within 1 s of a request being written to them, before any byte of an answer (closed by the replica while idle, or the replica died); the request went again on a new connection. A steady rise: timeouts.pool_idle_ms outlasts the engines' keep-alive timeout.",
            )
            .expect("valid metric"),
            open_requests: prometheus::IntGauge::new(
                "headroom_open_requests",
                "Requests open at the proxy: read, queued, forwarded or being relayed.",
            )
            .expect("valid metric"),
            slow_headers_closed: IntCounter::new(
                "headroom_slow_header_connections_closed_total",
                "Connections closed because a request header did not arrive whole within timeouts.header_read_ms (slowloris).",
            )
            .expect("valid metric"),
            key_requests: counter(
                "headroom_key_requests_total",
                "Requests made with each client API key, by outcome (accepted, rate_limited).",
                &["key", "outcome"],
            ),
            uninspectable: IntCounter::new(
                "headroom_uninspectable_requests_total",
                "Generation requests whose body could not be inspected; routed without prefix information and left to the engine to judge.",
            )
            .expect("valid metric"),
            engine_tokens_failed: IntCounter::new(
                "headroom_engine_tokens_failed_total",
                "Requests whose engine tokens (chat template, tokenizer) could not be made for kv_events.hash = vllm_sha256_cbor; routed on headroom's own chain.",
            )
            .expect("valid metric"),
            routed: counter(
                "headroom_route_decisions_total",
                "Routing decisions, by policy and backend.",
                &["policy", "backend"],
            ),
            peer_polls: counter(
                "headroom_peer_polls_total",
                "Polls of the peer proxies' work in flight ([peers]), by result: ok, unmatched (the report named a replica this proxy does not have: backend URLs must be spelled alike; the rest counted), self (this proxy's own address among the peers'), stale (older than a report already heard from that peer, skipped), failed (or a name that did not resolve).",
                &["result"],
            ),
            peer_pushes: counter(
                "headroom_peer_pushes_total",
                "Reports of work in flight pushed between peer proxies ([peers]), by direction (sent, received) and result: sent by the peer's answer, ok, unknown (403), unauthorized (401), refused (404) or failed (any other answer, or none in time); received ok, unmatched, self, stale (older than one already heard, skipped), unknown (from an address none of peers.addresses resolves to, unless peers.any_address), unauthorized (without the peers' token), invalid (not a load report, or over 64 KiB) or refused (this proxy has no [peers]).",
                &["direction", "result"],
            ),
            peers_live: prometheus::IntGauge::new(
                "headroom_peers_live",
                "Peer proxies heard from within peers.expire_ms: their work on the replicas counts in routing.",
            )
            .expect("valid metric"),
            peer_work: FloatGaugeVec::new(
                Opts::new(
                    "headroom_peer_work",
                    "Work the live peer proxies report on each replica: requests, prefill_tokens (uncached, not yet done), decoding.",
                ),
                &["backend", "kind"],
            )
            .expect("valid metric"),
            routed_prompt_tokens: IntCounter::new(
                "headroom_routed_prompt_tokens_total",
                "Prompt tokens of routed generation requests.",
            )
            .expect("valid metric"),
            routed_matched_tokens: IntCounter::new(
                "headroom_routed_matched_tokens_total",
                "Prompt tokens the policy expected the chosen replica to hold in its prefix cache.",
            )
            .expect("valid metric"),
            ttft: latency(
                "headroom_request_ttft_seconds",
                "Request arrival to the first output-bearing event (a non-streamed response: its end).",
                LABELS,
            ),
            itl: latency(
                "headroom_request_itl_seconds",
                "Gaps between consecutive output-bearing events of a stream.",
                LABELS,
            ),
            tpot: latency(
                "headroom_request_tpot_seconds",
                "(last output event - first output event) / (output tokens - 1), streams with 2+ tokens.",
                LABELS,
            ),
            e2e: latency(
                "headroom_request_e2e_seconds",
                "Request arrival to the end of the response.",
                LABELS,
            ),
            queue: latency(
                "headroom_request_queue_seconds",
                "Request arrival to dispatch to a replica (body read, inspection, routing, admission).",
                LABELS,
            ),
            prefill: latency(
                "headroom_request_prefill_seconds",
                "Dispatch to the first output-bearing event: the engine's queue and prefill, seen from the proxy.",
                LABELS,
            ),
            prompt_tokens: counter(
                "headroom_prompt_tokens_total",
                "Prompt tokens of finished generation requests (engine usage, else the proxy's count).",
                LABELS,
            ),
            completion_tokens: counter(
                "headroom_completion_tokens_total",
                "Output tokens of finished generation requests (engine usage, else output events).",
                LABELS,
            ),
            slo_requests: counter(
                "headroom_slo_requests_total",
                "Finished generation requests by result: good (completed within every objective), slow (completed, missed one), failed.",
                &["pool", "class", "result"],
            ),
            slo_missed: counter(
                "headroom_slo_missed_total",
                "Completed requests that missed an objective, by objective (ttft, tpot, e2e).",
                &["pool", "class", "objective"],
            ),
            goodput_requests: counter(
                "headroom_goodput_requests_total",
                "Requests that completed within their class's objectives; its rate is goodput.",
                &["pool", "class"],
            ),
            goodput_tokens: counter(
                "headroom_goodput_tokens_total",
                "Output tokens of requests that completed within their class's objectives.",
                &["pool", "class"],
            ),
            capture: capture::CaptureCounters {
                written: IntCounter::new(
                    "headroom_capture_records_total",
                    "Trace records written to the capture file.",
                )
                .expect("valid metric"),
                dropped: counter(
                    "headroom_capture_dropped_total",
                    "Trace records lost, by reason (buffer_full, write_error).",
                    &["reason"],
                ),
                rotations: IntCounter::new(
                    "headroom_capture_rotations_total",
                    "Capture files rotated.",
                )
                .expect("valid metric"),
            },
            capture_skipped: counter(
                "headroom_capture_skipped_total",
                "Requests deliberately not captured, by reason (sampled_out, no_prompt).",
                &["reason"],
            ),
            refused: counter(
                "headroom_admission_refused_total",
                "Requests refused at admission, by reason (queue_full: 429, queue_timeout: 503).",
                &["pool", "class", "reason"],
            ),
            cap_changes: counter(
                "headroom_admission_cap_changes_total",
                "Admission cap changes, by direction (raised, cut) and reason (feedback: the engine's gauges; context: the planned cap moved with the length of the replica's requests).",
                &["backend", "direction", "reason"],
            ),
            displaced: counter(
                "headroom_admission_displaced_total",
                "Generation requests sent to another replica than the one the prefix-aware routing policy chose for them, because that one had no room (at its admission cap, or held for a waiter ahead): why = full (went at once to one with room), queued (waited in the queue, then took the first slot that freed) or waited (waited for that replica, then went where there was room). Counted once per request (its first attempt).",
                &["pool", "why"],
            ),
            displaced_matched_tokens: counter(
                "headroom_admission_displaced_matched_tokens_total",
                "Prompt tokens the replica routing chose was expected to hold cached beyond what the replica a displaced request went to holds: prefill the admission caps cost.",
                &["pool"],
            ),
            prefix_waits: counter(
                "headroom_admission_prefix_waits_total",
                "Admitted requests that waited for their routing choice at its cap because it holds at least admission.prefix_wait_min_tokens more of their prompt, at most as long as prefilling those would take at admission.prefill_tokens_per_s (those that then went elsewhere are displaced_total{why=\"waited\"}).",
                &["pool"],
            ),
            admission: AdmissionGauges {
                cap: fgauge(
                    "headroom_admission_cap",
                    "Requests the replica may have in flight at once (absent: not yet known).",
                ),
                admitted: fgauge(
                    "headroom_admission_in_flight",
                    "Admission permits held on the replica.",
                ),
                tokens: fgauge(
                    "headroom_admission_tokens_in_flight",
                    "Prompt + max_tokens of the requests admitted to the replica.",
                ),
                token_budget: fgauge(
                    "headroom_admission_token_budget",
                    "The most tokens the replica's admitted requests may come to (absent: no budget).",
                ),
                queued: FloatGaugeVec::new(
                    Opts::new(
                        "headroom_queue_depth",
                        "Requests waiting at the proxy for a replica with room, by class.",
                    ),
                    &["class"],
                )
                .expect("valid metric"),
            },
            route_seconds: Histogram::with_opts(
                HistogramOpts::new(
                    "headroom_route_seconds",
                    "Time the routing policy took to pick a replica.",
                )
                .buckets(vec![1e-6, 2e-6, 5e-6, 1e-5, 2e-5, 5e-5, 1e-4, 1e-3, 1e-2]),
            )
            .expect("valid metric"),
            inspect_seconds: HistogramVec::new(
                HistogramOpts::new(
                    "headroom_inspect_seconds",
                    "Time to inspect a generation request's body (parse, render, tokenize, hash), by where it ran: worker, or blocking_pool for large bodies (including the wait for a slot there).",
                )
                .buckets(vec![
                    1e-5, 2e-5, 5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2, 5e-2,
                ]),
                &["on"],
            )
            .expect("valid metric"),
            upstream_cut: counter(
                "headroom_upstream_cut_total",
                "Responses cut by the replica or the idle timeout after they started.",
                &["backend"],
            ),
            client_aborts: counter(
                "headroom_client_aborts_total",
                "Clients that went away before their response finished (the upstream request is cancelled).",
                &["backend"],
            ),
            backend: BackendGauges {
                cold_start: FloatGaugeVec::new(
                    Opts::new(
                        "headroom_backend_cold_start_seconds",
                        "The replica's latest cold start: from first seen (or seen down) until its first passing health probe (until=\"healthy\") and its first served token (until=\"first_token\").",
                    ),
                    &["backend", "until"],
                )
                .expect("valid metric"),
                in_flight: fgauge(
                    "headroom_backend_in_flight",
                    "Requests the proxy has in flight to the replica.",
                ),
                pending_prefill: fgauge(
                    "headroom_backend_pending_prefill_tokens",
                    "Uncached prompt tokens of in-flight requests that have not produced output.",
                ),
                decoding: fgauge(
                    "headroom_backend_decoding",
                    "In-flight requests past their first output.",
                ),
                healthy: fgauge(
                    "headroom_backend_healthy",
                    "1 when active health probes pass.",
                ),
                ejected: fgauge(
                    "headroom_backend_ejected",
                    "1 while the replica is passively ejected.",
                ),
                in_flight_seconds: fcounter(
                    "headroom_backend_in_flight_seconds_total",
                    "Integral of in-flight requests over time; its rate is the mean in-flight count.",
                ),
                capacity_seconds: fcounter(
                    "headroom_backend_capacity_seconds_total",
                    "Integral of the replica's admission cap over time (while one is known); with headroom_backend_capped_in_flight_seconds_total, its utilisation.",
                ),
                capped_in_flight_seconds: fcounter(
                    "headroom_backend_capped_in_flight_seconds_total",
                    "Integral of in-flight requests over the time a cap is known: rate(this) / rate(capacity_seconds) is the utilisation.",
                ),
                ejections: fcounter(
                    "headroom_backend_ejections_total",
                    "Passive ejections of the replica.",
                ),
                kv_usage: fgauge(
                    "headroom_engine_kv_cache_usage_ratio",
                    "The engine's KV cache usage, 0..1, as last scraped.",
                ),
                running: fgauge(
                    "headroom_engine_requests_running",
                    "Sequences the engine is running, as last scraped.",
                ),
                waiting: fgauge(
                    "headroom_engine_requests_waiting",
                    "Sequences waiting in the engine's own queue, as last scraped.",
                ),
                preemptions: fcounter(
                    "headroom_engine_preemptions_total",
                    "Preemptions reported by the engine.",
                ),
                prefix_queries: fcounter(
                    "headroom_engine_prefix_cache_queries_tokens_total",
                    "Prompt tokens the engine looked up in its prefix cache.",
                ),
                prefix_hits: fcounter(
                    "headroom_engine_prefix_cache_hits_tokens_total",
                    "Prompt tokens the engine found in its prefix cache.",
                ),
                index_blocks: fgauge(
                    "headroom_prefix_index_blocks",
                    "Blocks the approximate prefix index holds for a replica (bounded by its KV capacity in blocks).",
                ),
                prefix_hit_ratio: fgauge(
                    "headroom_engine_prefix_cache_hit_ratio",
                    "Prefix-cache hits over queries between the last two scrapes.",
                ),
                restarts: fcounter(
                    "headroom_engine_restarts_total",
                    "Engine restarts found by the scrape (its start time changed or a counter went back); each one empties the proxy's approximate prefix history of the replica.",
                ),
            },
            backend_pool: FloatGaugeVec::new(
                Opts::new(
                    "headroom_backend_pool",
                    "1 for each replica and the pool it belongs to, for joining per-replica series by pool.",
                ),
                &["backend", "pool"],
            )
            .expect("valid metric"),
            cost: FloatGaugeVec::new(
                Opts::new(
                    "headroom_cost_per_million_tokens",
                    "What a million tokens cost at the last 5 minutes' throughput, from [cost] replica_hour (tokens=\"output\" or \"all\": prompt and output).",
                ),
                &["tokens"],
            )
            .expect("valid metric"),
            last: Mutex::new(std::collections::HashMap::new()),
            shadow: ShadowMetrics::new(),
            kv_events: KvEventCounters {
                batches: counter(
                    "headroom_kv_events_batches_total",
                    "KV event batches applied to the exact prefix index.",
                    &["backend"],
                ),
                gaps: counter(
                    "headroom_kv_events_gaps_total",
                    "Gaps in a replica's KV event sequence numbers.",
                    &["backend"],
                ),
                losses: counter(
                    "headroom_kv_events_losses_total",
                    "KV event gaps the replay could not fill (the replica's picture restarted, partial).",
                    &["backend"],
                ),
                restarts: counter(
                    "headroom_kv_events_restarts_total",
                    "Engine restarts seen in a replica's KV event stream.",
                    &["backend"],
                ),
                decode_errors: counter(
                    "headroom_kv_events_decode_errors_total",
                    "KV event messages that could not be decoded.",
                    &["backend"],
                ),
                unknown_events: counter(
                    "headroom_kv_events_unknown_total",
                    "KV events of a type headroom does not know (skipped).",
                    &["backend"],
                ),
                replays: counter(
                    "headroom_kv_events_replays_total",
                    "KV event replay requests, by result (filled, short, failed).",
                    &["backend", "result"],
                ),
                state: FloatGaugeVec::new(
                    Opts::new(
                        "headroom_kv_events_state",
                        "1 for the state of a replica's KV event stream (live, partial, stale, missing); routing uses the exact index only when live.",
                    ),
                    &["backend", "state"],
                )
                .expect("valid metric"),
                blocks: fgauge(
                    "headroom_kv_events_blocks",
                    "Distinct blocks a replica's engine reports holding.",
                ),
            },
        };
        let r = &m.registry;
        let b = &m.backend;
        let all: Vec<Box<dyn prometheus::core::Collector>> = vec![
            Box::new(m.requests.clone()),
            Box::new(m.proxy_errors.clone()),
            Box::new(m.retries.clone()),
            Box::new(m.key_requests.clone()),
            Box::new(m.slow_headers_closed.clone()),
            Box::new(m.open_requests.clone()),
            Box::new(m.retries_over_budget.clone()),
            Box::new(m.upstream_stale_connections.clone()),
            Box::new(m.uninspectable.clone()),
            Box::new(m.engine_tokens_failed.clone()),
            Box::new(m.routed.clone()),
            Box::new(m.peer_polls.clone()),
            Box::new(m.peer_pushes.clone()),
            Box::new(m.peers_live.clone()),
            Box::new(m.peer_work.clone()),
            Box::new(m.routed_prompt_tokens.clone()),
            Box::new(m.routed_matched_tokens.clone()),
            Box::new(m.ttft.clone()),
            Box::new(m.itl.clone()),
            Box::new(m.tpot.clone()),
            Box::new(m.e2e.clone()),
            Box::new(m.queue.clone()),
            Box::new(m.prefill.clone()),
            Box::new(m.prompt_tokens.clone()),
            Box::new(m.completion_tokens.clone()),
            Box::new(m.slo_requests.clone()),
            Box::new(m.slo_missed.clone()),
            Box::new(m.goodput_requests.clone()),
            Box::new(m.goodput_tokens.clone()),
            Box::new(m.capture.written.clone()),
            Box::new(m.capture.dropped.clone()),
            Box::new(m.capture.rotations.clone()),
            Box::new(m.capture_skipped.clone()),
            Box::new(m.refused.clone()),
            Box::new(m.cap_changes.clone()),
            Box::new(m.displaced.clone()),
            Box::new(m.displaced_matched_tokens.clone()),
            Box::new(m.prefix_waits.clone()),
            Box::new(m.admission.cap.clone()),
            Box::new(m.admission.admitted.clone()),
            Box::new(m.admission.queued.clone()),
            Box::new(m.admission.tokens.clone()),
            Box::new(m.admission.token_budget.clone()),
            Box::new(m.route_seconds.clone()),
            Box::new(m.inspect_seconds.clone()),
            Box::new(m.upstream_cut.clone()),
            Box::new(m.client_aborts.clone()),
            Box::new(b.in_flight.clone()),
            Box::new(b.pending_prefill.clone()),
            Box::new(b.decoding.clone()),
            Box::new(b.healthy.clone()),
            Box::new(b.ejected.clone()),
            Box::new(b.cold_start.clone()),
            Box::new(b.in_flight_seconds.clone()),
            Box::new(b.capacity_seconds.clone()),
            Box::new(b.capped_in_flight_seconds.clone()),
            Box::new(b.ejections.clone()),
            Box::new(b.kv_usage.clone()),
            Box::new(b.running.clone()),
            Box::new(b.waiting.clone()),
            Box::new(b.preemptions.clone()),
            Box::new(b.prefix_queries.clone()),
            Box::new(b.prefix_hits.clone()),
            Box::new(b.prefix_hit_ratio.clone()),
            Box::new(b.index_blocks.clone()),
            Box::new(b.restarts.clone()),
            Box::new(m.kv_events.batches.clone()),
            Box::new(m.kv_events.gaps.clone()),
            Box::new(m.kv_events.losses.clone()),
            Box::new(m.kv_events.restarts.clone()),
            Box::new(m.kv_events.decode_errors.clone()),
            Box::new(m.kv_events.unknown_events.clone()),
            Box::new(m.kv_events.replays.clone()),
            Box::new(m.kv_events.state.clone()),
            Box::new(m.kv_events.blocks.clone()),
            Box::new(m.backend_pool.clone()),
            Box::new(m.cost.clone()),
            Box::new(m.shadow.sent.clone()),
            Box::new(m.shadow.dropped.clone()),
            Box::new(m.shadow.in_flight.clone()),
            Box::new(m.shadow.waiting.clone()),
            Box::new(m.shadow.compared.clone()),
            Box::new(m.shadow.uncompared.clone()),
            Box::new(m.shadow.diverged_at.clone()),
            Box::new(m.shadow.length_diff.clone()),
        ];
        for c in all {
            r.register(c).expect("unique metric names");
        }
        // The standard process metrics an operator's dashboards already know
        // (process_resident_memory_bytes, process_cpu_seconds_total, process_open_fds, …).
        #[cfg(target_os = "linux")]
        r.register(Box::new(
            prometheus::process_collector::ProcessCollector::for_self(),
        ))
        .expect("unique metric names");
        m
    }

    /// Records a scrape of `b`'s engine: counters advance by what the engine's counters advanced
    /// (after a restart, where they fall or the start time changed, by the new engine's whole
    /// count), and `restarted` counts one.
    pub fn engine_scraped(&self, b: &Backend, g: &EngineGauges, restarted: bool) {
        let name = b.name.as_str();
        let bg = &self.backend;
        let restarts = bg.restarts.with_label_values(&[name]);
        if restarted {
            restarts.inc();
        }
        let set = |v: &FloatGaugeVec, x: Option<f64>| {
            if let Some(x) = x {
                v.with_label_values(&[name]).set(x);
            }
        };
        set(&bg.kv_usage, g.kv_usage);
        set(&bg.running, g.running);
        set(&bg.waiting, g.waiting);
        let mut last = self.last.lock().unwrap_or_else(|e| e.into_inner());
        let prev = &mut BackendTotals::of(&mut last, b).engine;
        let advance = |v: &FloatCounterVec, now: Option<f64>, before: Option<f64>| -> f64 {
            let Some(now) = now else { return 0.0 };
            // A new engine counts from zero, even one that passed the old count between scrapes.
            let d = match before {
                Some(b) if now >= b && !restarted => now - b,
                _ => now,
            };
            v.with_label_values(&[name]).inc_by(d);
            d
        };
        advance(&bg.preemptions, g.preemptions_total, prev.preemptions_total);
        let dq = advance(
            &bg.prefix_queries,
            g.prefix_queries_total,
            prev.prefix_queries_total,
        );
        let dh = advance(&bg.prefix_hits, g.prefix_hits_total, prev.prefix_hits_total);
        if dq > 0.0 {
            bg.prefix_hit_ratio.with_label_values(&[name]).set(dh / dq);
        }
        *prev = g.clone();
    }

    /// Which pool each replica is in, as of the config now serving (a reload's changes replace
    /// the previous pairs).
    pub fn refresh_pools(&self, cfg: &headroom_config::serve::ServeConfig) {
        self.backend_pool.reset();
        for pool in cfg.pool_list() {
            for b in &pool.backends {
                self.backend_pool
                    .with_label_values(&[b.as_str(), pool.name.as_str()])
                    .set(1.0);
            }
        }
    }

    /// The cost gauges from `/stats`' cost (absent while no price is set or nothing was served).
    pub fn refresh_cost(&self, cost: Option<serde_json::Value>) {
        self.cost.reset();
        let Some(cost) = cost else { return };
        for (tokens, key) in [
            ("output", "per_million_output_tokens"),
            ("all", "per_million_tokens"),
        ] {
            if let Some(v) = cost[key].as_f64() {
                self.cost.with_label_values(&[tokens]).set(v);
            }
        }
    }

    /// Sets each replica's prefix-index size from the policy (history-based policies only).
    pub fn refresh_index(&self, fleet: &Fleet, policy: &dyn crate::routing::RoutingPolicy) {
        for b in &fleet.backends {
            if let Some(n) = policy.index_blocks(b.id) {
                self.backend
                    .index_blocks
                    .with_label_values(&[b.name.as_str()])
                    .set(n as f64);
            }
        }
    }

    /// Reads the fleet's per-replica state into the gauges. A replica no longer in the fleet (a
    /// reload removed it) loses its gauges, so no alert keeps reading its last state.
    pub fn refresh(&self, fleet: &Fleet) {
        let bg = &self.backend;
        let mut last = self.last.lock().unwrap_or_else(|e| e.into_inner());
        // Gauges are by name: a name the fleet no longer has (its replica left, or a reload renamed
        // it) loses them, so no alert keeps reading its last state.
        let mut gone: Vec<String> = Vec::new();
        last.retain(|url, t| {
            let kept = fleet.backends.iter().find(|b| &b.url == url);
            if kept.is_none_or(|b| b.name != t.name) {
                gone.push(t.name.clone());
            }
            kept.is_some()
        });
        gone.retain(|n| !n.is_empty() && !fleet.backends.iter().any(|b| &b.name == n));
        for name in gone {
            for g in [
                &bg.in_flight,
                &bg.pending_prefill,
                &bg.decoding,
                &bg.healthy,
                &bg.ejected,
                &bg.kv_usage,
                &bg.running,
                &bg.waiting,
                &bg.index_blocks,
                &bg.prefix_hit_ratio,
            ] {
                let _ = g.remove_label_values(&[name.as_str()]);
            }
            for until in ["healthy", "first_token"] {
                let _ = bg.cold_start.remove_label_values(&[name.as_str(), until]);
            }
        }
        for b in &fleet.backends {
            let name = [b.name.as_str()];
            let l = b.load();
            bg.in_flight
                .with_label_values(&name)
                .set(f64::from(l.in_flight));
            bg.pending_prefill
                .with_label_values(&name)
                .set(l.pending_prefill_tokens as f64);
            bg.decoding
                .with_label_values(&name)
                .set(f64::from(l.decoding));
            bg.healthy
                .with_label_values(&name)
                .set(f64::from(u8::from(b.probe_healthy())));
            bg.ejected
                .with_label_values(&name)
                .set(f64::from(u8::from(fleet.is_ejected(b))));
            let cold = b
                .cold_start
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .clone();
            for (until, d) in [
                ("healthy", cold.healthy_after()),
                ("first_token", cold.first_token_after()),
            ] {
                match d {
                    Some(d) => bg
                        .cold_start
                        .with_label_values(&[b.name.as_str(), until])
                        .set(d.as_secs_f64()),
                    // A cold start in progress: no value yet, rather than the previous one's.
                    None => {
                        let _ = bg.cold_start.remove_label_values(&[b.name.as_str(), until]);
                    }
                }
            }
            let t = BackendTotals::of(&mut last, b);
            // A replica a reload added (or a restart) starts its totals from zero: count from there.
            let since = |now: f64, before: f64| if now >= before { now - before } else { now };
            bg.in_flight_seconds
                .with_label_values(&name)
                .inc_by(since(l.in_flight_seconds, t.in_flight_seconds));
            t.in_flight_seconds = l.in_flight_seconds;
            bg.capacity_seconds
                .with_label_values(&name)
                .inc_by(since(l.capacity_seconds, t.capacity_seconds));
            t.capacity_seconds = l.capacity_seconds;
            bg.capped_in_flight_seconds
                .with_label_values(&name)
                .inc_by(since(
                    l.capped_in_flight_seconds,
                    t.capped_in_flight_seconds,
                ));
            t.capped_in_flight_seconds = l.capped_in_flight_seconds;
            let ej = b.ejections.load(std::sync::atomic::Ordering::Relaxed) as f64;
            bg.ejections
                .with_label_values(&name)
                .inc_by(since(ej, t.ejections));
            t.ejections = ej;
        }
    }

    /// Reads admission state into its gauges.
    pub fn refresh_admission(
        &self,
        fleet: &Fleet,
        admission: &crate::admission::Admission,
        classes: &[&str],
    ) {
        let snapshot = admission.snapshot();
        for (b, r) in fleet.backends.iter().zip(&snapshot.replicas) {
            let name = [b.name.as_str()];
            // A gauge with no value yet is absent rather than 0.
            let set_or_remove = |g: &FloatGaugeVec, v: Option<f64>| match v {
                Some(v) => g.with_label_values(&name).set(v),
                None => {
                    let _ = g.remove_label_values(&name);
                }
            };
            set_or_remove(&self.admission.cap, r.cap.map(f64::from));
            set_or_remove(
                &self.admission.token_budget,
                r.token_budget.map(|t| t as f64),
            );
            self.admission
                .admitted
                .with_label_values(&name)
                .set(f64::from(r.admitted));
            self.admission
                .tokens
                .with_label_values(&name)
                .set(r.tokens as f64);
        }
        // Every configured class has a series (0 while none of it waits), so an empty queue reads
        // 0 rather than no data; a class a reload dropped loses its series.
        self.admission.queued.reset();
        for class in classes {
            self.admission.queued.with_label_values(&[class]).set(0.0);
        }
        for (class, n) in snapshot.queued {
            self.admission
                .queued
                .with_label_values(&[&class])
                .set(n as f64);
        }
    }

    /// Sets the peer gauges from the peers' last reports.
    pub fn refresh_peers(&self, fleet: &Fleet) {
        // A reload may have dropped [peers] or a replica: no series outlives its source.
        self.peer_work.reset();
        let Some(peers) = &fleet.peers else {
            self.peers_live.set(0);
            return;
        };
        let now = std::time::Instant::now();
        let live = peers.states(now).iter().filter(|p| p.live).count();
        self.peers_live.set(live as i64);
        for (b, w) in fleet.backends.iter().zip(peers.foreign(now)) {
            for (kind, v) in [
                ("requests", f64::from(w.in_flight)),
                ("prefill_tokens", w.pending_prefill_tokens as f64),
                ("decoding", f64::from(w.decoding)),
            ] {
                self.peer_work
                    .with_label_values(&[b.name.as_str(), kind])
                    .set(v);
            }
        }
    }

    /// Sets the KV event stream gauges from the exact index.
    pub fn refresh_kv_events(&self, fleet: &Fleet, index: &crate::routing::KvIndex) {
        let now = std::time::Instant::now();
        for b in &fleet.backends {
            let state = index.state(b.id, now);
            for s in crate::routing::StreamState::ALL {
                self.kv_events
                    .state
                    .with_label_values(&[b.name.as_str(), s.name()])
                    .set(if s == state { 1.0 } else { 0.0 });
            }
            self.kv_events
                .blocks
                .with_label_values(&[b.name.as_str()])
                .set(index.held(b.id) as f64);
        }
    }

    /// Each replica's state for `/stats`: the proxy's own counts and the engine's last gauges.
    pub fn backend_stats(&self, fleet: &Fleet) -> Vec<serde_json::Value> {
        let last = self.last.lock().unwrap_or_else(|e| e.into_inner());
        fleet
            .backends
            .iter()
            .map(|b| {
                let l = b.load();
                let cold = b
                    .cold_start
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .clone();
                let g = last
                    .get(&b.url)
                    .map(|t| t.engine.clone())
                    .unwrap_or_default();
                let ratio = self
                    .backend
                    .prefix_hit_ratio
                    .get_metric_with_label_values(&[&b.name])
                    .ok()
                    .map(|m| m.get());
                serde_json::json!({
                    "name": b.name,
                    "url": b.url,
                    "healthy": b.probe_healthy(),
                    "ejected": fleet.is_ejected(b),
                    "in_flight": l.in_flight,
                    "pending_prefill_tokens": l.pending_prefill_tokens,
                    "decoding": l.decoding,
                    "cold_start_s": {
                        "healthy": cold.healthy_after().map(|d| d.as_secs_f64()),
                        "first_token": cold.first_token_after().map(|d| d.as_secs_f64()),
                    },
                    "engine": {
                        "kv_cache_usage": g.kv_usage,
                        "requests_running": g.running,
                        "requests_waiting": g.waiting,
                        "preemptions_total": g.preemptions_total,
                        "prefix_cache_hit_ratio": ratio,
                    },
                })
            })
            .collect()
    }

    /// Adds a collector the embedding program owns (the binary's allocator statistics).
    pub fn register(&self, c: Box<dyn prometheus::core::Collector>) -> prometheus::Result<()> {
        self.registry.register(c)
    }

    /// The Prometheus text exposition of every metric.
    pub fn render(&self) -> Vec<u8> {
        let mut out = Vec::new();
        // Encoding into a Vec cannot fail.
        let _ = TextEncoder::new().encode(&self.registry.gather(), &mut out);
        out
    }
}

#[cfg(test)]
mod tests {
    use headroom_config::serve::{BackendConfig, HealthConfig};

    use super::*;
    use crate::upstreams::Fleet;

    #[test]
    fn after_a_restart_engine_counters_advance_by_the_new_engines_whole_count() {
        let m = Metrics::new();
        let fleet = Fleet::new(
            &[BackendConfig::at("http://127.0.0.1:9")],
            HealthConfig::default(),
        )
        .unwrap();
        let b = &fleet.backends[0];
        let scrape = |queries: f64, start: f64| EngineGauges {
            prefix_queries_total: Some(queries),
            process_start_time: Some(start),
            ..EngineGauges::default()
        };
        let queries = || m.backend.prefix_queries.with_label_values(&[&b.name]).get();
        let restarts = || m.backend.restarts.with_label_values(&[&b.name]).get();
        m.engine_scraped(b, &scrape(1000.0, 1.0), false);
        m.engine_scraped(b, &scrape(1500.0, 1.0), false);
        assert_eq!((queries(), restarts()), (1500.0, 0.0));
        // A new engine that looked up 2,000 tokens before the next scrape: every one is new,
        // though the count is above the old engine's.
        let after = scrape(2000.0, 100.0);
        let restarted = after.restarted_since(&scrape(1500.0, 1.0));
        assert!(restarted);
        m.engine_scraped(b, &after, restarted);
        assert_eq!((queries(), restarts()), (3500.0, 1.0));
        // A counter that fell is a new engine's whole count too.
        m.engine_scraped(b, &scrape(300.0, 100.0), true);
        assert_eq!((queries(), restarts()), (3800.0, 2.0));
    }
}
