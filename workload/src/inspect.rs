//! Request inspection for routing: what an OpenAI-compatible request body asks for, and the chain of
//! prefix-block hashes of the prompt it renders to.
//!
//! ```text
//! prompt  = render_chat(messages)  (every message, in order, Llama-3 template;   chat
//!                                    a media part as <|TYPE:digest of its content|>)
//!         | <|begin_of_text|> + prompt text  | prompt token ids                  completions
//! tokens  = Tokenizer(prompt[..cut])          cut = max_hashed_tokens × MAX_BYTES_PER_TOKEN bytes
//! seed    = xxh3(model, hash_seed)          (Chain::Sim: hash_seed alone, as the simulator's KV events)
//! extra   = cache_salt (LoRA adapters are served under their own model name, so the model covers them)
//! blocks  = BlockHasher(block_tokens, seed).hash_all(tokens[..min(n, max_hashed_tokens)], extra)
//! prompt_tokens = n                          when the whole prompt was tokenized
//!               = n_cut × len(prompt) / cut  otherwise (the prefix's own bytes-per-token ratio)
//! ```
//!
//! | parameter | meaning | default |
//! |---|---|---|
//! | `block_tokens` | tokens per prefix block (vLLM's `--block-size`) | 16 |
//! | `max_hashed_tokens` | how much of a huge prompt is hashed; the rest only counted | 131072 |
//! | `hash_seed` | mixes into every chain, so unrelated deployments never share hashes | 0 |
//!
//! The token count is exact on headroom's simulator and an estimate for real engines, whose
//! tokenizers differ; routing only needs it in the right proportion. Under `Chain::Vllm` the
//! prompt is rendered and tokenized as the engine does (engine_tokenizer.rs) and hashed in vLLM's
//! chain (vllm_hash.rs), so the blocks equal the ones the engine publishes and the count is exact.

use std::sync::Arc;

use serde::Deserialize;
use xxhash_rust::xxh3::xxh3_64_with_seed;

use crate::blocks::{BlockHash, BlockHasher};
use crate::engine_tokenizer::EngineTokenizer;
use crate::openai::{ChatMessage, GenerationParams, Prompt, StreamOptions, render_chat};
use crate::tokenizer::Tokenizer;
use crate::vllm_hash::VllmHasher;

/// Token id of `<|begin_of_text|>`, which engines prepend to a completion prompt.
pub const BOS: u32 = 128_000;
/// The most bytes one token of the headroom tokenizer can span (a space and 8 four-byte chars),
/// so a cut this many bytes per token long holds at least the wanted tokens.
pub const MAX_BYTES_PER_TOKEN: usize = 33;

/// The two generation endpoints.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    /// `/v1/chat/completions`
    Chat,
    /// `/v1/completions`
    Completions,
}

impl Endpoint {
    /// The endpoint served at `path`, if any.
    pub fn from_path(path: &str) -> Option<Self> {
        match path {
            "/v1/chat/completions" => Some(Self::Chat),
            "/v1/completions" => Some(Self::Completions),
            _ => None,
        }
    }
}

/// Which chain of block hashes a prompt is hashed into.
#[derive(Debug, Clone, Default)]
pub enum Chain {
    /// headroom's own: the headroom tokenizer, xxh3 seeded with the model and `hash_seed`, so
    /// models never share blocks (approximate routing).
    #[default]
    Headroom,
    /// What headroom's simulator publishes in its KV events: the same tokens, xxh3 seeded with
    /// `hash_seed` (its `--hash-seed`) alone.
    Sim,
    /// What a vLLM engine publishes: its own tokens (the model's tokenizer and chat template) in
    /// vLLM's `sha256_cbor` chain.
    Vllm(Arc<VllmChain>),
}

/// vLLM's chain: the model's tokenizer and the engine's hash.
#[derive(Debug)]
pub struct VllmChain {
    /// The model's tokenizer and chat template.
    pub tokenizer: EngineTokenizer,
    /// The engine's block hash.
    pub hasher: VllmHasher,
}

/// How prompts are hashed into blocks.
#[derive(Debug, Clone)]
pub struct InspectConfig {
    /// Tokens per block.
    pub block_tokens: u32,
    /// Prompt tokens hashed at most.
    pub max_hashed_tokens: u32,
    /// Seed mixed into every chain.
    pub hash_seed: u64,
    /// The chain.
    pub chain: Chain,
}

