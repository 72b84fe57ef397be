//! Live shadowing: a sampled share of a pool's requests is copied to a candidate pool off the
//! request path. The client only ever gets the primary's answer; the copy's response is measured
//! (metrics with `shadow="true"`, its own `/stats` windows, a capture record marked `shadow`),
//! compared with the primary's output when sampling is deterministic, and discarded.
//!
//! ```text
//! mirrored(request)  ⇔  xxh3(request_id) < fraction · 2^64          (every proxy agrees)
//! a copy is sent     ⇔  a slot is free now, or frees within max_wait_ms while ≤ max_queue wait
//! dropped, counted   :  busy (queue full) · late (waited max_wait_ms) · no_backend
//! ```
//!
//! | parameter | default | meaning |
//! |---|---|---|
//! | `fraction` | 1.0 | share of the pool's requests copied |
//! | `max_in_flight` | 64 | copies in flight at once |
//! | `max_queue` | 64 | copies waiting for a slot |
//! | `max_wait_ms` | 1000 | longest wait for a slot |
//! | `compare` | true | compare outputs of deterministic requests |
//!
//! Nothing here can hold the primary back: the primary never waits on a copy, a copy never takes
//! an admission permit, and the primary's end is handed over on a one-shot channel that cannot
//! block. The comparison keeps only hashes (`headroom_workload::digest`), never text.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant, SystemTime};

use bytes::Bytes;
use headroom_config::serve::{ServeConfig, ShadowConfig};
use headroom_workload::digest::Fingerprint;
use headroom_workload::measure::{ResponseMeter, ResponseTiming};
use headroom_workload::trace::ShadowFields;
use tokio::sync::{OwnedSemaphorePermit, Semaphore, oneshot};

use crate::app::PoolPlan;
use crate::record::{Outcome, PromptFacts, Recorder};
use crate::routing::{RouteRequest, RoutingPolicy};
use crate::upstreams::{Fleet, InFlight};

/// One primary pool's shadow.
#[derive(Debug)]
pub struct Shadow {
    /// The pool whose requests are copied.
    pub primary: String,
    /// The candidate pool.
    pub target: String,
    /// `members[backend id]`: the backend belongs to the candidate pool.
    members: Vec<bool>,
    cfg: ShadowConfig,
    slots: Arc<Semaphore>,
    waiting: AtomicU32,
}

/// The shadows of one config, and what sending copies needs.
pub struct Shadows {
    shadows: Vec<Arc<Shadow>>,
    fleet: Arc<Fleet>,
    policy: Arc<dyn RoutingPolicy>,
    http: reqwest::Client,
    recorder: Arc<Recorder>,
    block_tokens: u32,
    first_byte: Duration,
    idle: Duration,
    max_event: usize,
}

impl std::fmt::Debug for Shadows {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shadows")
            .field("shadows", &self.shadows)
            .finish_non_exhaustive()
    }
}

/// A request to copy.
#[derive(Debug)]
pub struct Copy {
    /// Class of the primary.
    pub class: String,
    /// The request id (the copy carries the same `x-request-id`).
    pub request_id: String,
    /// Path and query.
    pub path: String,
    /// Headers to send (already stripped of hop-by-hop, client-credential and forwarding ones).
    pub headers: http::HeaderMap,
    /// The body as the primary sent it.
    pub body: Bytes,
    /// What inspection learnt.
    pub facts: Option<PromptFacts>,
    /// Sampling is deterministic: the outputs should be equal.
    pub deterministic: bool,
    /// Wall-clock arrival.
    pub arrival: SystemTime,
}

/// How the primary ended, as its copy needs to know.
#[derive(Debug)]
struct PrimaryEnd {
    completed: bool,
    output: Option<Fingerprint>,
    output_tokens: u64,
}

/// The primary side of a copy: the request's context holds it until the primary's record is
/// finished. Dropped without a word (the primary failed early): the copy is not compared.
#[derive(Debug)]
pub struct MirrorLink {
    tx: Option<oneshot::Sender<PrimaryEnd>>,
}

impl MirrorLink {
    /// The primary's response should be digested for a comparison.
    pub fn wants_digest(&self) -> bool {
        self.tx.is_some()
    }

