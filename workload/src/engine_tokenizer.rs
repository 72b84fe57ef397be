//! The engine's own prompt tokens, from the model's `tokenizer.json` and chat template, so the
//! proxy hashes exactly the token ids a vLLM replica caches (vllm_hash.rs).
//!
//! | request | tokens (as vLLM's OpenAI server makes them) |
//! |---|---|
//! | chat | the chat template rendered (`messages`, `tools`, `add_generation_prompt` (default true), `chat_template_kwargs`, `bos_token`, `eos_token`), then tokenized without adding special tokens (the template writes them); `add_special_tokens: true` in the body adds them |
//! | completions, text | tokenized adding special tokens (BOS for Llama) unless the body sets `add_special_tokens: false` |
//! | completions, token ids | as given |
//!
//! The template is rendered with minijinja in jinja2's mode for Hugging Face templates
//! (`trim_blocks`, `lstrip_blocks`, Python string methods, `raise_exception`, `strftime_now`).
//! Message content given as a list of parts is joined into one string (text parts, newline
//! separated), as vLLM does for templates that expect string content. A template that renders
//! differently from the engine's (another `--chat-template`, a template reading parts) gives other
//! tokens, and the proxy's hashes then match nothing: `/stats` shows it (kv_events in routing.md).
//!
//! | file | found |
//! |---|---|
//! | `tokenizer.json` | configured path |
//! | chat template | configured path, else `chat_template.jinja` beside the tokenizer, else `chat_template` in `tokenizer_config.json` beside it |
//! | `bos_token`, `eos_token` | `tokenizer_config.json` beside the tokenizer, when present |

use std::path::Path;

use minijinja::{Environment, Value, context};
use serde_json::Value as Json;

/// Why the tokenizer or template could not be loaded or used.
#[derive(Debug, thiserror::Error)]
pub enum EngineTokenizerError {
    /// A file could not be read or parsed.
    #[error("{path}: {reason}")]
    Load {
        /// The file.
        path: String,
        /// What went wrong.
        reason: String,
    },
    /// The template failed on this request.
    #[error("chat template: {0}")]
    Template(String),
    /// The tokenizer failed on this text.
    #[error("tokenizer: {0}")]
    Tokenize(String),
}

/// A model's tokenizer and chat template.
#[derive(Debug)]
pub struct EngineTokenizer {
    tokenizer: tokenizers::Tokenizer,
    env: Option<Environment<'static>>,
    bos: String,
    eos: String,
}

const TEMPLATE: &str = "chat";

fn load_err(path: &Path, reason: impl ToString) -> EngineTokenizerError {
    EngineTokenizerError::Load {
        path: path.display().to_string(),
        reason: reason.to_string(),
    }
}

/// A special token as `tokenizer_config.json` writes it: a string or `{"content": …}`.
fn token_text(v: Option<&Json>) -> String {
    match v {
        Some(Json::String(s)) => s.clone(),
        Some(Json::Object(o)) => o
            .get("content")
            .and_then(Json::as_str)
            .unwrap_or("")
            .to_owned(),
        _ => String::new(),
    }
}

impl EngineTokenizer {
    /// Loads `tokenizer_json` and the chat template (`chat_template`, else found beside it).
    pub fn load(
        tokenizer_json: &Path,
        chat_template: Option<&Path>,
    ) -> Result<Self, EngineTokenizerError> {
        let tokenizer = tokenizers::Tokenizer::from_file(tokenizer_json)
            .map_err(|e| load_err(tokenizer_json, e))?;
        let dir = tokenizer_json.parent().unwrap_or(Path::new("."));
        let config_path = dir.join("tokenizer_config.json");
        let config: Option<Json> = match std::fs::read(&config_path) {
            Ok(bytes) => {
                Some(serde_json::from_slice(&bytes).map_err(|e| load_err(&config_path, e))?)
            }
            Err(_) => None,
        };
        let read = |p: &Path| std::fs::read_to_string(p).map_err(|e| load_err(p, e));
        let beside = dir.join("chat_template.jinja");
        let source = match chat_template {
            Some(p) => Some(read(p)?),
            None if beside.exists() => Some(read(&beside)?),
            None => config
                .as_ref()
                .and_then(|c| c.get("chat_template"))
                .and_then(|t| match t {
                    Json::String(s) => Some(s.clone()),
                    // A list of named templates: the default one.
                    Json::Array(named) => named
                        .iter()
                        .find(|n| n.get("name").and_then(Json::as_str) == Some("default"))
                        .and_then(|n| n.get("template").and_then(Json::as_str))
                        .map(str::to_owned),
                    _ => None,
                }),
        };
        let env = match source {
            Some(src) => Some(environment(src).map_err(|e| {
                load_err(
                    chat_template.unwrap_or(&config_path),
                    format!("chat template: {e}"),
                )
            })?),
            None => None,
        };
        Ok(Self {
            tokenizer,
            env,
            bos: token_text(config.as_ref().and_then(|c| c.get("bos_token"))),
            eos: token_text(config.as_ref().and_then(|c| c.get("eos_token"))),
        })
    }

