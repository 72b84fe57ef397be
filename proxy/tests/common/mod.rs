//! Helpers shared by the proxy's integration tests (each test binary uses some of them).
#![allow(dead_code)]

use std::time::Duration;

use headroom_config::serve::ServeConfig;
use headroom_loadtest::replay::{Arrivals, ReplayOptions};
use headroom_loadtest::synth::Endpoint;
use headroom_proxy::ServeHandle;
use headroom_sim::{RunningReplica, SimArgs, start_replica};
use headroom_workload::trace::{TraceRecord, read_jsonl};

/// Flags of a simulated replica with constant step times (`ttft_ms` for a step with prefill,
/// `itl_ms` otherwise), room for long prompts, and `extra` flags after those (later flags win).
/// Engine threads stay at normal priority: an unoptimised test build's engine can fall behind its
/// modelled steps and then never sleeps, and a real-time thread that never sleeps starves the
/// proxy, the probes and the client sharing the machine's cores.
pub fn sim_args(ttft_ms: u32, itl_ms: u32, extra: &[&str]) -> SimArgs {
    let (ttft, itl) = (ttft_ms.to_string(), itl_ms.to_string());
    let mut flags = vec![
        "--latency-model",
        "constant",
        "--time-to-first-token",
        &ttft,
        "--inter-token-latency",
        &itl,
        "--max-model-len",
        "200000",
        "--no-realtime-engine",
    ];
    flags.extend_from_slice(extra);
    SimArgs::from_flags(flags).expect("valid simulator flags")
}

/// A simulated replica of [`sim_args`] on port 0.
pub async fn sim(ttft_ms: u32, itl_ms: u32, extra: &[&str]) -> RunningReplica {
    start_replica(
        sim_args(ttft_ms, itl_ms, extra)
            .build_replica(0)
            .expect("a replica"),
        "127.0.0.1:0".parse().expect("an address"),
    )
    .await
    .expect("the replica starts")
}

/// A loopback port bound and never listened on, held for as long as the returned socket lives:
/// connections to it are refused, and no other bind to port 0 takes it meanwhile (a port bound
/// and let go is free for the next one, another test's replica or proxy among them). With
/// `reuse`, a listener that sets address reuse too, as tokio's does, can still bind it by
/// number: a replica that starts there later, or starts again.
pub fn held_port(reuse: bool) -> (socket2::Socket, std::net::SocketAddr) {
    use socket2::{Domain, Socket, Type};
    let s = Socket::new(Domain::IPV4, Type::STREAM, None).expect("a socket");
    s.set_reuse_address(reuse).expect("address reuse");
    s.bind(&std::net::SocketAddr::from(([127, 0, 0, 1], 0)).into())
        .expect("a loopback port");
    let addr = s
        .local_addr()
        .unwrap()
        .as_socket()
        .expect("an IPv4 address");
    (s, addr)
}

