//! Output agreement and the shadow comparison of `headroom report compare`.
//!
//! ```text
//! two runs of one trace:  rows joined by trace index; both answered, both fingerprinted
//! one capture (shadow):   primary and shadow records joined by request_id
//! agreement  = byte-identical outputs / outputs compared     (deterministic sampling only)
//! diverged   = first output token that differs, over the mismatches
//! paired Δ   = shadow − primary per request, then its median (the same request, the same moment)
//! ```

use std::collections::HashMap;

use headroom_workload::digest::Fingerprint;
use headroom_workload::trace::TraceRecord;
use serde::Serialize;
use serde_json::{Value, json};

use crate::report::{Dist, RequestRow, percentile};

/// How the outputs of two answers to the same requests compare.
#[derive(Debug, Clone, Default, Serialize, PartialEq)]
pub struct OutputAgreement {
    /// Requests with an output on both sides.
    pub compared: usize,
    /// Of those, byte-identical.
    pub matched: usize,
    /// Mismatches whose first differing token is known: its median.
    pub diverged_at_p50: Option<f64>,
    /// …and its smallest.
    pub diverged_at_min: Option<u32>,
    /// Requests whose output token counts differ.
    pub length_differs: usize,
    /// Mean of (B − A) output tokens.
    pub length_diff_mean: f64,
}

impl OutputAgreement {
    /// Share of compared outputs that are identical.
    pub fn rate(&self) -> Option<f64> {
        (self.compared > 0).then(|| self.matched as f64 / self.compared as f64)
    }

    fn collect(pairs: impl Iterator<Item = (bool, Option<u32>, i64)>) -> Self {
        let mut out = Self::default();
        let mut diverged = Vec::new();
        let mut diff_sum = 0i64;
        for (exact, at, diff) in pairs {
            out.compared += 1;
            out.matched += usize::from(exact);
            diverged.extend(at.filter(|_| !exact).map(f64::from));
            out.length_differs += usize::from(diff != 0);
            diff_sum += diff;
        }
        if out.compared > 0 {
            out.length_diff_mean = diff_sum as f64 / out.compared as f64;
        }
        diverged.sort_by(f64::total_cmp);
        out.diverged_at_p50 = (!diverged.is_empty()).then(|| percentile(&diverged, 50.0));
        out.diverged_at_min = diverged.first().map(|&d| d as u32);
        out
    }

    /// One paragraph for a text report.
    pub fn text(&self) -> String {
        let Some(rate) = self.rate() else {
            return "Output agreement: no request was answered on both sides with an output to compare.\n".into();
        };
        let mut s = format!(
            "Output agreement ({} requests answered on both sides, deterministic sampling): {:.1}% byte-identical",
            self.compared,
            100.0 * rate
        );
        let differ = self.compared - self.matched;
        if differ > 0 {
            s.push_str(&format!("; {differ} differ"));
            if let (Some(p50), Some(min)) = (self.diverged_at_p50, self.diverged_at_min) {
                s.push_str(&format!(
                    ", first at output token {p50:.0} (median; earliest {min})"
                ));
            }
        }
        s.push_str(&format!(
            "; output length differs on {} (mean {:+.1} tokens).\n",
            self.length_differs, self.length_diff_mean
        ));
        s
    }
}

/// Output agreement of two runs of one trace, rows joined by trace index (warm-up and failed
/// requests left out); `None` when either run kept no outputs.
pub fn runs_agreement(a: &[RequestRow], b: &[RequestRow]) -> Option<OutputAgreement> {
    let outputs = |rows: &[RequestRow]| -> HashMap<usize, (Fingerprint, u64)> {
        rows.iter()
            .filter(|r| !r.warmup && r.error.is_none())
            .filter_map(|r| {
                let f = Fingerprint::decode(r.output.as_deref()?).ok()?;
                Some((r.index, (f, r.completion_tokens)))
            })
            .collect()
    };
    let (a, b) = (outputs(a), outputs(b));
    if a.is_empty() || b.is_empty() {
        return None;
    }
    let mut keys: Vec<&usize> = a.keys().filter(|k| b.contains_key(k)).collect();
    keys.sort();
    Some(OutputAgreement::collect(keys.into_iter().map(|k| {
        let ((fa, na), (fb, nb)) = (&a[k], &b[k]);
        let c = fa.compare(fb);
        (c.exact, c.diverged_at, *nb as i64 - *na as i64)
    })))
}

