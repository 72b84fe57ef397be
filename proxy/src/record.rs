//! The end of a generation request's timing record: what the proxy learnt about the prompt at
//! inspection, joined with what the meter read from the response, judged against the class's
//! objectives and handed to the metrics, the `/stats` windows and the trace capture.

use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use headroom_config::serve::ServeConfig;
use headroom_workload::inspect::InspectConfig;
use headroom_workload::measure::{Objectives, ResponseTiming};
use headroom_workload::trace::{ShadowFields, TraceRecord};

use crate::app::{Headroom, RequestCtx};
use crate::telemetry::capture::Pending;
use crate::telemetry::stats::Finished;

/// What inspection learnt about a generation request (never its text).
#[derive(Debug, Default, Clone)]
pub struct PromptFacts {
    /// `chat` or `completions`.
    pub endpoint: &'static str,
    /// Requested model.
    pub model: Option<String>,
    /// Streamed.
    pub stream: bool,
    /// Requested output limit.
    pub max_tokens: Option<i64>,
    /// The proxy's prompt token count.
    pub prompt_tokens: u32,
    /// The prompt's block hash chain.
    pub blocks: Vec<u64>,
    /// The hash of the prompt's tail, when hashed whole.
    pub tail_hash: Option<u64>,
    /// The session header's value.
    pub session: Option<String>,
    /// The body, kept (shared) when the prompt was longer than routing hashes, so the capture can
    /// hash it whole off the request path.
    pub long_body: Option<(headroom_workload::inspect::Endpoint, bytes::Bytes)>,
}

impl PromptFacts {
    /// What inspection `i` learnt about a request to `endpoint` carrying the session header
    /// `session`; `long_body` when the capture must hash the prompt whole.
    pub fn of(
        endpoint: &'static str,
        i: headroom_workload::inspect::Inspected,
        session: Option<String>,
        long_body: Option<(headroom_workload::inspect::Endpoint, bytes::Bytes)>,
    ) -> Self {
        Self {
            endpoint,
            model: i.model,
            stream: i.stream,
            max_tokens: i.max_tokens,
            prompt_tokens: i.prompt_tokens,
            blocks: i.blocks,
            tail_hash: i.tail_hash,
            session,
            long_body,
        }
    }
}

/// How a finished request is judged.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Completed within every objective.
    Good,
    /// Completed, missed at least one objective.
    Slow,
    /// Did not complete: an error status, an error event, a cut stream or a client that left.
    Failed,
}

impl Verdict {
    fn label(self) -> &'static str {
        match self {
            Self::Good => "good",
            Self::Slow => "slow",
            Self::Failed => "failed",
        }
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// A stream's inter-token gaps summed up for its trace record, in ms.
#[derive(Debug, Clone, Copy, PartialEq)]
struct GapSummary {
    mean: f64,
    p50: f64,
    p99: f64,
    max: f64,
}

/// The gaps' mean, p50 and p99 (nearest rank) and max, found by selection (linear in the gaps;
/// a sort of a long generation's thousands of gaps would hold the worker at the stream's end).
/// Reorders `gaps`; `None` when there are none.
fn gap_summary(gaps: &mut [Duration]) -> Option<GapSummary> {
    let n = gaps.len();
    if n == 0 {
        return None;
    }
    let rank = |q: f64| ((q * n as f64).ceil() as usize).clamp(1, n) - 1;
    let (r50, r99) = (rank(0.50), rank(0.99));
    let mean = gaps.iter().map(|g| ms(*g)).sum::<f64>() / n as f64;
    let (_, p50, above) = gaps.select_nth_unstable(r50);
    let p50 = *p50;
    // Everything past the median is at least it: p99 and the max are among those.
    let (p99, max) = match above.len() {
        0 => (p50, p50),
        _ if r99 == r50 => (p50, *above.iter().max().unwrap_or(&p50)),
        _ => {
            let (_, p99, top) = above.select_nth_unstable(r99 - r50 - 1);
            let p99 = *p99;
            (p99, top.iter().copied().max().unwrap_or(p99))
        }
    };
    Some(GapSummary {
        mean,
        p50: ms(p50),
        p99: ms(p99),
        max: ms(max),
    })
}

/// A response that was `relayed` to its end completed when its status was 2xx, its stream
/// carried no error event, and the engine did not abort it.
pub fn completed(relayed: bool, status: u16, timing: &ResponseTiming) -> bool {
    relayed
        && (200..300).contains(&status)
        && !timing.error_event
        // The engine gave the request up (vLLM's `abort`): not an answer, whatever came first.
        && timing.finish_reason.as_deref() != Some("abort")
}

/// Whether a response of `status` can carry output. An error answer cannot: it takes no TTFT (a
/// fast 429 or 500 would otherwise make the percentiles better the worse things get). A client
/// that left (499) may have had its first tokens: those stay.
pub fn answers_with_output(status: u16) -> bool {
    (200..300).contains(&status) || status == 499
}

/// The objectives a timing missed, by name.
pub fn missed(o: &Objectives, t: &ResponseTiming) -> Vec<&'static str> {
    let mut out = Vec::new();
    if o.ttft_ms.is_some_and(|b| t.ttft.is_none_or(|x| ms(x) > b)) {
        out.push("ttft");
    }
    if o.tpot_ms
        .is_some_and(|b| t.tpot().is_some_and(|x| ms(x) > b))
    {
        out.push("tpot");
    }
    if o.e2e_ms.is_some_and(|b| t.e2e.is_none_or(|x| ms(x) > b)) {
        out.push("e2e");
    }
    out
}

