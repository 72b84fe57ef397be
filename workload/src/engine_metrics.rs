//! Reading an engine's Prometheus exposition (`/metrics` of vLLM or the simulator): the gauges and
//! counters routing and reports need, summed over engines and label sets.
//!
//! Both vLLM's current names and the older ones (`gpu_` prefixes) are read.

/// One replica's engine state, as last scraped.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct EngineGauges {
    /// Sequences running (`vllm:num_requests_running`).
    pub running: Option<f64>,
    /// Sequences waiting in the engine's queue (`vllm:num_requests_waiting`).
    pub waiting: Option<f64>,
    /// KV cache usage, 0..1 (`vllm:kv_cache_usage_perc`, formerly `gpu_cache_usage_perc`).
    pub kv_usage: Option<f64>,
    /// Preemptions since start (`vllm:num_preemptions_total`).
    pub preemptions_total: Option<f64>,
    /// Prefix-cache lookups since start, in tokens.
    pub prefix_queries_total: Option<f64>,
    /// Prefix-cache hits since start, in tokens.
    pub prefix_hits_total: Option<f64>,
    /// KV blocks the engine allocated (`vllm:cache_config_info{num_gpu_blocks}`).
    pub num_gpu_blocks: Option<u64>,
    /// Tokens per KV block (`vllm:cache_config_info{block_size}`).
    pub block_size: Option<u64>,
    /// Prompt tokens processed since start (`vllm:prompt_tokens_total`).
    pub prompt_tokens_total: Option<f64>,
    /// Output tokens generated since start (`vllm:generation_tokens_total`).
    pub generation_tokens_total: Option<f64>,
    /// When the serving process started, in Unix seconds (`process_start_time_seconds`, from
    /// prometheus_client's process collector; absent in vLLM's multi-process metrics mode).
    pub process_start_time: Option<f64>,
}

impl EngineGauges {
    /// Reads the gauges from an exposition; absent series stay `None`.
    pub fn parse(text: &str) -> Self {
        let mut g = Self::default();
        // KV usage is a fraction per engine (data-parallel ranks each report theirs): the replica's
        // is their mean, where counts and totals add up.
        let mut kv_engines = 0.0;
        for line in text.lines() {
            // Most lines are comments and histogram buckets: the name alone says whether the rest
            // of a line (labels, value) is worth reading.
            let Some((name, rest)) = split_name(line) else {
                continue;
            };
            let (slot, is_kv) = match name {
                "vllm:num_requests_running" => (&mut g.running, false),
                "vllm:num_requests_waiting" => (&mut g.waiting, false),
                "vllm:kv_cache_usage_perc" | "vllm:gpu_cache_usage_perc" => (&mut g.kv_usage, true),
                "vllm:num_preemptions_total" => (&mut g.preemptions_total, false),
                "vllm:prefix_cache_queries_total" | "vllm:gpu_prefix_cache_queries_total" => {
                    (&mut g.prefix_queries_total, false)
                }
                "vllm:prefix_cache_hits_total" | "vllm:gpu_prefix_cache_hits_total" => {
                    (&mut g.prefix_hits_total, false)
                }
                "vllm:prompt_tokens_total" => (&mut g.prompt_tokens_total, false),
                "vllm:generation_tokens_total" => (&mut g.generation_tokens_total, false),
                "process_start_time_seconds" => {
                    if let Some((_, value)) = labels_and_value(rest) {
                        g.process_start_time = Some(value);
                    }
                    continue;
                }
                "vllm:cache_config_info" => {
                    if let Some((labels, _)) = labels_and_value(rest) {
                        g.num_gpu_blocks =
                            label(labels, "num_gpu_blocks").and_then(|v| v.parse().ok());
                        g.block_size = label(labels, "block_size").and_then(|v| v.parse().ok());
                    }
                    continue;
                }
                _ => continue,
            };
            let Some((_, value)) = labels_and_value(rest) else {
                continue;
            };
            if is_kv {
                kv_engines += 1.0;
            }
            *slot = Some(slot.unwrap_or(0.0) + value);
        }
        if kv_engines > 1.0 {
            g.kv_usage = g.kv_usage.map(|sum| sum / kv_engines);
        }
        g
    }

