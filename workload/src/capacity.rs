//! The capacity note: how much KV cache a deployment has, how many sequences of a given context it
//! holds, what one decode step reads from memory as the batch grows, where the memory knee and the
//! compute ridge fall, and the admission cap that keeps a replica below the point where it preempts.
//!
//! ```text
//! W_read   = bytes·(P_L + P_head)              weights read by every decode step (all ranks)
//! b_kv     = 2·L·n_kv·d_h·kv_bytes             KV bytes per token
//! KV_tok   = blocks·block_size                 KV capacity in tokens (profile.rs)
//! seqs(C)  = KV_tok / C                        sequences of context C the cache holds (the knee)
//! KV_read(B, C) = B·C·b_kv                     KV bytes one decode step reads at batch B
//! share(B, C)   = KV_read / (KV_read + W_read)
//! B_cross(C)    = W_read / (C·b_kv)            KV reads overtake weight reads
//! FLOP(B, C)    = B·(2·(P_L + P_head) + 4·L·n_q·d_h·C)
//! I(B, C)       = FLOP / (W_read + KV_read)    arithmetic intensity, FLOP per byte
//! ridge         = F / BW                       the GPU's compute ridge, FLOP per byte
//! I(∞, C)       = (2·(P_L + P_head) + 4·L·n_q·d_h·C) / (C·b_kv)    decode's ceiling as B grows
//! T_step(B, C)  = max(FLOP/(tp·η_c·F), (W_read + KV_read)/(tp·η_m·BW))
//! cap(C)        = min(max_num_seqs, floor(headroom · seqs(C)))
//! ```
//!
//! | parameter | meaning | default |
//! |---|---|---|
//! | `C` | context per sequence (prompt + output) the note is computed for | 2,300 |
//! | `headroom` | fraction of the KV cache the cap plans to fill | 0.9 |
//! | η_m, η_c | achieved fractions of bandwidth and peak FLOP/s (as the simulator's roofline) | 0.70, 0.65 |

use serde::Serialize;

use crate::profile::Deployment;

/// Achieved fraction of HBM bandwidth.
pub const MEM_EFFICIENCY: f64 = 0.70;
/// Achieved fraction of peak FLOP/s.
pub const COMPUTE_EFFICIENCY: f64 = 0.65;
/// Fraction of the KV cache the recommended cap plans to fill.
pub const HEADROOM: f64 = 0.9;
/// Batch sizes the note tabulates.
pub const BATCHES: &[u32] = &[1, 8, 16, 32, 50, 60, 64, 100, 128, 200, 256, 512];

/// One batch size's decode step.
#[derive(Debug, Clone, Serialize)]
pub struct DecodeRow {
    /// Sequences in the step.
    pub batch: u32,
    /// Whether that many sequences of the context fit in the KV cache.
    pub fits: bool,
    /// Weight bytes read (all ranks).
    pub weight_read_bytes: f64,
    /// KV bytes read (all ranks).
    pub kv_read_bytes: f64,
    /// KV's share of the bytes read.
    pub kv_share: f64,
    /// FLOP per byte.
    pub intensity: f64,
    /// Modelled step time, ms.
    pub step_ms: f64,
    /// Output tokens per second of the replica at this batch.
    pub tokens_per_s: f64,
}

/// The capacity note of one deployment at one context.
#[derive(Debug, Clone, Serialize)]
pub struct CapacityNote {
    /// Model name.
    pub model: String,
    /// GPU name.
    pub gpu: String,
    /// Tensor-parallel degree.
    pub tp: u32,
    /// Bytes per KV element.
    pub kv_bytes: f64,
    /// `gpu_memory_utilization`.
    pub gpu_memory_utilization: f64,
    /// Weights held in memory, bytes (all ranks).
    pub weight_memory_bytes: f64,
    /// Weights read by each decode step, bytes (all ranks).
    pub weight_read_bytes: f64,
    /// KV bytes per token.
    pub kv_bytes_per_token: f64,
    /// KV cache per GPU, bytes.
    pub kv_memory_per_gpu: f64,
    /// Tokens per KV block.
    pub block_size: u32,
    /// KV blocks (vLLM's `num_gpu_blocks`).
    pub kv_blocks: u64,
    /// KV capacity in tokens.
    pub kv_tokens: u64,
    /// The context the rest is computed for.
    pub context: u32,
    /// Sequences of that context the cache holds: the memory knee.
    pub sequences_at_context: f64,
    /// Batch at which KV reads equal weight reads.
    pub kv_crossover_batch: f64,
    /// The GPU's compute ridge, FLOP per byte.
    pub ridge_intensity: f64,
    /// Decode's arithmetic intensity as the batch grows without bound, at this context.
    pub decode_intensity_ceiling: f64,
    /// Smallest batch at which a decode step is compute-bound (None: never at this context).
    pub compute_bound_batch: Option<f64>,
    /// vLLM's default `max_num_seqs` for this GPU.
    pub max_num_seqs: u32,
    /// The recommended admission cap in sequences.
    pub recommended_cap: u32,
    /// The decode step at the tabulated batch sizes.
    pub rows: Vec<DecodeRow>,
}

