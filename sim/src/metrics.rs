//! The replica's Prometheus metrics under vLLM 0.33's names, labels (`model_name`, `engine`) and
//! histogram buckets, or the pre-0.10 names with `--legacy-metric-names`.
//!
//! | 0.33 name | legacy name (`--legacy-metric-names`) |
//! |---|---|
//! | `vllm:kv_cache_usage_perc` | `vllm:gpu_cache_usage_perc` |
//! | `vllm:prefix_cache_queries_total` | `vllm:gpu_prefix_cache_queries_total` |
//! | `vllm:prefix_cache_hits_total` | `vllm:gpu_prefix_cache_hits_total` |
//! | `vllm:inter_token_latency_seconds` | `vllm:time_per_output_token_seconds` |
//!
//! One extra family, `headroom_sim_step_lateness_seconds`, says how far behind its modelled time
//! each engine step actually fired (the simulator's own fidelity).

use prometheus::{
    Encoder, GaugeVec, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge,
    Opts, Registry, TextEncoder,
};

/// TTFT buckets (`vllm/v1/metrics/buckets.py`).
pub const TTFT_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
];
/// Inter-token latency buckets (also a request's time per output token).
pub const ITL_BUCKETS: &[f64] = &[
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0,
];
/// Request phase buckets (e2e, queue, prefill, decode, inference).
pub const PHASE_BUCKETS: &[f64] = &[
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
    480.0, 960.0, 1920.0, 7680.0,
];
/// Tokens per step buckets.
pub const ITERATION_TOKEN_BUCKETS: &[f64] = &[
    1.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0, 8192.0, 16384.0,
];
/// Step lateness buckets (fine: the target is under 1 ms).
pub const LATENESS_BUCKETS: &[f64] = &[
    0.0001, 0.00025, 0.0005, 0.00075, 0.001, 0.002, 0.005, 0.01, 0.05, 0.1,
];

/// vLLM's finish reasons, each a `finished_reason` label of `vllm:request_success_total`.
pub const FINISH_REASONS: &[&str] = &["stop", "length", "abort", "error", "repetition"];

/// Static facts shown on `vllm:cache_config_info`.
#[derive(Debug, Clone)]
pub struct CacheInfo {
    /// Tokens per block.
    pub block_size: u32,
    /// Blocks in the pool.
    pub num_gpu_blocks: u64,
    /// `gpu_memory_utilization`.
    pub gpu_memory_utilization: f64,
    /// `cache_dtype`, e.g. `auto` or `fp8`.
    pub cache_dtype: String,
    /// Prefix caching on.
    pub enable_prefix_caching: bool,
}

/// Every metric one replica exposes.
#[derive(Debug, Clone)]
pub struct Metrics {
    registry: Registry,
    model_name: String,
    /// `vllm:num_requests_running`.
    pub running: IntGauge,
    /// `vllm:num_requests_waiting`.
    pub waiting: IntGauge,
    /// `vllm:kv_cache_usage_perc`.
    pub kv_usage: prometheus::Gauge,
    /// `vllm:prefix_cache_queries_total` (tokens).
    pub prefix_queries: IntCounter,
    /// `vllm:prefix_cache_hits_total` (tokens).
    pub prefix_hits: IntCounter,
    /// `vllm:num_preemptions_total`.
    pub preemptions: IntCounter,
    /// `vllm:prompt_tokens_total`.
    pub prompt_tokens: IntCounter,
    /// `vllm:generation_tokens_total`.
    pub generation_tokens: IntCounter,
    /// `vllm:request_success_total{finished_reason}`.
    pub request_success: IntCounterVec,
    /// `vllm:time_to_first_token_seconds`.
    pub ttft: Histogram,
    /// `vllm:inter_token_latency_seconds`.
    pub itl: Histogram,
    /// `vllm:request_time_per_output_token_seconds`.
    pub tpot: Histogram,
    /// `vllm:e2e_request_latency_seconds`.
    pub e2e: Histogram,
    /// `vllm:request_queue_time_seconds`.
    pub queue: Histogram,
    /// `vllm:request_prefill_time_seconds`.
    pub prefill: Histogram,
    /// `vllm:request_decode_time_seconds`.
    pub decode: Histogram,
    /// `vllm:request_inference_time_seconds`.
    pub inference: Histogram,
    /// `vllm:request_prompt_tokens`.
    pub request_prompt_tokens: Histogram,
    /// `vllm:request_generation_tokens`.
    pub request_generation_tokens: Histogram,
    /// `vllm:request_params_n` (always 1: the simulator serves n=1).
    pub request_params_n: Histogram,
    /// `vllm:request_params_max_tokens`.
    pub request_params_max_tokens: Histogram,
    /// `vllm:request_max_num_generation_tokens` (n=1: the request's max_tokens).
    pub request_max_num_generation_tokens: Histogram,
    /// `vllm:iteration_tokens_total`.
    pub iteration_tokens: Histogram,
    /// `headroom_sim_step_lateness_seconds`.
    pub step_lateness: Histogram,
}

