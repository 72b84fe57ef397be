//! `headroom demo`: simulated vLLM replicas and a seeded multi-tenant, multi-turn chat trace
//! generated on the spot, replayed twice with `headroom replay`: once round-robin straight to the
//! replicas, as a plain load balancer sends it, and once through `headroom serve` with
//! prefix-affinity routing, each from cold caches. Ends in a side-by-side table and, per run, the
//! report (text, JSON with the workload contract, CSV, HTML).

use std::path::PathBuf;

use anyhow::Context;
use headroom_config::serve::ServeConfig;
use headroom_loadtest::cli::{ReplayArgs, run_replay};
use headroom_loadtest::synth;
use headroom_sim::SimArgs;
use headroom_workload::trace::{TraceRecord, write_jsonl};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// Flags of `headroom demo`.
#[derive(Debug, Clone, clap::Args)]
pub struct DemoArgs {
    /// Simulated replicas (Llama-3.1-8B on H100, roofline timing).
    #[arg(long, default_value_t = 2)]
    pub replicas: u16,
    /// Requests to send.
    #[arg(long, default_value_t = 160)]
    pub requests: usize,
    /// Mean arrival rate, requests per second (Poisson).
    #[arg(long, default_value_t = 6.0)]
    pub rate: f64,
    /// Tenants, each with its own shared system prompt.
    #[arg(long, default_value_t = 4)]
    pub tenants: u64,
    /// Seed of the workload.
    #[arg(long, default_value_t = 42)]
    pub seed: u64,
    /// Where the trace, the report and its contract are written.
    #[arg(long, default_value = "results/demo")]
    pub out: PathBuf,
}

/// Tokens per hash id in the demo trace (the engine's block size, so sharing is exact).
const BLOCK: u32 = 16;
/// Blocks of each tenant's system prompt (592 tokens).
const SYSTEM_BLOCKS: u32 = 37;

/// The demo workload: conversations, each opened by a tenant (drawn uniformly) whose system prompt
/// (592 tokens) every one of its conversations shares. A conversation has 2–6 turns; the first adds a
/// user message of log-normal length (median 250, σ 0.9, 8..6,000 tokens), each later turn carries the
/// whole previous prompt plus the answer and a new message (median 80, σ 0.7). Answers are log-normal
/// (median 150, σ 0.6, 4..1,024 tokens). Conversations start as a Poisson process; turns follow after
/// a log-normal think time (median 3 s). The first `requests` turns in time order are kept.
pub fn demo_trace(args: &DemoArgs) -> Vec<TraceRecord> {
    let mut rng = StdRng::seed_from_u64(args.seed);
    let mean_turns = 4.0;
    let mut next_id = 1_000_000_000u64;
    let mut start = 0.0;
    let mut rows: Vec<(f64, TraceRecord)> = Vec::new();
    let mut conversation = 0;
    // Turn times not yet earlier than the latest conversation start (as bits: for positive floats
    // their order is the numbers' order), and how many are.
    let mut pending = std::collections::BinaryHeap::new();
    let mut settled = 0;
    loop {
        start += synth::poisson_gap(&mut rng, args.rate / mean_turns);
        while pending
            .peek()
            .is_some_and(|std::cmp::Reverse(t)| f64::from_bits(*t) < start)
        {
            pending.pop();
            settled += 1;
        }
        // Every later conversation starts after the first `requests` turns: they are all here.
        if settled >= args.requests {
            break;
        }
        let tenant = rng.random_range(0..args.tenants.max(1));
        let turns = rng.random_range(2..=6u32);
        let mut hash_ids: Vec<u64> = (0..u64::from(SYSTEM_BLOCKS))
            .map(|k| (tenant + 1) * 1_000_000 + k)
            .collect();
        let mut input = SYSTEM_BLOCKS * BLOCK;
        let mut t = start;
        for turn in 0..turns {
            let user = if turn == 0 {
                synth::lognormal_len(&mut rng, 250.0, 0.9, 8, 6000)
            } else {
                synth::lognormal_len(&mut rng, 80.0, 0.7, 4, 2000)
            };
            let output = synth::lognormal_len(&mut rng, 150.0, 0.6, 4, 1024);
            // Only full blocks carry over: the partial last block is recomputed, as in an engine.
            hash_ids.truncate((input / BLOCK) as usize);
            input += user;
            let fresh = u64::from(input.div_ceil(BLOCK)) - hash_ids.len() as u64;
            hash_ids.extend(next_id..next_id + fresh);
            next_id += fresh;
            pending.push(std::cmp::Reverse(t.to_bits()));
            rows.push((
                t,
                TraceRecord {
                    timestamp: (t * 1e3) as u64,
                    input_length: input,
                    output_length: output,
                    hash_ids: hash_ids.clone(),
                    block_tokens: Some(BLOCK),
                    session_id: Some(format!("tenant-{tenant}-conversation-{conversation}")),
                    ..TraceRecord::default()
                },
            ));
            input += output;
            t += synth::lognormal_len(&mut rng, 3000.0, 0.6, 200, 30_000) as f64 / 1e3;
        }
        conversation += 1;
    }
    rows.sort_by(|a, b| a.0.total_cmp(&b.0));
    rows.truncate(args.requests);
    rows.into_iter().map(|(_, r)| r).collect()
}

