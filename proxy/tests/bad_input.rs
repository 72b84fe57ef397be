//! The bad inputs a proxy of this kind must survive (docs/reliability.md): oversized or malformed
//! headers, slow clients, unbounded or ambiguous bodies, JSON bombs, a replica that sends a line
//! without end, a client that stops reading. Each is refused or cut off with a clear answer, and
//! refused requests never reach an engine.

mod common;

use std::time::{Duration, Instant};

use common::recording_engine;
use headroom_config::serve::ServeConfig;
use headroom_proxy::ServeHandle;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

async fn proxy(url: &str, tune: impl FnOnce(&mut ServeConfig)) -> ServeHandle {
    let mut cfg = ServeConfig::quick("127.0.0.1:0", &[url.to_owned()], "least_load");
    cfg.admin_listen = "127.0.0.1:0".into();
    cfg.scrape.interval_ms = 0;
    tune(&mut cfg);
    headroom_proxy::start(cfg.validated().unwrap())
        .await
        .unwrap()
}

/// Sends `raw` and reads until the proxy closes the connection or 10 s pass; returns what came
/// back and whether the connection was closed.
async fn exchange(h: &ServeHandle, raw: &[u8]) -> (String, bool) {
    let mut tcp = TcpStream::connect(h.addr).await.unwrap();
    tcp.write_all(raw).await.unwrap();
    read_all(&mut tcp, Duration::from_secs(10)).await
}

async fn read_all(tcp: &mut TcpStream, within: Duration) -> (String, bool) {
    let mut got = Vec::new();
    let mut buf = vec![0u8; 65_536];
    let deadline = tokio::time::Instant::now() + within;
    loop {
        match tokio::time::timeout_at(deadline, tcp.read(&mut buf)).await {
            Ok(Ok(0)) | Ok(Err(_)) => return (String::from_utf8_lossy(&got).into(), true),
            Ok(Ok(n)) => got.extend_from_slice(&buf[..n]),
            Err(_) => return (String::from_utf8_lossy(&got).into(), false),
        }
    }
}

fn status(response: &str) -> u16 {
    response
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no status line in {response:?}"))
}

const BODY: &str = r#"{"model":"m","prompt":"hello","max_tokens":1}"#;

