//! `headroom trace import|synth` and `headroom replay`: flags, the run's contract, progress output
//! and the result files (JSON with the contract and every request, CSV, text).

use std::fs::File;
use std::io::{BufReader, BufWriter, IsTerminal};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use anyhow::{Context, bail};
use clap::{Args, Subcommand, ValueEnum};
use headroom_workload::trace::{self, TraceRecord};
use serde_json::{Value, json};
use sha2::Digest;

use crate::analysis;
use crate::contracts::{Contract, synthesize};
use crate::outputs;
use crate::pages;
use crate::replay::{self, Arrivals, Counters, ReplayOptions};
use crate::report::{self, Dist, RequestRow, Slo, Summary};
use crate::stalls::StallMeter;
use crate::synth::Endpoint;

/// Schema name of replay result files (docs/replay-results.md).
pub const RESULT_SCHEMA: &str = "headroom.replay.v1";

/// `headroom trace …`.
#[derive(Debug, Subcommand)]
pub enum TraceCommand {
    /// Convert a public trace (Mooncake JSONL, Azure CSV, BurstGPT CSV) to a headroom trace.
    Import(ImportArgs),
    /// Generate a trace from a named workload contract.
    Synth(SynthArgs),
    /// Summarize a trace: requests, span, length percentiles, prefix sharing and the offline
    /// ideal prefix-cache hit rate (two traces with the same structure print the same numbers).
    Info(InfoArgs),
}

/// Flags of `headroom trace info`.
#[derive(Debug, Args)]
pub struct InfoArgs {
    /// The trace (any supported format).
    pub input: PathBuf,
    /// Also the ideal hit rate of one LRU cache of this many tokens.
    #[arg(long)]
    pub cache_tokens: Option<u64>,
    /// Print JSON instead of text.
    #[arg(long)]
    pub json: bool,
}

/// Source formats `trace import` reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum SourceFormat {
    /// Mooncake JSONL (also headroom's own traces).
    Mooncake,
    /// Azure LLM inference trace CSV (TIMESTAMP, ContextTokens, GeneratedTokens).
    Azure,
    /// BurstGPT CSV.
    Burstgpt,
}

/// Flags of `headroom trace import`.
#[derive(Debug, Args)]
pub struct ImportArgs {
    /// The source file.
    pub input: PathBuf,
    /// Its format.
    #[arg(long, value_enum)]
    pub format: SourceFormat,
    /// Where to write the headroom trace (JSONL).
    #[arg(long, short)]
    pub output: PathBuf,
    /// Keep only the first N requests.
    #[arg(long)]
    pub max_requests: Option<usize>,
}

/// Flags of `headroom trace synth`.
#[derive(Debug, Args)]
pub struct SynthArgs {
    /// The workload contract.
    #[arg(long, value_enum)]
    pub contract: Contract,
    /// Requests to generate.
    #[arg(long, default_value_t = 1000)]
    pub requests: usize,
    /// Mean arrival rate, requests per second (Poisson).
    #[arg(long, default_value_t = 5.0)]
    pub rate: f64,
    /// Seed.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Where to write the trace (JSONL).
    #[arg(long, short)]
    pub output: PathBuf,
}

/// Reads a trace file in any supported format, guessing from the extension (`.csv`: Azure or
/// BurstGPT by header; anything else: JSONL).
pub fn read_trace(path: &Path, format: Option<SourceFormat>) -> anyhow::Result<Vec<TraceRecord>> {
    let open = || -> anyhow::Result<BufReader<File>> {
        Ok(BufReader::new(File::open(path).with_context(|| {
            format!("opening trace {}", path.display())
        })?))
    };
    let format = match format {
        Some(f) => f,
        None if path
            .extension()
            .is_some_and(|e| e.eq_ignore_ascii_case("csv")) =>
        {
            let head = std::fs::read_to_string(path)
                .map(|s| s.lines().next().unwrap_or("").to_ascii_lowercase())?;
            if head.contains("contexttokens") {
                SourceFormat::Azure
            } else {
                SourceFormat::Burstgpt
            }
        }
        None => SourceFormat::Mooncake,
    };
    let records = match format {
        SourceFormat::Mooncake => trace::read_jsonl(open()?).map(|mut r| {
            // Rows without hash ids share nothing (their filler text must not collide).
            trace::fill_unique_hash_ids(&mut r);
            r
        }),
        SourceFormat::Azure => trace::import_azure(open()?).map(|i| skipped(path, i)),
        SourceFormat::Burstgpt => trace::import_burstgpt(open()?).map(|i| skipped(path, i)),
    }
    .with_context(|| format!("reading trace {}", path.display()))?;
    // A capture's shadow records are copies of requests already in it, not traffic.
    let all = records.len();
    let records: Vec<TraceRecord> = records.into_iter().filter(|r| r.shadow.is_none()).collect();
    if records.len() < all {
        eprintln!(
            "{}: left out {} shadow records (copies sent to a candidate pool; `headroom report compare` reads them)",
            path.display(),
            all - records.len()
        );
    }
    if records.is_empty() {
        bail!("trace {} holds no requests", path.display());
    }
    Ok(records)
}

/// A replay's `result.json` (or a merge of them), refusing any other JSON by name.
fn read_result(path: &Path) -> anyhow::Result<Value> {
    let doc = read_json(path)?;
    match doc["schema"].as_str() {
        Some(RESULT_SCHEMA) => Ok(doc),
        Some("headroom.sweep.v1") => bail!(
            "{} is a sweep's result: `report compare` takes the result.json of two runs",
            path.display()
        ),
        _ => bail!(
            "{} is not a replay result (no \"schema\": \"{RESULT_SCHEMA}\")",
            path.display()
        ),
    }
}

/// An import's records, saying how many rows it left out.
fn skipped(path: &Path, import: trace::Import) -> Vec<TraceRecord> {
    if import.skipped_empty > 0 {
        eprintln!(
            "{}: left out {} rows with no prompt tokens (nothing to replay)",
            path.display(),
            import.skipped_empty
        );
    }
    import.records
}

fn write_trace(path: &Path, records: &[TraceRecord]) -> anyhow::Result<()> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)?;
    }
    let file = File::create(path).with_context(|| format!("creating {}", path.display()))?;
    trace::write_jsonl(BufWriter::new(file), records)?;
    Ok(())
}

/// Runs `headroom trace …`.
pub fn run_trace(cmd: TraceCommand) -> anyhow::Result<()> {
    match cmd {
        TraceCommand::Import(a) => {
            outputs::not_an_input(&a.output, &[&a.input])?;
            let mut records = read_trace(&a.input, Some(a.format))?;
            if let Some(n) = a.max_requests {
                if n == 0 {
                    bail!(
                        "--max-requests 0 would write a trace with no requests, which nothing reads"
                    );
                }
                records.truncate(n);
            }
            write_trace(&a.output, &records)?;
            eprintln!("wrote {} requests to {}", records.len(), a.output.display());
        }
        TraceCommand::Synth(a) => {
            if a.requests == 0 || !a.rate.is_finite() || a.rate <= 0.0 {
                bail!("--requests and --rate must be positive");
            }
            let records = synthesize(a.contract, a.requests, a.rate, a.seed);
            write_trace(&a.output, &records)?;
            eprintln!(
                "wrote {} requests ({:?} contract, seed {}) to {}",
                records.len(),
                a.contract,
                a.seed,
                a.output.display()
            );
        }
        TraceCommand::Info(a) => {
            let records = read_trace(&a.input, None)?;
            if records.is_empty() {
                bail!("{} holds no requests", a.input.display());
            }
            let info = trace_info(&records, a.cache_tokens);
            if a.json {
                println!("{}", serde_json::to_string_pretty(&info)?);
            } else {
                print!("{}", trace_info_text(&info));
            }
        }
    }
    Ok(())
}