    /// Hands the primary's end to its copy (never blocks).
    pub fn primary_ended(self, completed: bool, timing: &ResponseTiming) {
        if let Some(tx) = self.tx {
            let _ = tx.send(PrimaryEnd {
                completed,
                output: timing.output.clone(),
                output_tokens: timing.output_tokens(),
            });
        }
    }
}

/// Whether `request_id` is in the sampled `fraction` (the same answer on every proxy).
pub fn sampled(request_id: &str, fraction: f64) -> bool {
    if fraction >= 1.0 {
        return true;
    }
    let h = xxhash_rust::xxh3::xxh3_64_with_seed(request_id.as_bytes(), 0x5AAD_0C0F);
    (h as f64) < fraction * u64::MAX as f64
}

/// Counts one waiting copy until dropped.
struct Waiting {
    shadow: Arc<Shadow>,
    gauge: prometheus::IntGauge,
}

impl Drop for Waiting {
    fn drop(&mut self) {
        self.shadow.waiting.fetch_sub(1, Ordering::AcqRel);
        self.gauge.dec();
    }
}

/// A copy's place: a slot held, or a place in the queue for one.
enum Slot {
    Held(OwnedSemaphorePermit),
    Waiting(Waiting),
}

/// Counts one copy in flight until dropped.
struct Flying(prometheus::IntGauge);

impl Drop for Flying {
    fn drop(&mut self) {
        self.0.dec();
    }
}

impl Shadows {
    /// The shadows `cfg` configures, or `None` when no pool shadows.
    pub fn new(
        cfg: &ServeConfig,
        pools: &[PoolPlan],
        fleet: Arc<Fleet>,
        policy: Arc<dyn RoutingPolicy>,
        http: reqwest::Client,
        recorder: Arc<Recorder>,
        block_tokens: u32,
    ) -> Option<Arc<Self>> {
        let shadows: Vec<Arc<Shadow>> = cfg
            .pools
            .iter()
            .filter_map(|p| {
                let s = p.shadow.as_ref()?;
                let target = pools.iter().find(|t| t.name == s.pool)?;
                Some(Arc::new(Shadow {
                    primary: p.name.clone(),
                    target: s.pool.clone(),
                    members: target.members.clone(),
                    cfg: s.clone(),
                    slots: Arc::new(Semaphore::new(s.max_in_flight as usize)),
                    waiting: AtomicU32::new(0),
                }))
            })
            .collect();
        (!shadows.is_empty()).then(|| {
            Arc::new(Self {
                shadows,
                fleet,
                policy,
                http,
                recorder,
                block_tokens,
                first_byte: Duration::from_millis(cfg.timeouts.first_byte_ms),
                idle: Duration::from_millis(cfg.timeouts.idle_ms),
                max_event: cfg.limits.max_event_bytes as usize,
            })
        })
    }

    /// The shadow of `pool`, when `request_id` is among the copies it samples.
    pub fn sampling(&self, pool: &str, request_id: &str) -> Option<&Arc<Shadow>> {
        self.shadows
            .iter()
            .find(|s| s.primary == pool)
            .filter(|s| sampled(request_id, s.cfg.fraction))
    }

    /// Every shadow (for `/stats`).
    pub fn all(&self) -> &[Arc<Shadow>] {
        &self.shadows
    }

    /// Starts copying `copy` to `shadow`'s candidate pool, unless too many copies already wait.
    pub fn mirror(self: &Arc<Self>, shadow: &Arc<Shadow>, copy: Copy) -> Option<MirrorLink> {
        let m = &self.recorder.metrics.shadow;
        let slot = match shadow.slots.clone().try_acquire_owned() {
            Ok(p) => Slot::Held(p),
            Err(_) => {
                if shadow.waiting.fetch_add(1, Ordering::AcqRel) >= shadow.cfg.max_queue {
                    shadow.waiting.fetch_sub(1, Ordering::AcqRel);
                    m.dropped
                        .with_label_values(&[shadow.primary.as_str(), "busy"])
                        .inc();
                    return None;
                }
                let gauge = m.waiting.with_label_values(&[shadow.primary.as_str()]);
                gauge.inc();
                // Owned by the task from here: dropped however it ends, even before it runs.
                Slot::Waiting(Waiting {
                    shadow: shadow.clone(),
                    gauge,
                })
            }
        };
        let (tx, rx) = if shadow.cfg.compare && copy.deterministic {
            let (tx, rx) = oneshot::channel();
            (Some(tx), Some(rx))
        } else {
            (None, None)
        };
        tokio::spawn(self.clone().run(shadow.clone(), copy, slot, rx));
        Some(MirrorLink { tx })
    }

