//! Passive measurement of one response as it passes through: the instants users feel (first byte,
//! first output-bearing event, every later one, the end), the usage the engine reported and the
//! finish reason, read from the SSE stream chunk by chunk, or from the tail of a JSON body. When
//! the proxy asked for a usage chunk the client did not, the meter also cuts that event out of
//! what the client receives.
//!
//! ```text
//! TTFT = first output-bearing event handed to the client − arrival   (non-streamed: the end)
//! ITL  = gaps between consecutive output-bearing events (per event, as vLLM bench serve)
//! TPOT = (last output event − first output event) / (completion_tokens − 1),  completion_tokens > 1
//! E2E  = end of the response − arrival
//! ```
//!
//! An output-bearing event has a choice with text, content, reasoning, tool calls or a finish
//! reason; a role-only chunk, a usage-only chunk, an error and `[DONE]` carry no output.
//! Definitions side by side with other tools: docs/measurement.md.

use std::borrow::Cow;
use std::collections::VecDeque;
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use serde::Deserialize;
use serde::de::IgnoredAny;

use crate::digest::{Fingerprint, OutputDigest};
use crate::sse::{DONE, SseParser};

/// Bytes of a non-streamed body's end kept (as shared chunks, not copies) to read its usage.
pub const TAIL_BYTES: usize = 16 * 1024;

/// Largest non-streamed body copied whole to digest its output (agreement checks only).
pub const MAX_DIGEST_BODY_BYTES: usize = 4 << 20;

/// Token counts an engine reports.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
pub struct Usage {
    /// Prompt tokens.
    #[serde(default)]
    pub prompt_tokens: u64,
    /// Generated tokens.
    #[serde(default)]
    pub completion_tokens: u64,
    /// Prompt tokens served from the prefix cache, when the engine reports them.
    #[serde(
        default,
        deserialize_with = "cached_tokens",
        rename = "prompt_tokens_details"
    )]
    pub cached_tokens: Option<u64>,
}

fn cached_tokens<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
    #[derive(Deserialize)]
    struct Details {
        cached_tokens: Option<u64>,
    }
    Ok(Option::<Details>::deserialize(d)?.and_then(|x| x.cached_tokens))
}

#[derive(Deserialize)]
struct EventLite<'a> {
    #[serde(default, borrow)]
    choices: Choices<'a>,
    #[serde(default)]
    usage: Option<Usage>,
    #[serde(default)]
    error: Option<IgnoredAny>,
}

#[derive(Deserialize)]
struct ChoiceLite<'a> {
    #[serde(default)]
    index: Option<u32>,
    #[serde(default, borrow, deserialize_with = "text_in_place")]
    text: Option<Cow<'a, str>>,
    #[serde(default, borrow)]
    delta: Option<DeltaLite<'a>>,
    #[serde(default, borrow, deserialize_with = "text_in_place")]
    finish_reason: Option<Cow<'a, str>>,
}

/// An optional string, read in place when it has no escapes (serde's own `Cow` inside an
/// `Option` always copies): no allocation per event, and the text's place in the event for
/// [`Shape`].
fn text_in_place<'de: 'a, 'a, D: serde::Deserializer<'de>>(
    d: D,
) -> Result<Option<Cow<'a, str>>, D::Error> {
    struct Text;
    impl<'de> serde::de::Visitor<'de> for Text {
        type Value = Option<Cow<'de, str>>;
        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("a string or null")
        }
        fn visit_none<E>(self) -> Result<Self::Value, E> {
            Ok(None)
        }
        fn visit_unit<E>(self) -> Result<Self::Value, E> {
            Ok(None)
        }
        fn visit_some<D: serde::Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
            d.deserialize_str(self)
        }
        fn visit_borrowed_str<E>(self, v: &'de str) -> Result<Self::Value, E> {
            Ok(Some(Cow::Borrowed(v)))
        }
        fn visit_str<E>(self, v: &str) -> Result<Self::Value, E> {
            Ok(Some(Cow::Owned(v.to_owned())))
        }
        fn visit_string<E>(self, v: String) -> Result<Self::Value, E> {
            Ok(Some(Cow::Owned(v)))
        }
    }
    d.deserialize_option(Text)
}

impl ChoiceLite<'_> {
    fn has_output(&self) -> bool {
        self.has_output_without(None)
    }

    /// Whether the choice carries output with `field`'s text left out.
    fn has_output_without(&self, field: impl Into<Option<OutputField>>) -> bool {
        let field = field.into();
        let nonempty = |f: OutputField, s: &Option<Cow<'_, str>>| {
            field != Some(f) && s.as_deref().is_some_and(|s| !s.is_empty())
        };
        nonempty(OutputField::Text, &self.text)
            || self.finish_reason.is_some()
            || self.delta.as_ref().is_some_and(|d| {
                nonempty(OutputField::Content, &d.content)
                    || nonempty(OutputField::ReasoningContent, &d.reasoning_content)
                    || nonempty(OutputField::Reasoning, &d.reasoning)
                    || d.tool_calls.as_ref().is_some_and(|t| !t.is_empty())
            })
    }
}

/// An event's `choices`, summarized as they are parsed instead of collected (this runs on every
/// relayed event): how many, whether any carries output, the first finish reason, and choice 0
/// (by its `index`) for the digest. `null` or absent reads as none.
#[derive(Default)]
struct Choices<'a> {
    count: usize,
    output: bool,
    finish_reason: Option<Cow<'a, str>>,
    zero: Option<ChoiceLite<'a>>,
}

impl<'de: 'a, 'a> Deserialize<'de> for Choices<'a> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Read<'a>(std::marker::PhantomData<&'a ()>);
        impl<'de: 'a, 'a> serde::de::Visitor<'de> for Read<'a> {
            type Value = Choices<'a>;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a list of choices or null")
            }
            fn visit_none<E>(self) -> Result<Self::Value, E> {
                Ok(Choices::default())
            }
            fn visit_unit<E>(self) -> Result<Self::Value, E> {
                Ok(Choices::default())
            }
            fn visit_some<D: serde::Deserializer<'de>>(
                self,
                d: D,
            ) -> Result<Self::Value, D::Error> {
                d.deserialize_seq(self)
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(
                self,
                mut seq: A,
            ) -> Result<Self::Value, A::Error> {
                let mut out = Choices::default();
                while let Some(c) = seq.next_element::<ChoiceLite<'a>>()? {
                    out.count += 1;
                    out.output |= c.has_output();
                    if out.finish_reason.is_none() {
                        out.finish_reason.clone_from(&c.finish_reason);
                    }
                    if out.zero.is_none() && c.index.unwrap_or(0) == 0 {
                        out.zero = Some(c);
                    }
                }
                Ok(out)
            }
        }
        d.deserialize_option(Read(std::marker::PhantomData))
    }
}

