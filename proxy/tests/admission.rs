//! Admission end to end, in-process: a replica at its cap makes requests wait at the proxy in
//! priority order; a full queue is refused with 429 and a waited-out deadline with 503, both with
//! Retry-After; every permit and queue entry is back to zero at rest.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use headroom_config::serve::{ClassConfig, ServeConfig, SloConfig};
use headroom_proxy::ServeHandle;
use headroom_sim::RunningReplica;

mod common;
use serde_json::json;

async fn sim() -> RunningReplica {
    common::sim(5, 5, &[]).await
}

fn class(priority: i32, max_queue: usize, queue_timeout_ms: u64) -> ClassConfig {
    ClassConfig {
        slo: SloConfig::default(),
        priority,
        max_queue,
        queue_timeout_ms,
        pool: None,
        min_prompt_tokens: None,
        models: Vec::new(),
        paths: Vec::new(),
    }
}

async fn proxy(url: String) -> ServeHandle {
    let mut cfg = ServeConfig::quick("127.0.0.1:0", &[url], "least_load");
    cfg.admin_listen = "127.0.0.1:0".into();
    // A probe that times out on a busy test machine must not take a replica out mid-test.
    cfg.health.unhealthy_after = 1_000;
    cfg.admission.max_in_flight = Some(1);
    // No engine feedback: the cap stays where it is put.
    cfg.scrape.interval_ms = 0;
    cfg.classes = BTreeMap::from([
        ("default".to_owned(), class(0, 2, 30_000)),
        ("interactive".to_owned(), class(10, 8, 30_000)),
        ("impatient".to_owned(), class(0, 8, 50)),
    ]);
    headroom_proxy::start(cfg.validated().unwrap())
        .await
        .unwrap()
}

/// A proxy in front of replicas `a` and `b` (in that order), one slot each, the engines' feedback
/// off so the caps stay at 1, and the rest of its config from `rest`.
async fn two_replicas(a: &str, b: &str, rest: &str) -> ServeHandle {
    let text = format!(
        r#"
listen = "127.0.0.1:0"
admin_listen = "127.0.0.1:0"
[[backends]]
url = "{a}"
name = "a"
[[backends]]
url = "{b}"
name = "b"
[admission]
max_in_flight = 1
max_cap = 1
[scrape]
interval_ms = 0
{rest}"#
    );
    let cfg: ServeConfig =
        headroom_config::parse_toml(&text, std::path::Path::new("two-replicas.toml")).unwrap();
    headroom_proxy::start(cfg).await.unwrap()
}