/// A completion request on a connection kept alive after it.
fn keepalive_request(extra_headers: &str, body: &str) -> Vec<u8> {
    format!(
        "POST /v1/completions HTTP/1.1\r\nhost: a\r\n{extra_headers}content-length: {}\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

/// A completion request on a connection the client closes after it.
fn request(extra_headers: &str, body: &str) -> Vec<u8> {
    keepalive_request(&format!("connection: close\r\n{extra_headers}"), body)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_or_oversized_headers_never_reach_an_engine() {
    let (url, seen) = recording_engine().await;
    let h = proxy(&url, |_| {}).await;

    let big = format!("x-big: {}\r\n", "a".repeat(100_000));
    let (r, closed) = exchange(&h, &keepalive_request(&big, BODY)).await;
    assert_eq!(status(&r), 431, "{r}");
    assert!(r.contains("x-headroom-error: headers_too_large"), "{r}");
    assert!(
        closed,
        "the unread body must not be taken as the next request"
    );

    let many: String = (0..120).map(|i| format!("x-h{i}: v\r\n")).collect();
    assert_eq!(status(&exchange(&h, &request(&many, BODY)).await.0), 431);
    // Past pingora's own parser limit (256 fields) the request cannot be read: a 400.
    let too_many: String = (0..300).map(|i| format!("x-h{i}: v\r\n")).collect();
    assert_eq!(
        status(&exchange(&h, &request(&too_many, BODY)).await.0),
        400
    );

    for bad in ["x-a: a\0b\r\n", "x-a: a\rb\r\n", "content-length: 5\r\n"] {
        let (r, closed) = exchange(&h, &request(bad, BODY)).await;
        assert_eq!(status(&r), 400, "{bad:?}: {r}");
        assert!(closed, "{bad:?}");
    }
    // With a large body behind it the answer still arrives: the proxy reads past what the client
    // still sends before it closes, instead of a reset that could destroy the answer unread.
    let (r, closed) = exchange(&h, &request("x-a: a\0b\r\n", &"x".repeat(4 << 20))).await;
    assert_eq!(status(&r), 400, "{r}");
    assert!(closed);
    // An unreadable request is answered as every other refusal is: the OpenAI error shape and
    // the reason, not the HTTP library's bare page.
    let (r, _) = exchange(&h, &request("x-a: a\0b\r\n", BODY)).await;
    assert!(r.contains("x-headroom-error: malformed_header"), "{r}");
    assert!(r.contains(r#""type":"BadRequestError""#), "{r}");
    assert!(!r.to_ascii_lowercase().contains("pingora"), "{r}");
    // A tunnel is never opened: 405, and the connection closed rather than read as a tunnel.
    let (r, closed) = exchange(
        &h,
        b"CONNECT replica.internal:8000 HTTP/1.1\r\nhost: replica.internal:8000\r\n\r\n",
    )
    .await;
    assert_eq!(status(&r), 405, "{r}");
    assert!(closed, "{r}");
    assert!(r.contains("x-headroom-error: method_not_allowed"), "{r}");
    assert!(r.contains("x-request-id: "), "{r}");
    assert!(
        r.to_ascii_lowercase()
            .contains("allow: get, head, post, options"),
        "{r}"
    );
    assert_eq!(seen.requests(), 0, "an engine saw a refused request");
    let m = common::get_text(&format!("http://{}/metrics", h.admin_addr)).await;
    assert!(
        m.contains(r#"headroom_proxy_errors_total{reason="method_not_allowed"} 1"#),
        "{m}"
    );
    // Every unreadable request above counted as a refusal of an unknown route.
    let malformed = common::metric(
        &m,
        r#"headroom_proxy_errors_total{reason="malformed_header"}"#,
    );
    assert!(malformed >= 4.0, "{m}");
    assert!(
        m.contains(r#"headroom_requests_total{backend="none",route="unknown",status="405"} 1"#),
        "{m}"
    );

    // Framed two ways: read as chunked (RFC 9112 §6.3), and the connection closed after it, so
    // the request smuggled behind the chunked body is never served.
    let smuggle = format!(
        "POST /v1/completions HTTP/1.1\r\nhost: a\r\ncontent-length: 5\r\n\
         transfer-encoding: chunked\r\n\r\n{:x}\r\n{BODY}\r\n0\r\n\r\n\
         GET /v1/models HTTP/1.1\r\nhost: a\r\n\r\n",
        BODY.len()
    );
    let (r, closed) = exchange(&h, smuggle.as_bytes()).await;
    assert_eq!(status(&r), 200, "{r}");
    assert!(closed);
    assert_eq!(
        r.matches("HTTP/1.1").count(),
        1,
        "a smuggled request was served: {r}"
    );
    assert_eq!(seen.requests(), 1);
    // The proxy still serves.
    assert_eq!(status(&exchange(&h, &request("", BODY)).await.0), 200);
    assert_eq!(seen.requests(), 2);
}

/// The proxy speaks HTTP/1.x (docs/proxy.md#clients): an HTTP/2 client gets a 400 and a closed
/// connection, never a hang, and a request that offers an upgrade to h2c is answered over HTTP/1.1.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_http2_client_is_refused_and_an_h2c_upgrade_is_declined() {
    let (url, seen) = recording_engine().await;
    let h = proxy(&url, |_| {}).await;
    let (r, closed) = exchange(&h, b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n").await;
    assert_eq!(status(&r), 400, "{r}");
    assert!(r.contains("must use HTTP/1.1"), "{r}");
    assert!(closed, "{r}");
    assert_eq!(seen.requests(), 0);

    let offer = "upgrade: h2c\r\nconnection: Upgrade, HTTP2-Settings, close\r\nhttp2-settings: AAMAAABkAAQCAAAAAAIAAAAA\r\n";
    let (r, _) = exchange(&h, &keepalive_request(offer, BODY)).await;
    assert!(r.starts_with("HTTP/1.1 200"), "{r}");
    assert!(!r.to_ascii_lowercase().contains("upgrade"), "{r}");
    let got = seen.last();
    for gone in ["upgrade", "http2-settings"] {
        assert!(
            !got.contains_key(gone),
            "{gone} reached the engine: {got:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bodies_are_bounded_framed_once_and_json() {
    let (url, seen) = recording_engine().await;
    let h = proxy(&url, |c| c.limits.max_body_bytes = 4096).await;

    // A chunked body is counted as it arrives: refused at the limit, not after reading it all.
    let mut tcp = TcpStream::connect(h.addr).await.unwrap();
    tcp.write_all(
        b"POST /v1/completions HTTP/1.1\r\nhost: a\r\ntransfer-encoding: chunked\r\n\r\n",
    )
    .await
    .unwrap();
    let chunk = format!("400\r\n{}\r\n", "x".repeat(1024));
    for _ in 0..5 {
        tcp.write_all(chunk.as_bytes()).await.unwrap();
    }
    let (r, _) = read_all(&mut tcp, Duration::from_secs(10)).await;
    assert_eq!(status(&r), 413, "{r}");
    // A client that sends its whole body before reading still gets the 413, not a reset while it
    // writes: the proxy reads past the rest before it closes.
    let big = "x".repeat(4 << 20);
    let (r, closed) = exchange(&h, &request("", &big)).await;
    assert_eq!(status(&r), 413, "{r}");
    assert!(closed);

    let bad_chunk = b"POST /v1/completions HTTP/1.1\r\nhost: a\r\nconnection: close\r\n\
                      transfer-encoding: chunked\r\n\r\n\
                      zz\r\nhello\r\n0\r\n\r\n";
    assert_eq!(status(&exchange(&h, bad_chunk).await.0), 400);
    // On a connection kept alive, what follows a body framed wrongly is never read as the next
    // request: the connection is closed after the 400.
    let desync = b"POST /v1/completions HTTP/1.1\r\nhost: a\r\ntransfer-encoding: chunked\r\n\r\n\
                   5\r\nhelloXX0\r\n\r\nGET /v1/models HTTP/1.1\r\nhost: a\r\n\r\n";
    let (r, closed) = exchange(&h, desync).await;
    assert_eq!(status(&r), 400, "{r}");
    assert!(closed, "the connection outlived a body framed wrongly: {r}");
    assert_eq!(
        r.matches("HTTP/1.1").count(),
        1,
        "bytes after the body were served: {r}"
    );

    let bomb = format!(r#"{{"prompt": {}1{}}}"#, "[".repeat(1500), "]".repeat(1500));
    let (r, _) = exchange(&h, &request("", &bomb)).await;
    assert_eq!(status(&r), 400, "{r}");
    assert!(r.contains("x-headroom-error: bad_request"), "{r}");
    assert!(r.contains("not JSON"), "{r}");
    assert_eq!(
        status(&exchange(&h, &request("", "{\"prompt\": ")).await.0),
        400
    );
    assert_eq!(seen.requests(), 0, "an engine saw a refused request");

    // JSON the proxy cannot read as a request is still the engine's to judge.
    let (r, _) = exchange(&h, &request("", r#"{"prompt": {"odd": 1}}"#)).await;
    assert_eq!(status(&r), 200, "{r}");
    assert_eq!(seen.requests(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_clients_are_cut_off_without_slowing_others() {
    let (url, seen) = recording_engine().await;
    let h = proxy(&url, |c| {
        c.timeouts.header_read_ms = 1500;
        c.timeouts.body_read_ms = 1500;
    })
    .await;

    // Twenty slowloris connections, each trickling its header; half open with empty lines, which
    // a parser skips and which are no end of a header.
    let mut slow = Vec::new();
    for i in 0..20 {
        let mut tcp = TcpStream::connect(h.addr).await.unwrap();
        let lead: &[u8] = if i % 2 == 0 { b"" } else { b"\r\n\r\n" };
        tcp.write_all(&[lead, b"POST /v1/completions HTTP/1.1\r\nhost: a\r\n"].concat())
            .await
            .unwrap();
        slow.push(tcp);
    }
    // Meanwhile a real request is answered, well before the slow ones' deadline.
    let t = Instant::now();
    assert_eq!(status(&exchange(&h, &request("", BODY)).await.0), 200);
    assert!(
        t.elapsed() < Duration::from_millis(1000),
        "{:?}",
        t.elapsed()
    );
    for tcp in &mut slow {
        let _ = tcp.write_all(b"x-a: 1\r\n").await;
        let (r, closed) = read_all(tcp, Duration::from_secs(5)).await;
        assert!(closed && r.is_empty(), "slowloris kept open: {r:?}");
    }
    let m = common::get_text(&format!("http://{}/metrics", h.admin_addr)).await;
    assert_eq!(
        common::metric(&m, "headroom_slow_header_connections_closed_total"),
        20.0
    );

    // A request in three pieces, each well within the limit: the header cut in two, its end with
    // most of the body, the body's last bytes; what was read before the connection was handed on
    // reaches the engine whole.
    let raw = request("", BODY);
    let mut tcp = TcpStream::connect(h.addr).await.unwrap();
    for piece in [&raw[..20], &raw[20..raw.len() - 10], &raw[raw.len() - 10..]] {
        tcp.write_all(piece).await.unwrap();
        tcp.flush().await.unwrap();
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let (r, _) = read_all(&mut tcp, Duration::from_secs(5)).await;
    assert_eq!(status(&r), 200, "{r}");
    assert_eq!(seen.requests(), 2);

    // Lines ended by a bare LF, which the parser accepts: the header's end is seen, not waited
    // out to the deadline.
    let raw = String::from_utf8(request("", BODY))
        .unwrap()
        .replace("\r\n", "\n");
    let (r, _) = exchange(&h, raw.as_bytes()).await;
    assert_eq!(status(&r), 200, "{r}");
    assert_eq!(seen.requests(), 3);

    // A body that stalls halfway: 408.
    let mut tcp = TcpStream::connect(h.addr).await.unwrap();
    tcp.write_all(b"POST /v1/completions HTTP/1.1\r\nhost: a\r\ncontent-length: 100\r\n\r\n{")
        .await
        .unwrap();
    let (r, closed) = read_all(&mut tcp, Duration::from_secs(5)).await;
    assert_eq!(status(&r), 408, "{r}");
    assert!(r.contains("body_timeout"), "{r}");
    assert!(closed);
    assert_eq!(
        seen.requests(),
        3,
        "only the real requests reached the engine"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_first_header_past_the_size_read_up_front_is_still_held_to_its_deadline() {
    let (url, seen) = recording_engine().await;
    let h = proxy(&url, |c| {
        c.timeouts.header_read_ms = 300;
        c.limits.max_header_bytes = 1024;
    })
    .await;
    // More header than the accept loop reads before handing the connection on (the size limit
    // and 8 KiB), with no end, then nothing: cut at the header's deadline like any slow header,
    // instead of waiting as long as the parser's own limit lets a client trickle.
    let mut tcp = TcpStream::connect(h.addr).await.unwrap();
    let mut header = b"POST /v1/completions HTTP/1.1\r\nhost: a\r\nx-pad: ".to_vec();
    header.resize(16 << 10, b'a');
    tcp.write_all(&header).await.unwrap();
    let t = Instant::now();
    let (r, closed) = read_all(&mut tcp, Duration::from_secs(5)).await;
    assert!(
        closed,
        "a header without end held the connection open: {r:?}"
    );
    assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
    let m = common::get_text(&format!("http://{}/metrics", h.admin_addr)).await;
    assert_eq!(
        common::metric(&m, "headroom_slow_header_connections_closed_total"),
        1.0
    );
    assert_eq!(seen.requests(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_sends_requests_and_reads_no_answers_is_dropped() {
    let (url, _seen) = recording_engine().await;
    let h = proxy(&url, |c| c.timeouts.client_write_ms = 300).await;
    // Requests the proxy answers itself (404), pipelined without end, never read: once the
    // socket buffers are full the next answer's header cannot be written, and that write is
    // bounded like a body's. HEAD requests, so that every answer is a header alone and the write
    // that stalls is always a header's.
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.set_recv_buffer_size(4096).unwrap();
    let tcp = socket.connect(h.addr).await.unwrap();
    let (reader, mut writer) = tcp.into_split();
    // Nothing is read, and the write side stays open (closed, it would end the connection by
    // itself): the client writes until the proxy drops the connection, which resets it under a
    // write it can no longer take. However slowly the machine fills the buffers, only the drop
    // ends the writing; the bound is for a proxy that never drops it.
    let one = b"HEAD /nope HTTP/1.1\r\nhost: a\r\n\r\n";
    let dropped = tokio::time::timeout(Duration::from_secs(60), async {
        while writer.write_all(one).await.is_ok() {}
    })
    .await;
    assert!(
        dropped.is_ok(),
        "the proxy kept a client that reads nothing"
    );
    drop((reader, writer));
    let m = common::get_text(&format!("http://{}/metrics", h.admin_addr)).await;
    assert_eq!(common::metric(&m, "headroom_open_requests"), 0.0, "{m}");
}

/// The header a simulated replica needs on a request body.
const JSON: &str = "content-type: application/json\r\n";

/// Reads one response on a kept-alive connection: up to the end of its chunked body, or 10 s.
async fn read_response(tcp: &mut TcpStream) -> String {
    let mut got = Vec::new();
    let mut buf = vec![0u8; 65_536];
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while !got.ends_with(b"\r\n0\r\n\r\n") {
        match tokio::time::timeout_at(deadline, tcp.read(&mut buf)).await {
            Ok(Ok(n)) if n > 0 => got.extend_from_slice(&buf[..n]),
            _ => break,
        }
    }
    String::from_utf8_lossy(&got).into()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kept_alive_connections_are_held_to_the_header_deadline_and_an_idle_limit() {
    // 40 tokens 20 ms apart: a stream longer than both limits.
    let replica = common::sim(5, 20, &[]).await;
    let h = proxy(&replica.url(), |c| {
        c.timeouts.header_read_ms = 300;
        c.timeouts.keepalive_ms = 400;
    })
    .await;
    let stream = r#"{"prompt":"hello","max_tokens":40,"ignore_eos":true,"stream":true}"#;
    let mut tcp = TcpStream::connect(h.addr).await.unwrap();
    // Neither limit cuts a request in progress, nor the next one sent at once.
    for _ in 0..2 {
        tcp.write_all(&keepalive_request(JSON, stream))
            .await
            .unwrap();
        let t = Instant::now();
        let r = read_response(&mut tcp).await;
        assert_eq!(status(&r), 200, "{r}");
        assert!(r.contains("data: [DONE]"), "{r}");
        assert!(
            t.elapsed() > Duration::from_millis(600),
            "{:?}",
            t.elapsed()
        );
    }
    // Idle past the keep-alive limit: closed, quietly.
    let (r, closed) = read_all(&mut tcp, Duration::from_secs(5)).await;
    assert!(closed && r.is_empty(), "{r:?}");

    // The second request's header trickles: closed past the header deadline, and counted.
    let mut tcp = TcpStream::connect(h.addr).await.unwrap();
    let one = r#"{"prompt":"hello","max_tokens":1}"#;
    tcp.write_all(&keepalive_request(JSON, one)).await.unwrap();
    let r = read_response_whole(&mut tcp).await;
    assert_eq!(status(&r), 200, "{r}");
    // Empty lines first (a parser skips them): they do not end the header's clock.
    tcp.write_all(b"\r\n\r\nPOST /v1/completions HTTP/1.1\r\n")
        .await
        .unwrap();
    let mut cut = false;
    for _ in 0..20 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        if tcp.write_all(b"x-a: 1\r\n").await.is_err() {
            cut = true;
            break;
        }
        let mut one = [0u8; 1];
        if let Ok(Ok(0) | Err(_)) =
            tokio::time::timeout(Duration::from_millis(1), tcp.read(&mut one)).await
        {
            cut = true;
            break;
        }
    }
    assert!(cut, "a trickled second header was not cut within 2 s");
    let m = common::get_text(&format!("http://{}/metrics", h.admin_addr)).await;
    assert_eq!(
        common::metric(&m, "headroom_slow_header_connections_closed_total"),
        1.0
    );

    // An admin connection is closed at keepalive_ms, whatever it does (here: nothing).
    let mut admin = TcpStream::connect(h.admin_addr).await.unwrap();
    let t = Instant::now();
    let (r, closed) = read_all(&mut admin, Duration::from_secs(5)).await;
    assert!(closed && r.is_empty(), "{r:?}");
    assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());

    // A request refused before its body was read closes its connection, and says so.
    let mut tcp = TcpStream::connect(h.addr).await.unwrap();
    tcp.write_all(b"POST /v2/nothing HTTP/1.1\r\nhost: a\r\ncontent-length: 5\r\n\r\nhello")
        .await
        .unwrap();
    let (r, closed) = read_all(&mut tcp, Duration::from_secs(5)).await;
    assert_eq!(status(&r), 404, "{r}");
    assert!(r.to_ascii_lowercase().contains("connection: close"), "{r}");
    assert!(closed);
    h.shutdown().await;
}

/// Reads one whole (content-length) response on a kept-alive connection.
async fn read_response_whole(tcp: &mut TcpStream) -> String {
    let mut got = Vec::new();
    let mut buf = vec![0u8; 65_536];
    loop {
        let n = tokio::time::timeout(Duration::from_secs(10), tcp.read(&mut buf))
            .await
            .unwrap()
            .unwrap();
        got.extend_from_slice(&buf[..n]);
        let text = String::from_utf8_lossy(&got).to_string();
        if let Some((head, body)) = text.split_once("\r\n\r\n") {
            let len = head.lines().find_map(|l| {
                l.to_ascii_lowercase()
                    .strip_prefix("content-length: ")
                    .map(|v| v.trim().parse::<usize>().unwrap())
            });
            if len.is_some_and(|l| body.len() >= l) || n == 0 {
                return text;
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_line_without_end_is_capped_and_cut() {
    let (url, seen) = recording_engine().await;
    let h = proxy(&url, |c| c.limits.max_event_bytes = 65_536).await;
    let body = r#"{"model":"m","prompt":"hello","max_tokens":1,"stream":true}"#;
    let (r, closed) = exchange(&h, &request("x-test-mode: endless-line\r\n", body)).await;
    assert_eq!(status(&r), 200, "{}", &r[..r.len().min(300)]);
    assert!(closed);
    assert!(
        r.contains("an event longer than 65536 bytes"),
        "{}",
        &r[r.len().saturating_sub(400)..]
    );
    // The client got the error event, not megabytes of the line, and the engine's stream ended.
    assert!(r.len() < 300_000, "{} bytes relayed", r.len());
    assert!(seen.settled(1).await, "upstream still open");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_stops_reading_is_dropped_and_its_request_cancelled() {
    let (url, seen) = recording_engine().await;
    let h = proxy(&url, |c| c.timeouts.client_write_ms = 300).await;
    let body = r#"{"model":"m","prompt":"hello","max_tokens":1,"stream":true}"#;
    let mut tcp = TcpStream::connect(h.addr).await.unwrap();
    tcp.write_all(&request("x-test-mode: firehose\r\n", body))
        .await
        .unwrap();
    // Never read: the socket buffers fill, the proxy's write stalls, and the stall is bounded.
    assert!(
        seen.settled(1).await,
        "the engine is still streaming to a client that stopped reading"
    );
    let m = common::get_text(&format!("http://{}/metrics", h.admin_addr)).await;
    assert!(
        m.lines()
            .any(|l| l.starts_with("headroom_client_aborts_total") && l.ends_with(" 1")),
        "{m}"
    );
    drop(tcp);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_http10_client_gets_a_stream_it_can_read() {
    let replica = common::sim(2, 1, &[]).await;
    let h = proxy(&replica.url(), |_| {}).await;
    let body = r#"{"model":"meta-llama/Llama-3.1-8B-Instruct","prompt":"hello","max_tokens":5,"stream":true,"ignore_eos":true}"#;
    // HTTP/1.0 knows no chunked coding and no interim responses: the stream ends with the
    // connection, and `Expect: 100-continue` gets no `100 Continue`.
    let raw = format!(
        "POST /v1/completions HTTP/1.0\r\nhost: a\r\nexpect: 100-continue\r\n\
         content-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    let (r, closed) = exchange(&h, raw.as_bytes()).await;
    assert_eq!(status(&r), 200, "{r}");
    assert!(
        closed,
        "a close-delimited body must end with the connection"
    );
    assert!(!r.contains("100 Continue"), "{r}");
    let (head, stream) = r.split_once("\r\n\r\n").unwrap();
    assert!(
        !head.to_ascii_lowercase().contains("transfer-encoding"),
        "{head}"
    );
    // The body is the events themselves, with no chunk-size lines between them.
    assert!(stream.starts_with("data: "), "{stream:?}");
    assert!(stream.ends_with("data: [DONE]\n\n"), "{stream:?}");
    assert!(
        stream
            .split("\n")
            .all(|line| line.is_empty() || line.starts_with("data: ")),
        "{stream:?}"
    );
    assert!(stream.matches("data: ").count() >= 6, "{stream:?}");
}

/// An engine written byte by byte: it answers every generation request with `answer` (then
/// closes the connection when `close`), and every other request with an empty 200.
async fn raw_engine(answer: &'static str, close: bool) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move {
        while let Ok((mut tcp, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut got = Vec::new();
                let mut buf = vec![0u8; 65_536];
                loop {
                    // One whole request: its header, then the body its content-length gives.
                    let Some(end) = got.windows(4).position(|w| w == b"\r\n\r\n") else {
                        match tcp.read(&mut buf).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => got.extend_from_slice(&buf[..n]),
                        }
                        continue;
                    };
                    let head = String::from_utf8_lossy(&got[..end]).to_ascii_lowercase();
                    let length: usize = head
                        .lines()
                        .find_map(|l| l.strip_prefix("content-length:"))
                        .map_or(0, |v| v.trim().parse().unwrap());
                    if got.len() < end + 4 + length {
                        match tcp.read(&mut buf).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => got.extend_from_slice(&buf[..n]),
                        }
                        continue;
                    }
                    got.drain(..end + 4 + length);
                    let post = head.starts_with("post");
                    let reply = if post {
                        answer
                    } else {
                        "HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n"
                    };
                    if tcp.write_all(reply.as_bytes()).await.is_err() || (post && close) {
                        return;
                    }
                }
            });
        }
    });
    url
}

const JSON_ANSWER: &str = r#"{"id":"cmpl-1","object":"text_completion","model":"m","choices":[{"index":0,"text":" ok","finish_reason":"stop"}],"usage":{"prompt_tokens":3,"completion_tokens":1,"total_tokens":4}}"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn interim_answers_from_an_engine_are_read_past() {
    let answer: &'static str = Box::leak(
        format!(
            "HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nlink: </x>; rel=preload\r\n\r\n\
             HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{JSON_ANSWER}",
            JSON_ANSWER.len()
        )
        .into_boxed_str(),
    );
    let url = raw_engine(answer, false).await;
    let h = proxy(&url, |_| {}).await;
    for _ in 0..2 {
        let (r, _) = exchange(&h, &request("", BODY)).await;
        assert_eq!(status(&r), 200, "{r}");
        assert_eq!(r.matches("HTTP/1.1").count(), 1, "{r}");
        assert!(r.ends_with(r#""total_tokens":4}}"#), "{r}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answer_ended_by_closing_reaches_the_client_framed() {
    // An HTTP/1.0 engine: no length, no chunks, the end of the stream is the end of the answer.
    let url = raw_engine(
        "HTTP/1.0 200 OK\r\ncontent-type: text/event-stream\r\n\r\n\
         data: {\"choices\":[{\"index\":0,\"text\":\" ok\",\"finish_reason\":\"stop\"}]}\n\n\
         data: [DONE]\n\n",
        true,
    )
    .await;
    let h = proxy(&url, |_| {}).await;
    let body = r#"{"model":"m","prompt":"hello","max_tokens":1,"stream":true}"#;
    // Two requests on one kept-alive connection: the first answer is chunked, so the client's
    // connection outlives the engine's.
    let mut tcp = TcpStream::connect(h.addr).await.unwrap();
    for round in 0..2 {
        tcp.write_all(&keepalive_request("", body)).await.unwrap();
        let mut got = Vec::new();
        let mut buf = vec![0u8; 65_536];
        while !got.ends_with(b"0\r\n\r\n") {
            let n = tokio::time::timeout(Duration::from_secs(10), tcp.read(&mut buf))
                .await
                .expect("the answer ends")
                .unwrap();
            assert!(
                n > 0,
                "round {round}: closed after {:?}",
                String::from_utf8_lossy(&got)
            );
            got.extend_from_slice(&buf[..n]);
        }
        let r = String::from_utf8_lossy(&got);
        assert!(r.starts_with("HTTP/1.1 200"), "{r}");
        assert!(
            r.to_ascii_lowercase()
                .contains("transfer-encoding: chunked"),
            "{r}"
        );
        assert!(r.contains("data: [DONE]"), "{r}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_json_body_the_engine_cuts_reaches_the_client_cut() {
    // Half a JSON answer, chunked, then the engine closes its connection.
    let url = raw_engine(
        "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n\
         10\r\n{\"id\":\"cmpl-1\",\"\r\n",
        true,
    )
    .await;
    let h = proxy(&url, |_| {}).await;
    let (r, closed) = exchange(&h, &keepalive_request("", BODY)).await;
    assert!(closed, "the connection ends: {r:?}");
    assert_eq!(status(&r), 200, "{r}");
    assert!(r.ends_with("10\r\n{\"id\":\"cmpl-1\",\"\r\n"), "{r:?}");
    // No last chunk: a client sees a cut body, not a whole one.
    assert!(!r.ends_with("0\r\n\r\n"), "{r:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_the_engine_closes_between_events_without_an_end_is_a_cut() {
    // An engine that frames its answer by closing the connection, and closes it after whole
    // events but before a finish reason or `[DONE]`.
    let url = raw_engine(
        "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n\
         data: {\"choices\":[{\"index\":0,\"text\":\" one\",\"finish_reason\":null}]}\n\n\
         data: {\"choices\":[{\"index\":0,\"text\":\" two\",\"finish_reason\":null}]}\n\n",
        true,
    )
    .await;
    let h = proxy(&url, |_| {}).await;
    let body = r#"{"model":"m","prompt":"hello","max_tokens":5,"stream":true}"#;
    let (r, _) = exchange(&h, &request("", body)).await;
    assert_eq!(status(&r), 200, "{r}");
    assert!(r.contains(" two"), "{r}");
    assert!(r.contains("closed the stream before it finished"), "{r}");
    assert!(!r.contains("[DONE]"), "{r}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_framed_by_its_length_and_cut_short_ends_its_connection() {
    // An engine that frames an event stream by its length and closes before the length is in:
    // an error event cannot be added within a length the client already counts on, and a
    // connection left open would read the next response as the rest of this body.
    let url = raw_engine(
        "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncontent-length: 500\r\n\r\n\
         data: {\"choices\":[{\"index\":0,\"text\":\" one\",\"finish_reason\":null}]}\n\n",
        true,
    )
    .await;
    let h = proxy(&url, |_| {}).await;
    let body = r#"{"model":"m","prompt":"hello","max_tokens":5,"stream":true}"#;
    let (r, closed) = exchange(&h, &keepalive_request("", body)).await;
    assert_eq!(status(&r), 200, "{r}");
    assert!(r.contains(" one"), "{r}");
    assert!(
        closed,
        "the connection outlived a body cut short of its length: {r:?}"
    );
    assert!(!r.contains("closed the stream before it finished"), "{r}");
}