    async fn run(
        self: Arc<Self>,
        shadow: Arc<Shadow>,
        copy: Copy,
        slot: Slot,
        primary: Option<oneshot::Receiver<PrimaryEnd>>,
    ) {
        let start = Instant::now();
        let m = &self.recorder.metrics.shadow;
        let pool = shadow.primary.as_str();
        let permit = match slot {
            Slot::Held(p) => p,
            Slot::Waiting(_waiting) => {
                let wait = Duration::from_millis(shadow.cfg.max_wait_ms);
                match tokio::time::timeout(wait, shadow.slots.clone().acquire_owned()).await {
                    Ok(Ok(p)) => p,
                    _ => {
                        m.dropped.with_label_values(&[pool, "late"]).inc();
                        return;
                    }
                }
            }
        };
        let facts = copy.facts.as_ref();
        let route = RouteRequest {
            blocks: facts.map_or(&[], |f| &f.blocks),
            block_tokens: self.block_tokens,
            prompt_tokens: facts.map_or((copy.body.len() / 4) as u32, |f| f.prompt_tokens),
            session: facts.and_then(|f| f.session.as_deref()),
            not_engine_chain: false,
        };
        let mut views = self.fleet.views();
        for v in &mut views {
            v.healthy &= shadow.members.get(v.id).copied().unwrap_or(false);
        }
        let Ok(pick) = self.policy.select(&route, &views) else {
            m.dropped.with_label_values(&[pool, "no_backend"]).inc();
            return;
        };
        self.policy.record(&route, &pick);
        let backend = self.fleet.backends[pick.backend].clone();
        let flying = Flying(m.in_flight.with_label_values(&[pool]));
        flying.0.inc();
        m.sent.with_label_values(&[pool]).inc();
        let uncached = route.prompt_tokens.saturating_sub(pick.matched_tokens);
        let mut guard = InFlight::new(backend.clone(), u64::from(uncached));
        let sent = Instant::now();
        let (status, completed, timing) = self
            .exchange(&backend, &copy, primary.is_some(), &mut guard, start)
            .await;
        if status >= 500 || status == 0 || (status < 300 && !completed) {
            self.fleet.request_failed(&backend);
        } else {
            self.fleet.request_succeeded(&backend);
        }
        // The slot and the replica's count go back before waiting on the primary.
        drop((guard, flying, permit));
        let mut fields = ShadowFields::default();
        if let Some(rx) = primary {
            let uncompared = |reason: &str| m.uncompared.with_label_values(&[pool, reason]).inc();
            match rx.await {
                Err(_) => uncompared("primary_unknown"),
                Ok(p) if !p.completed => uncompared("primary_failed"),
                Ok(_) if !completed => uncompared("shadow_failed"),
                Ok(p) => match (&p.output, &timing.output) {
                    (Some(a), Some(b)) => {
                        let c = a.compare(b);
                        let diff = timing.output_tokens() as i64 - p.output_tokens as i64;
                        let result = if c.exact { "match" } else { "mismatch" };
                        m.compared.with_label_values(&[pool, result]).inc();
                        if let Some(at) = c.diverged_at {
                            m.diverged_at
                                .with_label_values(&[pool])
                                .observe(f64::from(at));
                        }
                        m.length_diff
                            .with_label_values(&[pool])
                            .observe(diff.unsigned_abs() as f64);
                        fields = ShadowFields {
                            output_match: Some(c.exact),
                            diverged_at: c.diverged_at,
                            length_diff: Some(diff),
                        };
                    }
                    _ => uncompared("no_output"),
                },
            }
        }
        let _ = self.recorder.finish(Outcome {
            pool: &shadow.target,
            class: &copy.class,
            backend: Some(&backend.name),
            predicted_cached_tokens: None,
            shadow: Some(fields),
            request_id: &copy.request_id,
            arrival: copy.arrival,
            start,
            dispatched: Some(sent),
            sent: Some(sent),
            status,
            completed,
            timing,
            facts: copy.facts,
        });
    }

