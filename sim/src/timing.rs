//! Step time: how long one engine step takes, given what the scheduler put in it.
//!
//! **Roofline** (default). Prefill chunks i compute c_i new tokens on top of p_i cached or computed
//! ones; decodes j attend over ctx_j tokens; N = Σc_i + B_decode tokens; S scheduled requests.
//! ```text
//! FLOPs  = 2·P_L·N + 2·P_head·S + 4·L·n_q·d_h·[Σ_i(c_i·p_i + c_i(c_i+1)/2) + Σ_j ctx_j]
//! Bytes  = W_read + b_kv·(Σ_i p_i + Σ_j ctx_j + N)
//! T_comm = (tp > 1) · 2·L·(α + 2·(tp−1)/tp · N·d·2 / link_bw)
//! T_step = T_ovh + max(FLOPs/(tp·η_c·F), Bytes/(tp·η_m·BW)) + T_comm
//! ```
//! | parameter | flag | default |
//! |---|---|---|
//! | η_m, memory efficiency | `--mem-efficiency` | 0.70 |
//! | η_c, compute efficiency | `--compute-efficiency` | 0.65 |
//! | T_ovh, fixed per-step overhead | `--step-overhead-ms` | 1.0 ms |
//! | α, all-reduce latency | `--allreduce-latency-us` | 8 µs |
//!
//! **Constant** (llm-d's `constant`): a step with any prefill takes `time-to-first-token`, any
//! other step `inter-token-latency`. **Per-token** (llm-d's `per-token`): a step with prefill takes
//! `prefill-overhead + new prefill tokens · prefill-time-per-token`, plus `inter-token-latency` when
//! it also decodes. Both: optional Gaussian jitter (standard deviation as a fraction of the mean,
//! clamped to ±70%), and llm-d's load factor `1 + (f−1)(running−1)/(max_num_seqs−1)`.
//!
//! **Fixed** (per request, no shared steps): each request runs on its own clock, first token
//! `time-to-first-token` after it was admitted (its arrival, unless it had to wait for KV blocks or
//! a `max_num_seqs` slot), then one every `inter-token-latency`; jitter and the load factor apply to
//! each interval. No request's timing depends on another's, so a delay in front of the replica
//! shows up in full and alone: a reference backend for measuring what stands in front of it (a
//! proxy's hop), not a model of a GPU.

use std::time::Duration;

use rand::rngs::StdRng;
use rand_distr::{Distribution, Normal};

use crate::profile::Deployment;

/// What one step computes (filled in by the scheduler).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StepShape {
    /// New tokens computed (N).
    pub tokens: u64,
    /// Requests scheduled (S).
    pub requests: u64,
    /// Prefill chunks in the step.
    pub prefill_chunks: u64,
    /// New prefill tokens (Σ c_i).
    pub prefill_tokens: u64,
    /// Σ p_i over prefill chunks.
    pub prefill_context: u64,
    /// Σ (c_i·p_i + c_i(c_i+1)/2): attention pairs of the prefill chunks.
    pub prefill_attention: f64,
    /// Decodes in the step.
    pub decodes: u64,
    /// Σ ctx_j over decodes.
    pub decode_context: u64,
    /// Requests running after scheduling (for the load factor).
    pub running: u64,
}

impl StepShape {
    /// Adds a prefill chunk of `c` new tokens over `p` already computed.
    pub fn add_prefill(&mut self, c: u64, p: u64) {
        self.tokens += c;
        self.requests += 1;
        self.prefill_chunks += 1;
        self.prefill_tokens += c;
        self.prefill_context += p;
        let (c, p) = (c as f64, p as f64);
        self.prefill_attention += c * p + c * (c + 1.0) / 2.0;
    }

    /// Adds a decode over a context of `ctx` tokens.
    pub fn add_decode(&mut self, ctx: u64) {
        self.tokens += 1;
        self.requests += 1;
        self.decodes += 1;
        self.decode_context += ctx;
    }
}

/// Roofline constants.
#[derive(Debug, Clone, PartialEq)]
pub struct Roofline {
    /// The deployment the constants come from.
    pub deployment: Deployment,
    /// η_m.
    pub mem_efficiency: f64,
    /// η_c.
    pub compute_efficiency: f64,
    /// T_ovh.
    pub overhead: Duration,
    /// α.
    pub allreduce_latency: Duration,
}

impl Roofline {
    /// The reference defaults for a deployment.
    pub fn new(deployment: Deployment) -> Self {
        Self {
            deployment,
            mem_efficiency: 0.70,
            compute_efficiency: 0.65,
            overhead: Duration::from_millis(1),
            allreduce_latency: Duration::from_micros(8),
        }
    }

