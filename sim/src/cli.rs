//! `headroom sim`: flags (named as vLLM and llm-d's simulator name them), heterogeneous fleets from
//! a TOML file, and starting N replicas on consecutive ports in one process.

use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, bail};
use clap::{Args, ValueEnum};
use headroom_config::{FieldError, Validate, check, field_path};
use serde::Deserialize;

use crate::core::{Core, CoreConfig};
use crate::engine::Engine;
use crate::faults::Faults;
use crate::kv_events::{KvEventsConfig, start_publisher};
use crate::metrics::{CacheInfo, Metrics};
use crate::profile::{Deployment, GpuSpec};
use crate::server::{Replica, ServeSettings, serve};
use crate::timing::{Roofline, StepShape, StepTimer, Variation};

/// How step time is computed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum LatencyModel {
    /// FLOPs and bytes of each step against the GPU's peaks.
    Roofline,
    /// Fixed prefill-step and decode-step times.
    Constant,
    /// Prefill proportional to new tokens; fixed decode step.
    PerToken,
    /// No shared steps: every request's first token a fixed time after its admission, then one
    /// every fixed interval (a reference backend for measuring what stands in front of it).
    Fixed,
}

/// Flags of `headroom sim`.
#[derive(Debug, Clone, Args)]
pub struct SimArgs {
    /// Replicas to run, on ports PORT..PORT+N−1.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..))]
    pub replicas: u16,
    /// First port (0: any free port for each replica).
    #[arg(long, default_value_t = 8000)]
    pub port: u16,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: IpAddr,
    /// Heterogeneous fleet: a TOML file of `[[replica]]` tables overriding these flags.
    #[arg(long)]
    pub fleet: Option<PathBuf>,
    /// Model preset: llama-3.1-8b or llama-3.1-70b.
    #[arg(long, default_value = "llama-3.1-8b")]
    pub profile: String,
    /// GPU preset: h100 or h200.
    #[arg(long, default_value = "h100")]
    pub gpu: String,
    /// Tensor parallelism (default: the smallest that holds one full context).
    #[arg(long)]
    pub tp: Option<u32>,
    /// Model id shown as `root` (default: the preset's Hugging Face id).
    #[arg(long)]
    pub model: Option<String>,
    /// Name clients put in `model` (default: --model).
    #[arg(long)]
    pub served_model_name: Option<String>,
    /// Longest prompt + output (default: the model's, capped by the KV cache).
    #[arg(long)]
    pub max_model_len: Option<u32>,
    /// Most requests running at once (default as vLLM picks for the GPU).
    #[arg(long)]
    pub max_num_seqs: Option<u32>,
    /// Token budget per step (default as vLLM picks for the GPU).
    #[arg(long)]
    pub max_num_batched_tokens: Option<u32>,
    /// Tokens per KV block.
    #[arg(long, default_value_t = 16)]
    pub block_size: u32,
    /// KV blocks, overriding the profile's computed count (vLLM's --num-gpu-blocks-override).
    #[arg(long, alias = "num-gpu-blocks-override")]
    pub num_gpu_blocks: Option<u64>,
    /// Share of GPU memory vLLM may use.
    #[arg(long, default_value_t = 0.92)]
    pub gpu_memory_utilization: f64,
    /// KV cache dtype: auto (bf16) or fp8.
    #[arg(long, default_value = "auto")]
    pub kv_cache_dtype: String,
    /// Turn the prefix cache off.
    #[arg(long)]
    pub no_enable_prefix_caching: bool,
    /// Seed of the block hash chain.
    #[arg(long, default_value_t = 0)]
    pub hash_seed: u64,
    /// Seed of generated text, output lengths, jitter and injected failures.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Step-time model.
    #[arg(long, value_enum, default_value_t = LatencyModel::Roofline, alias = "latency-calculator")]
    pub latency_model: LatencyModel,
    /// constant: duration of a step with prefill, ms; fixed: admission to first token, ms.
    #[arg(long, default_value_t = 100.0)]
    pub time_to_first_token: f64,
    /// constant / per-token: duration of a decode step, ms; fixed: between two tokens, ms.
    #[arg(long, default_value_t = 20.0)]
    pub inter_token_latency: f64,
    /// per-token: fixed cost of a step with prefill, ms.
    #[arg(long, default_value_t = 30.0)]
    pub prefill_overhead: f64,
    /// per-token: cost per new prefill token, ms.
    #[arg(long, default_value_t = 0.25)]
    pub prefill_time_per_token: f64,
    /// constant / per-token / fixed: jitter, standard deviation as a fraction of the mean (≤ 0.3).
    #[arg(long, default_value_t = 0.0)]
    pub latency_jitter: f64,
    /// constant / per-token / fixed: llm-d's time factor under load (1 = none).
    #[arg(long, default_value_t = 1.0)]
    pub time_factor_under_load: f64,
    /// roofline: memory-bandwidth efficiency η_m.
    #[arg(long, default_value_t = 0.70)]
    pub mem_efficiency: f64,
    /// roofline: compute efficiency η_c.
    #[arg(long, default_value_t = 0.65)]
    pub compute_efficiency: f64,
    /// roofline: fixed overhead per step, ms.
    #[arg(long, default_value_t = 1.0)]
    pub step_overhead_ms: f64,
    /// 503 when this many requests already wait (off by default, as in vLLM).
    #[arg(long)]
    pub max_num_queued_reqs: Option<usize>,
    /// Always send the final usage chunk.
    #[arg(long)]
    pub enable_force_include_usage: bool,
    /// Report the prompt tokens served from the prefix cache in `usage.prompt_tokens_details`.
    #[arg(long)]
    pub enable_prompt_tokens_details: bool,
    /// Role of generated chat messages.
    #[arg(long, default_value = "assistant")]
    pub response_role: String,
    /// Expose pre-0.10 metric names (gpu_cache_usage_perc, …).
    #[arg(long)]
    pub legacy_metric_names: bool,
    /// Mean output length when the request does not set ignore_eos.
    #[arg(long, default_value_t = 256)]
    pub mean_output_tokens: u32,
    /// Percentage (0–100) of requests answered with an injected error.
    #[arg(long, default_value_t = 0.0)]
    pub failure_injection_rate: f64,
    /// Percentage (0–100) of requests whose generated text differs from the reference from a
    /// drawn token on (the same requests on every replica with the flag: drawn from the request's
    /// seed), to test output-agreement checks.
    #[arg(long, default_value_t = 0.0)]
    pub perturb_text_rate: f64,
    /// Statuses injected, one drawn per failure.
    #[arg(long, value_delimiter = ',', default_values_t = [503u16])]
    pub failure_status: Vec<u16>,
    /// Hold every first token back this long, ms.
    #[arg(long)]
    pub stall_first_ms: Option<u64>,
    /// Pause every stream after this many tokens (with --stall-ms).
    #[arg(long, requires = "stall_ms")]
    pub stall_after: Option<u32>,
    /// Length of the --stall-after pause, ms.
    #[arg(long)]
    pub stall_ms: Option<u64>,
    /// Cut every stream's connection after this many tokens.
    #[arg(long)]
    pub drop_after: Option<u32>,
    /// Accept requests and never answer.
    #[arg(long)]
    pub hang: bool,
    /// Answer /health with 503 (and refuse work) for this many seconds after start.
    #[arg(long, default_value_t = 0.0)]
    pub startup_duration: f64,
    /// vLLM's --kv-events-config JSON: publish KV cache events over ZMQ.
    #[arg(long)]
    pub kv_events_config: Option<String>,
    /// Keep engine threads at normal priority instead of asking for real-time scheduling
    /// (which keeps steps on time on a busy machine; needs root or CAP_SYS_NICE).
    #[arg(long)]
    pub no_realtime_engine: bool,
    /// Print the decode-batch table (step time, tokens/s, KV share of bytes) and exit.
    #[arg(long)]
    pub table: bool,
}

