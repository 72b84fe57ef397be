//! Run summaries with vLLM `bench serve`'s definitions: exact percentiles (linear interpolation,
//! as `np.percentile`), throughput, goodput against an SLO, errors by kind, and the check that the
//! run measured the workload it was asked to (prompt and output lengths against the contract).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::client::{Failure, Timing};
use crate::replay::RequestResult;

/// A latency distribution in milliseconds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Dist {
    /// Samples.
    pub count: usize,
    /// Mean.
    pub mean_ms: f64,
    /// Smallest.
    pub min_ms: f64,
    /// Median.
    pub p50_ms: f64,
    /// 90th percentile.
    pub p90_ms: f64,
    /// 95th percentile.
    pub p95_ms: f64,
    /// 99th percentile.
    pub p99_ms: f64,
    /// 99.9th percentile.
    pub p999_ms: f64,
    /// Largest.
    pub max_ms: f64,
}

impl Dist {
    /// The distribution of a count (tokens, not milliseconds): the same numbers under names
    /// without a unit.
    pub fn as_count(&self) -> serde_json::Value {
        serde_json::json!({
            "count": self.count, "mean": self.mean_ms, "min": self.min_ms, "p50": self.p50_ms,
            "p90": self.p90_ms, "p95": self.p95_ms, "p99": self.p99_ms, "p999": self.p999_ms,
            "max": self.max_ms,
        })
    }
}

/// Serializes a [`Dist`] of counts with [`Dist::as_count`]'s names.
pub fn serialize_count<S: serde::Serializer>(d: &Dist, s: S) -> Result<S::Ok, S::Error> {
    serde::Serialize::serialize(&d.as_count(), s)
}

/// The `p`-th percentile (0–100) of sorted values, interpolating linearly between ranks.
pub fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = (p / 100.0).clamp(0.0, 1.0) * (sorted.len() - 1) as f64;
    let (lo, hi) = (rank.floor() as usize, rank.ceil() as usize);
    sorted[lo] + (sorted[hi] - sorted[lo]) * (rank - lo as f64)
}

impl Dist {
    /// The distribution of `values` (milliseconds; sorted in place).
    pub fn of(values: &mut [f64]) -> Self {
        if values.is_empty() {
            return Self::default();
        }
        values.sort_by(f64::total_cmp);
        Self {
            count: values.len(),
            mean_ms: values.iter().sum::<f64>() / values.len() as f64,
            min_ms: values[0],
            p50_ms: percentile(values, 50.0),
            p90_ms: percentile(values, 90.0),
            p95_ms: percentile(values, 95.0),
            p99_ms: percentile(values, 99.0),
            p999_ms: percentile(values, 99.9),
            max_ms: values[values.len() - 1],
        }
    }
}

/// The longest gap [`Buckets`] tells apart from longer ones: an hour, in µs.
const MAX_TRACKED_US: u64 = 3_600_000_000;

/// A pooled distribution kept as HDR buckets (3 significant digits, µs), so that it can be read
/// later at any value, not only at the percentiles a summary names: where the percentiles sit on a
/// cliff of the distribution, "what share of the samples lie below this value" is the comparison
/// that holds.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Buckets {
    /// `[lowest value of the bucket in µs, samples]`, ascending (a bucket spans at most 0.1% of its
    /// values).
    pub us_counts: Vec<[u64; 2]>,
}

impl Buckets {
    /// The buckets of `values` (milliseconds).
    pub fn of(values: impl IntoIterator<Item = f64>) -> Self {
        // Bounded up front: a histogram made with `new` only tracks up to 2,047 µs without
        // resizing, and a saturating record would clamp every longer gap to that.
        let mut h = hdrhistogram::Histogram::<u64>::new_with_bounds(1, MAX_TRACKED_US, 3)
            .expect("a histogram");
        for v in values {
            h.saturating_record((v.max(0.0) * 1e3).round() as u64);
        }
        Self {
            us_counts: h
                .iter_recorded()
                .map(|v| {
                    [
                        h.lowest_equivalent(v.value_iterated_to()),
                        v.count_at_value(),
                    ]
                })
                .collect(),
        }
    }

