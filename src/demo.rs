//! `headroom demo`: simulated vLLM replicas serving two kinds of traffic at once — multi-turn chat of
//! several tenants (interactive) and a batch job of long RAG prompts — replayed twice from cold
//! caches: once as a plain load balancer serves it (round-robin over every replica, no admission),
//! once through `headroom serve` (an interactive and a batch pool, prefix-affinity routing, admission
//! below preemption). Ends in a side-by-side table, an HTML report, every run's result with its
//! workload contract, and the trace the proxy captured.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use anyhow::Context;
use headroom_config::serve::ServeConfig;
use headroom_loadtest::cli::{ReplayArgs, run_replay_counted};
use headroom_loadtest::contracts::{self, Contract};
use headroom_loadtest::html::{self, Chart, Section, Series, Style};
use headroom_loadtest::replay::Counters;
use headroom_loadtest::synth;
use headroom_sim::SimArgs;
use headroom_workload::engine_metrics::EngineGauges;
use headroom_workload::trace::{TraceRecord, write_jsonl};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::Value;

/// Flags of `headroom demo`.
#[derive(Debug, Clone, clap::Args)]
pub struct DemoArgs {
    /// Simulated replicas (Llama-3.1-8B on H100, roofline timing). Under headroom the first half
    /// serve the interactive pool and the rest the batch pool.
    #[arg(long, default_value_t = 4)]
    pub replicas: u16,
    /// Interactive chat turns to send.
    #[arg(long, default_value_t = 160)]
    pub requests: usize,
    /// Mean arrival rate of chat turns, per second (Poisson).
    #[arg(long, default_value_t = 6.0)]
    pub rate: f64,
    /// Tenants, each with its own shared system prompt.
    #[arg(long, default_value_t = 4)]
    pub tenants: u64,
    /// Requests of the batch job (RAG contract: ~3,500-token prompts, ~200-token answers).
    #[arg(long, default_value_t = 240)]
    pub batch_requests: usize,
    /// Arrival rate of the batch job, per second.
    #[arg(long, default_value_t = 60.0)]
    pub batch_rate: f64,
    /// Seconds after the chat traffic starts that the batch job is submitted.
    #[arg(long, default_value_t = 5.0)]
    pub batch_after: f64,
    /// KV cache blocks (16 tokens each) per simulated replica: a small cache, so that the
    /// pressure a batch job puts on it shows within a minute.
    #[arg(long, default_value_t = 4096)]
    pub kv_blocks: u32,
    /// Seed of the workload and of the prompts' text.
    #[arg(long, default_value_t = 42)]
    pub seed: u64,
    /// Where the traces, the reports and their contracts are written.
    #[arg(long, default_value = "results/demo")]
    pub out: PathBuf,
}

/// Tokens per hash id in the chat trace (the engine's block size, so sharing is exact).
const BLOCK: u32 = 16;
/// Blocks of each tenant's system prompt (592 tokens).
const SYSTEM_BLOCKS: u32 = 37;
/// The interactive objectives the runs are judged by (and the proxy's interactive class holds).
const SLO_TTFT_MS: f64 = 400.0;
const SLO_TPOT_MS: f64 = 50.0;
/// The class header both runs send (the plain balancer ignores it).
const CLASS_HEADER: &str = "x-headroom-class";

/// The chat workload: conversations, each opened by a tenant (drawn uniformly) whose system prompt
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
                    class: Some("interactive".into()),
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

/// The batch job: the RAG contract (`headroom trace synth --contract rag`) with its own seed.
pub fn batch_trace(args: &DemoArgs) -> Vec<TraceRecord> {
    let mut rows = contracts::synthesize(
        Contract::Rag,
        args.batch_requests,
        args.batch_rate,
        args.seed.wrapping_add(1),
    );
    for r in &mut rows {
        r.class = Some("batch".into());
    }
    rows
}

/// The two ways the demo serves the same traffic.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// Round-robin straight to every replica, no admission: a plain load balancer.
    RoundRobin,
    /// Through `headroom serve` with pools, prefix-affinity routing and admission.
    Headroom,
}

impl Mode {
    fn dir(self) -> &'static str {
        match self {
            Mode::RoundRobin => "round_robin",
            Mode::Headroom => "headroom",
        }
    }

    fn label(self) -> &'static str {
        match self {
            Mode::RoundRobin => "round-robin, no admission",
            Mode::Headroom => "headroom (pools, affinity, admission)",
        }
    }
}