/// The exposition with its numbers as Python's prometheus_client writes every sample value and
/// bucket bound, as a float: `1.0` and `le="1.0"` where Rust writes `1` and `le="1"`. A query or
/// dashboard written against vLLM that selects `le="1.0"` then matches the simulator too
/// (Prometheus 2 compares label values as strings).
pub fn python_floats(text: &str) -> String {
    let integral = |s: &str| {
        let digits = s.strip_prefix('-').unwrap_or(s);
        !digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit())
    };
    let mut out = String::with_capacity(text.len() + text.len() / 16);
    for line in text.lines() {
        if line.starts_with('#') {
            out.push_str(line);
        } else {
            let (series, value) = line.rsplit_once(' ').unwrap_or((line, ""));
            match series.find("le=\"") {
                Some(at) => {
                    let start = at + 4;
                    let end = series[start..]
                        .find('"')
                        .map_or(series.len(), |e| start + e);
                    out.push_str(&series[..end]);
                    if integral(&series[start..end]) {
                        out.push_str(".0");
                    }
                    out.push_str(&series[end..]);
                }
                None => out.push_str(series),
            }
            if !value.is_empty() {
                out.push(' ');
                out.push_str(value);
                if integral(value) {
                    out.push_str(".0");
                }
            }
        }
        out.push('\n');
    }
    out
}

/// Buckets 1, 2, 5, 10, 20, 50, … up to `max` (vLLM's `build_1_2_5_buckets`).
pub fn buckets_1_2_5(max: u64) -> Vec<f64> {
    let mut out = Vec::new();
    let mut exp = 1u64;
    loop {
        for m in [1, 2, 5] {
            let v = m * exp;
            if v > max {
                return out;
            }
            out.push(v as f64);
        }
        exp *= 10;
    }
}

struct Builder {
    registry: Registry,
    labels: Vec<(&'static str, String)>,
}

impl Builder {
    fn label_names(&self) -> Vec<&'static str> {
        self.labels.iter().map(|(k, _)| *k).collect()
    }

    fn label_values(&self) -> Vec<&str> {
        self.labels.iter().map(|(_, v)| v.as_str()).collect()
    }

    fn register(&self, c: impl prometheus::core::Collector + Clone + 'static) {
        // Names are static and distinct, so registration cannot collide.
        self.registry
            .register(Box::new(c))
            .expect("metric names are unique");
    }

    fn histogram(&self, name: &str, help: &str, buckets: &[f64]) -> Histogram {
        let v = HistogramVec::new(
            HistogramOpts::new(name, help).buckets(buckets.to_vec()),
            &self.label_names(),
        )
        .expect("valid histogram");
        self.register(v.clone());
        v.with_label_values(&self.label_values())
    }

    fn counter(&self, name: &str, help: &str) -> IntCounter {
        let v =
            IntCounterVec::new(Opts::new(name, help), &self.label_names()).expect("valid counter");
        self.register(v.clone());
        v.with_label_values(&self.label_values())
    }

    fn gauge(&self, name: &str, help: &str) -> IntGauge {
        let v = prometheus::IntGaugeVec::new(Opts::new(name, help), &self.label_names())
            .expect("valid gauge");
        self.register(v.clone());
        v.with_label_values(&self.label_values())
    }
}