impl Default for InspectConfig {
    fn default() -> Self {
        Self {
            block_tokens: 16,
            max_hashed_tokens: 131_072,
            hash_seed: 0,
            chain: Chain::Headroom,
        }
    }
}

/// What routing and measurement need to know about one request.
#[derive(Debug, Clone, PartialEq)]
pub struct Inspected {
    /// The endpoint.
    pub endpoint: Endpoint,
    /// The `model` field.
    pub model: Option<String>,
    /// Whether the response is streamed.
    pub stream: bool,
    /// Whether the client asked for a usage chunk (`stream_options.include_usage`).
    pub include_usage: bool,
    /// The request's `stream_options`, as sent.
    pub stream_options: Option<StreamOptions>,
    /// `max_completion_tokens`, else `max_tokens`.
    pub max_tokens: Option<i64>,
    /// Prompt tokens (exact when `hashed_tokens` covers the prompt, else estimated).
    pub prompt_tokens: u32,
    /// Tokens that went into `blocks` (a multiple of the block size at most).
    pub hashed_tokens: u32,
    /// Chained hashes of the prompt's full blocks, from the start, up to the cap.
    pub blocks: Vec<BlockHash>,
    /// When the whole prompt was hashed: the hash of its tokens after the last full block,
    /// chained to that block, so it stands for the exact prompt.
    pub tail_hash: Option<BlockHash>,
    /// Temperature 0 or a fixed seed: the output is reproducible.
    pub deterministic: bool,
    /// Under [`Chain::Vllm`], why the engine's tokens could not be made (the blocks are then
    /// headroom's own chain, which only the approximate index can match).
    pub engine_error: Option<String>,
}

/// Why a body could not be inspected. The message is safe to show the client (no prompt text).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum InspectError {
    /// Not JSON at all (a syntax error, a truncated body, nesting past serde_json's recursion
    /// limit): no engine could accept it.
    #[error("the request body is not JSON: {0}")]
    NotJson(String),
    /// JSON, but not the endpoint's schema (as headroom reads it; the engine may know better).
    #[error("invalid request body: {0}")]
    Body(String),
    /// The request has no prompt to generate from.
    #[error("the request has no prompt")]
    EmptyPrompt,
}

#[derive(Deserialize)]
struct ChatBody {
    messages: Vec<ChatMessage>,
    #[serde(flatten)]
    params: GenerationParams,
}

#[derive(Deserialize)]
struct CompletionBody {
    prompt: Prompt,
    #[serde(flatten)]
    params: GenerationParams,
}

enum Rendered {
    Text(String),
    Tokens(Vec<u32>),
}

/// Inspects a request body sent to `endpoint`.
pub fn inspect(
    endpoint: Endpoint,
    body: &[u8],
    cfg: &InspectConfig,
) -> Result<Inspected, InspectError> {
    // A UTF-8 byte order mark before the JSON (some .NET and Windows clients write one) is
    // accepted, as Python's JSON parser in the engine accepts it; the body is forwarded as sent.
    let body = body.strip_prefix(b"\xEF\xBB\xBF").unwrap_or(body);
    let (rendered, params, extra_prompt_tokens) = parse(endpoint, body)?;
    if let Chain::Vllm(vllm) = &cfg.chain {
        return inspect_engine(
            endpoint,
            body,
            cfg,
            vllm,
            (rendered, params, extra_prompt_tokens),
        );
    }
    let hashed = hash_headroom(rendered, &params, cfg);
    Ok(finish(
        endpoint,
        params,
        hashed.prompt_tokens + extra_prompt_tokens,
        hashed,
        None,
    ))
}