#[derive(Deserialize)]
struct DeltaLite<'a> {
    #[serde(default, borrow, deserialize_with = "text_in_place")]
    content: Option<Cow<'a, str>>,
    #[serde(default, borrow, deserialize_with = "text_in_place")]
    reasoning_content: Option<Cow<'a, str>>,
    #[serde(default, borrow, deserialize_with = "text_in_place")]
    reasoning: Option<Cow<'a, str>>,
    #[serde(default)]
    tool_calls: Option<Vec<IgnoredAny>>,
}

/// What one SSE event of an OpenAI-compatible stream says.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EventInfo {
    /// It carries output.
    pub output: bool,
    /// Its usage, if it has one.
    pub usage: Option<Usage>,
    /// A usage chunk and nothing else (`choices: []`).
    pub usage_only: bool,
    /// The finish reason of its first finished choice.
    pub finish_reason: Option<String>,
    /// An error object, or data that is not JSON (and not `[DONE]`).
    pub error: bool,
    /// `[DONE]`.
    pub done: bool,
    /// Choices the event carried, output or not (a load generator following vLLM's benchmark
    /// counts each such event as a message).
    pub choices: usize,
}

/// Reads one event's data.
pub fn classify_event(data: &str) -> EventInfo {
    read_event(data, None)
}

/// Reads one event's data, adding the output text of choice 0 (by its `index`) to `digest`
/// (not for an error event: a failed answer has no output to compare).
/// Fields it reads (`choices`, `usage`, `error`) of unexpected types make the event unreadable
/// (`error`), as data that is not JSON does.
pub fn read_event(data: &str, digest: Option<&mut OutputDigest>) -> EventInfo {
    parse_event(data, digest).0
}

/// Reads one event whole, and says where its text is if the next event of the same stream may
/// reuse the rest.
fn parse_event(data: &str, digest: Option<&mut OutputDigest>) -> (EventInfo, Option<TextCut>) {
    if data.is_empty() {
        // An event whose data is empty has nothing to read (clients skip it): it is no output,
        // no error.
        return (EventInfo::default(), None);
    }
    if data == DONE {
        let info = EventInfo {
            done: true,
            ..EventInfo::default()
        };
        return (info, None);
    }
    let Ok(ev) = serde_json::from_str::<EventLite<'_>>(data) else {
        let info = EventInfo {
            error: true,
            ..EventInfo::default()
        };
        return (info, None);
    };
    let choices = ev.choices;
    if let (Some(digest), Some(zero), None) = (digest, &choices.zero, &ev.error) {
        digest_choice(digest, zero);
    }
    let info = EventInfo {
        output: choices.output,
        usage_only: ev.usage.is_some() && choices.count == 0 && ev.error.is_none(),
        usage: ev.usage,
        finish_reason: choices.finish_reason.map(Cow::into_owned),
        error: ev.error.is_some(),
        done: false,
        choices: choices.count,
    };
    let cut = match (&choices.zero, choices.count, &ev.error) {
        (Some(zero), 1, None) => TextCut::of(data, zero),
        _ => None,
    };
    (info, cut)
}

/// Reads the events of one stream in order. Consecutive events of a stream are the same bytes
/// but for the output text (engines repeat the id, model, creation time and the rest of the
/// choice), so an event that is its predecessor's [`Shape`] with other text is read by comparing
/// bytes, not parsed: the same answers as [`read_event`] for a fraction of the work, which runs on
/// every relayed event.
#[derive(Debug, Default)]
pub struct EventReader {
    shape: Option<Shape>,
}

impl EventReader {
    /// A reader for a new stream.
    pub fn new() -> Self {
        Self::default()
    }

    /// What [`read_event`] says of `data`.
    pub fn read(&mut self, data: &str, mut digest: Option<&mut OutputDigest>) -> EventInfo {
        match self.read_by_shape(data.as_bytes(), digest.as_deref_mut()) {
            Some(info) => info,
            None => self.read_whole(data, digest),
        }
    }

    /// What [`read_event`] says of `data` as the stream carried it, bytes that are not UTF-8
    /// read as U+FFFD. An event of the last shape is read without checking the rest of it as
    /// text: its bytes outside the text are the shape's own, and its text holds no quote,
    /// backslash or control byte.
    pub fn read_bytes(&mut self, data: &[u8], mut digest: Option<&mut OutputDigest>) -> EventInfo {
        match self.read_by_shape(data, digest.as_deref_mut()) {
            Some(info) => info,
            None => self.read_whole(&String::from_utf8_lossy(data), digest),
        }
    }

    /// `data` read as an event of the last shape, when it is one.
    fn read_by_shape(&self, data: &[u8], digest: Option<&mut OutputDigest>) -> Option<EventInfo> {
        let shape = self.shape.as_ref()?;
        let text = shape.text_of(data)?;
        if let Some(digest) = digest {
            if !text.is_empty() {
                digest.event(&String::from_utf8_lossy(text));
            }
        }
        let mut info = shape.info.clone();
        info.output = shape.cut.output_without_text || !text.is_empty();
        Some(info)
    }

    /// `data` parsed whole; it becomes the shape the next events are matched against.
    fn read_whole(&mut self, data: &str, digest: Option<&mut OutputDigest>) -> EventInfo {
        let (info, cut) = parse_event(data, digest);
        // An event of another shape (an escaped text, say) keeps the last shape known: the events
        // after it are likely that shape again.
        if let Some(cut) = cut {
            // The shape's buffer is reused: a stream whose events all differ (a usage count in
            // each) copies each event into it, without allocating.
            let shape = self.shape.get_or_insert_with(|| Shape {
                event: String::new(),
                cut,
                info: EventInfo::default(),
            });
            shape.event.clear();
            shape.event.push_str(data);
            shape.cut = cut;
            shape.info.clone_from(&info);
        }
        info
    }
}