/// What one run measured.
struct Run {
    mode: Mode,
    interactive: Value,
    batch: Value,
    engines: EngineDelta,
    proxy_stats: Option<Value>,
}

/// The replicas' own counters over a run.
#[derive(Debug, Clone, Copy, Default)]
struct EngineDelta {
    prefix_queries: f64,
    prefix_hits: f64,
    preemptions: f64,
}

impl EngineDelta {
    fn hit_rate(&self) -> f64 {
        if self.prefix_queries > 0.0 {
            self.prefix_hits / self.prefix_queries
        } else {
            0.0
        }
    }
}

/// Runs the demo.
pub async fn run(args: DemoArgs) -> anyhow::Result<()> {
    anyhow::ensure!(
        args.requests > 0
            && args.batch_requests > 0
            && args.rate > 0.0
            && args.batch_rate > 0.0
            && args.tenants > 0,
        "--requests, --batch-requests, --rate, --batch-rate and --tenants must be positive"
    );
    anyhow::ensure!(
        args.replicas >= 2,
        "--replicas must be at least 2: one pool for interactive traffic, one for batch"
    );
    anyhow::ensure!(
        args.batch_after.is_finite() && args.batch_after >= 0.0,
        "--batch-after must be a number of seconds ≥ 0"
    );
    let sim_flags = [
        "--port".to_owned(),
        "0".to_owned(),
        "--replicas".to_owned(),
        args.replicas.to_string(),
        "--num-gpu-blocks".to_owned(),
        args.kv_blocks.to_string(),
    ];
    let sim = SimArgs::from_flags(&sim_flags).context("simulator flags")?;
    let fleet = headroom_sim::start_fleet(&sim).await?;
    let urls: Vec<String> = fleet.iter().map(|r| r.url()).collect();
    eprintln!(
        "headroom demo: {} simulated Llama-3.1-8B/H100 replicas, {} KV tokens each, at {}",
        urls.len(),
        u64::from(args.kv_blocks) * u64::from(BLOCK),
        urls.join(", ")
    );

    std::fs::create_dir_all(&args.out)
        .with_context(|| format!("creating {}", args.out.display()))?;
    let traces = [
        ("interactive", demo_trace(&args)),
        ("batch", batch_trace(&args)),
    ];
    for (name, rows) in &traces {
        let path = args.out.join(format!("{name}.jsonl"));
        let file =
            std::fs::File::create(&path).with_context(|| format!("creating {}", path.display()))?;
        write_jsonl(std::io::BufWriter::new(file), rows)?;
    }
    eprintln!(
        "headroom demo: interactive: {} chat turns from {} tenants' conversations (592-token system prompts), {} req/s; batch: {} RAG requests at {} req/s from t = {} s",
        args.requests,
        args.tenants,
        args.rate,
        args.batch_requests,
        args.batch_rate,
        args.batch_after
    );

    let runs = async {
        let mut runs = Vec::new();
        for mode in [Mode::RoundRobin, Mode::Headroom] {
            reset_caches(&urls).await;
            runs.push(run_mode(&args, mode, &urls).await?);
        }
        anyhow::Ok(runs)
    }
    .await;
    for r in fleet {
        r.shutdown().await?;
    }
    let runs = runs?;
    print!("{}", comparison_text(&args, &runs));
    let report = args.out.join("report.html");
    std::fs::write(&report, report_page(&args, &runs))
        .with_context(|| format!("writing {}", report.display()))?;
    eprintln!(
        "headroom demo: report {}; the proxy's own trace of every request {}",
        report.display(),
        args.out.join("headroom/capture.jsonl").display()
    );
    let lost: u64 = runs
        .iter()
        .flat_map(|r| [&r.interactive, &r.batch])
        .map(unanswered)
        .sum();
    anyhow::ensure!(lost == 0, "{lost} requests got no HTTP answer at all");
    Ok(())
}

