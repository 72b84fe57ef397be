//! Config reload without a restart: new requests follow the new config at once, a stream in
//! progress finishes on the old one, and a config that cannot be served is refused while the old
//! one keeps serving; what the proxy knows about a replica both configs share (its work in flight,
//! its admitted requests, its prefix history) carries over.

mod common;

use std::time::Duration;

use headroom_config::serve::{BackendConfig, ServeConfig};
use serde_json::{Value, json};

fn config(url: &str) -> ServeConfig {
    let mut cfg = ServeConfig::quick("127.0.0.1:0", &[url.to_owned()], "least_load");
    cfg.admin_listen = "127.0.0.1:0".into();
    cfg.health.interval_ms = 100;
    cfg.validated().unwrap()
}

async fn served_by(client: &reqwest::Client, url: &str) -> String {
    let resp = client
        .post(url)
        .json(&json!({"model": common::MODEL, "prompt": "hi", "max_tokens": 2}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    resp.headers()["x-headroom-backend"]
        .to_str()
        .unwrap()
        .to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_moves_new_requests_and_lets_streams_in_progress_finish() {
    let (a, b) = (
        common::sim(20, 20, &[]).await,
        common::sim(20, 20, &[]).await,
    );
    let mut cfg_a = config(&a.url());
    cfg_a.backends[0].name = Some("a".into());
    let mut h = headroom_proxy::start(cfg_a.clone()).await.unwrap();
    let (url, admin) = (
        format!("http://{}/v1/completions", h.addr),
        format!("http://{}", h.admin_addr),
    );
    let client = reqwest::Client::new();
    assert_eq!(served_by(&client, &url).await, "a");

    // A stream of ~2 s on the old config.
    let old_stream = tokio::spawn(stream(
        client.clone(),
        url.clone(),
        "a long story".into(),
        100,
    ));
    while h.lifecycle.open() == 0 {
        tokio::task::yield_now().await;
    }

    let mut cfg_b = cfg_a.clone();
    cfg_b.backends = vec![BackendConfig {
        name: Some("b".into()),
        ..BackendConfig::at(&b.url())
    }];
    let before = common::get_text(&format!("{admin}/metrics")).await;
    assert!(
        before.contains("headroom_backend_healthy{backend=\"a\"} 1"),
        "{before}"
    );
    h.reload(cfg_b.clone()).await.unwrap();
    // New requests (new connections) go by the new config at once.
    assert_eq!(served_by(&reqwest::Client::new(), &url).await, "b");
    let stats: Value = reqwest::get(format!("{admin}/stats"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(stats["backends"][0]["name"], "b", "{stats}");

    // The stream that started on the old config finished there, whole.
    let (backend, body) = old_stream.await.unwrap();
    assert_eq!(backend, "a");
    assert!(body.contains("data: [DONE]"), "the stream was cut");

    // A config that cannot be served, or that needs a restart, is refused; the old one serves on.
    let mut unbuildable = cfg_b.clone();
    unbuildable.backends[0].api_key_env = Some("HEADROOM_TEST_NEVER_SET".into());
    let e = h.reload(unbuildable).await.unwrap_err().to_string();
    assert!(e.contains("HEADROOM_TEST_NEVER_SET is not set"), "{e}");
    let mut moved = cfg_b.clone();
    moved.listen = "127.0.0.1:1".into();
    let e = h.reload(moved).await.unwrap_err().to_string();
    assert!(e.contains("listen cannot change without a restart"), "{e}");
    let mut limits = cfg_b.clone();
    limits.timeouts.keepalive_ms += 1;
    let e = h.reload(limits).await.unwrap_err().to_string();
    assert!(e.contains("timeouts.keepalive_ms cannot change"), "{e}");
    assert_eq!(served_by(&reqwest::Client::new(), &url).await, "b");

    // Metrics carry on across reloads (one registry).
    let m = common::get_text(&format!("{admin}/metrics")).await;
    let answered: f64 = m
        .lines()
        .filter(|l| l.starts_with("headroom_requests_total{") && l.contains("status=\"200\""))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum();
    assert_eq!(answered, 4.0, "{m}");
    // The replica the reload removed has no gauges left for an alert to read.
    assert!(
        m.contains("headroom_backend_healthy{backend=\"b\"} 1"),
        "{m}"
    );
    assert!(
        !m.contains("headroom_backend_healthy{backend=\"a\"}"),
        "{m}"
    );
    h.shutdown().await;
}

/// A streamed completion of `max_tokens` tokens, read to its end: its replica and its body.
async fn stream(
    client: reqwest::Client,
    url: String,
    prompt: String,
    max_tokens: u32,
) -> (String, String) {
    let (backend, resp) = common::start_stream(&client, &url, &prompt, max_tokens).await;
    (backend, resp.text().await.unwrap())
}

/// `headroom_prefix_index_blocks` of one replica.
fn index_blocks(metrics: &str, backend: &str) -> f64 {
    metrics
        .lines()
        .find(|l| {
            l.starts_with(&format!(
                "headroom_prefix_index_blocks{{backend=\"{backend}\"}}"
            ))
        })
        .and_then(|l| l.rsplit(' ').next()?.parse().ok())
        .unwrap_or(0.0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_keeps_each_kept_replicas_work_admissions_and_prefix_history() {
    let (a, b, c) = (
        common::sim(20, 20, &[]).await,
        common::sim(20, 20, &[]).await,
        common::sim(20, 20, &[]).await,
    );
    let mut old = ServeConfig::quick("127.0.0.1:0", &[a.url(), b.url()], "prefix_affinity");
    old.admin_listen = "127.0.0.1:0".into();
    old.admission.enabled = true;
    old.admission.max_in_flight = Some(8);
    for (cfg, name) in old.backends.iter_mut().zip(["a", "b"]) {
        cfg.name = Some(name.into());
    }
    let old = old.validated().unwrap();
    let mut h = headroom_proxy::start(old.clone()).await.unwrap();
    let (url, admin) = (
        format!("http://{}/v1/completions", h.addr),
        format!("http://{}", h.admin_addr),
    );
    let client = reqwest::Client::new();
    // Three streams of ~3 s under the old config, with prompts of several blocks.
    let streams: Vec<_> = ["first", "second", "third"]
        .into_iter()
        .map(|p| {
            let prompt = format!("the {p} story: {}", "once upon a time ".repeat(200));
            tokio::spawn(stream(client.clone(), url.clone(), prompt, 150))
        })
        .collect();
    let sent = |h: &headroom_proxy::ServeHandle| -> u32 {
        h.fleet().backends.iter().map(|b| b.load().in_flight).sum()
    };
    tokio::time::timeout(Duration::from_secs(10), async {
        while sent(&h) < 3 {
            tokio::task::yield_now().await;
        }
    })
    .await
    .expect("three streams dispatched");
    let before: Vec<(String, u32)> = h
        .fleet()
        .backends
        .iter()
        .map(|b| (b.url.clone(), b.load().in_flight))
        .collect();
    assert_eq!(before.iter().map(|(_, n)| n).sum::<u32>(), 3, "{before:?}");
    let m = common::get_text(&format!("{admin}/metrics")).await;
    let history: Vec<f64> = ["a", "b"].iter().map(|n| index_blocks(&m, n)).collect();
    assert!(history.iter().sum::<f64>() > 0.0, "{m}");

    // The new config lists b before a, drops nothing, adds c and weighs decoding differently.
    let mut new = old.clone();
    new.backends = vec![
        old.backends[1].clone(),
        old.backends[0].clone(),
        BackendConfig {
            name: Some("c".into()),
            ..BackendConfig::at(&c.url())
        },
    ];
    new.routing.decode_weight = 4.0;
    h.reload(new.validated().unwrap()).await.unwrap();

    // The new config counts the streams still running under the old one, replica by replica:
    // in the routing cost and in admission (the same [admission], so the caps came too).
    let fleet = h.fleet();
    let admitted = h.admission().unwrap().slots();
    for (i, b) in fleet.backends.iter().enumerate() {
        let was = before
            .iter()
            .find(|(u, _)| *u == b.url)
            .map_or(0, |(_, n)| *n);
        assert_eq!(b.load().in_flight, was, "{}", b.name);
        assert_eq!(admitted[i], (Some(8), was), "{}", b.name);
    }
    // The prefix history of a and b came over under their new positions; c has none.
    let m = common::get_text(&format!("{admin}/metrics")).await;
    assert_eq!(index_blocks(&m, "a"), history[0], "{m}");
    assert_eq!(index_blocks(&m, "b"), history[1], "{m}");
    assert_eq!(index_blocks(&m, "c"), 0.0, "{m}");

    // The streams finish on the old config, and the new one's counts fall with them.
    for s in streams {
        let (backend, body) = s.await.unwrap();
        assert!(backend == "a" || backend == "b", "{backend}");
        assert!(body.contains("data: [DONE]"), "the stream was cut");
    }
    tokio::time::timeout(Duration::from_secs(10), async {
        while h.lifecycle.open() > 0 {
            tokio::task::yield_now().await;
        }
    })
    .await
    .expect("every request closed");
    assert!(fleet.backends.iter().all(|b| b.load().in_flight == 0));
    assert_eq!(
        h.admission().unwrap().slots(),
        vec![(Some(8), 0); 3],
        "every admission released"
    );
    h.shutdown().await;
}