/// A 2xx answer relayed to its end.
fn completed(r: &TraceRecord) -> bool {
    r.status.is_some_and(|s| (200..300).contains(&s)) && r.e2e_ms.is_some()
}

/// One side of a shadow comparison.
#[derive(Debug, Clone, Serialize)]
pub struct Side {
    /// Pools seen on this side.
    pub pools: Vec<String>,
    /// Paired requests.
    pub requests: usize,
    /// Completed (2xx, whole answer).
    pub completed: usize,
    /// Met every objective of their class.
    pub good: usize,
    /// TTFT.
    pub ttft: Dist,
    /// TPOT.
    pub tpot: Dist,
    /// E2E.
    pub e2e: Dist,
}

impl Side {
    fn of(records: &[&TraceRecord]) -> Self {
        let mut pools: Vec<String> = records.iter().filter_map(|r| r.pool.clone()).collect();
        pools.sort();
        pools.dedup();
        let dist = |f: fn(&TraceRecord) -> Option<f64>| {
            let mut v: Vec<f64> = records
                .iter()
                .filter(|r| completed(r))
                .filter_map(|r| f(r))
                .collect();
            Dist::of(&mut v)
        };
        Self {
            pools,
            requests: records.len(),
            completed: records.iter().filter(|r| completed(r)).count(),
            good: records.iter().filter(|r| r.good == Some(true)).count(),
            ttft: dist(|r| r.ttft_ms),
            tpot: dist(|r| r.tpot_ms),
            e2e: dist(|r| r.e2e_ms),
        }
    }
}

/// The primary's and the shadow's answers to the same requests, from one capture.
#[derive(Debug, Clone, Serialize)]
pub struct ShadowComparison {
    /// Primary records without a shadow record (not sampled, or the copy was dropped).
    pub not_copied: usize,
    /// Shadow records without a primary record (the primary's was sampled out of the capture).
    pub unpaired_shadows: usize,
    /// The primary.
    pub primary: Side,
    /// The shadow.
    pub shadow: Side,
    /// Median of (shadow − primary) TTFT over requests both completed, ms.
    pub paired_ttft_delta_p50_ms: Option<f64>,
    /// Median of (shadow − primary) TPOT, ms.
    pub paired_tpot_delta_p50_ms: Option<f64>,
    /// Output agreement, from the shadow records.
    pub agreement: OutputAgreement,
}

/// Compares a capture's primary and shadow records; `None` when it holds no shadow record.
pub fn shadow_comparison(records: &[TraceRecord]) -> Option<ShadowComparison> {
    let primaries: HashMap<&str, &TraceRecord> = records
        .iter()
        .filter(|r| r.shadow.is_none())
        .filter_map(|r| Some((r.request_id.as_deref()?, r)))
        .collect();
    let mut pairs: Vec<(&TraceRecord, &TraceRecord)> = Vec::new();
    let mut unpaired_shadows = 0;
    for s in records.iter().filter(|r| r.shadow.is_some()) {
        match s.request_id.as_deref().and_then(|id| primaries.get(id)) {
            Some(p) => pairs.push((p, s)),
            None => unpaired_shadows += 1,
        }
    }
    if pairs.is_empty() && unpaired_shadows == 0 {
        return None;
    }
    let deltas = |f: fn(&TraceRecord) -> Option<f64>| {
        let mut d: Vec<f64> = pairs
            .iter()
            .filter(|(p, s)| completed(p) && completed(s))
            .filter_map(|(p, s)| Some(f(s)? - f(p)?))
            .collect();
        d.sort_by(f64::total_cmp);
        (!d.is_empty()).then(|| percentile(&d, 50.0))
    };
    let agreement = OutputAgreement::collect(pairs.iter().filter_map(|(_, s)| {
        let f = s.shadow?;
        Some((f.output_match?, f.diverged_at, f.length_diff.unwrap_or(0)))
    }));
    let (p, s): (Vec<&TraceRecord>, Vec<&TraceRecord>) = pairs.iter().copied().unzip();
    Some(ShadowComparison {
        // A reused request id can pair one primary with several copies.
        not_copied: primaries.len().saturating_sub(pairs.len()),
        unpaired_shadows,
        primary: Side::of(&p),
        shadow: Side::of(&s),
        paired_ttft_delta_p50_ms: deltas(|r| r.ttft_ms),
        paired_tpot_delta_p50_ms: deltas(|r| r.tpot_ms),
        agreement,
    })
}

