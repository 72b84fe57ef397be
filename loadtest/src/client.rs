//! One request against an OpenAI-compatible endpoint, timed from the client's side with vLLM
//! `bench serve`'s definitions (docs/measurement.md):
//!
//! | number | definition |
//! |---|---|
//! | start | just before the POST (prestaged: when the body's last byte was handed over) |
//! | TTFT | arrival of the first SSE message whose `choices` is non-empty (a chat role chunk counts) |
//! | ITL | gaps between consecutive such messages: per chunk, not per token |
//! | E2EL | last such message − start (the trailing usage chunk is excluded) |
//! | TPOT | (E2EL − TTFT) / (output tokens − 1), only when output tokens > 1 |
//! | output tokens | `usage.completion_tokens` (else the count of token-bearing messages) |

use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use headroom_workload::digest::OutputDigest;
use headroom_workload::measure::EventReader;
use headroom_workload::sse::SseParser;
use serde_json::Value;

/// What went wrong with a request, by kind.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Failure {
    /// No HTTP response (connect, reset, timeout before headers).
    Transport(String),
    /// A non-2xx status, with the start of the body.
    Status(u16, String),
    /// A `data: {"error": …}` event inside the stream.
    ErrorEvent(String),
    /// The stream ended (or broke) without `[DONE]`.
    Cut(String),
    /// No complete answer within the request timeout.
    Timeout(String),
}

impl Failure {
    /// Short kind name for counting (`transport`, `status_503`, `error_event`, `cut`).
    pub fn kind(&self) -> String {
        match self {
            Self::Transport(_) => "transport".into(),
            Self::Status(s, _) => format!("status_{s}"),
            Self::ErrorEvent(_) => "error_event".into(),
            Self::Cut(_) => "cut".into(),
            Self::Timeout(_) => "timeout".into(),
        }
    }
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Transport(e) => write!(f, "transport: {e}"),
            Self::Status(s, body) => write!(f, "status {s}: {body}"),
            Self::ErrorEvent(e) => write!(f, "error event: {e}"),
            Self::Cut(e) => write!(f, "stream cut: {e}"),
            Self::Timeout(e) => write!(f, "timeout: {e}"),
        }
    }
}

/// What one request did, as the client saw it.
#[derive(Debug, Clone, Default)]
pub struct Timing {
    /// HTTP status (0 when no response arrived).
    pub status: u16,
    /// Why it failed, if it did.
    pub failure: Option<Failure>,
    /// Time to the first message with non-empty `choices`.
    pub ttft: Option<Duration>,
    /// Gaps between consecutive token-bearing messages.
    pub itl: Vec<Duration>,
    /// Time to the last token-bearing message (E2EL), or to the failure.
    pub e2e: Duration,
    /// `usage.prompt_tokens` as reported (0 without usage).
    pub prompt_tokens: u64,
    /// `usage.completion_tokens` (or token-bearing messages counted, without usage).
    pub completion_tokens: u64,
    /// The URL it was sent to.
    pub target: String,
    /// The output's fingerprint (hashes, never the text), for output agreement between runs.
    pub output: Option<headroom_workload::digest::Fingerprint>,
}

impl Timing {
    /// Completed without error.
    pub fn ok(&self) -> bool {
        self.failure.is_none()
    }

    /// (E2EL − TTFT) / (output tokens − 1), when output tokens > 1.
    pub fn tpot(&self) -> Option<Duration> {
        let ttft = self.ttft?;
        (self.completion_tokens > 1)
            .then(|| self.e2e.saturating_sub(ttft) / (self.completion_tokens - 1) as u32)
    }
}

