//! vLLM's response bodies: the SSE chunks, non-streamed bodies and error bodies, written field for
//! field in vLLM 0.33's order so a byte-comparing client sees what a real replica sends.
//!
//! Streamed chunks are formatted by hand from a per-request prefix (`{"id":…,"model":…,"choices":[`)
//! because they are the hot path: one per token per request.

use serde_json::{Value, json};

/// Which OpenAI endpoint a request came in on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    /// `/v1/chat/completions`.
    Chat,
    /// `/v1/completions`.
    Completions,
}

/// Token counts for `usage`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    /// Prompt tokens.
    pub prompt: u32,
    /// Generated tokens.
    pub completion: u32,
    /// Prompt tokens served from the prefix cache, reported with `--enable-prompt-tokens-details`
    /// (vLLM's `prompt_tokens_details.cached_tokens`).
    pub cached: Option<u32>,
}

impl Usage {
    /// `{"prompt_tokens":…,"total_tokens":…,"completion_tokens":…}` (vLLM's key order), then
    /// `"prompt_tokens_details":{"cached_tokens":…}` when the details are on.
    pub fn json(self) -> String {
        let details = self.cached.map_or_else(String::new, |n| {
            format!(r#","prompt_tokens_details":{{"cached_tokens":{n}}}"#)
        });
        format!(
            r#"{{"prompt_tokens":{},"total_tokens":{},"completion_tokens":{}{details}}}"#,
            self.prompt,
            self.prompt + self.completion,
            self.completion
        )
    }

    /// The same counts without the prompt details (vLLM puts them in the final usage only).
    fn counts(self) -> Self {
        Self {
            cached: None,
            ..self
        }
    }
}

/// JSON string literal of `s` (with quotes).
pub fn quote(s: &str) -> String {
    serde_json::to_string(s).unwrap_or_else(|_| "\"\"".to_owned())
}

/// Formats the SSE chunks of one streamed response.
#[derive(Debug, Clone)]
pub struct ChunkWriter {
    endpoint: Endpoint,
    /// `{"id":"…","object":"…","created":…,"model":"…","choices":[`
    head: String,
    role: String,
    continuous_usage: bool,
}

impl ChunkWriter {
    /// A writer for one response.
    pub fn new(
        endpoint: Endpoint,
        id: &str,
        created: u64,
        model: &str,
        role: &str,
        continuous_usage: bool,
    ) -> Self {
        let object = match endpoint {
            Endpoint::Chat => "chat.completion.chunk",
            Endpoint::Completions => "text_completion",
        };
        let head = format!(
            r#"{{"id":{},"object":"{object}","created":{created},"model":{},"choices":["#,
            quote(id),
            quote(model)
        );
        Self {
            endpoint,
            head,
            role: quote(role),
            continuous_usage,
        }
    }