/// One `[[replica]]` of a fleet file: any field set overrides the command line.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReplicaOverrides {
    /// Replicas of this kind.
    #[serde(default = "one")]
    pub count: u16,
    /// Model preset.
    pub profile: Option<String>,
    /// GPU preset.
    pub gpu: Option<String>,
    /// Tensor parallelism.
    pub tp: Option<u32>,
    /// Served model name.
    pub served_model_name: Option<String>,
    /// KV blocks.
    pub num_gpu_blocks: Option<u64>,
    /// Longest prompt + output.
    pub max_model_len: Option<u32>,
    /// Most running requests.
    pub max_num_seqs: Option<u32>,
    /// Token budget per step.
    pub max_num_batched_tokens: Option<u32>,
    /// Step-time model.
    pub latency_model: Option<LatencyModel>,
    /// constant: prefill step, ms.
    pub time_to_first_token: Option<f64>,
    /// constant / per-token: decode step, ms.
    pub inter_token_latency: Option<f64>,
    /// Percentage of requests failed.
    pub failure_injection_rate: Option<f64>,
    /// Percentage of requests whose text is perturbed.
    pub perturb_text_rate: Option<f64>,
    /// Cold-start seconds.
    pub startup_duration: Option<f64>,
}

fn one() -> u16 {
    1
}