/// Reads an event the borrowing reader did not take (an error object, or fields of other types):
/// records an error and usage, digests choice 0 of an answer, and says whether it carried choices.
fn read_whole_event(v: &Value, t: &mut Timing, digest: &mut OutputDigest) -> bool {
    let error = v.get("error");
    if let Some(err) = error {
        t.failure
            .get_or_insert(Failure::ErrorEvent(err.to_string()));
    }
    if let Some(u) = v.get("usage").filter(|u| u.is_object()) {
        t.prompt_tokens = u["prompt_tokens"].as_u64().unwrap_or(t.prompt_tokens);
        t.completion_tokens = u["completion_tokens"]
            .as_u64()
            .unwrap_or(t.completion_tokens);
    }
    if !has_choices(v) {
        return false;
    }
    if error.is_some() {
        // A failed answer has no output to compare (as the proxy's meter reads it).
        return true;
    }
    // The output of choice 0 is digested (as the proxy does), whatever its position.
    let text = headroom_workload::digest::choice_zero(&v["choices"])
        .map(headroom_workload::digest::choice_text)
        .unwrap_or_default();
    if !text.is_empty() {
        digest.event(&text);
    }
    true
}

/// Whether an SSE payload is a token-bearing message: non-empty `choices`.
fn has_choices(v: &Value) -> bool {
    v.get("choices")
        .and_then(Value::as_array)
        .is_some_and(|c| !c.is_empty())
}

/// The instant a scheduled request may go, and the signal that it has come. The replay's dispatcher
/// thread sleeps to each instant on the OS's timer (tens of microseconds; the runtime's timer rounds
/// to milliseconds) and fires the [`Trigger`]; the request's task waits asleep, not spinning, so a
/// load generator sharing a core with what it measures does not take it from the target.
#[derive(Debug)]
pub struct Release {
    at: Instant,
    go: tokio::sync::oneshot::Receiver<()>,
}

/// Fires a [`Release`].
#[derive(Debug)]
pub struct Trigger {
    at: Instant,
    go: tokio::sync::oneshot::Sender<()>,
}

impl Release {
    /// A release at `at` and its trigger.
    pub fn new(at: Instant) -> (Release, Trigger) {
        let (tx, rx) = tokio::sync::oneshot::channel();
        (Release { at, go: rx }, Trigger { at, go: tx })
    }

    /// The planned instant.
    pub fn at(&self) -> Instant {
        self.at
    }

    /// Waits for the trigger; should it be dropped unfired, waits for the instant on the
    /// runtime's timer instead.
    pub async fn wait(self) {
        if self.go.await.is_err() {
            tokio::time::sleep_until(self.at.into()).await;
        }
    }
}

impl Trigger {
    /// The instant it is for.
    pub fn at(&self) -> Instant {
        self.at
    }

    /// Lets the request go (a request that ended already is not waiting).
    pub fn fire(self) {
        let _ = self.go.send(());
    }
}

/// Sends the JSON `body` (already serialized; it must ask for `stream: true`) to `url` with
/// `headers`, and times the stream from just before the POST.
pub async fn send_streaming_with(
    client: &reqwest::Client,
    url: &str,
    body: bytes::Bytes,
    headers: &[(&str, &str)],
) -> Timing {
    send_timed(client, url, body, headers, None).await.0
}

/// Sends a prestaged request: the headers and the body up to its last byte go now, the last byte
/// when `release` comes (or as soon after as the connection takes it), so that the server holds
/// the complete request at its time however many large requests are due at once. Returns the
/// timing, measured from the moment the last byte was handed to the connection, and that moment
/// (for a request that ended before, e.g. refused on its headers, its planned instant).
pub async fn send_streaming_at(
    client: &reqwest::Client,
    url: &str,
    body: bytes::Bytes,
    headers: &[(&str, &str)],
    release: Release,
) -> (Timing, Instant) {
    send_timed(client, url, body, headers, Some(release)).await
}