    /// Samples in all.
    pub fn count(&self) -> u64 {
        self.us_counts.iter().map(|b| b[1]).sum()
    }

    /// The share of samples at or below `ms` (0–1; None without samples), counting a bucket whole
    /// when `ms` reaches its lowest value.
    pub fn share_at_or_below(&self, ms: f64) -> Option<f64> {
        let total = self.count();
        if total == 0 {
            return None;
        }
        let us = ms * 1e3;
        let below: u64 = self
            .us_counts
            .iter()
            .take_while(|b| b[0] as f64 <= us)
            .map(|b| b[1])
            .sum();
        Some(below as f64 / total as f64)
    }
}

/// The pooled inter-token gaps of the measured, completed requests, as [`Buckets`].
pub fn itl_buckets(results: &[RequestResult]) -> Buckets {
    Buckets::of(
        results
            .iter()
            .filter(|r| !r.warmup && r.timing.ok())
            .flat_map(|r| r.timing.itl.iter().map(|d| ms(*d))),
    )
}

/// Latency objectives; a request is good when it completed and met every one set.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Slo {
    /// TTFT bound, ms.
    pub ttft_ms: Option<f64>,
    /// TPOT bound, ms.
    pub tpot_ms: Option<f64>,
    /// E2E bound, ms.
    pub e2el_ms: Option<f64>,
}

impl Slo {
    /// Parses `ttft=400,tpot=50,e2el=20000` (milliseconds; vLLM also writes `ttft:400`).
    pub fn parse(s: &str) -> Result<Self, String> {
        let mut slo = Self::default();
        for item in s.split(',').map(str::trim).filter(|i| !i.is_empty()) {
            let (k, v) = item
                .split_once(['=', ':'])
                .ok_or_else(|| format!("SLO item `{item}`: write name=milliseconds"))?;
            let ms: f64 = v
                .trim()
                .trim_end_matches("ms")
                .parse()
                .map_err(|_| format!("SLO `{k}`: `{v}` is not a number of ms"))?;
            if !(ms.is_finite() && ms > 0.0) {
                return Err(format!("SLO `{k}` must be positive, got {ms}"));
            }
            match k.trim() {
                "ttft" => slo.ttft_ms = Some(ms),
                "tpot" => slo.tpot_ms = Some(ms),
                "e2el" | "e2e" => slo.e2el_ms = Some(ms),
                other => return Err(format!("unknown SLO `{other}`: use ttft, tpot, e2el")),
            }
        }
        if slo == Self::default() {
            return Err("an SLO needs at least one of ttft, tpot, e2el".into());
        }
        Ok(slo)
    }

    /// Whether a completed request met every set bound.
    pub fn met(&self, r: &RequestResult) -> bool {
        let t = &r.timing;
        let ms = |d: std::time::Duration| d.as_secs_f64() * 1e3;
        let objectives = headroom_workload::measure::Objectives {
            ttft_ms: self.ttft_ms,
            tpot_ms: self.tpot_ms,
            e2e_ms: self.e2el_ms,
        };
        t.ok() && objectives.met(t.ttft.map(ms), t.tpot().map(ms), ms(t.e2e))
    }
}

/// Goodput of a run.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Goodput {
    /// The objectives.
    pub slo: Slo,
    /// Requests that met them.
    pub good_requests: usize,
    /// Good requests per second of the run.
    pub requests_per_s: f64,
    /// Output tokens per second of good requests.
    pub output_tokens_per_s: f64,
}

/// Did the run measure the contracted workload?
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct LengthCheck {
    /// Completed requests whose reported prompt tokens differ from the contract.
    pub prompt_mismatches: usize,
    /// Mean of (reported − contracted) prompt tokens.
    pub prompt_drift_mean: f64,
    /// Completed requests that produced fewer output tokens than contracted.
    pub output_short: usize,
    /// Output tokens produced / contracted, over completed requests.
    pub output_ratio: f64,
    /// Set when the run measured a different workload than its contract (any output short, or
    /// more than 1% of prompts off), with the reason.
    pub warning: Option<String>,
}