impl Metrics {
    /// A fresh registry for one replica serving `model_name`.
    /// `max_model_len` bounds the request token-count buckets, as vLLM's do.
    pub fn new(
        model_name: &str,
        legacy_names: bool,
        cache: &CacheInfo,
        max_model_len: u32,
    ) -> Self {
        let token_buckets = buckets_1_2_5(u64::from(max_model_len));
        let b = Builder {
            registry: Registry::new(),
            labels: vec![
                ("model_name", model_name.to_owned()),
                ("engine", "0".to_owned()),
            ],
        };
        let pick = |new: &'static str, old: &'static str| if legacy_names { old } else { new };

        let kv_usage = GaugeVec::new(
            Opts::new(
                pick("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
                "KV-cache usage. 1 means 100 percent usage.",
            ),
            &b.label_names(),
        )
        .expect("valid gauge");
        b.register(kv_usage.clone());
        let kv_usage = kv_usage.with_label_values(&b.label_values());

        let success = IntCounterVec::new(
            Opts::new(
                "vllm:request_success_total",
                "Count of successfully processed requests.",
            ),
            &["model_name", "engine", "finished_reason"],
        )
        .expect("valid counter");
        b.register(success.clone());
        for reason in FINISH_REASONS {
            success.with_label_values(&[model_name, "0", reason]);
        }

        let info = GaugeVec::new(
            Opts::new(
                "vllm:cache_config_info",
                "Information of the LLMEngine CacheConfig",
            ),
            &[
                "block_size",
                "cache_dtype",
                "enable_prefix_caching",
                "engine",
                "gpu_memory_utilization",
                "num_cpu_blocks",
                "num_gpu_blocks",
                "prefix_caching_hash_algo",
            ],
        )
        .expect("valid gauge");
        b.register(info.clone());
        let (block_size, utilization, blocks) = (
            cache.block_size.to_string(),
            cache.gpu_memory_utilization.to_string(),
            cache.num_gpu_blocks.to_string(),
        );
        info.with_label_values(&[
            block_size.as_str(),
            cache.cache_dtype.as_str(),
            if cache.enable_prefix_caching {
                "True"
            } else {
                "False"
            },
            "0",
            utilization.as_str(),
            "None",
            blocks.as_str(),
            "xxh3_64",
        ])
        .set(1.0);

        // prometheus_client's process collector, which vLLM's API server exposes: when this replica
        // started, in seconds since the Unix epoch (a proxy tells a restarted engine by it).
        let start = prometheus::Gauge::new(
            "process_start_time_seconds",
            "Start time of the process since unix epoch in seconds.",
        )
        .expect("valid gauge");
        b.register(start.clone());
        start.set(
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0.0, |d| (d.as_secs_f64() * 100.0).round() / 100.0),
        );

        Self {
            running: b.gauge("vllm:num_requests_running", "Number of requests in model execution batches."),
            waiting: b.gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed."),
            kv_usage,
            prefix_queries: b.counter(
                pick("vllm:prefix_cache_queries_total", "vllm:gpu_prefix_cache_queries_total"),
                "Prefix cache queries, in terms of number of queried tokens.",
            ),
            prefix_hits: b.counter(
                pick("vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total"),
                "Prefix cache hits, in terms of number of cached tokens.",
            ),
            preemptions: b.counter("vllm:num_preemptions_total", "Cumulative number of preemption from the engine."),
            prompt_tokens: b.counter("vllm:prompt_tokens_total", "Number of prefill tokens processed."),
            generation_tokens: b.counter("vllm:generation_tokens_total", "Number of generation tokens processed."),
            request_success: success,
            ttft: b.histogram(
                "vllm:time_to_first_token_seconds",
                "Histogram of time to first token in seconds.",
                TTFT_BUCKETS,
            ),
            itl: b.histogram(
                pick("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"),
                "Histogram of inter-token latency in seconds.",
                ITL_BUCKETS,
            ),
            tpot: b.histogram(
                "vllm:request_time_per_output_token_seconds",
                "Histogram of time_per_output_token_seconds per request.",
                ITL_BUCKETS,
            ),
            e2e: b.histogram(
                "vllm:e2e_request_latency_seconds",
                "Histogram of e2e request latency in seconds.",
                PHASE_BUCKETS,
            ),
            queue: b.histogram(
                "vllm:request_queue_time_seconds",
                "Histogram of time spent in WAITING phase for request.",
                PHASE_BUCKETS,
            ),
            prefill: b.histogram(
                "vllm:request_prefill_time_seconds",
                "Histogram of time spent in PREFILL phase for request.",
                PHASE_BUCKETS,
            ),
            decode: b.histogram(
                "vllm:request_decode_time_seconds",
                "Histogram of time spent in DECODE phase for request.",
                PHASE_BUCKETS,
            ),
            inference: b.histogram(
                "vllm:request_inference_time_seconds",
                "Histogram of time spent in RUNNING phase for request.",
                PHASE_BUCKETS,
            ),
            request_prompt_tokens: b.histogram(
                "vllm:request_prompt_tokens",
                "Number of prefill tokens processed.",
                &token_buckets,
            ),
            request_generation_tokens: b.histogram(
                "vllm:request_generation_tokens",
                "Number of generation tokens processed.",
                &token_buckets,
            ),
            request_params_n: b.histogram(
                "vllm:request_params_n",
                "Histogram of the n request parameter.",
                &[1.0, 2.0, 5.0, 10.0, 20.0],
            ),
            request_params_max_tokens: b.histogram(
                "vllm:request_params_max_tokens",
                "Histogram of the max_tokens request parameter.",
                &token_buckets,
            ),
            request_max_num_generation_tokens: b.histogram(
                "vllm:request_max_num_generation_tokens",
                "Histogram of maximum number of requested generation tokens.",
                &token_buckets,
            ),
            iteration_tokens: b.histogram(
                "vllm:iteration_tokens_total",
                "Histogram of number of tokens per engine_step.",
                ITERATION_TOKEN_BUCKETS,
            ),
            step_lateness: b.histogram(
                "headroom_sim_step_lateness_seconds",
                "How long after its modelled end time each simulated engine step actually completed.",
                LATENESS_BUCKETS,
            ),
            registry: b.registry,
            model_name: model_name.to_owned(),
        }
    }