    /// Whether a chat template was found.
    pub fn has_chat_template(&self) -> bool {
        self.env.is_some()
    }

    /// The prompt text of a chat request body (already parsed as JSON).
    pub fn render_chat(&self, body: &Json) -> Result<String, EngineTokenizerError> {
        let env = self.env.as_ref().ok_or_else(|| {
            EngineTokenizerError::Template("the model has no chat template".into())
        })?;
        let messages: Vec<Json> = body
            .get("messages")
            .and_then(Json::as_array)
            .map(|ms| ms.iter().map(flatten_content).collect())
            .unwrap_or_default();
        let add_generation_prompt = body
            .get("add_generation_prompt")
            .and_then(Json::as_bool)
            .unwrap_or(true);
        let kwargs = body
            .get("chat_template_kwargs")
            .cloned()
            .unwrap_or(Json::Object(Default::default()));
        let ctx = context! {
            messages => Value::from_serialize(&messages),
            tools => Value::from_serialize(body.get("tools").unwrap_or(&Json::Null)),
            add_generation_prompt => add_generation_prompt,
            bos_token => &self.bos,
            eos_token => &self.eos,
            ..Value::from_serialize(&kwargs)
        };
        env.get_template(TEMPLATE)
            .and_then(|t| t.render(ctx))
            .map_err(|e| EngineTokenizerError::Template(e.to_string()))
    }

    /// Token ids of `text`, adding the model's special tokens (BOS) when asked.
    pub fn encode(&self, text: &str, add_special: bool) -> Result<Vec<u32>, EngineTokenizerError> {
        self.tokenizer
            .encode(text, add_special)
            .map(|e| e.get_ids().to_vec())
            .map_err(|e| EngineTokenizerError::Tokenize(e.to_string()))
    }
}

/// A message with list content joined into a string of its text parts.
fn flatten_content(m: &Json) -> Json {
    let Some(Json::Array(parts)) = m.get("content") else {
        return m.clone();
    };
    let text: Vec<&str> = parts
        .iter()
        .filter(|p| p.get("type").and_then(Json::as_str) == Some("text"))
        .filter_map(|p| p.get("text").and_then(Json::as_str))
        .collect();
    let mut m = m.clone();
    m["content"] = Json::String(text.join("\n"));
    m
}

fn environment(source: String) -> Result<Environment<'static>, minijinja::Error> {
    let mut env = Environment::new();
    // jinja2 as transformers configures it for chat templates.
    env.set_trim_blocks(true);
    env.set_lstrip_blocks(true);
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.add_function(
        "raise_exception",
        |msg: String| -> Result<Value, minijinja::Error> {
            Err(minijinja::Error::new(
                minijinja::ErrorKind::InvalidOperation,
                msg,
            ))
        },
    );
    env.add_function("strftime_now", |format: String| strftime_now(&format));
    env.add_filter("tojson", tojson);
    env.add_template_owned(TEMPLATE, source)?;
    Ok(env)
}

/// transformers' `tojson`: Python's `json.dumps(x, ensure_ascii=False)`, so `", "` and `": "`
/// between items (minijinja's own is compact and HTML-escaped); with `indent`, Python's indented form.
fn tojson(value: Value, kwargs: minijinja::value::Kwargs) -> Result<String, minijinja::Error> {
    let invalid = |e: &dyn std::fmt::Display| {
        minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, e.to_string())
    };
    let indent: Option<usize> = kwargs.get("indent")?;
    kwargs.assert_all_used()?;
    let json = serde_json::to_value(&value).map_err(|e| invalid(&e))?;
    let out = match indent {
        Some(n) => {
            let pad = vec![b' '; n];
            let fmt = serde_json::ser::PrettyFormatter::with_indent(&pad);
            write_json(&json, fmt)
        }
        None => write_json(&json, PythonFormatter),
    };
    String::from_utf8(out.map_err(|e| invalid(&e))?).map_err(|e| invalid(&e))
}