/// An event with one choice whose output is a single text field (`text`, or `content` or a
/// reasoning field of the `delta`), and where that text's value lies in it: an event that starts
/// with the same bytes up to the value's opening quote, ends with the same bytes from its closing
/// quote, and holds between them only bytes a JSON string takes unescaped (no quote, backslash or
/// control character) has the same tokens but for that one string, so it reads as `info` with
/// that text.
#[derive(Debug)]
struct Shape {
    event: String,
    cut: TextCut,
    info: EventInfo,
}

/// Where an event's output text lies in it.
#[derive(Debug, Clone, Copy)]
struct TextCut {
    /// The text's first byte (just past its opening quote).
    start: usize,
    /// Just past its last byte (its closing quote).
    end: usize,
    /// The choice carries output whatever its text (a finish reason, tool calls).
    output_without_text: bool,
}

impl TextCut {
    fn of(data: &str, zero: &ChoiceLite<'_>) -> Option<Self> {
        let delta = zero.delta.as_ref();
        let fields = [
            (OutputField::Text, zero.text.as_ref()),
            (OutputField::Content, delta.and_then(|d| d.content.as_ref())),
            (
                OutputField::ReasoningContent,
                delta.and_then(|d| d.reasoning_content.as_ref()),
            ),
            (
                OutputField::Reasoning,
                delta.and_then(|d| d.reasoning.as_ref()),
            ),
        ];
        let (field, value) = fields.iter().find_map(|(f, v)| Some((*f, (*v)?)))?;
        // The other text fields add nothing to the output or its digest.
        if fields
            .iter()
            .any(|(f, v)| *f != field && v.is_some_and(|v| !v.is_empty()))
        {
            return None;
        }
        // Only a value read in place (no escapes) has a place in `data`.
        let Cow::Borrowed(text) = value else {
            return None;
        };
        let start = (text.as_ptr() as usize).checked_sub(data.as_ptr() as usize)?;
        let end = start + text.len();
        let bytes = data.as_bytes();
        if end >= bytes.len() || start == 0 || bytes[start - 1] != b'"' || bytes[end] != b'"' {
            return None;
        }
        Some(Self {
            start,
            end,
            output_without_text: zero.has_output_without(field),
        })
    }
}

impl Shape {
    /// The text of an event of this shape, unescaped as it stands.
    fn text_of<'d>(&self, data: &'d [u8]) -> Option<&'d [u8]> {
        let shape = self.event.as_bytes();
        let text = data
            .strip_prefix(&shape[..self.cut.start])?
            .strip_suffix(&shape[self.cut.end..])?;
        let plain = !text.iter().any(|&b| b == b'"' || b == b'\\' || b < 0x20);
        plain.then_some(text)
    }
}

/// The fields of a choice that carry output text.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum OutputField {
    Text,
    Content,
    ReasoningContent,
    Reasoning,
}

/// Adds the output text of one choice (choice 0) of a stream event to `digest`.
fn digest_choice(digest: &mut OutputDigest, first: &ChoiceLite<'_>) {
    let delta = first.delta.as_ref();
    let text = crate::digest::output_text(
        delta.and_then(|d| d.reasoning_content.as_deref()),
        delta.and_then(|d| d.reasoning.as_deref()),
        delta.and_then(|d| d.content.as_deref()),
        first.text.as_deref(),
    );
    if !text.is_empty() {
        digest.event(&text);
    }
}

/// Latency objectives in ms; an unset one always passes.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Objectives {
    /// Time to first token.
    pub ttft_ms: Option<f64>,
    /// Time per output token after the first.
    pub tpot_ms: Option<f64>,
    /// End to end.
    pub e2e_ms: Option<f64>,
}

impl Objectives {
    /// Whether a completed request with these measurements is good: TTFT and E2E at or under
    /// their bounds, and TPOT too where it is defined (one output token has none).
    pub fn met(&self, ttft_ms: Option<f64>, tpot_ms: Option<f64>, e2e_ms: f64) -> bool {
        self.ttft_ms.is_none_or(|b| ttft_ms.is_some_and(|x| x <= b))
            && self.tpot_ms.is_none_or(|b| tpot_ms.is_none_or(|x| x <= b))
            && self.e2e_ms.is_none_or(|b| e2e_ms <= b)
    }
}

/// What the relay does with one upstream chunk.
#[derive(Debug, Default)]
pub struct Passed {
    /// Bytes to send to the client now (the chunk itself unless an event was cut out or is
    /// still incomplete).
    pub forward: Option<Bytes>,
    /// This chunk held the response's first output.
    pub first_output: bool,
}

/// The measurement of one response, fed every chunk as it is relayed.
#[derive(Debug)]
pub struct ResponseMeter {
    sse: Option<SseParser>,
    events: EventReader,
    strip_usage: bool,
    /// Bytes of an unfinished event, held back until it ends.
    held: BytesMut,
    /// The last event that ended was passed on (not cut out).
    last_kept: bool,
    tail: VecDeque<Bytes>,
    tail_len: usize,
    first_byte: Option<Instant>,
    first_output: Option<Instant>,
    last_output: Option<Instant>,
    end: Option<Instant>,
    itl: Vec<Duration>,
    output_events: u32,
    /// Output events read but not yet handed to the client.
    undelivered: u32,
    usage: Option<Usage>,
    finish_reason: Option<String>,
    error_event: bool,
    done: bool,
    /// The output text's digest, when asked for.
    digest: Option<OutputDigest>,
    /// A non-streamed body, copied while it is small enough to digest.
    body_copy: Option<Vec<u8>>,
}

/// A measured response, relative to the request's arrival.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ResponseTiming {
    /// Arrival to the first response byte.
    pub first_byte: Option<Duration>,
    /// Arrival to the first output-bearing event (non-streamed: to the end).
    pub ttft: Option<Duration>,
    /// Arrival to the last output-bearing event (non-streamed: to the end).
    pub last_output: Option<Duration>,
    /// Arrival to the end of the response.
    pub e2e: Option<Duration>,
    /// Gaps between consecutive output-bearing events.
    pub itl: Vec<Duration>,
    /// Output-bearing events seen (streams).
    pub output_events: u32,
    /// Usage, as the engine reported it.
    pub usage: Option<Usage>,
    /// Finish reason of the (first) choice.
    pub finish_reason: Option<String>,
    /// The stream carried an error event (or an unreadable one).
    pub error_event: bool,
    /// The stream ended with `[DONE]`.
    pub done: bool,
    /// The output's fingerprint, when the meter was asked to digest it.
    pub output: Option<Fingerprint>,
}

