//! Live shadowing against simulated replicas: copies reach the candidate pool and never the
//! client, are measured with `shadow="true"`, are compared for deterministic requests (all equal
//! on an equal candidate, all different on one that perturbs its text), and a candidate that hangs
//! costs the primary nothing (its copies are dropped and counted).

mod common;

use std::time::Duration;

use common::{MODEL, metric_sum, read_capture, sim, stats};
use headroom_config::serve::{PoolConfig, ServeConfig, ShadowConfig};
use headroom_proxy::ServeHandle;
use serde_json::{Value, json};

/// The proxy with pool `live` = [`primary`] copying to pool `candidate` = [`candidate`].
async fn shadowing(
    primary: String,
    candidate: String,
    shadow: ShadowConfig,
    capture: Option<&std::path::Path>,
) -> ServeHandle {
    let mut cfg = ServeConfig::quick("127.0.0.1:0", &[primary, candidate], "least_load");
    cfg.admin_listen = "127.0.0.1:0".into();
    cfg.health.interval_ms = 200;
    // A probe that times out on a busy test machine must not take a candidate out mid-test.
    cfg.health.unhealthy_after = 1_000;
    cfg.scrape.interval_ms = 0;
    // A copy to a replica that hangs gives up after this long.
    cfg.timeouts.first_byte_ms = 2_000;
    cfg.backends[0].name = Some("primary".into());
    cfg.backends[1].name = Some("candidate".into());
    cfg.capture.path = capture.map(|p| p.display().to_string());
    cfg.capture.id_key = Some("a test key, 16+ chars".into());
    cfg.pools = vec![
        PoolConfig {
            name: "live".into(),
            backends: vec!["primary".into()],
            borrow: vec![],
            borrow_below: 0.5,
            shadow: Some(shadow),
        },
        PoolConfig {
            name: "candidate".into(),
            backends: vec!["candidate".into()],
            borrow: vec![],
            borrow_below: 0.5,
            shadow: None,
        },
    ];
    let default = headroom_config::serve::ClassConfig {
        slo: headroom_config::serve::SloConfig::default(),
        priority: 0,
        max_queue: 64,
        queue_timeout_ms: 30_000,
        pool: Some("live".into()),
        min_prompt_tokens: None,
        models: Vec::new(),
        paths: Vec::new(),
    };
    cfg.classes.insert("default".into(), default);
    headroom_proxy::start(cfg.validated().unwrap())
        .await
        .unwrap()
}

fn shadow_to_candidate() -> ShadowConfig {
    ShadowConfig {
        pool: "candidate".into(),
        fraction: 1.0,
        max_in_flight: 64,
        max_queue: 64,
        max_wait_ms: 1_000,
        compare: true,
    }
}

/// Sends request `i`: deterministic (temperature 0) unless `sampled`, streamed when `i` is even.
/// Returns the replica that answered and the client's body.
async fn ask(h: &ServeHandle, i: usize, sampled: bool) -> (String, String) {
    let body = json!({
        "model": MODEL,
        "messages": [{"role": "user", "content": format!("question {i}: {}", " why".repeat(i))}],
        "max_tokens": 12,
        "temperature": if sampled { 1.0 } else { 0.0 },
        "stream": i % 2 == 0,
    });
    let resp = reqwest::Client::new()
        .post(format!("http://{}/v1/chat/completions", h.addr))
        .header("x-request-id", format!("shadow-test-{i}-{sampled}"))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let backend = resp.headers()["x-headroom-backend"]
        .to_str()
        .unwrap()
        .to_owned();
    (backend, resp.text().await.unwrap())
}