/// Polls `cond` every 20 ms for up to 10 s; the state it waits for is reached asynchronously by
/// another process-like component (a replica noticing a closed connection), which offers no event.
pub async fn eventually<F, Fut>(what: &str, mut cond: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    for _ in 0..500 {
        if cond().await {
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("timed out waiting for {what}");
}

/// The value of the unlabelled metric `name` in a Prometheus exposition (NaN when absent).
pub fn metric(exposition: &str, name: &str) -> f64 {
    exposition
        .lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
        .unwrap_or(f64::NAN)
}

/// The sum of every series of the labelled metric `name` (lines `name{…} value`).
pub fn metric_sum(exposition: &str, name: &str) -> f64 {
    let prefix = format!("{name}{{");
    exposition
        .lines()
        .filter(|l| l.starts_with(&prefix))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// The body of `GET url`, as text.
pub async fn get_text(url: &str) -> String {
    reqwest::get(url)
        .await
        .expect("the GET is answered")
        .text()
        .await
        .expect("a text body")
}

/// The proxy's `/stats`.
pub async fn stats(h: &ServeHandle) -> serde_json::Value {
    reqwest::get(format!("http://{}/stats", h.admin_addr))
        .await
        .expect("the GET is answered")
        .json()
        .await
        .expect("a JSON body")
}

/// The model the simulator serves.
pub const MODEL: &str = "meta-llama/Llama-3.1-8B-Instruct";

/// The proxy in front of `urls` (prefix affinity), capturing to `capture` when given.
pub async fn proxy(urls: &[String], capture: Option<&std::path::Path>) -> ServeHandle {
    let mut cfg = ServeConfig::quick("127.0.0.1:0", urls, "prefix_affinity");
    cfg.admin_listen = "127.0.0.1:0".into();
    cfg.health.interval_ms = 200;
    cfg.scrape.interval_ms = 200;
    cfg.capture.path = capture.map(|p| p.display().to_string());
    cfg.capture.id_key = Some("a test key, 16+ chars".into());
    headroom_proxy::start(cfg.validated().unwrap())
        .await
        .unwrap()
}

/// Waits until the proxy has finished every request it took (a client has the whole answer
/// before the proxy records it), then until the capture writer has written every record; false
/// when the writer could not.
pub async fn flush_finished(p: &ServeHandle) -> bool {
    tokio::time::timeout(Duration::from_secs(10), p.lifecycle.all_closed())
        .await
        .expect("the proxy's requests finish");
    p.flush_capture().await
}

/// The records of a capture file.
pub fn read_capture(path: &std::path::Path) -> Vec<TraceRecord> {
    let f = std::fs::File::open(path).unwrap();
    read_jsonl(std::io::BufReader::new(f)).unwrap()
}

/// Replay options for a chat trace at its own timestamps, scaled by `time_scale`.
pub fn options(target: String, seed: u64, time_scale: f64) -> ReplayOptions {
    ReplayOptions {
        targets: vec![target],
        endpoint: Endpoint::Chat,
        model: Some(MODEL.into()),
        arrivals: Arrivals::Trace { time_scale },
        duration: None,
        warmup: 0,
        seed,
        prompt_salt: 0,
        plan: None,
        rows: None,
        timeout: Duration::from_secs(60),
        run_id: format!("m{seed}"),
        headers: Vec::new(),
        prestage: false,
        stop: Default::default(),
    }
}

/// What a [`recording_engine`] saw.
#[derive(Debug, Default)]
pub struct Seen {
    /// The headers of every generation request, in order.
    pub headers: std::sync::Mutex<Vec<std::collections::BTreeMap<String, String>>>,
    /// Streamed responses still being sent.
    pub open_streams: std::sync::atomic::AtomicUsize,
}

impl Seen {
    /// Waits (at most 10 s) until `n` requests arrived and no response stream is still open;
    /// whether that happened.
    pub async fn settled(&self, n: usize) -> bool {
        for _ in 0..1000 {
            let open = self.open_streams.load(std::sync::atomic::Ordering::SeqCst);
            if self.requests() == n && open == 0 {
                return true;
            }
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        false
    }

    /// Generation requests received.
    pub fn requests(&self) -> usize {
        self.headers.lock().unwrap().len()
    }

    /// The headers of the last generation request.
    pub fn last(&self) -> std::collections::BTreeMap<String, String> {
        self.headers
            .lock()
            .unwrap()
            .last()
            .cloned()
            .expect("a request")
    }
}

/// Decrements a counter when the response stream holding it is dropped (sent or cancelled).
struct OpenStream(std::sync::Arc<Seen>);

impl Drop for OpenStream {
    fn drop(&mut self) {
        self.0
            .open_streams
            .fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
    }
}

/// An engine that records every completion request's headers. By its `x-test-mode` header it
/// answers at once (absent; with an `x-request-id` of its own making, `engine-made`), streams one SSE line of `line_bytes` that never ends (`endless-line`),
/// or streams 64 KB events without end (`firehose`).
pub async fn recording_engine() -> (String, std::sync::Arc<Seen>) {
    use axum::http::HeaderMap;
    use axum::response::IntoResponse;
    use axum::routing::{get, options};
    let seen = std::sync::Arc::new(Seen::default());
    let log = seen.clone();
    let app = axum::Router::new()
        .route("/health", get(|| async { "" }))
        .route(
            "/v1/completions",
            // A CORS preflight, answered as vLLM's default middleware answers it.
            options(|| async {
                [
                    ("access-control-allow-origin", "*"),
                    ("access-control-allow-methods", "POST"),
                ]
            })
            .post(move |headers: HeaderMap| {
                let log = log.clone();
                async move {
                    let h = headers
                        .iter()
                        .map(|(k, v)| (k.to_string(), v.to_str().unwrap_or("?").to_owned()))
                        .collect();
                    log.headers.lock().unwrap().push(h);
                    let mode = headers
                        .get("x-test-mode")
                        .and_then(|v| v.to_str().ok())
                        .unwrap_or("")
                        .to_owned();
                    if mode.is_empty() {
                        return (
                            [("x-request-id", "engine-made")],
                            axum::Json(serde_json::json!({
                            "id": "cmpl-1", "object": "text_completion", "model": "m",
                            "choices": [{"index": 0, "text": " ok", "finish_reason": "stop"}],
                            "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}
                            })),
                        )
                            .into_response();
                    }
                    log.open_streams
                        .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    let guard = OpenStream(log.clone());
                    let first: &'static [u8] = if mode == "endless-line" {
                        b"data: {\"x\": \""
                    } else {
                        b""
                    };
                    let piece: bytes::Bytes = if mode == "endless-line" {
                        vec![b'a'; 65_536].into()
                    } else {
                        let mut e = b"data: {\"choices\":[{\"text\":\"".to_vec();
                        e.extend(std::iter::repeat_n(b'b', 65_536));
                        e.extend_from_slice(b"\"}]}\n\n");
                        e.into()
                    };
                    // At most 64 MB, so a test that fails cannot stream forever.
                    let chunks = std::iter::once(bytes::Bytes::from_static(first))
                        .chain(std::iter::repeat_n(piece, 1024))
                        .map(move |c| {
                            let _held = &guard;
                            Ok::<_, std::io::Error>(c)
                        });
                    let body = axum::body::Body::from_stream(futures_util::stream::iter(chunks));
                    ([("content-type", "text/event-stream")], body).into_response()
                }
            }),
        );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await });
    (url, seen)
}

/// Starts a streamed completion of `max_tokens` tokens (`ignore_eos`) at `url`: the replica that
/// serves it (the proxy's `x-headroom-backend` header) and the response, its body still to read.
pub async fn start_stream(
    client: &reqwest::Client,
    url: &str,
    prompt: &str,
    max_tokens: u32,
) -> (String, reqwest::Response) {
    let resp = client
        .post(url)
        .json(&serde_json::json!({"model": MODEL, "prompt": prompt,
            "max_tokens": max_tokens, "ignore_eos": true, "stream": true}))
        .send()
        .await
        .unwrap();
    let backend = resp.headers()["x-headroom-backend"]
        .to_str()
        .unwrap()
        .to_owned();
    (backend, resp)
}
