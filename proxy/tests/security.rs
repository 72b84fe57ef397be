//! Client API keys (401 before any engine sees the request, per-key class, per-key rate limit),
//! the headers an engine receives (the client's forwarding claims and the proxy's own inputs are
//! removed unless trusted), TLS on the listener and TLS to replicas verified against a CA.

mod common;

use common::recording_engine as engine;
use headroom_config::serve::{ApiKeyConfig, ServeConfig};
use headroom_proxy::ServeHandle;
use serde_json::{Value, json};
use sha2::{Digest, Sha256};

fn hex_sha256(key: &str) -> String {
    Sha256::digest(key.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

fn key(name: &str, secret: &str, class: Option<&str>, rate: Option<f64>) -> ApiKeyConfig {
    ApiKeyConfig {
        name: name.into(),
        sha256: Some(hex_sha256(secret)),
        env: None,
        class: class.map(str::to_owned),
        rate_per_s: rate,
        burst: rate.map(|_| 2),
    }
}

fn config(url: &str, keys: Vec<ApiKeyConfig>, trust_forwarded: bool) -> ServeConfig {
    let mut cfg = ServeConfig::quick("127.0.0.1:0", &[url.to_owned()], "least_load");
    cfg.admin_listen = "127.0.0.1:0".into();
    cfg.scrape.interval_ms = 0;
    let default = cfg.classes["default"].clone();
    cfg.classes.insert("batch".into(), default);
    cfg.security.api_keys = keys;
    cfg.security.trust_forwarded_headers = trust_forwarded;
    cfg.validated().unwrap()
}

async fn proxy(url: &str, keys: Vec<ApiKeyConfig>, trust_forwarded: bool) -> ServeHandle {
    headroom_proxy::start(config(url, keys, trust_forwarded))
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_removed_by_a_reload_stops_on_connections_opened_before_it() {
    let (url, _seen) = engine().await;
    let mut h = proxy(&url, vec![key("old", "old-secret", None, None)], false).await;
    // One connection, kept alive across the reload (one idle connection in the pool).
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(1)
        .build()
        .unwrap();
    // A completion with a bearer key, on the client's kept-alive connection to `addr`.
    let keyed = |addr: std::net::SocketAddr, secret: &str| {
        client
            .post(format!("http://{addr}/v1/completions"))
            .header("authorization", format!("Bearer {secret}"))
            .json(&json!({"model": "m", "prompt": "hello there", "max_tokens": 1}))
            .send()
    };
    let addr = h.addr;
    let send = |secret: &str| keyed(addr, secret);
    assert_eq!(send("old-secret").await.unwrap().status(), 200);
    let cfg = config(&url, vec![key("new", "new-secret", None, None)], false);
    h.reload(cfg).await.unwrap();
    let r = send("old-secret").await.unwrap();
    assert_eq!(r.status(), 401);
    assert_eq!(r.headers()["x-headroom-error"], "invalid_key");
    assert_eq!(send("new-secret").await.unwrap().status(), 200);
    h.shutdown().await;

    // The other way: keys turned on by a reload strip the key from a request on a connection
    // opened before it, as they do on a new one.
    let (url, seen) = engine().await;
    let mut h = proxy(&url, vec![], false).await;
    let addr = h.addr;
    let send = |secret: &str| keyed(addr, secret);
    assert_eq!(send("engine-key").await.unwrap().status(), 200);
    assert!(
        seen.last().contains_key("authorization"),
        "no keys: passed on"
    );
    h.reload(config(&url, vec![key("k", "k-secret", None, None)], false))
        .await
        .unwrap();
    assert_eq!(send("k-secret").await.unwrap().status(), 200);
    assert!(
        !seen.last().contains_key("authorization"),
        "a proxy key reached the engine"
    );
    h.shutdown().await;
}

async fn complete(h: &ServeHandle, headers: &[(&str, &str)]) -> reqwest::Response {
    let mut req = reqwest::Client::new()
        .post(format!("http://{}/v1/completions", h.addr))
        .json(&json!({"model": "m", "prompt": "hello there", "max_tokens": 1}));
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    req.send().await.unwrap()
}

async fn proxy_metrics(h: &ServeHandle) -> String {
    common::get_text(&format!("http://{}/metrics", h.admin_addr)).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_are_checked_before_any_engine_sees_the_request() {
    let (url, seen) = engine().await;
    let h = proxy(
        &url,
        vec![
            key("chat-app", "chat-secret-1", None, None),
            key("nightly", "batch-secret-2", Some("batch"), Some(0.01)),
        ],
        false,
    )
    .await;

    let r = complete(&h, &[]).await;
    assert_eq!(r.status(), 401);
    assert_eq!(r.headers()["www-authenticate"], "Bearer");
    assert_eq!(r.headers()["x-headroom-error"], "missing_key");
    let r = complete(&h, &[("authorization", "Bearer chat-secret-X")]).await;
    assert_eq!(r.headers()["x-headroom-error"], "invalid_key");
    let body: Value = r.json().await.unwrap();
    assert_eq!(body["error"]["type"], "AuthenticationError");
    // Unknown paths are refused after the key, so they reveal nothing to a keyless client.
    let r = reqwest::get(format!("http://{}/reset_prefix_cache", h.addr))
        .await
        .unwrap();
    assert_eq!(r.status(), 401);
    assert!(seen.requests() == 0, "an engine saw a refused request");
    // Probes stay open, as probes: GET or HEAD without a body; anything else is refused before
    // an engine sees it.
    let r = reqwest::get(format!("http://{}/health", h.addr))
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let probe = |method: reqwest::Method, body: &'static str| {
        reqwest::Client::new()
            .request(method, format!("http://{}/health", h.addr))
            .body(body)
            .send()
    };
    let r = probe(reqwest::Method::HEAD, "").await.unwrap();
    assert_eq!(r.status(), 200);
    let r = probe(reqwest::Method::TRACE, "").await.unwrap();
    assert_eq!(r.status(), 405);
    assert_eq!(r.headers()["allow"], "GET, HEAD");
    // Answered by the proxy itself (its error header), not by an engine.
    for (method, body, status) in [
        (reqwest::Method::POST, "x", 405),
        (reqwest::Method::DELETE, "", 405),
        (reqwest::Method::GET, "body", 400),
    ] {
        let r = probe(method, body).await.unwrap();
        assert_eq!(r.status(), status);
        assert!(r.headers().contains_key("x-headroom-error"));
    }
    // So does a browser's CORS preflight, which carries no key: the engine answers it. An
    // unknown path is still refused first.
    let preflight = |path: &str| {
        reqwest::Client::new()
            .request(reqwest::Method::OPTIONS, format!("http://{}{path}", h.addr))
            .header("origin", "https://app.example")
            .header("access-control-request-method", "POST")
            .send()
    };
    let r = preflight("/v1/completions").await.unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["access-control-allow-origin"], "*");
    assert_eq!(
        preflight("/reset_prefix_cache").await.unwrap().status(),
        401
    );
    // An OPTIONS that is no preflight (here: with a body) needs a key like any request.
    let bare = reqwest::Client::new()
        .request(
            reqwest::Method::OPTIONS,
            format!("http://{}/v1/completions", h.addr),
        )
        .body("{}")
        .header("origin", "https://app.example")
        .header("access-control-request-method", "POST")
        .send()
        .await
        .unwrap();
    assert_eq!(bare.status(), 401);
    assert!(
        seen.requests() == 0,
        "a preflight was counted as generation"
    );

    // A good key: the engine never sees the client's key.
    let r = complete(&h, &[("authorization", "Bearer chat-secret-1")]).await;
    assert_eq!(r.status(), 200);
    let got = seen.last();
    assert!(!got.contains_key("authorization"), "{got:?}");

    // The batch key is batch whatever its header says, and is held to 2 requests at once,
    // then one per 100 s.
    for _ in 0..2 {
        let r = complete(
            &h,
            &[
                ("authorization", "Bearer batch-secret-2"),
                ("x-headroom-class", "default"),
            ],
        )
        .await;
        assert_eq!(r.status(), 200);
    }
    let r = complete(&h, &[("authorization", "Bearer batch-secret-2")]).await;
    assert_eq!(r.status(), 429);
    assert_eq!(r.headers()["x-headroom-error"], "rate_limited");
    let wait: u32 = r.headers()["retry-after"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!(wait > 90, "Retry-After {wait}");
    // The other key is not limited by it.
    let r = complete(&h, &[("authorization", "Bearer chat-secret-1")]).await;
    assert_eq!(r.status(), 200);

    // Each request is recorded once its response has been relayed: wait (bounded) for the last.
    let mut m = proxy_metrics(&h).await;
    for _ in 0..100 {
        if m.contains(
            r#"headroom_slo_requests_total{class="batch",pool="default",result="good"} 2"#,
        ) {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        m = proxy_metrics(&h).await;
    }
    let line = |needle: &str| {
        m.lines()
            .find(|l| l.starts_with(needle))
            .unwrap_or_else(|| panic!("no {needle} in\n{m}"))
            .rsplit(' ')
            .next()
            .unwrap()
            .to_owned()
    };
    assert_eq!(
        line(r#"headroom_key_requests_total{key="nightly",outcome="rate_limited"}"#),
        "1"
    );
    assert_eq!(
        line(r#"headroom_key_requests_total{key="nightly",outcome="accepted"}"#),
        "2"
    );
    assert_eq!(
        line(r#"headroom_slo_requests_total{class="batch",pool="default",result="good"}"#),
        "2"
    );
    // The rate-limited request counts in its key's class; the requests refused for want of a
    // key are of no class and count in none.
    assert_eq!(
        line(r#"headroom_slo_requests_total{class="batch",pool="default",result="failed"}"#),
        "1"
    );
    assert!(
        !m.contains(
            r#"headroom_slo_requests_total{class="default",pool="default",result="failed"}"#
        ),
        "{m}"
    );
    // The keyless request, the unknown path, the preflight of the unknown path, and the
    // OPTIONS with a body.
    assert_eq!(
        line(r#"headroom_proxy_errors_total{reason="missing_key"}"#),
        "4"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engines_never_see_forged_forwarding_headers_or_the_proxys_inputs() {
    let (url, seen) = engine().await;
    let forged = [
        ("x-forwarded-for", "6.6.6.6"),
        ("x-forwarded-host", "evil.example"),
        ("x-forwarded-proto", "https"),
        ("forwarded", "for=6.6.6.6"),
        ("x-real-ip", "6.6.6.6"),
        ("x-headroom-class", "batch"),
        ("authorization", "Bearer client-token"),
        ("x-custom", "kept"),
        // A header the client's `Connection` lists is for the proxy's hop only.
        ("connection", "keep-alive, X-Hop-Only"),
        ("x-hop-only", "this hop"),
    ];
    let h = proxy(&url, Vec::new(), false).await;
    let resp = complete(&h, &forged).await;
    assert_eq!(resp.status(), 200);
    let got = seen.last();
    // The client gets back the id the engine was sent (and the proxy's records name), not one
    // the engine made up.
    assert_eq!(
        resp.headers()["x-request-id"].to_str().unwrap(),
        got["x-request-id"]
    );
    assert_eq!(got["x-forwarded-for"], "127.0.0.1");
    assert_eq!(got["x-forwarded-proto"], "http");
    for gone in [
        "x-forwarded-host",
        "forwarded",
        "x-real-ip",
        "x-headroom-class",
        "x-hop-only",
    ] {
        assert!(
            !got.contains_key(gone),
            "{gone} reached the engine: {got:?}"
        );
    }
    // Without keys the proxy is transparent to the client's own credentials.
    assert_eq!(got["authorization"], "Bearer client-token");
    assert_eq!(got["x-custom"], "kept");
    assert!(got.contains_key("x-request-id"));

    // Behind a trusted load balancer the chain is extended instead.
    let h = proxy(&url, Vec::new(), true).await;
    assert_eq!(complete(&h, &forged).await.status(), 200);
    let got = seen.last();
    assert_eq!(got["x-forwarded-for"], "6.6.6.6, 127.0.0.1");
    assert_eq!(got["x-forwarded-proto"], "https");
    assert_eq!(got["x-real-ip"], "6.6.6.6");
    assert!(!got.contains_key("x-headroom-class"));
}

/// The test-only self-signed certificate for `localhost` and 127.0.0.1 (made with `openssl req
/// -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -days 36500 -subj /CN=localhost
/// -addext subjectAltName=DNS:localhost,IP:127.0.0.1 -addext basicConstraints=critical,CA:FALSE
/// -addext keyUsage=critical,digitalSignature -addext extendedKeyUsage=serverAuth`).
fn fixture(name: &str) -> String {
    format!("{}/tests/fixtures/tls/{name}", env!("CARGO_MANIFEST_DIR"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_tls_listener_serves_https_and_tells_the_engine() {
    use pingora::tls::{ClientConfig, RootCertStore, ServerName, TlsConnector};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    let (url, seen) = engine().await;
    let mut cfg = ServeConfig::quick("127.0.0.1:0", &[url], "least_load");
    cfg.admin_listen = "127.0.0.1:0".into();
    cfg.scrape.interval_ms = 0;
    cfg.tls.cert = Some(fixture("localhost.crt"));
    cfg.tls.key = Some(fixture("localhost.key"));
    let h = headroom_proxy::start(cfg.clone().validated().unwrap())
        .await
        .unwrap();

    pingora::tls::install_default_crypto_provider();
    let mut roots = RootCertStore::empty();
    pingora::tls::load_ca_file_into_store(fixture("localhost.crt"), &mut roots).unwrap();
    let client = ClientConfig::builder()
        .with_root_certificates(roots)
        .with_no_client_auth();
    let tcp = tokio::net::TcpStream::connect(h.addr).await.unwrap();
    let mut tls = TlsConnector::from(std::sync::Arc::new(client))
        .connect(ServerName::try_from("localhost").unwrap(), tcp)
        .await
        .expect("the certificate verifies");
    let body = r#"{"model":"m","prompt":"hello","max_tokens":1}"#;
    let req = format!(
        "POST /v1/completions HTTP/1.1\r\nhost: localhost\r\nconnection: close\r\n\
         content-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    tls.write_all(req.as_bytes()).await.unwrap();
    let mut got = Vec::new();
    let _ = tls.read_to_end(&mut got).await;
    let got = String::from_utf8_lossy(&got);
    assert!(got.starts_with("HTTP/1.1 200"), "{got}");
    assert_eq!(seen.last()["x-forwarded-proto"], "https");

    // Plain HTTP on the TLS port gets no answer from an engine.
    let plain = reqwest::Client::new()
        .post(format!("http://{}/v1/completions", h.addr))
        .body(body)
        .send()
        .await;
    assert!(plain.is_err() || !plain.unwrap().status().is_success());
    assert_eq!(seen.requests(), 1);

    // A key file that is not a key: refused at start, with the reason.
    let mut broken = cfg;
    broken.tls.key = Some(fixture("localhost.crt"));
    let e = headroom_proxy::start(broken.validated().unwrap())
        .await
        .unwrap_err()
        .to_string();
    assert!(e.contains("no private key"), "{e}");
    h.shutdown().await;
}

/// `/stats`' view of the first replica's health.
async fn first_backend_healthy(h: &ServeHandle) -> bool {
    let stats = common::stats(h).await;
    stats["backends"][0]["healthy"].as_bool().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn https_replicas_are_verified_against_the_configured_ca() {
    // An engine behind a TLS front (headroom's own TLS listener, with the localhost certificate).
    let (url, seen) = engine().await;
    let mut front = ServeConfig::quick("127.0.0.1:0", &[url], "least_load");
    front.admin_listen = "127.0.0.1:0".into();
    front.scrape.interval_ms = 0;
    front.tls.cert = Some(fixture("localhost.crt"));
    front.tls.key = Some(fixture("localhost.key"));
    let front = headroom_proxy::start(front.validated().unwrap())
        .await
        .unwrap();
    let replica = format!("https://127.0.0.1:{}", front.addr.port());
    let through = |ca: Option<String>| {
        let mut cfg =
            ServeConfig::quick("127.0.0.1:0", std::slice::from_ref(&replica), "least_load");
        cfg.admin_listen = "127.0.0.1:0".into();
        cfg.scrape.interval_ms = 0;
        cfg.health.interval_ms = 50;
        cfg.upstream_tls.ca = ca;
        async move {
            headroom_proxy::start(cfg.validated().unwrap())
                .await
                .unwrap()
        }
    };

    // Trusting the CA that signed the replica's certificate: served over TLS end to end.
    let trusted = through(Some(fixture("localhost.crt"))).await;
    let resp = complete(&trusted, &[]).await;
    assert_eq!(resp.status(), 200);
    assert_eq!(seen.requests(), 1);
    assert_eq!(seen.last()["x-forwarded-proto"], "https");

    // With only the system's roots the certificate is unknown: the request fails at the proxy
    // (502/503 with no replica left to try; nothing reaches the engine) and the health probes,
    // over the same TLS, fail too.
    let untrusted = through(None).await;
    let resp = complete(&untrusted, &[]).await;
    assert!(
        [502, 503].contains(&resp.status().as_u16()),
        "{}",
        resp.status()
    );
    assert_eq!(seen.requests(), 1);
    let mut flipped = false;
    for _ in 0..200 {
        if !first_backend_healthy(&untrusted).await {
            flipped = true;
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(25)).await;
    }
    assert!(flipped, "the untrusted replica never turned unhealthy");
    assert!(first_backend_healthy(&trusted).await);

    // A CA file that is not one: refused at start, with the reason.
    let mut broken =
        ServeConfig::quick("127.0.0.1:0", std::slice::from_ref(&replica), "least_load");
    broken.admin_listen = "127.0.0.1:0".into();
    broken.upstream_tls.ca = Some(fixture("localhost.key"));
    let e = headroom_proxy::start(broken.validated().unwrap())
        .await
        .unwrap_err()
        .to_string();
    assert!(e.contains("upstream_tls"), "{e}");
    for h in [trusted, untrusted, front] {
        h.shutdown().await;
    }
}