/// The numbers `trace info` prints.
pub fn trace_info(records: &[TraceRecord], cache_tokens: Option<u64>) -> Value {
    let dist = |f: &dyn Fn(&TraceRecord) -> f64| {
        let mut v: Vec<f64> = records.iter().map(f).collect();
        report::Dist::of(&mut v)
    };
    let blocks: std::collections::HashSet<u64> = records
        .iter()
        .flat_map(|r| r.hash_ids.iter().copied())
        .collect();
    let total_blocks: usize = records.iter().map(|r| r.hash_ids.len()).sum();
    let span_ms = records.last().map_or(0, |r| r.timestamp) - records[0].timestamp;
    let mut doc = json!({
        "requests": records.len(),
        "span_s": span_ms as f64 / 1e3,
        "input_length": dist(&|r| f64::from(r.input_length)).as_count(),
        "output_length": dist(&|r| f64::from(r.output_length)).as_count(),
        "input_tokens_total": records.iter().map(|r| u64::from(r.input_length)).sum::<u64>(),
        "output_tokens_total": records.iter().map(|r| u64::from(r.output_length)).sum::<u64>(),
        "hash_ids": total_blocks,
        "distinct_hash_ids": blocks.len(),
        "ideal_hit_rate_unbounded": trace::offline_prefix_hit_rate(records, u64::MAX / 2),
    });
    if let Some(c) = cache_tokens {
        doc["cache_tokens"] = json!(c);
        doc["ideal_hit_rate_at_cache"] = json!(trace::offline_prefix_hit_rate(records, c));
    }
    doc
}

fn trace_info_text(d: &Value) -> String {
    let n = |v: &Value| v.as_f64().unwrap_or(f64::NAN);
    let lens = |k: &str| {
        let x = &d[k];
        format!(
            "p50 {:.0}, p90 {:.0}, p99 {:.0}, max {:.0} (mean {:.1})",
            n(&x["p50"]),
            n(&x["p90"]),
            n(&x["p99"]),
            n(&x["max"]),
            n(&x["mean"])
        )
    };
    let mut s = format!(
        "requests: {} over {:.1} s\ninput tokens: {}\noutput tokens: {}\nhash ids: {} ({} distinct)\nideal prefix-cache hit rate, unbounded cache: {:.4}\n",
        d["requests"],
        n(&d["span_s"]),
        lens("input_length"),
        lens("output_length"),
        d["hash_ids"],
        d["distinct_hash_ids"],
        n(&d["ideal_hit_rate_unbounded"]),
    );
    if d.get("cache_tokens").is_some() {
        s.push_str(&format!(
            "ideal prefix-cache hit rate, {} tokens of cache: {:.4}\n",
            d["cache_tokens"],
            n(&d["ideal_hit_rate_at_cache"])
        ));
    }
    s
}

/// Flags of `headroom replay`.
#[derive(Debug, Clone, Args)]
pub struct ReplayArgs {
    /// The trace (headroom/Mooncake JSONL, Azure or BurstGPT CSV).
    #[arg(long)]
    pub trace: PathBuf,
    /// Base URL of the target (a proxy or an engine); several (repeated or comma-separated) are
    /// visited round-robin, as a plain load balancer would.
    #[arg(long, required = true, num_args = 1.., value_delimiter = ',')]
    pub target: Vec<String>,
    /// Replicas behind the target (e.g. behind a proxy) whose `/metrics` tell the run's prefix-cache
    /// hit rate; the trace's ideal is then computed for one cache of their combined KV capacity.
    /// Default: the targets themselves.
    #[arg(long, num_args = 1.., value_delimiter = ',', value_name = "URL")]
    pub observe: Vec<String>,
    /// Endpoint the prompts are sent to.
    #[arg(long, value_enum, default_value_t = Endpoint::Completions)]
    pub endpoint: Endpoint,
    /// `model` to send (default: the first model the target lists).
    #[arg(long)]
    pub model: Option<String>,
    /// Replay at the trace's own timestamps, gaps multiplied by this (the default, at 1).
    #[arg(long, conflicts_with_all = ["rate", "concurrency"])]
    pub time_scale: Option<f64>,
    /// Replay at this mean rate (requests/s) instead of the trace's timestamps.
    #[arg(long, conflicts_with = "concurrency")]
    pub rate: Option<f64>,
    /// Gamma shape of the gaps at --rate: 1 is Poisson, lower is burstier.
    #[arg(long, default_value_t = 1.0)]
    pub burstiness: f64,
    /// Keep this many requests in flight instead (closed loop).
    #[arg(long)]
    pub concurrency: Option<usize>,
    /// Stop sending after this many seconds.
    #[arg(long)]
    pub duration: Option<f64>,
    /// Use only the first N requests of the trace (before sharding).
    #[arg(long)]
    pub max_requests: Option<usize>,
    /// Leading requests whose numbers are discarded.
    #[arg(long, default_value_t = 0)]
    pub warmup: usize,
    /// Goodput objectives, e.g. `ttft=400,tpot=50` (ms).
    #[arg(long)]
    pub slo: Option<String>,
    /// This load generator's share of the trace: `i/n` keeps rows with index % n == i.
    #[arg(long)]
    pub shard: Option<String>,
    /// Seed of arrivals and prompt text.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Salt mixed into prompt text (default: fresh per run, so no run profits from a cache an
    /// earlier run warmed; give the contract's value to repeat a run exactly). Shards of one run
    /// derive it from --seed unless it is given.
    #[arg(long)]
    pub prompt_salt: Option<u64>,
    /// Per-request timeout, seconds.
    #[arg(long, default_value_t = 600.0)]
    pub timeout: f64,
    /// Free-text label of the hardware under test, recorded in the contract.
    #[arg(long, default_value = "unspecified")]
    pub hardware: String,
    /// An extra request header, `Name: value` (repeatable), e.g. `x-headroom-class: batch`. The
    /// contract records the names only (values may be keys).
    #[arg(long = "header", value_name = "NAME: VALUE", value_parser = parse_header)]
    pub headers: Vec<(String, String)>,
    /// Open loop: send each request's headers and body up to its last byte ahead of its time (at
    /// most 10 ms) and the last byte on time, so that the target holds every request of a burst
    /// complete on schedule even when one core must hand many large prompts over at once. Send
    /// times and TTFT then count from the last byte. A proxy in front that times requests from
    /// their headers counts the wait for that byte as its own.
    #[arg(long, conflicts_with = "concurrency")]
    pub prestage: bool,
    /// Sweep the load instead of one run: `concurrency:1,2,4,8` or `rate:1,2,4`, one run of
    /// --sweep-duration seconds per level, each with fresh prompt text (no cache reuse between
    /// levels). Finds the knee and the largest level within the SLO.
    #[arg(long, conflicts_with_all = ["rate", "concurrency", "time_scale"])]
    pub sweep: Option<String>,
    /// Seconds per sweep level.
    #[arg(long, default_value_t = 30.0)]
    pub sweep_duration: f64,
    /// Directory for result.json, requests.csv, summary.txt and report.html (sweeps: sweep.*).
    #[arg(long, default_value = "results/replay")]
    pub out: PathBuf,
    /// No progress line and no summary on stdout (the result files are written all the same).
    #[arg(long, short = 'q')]
    pub quiet: bool,
}

fn parse_header(s: &str) -> Result<(String, String), String> {
    let (k, v) = s
        .split_once(':')
        .ok_or_else(|| format!("`{s}`: write a header as `Name: value`"))?;
    let k = k.trim();
    if k.is_empty()
        || !k
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
    {
        return Err(format!("`{k}` is not a header name"));
    }
    Ok((k.to_ascii_lowercase(), v.trim().to_owned()))
}

#[derive(Debug, clap::Parser)]
struct ReplayFlags {
    #[command(flatten)]
    args: ReplayArgs,
}

impl ReplayArgs {
    /// Parses `headroom replay` flags from a list (for the demo and tests).
    pub fn from_flags<I, S>(flags: I) -> Result<Self, clap::Error>
    where
        I: IntoIterator<Item = S>,
        S: Into<std::ffi::OsString> + Clone,
    {
        use clap::Parser;
        let argv = std::iter::once(std::ffi::OsString::from("replay"))
            .chain(flags.into_iter().map(Into::into));
        ReplayFlags::try_parse_from(argv).map(|f| f.args)
    }
}