impl ResponseTiming {
    /// Forgets the output instants (TTFT, gaps): for an answer that was an error, not output.
    pub fn without_output(&mut self) {
        self.ttft = None;
        self.last_output = None;
        self.itl.clear();
    }

    /// Output tokens: the usage's count, else (streams) the output events.
    pub fn output_tokens(&self) -> u64 {
        self.usage
            .map_or(u64::from(self.output_events), |u| u.completion_tokens)
    }

    /// (last output − first output) / (output tokens − 1), for a stream with two or more output
    /// tokens (a non-streamed answer arrives at once: it has no TPOT).
    pub fn tpot(&self) -> Option<Duration> {
        let n = self.output_tokens();
        let (first, last) = (self.ttft?, self.last_output?);
        (n > 1 && self.output_events > 0)
            .then(|| last.saturating_sub(first).div_f64((n - 1) as f64))
    }
}

impl ResponseMeter {
    /// A meter for a response; `strip_usage` cuts usage-only events out of an SSE stream.
    pub fn new(is_sse: bool, strip_usage: bool) -> Self {
        Self {
            sse: is_sse.then(SseParser::new),
            events: EventReader::new(),
            strip_usage: strip_usage && is_sse,
            held: BytesMut::new(),
            last_kept: true,
            tail: VecDeque::new(),
            tail_len: 0,
            first_byte: None,
            first_output: None,
            last_output: None,
            end: None,
            itl: Vec::new(),
            output_events: 0,
            undelivered: 0,
            usage: None,
            finish_reason: None,
            error_event: false,
            done: false,
            digest: None,
            body_copy: None,
        }
    }

    /// Also digests the output text (for agreement checks); a JSON body is then copied whole,
    /// up to [`MAX_DIGEST_BODY_BYTES`].
    pub fn with_digest(mut self) -> Self {
        self.digest = Some(OutputDigest::new());
        if self.sse.is_none() {
            self.body_copy = Some(Vec::new());
        }
        self
    }

    /// Reads a chunk that arrived at `now` and says what to pass on. The output events it holds
    /// are stamped by [`Self::delivered`], once the proxy has handed them to the client.
    pub fn on_chunk(&mut self, chunk: Bytes, now: Instant) -> Passed {
        self.first_byte.get_or_insert(now);
        let had_output = self.output_events > 0;
        let Some(mut parser) = self.sse.take() else {
            if let Some(copy) = &mut self.body_copy {
                if copy.len() + chunk.len() <= MAX_DIGEST_BODY_BYTES {
                    copy.extend_from_slice(&chunk);
                } else {
                    self.body_copy = None;
                    self.digest = None;
                }
            }
            self.keep_tail(chunk.clone());
            return Passed {
                forward: Some(chunk),
                first_output: false,
            };
        };
        // Whole events only, whether or not usage is cut: a stream the engine breaks off in the
        // middle of an event then ends on an event boundary, where the proxy's error event can
        // follow, instead of glued to half an event.
        let forward = self.whole_events(&mut parser, chunk);
        self.sse = Some(parser);
        Passed {
            forward,
            first_output: !had_output && self.output_events > 0,
        }
    }

    /// The stream ended in the middle of a line, before `[DONE]` or a finish reason: an engine
    /// that frames its answer by closing the connection was cut off, not finished. (Whole lines
    /// of a last event without its blank line are an engine's sloppy ending, not a cut.)
    pub fn broken_off(&self) -> bool {
        self.unfinished()
            && self.held.iter().any(|b| !b.is_ascii_whitespace())
            && !matches!(self.held.last(), Some(b'\n' | b'\r'))
    }

    /// A stream that has neither said `[DONE]` nor given a finish reason: when the engine framed
    /// it by closing the connection, its close cannot say whether it finished, and this says it
    /// did not (an OpenAI-compatible stream ends with one or the other).
    pub fn unfinished(&self) -> bool {
        self.sse.is_some() && !self.done && self.finish_reason.is_none()
    }

    /// Bytes held for an event not finished yet (its line and data so far): bounded by the
    /// longest event, not the stream.
    pub fn buffered(&self) -> usize {
        // The held bytes and the parser's buffer are the same unfinished event, counted once.
        self.sse
            .as_ref()
            .map_or(0, SseParser::buffered)
            .max(self.held.len())
    }

    /// The bytes of the last chunk reached the client's connection at `now`: its output events
    /// happened then, as far as the client can tell (several in one chunk: gaps of zero).
    pub fn delivered(&mut self, now: Instant) {
        for _ in 0..std::mem::take(&mut self.undelivered) {
            if let Some(prev) = self.last_output {
                self.itl.push(now.saturating_duration_since(prev));
            }
            self.first_output.get_or_insert(now);
            self.last_output = Some(now);
        }
    }

    /// Feeds `chunk`, keeping whole events only and, when cutting usage, leaving out usage-only
    /// ones.
    fn whole_events(&mut self, parser: &mut SseParser, chunk: Bytes) -> Option<Bytes> {
        let mut pieces: Vec<Bytes> = Vec::new();
        let mut held = std::mem::take(&mut self.held);
        let mut run: Option<usize> = None;
        let mut start = 0;
        // The last chunk ended an event with `\r` and this one starts with the `\n` of that
        // `\r\n`: the byte belongs to that event, kept or cut with it.
        if held.is_empty() && parser.pending_cr() && chunk.first() == Some(&b'\n') {
            if self.last_kept {
                pieces.push(chunk.slice(0..1));
            }
            start = 1;
        }
        let mut last_kept = self.last_kept;
        parser.feed_with_ends(&chunk, |end, ev| {
            let keep = ev.is_none_or(|e| !(self.on_event(e.data).usage_only && self.strip_usage));
            last_kept = keep;
            if start == 0 && !held.is_empty() {
                let h = std::mem::take(&mut held);
                if keep {
                    pieces.push(h.freeze());
                }
            }
            match (keep, run) {
                (true, None) => run = Some(start),
                (false, Some(s)) => {
                    pieces.push(chunk.slice(s..start));
                    run = None;
                }
                _ => {}
            }
            start = end;
        });
        self.last_kept = last_kept;
        if run == Some(0) && start == chunk.len() && pieces.is_empty() {
            // The usual chunk: whole events, all kept, nothing held before it (nor now).
            self.held = held;
            return Some(chunk);
        }
        if let Some(s) = run {
            pieces.push(chunk.slice(s..start));
        }
        held.extend_from_slice(&chunk[start..]);
        self.held = held;
        match pieces.len() {
            0 => None,
            1 => pieces.pop(),
            _ => {
                let mut joined = BytesMut::with_capacity(pieces.iter().map(Bytes::len).sum());
                for p in pieces {
                    joined.extend_from_slice(&p);
                }
                Some(joined.freeze())
            }
        }
    }