/// The prompt (rendered with headroom's template, or token ids), the generation parameters, and
/// the prompt tokens of a completion batch's other prompts; errors for bodies without a prompt.
fn parse(
    endpoint: Endpoint,
    body: &[u8],
) -> Result<(Rendered, GenerationParams, usize), InspectError> {
    // A schema error can come before a syntax error further on (`[[[…` fails as "not an
    // object" at its first byte): only a body that parses as JSON, within serde_json's recursion
    // limit, is handed on. This second parse runs only for bodies headroom cannot read.
    let bad = |e: serde_json::Error| match e.classify() {
        serde_json::error::Category::Syntax | serde_json::error::Category::Eof => {
            InspectError::NotJson(e.to_string())
        }
        _ => match serde_json::from_slice::<serde_json::Value>(body) {
            Err(syntax) => InspectError::NotJson(syntax.to_string()),
            Ok(_) => InspectError::Body(e.to_string()),
        },
    };
    match endpoint {
        Endpoint::Chat => {
            let b: ChatBody = serde_json::from_slice(body).map_err(bad)?;
            if b.messages.is_empty() {
                return Err(InspectError::EmptyPrompt);
            }
            Ok((Rendered::Text(render_chat(&b.messages)), b.params, 0))
        }
        Endpoint::Completions => {
            let b: CompletionBody = serde_json::from_slice(body).map_err(bad)?;
            // A batch is routed by its first prompt; the others still count as work.
            let (first, rest) = match b.prompt {
                Prompt::Text(t) => (Rendered::Text(t), 0),
                Prompt::Tokens(ids) => (Rendered::Tokens(ids), 0),
                Prompt::TextBatch(mut v) if !v.is_empty() => {
                    let rest: usize = v[1..].iter().map(|t| Tokenizer.count(t) + 1).sum();
                    (Rendered::Text(v.swap_remove(0)), rest)
                }
                Prompt::TokensBatch(mut v) if !v.is_empty() => {
                    let rest: usize = v[1..].iter().map(Vec::len).sum();
                    (Rendered::Tokens(v.swap_remove(0)), rest)
                }
                _ => return Err(InspectError::EmptyPrompt),
            };
            let first = match first {
                Rendered::Text(t) if t.is_empty() => return Err(InspectError::EmptyPrompt),
                Rendered::Text(t) => Rendered::Text(format!("<|begin_of_text|>{t}")),
                Rendered::Tokens(ids) if ids.is_empty() => return Err(InspectError::EmptyPrompt),
                tokens => tokens,
            };
            Ok((first, b.params, rest))
        }
    }
}

/// A prompt's blocks in one chain.
struct Hashed {
    prompt_tokens: usize,
    hashed_tokens: u32,
    blocks: Vec<BlockHash>,
    tail_hash: Option<BlockHash>,
}

/// headroom's chain (or the simulator's) over headroom's tokens.
fn hash_headroom(rendered: Rendered, params: &GenerationParams, cfg: &InspectConfig) -> Hashed {
    let max = cfg.max_hashed_tokens as usize;
    let (tokens, prompt_tokens) = match rendered {
        Rendered::Tokens(mut ids) => {
            let n = ids.len();
            ids.truncate(max);
            (ids, n)
        }
        Rendered::Text(text) => tokens_of(&text, max),
    };
    let hasher = BlockHasher::new(cfg.block_tokens.max(1) as usize, headroom_seed(params, cfg));
    let extra = params.cache_salt.as_deref().unwrap_or("").as_bytes();
    let blocks = hasher.hash_all(&tokens, extra);
    let hashed_tokens = (blocks.len() * hasher.block_size()) as u32;
    let tail_hash = (tokens.len() == prompt_tokens).then(|| {
        hasher.hash_block(
            blocks.last().copied(),
            &tokens[hashed_tokens as usize..],
            extra,
        )
    });
    Hashed {
        prompt_tokens,
        hashed_tokens,
        blocks,
        tail_hash,
    }
}

fn headroom_seed(params: &GenerationParams, cfg: &InspectConfig) -> u64 {
    match cfg.chain {
        Chain::Sim => cfg.hash_seed,
        _ => xxh3_64_with_seed(
            params.model.as_deref().unwrap_or("").as_bytes(),
            cfg.hash_seed,
        ),
    }
}

fn finish(
    endpoint: Endpoint,
    params: GenerationParams,
    prompt_tokens: usize,
    hashed: Hashed,
    engine_error: Option<String>,
) -> Inspected {
    Inspected {
        endpoint,
        stream: params.stream,
        include_usage: params.include_usage(),
        stream_options: params.stream_options.clone(),
        max_tokens: params.requested_max_tokens(),
        deterministic: params.temperature == Some(0.0) || params.seed.is_some(),
        model: params.model,
        prompt_tokens: prompt_tokens.min(u32::MAX as usize) as u32,
        hashed_tokens: hashed.hashed_tokens,
        blocks: hashed.blocks,
        tail_hash: hashed.tail_hash,
        engine_error,
    }
}