/// A fleet file.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FleetFile {
    /// The replica kinds, started in order on consecutive ports.
    pub replica: Vec<ReplicaOverrides>,
}

impl Validate for FleetFile {
    fn validate(&self, prefix: &str, errors: &mut Vec<FieldError>) {
        check(
            errors,
            !self.replica.is_empty(),
            prefix,
            "replica",
            "[]",
            "list at least one [[replica]]",
        );
        for (i, r) in self.replica.iter().enumerate() {
            let p = field_path(prefix, &format!("replica[{i}]"));
            check(errors, r.count >= 1, &p, "count", r.count, "at least 1");
            if let Some(g) = &r.gpu {
                check(
                    errors,
                    GpuSpec::by_name(g).is_some(),
                    &p,
                    "gpu",
                    g,
                    "known GPUs: h100, h200",
                );
            }
            if let Some(m) = &r.profile {
                check(
                    errors,
                    Deployment::preset(m, "h100").is_some(),
                    &p,
                    "profile",
                    m,
                    "known: llama-3.1-8b, llama-3.1-70b",
                );
            }
            if let Some(b) = r.num_gpu_blocks {
                check(errors, b >= 2, &p, "num_gpu_blocks", b, "at least 2");
            }
            for (name, value) in [
                ("failure_injection_rate", r.failure_injection_rate),
                ("perturb_text_rate", r.perturb_text_rate),
            ] {
                if let Some(f) = value {
                    check(
                        errors,
                        (0.0..=100.0).contains(&f),
                        &p,
                        name,
                        f,
                        "a percentage in 0..=100",
                    );
                }
            }
        }
    }
}

#[derive(Debug, clap::Parser)]
#[command(args_override_self = true)]
struct FlagsOnly {
    #[command(flatten)]
    args: SimArgs,
}

impl SimArgs {
    /// Parses `headroom sim` flags from a list (for tests, the demo and fleet tooling); a flag
    /// given twice takes its last value.
    pub fn from_flags<I, S>(flags: I) -> Result<Self, clap::Error>
    where
        I: IntoIterator<Item = S>,
        S: Into<std::ffi::OsString> + Clone,
    {
        use clap::Parser;
        let argv = std::iter::once(std::ffi::OsString::from("sim"))
            .chain(flags.into_iter().map(Into::into));
        FlagsOnly::try_parse_from(argv).map(|f| f.args)
    }

    fn with(&self, o: &ReplicaOverrides) -> Self {
        let mut a = self.clone();
        if let Some(v) = &o.profile {
            a.profile = v.clone();
        }
        if let Some(v) = &o.gpu {
            a.gpu = v.clone();
        }
        a.tp = o.tp.or(a.tp);
        a.served_model_name = o.served_model_name.clone().or(a.served_model_name);
        a.num_gpu_blocks = o.num_gpu_blocks.or(a.num_gpu_blocks);
        a.max_model_len = o.max_model_len.or(a.max_model_len);
        a.max_num_seqs = o.max_num_seqs.or(a.max_num_seqs);
        a.max_num_batched_tokens = o.max_num_batched_tokens.or(a.max_num_batched_tokens);
        a.latency_model = o.latency_model.unwrap_or(a.latency_model);
        a.time_to_first_token = o.time_to_first_token.unwrap_or(a.time_to_first_token);
        a.inter_token_latency = o.inter_token_latency.unwrap_or(a.inter_token_latency);
        a.failure_injection_rate = o.failure_injection_rate.unwrap_or(a.failure_injection_rate);
        a.perturb_text_rate = o.perturb_text_rate.unwrap_or(a.perturb_text_rate);
        a.startup_duration = o.startup_duration.unwrap_or(a.startup_duration);
        a
    }

