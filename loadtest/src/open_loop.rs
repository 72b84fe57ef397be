//! Open-loop load: every request is sent at its planned time whatever happened to earlier ones,
//! so a slow response never delays later sends (no coordinated omission).

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use serde_json::Value;
use tokio::time::Instant;

use crate::client::{Timing, send_streaming};

/// One request of a plan.
#[derive(Debug, Clone)]
pub struct Planned {
    /// Offset from the start of the run.
    pub at: Duration,
    /// Full URL to POST to.
    pub url: String,
    /// JSON body (streaming).
    pub body: Value,
}

/// Counts for progress output.
#[derive(Debug, Default)]
pub struct Progress {
    /// Requests sent.
    pub sent: AtomicUsize,
    /// Requests finished (ok or not).
    pub done: AtomicUsize,
    /// Requests failed.
    pub failed: AtomicUsize,
}

/// Sends every planned request at its time; returns timings in plan order.
pub async fn run(
    client: reqwest::Client,
    plan: Vec<Planned>,
    progress: Arc<Progress>,
) -> Vec<Timing> {
    let start = Instant::now();
    let mut handles = Vec::with_capacity(plan.len());
    for p in plan {
        tokio::time::sleep_until(start + p.at).await;
        let client = client.clone();
        let progress = progress.clone();
        progress.sent.fetch_add(1, Ordering::Relaxed);
        handles.push(tokio::spawn(async move {
            let t = send_streaming(&client, &p.url, &p.body).await;
            if !t.ok() {
                progress.failed.fetch_add(1, Ordering::Relaxed);
            }
            progress.done.fetch_add(1, Ordering::Relaxed);
            t
        }));
    }
    let mut out = Vec::with_capacity(handles.len());
    for h in handles {
        out.push(h.await.unwrap_or_else(|e| Timing {
            failure: Some(crate::client::Failure::Transport(format!(
                "task failed: {e}"
            ))),
            ..Timing::default()
        }));
    }
    out
}
