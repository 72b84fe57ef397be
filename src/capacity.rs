//! `headroom capacity`: the capacity note of a model on a GPU (docs/admission.md).

use std::path::Path;

use anyhow::{Context, bail};
use clap::{Args, ValueEnum};
use headroom_workload::capacity::{capacity_note, capacity_text};
use headroom_workload::profile::{Deployment, GpuSpec, ModelSpec};

/// KV cache element type.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum KvDtype {
    /// 2 bytes per element (vLLM's default, `auto` on a bf16 model).
    Bf16,
    /// 1 byte per element (`--kv-cache-dtype fp8`).
    Fp8,
}

/// Flags of `headroom capacity`.
#[derive(Debug, Args)]
pub struct CapacityArgs {
    /// A preset (`llama-3.1-8b`, `llama-3.1-70b`) or a Hugging Face `config.json`.
    #[arg(long, value_name = "NAME|config.json")]
    model: String,
    /// GPU: `h100` or `h200`.
    #[arg(long, value_name = "NAME")]
    gpu: String,
    /// Tensor-parallel degree [default: the smallest power of two that holds one full context].
    #[arg(long)]
    tp: Option<u32>,
    /// KV cache element type.
    #[arg(long, value_enum, default_value_t = KvDtype::Bf16)]
    kv_dtype: KvDtype,
    /// Context per sequence (prompt + output) the note is computed for.
    #[arg(long, default_value_t = 2_300)]
    context: u32,
    /// vLLM's `--gpu-memory-utilization`.
    #[arg(long, default_value_t = 0.92)]
    gpu_memory_utilization: f64,
    /// Tokens per KV block (vLLM's `--block-size`).
    #[arg(long, default_value_t = 16)]
    block_size: u32,
    /// Print JSON instead of text.
    #[arg(long)]
    json: bool,
}

/// Prints the note.
pub fn run(a: CapacityArgs) -> anyhow::Result<()> {
    let gpu = GpuSpec::by_name(&a.gpu)
        .with_context(|| format!("unknown GPU `{}`: use h100 or h200", a.gpu))?;
    // A model directory (a Hugging Face checkout) is read through its config.json.
    let file = if Path::new(&a.model).is_dir() {
        let file = Path::new(&a.model).join("config.json");
        if !file.is_file() {
            bail!("{} is a directory without a config.json", a.model);
        }
        file
    } else {
        Path::new(&a.model).to_path_buf()
    };
    let model = if a.model.ends_with(".json") || file.is_file() {
        let text = std::fs::read_to_string(&file)
            .with_context(|| format!("reading {}", file.display()))?;
        let name = file
            .parent()
            .and_then(|p| p.file_name())
            .map_or_else(|| a.model.clone(), |n| n.to_string_lossy().into_owned());
        ModelSpec::from_hf_config(&name, &text)
            .map_err(|e| anyhow::anyhow!("{}: {e}", file.display()))?
    } else {
        ModelSpec::by_name(&a.model).with_context(|| {
            format!(
                "unknown model `{}`: use llama-3.1-8b, llama-3.1-70b or a config.json",
                a.model
            )
        })?
    };
    if !(a.gpu_memory_utilization > 0.0 && a.gpu_memory_utilization <= 1.0) {
        bail!("--gpu-memory-utilization must be in (0, 1]");
    }
    if a.context == 0 || a.block_size == 0 || a.tp == Some(0) {
        bail!("--context, --block-size and --tp must be positive");
    }
    if let Some(why) = a.tp.and_then(|tp| model.tp_refusal(tp)) {
        bail!("{why}");
    }
    if a.context > model.max_model_len {
        bail!(
            "--context {} is longer than {} takes ({} tokens, max_position_embeddings)",
            a.context,
            model.name,
            model.max_model_len
        );
    }
    let mut d = match a.tp {
        Some(tp) => Deployment::new(model, gpu, tp),
        None => Deployment::fitting(model, gpu),
    };
    d.gpu_memory_utilization = a.gpu_memory_utilization;
    d.kv_bytes = match a.kv_dtype {
        KvDtype::Bf16 => 2.0,
        KvDtype::Fp8 => 1.0,
    };
    let note = capacity_note(&d, a.context, a.block_size);
    if note.kv_blocks == 0 {
        bail!(
            "{} does not fit on {} × {} at utilisation {}: no memory is left for the KV cache (try a larger --tp)",
            note.model,
            note.tp,
            note.gpu,
            a.gpu_memory_utilization
        );
    }
    if note.sequences_at_context < 1.0 {
        bail!(
            "not one sequence of --context {} tokens fits in {}'s KV cache on {} × {} ({} tokens): try a larger --tp or fp8 KV",
            a.context,
            note.model,
            note.tp,
            note.gpu,
            note.kv_tokens
        );
    }
    if a.json {
        println!("{}", serde_json::to_string_pretty(&note)?);
    } else {
        print!("{}", capacity_text(&note));
    }
    Ok(())
}
