//! Passive measurement end to end, in-process: the client receives the bytes it would have without
//! headroom, prompts never reach a capture, and a captured trace replays with the structure of the
//! one that produced it. (Agreement with the client is in agreement.rs, a binary of its own, so no
//! other test shares its cores.)

use std::sync::Arc;

use common::{MODEL, options, proxy, read_capture, sim};
use headroom_loadtest::replay::{Counters, run};
use headroom_workload::trace::{TraceRecord, offline_prefix_hit_rate};
use serde_json::{Value, json};

mod common;

/// `"id":"…"` values and `"created":N` numbers replaced: they differ between any two responses.
fn scrub(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    loop {
        let next_id = rest.find("\"id\":\"");
        let next_created = rest.find("\"created\":");
        let (at, is_id) = match (next_id, next_created) {
            (Some(a), Some(b)) if a < b => (a, true),
            (Some(a), None) => (a, true),
            (_, Some(b)) => (b, false),
            (None, None) => break,
        };
        if is_id {
            let start = at + 6;
            out.push_str(&rest[..start]);
            let end = start + rest[start..].find('"').unwrap();
            out.push('X');
            rest = &rest[end..];
        } else {
            let start = at + 10;
            out.push_str(&rest[..start]);
            let digits = rest[start..]
                .find(|c: char| !c.is_ascii_digit())
                .unwrap_or(rest.len() - start);
            out.push('0');
            rest = &rest[start + digits..];
        }
    }
    out.push_str(rest);
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clients_receive_the_bytes_they_would_without_headroom() {
    let r = sim(2, 1, &[]).await;
    let p = proxy(&[r.url()], None).await;
    let c = reqwest::Client::new();
    let chat = |extra: Value| {
        let mut b = json!({"model": MODEL, "messages": [{"role": "user", "content": "tell me"}],
            "max_tokens": 12, "ignore_eos": true, "temperature": 0, "seed": 5});
        b.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        ("/v1/chat/completions", b)
    };
    let completion = |extra: Value| {
        let mut b = json!({"model": MODEL, "prompt": "once upon", "max_tokens": 9, "ignore_eos": true, "seed": 6});
        b.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        ("/v1/completions", b)
    };
    let cases = [
        chat(json!({"stream": true})),
        chat(json!({"stream": true, "stream_options": {"include_usage": true}})),
        chat(json!({"stream": true, "stream_options": {"include_usage": false}})),
        chat(json!({"stream": false})),
        completion(json!({"stream": true})),
        completion(json!({"stream": true, "stream_options": {"include_usage": true}})),
        completion(json!({})),
    ];
    for (path, body) in cases {
        let direct = c
            .post(format!("{}{path}", r.url()))
            .json(&body)
            .send()
            .await
            .unwrap();
        let direct_type = direct.headers()["content-type"].clone();
        let direct = direct.text().await.unwrap();
        let via = c
            .post(format!("http://{}{path}", p.addr))
            .json(&body)
            .send()
            .await
            .unwrap();
        assert_eq!(via.status(), 200);
        assert_eq!(via.headers()["content-type"], direct_type);
        let via = via.text().await.unwrap();
        assert_eq!(scrub(&via), scrub(&direct), "{path} {body}");
    }
    // The proxy counted exact tokens even where the client did not ask for usage: 12 per chat
    // case, 9 per completion.
    let metrics = common::get_text(&format!("http://{}/metrics", p.admin_addr)).await;
    let total: f64 = metrics
        .lines()
        .filter(|l| l.starts_with("headroom_completion_tokens_total{"))
        .map(|l| l.rsplit(' ').next().unwrap().parse::<f64>().unwrap())
        .sum();
    assert_eq!(total, (4 * 12 + 3 * 9) as f64, "{metrics}");
    p.shutdown().await;
    r.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_captured_trace_replays_with_the_structure_that_produced_it() {
    let r = sim(1, 1, &[]).await;
    let scratch = tempfile::tempdir().expect("a scratch directory");
    let dir = scratch.path();
    let first = dir.join("first.jsonl");
    // Conversations whose context grows, sharing system prompts: real prefix structure.
    let original = headroom_loadtest::contracts::synthesize(
        headroom_loadtest::contracts::Contract::Multiturn,
        80,
        40.0,
        11,
    );
    let p = proxy(&[r.url()], Some(&first)).await;
    let results = run(
        original.clone(),
        options(format!("http://{}", p.addr), 11, 0.1),
        Arc::new(Counters::default()),
    )
    .await;
    assert!(results.iter().all(|x| x.timing.ok()));
    assert!(common::flush_finished(&p).await);
    p.shutdown().await;
    let captured = read_capture(&first);
    assert_eq!(captured.len(), original.len());

    let lengths = |t: &[TraceRecord]| {
        let mut v: Vec<(u32, u32)> = t
            .iter()
            .map(|r| (r.input_length, r.output_length))
            .collect();
        v.sort_unstable();
        v
    };
    assert_eq!(lengths(&captured), lengths(&original));
    // The same offline ideal hit rate, at a tight cache and an unbounded one. Arrival order is
    // kept up to the jitter of sending; the ideal depends on order only through which request
    // comes first, so compare on records sorted the same way.
    let order = |t: &[TraceRecord]| {
        let mut v = t.to_vec();
        v.sort_by_key(|r| r.timestamp);
        v
    };
    let (o, c) = (order(&original), order(&captured));
    for cache in [20_000, u64::MAX / 2] {
        let (a, b) = (
            offline_prefix_hit_rate(&o, cache),
            offline_prefix_hit_rate(&c, cache),
        );
        assert!(
            (a - b).abs() < 1e-9,
            "cache {cache}: original {a} captured {b}"
        );
        assert!(a > 0.3, "the trace shares prefixes: {a}");
    }

    // The capture replays unchanged and captures the same structure again.
    let second = dir.join("second.jsonl");
    let p = proxy(&[r.url()], Some(&second)).await;
    let again = run(
        captured.clone(),
        options(format!("http://{}", p.addr), 12, 0.1),
        Arc::new(Counters::default()),
    )
    .await;
    assert!(again.iter().all(|x| x.timing.ok()));
    assert!(common::flush_finished(&p).await);
    p.shutdown().await;
    let recaptured = read_capture(&second);
    assert_eq!(lengths(&recaptured), lengths(&original));
    let rc = order(&recaptured);
    let ideal = |t: &[TraceRecord]| offline_prefix_hit_rate(t, u64::MAX / 2);
    assert!((ideal(&rc) - ideal(&o)).abs() < 1e-9);
    r.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prompt_text_never_reaches_a_capture() {
    const CANARY: &str = "zqxcanary7731";
    let r = sim(1, 1, &[]).await;
    let scratch = tempfile::tempdir().expect("a scratch directory");
    let dir = scratch.path();
    let path = dir.join("t.jsonl");
    let p = proxy(&[r.url()], Some(&path)).await;
    let c = reqwest::Client::new();
    let long: String = (0..40_000).map(|i| format!(" {CANARY}{i}")).collect();
    let bodies = [
        json!({"model": MODEL, "messages": [{"role": "user", "content": CANARY}], "max_tokens": 3}),
        json!({"model": MODEL, "messages": [{"role": "system", "content": CANARY}, {"role": "user", "content": "x"}], "max_tokens": 3, "stream": true}),
        json!({"model": MODEL, "prompt": long, "max_tokens": 2}),
        json!({"model": MODEL, "prompt": format!("{CANARY} "), "max_tokens": 2, "user": "u"}),
        json!({"model": MODEL, "messages": CANARY}),
    ];
    for (i, b) in bodies.iter().enumerate() {
        let path = if b.get("prompt").is_some() {
            "/v1/completions"
        } else {
            "/v1/chat/completions"
        };
        let resp = c
            .post(format!("http://{}{path}", p.addr))
            .header("x-request-id", format!("privacy-{i}"))
            .json(b)
            .send()
            .await
            .unwrap();
        resp.bytes().await.unwrap();
    }
    assert!(common::flush_finished(&p).await);
    let text = std::fs::read_to_string(&path).unwrap();
    assert_eq!(
        text.lines().count(),
        4,
        "the unreadable body has no prompt to record"
    );
    assert!(!text.contains(CANARY) && !text.contains("zqx"), "{text}");
    p.shutdown().await;
    r.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_error_answer_takes_no_ttft() {
    let r = sim(1, 1, &[]).await;
    let scratch = tempfile::tempdir().expect("a scratch directory");
    let path = scratch.path().join("t.jsonl");
    let p = proxy(&[r.url()], Some(&path)).await;
    let c = reqwest::Client::new();
    for (id, fault) in [("ok", ""), ("busy", "error=429"), ("broken", "error=500")] {
        let mut req = c
            .post(format!("http://{}/v1/chat/completions", p.addr))
            .header("x-request-id", id)
            .json(
                &json!({"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                          "max_tokens": 3, "stream": true}),
            );
        if !fault.is_empty() {
            req = req.header("x-headroom-fault", fault);
        }
        req.send().await.unwrap().bytes().await.unwrap();
    }
    assert!(common::flush_finished(&p).await);
    let records = common::read_capture(&path);
    assert_eq!(records.len(), 3);
    for rec in &records {
        let id = rec.request_id.as_deref().unwrap();
        match id {
            "ok" => assert!(rec.ttft_ms.is_some(), "{rec:?}"),
            _ => {
                assert_ne!(rec.status, Some(200), "{rec:?}");
                assert_eq!(rec.ttft_ms, None, "an error answer is no output: {rec:?}");
            }
        }
    }
    let m = common::get_text(&format!("http://{}/metrics", p.admin_addr)).await;
    assert_eq!(
        common::metric_sum(&m, "headroom_request_ttft_seconds_count"),
        1.0,
        "only the answer took a TTFT"
    );
    p.shutdown().await;
    r.shutdown().await.unwrap();
}

/// A client can quote the id its request is known by in the engine's logs, the access log and
/// the capture: every answer carries `x-request-id`, the client's own or the one the proxy made.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_answer_carries_the_request_id_the_capture_names() {
    let r = sim(1, 1, &[]).await;
    let scratch = tempfile::tempdir().expect("a scratch directory");
    let path = scratch.path().join("t.jsonl");
    let p = proxy(&[r.url()], Some(&path)).await;
    let c = reqwest::Client::new();
    let body = json!({"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                      "max_tokens": 3, "stream": true});
    let id_of = |resp: &reqwest::Response| {
        resp.headers()
            .get("x-request-id")
            .map(|v| v.to_str().unwrap().to_owned())
    };
    let url = format!("http://{}/v1/chat/completions", p.addr);
    let own = c
        .post(&url)
        .header("x-request-id", "client-chosen-7")
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(id_of(&own).as_deref(), Some("client-chosen-7"));
    own.bytes().await.unwrap();
    let made = c.post(&url).json(&body).send().await.unwrap();
    let made_id = id_of(&made).expect("an id for a request that came without one");
    assert!(
        made_id.len() == 16 && made_id.bytes().all(|b| b.is_ascii_hexdigit()),
        "{made_id}"
    );
    made.bytes().await.unwrap();
    // The engine's error answer and the proxy's own refusal carry it too.
    let failed = c
        .post(&url)
        .header("x-headroom-fault", "error=500")
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(failed.status(), 500);
    assert!(id_of(&failed).is_some());
    let refused = c
        .post(format!("http://{}/v1/embeddings", p.addr))
        .header("x-request-id", "unserved")
        .send()
        .await
        .unwrap();
    assert_eq!(refused.status(), 404);
    assert_eq!(id_of(&refused).as_deref(), Some("unserved"));
    assert!(common::flush_finished(&p).await);
    let ids: Vec<_> = read_capture(&path)
        .into_iter()
        .filter_map(|rec| rec.request_id)
        .collect();
    assert!(ids.contains(&"client-chosen-7".to_owned()), "{ids:?}");
    assert!(ids.contains(&made_id), "{made_id} in {ids:?}");
    p.shutdown().await;
    r.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_capture_sets_what_routing_expected_cached_beside_what_the_engine_found() {
    let r = sim(1, 1, &["--enable-prompt-tokens-details"]).await;
    let scratch = tempfile::tempdir().expect("a scratch directory");
    let path = scratch.path().join("t.jsonl");
    let p = proxy(&[r.url()], Some(&path)).await;
    let c = reqwest::Client::new();
    let history: String = (0..3_000).map(|i| format!(" turn{i}")).collect();
    let ask = |turn: &str, stream: bool| {
        json!({"model": MODEL, "max_tokens": 2, "stream": stream,
               "messages": [{"role": "user", "content": history}, {"role": "user", "content": turn}]})
    };
    // The same conversation twice, one after the other: the second finds the first's prefix.
    let mut bodies = Vec::new();
    for (id, body) in [("first", ask("a", false)), ("second", ask("b", false))] {
        let resp = c
            .post(format!("http://{}/v1/chat/completions", p.addr))
            .header("x-request-id", id)
            .json(&body)
            .send()
            .await
            .unwrap();
        bodies.push(resp.json::<Value>().await.unwrap());
    }
    // A stream whose client asked for no usage still gets none, though the proxy reads it.
    let streamed = c
        .post(format!("http://{}/v1/chat/completions", p.addr))
        .header("x-request-id", "streamed")
        .json(&ask("c", true))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(!streamed.contains("usage"), "{streamed}");
    assert!(common::flush_finished(&p).await);
    let records = read_capture(&path);
    let by_id = |id: &str| {
        records
            .iter()
            .find(|x| x.request_id.as_deref() == Some(id))
            .unwrap()
    };
    let (first, second, third) = (by_id("first"), by_id("second"), by_id("streamed"));
    assert_eq!(first.cached_tokens, Some(0), "{first:?}");
    assert_eq!(first.predicted_cached_tokens, Some(0), "{first:?}");
    for (rec, body) in [(first, &bodies[0]), (second, &bodies[1])] {
        assert_eq!(
            rec.cached_tokens,
            body["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64(),
            "the record says what the client was told: {body}"
        );
    }
    for rec in [second, third] {
        let (found, expected) = (
            rec.cached_tokens.unwrap(),
            rec.predicted_cached_tokens.unwrap(),
        );
        assert!(found > 1_000 && expected > 1_000, "{rec:?}");
        assert!(found < u64::from(rec.input_length), "{rec:?}");
    }
    p.shutdown().await;
    r.shutdown().await.unwrap();
}