fn parse_shard(s: &str) -> anyhow::Result<(usize, usize)> {
    let (i, n) = s.split_once('/').context("--shard is i/n, e.g. 0/4")?;
    let number = |x: &str| {
        x.trim().parse::<usize>().with_context(|| {
            format!("--shard {s}: {x:?} is not a whole number (the form is i/n, e.g. 0/4)")
        })
    };
    let (i, n) = (number(i)?, number(n)?);
    if n == 0 || i >= n {
        bail!("--shard {s}: need 0 <= i < n");
    }
    Ok((i, n))
}

/// Refuses results that are not distinct shards of one split of a trace (a request in two of
/// them, or shards of different counts), and warns when shards are missing.
fn check_shards(docs: &[Value], paths: &[PathBuf], rows: &[RequestRow]) -> anyhow::Result<()> {
    let mut shards: Vec<(usize, usize, &Path)> = Vec::new();
    for (doc, path) in docs.iter().zip(paths) {
        if let Some(spec) = doc["contract"]["trace"]["shard"].as_str() {
            let (i, n) =
                parse_shard(spec).with_context(|| format!("reading {}", path.display()))?;
            shards.push((i, n, path));
        }
    }
    if let Some(&(_, n, first)) = shards.first() {
        if let Some((_, m, other)) = shards.iter().find(|s| s.1 != n) {
            bail!(
                "{} is a shard of {n} and {} a shard of {m}: shards of one run split the trace alike",
                first.display(),
                other.display()
            );
        }
    }
    let mut seen = std::collections::HashMap::new();
    for (doc, path) in docs.iter().zip(paths) {
        for index in doc["requests"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|r| r["index"].as_u64())
        {
            if let Some(before) = seen.insert(index, path) {
                bail!(
                    "trace row {index} is in both {} and {}: the same shard given twice, or overlapping shards",
                    before.display(),
                    path.display()
                );
            }
        }
    }
    if let Some(&(_, n, _)) = shards.first() {
        let have: std::collections::BTreeSet<usize> = shards.iter().map(|s| s.0).collect();
        let missing: Vec<String> = (0..n)
            .filter(|i| !have.contains(i))
            .map(|i| format!("{i}/{n}"))
            .collect();
        if !missing.is_empty() {
            eprintln!(
                "headroom report merge: WARNING: shards {} are missing; the merged result holds {} requests, not the whole trace",
                missing.join(", "),
                rows.len()
            );
        }
    }
    Ok(())
}

async fn get_json(client: &reqwest::Client, url: &str) -> Option<Value> {
    client
        .get(url)
        .timeout(Duration::from_secs(10))
        .send()
        .await
        .ok()?
        .json()
        .await
        .ok()
}

pub use headroom_workload::engine_metrics::prefix_counters;

/// KV cache size in tokens from `vllm:cache_config_info`, when present.
pub fn kv_cache_tokens(metrics: &str) -> Option<u64> {
    headroom_workload::engine_metrics::EngineGauges::parse(metrics).kv_capacity_tokens()
}

async fn metrics_text(client: &reqwest::Client, base: &str) -> Option<String> {
    client
        .get(format!("{base}/metrics"))
        .timeout(Duration::from_secs(10))
        .send()
        .await
        .ok()?
        .text()
        .await
        .ok()
}

/// A flag that the first Ctrl-C sets: the run stops sending, lets the requests in flight finish
/// for a moment, and saves what finished. A second Ctrl-C quits without saving.
fn stop_on_interrupt(quiet: bool) -> Arc<std::sync::atomic::AtomicBool> {
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let flag = stop.clone();
    tokio::spawn(async move {
        if tokio::signal::ctrl_c().await.is_err() {
            return;
        }
        flag.store(true, Ordering::Relaxed);
        if !quiet {
            eprintln!(
                "\nheadroom replay: interrupted: nothing more is sent; the requests in flight get {} s to finish, then what finished is saved (Ctrl-C again quits without saving)",
                replay::STOP_GRACE.as_secs()
            );
        }
        if tokio::signal::ctrl_c().await.is_ok() {
            std::process::exit(130);
        }
    });
    stop
}

/// The longest run or wait a replay accepts.
const A_YEAR: Duration = Duration::from_secs(365 * 24 * 3600);

/// The longest prompt a replay builds, whatever the target says it takes.
const MAX_PROMPT_TOKENS: u64 = 10_000_000;

/// Runs `headroom replay`; returns the path of the result JSON.
pub async fn run_replay(a: ReplayArgs) -> anyhow::Result<PathBuf> {
    replay_with(a, Arc::default(), true).await
}

/// [`run_replay`] counting sends and completions into `counters` as they happen, so a caller
/// running several replays at once can show one progress line for all of them.
pub async fn run_replay_counted(a: ReplayArgs, counters: Arc<Counters>) -> anyhow::Result<PathBuf> {
    replay_with(a, counters, false).await
}