/// Computes the note of `d` for sequences of `context` tokens in `block_size`-token blocks.
pub fn capacity_note(d: &Deployment, context: u32, block_size: u32) -> CapacityNote {
    let m = &d.model;
    let w_read = m.weight_read_bytes(d.weight_bytes);
    let b_kv = m.kv_bytes_per_token(d.kv_bytes);
    let blocks = d.kv_blocks(block_size);
    let kv_tokens = blocks * u64::from(block_size);
    let c = f64::from(context.max(1));
    let flop_per_seq = 2.0 * (m.layer_params() + m.head_params())
        + 4.0 * f64::from(m.layers) * f64::from(m.heads) * f64::from(m.head_dim) * c;
    let kv_per_seq = c * b_kv;
    let tp = f64::from(d.tp);
    let compute_rate = tp * COMPUTE_EFFICIENCY * d.gpu.flops;
    let memory_rate = tp * MEM_EFFICIENCY * d.gpu.bandwidth;
    let seqs = kv_tokens as f64 / c;
    // Compute-bound once B·flop/compute_rate ≥ (W + B·kv)/memory_rate.
    let denominator = flop_per_seq / compute_rate - kv_per_seq / memory_rate;
    let compute_bound_batch = (denominator > 0.0).then(|| (w_read / memory_rate) / denominator);
    let (_, max_num_seqs) = d.batch_defaults();
    let rows = BATCHES
        .iter()
        .map(|&b| {
            let bf = f64::from(b);
            let kv = bf * kv_per_seq;
            let flop = bf * flop_per_seq;
            let step = (flop / compute_rate).max((w_read + kv) / memory_rate);
            DecodeRow {
                batch: b,
                fits: bf <= seqs,
                weight_read_bytes: w_read,
                kv_read_bytes: kv,
                kv_share: kv / (kv + w_read),
                intensity: flop / (w_read + kv),
                step_ms: step * 1e3,
                tokens_per_s: bf / step,
            }
        })
        .collect();
    CapacityNote {
        model: m.name.clone(),
        gpu: d.gpu.name.clone(),
        tp: d.tp,
        kv_bytes: d.kv_bytes,
        gpu_memory_utilization: d.gpu_memory_utilization,
        weight_memory_bytes: m.weight_memory_bytes(d.weight_bytes),
        weight_read_bytes: w_read,
        kv_bytes_per_token: b_kv,
        kv_memory_per_gpu: d.kv_memory_per_gpu(),
        block_size,
        kv_blocks: blocks,
        kv_tokens,
        context,
        sequences_at_context: seqs,
        kv_crossover_batch: w_read / kv_per_seq,
        ridge_intensity: d.gpu.flops / d.gpu.bandwidth,
        decode_intensity_ceiling: flop_per_seq / kv_per_seq,
        compute_bound_batch,
        max_num_seqs,
        recommended_cap: ((HEADROOM * seqs).floor() as u32).clamp(1, max_num_seqs),
        rows,
    }
}

fn gb(x: f64) -> String {
    format!("{:.2} GB", x / 1e9)
}

