//! `headroom demo`: simulated vLLM replicas, a seeded multi-tenant chat workload replayed against
//! them open-loop, and a report of what users felt, with the workload contract written beside it.
//!
//! Today the requests go to the replicas round-robin, as a plain load balancer would send them;
//! the proxy (prefix-affinity routing, admission) slots in between once it exists.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use anyhow::Context;
use headroom_loadtest::client::Timing;
use headroom_loadtest::open_loop::{self, Planned, Progress};
use headroom_loadtest::stats::{LatencyHistogram, Percentiles};
use headroom_loadtest::synth;
use headroom_sim::SimArgs;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::Serialize;
use serde_json::json;

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
    /// Where the report and its contract are written.
    #[arg(long, default_value = "results/demo")]
    pub out: PathBuf,
}

/// The workload contract: everything needed to reproduce the numbers beside it.
#[derive(Debug, Serialize)]
struct Contract {
    command: String,
    seed: u64,
    requests: usize,
    arrival: String,
    endpoint: &'static str,
    tenants: u64,
    system_prompt_tokens: u32,
    user_prompt_tokens: String,
    output_tokens: String,
    sampling: &'static str,
    routing: &'static str,
    replicas: u16,
    engine: String,
}

#[derive(Debug, Serialize)]
struct Results {
    completed: usize,
    failed: usize,
    duration_s: f64,
    requests_per_s: f64,
    output_tokens_per_s: f64,
    ttft: Percentiles,
    itl: Percentiles,
    tpot: Percentiles,
    e2e: Percentiles,
    replicas: Vec<serde_json::Value>,
}

const SYSTEM_TOKENS: u32 = 600;

fn plan(args: &DemoArgs, urls: &[String]) -> Vec<Planned> {
    let mut rng = StdRng::seed_from_u64(args.seed);
    let mut at = 0.0;
    (0..args.requests)
        .map(|i| {
            at += synth::poisson_gap(&mut rng, args.rate);
            let tenant = rng.random_range(0..args.tenants.max(1));
            let user = synth::lognormal_len(&mut rng, 250.0, 0.9, 8, 6000);
            let output = synth::lognormal_len(&mut rng, 150.0, 0.6, 4, 1024);
            let body = json!({
                "model": "meta-llama/Llama-3.1-8B-Instruct",
                "messages": [
                    {"role": "system", "content": synth::text(SYSTEM_TOKENS as usize, 1_000 + tenant)},
                    {"role": "user", "content": synth::text(user as usize, args.seed * 1_000_003 + i as u64)},
                ],
                "stream": true,
                "stream_options": {"include_usage": true},
                "max_tokens": output,
                "ignore_eos": true,
                "temperature": 0,
            });
            Planned { at: Duration::from_secs_f64(at), url: format!("{}/v1/chat/completions", urls[i % urls.len()]), body }
        })
        .collect()
}

#[derive(Debug, Default)]
struct Histograms {
    ttft: LatencyHistogram,
    itl: LatencyHistogram,
    tpot: LatencyHistogram,
    e2e: LatencyHistogram,
}

fn summarize(timings: &[Timing]) -> Histograms {
    let mut h = Histograms::default();
    for t in timings.iter().filter(|t| t.ok()) {
        if let Some(d) = t.ttft {
            h.ttft.record(d);
        }
        for d in &t.itl {
            h.itl.record(*d);
        }
        if let Some(d) = t.tpot() {
            h.tpot.record(d);
        }
        h.e2e.record(t.e2e);
    }
    h
}

async fn scrape(client: &reqwest::Client, url: &str) -> anyhow::Result<serde_json::Value> {
    let text = client
        .get(format!("{url}/metrics"))
        .send()
        .await?
        .text()
        .await?;
    let sum = |name: &str| -> f64 {
        text.lines()
            .filter(|l| l.starts_with(name) && l[name.len()..].starts_with('{'))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    };
    let queries = sum("vllm:prefix_cache_queries_total");
    let hits = sum("vllm:prefix_cache_hits_total");
    Ok(json!({
        "url": url,
        "prefix_cache_hit_rate": if queries > 0.0 { hits / queries } else { 0.0 },
        "prompt_tokens": sum("vllm:prompt_tokens_total"),
        "generation_tokens": sum("vllm:generation_tokens_total"),
        "preemptions": sum("vllm:num_preemptions_total"),
    }))
}

fn row(name: &str, p: &Percentiles) -> String {
    format!(
        "  {name:<6} p50 {:>8.1} ms   p95 {:>8.1} ms   p99 {:>8.1} ms   max {:>8.1} ms   (n={})\n",
        p.p50_ms, p.p95_ms, p.p99_ms, p.max_ms, p.count
    )
}

