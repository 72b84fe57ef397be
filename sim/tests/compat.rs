//! Compatibility suite: what a client, a router or a Prometheus scraper sees from a simulated
//! replica, compared with vLLM 0.33's shapes byte for byte (streams, bodies, errors) or name for
//! name (metrics). Replicas bind port 0 and are ready when `start_replica` returns.

use std::time::Duration;

use headroom_sim::{RunningReplica, SimArgs, start_replica};
use headroom_workload::sse::SseParser;
use serde_json::{Value, json};

const MODEL: &str = "sim-model";

async fn replica(extra: &[&str]) -> RunningReplica {
    let mut flags = vec![
        "--served-model-name",
        MODEL,
        "--latency-model",
        "constant",
        "--time-to-first-token",
        "5",
        "--inter-token-latency",
        "1",
        "--max-model-len",
        "4096",
    ];
    flags.extend_from_slice(extra);
    let args = SimArgs::from_flags(flags).expect("valid flags");
    let replica = args.build_replica(0).expect("replica builds");
    start_replica(replica, "127.0.0.1:0".parse().unwrap())
        .await
        .expect("binds")
}

fn client() -> reqwest::Client {
    reqwest::Client::new()
}

async fn post(r: &RunningReplica, path: &str, body: Value) -> reqwest::Response {
    client()
        .post(format!("{}{path}", r.url()))
        .json(&body)
        .send()
        .await
        .unwrap()
}

/// The SSE `data:` payloads of a whole response.
async fn events(resp: reqwest::Response) -> Vec<String> {
    let bytes = resp.bytes().await.unwrap();
    let mut parser = SseParser::new();
    parser
        .feed_collect(&bytes)
        .into_iter()
        .map(|e| e.data)
        .collect()
}

/// A streamed completion of `max_tokens` tokens (`ignore_eos`) asked with the fault `fault`.
async fn streamed_with_fault(
    r: &RunningReplica,
    fault: &str,
    max_tokens: u32,
) -> reqwest::Response {
    client()
        .post(format!("{}/v1/completions", r.url()))
        .header("x-headroom-fault", fault)
        .json(
            &json!({"prompt": "hi", "max_tokens": max_tokens, "stream": true, "ignore_eos": true}),
        )
        .send()
        .await
        .unwrap()
}

/// Reads a streamed body to its end: the bytes, and whether it was cut (a read error) rather
/// than finished.
async fn read_to_end(mut resp: reqwest::Response) -> (String, bool) {
    let mut got = Vec::new();
    let cut = loop {
        match resp.chunk().await {
            Ok(Some(c)) => got.extend_from_slice(&c),
            Ok(None) => break false,
            Err(_) => break true,
        }
    };
    (String::from_utf8(got).unwrap(), cut)
}