    /// FLOPs and bytes of a step.
    pub fn work(&self, s: &StepShape) -> (f64, f64) {
        let m = &self.deployment.model;
        let attn = 4.0 * f64::from(m.layers) * f64::from(m.heads) * f64::from(m.head_dim);
        let flops = 2.0 * m.layer_params() * s.tokens as f64
            + 2.0 * m.head_params() * s.requests as f64
            + attn * (s.prefill_attention + s.decode_context as f64);
        let kv = m.kv_bytes_per_token(self.deployment.kv_bytes);
        let bytes = m.weight_read_bytes(self.deployment.weight_bytes)
            + kv * (s.prefill_context + s.decode_context + s.tokens) as f64;
        (flops, bytes)
    }

    /// Modelled duration of a step.
    pub fn step_time(&self, s: &StepShape) -> Duration {
        let d = &self.deployment;
        let tp = f64::from(d.tp);
        let (flops, bytes) = self.work(s);
        let compute = flops / (tp * self.compute_efficiency * d.gpu.flops);
        let memory = bytes / (tp * self.mem_efficiency * d.gpu.bandwidth);
        let comm = if d.tp > 1 {
            let per_reduce = self.allreduce_latency.as_secs_f64()
                + 2.0 * (tp - 1.0) / tp * s.tokens as f64 * f64::from(d.model.hidden) * 2.0
                    / d.gpu.link_bandwidth;
            2.0 * f64::from(d.model.layers) * per_reduce
        } else {
            0.0
        };
        self.overhead + Duration::from_secs_f64(compute.max(memory) + comm)
    }
}

/// Jitter and load scaling shared by the constant and per-token modes.
#[derive(Debug, Clone, PartialEq)]
pub struct Variation {
    /// Standard deviation as a fraction of the mean (0 = none; at most 0.3 as in llm-d).
    pub std_dev_fraction: f64,
    /// llm-d's `time-factor-under-load` f (1 = none).
    pub load_factor: f64,
    /// `max_num_seqs`, the load factor's denominator.
    pub max_num_seqs: u64,
}

impl Variation {
    fn apply(&self, base: Duration, running: u64, rng: &mut StdRng) -> Duration {
        let mut t = base.as_secs_f64();
        if self.load_factor != 1.0 && self.max_num_seqs > 1 {
            let share = running.saturating_sub(1) as f64 / (self.max_num_seqs - 1) as f64;
            t *= 1.0 + (self.load_factor - 1.0) * share.min(1.0);
        }
        if self.std_dev_fraction > 0.0 && t > 0.0 {
            if let Ok(normal) = Normal::new(t, t * self.std_dev_fraction) {
                t = normal.sample(rng).clamp(0.3 * t, 1.7 * t);
            }
        }
        Duration::try_from_secs_f64(t.max(0.0)).unwrap_or(Duration::MAX)
    }
}

/// The step-time model in use.
#[derive(Debug, Clone, PartialEq)]
pub enum StepTimer {
    /// The roofline model.
    Roofline(Roofline),
    /// Fixed TTFT-step and ITL-step times.
    Constant {
        /// Duration of a step that contains prefill.
        ttft: Duration,
        /// Duration of a decode-only step.
        itl: Duration,
        /// Jitter and load scaling.
        variation: Variation,
    },
    /// Prefill time proportional to new prompt tokens.
    PerToken {
        /// Fixed cost of a step with prefill.
        prefill_overhead: Duration,
        /// Cost per new prefill token.
        prefill_per_token: Duration,
        /// Duration of decoding (added to prefill when both are in a step).
        itl: Duration,
        /// Jitter and load scaling.
        variation: Variation,
    },
    /// Every request on its own clock (no steps): first token `ttft` after admission, then one
    /// every `itl`.
    Fixed {
        /// Admission to first token.
        ttft: Duration,
        /// Between two tokens of one request.
        itl: Duration,
        /// Jitter and load scaling, per interval.
        variation: Variation,
    },
}

impl StepTimer {
    /// Whether requests run on their own clocks ([`Self::Fixed`]) rather than in shared steps.
    pub fn is_per_request(&self) -> bool {
        matches!(self, Self::Fixed { .. })
    }

    /// Fixed mode: the wait before a request's next token (`first`: its first), with `running`
    /// requests in the engine.
    pub fn per_request_interval(&self, first: bool, running: u64, rng: &mut StdRng) -> Duration {
        match self {
            Self::Fixed {
                ttft,
                itl,
                variation,
            } => variation.apply(if first { *ttft } else { *itl }, running, rng),
            // The step models have no per-request clock; a step of their decode time stands in.
            _ => self.step_time(&StepShape::default(), rng),
        }
    }

