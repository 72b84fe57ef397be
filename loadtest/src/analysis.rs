//! Reports over traces and results: the prompt-length tail report, comparing two runs (refusing
//! to call a difference in contracts a comparison), and merging sharded runs.

use std::collections::BTreeMap;

use headroom_workload::trace::TraceRecord;
use serde::Serialize;
use serde_json::{Value, json};

use crate::html::{self, Chart, Section, Series, Style, escape, table};
use crate::report::{Dist, RequestRow, percentile};

/// One prompt-length bucket of the tail report: [lo, hi) tokens.
#[derive(Debug, Clone, Serialize)]
pub struct Bucket {
    /// Lower bound (inclusive).
    pub lo: u32,
    /// Upper bound (exclusive).
    pub hi: u32,
    /// Requests.
    pub requests: usize,
    /// Share of all prompt tokens.
    pub token_share: f64,
    /// TTFT median in the bucket, ms (when timings are known).
    pub ttft_p50_ms: Option<f64>,
    /// TTFT p99 in the bucket, ms.
    pub ttft_p99_ms: Option<f64>,
}

/// The prompt-length tail report.
#[derive(Debug, Clone, Serialize)]
pub struct TailReport {
    /// Requests.
    pub requests: usize,
    /// Prompt length distribution, in tokens.
    #[serde(serialize_with = "crate::report::serialize_count")]
    pub prompt_tokens: Dist,
    /// Share of all prompt tokens in the longest 1% of prompts.
    pub top1_token_share: f64,
    /// Share of quadratic attention work (Σ n²) in the longest 1%.
    pub top1_attention_share: f64,
    /// Log-scale (powers of two) histogram, with TTFT per bucket where known.
    pub buckets: Vec<Bucket>,
    /// Correlation of log TTFT with log prompt length (when timings are known).
    pub ttft_vs_length: Option<f64>,
    /// Correlation of log TTFT with requests in flight at arrival.
    pub ttft_vs_load: Option<f64>,
    /// What to do about it.
    pub recommendation: String,
}

/// A request as the tail report sees it: prompt length, and optionally TTFT and timing.
#[derive(Debug, Clone, Copy)]
pub struct TailPoint {
    /// Prompt tokens.
    pub input: u32,
    /// TTFT, ms.
    pub ttft_ms: Option<f64>,
    /// Arrival, ms.
    pub at_ms: f64,
    /// End, ms (to count requests in flight).
    pub end_ms: Option<f64>,
    /// Counted in the report's figures (a warm-up request is not, but it was in flight).
    pub measured: bool,
}

impl TailPoint {
    /// From a trace record (captured traces carry ttft_ms and e2e_ms).
    pub fn from_record(r: &TraceRecord) -> Self {
        let at = r.timestamp as f64;
        Self {
            input: r.input_length,
            ttft_ms: r.ttft_ms,
            at_ms: at,
            end_ms: r.e2e_ms.map(|e| at + e),
            measured: true,
        }
    }

    /// From a replay result row.
    pub fn from_row(r: &RequestRow) -> Self {
        Self {
            input: r.input_length,
            ttft_ms: r.ttft_ms,
            at_ms: r.sent_ms,
            end_ms: Some(r.sent_ms + r.e2el_ms),
            measured: !r.warmup,
        }
    }
}

fn correlation(xs: &[f64], ys: &[f64]) -> Option<f64> {
    let n = xs.len() as f64;
    if xs.len() < 3 {
        return None;
    }
    let (mx, my) = (xs.iter().sum::<f64>() / n, ys.iter().sum::<f64>() / n);
    let cov: f64 = xs.iter().zip(ys).map(|(x, y)| (x - mx) * (y - my)).sum();
    let vx: f64 = xs.iter().map(|x| (x - mx).powi(2)).sum();
    let vy: f64 = ys.iter().map(|y| (y - my).powi(2)).sum();
    (vx > 0.0 && vy > 0.0).then(|| cov / (vx * vy).sqrt())
}

/// Fewer requests than this and the longest 1% is a request or two: the report says so.
const MIN_TAIL_REQUESTS: usize = 200;
/// A correlation weaker than this does not say what drives TTFT.
const MIN_CORRELATION: f64 = 0.3;
/// Nor does one over fewer timed requests than this.
const MIN_CORRELATED: usize = 30;

