//! Closed-loop load: a fixed number of clients, each sending its next request as soon as the last
//! one finished, until a deadline. Measures capacity at a concurrency (not latency under a given
//! arrival rate: that is the open loop's job).

use std::sync::Arc;
use std::time::Duration;

use serde_json::Value;
use tokio::time::Instant;

use crate::client::{Timing, send_streaming};
use crate::replay::Counters as Progress;

/// Runs `concurrency` clients for `duration`; client `i` sends `make_body(i, n)` for its `n`-th
/// request to `urls[i % urls.len()]`. Returns every finished request's timing.
pub async fn run(
    client: reqwest::Client,
    urls: Vec<String>,
    concurrency: usize,
    duration: Duration,
    make_body: Arc<dyn Fn(usize, usize) -> Value + Send + Sync>,
    progress: Arc<Progress>,
) -> Vec<Timing> {
    let deadline = Instant::now() + duration;
    let mut workers = Vec::with_capacity(concurrency);
    for i in 0..concurrency {
        let client = client.clone();
        let url = urls[i % urls.len()].clone();
        let make_body = make_body.clone();
        let progress = progress.clone();
        workers.push(tokio::spawn(async move {
            let mut out = Vec::new();
            let mut n = 0;
            while Instant::now() < deadline {
                progress
                    .sent
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let body = make_body(i, n);
                let started = Instant::now();
                // In-flight requests may finish for up to one more run length after the deadline.
                let t = match tokio::time::timeout_at(
                    deadline + duration,
                    send_streaming(&client, &url, &body),
                )
                .await
                {
                    Ok(t) => t,
                    Err(_) => Timing {
                        failure: Some(crate::client::Failure::Timeout(format!(
                            "unfinished {:?} after the run's end",
                            duration
                        ))),
                        e2e: started.elapsed(),
                        target: url.clone(),
                        ..Timing::default()
                    },
                };
                if !t.ok() {
                    progress
                        .failed
                        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                }
                progress
                    .done
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                out.push(t);
                n += 1;
            }
            out
        }));
    }
    let mut all = Vec::new();
    for w in workers {
        all.extend(w.await.unwrap_or_default());
    }
    all
}
