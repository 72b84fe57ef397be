//! Model and GPU profiles: the numbers the simulator's step-time model, the KV block count and the
//! capacity note are computed from. Models come from presets or a Hugging Face `config.json`.
//!
//! ```text
//! P_layer   = d·n_q·d_h + 2·d·n_kv·d_h + n_q·d_h·d + 3·d·d_ff          (attention + SwiGLU MLP)
//! P_L       = L·P_layer            P_head = V·d            P_embed = V·d (0 when tied)
//! W_read    = bytes·(P_L + P_head)                  weights read by every forward pass
//! W_mem     = bytes·(P_L + P_head + P_embed)        weights held in memory
//! b_kv      = 2·L·n_kv·d_h·kv_bytes                 KV bytes per token (all ranks together)
//! avail/GPU = mem·util − W_mem/tp − reserved
//! blocks    = floor(avail / (block_size·b_kv/tp))
//! ```
//!
//! | symbol | field | Llama-3.1-8B | Llama-3.1-70B |
//! |---|---|---|---|
//! | L | `layers` | 32 | 80 |
//! | d | `hidden` | 4096 | 8192 |
//! | n_q / n_kv | `heads` / `kv_heads` | 32 / 8 | 64 / 8 |
//! | d_h | `head_dim` | 128 | 128 |
//! | d_ff | `ffn` | 14336 | 28672 |
//! | V | `vocab` | 128256 | 128256 |
//!
//! | GPU | memory seen by torch | HBM bandwidth | dense bf16 |
//! |---|---|---|---|
//! | H100 SXM | 79.1 GiB | 3.35 TB/s | 989 TFLOP/s |
//! | H200 SXM | 139.8 GiB | 4.8 TB/s | 989 TFLOP/s |

use serde::Deserialize;

const GIB: f64 = 1024.0 * 1024.0 * 1024.0;

/// A decoder-only transformer's shape.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelSpec {
    /// Model id served (`--model`).
    pub name: String,
    /// Transformer layers (L).
    pub layers: u32,
    /// Hidden size (d).
    pub hidden: u32,
    /// Query heads (n_q).
    pub heads: u32,
    /// KV heads (n_kv).
    pub kv_heads: u32,
    /// Head dimension (d_h).
    pub head_dim: u32,
    /// MLP intermediate size (d_ff).
    pub ffn: u32,
    /// Vocabulary size (V).
    pub vocab: u32,
    /// Input and output embeddings shared.
    #[serde(default)]
    pub tied_embeddings: bool,
    /// Longest context the model serves.
    pub max_model_len: u32,
}

impl ModelSpec {
    /// Llama-3.1-8B.
    pub fn llama_3_1_8b() -> Self {
        Self {
            name: "meta-llama/Llama-3.1-8B-Instruct".into(),
            layers: 32,
            hidden: 4096,
            heads: 32,
            kv_heads: 8,
            head_dim: 128,
            ffn: 14336,
            vocab: 128_256,
            tied_embeddings: false,
            max_model_len: 131_072,
        }
    }

    /// Llama-3.1-70B.
    pub fn llama_3_1_70b() -> Self {
        Self {
            name: "meta-llama/Llama-3.1-70B-Instruct".into(),
            layers: 80,
            hidden: 8192,
            heads: 64,
            kv_heads: 8,
            head_dim: 128,
            ffn: 28672,
            vocab: 128_256,
            tied_embeddings: false,
            max_model_len: 131_072,
        }
    }

