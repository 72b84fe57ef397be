//! One request against an OpenAI-compatible endpoint, timed from the client's side as the
//! benchmark tools define it: TTFT to the first event that carries output (a role-only chunk is
//! not output), inter-token latency between later output events, E2E to the end of the stream.

use std::time::{Duration, Instant};

use futures_util::StreamExt;
use headroom_workload::sse::SseParser;
use serde_json::Value;

/// What one request did, as the client saw it.
#[derive(Debug, Clone, Default)]
pub struct Timing {
    /// HTTP status (0 when no response arrived).
    pub status: u16,
    /// Why it failed, if it did (transport error, error status, error event, cut stream).
    pub error: Option<String>,
    /// Time to the first output-bearing event.
    pub ttft: Option<Duration>,
    /// Gaps between consecutive output-bearing events.
    pub itl: Vec<Duration>,
    /// Time to the end of the response.
    pub e2e: Duration,
    /// `usage.prompt_tokens` as reported.
    pub prompt_tokens: u64,
    /// `usage.completion_tokens` as reported (or output events counted, without usage).
    pub completion_tokens: u64,
    /// The target URL it was sent to.
    pub target: String,
}

impl Timing {
    /// Completed without error.
    pub fn ok(&self) -> bool {
        self.error.is_none()
    }

    /// Time per output token after the first: (E2E − TTFT) / (tokens − 1).
    pub fn tpot(&self) -> Option<Duration> {
        let ttft = self.ttft?;
        (self.completion_tokens > 1)
            .then(|| (self.e2e - ttft) / (self.completion_tokens - 1) as u32)
    }
}

/// Whether an SSE payload carries generated output (chat `delta.content` or completions `text`).
fn has_output(v: &Value) -> bool {
    let Some(choice) = v.get("choices").and_then(|c| c.get(0)) else {
        return false;
    };
    let text = choice
        .get("text")
        .or_else(|| choice.get("delta").and_then(|d| d.get("content")));
    text.and_then(Value::as_str).is_some_and(|s| !s.is_empty())
}

/// Sends `body` (which must ask for `stream: true`) to `url` and times the stream.
pub async fn send_streaming(client: &reqwest::Client, url: &str, body: &Value) -> Timing {
    let start = Instant::now();
    let mut t = Timing {
        target: url.to_owned(),
        ..Timing::default()
    };
    let resp = match client.post(url).json(body).send().await {
        Ok(r) => r,
        Err(e) => {
            t.error = Some(format!("transport: {e}"));
            t.e2e = start.elapsed();
            return t;
        }
    };
    t.status = resp.status().as_u16();
    if !resp.status().is_success() {
        let text = resp.text().await.unwrap_or_default();
        t.error = Some(format!(
            "status {}: {}",
            t.status,
            text.chars().take(200).collect::<String>()
        ));
        t.e2e = start.elapsed();
        return t;
    }
    let mut parser = SseParser::new();
    let mut stream = resp.bytes_stream();
    let mut last_output: Option<Instant> = None;
    let mut outputs = 0u64;
    let mut done = false;
    while let Some(chunk) = stream.next().await {
        let chunk = match chunk {
            Ok(c) => c,
            Err(e) => {
                t.error = Some(format!("stream cut: {e}"));
                break;
            }
        };
        let now = Instant::now();
        parser.feed(&chunk, |event| {
            if event.is_done() {
                done = true;
                return;
            }
            let Ok(v) = serde_json::from_str::<Value>(&event.data) else {
                return;
            };
            if let Some(err) = v.get("error") {
                t.error = Some(format!("error event: {err}"));
            }
            if let Some(u) = v.get("usage").filter(|u| u.is_object()) {
                t.prompt_tokens = u["prompt_tokens"].as_u64().unwrap_or(t.prompt_tokens);
                t.completion_tokens = u["completion_tokens"]
                    .as_u64()
                    .unwrap_or(t.completion_tokens);
            }
            if has_output(&v) {
                outputs += 1;
                match last_output {
                    None => t.ttft = Some(now - start),
                    Some(prev) => t.itl.push(now - prev),
                }
                last_output = Some(now);
            }
        });
    }
    t.e2e = start.elapsed();
    if t.completion_tokens == 0 {
        t.completion_tokens = outputs;
    }
    if t.error.is_none() && !done {
        t.error = Some("stream ended without [DONE]".to_owned());
    }
    t
}