fn write_json<F: serde_json::ser::Formatter>(
    json: &serde_json::Value,
    fmt: F,
) -> Result<Vec<u8>, serde_json::Error> {
    let mut out = Vec::new();
    serde::Serialize::serialize(
        json,
        &mut serde_json::Serializer::with_formatter(&mut out, fmt),
    )?;
    Ok(out)
}

/// `json.dumps`'s default separators: `", "` between items, `": "` after keys.
struct PythonFormatter;

impl serde_json::ser::Formatter for PythonFormatter {
    fn begin_array_value<W: ?Sized + std::io::Write>(
        &mut self,
        writer: &mut W,
        first: bool,
    ) -> std::io::Result<()> {
        if first {
            Ok(())
        } else {
            writer.write_all(b", ")
        }
    }

    fn begin_object_key<W: ?Sized + std::io::Write>(
        &mut self,
        writer: &mut W,
        first: bool,
    ) -> std::io::Result<()> {
        self.begin_array_value(writer, first)
    }

    fn begin_object_value<W: ?Sized + std::io::Write>(
        &mut self,
        writer: &mut W,
    ) -> std::io::Result<()> {
        writer.write_all(b": ")
    }
}

/// Today's UTC date in the few `strftime` codes chat templates use (`%d %b %Y`, `%B`, `%m`, `%y`,
/// `%A`, `%a`, `%e`); other codes are kept as written.
fn strftime_now(format: &str) -> String {
    let days = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() / 86_400) as i64;
    format_date(days, format)
}

fn format_date(days_since_epoch: i64, format: &str) -> String {
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    const WEEKDAYS: [&str; 7] = [
        "Thursday",
        "Friday",
        "Saturday",
        "Sunday",
        "Monday",
        "Tuesday",
        "Wednesday",
    ];
    // Civil date from days since 1970-01-01 (proleptic Gregorian).
    let z = days_since_epoch + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    let weekday = WEEKDAYS[days_since_epoch.rem_euclid(7) as usize];
    let month_name = MONTHS[(month - 1) as usize];
    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('d') => out.push_str(&format!("{day:02}")),
            Some('e') => out.push_str(&format!("{day:>2}")),
            Some('m') => out.push_str(&format!("{month:02}")),
            Some('Y') => out.push_str(&year.to_string()),
            Some('y') => out.push_str(&format!("{:02}", year % 100)),
            Some('b') => out.push_str(&month_name[..3]),
            Some('B') => out.push_str(month_name),
            Some('a') => out.push_str(&weekday[..3]),
            Some('A') => out.push_str(weekday),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dates_format_like_strftime() {
        // 2024-07-26 is day 19,930 since the epoch, a Friday.
        assert_eq!(format_date(19_930, "%d %b %Y"), "26 Jul 2024");
        assert_eq!(
            format_date(19_930, "%A %e %B %y, %m/%d %%"),
            "Friday 26 July 24, 07/26 %"
        );
        assert_eq!(format_date(0, "%Y-%m-%d %a"), "1970-01-01 Thu");
        assert_eq!(format_date(11_016, "%d %b %Y"), "29 Feb 2000");
    }

    #[test]
    fn tojson_writes_what_python_json_dumps_writes() {
        let env = environment(r#"{{ x | tojson }}|{{ x | tojson(indent=2) }}"#.into()).unwrap();
        let x = serde_json::json!({"name": "get_weather", "args": [1, "é<b>"], "empty": {}});
        let out = env
            .get_template(TEMPLATE)
            .unwrap()
            .render(context! { x => Value::from_serialize(&x) })
            .unwrap();
        assert_eq!(
            out,
            "{\"name\": \"get_weather\", \"args\": [1, \"é<b>\"], \"empty\": {}}|{\n  \"name\": \"get_weather\",\n  \"args\": [\n    1,\n    \"é<b>\"\n  ],\n  \"empty\": {}\n}"
        );
    }

    #[test]
    fn list_content_is_joined_into_text() {
        let m = serde_json::json!({"role": "user", "content": [
            {"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": "x"}},
            {"type": "text", "text": "b"}]});
        assert_eq!(flatten_content(&m)["content"], "a\nb");
    }
}