/// A replay; `interruptible`: the first Ctrl-C stops it and saves what finished (the command
/// line's replay, which owns the process's Ctrl-C; not a replay run inside another command).
async fn replay_with(
    a: ReplayArgs,
    counters: Arc<Counters>,
    interruptible: bool,
) -> anyhow::Result<PathBuf> {
    let mut records = read_trace(&a.trace, None)?;
    let digest = hex(&sha2::Sha256::digest(std::fs::read(&a.trace)?));
    if let Some(n) = a.max_requests {
        records.truncate(n);
    }
    let shard = a.shard.as_deref().map(parse_shard).transpose()?;
    for (name, v) in [
        ("--timeout", Some(a.timeout)),
        ("--duration", a.duration),
        ("--sweep-duration", Some(a.sweep_duration)),
    ] {
        if let Some(v) = v {
            if !(v.is_finite() && v > 0.0 && v <= A_YEAR.as_secs_f64()) {
                bail!("{name} must be a positive number of seconds, at most a year, got {v:?}");
            }
        }
    }
    let arrivals = match (a.concurrency, a.rate, a.time_scale) {
        (Some(0), _, _) => bail!("--concurrency must be at least 1"),
        (Some(n), _, _) => Arrivals::Concurrency(n),
        (None, Some(r), _)
            if r.is_finite() && r > 0.0 && a.burstiness.is_finite() && a.burstiness > 0.0 =>
        {
            Arrivals::Rate {
                rate: r,
                burstiness: a.burstiness,
            }
        }
        (None, Some(_), _) => bail!("--rate and --burstiness must be positive"),
        (None, None, Some(s)) if s.is_finite() && s > 0.0 => Arrivals::Trace { time_scale: s },
        (None, None, Some(_)) => bail!("--time-scale must be positive"),
        (None, None, None) => Arrivals::Trace { time_scale: 1.0 },
    };
    // A shard keeps its rows of the whole trace with the times the whole run would give them, so
    // n load generators together send exactly the contracted load.
    let global_plan = replay::schedule(&records, &arrivals, a.seed);
    let span = global_plan
        .as_ref()
        .and_then(|p| p.iter().max().copied())
        .unwrap_or_default();
    if a.duration.is_none() && span > A_YEAR {
        bail!(
            "the schedule would send its last request {} after the first (more than a year): check --rate, --time-scale and the trace's timestamps, or bound the run with --duration",
            if span == Duration::MAX {
                "too long to count".to_owned()
            } else {
                format!("{:.0} s", span.as_secs_f64())
            }
        );
    }
    let rows: Vec<usize> = match shard {
        Some((i, n)) => (0..records.len()).filter(|k| k % n == i).collect(),
        None => (0..records.len()).collect(),
    };
    let trace_rows = records.len();
    let plan = global_plan.map(|p| rows.iter().map(|&k| p[k]).collect::<Vec<_>>());
    let records: Vec<TraceRecord> = rows.iter().map(|&k| records[k].clone()).collect();
    if records.is_empty() {
        bail!("no requests left to replay after --shard/--max-requests");
    }
    if a.warmup >= records.len() {
        bail!(
            "--warmup {} leaves no request to measure: this run sends {}",
            a.warmup,
            records.len()
        );
    }
    let slo = a
        .slo
        .as_deref()
        .map(Slo::parse)
        .transpose()
        .map_err(|e| anyhow::anyhow!("--slo: {e}"))?;
    let targets: Vec<String> = a
        .target
        .iter()
        .map(|t| t.trim_end_matches('/').to_owned())
        .collect();
    for t in targets.iter().chain(&a.observe) {
        let url = reqwest::Url::parse(t).with_context(|| format!("{t:?} is not a URL"))?;
        if !matches!(url.scheme(), "http" | "https") || url.host_str().is_none() {
            bail!("{t:?} is not an http:// or https:// URL with a host");
        }
    }
    let target = targets[0].clone();
    let client = reqwest::Client::new();
    let models = get_json(&client, &format!("{target}/v1/models")).await;
    let version = get_json(&client, &format!("{target}/version")).await;
    let model = a.model.clone().or_else(|| {
        models.as_ref()?["data"][0]["id"]
            .as_str()
            .map(str::to_owned)
    });
    // A prompt is built whole in memory before it is sent: one longer than the target takes is
    // refused here, before any load, not found out by the engine (or the allocator).
    let max_model_len = models.as_ref().and_then(|m| {
        m["data"].as_array()?.iter().find_map(|c| {
            (model.as_deref().is_none_or(|id| c["id"] == id))
                .then(|| c["max_model_len"].as_u64())?
        })
    });
    let limit = max_model_len
        .unwrap_or(MAX_PROMPT_TOKENS)
        .min(MAX_PROMPT_TOKENS);
    if let Some(r) = records.iter().find(|r| u64::from(r.input_length) > limit) {
        let n = records
            .iter()
            .filter(|r| u64::from(r.input_length) > limit)
            .count();
        bail!(
            "{n} request(s) of {} have prompts longer than {} tokens (the first: {} tokens at timestamp {}): {}",
            a.trace.display(),
            limit,
            r.input_length,
            r.timestamp,
            if max_model_len.is_some_and(|m| m <= MAX_PROMPT_TOKENS) {
                "the target's max_model_len; leave them out of the trace"
            } else {
                "the most a replay builds"
            }
        );
    }
    // Before any load: a run's results must not be lost at its end for want of a place to go.
    let files: &[&str] = if a.sweep.is_some() {
        &["sweep.json", "sweep.html", "sweep.txt"]
    } else {
        &["result.json", "requests.csv", "report.html", "summary.txt"]
    };
    outputs::out_dir(&a.out, files, &[&a.trace])?;
    let behind = !a.observe.is_empty();
    let observed: Vec<String> = if behind {
        a.observe
            .iter()
            .map(|u| u.trim_end_matches('/').to_owned())
            .collect()
    } else {
        targets.clone()
    };
    let mut metrics_before = Vec::new();
    for t in &observed {
        let text = metrics_text(&client, t).await;
        if text.is_none() && behind {
            eprintln!(
                "headroom replay: WARNING: --observe {t}: no /metrics answered, so the run's prefix-cache hit rate is left out"
            );
        }
        metrics_before.push(text);
    }

    let run_id = format!("hr{:08x}", rand::random::<u32>());
    // Shards of one run must render the same prompts, so without an explicit salt they derive it
    // from the seed; a single run draws a fresh one.
    let prompt_salt = a.prompt_salt.unwrap_or_else(|| {
        if shard.is_some() {
            a.seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0x5A17
        } else {
            rand::random::<u64>()
        }
    });
    // Prestaging holds back the last byte of an open-loop send; closed-loop sends (a concurrency
    // run or sweep) go whole, and the contract says which.
    let prestaged = a.prestage
        && !matches!(arrivals, Arrivals::Concurrency(_))
        && !a
            .sweep
            .as_deref()
            .is_some_and(|s| s.trim().starts_with("concurrency"));
    let opts = ReplayOptions {
        targets: targets.clone(),
        endpoint: a.endpoint,
        model: model.clone(),
        arrivals: arrivals.clone(),
        duration: a.duration.map(Duration::from_secs_f64),
        warmup: a.warmup,
        seed: a.seed,
        prompt_salt,
        plan,
        rows: Some(rows.clone()),
        timeout: Duration::from_secs_f64(a.timeout),
        run_id: run_id.clone(),
        headers: a.headers.clone(),
        prestage: prestaged,
        stop: if interruptible {
            stop_on_interrupt(a.quiet)
        } else {
            Arc::default()
        },
    };
    let lengths = |f: fn(&TraceRecord) -> u32| length_stats(records.iter().map(f));
    let contract = json!({
        "trace": {"path": a.trace.display().to_string(), "sha256": digest, "requests": records.len(),
                  "rows_in_trace": trace_rows, "shard": a.shard, "max_requests": a.max_requests},
        "load": match &arrivals {
            Arrivals::Trace { time_scale } => json!({"mode": "trace timestamps", "time_scale": time_scale}),
            Arrivals::Rate { rate, burstiness } => json!({"mode": "rate", "rate": rate, "burstiness": burstiness,
                "process": if *burstiness == 1.0 { "poisson" } else { "gamma" }}),
            Arrivals::Concurrency(n) => json!({"mode": "concurrency", "concurrency": n}),
        },
        "duration_s": a.duration, "warmup_requests": a.warmup,
        "input_tokens": lengths(|r| r.input_length),
        "output_tokens": lengths(|r| r.output_length),
        "output_pinning": "max_tokens = output_length, ignore_eos",
        "sampling": {"temperature": 0},
        "endpoint": a.endpoint.path(), "stream": true,
        "send": if prestaged {
            "prestaged: headers and body but its last byte up to 10 ms early, the last byte at the planned time; send time and client clock from the last byte"
        } else {
            "whole request at the planned time; client clock from just before the POST"
        },
        "prompt_synthesis": "hash id -> seeded block of one-token words; template tokens counted (docs/replay.md)",
        "seed": a.seed,
        "prompt_salt": prompt_salt,
        "slo": slo,
        "target": {
            "url": target,
            "urls": targets,
            "models": models.as_ref().and_then(|m| m["data"].as_array()).map(|d| d.iter().map(|c| json!({
                "id": c["id"], "root": c["root"], "max_model_len": c["max_model_len"]})).collect::<Vec<_>>()),
            "version": version.as_ref().and_then(|v| v["version"].as_str()),
        },
        "model": model,
        "hardware": a.hardware,
        "extra_headers": a.headers.iter().map(|(k, _)| k.as_str()).collect::<Vec<_>>(),
        "tool": {"name": "headroom", "version": env!("CARGO_PKG_VERSION")},
        "run_id": run_id,
    });

    if let Some(spec) = a.sweep.as_deref() {
        let sweep = SweepSpec::parse(spec)?;
        return run_sweep(&a, sweep, records, opts, contract, slo).await;
    }

    let total = records.len();
    if !a.quiet {
        eprintln!(
            "headroom replay: {total} requests from {} against {} ({})",
            a.trace.display(),
            targets.join(", "),
            contract["load"]
        );
    }
    let progress = (!a.quiet).then(|| spawn_progress(counters.clone(), total));
    let stall_meter = StallMeter::start().context("starting the client stall probe")?;
    let stop = opts.stop.clone();
    // The wall clock at the run's time zero: shards of one run are merged on it.
    let open_loop = !matches!(arrivals, Arrivals::Concurrency(_));
    let started_unix_ms = (std::time::SystemTime::now() + replay::start_lead(open_loop))
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64() * 1e3);
    let results = replay::run(records.clone(), opts, counters).await;
    let interrupted = stop.load(Ordering::Relaxed);
    let mut contract = contract;
    if interrupted {
        // The contract says the run is not the whole of what it planned.
        contract["interrupted"] = json!({"finished": results.len(), "planned": total});
    }
    // The contract is the load planned; when `--duration` (or an interruption) ended the
    // schedule early, what was sent of it is said beside it (a closed loop sends as many as the
    // target finishes, so this differs from run to run while the contract does not).
    let sent = (results.len() < total).then(|| {
        // A result's index is its row of the whole trace; `rows` maps the records to those.
        let at: std::collections::HashMap<usize, usize> =
            rows.iter().enumerate().map(|(k, &row)| (row, k)).collect();
        let rows: Vec<&TraceRecord> = results
            .iter()
            .filter_map(|r| at.get(&r.index).and_then(|&k| records.get(k)))
            .collect();
        json!({"requests": rows.len(), "requests_planned": total,
               "input_tokens": length_stats(rows.iter().map(|r| r.input_length)),
               "output_tokens": length_stats(rows.iter().map(|r| r.output_length))})
    });
    let stalls = stall_meter.finish();
    if let Some(progress) = progress {
        progress.abort();
        if std::io::stderr().is_terminal() {
            eprintln!();
        }
    }

    let summary = report::summarize(&results, slo);
    let target_info = observe_targets(
        &client,
        &observed,
        behind,
        &metrics_before,
        &records,
        &rows,
        results.len(),
    )
    .await;
    let rows: Vec<RequestRow> = results.iter().map(RequestRow::from).collect();
    std::fs::create_dir_all(&a.out).with_context(|| format!("creating {}", a.out.display()))?;
    let result_path = a.out.join("result.json");
    let doc = json!({"schema": RESULT_SCHEMA, "contract": contract, "summary": summary, "target_observed": target_info, "client_stalls": stalls,
        "started_unix_ms": started_unix_ms, "sent": sent, "itl_buckets": report::itl_buckets(&results), "requests": rows});
    outputs::write(&result_path, serde_json::to_string_pretty(&doc)?)?;
    outputs::write(&a.out.join("requests.csv"), report::to_csv(&rows))?;
    outputs::write(&a.out.join("report.html"), pages::replay_page(&doc)?)?;
    let mut text = report::to_text(&summary);
    text.push_str(&stalls.line());
    text.push('\n');
    if let Some(h) = target_info.get("prefix_cache_hit_rate") {
        text.push_str(&format!(
            "target prefix-cache hit rate: {:.1}%",
            100.0 * h.as_f64().unwrap_or(0.0)
        ));
        if let Some(o) = target_info.get("offline_prefix_hit_rate") {
            text.push_str(&format!(
                " (offline from hash ids at the same cache size: {:.1}%)",
                100.0 * o.as_f64().unwrap_or(0.0)
            ));
        }
        text.push('\n');
        if let (Some(o), Some(h)) = (target_info["offline_prefix_hit_rate"].as_f64(), h.as_f64()) {
            if h > o + 0.02 {
                text.push_str(&format!(
                    "WARNING: the target's hit rate is {:.1} points above what the trace implies: it held prefixes from before this run (a warm cache), or the prompts share more than their hash ids say\n",
                    100.0 * (h - o)
                ));
            }
        }
    }
    outputs::write(&a.out.join("summary.txt"), &text)?;
    if !a.quiet {
        print!("{text}");
        eprintln!("headroom replay: results in {}", a.out.display());
    }
    if interrupted {
        bail!(
            "interrupted: {} of {} requests finished and are saved in {} (the contract says so)",
            results.len(),
            total,
            a.out.display()
        );
    }
    if summary.measured > 0 && summary.completed == 0 {
        bail!(
            "no request completed ({} failed): see {}",
            summary.failed,
            a.out.join("summary.txt").display()
        );
    }
    Ok(result_path)
}