    /// The Prometheus text exposition (format 0.0.4), numbers written as vLLM's Python client
    /// writes them.
    pub fn render(&self) -> String {
        let mut buf = Vec::new();
        // Encoding into memory cannot fail for well-formed families.
        TextEncoder::new()
            .encode(&self.registry.gather(), &mut buf)
            .expect("text encoding");
        python_floats(&String::from_utf8(buf).unwrap_or_default())
    }

    /// Counts one request finished for `reason`.
    pub fn count_finished(&self, reason: &str) {
        self.request_success
            .with_label_values(&[&self.model_name, "0", reason])
            .inc();
    }

    /// The number of `finished_reason` requests so far.
    pub fn successes(&self, reason: &str) -> u64 {
        self.request_success
            .get_metric_with_label_values(&[&self.model_name, "0", reason])
            .map_or(0, |c| c.get())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_are_written_as_pythons_client_writes_them() {
        let rust = "# HELP x x\n# TYPE x histogram\nx_bucket{engine=\"0\",le=\"1\"} 3\nx_bucket{engine=\"0\",le=\"0.25\"} 2\nx_bucket{le=\"+Inf\"} 3\nx_sum{engine=\"0\"} 0.5\ny -4\nz{block_size=\"16\"} 1\n";
        assert_eq!(
            python_floats(rust),
            "# HELP x x\n# TYPE x histogram\nx_bucket{engine=\"0\",le=\"1.0\"} 3.0\nx_bucket{engine=\"0\",le=\"0.25\"} 2.0\nx_bucket{le=\"+Inf\"} 3.0\nx_sum{engine=\"0\"} 0.5\ny -4.0\nz{block_size=\"16\"} 1.0\n"
        );
    }

    fn info() -> CacheInfo {
        CacheInfo {
            block_size: 16,
            num_gpu_blocks: 1000,
            gpu_memory_utilization: 0.92,
            cache_dtype: "auto".into(),
            enable_prefix_caching: true,
        }
    }

    #[test]
    fn buckets_1_2_5_stop_at_max() {
        assert_eq!(
            buckets_1_2_5(100),
            vec![1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0]
        );
    }

    #[test]
    fn exposition_uses_vllm_names_labels_and_buckets() {
        let m = Metrics::new("m", false, &info(), 4096);
        m.ttft.observe(0.003);
        let text = m.render();
        assert!(text.contains("vllm:time_to_first_token_seconds_bucket{engine=\"0\",model_name=\"m\",le=\"0.005\"} 1"), "{text}");
        assert!(text.contains("vllm:kv_cache_usage_perc{engine=\"0\",model_name=\"m\"} 0"));
        assert!(text.contains("num_gpu_blocks=\"1000\""));
        assert!(text.contains(
            "vllm:request_success_total{engine=\"0\",finished_reason=\"length\",model_name=\"m\"} 0"
        ));
        assert!(!text.contains("gpu_cache_usage_perc"));
    }

    #[test]
    fn legacy_names_replace_the_renamed_families() {
        let text = Metrics::new("m", true, &info(), 4096).render();
        for old in [
            "vllm:gpu_cache_usage_perc",
            "vllm:gpu_prefix_cache_hits_total",
            "vllm:time_per_output_token_seconds",
        ] {
            assert!(text.contains(old), "{old}");
        }
        assert!(!text.contains("vllm:kv_cache_usage_perc"));
        assert!(!text.contains("vllm:inter_token_latency_seconds"));
    }
}
