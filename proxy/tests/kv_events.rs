//! The `kv_events` policy against simulated replicas publishing KV events over ZMQ: the proxy
//! learns what an engine holds even when the proxy never sent it (a late join filled from the
//! replay socket), routes to the holder, and stops sending a prefix to a replica within a second of
//! that replica clearing its cache or restarting. Without events, the approximate index of
//! `prefix_affinity` forgets a replica whose engine the scrape finds restarted.

mod common;

use std::time::{Duration, Instant};

use bytes::Bytes;
use common::{MODEL, sim};
use headroom_config::serve::{BackendConfig, ServeConfig};
use headroom_proxy::ServeHandle;
use headroom_sim::RunningReplica;
use headroom_workload::kv_events::{KvEvent, encode_batch};
use serde_json::{Value, json};
use zeromq::{Socket, SocketRecv, SocketSend, ZmqMessage};

/// A port for a replica's ZMQ publisher, held until the test binary exits
/// ([`common::held_port`] with reuse): the replica binds it by number when it starts and again
/// when it restarts, and nothing else takes it in between.
fn held_port() -> u16 {
    static HELD: std::sync::Mutex<Vec<socket2::Socket>> = std::sync::Mutex::new(Vec::new());
    let (socket, addr) = common::held_port(true);
    HELD.lock().unwrap().push(socket);
    addr.port()
}

/// Event and replay ports of one replica.
#[derive(Clone, Copy)]
struct Ports {
    events: u16,
    replay: u16,
}

impl Ports {
    fn new() -> Self {
        Self {
            events: held_port(),
            replay: held_port(),
        }
    }

    fn sim_config(self) -> String {
        json!({"enable_kv_cache_events": true, "publisher": "zmq",
            "endpoint": format!("tcp://*:{}", self.events),
            "replay_endpoint": format!("tcp://*:{}", self.replay)})
        .to_string()
    }
}

async fn replica(ports: Ports) -> RunningReplica {
    sim(5, 1, &["--kv-events-config", &ports.sim_config()]).await
}

async fn kv_proxy(replicas: &[(&RunningReplica, Ports)]) -> ServeHandle {
    headroom_proxy::start(kv_config(replicas)).await.unwrap()
}

/// A `kv_events` proxy's config over `replicas`, each with its event and replay endpoints.
fn kv_config(replicas: &[(&RunningReplica, Ports)]) -> ServeConfig {
    let urls: Vec<String> = replicas.iter().map(|(r, _)| r.url()).collect();
    let mut cfg = ServeConfig::quick("127.0.0.1:0", &urls, "kv_events");
    cfg.admin_listen = "127.0.0.1:0".into();
    cfg.backends = replicas
        .iter()
        .map(|(r, p)| BackendConfig {
            kv_events: Some(format!("tcp://127.0.0.1:{}", p.events)),
            kv_events_replay: Some(format!("tcp://127.0.0.1:{}", p.replay)),
            ..BackendConfig::at(&r.url())
        })
        .collect();
    // What these proxies know of the engines comes from the events alone (the scrape's own
    // restart detection is tested with `prefix_affinity` below).
    cfg.scrape.interval_ms = 0;
    cfg.validated().unwrap()
}

/// The shared text followed by a distinct tail.
fn prompt(shared: &str, tail: u32) -> String {
    format!("{shared} tail{tail}")
}

async fn complete(base: &str, prompt: &str) -> String {
    let r = reqwest::Client::new()
        .post(format!("{base}/v1/completions"))
        .json(&json!({"model": MODEL, "prompt": prompt, "max_tokens": 2}))
        .send()
        .await
        .unwrap();
    assert!(r.status().is_success(), "{}", r.status());
    let backend = r
        .headers()
        .get("x-headroom-backend")
        .map(|v| v.to_str().unwrap().to_owned())
        .unwrap_or_default();
    r.text().await.unwrap();
    backend
}

async fn kv_stats(h: &ServeHandle) -> Vec<Value> {
    let s = common::stats(h).await;
    s["backends"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| b["kv_events"].clone())
        .collect()
}