/// Runs the demo.
pub async fn run(args: DemoArgs) -> anyhow::Result<()> {
    anyhow::ensure!(
        args.requests > 0 && args.rate > 0.0 && args.replicas > 0,
        "--requests, --rate and --replicas must be positive"
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

    let plan = plan(&args, &urls);
    let total = plan.len();
    let span = plan.last().map_or(0.0, |p| p.at.as_secs_f64());
    eprintln!(
        "headroom demo: replaying {total} chat requests from {} tenants over ~{span:.0} s (Poisson {} req/s), round-robin",
        args.tenants, args.rate
    );
    let progress = Arc::new(Progress::default());
    let ticker = {
        let progress = progress.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_secs(2));
            tick.tick().await;
            loop {
                tick.tick().await;
                eprintln!(
                    "  sent {:>4}/{total}   done {:>4}   failed {}",
                    progress.sent.load(Ordering::Relaxed),
                    progress.done.load(Ordering::Relaxed),
                    progress.failed.load(Ordering::Relaxed)
                );
            }
        })
    };
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(1024)
        .build()?;
    let started = Instant::now();
    let timings = open_loop::run(client.clone(), plan, progress).await;
    let duration = started.elapsed().as_secs_f64();
    ticker.abort();

    let h = summarize(&timings);
    let completed = timings.iter().filter(|t| t.ok()).count();
    let output_tokens: u64 = timings
        .iter()
        .filter(|t| t.ok())
        .map(|t| t.completion_tokens)
        .sum();
    let mut replicas = Vec::new();
    for url in &urls {
        replicas.push(scrape(&client, url).await?);
    }
    let results = Results {
        completed,
        failed: timings.len() - completed,
        duration_s: duration,
        requests_per_s: completed as f64 / duration,
        output_tokens_per_s: output_tokens as f64 / duration,
        ttft: h.ttft.percentiles(),
        itl: h.itl.percentiles(),
        tpot: h.tpot.percentiles(),
        e2e: h.e2e.percentiles(),
        replicas,
    };
    let contract = Contract {
        command: format!(
            "headroom demo --replicas {} --requests {} --rate {} --tenants {} --seed {}",
            args.replicas, args.requests, args.rate, args.tenants, args.seed
        ),
        seed: args.seed,
        requests: args.requests,
        arrival: format!("open loop, Poisson, {} req/s", args.rate),
        endpoint: "/v1/chat/completions, stream, include_usage",
        tenants: args.tenants,
        system_prompt_tokens: SYSTEM_TOKENS,
        user_prompt_tokens: "log-normal, median 250, sigma 0.9, clamped 8..6000".into(),
        output_tokens: "log-normal, median 150, sigma 0.6, clamped 4..1024, ignore_eos".into(),
        sampling: "temperature 0",
        routing: "round-robin across replicas (no proxy yet)",
        replicas: args.replicas,
        engine: format!(
            "headroom sim {}: vLLM 0.33 scheduler, Llama-3.1-8B on H100 roofline timing",
            env!("CARGO_PKG_VERSION")
        ),
    };

    let mut report = String::new();
    report.push_str(&format!(
        "\nheadroom demo: {} of {} requests completed in {duration:.1} s ({:.2} req/s, {:.0} output tokens/s)\n",
        results.completed, total, results.requests_per_s, results.output_tokens_per_s
    ));
    report.push_str(&row("TTFT", &results.ttft));
    report.push_str(&row("ITL", &results.itl));
    report.push_str(&row("TPOT", &results.tpot));
    report.push_str(&row("E2E", &results.e2e));
    for r in &results.replicas {
        report.push_str(&format!(
            "  replica {}: prefix-cache hit rate {:.1}%, {} preemptions\n",
            r["url"].as_str().unwrap_or("?"),
            100.0 * r["prefix_cache_hit_rate"].as_f64().unwrap_or(0.0),
            r["preemptions"]
        ));
    }
    report.push_str(&format!("  contract: {}\n", contract.command));
    print!("{report}");

    std::fs::create_dir_all(&args.out)
        .with_context(|| format!("creating {}", args.out.display()))?;
    let path = args.out.join("report.json");
    std::fs::write(
        &path,
        serde_json::to_string_pretty(&json!({"contract": contract, "results": results}))?,
    )
    .with_context(|| format!("writing {}", path.display()))?;
    eprintln!(
        "headroom demo: report and contract written to {}",
        path.display()
    );
    for r in fleet {
        r.shutdown().await?;
    }
    if results.failed > 0 {
        anyhow::bail!("{} requests failed", results.failed);
    }
    Ok(())
}