/// Under [`Chain::Vllm`]: the engine's own tokens hashed in its chain; when the template or the
/// tokenizer fails on the request, headroom's chain with the reason in `engine_error`.
fn inspect_engine(
    endpoint: Endpoint,
    body: &[u8],
    cfg: &InspectConfig,
    vllm: &VllmChain,
    (rendered, params, extra_prompt_tokens): (Rendered, GenerationParams, usize),
) -> Result<Inspected, InspectError> {
    let raw: serde_json::Value =
        serde_json::from_slice(body).map_err(|e| InspectError::Body(e.to_string()))?;
    let (mut tokens, batch_rest) = match engine_tokens(endpoint, &raw, &vllm.tokenizer) {
        Ok(t) => t,
        Err(e) => {
            // Under the vLLM chain headroom_seed is headroom's own (model-seeded).
            let hashed = hash_headroom(rendered, &params, cfg);
            let n = hashed.prompt_tokens + extra_prompt_tokens;
            return Ok(finish(endpoint, params, n, hashed, Some(e.to_string())));
        }
    };
    let n = tokens.len();
    tokens.truncate(cfg.max_hashed_tokens as usize);
    let cache_salt = params.cache_salt.as_deref();
    let blocks = vllm.hasher.hash_all(&tokens, cache_salt);
    let hashed_tokens = blocks.len() * vllm.hasher.block_size();
    // An identity for the exact prompt (the capture's), chained to the engine's last block.
    let tail_hash = (tokens.len() == n).then(|| {
        BlockHasher::new(vllm.hasher.block_size(), headroom_seed(&params, cfg)).hash_block(
            blocks.last().copied(),
            &tokens[hashed_tokens..],
            cache_salt.unwrap_or("").as_bytes(),
        )
    });
    let hashed = Hashed {
        prompt_tokens: n,
        hashed_tokens: hashed_tokens as u32,
        blocks,
        tail_hash,
    };
    Ok(finish(endpoint, params, n + batch_rest, hashed, None))
}

/// The engine's token ids of the (first) prompt, and the token count of a completion batch's
/// other prompts.
fn engine_tokens(
    endpoint: Endpoint,
    raw: &serde_json::Value,
    t: &EngineTokenizer,
) -> Result<(Vec<u32>, usize), crate::engine_tokenizer::EngineTokenizerError> {
    use serde_json::Value;
    let special = raw.get("add_special_tokens").and_then(Value::as_bool);
    let text_tokens = |text: &str| t.encode(text, special.unwrap_or(true));
    let prompt = match endpoint {
        Endpoint::Chat => {
            let text = t.render_chat(raw)?;
            return Ok((t.encode(&text, special.unwrap_or(false))?, 0));
        }
        Endpoint::Completions => raw.get("prompt"),
    };
    match prompt {
        Some(Value::String(text)) => Ok((text_tokens(text)?, 0)),
        // Token ids: the engine takes them as they are.
        Some(Value::Array(items)) if items.first().is_some_and(Value::is_number) => {
            Ok((ids_of(items), 0))
        }
        // A batch: the first prompt is hashed; the others are work too.
        Some(Value::Array(items)) => {
            let tokens_of = |p: &Value| match p {
                Value::String(text) => text_tokens(text),
                Value::Array(ids) => Ok(ids_of(ids)),
                _ => Ok(Vec::new()),
            };
            let first = items
                .first()
                .map(tokens_of)
                .transpose()?
                .unwrap_or_default();
            let rest = items
                .iter()
                .skip(1)
                .map(|p| tokens_of(p).map_or(0, |ids| ids.len()))
                .sum();
            Ok((first, rest))
        }
        _ => Ok((Vec::new(), 0)),
    }
}

fn ids_of(items: &[serde_json::Value]) -> Vec<u32> {
    items
        .iter()
        .filter_map(serde_json::Value::as_u64)
        .map(|t| u32::try_from(t).unwrap_or(u32::MAX))
        .collect()
}

/// The first `max` tokens of `text` and the whole text's token count (estimated beyond the cut).
fn tokens_of(text: &str, max: usize) -> (Vec<u32>, usize) {
    let cut_bytes = max.saturating_mul(MAX_BYTES_PER_TOKEN);
    if text.len() <= cut_bytes {
        let mut ids = Tokenizer.encode(text);
        let n = ids.len();
        ids.truncate(max);
        return (ids, n);
    }
    let mut cut = cut_bytes;
    while !text.is_char_boundary(cut) {
        cut -= 1;
    }
    let mut ids = Tokenizer.encode(&text[..cut]);
    // The last piece may be a word or space run split by the cut.
    ids.pop();
    let estimate = (ids.len() as f64 * text.len() as f64 / cut as f64).ceil() as usize;
    ids.truncate(max);
    (ids, estimate)
}

