//! The HTML pages of replay results and sweeps, built from their JSON result files so any result
//! can be re-rendered later.

use serde_json::Value;

use crate::html::{self, Chart, Section, Series, Style, escape, table};
use crate::report::{Dist, RequestRow, Summary};

fn dist_rows(s: &Summary) -> Vec<Vec<String>> {
    let f = |v: f64| format!("{v:.1}");
    [
        ("TTFT", &s.ttft),
        ("TPOT", &s.tpot),
        ("ITL", &s.itl),
        ("E2EL", &s.e2el),
        ("send lateness", &s.send_lateness),
    ]
    .iter()
    .filter(|(_, d)| d.count > 0)
    .map(|(name, d): &(&str, &Dist)| {
        vec![
            (*name).to_owned(),
            d.count.to_string(),
            f(d.mean_ms),
            f(d.p50_ms),
            f(d.p90_ms),
            f(d.p95_ms),
            f(d.p99_ms),
            f(d.p999_ms),
            f(d.max_ms),
        ]
    })
    .collect()
}

/// The page of one replay result (`result.json`).
pub fn replay_page(doc: &Value) -> anyhow::Result<String> {
    let summary: Summary = serde_json::from_value(doc["summary"].clone())?;
    let rows: Vec<RequestRow> = serde_json::from_value(doc["requests"].clone())?;
    let contract = &doc["contract"];
    let measured: Vec<&RequestRow> = rows
        .iter()
        .filter(|r| !r.warmup && r.error.is_none())
        .collect();

    let mut overview = format!(
        "<p>{} measured requests, {} completed, {} failed in {:.1} s: {:.2} req/s, {:.0} input tok/s, {:.0} output tok/s.</p>",
        summary.measured,
        summary.completed,
        summary.failed,
        summary.duration_s,
        summary.request_throughput,
        summary.input_token_throughput,
        summary.output_token_throughput
    );
    if let Some(g) = &summary.goodput {
        overview.push_str(&format!(
            "<p>Goodput: {} requests met the SLO ({:.2} req/s, {:.0} output tok/s).</p>",
            g.good_requests, g.requests_per_s, g.output_tokens_per_s
        ));
    }
    if let Some(w) = &summary.lengths.warning {
        overview.push_str(&format!("<p class=\"warn\">{}</p>", escape(w)));
    }
    for (kind, n) in &summary.errors {
        overview.push_str(&format!("<p>errors {}: {n}</p>", escape(kind)));
    }
    overview.push_str(&table(
        &[
            "ms", "n", "mean", "p50", "p90", "p95", "p99", "p99.9", "max",
        ],
        &dist_rows(&summary),
    ));

    let mut cdfs = Vec::new();
    for (name, pick) in [
        (
            "TTFT",
            (|r: &RequestRow| r.ttft_ms) as fn(&RequestRow) -> Option<f64>,
        ),
        ("TPOT", |r: &RequestRow| r.tpot_ms),
        ("E2EL", |r: &RequestRow| Some(r.e2el_ms)),
    ] {
        let mut v: Vec<f64> = measured.iter().filter_map(|r| pick(r)).collect();
        v.sort_by(f64::total_cmp);
        let (x, y) = html::cdf(&v, 400);
        cdfs.push(Chart {
            title: format!("{name} distribution"),
            x_label: format!("{name} (ms)"),
            y_label: "share of requests".into(),
            log_x: false,
            log_y: false,
            x,
            series: vec![Series {
                label: format!("CDF of {name}"),
                values: y,
                style: Style::Line,
            }],
        });
    }

    let mut by_len: Vec<(f64, f64)> = measured
        .iter()
        .filter_map(|r| Some((f64::from(r.input_length), r.ttft_ms?)))
        .collect();
    by_len.sort_by(|a, b| a.0.total_cmp(&b.0));
    let mut by_time: Vec<(f64, f64)> = measured
        .iter()
        .filter_map(|r| Some((r.sent_ms / 1e3, r.ttft_ms?)))
        .collect();
    by_time.sort_by(|a, b| a.0.total_cmp(&b.0));
    let scatter = |title: &str, x_label: &str, pts: Vec<(f64, f64)>| Chart {
        title: title.into(),
        x_label: x_label.into(),
        y_label: "TTFT (ms)".into(),
        log_x: false,
        log_y: false,
        x: pts.iter().map(|p| p.0).collect(),
        series: vec![Series {
            label: "TTFT".into(),
            values: pts.iter().map(|p| Some(p.1)).collect(),
            style: Style::Points,
        }],
    };

    let sections = vec![
        Section { heading: "Summary".into(), html: overview, charts: cdfs },
        Section {
            heading: "What drives TTFT".into(),
            html: "<p>Each point is a request: against its prompt length, then against when it was sent.</p>".into(),
            charts: vec![
                scatter("TTFT against prompt length", "prompt tokens (contract)", by_len),
                scatter("TTFT over the run", "sent at (s)", by_time),
            ],
        },
        Section {
            heading: "Contract".into(),
            html: format!("<pre>{}</pre>", escape(&serde_json::to_string_pretty(contract)?)),
            charts: vec![],
        },
    ];
    let targets: Vec<&str> = match contract["target"]["urls"].as_array() {
        Some(urls) => urls.iter().filter_map(Value::as_str).collect(),
        None => contract["target"]["url"].as_str().into_iter().collect(),
    };
    let subtitle = format!(
        "{} against {}",
        contract["trace"]["path"].as_str().unwrap_or("?"),
        if targets.is_empty() {
            "?".to_owned()
        } else {
            targets.join(", ")
        }
    );
    Ok(html::page("headroom replay", &subtitle, &sections))
}

