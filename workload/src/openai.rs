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
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StreamOptions {
    /// Send a final usage chunk (`choices: []`). As in vLLM, an options object that leaves it
    /// out asks for it (`include_usage: bool | None = True`); `null` does not.
    #[serde(default = "lax::yes", deserialize_with = "lax::bool_or_null")]
    pub include_usage: bool,
    /// Add `usage` to every chunk (only together with `include_usage`).
    #[serde(default, deserialize_with = "lax::bool_or_null")]
    pub continuous_usage_stats: bool,
}

impl Default for StreamOptions {
    fn default() -> Self {
        Self {
            include_usage: true,
            continuous_usage_stats: false,
        }
    }
}

/// Scalars read as vLLM's request models read them (pydantic's lax mode): an integer may come as
/// an integral float or a numeric string, a float as a numeric string, a boolean as `0`/`1` or
/// words like `"true"`. A proxy that refused what the engine accepts would fail requests the
/// engine would serve.
pub(crate) mod lax {
    use serde::de::Error as _;
    use serde::{Deserialize, Deserializer};

    /// A JSON scalar as it came. Read straight from the parser's token (an untagged enum would
    /// buffer the value and build, then drop, a formatted error for every variant before the one
    /// that fits: four or five per request).
    enum Scalar {
        Bool(bool),
        Int(i64),
        Float(f64),
        Text(String),
    }

    impl<'de> Deserialize<'de> for Scalar {
        fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
            struct Read;
            impl serde::de::Visitor<'_> for Read {
                type Value = Scalar;
                fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                    f.write_str("a boolean, a number or a string")
                }
                fn visit_bool<E>(self, b: bool) -> Result<Scalar, E> {
                    Ok(Scalar::Bool(b))
                }
                fn visit_i64<E>(self, i: i64) -> Result<Scalar, E> {
                    Ok(Scalar::Int(i))
                }
                fn visit_u64<E>(self, u: u64) -> Result<Scalar, E> {
                    // Past i64's range: a float, as JSON numbers are.
                    Ok(i64::try_from(u).map_or(Scalar::Float(u as f64), Scalar::Int))
                }
                fn visit_f64<E>(self, f: f64) -> Result<Scalar, E> {
                    Ok(Scalar::Float(f))
                }
                fn visit_str<E>(self, t: &str) -> Result<Scalar, E> {
                    Ok(Scalar::Text(t.to_owned()))
                }
                fn visit_string<E>(self, t: String) -> Result<Scalar, E> {
                    Ok(Scalar::Text(t))
                }
            }
            d.deserialize_any(Read)
        }
    }

    impl Scalar {
        fn int(&self) -> Option<i64> {
            match self {
                Self::Bool(b) => Some(i64::from(*b)),
                Self::Int(i) => Some(*i),
                // Integral and inside i64's range (`i64::MAX as f64` is 2^63, just outside it).
                Self::Float(f)
                    if f.fract() == 0.0 && (i64::MIN as f64..i64::MAX as f64).contains(f) =>
                {
                    Some(*f as i64)
                }
                Self::Float(_) => None,
                Self::Text(t) => t.trim().parse().ok(),
            }
        }

        fn float(&self) -> Option<f64> {
            match self {
                Self::Bool(b) => Some(f64::from(u8::from(*b))),
                Self::Int(i) => Some(*i as f64),
                Self::Float(f) => Some(*f),
                Self::Text(t) => t.trim().parse::<f64>().ok().filter(|f| f.is_finite()),
            }
        }

        fn bool(&self) -> Option<bool> {
            match self {
                Self::Bool(b) => Some(*b),
                Self::Int(0) => Some(false),
                Self::Int(1) => Some(true),
                Self::Int(_) => None,
                Self::Float(f) if *f == 0.0 => Some(false),
                Self::Float(f) if *f == 1.0 => Some(true),
                Self::Float(_) => None,
                Self::Text(t) => match t.trim().to_ascii_lowercase().as_str() {
                    "0" | "off" | "f" | "false" | "n" | "no" => Some(false),
                    "1" | "on" | "t" | "true" | "y" | "yes" => Some(true),
                    _ => None,
                },
            }
        }

        fn shown(&self) -> String {
            match self {
                Self::Bool(b) => b.to_string(),
                Self::Int(i) => i.to_string(),
                Self::Float(f) => f.to_string(),
                Self::Text(t) => format!("{t:?}"),
            }
        }
    }

    pub(crate) fn yes() -> bool {
        true
    }

    /// A scalar read by `read` (the kind `what` names in the error), `None` for `null` or absent.
    fn lax<'de, D: Deserializer<'de>, T>(
        d: D,
        read: fn(&Scalar) -> Option<T>,
        what: &str,
    ) -> Result<Option<T>, D::Error> {
        match Option::<Scalar>::deserialize(d)? {
            None => Ok(None),
            Some(s) => read(&s)
                .map(Some)
                .ok_or_else(|| D::Error::custom(format!("expected {what}, got {}", s.shown()))),
        }
    }

    /// A boolean, lax; `null` reads as false.
    pub(crate) fn bool_or_null<'de, D: Deserializer<'de>>(d: D) -> Result<bool, D::Error> {
        Ok(lax(d, Scalar::bool, "a boolean")?.unwrap_or(false))
    }

    /// An optional integer, lax.
    pub(crate) fn opt_int<'de, D: Deserializer<'de>>(d: D) -> Result<Option<i64>, D::Error> {
        lax(d, Scalar::int, "an integer")
    }

    /// An optional number, lax.
    pub(crate) fn opt_float<'de, D: Deserializer<'de>>(d: D) -> Result<Option<f64>, D::Error> {
        lax(d, Scalar::float, "a number")
    }
}