/// What a sweep varies.
#[derive(Debug, Clone, PartialEq)]
pub struct SweepSpec {
    /// `concurrency` or `rate`.
    pub load: &'static str,
    /// Levels, ascending.
    pub levels: Vec<f64>,
}

impl SweepSpec {
    /// Parses `concurrency:1,2,4` or `rate:0.5,1,2`.
    pub fn parse(spec: &str) -> anyhow::Result<Self> {
        let (kind, list) = spec
            .split_once(':')
            .context("--sweep is concurrency:1,2,4 or rate:1,2,4")?;
        let load = match kind.trim() {
            "concurrency" => "concurrency",
            "rate" => "rate",
            other => bail!("--sweep over `{other}`: use concurrency or rate"),
        };
        let mut levels = Vec::new();
        for item in list.split(',') {
            let v: f64 = item
                .trim()
                .parse()
                .with_context(|| format!("--sweep level `{item}`"))?;
            if !(v.is_finite() && v > 0.0) || (load == "concurrency" && v.fract() != 0.0) {
                bail!("--sweep level {v}: positive (whole numbers for concurrency)");
            }
            levels.push(v);
        }
        if levels.len() < 2 || levels.windows(2).any(|w| w[0] >= w[1]) {
            bail!("--sweep needs at least two ascending levels");
        }
        Ok(Self { load, levels })
    }
}

/// The knee: the first level after which more load buys less than 10% more output throughput
/// per doubling. The largest safe level: the largest whose p99 TTFT (else p99 TPOT, else E2EL)
/// is within the SLO, with every lower level within it too.
pub fn sweep_verdict(points: &[(f64, Summary)], slo: Option<Slo>) -> (Option<f64>, Option<f64>) {
    let knee = points
        .windows(2)
        .find(|w| {
            let (l0, s0) = (&w[0].0, &w[0].1);
            let (l1, s1) = (&w[1].0, &w[1].1);
            let doublings = (l1 / l0).log2().max(1e-9);
            s1.output_token_throughput < s0.output_token_throughput * (1.0 + 0.10 * doublings)
        })
        .map(|w| w[0].0);
    let safe = slo.and_then(|slo| {
        // Failed requests missed the SLO too: a level that sheds or times out more than 1% of its
        // requests is not safe however fast the survivors were.
        let within = |s: &Summary| {
            s.completed > 0
                && s.failed * 100 <= s.measured
                && slo.ttft_ms.is_none_or(|b| s.ttft.p99_ms <= b)
                && slo.tpot_ms.is_none_or(|b| s.tpot.p99_ms <= b)
                && slo.e2el_ms.is_none_or(|b| s.e2el.p99_ms <= b)
        };
        points
            .iter()
            .take_while(|(_, s)| within(s))
            .last()
            .map(|(l, _)| *l)
    });
    (knee, safe)
}