/// One run of both traces at once; the batch replay starts `batch_after` seconds after the chat.
async fn run_mode(args: &DemoArgs, mode: Mode, urls: &[String]) -> anyhow::Result<Run> {
    let out = args.out.join(mode.dir());
    std::fs::create_dir_all(&out).with_context(|| format!("creating {}", out.display()))?;
    let proxy = match mode {
        Mode::RoundRobin => None,
        Mode::Headroom => {
            let text = proxy_config(&out, urls);
            let path = out.join("headroom.toml");
            std::fs::write(&path, &text)?;
            let cfg = headroom_config::parse_toml::<ServeConfig>(&text, &path)?
                .validated()
                .map_err(|e| anyhow::anyhow!("demo proxy config: {e:?}"))?;
            // A fresh capture per run: the file is appended to otherwise.
            if let Some(capture) = &cfg.capture.path {
                let _ = std::fs::remove_file(capture);
            }
            let handle = headroom_proxy::start(cfg).await?;
            crate::export_allocator_metrics(&handle.metrics)?;
            Some(handle)
        }
    };
    let targets: Vec<String> = match &proxy {
        Some(p) => vec![format!("http://{}", p.addr)],
        None => urls.to_vec(),
    };
    eprintln!(
        "headroom demo: run {}: {}",
        mode.dir(),
        match mode {
            Mode::RoundRobin =>
                "round-robin over every replica, no admission (config: none)".to_owned(),
            Mode::Headroom => format!(
                "through headroom serve (config: {})",
                out.join("headroom.toml").display()
            ),
        }
    );
    let before = scrape(urls).await;
    let counters = [Arc::new(Counters::default()), Arc::new(Counters::default())];
    let totals = [args.requests, args.batch_requests];
    let progress = tokio::spawn(show_progress(counters.clone(), totals));
    let replay = |class: &str, counters: Arc<Counters>| {
        let flags = replay_flags(args, mode, class, &targets, &out);
        async move { run_replay_counted(ReplayArgs::from_flags(flags)?, counters).await }
    };
    let batch_after = Duration::from_secs_f64(args.batch_after);
    let (interactive, batch) = tokio::join!(replay("interactive", counters[0].clone()), async {
        tokio::time::sleep(batch_after).await;
        replay("batch", counters[1].clone()).await
    });
    progress.abort();
    eprintln!();
    let after = scrape(urls).await;
    let stats = match proxy {
        Some(p) => {
            let url = format!("http://{}/stats", p.admin_addr);
            let stats = async { reqwest::get(url).await?.json::<Value>().await }.await;
            p.shutdown().await;
            stats.ok()
        }
        None => None,
    };
    if let Some(stats) = &stats {
        std::fs::write(out.join("stats.json"), serde_json::to_vec_pretty(stats)?)?;
    }
    let read = |p: PathBuf| -> anyhow::Result<Value> {
        Ok(serde_json::from_str(&std::fs::read_to_string(p)?)?)
    };
    Ok(Run {
        mode,
        interactive: read(interactive?)?,
        batch: read(batch?)?,
        engines: EngineDelta {
            prefix_queries: after.prefix_queries - before.prefix_queries,
            prefix_hits: after.prefix_hits - before.prefix_hits,
            preemptions: after.preemptions - before.preemptions,
        },
        proxy_stats: stats,
    })
}

/// `headroom replay` flags for one class of one run.
fn replay_flags(
    args: &DemoArgs,
    mode: Mode,
    class: &str,
    targets: &[String],
    out: &Path,
) -> Vec<String> {
    let how = match mode {
        Mode::RoundRobin => "round-robin to every replica, no admission",
        Mode::Headroom => "headroom serve: interactive and batch pools, prefix_affinity, admission",
    };
    let mut flags: Vec<String> = [
        "--trace",
        &args
            .out
            .join(format!("{class}.jsonl"))
            .display()
            .to_string(),
        "--target",
        &targets.join(","),
        "--endpoint",
        "chat",
        "--seed",
        &args.seed.to_string(),
        // The same prompt text in both runs (caches are emptied in between).
        "--prompt-salt",
        &args.seed.to_string(),
        "--header",
        &format!("{CLASS_HEADER}: {class}"),
        "--hardware",
        &format!(
            "headroom sim: {} × Llama-3.1-8B on H100 (roofline), {} KV blocks each; {how}",
            args.replicas, args.kv_blocks
        ),
        "--timeout",
        "600",
        "--quiet",
        "--out",
        &out.join(class).display().to_string(),
    ]
    .map(str::to_owned)
    .into();
    if class == "interactive" {
        flags.push("--slo".into());
        flags.push(format!("ttft={SLO_TTFT_MS},tpot={SLO_TPOT_MS}"));
    }
    flags
}

