//! Client against proxy: a replay's per-request rows joined with the proxy's capture by
//! `x-request-id`, to show how far the proxy's passive numbers are from what the client measured.
//!
//! ```text
//! TTFT gap  = |client TTFT − proxy TTFT|             per request, then its distribution
//! TPOT, E2E = each side's distribution, and the relative difference of their percentiles
//! tokens    = requests whose output and prompt token counts agree exactly
//! ```
//!
//! The client's clock starts before its POST and stops when it reads a chunk; the proxy's starts
//! when it has read the request header and stops when it relays the chunk, so on loopback the
//! client's TTFT is the larger by the two hops.

use std::collections::HashMap;
use std::fmt::Write as _;

use headroom_workload::trace::TraceRecord;
use serde::Serialize;

use crate::report::{Buckets, Dist, RequestRow};

/// The joined comparison.
#[derive(Debug, Clone, Serialize)]
pub struct Agreement {
    /// Client rows (warm-up excluded) with a capture record of the same id.
    pub joined: usize,
    /// Client rows without one.
    pub client_only: usize,
    /// Capture records without a client row.
    pub proxy_only: usize,
    /// |client TTFT − proxy TTFT| per request.
    pub ttft_gap: Dist,
    /// Client TTFT.
    pub ttft_client: Dist,
    /// Proxy TTFT.
    pub ttft_proxy: Dist,
    /// Client TPOT.
    pub tpot_client: Dist,
    /// Proxy TPOT.
    pub tpot_proxy: Dist,
    /// Client E2E.
    pub e2e_client: Dist,
    /// Proxy E2E.
    pub e2e_proxy: Dist,
    /// Joined requests whose prompt and output token counts are equal on both sides.
    pub tokens_equal: usize,
}

/// Joins `rows` and `capture` by request id.
pub fn agreement(rows: &[RequestRow], capture: &[TraceRecord]) -> Agreement {
    let by_id: HashMap<&str, &TraceRecord> = capture
        .iter()
        .filter_map(|r| r.request_id.as_deref().map(|id| (id, r)))
        .collect();
    let mut seen = std::collections::HashSet::new();
    let (mut gap, mut tc, mut tp, mut pc, mut pp, mut ec, mut ep) = Default::default();
    let mut tokens_equal = 0;
    let mut client_only = 0;
    let push = |v: &mut Vec<f64>, x: Option<f64>| v.extend(x);
    for row in rows.iter().filter(|r| !r.warmup && r.error.is_none()) {
        let Some(rec) = by_id.get(row.request_id.as_str()) else {
            client_only += 1;
            continue;
        };
        seen.insert(row.request_id.as_str());
        if let (Some(c), Some(p)) = (row.ttft_ms, rec.ttft_ms) {
            Vec::push(&mut gap, (c - p).abs());
        }
        push(&mut tc, row.ttft_ms);
        push(&mut tp, rec.ttft_ms);
        push(&mut pc, row.tpot_ms);
        push(&mut pp, rec.tpot_ms);
        push(&mut ec, Some(row.e2el_ms));
        push(&mut ep, rec.e2e_ms);
        if u64::from(rec.output_length) == row.completion_tokens
            && u64::from(rec.input_length) == row.prompt_tokens
        {
            tokens_equal += 1;
        }
    }
    let dist = |v: &mut Vec<f64>| Dist::of(v);
    Agreement {
        joined: seen.len(),
        client_only,
        proxy_only: by_id.len() - seen.len(),
        ttft_gap: dist(&mut gap),
        ttft_client: dist(&mut tc),
        ttft_proxy: dist(&mut tp),
        tpot_client: dist(&mut pc),
        tpot_proxy: dist(&mut pp),
        e2e_client: dist(&mut ec),
        e2e_proxy: dist(&mut ep),
        tokens_equal,
    }
}

/// Pooled ITL, the client's against the proxy's `/stats` window.
#[derive(Debug, Clone, Serialize)]
pub struct ItlAgreement {
    /// The `/stats` window read.
    pub window: String,
    /// Gaps the client measured.
    pub client_gaps: usize,
    /// Gaps in the proxy's window.
    pub proxy_gaps: u64,
    /// One row per percentile both sides report.
    pub rows: Vec<ItlRow>,
}