    fn on_event(&mut self, data: &[u8]) -> EventInfo {
        let info = self.events.read_bytes(data, self.digest.as_mut());
        if info.output {
            self.output_events += 1;
            self.undelivered += 1;
        }
        if info.usage.is_some() {
            self.usage = info.usage;
        }
        if self.finish_reason.is_none() {
            self.finish_reason.clone_from(&info.finish_reason);
        }
        self.error_event |= info.error;
        self.done |= info.done;
        info
    }

    fn keep_tail(&mut self, chunk: Bytes) {
        self.tail_len += chunk.len();
        self.tail.push_back(chunk);
        while self
            .tail
            .front()
            .is_some_and(|f| self.tail_len - f.len() >= TAIL_BYTES)
        {
            if let Some(f) = self.tail.pop_front() {
                self.tail_len -= f.len();
            }
        }
    }

    /// The response ended at `now` (`complete`: the upstream finished it, rather than failing or
    /// losing its client): returns any bytes still held back (an unfinished last event, passed on
    /// as it came), and reads a JSON body's usage and finish reason; its first output is its end.
    pub fn finish(&mut self, now: Instant, complete: bool) -> Option<Bytes> {
        if self.end.is_some() {
            return None;
        }
        self.end = Some(now);
        // Events still held back go out now.
        self.delivered(now);
        if self.sse.is_none() {
            let mut body = Vec::with_capacity(self.tail_len);
            for c in &self.tail {
                body.extend_from_slice(c);
            }
            self.usage = json_tail_value::<Usage>(&body, b"\"usage\"");
            self.finish_reason = json_tail_value::<String>(&body, b"\"finish_reason\"");
            if let (Some(digest), Some(copy)) = (&mut self.digest, self.body_copy.take()) {
                match body_output(&copy) {
                    Some(text) => digest.whole(&text),
                    None => self.digest = None,
                }
            }
            if complete && self.first_byte.is_some() {
                self.first_output = Some(now);
                self.last_output = Some(now);
            }
            return None;
        }
        (!self.held.is_empty()).then(|| std::mem::take(&mut self.held).freeze())
    }

    /// The measured timing, relative to `arrival`; the meter is used up.
    pub fn into_timing(self, arrival: Instant) -> ResponseTiming {
        let since = |t: Option<Instant>| t.map(|t| t.saturating_duration_since(arrival));
        ResponseTiming {
            first_byte: since(self.first_byte),
            ttft: since(self.first_output),
            last_output: since(self.last_output),
            e2e: since(self.end),
            itl: self.itl,
            output_events: self.output_events,
            usage: self.usage,
            finish_reason: self.finish_reason,
            error_event: self.error_event,
            done: self.done,
            output: self.digest.as_ref().map(OutputDigest::finish),
        }
    }
}

/// The first choice's output text of a non-streamed body.
fn body_output(body: &[u8]) -> Option<String> {
    let v: serde_json::Value = serde_json::from_slice(body).ok()?;
    Some(crate::digest::choice_text(crate::digest::choice_zero(
        v.get("choices")?,
    )?))
}

/// The value after the last `key` (a quoted JSON key, not inside a string) in `body`.
fn json_tail_value<T: serde::de::DeserializeOwned>(body: &[u8], key: &[u8]) -> Option<T> {
    let mut end = body.len();
    while let Some(at) = find_last(&body[..end], key) {
        end = at;
        if at > 0 && body[at - 1] == b'\\' {
            continue;
        }
        let rest = body[at + key.len()..].trim_ascii_start();
        let Some(value) = rest.strip_prefix(b":") else {
            continue;
        };
        if let Some(Ok(v)) = serde_json::Deserializer::from_slice(value)
            .into_iter::<T>()
            .next()
        {
            return Some(v);
        }
    }
    None
}