/// What a run measured.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Summary {
    /// Requests measured (warm-up excluded).
    pub measured: usize,
    /// Of those, completed.
    pub completed: usize,
    /// Of those, failed.
    pub failed: usize,
    /// Warm-up requests sent and discarded.
    pub warmup_discarded: usize,
    /// Failures by kind (`status_503`, `transport`, `cut`, `error_event`).
    pub errors: BTreeMap<String, usize>,
    /// From the first measured send to the last measured end, s.
    pub duration_s: f64,
    /// Completed requests per second.
    pub request_throughput: f64,
    /// Prompt tokens (reported) of completed requests per second.
    pub input_token_throughput: f64,
    /// Output tokens (reported) of completed requests per second.
    pub output_token_throughput: f64,
    /// Time to first token.
    pub ttft: Dist,
    /// Time per output token after the first.
    pub tpot: Dist,
    /// Inter-token latency, per chunk, pooled over requests.
    pub itl: Dist,
    /// End-to-end latency to the last token.
    pub e2el: Dist,
    /// Actual minus planned send time (open loop).
    pub send_lateness: Dist,
    /// Goodput, when an SLO was given.
    pub goodput: Option<Goodput>,
    /// Lengths against the contract.
    pub lengths: LengthCheck,
}

fn ms(d: std::time::Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// Summarizes the measured (non-warm-up) requests of a run.
pub fn summarize(results: &[RequestResult], slo: Option<Slo>) -> Summary {
    let measured: Vec<&RequestResult> = results.iter().filter(|r| !r.warmup).collect();
    let completed: Vec<&RequestResult> =
        measured.iter().copied().filter(|r| r.timing.ok()).collect();
    let mut errors = BTreeMap::new();
    for r in measured.iter().filter(|r| !r.timing.ok()) {
        if let Some(f) = &r.timing.failure {
            *errors.entry(f.kind()).or_insert(0) += 1;
        }
    }
    let start = measured.iter().map(|r| r.sent).min().unwrap_or_default();
    let end = measured
        .iter()
        .map(|r| r.sent + r.timing.e2e)
        .max()
        .unwrap_or_default();
    let duration_s = (end.saturating_sub(start)).as_secs_f64().max(1e-9);
    let input: u64 = completed.iter().map(|r| r.timing.prompt_tokens).sum();
    let output: u64 = completed.iter().map(|r| r.timing.completion_tokens).sum();

    let mut ttft: Vec<f64> = completed
        .iter()
        .filter_map(|r| r.timing.ttft.map(ms))
        .collect();
    let mut tpot: Vec<f64> = completed
        .iter()
        .filter_map(|r| r.timing.tpot().map(ms))
        .collect();
    let mut itl: Vec<f64> = completed
        .iter()
        .flat_map(|r| r.timing.itl.iter().map(|d| ms(*d)))
        .collect();
    let mut e2el: Vec<f64> = completed.iter().map(|r| ms(r.timing.e2e)).collect();
    let mut late: Vec<f64> = measured
        .iter()
        .filter_map(|r| r.scheduled.map(|s| ms(r.sent) - ms(s)))
        .collect();

    let goodput = slo.map(|slo| {
        let good: Vec<&&RequestResult> = completed.iter().filter(|r| slo.met(r)).collect();
        Goodput {
            slo,
            good_requests: good.len(),
            requests_per_s: good.len() as f64 / duration_s,
            output_tokens_per_s: good.iter().map(|r| r.timing.completion_tokens).sum::<u64>()
                as f64
                / duration_s,
        }
    });

    let mut lengths = LengthCheck::default();
    let with_usage: Vec<&&RequestResult> = completed
        .iter()
        .filter(|r| r.timing.prompt_tokens > 0)
        .collect();
    lengths.prompt_mismatches = with_usage
        .iter()
        .filter(|r| r.timing.prompt_tokens != u64::from(r.input_length))
        .count();
    if !with_usage.is_empty() {
        lengths.prompt_drift_mean = with_usage
            .iter()
            .map(|r| r.timing.prompt_tokens as f64 - f64::from(r.input_length))
            .sum::<f64>()
            / with_usage.len() as f64;
    }
    lengths.output_short = completed
        .iter()
        .filter(|r| r.timing.completion_tokens < u64::from(r.output_length.max(1)))
        .count();
    let contracted: u64 = completed
        .iter()
        .map(|r| u64::from(r.output_length.max(1)))
        .sum();
    lengths.output_ratio = if contracted > 0 {
        output as f64 / contracted as f64
    } else {
        0.0
    };
    if lengths.output_short > 0 {
        lengths.warning = Some(format!(
            "{} of {} requests ended before their contracted output length: this run measured a shorter workload than its contract",
            lengths.output_short,
            completed.len()
        ));
    } else if lengths.prompt_mismatches * 100 > with_usage.len() {
        lengths.warning = Some(format!(
            "{} of {} prompts differ from their contracted length (mean drift {:+.1} tokens): the target tokenizes differently",
            lengths.prompt_mismatches,
            with_usage.len(),
            lengths.prompt_drift_mean
        ));
    }

    Summary {
        measured: measured.len(),
        completed: completed.len(),
        failed: measured.len() - completed.len(),
        warmup_discarded: results.len() - measured.len(),
        errors,
        duration_s,
        request_throughput: completed.len() as f64 / duration_s,
        input_token_throughput: input as f64 / duration_s,
        output_token_throughput: output as f64 / duration_s,
        ttft: Dist::of(&mut ttft),
        tpot: Dist::of(&mut tpot),
        itl: Dist::of(&mut itl),
        e2el: Dist::of(&mut e2el),
        send_lateness: Dist::of(&mut late),
        goodput,
        lengths,
    }
}

/// One row per request for CSV and JSON results.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct RequestRow {
    /// Trace row.
    pub index: usize,
    /// `x-request-id`.
    pub request_id: String,
    /// Warm-up (not in the summary).
    pub warmup: bool,
    /// Planned send, ms from start.
    pub scheduled_ms: Option<f64>,
    /// Actual send, ms from start.
    pub sent_ms: f64,
    /// URL it was sent to.
    #[serde(default)]
    pub target: String,
    /// HTTP status.
    pub status: u16,
    /// Failure, if any.
    pub error: Option<String>,
    /// Failure kind (`status_503`, `transport`, `cut`, `error_event`), if any.
    #[serde(default)]
    pub error_kind: Option<String>,
    /// TTFT, ms.
    pub ttft_ms: Option<f64>,
    /// TPOT, ms.
    pub tpot_ms: Option<f64>,
    /// Largest inter-token gap, ms.
    pub itl_max_ms: Option<f64>,
    /// E2E, ms.
    pub e2el_ms: f64,
    /// Contracted prompt tokens.
    pub input_length: u32,
    /// Reported prompt tokens.
    pub prompt_tokens: u64,
    /// Contracted output tokens.
    pub output_length: u32,
    /// Reported output tokens.
    pub completion_tokens: u64,
    /// The output's fingerprint (`headroom_workload::digest`: hashes, never text), for output
    /// agreement between two runs of one trace.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output: Option<String>,
}