/// One percentile of the pooled ITL on both sides.
#[derive(Debug, Clone, Serialize)]
pub struct ItlRow {
    /// The percentile (50, 95, 99).
    pub percentile: f64,
    /// The client's value, ms.
    pub client_ms: f64,
    /// The proxy's value, ms.
    pub proxy_ms: f64,
    /// Percent of the client's gaps at or below the proxy's value (where the proxy's value falls
    /// in the client's distribution), when the result kept its ITL buckets.
    pub client_percent_at_proxy: Option<f64>,
}

/// Reads the proxy's pooled ITL from a `/stats` document (`windows.<window>`: exactly one pool and
/// class entry) and sets it beside the client's.
pub fn itl_agreement(
    client: &Dist,
    client_buckets: Option<&Buckets>,
    stats: &serde_json::Value,
    window: &str,
) -> anyhow::Result<ItlAgreement> {
    let entries = stats["windows"][window]
        .as_array()
        .ok_or_else(|| anyhow::anyhow!("no `windows.{window}` in the /stats document"))?;
    let [entry] = entries.as_slice() else {
        anyhow::bail!(
            "the /stats window {window} has {} pool/class entries; a pooled ITL needs exactly one",
            entries.len()
        );
    };
    let itl = &entry["latency"]["itl_ms"];
    let value = |k: &str| {
        itl[k]
            .as_f64()
            .ok_or_else(|| anyhow::anyhow!("no `latency.itl_ms.{k}` in the {window} window"))
    };
    let mut rows = Vec::new();
    for (percentile, key, client_ms) in [
        (50.0, "p50", client.p50_ms),
        (95.0, "p95", client.p95_ms),
        (99.0, "p99", client.p99_ms),
    ] {
        let proxy_ms = value(key)?;
        rows.push(ItlRow {
            percentile,
            client_ms,
            proxy_ms,
            client_percent_at_proxy: client_buckets
                .and_then(|b| b.share_at_or_below(proxy_ms))
                .map(|s| 100.0 * s),
        });
    }
    Ok(ItlAgreement {
        window: window.to_owned(),
        client_gaps: client.count,
        proxy_gaps: itl["count"].as_u64().unwrap_or(0),
        rows,
    })
}

/// The pooled ITL comparison as a table.
pub fn itl_text(a: &ItlAgreement) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "\npooled ITL: the client's {} gaps against the proxy's {} (/stats, {} window)\n",
        a.client_gaps, a.proxy_gaps, a.window
    );
    let _ = writeln!(
        s,
        "| percentile | client ms | proxy ms | diff | the proxy's value is the client's |"
    );
    let _ = writeln!(s, "|---|---|---|---|---|");
    for r in &a.rows {
        let at = r
            .client_percent_at_proxy
            .map_or_else(|| "-".to_owned(), |p| format!("p{p:.2}"));
        let _ = writeln!(
            s,
            "| p{} | {:.3} | {:.3} | {} | {at} |",
            r.percentile,
            r.client_ms,
            r.proxy_ms,
            rel(r.client_ms, r.proxy_ms)
        );
    }
    s
}

fn rel(client: f64, proxy: f64) -> String {
    if client == 0.0 {
        return "-".into();
    }
    format!("{:+.2}%", (proxy - client) / client * 100.0)
}