/// The page of a sweep (`sweep.json`).
pub fn sweep_page(doc: &Value) -> anyhow::Result<String> {
    let points = doc["points"].as_array().cloned().unwrap_or_default();
    let load_name = doc["load"].as_str().unwrap_or("load");
    let x: Vec<f64> = points
        .iter()
        .map(|p| p["level"].as_f64().unwrap_or(0.0))
        .collect();
    let get = |path: &[&str]| -> Vec<Option<f64>> {
        points
            .iter()
            .map(|p| path.iter().fold(p, |v, k| &v[*k]).as_f64())
            .collect()
    };
    let slo_ttft = doc["slo"]["ttft_ms"].as_f64();
    let mut latency = vec![
        Series {
            label: "TTFT p50 (ms)".into(),
            values: get(&["summary", "ttft", "p50_ms"]),
            style: Style::Line,
        },
        Series {
            label: "TTFT p99 (ms)".into(),
            values: get(&["summary", "ttft", "p99_ms"]),
            style: Style::Line,
        },
    ];
    if let Some(b) = slo_ttft {
        latency.push(Series {
            label: format!("SLO {b} ms"),
            values: vec![Some(b); x.len()],
            style: Style::Line,
        });
    }
    let rows: Vec<Vec<String>> = points
        .iter()
        .map(|p| {
            let f = |v: &Value| v.as_f64().map_or_else(|| "-".into(), |v| format!("{v:.1}"));
            vec![
                f(&p["level"]),
                f(&p["summary"]["request_throughput"]),
                f(&p["summary"]["output_token_throughput"]),
                f(&p["summary"]["ttft"]["p50_ms"]),
                f(&p["summary"]["ttft"]["p99_ms"]),
                f(&p["summary"]["tpot"]["p99_ms"]),
                p["summary"]["goodput"]["good_requests"]
                    .as_u64()
                    .map_or("-".into(), |g| g.to_string()),
                p["summary"]["completed"].to_string(),
            ]
        })
        .collect();
    let mut verdict = String::new();
    for key in ["knee", "largest_safe"] {
        if let Some(v) = doc["verdict"][key].as_str() {
            verdict.push_str(&format!("<p><b>{}</b></p>", escape(v)));
        }
    }
    let sections = vec![
        Section {
            heading: "Verdict".into(),
            html: verdict
                + &table(
                    &[
                        load_name,
                        "req/s",
                        "output tok/s",
                        "TTFT p50",
                        "TTFT p99",
                        "TPOT p99",
                        "good",
                        "completed",
                    ],
                    &rows,
                ),
            charts: vec![
                Chart {
                    title: "Throughput against load".into(),
                    x_label: load_name.into(),
                    y_label: "output tokens/s".into(),
                    log_x: true,
                    log_y: false,
                    x: x.clone(),
                    series: vec![Series {
                        label: "output tokens/s".into(),
                        values: get(&["summary", "output_token_throughput"]),
                        style: Style::Line,
                    }],
                },
                Chart {
                    title: "TTFT against load".into(),
                    x_label: load_name.into(),
                    y_label: "ms".into(),
                    log_x: true,
                    log_y: true,
                    x,
                    series: latency,
                },
            ],
        },
        Section {
            heading: "Contract".into(),
            html: format!(
                "<pre>{}</pre>",
                escape(&serde_json::to_string_pretty(&doc["contract"])?)
            ),
            charts: vec![],
        },
    ];
    Ok(html::page(
        "headroom sweep",
        doc["contract"]["target"]["url"].as_str().unwrap_or(""),
        &sections,
    ))
}