/// Runs the demo.
pub async fn run(args: DemoArgs) -> anyhow::Result<()> {
    anyhow::ensure!(
        args.requests > 0 && args.rate > 0.0 && args.replicas > 0 && args.tenants > 0,
        "--requests, --rate, --replicas and --tenants must be positive"
    );
    let sim_flags = [
        "--port".to_owned(),
        "0".to_owned(),
        "--replicas".to_owned(),
        args.replicas.to_string(),
    ];
    let sim = SimArgs::from_flags(&sim_flags).context("simulator flags")?;
    let fleet = headroom_sim::start_fleet(&sim).await?;
    let urls: Vec<String> = fleet.iter().map(|r| r.url()).collect();
    eprintln!(
        "headroom demo: {} simulated Llama-3.1-8B/H100 replicas at {}",
        urls.len(),
        urls.join(", ")
    );

    std::fs::create_dir_all(&args.out)
        .with_context(|| format!("creating {}", args.out.display()))?;
    let trace_path = args.out.join("trace.jsonl");
    let file = std::fs::File::create(&trace_path)
        .with_context(|| format!("creating {}", trace_path.display()))?;
    write_jsonl(std::io::BufWriter::new(file), &demo_trace(&args))?;
    eprintln!(
        "headroom demo: {} chat turns of multi-turn conversations from {} tenants (each with a 592-token system prompt), {} req/s",
        args.requests, args.tenants, args.rate
    );

    let runs = async {
        let direct = replay_once(&args, &trace_path, &urls, None, "round_robin").await?;
        reset_caches(&urls).await;
        let proxied = through_headroom(&args, &trace_path, &urls).await?;
        anyhow::Ok([
            ("round-robin, no proxy", direct),
            ("headroom (prefix_affinity)", proxied),
        ])
    }
    .await;
    for r in fleet {
        r.shutdown().await?;
    }
    let runs = runs?;
    print_comparison(&runs);
    let failed: u64 = runs
        .iter()
        .map(|(_, d)| d["summary"]["failed"].as_u64().unwrap_or(0))
        .sum();
    anyhow::ensure!(failed == 0, "{failed} requests failed");
    Ok(())
}

/// One replay of the demo trace against `targets`; returns its result document.
async fn replay_once(
    args: &DemoArgs,
    trace: &std::path::Path,
    targets: &[String],
    observe: Option<&[String]>,
    name: &str,
) -> anyhow::Result<serde_json::Value> {
    let out = args.out.join(name);
    let how = if observe.is_some() {
        "through headroom serve --policy prefix_affinity"
    } else {
        "round-robin, no proxy"
    };
    eprintln!("headroom demo: run {name}: {how}");
    let mut flags = vec![
        "--trace".to_owned(),
        trace.display().to_string(),
        "--target".to_owned(),
        targets.join(","),
        "--endpoint".to_owned(),
        "chat".to_owned(),
        "--seed".to_owned(),
        args.seed.to_string(),
        "--slo".to_owned(),
        "ttft=400,tpot=50".to_owned(),
        "--hardware".to_owned(),
        format!(
            "headroom sim: {} × Llama-3.1-8B on H100 (roofline), {how}",
            args.replicas
        ),
        "--out".to_owned(),
        out.display().to_string(),
    ];
    if let Some(urls) = observe {
        flags.push("--observe".to_owned());
        flags.push(urls.join(","));
    }
    let result = run_replay(ReplayArgs::from_flags(flags)?).await?;
    Ok(serde_json::from_str(&std::fs::read_to_string(&result)?)?)
}