/// A streamed request whose client goes away after its first chunk ends as an abort in the
/// engine, which then runs nothing.
async fn disconnect_is_aborted(r: &RunningReplica) {
    let mut resp = post(
        r,
        "/v1/completions",
        json!({"prompt": "hi", "max_tokens": 1000, "stream": true, "ignore_eos": true}),
    )
    .await;
    resp.chunk().await.unwrap();
    drop(resp);
    let mut aborted = 0.0;
    for _ in 0..400 {
        aborted = metric(
            r,
            "vllm:request_success_total{engine=\"0\",finished_reason=\"abort\"",
        )
        .await;
        if aborted > 0.0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(aborted, 1.0);
    assert_eq!(metric(r, "vllm:num_requests_running").await, 0.0);
}

async fn metric(r: &RunningReplica, name: &str) -> f64 {
    let text = client()
        .get(format!("{}/metrics", r.url()))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    text.lines()
        .filter(|l| l.starts_with(name) && l[name.len()..].starts_with(['{', ',', ' ']))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

#[tokio::test]
async fn chat_stream_matches_vllm_chunk_bytes() {
    let r = replica(&[]).await;
    let resp = client()
        .post(format!("{}/v1/chat/completions", r.url()))
        .header("x-request-id", "X")
        .json(&json!({"model": MODEL, "messages": [{"role": "user", "content": "Say hello"}],
            "stream": true, "max_tokens": 3, "ignore_eos": true, "stream_options": {"include_usage": true}}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(
        resp.headers()["content-type"],
        "text/event-stream; charset=utf-8"
    );
    let ev = events(resp).await;
    assert_eq!(ev.len(), 1 + 3 + 1 + 1, "{ev:#?}");
    let created = serde_json::from_str::<Value>(&ev[0]).unwrap()["created"]
        .as_u64()
        .unwrap();
    let head = format!(
        r#"{{"id":"chatcmpl-X","object":"chat.completion.chunk","created":{created},"model":"{MODEL}","choices":["#
    );
    assert_eq!(
        ev[0],
        format!(
            r#"{head}{{"index":0,"delta":{{"role":"assistant","content":""}},"logprobs":null,"finish_reason":null}}],"prompt_token_ids":null,"prompt_text":null}}"#
        )
    );
    let mut text = String::new();
    for (i, e) in ev[1..4].iter().enumerate() {
        let v: Value = serde_json::from_str(e).unwrap();
        let piece = v["choices"][0]["delta"]["content"]
            .as_str()
            .unwrap()
            .to_owned();
        let expected = if i < 2 {
            format!(
                r#"{head}{{"index":0,"delta":{{"content":{}}},"logprobs":null,"finish_reason":null,"token_ids":null}}],"kv_transfer_params":null}}"#,
                json!(piece)
            )
        } else {
            format!(
                r#"{head}{{"index":0,"delta":{{"content":{}}},"logprobs":null,"finish_reason":"length","stop_reason":null,"token_ids":null,"weight_versions":null}}],"kv_transfer_params":null}}"#,
                json!(piece)
            )
        };
        assert_eq!(e, &expected);
        text.push_str(&piece);
    }
    // "Say hello" in the chat template: 6 fixed + 5 per message + 2 content tokens.
    assert_eq!(
        ev[4],
        format!(
            r#"{head}],"usage":{{"prompt_tokens":13,"total_tokens":16,"completion_tokens":3}}}}"#
        )
    );
    assert_eq!(ev[5], "[DONE]");
    assert_eq!(text.split(' ').filter(|w| !w.is_empty()).count(), 3);
}

#[tokio::test]
async fn completion_stream_matches_vllm_and_usage_is_opt_in() {
    let r = replica(&[]).await;
    let ev = events(
        post(
            &r,
            "/v1/completions",
            json!({"model": MODEL, "prompt": "Once upon", "max_tokens": 2, "stream": true}),
        )
        .await,
    )
    .await;
    assert_eq!(ev.len(), 3, "no role chunk and no usage chunk: {ev:#?}");
    let v: Value = serde_json::from_str(&ev[0]).unwrap();
    let id = v["id"].as_str().unwrap();
    assert!(id.starts_with("cmpl-") && id.len() == 5 + 16, "{id}");
    let created = v["created"].as_u64().unwrap();
    let piece = v["choices"][0]["text"].as_str().unwrap();
    assert_eq!(
        ev[0],
        format!(
            r#"{{"id":"{id}","object":"text_completion","created":{created},"model":"{MODEL}","choices":[{{"index":0,"text":{},"logprobs":null,"finish_reason":null,"stop_reason":null,"prompt_token_ids":null,"token_ids":null,"weight_versions":null}}],"kv_transfer_params":null}}"#,
            json!(piece)
        )
    );
    assert!(ev[1].contains(r#""finish_reason":"length","stop_reason":null"#));
    assert_eq!(ev[2], "[DONE]");

    // continuous_usage_stats puts usage on every chunk, but only with include_usage.
    let ev = events(
        post(
            &r,
            "/v1/completions",
            json!({"model": MODEL, "prompt": "Once upon", "max_tokens": 2, "stream": true,
        "stream_options": {"include_usage": true, "continuous_usage_stats": true}}),
        )
        .await,
    )
    .await;
    assert_eq!(ev.len(), 4);
    let usage: Vec<u64> = ev[..3]
        .iter()
        .map(|e| {
            serde_json::from_str::<Value>(e).unwrap()["usage"]["completion_tokens"]
                .as_u64()
                .unwrap()
        })
        .collect();
    assert_eq!(usage, vec![1, 2, 2]);
    // The BOS token counts: "Once upon" is 2 tokens + <|begin_of_text|>.
    assert_eq!(
        serde_json::from_str::<Value>(&ev[2]).unwrap()["usage"]["prompt_tokens"],
        3
    );
}

#[tokio::test]
async fn non_stream_bodies_have_vllm_fields_in_order() {
    let r = replica(&[]).await;
    let resp = post(&r, "/v1/chat/completions", json!({"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_completion_tokens": 4, "ignore_eos": true})).await;
    assert_eq!(resp.status(), 200);
    let text = resp.text().await.unwrap();
    let v: Value = serde_json::from_str(&text).unwrap();
    let keys: Vec<&str> = v.as_object().unwrap().keys().map(String::as_str).collect();
    assert_eq!(
        keys,
        [
            "id",
            "object",
            "created",
            "model",
            "choices",
            "service_tier",
            "system_fingerprint",
            "usage",
            "prompt_logprobs",
            "prompt_token_ids",
            "prompt_text",
            "kv_transfer_params",
            "ec_transfer_params",
            "metrics"
        ]
    );
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    assert_eq!(v["usage"]["completion_tokens"], 4);
    assert!(text.contains(r#""usage":{"prompt_tokens":12,"total_tokens":16,"completion_tokens":4,"prompt_tokens_details":null,"completion_tokens_details":null}"#), "{text}");
    assert!(
        v["system_fingerprint"]
            .as_str()
            .unwrap()
            .starts_with("vllm-0.33.0-")
    );

    // Completions default to 16 output tokens, as vLLM does.
    let v: Value = post(
        &r,
        "/v1/completions",
        json!({"prompt": "Hi", "ignore_eos": true}),
    )
    .await
    .json()
    .await
    .unwrap();
    assert_eq!(v["usage"]["completion_tokens"], 16);
    assert_eq!(v["object"], "text_completion");
}

#[tokio::test]
async fn errors_have_vllm_bodies_and_statuses() {
    let r = replica(&["--max-model-len", "64"]).await;
    let resp = post(
        &r,
        "/v1/chat/completions",
        json!({"model": "nope", "messages": []}),
    )
    .await;
    assert_eq!(resp.status(), 404);
    assert_eq!(
        resp.text().await.unwrap(),
        format!(
            r#"{{"error":{{"message":"The model `nope` does not exist. Valid aliases: {MODEL}.","type":"NotFoundError","param":"model","code":404}}}}"#
        )
    );

    let long = "word ".repeat(100);
    let resp = post(&r, "/v1/completions", json!({"prompt": long})).await;
    assert_eq!(resp.status(), 400);
    let v: Value = resp.json().await.unwrap();
    assert_eq!(
        v["error"]["message"],
        "This model's maximum context length is 64 tokens. However, your prompt contains 102 input tokens, which exceeds this limit even without any output tokens. Please reduce the length of the input prompt."
    );
    assert_eq!(v["error"]["code"], 400);

    let resp = post(
        &r,
        "/v1/completions",
        json!({"prompt": "hi", "max_tokens": 65}),
    )
    .await;
    assert_eq!(resp.status(), 400);
    let v: Value = resp.json().await.unwrap();
    assert_eq!(
        v["error"]["message"],
        "max_tokens=65 cannot be greater than max_model_len=64. Please request fewer output tokens. (parameter=max_tokens)"
    );

    // Over the remaining context: silently clamped.
    let v: Value = post(
        &r,
        "/v1/completions",
        json!({"prompt": "hi", "max_tokens": 64, "ignore_eos": true}),
    )
    .await
    .json()
    .await
    .unwrap();
    assert_eq!(v["usage"]["completion_tokens"], 62);

    let resp = post(
        &r,
        "/v1/completions",
        json!({"prompt": "hi", "stream_options": {"include_usage": true}}),
    )
    .await;
    assert_eq!(resp.status(), 400);
    let v: Value = resp.json().await.unwrap();
    assert_eq!(
        v["error"]["message"],
        "Stream options can only be defined when `stream=True`. (parameter=stream_options)"
    );
    assert_eq!(v["error"]["type"], "BadRequestError");

    let resp = client()
        .post(format!("{}/v1/completions", r.url()))
        .header("content-type", "application/json")
        .body("{\"prompt\":")
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 400);
    let v: Value = resp.json().await.unwrap();
    assert_eq!(v["error"]["type"], "Bad Request");
}

#[tokio::test]
async fn sampling_fields_are_checked_and_scalars_read_as_vllm_reads_them() {
    let r = replica(&[]).await;
    for (field, value) in [
        ("temperature", json!(-1)),
        ("top_p", json!(1.5)),
        ("presence_penalty", json!(5)),
        ("top_logprobs", json!(3)),
    ] {
        let mut body = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2});
        body[field] = value;
        let resp = post(&r, "/v1/chat/completions", body).await;
        assert_eq!(resp.status(), 400, "{field}");
        let v: Value = resp.json().await.unwrap();
        assert_eq!(v["error"]["param"], field);
    }
    // Lax scalars, as pydantic reads them: a numeric string, an integral float, a null stream.
    let resp = post(
        &r,
        "/v1/completions",
        json!({"prompt": "hi", "max_tokens": "3", "temperature": "0", "stream": null, "ignore_eos": true}),
    )
    .await;
    assert_eq!(resp.status(), 200);
    let v: Value = resp.json().await.unwrap();
    assert_eq!(v["usage"]["completion_tokens"], 3);
    // An options object without include_usage asks for usage (vLLM's default is true).
    let resp = post(
        &r,
        "/v1/completions",
        json!({"prompt": "hi", "max_tokens": 2.0, "stream": true, "stream_options": {}}),
    )
    .await;
    let last = events(resp).await;
    assert!(
        last.iter()
            .any(|e| e.starts_with(r#"{"id""#) && e.contains(r#""choices":[],"usage""#)),
        "{last:?}"
    );
    // The probe and the answer to an unknown path.
    let ping = client()
        .post(format!("{}/ping", r.url()))
        .send()
        .await
        .unwrap();
    assert_eq!(ping.status(), 200);
    let missing = client()
        .get(format!("{}/v2/nothing", r.url()))
        .send()
        .await
        .unwrap();
    assert_eq!(missing.status(), 404);
    assert_eq!(missing.text().await.unwrap(), r#"{"detail":"Not Found"}"#);
}

#[tokio::test]
async fn stop_ends_with_an_empty_eos_chunk_and_min_tokens_is_validated() {
    let r = replica(&["--mean-output-tokens", "2"]).await;
    let ev = events(
        post(
            &r,
            "/v1/completions",
            json!({"prompt": "hi", "max_tokens": 500, "stream": true, "seed": 1}),
        )
        .await,
    )
    .await;
    let last: Value = serde_json::from_str(&ev[ev.len() - 2]).unwrap();
    assert_eq!(last["choices"][0]["finish_reason"], "stop");
    assert_eq!(last["choices"][0]["text"], "");
    assert!(ev.len() - 1 < 500, "stopped early: {} chunks", ev.len() - 1);

    let resp = post(
        &r,
        "/v1/completions",
        json!({"prompt": "hi", "max_tokens": 5, "min_tokens": 6}),
    )
    .await;
    assert_eq!(resp.status(), 400);
    let v: Value = resp.json().await.unwrap();
    assert_eq!(
        v["error"]["message"],
        "min_tokens must be less than or equal to max_tokens=5, got 6. (parameter=min_tokens)"
    );
}

#[tokio::test]
async fn queue_cap_counts_only_requests_really_waiting() {
    let r = replica(&[
        "--max-num-seqs",
        "1",
        "--max-num-queued-reqs",
        "1",
        "--time-to-first-token",
        "300",
    ])
    .await;
    let body = json!({"prompt": "hi", "max_tokens": 5, "ignore_eos": true, "stream": true});
    let a = post(&r, "/v1/completions", body.clone()).await;
    assert_eq!(a.status(), 200);
    // Once A is admitted (its first step has begun), nothing waits: the next request is accepted.
    for _ in 0..200 {
        if metric(&r, "vllm:num_requests_running").await == 1.0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(metric(&r, "vllm:num_requests_waiting").await, 0.0);
    let b = post(&r, "/v1/completions", body.clone()).await;
    assert_eq!(b.status(), 200, "an empty queue must not refuse");
    drop((a, b));
}

#[tokio::test]
async fn queue_cap_answers_503_with_vllms_message() {
    let r = replica(&[
        "--max-num-seqs",
        "1",
        "--max-num-queued-reqs",
        "1",
        "--inter-token-latency",
        "50",
    ])
    .await;
    let body = json!({"prompt": "hi", "max_tokens": 20, "ignore_eos": true, "stream": true});
    // One running (its first token seen), one waiting: the third is refused.
    let mut a = post(&r, "/v1/completions", body.clone()).await;
    assert_eq!(a.status(), 200);
    a.chunk().await.unwrap();
    let b = post(&r, "/v1/completions", body.clone()).await;
    assert_eq!(b.status(), 200);
    let mut refused = None;
    for _ in 0..50 {
        let c = post(&r, "/v1/completions", body.clone()).await;
        if c.status() == 503 {
            refused = Some(c);
            break;
        }
        drop(c);
    }
    let v: Value = refused
        .expect("the queue cap refuses")
        .json()
        .await
        .unwrap();
    assert_eq!(
        v["error"]["message"],
        "The engine is currently busy and cannot accept new requests. Please try again later or on a different instance."
    );
    drop((a, b));
}

#[tokio::test]
async fn models_health_version_and_tokenize() {
    let r = replica(&["--model", "/models/llama"]).await;
    let v: Value = client()
        .get(format!("{}/v1/models", r.url()))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(v["object"], "list");
    let card = &v["data"][0];
    let keys: Vec<&str> = card
        .as_object()
        .unwrap()
        .keys()
        .map(String::as_str)
        .collect();
    assert_eq!(
        keys,
        [
            "id",
            "object",
            "created",
            "owned_by",
            "root",
            "parent",
            "max_model_len",
            "permission"
        ]
    );
    assert_eq!(
        (
            card["id"].as_str(),
            card["root"].as_str(),
            card["max_model_len"].as_u64()
        ),
        (Some(MODEL), Some("/models/llama"), Some(4096))
    );

    let health = client()
        .get(format!("{}/health", r.url()))
        .send()
        .await
        .unwrap();
    assert_eq!(health.status(), 200);
    assert!(health.bytes().await.unwrap().is_empty());
    let v: Value = client()
        .get(format!("{}/version", r.url()))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(v, json!({"version": "0.33.0"}));

    let text = post(&r, "/tokenize", json!({"prompt": "Hello world"}))
        .await
        .text()
        .await
        .unwrap();
    let v: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["count"], 3);
    assert_eq!(v["tokens"][0], 128_000);
    assert!(
        text.starts_with(r#"{"count":3,"max_model_len":4096,"tokens":["#)
            && text.ends_with(r#""token_strs":null}"#),
        "{text}"
    );
    let v: Value = post(
        &r,
        "/tokenize",
        json!({"messages": [{"role": "user", "content": "Say hello"}], "return_token_strs": true}),
    )
    .await
    .json()
    .await
    .unwrap();
    assert_eq!(
        v["count"], 13,
        "the same count the chat endpoint reports as prompt_tokens"
    );
    assert_eq!(v["token_strs"][0], "<|begin_of_text|>");
}

#[tokio::test]
async fn metrics_expose_every_vllm_family_by_name() {
    let r = replica(&[]).await;
    post(
        &r,
        "/v1/completions",
        json!({"prompt": "hi", "max_tokens": 3}),
    )
    .await
    .text()
    .await
    .unwrap();
    let resp = client()
        .get(format!("{}/metrics", r.url()))
        .send()
        .await
        .unwrap();
    assert_eq!(
        resp.headers()["content-type"],
        "text/plain; version=0.0.4; charset=utf-8"
    );
    let text = resp.text().await.unwrap();
    for name in [
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "vllm:num_preemptions_total",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:request_success_total",
        "vllm:time_to_first_token_seconds",
        "vllm:inter_token_latency_seconds",
        "vllm:request_time_per_output_token_seconds",
        "vllm:e2e_request_latency_seconds",
        "vllm:request_queue_time_seconds",
        "vllm:request_prefill_time_seconds",
        "vllm:request_decode_time_seconds",
        "vllm:request_inference_time_seconds",
        "vllm:iteration_tokens_total",
        "vllm:request_params_n",
        "vllm:request_params_max_tokens",
        "vllm:request_max_num_generation_tokens",
        "vllm:cache_config_info",
    ] {
        assert!(text.contains(&format!("# TYPE {name} ")), "{name} missing");
    }
    // The request asked for 3 tokens: the max_tokens families count it at 3, in the bucket ≤ 5.
    for name in [
        "vllm:request_params_max_tokens",
        "vllm:request_max_num_generation_tokens",
    ] {
        assert!(
            text.contains(&format!(
                "{name}_sum{{engine=\"0\",model_name=\"{MODEL}\"}} 3"
            )),
            "{name}"
        );
    }
    // A request's time per output token lands in vLLM's fine buckets (1 ms ITL here).
    assert!(text.contains(&format!(
        "vllm:request_time_per_output_token_seconds_bucket{{engine=\"0\",model_name=\"{MODEL}\",le=\"0.01\"}} 1"
    )));
    assert!(text.contains(&format!("vllm:request_success_total{{engine=\"0\",finished_reason=\"length\",model_name=\"{MODEL}\"}} 1")));
    assert!(text.contains("vllm:time_to_first_token_seconds_bucket{engine=\"0\",model_name=\"sim-model\",le=\"0.001\"}"));
    assert_eq!(metric(&r, "vllm:generation_tokens_total").await, 3.0);
}

#[tokio::test]
async fn shared_prefixes_raise_prefix_cache_hits_exactly() {
    let r = replica(&[]).await;
    let system = "You are a careful assistant. ".repeat(20); // 101 tokens
    let ask = |q: &str| json!({"messages": [{"role": "system", "content": system}, {"role": "user", "content": q}], "max_tokens": 1});
    let first = post(&r, "/v1/chat/completions", ask("first question"))
        .await
        .json::<Value>()
        .await
        .unwrap();
    let prompt = first["usage"]["prompt_tokens"].as_u64().unwrap();
    assert_eq!(metric(&r, "vllm:prefix_cache_hits_total").await, 0.0);
    post(&r, "/v1/chat/completions", ask("second question here"))
        .await
        .text()
        .await
        .unwrap();
    // Shared: the template head + system message + the user header up to the first differing
    // token; only full 16-token blocks count.
    let tok = headroom_workload::Tokenizer;
    let render = |q: &str| {
        let m: Vec<headroom_workload::openai::ChatMessage> =
            serde_json::from_value(ask(q)["messages"].clone()).unwrap();
        tok.encode(&headroom_workload::openai::render_chat(&m))
    };
    let (a, b) = (render("first question"), render("second question here"));
    assert_eq!(a.len() as u64, prompt);
    let common = a.iter().zip(&b).take_while(|(x, y)| x == y).count();
    let expected_hit = (common / 16 * 16) as f64;
    assert!(expected_hit >= 96.0);
    assert_eq!(
        metric(&r, "vllm:prefix_cache_hits_total").await,
        expected_hit
    );
    assert_eq!(
        metric(&r, "vllm:prefix_cache_queries_total").await,
        (a.len() + b.len()) as f64
    );
}

#[tokio::test]
async fn small_kv_cache_preempts_under_concurrent_long_prompts_and_all_complete() {
    // 40 usable blocks = 640 tokens; six 200-token prompts decoding 100 tokens each need 1,800.
    let r = replica(&["--num-gpu-blocks", "41", "--max-model-len", "640"]).await;
    let prompt: Vec<u32> = (0..200).collect();
    let mut tasks = Vec::new();
    for i in 0..6u32 {
        let url = format!("{}/v1/completions", r.url());
        let mut p = prompt.clone();
        p[0] = 1000 + i;
        tasks.push(tokio::spawn(async move {
            let body = json!({"prompt": p, "max_tokens": 100, "ignore_eos": true, "stream": true});
            events(client().post(url).json(&body).send().await.unwrap()).await
        }));
    }
    for t in tasks {
        let ev = t.await.unwrap();
        assert_eq!(ev.len(), 101, "100 token chunks and [DONE]");
    }
    assert!(metric(&r, "vllm:num_preemptions_total").await > 0.0);
    assert_eq!(metric(&r, "vllm:generation_tokens_total").await, 600.0);
}

#[tokio::test]
async fn faults_drop_stall_error_and_cold_start() {
    let r = replica(&["--startup-duration", "30"]).await;
    assert_eq!(
        client()
            .get(format!("{}/health", r.url()))
            .send()
            .await
            .unwrap()
            .status(),
        503
    );
    assert_eq!(
        post(&r, "/v1/completions", json!({"prompt": "hi"}))
            .await
            .status(),
        503
    );

    let r = replica(&[]).await;
    let resp = streamed_with_fault(&r, "drop-after=2", 10).await;
    assert_eq!(resp.status(), 200);
    // Exactly two tokens reach the client, then the cut (no [DONE]).
    let (got, cut) = read_to_end(resp).await;
    assert!(cut, "the stream is cut, not finished: {got}");
    assert_eq!(got.matches("\"text\":").count(), 2, "{got}");
    assert!(!got.contains("[DONE]"), "{got}");

    // Two tokens, then the stall: the third waits for it.
    let mut resp = streamed_with_fault(&r, "stall-after=2,stall-ms=3000", 5).await;
    let mut got = Vec::new();
    while let Ok(Some(c)) = tokio::time::timeout(Duration::from_millis(1000), resp.chunk())
        .await
        .map(Result::unwrap)
    {
        got.extend_from_slice(&c);
    }
    let got = String::from_utf8(got).unwrap();
    assert_eq!(got.matches("\"text\":").count(), 2, "{got}");

    let resp = client()
        .post(format!("{}/v1/completions", r.url()))
        .header("X-Return-Error", "429")
        .json(&json!({"prompt": "hi"}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 429);
    let v: Value = resp.json().await.unwrap();
    assert_eq!(v["error"]["code"], 429);

    let resp = client()
        .post(format!("{}/v1/completions", r.url()))
        .header("x-headroom-fault", "explode")
        .json(&json!({"prompt": "hi"}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 400);

    let hung = client()
        .post(format!("{}/v1/completions", r.url()))
        .header("x-headroom-fault", "hang")
        .timeout(Duration::from_millis(300))
        .json(&json!({"prompt": "hi"}))
        .send()
        .await;
    assert!(hung.unwrap_err().is_timeout());
}

#[tokio::test]
async fn client_disconnect_aborts_the_request_in_the_engine() {
    let r = replica(&["--inter-token-latency", "20"]).await;
    // The engine picks the cancellation up at its next step boundary (every 20 ms here).
    disconnect_is_aborted(&r).await;
}

#[tokio::test]
async fn fixed_model_times_every_request_on_its_own_clock() {
    let r = replica(&[
        "--latency-model",
        "fixed",
        "--time-to-first-token",
        "30",
        "--inter-token-latency",
        "5",
    ])
    .await;
    let mut tasks = Vec::new();
    for i in 0..4u32 {
        let url = format!("{}/v1/completions", r.url());
        tasks.push(tokio::spawn(async move {
            // Staggered arrivals: a step-based engine would round them onto shared steps.
            tokio::time::sleep(Duration::from_millis(u64::from(i) * 7)).await;
            let body = json!({"prompt": [1000 + i, 2, 3], "max_tokens": 20, "ignore_eos": true,
                              "stream": true});
            let started = std::time::Instant::now();
            let ev = events(client().post(url).json(&body).send().await.unwrap()).await;
            (ev, started.elapsed())
        }));
    }
    for t in tasks {
        let (ev, took) = t.await.unwrap();
        assert_eq!(ev.len(), 21, "20 token chunks and [DONE]");
        assert!(took >= Duration::from_millis(30 + 19 * 5), "took {took:?}");
    }
    // The engine stamps each token with its own due instant: TTFT and ITL are exact.
    let ttft = metric(&r, "vllm:time_to_first_token_seconds_sum").await
        / metric(&r, "vllm:time_to_first_token_seconds_count").await;
    let itl = metric(&r, "vllm:inter_token_latency_seconds_sum").await
        / metric(&r, "vllm:inter_token_latency_seconds_count").await;
    assert!((ttft - 0.030).abs() < 1e-6, "mean TTFT {ttft}");
    assert!((itl - 0.005).abs() < 1e-6, "mean ITL {itl}");
    assert_eq!(metric(&r, "vllm:generation_tokens_total").await, 80.0);

    // A client that goes away is aborted (the cancellation wakes the engine).
    disconnect_is_aborted(&r).await;
}

#[tokio::test]
async fn a_dropped_stream_delivers_its_tokens_before_the_cut_even_when_the_next_is_ready() {
    // Steps of no time: every token is ready before the stream asks for it, so the cut must not
    // come in the same write as the tokens before it.
    let r = replica(&[
        "--latency-model",
        "constant",
        "--time-to-first-token",
        "0",
        "--inter-token-latency",
        "0",
    ])
    .await;
    for _ in 0..20 {
        let (got, cut) = read_to_end(streamed_with_fault(&r, "drop-after=2", 10).await).await;
        assert!(cut, "the stream is cut, not finished: {got}");
        assert_eq!(got.matches("\"text\":").count(), 2, "{got}");
    }
}