/// A readable report.
pub fn agreement_text(a: &Agreement) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "joined by x-request-id: {} requests ({} only in the client's rows, {} only in the capture)",
        a.joined, a.client_only, a.proxy_only
    );
    let _ = writeln!(
        s,
        "token counts equal on both sides: {} of {}",
        a.tokens_equal, a.joined
    );
    let g = &a.ttft_gap;
    let _ = writeln!(
        s,
        "|client TTFT - proxy TTFT| per request: p50 {:.3} ms, p90 {:.3} ms, p99 {:.3} ms, max {:.3} ms",
        g.p50_ms, g.p90_ms, g.p99_ms, g.max_ms
    );
    let _ = writeln!(s);
    let _ = writeln!(
        s,
        "| measure | client p50 | proxy p50 | diff | client p90 | proxy p90 | diff | client p99 | proxy p99 | diff |"
    );
    let _ = writeln!(s, "|---|---|---|---|---|---|---|---|---|---|");
    for (name, c, p) in [
        ("TTFT ms", &a.ttft_client, &a.ttft_proxy),
        ("TPOT ms", &a.tpot_client, &a.tpot_proxy),
        ("E2E ms", &a.e2e_client, &a.e2e_proxy),
    ] {
        let _ = writeln!(
            s,
            "| {name} | {:.3} | {:.3} | {} | {:.3} | {:.3} | {} | {:.3} | {:.3} | {} |",
            c.p50_ms,
            p.p50_ms,
            rel(c.p50_ms, p.p50_ms),
            c.p90_ms,
            p.p90_ms,
            rel(c.p90_ms, p.p90_ms),
            c.p99_ms,
            p.p99_ms,
            rel(c.p99_ms, p.p99_ms),
        );
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(id: &str, ttft: f64, tpot: f64) -> RequestRow {
        RequestRow {
            index: 0,
            request_id: id.into(),
            warmup: false,
            scheduled_ms: None,
            sent_ms: 0.0,
            target: String::new(),
            status: 200,
            error: None,
            error_kind: None,
            ttft_ms: Some(ttft),
            tpot_ms: Some(tpot),
            itl_max_ms: None,
            e2el_ms: 100.0,
            input_length: 10,
            prompt_tokens: 10,
            output_length: 5,
            completion_tokens: 5,
            output: None,
        }
    }

    #[test]
    fn pooled_itl_is_read_from_one_stats_entry_and_placed_in_the_clients_distribution() {
        let stats = serde_json::json!({"windows": {"5m": [{"pool": "default", "class": "default",
            "latency": {"itl_ms": {"count": 4, "p50": 8.0, "p95": 9.0, "p99": 10.0, "max": 12.0}}}]}});
        // The client: 96 gaps of 8 ms, then 9.5, 10, 13 and 13 ms.
        let mut values: Vec<f64> = vec![8.0; 96];
        values.extend([9.5, 10.0, 13.0, 13.0]);
        let buckets = Buckets::of(values.iter().copied());
        assert_eq!(buckets.count(), 100);
        let client = Dist::of(&mut values);
        let a = itl_agreement(&client, Some(&buckets), &stats, "5m").unwrap();
        assert_eq!(a.rows.len(), 3);
        let p99 = &a.rows[2];
        assert_eq!((p99.percentile, p99.proxy_ms), (99.0, 10.0));
        // 98 of the client's 100 gaps are at or below the proxy's 10 ms.
        assert_eq!(p99.client_percent_at_proxy, Some(98.0));
        assert!(
            itl_text(&a).contains("| p99 | 13.000 | 10.000 | -23.08% | p98.00 |"),
            "{}",
            itl_text(&a)
        );
        // Several entries, or no window: a clear error.
        let two = serde_json::json!({"windows": {"5m": [{}, {}]}});
        let e = itl_agreement(&client, None, &two, "5m")
            .unwrap_err()
            .to_string();
        assert!(e.contains("2 pool/class entries"), "{e}");
        assert!(itl_agreement(&client, None, &stats, "1h").is_err());
    }

    #[test]
    fn rows_join_by_id_and_gaps_are_per_request() {
        let rows = vec![row("a", 10.0, 2.0), row("b", 20.0, 4.0), row("c", 5.0, 1.0)];
        let rec = |id: &str, ttft: f64, out: u32| TraceRecord {
            request_id: Some(id.into()),
            input_length: 10,
            output_length: out,
            ttft_ms: Some(ttft),
            tpot_ms: Some(2.0),
            e2e_ms: Some(99.0),
            ..TraceRecord::default()
        };
        let capture = vec![rec("b", 19.5, 5), rec("a", 9.0, 4), rec("z", 1.0, 5)];
        let a = agreement(&rows, &capture);
        assert_eq!((a.joined, a.client_only, a.proxy_only), (2, 1, 1));
        assert_eq!(a.ttft_gap.max_ms, 1.0);
        assert_eq!(a.ttft_gap.min_ms, 0.5);
        assert_eq!(a.tokens_equal, 1);
        assert!(agreement_text(&a).contains("| TTFT ms | 15.000 | 14.250 | -5.00% |"));
    }
}
