//! OpenAI-compatible request bodies (`/v1/completions`, `/v1/chat/completions`) as vLLM reads
//! them, and the rendering of a request into the prompt text an engine tokenizes.
//!
//! Unknown fields are accepted and ignored, as vLLM does. Chat messages are rendered with a
//! Llama-3-shaped template (every message, in order, then the assistant generation prompt):
//!
//! ```text
//! <|begin_of_text|>{ <|start_header_id|>{role}<|end_header_id|>\n\n{content}<|eot_id|> }*<|start_header_id|>assistant<|end_header_id|>\n\n
//! ```

use serde::{Deserialize, Serialize};

/// `stream_options` of a streamed request.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StreamOptions {
    /// Send a final usage chunk (`choices: []`).
    #[serde(default)]
    pub include_usage: bool,
    /// Add `usage` to every chunk (only together with `include_usage`).
    #[serde(default)]
    pub continuous_usage_stats: bool,
}

/// The sampling and output fields both endpoints share.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct GenerationParams {
    /// Served model name.
    pub model: Option<String>,
    /// Stream the response as SSE.
    #[serde(default)]
    pub stream: bool,
    /// Options for a streamed response.
    pub stream_options: Option<StreamOptions>,
    /// Output token limit (completions, and chat's legacy field).
    pub max_tokens: Option<i64>,
    /// Chat's output token limit; wins over `max_tokens` when both are set.
    pub max_completion_tokens: Option<i64>,
    /// Keep generating past end-of-sequence (vLLM extension).
    #[serde(default)]
    pub ignore_eos: bool,
    /// Minimum output tokens before end-of-sequence may be sampled (vLLM extension).
    pub min_tokens: Option<i64>,
    /// Sampling seed.
    pub seed: Option<i64>,
    /// Sampling temperature.
    pub temperature: Option<f64>,
    /// Number of choices; only 1 is served by the simulator.
    pub n: Option<i64>,
    /// Prefix-cache isolation salt (vLLM extension): mixed into the first block's hash.
    pub cache_salt: Option<String>,
    /// End-user id, passed through.
    pub user: Option<String>,
}

impl GenerationParams {
    /// The requested output limit: `max_completion_tokens`, else `max_tokens`.
    pub fn requested_max_tokens(&self) -> Option<i64> {
        self.max_completion_tokens.or(self.max_tokens)
    }

    /// Whether a final usage chunk was asked for.
    pub fn include_usage(&self) -> bool {
        self.stream_options
            .as_ref()
            .is_some_and(|o| o.include_usage)
    }

    /// Whether every chunk carries usage.
    pub fn continuous_usage(&self) -> bool {
        self.stream_options
            .as_ref()
            .is_some_and(|o| o.include_usage && o.continuous_usage_stats)
    }
}

/// A `/v1/completions` prompt: text, or token ids.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Prompt {
    /// A single text prompt.
    Text(String),
    /// A single prompt already tokenized.
    Tokens(Vec<u32>),
    /// A batch of text prompts.
    TextBatch(Vec<String>),
    /// A batch of tokenized prompts.
    TokensBatch(Vec<Vec<u32>>),
}

/// The body of `/v1/completions`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct CompletionRequest {
    /// The prompt.
    pub prompt: Prompt,
    /// Sampling and output fields.
    #[serde(flatten)]
    pub params: GenerationParams,
}

/// A chat message's content: a string or a list of parts.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(untagged)]
pub enum MessageContent {
    /// Plain text.
    Text(String),
    /// Typed parts; text parts are joined with `\n`, others are ignored.
    Parts(Vec<ContentPart>),
}

/// One typed part of a chat message.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ContentPart {
    /// The part type, e.g. `text`.
    #[serde(rename = "type")]
    pub kind: String,
    /// The text of a `text` part.
    pub text: Option<String>,
}