    /// Reads a Hugging Face `config.json` (Llama, Mistral, Qwen and other decoder-only shapes):
    /// `num_hidden_layers`, `hidden_size`, `num_attention_heads`, `num_key_value_heads` (absent:
    /// as many as the query heads), `head_dim` (absent: hidden / heads), `intermediate_size`,
    /// `vocab_size`, `tie_word_embeddings`, `max_position_embeddings`.
    pub fn from_hf_config(name: &str, json: &str) -> Result<Self, String> {
        let v: serde_json::Value =
            serde_json::from_str(json).map_err(|e| format!("not JSON: {e}"))?;
        // Multimodal configs keep the language model's shape under `text_config`.
        let v = v.get("text_config").unwrap_or(&v);
        let field = |k: &str| -> Result<u32, String> {
            v.get(k)
                .and_then(serde_json::Value::as_u64)
                .and_then(|x| u32::try_from(x).ok())
                .filter(|&x| x > 0)
                .ok_or_else(|| {
                    format!(
                        "`{k}` is missing or not a positive integer below 2^32 (got {})",
                        v.get(k)
                            .map_or_else(|| "nothing".to_owned(), ToString::to_string)
                    )
                })
        };
        let heads = field("num_attention_heads")?;
        let kv_heads = field("num_key_value_heads").unwrap_or(heads);
        if heads % kv_heads != 0 {
            return Err(format!(
                "num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}"
            ));
        }
        let hidden = field("hidden_size")?;
        let head_dim = field("head_dim").unwrap_or(hidden / heads);
        Ok(Self {
            name: name.to_owned(),
            layers: field("num_hidden_layers")?,
            hidden,
            heads,
            kv_heads,
            head_dim,
            ffn: field("intermediate_size")?,
            vocab: field("vocab_size")?,
            tied_embeddings: v
                .get("tie_word_embeddings")
                .and_then(serde_json::Value::as_bool)
                .unwrap_or(false),
            max_model_len: field("max_position_embeddings").unwrap_or(4096),
        })
    }

    /// A preset model by name: `llama-3.1-8b` (`8b`) or `llama-3.1-70b` (`70b`).
    pub fn by_name(name: &str) -> Option<Self> {
        match name.to_ascii_lowercase().as_str() {
            "llama-3.1-8b" | "8b" | "meta-llama/llama-3.1-8b-instruct" => {
                Some(Self::llama_3_1_8b())
            }
            "llama-3.1-70b" | "70b" | "meta-llama/llama-3.1-70b-instruct" => {
                Some(Self::llama_3_1_70b())
            }
            _ => None,
        }
    }

    /// Parameters of the transformer layers (P_L).
    pub fn layer_params(&self) -> f64 {
        let (d, nq, nkv, dh, ff) = (
            f64::from(self.hidden),
            f64::from(self.heads),
            f64::from(self.kv_heads),
            f64::from(self.head_dim),
            f64::from(self.ffn),
        );
        let per_layer = d * nq * dh + 2.0 * d * nkv * dh + nq * dh * d + 3.0 * d * ff;
        f64::from(self.layers) * per_layer
    }

    /// Parameters of the output head (P_head).
    pub fn head_params(&self) -> f64 {
        f64::from(self.vocab) * f64::from(self.hidden)
    }

    /// Weight bytes read by one forward pass (W_read).
    pub fn weight_read_bytes(&self, weight_bytes: f64) -> f64 {
        weight_bytes * (self.layer_params() + self.head_params())
    }

    /// Weight bytes held in memory (W_mem).
    pub fn weight_memory_bytes(&self, weight_bytes: f64) -> f64 {
        let embed = if self.tied_embeddings {
            0.0
        } else {
            self.head_params()
        };
        weight_bytes * (self.layer_params() + self.head_params() + embed)
    }

    /// KV-cache bytes per token over all ranks (b_kv).
    pub fn kv_bytes_per_token(&self, kv_bytes: f64) -> f64 {
        2.0 * f64::from(self.layers)
            * f64::from(self.kv_heads)
            * f64::from(self.head_dim)
            * kv_bytes
    }
    /// Why vLLM cannot run the model over `tp` GPUs, if it cannot: it splits the attention heads
    /// over them, and the KV heads too (or replicates them when there are fewer KV heads).
    pub fn tp_refusal(&self, tp: u32) -> Option<String> {
        let splits =
            tp > 0 && self.heads % tp == 0 && (self.kv_heads % tp == 0 || tp % self.kv_heads == 0);
        (!splits).then(|| {
            format!(
                "--tp {tp} does not divide {}'s {} attention heads and {} KV heads evenly",
                self.name, self.heads, self.kv_heads
            )
        })
    }
}