    /// Duration of a step of shape `s`.
    pub fn step_time(&self, s: &StepShape, rng: &mut StdRng) -> Duration {
        match self {
            Self::Roofline(r) => r.step_time(s),
            // Fixed mode never forms steps; a step shaped like one of its emissions costs the same.
            Self::Constant {
                ttft,
                itl,
                variation,
            }
            | Self::Fixed {
                ttft,
                itl,
                variation,
            } => {
                let base = if s.prefill_chunks > 0 { *ttft } else { *itl };
                variation.apply(base, s.running, rng)
            }
            Self::PerToken {
                prefill_overhead,
                prefill_per_token,
                itl,
                variation,
            } => {
                let mut base = Duration::ZERO;
                if s.prefill_chunks > 0 {
                    base += *prefill_overhead + prefill_per_token.mul_f64(s.prefill_tokens as f64);
                }
                if s.decodes > 0 {
                    base += *itl;
                }
                variation.apply(base, s.running, rng)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    fn roofline_8b() -> Roofline {
        Roofline::new(Deployment::preset("8b", "h100").unwrap())
    }

    fn ms(d: Duration) -> f64 {
        d.as_secs_f64() * 1e3
    }

    fn within(actual: f64, expected: f64, tolerance: f64) -> bool {
        (actual - expected).abs() <= expected * tolerance
    }

    #[test]
    fn decode_alone_at_1k_context_is_about_7_5_ms() {
        let mut s = StepShape::default();
        s.add_decode(1024);
        let t = ms(roofline_8b().step_time(&s));
        assert!(within(t, 7.5, 0.10), "{t}");
    }

    #[test]
    fn uncached_4000_token_prefill_is_about_94_ms_and_compute_bound() {
        let r = roofline_8b();
        let mut s = StepShape::default();
        s.add_prefill(4000, 0);
        let t = ms(r.step_time(&s));
        assert!(within(t, 94.0, 0.10), "{t}");
        let (flops, bytes) = r.work(&s);
        assert!(flops / (0.65 * 989e12) > bytes / (0.70 * 3.35e12));
    }

    #[test]
    fn cached_prefix_makes_prefill_much_faster() {
        let mut s = StepShape::default();
        s.add_prefill(4000 - 3008, 3008);
        let t = ms(roofline_8b().step_time(&s));
        assert!(within(t, 25.4, 0.10), "{t}");
    }

    #[test]
    fn batched_decode_and_mixed_steps_match_the_reference_table() {
        let r = roofline_8b();
        let mut decode64 = StepShape::default();
        for _ in 0..64 {
            decode64.add_decode(2048);
        }
        assert!(within(ms(r.step_time(&decode64)), 14.6, 0.10));
        let mut mixed = decode64.clone();
        mixed.add_prefill(2048, 0);
        // 2048-token chunk + 63 decodes at 2k ≈ 48.8 ms; one more decode changes little.
        assert!(
            within(ms(r.step_time(&mixed)), 48.8, 0.10),
            "{}",
            ms(r.step_time(&mixed))
        );
    }

    #[test]
    fn constant_mode_jitter_stays_clamped_and_is_seeded() {
        let timer = StepTimer::Constant {
            ttft: Duration::from_millis(100),
            itl: Duration::from_millis(10),
            variation: Variation {
                std_dev_fraction: 0.3,
                load_factor: 1.0,
                max_num_seqs: 8,
            },
        };
        let mut decode = StepShape::default();
        decode.add_decode(10);
        let draw = |seed| {
            let mut rng = StdRng::seed_from_u64(seed);
            (0..1000)
                .map(|_| timer.step_time(&decode, &mut rng))
                .collect::<Vec<_>>()
        };
        let a = draw(1);
        assert_eq!(a, draw(1));
        assert!(a.iter().all(|d| (3.0..=17.0).contains(&ms(*d))));
        let mean = a.iter().map(|d| ms(*d)).sum::<f64>() / a.len() as f64;
        assert!(within(mean, 10.0, 0.05), "{mean}");
    }

    #[test]
    fn load_factor_scales_linearly_with_running_requests() {
        let v = Variation {
            std_dev_fraction: 0.0,
            load_factor: 2.0,
            max_num_seqs: 5,
        };
        let mut rng = StdRng::seed_from_u64(0);
        let base = Duration::from_millis(10);
        assert_eq!(v.apply(base, 1, &mut rng), base);
        assert_eq!(v.apply(base, 5, &mut rng), base * 2);
        assert_eq!(v.apply(base, 3, &mut rng), base * 3 / 2);
    }
}
