//! The load tester against an in-process simulated replica: prompts hit their contracted lengths
//! exactly, outputs are pinned, every run writes its contract and results, and the sweep, tail,
//! compare and merge reports work on real results.

use std::path::Path;

use clap::Parser;
use headroom_loadtest::cli::{ReplayArgs, ReportCommand, run_replay, run_report};
use headroom_loadtest::contracts::{Contract, synthesize};
use headroom_sim::{RunningReplica, SimArgs, start_replica};
use headroom_workload::trace::write_jsonl;
use serde_json::Value;

async fn sim() -> RunningReplica {
    let args = SimArgs::from_flags([
        "--latency-model",
        "constant",
        "--time-to-first-token",
        "3",
        "--inter-token-latency",
        "1",
        "--max-model-len",
        "20000",
    ])
    .unwrap();
    start_replica(
        args.build_replica(0).unwrap(),
        "127.0.0.1:0".parse().unwrap(),
    )
    .await
    .unwrap()
}

#[derive(Parser)]
struct Replay {
    #[command(flatten)]
    args: ReplayArgs,
}

#[derive(Parser)]
struct Report {
    #[command(subcommand)]
    cmd: ReportCommand,
}

fn replay_args(flags: &[&str]) -> ReplayArgs {
    Replay::try_parse_from(std::iter::once("replay").chain(flags.iter().copied()))
        .unwrap()
        .args
}

fn report_cmd(flags: &[&str]) -> ReportCommand {
    Report::try_parse_from(std::iter::once("report").chain(flags.iter().copied()))
        .unwrap()
        .cmd
}