/// The request body: whole, or (prestaged) all but its last byte at once and that byte at its
/// release, recording when it was handed over.
fn request_body(
    body: bytes::Bytes,
    release: Option<Release>,
    completed: &Arc<OnceLock<Instant>>,
) -> reqwest::Body {
    let Some(release) = release else {
        return reqwest::Body::from(body);
    };
    let head = body.slice(..body.len() - 1);
    let last = body.slice(body.len() - 1..);
    let completed = completed.clone();
    let tail = futures_util::stream::once(async move {
        release.wait().await;
        let _ = completed.set(Instant::now());
        Ok::<_, std::convert::Infallible>(last)
    });
    reqwest::Body::wrap_stream(futures_util::stream::iter([Ok(head)]).chain(tail))
}

/// Sends and times one request; returns when it was sent: just before the POST, or when a
/// prestaged request's last byte went (for one that ended before, its planned instant).
async fn send_timed(
    client: &reqwest::Client,
    url: &str,
    body: bytes::Bytes,
    headers: &[(&str, &str)],
    release: Option<Release>,
) -> (Timing, Instant) {
    let planned = release.as_ref().map(Release::at);
    // An empty body has no last byte to hold back: it waits for its time and goes whole.
    let release = match release {
        Some(r) if body.is_empty() => {
            r.wait().await;
            None
        }
        other => other,
    };
    let attempt = Instant::now();
    let completed = Arc::new(OnceLock::new());
    let t = exchange(client, url, body, headers, release, attempt, &completed).await;
    let sent = completed
        .get()
        .copied()
        .unwrap_or_else(|| planned.map_or(attempt, |at| at.max(attempt)));
    (t, sent)
}

async fn exchange(
    client: &reqwest::Client,
    url: &str,
    body: bytes::Bytes,
    headers: &[(&str, &str)],
    release: Option<Release>,
    attempt: Instant,
    completed: &Arc<OnceLock<Instant>>,
) -> Timing {
    let mut t = Timing {
        target: url.to_owned(),
        ..Timing::default()
    };
    // A streamed body is sent with its length (not chunked), as a whole one is.
    let mut req = client
        .post(url)
        .header(reqwest::header::CONTENT_TYPE, "application/json")
        .header(reqwest::header::CONTENT_LENGTH, body.len())
        .body(request_body(body, release, completed));
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    // The clock starts when the server can hold the whole request: before the POST, or when a
    // prestaged request's last byte went (an early answer, e.g. a refusal, starts it at the POST).
    let start = || completed.get().copied().unwrap_or(attempt);
    let resp = match req.send().await {
        Ok(r) => r,
        Err(e) => {
            t.failure = Some(Failure::Transport(e.to_string()));
            t.e2e = start().elapsed();
            return t;
        }
    };
    let start = start();
    t.status = resp.status().as_u16();
    if !resp.status().is_success() {
        let text = resp.text().await.unwrap_or_default();
        t.failure = Some(Failure::Status(t.status, text.chars().take(300).collect()));
        t.e2e = start.elapsed();
        return t;
    }
    let mut parser = SseParser::new();
    let mut stream = resp.bytes_stream();
    let mut last: Option<Instant> = None;
    let mut messages = 0u64;
    let mut done = false;
    let mut digest = OutputDigest::new();
    let mut events = EventReader::new();
    while let Some(chunk) = stream.next().await {
        let chunk = match chunk {
            Ok(c) => c,
            Err(e) => {
                t.failure.get_or_insert(Failure::Cut(e.to_string()));
                break;
            }
        };
        let now = Instant::now();
        parser.feed(&chunk, |event| {
            if event.is_done() {
                done = true;
                return;
            }
            // The borrowing reader first (this runs for every event of every stream, on the
            // load generator's own cores); an error event or an unusual shape is read whole.
            let info = events.read(&event.data, Some(&mut digest));
            let has_choices = if info.error {
                let Ok(v) = serde_json::from_str::<Value>(&event.data) else {
                    return;
                };
                read_whole_event(&v, &mut t, &mut digest)
            } else {
                if let Some(u) = info.usage {
                    // A field the usage leaves out (read as 0) keeps the count already known.
                    if u.prompt_tokens > 0 {
                        t.prompt_tokens = u.prompt_tokens;
                    }
                    if u.completion_tokens > 0 {
                        t.completion_tokens = u.completion_tokens;
                    }
                }
                info.choices > 0
            };
            if has_choices {
                messages += 1;
                match last {
                    None => t.ttft = Some(now - start),
                    Some(prev) => t.itl.push(now - prev),
                }
                last = Some(now);
            }
        });
    }
    t.e2e = last.map_or_else(|| start.elapsed(), |l| l - start);
    if t.completion_tokens == 0 {
        t.completion_tokens = messages;
    }
    if t.failure.is_none() && !done {
        t.failure = Some(Failure::Cut("ended without [DONE]".into()));
    }
    if t.failure.is_none() {
        t.output = Some(digest.finish());
    }
    t
}

