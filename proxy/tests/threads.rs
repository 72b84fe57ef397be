//! The threads a serving proxy runs besides its workers. A binary of its own: which of pingora's
//! threads start is decided once per process.
#![cfg(target_os = "linux")]

mod common;

use std::time::Duration;

use headroom_config::serve::ServeConfig;

/// Each thread of this process: its name and its scheduling policy (`/proc`'s `stat` field 41:
/// 0 normal, 3 batch).
fn threads() -> Vec<(String, u32)> {
    std::fs::read_dir("/proc/self/task")
        .expect("/proc/self/task")
        .filter_map(|t| {
            let dir = t.ok()?.path();
            let name = std::fs::read_to_string(dir.join("comm")).ok()?;
            let stat = std::fs::read_to_string(dir.join("stat")).ok()?;
            // The fields after the name, which is in parentheses and may hold spaces.
            let rest = &stat[stat.rfind(')')? + 2..];
            let policy = rest.split(' ').nth(38)?.parse().ok()?;
            Some((name.trim().to_owned(), policy))
        })
        .collect()
}

/// A proxy (and its replica, kept running with it) that has relayed one stream.
async fn serve_one_stream(
    tune: impl FnOnce(&mut ServeConfig),
) -> (headroom_proxy::ServeHandle, impl Sized) {
    let replica = common::sim(5, 1, &[]).await;
    let mut cfg = ServeConfig::quick("127.0.0.1:0", &[replica.url()], "least_load");
    cfg.admin_listen = "127.0.0.1:0".into();
    tune(&mut cfg);
    let h = headroom_proxy::start(cfg.validated().unwrap())
        .await
        .unwrap();
    let body = serde_json::json!({"model": common::MODEL, "prompt": "hello", "max_tokens": 3,
        "stream": true});
    let resp = reqwest::Client::new()
        .post(format!("http://{}/v1/completions", h.addr))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    assert!(resp.text().await.unwrap().contains("[DONE]"));
    (h, replica)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pingoras_clock_runs_only_for_a_sub_second_timeout_and_then_in_the_batch_class() {
    // The default timeouts (seconds) run on tokio's timer: no clock thread ticking every 10 ms.
    let _h = serve_one_stream(|_| {}).await;
    tokio::time::sleep(Duration::from_millis(50)).await;
    let names: Vec<String> = threads().into_iter().map(|(n, _)| n).collect();
    assert!(
        !names.iter().any(|n| n == "Timer thread"),
        "pingora's clock thread runs: {names:?}"
    );

    // A sub-second write timeout needs pingora's clock: started, and in the batch class.
    let _h2 = serve_one_stream(|c| c.timeouts.client_write_ms = 500).await;
    let clock: Vec<(String, u32)> = threads()
        .into_iter()
        .filter(|(n, _)| n == "Timer thread")
        .collect();
    assert_eq!(clock.len(), 1, "{:?}", threads());
    assert_eq!(clock[0].1, 3, "the clock's scheduling policy: {clock:?}");
}