/// The body with `stream_options.include_usage` set, for a streamed request that did not ask for
/// the usage chunk (so token counts are exact); `None` when nothing is to change: not streamed,
/// already asked, or `continuous_usage_stats` set (asking would add usage to every chunk).
///
/// Without `stream_options` the member is inserted first in the object, leaving every other byte
/// as sent; otherwise the object is re-serialized with its members in their order.
pub fn ask_for_usage(body: &[u8], inspected: &Inspected) -> Option<Vec<u8>> {
    if !inspected.stream || inspected.include_usage {
        return None;
    }
    // A body whose `stream_options` member is there (an object, or `null`, which reads as absent
    // but is a member all the same: inserting another would send the key twice, which a strict
    // engine refuses and a lenient one resolves to the client's null) is parsed and rewritten.
    // The name can also appear in a message or a tool's schema: only a member of the body itself
    // counts (looked for by parsing, only for the rare body that has the name).
    let parsed = match &inspected.stream_options {
        Some(o) if o.continuous_usage_stats => return None,
        Some(_) => Some(serde_json::from_slice::<serde_json::Value>(body).ok()?),
        None if memchr::memmem::find(body, br#""stream_options""#).is_some() => {
            serde_json::from_slice::<serde_json::Value>(body)
                .ok()
                .filter(|v| v.get("stream_options").is_some())
        }
        None => None,
    };
    match parsed {
        Some(v) => with_usage_option(v),
        None => {
            let open = body.iter().position(|b| !b.is_ascii_whitespace())?;
            if body[open] != b'{' {
                return None;
            }
            let after = &body[open + 1..];
            let empty = after
                .iter()
                .find(|b| !b.is_ascii_whitespace())
                .is_none_or(|&b| b == b'}');
            let member: &[u8] = if empty {
                br#""stream_options":{"include_usage":true}"#
            } else {
                br#""stream_options":{"include_usage":true},"#
            };
            let mut out = Vec::with_capacity(body.len() + member.len());
            out.extend_from_slice(&body[..=open]);
            out.extend_from_slice(member);
            out.extend_from_slice(after);
            Some(out)
        }
    }
}