/// Where finished requests go: metrics, the `/stats` windows, the trace capture. Shared by the
/// primary path and the shadow copies (which have their own windows).
#[derive(Debug)]
pub struct Recorder {
    /// The metrics.
    pub metrics: Arc<crate::telemetry::Metrics>,
    /// `/stats` windows of the served traffic.
    pub stats: Arc<crate::telemetry::stats::Stats>,
    /// `/stats` windows of the shadow copies.
    pub shadow_stats: Arc<crate::telemetry::stats::Stats>,
    /// The trace capture, when configured.
    pub capture: Option<Arc<crate::telemetry::capture::Capture>>,
    /// The config (class objectives).
    pub cfg: Arc<ServeConfig>,
    /// Prompt hashing settings (whole-prompt rehash for the capture).
    pub inspect: InspectConfig,
}

/// One finished generation request (or shadow copy), as the recorder takes it.
#[derive(Debug)]
pub struct Outcome<'a> {
    /// Pool (a shadow copy: the candidate pool).
    pub pool: &'a str,
    /// Class.
    pub class: &'a str,
    /// The replica that answered.
    pub backend: Option<&'a str>,
    /// Prompt tokens a prefix-aware policy expected the replica first chosen to hold cached.
    pub predicted_cached_tokens: Option<u32>,
    /// A shadow copy, and how its output compared.
    pub shadow: Option<ShadowFields>,
    /// The request id.
    pub request_id: &'a str,
    /// Wall-clock arrival.
    pub arrival: SystemTime,
    /// Arrival, on the monotonic clock (the origin of `timing`).
    pub start: Instant,
    /// First dispatch.
    pub dispatched: Option<Instant>,
    /// The last attempt's dispatch.
    pub sent: Option<Instant>,
    /// Status sent to the client (a shadow copy: the candidate's).
    pub status: u16,
    /// Relayed to its end with a 2xx status and no error event ([`completed`]).
    pub completed: bool,
    /// The response's measurement.
    pub timing: ResponseTiming,
    /// What inspection learnt.
    pub facts: Option<PromptFacts>,
}

impl Recorder {
    /// The objectives of `class`.
    pub(crate) fn objectives(&self, class: &str) -> Objectives {
        self.cfg
            .classes
            .get(class)
            .map(|c| Objectives {
                ttft_ms: c.slo.ttft_ms,
                tpot_ms: c.slo.tpot_ms,
                e2e_ms: c.slo.e2e_ms,
            })
            .unwrap_or_default()
    }