/// [`send_streaming_with`] for a JSON value, without extra headers.
pub async fn send_streaming(client: &reqwest::Client, url: &str, body: &Value) -> Timing {
    let bytes = bytes::Bytes::from(serde_json::to_vec(body).unwrap_or_default());
    send_streaming_with(client, url, bytes, &[]).await
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// Serves `body` as one SSE response to the first connection, then closes it.
    async fn serve_once(body: &'static str) -> String {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}/v1/completions", listener.local_addr().unwrap());
        tokio::spawn(async move {
            let (mut conn, _) = listener.accept().await.unwrap();
            let mut buf = vec![0u8; 4096];
            let _ = conn.read(&mut buf).await;
            let head = format!(
                "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
                body.len()
            );
            conn.write_all(head.as_bytes()).await.unwrap();
            conn.write_all(body.as_bytes()).await.unwrap();
        });
        url
    }

    async fn time(body: &'static str) -> Timing {
        let url = serve_once(body).await;
        let client = reqwest::Client::new();
        send_streaming_with(&client, &url, bytes::Bytes::from_static(b"{}"), &[]).await
    }

    #[tokio::test]
    async fn every_event_with_choices_is_a_message_and_usage_counts_tokens() {
        // A role chunk (counts, as in vLLM's benchmark), a choice whose index is a string (the
        // borrowing reader refuses it; it is read whole and still counts), then usage and [DONE].
        let t = time(concat!(
            "data: {\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"\"}}]}\n\n",
            "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"a\"}}]}\n\n",
            "data: {\"choices\":[{\"index\":\"0\",\"delta\":{\"content\":\"b\"}}]}\n\n",
            // Usage in two parts: a field one leaves out keeps what the other said.
            "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":5,\"completion_tokens\":2}}\n\n",
            "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":5}}\n\n",
            "data: [DONE]\n\n",
        ))
        .await;
        assert!(t.ok(), "{:?}", t.failure);
        assert!(t.ttft.is_some());
        assert_eq!(t.itl.len(), 2);
        assert_eq!((t.prompt_tokens, t.completion_tokens), (5, 2));
        // Both output texts were digested, the refused event's too.
        let mut want = OutputDigest::new();
        want.event("a");
        want.event("b");
        assert_eq!(t.output, Some(want.finish()));
    }

    #[tokio::test]
    async fn an_error_event_fails_the_request_with_its_message() {
        let t = time(concat!(
            "data: {\"choices\":[{\"index\":0,\"text\":\"a\"}]}\n\n",
            "data: {\"error\":{\"message\":\"engine died\",\"code\":500}}\n\n",
            "data: [DONE]\n\n",
        ))
        .await;
        match t.failure {
            Some(Failure::ErrorEvent(e)) => assert!(e.contains("engine died"), "{e}"),
            other => panic!("{other:?}"),
        }
        assert_eq!(t.completion_tokens, 1);
    }

    #[tokio::test(start_paused = true)]
    async fn a_release_waits_for_its_trigger_or_without_one_for_its_instant() {
        let at = tokio::time::Instant::now() + Duration::from_secs(5);
        // Fired early: it goes at the trigger, not at the instant.
        let (release, trigger) = Release::new(at.into_std());
        trigger.fire();
        release.wait().await;
        assert!(tokio::time::Instant::now() < at);
        // Its trigger alive: it waits for the trigger, however long after the instant.
        let (release, trigger) = Release::new(at.into_std());
        let waiting = tokio::spawn(release.wait());
        tokio::time::sleep(Duration::from_secs(10)).await;
        assert!(
            !waiting.is_finished(),
            "went at its instant, not at its trigger"
        );
        trigger.fire();
        waiting.await.unwrap();
        // Its trigger dropped unfired: it still waits for the instant.
        let at = tokio::time::Instant::now() + Duration::from_secs(5);
        let (release, trigger) = Release::new(at.into_std());
        drop(trigger);
        release.wait().await;
        assert!(tokio::time::Instant::now() >= at);
    }

    /// Reads from `conn` into `got` until the body after the head holds `want` bytes; returns the
    /// head's length.
    async fn read_until_body(
        conn: &mut tokio::net::TcpStream,
        got: &mut Vec<u8>,
        want: usize,
    ) -> usize {
        let mut buf = [0u8; 4096];
        loop {
            if let Some(h) = got.windows(4).position(|w| w == b"\r\n\r\n") {
                if got.len() - (h + 4) >= want {
                    return h + 4;
                }
            }
            let k = conn.read(&mut buf).await.unwrap();
            assert!(k > 0, "connection closed early");
            got.extend_from_slice(&buf[..k]);
        }
    }

    #[tokio::test]
    async fn a_prestaged_request_is_complete_only_at_its_time_and_timed_from_its_last_byte() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}/v1/completions", listener.local_addr().unwrap());
        let body = bytes::Bytes::from_static(b"{\"prompt\":\"hello\",\"stream\":true}");
        let n = body.len();
        // The wait is long against the machine's noise: a clock started at the POST would show it.
        let wait = Duration::from_millis(500);
        let complete_at = Instant::now() + wait;
        let server = tokio::spawn(async move {
            let (mut conn, _) = listener.accept().await.unwrap();
            let mut got = Vec::new();
            let head_len = read_until_body(&mut conn, &mut got, n - 1).await;
            let head_at = Instant::now();
            read_until_body(&mut conn, &mut got, n).await;
            let last_at = Instant::now();
            let sse = "data: {\"choices\":[{\"index\":0,\"text\":\"a\"}]}\n\ndata: [DONE]\n\n";
            let answer = format!(
                "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{sse}",
                sse.len()
            );
            conn.write_all(answer.as_bytes()).await.unwrap();
            let head = String::from_utf8_lossy(&got[..head_len]).to_lowercase();
            (head, got[head_len..].to_vec(), head_at, last_at)
        });
        let client = reqwest::Client::new();
        let (release, trigger) = Release::new(complete_at);
        let fire = std::thread::spawn(move || {
            std::thread::sleep(trigger.at().saturating_duration_since(Instant::now()));
            trigger.fire();
        });
        let (t, sent) = send_streaming_at(&client, &url, body.clone(), &[], release).await;
        fire.join().unwrap();
        let (head, received, head_at, last_at) = server.await.unwrap();
        assert!(t.ok(), "{:?}", t.failure);
        assert_eq!(received, body, "the body arrives whole");
        assert!(head.contains(&format!("content-length: {n}")), "{head}");
        assert!(!head.contains("transfer-encoding"), "{head}");
        assert!(head_at < complete_at, "all but the last byte went ahead");
        assert!(
            sent >= complete_at && last_at >= complete_at,
            "the last byte waited"
        );
        assert!(
            t.ttft.unwrap() < wait && t.e2e < wait,
            "timed from the last byte, not from the POST: {t:?}"
        );
    }
}
