//! Agreement with the client: `headroom replay` through the proxy to a simulated replica, the
//! client's numbers and the proxy's capture joined by `x-request-id`. A test binary of its own, so
//! that no other test competes for the cores while it measures.

use std::sync::Arc;

use common::{options, proxy, read_capture, sim};
use headroom_loadtest::replay::{Counters, run};
use headroom_workload::trace::TraceRecord;

mod common;

fn percentile(v: &mut [f64], p: f64) -> f64 {
    v.sort_by(f64::total_cmp);
    let rank = ((p / 100.0 * v.len() as f64).ceil() as usize).clamp(1, v.len());
    v[rank - 1]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_proxy_and_the_client_agree_on_every_request() {
    let r = sim(20, 8, &[]).await;
    let scratch = tempfile::tempdir().expect("a scratch directory");
    let dir = scratch.path();
    let path = dir.join("trace.jsonl");
    let p = proxy(&[r.url()], Some(&path)).await;
    // 60 chat requests at ~15/s, prompts of a few hundred tokens, 20-60 tokens out.
    let mut records = headroom_loadtest::contracts::synthesize(
        headroom_loadtest::contracts::Contract::Chat,
        60,
        15.0,
        7,
    );
    for (i, rec) in records.iter_mut().enumerate() {
        rec.output_length = 20 + (i as u32 * 7) % 41;
    }
    let results = run(
        records,
        options(format!("http://{}", p.addr), 7, 1.0),
        Arc::new(Counters::default()),
    )
    .await;
    assert!(common::flush_finished(&p).await);
    let captured = read_capture(&path);
    assert_eq!(captured.len(), 60);
    let by_id: std::collections::HashMap<&str, &TraceRecord> = captured
        .iter()
        .map(|r| (r.request_id.as_deref().unwrap(), r))
        .collect();
    let (mut ttft_diff, mut tpot_client, mut tpot_proxy) = (Vec::new(), Vec::new(), Vec::new());
    let mut itl_client = Vec::new();
    for res in &results {
        assert!(res.timing.ok(), "{:?}", res.timing.failure);
        let rec = by_id[res.request_id.as_str()];
        let client_ttft = res.timing.ttft.unwrap().as_secs_f64() * 1e3;
        ttft_diff.push((client_ttft - rec.ttft_ms.unwrap()).abs());
        assert_eq!(
            u64::from(rec.output_length),
            res.timing.completion_tokens,
            "exact tokens"
        );
        assert_eq!(u64::from(rec.input_length), res.timing.prompt_tokens);
        tpot_client.push(res.timing.tpot().unwrap().as_secs_f64() * 1e3);
        tpot_proxy.push(rec.tpot_ms.unwrap());
        itl_client.extend(res.timing.itl.iter().map(|d| d.as_secs_f64() * 1e3));
        assert_eq!(rec.good, Some(true));
    }
    // The bounds of the must-show (1 ms at the median, 5 ms at p99) are measured on release builds
    // over hundreds of requests (scripts/bench-measure.sh, docs/benchmarks.md). Here p99 of 60 is
    // the single largest gap, which one scheduler stall on a shared two-core runner decides (15 ms
    // seen in CI), so the tail is checked at p95: a bias in what the proxy stamps moves most
    // requests and fails the median, a stall moves one. An unoptimised client and proxy get three
    // times the room.
    let slack = if cfg!(debug_assertions) { 3.0 } else { 1.0 };
    let median = percentile(&mut ttft_diff, 50.0);
    let p95 = percentile(&mut ttft_diff, 95.0);
    assert!(
        median <= slack && p95 <= 5.0 * slack,
        "TTFT |diff| p50 {median} p95 {p95} ms"
    );
    for q in [50.0, 90.0, 95.0] {
        let (c, x) = (
            percentile(&mut tpot_client, q),
            percentile(&mut tpot_proxy, q),
        );
        assert!((c - x).abs() <= 0.03 * c, "TPOT p{q}: client {c} proxy {x}");
    }
    let stats = common::stats(&p).await;
    let window = &stats["windows"]["1m"][0];
    assert_eq!(window["requests"], 60);
    assert_eq!(window["good"], 60);
    let itl = |key: &str| window["latency"]["itl_ms"][key].as_f64().unwrap();
    let c = percentile(&mut itl_client, 50.0);
    assert!(
        (c - itl("p50")).abs() <= 0.03 * c,
        "ITL p50: client {c} proxy {}",
        itl("p50")
    );
    // The pooled ITL's p99 sits where the gaps thin out (decode steps below it, prefill stalls
    // above), so a few samples on either side move its value by more than 3% from run to run
    // (docs/benchmarks.md, "it sits on a cliff"); the proxy's p99 must fall where the client's
    // p98–p99.9 fall, with 3% for the proxy's 2-significant-digit histogram buckets.
    let (lo, hi) = (
        percentile(&mut itl_client, 98.0),
        percentile(&mut itl_client, 99.9),
    );
    let x = itl("p99");
    assert!(
        x >= 0.97 * lo && x <= 1.03 * hi,
        "ITL p99: proxy {x}, client p98 {lo} and p99.9 {hi}"
    );
    assert!(stats["backends"][0]["engine"]["kv_cache_usage"].is_number());
    p.shutdown().await;
    r.shutdown().await.unwrap();
}