/// The sampling and output fields both endpoints share.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct GenerationParams {
    /// Served model name.
    pub model: Option<String>,
    /// Stream the response as SSE (`null` reads as false).
    #[serde(default, deserialize_with = "lax::bool_or_null")]
    pub stream: bool,
    /// Options for a streamed response.
    pub stream_options: Option<StreamOptions>,
    /// Output token limit (completions, and chat's legacy field).
    #[serde(default, deserialize_with = "lax::opt_int")]
    pub max_tokens: Option<i64>,
    /// Chat's output token limit; wins over `max_tokens` when both are set.
    #[serde(default, deserialize_with = "lax::opt_int")]
    pub max_completion_tokens: Option<i64>,
    /// Keep generating past end-of-sequence (vLLM extension).
    #[serde(default, deserialize_with = "lax::bool_or_null")]
    pub ignore_eos: bool,
    /// Minimum output tokens before end-of-sequence may be sampled (vLLM extension).
    #[serde(default, deserialize_with = "lax::opt_int")]
    pub min_tokens: Option<i64>,
    /// Sampling seed.
    #[serde(default, deserialize_with = "lax::opt_int")]
    pub seed: Option<i64>,
    /// Sampling temperature.
    #[serde(default, deserialize_with = "lax::opt_float")]
    pub temperature: Option<f64>,
    /// Number of choices; only 1 is served by the simulator.
    #[serde(default, deserialize_with = "lax::opt_int")]
    pub n: Option<i64>,
    /// Nucleus sampling mass, in (0, 1].
    #[serde(default, deserialize_with = "lax::opt_float")]
    pub top_p: Option<f64>,
    /// Top-k sampling: -1 or 0 for off, else at least 1.
    #[serde(default, deserialize_with = "lax::opt_int")]
    pub top_k: Option<i64>,
    /// Minimum token probability relative to the most likely, in [0, 1].
    #[serde(default, deserialize_with = "lax::opt_float")]
    pub min_p: Option<f64>,
    /// Presence penalty, in [-2, 2].
    #[serde(default, deserialize_with = "lax::opt_float")]
    pub presence_penalty: Option<f64>,
    /// Frequency penalty, in [-2, 2].
    #[serde(default, deserialize_with = "lax::opt_float")]
    pub frequency_penalty: Option<f64>,
    /// Repetition penalty, above 0.
    #[serde(default, deserialize_with = "lax::opt_float")]
    pub repetition_penalty: Option<f64>,
    /// Log probabilities: chat's switch (`true` reads as 1), or completions' count.
    #[serde(default, deserialize_with = "lax::opt_int")]
    pub logprobs: Option<i64>,
    /// Chat's number of alternatives per token; needs `logprobs`.
    #[serde(default, deserialize_with = "lax::opt_int")]
    pub top_logprobs: Option<i64>,
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

    /// What vLLM refuses with 400 among the sampling fields (`SamplingParams._verify_args` and
    /// the chat request's `logprobs` check): the message, in vLLM's words, and the field.
    pub fn sampling_error(&self) -> Option<(String, &'static str)> {
        let outside = |v: Option<f64>, ok: &dyn Fn(f64) -> bool| v.filter(|x| !ok(*x));
        if let Some(t) = outside(self.temperature, &|t| t >= 0.0) {
            return Some((
                format!("temperature must be non-negative, got {}.", py_float(t)),
                "temperature",
            ));
        }
        if let Some(p) = outside(self.top_p, &|p| p > 0.0 && p <= 1.0) {
            return Some((
                format!("top_p must be in (0, 1], got {}.", py_float(p)),
                "top_p",
            ));
        }
        if let Some(k) = self.top_k.filter(|k| *k < -1) {
            return Some((
                format!("top_k must be 0 (disable), or at least 1, got {k}."),
                "top_k",
            ));
        }
        if let Some(m) = outside(self.min_p, &|m| (0.0..=1.0).contains(&m)) {
            return Some((
                format!("min_p must be in [0, 1], got {}.", py_float(m)),
                "min_p",
            ));
        }
        for (name, v) in [
            ("presence_penalty", self.presence_penalty),
            ("frequency_penalty", self.frequency_penalty),
        ] {
            if let Some(x) = outside(v, &|x| (-2.0..=2.0).contains(&x)) {
                return Some((
                    format!("{name} must be in [-2, 2], got {}.", py_float(x)),
                    name,
                ));
            }
        }
        if let Some(r) = outside(self.repetition_penalty, &|r| r > 0.0) {
            return Some((
                format!(
                    "repetition_penalty must be greater than zero, got {}.",
                    py_float(r)
                ),
                "repetition_penalty",
            ));
        }
        match self.top_logprobs {
            Some(k) if k < 0 && k != -1 => Some((
                "`top_logprobs` must be a positive value.".into(),
                "top_logprobs",
            )),
            Some(k) if k > 0 && self.logprobs.unwrap_or(0) == 0 => Some((
                "when using `top_logprobs`, `logprobs` must be set to true.".into(),
                "top_logprobs",
            )),
            _ => None,
        }
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

/// A float as Python prints it in vLLM's messages (`-1.0`, `1.5`).
fn py_float(x: f64) -> String {
    if x.fract() == 0.0 && x.abs() < 1e16 {
        format!("{x:.1}")
    } else {
        format!("{x}")
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
    /// Typed parts, joined with `\n`: text parts by their text, others (images, audio, video)
    /// by a marker naming their type and the digest of their content ([`render_chat`]).
    Parts(Vec<ContentPart>),
}

/// Fields of a content part that hold text.
const TEXT_FIELDS: [&str; 3] = ["text", "refusal", "thinking"];
/// Part types whose content is text, and which of [`TEXT_FIELDS`] holds it (as vLLM reads them).
const TEXT_PARTS: [(&str, usize); 4] = [
    ("text", 0),
    ("input_text", 0),
    ("refusal", 1),
    ("thinking", 2),
];

/// One typed part of a chat message.
#[derive(Debug, Clone, Serialize)]
pub struct ContentPart {
    /// The part type, e.g. `text`.
    #[serde(rename = "type")]
    pub kind: String,
    /// The text of a text part (`text`, `input_text`, `refusal`, `thinking`).
    pub text: Option<String>,
    /// For any other part (an image, audio, video), the digest of its fields but its type
    /// ([`crate::json_digest`]): an image's URL or its inline data. Two images that differ give
    /// different digests, where their messages' text alone would be the same. Not serialized:
    /// the content itself is not kept.
    #[serde(skip)]
    pub media: Option<u64>,
}

impl<'de> Deserialize<'de> for ContentPart {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct PartVisitor;
        impl<'de> serde::de::Visitor<'de> for PartVisitor {
            type Value = ContentPart;

            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a content part (an object with a type)")
            }

            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut map: A,
            ) -> Result<ContentPart, A::Error> {
                // The type may come after the content: the fields that can hold text are kept
                // until it is known, every other one digested as it is read.
                let mut kind: Option<String> = None;
                let mut texts: [Option<String>; TEXT_FIELDS.len()] = Default::default();
                let mut media = crate::json_digest::ObjectDigest::default();
                while let Some(key) = map.next_key::<std::borrow::Cow<'de, str>>()? {
                    if key == "type" {
                        kind = Some(map.next_value()?);
                    } else if let Some(i) = TEXT_FIELDS.iter().position(|f| *f == key) {
                        texts[i] = map.next_value()?;
                    } else {
                        media.entry(&key, &mut map)?;
                    }
                }
                let kind = kind.ok_or_else(|| serde::de::Error::missing_field("type"))?;
                let field = TEXT_PARTS.iter().find(|(k, _)| *k == kind).map(|(_, i)| *i);
                let text = field.and_then(|i| texts[i].take());
                let media = (field.is_none() && !media.is_empty()).then(|| media.digest());
                Ok(ContentPart { kind, text, media })
            }
        }
        d.deserialize_map(PartVisitor)
    }
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
                let mut first = true;
                for p in parts {
                    let (text, media) = (p.text.as_deref(), p.media);
                    if text.is_none() && media.is_none() {
                        continue;
                    }
                    if !first {
                        out.push('\n');
                    }
                    first = false;
                    if let Some(t) = text {
                        out.push_str(t);
                    } else if let Some(digest) = media {
                        // What the engine puts in its place differs with the content (vLLM keys
                        // the blocks it falls in by the item's hash): the chain diverges here.
                        use std::fmt::Write;
                        let _ = write!(out, "<|{}:{digest:016x}|>", p.kind);
                    }
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
        let marker = &text[text.find("<|image_url:").expect(&text)..];
        assert_eq!(&marker[12 + 16..12 + 18], "|>", "{text}");
        assert!(
            marker[12..28].bytes().all(|b| b.is_ascii_hexdigit()),
            "{text}"
        );
        assert!(
            text.contains(&format!(
                "<|end_header_id|>\n\nHi\n{}\nthere<|eot_id|>",
                &marker[..30]
            )),
            "{text}"
        );
        assert!(text.ends_with("assistant<|end_header_id|>\n\n"));
    }

    /// Two requests that differ only in their image render differently from the image on, and
    /// alike before it; the same image (URL or inline data) renders alike.
    #[test]
    fn media_parts_tell_their_contents_apart() {
        let chat = |image: &str| {
            let body = format!(
                r#"{{"model":"m","messages":[{{"role":"system","content":"Describe images."}},
                {{"role":"user","content":[{{"type":"text","text":"What is this?"}},
                {{"type":"image_url","image_url":{{"url":"{image}"}}}}]}}]}}"#
            );
            let r: ChatCompletionRequest = serde_json::from_str(&body).unwrap();
            render_chat(&r.messages)
        };
        let (a, b) = (
            chat("data:image/png;base64,AAAA"),
            chat("data:image/png;base64,AAAB"),
        );
        assert_ne!(a, b);
        assert_eq!(a, chat("data:image/png;base64,AAAA"));
        let common = a.bytes().zip(b.bytes()).take_while(|(x, y)| x == y).count();
        assert!(
            a[..common].ends_with("What is this?\n<|image_url:"),
            "{}",
            &a[..common]
        );
        // A part of an unknown shape with nothing but its type adds nothing; text-only content
        // renders as before.
        let r: ChatCompletionRequest = serde_json::from_str(
            r#"{"messages":[{"role":"user","content":[{"type":"text","text":"a"},{"type":"refusal"},{"type":"text","text":"b"}]}]}"#,
        )
        .unwrap();
        assert!(render_chat(&r.messages).contains("\n\na\nb<|eot_id|>"));
        // Text parts of the other kinds vLLM reads as text, whichever comes first, type or text.
        let r: ChatCompletionRequest = serde_json::from_str(
            r#"{"messages":[{"role":"assistant","content":[{"type":"refusal","refusal":"no"},
            {"type":"input_text","text":"x"},{"thinking":"hmm","type":"thinking"}]}]}"#,
        )
        .unwrap();
        assert!(render_chat(&r.messages).contains("\n\nno\nx\nhmm<|eot_id|>"));
        // The same image whose fields a client wrote in another order.
        let part = |fields: &str| {
            let body = format!(r#"{{"messages":[{{"role":"user","content":[{fields}]}}]}}"#);
            render_chat(
                &serde_json::from_str::<ChatCompletionRequest>(&body)
                    .unwrap()
                    .messages,
            )
        };
        assert_eq!(
            part(r#"{"type":"image_url","image_url":{"url":"u","detail":"low"}}"#),
            part(r#"{"image_url":{"detail":"low","url":"u"},"type":"image_url"}"#)
        );
        // A part without a type is not a part.
        assert!(
            serde_json::from_str::<ChatCompletionRequest>(
                r#"{"messages":[{"role":"user","content":[{"text":"a"}]}]}"#
            )
            .is_err()
        );
    }

    #[test]
    fn scalars_are_read_as_leniently_as_vllm_reads_them() {
        let params = |body: &str| serde_json::from_str::<CompletionRequest>(body).map(|r| r.params);
        let p = params(
            r#"{"prompt":"x","max_tokens":2.0,"min_tokens":"1","seed":" 7 ","n":true,
                "temperature":"0.5","stream":"true","ignore_eos":1}"#,
        )
        .unwrap();
        assert_eq!(
            (p.max_tokens, p.min_tokens, p.seed, p.n, p.temperature),
            (Some(2), Some(1), Some(7), Some(1), Some(0.5))
        );
        assert!(p.stream && p.ignore_eos);
        let p =
            params(r#"{"prompt":"x","stream":null,"max_tokens":null,"ignore_eos":"off"}"#).unwrap();
        assert!(!p.stream && !p.ignore_eos && p.max_tokens.is_none());
        for bad in [
            r#"{"prompt":"x","max_tokens":2.5}"#,
            r#"{"prompt":"x","max_tokens":"five"}"#,
            r#"{"prompt":"x","max_tokens":1e30}"#,
            r#"{"prompt":"x","stream":"maybe"}"#,
            r#"{"prompt":"x","stream":2}"#,
            r#"{"prompt":"x","temperature":"hot"}"#,
            r#"{"prompt":"x","temperature":[1]}"#,
        ] {
            assert!(params(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn sampling_fields_are_range_checked_as_vllm_checks_them() {
        let error = |fields: &str| {
            let body = format!(r#"{{"prompt":"x",{fields}}}"#);
            let p = serde_json::from_str::<CompletionRequest>(&body)
                .unwrap()
                .params;
            p.sampling_error()
        };
        for ok in [
            r#""temperature":0,"top_p":1,"top_k":-1,"min_p":0"#,
            r#""presence_penalty":2,"frequency_penalty":-2,"repetition_penalty":1.1"#,
            r#""top_k":0,"logprobs":true,"top_logprobs":5"#,
            r#""top_logprobs":0"#,
        ] {
            assert_eq!(error(ok), None, "{ok}");
        }
        for (bad, field, message) in [
            (
                r#""temperature":-1"#,
                "temperature",
                "temperature must be non-negative, got -1.0.",
            ),
            (r#""top_p":0"#, "top_p", "top_p must be in (0, 1], got 0.0."),
            (
                r#""top_p":1.5"#,
                "top_p",
                "top_p must be in (0, 1], got 1.5.",
            ),
            (
                r#""top_k":-2"#,
                "top_k",
                "top_k must be 0 (disable), or at least 1, got -2.",
            ),
            (r#""min_p":2"#, "min_p", "min_p must be in [0, 1], got 2.0."),
            (
                r#""presence_penalty":5"#,
                "presence_penalty",
                "presence_penalty must be in [-2, 2], got 5.0.",
            ),
            (
                r#""frequency_penalty":-9"#,
                "frequency_penalty",
                "frequency_penalty must be in [-2, 2], got -9.0.",
            ),
            (
                r#""repetition_penalty":0"#,
                "repetition_penalty",
                "repetition_penalty must be greater than zero, got 0.0.",
            ),
            (
                r#""top_logprobs":3"#,
                "top_logprobs",
                "when using `top_logprobs`, `logprobs` must be set to true.",
            ),
            (
                r#""logprobs":false,"top_logprobs":3"#,
                "top_logprobs",
                "when using `top_logprobs`, `logprobs` must be set to true.",
            ),
            (
                r#""top_logprobs":-3"#,
                "top_logprobs",
                "`top_logprobs` must be a positive value.",
            ),
        ] {
            assert_eq!(error(bad), Some((message.to_owned(), field)), "{bad}");
        }
    }

    #[test]
    fn stream_options_ask_for_usage_unless_told_not_to() {
        let usage = |opts: &str| {
            let body = format!(r#"{{"prompt":"x","stream":true,"stream_options":{opts}}}"#);
            let p = serde_json::from_str::<CompletionRequest>(&body)
                .unwrap()
                .params;
            (p.include_usage(), p.continuous_usage())
        };
        assert_eq!(usage("{}"), (true, false));
        assert_eq!(usage(r#"{"continuous_usage_stats":true}"#), (true, true));
        assert_eq!(usage(r#"{"include_usage":null}"#), (false, false));
        assert_eq!(
            usage(r#"{"include_usage":false,"continuous_usage_stats":true}"#),
            (false, false)
        );
        assert_eq!(usage("null"), (false, false));
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