/// The note as text.
pub fn capacity_text(n: &CapacityNote) -> String {
    use std::fmt::Write as _;
    let mut s = String::new();
    let dtype = if n.kv_bytes >= 2.0 { "bf16" } else { "fp8" };
    let _ = writeln!(
        s,
        "{} on {} × {} (tp {}), KV cache in {dtype}, gpu_memory_utilization {}",
        n.model, n.tp, n.gpu, n.tp, n.gpu_memory_utilization
    );
    let _ = writeln!(s);
    let _ = writeln!(
        s,
        "weights in memory      {} ({} per GPU)",
        gb(n.weight_memory_bytes),
        gb(n.weight_memory_bytes / f64::from(n.tp))
    );
    let _ = writeln!(s, "weights read per step  {}", gb(n.weight_read_bytes));
    let _ = writeln!(
        s,
        "KV per token           {:.0} bytes",
        n.kv_bytes_per_token
    );
    let _ = writeln!(
        s,
        "KV cache               {} per GPU = {} blocks of {} tokens = {} tokens",
        gb(n.kv_memory_per_gpu.max(0.0)),
        n.kv_blocks,
        n.block_size,
        n.kv_tokens
    );
    let _ = writeln!(
        s,
        "at {} tokens of context: {:.1} sequences fit (the memory knee)",
        n.context, n.sequences_at_context
    );
    let _ = writeln!(
        s,
        "KV reads overtake weight reads at batch {:.1}",
        n.kv_crossover_batch
    );
    match n.compute_bound_batch {
        Some(b) => {
            let _ = writeln!(
                s,
                "compute ridge {:.0} FLOP/byte: decode becomes compute-bound at batch {b:.0}",
                n.ridge_intensity
            );
        }
        None => {
            let _ = writeln!(
                s,
                "compute ridge {:.0} FLOP/byte: decode at this context never reaches it (at most {:.1} FLOP/byte however large the batch): memory-bound at every batch",
                n.ridge_intensity, n.decode_intensity_ceiling
            );
        }
    }
    let _ = writeln!(s);
    let _ = writeln!(
        s,
        "{:>6} {:>5} {:>11} {:>11} {:>9} {:>10} {:>9} {:>11}",
        "batch", "fits", "weights GB", "KV GB", "KV share", "FLOP/byte", "step ms", "tokens/s"
    );
    for r in &n.rows {
        let _ = writeln!(
            s,
            "{:>6} {:>5} {:>11.2} {:>11.2} {:>8.1}% {:>10.1} {:>9.2} {:>11.0}",
            r.batch,
            if r.fits { "yes" } else { "no" },
            r.weight_read_bytes / 1e9,
            r.kv_read_bytes / 1e9,
            100.0 * r.kv_share,
            r.intensity,
            r.step_ms,
            r.tokens_per_s
        );
    }
    let _ = writeln!(s);
    let _ = writeln!(
        s,
        "recommended admission cap: {} sequences per replica ({:.0}% of the {:.1} that fit at {} tokens; vLLM's max_num_seqs is {})",
        n.recommended_cap,
        100.0 * HEADROOM,
        n.sequences_at_context,
        n.context,
        n.max_num_seqs
    );
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn llama_8b_on_h100_kv_overtakes_weights_near_batch_50_at_2300_tokens() {
        let d = Deployment::preset("8b", "h100").unwrap();
        let n = capacity_note(&d, 2_300, 16);
        assert_eq!(n.kv_bytes_per_token, 131_072.0);
        // W_read = 15.01 GB; one 2,300-token sequence's KV = 301.5 MB.
        assert!(
            (n.kv_crossover_batch - 49.8).abs() < 0.2,
            "{}",
            n.kv_crossover_batch
        );
        let share = |b: u32| n.rows.iter().find(|r| r.batch == b).unwrap().kv_share;
        assert!(share(50) > 0.49 && share(50) < 0.51);
        assert!(share(60) > 0.5);
        assert!((share(200) - 0.80).abs() < 0.01, "{}", share(200));
        // Decode's intensity tops out near 54 FLOP/byte, far below H100's ridge of 295.
        assert!((n.ridge_intensity - 295.2).abs() < 0.5);
        assert!((n.decode_intensity_ceiling - 53.7).abs() < 0.2);
        assert!(n.compute_bound_batch.is_none());
        // 460,512 tokens of cache hold 200 such sequences; the cap keeps 10% spare.
        assert_eq!(n.kv_tokens, 460_512);
        assert_eq!(n.recommended_cap, 180);
        let text = capacity_text(&n);
        assert!(text.contains("131072 bytes"), "{text}");
    }

    #[test]
    fn fp8_halves_kv_and_short_contexts_reach_the_ridge() {
        let mut d = Deployment::preset("8b", "h100").unwrap();
        d.kv_bytes = 1.0;
        let n = capacity_note(&d, 2_300, 16);
        assert_eq!(n.kv_bytes_per_token, 65_536.0);
        assert!((n.kv_crossover_batch - 99.6).abs() < 0.5);
        // With almost no context, decode is a weights-only GEMV: compute-bound near batch
        // (F·η_c)/(BW·η_m) ≈ 274.
        let short = capacity_note(&Deployment::preset("8b", "h100").unwrap(), 1, 16);
        let b = short.compute_bound_batch.unwrap();
        assert!((260.0..290.0).contains(&b), "{b}");
    }
}
