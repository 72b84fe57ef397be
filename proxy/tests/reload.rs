//! Config reload without a restart: new requests follow the new config at once, a stream in
//! progress finishes on the old one, and a config that cannot be served is refused while the old
//! one keeps serving.

mod common;

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
    let stream = {
        let (client, url) = (client.clone(), url.clone());
        tokio::spawn(async move {
            let resp = client
                .post(url)
                .json(&json!({"model": common::MODEL, "prompt": "a long story",
                              "max_tokens": 100, "ignore_eos": true, "stream": true}))
                .send()
                .await
                .unwrap();
            let backend = resp.headers()["x-headroom-backend"]
                .to_str()
                .unwrap()
                .to_owned();
            (backend, resp.text().await.unwrap())
        })
    };
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
    let (backend, body) = stream.await.unwrap();
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