/// Polls `/stats` (at most 20 s) until the shadow's counters satisfy `done`; returns them.
async fn shadow_stats(h: &ServeHandle, done: impl Fn(&Value) -> bool) -> Value {
    for _ in 0..2000 {
        let s = stats(h).await["shadow"]["pools"][0].clone();
        if done(&s) {
            return s;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("the shadow counters never settled: {}", stats(h).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn copies_are_measured_and_agree_on_an_equal_candidate() {
    let (a, b) = (sim(5, 2, &[]).await, sim(20, 4, &[]).await);
    let scratch = tempfile::tempdir().expect("a scratch directory");
    let dir = scratch.path();
    let capture = dir.join("capture.jsonl");
    let p = shadowing(a.url(), b.url(), shadow_to_candidate(), Some(&capture)).await;
    for i in 0..12 {
        let (backend, text) = ask(&p, i, false).await;
        assert_eq!(
            backend, "primary",
            "the client only ever gets the primary's answer"
        );
        assert!(!text.is_empty());
    }
    for i in 0..4 {
        ask(&p, 100 + i, true).await;
    }
    let s = shadow_stats(&p, |s| s["compared"] == 12 && s["in_flight"] == 0).await;
    assert_eq!(s["sent"], 16, "{s}");
    assert_eq!(s["matched"], 12, "sampled requests are not compared: {s}");
    assert_eq!(s["agreement"], 1.0);
    assert_eq!(s["dropped"], json!({"busy": 0, "late": 0, "no_backend": 0}));
    let m = common::get_text(&format!("http://{}/metrics", p.admin_addr)).await;
    assert!(m.contains(
        "headroom_request_ttft_seconds_count{backend=\"candidate\",class=\"default\",pool=\"candidate\",shadow=\"true\"} 16"
    ), "{m}");
    assert!(m.contains(
        "headroom_request_ttft_seconds_count{backend=\"primary\",class=\"default\",pool=\"live\",shadow=\"false\"} 16"
    ));
    assert!(m.contains("headroom_shadow_compared_total{pool=\"live\",result=\"match\"} 12"));
    // Goodput is the served traffic's alone.
    assert_eq!(metric_sum(&m, "headroom_slo_requests_total"), 16.0);
    // The candidate is slower here, and its own windows say so.
    let all = stats(&p).await;
    let windows = &all["shadow"]["windows"]["1m"];
    let shadow_ttft = windows[0]["latency"]["ttft_ms"]["p50"].as_f64().unwrap();
    let primary_ttft = all["windows"]["1m"][0]["latency"]["ttft_ms"]["p50"]
        .as_f64()
        .unwrap();
    assert!(
        shadow_ttft > primary_ttft,
        "{shadow_ttft} vs {primary_ttft}"
    );
    assert!(common::flush_finished(&p).await);
    let records = read_capture(&capture);
    let shadows: Vec<_> = records.iter().filter(|r| r.shadow.is_some()).collect();
    assert_eq!((records.len(), shadows.len()), (32, 16));
    assert_eq!(
        shadows
            .iter()
            .filter(|r| r.shadow.unwrap().output_match == Some(true))
            .count(),
        12
    );
    assert!(
        shadows
            .iter()
            .all(|r| r.pool.as_deref() == Some("candidate"))
    );
    p.shutdown().await;
    a.shutdown().await.unwrap();
    b.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_candidate_that_perturbs_its_text_disagrees_and_says_where() {
    let a = sim(5, 2, &[]).await;
    let b = sim(5, 2, &["--perturb-text-rate", "100"]).await;
    let p = shadowing(a.url(), b.url(), shadow_to_candidate(), None).await;
    for i in 0..10 {
        ask(&p, i, false).await;
    }
    let s = shadow_stats(&p, |s| s["compared"] == 10 && s["in_flight"] == 0).await;
    assert_eq!(
        (s["matched"].clone(), s["agreement"].clone()),
        (json!(0), json!(0.0))
    );
    let m = common::get_text(&format!("http://{}/metrics", p.admin_addr)).await;
    assert!(m.contains("headroom_shadow_compared_total{pool=\"live\",result=\"mismatch\"} 10"));
    // Streamed copies say where they part (within the 12 tokens); whole bodies cannot.
    assert!(
        m.contains("headroom_shadow_diverged_at_tokens_count{pool=\"live\"} 5"),
        "{m}"
    );
    assert!(m.contains("headroom_shadow_diverged_at_tokens_bucket{pool=\"live\",le=\"16\"} 5"));
    assert!(m.contains("headroom_shadow_length_diff_tokens_bucket{pool=\"live\",le=\"0\"} 10"));
    p.shutdown().await;
    a.shutdown().await.unwrap();
    b.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hanging_candidate_costs_the_primary_nothing_and_its_copies_are_dropped() {
    let a = sim(5, 2, &[]).await;
    let b = sim(5, 2, &["--hang"]).await;
    let shadow = ShadowConfig {
        max_in_flight: 1,
        max_queue: 1,
        max_wait_ms: 50,
        ..shadow_to_candidate()
    };
    let p = shadowing(a.url(), b.url(), shadow, None).await;
    let started = std::time::Instant::now();
    let answers = futures_util::future::join_all((0..20).map(|i| ask(&p, i, false))).await;
    assert!(answers.iter().all(|(b, _)| b == "primary"));
    // Twenty 12-token answers at 2 ms a step: well under the first-byte timeout the copy waits.
    assert!(started.elapsed() < Duration::from_secs(5));
    let count = |s: &Value, k: &str| s["dropped"][k].as_u64().unwrap();
    let s = shadow_stats(&p, |s| {
        s["sent"].as_u64().unwrap() + count(s, "busy") + count(s, "late") + count(s, "no_backend")
            == 20
    })
    .await;
    // One slot, held by the first copy (unless the candidate was already found dead: then none
    // is sent at all); every other copy dropped, busy or late.
    assert!(s["sent"].as_u64().unwrap() <= 1, "{s}");
    assert!(count(&s, "busy") + count(&s, "late") >= 18, "{s}");
    assert_eq!(s["compared"], 0);
    // The copy that hung gives up at the first-byte timeout and frees its slot.
    shadow_stats(&p, |s| s["in_flight"] == 0).await;
    p.shutdown().await;
    a.shutdown().await.unwrap();
    b.shutdown().await.unwrap();
}
