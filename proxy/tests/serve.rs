//! `headroom serve` end to end, in-process: simulated replicas on port 0, the proxy on port 0, and
//! real HTTP clients. Streaming, prefix affinity, cancellation on disconnect, failed replicas
//! avoided, faults mid-stream, unknown routes refused, large bodies, merged model lists.

use std::time::Duration;

use futures_util::StreamExt;
use headroom_config::serve::ServeConfig;
use headroom_proxy::ServeHandle;
use headroom_sim::RunningReplica;

mod common;
use headroom_workload::engine_metrics::EngineGauges;
use serde_json::{Value, json};

const MODEL: &str = "meta-llama/Llama-3.1-8B-Instruct";

async fn sim(extra: &[&str]) -> RunningReplica {
    common::sim(2, 1, extra).await
}

async fn proxy(urls: &[String], policy: &str, tweak: impl FnOnce(&mut ServeConfig)) -> ServeHandle {
    let mut cfg = ServeConfig::quick("127.0.0.1:0", urls, policy);
    cfg.admin_listen = "127.0.0.1:0".into();
    cfg.health.interval_ms = 200;
    cfg.scrape.interval_ms = 200;
    tweak(&mut cfg);
    headroom_proxy::start(cfg.validated().unwrap())
        .await
        .unwrap()
}

fn client() -> reqwest::Client {
    reqwest::Client::new()
}

/// A 5,000-token stream through the proxy at `addr`, started: the replica it went to (the
/// `x-headroom-backend` header) and the rest of the stream.
async fn long_stream(
    addr: std::net::SocketAddr,
) -> (
    String,
    impl futures_util::Stream<Item = reqwest::Result<bytes::Bytes>>,
) {
    let url = format!("http://{addr}/v1/completions");
    let (backend, resp) = common::start_stream(&client(), &url, "tell me everything", 5000).await;
    let mut stream = resp.bytes_stream();
    stream.next().await.unwrap().unwrap();
    (backend, stream)
}

fn chat(system: &str, user: &str, max_tokens: u32, stream: bool) -> Value {
    json!({
        "model": MODEL,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
        "max_tokens": max_tokens,
        "ignore_eos": true,
        "stream": stream,
    })
}

fn words(n: usize, salt: &str) -> String {
    (0..n).map(|i| format!(" {salt}{}", i % 101)).collect()
}

/// A replica that refuses connections: a port held for as long as this lives
/// ([`common::held_port`]).
struct Refused {
    _held: socket2::Socket,
    addr: std::net::SocketAddr,
}

impl Refused {
    fn new() -> Self {
        let (_held, addr) = common::held_port(false);
        Self { _held, addr }
    }

    fn url(&self) -> String {
        format!("http://{}", self.addr)
    }
}

/// Blocks in `backend`'s prefix history, from a proxy's metrics (0 when it has none).
fn index_blocks(exposition: &str, backend: &str) -> f64 {
    let n = common::metric(
        exposition,
        &format!("headroom_prefix_index_blocks{{backend=\"{backend}\"}}"),
    );
    if n.is_nan() { 0.0 } else { n }
}