/// An accelerator's memory and peak rates.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GpuSpec {
    /// Name, e.g. `H100`.
    pub name: String,
    /// Memory the framework sees, GiB.
    pub memory_gib: f64,
    /// HBM bandwidth, bytes/s.
    pub bandwidth: f64,
    /// Dense bf16 peak, FLOP/s.
    pub flops: f64,
    /// Per-GPU interconnect bandwidth for all-reduce under tensor parallelism, bytes/s.
    #[serde(default = "default_link_bandwidth")]
    pub link_bandwidth: f64,
}

fn default_link_bandwidth() -> f64 {
    450e9
}

impl GpuSpec {
    /// H100 SXM 80 GB.
    pub fn h100() -> Self {
        Self {
            name: "H100".into(),
            memory_gib: 79.1,
            bandwidth: 3.35e12,
            flops: 989e12,
            link_bandwidth: default_link_bandwidth(),
        }
    }

    /// H200 SXM 141 GB.
    pub fn h200() -> Self {
        Self {
            name: "H200".into(),
            memory_gib: 139.8,
            bandwidth: 4.8e12,
            flops: 989e12,
            link_bandwidth: default_link_bandwidth(),
        }
    }

    /// A GPU by (case-insensitive) name.
    pub fn by_name(name: &str) -> Option<Self> {
        match name.to_ascii_lowercase().as_str() {
            "h100" | "h100-sxm" | "h100_sxm" => Some(Self::h100()),
            "h200" | "h200-sxm" | "h200_sxm" => Some(Self::h200()),
            _ => None,
        }
    }
}

/// The deployment: model, GPU, tensor parallelism and memory settings.
#[derive(Debug, Clone, PartialEq)]
pub struct Deployment {
    /// The model.
    pub model: ModelSpec,
    /// The GPU type.
    pub gpu: GpuSpec,
    /// Tensor-parallel degree.
    pub tp: u32,
    /// Bytes per weight (2 for bf16).
    pub weight_bytes: f64,
    /// Bytes per KV element (2 for bf16, 1 for fp8).
    pub kv_bytes: f64,
    /// `gpu_memory_utilization` (vLLM 0.33 default 0.92).
    pub gpu_memory_utilization: f64,
    /// Activation peak and non-torch memory per GPU, GiB.
    pub reserved_gib: f64,
}

impl Deployment {
    /// A model on `tp` GPUs with vLLM 0.33's defaults (bf16, utilisation 0.92).
    pub fn new(model: ModelSpec, gpu: GpuSpec, tp: u32) -> Self {
        Self {
            model,
            gpu,
            tp,
            weight_bytes: 2.0,
            kv_bytes: 2.0,
            gpu_memory_utilization: 0.92,
            reserved_gib: 1.6,
        }
    }

    /// A named preset: `llama-3.1-8b`/`8b` and `llama-3.1-70b`/`70b` on `h100` or `h200`, at the
    /// smallest power-of-two tensor parallelism whose KV cache holds one full context
    /// (70B: TP4 on H100, TP2 on H200).
    pub fn preset(model: &str, gpu: &str) -> Option<Self> {
        Some(Self::fitting(
            ModelSpec::by_name(model)?,
            GpuSpec::by_name(gpu)?,
        ))
    }

    /// `model` on `gpu` at the smallest power-of-two tensor parallelism (up to 8) whose KV cache
    /// holds one full context.
    pub fn fitting(model: ModelSpec, gpu: GpuSpec) -> Self {
        let mut tp = 1;
        while tp < 8
            && Self::new(model.clone(), gpu.clone(), tp).kv_blocks(16) * 16
                < u64::from(model.max_model_len)
        {
            tp *= 2;
        }
        Self::new(model, gpu, tp)
    }