    fn usage_field(&self, usage: Usage) -> String {
        if self.continuous_usage {
            format!(r#","usage":{}"#, usage.counts().json())
        } else {
            String::new()
        }
    }

    /// The chat role chunk that opens a chat stream (vLLM sends it with the first output).
    pub fn role_chunk(&self, prompt_tokens: u32) -> String {
        format!(
            r#"{}{{"index":0,"delta":{{"role":{},"content":""}},"logprobs":null,"finish_reason":null}}]{},"prompt_token_ids":null,"prompt_text":null}}"#,
            self.head,
            self.role,
            self.usage_field(Usage {
                prompt: prompt_tokens,
                ..Usage::default()
            })
        )
    }

    /// One token's chunk; `finish` set on the last one.
    pub fn token_chunk(&self, text: &str, finish: Option<&str>, usage: Usage) -> String {
        let text = quote(text);
        let usage = self.usage_field(usage);
        match (self.endpoint, finish) {
            (Endpoint::Chat, None) => format!(
                r#"{}{{"index":0,"delta":{{"content":{text}}},"logprobs":null,"finish_reason":null,"token_ids":null}}]{usage},"kv_transfer_params":null}}"#,
                self.head
            ),
            (Endpoint::Chat, Some(reason)) => format!(
                r#"{}{{"index":0,"delta":{{"content":{text}}},"logprobs":null,"finish_reason":"{reason}","stop_reason":null,"token_ids":null,"weight_versions":null}}]{usage},"kv_transfer_params":null}}"#,
                self.head
            ),
            (Endpoint::Completions, finish) => {
                let finish = finish.map_or_else(|| "null".to_owned(), |r| format!("\"{r}\""));
                format!(
                    r#"{}{{"index":0,"text":{text},"logprobs":null,"finish_reason":{finish},"stop_reason":null,"prompt_token_ids":null,"token_ids":null,"weight_versions":null}}]{usage},"kv_transfer_params":null}}"#,
                    self.head
                )
            }
        }
    }

    /// The final usage chunk (`choices: []`).
    pub fn usage_chunk(&self, usage: Usage) -> String {
        format!(r#"{}],"usage":{}}}"#, self.head, usage.json())
    }
}

/// What a non-streamed response says besides its text.
#[derive(Debug, Clone, Copy)]
pub struct Completed<'a> {
    /// `chatcmpl-…` or `cmpl-…`.
    pub id: &'a str,
    /// Unix seconds.
    pub created: u64,
    /// Served model name.
    pub model: &'a str,
    /// `system_fingerprint`.
    pub fingerprint: &'a str,
    /// Chat role of the answer.
    pub role: &'a str,
    /// `stop`, `length`, ….
    pub finish: &'a str,
    /// Token counts.
    pub usage: Usage,
}

/// A non-streamed response body, every field present in vLLM 0.33's order (it serializes these
/// with `model_dump()`, nulls included; an empty `tool_calls` is dropped).
pub fn full_response(endpoint: Endpoint, text: &str, c: &Completed<'_>) -> Value {
    let usage = json!({
        "prompt_tokens": c.usage.prompt,
        "total_tokens": c.usage.prompt + c.usage.completion,
        "completion_tokens": c.usage.completion,
        "prompt_tokens_details": c.usage.cached.map(|n| json!({ "cached_tokens": n })),
        "completion_tokens_details": null,
    });
    match endpoint {
        Endpoint::Chat => json!({
            "id": c.id,
            "object": "chat.completion",
            "created": c.created,
            "model": c.model,
            "choices": [{
                "index": 0,
                "message": {
                    "role": c.role,
                    "content": text,
                    "refusal": null,
                    "annotations": null,
                    "audio": null,
                    "function_call": null,
                    "reasoning": null,
                },
                "logprobs": null,
                "finish_reason": c.finish,
                "stop_reason": null,
                "token_ids": null,
                "routed_experts": null,
                "weight_versions": null,
            }],
            "service_tier": null,
            "system_fingerprint": c.fingerprint,
            "usage": usage,
            "prompt_logprobs": null,
            "prompt_token_ids": null,
            "prompt_text": null,
            "kv_transfer_params": null,
            "ec_transfer_params": null,
            "metrics": null,
        }),
        Endpoint::Completions => json!({
            "id": c.id,
            "object": "text_completion",
            "created": c.created,
            "model": c.model,
            "choices": [{
                "index": 0,
                "text": text,
                "logprobs": null,
                "finish_reason": c.finish,
                "stop_reason": null,
                "token_ids": null,
                "prompt_logprobs": null,
                "prompt_token_ids": null,
                "routed_experts": null,
                "weight_versions": null,
            }],
            "service_tier": null,
            "system_fingerprint": c.fingerprint,
            "usage": usage,
            "kv_transfer_params": null,
            "ec_transfer_params": null,
            "metrics": null,
        }),
    }
}

/// vLLM's error body: `{"error":{"message":…,"type":…,"param":…,"code":status}}`.
pub fn error_body(status: u16, kind: &str, message: &str, param: Option<&str>) -> Value {
    json!({"error": {"message": message, "type": kind, "param": param, "code": status}})
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chat_chunks_match_the_reference_bytes() {
        let w = ChunkWriter::new(Endpoint::Chat, "chatcmpl-X", 7, "M", "assistant", false);
        assert_eq!(
            w.role_chunk(12),
            r#"{"id":"chatcmpl-X","object":"chat.completion.chunk","created":7,"model":"M","choices":[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}],"prompt_token_ids":null,"prompt_text":null}"#
        );
        assert_eq!(
            w.token_chunk("Hello", None, Usage::default()),
            r#"{"id":"chatcmpl-X","object":"chat.completion.chunk","created":7,"model":"M","choices":[{"index":0,"delta":{"content":"Hello"},"logprobs":null,"finish_reason":null,"token_ids":null}],"kv_transfer_params":null}"#
        );
        assert_eq!(
            w.token_chunk("!", Some("stop"), Usage::default()),
            r#"{"id":"chatcmpl-X","object":"chat.completion.chunk","created":7,"model":"M","choices":[{"index":0,"delta":{"content":"!"},"logprobs":null,"finish_reason":"stop","stop_reason":null,"token_ids":null,"weight_versions":null}],"kv_transfer_params":null}"#
        );
        assert_eq!(
            w.usage_chunk(Usage {
                prompt: 12,
                completion: 3,
                cached: None,
            }),
            r#"{"id":"chatcmpl-X","object":"chat.completion.chunk","created":7,"model":"M","choices":[],"usage":{"prompt_tokens":12,"total_tokens":15,"completion_tokens":3}}"#
        );
    }

    #[test]
    fn completion_chunks_match_the_reference_bytes() {
        let w = ChunkWriter::new(Endpoint::Completions, "cmpl-X", 7, "M", "assistant", false);
        assert_eq!(
            w.token_chunk(" Hello", None, Usage::default()),
            r#"{"id":"cmpl-X","object":"text_completion","created":7,"model":"M","choices":[{"index":0,"text":" Hello","logprobs":null,"finish_reason":null,"stop_reason":null,"prompt_token_ids":null,"token_ids":null,"weight_versions":null}],"kv_transfer_params":null}"#
        );
        assert!(
            w.token_chunk(" x", Some("length"), Usage::default())
                .contains(r#""finish_reason":"length","stop_reason":null"#)
        );
        assert_eq!(
            w.usage_chunk(Usage {
                prompt: 1,
                completion: 2,
                cached: None,
            }),
            r#"{"id":"cmpl-X","object":"text_completion","created":7,"model":"M","choices":[],"usage":{"prompt_tokens":1,"total_tokens":3,"completion_tokens":2}}"#
        );
    }

    #[test]
    fn full_bodies_keep_vllm_key_order() {
        let c = Completed {
            id: "chatcmpl-1",
            created: 5,
            model: "m",
            fingerprint: "vllm-0.33.0-00000000",
            role: "assistant",
            finish: "length",
            usage: Usage {
                prompt: 12,
                completion: 5,
                cached: None,
            },
        };
        let chat = full_response(Endpoint::Chat, "Hi", &c).to_string();
        assert_eq!(
            chat,
            r#"{"id":"chatcmpl-1","object":"chat.completion","created":5,"model":"m","choices":[{"index":0,"message":{"role":"assistant","content":"Hi","refusal":null,"annotations":null,"audio":null,"function_call":null,"reasoning":null},"logprobs":null,"finish_reason":"length","stop_reason":null,"token_ids":null,"routed_experts":null,"weight_versions":null}],"service_tier":null,"system_fingerprint":"vllm-0.33.0-00000000","usage":{"prompt_tokens":12,"total_tokens":17,"completion_tokens":5,"prompt_tokens_details":null,"completion_tokens_details":null},"prompt_logprobs":null,"prompt_token_ids":null,"prompt_text":null,"kv_transfer_params":null,"ec_transfer_params":null,"metrics":null}"#
        );
        let cmpl = full_response(
            Endpoint::Completions,
            " world",
            &Completed { id: "cmpl-1", ..c },
        )
        .to_string();
        assert_eq!(
            cmpl,
            r#"{"id":"cmpl-1","object":"text_completion","created":5,"model":"m","choices":[{"index":0,"text":" world","logprobs":null,"finish_reason":"length","stop_reason":null,"token_ids":null,"prompt_logprobs":null,"prompt_token_ids":null,"routed_experts":null,"weight_versions":null}],"service_tier":null,"system_fingerprint":"vllm-0.33.0-00000000","usage":{"prompt_tokens":12,"total_tokens":17,"completion_tokens":5,"prompt_tokens_details":null,"completion_tokens_details":null},"kv_transfer_params":null,"ec_transfer_params":null,"metrics":null}"#
        );
        let err = error_body(
            404,
            "NotFoundError",
            "The model `x` does not exist. Valid aliases: m.",
            Some("model"),
        );
        assert_eq!(
            err.to_string(),
            r#"{"error":{"message":"The model `x` does not exist. Valid aliases: m.","type":"NotFoundError","param":"model","code":404}}"#
        );
    }

    #[test]
    fn cached_tokens_appear_in_the_final_usage_only_when_the_details_are_on() {
        let usage = Usage {
            prompt: 1024,
            completion: 2,
            cached: Some(512),
        };
        let w = ChunkWriter::new(Endpoint::Chat, "c", 1, "m", "assistant", true);
        assert!(
            w.usage_chunk(usage).ends_with(
                r#""usage":{"prompt_tokens":1024,"total_tokens":1026,"completion_tokens":2,"prompt_tokens_details":{"cached_tokens":512}}}"#
            ),
            "{}",
            w.usage_chunk(usage)
        );
        // vLLM's per-chunk usage carries the counts alone.
        let chunk = w.token_chunk("x", None, usage);
        assert!(!chunk.contains("prompt_tokens_details"), "{chunk}");
        let c = Completed {
            id: "cmpl-1",
            created: 5,
            model: "m",
            fingerprint: "f",
            role: "assistant",
            finish: "stop",
            usage,
        };
        let body = full_response(Endpoint::Completions, "x", &c);
        assert_eq!(body["usage"]["prompt_tokens_details"]["cached_tokens"], 512);
        let off = Completed {
            usage: Usage {
                cached: None,
                ..usage
            },
            ..c
        };
        assert!(
            full_response(Endpoint::Completions, "x", &off)["usage"]["prompt_tokens_details"]
                .is_null()
        );
    }

    #[test]
    fn continuous_usage_rides_on_every_chunk_and_json_stays_valid() {
        let w = ChunkWriter::new(Endpoint::Chat, "a\"b", 1, "m", "assistant", true);
        for chunk in [
            w.role_chunk(5),
            w.token_chunk(
                "x\n",
                None,
                Usage {
                    prompt: 5,
                    completion: 1,
                    cached: None,
                },
            ),
        ] {
            let v: Value = serde_json::from_str(&chunk).unwrap();
            assert_eq!(v["usage"]["prompt_tokens"], 5);
            assert_eq!(v["id"], "a\"b");
        }
    }
}
