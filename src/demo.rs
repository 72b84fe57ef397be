//! `headroom demo`: simulated vLLM replicas, a seeded multi-tenant chat trace generated on the spot,
//! replayed against them with `headroom replay`, ending in its report (text, JSON with the workload
//! contract, CSV, HTML).
//!
//! Today the requests go to the replicas round-robin, as a plain load balancer would send them;
//! the proxy (prefix-affinity routing, admission) slots in between once it exists.

use std::path::PathBuf;

use anyhow::Context;
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

/// The demo workload: each request is a tenant's shared system prompt, then a user message of
/// log-normal length (median 250, σ 0.9, 8..6,000 tokens); answers log-normal (median 150, σ 0.6,
/// 4..1,024 tokens); tenants drawn uniformly; Poisson arrivals.
pub fn demo_trace(args: &DemoArgs) -> Vec<TraceRecord> {
    let mut rng = StdRng::seed_from_u64(args.seed);
    let mut t = 0.0;
    let mut next_id = 1_000_000_000u64;
    (0..args.requests)
        .map(|i| {
            if i > 0 {
                t += synth::poisson_gap(&mut rng, args.rate);
            }
            let tenant = rng.random_range(0..args.tenants.max(1));
            let user = synth::lognormal_len(&mut rng, 250.0, 0.9, 8, 6000);
            let output = synth::lognormal_len(&mut rng, 150.0, 0.6, 4, 1024);
            let input = SYSTEM_BLOCKS * BLOCK + user;
            let mut hash_ids: Vec<u64> = (0..u64::from(SYSTEM_BLOCKS))
                .map(|k| (tenant + 1) * 1_000_000 + k)
                .collect();
            let fresh = u64::from(input.div_ceil(BLOCK) - SYSTEM_BLOCKS);
            hash_ids.extend(next_id..next_id + fresh);
            next_id += fresh;
            TraceRecord {
                timestamp: (t * 1e3) as u64,
                input_length: input,
                output_length: output,
                hash_ids,
                block_tokens: Some(BLOCK),
                session_id: Some(format!("tenant-{tenant}")),
                ..TraceRecord::default()
            }
        })
        .collect()
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
        "headroom demo: {} chat requests from {} tenants (each with a 592-token system prompt), Poisson {} req/s, sent round-robin",
        args.requests, args.tenants, args.rate
    );

    let replay = ReplayArgs::from_flags([
        "--trace".to_owned(),
        trace_path.display().to_string(),
        "--target".to_owned(),
        urls.join(","),
        "--endpoint".to_owned(),
        "chat".to_owned(),
        "--seed".to_owned(),
        args.seed.to_string(),
        "--slo".to_owned(),
        "ttft=400,tpot=50".to_owned(),
        "--hardware".to_owned(),
        format!(
            "headroom sim: {} × Llama-3.1-8B on H100 (roofline), round-robin, no proxy",
            args.replicas
        ),
        "--out".to_owned(),
        args.out.display().to_string(),
    ])?;
    let result = run_replay(replay).await;
    for r in fleet {
        r.shutdown().await?;
    }
    let result = result?;
    let doc: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&result)?)?;
    for t in doc["target_observed"]["targets"]
        .as_array()
        .into_iter()
        .flatten()
    {
        println!(
            "replica {}: prefix-cache hit rate {:.1}%",
            t["url"].as_str().unwrap_or("?"),
            100.0 * t["prefix_cache_hit_rate"].as_f64().unwrap_or(0.0)
        );
    }
    println!("report: {}", args.out.join("report.html").display());
    let failed = doc["summary"]["failed"].as_u64().unwrap_or(0);
    anyhow::ensure!(failed == 0, "{failed} requests failed");
    Ok(())
}