async fn engine(url: &str) -> EngineGauges {
    EngineGauges::parse(&common::get_text(&format!("{url}/metrics")).await)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_relay_every_event_and_measure() {
    let r = sim(&[]).await;
    let p = proxy(&[r.url()], "round_robin", |_| {}).await;
    let url = format!("http://{}/v1/chat/completions", p.addr);
    let resp = client()
        .post(&url)
        .json(&chat("You are terse.", "hello", 20, true))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(
        resp.headers()["content-type"].to_str().unwrap(),
        "text/event-stream; charset=utf-8"
    );
    assert!(resp.headers().contains_key("x-headroom-backend"));
    let mut body = Vec::new();
    let mut chunks = 0;
    let mut stream = resp.bytes_stream();
    while let Some(c) = stream.next().await {
        body.extend_from_slice(&c.unwrap());
        chunks += 1;
    }
    let text = String::from_utf8(body).unwrap();
    let events: Vec<&str> = text.split("\n\n").filter(|e| !e.is_empty()).collect();
    // A role chunk, 20 tokens, [DONE]; relayed as they came, not as one buffer.
    assert_eq!(events.len(), 22, "{text}");
    assert_eq!(*events.last().unwrap(), "data: [DONE]");
    assert!(chunks > 5, "stream arrived in {chunks} chunk(s)");

    // The load tester's client sees the same stream through the proxy.
    let body = bytes::Bytes::from(serde_json::to_vec(&chat("s", "u", 8, true)).unwrap());
    let t = headroom_loadtest::client::send_streaming_with(&client(), &url, body, &[]).await;
    assert!(t.ok(), "{:?}", t.failure);
    assert!(t.ttft.is_some());

    let metrics = common::get_text(&format!("http://{}/metrics", p.admin_addr)).await;
    assert!(
        metrics.contains("headroom_request_ttft_seconds_count{backend="),
        "{metrics}"
    );
    assert!(metrics.contains("route=\"chat\""), "{metrics}");
    // The process's own memory, under the standard exporter's name (Linux).
    #[cfg(target_os = "linux")]
    let rss = metrics
        .lines()
        .find_map(|l| l.strip_prefix("process_resident_memory_bytes "))
        .and_then(|v| v.trim().parse::<f64>().ok());
    #[cfg(target_os = "linux")]
    assert!(rss.is_some_and(|b| b > 1e6), "{metrics}");
    // The proxy lets a request go once the client has its last byte: waited for.
    let fleet = p.fleet();
    common::eventually("the replica's load to fall to zero", || async {
        fleet.backends[0].load().in_flight == 0
    })
    .await;
    let l = fleet.backends[0].load();
    assert_eq!(
        (l.in_flight, l.pending_prefill_tokens, l.decoding),
        (0, 0, 0)
    );
    p.shutdown().await;
    r.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefix_affinity_keeps_a_shared_prompt_on_one_replica() {
    let replicas = [sim(&[]).await, sim(&[]).await, sim(&[]).await];
    let urls: Vec<String> = replicas.iter().map(RunningReplica::url).collect();
    let p = proxy(&urls, "prefix_affinity", |_| {}).await;
    let url = format!("http://{}/v1/chat/completions", p.addr);
    let mut homes = std::collections::HashMap::<String, Vec<String>>::new();
    // Twelve tenants: cold prompts on an idle fleet are split by a rendezvous hash over replicas
    // whose keys come from ephemeral ports, and six could all land on one (p = 3 / 3^6 = 0.4%:
    // seen once in CI); with twelve that is 3 / 3^12.
    for tenant in ["a", "b", "c", "d", "e", "f", "g", "h", "i", "j", "k", "l"] {
        let system = words(600, tenant);
        for turn in 0..4 {
            // Sequential requests: each finds the fleet idle, so only the prefix decides.
            let resp = client()
                .post(&url)
                .json(&chat(&system, &format!("question {turn}"), 2, false))
                .send()
                .await
                .unwrap();
            assert_eq!(resp.status(), 200);
            let backend = resp.headers()["x-headroom-backend"]
                .to_str()
                .unwrap()
                .to_owned();
            homes.entry(tenant.into()).or_default().push(backend);
            resp.bytes().await.unwrap();
        }
    }
    for (tenant, picks) in &homes {
        assert!(
            picks.iter().all(|b| b == &picks[0]),
            "tenant {tenant} moved: {picks:?}"
        );
    }
    let used: std::collections::HashSet<_> = homes.values().map(|v| v[0].clone()).collect();
    assert!(used.len() >= 2, "cold prompts did not spread: {used:?}");
    // The replicas confirm it: every repeat found its prefix cached.
    let mut hits = 0.0;
    let mut queries = 0.0;
    for u in &urls {
        let g = engine(u).await;
        hits += g.prefix_hits_total.unwrap();
        queries += g.prefix_queries_total.unwrap();
    }
    assert!(hits / queries > 0.7, "hit rate {}", hits / queries);
    // The index the proxy routed by is visible, replica by replica.
    let m = common::get_text(&format!("http://{}/metrics", p.admin_addr)).await;
    let indexed = common::metric_sum(&m, "headroom_prefix_index_blocks");
    assert!(indexed > 0.0, "{m}");
    p.shutdown().await;
    for r in replicas {
        r.shutdown().await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_disconnect_cancels_the_upstream_request() {
    let r = sim(&["--inter-token-latency", "20"]).await;
    let p = proxy(&[r.url()], "least_load", |_| {}).await;
    let (_, stream) = long_stream(p.addr).await;
    assert_eq!(engine(&r.url()).await.running, Some(1.0));
    drop(stream);
    let url = r.url();
    common::eventually("the replica to drop the request", || {
        let url = url.clone();
        async move { engine(&url).await.running == Some(0.0) }
    })
    .await;
    let fleet = p.fleet();
    common::eventually("the proxy's in-flight count to return to 0", || {
        let fleet = fleet.clone();
        async move { fleet.backends[0].load().in_flight == 0 }
    })
    .await;
    p.shutdown().await;
    r.shutdown().await.unwrap();
}

/// A second request sent on the connection while the first one's stream is still being relayed
/// (pipelining, RFC 9112 §9.3.2) is neither taken for the client leaving nor lost: the stream
/// ends whole, then the second request is answered on the same connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_pipelined_behind_a_stream_is_answered_after_it() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let r = sim(&["--inter-token-latency", "5"]).await;
    let p = proxy(&[r.url()], "least_load", |_| {}).await;
    let request = |stream: bool, max_tokens: u32| {
        let body = json!({"model": MODEL, "prompt": "a pipelined pair", "max_tokens": max_tokens,
                          "ignore_eos": true, "stream": stream})
        .to_string();
        format!(
            "POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n\
             content-length: {}\r\n\r\n{body}",
            body.len()
        )
    };
    let mut conn = tokio::net::TcpStream::connect(p.addr).await.unwrap();
    conn.write_all(request(true, 40).as_bytes()).await.unwrap();
    // The stream has begun before the next request arrives.
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    while !String::from_utf8_lossy(&got).contains("data: ") {
        let n = conn.read(&mut buf).await.unwrap();
        assert!(
            n > 0,
            "the proxy closed the connection: {}",
            String::from_utf8_lossy(&got)
        );
        got.extend_from_slice(&buf[..n]);
    }
    conn.write_all(request(false, 2).as_bytes()).await.unwrap();
    let whole = tokio::time::timeout(Duration::from_secs(20), async {
        loop {
            let text = String::from_utf8_lossy(&got).into_owned();
            if text.matches("HTTP/1.1 200").count() == 2 && text.contains("\"completion_tokens\":2")
            {
                return text;
            }
            let n = conn.read(&mut buf).await.unwrap();
            assert!(n > 0, "the proxy closed the connection: {text}");
            got.extend_from_slice(&buf[..n]);
        }
    })
    .await
    .expect("both answers");
    let (first, second) = whole.split_at(whole.rfind("HTTP/1.1 200").unwrap());
    assert!(
        first.contains("data: [DONE]"),
        "the stream ended whole: {first}"
    );
    assert_eq!(
        first.matches("\"text\":").count(),
        40,
        "every token of the stream: {first}"
    );
    assert!(second.contains("\"completion_tokens\":2"), "{second}");
    p.shutdown().await;
    r.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_or_failing_replica_is_avoided() {
    let live = sim(&[]).await;
    let dead = Refused::new();
    let p = proxy(&[dead.url(), live.url()], "round_robin", |c| {
        c.health.interval_ms = 60_000; // passive ejection alone must do it
        c.health.eject_after = 2;
        c.health.max_ejected_fraction = 0.5;
    })
    .await;
    let url = format!("http://{}/v1/chat/completions", p.addr);
    for i in 0..10 {
        let resp = client()
            .post(&url)
            .json(&chat("s", &format!("q{i}"), 3, true))
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 200, "request {i}");
        assert_eq!(
            resp.headers()["x-headroom-backend"].to_str().unwrap(),
            p.fleet().backends[1].name
        );
        resp.bytes().await.unwrap();
    }
    assert!(p.fleet().is_ejected(&p.fleet().backends[0]));
    assert_eq!(
        p.fleet().backends[0]
            .ejections
            .load(std::sync::atomic::Ordering::Relaxed),
        1
    );
    // A model nobody lists goes to an engine for its own 404: the dead replica, whose list was
    // never read, does not capture it (which would be the proxy's 503).
    common::eventually("the live replica's model list", || {
        let fleet = p.fleet();
        async move { fleet.backends[1].serves("x").is_some() }
    })
    .await;
    let mut typo = chat("s", "q", 3, false);
    typo["model"] = json!("no-such-model");
    let resp = client().post(&url).json(&typo).send().await.unwrap();
    assert_eq!(resp.status(), 404);

    // A replica answering 503 is retried elsewhere; a 400 is the client's and is passed on.
    let resp = client()
        .post(&url)
        .header("x-headroom-fault", "error=400")
        .json(&chat("s", "q", 3, false))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 400);
    assert!(!p.fleet().is_ejected(&p.fleet().backends[1]));
    p.shutdown().await;
    live.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readiness_waits_for_a_replica_to_pass_a_probe() {
    let dead = Refused::new();
    // Probes far apart: the replica is presumed healthy for a long time, but never shown to be.
    let p = proxy(&[dead.url()], "round_robin", |c| {
        c.health.interval_ms = 60_000;
        c.health.unhealthy_after = 3;
    })
    .await;
    let ready = |admin: std::net::SocketAddr| async move {
        client()
            .get(format!("http://{admin}/readyz"))
            .send()
            .await
            .unwrap()
            .status()
    };
    assert_eq!(ready(p.admin_addr).await, 503);
    p.shutdown().await;
    let live = sim(&[]).await;
    let p = proxy(&[live.url()], "round_robin", |c| {
        c.health.interval_ms = 60_000
    })
    .await;
    let admin = p.admin_addr;
    common::eventually("the first probe passes", || async move {
        ready(admin).await == 200
    })
    .await;
    p.shutdown().await;
    live.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prompt_retried_past_a_dead_replica_is_in_the_history_of_the_one_that_got_it() {
    let live = sim(&[]).await;
    let dead = Refused::new();
    let tune = |c: &mut ServeConfig| {
        c.health.interval_ms = 60_000;
        c.health.eject_after = 1000;
        c.limits.retry_budget_ratio = 1.0;
    };
    // The same prompts through the live replica alone, and with a dead one listed first: the
    // live replica's history must come out the same.
    let alone = proxy(&[live.url()], "prefix_affinity", tune).await;
    let both = proxy(&[dead.url(), live.url()], "prefix_affinity", tune).await;
    let mut blocks = Vec::new();
    for p in [&alone, &both] {
        // Prompts apart from their first block: each cold one's first pick is a hash of it, so
        // about half of them meet the dead replica first.
        for i in 0..16 {
            let system = format!("prompt{i} of this test, with words enough for two blocks");
            let resp = client()
                .post(format!("http://{}/v1/chat/completions", p.addr))
                .json(&chat(&system, &format!("question {i}"), 2, false))
                .send()
                .await
                .unwrap();
            assert_eq!(resp.status(), 200);
            resp.bytes().await.unwrap();
        }
        let m = common::get_text(&format!("http://{}/metrics", p.admin_addr)).await;
        blocks.push(index_blocks(&m, &p.fleet().backends.last().unwrap().name));
        if std::ptr::eq(p, &both) {
            assert!(
                m.lines().any(|l| l.starts_with("headroom_upstream_retries_total")
                    && !l.ends_with(" 0")),
                "no request met the dead replica first"
            );
            // The dead replica never got a prompt: none is in its history.
            let dead_blocks = index_blocks(&m, &p.fleet().backends[0].name);
            assert_eq!(dead_blocks, 0.0, "the dead replica's history");
        }
    }
    assert!(blocks[0] > 0.0, "{blocks:?}");
    assert_eq!(blocks[0], blocks[1]);
    alone.shutdown().await;
    both.shutdown().await;
    live.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retries_a_503_on_another_replica_and_reports_faults_mid_stream() {
    let a = sim(&["--failure-injection-rate", "100", "--failure-status", "503"]).await;
    let b = sim(&[]).await;
    let p = proxy(&[a.url(), b.url()], "round_robin", |c| {
        c.health.eject_after = 100;
        // Every request may meet the failing replica first: let each one retry.
        c.limits.retry_budget_ratio = 1.0;
    })
    .await;
    let url = format!("http://{}/v1/chat/completions", p.addr);
    for i in 0..4 {
        let resp = client()
            .post(&url)
            .json(&chat("s", &format!("q{i}"), 2, false))
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 200);
        resp.bytes().await.unwrap();
    }
    // The replica cuts the stream after 3 tokens: the client gets an error event, never [DONE].
    let resp = client()
        .post(&url)
        .header("x-headroom-fault", "drop-after=3")
        .json(&chat("s", "q", 50, true))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let text = resp.text().await.unwrap();
    assert!(text.contains("\"error\""), "{text}");
    assert!(text.contains("closed the stream"), "{text}");
    assert!(!text.contains("[DONE]"), "{text}");
    // A long wait for the first token is bounded by the first-byte timeout, not the idle one; a
    // stream that falls silent after it started is cut with an error event.
    let p3 = proxy(&[b.url()], "round_robin", |c| {
        // Idle 1 s: longer than any stall a loaded machine puts into a healthy stream.
        c.timeouts.idle_ms = 1000;
        c.timeouts.first_byte_ms = 10_000;
    })
    .await;
    let url3 = format!("http://{}/v1/chat/completions", p3.addr);
    let slow_start = client()
        .post(&url3)
        .header("x-headroom-fault", "stall-first-ms=2000")
        .json(&chat("s", "q", 3, true))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(slow_start.ends_with("data: [DONE]\n\n"), "{slow_start}");
    let stalls = client()
        .post(&url3)
        .header("x-headroom-fault", "stall-after=2,stall-ms=5000")
        .json(&chat("s", "q", 5, true))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(stalls.contains("sent nothing for 1000 ms"), "{stalls}");
    assert!(!stalls.contains("[DONE]"), "{stalls}");
    p3.shutdown().await;

    // The replica never answers: the first-byte timeout turns it into a 504.
    let p2 = proxy(&[b.url()], "round_robin", |c| {
        c.timeouts.first_byte_ms = 300
    })
    .await;
    let resp = client()
        .post(format!("http://{}/v1/chat/completions", p2.addr))
        .header("x-headroom-fault", "hang")
        .json(&chat("s", "q", 2, false))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 504);
    p2.shutdown().await;
    p.shutdown().await;
    a.shutdown().await.unwrap();
    b.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_routes_large_bodies_limits_and_models() {
    let a = sim(&["--served-model-name", "alpha"]).await;
    let b = sim(&["--served-model-name", "beta"]).await;
    let p = proxy(&[a.url(), b.url()], "least_load", |c| {
        c.limits.max_body_bytes = 1 << 20;
    })
    .await;
    let base = format!("http://{}", p.addr);
    let fleet = p.fleet();
    common::eventually("the replicas' model lists", || {
        let fleet = fleet.clone();
        async move { fleet.backends.iter().all(|b| b.serves("alpha").is_some()) }
    })
    .await;
    for path in ["/v1/embeddings", "/metrics", "/reset_prefix_cache", "/"] {
        let resp = client().post(format!("{base}{path}")).send().await.unwrap();
        assert_eq!(resp.status(), 404, "{path}");
        assert!(!resp.headers().contains_key("x-headroom-backend"));
        assert_eq!(resp.headers()["x-headroom-error"], "unknown_route");
        let body: Value = resp.json().await.unwrap();
        assert_eq!(body["error"]["type"], "NotFoundError");
    }
    let resp = client()
        .get(format!("{base}/v1/chat/completions"))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 405);
    assert_eq!(resp.headers()["allow"], "POST");
    let resp = client()
        .post(format!("{base}/v1/models"))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 405);
    assert_eq!(resp.headers()["allow"], "GET");

    let models: Value = client()
        .get(format!("{base}/v1/models"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let mut ids: Vec<&str> = models["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_str().unwrap())
        .collect();
    ids.sort_unstable();
    assert_eq!(ids, ["alpha", "beta"]);

    // 300 KB of prompt: far past pingora's 64 KB retry buffer, forwarded whole, and only to the
    // replica serving its model.
    let prompt: String = words(50_000, "w");
    let expected = headroom_workload::Tokenizer.count(&prompt) + 1;
    let body = json!({"model": "alpha", "prompt": prompt, "max_tokens": 1});
    let mut served = 0;
    for _ in 0..4 {
        let resp = client()
            .post(format!("{base}/v1/completions"))
            .json(&body)
            .send()
            .await
            .unwrap();
        let status = resp.status();
        let v: Value = resp.json().await.unwrap();
        assert_eq!(status, 200, "{v}");
        assert_eq!(v["usage"]["prompt_tokens"], expected);
        served += 1;
    }
    assert_eq!(served, 4);
    let huge = json!({"model": "alpha", "prompt": words(300_000, "w")});
    let resp = client()
        .post(format!("{base}/v1/completions"))
        .json(&huge)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 413);

    let tok: Value = client()
        .post(format!("{base}/tokenize"))
        .json(&json!({"prompt": "hi there"}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(tok["count"], 3);
    let ready = client()
        .get(format!("http://{}/readyz", p.admin_addr))
        .send()
        .await;
    assert_eq!(ready.unwrap().status(), 200);

    // The only replica serving `beta` goes down: its requests get the proxy's 503 with
    // Retry-After, not a 404 from the replica that never served it.
    b.shutdown().await.unwrap();
    common::eventually("beta's replica marked down", || {
        let fleet = fleet.clone();
        async move { !fleet.backends[1].probe_healthy() }
    })
    .await;
    let resp = client()
        .post(format!("{base}/v1/completions"))
        .json(&json!({"model": "beta", "prompt": "hi", "max_tokens": 1}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 503);
    assert_eq!(resp.headers()["x-headroom-error"], "no_backend");
    assert!(resp.headers().contains_key("retry-after"));
    p.shutdown().await;
    a.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_last_replicas_503_reaches_the_client_as_the_engine_sent_it() {
    let a = sim(&[]).await;
    let p = proxy(&[a.url()], "round_robin", |c| c.health.eject_after = 100).await;
    let resp = client()
        .post(format!("http://{}/v1/chat/completions", p.addr))
        .header("x-headroom-fault", "error=503")
        .json(&chat("s", "q", 2, false))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 503);
    // The engine's answer, relayed (with no replica left to try), not the proxy's own 502.
    assert!(resp.headers().contains_key("x-headroom-backend"));
    assert!(!resp.headers().contains_key("x-headroom-error"));
    let m = common::get_text(&format!("http://{}/metrics", p.admin_addr)).await;
    assert_eq!(
        common::metric_sum(&m, "headroom_upstream_retries_total"),
        0.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retries_are_budgeted_when_every_replica_fails() {
    let (a, b) = (sim(&[]).await, sim(&[]).await);
    let p = proxy(&[a.url(), b.url()], "round_robin", |c| {
        c.limits.retries = 2;
        // Failing replicas stay in rotation: the budget alone must bound the attempts.
        c.health.eject_after = 1_000_000;
    })
    .await;
    let url = format!("http://{}/v1/chat/completions", p.addr);
    let requests = 100;
    for i in 0..requests {
        let resp = client()
            .post(&url)
            .header("x-headroom-fault", "error=503")
            .json(&chat("s", &format!("q{i}"), 2, false))
            .send()
            .await
            .unwrap();
        assert!(
            matches!(resp.status().as_u16(), 502 | 503),
            "{}",
            resp.status()
        );
    }
    let m = common::get_text(&format!("http://{}/metrics", p.admin_addr)).await;
    let retries = common::metric_sum(&m, "headroom_upstream_retries_total");
    let attempts = f64::from(requests) + retries;
    // Envoy's promise: attempts ≤ 1.2 × requests + 3 (without a budget: 3 × requests).
    assert!(
        attempts <= 1.2 * f64::from(requests) + 3.0,
        "{attempts} attempts"
    );
    // The budget was used (3 + 0.2 · 100), then refused the rest.
    assert!(retries >= 20.0, "{retries} retries");
    assert!(common::metric(&m, "headroom_retries_over_budget_total") >= 50.0);
}

/// A replica that takes `--startup-duration` to come up (its health answers 503 until then): its
/// cold start in the metrics is that delay, to within the probe interval, and its first served
/// token comes after.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_starting_replica_shows_its_cold_start() {
    let delay = 1.5;
    // The replica's clock starts as it is built, the proxy's as it starts: what lies between
    // comes off the cold start the proxy can see.
    let built = std::time::Instant::now();
    let replica = common::sim(5, 2, &["--startup-duration", "1.5"]).await;
    let mut cfg = ServeConfig::quick("127.0.0.1:0", &[replica.url()], "least_load");
    cfg.admin_listen = "127.0.0.1:0".into();
    cfg.health.interval_ms = 25;
    cfg.scrape.interval_ms = 0;
    let h = headroom_proxy::start(cfg.validated().unwrap())
        .await
        .unwrap();
    let head_start = built.elapsed().as_secs_f64();
    let name = replica.url().trim_start_matches("http://").to_owned();
    let cold = |m: &str, until: &str| -> Option<f64> {
        let series =
            format!("headroom_backend_cold_start_seconds{{backend=\"{name}\",until=\"{until}\"}} ");
        m.lines()
            .find_map(|l| l.strip_prefix(&series)?.trim().parse().ok())
    };
    let metrics = format!("http://{}/metrics", h.admin_addr);
    let mut healthy = None;
    for _ in 0..400 {
        healthy = cold(&common::get_text(&metrics).await, "healthy");
        if healthy.is_some() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    let healthy = healthy.expect("the replica came up");
    // At least the start-up the proxy saw, and at most a probe's round and a loaded machine's
    // delays later.
    assert!(
        healthy >= delay - head_start && healthy <= delay + 1.0,
        "cold start {healthy} s against a configured {delay} s ({head_start} s before the proxy)"
    );
    let resp = reqwest::Client::new()
        .post(format!("http://{}/v1/completions", h.addr))
        .json(&serde_json::json!({"model": common::MODEL, "prompt": "hello", "max_tokens": 2}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let m = common::get_text(&metrics).await;
    let first_token = cold(&m, "first_token").expect("a token was served");
    assert!(first_token >= healthy, "{first_token} < {healthy}");
    let stats = common::stats(&h).await;
    // The same number, printed by two encoders (they may differ in the last digit).
    let in_stats = stats["backends"][0]["cold_start_s"]["first_token"]
        .as_f64()
        .unwrap();
    assert!(
        (in_stats - first_token).abs() < 1e-6,
        "{in_stats} vs {first_token}"
    );
    h.shutdown().await;
    replica.shutdown().await.unwrap();
}

/// A `least_load` proxy in front of `urls` with the peers at `addresses` (admin listener on port 0,
/// 500 ms poll and push timeout), the rest of `[peers]` as `tune` sets it.
fn peers_config(
    urls: &[String],
    addresses: Vec<String>,
    tune: impl FnOnce(&mut headroom_config::serve::PeersConfig),
) -> ServeConfig {
    let mut cfg = ServeConfig::quick("127.0.0.1:0", urls, "least_load");
    cfg.admin_listen = "127.0.0.1:0".into();
    cfg.health.interval_ms = 200;
    cfg.peers.addresses = addresses;
    cfg.peers.timeout_ms = 500;
    tune(&mut cfg.peers);
    cfg.validated().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn proxies_that_poll_each_other_route_around_each_others_work() {
    let (r0, r1) = (
        sim(&["--inter-token-latency", "20"]).await,
        sim(&["--inter-token-latency", "20"]).await,
    );
    let urls = [r0.url(), r1.url()];
    let config = |addresses| {
        peers_config(&urls, addresses, |p| {
            p.interval_ms = 20;
            // Long enough that a loaded machine's stall does not expire a live peer meanwhile;
            // the expiry at the end is waited for.
            p.expire_ms = 3000;
        })
    };
    let mut a = headroom_proxy::start(config(vec![])).await.unwrap();
    let mut b = headroom_proxy::start(config(vec![])).await.unwrap();
    // As a headless Service lists them: every proxy, each one itself included.
    let everyone = vec![a.admin_addr.to_string(), b.admin_addr.to_string()];
    a.reload(config(everyone.clone())).await.unwrap();
    b.reload(config(everyone)).await.unwrap();

    // A long stream through a.
    let (busy, stream) = long_stream(a.addr).await;
    let report: Value = client()
        .get(format!("http://{}/peers/load", a.admin_addr))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let busy_id = urls.iter().position(|u| u.ends_with(&busy)).unwrap();
    assert_eq!(report["backends"][busy_id]["in_flight"], 1, "{report}");
    assert_eq!(report["backends"][busy_id]["decoding"], 1, "{report}");

    common::eventually("b to hear of a's stream", || async {
        common::stats(&b).await["backends"][busy_id]["peers"]["in_flight"] == 1
    })
    .await;
    // b, idle itself, sends everything to the other replica: with no word from a, its ties would
    // spread these over both.
    for i in 0..8 {
        let resp = client()
            .post(format!("http://{}/v1/completions", b.addr))
            .json(
                &json!({"model": MODEL, "prompt": words(20, &format!("p{i}")),
                "max_tokens": 1}),
            )
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 200);
        assert_ne!(
            resp.headers()["x-headroom-backend"],
            busy.as_str(),
            "request {i}"
        );
    }
    let metrics = common::get_text(&format!("http://{}/metrics", b.admin_addr)).await;
    assert!(
        metrics.contains("headroom_peer_polls_total{result=\"self\"}"),
        "b found itself among the peers and skipped it"
    );
    assert_eq!(common::metric(&metrics, "headroom_peers_live"), 1.0);

    // The stream ends: b hears it at the next poll.
    drop(stream);
    common::eventually("b to hear the stream ended", || async {
        let s = common::stats(&b).await;
        let live = s["peers"]
            .as_array()
            .unwrap()
            .iter()
            .any(|p| p["live"] == true);
        live && s["backends"][busy_id]["peers"]["in_flight"] == 0
    })
    .await;
    // a stops with a stream still open on the replica: b stops counting it once a expires.
    let (busy, stream) = long_stream(a.addr).await;
    let busy_id = urls.iter().position(|u| u.ends_with(&busy)).unwrap();
    common::eventually("b to hear of a's second stream", || async {
        common::stats(&b).await["backends"][busy_id]["peers"]["in_flight"] == 1
    })
    .await;
    a.shutdown().await;
    common::eventually("b to stop counting the stopped peer's work", || async {
        let s = common::stats(&b).await;
        let peers = s["peers"].as_array().unwrap();
        peers.iter().all(|p| p["live"] == false)
            && s["backends"][busy_id]["peers"]["in_flight"] == 0
    })
    .await;
    drop(stream);
    b.shutdown().await;
    r0.shutdown().await.unwrap();
    r1.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn proxies_push_their_work_to_each_other_between_polls() {
    let (r0, r1) = (
        sim(&["--inter-token-latency", "20"]).await,
        sim(&["--inter-token-latency", "20"]).await,
    );
    let urls = [r0.url(), r1.url()];
    // Polls once a minute: within the test only the first poll and pushes can carry news.
    let config = |addresses| {
        peers_config(&urls, addresses, |p| {
            p.interval_ms = 60_000;
            p.push_interval_ms = 5;
            p.expire_ms = 600_000;
        })
    };
    let mut a = headroom_proxy::start(config(vec![])).await.unwrap();
    let mut b = headroom_proxy::start(config(vec![])).await.unwrap();
    let push = |from: &str, to: &ServeHandle| {
        let client = reqwest::Client::builder()
            .local_address(from.parse::<std::net::IpAddr>().unwrap())
            .build()
            .unwrap();
        let url = format!("http://{}/peers/load", to.admin_addr);
        async move {
            let report = json!({"proxy": 1, "seq": 1, "backends": []});
            client
                .post(url)
                .json(&report)
                .send()
                .await
                .unwrap()
                .status()
        }
    };
    assert_eq!(
        push("127.0.0.1", &a).await,
        404,
        "a proxy without [peers] takes no push"
    );
    let everyone = vec![a.admin_addr.to_string(), b.admin_addr.to_string()];
    a.reload(config(everyone.clone())).await.unwrap();
    b.reload(config(everyone)).await.unwrap();
    // The first polls, which find the addresses (and each proxy itself among them).
    for p in [&a, &b] {
        common::eventually("the first polls", || async {
            let m = common::get_text(&format!("http://{}/metrics", p.admin_addr)).await;
            m.contains("headroom_peer_polls_total{result=\"self\"}")
                && common::metric(&m, "headroom_peers_live") == 1.0
        })
        .await;
    }

    // Loopback holds all of 127/8: a push from an address no peer name resolves to is refused.
    assert_eq!(push("127.0.0.2", &b).await, 403);
    let (busy, stream) = long_stream(a.addr).await;
    let busy_id = urls.iter().position(|u| u.ends_with(&busy)).unwrap();
    common::eventually("b to hear of a's stream from a push", || async {
        common::stats(&b).await["backends"][busy_id]["peers"]["in_flight"] == 1
    })
    .await;
    let resp = client()
        .post(format!("http://{}/v1/completions", b.addr))
        .json(&json!({"model": MODEL, "prompt": words(20, "q"), "max_tokens": 1}))
        .send()
        .await
        .unwrap();
    assert_ne!(resp.headers()["x-headroom-backend"], busy.as_str());
    drop(stream);
    common::eventually("b to hear the stream ended from a push", || async {
        common::stats(&b).await["backends"][busy_id]["peers"]["in_flight"] == 0
    })
    .await;

    let sent = common::get_text(&format!("http://{}/metrics", a.admin_addr)).await;
    let got = common::get_text(&format!("http://{}/metrics", b.admin_addr)).await;
    let pushes = |m: &str, labels: &str| {
        common::metric(m, &format!("headroom_peer_pushes_total{{{labels}}}"))
    };
    assert!(
        pushes(&sent, "direction=\"sent\",result=\"ok\"") >= 2.0,
        "{sent}"
    );
    assert!(
        pushes(&got, "direction=\"received\",result=\"ok\"") >= 2.0,
        "{got}"
    );
    for m in [&sent, &got] {
        assert!(
            !m.contains("direction=\"received\",result=\"self\""),
            "no proxy pushes to itself once a poll found it: {m}"
        );
    }
    a.shutdown().await;
    b.shutdown().await;
    r0.shutdown().await.unwrap();
    r1.shutdown().await.unwrap();
}