/// The shadow comparison as text (contract first, then speed, goodput, agreement) and JSON.
pub fn shadow_text(c: &ShadowComparison) -> (String, Value) {
    let mut out = format!(
        "Shadow comparison: {} requests of {} answered by the primary and, as copies sent at the same moments, by {}.\n\
         Same contract by construction (the same requests at the same times): the differences below are the fleets'.\n",
        c.primary.requests,
        c.primary.pools.join(", "),
        c.shadow.pools.join(", "),
    );
    if c.not_copied > 0 || c.unpaired_shadows > 0 {
        out.push_str(&format!(
            "({} primary requests had no copy: not sampled, or dropped; {} copies had no primary record.)\n",
            c.not_copied, c.unpaired_shadows
        ));
    }
    out.push_str(&format!(
        "{:<14} {:>12} {:>12} {:>10}\n",
        "", "primary", "shadow", "Δ"
    ));
    let share = |n: usize, of: usize| (of > 0).then(|| n as f64 / of as f64 * 100.0);
    let rows: Vec<(&str, Option<f64>, Option<f64>)> = vec![
        (
            "completed",
            Some(c.primary.completed as f64),
            Some(c.shadow.completed as f64),
        ),
        (
            "good %",
            share(c.primary.good, c.primary.requests),
            share(c.shadow.good, c.shadow.requests),
        ),
        ("TTFT p50 ms", q(&c.primary.ttft, 50), q(&c.shadow.ttft, 50)),
        ("TTFT p95 ms", q(&c.primary.ttft, 95), q(&c.shadow.ttft, 95)),
        ("TTFT p99 ms", q(&c.primary.ttft, 99), q(&c.shadow.ttft, 99)),
        ("TPOT p50 ms", q(&c.primary.tpot, 50), q(&c.shadow.tpot, 50)),
        ("TPOT p95 ms", q(&c.primary.tpot, 95), q(&c.shadow.tpot, 95)),
        ("TPOT p99 ms", q(&c.primary.tpot, 99), q(&c.shadow.tpot, 99)),
        ("E2E p99 ms", q(&c.primary.e2e, 99), q(&c.shadow.e2e, 99)),
    ];
    let mut json_rows = Vec::new();
    for (name, a, b) in rows {
        let delta = delta(a, b);
        out.push_str(&format!(
            "{name:<14} {:>12} {:>12} {delta:>10}\n",
            num(a),
            num(b)
        ));
        json_rows.push(json!({"metric": name, "primary": a, "shadow": b, "delta": delta}));
    }
    let paired = |v: Option<f64>| v.map_or_else(|| "-".into(), |v| format!("{v:+.2} ms"));
    out.push_str(&format!(
        "Paired (the same request on both): median shadow − primary TTFT {}, TPOT {}.\n",
        paired(c.paired_ttft_delta_p50_ms),
        paired(c.paired_tpot_delta_p50_ms)
    ));
    out.push_str(&c.agreement.text());
    (out, json!({"shadow": c, "rows": json_rows}))
}

