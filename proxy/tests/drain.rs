//! Graceful drain: after SIGTERM the proxy refuses nothing while it announces that it is going
//! (`/readyz` 503, keep-alive closed), then stops listening and lets open streams finish.

mod common;

use std::time::Duration;

use headroom_config::serve::ServeConfig;
use headroom_proxy::ServeHandle;
use serde_json::json;

async fn proxy(url: String) -> ServeHandle {
    let mut cfg = ServeConfig::quick("127.0.0.1:0", &[url], "least_load");
    cfg.admin_listen = "127.0.0.1:0".into();
    cfg.health.interval_ms = 200;
    headroom_proxy::start(cfg.validated().unwrap())
        .await
        .unwrap()
}

fn stream_body(tokens: u32) -> serde_json::Value {
    json!({"model": common::MODEL, "prompt": "tell me a story", "max_tokens": tokens,
           "ignore_eos": true, "stream": true})
}

/// Sends a streamed completion and reads it to its end; returns the status and whether the
/// stream finished with `[DONE]`.
async fn stream(client: reqwest::Client, url: String, tokens: u32) -> (u16, bool, Option<String>) {
    let resp = match client.post(url).json(&stream_body(tokens)).send().await {
        Ok(r) => r,
        Err(e) => return (0, false, Some(e.to_string())),
    };
    let status = resp.status().as_u16();
    let connection = resp
        .headers()
        .get("connection")
        .map(|v| v.to_str().unwrap_or("").to_owned());
    let text = resp.text().await.unwrap_or_default();
    (status, text.contains("data: [DONE]"), connection)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn draining_refuses_nothing_and_lets_open_streams_finish() {
    let replica = common::sim(30, 15, &[]).await;
    let h = proxy(replica.url()).await;
    let (url, admin) = (
        format!("http://{}/v1/completions", h.addr),
        format!("http://{}", h.admin_addr),
    );
    let metrics = h.metrics.clone();
    let client = reqwest::Client::new();

    // 100 open streams of ~6 s each: all still open once the last has started, however slowly
    // the machine opens them, and through the announce below.
    let open: Vec<_> = (0..100)
        .map(|_| tokio::spawn(stream(client.clone(), url.clone(), 400)))
        .collect();
    for _ in 0..1000 {
        if h.lifecycle.open() >= 100 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(h.lifecycle.open() >= 100, "{} open", h.lifecycle.open());

    let lifecycle = h.lifecycle.clone();
    // Announced for 3 s: time enough for the 20 requests below (0.5 s apart from their sends).
    let drained = tokio::spawn(h.drain(Duration::from_secs(3), Duration::from_secs(20)));
    while !lifecycle.draining() {
        tokio::task::yield_now().await;
    }
    let ready = reqwest::get(format!("{admin}/readyz")).await.unwrap();
    assert_eq!(ready.status(), 503);
    assert_eq!(ready.text().await.unwrap(), "draining\n");

    // While the proxy announces, new requests (40/s) are all served, and told to reconnect.
    let mut fresh = Vec::new();
    for _ in 0..20 {
        fresh.push(tokio::spawn(stream(client.clone(), url.clone(), 2)));
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    for f in fresh {
        let (status, done, connection) = f.await.unwrap();
        assert_eq!(
            (status, done),
            (200, true),
            "a request during the drain failed"
        );
        assert_eq!(connection.as_deref(), Some("close"));
    }

    assert_eq!(drained.await.unwrap(), 0, "requests were cut");
    for s in open {
        let (status, done, _) = s.await.unwrap();
        assert_eq!((status, done), (200, true), "an open stream did not finish");
    }
    assert_eq!(metrics.open_requests.get(), 0);
    // And the listener is gone.
    let after = reqwest::Client::new()
        .post(&url)
        .json(&stream_body(1))
        .send()
        .await;
    assert!(after.is_err(), "still listening after the drain");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_grace_period_bounds_the_drain() {
    let replica = common::sim(30, 20, &[]).await;
    let h = proxy(replica.url()).await;
    let url = format!("http://{}/v1/completions", h.addr);
    // ~10 s of output: longer than the grace period.
    let long = tokio::spawn(stream(reqwest::Client::new(), url, 500));
    for _ in 0..200 {
        if h.lifecycle.open() == 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let t = std::time::Instant::now();
    let left = h
        .drain(Duration::from_millis(100), Duration::from_millis(300))
        .await;
    assert_eq!(left, 1);
    assert!(t.elapsed() < Duration::from_secs(3), "{:?}", t.elapsed());
    long.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_idle_between_requests_close_as_draining_starts() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let replica = common::sim(30, 15, &[]).await;
    let h = proxy(replica.url()).await;
    let addr = h.addr;
    let body = stream_body(3).to_string();
    let request = format!(
        "POST /v1/completions HTTP/1.1\r\nhost: a\r\ncontent-type: application/json\r\n\
         content-length: {}\r\n\r\n{body}",
        body.len()
    );
    // A connection kept alive after its answer, then idle.
    let mut idle = tokio::net::TcpStream::connect(addr).await.unwrap();
    idle.write_all(request.as_bytes()).await.unwrap();
    let mut got = Vec::new();
    let mut buf = vec![0u8; 65_536];
    while !got.ends_with(b"0\r\n\r\n") {
        let n = idle.read(&mut buf).await.unwrap();
        assert!(n > 0, "closed before its answer ended");
        got.extend_from_slice(&buf[..n]);
    }
    assert!(String::from_utf8_lossy(&got).contains("data: [DONE]"));

    let draining = tokio::spawn(h.drain(Duration::from_secs(3), Duration::from_secs(1)));
    // Closed as draining starts, long before the keep-alive time (60 s) and before the
    // announcing ends (3 s), while the proxy still serves.
    let t = std::time::Instant::now();
    let n = tokio::time::timeout(Duration::from_secs(2), idle.read(&mut buf))
        .await
        .expect("an idle connection left open while draining")
        .unwrap_or(0);
    assert_eq!(n, 0, "an idle connection gets nothing but its end");
    assert!(
        t.elapsed() < Duration::from_millis(1500),
        "{:?}",
        t.elapsed()
    );
    // A new connection meanwhile is still served, and told to close.
    let (status, done, connection) = stream(
        reqwest::Client::new(),
        format!("http://{addr}/v1/completions"),
        3,
    )
    .await;
    assert_eq!((status, done), (200, true));
    assert_eq!(connection.as_deref(), Some("close"));
    draining.await.unwrap();
}