/// Builds the tail report from the measured points; every point, warm-up included, counts as
/// load (in flight) for the others.
pub fn tail_report(all: &[TailPoint]) -> TailReport {
    let measured: Vec<TailPoint> = all.iter().filter(|p| p.measured).copied().collect();
    let points = measured.as_slice();
    let mut lens: Vec<f64> = points.iter().map(|p| f64::from(p.input)).collect();
    let dist = Dist::of(&mut lens);
    let total_tokens: f64 = lens.iter().sum();
    let total_sq: f64 = lens.iter().map(|n| n * n).sum();
    let top = ((lens.len() as f64) * 0.01).ceil() as usize;
    let top_slice = &lens[lens.len().saturating_sub(top)..];
    let top1_token_share = if total_tokens > 0.0 {
        top_slice.iter().sum::<f64>() / total_tokens
    } else {
        0.0
    };
    let top1_attention_share = if total_sq > 0.0 {
        top_slice.iter().map(|n| n * n).sum::<f64>() / total_sq
    } else {
        0.0
    };

    let mut buckets: BTreeMap<u32, (Vec<f64>, f64)> = BTreeMap::new();
    for p in points {
        let k = 31 - p.input.max(1).leading_zeros();
        let e = buckets.entry(k).or_default();
        e.1 += f64::from(p.input);
        if let Some(t) = p.ttft_ms {
            e.0.push(t);
        }
    }
    let buckets: Vec<Bucket> = buckets
        .into_iter()
        .map(|(k, (mut ttfts, tokens))| {
            ttfts.sort_by(f64::total_cmp);
            let count = points
                .iter()
                .filter(|p| 31 - p.input.max(1).leading_zeros() == k)
                .count();
            Bucket {
                lo: 1 << k,
                hi: 1u32.checked_shl(k + 1).unwrap_or(u32::MAX),
                requests: count,
                token_share: if total_tokens > 0.0 {
                    tokens / total_tokens
                } else {
                    0.0
                },
                ttft_p50_ms: (!ttfts.is_empty()).then(|| percentile(&ttfts, 50.0)),
                ttft_p99_ms: (!ttfts.is_empty()).then(|| percentile(&ttfts, 99.0)),
            }
        })
        .collect();

    let timed: Vec<&TailPoint> = points
        .iter()
        .filter(|p| p.ttft_ms.is_some_and(|t| t > 0.0))
        .collect();
    let log_ttft: Vec<f64> = timed
        .iter()
        .filter_map(|p| p.ttft_ms.map(f64::ln))
        .collect();
    let ttft_vs_length = correlation(
        &timed
            .iter()
            .map(|p| f64::from(p.input.max(1)).ln())
            .collect::<Vec<_>>(),
        &log_ttft,
    );
    let in_flight: Vec<f64> = timed
        .iter()
        .map(|p| {
            all.iter()
                .filter(|q| q.at_ms <= p.at_ms && q.end_ms.is_some_and(|e| e > p.at_ms))
                .count() as f64
        })
        .collect();
    let ttft_vs_load = if points.iter().any(|p| p.end_ms.is_some()) {
        correlation(&in_flight, &log_ttft)
    } else {
        None
    };

    let threshold = (dist.p99_ms as u32).next_power_of_two() / 2;
    // A round threshold below the p99: the share it moves is said, not assumed to be 1%.
    let above =
        points.iter().filter(|p| p.input > threshold).count() as f64 / points.len().max(1) as f64;
    let heavy_tail = top1_token_share > 0.05 || top1_attention_share > 0.25;
    let longest_slow = {
        let timed_buckets: Vec<&Bucket> =
            buckets.iter().filter(|b| b.ttft_p99_ms.is_some()).collect();
        match (timed_buckets.first(), timed_buckets.last()) {
            (Some(first), Some(last)) if timed_buckets.len() > 1 => {
                last.ttft_p99_ms.unwrap_or(0.0) > 3.0 * first.ttft_p99_ms.unwrap_or(f64::MAX)
            }
            _ => false,
        }
    };
    // A correlation says something only when it is positive, not weak, and over enough requests.
    let telling =
        |r: Option<f64>| r.filter(|r| *r >= MIN_CORRELATION && timed.len() >= MIN_CORRELATED);
    let driver = match (telling(ttft_vs_length), telling(ttft_vs_load)) {
        (l, Some(q)) if l.is_none_or(|l| q > l) => {
            " TTFT follows load more than prompt length: admission (queueing at the proxy) matters more than routing long prompts apart."
        }
        (Some(_), _) => " TTFT follows prompt length: the long prompts themselves set the tail.",
        _ => "",
    };
    let few = if points.len() < MIN_TAIL_REQUESTS {
        format!(
            "Too few requests to judge a 1% tail ({} requests: the longest 1% is {} request(s)); read this over a few hundred or more. ",
            points.len(),
            points.len().div_ceil(100)
        )
    } else {
        String::new()
    };
    let recommendation = few
        + &if heavy_tail || longest_slow {
            format!(
                "Route prompts above ~{threshold} tokens ({:.1}% of requests) to their own pool: the longest 1% carry {:.0}% of prompt tokens and {:.0}% of attention work{}, and their prefill delays every request batched with them.{driver}",
                100.0 * above,
                100.0 * top1_token_share,
                100.0 * top1_attention_share,
                if longest_slow {
                    ", and their p99 TTFT is over 3× the shortest prompts'"
                } else {
                    ""
                }
            )
        } else {
            format!(
                "No separate long-prompt route needed: the longest 1% carry only {:.0}% of prompt tokens.{driver}",
                100.0 * top1_token_share
            )
        };
    TailReport {
        requests: points.len(),
        prompt_tokens: dist,
        top1_token_share,
        top1_attention_share,
        buckets,
        ttft_vs_length,
        ttft_vs_load,
        recommendation,
    }
}