impl From<&RequestResult> for RequestRow {
    fn from(r: &RequestResult) -> Self {
        let t = &r.timing;
        Self {
            index: r.index,
            request_id: r.request_id.clone(),
            warmup: r.warmup,
            scheduled_ms: r.scheduled.map(ms),
            sent_ms: ms(r.sent),
            target: t.target.clone(),
            status: t.status,
            error: t.failure.as_ref().map(|f| f.to_string()),
            error_kind: t.failure.as_ref().map(Failure::kind),
            ttft_ms: t.ttft.map(ms),
            tpot_ms: t.tpot().map(ms),
            itl_max_ms: t.itl.iter().max().map(|d| ms(*d)),
            e2el_ms: ms(t.e2e),
            input_length: r.input_length,
            prompt_tokens: t.prompt_tokens,
            output_length: r.output_length,
            completion_tokens: t.completion_tokens,
            output: t
                .output
                .as_ref()
                .map(headroom_workload::digest::Fingerprint::encode),
        }
    }
}

/// Rebuilds results from rows (to merge shards). Per-chunk gaps are not kept in rows, so the
/// merged summary has no ITL distribution; everything else is exact.
pub fn results_from_rows(rows: &[RequestRow]) -> Vec<RequestResult> {
    let d = |ms: f64| std::time::Duration::from_secs_f64(ms.max(0.0) / 1e3);
    rows.iter()
        .map(|r| RequestResult {
            index: r.index,
            request_id: r.request_id.clone(),
            scheduled: r.scheduled_ms.map(d),
            sent: d(r.sent_ms),
            warmup: r.warmup,
            input_length: r.input_length,
            output_length: r.output_length,
            timing: Timing {
                status: r.status,
                failure: r.error.as_ref().map(|e| match r.error_kind.as_deref() {
                    Some(k) if k.starts_with("status_") => {
                        Failure::Status(k[7..].parse().unwrap_or(0), e.clone())
                    }
                    Some("error_event") => Failure::ErrorEvent(e.clone()),
                    Some("cut") => Failure::Cut(e.clone()),
                    Some("timeout") => Failure::Timeout(e.clone()),
                    _ => Failure::Transport(e.clone()),
                }),
                ttft: r.ttft_ms.map(d),
                itl: Vec::new(),
                e2e: d(r.e2el_ms),
                prompt_tokens: r.prompt_tokens,
                completion_tokens: r.completion_tokens,
                target: r.target.clone(),
                output: r
                    .output
                    .as_deref()
                    .and_then(|o| headroom_workload::digest::Fingerprint::decode(o).ok()),
            },
        })
        .collect()
}

