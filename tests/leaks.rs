//! Counters never leak: a mixed load through the proxy (streamed and not, random client aborts,
//! injected engine faults) while simulated replicas (separate processes) are killed with SIGKILL
//! and restarted; afterwards every gauge of work at the proxy — open requests, each replica's
//! in-flight, pending prefill and decoding counts, admission permits and queues — is exactly 0,
//! and every request that was not aborted by its client got an answer.
//!
//! `HEADROOM_LEAK_REQUESTS` sets the number of requests (default 3000; docs/reliability.md records
//! a 10,000-request run).

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use headroom_config::serve::ServeConfig;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

const MODEL: &str = "meta-llama/Llama-3.1-8B-Instruct";

/// A simulated replica in its own process (so it can be killed for real), on `port` (0: any).
fn spawn_sim(port: u16) -> (Child, u16) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_headroom"))
        .args([
            "sim",
            "--port",
            &port.to_string(),
            "--latency-model",
            "constant",
            "--time-to-first-token",
            "5",
            "--inter-token-latency",
            "2",
            "--max-model-len",
            "200000",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("the simulator starts");
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .expect("the simulator prints its address");
    let port = line
        .trim()
        .rsplit(':')
        .next()
        .and_then(|p| p.parse().ok())
        .unwrap_or_else(|| panic!("no port in {line:?}"));
    (child, port)
}

#[derive(Debug, Default)]
struct Outcomes {
    answered: AtomicU64,
    aborted: AtomicU64,
    cut: AtomicU64,
    unanswered: AtomicU64,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_gauge_is_zero_at_rest_after_aborts_and_replica_kills() {
    let total: u64 = std::env::var("HEADROOM_LEAK_REQUESTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(3000);
    let sims: Vec<(Child, u16)> = (0..3).map(|_| spawn_sim(0)).collect();
    let ports: Vec<u16> = sims.iter().map(|(_, p)| *p).collect();
    let sims = Arc::new(std::sync::Mutex::new(
        sims.into_iter().map(|(c, _)| c).collect::<Vec<_>>(),
    ));

    let urls: Vec<String> = ports
        .iter()
        .map(|p| format!("http://127.0.0.1:{p}"))
        .collect();
    let mut cfg = ServeConfig::quick("127.0.0.1:0", &urls, "prefix_affinity");
    cfg.admin_listen = "127.0.0.1:0".into();
    cfg.health.interval_ms = 100;
    cfg.health.eject_ms = 300;
    cfg.scrape.interval_ms = 100;
    cfg.admission.enabled = true;
    cfg.admission.max_in_flight = Some(6);
    cfg.timeouts.first_byte_ms = 5_000;
    cfg.timeouts.idle_ms = 2_000;
    let h = headroom_proxy::start(cfg.validated().unwrap())
        .await
        .unwrap();
    let url = format!("http://{}/v1/completions", h.addr);

    // Kill a replica (SIGKILL) every 300 ms and restart it on its port 150 ms later.
    let sending = Arc::new(AtomicBool::new(true));
    let killer = {
        let (sims, sending, ports) = (sims.clone(), sending.clone(), ports.clone());
        std::thread::spawn(move || {
            let mut rng = StdRng::seed_from_u64(7);
            let mut kills = 0;
            while sending.load(Ordering::Relaxed) {
                std::thread::sleep(Duration::from_millis(300));
                let i = rng.random_range(0..ports.len());
                let mut list = sims.lock().unwrap();
                let _ = list[i].kill();
                let _ = list[i].wait();
                drop(list);
                kills += 1;
                std::thread::sleep(Duration::from_millis(150));
                let (child, _) = spawn_sim(ports[i]);
                sims.lock().unwrap()[i] = child;
            }
            kills
        })
    };

    let outcomes = Arc::new(Outcomes::default());
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(64)
        .build()
        .unwrap();
    let slots = Arc::new(tokio::sync::Semaphore::new(48));
    let mut rng = StdRng::seed_from_u64(42);
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..total {
        let permit = slots.clone().acquire_owned().await.unwrap();
        let stream = rng.random_bool(0.7);
        let tokens = rng.random_range(1..40u32);
        let abort_after = rng
            .random_bool(0.25)
            .then(|| Duration::from_millis(rng.random_range(0..40)));
        let fault = match rng.random_range(0..100) {
            0..3 => Some("error=503"),
            3..6 => Some("drop-after=2"),
            6..8 => Some("stall-first-ms=60"),
            _ => None,
        };
        // A few shared prefixes, so affinity and its index are exercised.
        let prompt = format!("system prompt {} — question {i}", i % 7);
        let body = serde_json::json!({"model": MODEL, "prompt": prompt, "max_tokens": tokens,
                                      "ignore_eos": true, "stream": stream});
        let (client, url, outcomes) = (client.clone(), url.clone(), outcomes.clone());
        tasks.spawn(async move {
            let _permit = permit;
            let mut req = client.post(url).json(&body);
            if let Some(f) = fault {
                req = req.header("x-headroom-fault", f);
            }
            let exchange = async move {
                match req.send().await {
                    Ok(resp) => resp.bytes().await.is_ok(),
                    Err(_) => false,
                }
            };
            match abort_after {
                Some(after) => {
                    // The client goes away: the future (and its connection) is dropped.
                    if tokio::time::timeout(after, exchange).await.is_err() {
                        outcomes.aborted.fetch_add(1, Ordering::Relaxed);
                    } else {
                        outcomes.answered.fetch_add(1, Ordering::Relaxed);
                    }
                }
                None => match tokio::time::timeout(Duration::from_secs(30), exchange).await {
                    Ok(true) => {
                        outcomes.answered.fetch_add(1, Ordering::Relaxed);
                    }
                    // A response cut off (a killed replica, a dropped stream) is an answer too:
                    // the connection closed instead of completing the body.
                    Ok(false) => {
                        outcomes.cut.fetch_add(1, Ordering::Relaxed);
                    }
                    Err(_) => {
                        outcomes.unanswered.fetch_add(1, Ordering::Relaxed);
                    }
                },
            }
        });
    }
    while tasks.join_next().await.is_some() {}
    sending.store(false, Ordering::Relaxed);
    let kills = killer.join().unwrap();

    // At rest: the last guards drop as their tasks finish; wait (bounded) for them.
    let at_rest = || {
        let loads: Vec<_> = h
            .fleet()
            .backends
            .iter()
            .map(|b| {
                let l = b.load();
                (l.in_flight, l.pending_prefill_tokens, l.decoding)
            })
            .collect();
        let adm = h.admission().unwrap();
        let permits: Vec<u32> = adm.slots().iter().map(|(_, n)| *n).collect();
        let queued: usize = adm.queued().values().sum();
        (h.lifecycle.open(), loads, permits, queued)
    };
    for _ in 0..500 {
        let (open, loads, permits, queued) = at_rest();
        if open == 0
            && loads.iter().all(|l| *l == (0, 0, 0))
            && permits.iter().all(|p| *p == 0)
            && queued == 0
        {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let (open, loads, permits, queued) = at_rest();
    let o = &outcomes;
    let summary = format!(
        "{total} requests, {kills} replica kills: {} answered, {} cut, {} aborted by the client, {} unanswered",
        o.answered.load(Ordering::Relaxed),
        o.cut.load(Ordering::Relaxed),
        o.aborted.load(Ordering::Relaxed),
        o.unanswered.load(Ordering::Relaxed)
    );
    eprintln!("{summary}");
    for mut c in sims.lock().unwrap().drain(..) {
        let _ = c.kill();
        let _ = c.wait();
    }
    assert!(kills >= 2, "{summary}");
    assert!(o.aborted.load(Ordering::Relaxed) > 0, "{summary}");
    assert_eq!(o.unanswered.load(Ordering::Relaxed), 0, "{summary}");
    assert_eq!(open, 0, "open requests at rest; {summary}");
    for (b, l) in loads.iter().enumerate() {
        assert_eq!(
            *l,
            (0, 0, 0),
            "backend {b}: (in flight, pending prefill, decoding) at rest; {summary}"
        );
    }
    assert!(
        permits.iter().all(|p| *p == 0),
        "permits {permits:?}; {summary}"
    );
    assert_eq!(queued, 0, "queued at rest; {summary}");
    let m = reqwest::get(format!("http://{}/metrics", h.admin_addr))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let gauges: Vec<&str> = m
        .lines()
        .filter(|l| {
            l.starts_with("headroom_open_requests ")
                || l.starts_with("headroom_backend_in_flight{")
                || l.starts_with("headroom_admission_in_flight{")
                || l.starts_with("headroom_queue_depth{")
        })
        .collect();
    // The open-request gauge, and in-flight and permits for each of the 3 replicas.
    assert!(gauges.len() >= 7, "{gauges:?}");
    for line in gauges {
        assert!(line.ends_with(" 0"), "{line}; {summary}");
    }
    h.shutdown().await;
}