/// Text form of the tail report.
pub fn tail_text(t: &TailReport) -> String {
    let d = &t.prompt_tokens;
    let mut out = format!(
        "prompt tokens over {} requests: p50 {:.0}, p90 {:.0}, p95 {:.0}, p99 {:.0}, p99.9 {:.0}, max {:.0}\n",
        t.requests, d.p50_ms, d.p90_ms, d.p95_ms, d.p99_ms, d.p999_ms, d.max_ms
    );
    out.push_str(&format!(
        "longest 1%: {:.1}% of prompt tokens, {:.1}% of attention work (sum of n^2)\n",
        100.0 * t.top1_token_share,
        100.0 * t.top1_attention_share
    ));
    out.push_str("     tokens      requests  token share   TTFT p50   TTFT p99\n");
    for b in &t.buckets {
        let ms = |v: Option<f64>| v.map_or_else(|| "-".into(), |v| format!("{v:.1}ms"));
        out.push_str(&format!(
            "{:>6}-{:<6} {:>9} {:>11.1}% {:>10} {:>10}\n",
            b.lo,
            b.hi,
            b.requests,
            100.0 * b.token_share,
            ms(b.ttft_p50_ms),
            ms(b.ttft_p99_ms)
        ));
    }
    if let Some(c) = t.ttft_vs_length {
        out.push_str(&format!(
            "correlation of log TTFT with log prompt length: {c:.2}\n"
        ));
    }
    if let Some(c) = t.ttft_vs_load {
        out.push_str(&format!(
            "correlation of log TTFT with requests in flight: {c:.2}\n"
        ));
    }
    out.push_str(&format!("recommendation: {}\n", t.recommendation));
    out
}

/// CSV of the buckets.
pub fn tail_csv(t: &TailReport) -> String {
    let mut out = String::from("lo,hi,requests,token_share,ttft_p50_ms,ttft_p99_ms\n");
    let opt = |v: Option<f64>| v.map_or_else(String::new, |v| format!("{v:.3}"));
    for b in &t.buckets {
        out.push_str(&format!(
            "{},{},{},{:.6},{},{}\n",
            b.lo,
            b.hi,
            b.requests,
            b.token_share,
            opt(b.ttft_p50_ms),
            opt(b.ttft_p99_ms)
        ));
    }
    out
}