/// The proxy's config for the headroom run: replicas split into an interactive pool (first half)
/// and a batch pool; chat is interactive (priority 10, its SLO), the batch job waits its turn at the
/// proxy (priority −10, a long queue deadline); admission caps each replica below preemption.
fn proxy_config(out: &Path, urls: &[String]) -> String {
    let half = urls.len().div_ceil(2);
    let names = |range: std::ops::Range<usize>| -> String {
        range
            .map(|i| format!("\"r{i}\""))
            .collect::<Vec<_>>()
            .join(", ")
    };
    let mut text = String::from(
        "# Written by `headroom demo`: the proxy of the headroom run.\n\
         listen = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\n\n",
    );
    for (i, u) in urls.iter().enumerate() {
        text.push_str(&format!("[[backends]]\nname = \"r{i}\"\nurl = \"{u}\"\n\n"));
    }
    text.push_str(&format!(
        "[routing]\npolicy = \"prefix_affinity\"\n\n\
         [admission]\nenabled = true\n\
         # Caps start at ⌊headroom · KV tokens / context⌋ per replica (context_tokens until each\n\
         # replica has learnt the mean of its own requests), then follow its gauges.\n\
         context_tokens = 6000\n\
         # Short chat turns and long RAG requests share the interactive replicas (batch borrows\n\
         # them): a cap in sequences alone cannot tell them apart, a budget in tokens can.\n\
         token_budget = true\n\n\
         [[pools]]\nname = \"interactive\"\nbackends = [{}]\n\n\
         # Batch may use an interactive replica while that one is under a quarter of its cap.\n\
         [[pools]]\nname = \"batch\"\nbackends = [{}]\nborrow = [\"interactive\"]\nborrow_below = 0.25\n\n\
         [classes.default]\npool = \"interactive\"\n\n\
         [classes.interactive]\npool = \"interactive\"\npriority = 10\n\
         [classes.interactive.slo]\nttft_ms = {SLO_TTFT_MS}\ntpot_ms = {SLO_TPOT_MS}\n\n\
         [classes.batch]\npool = \"batch\"\npriority = -10\nqueue_timeout_ms = 600000\nmax_queue = 100000\n\n\
         [capture]\npath = \"{}\"\n",
        names(0..half),
        names(half..urls.len()),
        out.join("capture.jsonl").display().to_string().replace('\\', "/"),
    ));
    text
}

/// Sums the replicas' prefix-cache and preemption counters.
async fn scrape(urls: &[String]) -> EngineDelta {
    let client = reqwest::Client::new();
    let mut sum = EngineDelta::default();
    for u in urls {
        let Ok(resp) = client
            .get(format!("{u}/metrics"))
            .timeout(Duration::from_secs(10))
            .send()
            .await
        else {
            continue;
        };
        let g = EngineGauges::parse(&resp.text().await.unwrap_or_default());
        sum.prefix_queries += g.prefix_queries_total.unwrap_or(0.0);
        sum.prefix_hits += g.prefix_hits_total.unwrap_or(0.0);
        sum.preemptions += g.preemptions_total.unwrap_or(0.0);
    }
    sum
}

/// One progress line for both replays of a run.
async fn show_progress(counters: [Arc<Counters>; 2], totals: [usize; 2]) {
    use std::io::IsTerminal;
    let tty = std::io::stderr().is_terminal();
    let mut tick = tokio::time::interval(Duration::from_millis(if tty { 250 } else { 5000 }));
    loop {
        tick.tick().await;
        let part = |c: &Counters, total: usize, name: &str| {
            let (sent, done, failed) = (
                c.sent.load(Ordering::Relaxed),
                c.done.load(Ordering::Relaxed),
                c.failed.load(Ordering::Relaxed),
            );
            let width = 20;
            let filled = (done * width).checked_div(total).unwrap_or(0).min(width);
            format!(
                "{name} [{}{}] {done}/{total} ({} in flight, {failed} failed)",
                "#".repeat(filled),
                "-".repeat(width - filled),
                sent - done
            )
        };
        let line = format!(
            "{}  {}",
            part(&counters[0], totals[0], "interactive"),
            part(&counters[1], totals[1], "batch")
        );
        if tty {
            eprint!("\r{line}   ");
        } else {
            eprintln!("{line}");
        }
    }
}

/// Empties every replica's prefix cache, so each run starts as cold as the first.
async fn reset_caches(urls: &[String]) {
    let client = reqwest::Client::new();
    for u in urls {
        let _ = client.post(format!("{u}/reset_prefix_cache")).send().await;
    }
}