/// Sends a streamed chat request of `tokens` output tokens as `class`; returns (status,
/// Retry-After, time to the end of the body).
async fn send(
    addr: std::net::SocketAddr,
    class: &str,
    tokens: u32,
) -> (u16, Option<String>, Duration) {
    let t0 = Instant::now();
    let resp = reqwest::Client::new()
        .post(format!("http://{addr}/v1/chat/completions"))
        .header("x-headroom-class", class)
        .json(
            &json!({"messages": [{"role": "user", "content": "go"}], "max_tokens": tokens,
            "ignore_eos": true, "stream": true}),
        )
        .send()
        .await
        .unwrap();
    let status = resp.status().as_u16();
    let retry = resp
        .headers()
        .get("retry-after")
        .map(|v| v.to_str().unwrap().to_owned());
    resp.bytes().await.unwrap();
    (status, retry, t0.elapsed())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_at_its_cap_queues_by_priority_and_refuses_with_retry_after() {
    let r = sim().await;
    let p = proxy(r.url()).await;
    let addr = p.addr;
    let admission = p.admission().unwrap();
    // One long request holds the only slot (25 s) until it is called off below: however slowly
    // the steps between run, the slot stays taken through them.
    let holder = tokio::spawn(send(addr, "default", 5000));
    while admission.slots()[0].1 == 0 {
        tokio::task::yield_now().await;
    }
    // Two default requests queue (the class's bound), a third is refused at once.
    let d1 = tokio::spawn(send(addr, "default", 5));
    let d2 = tokio::spawn(send(addr, "default", 5));
    while admission.queued().get("default").copied().unwrap_or(0) < 2 {
        tokio::task::yield_now().await;
    }
    let (status, retry, _) = send(addr, "default", 5).await;
    assert_eq!(status, 429);
    assert!(retry.unwrap().parse::<u32>().unwrap() >= 1);
    // An interactive request arrives last but is admitted before the two queued ones.
    let interactive = tokio::spawn(send(addr, "interactive", 5));
    while !admission.queued().contains_key("interactive") {
        tokio::task::yield_now().await;
    }
    // An impatient one gives up after 50 ms with a 503.
    let (status, retry, waited) = send(addr, "impatient", 5).await;
    assert_eq!(status, 503);
    assert!(retry.is_some());
    assert!(waited >= Duration::from_millis(50));

    // The holder hangs up: its slot goes to the queue, the interactive request first.
    holder.abort();
    let (si, _, ti) = interactive.await.unwrap();
    let (s1, _, t1) = d1.await.unwrap();
    let (s2, _, t2) = d2.await.unwrap();
    assert_eq!((si, s1, s2), (200, 200, 200));
    assert!(
        ti < t1 && ti < t2,
        "interactive {ti:?}, default {t1:?} {t2:?}"
    );

    // At rest: no permit held, nobody queued, the refusals counted by reason. The proxy releases
    // a permit when it has finished the request (after the client read the last byte), so rest
    // is waited for, within a bound.
    let t0 = std::time::Instant::now();
    while (admission.slots()[0].1 != 0 || p.fleet().backends[0].load().in_flight != 0)
        && t0.elapsed() < Duration::from_secs(5)
    {
        tokio::task::yield_now().await;
    }
    assert_eq!(admission.slots(), vec![(Some(1), 0)]);
    assert!(admission.queued().is_empty());
    let metrics = common::get_text(&format!("http://{}/metrics", p.admin_addr)).await;
    for line in [
        "headroom_admission_refused_total{class=\"default\",pool=\"default\",reason=\"queue_full\"} 1",
        "headroom_admission_refused_total{class=\"impatient\",pool=\"default\",reason=\"queue_timeout\"} 1",
        "headroom_admission_in_flight{backend=",
    ] {
        assert!(metrics.contains(line), "{line}\n{metrics}");
    }
    assert_eq!(p.fleet().backends[0].load().in_flight, 0);
    p.shutdown().await;
    r.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cap_starts_from_the_engines_kv_capacity() {
    let r = common::sim(
        5,
        5,
        &[
            "--num-gpu-blocks",
            "1000",
            "--block-size",
            "16",
            "--max-model-len",
            "4096",
        ],
    )
    .await;
    let mut cfg = ServeConfig::quick("127.0.0.1:0", &[r.url()], "least_load");
    cfg.admin_listen = "127.0.0.1:0".into();
    // A probe that times out on a busy test machine must not take a replica out mid-test.
    cfg.health.unhealthy_after = 1_000;
    cfg.scrape.interval_ms = 50;
    cfg.admission.context_tokens = 1000;
    cfg.admission.token_budget = true;
    cfg.cost.replica_hour = Some(2.0);
    let p = headroom_proxy::start(cfg.validated().unwrap())
        .await
        .unwrap();
    let admission = p.admission().unwrap();
    // ⌊0.9 · 16,000 KV tokens / 1,000⌋ = 14, once the first scrape has read cache_config_info.
    // The scrape runs on its own timer; this polls for its effect (no event to wait on).
    for _ in 0..400 {
        if admission.slots()[0].0.is_some() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(admission.slots()[0].0, Some(14));

    // The cap is the replica's capacity: after a request, the pool's utilisation is known, and
    // with a price per replica-hour, what a million tokens cost at the measured throughput.
    let resp = reqwest::Client::new()
        .post(format!("http://{}/v1/completions", p.addr))
        .json(&json!({"model": common::MODEL, "prompt": "hello", "max_tokens": 8}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    resp.bytes().await.unwrap();
    // The proxy lets the request's tokens go once the client has its last byte: waited for.
    common::eventually("the request's tokens to be let go", || async {
        common::stats(&p).await["backends"][0]["admission"]["tokens_in_flight"] == json!(0)
    })
    .await;
    let stats = common::stats(&p).await;
    // The token budget is 90% of the replica's KV tokens (999 usable blocks of 16: 15,984); the
    // request is done, so nothing is held.
    let adm = &stats["backends"][0]["admission"];
    assert_eq!(
        (adm["token_budget"].clone(), adm["tokens_in_flight"].clone()),
        (json!(14_385), json!(0))
    );
    let pool = &stats["pools"][0];
    assert_eq!(pool["pool"], "default");
    let u = pool["utilisation_since_start"]
        .as_f64()
        .expect("a utilisation");
    assert!(u > 0.0 && u <= 1.0, "{u}");
    let per_million = stats["cost"]["per_million_tokens"]
        .as_f64()
        .expect("a cost");
    assert!(per_million > 0.0, "{}", stats["cost"]);
    let m = common::get_text(&format!("http://{}/metrics", p.admin_addr)).await;
    assert!(common::metric_sum(&m, "headroom_backend_capacity_seconds_total") > 0.0);
    assert!(common::metric_sum(&m, "headroom_backend_capped_in_flight_seconds_total") > 0.0);
    assert_eq!(common::metric_sum(&m, "headroom_backend_pool"), 1.0);
    assert!(common::metric_sum(&m, "headroom_cost_per_million_tokens") > 0.0);

    // The requests are shorter than the 1,000 tokens planned for: once 32 have finished, the plan
    // is made for their mean context, and the cap follows it at the next scrape.
    let client = reqwest::Client::new();
    for _ in 0..32 {
        let resp = client
            .post(format!("http://{}/v1/completions", p.addr))
            .json(&json!({"model": common::MODEL, "prompt": " w".repeat(390),
                          "max_tokens": 8, "ignore_eos": true}))
            .send()
            .await
            .unwrap();
        let status = resp.status();
        let body = resp.text().await.unwrap();
        assert_eq!(status, 200, "{body}");
    }
    // 33 requests: one of 1 + 8 tokens, 32 of about 391 + 8; the cap rises to the plan for that,
    // at most twofold a scrape.
    let planned = |context: f64| (0.9 * 16_000.0 / context).floor() as u32;
    let mut context = 0.0;
    for _ in 0..400 {
        context = common::stats(&p).await["backends"][0]["admission"]["context_tokens"]
            .as_f64()
            .unwrap();
        let cap = admission.slots()[0].0.unwrap_or(0);
        if context < 1000.0 && cap.abs_diff(planned(context)) <= 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!((380.0..400.0).contains(&context), "{context}");
    let cap = admission.slots()[0].0.unwrap();
    assert!(
        cap.abs_diff(planned(context)) <= 1,
        "cap {cap}, planned {}",
        planned(context)
    );
    let m = common::get_text(&format!("http://{}/metrics", p.admin_addr)).await;
    assert!(m.contains("headroom_admission_cap_changes_total{backend=\"127.0.0.1:"));
    assert_eq!(
        common::metric_sum(&m, "headroom_admission_cap_changes_total"),
        2.0,
        "two moves, for the context (14, 28, 37): {m}"
    );
    assert!(m.contains("direction=\"raised\",reason=\"context\"} 2"));
    p.shutdown().await;
    r.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pools_keep_classes_on_their_replicas_and_batch_borrows_idle_interactive_room() {
    use headroom_config::serve::PoolConfig;
    let (a, b) = (sim().await, sim().await);
    let mut cfg = ServeConfig::quick("127.0.0.1:0", &[a.url(), b.url()], "least_load");
    cfg.admin_listen = "127.0.0.1:0".into();
    // A probe that times out on a busy test machine must not take a replica out mid-test.
    cfg.health.unhealthy_after = 1_000;
    cfg.scrape.interval_ms = 0;
    cfg.admission.max_in_flight = Some(1);
    cfg.backends[0].name = Some("a".into());
    cfg.backends[1].name = Some("b".into());
    cfg.pools = vec![
        PoolConfig {
            name: "interactive".into(),
            backends: vec!["a".into()],
            borrow: vec![],
            borrow_below: 0.5,
            shadow: None,
        },
        PoolConfig {
            name: "batch".into(),
            backends: vec!["b".into()],
            borrow: vec!["interactive".into()],
            borrow_below: 1.0,
            shadow: None,
        },
    ];
    let mut interactive = class(10, 8, 30_000);
    interactive.pool = Some("interactive".into());
    let mut batch = class(0, 8, 30_000);
    batch.pool = Some("batch".into());
    let mut long = class(0, 8, 30_000);
    long.pool = Some("batch".into());
    long.min_prompt_tokens = Some(200);
    let mut by_path = class(0, 8, 30_000);
    by_path.pool = Some("batch".into());
    by_path.paths = vec!["/v1/completions".into()];
    let mut by_model = class(0, 8, 30_000);
    by_model.pool = Some("batch".into());
    by_model.models = vec!["offline-model".into()];
    cfg.classes = BTreeMap::from([
        ("default".to_owned(), interactive.clone()),
        ("interactive".to_owned(), interactive),
        ("batch".to_owned(), batch),
        ("long".to_owned(), long),
        ("legacy".to_owned(), by_path),
        ("offline".to_owned(), by_model),
    ]);
    cfg.measure.default_class = "default".into();
    let p = headroom_proxy::start(cfg.validated().unwrap())
        .await
        .unwrap();
    let c = reqwest::Client::new();
    let ask = |class: Option<&'static str>, words: usize, tokens: u32| {
        let c = c.clone();
        let addr = p.addr;
        async move {
            let mut req = c
                .post(format!("http://{addr}/v1/chat/completions"))
                .json(&json!({
                "messages": [{"role": "user", "content": " w".repeat(words)}],
                "max_tokens": tokens, "ignore_eos": true}));
            if let Some(class) = class {
                req = req.header("x-headroom-class", class);
            }
            let resp = req.send().await.unwrap();
            let Some(backend) = resp.headers().get("x-headroom-backend").cloned() else {
                panic!(
                    "no backend: {} {}",
                    resp.status(),
                    resp.text().await.unwrap()
                );
            };
            resp.bytes().await.unwrap();
            backend.to_str().unwrap().to_owned()
        }
    };
    // The client has every byte of an answer a moment before the proxy releases its permit: one
    // at a time means after that release, or a request could borrow the other pool's replica.
    let admission = p.admission().unwrap();
    let idle = || async {
        while admission.slots().iter().any(|(_, held)| *held > 0) {
            tokio::task::yield_now().await;
        }
    };
    // One at a time: each class on its own pool; a long prompt without a header is batch work.
    for (class, words, want) in [
        (Some("interactive"), 5, "a"),
        (Some("batch"), 5, "b"),
        (None, 5, "a"),
        (None, 300, "b"),
    ] {
        idle().await;
        assert_eq!(ask(class, words, 2).await, want, "{class:?}, {words} words");
    }
    // The path and the model classify too.
    let backend_of = |resp: reqwest::Response| match resp.headers().get("x-headroom-backend") {
        Some(b) => b.to_str().unwrap().to_owned(),
        None => panic!(
            "no backend: {} {:?}",
            resp.status(),
            resp.headers().get("x-headroom-error")
        ),
    };
    idle().await;
    let completion = c
        .post(format!("http://{}/v1/completions", p.addr))
        .json(&json!({"prompt": "hi", "max_tokens": 2}))
        .send()
        .await
        .unwrap();
    assert_eq!(backend_of(completion), "b");
    idle().await;
    let offline = c
        .post(format!("http://{}/v1/chat/completions", p.addr))
        .json(&json!({"model": "offline-model", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}))
        .send()
        .await
        .unwrap();
    assert_eq!(backend_of(offline), "b");
    // Two batch requests at once: the second borrows the idle interactive replica. The first
    // holds b's only slot (25 s) until it is called off, however late the second arrives.
    idle().await;
    let holder = tokio::spawn(ask(Some("batch"), 5, 5000));
    while admission.slots()[1].1 == 0 {
        tokio::task::yield_now().await;
    }
    assert_eq!(ask(Some("batch"), 5, 2).await, "a");
    holder.abort();
    let stats = common::stats(&p).await;
    let pools: std::collections::BTreeSet<String> = stats["windows"]["5m"]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| w["pool"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(pools, ["batch", "interactive"].map(str::to_owned).into());
    p.shutdown().await;
    a.shutdown().await.unwrap();
    b.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shutdown_answers_the_requests_still_queued_instead_of_cutting_them() {
    let replica = common::sim(30, 20, &[]).await;
    let h = proxy(replica.url()).await;
    let addr = h.addr;
    let admission = h.admission().unwrap();
    // One ~10 s stream holds the only slot; three more wait for it.
    let long = tokio::spawn(send(addr, "interactive", 500));
    for _ in 0..500 {
        if admission.slots().iter().any(|(_, admitted)| *admitted == 1) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let queued: Vec<_> = (0..3)
        .map(|_| {
            tokio::spawn(async move {
                let resp = reqwest::Client::new()
                    .post(format!("http://{addr}/v1/chat/completions"))
                    .header("x-headroom-class", "interactive")
                    .json(&json!({"messages": [{"role": "user", "content": "go"}],
                        "max_tokens": 5, "ignore_eos": true, "stream": true}))
                    .send()
                    .await
                    .unwrap();
                let header = |name: &str| {
                    resp.headers()
                        .get(name)
                        .map(|v| v.to_str().unwrap().to_owned())
                };
                (
                    resp.status().as_u16(),
                    header("retry-after"),
                    header("connection"),
                )
            })
        })
        .collect();
    for _ in 0..500 {
        if admission.queued().values().sum::<usize>() == 3 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(admission.queued().values().sum::<usize>(), 3);
    // The grace period ends with the stream still open: it is cut, the queued ones are answered.
    let left = h
        .drain(Duration::from_millis(50), Duration::from_millis(300))
        .await;
    assert_eq!(left, 1);
    for q in queued {
        // The process is about to exit: the answer does not invite another request.
        let (status, retry_after, connection) = q.await.unwrap();
        assert_eq!(
            (status, retry_after.as_deref(), connection.as_deref()),
            (503, Some("1"), Some("close"))
        );
    }
    long.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_request_for_an_idle_batch_replica_does_not_wait_behind_interactive_ones() {
    let (a, b) = (sim().await, sim().await);
    let p = two_replicas(
        &a.url(),
        &b.url(),
        r#"
[health]
unhealthy_after = 1000
[[pools]]
name = "interactive"
backends = ["a"]
[[pools]]
name = "batch"
backends = ["b"]
[classes.default]
pool = "interactive"
priority = 10
queue_timeout_ms = 30000
[classes.batch]
pool = "batch"
priority = -10
queue_timeout_ms = 30000
"#,
    )
    .await;
    let admission = p.admission().unwrap();
    // A long interactive request holds replica a (25 s, until it is called off); a second one
    // waits for it.
    let holder = tokio::spawn(send(p.addr, "default", 5000));
    while admission.slots()[0].1 == 0 {
        tokio::task::yield_now().await;
    }
    let second = tokio::spawn(send(p.addr, "default", 5));
    while !admission.queued().contains_key("default") {
        tokio::task::yield_now().await;
    }
    // A batch request goes straight to the idle replica b: its whole answer (5 tokens at 5 ms)
    // comes while the interactive holder still streams.
    let (status, _, took) = tokio::time::timeout(Duration::from_secs(10), send(p.addr, "batch", 5))
        .await
        .expect("the batch request waited for the interactive slot");
    assert_eq!(status, 200);
    assert!(
        !holder.is_finished(),
        "the batch request waited for the interactive slot ({took:?})"
    );
    holder.abort();
    assert_eq!(second.await.unwrap().0, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_back_in_service_takes_the_queued_requests_at_once() {
    // Replica a's address answers nothing yet (its replica starts there later); b is up.
    let (_held, a_addr) = common::held_port(true);
    let b = sim().await;
    let p = two_replicas(
        &format!("http://{a_addr}"),
        &b.url(),
        r#"
[health]
interval_ms = 50
unhealthy_after = 1
healthy_after = 1
[routing]
policy = "least_load"
[classes.default]
queue_timeout_ms = 30000
"#,
    )
    .await;
    let admission = p.admission().unwrap();
    while p.fleet().backends[0].probe_healthy() {
        tokio::task::yield_now().await;
    }
    // A long request holds b (25 s, until it is called off); the next one waits, a being out.
    let holder = tokio::spawn(send(p.addr, "default", 5000));
    while admission.slots()[1].1 == 0 {
        tokio::task::yield_now().await;
    }
    let waiting = tokio::spawn(send(p.addr, "default", 5));
    while !admission.queued().contains_key("default") {
        tokio::task::yield_now().await;
    }
    // a comes up: its first passing probe hands it the waiting request, long before b frees.
    let a = headroom_sim::start_replica(
        common::sim_args(5, 5, &[]).build_replica(0).unwrap(),
        a_addr,
    )
    .await
    .unwrap();
    let (status, _, took) = waiting.await.unwrap();
    assert_eq!(status, 200);
    assert!(
        !holder.is_finished(),
        "the queued request waited for b's slot ({took:?})"
    );
    assert_eq!(
        admission.slots()[1].1,
        1,
        "b still holds only the long request"
    );
    holder.abort();
    p.shutdown().await;
    a.shutdown().await.unwrap();
    b.shutdown().await.unwrap();
}