/// HTML form of the tail report.
pub fn tail_page(t: &TailReport, source: &str) -> String {
    let x: Vec<f64> = t.buckets.iter().map(|b| f64::from(b.lo)).collect();
    let mut charts = vec![Chart {
        title: "Prompt length histogram (log scale)".into(),
        x_label: "prompt tokens (bucket start)".into(),
        y_label: "requests".into(),
        log_x: true,
        log_y: false,
        x: x.clone(),
        series: vec![Series {
            label: "requests".into(),
            values: t.buckets.iter().map(|b| Some(b.requests as f64)).collect(),
            style: Style::Bars,
        }],
    }];
    if t.buckets.iter().any(|b| b.ttft_p99_ms.is_some()) {
        charts.push(Chart {
            title: "TTFT by prompt length".into(),
            x_label: "prompt tokens (bucket start)".into(),
            y_label: "TTFT (ms)".into(),
            log_x: true,
            log_y: true,
            x,
            series: vec![
                Series {
                    label: "p50".into(),
                    values: t.buckets.iter().map(|b| b.ttft_p50_ms).collect(),
                    style: Style::Line,
                },
                Series {
                    label: "p99".into(),
                    values: t.buckets.iter().map(|b| b.ttft_p99_ms).collect(),
                    style: Style::Line,
                },
            ],
        });
    }
    let rows: Vec<Vec<String>> = t
        .buckets
        .iter()
        .map(|b| {
            let ms = |v: Option<f64>| v.map_or_else(|| "-".into(), |v| format!("{v:.1}"));
            vec![
                format!("{}–{}", b.lo, b.hi),
                b.requests.to_string(),
                format!("{:.1}%", 100.0 * b.token_share),
                ms(b.ttft_p50_ms),
                ms(b.ttft_p99_ms),
            ]
        })
        .collect();
    let html_text = format!(
        "<p><b>{}</b></p><pre>{}</pre>{}",
        escape(&t.recommendation),
        escape(&tail_text(t)),
        table(
            &[
                "prompt tokens",
                "requests",
                "token share",
                "TTFT p50 ms",
                "TTFT p99 ms"
            ],
            &rows
        )
    );
    html::page(
        "headroom tail report",
        source,
        &[Section {
            heading: "Prompt-length tail".into(),
            html: html_text,
            charts,
        }],
    )
}

/// Keys of a contract that may differ between two runs without making them incomparable.
const INCIDENTAL: &[&str] = &["run_id", "tool", "prompt_salt"];
/// Contract keys that say how a result was put together, not what load it contracted: a merged
/// result's list of shards.
const BOOKKEEPING: &[&str] = &["trace.shards_merged"];

fn flatten(prefix: &str, v: &Value, out: &mut BTreeMap<String, Value>) {
    match v {
        Value::Object(m) => {
            for (k, x) in m {
                let key = if prefix.is_empty() {
                    k.clone()
                } else {
                    format!("{prefix}.{k}")
                };
                if (prefix.is_empty() && INCIDENTAL.contains(&k.as_str()))
                    || BOOKKEEPING.contains(&key.as_str())
                {
                    continue;
                }
                flatten(&key, x, out);
            }
        }
        _ => {
            out.insert(prefix.to_owned(), v.clone());
        }
    }
}

/// The top-level contract keys whose values differ between two runs.
pub fn contract_differences(a: &Value, b: &Value) -> Vec<String> {
    let (mut fa, mut fb) = (BTreeMap::new(), BTreeMap::new());
    flatten("", a, &mut fa);
    flatten("", b, &mut fb);
    let mut keys: Vec<String> = fa
        .keys()
        .chain(fb.keys())
        .filter(|k| fa.get(*k) != fb.get(*k))
        .map(|k| k.split('.').next().unwrap_or(k).to_owned())
        .collect();
    keys.sort();
    keys.dedup();
    keys
}