    /// Sends the copy and reads its response to the end: (status, completed, timing). A status
    /// of 0 means no response arrived.
    async fn exchange(
        &self,
        backend: &crate::upstreams::Backend,
        copy: &Copy,
        digest: bool,
        guard: &mut InFlight,
        start: Instant,
    ) -> (u16, bool, ResponseTiming) {
        let mut headers = copy.headers.clone();
        if let Some(auth) = &backend.authorization {
            // Replaces the client's: the replica's own key, as on the primary path.
            headers.insert(http::header::AUTHORIZATION, auth.clone());
        }
        let req = self
            .http
            .post(format!("{}{}", backend.url, copy.path))
            .headers(headers)
            .header("x-request-id", copy.request_id.as_str())
            .body(copy.body.clone());
        let failed = |status| (status, false, ResponseTiming::default());
        let mut resp = match tokio::time::timeout(self.first_byte, req.send()).await {
            Ok(Ok(r)) => r,
            _ => return failed(0),
        };
        let status = resp.status().as_u16();
        let is_sse = resp
            .headers()
            .get(http::header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .is_some_and(headroom_workload::sse::is_event_stream);
        let mut meter = ResponseMeter::new(is_sse, false);
        if digest {
            meter = meter.with_digest();
        }
        // As on the primary path: the first byte may take the engine's queue and prefill, later
        // ones only a decode step; an event that never ends is cut.
        let mut wait = self.first_byte;
        let complete = loop {
            match tokio::time::timeout(wait, resp.chunk()).await {
                Ok(Ok(Some(chunk))) => {
                    wait = self.idle;
                    let now = Instant::now();
                    if meter.on_chunk(chunk, now).first_output {
                        guard.first_output();
                    }
                    meter.delivered(now);
                    if meter.buffered() > self.max_event {
                        break false;
                    }
                }
                // Ended mid-line with no finish: cut off, as on the primary path.
                Ok(Ok(None)) => break !meter.broken_off(),
                _ => break false,
            }
        };
        meter.finish(Instant::now(), complete);
        if complete && !is_sse && (200..300).contains(&status) {
            guard.first_output();
        }
        let timing = meter.into_timing(start);
        let completed = crate::record::completed(complete, status, &timing);
        (status, completed, timing)
    }
}

impl Shadow {
    /// `/stats`: the configuration and what the counters say.
    pub fn stats(&self, metrics: &crate::telemetry::Metrics) -> serde_json::Value {
        let m = &metrics.shadow;
        let p = self.primary.as_str();
        let dropped = |r: &str| m.dropped.with_label_values(&[p, r]).get();
        let (matched, mismatched) = (
            m.compared.with_label_values(&[p, "match"]).get(),
            m.compared.with_label_values(&[p, "mismatch"]).get(),
        );
        let compared = matched + mismatched;
        let uncompared: serde_json::Map<String, serde_json::Value> = [
            "primary_failed",
            "shadow_failed",
            "primary_unknown",
            "no_output",
        ]
        .iter()
        .map(|r| {
            (
                r.to_string(),
                m.uncompared.with_label_values(&[p, r]).get().into(),
            )
        })
        .collect();
        serde_json::json!({
            "pool": p,
            "target": self.target,
            "fraction": self.cfg.fraction,
            "sent": m.sent.with_label_values(&[p]).get(),
            "dropped": {"busy": dropped("busy"), "late": dropped("late"), "no_backend": dropped("no_backend")},
            "in_flight": m.in_flight.with_label_values(&[p]).get(),
            "waiting": m.waiting.with_label_values(&[p]).get(),
            "compared": compared,
            "matched": matched,
            "uncompared": uncompared,
            "agreement": (compared > 0).then(|| matched as f64 / compared as f64),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sampling_takes_the_fraction_and_is_the_same_every_time() {
        let ids: Vec<String> = (0..20_000).map(|i| format!("req-{i}")).collect();
        let share = |f: f64| ids.iter().filter(|id| sampled(id, f)).count() as f64 / 20_000.0;
        assert!((share(0.5) - 0.5).abs() < 0.02, "{}", share(0.5));
        assert!((share(0.1) - 0.1).abs() < 0.01, "{}", share(0.1));
        assert_eq!(share(1.0), 1.0);
        assert_eq!(
            ids.iter().map(|id| sampled(id, 0.3)).collect::<Vec<_>>(),
            ids.iter().map(|id| sampled(id, 0.3)).collect::<Vec<_>>()
        );
    }
}