    /// Whether the engine restarted between the scrape `before` and this one, so that it lost its
    /// prefix cache:
    ///
    /// ```text
    /// restarted ⇔ |start − start_before| > 1 s  ∨  ∃ c ∈ C: c < c_before
    /// C = { prompt tokens, generation tokens, prefix-cache queries, preemptions } (totals)
    /// ```
    ///
    /// A counter only goes back when the process that keeps it starts again (a pod replaced
    /// behind the same address, a crash and restart). The start time catches a restart that
    /// served more than its predecessor before the next scrape; the counters catch it where the
    /// start time is not exported. Series absent from either scrape say nothing (the scrape loop
    /// keeps the last value seen as the baseline, [`Self::keep_totals_of`]).
    pub fn restarted_since(&self, before: &EngineGauges) -> bool {
        if let (Some(now), Some(then)) = (self.process_start_time, before.process_start_time) {
            if (now - then).abs() > 1.0 {
                return true;
            }
        }
        [
            (self.prompt_tokens_total, before.prompt_tokens_total),
            (self.generation_tokens_total, before.generation_tokens_total),
            (self.prefix_queries_total, before.prefix_queries_total),
            (self.preemptions_total, before.preemptions_total),
        ]
        .into_iter()
        .any(|pair| matches!(pair, (Some(now), Some(then)) if now < then))
    }

    /// Takes the totals this scrape lacks (counters, start time) from `before`, so that one
    /// incomplete exposition does not erase what the next scrape's [`Self::restarted_since`] is
    /// judged against.
    pub fn keep_totals_of(&mut self, before: &EngineGauges) {
        for (now, then) in [
            (&mut self.prompt_tokens_total, before.prompt_tokens_total),
            (
                &mut self.generation_tokens_total,
                before.generation_tokens_total,
            ),
            (&mut self.prefix_queries_total, before.prefix_queries_total),
            (&mut self.prefix_hits_total, before.prefix_hits_total),
            (&mut self.preemptions_total, before.preemptions_total),
            (&mut self.process_start_time, before.process_start_time),
        ] {
            if now.is_none() {
                *now = then;
            }
        }
    }

    /// KV capacity in tokens (one block is the engine's null block and never holds data).
    pub fn kv_capacity_tokens(&self) -> Option<u64> {
        Some(self.num_gpu_blocks?.saturating_sub(1) * self.block_size?)
    }
}

/// Prefix-cache counters (queries, hits) of an exposition, when present.
pub fn prefix_counters(text: &str) -> Option<(f64, f64)> {
    let g = EngineGauges::parse(text);
    Some((g.prefix_queries_total?, g.prefix_hits_total?))
}

/// Splits one sample line into its name and the rest (label text in braces, if any, then the
/// value). Comments and blank lines give `None`.
fn split_name(line: &str) -> Option<(&str, &str)> {
    let line = line.trim();
    if line.is_empty() || line.starts_with('#') {
        return None;
    }
    let i = memchr::memchr2(b'{', b' ', line.as_bytes())?;
    Some((&line[..i], &line[i..]))
}

/// The label text (without braces) and the value of the rest of a sample line after its name;
/// `None` when the value does not parse.
fn labels_and_value(rest: &str) -> Option<(&str, f64)> {
    let (labels, rest) = match rest.strip_prefix('{') {
        Some(inner) => {
            let close = inner.rfind('}')?;
            (&inner[..close], &inner[close + 1..])
        }
        None => ("", rest),
    };
    // The value, then an optional timestamp.
    let value = rest.split_whitespace().next()?.parse().ok()?;
    Some((labels, value))
}