/// Side-by-side comparison of two replay results.
pub fn compare(a: &Value, b: &Value) -> (String, Value) {
    let diffs = contract_differences(&a["contract"], &b["contract"]);
    let mut out = String::new();
    match diffs.len() {
        0 => out.push_str("Same contract: the difference below is the run-to-run difference.\n"),
        1 => out.push_str(&format!("Compared: the contracts differ only in `{}`.\n", diffs[0])),
        _ => out.push_str(&format!(
            "These are being described, not compared: the contracts differ in {} things ({}), so no difference below can be put down to one of them.\n",
            diffs.len(),
            diffs.join(", ")
        )),
    }
    let metrics: &[(&str, &[&str])] = &[
        ("completed", &["completed"]),
        ("failed", &["failed"]),
        ("req/s", &["request_throughput"]),
        ("output tok/s", &["output_token_throughput"]),
        ("TTFT p50 ms", &["ttft", "p50_ms"]),
        ("TTFT p95 ms", &["ttft", "p95_ms"]),
        ("TTFT p99 ms", &["ttft", "p99_ms"]),
        ("TPOT p50 ms", &["tpot", "p50_ms"]),
        ("TPOT p95 ms", &["tpot", "p95_ms"]),
        ("TPOT p99 ms", &["tpot", "p99_ms"]),
        ("ITL p99 ms", &["itl", "p99_ms"]),
        ("E2EL p99 ms", &["e2el", "p99_ms"]),
        ("good req/s", &["goodput", "requests_per_s"]),
    ];
    out.push_str(&format!(
        "{:<14} {:>12} {:>12} {:>10}\n",
        "", "A", "B", "B vs A"
    ));
    let mut rows = Vec::new();
    for (name, path) in metrics {
        // A latency measure of no samples (every request failed; a merged result's ITL) is not
        // a value of 0: it is shown as absent.
        let get = |doc: &Value| {
            let empty = path.len() == 2 && doc["summary"][path[0]]["count"].as_u64() == Some(0);
            (!empty)
                .then(|| path.iter().fold(&doc["summary"], |v, k| &v[*k]).as_f64())
                .flatten()
        };
        let (x, y) = (get(a), get(b));
        if x.is_none() && y.is_none() {
            continue;
        }
        let delta = crate::compare::delta(x, y);
        out.push_str(&format!(
            "{name:<14} {:>12} {:>12} {delta:>10}\n",
            crate::compare::num(x),
            crate::compare::num(y)
        ));
        rows.push(json!({"metric": name, "a": x, "b": y, "delta": delta}));
    }
    let rows_of = |doc: &Value| -> Vec<RequestRow> {
        serde_json::from_value(doc["requests"].clone()).unwrap_or_default()
    };
    // The salt may differ for a speed comparison, not for an output one: other prompts, other
    // answers.
    let same_prompts = a["contract"]["prompt_salt"] == b["contract"]["prompt_salt"];
    let agreement = same_prompts
        .then(|| crate::compare::runs_agreement(&rows_of(a), &rows_of(b)))
        .flatten();
    match &agreement {
        Some(g) => out.push_str(&g.text()),
        None if !same_prompts => out.push_str(
            "Output agreement: not comparable: the runs rendered different prompts (their prompt_salt differs); replay both with the same --prompt-salt.\n",
        ),
        None => out.push_str(
            "Output agreement: not known (a run without output fingerprints, replayed by an older headroom).\n",
        ),
    }
    (
        out,
        json!({"contract_differences": diffs, "rows": rows, "agreement": agreement}),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pt(input: u32, ttft: f64) -> TailPoint {
        TailPoint {
            input,
            ttft_ms: Some(ttft),
            at_ms: 0.0,
            end_ms: None,
            measured: true,
        }
    }

    #[test]
    fn tail_shares_and_buckets() {
        let mut pts: Vec<TailPoint> = (0..99).map(|_| pt(100, 10.0)).collect();
        pts.push(pt(20_000, 900.0));
        let t = tail_report(&pts);
        assert_eq!(t.requests, 100);
        let expected = 20_000.0 / (99.0 * 100.0 + 20_000.0);
        assert!((t.top1_token_share - expected).abs() < 1e-9);
        assert!(t.top1_attention_share > 0.99);
        assert_eq!(t.buckets.len(), 2);
        assert_eq!(
            (t.buckets[0].lo, t.buckets[0].hi, t.buckets[0].requests),
            (64, 128, 99)
        );
        assert_eq!(t.buckets[1].ttft_p99_ms, Some(900.0));
        // A hundred requests: the tail is one request, and the report says so first.
        assert!(
            t.recommendation
                .starts_with("Too few requests to judge a 1% tail")
                && t.recommendation.contains("Route prompts above"),
            "{}",
            t.recommendation
        );
        assert!(t.ttft_vs_length.unwrap() > 0.9);
        let mut many: Vec<TailPoint> = (0..396).map(|_| pt(100, 10.0)).collect();
        many.extend((0..4).map(|_| pt(20_000, 900.0)));
        let t = tail_report(&many);
        assert!(
            t.recommendation.starts_with("Route prompts above"),
            "{}",
            t.recommendation
        );
        // The share the threshold moves is said: here the 4 long prompts of 400.
        assert!(
            t.recommendation.contains("(1.0% of requests)"),
            "{}",
            t.recommendation
        );
    }

    #[test]
    fn warm_up_requests_count_as_load_not_as_samples() {
        // Five warm-up requests in flight through the first half of the run; the measured ones
        // are short, and slow while the warm-up runs.
        let mut pts: Vec<TailPoint> = (0..5)
            .map(|_| TailPoint {
                input: 9_000,
                ttft_ms: Some(5_000.0),
                at_ms: 0.0,
                end_ms: Some(20.0),
                measured: false,
            })
            .collect();
        pts.extend((0..40).map(|i| TailPoint {
            input: 100,
            ttft_ms: Some(if i < 20 { 100.0 } else { 10.0 }),
            at_ms: f64::from(i),
            end_ms: Some(f64::from(i) + 0.5),
            measured: true,
        }));
        let t = tail_report(&pts);
        assert_eq!(t.requests, 40, "warm-up requests are not samples");
        // The measured requests alone are one in flight each: nothing to correlate. With the
        // warm-up's load, TTFT follows it exactly.
        let measured: Vec<TailPoint> = pts.iter().filter(|p| p.measured).copied().collect();
        assert_eq!(tail_report(&measured).ttft_vs_load, None);
        assert!(
            (t.ttft_vs_load.unwrap() - 1.0).abs() < 1e-9,
            "{:?}",
            t.ttft_vs_load
        );
    }

    #[test]
    fn a_negative_or_weak_correlation_drives_nothing() {
        // TTFT falls as more requests are in flight (load does not explain it) and does not
        // follow length: no driver is named.
        let pts: Vec<TailPoint> = (0..300)
            .map(|i| TailPoint {
                input: 500 + (i % 7) as u32,
                ttft_ms: Some(50.0 - f64::from(i) / 10.0),
                at_ms: f64::from(i),
                end_ms: Some(300.0),
                measured: true,
            })
            .collect();
        let t = tail_report(&pts);
        assert!(t.ttft_vs_load.unwrap() < 0.0, "{:?}", t.ttft_vs_load);
        assert!(
            !t.recommendation.contains("TTFT follows"),
            "{}",
            t.recommendation
        );
    }

    #[test]
    fn uniform_prompts_need_no_route() {
        let pts: Vec<TailPoint> = (0..200).map(|i| pt(500 + i, 20.0)).collect();
        assert!(tail_report(&pts).recommendation.starts_with("No separate"));
    }

    #[test]
    fn comparisons_say_when_contracts_differ_in_more_than_one_thing() {
        let doc = |rate: f64, model: &str, ttft: f64| {
            json!({"contract": {"load": {"rate": rate}, "model": model, "run_id": "x", "seed": 1},
                   "summary": {"ttft": {"p50_ms": ttft}, "completed": 10}})
        };
        let (text, _) = compare(&doc(1.0, "m", 100.0), &doc(2.0, "m", 150.0));
        assert!(
            text.starts_with("Compared: the contracts differ only in `load`"),
            "{text}"
        );
        assert!(text.contains("+50.0%"), "{text}");
        let (text, v) = compare(&doc(1.0, "m", 100.0), &doc(2.0, "n", 150.0));
        assert!(
            text.starts_with("These are being described, not compared"),
            "{text}"
        );
        assert_eq!(v["contract_differences"], json!(["load", "model"]));
        let (text, _) = compare(&doc(1.0, "m", 100.0), &doc(1.0, "m", 100.0));
        assert!(text.starts_with("Same contract"));
        // A merged result against the same run unsharded: the list of shards is bookkeeping.
        let mut merged = doc(1.0, "m", 100.0);
        merged["contract"]["trace"] = json!({"requests": 10, "shards_merged": ["a", "b"]});
        let mut whole = doc(1.0, "m", 100.0);
        whole["contract"]["trace"] = json!({"requests": 10});
        let (text, _) = compare(&merged, &whole);
        assert!(text.starts_with("Same contract"), "{text}");
    }
}
