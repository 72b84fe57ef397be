//! The `kv_events` policy against simulated replicas publishing KV events over ZMQ: the proxy
//! learns what an engine holds even when the proxy never sent it (a late join filled from the
//! replay socket), routes to the holder, and stops sending a prefix to a replica within a second of
//! that replica clearing its cache or restarting.

mod common;

use std::time::{Duration, Instant};

use common::{MODEL, sim};
use headroom_config::serve::{BackendConfig, ServeConfig};
use headroom_proxy::ServeHandle;
use headroom_sim::RunningReplica;
use serde_json::{Value, json};

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
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
            events: free_port(),
            replay: free_port(),
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
    headroom_proxy::start(cfg.validated().unwrap())
        .await
        .unwrap()
}

/// A prompt of `words` shared words and a distinct tail.
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
    let s: Value = reqwest::get(format!("http://{}/stats", h.admin_addr))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
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
    h.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cleared_replica_stops_attracting_its_prefix_within_a_second() {
    let (pa, pb) = (Ports::new(), Ports::new());
    let (a, b) = (replica(pa).await, replica(pb).await);
    let h = kv_proxy(&[(&a, pa), (&b, pb)]).await;
    wait_for(&h, Duration::from_secs(5), |s| {
        s.iter().all(|k| k["state"] == "live")
    })
    .await;
    let shared = shared_text();
    // Both replicas hold the prefix (sent to each directly).
    complete(&a.url(), &prompt(&shared, 0)).await;
    complete(&b.url(), &prompt(&shared, 0)).await;
    let both = |s: &[Value]| s.iter().all(|k| k["blocks"].as_u64() > Some(0));
    wait_for(&h, Duration::from_secs(5), both).await;
    let held = kv_stats(&h).await[0]["blocks"].as_u64().unwrap();

    reqwest::Client::new()
        .post(format!("{}/reset_prefix_cache", a.url()))
        .send()
        .await
        .unwrap();
    let took = wait_for(&h, Duration::from_secs(1), |s| s[0]["blocks"] == 0).await;
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
    // Several batches on a, so its restarted numbering starts visibly behind.
    for tail in 100..103 {
        complete(&a.url(), &prompt(&format!("other{tail}{shared}"), tail)).await;
    }
    wait_for(&h, Duration::from_secs(5), |s| {
        s[0]["next_seq"].as_u64() >= Some(4) && s[1]["blocks"].as_u64() > Some(0)
    })
    .await;

    // Restart a: a new engine process (empty cache, numbering from 0) on the same addresses.
    let addr = a.addr;
    a.shutdown().await.unwrap();
    let t0 = Instant::now();
    let a = loop {
        let args = headroom_sim::SimArgs::from_flags([
            "--latency-model",
            "constant",
            "--time-to-first-token",
            "5",
            "--inter-token-latency",
            "1",
            "--max-model-len",
            "200000",
            "--kv-events-config",
            &pa.sim_config(),
        ])
        .unwrap();
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
            assert!(sent.elapsed() < Duration::from_secs(1));
            break;
        }
    }
    for tail in 1..=4 {
        assert_eq!(
            complete(&format!("http://{}", h.addr), &prompt(&shared, tail)).await,
            name(&b)
        );
    }
    h.shutdown().await;
}