fn num(d: &Value, path: &[&str]) -> f64 {
    path.iter()
        .fold(d, |v, k| &v[*k])
        .as_f64()
        .unwrap_or(f64::NAN)
}

/// Requests the proxy (or engine) answered 429 or 503: refused, with Retry-After.
fn refused(d: &Value) -> u64 {
    ["status_429", "status_503"]
        .iter()
        .filter_map(|k| d["summary"]["errors"][*k].as_u64())
        .sum()
}

/// Requests that got no HTTP answer at all (connection failures, no answer in time).
fn unanswered(d: &Value) -> u64 {
    ["transport", "timeout"]
        .iter()
        .filter_map(|k| d["summary"]["errors"][*k].as_u64())
        .sum()
}

/// Requests that failed other than by being refused: errors, cut streams, no answer.
fn failed(d: &Value) -> u64 {
    d["summary"]["failed"]
        .as_u64()
        .unwrap_or(0)
        .saturating_sub(refused(d))
}

/// One row of the comparison, as cells.
fn row_cells(r: &Run) -> Vec<String> {
    let i = &r.interactive;
    let b = &r.batch;
    vec![
        r.mode.label().to_owned(),
        format!("{:.1}%", 100.0 * r.engines.hit_rate()),
        format!("{:.0} ms", num(i, &["summary", "ttft", "p50_ms"])),
        format!("{:.0} ms", num(i, &["summary", "ttft", "p99_ms"])),
        format!("{:.1} ms", num(i, &["summary", "tpot", "p99_ms"])),
        format!(
            "{:.2} r/s ({}/{})",
            num(i, &["summary", "goodput", "requests_per_s"]),
            num(i, &["summary", "goodput", "good_requests"]),
            num(i, &["summary", "measured"]),
        ),
        format!("{:.0}", r.engines.preemptions),
        format!("{}", refused(i) + refused(b)),
        format!("{}", failed(i) + failed(b)),
        format!(
            "{}/{} in {:.0} s",
            num(b, &["summary", "completed"]),
            num(b, &["summary", "measured"]),
            num(b, &["summary", "duration_s"]),
        ),
    ]
}

const COLUMNS: [&str; 10] = [
    "",
    "prefix hit",
    "TTFT p50",
    "TTFT p99",
    "TPOT p99",
    "goodput (good/all)",
    "preemptions",
    "refused",
    "failed",
    "batch done",
];

/// The side-by-side table and what it means, as printed.
fn comparison_text(args: &DemoArgs, runs: &[Run]) -> String {
    let rows: Vec<Vec<String>> = runs.iter().map(row_cells).collect();
    let widths: Vec<usize> = (0..COLUMNS.len())
        .map(|c| {
            rows.iter()
                .map(|r| r[c].chars().count())
                .chain([COLUMNS[c].chars().count()])
                .max()
                .unwrap_or(0)
        })
        .collect();
    let line = |cells: Vec<&str>| -> String {
        let mut s = String::new();
        for (c, cell) in cells.iter().enumerate() {
            let pad = widths[c] - cell.chars().count();
            if c == 0 {
                s.push_str(cell);
                s.push_str(&" ".repeat(pad));
            } else {
                s.push_str("  ");
                s.push_str(&" ".repeat(pad));
                s.push_str(cell);
            }
        }
        s.push('\n');
        s
    };
    let mut text = String::from("\n");
    text.push_str(&line(COLUMNS.to_vec()));
    for r in &rows {
        text.push_str(&line(r.iter().map(String::as_str).collect()));
    }
    text.push_str(&format!(
        "\nprefix hit: the replicas' own prefix-cache hit rate over the run (all traffic); TTFT, TPOT and goodput:\n\
         the interactive chat, goodput = requests per second meeting TTFT ≤ {SLO_TTFT_MS} ms and TPOT ≤ {SLO_TPOT_MS} ms;\n\
         preemptions: the replicas' own counter; refused: 429/503 answers (with Retry-After); failed: other\n\
         errors and cut streams; batch done: the {} RAG requests completed and the time the job took. Same traces, same seed ({}), cold caches each run.\n",
        args.batch_requests, args.seed
    ));
    if let Some(stats) = runs.iter().find_map(|r| r.proxy_stats.as_ref()) {
        if let Some(windows) = stats["windows"]["5m"].as_array() {
            text.push_str("headroom's own passive measurement of its run, per class (/stats):\n");
            for w in windows {
                let n = |p: &[&str]| num(w, p);
                text.push_str(&format!(
                    "  {:<12} {:>4} requests, {:>4} good; TTFT p50 {:.0} ms, p99 {:.0} ms; TPOT p99 {:.1} ms; queue p99 {:.0} ms\n",
                    w["class"].as_str().unwrap_or("?"),
                    n(&["requests"]),
                    n(&["good"]),
                    n(&["latency", "ttft_ms", "p50"]),
                    n(&["latency", "ttft_ms", "p99"]),
                    n(&["latency", "tpot_ms", "p99"]),
                    n(&["latency", "queue_ms", "p99"]),
                ));
            }
        }
    }
    text.push_str(&format!(
        "results: {} (report.html; per run: interactive/ and batch/ with result.json, the workload contract and every request)\n",
        args.out.display()
    ));
    text
}