    /// The deployment these flags describe.
    pub fn deployment(&self) -> anyhow::Result<Deployment> {
        let mut d = Deployment::preset(&self.profile, &self.gpu).with_context(|| {
            format!(
                "unknown --profile {:?} / --gpu {:?}: profiles are llama-3.1-8b, llama-3.1-70b; GPUs are h100, h200",
                self.profile, self.gpu
            )
        })?;
        if let Some(tp) = self.tp {
            if tp == 0 {
                bail!("--tp must be at least 1");
            }
            if let Some(why) = d.model.tp_refusal(tp) {
                bail!("{why}");
            }
            d.tp = tp;
        }
        // vLLM: "GPU memory utilization must be less than 1.0" (and above 0).
        if !(self.gpu_memory_utilization > 0.0 && self.gpu_memory_utilization <= 1.0) {
            bail!(
                "--gpu-memory-utilization is the fraction of each GPU's memory vLLM may use, in (0, 1], got {}",
                self.gpu_memory_utilization
            );
        }
        d.gpu_memory_utilization = self.gpu_memory_utilization;
        d.kv_bytes = match self.kv_cache_dtype.as_str() {
            "auto" | "bf16" | "bfloat16" => 2.0,
            "fp8" | "fp8_e4m3" | "fp8_e5m2" => 1.0,
            other => bail!("--kv-cache-dtype {other:?}: use auto or fp8"),
        };
        Ok(d)
    }

    fn step_timer(&self, d: &Deployment, max_num_seqs: u32) -> anyhow::Result<StepTimer> {
        let ms = |v: f64, flag: &str| -> anyhow::Result<Duration> {
            if !(v.is_finite() && v >= 0.0) {
                bail!("--{flag} must be a non-negative number of milliseconds, got {v}");
            }
            Ok(Duration::from_secs_f64(v / 1e3))
        };
        if !(self.time_factor_under_load.is_finite() && self.time_factor_under_load >= 1.0) {
            bail!(
                "--time-factor-under-load must be at least 1 (1 = no slowdown), got {}",
                self.time_factor_under_load
            );
        }
        if !(0.0..=0.3).contains(&self.latency_jitter) {
            bail!(
                "--latency-jitter must be in 0..=0.3 (a fraction of the mean), got {}",
                self.latency_jitter
            );
        }
        let variation = Variation {
            std_dev_fraction: self.latency_jitter,
            load_factor: self.time_factor_under_load,
            max_num_seqs: u64::from(max_num_seqs),
        };
        Ok(match self.latency_model {
            LatencyModel::Roofline => {
                let mut r = Roofline::new(d.clone());
                for (v, flag) in [
                    (self.mem_efficiency, "mem-efficiency"),
                    (self.compute_efficiency, "compute-efficiency"),
                ] {
                    if !(v > 0.0 && v <= 1.0) {
                        bail!("--{flag} must be in (0, 1], got {v}");
                    }
                }
                r.mem_efficiency = self.mem_efficiency;
                r.compute_efficiency = self.compute_efficiency;
                r.overhead = ms(self.step_overhead_ms, "step-overhead-ms")?;
                StepTimer::Roofline(r)
            }
            LatencyModel::Constant => StepTimer::Constant {
                ttft: ms(self.time_to_first_token, "time-to-first-token")?,
                itl: ms(self.inter_token_latency, "inter-token-latency")?,
                variation,
            },
            LatencyModel::Fixed => StepTimer::Fixed {
                ttft: ms(self.time_to_first_token, "time-to-first-token")?,
                itl: ms(self.inter_token_latency, "inter-token-latency")?,
                variation,
            },
            LatencyModel::PerToken => StepTimer::PerToken {
                prefill_overhead: ms(self.prefill_overhead, "prefill-overhead")?,
                prefill_per_token: ms(self.prefill_time_per_token, "prefill-time-per-token")?,
                itl: ms(self.inter_token_latency, "inter-token-latency")?,
                variation,
            },
        })
    }