/// One chat message.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant`, `tool`, ….
    pub role: String,
    /// The content; absent or null for some assistant tool-call messages.
    #[serde(default)]
    pub content: Option<MessageContent>,
}

/// The body of `/v1/chat/completions`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ChatCompletionRequest {
    /// The conversation so far.
    pub messages: Vec<ChatMessage>,
    /// Sampling and output fields.
    #[serde(flatten)]
    pub params: GenerationParams,
}

/// Renders chat messages with the template above.
pub fn render_chat(messages: &[ChatMessage]) -> String {
    let mut out = String::from("<|begin_of_text|>");
    for m in messages {
        out.push_str("<|start_header_id|>");
        out.push_str(&m.role);
        out.push_str("<|end_header_id|>\n\n");
        match &m.content {
            Some(MessageContent::Text(t)) => out.push_str(t),
            Some(MessageContent::Parts(parts)) => {
                let texts = parts
                    .iter()
                    .filter(|p| p.kind == "text")
                    .filter_map(|p| p.text.as_deref());
                for (i, t) in texts.enumerate() {
                    if i > 0 {
                        out.push('\n');
                    }
                    out.push_str(t);
                }
            }
            None => {}
        }
        out.push_str("<|eot_id|>");
    }
    out.push_str("<|start_header_id|>assistant<|end_header_id|>\n\n");
    out
}

/// Tokens the chat template adds around content: `<|begin_of_text|>` and the generation prompt
/// (`<|start_header_id|>`, `assistan`, `t`, `<|end_header_id|>`, `\n\n`: "assistant" has nine
/// letters, so it is two tokens).
pub const CHAT_FIXED_TOKENS: usize = 6;
/// Tokens the template adds per message whose role is at most 8 letters (`system`, `user`, `tool`)
/// and whose content starts with a word, not a space: header (3), `\n\n`, `<|eot_id|>`. An
/// `assistant` message takes one more.
pub const CHAT_TOKENS_PER_MESSAGE: usize = 5;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Tokenizer;

    #[test]
    fn chat_bodies_parse_with_unknown_fields_and_parts() {
        let body = r#"{"model":"m","messages":[{"role":"system","content":"Be brief."},
            {"role":"user","content":[{"type":"text","text":"Hi"},{"type":"image_url","image_url":{"url":"x"}},{"type":"text","text":"there"}]}],
            "stream":true,"stream_options":{"include_usage":true},"max_completion_tokens":7,"max_tokens":9,"top_k":3}"#;
        let r: ChatCompletionRequest = serde_json::from_str(body).unwrap();
        assert!(r.params.stream && r.params.include_usage() && !r.params.continuous_usage());
        assert_eq!(r.params.requested_max_tokens(), Some(7));
        let text = render_chat(&r.messages);
        assert!(text.contains("<|end_header_id|>\n\nHi\nthere<|eot_id|>"));
        assert!(text.ends_with("assistant<|end_header_id|>\n\n"));
    }

    #[test]
    fn chat_overhead_matches_the_documented_constants() {
        let messages: Vec<ChatMessage> = serde_json::from_str(
            r#"[{"role":"system","content":"one two"},{"role":"user","content":"three four five"}]"#,
        )
        .unwrap();
        let n = Tokenizer.count(&render_chat(&messages));
        assert_eq!(n, CHAT_FIXED_TOKENS + 2 * CHAT_TOKENS_PER_MESSAGE + 5);
    }

    #[test]
    fn completion_prompts_of_every_shape_parse() {
        for (body, tokens) in [
            (r#"{"prompt":"hello"}"#, false),
            (r#"{"prompt":[1,2,3]}"#, true),
            (r#"{"prompt":["a","b"]}"#, false),
            (r#"{"prompt":[[1],[2]]}"#, true),
        ] {
            let r: CompletionRequest = serde_json::from_str(body).unwrap();
            assert_eq!(
                matches!(r.prompt, Prompt::Tokens(_) | Prompt::TokensBatch(_)),
                tokens
            );
        }
    }
}