async fn run_sweep(
    a: &ReplayArgs,
    sweep: SweepSpec,
    records: Vec<TraceRecord>,
    base: ReplayOptions,
    mut contract: Value,
    slo: Option<Slo>,
) -> anyhow::Result<PathBuf> {
    contract["load"] = json!({"mode": "sweep", "over": sweep.load, "levels": sweep.levels,
        "seconds_per_level": a.sweep_duration});
    let mut points = Vec::new();
    for (i, &level) in sweep.levels.iter().enumerate() {
        let arrivals = if sweep.load == "concurrency" {
            Arrivals::Concurrency(level as usize)
        } else {
            Arrivals::Rate {
                rate: level,
                burstiness: a.burstiness,
            }
        };
        let opts = ReplayOptions {
            arrivals,
            duration: Some(Duration::from_secs_f64(a.sweep_duration)),
            prompt_salt: base.prompt_salt.wrapping_add(1_000_003 * (i as u64 + 1)),
            plan: None,
            run_id: format!("{}-l{i}", base.run_id),
            ..base.clone()
        };
        if !a.quiet {
            eprintln!(
                "headroom replay: sweep level {} = {level} for {} s",
                sweep.load, a.sweep_duration
            );
        }
        let counters = Arc::new(Counters::default());
        let progress = (!a.quiet).then(|| spawn_progress(counters.clone(), records.len()));
        let stop = opts.stop.clone();
        let results = replay::run(records.clone(), opts, counters).await;
        if let Some(progress) = progress {
            progress.abort();
            if std::io::stderr().is_terminal() {
                eprintln!();
            }
        }
        if stop.load(Ordering::Relaxed) {
            // A level cut short measures nothing it claims: the sweep keeps the levels it finished.
            contract["interrupted"] = json!({"levels_finished": points.len()});
            break;
        }
        let summary = report::summarize(&results, slo);
        if !a.quiet {
            eprintln!(
                "  {level}: {:.2} req/s, {:.0} output tok/s, TTFT p50 {:.1} ms p99 {:.1} ms",
                summary.request_throughput,
                summary.output_token_throughput,
                summary.ttft.p50_ms,
                summary.ttft.p99_ms
            );
        }
        points.push((level, summary));
    }
    let (knee, safe) = sweep_verdict(&points, slo);
    let knee_text = knee.map(|k| {
        format!("Knee: past {} = {k}, more load buys less than 10% more output throughput per doubling.", sweep.load)
    });
    let safe_text = match (slo, safe) {
        (None, _) => None,
        (Some(_), Some(s)) => Some(format!(
            "Largest safe {}: {s} (p99 within the SLO at this level and every lower one).",
            sweep.load
        )),
        (Some(_), None) => Some(format!("No {} level kept p99 within the SLO.", sweep.load)),
    };
    let doc = json!({
        "schema": "headroom.sweep.v1",
        "contract": contract,
        "load": sweep.load,
        "slo": slo,
        "points": points.iter().map(|(l, s)| json!({"level": l, "summary": s})).collect::<Vec<_>>(),
        "verdict": {"knee_level": knee, "largest_safe_level": safe, "knee": knee_text, "largest_safe": safe_text},
    });
    std::fs::create_dir_all(&a.out).with_context(|| format!("creating {}", a.out.display()))?;
    let path = a.out.join("sweep.json");
    outputs::write(&path, serde_json::to_string_pretty(&doc)?)?;
    outputs::write(&a.out.join("sweep.html"), pages::sweep_page(&doc)?)?;
    let mut text = format!(
        "{:>12} {:>9} {:>12} {:>10} {:>10} {:>10}\n",
        sweep.load, "req/s", "out tok/s", "TTFT p50", "TTFT p99", "TPOT p99"
    );
    for (l, s) in &points {
        text.push_str(&format!(
            "{l:>12} {:>9.2} {:>12.0} {:>8.1}ms {:>8.1}ms {:>8.1}ms\n",
            s.request_throughput,
            s.output_token_throughput,
            s.ttft.p50_ms,
            s.ttft.p99_ms,
            s.tpot.p99_ms
        ));
    }
    for line in [knee_text, safe_text].into_iter().flatten() {
        text.push_str(&line);
        text.push('\n');
    }
    outputs::write(&a.out.join("sweep.txt"), &text)?;
    if !a.quiet {
        print!("{text}");
        eprintln!("headroom replay: sweep results in {}", a.out.display());
    }
    if !contract["interrupted"].is_null() {
        bail!(
            "interrupted: the {} levels that finished are saved in {}",
            points.len(),
            a.out.display()
        );
    }
    Ok(path)
}

/// What the targets' own metrics say about the run: each target's prefix-cache hit rate over the
/// run, the overall one, and the hit rate the trace's hash ids imply for the same cache sizes (each
/// target seeing the rows sent to it). Replicas `behind` a router saw rows the router chose, so the
/// trace's figure is then the ideal: one LRU cache as large as all of theirs together (the most a
/// router can keep), beside an unbounded cache.
async fn observe_targets(
    client: &reqwest::Client,
    targets: &[String],
    behind: bool,
    before: &[Option<String>],
    records: &[TraceRecord],
    rows: &[usize],
    sent: usize,
) -> Value {
    let (mut queries, mut hits, mut offline_hits) = (0.0, 0.0, 0.0);
    let mut offline_known = true;
    let mut fleet_tokens = 0u64;
    let mut per_target = Vec::new();
    for (j, (t, b)) in targets.iter().zip(before).enumerate() {
        let after = metrics_text(client, t).await;
        let (Some(b), Some(after)) = (b.as_deref(), after) else {
            offline_known = false;
            continue;
        };
        let (Some((q0, h0)), Some((q1, h1))) = (prefix_counters(b), prefix_counters(&after)) else {
            offline_known = false;
            continue;
        };
        let (q, h) = (q1 - q0, h1 - h0);
        queries += q;
        hits += h;
        let mut entry =
            json!({"url": t, "prefix_cache_hit_rate": if q > 0.0 { h / q } else { 0.0 }});
        match kv_cache_tokens(&after) {
            Some(tokens) if behind => {
                fleet_tokens += tokens;
                entry["kv_cache_tokens"] = json!(tokens);
            }
            Some(tokens) => {
                let mine: Vec<TraceRecord> = records
                    .iter()
                    .take(sent)
                    .enumerate()
                    .filter(|(k, _)| rows[*k] % targets.len() == j)
                    .map(|(_, r)| r.clone())
                    .collect();
                let rate = trace::offline_prefix_hit_rate(&mine, tokens);
                let tokens_in: f64 = mine.iter().map(|r| f64::from(r.input_length)).sum();
                offline_hits += rate * tokens_in;
                entry["kv_cache_tokens"] = json!(tokens);
                entry["offline_prefix_hit_rate"] = json!(rate);
            }
            None => offline_known = false,
        }
        per_target.push(entry);
    }
    let mut out = json!({"targets": per_target});
    if queries > 0.0 {
        out["prefix_cache_hit_rate"] = json!(hits / queries);
        let contracted: f64 = records
            .iter()
            .take(sent)
            .map(|r| f64::from(r.input_length))
            .sum();
        if behind && offline_known {
            let sent_rows = &records[..sent.min(records.len())];
            out["offline_prefix_hit_rate"] =
                json!(trace::offline_prefix_hit_rate(sent_rows, fleet_tokens));
            out["offline_unbounded_hit_rate"] =
                json!(trace::offline_prefix_hit_rate(sent_rows, u64::MAX));
            out["offline_basis"] =
                json!("one LRU cache of the observed replicas' combined KV capacity");
        } else if offline_known && contracted > 0.0 {
            out["offline_prefix_hit_rate"] = json!(offline_hits / contracted);
        }
    }
    out
}

/// Token-length statistics for a contract.
fn length_stats(values: impl Iterator<Item = u32>) -> Value {
    let mut v: Vec<f64> = values.map(f64::from).collect();
    let d = report::Dist::of(&mut v);
    json!({"count": d.count, "mean": d.mean_ms, "min": d.min_ms, "p50": d.p50_ms, "p90": d.p90_ms,
           "p99": d.p99_ms, "p999": d.p999_ms, "max": d.max_ms})
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn spawn_progress(counters: Arc<Counters>, total: usize) -> tokio::task::JoinHandle<()> {
    let tty = std::io::stderr().is_terminal();
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_millis(if tty { 250 } else { 5000 }));
        loop {
            tick.tick().await;
            let (sent, done, failed) = (
                counters.sent.load(Ordering::Relaxed),
                counters.done.load(Ordering::Relaxed),
                counters.failed.load(Ordering::Relaxed),
            );
            let width = 30;
            let filled = (done * width).checked_div(total).unwrap_or(0).min(width);
            let bar = format!("[{}{}]", "#".repeat(filled), "-".repeat(width - filled));
            let line = format!(
                "{bar} {done}/{total} done, {} in flight, {failed} failed",
                sent - done
            );
            if tty {
                eprint!("\r{line}   ");
            } else {
                eprintln!("{line}");
            }
        }
    })
}

/// `headroom report …`.
#[derive(Debug, Subcommand)]
pub enum ReportCommand {
    /// The prompt-length tail report of a trace or a replay result: percentiles, histogram, the
    /// longest 1%'s share of the work, TTFT by prompt length, and what to do about it.
    Tail(TailArgs),
    /// Two replay results side by side, with deltas (and a warning when their contracts differ
    /// in more than one thing).
    Compare(CompareArgs),
    /// Merge the results of sharded load generators (`--shard i/n`) into one.
    Merge(MergeArgs),
    /// Re-render the HTML page of a result.json or sweep.json.
    Html(HtmlArgs),
    /// Join a replay's requests with the proxy's capture by x-request-id: how far the proxy's
    /// passive TTFT, TPOT and token counts are from the client's.
    Agreement(AgreementArgs),
}