fn read(path: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replays_hit_contracted_lengths_on_both_endpoints_and_write_their_contract() {
    let r = sim().await;
    let scratch = tempfile::tempdir().expect("a scratch directory");
    let dir = scratch.path();
    let trace = dir.join("rag.jsonl");
    write_jsonl(
        std::fs::File::create(&trace).unwrap(),
        &synthesize(Contract::Rag, 24, 40.0, 3),
    )
    .unwrap();
    for endpoint in ["completions", "chat"] {
        let out = dir.join(endpoint);
        let result = run_replay(replay_args(&[
            "--trace",
            trace.to_str().unwrap(),
            "--target",
            &r.url(),
            "--endpoint",
            endpoint,
            "--rate",
            "40",
            "--slo",
            "ttft=1000",
            "--out",
            out.to_str().unwrap(),
        ]))
        .await
        .unwrap();
        let doc = read(&result);
        assert_eq!(doc["schema"], "headroom.replay.v1");
        let s = &doc["summary"];
        assert_eq!(s["completed"], 24, "{endpoint}: {s}");
        assert_eq!(
            s["lengths"]["prompt_mismatches"], 0,
            "{endpoint}: prompts hit input_length"
        );
        assert_eq!(s["lengths"]["output_short"], 0);
        assert!(s["lengths"]["warning"].is_null());
        assert_eq!(s["goodput"]["good_requests"], 24);
        for row in doc["requests"].as_array().unwrap() {
            assert_eq!(row["prompt_tokens"], row["input_length"]);
            assert_eq!(row["completion_tokens"], row["output_length"]);
            assert!(row["request_id"].as_str().unwrap().starts_with("hr"));
        }
        let c = &doc["contract"];
        assert_eq!(c["trace"]["requests"], 24);
        assert_eq!(c["trace"]["sha256"].as_str().unwrap().len(), 64);
        assert_eq!(c["target"]["version"], "0.33.0");
        assert_eq!(c["model"], "meta-llama/Llama-3.1-8B-Instruct");
        let hit = doc["target_observed"]["prefix_cache_hit_rate"]
            .as_f64()
            .unwrap();
        assert!(hit > 0.0, "the shared system prefix hits: {hit}");
        for f in ["requests.csv", "summary.txt", "report.html"] {
            assert!(out.join(f).exists(), "{f}");
        }
        assert_eq!(
            std::fs::read_to_string(out.join("requests.csv"))
                .unwrap()
                .lines()
                .count(),
            25
        );
    }

    // A duration that ends the schedule early: the contract describes the rows sent.
    let short = dir.join("short");
    let doc = read(
        &run_replay(replay_args(&[
            "--trace",
            trace.to_str().unwrap(),
            "--target",
            &r.url(),
            "--rate",
            "40",
            "--duration",
            "0.2",
            "--quiet",
            "--out",
            short.to_str().unwrap(),
        ]))
        .await
        .unwrap(),
    );
    // The contract is the load planned; what was sent of it is said beside it.
    let sent = doc["requests"].as_array().unwrap().len();
    assert!(sent > 0 && sent < 24, "{sent}");
    assert_eq!(doc["contract"]["trace"]["requests"], 24);
    let s = &doc["sent"];
    assert_eq!(s["requests"], sent);
    assert_eq!(s["requests_planned"], 24);
    assert_eq!(s["input_tokens"]["count"], sent);
    assert_eq!(s["output_tokens"]["count"], sent);

    // The same contract but the endpoint: one difference, so it is a comparison.
    let (text, _) = headroom_loadtest::analysis::compare(
        &read(&dir.join("completions/result.json")),
        &read(&dir.join("chat/result.json")),
    );
    assert!(
        text.starts_with("Compared: the contracts differ only in `endpoint`"),
        "{text}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sharded_runs_merge_and_sweeps_name_a_safe_level() {
    let r = sim().await;
    let scratch = tempfile::tempdir().expect("a scratch directory");
    let dir = scratch.path();
    let trace = dir.join("chat.jsonl");
    write_jsonl(
        std::fs::File::create(&trace).unwrap(),
        &synthesize(Contract::Chat, 20, 50.0, 1),
    )
    .unwrap();
    let mut shards = Vec::new();
    for i in 0..2 {
        let out = dir.join(format!("shard{i}"));
        let shard = format!("{i}/2");
        run_replay(replay_args(&[
            "--trace",
            trace.to_str().unwrap(),
            "--target",
            &r.url(),
            "--concurrency",
            "4",
            "--shard",
            &shard,
            "--out",
            out.to_str().unwrap(),
        ]))
        .await
        .unwrap();
        assert_eq!(read(&out.join("result.json"))["summary"]["completed"], 10);
        shards.push(out.join("result.json"));
    }
    let merged = dir.join("merged");
    run_report(report_cmd(&[
        "merge",
        shards[0].to_str().unwrap(),
        shards[1].to_str().unwrap(),
        "--out",
        merged.to_str().unwrap(),
    ]))
    .unwrap();
    let merged_doc = read(&merged.join("result.json"));
    assert_eq!(merged_doc["summary"]["completed"], 20);
    assert_eq!(
        merged_doc["contract"]["load"]["concurrency"], 8,
        "two shards of 4"
    );
    let mut rows: Vec<u64> = merged_doc["requests"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["index"].as_u64().unwrap())
        .collect();
    rows.sort_unstable();
    assert_eq!(
        rows,
        (0..20).collect::<Vec<u64>>(),
        "every trace row exactly once"
    );
    // The shards ran one after the other: merged on one clock, the second's requests come after
    // the first's, and the run spans both.
    let start = |p: &Path| read(p)["started_unix_ms"].as_f64().unwrap();
    let gap = start(&shards[1]) - start(&shards[0]);
    assert!(gap > 0.0, "{gap}");
    let first_of_second = merged_doc["requests"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|r| r["index"].as_u64().unwrap() % 2 == 1)
        .map(|r| r["sent_ms"].as_f64().unwrap())
        .fold(f64::INFINITY, f64::min);
    assert!(first_of_second >= gap - 1.0, "{first_of_second} {gap}");

    // Open-loop shards keep the times the whole run would give their rows: not in lockstep.
    let mut times = Vec::new();
    for i in 0..2 {
        let out = dir.join(format!("rate{i}"));
        let shard = format!("{i}/2");
        run_replay(replay_args(&[
            "--trace",
            trace.to_str().unwrap(),
            "--target",
            &r.url(),
            "--rate",
            "100",
            "--shard",
            &shard,
            "--out",
            out.to_str().unwrap(),
        ]))
        .await
        .unwrap();
        let doc = read(&out.join("result.json"));
        let requests = doc["requests"].as_array().unwrap();
        // The dispatcher lets no request go before its time.
        for r in requests {
            let (scheduled, sent) = (r["scheduled_ms"].as_f64(), r["sent_ms"].as_f64());
            assert!(sent >= scheduled, "sent before its time: {r}");
        }
        let t: Vec<f64> = requests
            .iter()
            .map(|r| r["scheduled_ms"].as_f64().unwrap())
            .collect();
        times.push(t);
    }
    assert!(times[0].iter().all(|t| !times[1].contains(t)), "{times:?}");
    assert_eq!(times[0].len() + times[1].len(), 20);

    let sweep = dir.join("sweep");
    run_replay(replay_args(&[
        "--trace",
        trace.to_str().unwrap(),
        "--target",
        &r.url(),
        "--sweep",
        "concurrency:1,2",
        "--sweep-duration",
        "0.3",
        "--slo",
        "ttft=10000",
        "--out",
        sweep.to_str().unwrap(),
    ]))
    .await
    .unwrap();
    let doc = read(&sweep.join("sweep.json"));
    assert_eq!(doc["points"].as_array().unwrap().len(), 2);
    assert_eq!(doc["verdict"]["largest_safe_level"], 2.0);
    assert!(sweep.join("sweep.html").exists());

    let tail = dir.join("tail");
    let source = merged.join("result.json");
    run_report(report_cmd(&[
        "tail",
        "--trace",
        source.to_str().unwrap(),
        "--out",
        tail.to_str().unwrap(),
    ]))
    .unwrap();
    let t = read(&tail.join("tail.json"));
    assert_eq!(t["requests"], 20);
    assert!(
        t["buckets"]
            .as_array()
            .unwrap()
            .iter()
            .any(|b| !b["ttft_p99_ms"].is_null())
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_run_sends_nothing_more_and_returns_what_finished() {
    use headroom_loadtest::replay::{self, Arrivals, ReplayOptions, STOP_GRACE};
    use headroom_loadtest::synth::Endpoint;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::time::{Duration, Instant};

    let r = sim().await;
    // 400 requests over 20 s; the run is stopped 300 ms after its first send (however long the
    // machine takes to get there).
    let records = synthesize(Contract::Chat, 400, 20.0, 5);
    let stop = Arc::new(AtomicBool::new(false));
    let opts = ReplayOptions {
        targets: vec![r.url()],
        endpoint: Endpoint::Chat,
        model: None,
        arrivals: Arrivals::Trace { time_scale: 1.0 },
        duration: None,
        warmup: 0,
        seed: 1,
        prompt_salt: 1,
        plan: None,
        rows: None,
        timeout: Duration::from_secs(30),
        run_id: "stopped".into(),
        headers: Vec::new(),
        prestage: false,
        stop: stop.clone(),
    };
    let counters = Arc::new(replay::Counters::default());
    let (flag, seen) = (stop.clone(), counters.clone());
    let stopper = tokio::spawn(async move {
        let t0 = Instant::now();
        while seen.sent.load(Ordering::Relaxed) == 0 && t0.elapsed() < Duration::from_secs(10) {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
        flag.store(true, Ordering::Relaxed);
        (Instant::now(), seen.sent.load(Ordering::Relaxed))
    });
    let results = replay::run(records, opts, counters.clone()).await;
    let (stopped, sent_by_then) = stopper.await.unwrap();
    assert!(
        stopped.elapsed() < STOP_GRACE + Duration::from_secs(2),
        "{:?} after the stop",
        stopped.elapsed()
    );
    // Nothing more after the stop but what was already handed over to go at its time (10 ms
    // ahead: a request or two at this rate).
    let sent = counters.sent.load(Ordering::Relaxed);
    assert!(
        sent <= sent_by_then + 3,
        "{sent} sent, {sent_by_then} by the stop"
    );
    assert!(
        !results.is_empty() && results.len() <= sent,
        "{} results of {sent} sent",
        results.len()
    );
    assert!(results.iter().all(|r| r.timing.failure.is_none()));
}