/// Polls `/stats` until `done` holds (at most `limit`); returns how long it took.
async fn wait_for(h: &ServeHandle, limit: Duration, done: impl Fn(&[Value]) -> bool) -> Duration {
    let t0 = Instant::now();
    loop {
        let s = kv_stats(h).await;
        if done(&s) {
            return t0.elapsed();
        }
        assert!(t0.elapsed() < limit, "not reached within {limit:?}: {s:?}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

fn name(r: &RunningReplica) -> String {
    r.addr.to_string()
}

fn shared_text() -> String {
    (0..300).map(|i| format!(" w{}", i % 97)).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_proxy_learns_the_cache_from_the_replay_and_routes_to_its_holder() {
    let (pa, pb) = (Ports::new(), Ports::new());
    let (a, b) = (replica(pa).await, replica(pb).await);
    let shared = shared_text();
    // Warm replica b directly: the proxy never sees this request.
    complete(&b.url(), &prompt(&shared, 0)).await;
    let h = kv_proxy(&[(&a, pa), (&b, pb)]).await;
    wait_for(&h, Duration::from_secs(5), |s| {
        s[1]["blocks"].as_u64() > Some(0) && s[0]["state"] == "live" && s[1]["state"] == "live"
    })
    .await;
    for tail in 1..=6 {
        assert_eq!(
            complete(&format!("http://{}", h.addr), &prompt(&shared, tail)).await,
            name(&b)
        );
    }
    let s = kv_stats(&h).await;
    assert_eq!(s[1]["losses"], 0);
    assert_eq!(s[0]["blocks"], 0);
    // The requests matched the engine's blocks (so the proxy hashed them as the engine did),
    // rather than landing on b by a tie-break.
    let metrics = common::get_text(&format!("http://{}/metrics", h.admin_addr)).await;
    let matched = common::metric(&metrics, "headroom_routed_matched_tokens_total");
    assert!(matched >= 6.0 * 256.0, "{matched}");
    h.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_keeps_the_picture_the_replay_buffer_no_longer_holds() {
    // The engine's replay buffer holds only its last 2 batches (vLLM's `buffer_steps`).
    let p = Ports::new();
    let small_buffer = json!({"enable_kv_cache_events": true, "publisher": "zmq",
        "endpoint": format!("tcp://*:{}", p.events),
        "replay_endpoint": format!("tcp://*:{}", p.replay), "buffer_steps": 2})
    .to_string();
    let a = sim(5, 1, &["--kv-events-config", &small_buffer]).await;
    let cfg = kv_config(&[(&a, p)]);
    let mut h = headroom_proxy::start(cfg.clone()).await.unwrap();
    wait_for(&h, Duration::from_secs(5), |s| s[0]["state"] == "live").await;
    // Six documents, each stored in a batch of its own.
    let doc = |i: u32| format!("document {i}:{}", shared_text());
    for i in 0..6 {
        complete(&format!("http://{}", h.addr), &doc(i)).await;
    }
    // Every batch heard: the picture stops changing.
    let mut s = kv_stats(&h).await;
    loop {
        tokio::time::sleep(Duration::from_millis(200)).await;
        let now = kv_stats(&h).await;
        if now == s && s[0]["blocks"].as_u64() > Some(0) {
            break;
        }
        s = now;
    }
    let (blocks, next_seq) = (s[0]["blocks"].clone(), s[0]["next_seq"].as_u64().unwrap());
    assert!(next_seq > 2, "more batches than the buffer holds: {s:?}");
    // The same config again (a rollout that changes nothing for this replica): the picture is
    // carried over and checked against the engine's last batch, not rebuilt from a buffer that
    // lost the first batches.
    h.reload(cfg).await.unwrap();
    wait_for(&h, Duration::from_secs(5), |s| s[0]["state"] == "live").await;
    let s = kv_stats(&h).await;
    assert_eq!(s[0]["blocks"], blocks, "{s:?}");
    assert_eq!(s[0]["losses"], 0, "{s:?}");
    // And the proxy routes on it: a question about the first document, whose blocks only the
    // carried picture holds, is matched.
    let matched = || async {
        let m = common::get_text(&format!("http://{}/metrics", h.admin_addr)).await;
        common::metric(&m, "headroom_routed_matched_tokens_total")
    };
    let earlier = matched().await;
    complete(&format!("http://{}", h.addr), &prompt(&doc(0), 99)).await;
    assert!(matched().await - earlier >= 256.0);
    h.shutdown().await;
}

/// Two event-publishing replicas behind a `kv_events` proxy whose streams are live, both sent the
/// shared prefix directly; returns the first one's ports, both replicas and the proxy.
async fn both_holding_the_prefix() -> (Ports, RunningReplica, RunningReplica, ServeHandle) {
    let (pa, pb) = (Ports::new(), Ports::new());
    let (a, b) = (replica(pa).await, replica(pb).await);
    let h = kv_proxy(&[(&a, pa), (&b, pb)]).await;
    wait_for(&h, Duration::from_secs(5), |s| {
        s.iter().all(|k| k["state"] == "live")
    })
    .await;
    let shared = shared_text();
    complete(&a.url(), &prompt(&shared, 0)).await;
    complete(&b.url(), &prompt(&shared, 0)).await;
    (pa, a, b, h)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cleared_replica_stops_attracting_its_prefix_within_a_second() {
    let (_, a, b, h) = both_holding_the_prefix().await;
    let shared = shared_text();
    let both = |s: &[Value]| s.iter().all(|k| k["blocks"].as_u64() > Some(0));
    wait_for(&h, Duration::from_secs(5), both).await;
    let held = kv_stats(&h).await[0]["blocks"].as_u64().unwrap();

    reqwest::Client::new()
        .post(format!("{}/reset_prefix_cache", a.url()))
        .send()
        .await
        .unwrap();
    let took = wait_for(&h, Duration::from_secs(1), |s| s[0]["blocks"] == 0).await;
    println!("the proxy forgot the cleared replica's blocks {took:?} after the reset");
    assert!(took < Duration::from_secs(1), "{took:?}");
    assert_eq!(kv_stats(&h).await[0]["clears"], 1);
    // From now on the prefix goes where it is still cached.
    for tail in 1..=6 {
        assert_eq!(
            complete(&format!("http://{}", h.addr), &prompt(&shared, tail)).await,
            name(&b)
        );
    }
    assert!(held > 0);
    h.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_replica_is_forgotten_at_its_first_event() {
    let (pa, a, b, h) = both_holding_the_prefix().await;
    let shared = shared_text();
    // Several batches on a, so its restarted numbering starts visibly behind.
    for tail in 100..103 {
        complete(&a.url(), &prompt(&format!("other{tail}{shared}"), tail)).await;
    }
    wait_for(&h, Duration::from_secs(5), |s| {
        s[0]["next_seq"].as_u64() >= Some(4) && s[1]["blocks"].as_u64() > Some(0)
    })
    .await;
    // A prompt only a holds goes to a through the proxy, so the fallback history holds a's
    // blocks too.
    let own = format!("only on a {shared}");
    let before = kv_stats(&h).await[0]["blocks"].as_u64().unwrap();
    complete(&a.url(), &prompt(&own, 0)).await;
    wait_for(&h, Duration::from_secs(5), |s| {
        s[0]["blocks"].as_u64() > Some(before)
    })
    .await;
    assert_eq!(
        complete(&format!("http://{}", h.addr), &prompt(&own, 1)).await,
        name(&a)
    );
    assert!(backend_metric(&h, BLOCKS, &name(&a)).await > 0.0);

    // Restart a: a new engine process (empty cache, numbering from 0) on the same addresses.
    let addr = a.addr;
    a.shutdown().await.unwrap();
    let t0 = Instant::now();
    let a = loop {
        let args = common::sim_args(5, 1, &["--kv-events-config", &pa.sim_config()]);
        match args.build_replica(0) {
            Ok(r) => break headroom_sim::start_replica(r, addr).await.unwrap(),
            // The old publisher may still hold its port for a moment.
            Err(_) if t0.elapsed() < Duration::from_secs(10) => {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(e) => panic!("the replica does not restart: {e}"),
        }
    };
    // Its first event the proxy hears (from requests sent directly, until one is heard: the
    // subscriber reconnects with a backoff) tells the proxy it restarted.
    let mut n = 0;
    loop {
        n += 1;
        assert!(n <= 50, "no restart seen after {n} requests");
        let sent = Instant::now();
        complete(
            &a.url(),
            &format!("a fresh request {n} after the restart, long enough to fill one block or two"),
        )
        .await;
        tokio::time::sleep(Duration::from_millis(100)).await;
        if kv_stats(&h).await[0]["restarts"] == 1 {
            println!(
                "restart seen {:?} after sending the request that revealed it",
                sent.elapsed()
            );
            assert!(sent.elapsed() < Duration::from_secs(1));
            break;
        }
    }
    // The subscriber told the policy: its fallback history of a is gone too (the scrape, which
    // could also have found the restart, is off here).
    assert_eq!(backend_metric(&h, BLOCKS, &name(&a)).await, 0.0);
    for tail in 1..=4 {
        assert_eq!(
            complete(&format!("http://{}", h.addr), &prompt(&shared, tail)).await,
            name(&b)
        );
    }
    h.shutdown().await;
}

/// A stand-in engine's event sockets: the test publishes batches itself and answers the proxy's
/// replay requests.
struct FakeEngine {
    publisher: zeromq::PubSocket,
    router: zeromq::RouterSocket,
}

fn seq_frame(seq: u64) -> Bytes {
    Bytes::copy_from_slice(&seq.to_be_bytes())
}

impl FakeEngine {
    async fn bind(ports: Ports) -> Self {
        let mut e = Self {
            publisher: zeromq::PubSocket::new(),
            router: zeromq::RouterSocket::new(),
        };
        e.publisher
            .bind(&format!("tcp://127.0.0.1:{}", ports.events))
            .await
            .unwrap();
        e.router
            .bind(&format!("tcp://127.0.0.1:{}", ports.replay))
            .await
            .unwrap();
        e
    }

    async fn publish(&mut self, seq: u64, payload: Bytes) {
        let mut m = ZmqMessage::from(Bytes::new());
        m.push_back(seq_frame(seq));
        m.push_back(payload);
        self.publisher.send(m).await.unwrap();
    }

    /// Waits up to `limit` for a replay request: the requester's id and the start asked for.
    async fn request(&mut self, limit: Duration) -> Option<(Bytes, u64)> {
        let request = tokio::time::timeout(limit, self.router.recv())
            .await
            .ok()?
            .unwrap()
            .into_vec();
        let start = u64::from_be_bytes(request.last().unwrap()[..].try_into().unwrap());
        Some((request[0].clone(), start))
    }

    /// Answers a replay request with the batches at or after its start.
    async fn reply(&mut self, (id, start): (Bytes, u64), batches: &[(u64, Bytes)]) {
        for (s, payload) in batches.iter().filter(|(s, _)| *s >= start) {
            let mut m = ZmqMessage::from(id.clone());
            m.push_back(Bytes::new());
            m.push_back(seq_frame(*s));
            m.push_back(payload.clone());
            self.router.send(m).await.unwrap();
        }
        let mut end = ZmqMessage::from(id);
        end.push_back(Bytes::new());
        end.push_back(seq_frame(u64::MAX));
        end.push_back(Bytes::new());
        self.router.send(end).await.unwrap();
    }
}

/// Batch `seq`, storing one block of its own, so a complete picture holds next_seq blocks.
fn batch(seq: u64) -> Bytes {
    let stored = KvEvent::BlockStored {
        block_hashes: vec![1000 + seq],
        parent_block_hash: None,
        token_ids: vec![0; 16],
        block_size: 16,
    };
    Bytes::from(encode_batch(seq as f64, &[stored], 0, true))
}

/// Publishes batch `seq` past a gap, checks the proxy asks a replay from `asked_from`, answers it
/// with the batches `replayed`, waits until the proxy expects `seq + 1`, and returns the replica's
/// `kv_events` stats then.
async fn gap_replayed(
    e: &mut FakeEngine,
    h: &ServeHandle,
    seq: u64,
    asked_from: u64,
    replayed: &[u64],
) -> Value {
    e.publish(seq, batch(seq)).await;
    let r = e
        .request(Duration::from_secs(5))
        .await
        .expect("a replay request");
    assert_eq!(r.1, asked_from);
    let answer: Vec<(u64, Bytes)> = replayed.iter().map(|&s| (s, batch(s))).collect();
    e.reply(r, &answer).await;
    wait_for(h, Duration::from_secs(5), |s| {
        s[0]["next_seq"].as_u64() == Some(seq + 1)
    })
    .await;
    kv_stats(h).await[0].clone()
}

/// A stand-in engine: the test publishes batches itself (vLLM's positional format) and answers the
/// proxy's replay requests, to drive the subscriber through a late join with live copies of
/// replayed batches, a gap the replay fills, and a gap it cannot.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replays_fill_gaps_and_duplicates_are_not_restarts() {
    let batches = |seqs: &[u64]| seqs.iter().map(|&s| (s, batch(s))).collect::<Vec<_>>();
    let ports = Ports::new();
    let mut e = FakeEngine::bind(ports).await;
    let replica = sim(5, 1, &[]).await;
    let h = kv_proxy(&[(&replica, ports)]).await;
    let next_seq = async |h: &ServeHandle| kv_stats(h).await[0]["next_seq"].as_u64();

    // The proxy joins and asks for everything from 0. Batches 0–2 go out live while it waits, so
    // (once its subscription is through) their live copies arrive after the replay applied them.
    let first = e
        .request(Duration::from_secs(5))
        .await
        .expect("the proxy asks for a replay");
    assert_eq!(first.1, 0);
    for s in 0..3 {
        e.publish(s, batch(s)).await;
    }
    e.reply(first, &batches(&[0, 1, 2])).await;
    let mut last = 2;
    // Publish until the proxy has heard one live batch, answering the replays that gaps trigger.
    let start = Instant::now();
    loop {
        last += 1;
        e.publish(last, batch(last)).await;
        let seen = Instant::now();
        while seen.elapsed() < Duration::from_millis(300) && next_seq(&h).await != Some(last + 1) {
            if let Some(r) = e.request(Duration::from_millis(20)).await {
                e.reply(r, &batches(&(0..=last).collect::<Vec<_>>())).await;
            }
        }
        if next_seq(&h).await == Some(last + 1) {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "no live batch heard"
        );
    }
    let k = &kv_stats(&h).await[0];
    assert_eq!(k["restarts"], 0, "{k}");
    assert_eq!(k["blocks"].as_u64(), Some(last + 1), "{k}");
    assert_eq!(k["state"], "live", "{k}");

    // A gap that the replay fills.
    let k = &gap_replayed(
        &mut e,
        &h,
        last + 3,
        last + 1,
        &[last + 1, last + 2, last + 3],
    )
    .await;
    assert_eq!(
        (
            k["blocks"].as_u64(),
            k["losses"].as_u64(),
            k["state"].as_str()
        ),
        (Some(last + 4), Some(0), Some("live")),
        "{k}"
    );
    let gaps = k["gaps"].as_u64().unwrap();
    assert!(gaps >= 1);

    // A gap the replay buffer no longer reaches: the picture restarts from there, partial.
    let far = last + 7;
    let k = &gap_replayed(&mut e, &h, far, last + 4, &[far]).await;
    assert_eq!(
        (
            k["blocks"].as_u64(),
            k["losses"].as_u64(),
            k["state"].as_str()
        ),
        (Some(1), Some(1), Some("partial")),
        "{k}"
    );
    assert_eq!(k["restarts"], 0, "{k}");
    h.shutdown().await;
}

/// vLLM's hashes end to end: a stand-in engine publishes the blocks vLLM would store for a chat
/// prompt (the fixture's vectors, computed with transformers and cbor2), and the proxy, hashing
/// the same request with the model's tokenizer and template, routes it there with those blocks
/// matched.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_hashes_from_the_models_tokenizer_match_the_engines_events() {
    let fixture = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../workload/tests/fixtures/engine-tokenizer");
    let vectors: Vec<Value> =
        serde_json::from_str(&std::fs::read_to_string(fixture.join("vectors.json")).unwrap())
            .unwrap();
    let v = &vectors[0];
    let hashes: Vec<u64> = v["vllm_hashes_seed0"]
        .as_array()
        .unwrap()
        .iter()
        .map(|h| h.as_u64().unwrap())
        .collect();

    let ports = Ports::new();
    let mut e = FakeEngine::bind(ports).await;
    let (a, b) = (sim(5, 1, &[]).await, sim(5, 1, &[]).await);
    let urls = [a.url(), b.url()];
    let mut cfg = ServeConfig::quick("127.0.0.1:0", &urls, "kv_events");
    cfg.admin_listen = "127.0.0.1:0".into();
    cfg.backends[1].kv_events = Some(format!("tcp://127.0.0.1:{}", ports.events));
    cfg.backends[1].kv_events_replay = Some(format!("tcp://127.0.0.1:{}", ports.replay));
    cfg.kv_events.hash = "vllm_sha256_cbor".into();
    cfg.kv_events.python_hash_seed = Some("0".into());
    cfg.kv_events.tokenizer = Some(fixture.join("tokenizer.json").display().to_string());
    let h = headroom_proxy::start(cfg.validated().unwrap())
        .await
        .unwrap();

    // The engine already holds the prompt's blocks when the proxy joins (the replay says so).
    let stored = KvEvent::BlockStored {
        block_hashes: hashes.clone(),
        parent_block_hash: None,
        token_ids: vec![],
        block_size: 16,
    };
    let r = e
        .request(Duration::from_secs(5))
        .await
        .expect("the proxy asks for a replay");
    e.reply(
        r,
        &[(0, Bytes::from(encode_batch(1.0, &[stored], 0, false)))],
    )
    .await;
    wait_for(&h, Duration::from_secs(5), |s| {
        s[1]["blocks"].as_u64() == Some(hashes.len() as u64)
    })
    .await;

    let mut body = v["body"].clone();
    body["model"] = MODEL.into();
    body["max_tokens"] = 2.into();
    let resp = reqwest::Client::new()
        .post(format!("http://{}/v1/chat/completions", h.addr))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert!(resp.status().is_success());
    let backend = resp.headers()["x-headroom-backend"]
        .to_str()
        .unwrap()
        .to_owned();
    resp.text().await.unwrap();
    assert_eq!(backend, name(&b));
    let metrics = common::get_text(&format!("http://{}/metrics", h.admin_addr)).await;
    assert_eq!(
        common::metric(&metrics, "headroom_routed_matched_tokens_total"),
        (hashes.len() * 16) as f64
    );
    assert_eq!(
        common::metric(&metrics, "headroom_engine_tokens_failed_total"),
        0.0
    );
    h.shutdown().await;
}

const BLOCKS: &str = "headroom_prefix_index_blocks";

/// A replica's series of the labelled metric `name` in the proxy's `/metrics` (NaN when absent).
async fn backend_metric(h: &ServeHandle, name: &str, backend: &str) -> f64 {
    let text = common::get_text(&format!("http://{}/metrics", h.admin_addr)).await;
    let prefix = format!("{name}{{backend=\"{backend}\"}} ");
    text.lines()
        .find_map(|l| l.strip_prefix(&prefix)?.trim().parse().ok())
        .unwrap_or(f64::NAN)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefix_affinity_forgets_a_replica_whose_engine_restarted() {
    let (a, b) = (sim(5, 1, &[]).await, sim(5, 1, &[]).await);
    let h = common::proxy(&[a.url(), b.url()], None).await;
    let base = format!("http://{}", h.addr);
    let shared = shared_text();
    let holder = complete(&base, &prompt(&shared, 0)).await;
    for tail in 1..=3 {
        assert_eq!(complete(&base, &prompt(&shared, tail)).await, holder);
    }
    let (restarting, other) = if holder == name(&a) { (a, b) } else { (b, a) };
    let held = backend_metric(&h, BLOCKS, &holder).await;
    assert!(held > 0.0, "the proxy's history holds the prefix: {held}");
    assert_eq!(backend_metric(&h, BLOCKS, &name(&other)).await, 0.0);
    // Let a scrape see the engine's counters before the restart.
    let scraped_before = Instant::now();
    let queries = "headroom_engine_prefix_cache_queries_tokens_total";
    loop {
        // Absent reads as NaN, which is not above zero either.
        if backend_metric(&h, queries, &holder).await > 0.0 {
            break;
        }
        assert!(
            scraped_before.elapsed() < Duration::from_secs(5),
            "no scrape"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(
        backend_metric(&h, "headroom_engine_restarts_total", &holder).await,
        0.0
    );

    // A new engine process on the same address: empty cache, counters from zero.
    let addr = restarting.addr;
    restarting.shutdown().await.unwrap();
    let replica = common::sim_args(5, 1, &[]).build_replica(0).unwrap();
    let restarted = headroom_sim::start_replica(replica, addr).await.unwrap();
    let t0 = Instant::now();
    while backend_metric(&h, BLOCKS, &holder).await > 0.0 {
        // A scrape or two (200 ms apart), one of which may first fail on the old engine's
        // pooled connection (1 s timeout): 10 s is for a proxy that never forgets.
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "the history of the restarted replica is still held"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    println!("history forgotten {:?} after the restart", t0.elapsed());
    assert_eq!(
        backend_metric(&h, "headroom_engine_restarts_total", &holder).await,
        1.0
    );
    // The proxy learns the replica again from what it sends it, and routes as before.
    let again = complete(&base, &prompt(&shared, 9)).await;
    for tail in 10..=12 {
        assert_eq!(complete(&base, &prompt(&shared, tail)).await, again);
    }
    assert!(backend_metric(&h, BLOCKS, &again).await > 0.0);
    assert_eq!(
        backend_metric(&h, "headroom_engine_restarts_total", &holder).await,
        1.0,
        "one restart, counted once"
    );
    h.shutdown().await;
    restarted.shutdown().await.unwrap();
    other.shutdown().await.unwrap();
}