    /// Builds one replica (engine thread started) from these flags.
    pub fn build_replica(&self, index: usize) -> anyhow::Result<Replica> {
        let d = self.deployment()?;
        let (default_tokens, default_seqs) = d.batch_defaults();
        let num_gpu_blocks = match self.num_gpu_blocks {
            Some(b) if b < 2 => bail!("--num-gpu-blocks must be at least 2"),
            Some(b) => b,
            None => d.kv_blocks(self.block_size),
        };
        if num_gpu_blocks < 2 {
            bail!(
                "{} does not fit on {} × {} at --gpu-memory-utilization {}: raise --tp or set --num-gpu-blocks",
                d.model.name,
                d.tp,
                d.gpu.name,
                d.gpu_memory_utilization
            );
        }
        if ![1, 8, 16, 32, 64, 128].contains(&self.block_size) {
            bail!(
                "--block-size {}: vLLM takes 1, 8, 16, 32, 64 or 128",
                self.block_size
            );
        }
        let kv_tokens = (num_gpu_blocks - 1) * u64::from(self.block_size);
        let max_model_len = match self.max_model_len {
            Some(m) if u64::from(m) > kv_tokens => bail!(
                "--max-model-len {m} needs more KV cache than the {kv_tokens} tokens of {num_gpu_blocks} blocks: to serve at least one request at the model's max length, lower --max-model-len or give more blocks"
            ),
            Some(m) if m < 2 => bail!("--max-model-len must be at least 2"),
            Some(m) => m,
            None => d
                .model
                .max_model_len
                .min(kv_tokens.min(u64::from(u32::MAX)) as u32),
        };
        let max_num_seqs = self.max_num_seqs.unwrap_or(default_seqs);
        let max_num_batched_tokens = self.max_num_batched_tokens.unwrap_or(default_tokens);
        if max_num_seqs == 0 || max_num_batched_tokens == 0 {
            bail!("--max-num-seqs and --max-num-batched-tokens must be positive");
        }
        if max_num_batched_tokens < max_num_seqs {
            bail!(
                "--max-num-batched-tokens ({max_num_batched_tokens}) must be greater than or equal to --max-num-seqs ({max_num_seqs}): every running sequence needs a token of each step's budget"
            );
        }
        if !(0.0..=100.0).contains(&self.failure_injection_rate) {
            bail!(
                "--failure-injection-rate is a percentage in 0..=100, got {}",
                self.failure_injection_rate
            );
        }
        if !(0.0..=100.0).contains(&self.perturb_text_rate) {
            bail!(
                "--perturb-text-rate is a percentage in 0..=100, got {}",
                self.perturb_text_rate
            );
        }
        if let Some(bad) = self
            .failure_status
            .iter()
            .find(|s| !(400..600).contains(*s))
        {
            bail!("--failure-status {bad}: statuses must be in 400..599");
        }
        if !(self.startup_duration.is_finite() && self.startup_duration >= 0.0) {
            bail!("--startup-duration must be a non-negative number of seconds");
        }
        let timer = self.step_timer(&d, max_num_seqs)?;
        let model_root = self.model.clone().unwrap_or_else(|| d.model.name.clone());
        let served = self
            .served_model_name
            .clone()
            .unwrap_or_else(|| model_root.clone());
        let kv_events = self
            .kv_events_config
            .as_deref()
            .map(KvEventsConfig::parse)
            .transpose()?;
        let kv_events = kv_events.filter(|c| c.enable_kv_cache_events);
        let cfg = CoreConfig {
            block_size: self.block_size,
            num_gpu_blocks,
            max_num_batched_tokens,
            max_num_seqs,
            max_model_len,
            enable_prefix_caching: !self.no_enable_prefix_caching,
            hash_seed: self.hash_seed,
            record_kv_events: kv_events.is_some(),
        };
        let info = CacheInfo {
            block_size: self.block_size,
            num_gpu_blocks,
            gpu_memory_utilization: self.gpu_memory_utilization,
            cache_dtype: self.kv_cache_dtype.clone(),
            enable_prefix_caching: cfg.enable_prefix_caching,
        };
        let metrics = Metrics::new(&served, self.legacy_metric_names, &info, max_model_len);
        let seed = self.seed.wrapping_add(index as u64);
        let core = Core::new(cfg, timer, seed, metrics);
        let sink = match kv_events {
            Some(c) => Some(start_publisher(&c, index)?),
            None => None,
        };
        let engine = Engine::start(core, sink, &index.to_string(), !self.no_realtime_engine);
        let mut faults = Faults {
            stall_first: self.stall_first_ms.map(Duration::from_millis),
            stall_after: self.stall_after,
            stall: Duration::from_millis(self.stall_ms.unwrap_or(0)),
            drop_after: self.drop_after,
            hang: self.hang,
            error: None,
            perturb_after: None,
        };
        if faults.stall_after.is_none() {
            faults.stall = Duration::ZERO;
        }
        Ok(Replica::new(
            ServeSettings {
                served_model_name: served,
                model_root,
                max_model_len,
                response_role: self.response_role.clone(),
                max_num_queued_reqs: self.max_num_queued_reqs,
                force_include_usage: self.enable_force_include_usage,
                prompt_tokens_details: self.enable_prompt_tokens_details,
                mean_output_tokens: self.mean_output_tokens,
                faults,
                failure_rate: self.failure_injection_rate / 100.0,
                perturb_rate: self.perturb_text_rate / 100.0,
                failure_statuses: self.failure_status.clone(),
                startup_duration: Duration::from_secs_f64(self.startup_duration),
                seed,
            },
            engine,
        ))
    }