/// The value of label `name` in a label text such as `a="1",b="x"`.
fn label<'a>(labels: &'a str, name: &str) -> Option<&'a str> {
    let mut rest = labels;
    loop {
        let eq = rest.find("=\"")?;
        let key = rest[..eq].trim_start_matches([',', ' ']);
        let after = &rest[eq + 2..];
        let end = after.find('"')?;
        if key == name {
            return Some(&after[..end]);
        }
        rest = &after[end + 1..];
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TEXT: &str = r#"# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 2.0
vllm:num_requests_waiting{engine="0",model_name="m"} 7
vllm:gpu_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:gpu_cache_usage_perc{engine="1",model_name="m"} 0.75
vllm:num_preemptions_total{engine="0",model_name="m"} 4 1700000000000
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 1000
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 250
vllm:cache_config_info{block_size="16",cache_dtype="auto",engine="0",num_gpu_blocks="101"} 1.0
vllm:num_requests_running_total_bogus 9
"#;

    #[test]
    fn a_restart_shows_as_a_new_start_time_or_a_counter_going_back() {
        let before = EngineGauges::parse(
            "process_start_time_seconds 1700000000.25\n\
             vllm:prompt_tokens_total{engine=\"0\"} 5000\n\
             vllm:generation_tokens_total{engine=\"0\"} 800\n\
             vllm:prefix_cache_queries_total{engine=\"0\"} 5000\n",
        );
        assert_eq!(before.process_start_time, Some(1_700_000_000.25));
        assert_eq!(before.prompt_tokens_total, Some(5000.0));
        let later = |text: &str| EngineGauges::parse(text).restarted_since(&before);
        // The same process, further on: counters grew, start time unchanged.
        assert!(!later(
            "process_start_time_seconds 1700000000.25\nvllm:prompt_tokens_total 9000\n"
        ));
        // Nothing comparable scraped: no claim.
        assert!(!later("vllm:num_requests_running 1\n"));
        // A new process that already served more than the old one: the start time tells.
        assert!(later(
            "process_start_time_seconds 1700000600\nvllm:prompt_tokens_total 9000\n"
        ));
        // No start time exported (multi-process mode): a counter that went back tells.
        assert!(later("vllm:generation_tokens_total 10\n"));
        assert!(later(
            "vllm:prompt_tokens_total 0\nvllm:generation_tokens_total 900\n"
        ));
        assert!(!EngineGauges::default().restarted_since(&before));
        // A scrape without the totals keeps the baseline: a restart behind it is still found.
        let mut partial = EngineGauges::parse("vllm:num_requests_running 1\n");
        partial.keep_totals_of(&before);
        assert_eq!(partial.running, Some(1.0));
        assert_eq!(partial.prompt_tokens_total, Some(5000.0));
        assert!(EngineGauges::parse("vllm:prompt_tokens_total 10\n").restarted_since(&partial));
    }

    #[test]
    fn reads_vllm_gauges_summed_over_engines_and_kv_usage_averaged() {
        let g = EngineGauges::parse(TEXT);
        assert_eq!(g.running, Some(5.0));
        assert_eq!(g.waiting, Some(7.0));
        assert_eq!(g.kv_usage, Some(0.5));
        assert_eq!(g.preemptions_total, Some(4.0));
        assert_eq!((g.num_gpu_blocks, g.block_size), (Some(101), Some(16)));
        assert_eq!(g.kv_capacity_tokens(), Some(1600));
        assert_eq!(prefix_counters(TEXT), Some((1000.0, 250.0)));
    }

    #[test]
    fn absent_or_garbled_series_stay_unknown() {
        let g = EngineGauges::parse("vllm:num_requests_running{engine=\"0\"} NaNx\ngarbage{\n");
        assert_eq!(g, EngineGauges::default());
        assert_eq!(prefix_counters(""), None);
    }

    #[test]
    fn reads_only_the_named_series_whatever_surrounds_them() {
        // Look-alike names (a histogram's buckets, a longer name with a wanted one as its prefix),
        // comments naming a wanted series, indented lines, a timestamp after the value, a label
        // value holding a brace, a garbled line of another series, and a wanted series whose value
        // is garbled between two good ones.
        let g = EngineGauges::parse(
            "# HELP vllm:num_requests_running 9\n\
             # TYPE vllm:num_requests_waiting gauge\n\
             vllm:num_requests_running_bucket{le=\"1\"} 100\n\
             vllm:num_requests_runningx 100\n\
             vllm:e2e_request_latency_seconds_sum{model_name=\"m\"} garbled\n\
             \x20 vllm:num_requests_running{engine=\"0\"} 2 1700000000000\n\
             vllm:num_requests_running{engine=\"1\"} x\n\
             vllm:num_requests_running 3\n\
             vllm:num_requests_waiting{model_name=\"a}b\"} 4\n\
             vllm:kv_cache_usage_perc{engine=\"0\"} 0.2\n\
             vllm:kv_cache_usage_perc{engine=\"1\"} bad\n\
             vllm:cache_config_info{block_size=\"16\",num_gpu_blocks=\"11\"} 1.0\n",
        );
        assert_eq!(g.running, Some(5.0));
        assert_eq!(g.waiting, Some(4.0));
        // The garbled engine is not counted in the mean.
        assert_eq!(g.kv_usage, Some(0.2));
        assert_eq!(g.kv_capacity_tokens(), Some(160));
        assert_eq!(g.preemptions_total, None);
    }
}