/// Flags of `headroom report agreement`.
#[derive(Debug, Args)]
pub struct AgreementArgs {
    /// The replay's result.json.
    #[arg(long)]
    pub result: PathBuf,
    /// The proxy's capture (JSONL).
    #[arg(long)]
    pub capture: PathBuf,
    /// The proxy's `/stats` JSON saved at the end of the run: its pooled ITL percentiles are set
    /// beside the client's, with the share of the client's gaps at or below each.
    #[arg(long)]
    pub stats: Option<PathBuf>,
    /// The `/stats` window to read.
    #[arg(long, default_value = "5m")]
    pub window: String,
    /// Also write the numbers as JSON here.
    #[arg(long)]
    pub json: Option<PathBuf>,
}

/// Flags of `headroom report tail`.
#[derive(Debug, Args)]
pub struct TailArgs {
    /// A trace (any supported format) or a replay result.json.
    #[arg(long)]
    pub trace: PathBuf,
    /// Directory for tail.txt, tail.json, tail.csv and tail.html.
    #[arg(long, default_value = "results/tail")]
    pub out: PathBuf,
}

/// Flags of `headroom report compare`.
#[derive(Debug, Args)]
pub struct CompareArgs {
    /// Baseline result.json; or, alone, a proxy capture holding shadow records (primary vs
    /// shadow answers to the same requests).
    pub a: PathBuf,
    /// Candidate result.json.
    pub b: Option<PathBuf>,
}

/// Flags of `headroom report merge`.
#[derive(Debug, Args)]
pub struct MergeArgs {
    /// The shards' result.json files.
    #[arg(required = true, num_args = 2..)]
    pub results: Vec<PathBuf>,
    /// Directory for the merged result.json, requests.csv, summary.txt and report.html.
    #[arg(long, default_value = "results/merged")]
    pub out: PathBuf,
}

/// Flags of `headroom report html`.
#[derive(Debug, Args)]
pub struct HtmlArgs {
    /// result.json or sweep.json.
    pub input: PathBuf,
    /// Output HTML file.
    #[arg(long, short)]
    pub output: PathBuf,
}

fn read_json(path: &Path) -> anyhow::Result<Value> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    serde_json::from_str(&text).with_context(|| format!("{} is not JSON", path.display()))
}