fn q(d: &Dist, p: u32) -> Option<f64> {
    (d.count > 0).then_some(match p {
        50 => d.p50_ms,
        95 => d.p95_ms,
        _ => d.p99_ms,
    })
}

/// `{:.2}` or `-`.
pub fn num(v: Option<f64>) -> String {
    v.map_or_else(|| "-".into(), |v| format!("{v:.2}"))
}

/// Relative change from `a` to `b`, or `-`.
pub fn delta(a: Option<f64>, b: Option<f64>) -> String {
    match (a, b) {
        (Some(x), Some(y)) if x != 0.0 => format!("{:+.1}%", 100.0 * (y - x) / x),
        _ => "-".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use headroom_workload::digest::OutputDigest;
    use headroom_workload::trace::ShadowFields;

    fn fp(words: &[&str]) -> String {
        let mut d = OutputDigest::new();
        for w in words {
            d.event(w);
        }
        d.finish().encode()
    }

    fn row(index: usize, output: Option<String>, tokens: u64) -> RequestRow {
        RequestRow {
            index,
            status: 200,
            completion_tokens: tokens,
            output,
            ..RequestRow::default()
        }
    }

    #[test]
    fn runs_agree_where_their_outputs_are_equal() {
        let a = vec![
            row(0, Some(fp(&[" a", " b", " c"])), 3),
            row(1, Some(fp(&[" a", " b", " c"])), 3),
            row(2, Some(fp(&[" x"])), 1),
        ];
        let b = vec![
            row(0, Some(fp(&[" a", " b", " c"])), 3),
            row(1, Some(fp(&[" a", " z", " c", " d"])), 4),
            row(3, Some(fp(&[" y"])), 1),
        ];
        let g = runs_agreement(&a, &b).unwrap();
        assert_eq!((g.compared, g.matched, g.length_differs), (2, 1, 1));
        assert_eq!((g.diverged_at_p50, g.diverged_at_min), (Some(1.0), Some(1)));
        assert!(
            g.text()
                .contains("50.0% byte-identical; 1 differ, first at output token 1")
        );
        assert!(runs_agreement(&a, &[row(0, None, 3)]).is_none());
    }

    #[test]
    fn a_capture_pairs_primary_and_shadow_records() {
        let rec = |id: &str, shadow: Option<ShadowFields>, ttft: f64| TraceRecord {
            request_id: Some(id.into()),
            pool: Some(
                if shadow.is_some() {
                    "candidate"
                } else {
                    "live"
                }
                .into(),
            ),
            status: Some(200),
            ttft_ms: Some(ttft),
            e2e_ms: Some(ttft + 10.0),
            good: Some(true),
            shadow,
            ..TraceRecord::default()
        };
        let same = ShadowFields {
            output_match: Some(true),
            diverged_at: None,
            length_diff: Some(0),
        };
        let differs = ShadowFields {
            output_match: Some(false),
            diverged_at: Some(7),
            length_diff: Some(2),
        };
        let records = vec![
            rec("a", None, 10.0),
            rec("a", Some(same), 14.0),
            rec("b", None, 20.0),
            rec("b", Some(differs), 26.0),
            rec("c", None, 30.0),
        ];
        let c = shadow_comparison(&records).unwrap();
        assert_eq!((c.not_copied, c.unpaired_shadows), (1, 0));
        assert_eq!(c.paired_ttft_delta_p50_ms, Some(5.0));
        assert_eq!((c.agreement.compared, c.agreement.matched), (2, 1));
        let (text, _) = shadow_text(&c);
        assert!(
            text.starts_with("Shadow comparison: 2 requests of live"),
            "{text}"
        );
        assert!(text.contains("Same contract by construction"));
        assert!(text.contains("first at output token 7"), "{text}");
        assert!(shadow_comparison(&records[..1]).is_none());
    }
}