fn find_last(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).rposition(|w| w == needle)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn output_events_are_told_from_role_usage_and_done() {
        let role = r#"{"choices":[{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":null}]}"#;
        let text = r#"{"choices":[{"index":0,"delta":{"content":" hi"},"finish_reason":null}]}"#;
        let completion = r#"{"choices":[{"index":0,"text":" hi","finish_reason":null}]}"#;
        let finish = r#"{"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}"#;
        let tools = r#"{"choices":[{"delta":{"tool_calls":[{"index":0}]}}]}"#;
        let reasoning = r#"{"choices":[{"delta":{"reasoning":"hm"}}]}"#;
        let usage = r#"{"choices":[],"usage":{"prompt_tokens":3}}"#;
        let error = r#"{"error":{"message":"x"}}"#;
        for (data, want) in [
            (role, false),
            (text, true),
            (completion, true),
            (finish, true),
            (tools, true),
            (reasoning, true),
            (usage, false),
            (error, false),
            (DONE, false),
            ("not json", false),
            ("", false),
        ] {
            assert_eq!(classify_event(data).output, want, "{data}");
        }
        let u = classify_event(
            r#"{"id":"x","choices":[],"usage":{"prompt_tokens":3,"completion_tokens":7,"total_tokens":10,"prompt_tokens_details":{"cached_tokens":2}}}"#,
        );
        assert!(u.usage_only && !u.output);
        assert_eq!(
            u.usage,
            Some(Usage {
                prompt_tokens: 3,
                completion_tokens: 7,
                cached_tokens: Some(2)
            })
        );
        let f = classify_event(finish);
        assert_eq!(f.finish_reason.as_deref(), Some("stop"));
        assert!(classify_event(error).error && classify_event("nope").error);
        assert!(
            !classify_event("").error,
            "an event without data is no event"
        );
        assert!(classify_event(DONE).done);
    }

    /// Events of the shapes engines send, and odd ones.
    const SHAPES: &[&str] = &[
        r#"{"id":"cmpl-1","object":"text_completion","created":1,"model":"m","choices":[{"index":0,"text":" the","logprobs":null,"finish_reason":null,"stop_reason":null}]}"#,
        r#"{"id":"c","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}]}"#,
        r#"{"id":"c","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,"delta":{"content":" a"},"logprobs":null,"finish_reason":null}]}"#,
        r#"{"id":"c","choices":[{"index":0,"delta":{"content":""},"finish_reason":"stop"}]}"#,
        r#"{"id":"c","choices":[{"index":0,"delta":{"reasoning_content":"hm","content":null}}]}"#,
        r#"{"id":"c","choices":[{"index":0,"delta":{"reasoning":"hm","reasoning_content":""}}]}"#,
        r#"{"id":"c","choices":[{"index":0,"delta":{"content":"","tool_calls":[{"index":0}]}}]}"#,
        r#"{"id":"c","choices":[{"index":0,"delta":{"content":"x"}}],"usage":{"prompt_tokens":3,"completion_tokens":1}}"#,
        r#"{"choices":[{"index":1,"text":"b"}]}"#,
        r#"{"choices":[{"text":"a","index":0},{"index":1,"text":"b"}]}"#,
        r#" { "choices" : [ { "text" : "sp" } ] } "#,
        r#"{"choices":[{"index":0,"text":"a\nb"}]}"#,
        r#"{"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":3}}"#,
        r#"{"error":{"message":"x"},"choices":[{"text":"e"}]}"#,
    ];

    /// The reader's answer and digest for `data` after it has read `before`, against a whole read.
    fn check_reader(before: &[&str], data: &str) {
        let mut reader = EventReader::new();
        for b in before {
            reader.read(b, Some(&mut OutputDigest::new()));
        }
        let (mut fast, mut whole) = (OutputDigest::new(), OutputDigest::new());
        assert_eq!(
            reader.read(data, Some(&mut fast)),
            read_event(data, Some(&mut whole)),
            "{data:?} after {before:?}"
        );
        assert_eq!(fast.finish(), whole.finish(), "{data:?} after {before:?}");
        // Without a digest too.
        assert_eq!(reader.read(data, None), classify_event(data), "{data:?}");
    }

    #[test]
    fn the_event_reader_answers_as_a_whole_read() {
        // Every event after every other, and after itself.
        for before in SHAPES {
            for data in SHAPES {
                check_reader(&[before], data);
            }
        }
        // The text of a known shape replaced by anything: plain, empty, or what a JSON string
        // must escape (read whole then, or refused as JSON is).
        let texts = [
            "",
            " x",
            "é",
            "a b",
            "\\n",
            "\\\"",
            "\\u00e9",
            "\"",
            "\\",
            "a\"}]}",
            "\n",
            "\u{1}",
            "\"}],\"usage\":{\"completion_tokens\":9},\"x\":[{\"a\":\"",
        ];
        for shape in SHAPES {
            for (field, _) in [
                ("\"text\":\"", 0),
                ("\"content\":\"", 0),
                ("\"reasoning\":\"", 0),
            ] {
                let Some(at) = shape.find(field).map(|i| i + field.len()) else {
                    continue;
                };
                let end = at + shape[at..].find('"').unwrap();
                for text in texts {
                    let data = format!("{}{text}{}", &shape[..at], &shape[end..]);
                    check_reader(&[shape], &data);
                }
            }
        }
        // Every byte of every shape changed to a byte that matters to JSON.
        for shape in SHAPES {
            for i in 0..shape.len() {
                for b in [
                    b'"', b'\\', b'\n', b'a', b'}', b']', b',', b':', b' ', b'0', b'{',
                ] {
                    let mut bytes = shape.as_bytes().to_vec();
                    bytes[i] = b;
                    if let Ok(data) = std::str::from_utf8(&bytes) {
                        check_reader(&[shape], data);
                    }
                }
            }
        }
    }

    #[test]
    fn bytes_that_are_not_utf8_read_as_their_replacement_text() {
        // The reader on the stream's bytes answers as a whole read of their text (each invalid
        // sequence read as U+FFFD), whether the bytes fall in a known shape's text or outside it.
        let check = |before: &str, raw: &[u8]| {
            let mut reader = EventReader::new();
            reader.read(before, Some(&mut OutputDigest::new()));
            let text = String::from_utf8_lossy(raw);
            let (mut fast, mut whole) = (OutputDigest::new(), OutputDigest::new());
            assert_eq!(
                reader.read_bytes(raw, Some(&mut fast)),
                read_event(&text, Some(&mut whole)),
                "{text:?} after {before:?}"
            );
            assert_eq!(fast.finish(), whole.finish(), "{text:?} after {before:?}");
            assert_eq!(reader.read_bytes(raw, None), classify_event(&text));
        };
        let invalid: [&[u8]; 5] = [
            b"\xE2\x82",
            b"a\xFFb",
            b"\xC3",
            b"\xF0\x9F\x98",
            b"\xED\xA0\x80",
        ];
        for shape in SHAPES {
            for field in ["\"text\":\"", "\"content\":\""] {
                let Some(at) = shape.find(field).map(|i| i + field.len()) else {
                    continue;
                };
                let end = at + shape[at..].find('"').unwrap();
                for bad in invalid {
                    let mut raw = shape.as_bytes()[..at].to_vec();
                    raw.extend_from_slice(bad);
                    raw.extend_from_slice(&shape.as_bytes()[end..]);
                    check(shape, &raw);
                }
            }
            // Outside the text: a byte of the shape itself.
            for i in 0..shape.len() {
                let mut raw = shape.as_bytes().to_vec();
                raw[i] = 0xFF;
                check(shape, &raw);
            }
        }
    }

    #[test]
    fn the_event_reader_reads_a_stream_by_its_shape() {
        let mut reader = EventReader::new();
        let role = SHAPES[1];
        let text = |t: &str| SHAPES[2].replace("\" a\"", &format!("\"{t}\""));
        assert!(!reader.read(role, None).output);
        // The role chunk's shape (its `content` with other text) is not the text chunks' shape:
        // the first one is read whole and becomes the shape.
        assert!(reader.read(&text(" one"), None).output);
        let shape = reader.shape.as_ref().map(|s| s.cut.start);
        assert!(shape.is_some(), "a text chunk has a shape");
        assert!(reader.read(&text(" two"), None).output);
        assert!(!reader.read(&text(""), None).output);
        // An escaped text is read whole and leaves the shape as it was.
        assert!(reader.read(&text("\\n"), None).output);
        assert_eq!(reader.shape.as_ref().map(|s| s.cut.start), shape);
        let last = reader.read(SHAPES[3], None);
        assert_eq!(last.finish_reason.as_deref(), Some("stop"));
        assert!(last.output);
    }

    #[test]
    fn choices_are_read_whatever_their_shape_and_order() {
        // Absent or null: no choices (a usage chunk some engines send).
        for data in [
            r#"{"usage":{"prompt_tokens":1}}"#,
            r#"{"choices":null,"usage":{"prompt_tokens":1}}"#,
        ] {
            let e = classify_event(data);
            assert!(e.usage_only && !e.output && !e.error, "{data}");
        }
        // Not a list: unreadable, as any malformed event.
        assert!(classify_event(r#"{"choices":{"index":0}}"#).error);
        // Several choices: output and the finish reason come from any of them; the digest reads
        // choice 0 by its index, wherever it stands.
        let two = r#"{"choices":[{"index":1,"text":"b","finish_reason":"length"},{"index":0,"text":"a","finish_reason":null}]}"#;
        let e = classify_event(two);
        assert!(e.output && !e.usage_only);
        assert_eq!(e.finish_reason.as_deref(), Some("length"));
        let mut digest = OutputDigest::new();
        read_event(two, Some(&mut digest));
        let mut only_a = OutputDigest::new();
        only_a.event("a");
        assert_eq!(digest.finish(), only_a.finish());
        // Escaped text is still output.
        assert!(classify_event(r#"{"choices":[{"delta":{"content":"\u00e9\n"}}]}"#).output);
    }

    fn stream(include_usage: bool) -> Vec<u8> {
        let mut out = Vec::new();
        for data in [
            r#"{"id":"a","choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}"#,
            r#"{"id":"a","choices":[{"index":0,"delta":{"content":" one"}}]}"#,
            r#"{"id":"a","choices":[{"index":0,"delta":{"content":" two"}}]}"#,
            r#"{"id":"a","choices":[{"index":0,"delta":{"content":" three"},"finish_reason":"length"}]}"#,
        ] {
            crate::sse::write_data(&mut out, data);
        }
        if include_usage {
            crate::sse::write_data(
                &mut out,
                r#"{"id":"a","choices":[],"usage":{"prompt_tokens":5,"completion_tokens":3,"total_tokens":8}}"#,
            );
        }
        out.extend_from_slice(b": keep-alive\n\n");
        crate::sse::write_data(&mut out, DONE);
        out
    }

    /// Feeds `bytes` cut at `cuts`, one millisecond apart, and returns what reached the client.
    fn relay(bytes: &[u8], cuts: &[usize], strip: bool) -> (Vec<u8>, ResponseTiming) {
        let t0 = Instant::now();
        let mut m = ResponseMeter::new(true, strip);
        let mut out = Vec::new();
        let mut prev = 0;
        let mut firsts = 0;
        for (i, &c) in cuts.iter().chain([bytes.len()].iter()).enumerate() {
            let p = m.on_chunk(
                Bytes::copy_from_slice(&bytes[prev..c]),
                t0 + Duration::from_millis(i as u64 + 1),
            );
            firsts += u32::from(p.first_output);
            out.extend_from_slice(p.forward.as_deref().unwrap_or_default());
            m.delivered(t0 + Duration::from_millis(i as u64 + 1));
            prev = c;
        }
        let end = t0 + Duration::from_millis(cuts.len() as u64 + 2);
        out.extend_from_slice(m.finish(end, true).as_deref().unwrap_or_default());
        assert!(firsts <= 1);
        (out, m.into_timing(t0))
    }

    #[test]
    fn stripping_the_usage_chunk_gives_the_bytes_of_a_stream_without_it_at_every_split() {
        let with = stream(true);
        let without = stream(false);
        for i in 0..=with.len() {
            for j in (i..=with.len()).step_by(7) {
                let (out, t) = relay(&with, &[i, j], true);
                assert_eq!(
                    String::from_utf8_lossy(&out),
                    String::from_utf8_lossy(&without),
                    "split at {i},{j}"
                );
                assert_eq!(t.usage.map(|u| u.completion_tokens), Some(3));
                assert_eq!(t.output_events, 3);
                assert!(t.done && !t.error_event);
                assert_eq!(t.finish_reason.as_deref(), Some("length"));
            }
        }
    }

    #[test]
    fn a_crlf_split_across_chunks_stays_with_its_event() {
        // CRLF framing (not vLLM's, but other engines'), the usage chunk between two kept
        // events; cut at every point, including between the `\r` and `\n` that end an event
        // (found by the `sse` fuzz target: that `\n` went with the next event, cut or kept).
        let kept = b"data: {\"choices\":[{\"text\":\"a\"}]}\r\n\r\n";
        let usage = b"data: {\"choices\":[],\"usage\":{\"prompt_tokens\":1,\"completion_tokens\":1}}\r\n\r\n";
        let last = b"data: [DONE]\r\n\r\n";
        let with: Vec<u8> = [&kept[..], usage, last].concat();
        let without: Vec<u8> = [&kept[..], last].concat();
        for i in 0..=with.len() {
            for j in i..=with.len() {
                let (out, _) = relay(&with, &[i, j], true);
                assert_eq!(
                    String::from_utf8_lossy(&out),
                    String::from_utf8_lossy(&without),
                    "split at {i},{j}"
                );
            }
        }
    }

    #[test]
    fn the_digest_reads_each_output_event_and_a_json_body_whole() {
        let with = stream(true);
        let t0 = Instant::now();
        let mut m = ResponseMeter::new(true, true).with_digest();
        for piece in with.chunks(5) {
            m.on_chunk(Bytes::copy_from_slice(piece), t0);
        }
        m.finish(t0, true);
        let streamed = m.into_timing(t0).output.expect("digested");
        assert_eq!(streamed.bytes, " one two three".len() as u64);
        assert_eq!(streamed.pieces.len(), 3, "one piece per output event");
        let body = br#"{"id":"c","choices":[{"index":0,"message":{"role":"assistant","content":" one two three"},"finish_reason":"length"}],"usage":{"prompt_tokens":5,"completion_tokens":3,"total_tokens":8}}"#;
        let mut j = ResponseMeter::new(false, false).with_digest();
        for piece in body.chunks(9) {
            j.on_chunk(Bytes::copy_from_slice(piece), t0);
        }
        j.finish(t0, true);
        let whole = j.into_timing(t0).output.expect("digested");
        assert!(whole.compare(&streamed).exact);
        // Without asking, nothing is digested.
        let (_, plain) = relay(&with, &[], true);
        assert!(plain.output.is_none());
    }

    #[test]
    fn without_stripping_every_byte_passes_in_whole_events() {
        let with = stream(true);
        for i in 0..=with.len() {
            let (out, t) = relay(&with, &[i], false);
            assert_eq!(out, with, "split at {i}");
            assert_eq!(t.output_tokens(), 3);
        }
        // An event split over two chunks is passed on once it has ended.
        let mut m = ResponseMeter::new(true, false);
        let now = Instant::now();
        let first_event = with.windows(2).position(|w| w == b"\n\n").unwrap() + 2;
        let p = m.on_chunk(Bytes::copy_from_slice(&with[..first_event + 5]), now);
        assert_eq!(p.forward.as_deref(), Some(&with[..first_event]));
        assert!(m.broken_off(), "a stream ending here ends mid-event");
        let p = m.on_chunk(Bytes::copy_from_slice(&with[first_event + 5..]), now);
        assert_eq!(p.forward.as_deref(), Some(&with[first_event..]));
        assert!(!m.broken_off());
    }

    #[test]
    fn a_stream_cut_mid_event_is_told_from_one_that_ended() {
        let with = stream(false);
        let mid = with.windows(6).position(|w| w == b" three").unwrap();
        let mut m = ResponseMeter::new(true, false);
        m.on_chunk(Bytes::copy_from_slice(&with[..mid]), Instant::now());
        assert!(m.broken_off());
        // A trailing line end without a blank line after it is not an unfinished answer once the
        // finish reason or `[DONE]` came.
        let mut m = ResponseMeter::new(true, false);
        m.on_chunk(
            Bytes::copy_from_slice(&with[..with.len() - 1]),
            Instant::now(),
        );
        assert!(!m.broken_off());
        // Nor are whole lines of a last event that lacks its blank line.
        let mut m = ResponseMeter::new(true, false);
        m.on_chunk(
            Bytes::from_static(b"data: {\"choices\":[{\"text\":\"a\"}]}\n"),
            Instant::now(),
        );
        assert!(!m.broken_off());
        // Nor is whitespace left after the last event.
        let mut m = ResponseMeter::new(true, false);
        let mut spaced = with.clone();
        spaced.extend_from_slice(b"\n");
        m.on_chunk(Bytes::from(spaced), Instant::now());
        assert!(!m.broken_off());
    }

    #[test]
    fn timings_follow_the_events() {
        let s = stream(true);
        // One event per chunk: role at 1 ms, outputs at 2, 3, 4 ms.
        let mut cuts = Vec::new();
        let mut p = SseParser::new();
        p.feed_with_ends(&s, |end, _| cuts.push(end));
        cuts.pop();
        let (_, t) = relay(&s, &cuts, true);
        let ms = Duration::from_millis;
        assert_eq!(t.first_byte, Some(ms(1)));
        assert_eq!(t.ttft, Some(ms(2)));
        assert_eq!(t.last_output, Some(ms(4)));
        assert_eq!(t.itl, vec![ms(1), ms(1)]);
        assert_eq!(t.tpot(), Some(ms(1)));
        assert_eq!(t.e2e, Some(ms(cuts.len() as u64 + 2)));
    }

    #[test]
    fn a_json_body_is_measured_from_its_tail() {
        let body = br#"{"id":"c","choices":[{"index":0,"message":{"role":"assistant","content":"say \"usage\": 1 and \"finish_reason\":\"x\""},"finish_reason":"stop"}],"usage":{"prompt_tokens":9,"completion_tokens":4,"total_tokens":13},"prompt_logprobs":null}"#;
        let t0 = Instant::now();
        let mut m = ResponseMeter::new(false, true);
        let mut out = Vec::new();
        for (i, part) in body.chunks(13).enumerate() {
            let p = m.on_chunk(
                Bytes::copy_from_slice(part),
                t0 + Duration::from_millis(i as u64),
            );
            assert!(!p.first_output);
            out.extend_from_slice(&p.forward.unwrap());
        }
        assert!(m.finish(t0 + Duration::from_millis(50), true).is_none());
        assert_eq!(out, body);
        let t = m.into_timing(t0);
        assert_eq!(
            t.usage.map(|u| (u.prompt_tokens, u.completion_tokens)),
            Some((9, 4))
        );
        assert_eq!(t.finish_reason.as_deref(), Some("stop"));
        assert_eq!(t.ttft, Some(Duration::from_millis(50)));
        assert_eq!(t.ttft, t.e2e);
        assert_eq!(t.tpot(), None);
    }

    #[test]
    fn a_long_json_body_keeps_only_a_bounded_tail() {
        let mut m = ResponseMeter::new(false, false);
        let t0 = Instant::now();
        let filler = Bytes::from(vec![b' '; 4096]);
        for _ in 0..100 {
            m.on_chunk(filler.clone(), t0);
        }
        assert!(m.tail_len < TAIL_BYTES + 4096);
        m.on_chunk(
            Bytes::from_static(br#""usage":{"completion_tokens":2}}"#),
            t0,
        );
        m.finish(t0, true);
        assert_eq!(m.into_timing(t0).output_tokens(), 2);
    }
}