/// Runs `headroom report …`.
pub fn run_report(cmd: ReportCommand) -> anyhow::Result<()> {
    match cmd {
        ReportCommand::Tail(a) => {
            outputs::out_dir(
                &a.out,
                &["tail.txt", "tail.json", "tail.csv", "tail.html"],
                &[&a.trace],
            )?;
            let is_result = a.trace.extension().is_some_and(|e| e == "json");
            let points: Vec<analysis::TailPoint> = if is_result {
                let doc = read_json(&a.trace)?;
                let rows: Vec<RequestRow> = serde_json::from_value(doc["requests"].clone())
                    .with_context(|| format!("{} is not a replay result", a.trace.display()))?;
                // Warm-up rows are load for the others, not samples (TailPoint::measured).
                rows.iter().map(analysis::TailPoint::from_row).collect()
            } else {
                read_trace(&a.trace, None)?
                    .iter()
                    .map(analysis::TailPoint::from_record)
                    .collect()
            };
            if !points.iter().any(|p| p.measured) {
                bail!("{} holds no requests (past its warm-up)", a.trace.display());
            }
            let t = analysis::tail_report(&points);
            let text = analysis::tail_text(&t);
            outputs::write(&a.out.join("tail.txt"), &text)?;
            outputs::write(&a.out.join("tail.json"), serde_json::to_string_pretty(&t)?)?;
            outputs::write(&a.out.join("tail.csv"), analysis::tail_csv(&t))?;
            outputs::write(
                &a.out.join("tail.html"),
                analysis::tail_page(&t, &a.trace.display().to_string()),
            )?;
            print!("{text}");
            eprintln!("headroom report tail: written to {}", a.out.display());
        }
        ReportCommand::Compare(a) => {
            let text = match &a.b {
                Some(b) => analysis::compare(&read_result(&a.a)?, &read_result(b)?).0,
                None => {
                    let file = std::fs::File::open(&a.a)
                        .with_context(|| format!("opening {}", a.a.display()))?;
                    let records =
                        headroom_workload::trace::read_jsonl(std::io::BufReader::new(file))
                            .with_context(|| {
                                format!("{} is not a headroom trace", a.a.display())
                            })?;
                    let Some(c) = crate::compare::shadow_comparison(&records) else {
                        bail!(
                            "{} holds no shadow records: give two result.json files to compare two runs, or a capture from a proxy whose pool shadows ([pools.shadow])",
                            a.a.display()
                        );
                    };
                    crate::compare::shadow_text(&c).0
                }
            };
            print!("{text}");
        }
        ReportCommand::Merge(a) => {
            let inputs: Vec<&Path> = a.results.iter().map(PathBuf::as_path).collect();
            outputs::out_dir(
                &a.out,
                &["result.json", "requests.csv", "report.html", "summary.txt"],
                &inputs,
            )?;
            let docs = a
                .results
                .iter()
                .map(|p| read_json(p))
                .collect::<anyhow::Result<Vec<_>>>()?;
            let first = &docs[0];
            // Each shard's times count from its own start: on one clock, from the earliest.
            let starts: Option<Vec<f64>> =
                docs.iter().map(|d| d["started_unix_ms"].as_f64()).collect();
            let t0 = starts
                .as_ref()
                .map(|s| s.iter().copied().fold(f64::INFINITY, f64::min));
            let offsets = match (&starts, t0) {
                (Some(s), Some(t0)) => s.iter().map(|t| t - t0).collect(),
                _ => {
                    eprintln!(
                        "headroom report merge: a result has no start time (written by an older headroom): its shards are merged as if they started together"
                    );
                    vec![0.0; docs.len()]
                }
            };
            let mut rows: Vec<RequestRow> = Vec::new();
            for ((doc, path), offset) in docs.iter().zip(&a.results).zip(&offsets) {
                let diffs = analysis::contract_differences(&first["contract"], &doc["contract"]);
                // Shards differ in their slice of the trace and its length statistics only.
                let unexpected: Vec<&String> = diffs
                    .iter()
                    .filter(|d| !["trace", "input_tokens", "output_tokens"].contains(&d.as_str()))
                    .collect();
                if !unexpected.is_empty() {
                    bail!(
                        "{} was run under a different contract ({unexpected:?}): not a shard of the same run",
                        path.display()
                    );
                }
                let mut part: Vec<RequestRow> = serde_json::from_value(doc["requests"].clone())
                    .with_context(|| format!("{} is not a replay result", path.display()))?;
                for r in &mut part {
                    r.sent_ms += offset;
                    r.scheduled_ms = r.scheduled_ms.map(|s| s + offset);
                }
                rows.append(&mut part);
            }
            check_shards(&docs, &a.results, &rows)?;
            rows.sort_by(|x, y| x.sent_ms.total_cmp(&y.sent_ms));
            let slo: Option<Slo> = serde_json::from_value(first["contract"]["slo"].clone())
                .ok()
                .flatten();
            let summary = report::summarize(&report::results_from_rows(&rows), slo);
            let mut contract = first["contract"].clone();
            contract["trace"]["shards_merged"] = json!(
                a.results
                    .iter()
                    .map(|p| p.display().to_string())
                    .collect::<Vec<_>>()
            );
            contract["trace"]["requests"] = json!(rows.len());
            if contract["load"]["mode"] == "concurrency" {
                // Each load generator kept its own concurrency: together they kept the sum.
                let total: u64 = docs
                    .iter()
                    .filter_map(|d| d["contract"]["load"]["concurrency"].as_u64())
                    .sum();
                contract["load"]["concurrency"] = json!(total);
            }
            contract["trace"]["shard"] = Value::Null;
            contract["input_tokens"] = length_stats(rows.iter().map(|r| r.input_length));
            contract["output_tokens"] = length_stats(rows.iter().map(|r| r.output_length));
            let doc = json!({"schema": RESULT_SCHEMA, "contract": contract, "summary": summary,
                             "started_unix_ms": t0, "requests": rows,
                             "note": "merged from shards: ITL per chunk is not kept per request, so the merged ITL distribution is empty"});
            outputs::write(
                &a.out.join("result.json"),
                serde_json::to_string_pretty(&doc)?,
            )?;
            outputs::write(&a.out.join("requests.csv"), report::to_csv(&rows))?;
            outputs::write(&a.out.join("report.html"), pages::replay_page(&doc)?)?;
            let text = report::to_text(&summary);
            outputs::write(&a.out.join("summary.txt"), &text)?;
            print!("{text}");
            eprintln!(
                "headroom report merge: {} shards, {} requests, written to {}",
                docs.len(),
                rows.len(),
                a.out.display()
            );
        }
        ReportCommand::Html(a) => {
            outputs::not_an_input(&a.output, &[&a.input])?;
            let doc = read_json(&a.input)?;
            let page = if doc["schema"] == "headroom.sweep.v1" {
                pages::sweep_page(&doc)?
            } else {
                pages::replay_page(&doc)?
            };
            outputs::write(&a.output, page)?;
        }
        ReportCommand::Agreement(a) => {
            if let Some(out) = &a.json {
                let mut inputs = vec![a.result.as_path(), a.capture.as_path()];
                inputs.extend(a.stats.as_deref());
                outputs::not_an_input(out, &inputs)?;
            }
            let doc = read_json(&a.result)?;
            let rows: Vec<RequestRow> = serde_json::from_value(doc["requests"].clone())
                .with_context(|| format!("{} is not a replay result", a.result.display()))?;
            let capture = read_trace(&a.capture, None)?;
            let joined = crate::agreement::agreement(&rows, &capture);
            if joined.joined == 0 {
                bail!(
                    "no request of {} appears in {} (the capture joins by x-request-id)",
                    a.result.display(),
                    a.capture.display()
                );
            }
            print!("{}", crate::agreement::agreement_text(&joined));
            let itl = match &a.stats {
                Some(path) => {
                    let stats = read_json(path)?;
                    let client_buckets: Option<report::Buckets> =
                        serde_json::from_value(doc["itl_buckets"].clone()).ok();
                    let client_itl: Dist = serde_json::from_value(doc["summary"]["itl"].clone())
                        .with_context(|| format!("{} has no ITL summary", a.result.display()))?;
                    let itl = crate::agreement::itl_agreement(
                        &client_itl,
                        client_buckets.as_ref(),
                        &stats,
                        &a.window,
                    )
                    .with_context(|| format!("reading the ITL of {}", path.display()))?;
                    print!("{}", crate::agreement::itl_text(&itl));
                    Some(itl)
                }
                None => None,
            };
            // The client's own stalls are in its numbers and in none of the proxy's.
            if let Ok(stalls) =
                serde_json::from_value::<crate::stalls::Stalls>(doc["client_stalls"].clone())
            {
                println!("{}", stalls.line());
            }
            if let Some(path) = a.json {
                let mut out = serde_json::to_value(&joined)?;
                out["itl"] = serde_json::to_value(&itl)?;
                outputs::write(&path, serde_json::to_string_pretty(&out)?)?;
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn extra_headers_parse_and_bad_ones_are_named() {
        let a = ReplayArgs::from_flags([
            "--trace",
            "t.jsonl",
            "--target",
            "http://x",
            "--header",
            "X-Headroom-Class: batch",
        ])
        .unwrap();
        assert_eq!(
            a.headers,
            vec![("x-headroom-class".to_owned(), "batch".to_owned())]
        );
        let err = ReplayArgs::from_flags([
            "--trace", "t", "--target", "http://x", "--header", "nocolon",
        ])
        .unwrap_err()
        .to_string();
        assert!(err.contains("write a header as `Name: value`"), "{err}");
    }

    fn summary(out_tps: f64, ttft_p99: f64) -> Summary {
        let mut s = report::summarize(&[], None);
        s.completed = 10;
        s.output_token_throughput = out_tps;
        s.ttft.p99_ms = ttft_p99;
        s
    }

    #[test]
    fn verdict_finds_the_knee_and_the_largest_safe_level() {
        let points = vec![
            (1.0, summary(100.0, 50.0)),
            (2.0, summary(190.0, 60.0)),
            (4.0, summary(360.0, 120.0)),
            (8.0, summary(380.0, 390.0)),
            (16.0, summary(385.0, 900.0)),
            (32.0, summary(386.0, 300.0)),
        ];
        let slo = Slo::parse("ttft=400").unwrap();
        let (knee, safe) = sweep_verdict(&points, Some(slo));
        assert_eq!(knee, Some(4.0), "4 → 8 adds only 5.6%");
        assert_eq!(safe, Some(8.0), "32 is within the SLO again, but 16 is not");
        assert_eq!(sweep_verdict(&points, None).1, None);

        // Shedding is not safety: a level whose survivors are fast but 5% of requests failed is out,
        // and every metric the SLO names is checked.
        let mut shedding = points.clone();
        shedding[2].1.measured = 100;
        shedding[2].1.failed = 5;
        assert_eq!(sweep_verdict(&shedding, Some(slo)).1, Some(2.0));
        let mut slow_decode = points.clone();
        slow_decode[1].1.tpot.p99_ms = 80.0;
        let both = Slo::parse("ttft=400,tpot=50").unwrap();
        assert_eq!(sweep_verdict(&slow_decode, Some(both)).1, Some(1.0));
    }

    #[test]
    fn sweep_specs_and_shards_parse_or_say_why_not() {
        assert_eq!(
            SweepSpec::parse("concurrency:1,2,4").unwrap().levels,
            vec![1.0, 2.0, 4.0]
        );
        assert!(SweepSpec::parse("concurrency:1.5,2").is_err());
        assert!(SweepSpec::parse("rate:2,1").is_err());
        assert!(SweepSpec::parse("speed:1,2").is_err());
        assert_eq!(parse_shard("1/4").unwrap(), (1, 4));
        assert!(parse_shard("4/4").is_err());
        let e = parse_shard("a/b").unwrap_err().to_string();
        assert!(
            e.contains("--shard a/b") && e.contains("not a whole number"),
            "{e}"
        );
    }

    #[test]
    fn merged_shards_must_be_distinct_shards_of_one_split() {
        let shard = |spec: &str, rows: &[u64]| {
            json!({"contract": {"trace": {"shard": spec}},
                   "requests": rows.iter().map(|i| json!({"index": i})).collect::<Vec<_>>()})
        };
        let paths: Vec<PathBuf> = ["a", "b"].iter().map(PathBuf::from).collect();
        let check = |docs: &[Value]| check_shards(docs, &paths, &[]).map_err(|e| e.to_string());
        assert!(check(&[shard("0/2", &[0, 2]), shard("1/2", &[1, 3])]).is_ok());
        let twice = check(&[shard("0/2", &[0, 2]), shard("0/2", &[0, 2])]).unwrap_err();
        assert!(twice.contains("trace row 0 is in both a and b"), "{twice}");
        let splits = check(&[shard("0/3", &[0, 3]), shard("1/2", &[1])]).unwrap_err();
        assert!(
            splits.contains("a shard of 3") && splits.contains("a shard of 2"),
            "{splits}"
        );
        // A missing shard is only a warning.
        assert!(check(&[shard("0/3", &[0, 3]), shard("1/3", &[1, 4])]).is_ok());
    }

    #[test]
    fn prometheus_counters_and_cache_size_are_read() {
        let text = "vllm:prefix_cache_queries_total{engine=\"0\",model_name=\"m\"} 1000\nvllm:prefix_cache_hits_total{engine=\"0\",model_name=\"m\"} 250\nvllm:cache_config_info{block_size=\"16\",engine=\"0\",num_gpu_blocks=\"101\"} 1\n";
        assert_eq!(prefix_counters(text), Some((1000.0, 250.0)));
        assert_eq!(kv_cache_tokens(text), Some(1600));
        assert_eq!(prefix_counters("nothing"), None);
    }
}