    /// The replicas to start: one per `--replicas`, or as the fleet file lists them.
    pub fn replica_args(&self) -> anyhow::Result<Vec<SimArgs>> {
        match &self.fleet {
            None => Ok(vec![self.clone(); usize::from(self.replicas)]),
            Some(path) => {
                let fleet: FleetFile = headroom_config::load_toml(path)?;
                Ok(fleet
                    .replica
                    .iter()
                    .flat_map(|o| std::iter::repeat_n(self.with(o), usize::from(o.count)))
                    .collect())
            }
        }
    }
}

/// A replica serving on a socket.
#[derive(Debug)]
pub struct RunningReplica {
    /// Where it listens.
    pub addr: SocketAddr,
    /// The replica (engine, metrics).
    pub replica: Arc<Replica>,
    task: tokio::task::JoinHandle<std::io::Result<()>>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
}

impl RunningReplica {
    /// `http://addr`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Stops accepting, lets open responses finish, and waits.
    pub async fn shutdown(mut self) -> std::io::Result<()> {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        (&mut self.task)
            .await
            .unwrap_or_else(|e| Err(std::io::Error::other(e)))
    }
}

/// Binds `addr` and serves `replica` on it; ready when this returns.
pub async fn start_replica(replica: Replica, addr: SocketAddr) -> anyhow::Result<RunningReplica> {
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("binding {addr}"))?;
    let addr = listener.local_addr()?;
    let replica = Arc::new(replica);
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(serve(listener, replica.clone(), async move {
        let _ = stopped.await;
    }));
    Ok(RunningReplica {
        addr,
        replica,
        task,
        stop: Some(stop),
    })
}

/// Starts every replica these flags describe on consecutive ports (or port 0 each).
pub async fn start_fleet(args: &SimArgs) -> anyhow::Result<Vec<RunningReplica>> {
    let mut out = Vec::new();
    for (i, a) in args.replica_args()?.iter().enumerate() {
        let port = if args.port == 0 {
            0
        } else {
            args.port
                .checked_add(i as u16)
                .context("ports run past 65535")?
        };
        let replica = a.build_replica(i)?;
        out.push(start_replica(replica, SocketAddr::new(args.host, port)).await?);
    }
    Ok(out)
}