/// The replay through an in-process `headroom serve` in front of the same replicas.
async fn through_headroom(
    args: &DemoArgs,
    trace: &std::path::Path,
    urls: &[String],
) -> anyhow::Result<serde_json::Value> {
    let mut cfg = ServeConfig::quick("127.0.0.1:0", urls, "prefix_affinity");
    cfg.admin_listen = "127.0.0.1:0".into();
    let out = args.out.join("headroom");
    let capture = out.join("capture.jsonl");
    // A fresh capture per run: the file is appended to otherwise.
    let _ = std::fs::remove_file(&capture);
    cfg.capture.path = Some(capture.display().to_string());
    if let Some(default) = cfg.classes.get_mut("default") {
        // The same objectives the replay judges goodput by.
        default.slo.ttft_ms = Some(400.0);
        default.slo.tpot_ms = Some(50.0);
    }
    let cfg = cfg
        .validated()
        .map_err(|e| anyhow::anyhow!("demo proxy config: {e:?}"))?;
    let proxy = headroom_proxy::start(cfg).await?;
    let target = [format!("http://{}", proxy.addr)];
    let result = replay_once(args, trace, &target, Some(urls), "headroom").await;
    let stats = async {
        let url = format!("http://{}/stats", proxy.admin_addr);
        reqwest::get(url).await?.json::<serde_json::Value>().await
    }
    .await;
    proxy.shutdown().await;
    let mut result = result?;
    if let Ok(stats) = stats {
        std::fs::write(out.join("stats.json"), serde_json::to_vec_pretty(&stats)?)?;
        result["proxy_stats"] = stats;
    }
    eprintln!(
        "headroom demo: the proxy's own record of every request: {}",
        capture.display()
    );
    Ok(result)
}

/// Empties every replica's prefix cache, so the second run starts as cold as the first.
async fn reset_caches(urls: &[String]) {
    let client = reqwest::Client::new();
    for u in urls {
        let _ = client.post(format!("{u}/reset_prefix_cache")).send().await;
    }
}

fn print_comparison(runs: &[(&str, serde_json::Value); 2]) {
    let num = |d: &serde_json::Value, path: &[&str]| -> f64 {
        path.iter()
            .fold(d, |v, k| &v[*k])
            .as_f64()
            .unwrap_or(f64::NAN)
    };
    println!();
    println!(
        "{:<28} {:>9} {:>10} {:>10} {:>10} {:>13} {:>7}",
        "", "hit rate", "TTFT p50", "TTFT p99", "TPOT p99", "goodput", "failed"
    );
    for (name, d) in runs {
        println!(
            "{:<28} {:>8.1}% {:>8.1}ms {:>8.1}ms {:>8.1}ms {:>9.2} r/s {:>7}",
            name,
            100.0 * num(d, &["target_observed", "prefix_cache_hit_rate"]),
            num(d, &["summary", "ttft", "p50_ms"]),
            num(d, &["summary", "ttft", "p99_ms"]),
            num(d, &["summary", "tpot", "p99_ms"]),
            num(d, &["summary", "goodput", "requests_per_s"]),
            num(d, &["summary", "failed"]),
        );
    }
    let ideal = num(&runs[1].1, &["target_observed", "offline_prefix_hit_rate"]);
    println!(
        "the trace's ideal hit rate (one cache as large as the fleet's): {:.1}%",
        100.0 * ideal
    );
    println!("goodput: requests per second that met TTFT ≤ 400 ms and TPOT ≤ 50 ms");
    if let Some(w) = runs[1].1["proxy_stats"]["windows"]["5m"]
        .as_array()
        .and_then(|a| a.first())
    {
        let n = |p: &[&str]| num(w, p);
        println!(
            "headroom's own passive measurement of the same run: {} requests, {} good; TTFT p50 {:.1} ms, p99 {:.1} ms; TPOT p99 {:.1} ms",
            n(&["requests"]),
            n(&["good"]),
            n(&["latency", "ttft_ms", "p50"]),
            n(&["latency", "ttft_ms", "p99"]),
            n(&["latency", "tpot_ms", "p99"]),
        );
    }
}