    /// KV-cache memory per GPU after weights and reserve, bytes (may be negative: does not fit).
    pub fn kv_memory_per_gpu(&self) -> f64 {
        self.gpu.memory_gib * GIB * self.gpu_memory_utilization
            - self.model.weight_memory_bytes(self.weight_bytes) / f64::from(self.tp)
            - self.reserved_gib * GIB
    }

    /// KV blocks of `block_size` tokens (vLLM's `num_gpu_blocks`), 0 when the model does not fit.
    pub fn kv_blocks(&self, block_size: u32) -> u64 {
        let per_block = f64::from(block_size) * self.model.kv_bytes_per_token(self.kv_bytes)
            / f64::from(self.tp);
        (self.kv_memory_per_gpu() / per_block).floor().max(0.0) as u64
    }

    /// Default `max_num_batched_tokens` and `max_num_seqs` as vLLM's OpenAI server picks them.
    pub fn batch_defaults(&self) -> (u32, u32) {
        if self.gpu.memory_gib >= 160.0 {
            (16384, 1024)
        } else if self.gpu.memory_gib >= 70.0 {
            (8192, 1024)
        } else {
            (2048, 256)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn llama_8b_parameter_counts_match_the_reference() {
        let m = ModelSpec::llama_3_1_8b();
        assert!((m.layer_params() / 1e9 - 6.979).abs() < 0.001);
        assert!((m.weight_read_bytes(2.0) / 1e9 - 15.01).abs() < 0.01);
        assert_eq!(m.kv_bytes_per_token(2.0), 131_072.0);
        assert_eq!(m.kv_bytes_per_token(1.0), 65_536.0);
        // All parameters including the input embedding: 8.03 B.
        assert!((m.weight_memory_bytes(1.0) / 1e9 - 8.03).abs() < 0.01);
    }

    #[test]
    fn kv_capacity_of_8b_on_h100_is_about_28k_blocks() {
        let mut d = Deployment::preset("8b", "h100").unwrap();
        assert_eq!(d.tp, 1);
        d.gpu_memory_utilization = 0.9;
        // Reference estimate at 0.9: ≈ 54.6 GiB, ≈ 27.9k blocks.
        let blocks = d.kv_blocks(16);
        assert!((27_000..28_500).contains(&blocks), "{blocks}");
    }

    #[test]
    fn seventy_b_needs_tensor_parallelism() {
        assert_eq!(Deployment::preset("70b", "h100").unwrap().tp, 4);
        assert_eq!(Deployment::preset("70b", "h200").unwrap().tp, 2);
        assert_eq!(
            Deployment::new(ModelSpec::llama_3_1_70b(), GpuSpec::h100(), 1).kv_blocks(16),
            0
        );
        assert!(Deployment::preset("13b", "h100").is_none());
    }

    #[test]
    fn a_hugging_face_config_gives_the_preset_shape() {
        let json = r#"{"architectures": ["LlamaForCausalLM"], "hidden_size": 4096,
            "intermediate_size": 14336, "max_position_embeddings": 131072,
            "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
            "tie_word_embeddings": false, "torch_dtype": "bfloat16", "vocab_size": 128256}"#;
        let m = ModelSpec::from_hf_config("meta-llama/Llama-3.1-8B-Instruct", json).unwrap();
        assert_eq!(m, ModelSpec::llama_3_1_8b());
        let err = ModelSpec::from_hf_config("x", r#"{"hidden_size": 4096}"#).unwrap_err();
        assert!(err.contains("num_attention_heads"), "{err}");
        let odd = json.replace("\"num_key_value_heads\": 8", "\"num_key_value_heads\": 7");
        let err = ModelSpec::from_hf_config("x", &odd).unwrap_err();
        assert!(
            err.contains("not a multiple of num_key_value_heads 7"),
            "{err}"
        );
        let huge = json.replace("\"hidden_size\": 4096", "\"hidden_size\": 1e15");
        let err = ModelSpec::from_hf_config("x", &huge).unwrap_err();
        assert!(
            err.contains("`hidden_size`") && err.contains("1000000000000000"),
            "{err}"
        );
    }
}