/// The demo's HTML page: the table, then the interactive TTFT and TPOT distributions of both runs.
fn report_page(args: &DemoArgs, runs: &[Run]) -> String {
    let rows: Vec<Vec<String>> = runs
        .iter()
        .map(|r| row_cells(r).iter().map(|c| html::escape(c)).collect())
        .collect();
    let mut summary = html::table(&COLUMNS, &rows);
    summary.push_str(&format!(
        "<p>Interactive: {} chat turns of {} tenants at {} req/s, SLO TTFT ≤ {SLO_TTFT_MS} ms, TPOT ≤ {SLO_TPOT_MS} ms. \
         Batch: {} RAG requests at {} req/s from t = {} s. {} simulated Llama-3.1-8B/H100 replicas with {} KV blocks each; seed {}.</p>",
        args.requests,
        args.tenants,
        args.rate,
        args.batch_requests,
        args.batch_rate,
        args.batch_after,
        args.replicas,
        args.kv_blocks,
        args.seed
    ));
    summary.push_str("<p>Each run's own report, with its workload contract: ");
    let links: Vec<String> = runs
        .iter()
        .flat_map(|r| {
            ["interactive", "batch"].map(|class| {
                let href = format!("{}/{class}/report.html", r.mode.dir());
                format!("<a href=\"{href}\">{}</a>", html::escape(&href))
            })
        })
        .collect();
    summary.push_str(&links.join(", "));
    summary.push_str("</p>");
    let chart = |title: &str, field: &str, unit: &str| -> Chart {
        // Each run's values, and how many requests it measured: a request that failed has none,
        // and its run's curve stays below 1 by that much.
        let samples: Vec<(Vec<f64>, usize)> = runs
            .iter()
            .map(|r| {
                let rows = r.interactive["requests"].as_array();
                let measured = rows.map_or(0, |rows| {
                    rows.iter().filter(|q| q["warmup"] != true).count()
                });
                let mut v: Vec<f64> = rows
                    .map(|rows| rows.iter().filter_map(|q| q[field].as_f64()).collect())
                    .unwrap_or_default();
                v.sort_by(f64::total_cmp);
                (v, measured)
            })
            .collect();
        let mut x: Vec<f64> = samples.iter().flat_map(|(v, _)| v).copied().collect();
        x.sort_by(f64::total_cmp);
        x.dedup();
        let series = runs
            .iter()
            .zip(&samples)
            .map(|(r, (s, measured))| Series {
                label: r.mode.label().to_owned(),
                values: x
                    .iter()
                    .map(|&v| {
                        (*measured > 0)
                            .then(|| s.partition_point(|&y| y <= v) as f64 / *measured as f64)
                    })
                    .collect(),
                style: Style::Line,
            })
            .collect();
        Chart {
            title: title.to_owned(),
            x_label: unit.to_owned(),
            y_label: "fraction of requests ≤ x".to_owned(),
            log_x: true,
            log_y: false,
            x,
            series,
        }
    };
    html::page(
        "headroom demo",
        "the same chat and batch traffic, served round-robin and through headroom",
        &[
            Section {
                heading: "Side by side".into(),
                html: summary,
                charts: Vec::new(),
            },
            Section {
                heading: "Interactive latency".into(),
                html: String::new(),
                charts: vec![
                    chart("TTFT of the chat turns", "ttft_ms", "ms"),
                    chart("TPOT of the chat turns", "tpot_ms", "ms"),
                ],
            },
        ],
    )
}