    /// Records a finished request: metrics, goodput (served traffic only), `/stats`, capture.
    /// Returns its prompt and output tokens.
    pub(crate) fn finish(&self, o: Outcome<'_>) -> (u64, u64) {
        let now = Instant::now();
        let Outcome {
            pool,
            class,
            request_id,
            mut timing,
            ..
        } = o;
        if !answers_with_output(o.status) {
            timing.without_output();
        }
        let tpot = timing.tpot();
        let backend = o.backend.unwrap_or("none");
        let shadow = if o.shadow.is_some() { "true" } else { "false" };
        let labels = [pool, class, backend, shadow];
        let completed = o.completed;
        let objectives = self.objectives(class);
        let misses = if completed {
            missed(&objectives, &timing)
        } else {
            Vec::new()
        };
        let verdict = match (completed, misses.is_empty()) {
            (false, _) => Verdict::Failed,
            (true, true) => Verdict::Good,
            (true, false) => Verdict::Slow,
        };
        let m = &self.metrics;
        let observe = |h: &prometheus::HistogramVec, d: Option<Duration>| {
            if let Some(d) = d {
                h.with_label_values(&labels).observe(d.as_secs_f64());
            }
        };
        let queue = o.dispatched.map(|d| d.saturating_duration_since(o.start));
        let prefill = match (o.sent, timing.ttft) {
            (Some(sent), Some(ttft)) => Some((o.start + ttft).saturating_duration_since(sent)),
            _ => None,
        };
        observe(&m.queue, queue);
        observe(&m.prefill, prefill);
        observe(&m.ttft, timing.ttft);
        observe(&m.tpot, tpot);
        observe(&m.e2e, timing.e2e);
        if !timing.itl.is_empty() {
            // Tallied here and added once: a stream's hundreds of gaps then cost the shared
            // histogram four atomic operations, not four each.
            let gaps = m.itl.with_label_values(&labels).local();
            for gap in &timing.itl {
                gaps.observe(gap.as_secs_f64());
            }
            gaps.flush();
        }
        let facts = o.facts;
        let prompt_tokens = timing.usage.map_or_else(
            || facts.as_ref().map_or(0, |f| u64::from(f.prompt_tokens)),
            |u| u.prompt_tokens,
        );
        let output_tokens = timing.output_tokens();
        m.prompt_tokens
            .with_label_values(&labels)
            .inc_by(prompt_tokens);
        m.completion_tokens
            .with_label_values(&labels)
            .inc_by(output_tokens);
        // Goodput is the served traffic's: a shadow copy serves no one.
        if o.shadow.is_none() {
            let group = [pool, class];
            m.slo_requests
                .with_label_values(&[group[0], group[1], verdict.label()])
                .inc();
            for objective in &misses {
                m.slo_missed
                    .with_label_values(&[group[0], group[1], objective])
                    .inc();
            }
            if verdict == Verdict::Good {
                m.goodput_requests.with_label_values(&group).inc();
                m.goodput_tokens
                    .with_label_values(&group)
                    .inc_by(output_tokens);
            }
        }
        let windows = if o.shadow.is_some() {
            &self.shadow_stats
        } else {
            &self.stats
        };
        windows.record(
            pool,
            class,
            &Finished {
                completed,
                good: verdict == Verdict::Good,
                output_tokens,
                prompt_tokens,
                queue,
                ttft: timing.ttft,
                tpot,
                e2e: timing.e2e,
                itl: &timing.itl,
            },
            now,
        );
        let tokens = (prompt_tokens, output_tokens);
        let Some(capture) = &self.capture else {
            return tokens;
        };
        let Some(facts) = facts else {
            m.capture_skipped.with_label_values(&["no_prompt"]).inc();
            return tokens;
        };
        if !capture.sampled(request_id) {
            m.capture_skipped.with_label_values(&["sampled_out"]).inc();
            return tokens;
        }
        // The gaps are not needed in arrival order any more.
        let gaps = gap_summary(&mut timing.itl);
        let input_length = u32::try_from(prompt_tokens).unwrap_or(u32::MAX).max(1);
        let record = TraceRecord {
            timestamp: 0,
            input_length,
            output_length: u32::try_from(output_tokens).unwrap_or(u32::MAX),
            hash_ids: Vec::new(),
            block_tokens: None,
            session_id: facts.session,
            request_id: Some(request_id.to_owned()),
            model: facts.model,
            endpoint: Some(facts.endpoint.to_owned()),
            class: Some(class.to_owned()),
            pool: Some(pool.to_owned()),
            backend: o.backend.map(str::to_owned),
            status: Some(o.status),
            max_tokens: facts.max_tokens.and_then(|n| u32::try_from(n).ok()),
            stream: Some(facts.stream),
            queue_ms: queue.map(ms),
            ttft_ms: timing.ttft.map(ms),
            tpot_ms: tpot.map(ms),
            itl_mean_ms: gaps.map(|g| g.mean),
            itl_p50_ms: gaps.map(|g| g.p50),
            itl_p99_ms: gaps.map(|g| g.p99),
            itl_max_ms: gaps.map(|g| g.max),
            e2e_ms: timing.e2e.map(ms),
            finish_reason: timing.finish_reason.take().or_else(|| {
                (!completed).then(|| if o.status == 499 { "abort" } else { "error" }.to_owned())
            }),
            cached_tokens: timing.usage.and_then(|u| u.cached_tokens),
            predicted_cached_tokens: o.predicted_cached_tokens.map(u64::from),
            good: Some(verdict == Verdict::Good),
            shadow: o.shadow,
        };
        let rehash = facts
            .long_body
            .filter(|(_, body)| capture.reserve_body(body.len()))
            .map(|(endpoint, body)| crate::telemetry::capture::Rehash {
                endpoint,
                body,
                inspect: self.inspect.clone(),
            });
        let arrival_ns = o
            .arrival
            .duration_since(SystemTime::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        capture.submit(Pending {
            rehash,
            arrival: o.arrival,
            record,
            blocks: facts.blocks,
            block_tokens: self.inspect.block_tokens,
            tail_hash: facts.tail_hash,
            // A shadow copy's record is a record of its own.
            unique: xxhash_rust::xxh3::xxh3_64_with_seed(
                request_id.as_bytes(),
                arrival_ns ^ u64::from(o.shadow.is_some()),
            ),
        });
        tokens
    }
}

impl Headroom {
    /// Finishes a generation request's record: tells a mirror how the primary ended, then
    /// metrics, goodput, `/stats`, capture.
    pub(crate) fn finish_record(&self, ctx: &mut RequestCtx) {
        let mut timing = ctx
            .meter
            .take()
            .map(|m| m.into_timing(ctx.start))
            .unwrap_or_default();
        if !answers_with_output(ctx.status) {
            timing.without_output();
        }
        let completed = completed(ctx.completed, ctx.status, &timing);
        if let Some(link) = ctx.mirror.take() {
            link.primary_ended(completed, &timing);
        }
        let (prompt, output) = self.recorder.finish(Outcome {
            pool: &ctx.pool,
            class: &ctx.class,
            backend: ctx.backend.as_deref(),
            predicted_cached_tokens: ctx.predicted_cached_tokens,
            shadow: None,
            request_id: &ctx.request_id,
            arrival: ctx.arrival,
            start: ctx.start,
            dispatched: ctx.dispatched,
            sent: ctx.sent,
            status: ctx.status,
            completed,
            timing,
            facts: ctx.prompt.take(),
        });
        // What the replica held for it, for the context its cap plans for.
        if let (true, Some(adm), Some(name)) = (completed, &self.admission, &ctx.backend) {
            if let Some(b) = self.fleet.backends.iter().find(|b| &b.name == name) {
                let tokens = u32::try_from(prompt + output).unwrap_or(u32::MAX);
                adm.observe_context(b.id, tokens);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn misses_name_each_objective() {
        let o = Objectives {
            ttft_ms: Some(100.0),
            tpot_ms: Some(10.0),
            e2e_ms: Some(1000.0),
        };
        let t = ResponseTiming {
            ttft: Some(Duration::from_millis(150)),
            last_output: Some(Duration::from_millis(250)),
            e2e: Some(Duration::from_millis(260)),
            output_events: 11,
            ..ResponseTiming::default()
        };
        assert_eq!(missed(&o, &t), vec!["ttft"]);
        let slow_decode = ResponseTiming {
            ttft: Some(Duration::from_millis(50)),
            last_output: Some(Duration::from_millis(1500)),
            e2e: Some(Duration::from_millis(1501)),
            output_events: 11,
            ..ResponseTiming::default()
        };
        assert_eq!(missed(&o, &slow_decode), vec!["tpot", "e2e"]);
        assert!(missed(&Objectives::default(), &slow_decode).is_empty());
        let two = gap_summary(&mut [Duration::from_millis(1), Duration::from_millis(9)]);
        assert_eq!(
            two,
            Some(GapSummary {
                mean: 5.0,
                p50: 1.0,
                p99: 9.0,
                max: 9.0
            })
        );
        assert_eq!(gap_summary(&mut []), None);
    }

    #[test]
    fn gap_summaries_by_selection_match_a_sort() {
        // Nearest rank over the sorted gaps, for every length up to 300 and values with ties.
        let mut state = 0x2545_f491_4f6c_dd1d_u64;
        for n in 1..=300usize {
            let mut gaps: Vec<Duration> = (0..n)
                .map(|_| {
                    state ^= state << 13;
                    state ^= state >> 7;
                    state ^= state << 17;
                    Duration::from_micros(state % 50)
                })
                .collect();
            let mut sorted = gaps.clone();
            sorted.sort_unstable();
            let at = |q: f64| ms(sorted[((q * n as f64).ceil() as usize).clamp(1, n) - 1]);
            let mean = sorted.iter().map(|g| ms(*g)).sum::<f64>() / n as f64;
            let got = gap_summary(&mut gaps).expect("gaps");
            assert_eq!(got.p50, at(0.50), "n = {n}");
            assert_eq!(got.p99, at(0.99), "n = {n}");
            assert_eq!(got.max, ms(sorted[n - 1]), "n = {n}");
            assert!((got.mean - mean).abs() < 1e-9, "n = {n}");
        }
    }
}