/// CSV of request rows (header included).
pub fn to_csv(rows: &[RequestRow]) -> String {
    let mut out = String::from(
        "index,request_id,warmup,scheduled_ms,sent_ms,status,error,ttft_ms,tpot_ms,itl_max_ms,e2el_ms,input_length,prompt_tokens,output_length,completion_tokens\n",
    );
    let opt = |v: Option<f64>| v.map_or_else(String::new, |x| format!("{x:.3}"));
    for r in rows {
        let error = r
            .error
            .as_deref()
            .unwrap_or("")
            // One line per row; a quote inside the quoted field is doubled (RFC 4180).
            .replace(['\n', '\r'], " ")
            .replace('"', "\"\"");
        out.push_str(&format!(
            "{},{},{},{},{:.3},{},\"{}\",{},{},{},{:.3},{},{},{},{}\n",
            r.index,
            r.request_id,
            r.warmup,
            opt(r.scheduled_ms),
            r.sent_ms,
            r.status,
            error,
            opt(r.ttft_ms),
            opt(r.tpot_ms),
            opt(r.itl_max_ms),
            r.e2el_ms,
            r.input_length,
            r.prompt_tokens,
            r.output_length,
            r.completion_tokens
        ));
    }
    out
}

/// The human summary.
pub fn to_text(s: &Summary) -> String {
    let mut out = format!(
        "requests: {} measured, {} completed, {} failed ({} warm-up discarded) in {:.1} s\n",
        s.measured, s.completed, s.failed, s.warmup_discarded, s.duration_s
    );
    for (kind, n) in &s.errors {
        out.push_str(&format!("  errors {kind}: {n}\n"));
    }
    out.push_str(&format!(
        "throughput: {:.2} req/s, {:.0} input tok/s, {:.0} output tok/s\n",
        s.request_throughput, s.input_token_throughput, s.output_token_throughput
    ));
    out.push_str("              p50        p90        p95        p99      p99.9        max\n");
    for (name, d) in [
        ("TTFT", &s.ttft),
        ("TPOT", &s.tpot),
        ("ITL", &s.itl),
        ("E2EL", &s.e2el),
        ("send late", &s.send_lateness),
    ] {
        if d.count > 0 {
            out.push_str(&format!(
                "{name:<9} {:>7.1}ms  {:>7.1}ms  {:>7.1}ms  {:>7.1}ms  {:>7.1}ms  {:>7.1}ms\n",
                d.p50_ms, d.p90_ms, d.p95_ms, d.p99_ms, d.p999_ms, d.max_ms
            ));
        }
    }
    if let Some(g) = &s.goodput {
        out.push_str(&format!(
            "goodput: {} of {} requests met the SLO ({:.2} req/s, {:.0} output tok/s)\n",
            g.good_requests, s.measured, g.requests_per_s, g.output_tokens_per_s
        ));
    }
    if let Some(w) = &s.lengths.warning {
        out.push_str(&format!("WARNING: {w}\n"));
    }
    out
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn a_csv_error_field_keeps_its_quotes_doubled_on_one_line() {
        let row = RequestRow {
            error: Some("{\"error\": {\"message\": \"max_tokens\"}}\nmore".into()),
            ..RequestRow::default()
        };
        let csv = to_csv(&[row]);
        let line = csv.lines().nth(1).unwrap();
        assert!(
            line.contains(r#""{""error"": {""message"": ""max_tokens""}} more""#),
            "{line}"
        );
        assert_eq!(csv.lines().count(), 2);
    }
    use crate::client::{Failure, Timing};

    #[test]
    fn percentiles_interpolate_like_numpy() {
        let v: Vec<f64> = (1..=10).map(f64::from).collect();
        assert_eq!(percentile(&v, 50.0), 5.5);
        assert!((percentile(&v, 90.0) - 9.1).abs() < 1e-9);
        assert!((percentile(&v, 99.0) - 9.91).abs() < 1e-9);
        assert_eq!(percentile(&v, 0.0), 1.0);
        assert_eq!(percentile(&[3.0], 99.9), 3.0);
    }

    #[test]
    fn slo_parses_both_spellings_and_rejects_nonsense() {
        assert_eq!(
            Slo::parse("ttft=400,tpot:50").unwrap(),
            Slo {
                ttft_ms: Some(400.0),
                tpot_ms: Some(50.0),
                e2el_ms: None
            }
        );
        assert!(Slo::parse("speed=3").is_err());
        assert!(Slo::parse("ttft=-1").is_err());
        assert!(Slo::parse("").is_err());
    }

    fn result(ttft_ms: u64, out: u64, contracted: u32, ok: bool) -> RequestResult {
        RequestResult {
            index: 0,
            request_id: "r".into(),
            scheduled: Some(Duration::ZERO),
            sent: Duration::from_millis(1),
            warmup: false,
            input_length: 10,
            output_length: contracted,
            timing: Timing {
                status: if ok { 200 } else { 503 },
                failure: (!ok).then(|| Failure::Status(503, String::new())),
                ttft: Some(Duration::from_millis(ttft_ms)),
                itl: vec![Duration::from_millis(10); out.saturating_sub(1) as usize],
                e2e: Duration::from_millis(ttft_ms + 10 * out.saturating_sub(1)),
                prompt_tokens: 10,
                completion_tokens: out,
                target: String::new(),
                output: None,
            },
        }
    }

    #[test]
    fn goodput_counts_only_completed_requests_within_every_bound() {
        let rs = vec![
            result(100, 5, 5, true),
            result(500, 5, 5, true),
            result(100, 5, 5, false),
        ];
        let s = summarize(&rs, Some(Slo::parse("ttft=400,tpot=20").unwrap()));
        assert_eq!((s.completed, s.failed), (2, 1));
        assert_eq!(s.errors.get("status_503"), Some(&1));
        assert_eq!(s.goodput.unwrap().good_requests, 1);
        assert_eq!(s.tpot.p50_ms, 10.0);
        assert!(s.lengths.warning.is_none());
    }

    #[test]
    fn short_outputs_flag_a_different_workload() {
        let s = summarize(&[result(100, 3, 5, true)], None);
        assert_eq!(s.lengths.output_short, 1);
        assert!(s.lengths.warning.unwrap().contains("shorter workload"));
    }
}