/// The parsed body `v` re-serialized with `stream_options.include_usage` set, whatever
/// `stream_options` was (an object or `null`).
fn with_usage_option(mut v: serde_json::Value) -> Option<Vec<u8>> {
    let opts = v
        .as_object_mut()?
        .entry("stream_options")
        .or_insert(serde_json::Value::Null);
    if opts.is_null() {
        *opts = serde_json::Value::Object(serde_json::Map::new());
    }
    opts.as_object_mut()?
        .insert("include_usage".into(), serde_json::Value::Bool(true));
    serde_json::to_vec(&v).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> InspectConfig {
        InspectConfig::default()
    }

    fn chat(model: &str, msgs: &[(&str, &str)]) -> Vec<u8> {
        let messages: Vec<_> = msgs
            .iter()
            .map(|(r, c)| serde_json::json!({"role": r, "content": c}))
            .collect();
        serde_json::to_vec(&serde_json::json!({"model": model, "messages": messages})).unwrap()
    }

    fn words(n: usize, salt: &str) -> String {
        (0..n).map(|i| format!(" w{salt}{}", i % 97)).collect()
    }

    #[test]
    fn chat_counts_tokens_exactly_as_the_simulator_renders_them() {
        let body = chat("m", &[("system", "You are helpful."), ("user", "Hi there")]);
        let got = inspect(Endpoint::Chat, &body, &cfg()).unwrap();
        let want = Tokenizer.count(&render_chat(&[
            serde_json::from_value(
                serde_json::json!({"role":"system","content":"You are helpful."}),
            )
            .unwrap(),
            serde_json::from_value(serde_json::json!({"role":"user","content":"Hi there"}))
                .unwrap(),
        ]));
        assert_eq!(got.prompt_tokens as usize, want);
        assert_eq!(got.model.as_deref(), Some("m"));
        assert!(!got.stream);
    }

    #[test]
    fn shared_system_prompt_shares_leading_blocks_and_the_last_message_matters() {
        let sys = words(200, "s");
        let a = inspect(
            Endpoint::Chat,
            &chat("m", &[("system", &sys), ("user", "a")]),
            &cfg(),
        );
        let b = inspect(
            Endpoint::Chat,
            &chat("m", &[("system", &sys), ("user", "b")]),
            &cfg(),
        );
        let (a, b) = (a.unwrap(), b.unwrap());
        let shared = a
            .blocks
            .iter()
            .zip(&b.blocks)
            .take_while(|(x, y)| x == y)
            .count();
        assert!(shared >= 11, "shared {shared} blocks");
        // Every message counts: a later message changes only the blocks it reaches.
        let c = inspect(
            Endpoint::Chat,
            &chat("m", &[("system", &sys), ("user", &words(100, "u"))]),
            &cfg(),
        )
        .unwrap();
        assert!(c.blocks.len() > a.blocks.len());
        assert_eq!(c.blocks[..shared], a.blocks[..shared]);
    }

    #[test]
    fn model_and_cache_salt_separate_chains() {
        let sys = words(100, "s");
        let base = inspect(Endpoint::Chat, &chat("m1", &[("user", &sys)]), &cfg()).unwrap();
        let other = inspect(Endpoint::Chat, &chat("m2", &[("user", &sys)]), &cfg()).unwrap();
        assert_ne!(base.blocks[0], other.blocks[0]);
        let mut v: serde_json::Value =
            serde_json::from_slice(&chat("m1", &[("user", &sys)])).unwrap();
        v["cache_salt"] = "tenant-a".into();
        let salted = inspect(Endpoint::Chat, &serde_json::to_vec(&v).unwrap(), &cfg()).unwrap();
        assert_ne!(base.blocks[0], salted.blocks[0]);
        assert_eq!(base.prompt_tokens, salted.prompt_tokens);
    }

    #[test]
    fn huge_prompts_hash_only_the_cap_and_estimate_the_rest() {
        let cfg = InspectConfig {
            max_hashed_tokens: 64,
            ..InspectConfig::default()
        };
        let text = words(20_000, "x");
        let body = serde_json::to_vec(&serde_json::json!({"model": "m", "prompt": text})).unwrap();
        let got = inspect(Endpoint::Completions, &body, &cfg).unwrap();
        assert_eq!(got.blocks.len(), 4);
        assert_eq!(got.hashed_tokens, 64);
        let exact = Tokenizer.count(&text) + 1;
        let err = (f64::from(got.prompt_tokens) - exact as f64).abs() / exact as f64;
        assert!(err < 0.05, "estimate {} vs {exact}", got.prompt_tokens);
        // The capped chain is the start of the uncapped one.
        let full = inspect(Endpoint::Completions, &body, &InspectConfig::default()).unwrap();
        assert_eq!(full.blocks[..4], got.blocks[..]);
        assert_eq!(full.prompt_tokens as usize, exact);
    }

    #[test]
    fn completions_accept_token_ids_and_batches() {
        let ids: Vec<u32> = (0..40).collect();
        let body = serde_json::json!({"model": "m", "prompt": ids, "stream": true,
            "stream_options": {"include_usage": true}, "max_tokens": 7, "temperature": 0});
        let got = inspect(
            Endpoint::Completions,
            &serde_json::to_vec(&body).unwrap(),
            &cfg(),
        );
        let got = got.unwrap();
        assert_eq!((got.prompt_tokens, got.blocks.len()), (40, 2));
        assert!(got.stream && got.include_usage && got.deterministic);
        assert_eq!(got.max_tokens, Some(7));
        let batch = serde_json::json!({"model": "m", "prompt": [[1, 2, 3], [4, 5]]});
        let got = inspect(
            Endpoint::Completions,
            &serde_json::to_vec(&batch).unwrap(),
            &cfg(),
        );
        assert_eq!(got.unwrap().prompt_tokens, 5);
    }

    #[test]
    fn bad_bodies_are_named_errors() {
        for (ep, body) in [
            (Endpoint::Chat, &b"not json"[..]),
            (Endpoint::Chat, br#"{"model":"m"}"#),
            (Endpoint::Chat, br#"{"messages":"hi"}"#),
            (Endpoint::Completions, br#"{"prompt":""}"#),
            (Endpoint::Completions, br#"{"prompt":[]}"#),
            (Endpoint::Chat, br#"{"messages":[]}"#),
        ] {
            assert!(
                inspect(ep, body, &cfg()).is_err(),
                "{}",
                String::from_utf8_lossy(body)
            );
        }
    }

    #[test]
    fn bodies_that_are_not_json_are_told_apart_from_other_schemas() {
        let bomb = format!(
            r#"{{"prompt": {}1{}}}"#,
            "[".repeat(10_000),
            "]".repeat(10_000)
        );
        let bare_bomb = format!("{}{}", "[".repeat(10_000), "]".repeat(10_000));
        for body in [
            &b"not json"[..],
            br#"{"prompt": "cut"#,
            bomb.as_bytes(),
            bare_bomb.as_bytes(),
        ] {
            let e = inspect(Endpoint::Completions, body, &cfg()).unwrap_err();
            assert!(matches!(e, InspectError::NotJson(_)), "{e}");
        }
        for body in [&br#"{"messages":"hi"}"#[..], br#"[1, 2]"#] {
            let e = inspect(Endpoint::Chat, body, &cfg()).unwrap_err();
            assert!(matches!(e, InspectError::Body(_)), "{e}");
        }
    }

    #[test]
    fn a_byte_order_mark_before_the_json_is_read_past() {
        let body = chat("m1", &[("user", &"hello there ".repeat(100))]);
        let mut marked = b"\xEF\xBB\xBF".to_vec();
        marked.extend_from_slice(&body);
        let plain = inspect(Endpoint::Chat, &body, &cfg()).unwrap();
        let got = inspect(Endpoint::Chat, &marked, &cfg()).unwrap();
        assert_eq!(got.prompt_tokens, plain.prompt_tokens);
        assert!(!plain.blocks.is_empty());
        assert_eq!(got.blocks, plain.blocks);
        assert_eq!(got.tail_hash, plain.tail_hash);
    }

    #[test]
    fn usage_is_asked_for_only_where_it_changes_nothing_else() {
        let cfg = InspectConfig::default();
        let ask = |body: &str| {
            let i = inspect(Endpoint::Chat, body.as_bytes(), &cfg).unwrap();
            ask_for_usage(body.as_bytes(), &i).map(|b| String::from_utf8(b).unwrap())
        };
        let msgs = r#""messages":[{"role":"user","content":"hi"}]"#;
        assert_eq!(
            ask(&format!(r#" {{ {msgs}, "stream": true}}"#)).as_deref(),
            Some(
                format!(
                    r#" {{"stream_options":{{"include_usage":true}}, {msgs}, "stream": true}}"#
                )
                .as_str()
            )
        );
        let rewritten = ask(&format!(
            r#"{{{msgs},"stream":true,"stream_options":{{"include_usage":false}},"n":1}}"#
        ))
        .unwrap();
        let v: serde_json::Value = serde_json::from_str(&rewritten).unwrap();
        assert_eq!(v["stream_options"]["include_usage"], true);
        assert!(rewritten.ends_with(r#""n":1}"#), "{rewritten}");
        // The name elsewhere in the body (a tool's schema) leaves every byte as sent.
        let elsewhere = r#"{"messages":[{"role":"user","content":"hi"}],"stream":true,
            "tools":[{"type":"function","function":{"name":"f","parameters":{"type":"object",
            "properties":{"stream_options":{"type":"string"}}}}}]}"#;
        assert!(
            ask(elsewhere).unwrap().ends_with(&elsewhere[1..]),
            "{elsewhere}"
        );
        // `null` is replaced where it stands, never joined by a second `stream_options`.
        let rewritten = ask(&format!(
            r#"{{{msgs},"stream":true,"stream_options":null,"n":1}}"#
        ))
        .unwrap();
        assert_eq!(
            rewritten.matches("stream_options").count(),
            1,
            "{rewritten}"
        );
        let v: serde_json::Value = serde_json::from_str(&rewritten).unwrap();
        assert_eq!(v["stream_options"]["include_usage"], true);
        assert!(rewritten.ends_with(r#""n":1}"#), "{rewritten}");
        for unchanged in [
            format!(r#"{{{msgs}}}"#),
            format!(r#"{{{msgs},"stream":false}}"#),
            format!(r#"{{{msgs},"stream":true,"stream_options":{{"include_usage":true}}}}"#),
            format!(
                r#"{{{msgs},"stream":true,"stream_options":{{"continuous_usage_stats":true}}}}"#
            ),
        ] {
            assert_eq!(ask(&unchanged), None, "{unchanged}");
        }
    }
}