/// The decode-batch table of docs/sim.md: step time, tokens/s and KV share of bytes read against
/// decode batch size at a fixed context, with where the memory knee and compute ridge fall.
pub fn knee_table(args: &SimArgs, context: u64) -> anyhow::Result<String> {
    let d = args.deployment()?;
    let mut r = Roofline::new(d.clone());
    r.mem_efficiency = args.mem_efficiency;
    r.compute_efficiency = args.compute_efficiency;
    r.overhead = Duration::from_secs_f64(args.step_overhead_ms / 1e3);
    let blocks = args
        .num_gpu_blocks
        .unwrap_or_else(|| d.kv_blocks(args.block_size));
    if blocks < 2 {
        bail!(
            "{} does not fit on {} × {} at --gpu-memory-utilization {}: no KV cache is left (raise --tp or set --num-gpu-blocks)",
            d.model.name,
            d.tp,
            d.gpu.name,
            d.gpu_memory_utilization
        );
    }
    let kv_tokens = (blocks - 1) * u64::from(args.block_size);
    let memory_knee = kv_tokens / (context + 1);
    let mut out = format!(
        "{} on {} × {} (TP{}), decode at {context}-token context; KV cache {kv_tokens} tokens\n\n",
        d.model.name, d.tp, d.gpu.name, d.tp
    );
    out.push_str(
        "| batch | step ms | tokens/s | KV share of bytes | bound |\n|---:|---:|---:|---:|---|\n",
    );
    let mut ridge = None;
    for b in [
        1u64, 2, 4, 8, 16, 32, 64, 128, 192, 256, 384, 512, 768, 1024,
    ] {
        let mut s = StepShape::default();
        for _ in 0..b {
            s.add_decode(context);
        }
        let (flops, bytes) = r.work(&s);
        let kv = d.model.kv_bytes_per_token(d.kv_bytes) * (context * b + b) as f64;
        let compute_bound = flops / (r.compute_efficiency * d.gpu.flops)
            > bytes / (r.mem_efficiency * d.gpu.bandwidth);
        if compute_bound && ridge.is_none() {
            ridge = Some(b);
        }
        let t = r.step_time(&s).as_secs_f64();
        let fits = if b > memory_knee {
            " (over KV capacity)"
        } else {
            ""
        };
        out.push_str(&format!(
            "| {b} | {:.2} | {:.0} | {:.0}% | {}{fits} |\n",
            t * 1e3,
            b as f64 / t,
            100.0 * kv / bytes,
            if compute_bound { "compute" } else { "memory" },
        ));
    }
    out.push_str(&format!(
        "\nMemory knee: the KV cache holds {memory_knee} sequences of {context} tokens; past that the engine preempts.\n"
    ));
    let kv_equals_weights = (d.model.weight_read_bytes(d.weight_bytes)
        / (d.model.kv_bytes_per_token(d.kv_bytes) * (context + 1) as f64))
        .ceil();
    out.push_str(&format!(
        "KV reads overtake weight reads at a decode batch of about {kv_equals_weights}: beyond it, each added sequence costs its own KV bytes and tokens/s flattens.\n"
    ));
    // The weights-only ridge: the smallest uncached prefill chunk whose step is compute-bound.
    let compute_bound = |c: u64| {
        let mut s = StepShape::default();
        s.add_prefill(c, 0);
        let (flops, bytes) = r.work(&s);
        flops / (r.compute_efficiency * d.gpu.flops) > bytes / (r.mem_efficiency * d.gpu.bandwidth)
    };
    let prefill_ridge = (1..=16_384).find(|&c| compute_bound(c));
    if let Some(c) = prefill_ridge {
        out.push_str(&format!("Compute ridge: a step turns compute-bound at about {c} new tokens (prefill chunks reach it).\n"));
    }
    match ridge {
        Some(b) => out.push_str(&format!("Decode at this context turns compute-bound at a batch of about {b}.\n")),
        None => out.push_str(
            "Decode at this context never reaches the ridge: its attention reads grow with the batch as fast as its FLOPs, so it stays memory-bound and the KV cache, not compute, is the limit.\n",
        ),
    }
    Ok(out)
}
