//! Server-sent events: a writer for `data:` events and an incremental parser that keeps only the
//! current unfinished line and event, never the whole stream.
//!
//! The parser follows the WHATWG event-stream rules that matter for LLM streams: lines end in
//! `\n`, `\r\n` or `\r` (a `\r\n` split across two chunks is still one line end), a blank line
//! dispatches the event, several `data:` lines join with `\n`, one space after the colon is dropped,
//! `:` lines are comments, and an event with no data is not dispatched.

use std::borrow::Cow;

/// Bytes of event (and line) buffer a parser keeps between events; a longer one's is let go.
const KEPT_EVENT_CAPACITY: usize = 16 * 1024;

/// The payload that ends an OpenAI-compatible stream.
/// Whether a `Content-Type` value is an SSE stream's (`text/event-stream`, in any case, with or
/// without parameters).
pub fn is_event_stream(content_type: &str) -> bool {
    content_type
        .get(..17)
        .is_some_and(|t| t.eq_ignore_ascii_case("text/event-stream"))
}

pub const DONE: &str = "[DONE]";

/// Appends one `data:` event to `out`. `data` must not contain a line break (JSON never does).
pub fn write_data(out: &mut Vec<u8>, data: &str) {
    debug_assert!(!data.contains(['\n', '\r']), "SSE data with a line break");
    out.extend_from_slice(b"data: ");
    out.extend_from_slice(data.as_bytes());
    out.extend_from_slice(b"\n\n");
}

/// One dispatched event.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct SseEvent {
    /// The `event:` field, when one was given.
    pub event: Option<String>,
    /// The `data:` lines joined with `\n`.
    pub data: String,
    /// The `id:` field, when one was given.
    pub id: Option<String>,
}

impl SseEvent {
    /// Whether this is the `[DONE]` sentinel.
    pub fn is_done(&self) -> bool {
        self.data == DONE
    }
}

/// Incremental SSE parser. Feed it bytes as they arrive; it returns the events they complete.
#[derive(Debug, Default)]
pub struct SseParser {
    line: Vec<u8>,
    /// The previous chunk ended in `\r`: a `\n` at the start of the next one belongs to it.
    after_cr: bool,
    pending: SseEvent,
    has_data: bool,
}

impl SseParser {
    /// A parser at the start of a stream.
    pub fn new() -> Self {
        Self::default()
    }

    /// Parses `chunk`, calling `on_event` for each event it completes. The event is lent: the
    /// parser reuses its buffers for the next one (clone it to keep it).
    pub fn feed(&mut self, chunk: &[u8], mut on_event: impl FnMut(&SseEvent)) {
        self.feed_with_ends(chunk, |_, ev| {
            if let Some(ev) = ev {
                on_event(ev);
            }
        });
    }

    /// Parses `chunk`, calling `on_end(offset, event)` at every blank line, the end of an event
    /// in the byte stream: `offset` is where the next event starts in `chunk`, and `event` is the
    /// one dispatched there (`None` for a blank line after comments or nothing).
    pub fn feed_with_ends(
        &mut self,
        chunk: &[u8],
        mut on_end: impl FnMut(usize, Option<&SseEvent>),
    ) {
        let mut rest = chunk;
        // An empty chunk says nothing about what follows a `\r` that ended the last one.
        if chunk.is_empty() {
            return;
        }
        if self.after_cr {
            self.after_cr = false;
            if let [b'\n', tail @ ..] = rest {
                rest = tail;
            }
        }
        while let Some(i) = memchr::memchr2(b'\n', b'\r', rest) {
            let line_end = rest[i];
            let piece = &rest[..i];
            rest = &rest[i + 1..];
            if line_end == b'\r' {
                match rest.first() {
                    Some(b'\n') => rest = &rest[1..],
                    None => self.after_cr = true,
                    _ => {}
                }
            }
            let offset = chunk.len() - rest.len();
            let end = if self.line.is_empty() {
                self.process_line(piece)
            } else {
                self.line.extend_from_slice(piece);
                let line = std::mem::take(&mut self.line);
                let end = self.process_line(&line);
                // The line buffer is kept for the next split line, unless a long one grew it.
                if line.capacity() <= KEPT_EVENT_CAPACITY {
                    self.line = line;
                    self.line.clear();
                }
                end
            };
            match end {
                LineEnd::Field => {}
                LineEnd::Blank => on_end(offset, None),
                LineEnd::Dispatch => {
                    on_end(offset, Some(&self.pending));
                    self.clear_pending();
                }
            }
        }
        self.line.extend_from_slice(rest);
    }

    /// Convenience for tests and tools: parse `chunk` and collect its events.
    pub fn feed_collect(&mut self, chunk: &[u8]) -> Vec<SseEvent> {
        let mut out = Vec::new();
        self.feed(chunk, |e| out.push(e.clone()));
        out
    }

    /// The last chunk ended in `\r`: a `\n` starting the next one completes that line end (and
    /// is skipped by the parser).
    pub fn pending_cr(&self) -> bool {
        self.after_cr
    }

    /// Bytes held while waiting for a line end (bounded by the longest line, not the stream).
    pub fn buffered(&self) -> usize {
        self.line.len() + self.pending.data.len()
    }

    /// Forgets the event being read, keeping its buffer unless one unusually long event grew it
    /// (a stream should not hold that for the rest of its life).
    fn clear_pending(&mut self) {
        if self.pending.data.capacity() > KEPT_EVENT_CAPACITY {
            self.pending.data = String::new();
        }
        self.pending.data.clear();
        self.pending.event = None;
        self.pending.id = None;
        self.has_data = false;
    }

    /// Processes one line.
    fn process_line(&mut self, line: &[u8]) -> LineEnd {
        if line.is_empty() {
            if self.has_data {
                return LineEnd::Dispatch;
            }
            self.clear_pending();
            return LineEnd::Blank;
        }
        if line[0] == b':' {
            return LineEnd::Field;
        }
        let (field, value) = match memchr::memchr(b':', line) {
            Some(i) => {
                let v = &line[i + 1..];
                (&line[..i], v.strip_prefix(b" ").unwrap_or(v))
            }
            None => (line, &b""[..]),
        };
        // Valid UTF-8 (every JSON payload) is checked by the fast path and borrowed.
        let value = match std::str::from_utf8(value) {
            Ok(v) => Cow::Borrowed(v),
            Err(_) => String::from_utf8_lossy(value),
        };
        match field {
            b"data" => {
                if self.has_data {
                    self.pending.data.push('\n');
                }
                self.pending.data.push_str(&value);
                self.has_data = true;
            }
            b"event" => self.pending.event = Some(value.into_owned()),
            b"id" => self.pending.id = Some(value.into_owned()),
            _ => {}
        }
        LineEnd::Field
    }
}

/// What a line did.
enum LineEnd {
    /// A field or a comment: the event goes on.
    Field,
    /// A blank line with no data before it: nothing dispatched.
    Blank,
    /// A blank line after data: the pending event is dispatched.
    Dispatch,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse_all(chunks: &[&[u8]]) -> Vec<SseEvent> {
        let mut p = SseParser::new();
        chunks.iter().flat_map(|c| p.feed_collect(c)).collect()
    }

    fn data(events: &[SseEvent]) -> Vec<&str> {
        events.iter().map(|e| e.data.as_str()).collect()
    }

    #[test]
    fn writer_output_parses_back() {
        let mut out = Vec::new();
        write_data(&mut out, r#"{"a":1}"#);
        write_data(&mut out, DONE);
        assert_eq!(out, b"data: {\"a\":1}\n\ndata: [DONE]\n\n");
        let events = parse_all(&[&out]);
        assert_eq!(data(&events), vec![r#"{"a":1}"#, "[DONE]"]);
        assert!(events[1].is_done());
    }

    #[test]
    fn every_split_point_gives_the_same_events() {
        let stream = b"data: one\r\n\r\n: comment\n\nevent: x\ndata: two\ndata: lines\r\rdata:three\n\nid: 9\n\ndata: a\r\ndata: b\n\n";
        let whole = parse_all(&[stream]);
        assert_eq!(data(&whole), vec!["one", "two\nlines", "three", "a\nb"]);
        assert_eq!(whole[1].event.as_deref(), Some("x"));
        // The parser reuses its buffers: nothing of one event carries into the next, and an id
        // on an event without data is dropped with it.
        assert_eq!(
            (whole[2].event.as_deref(), whole[2].id.as_deref()),
            (None, None)
        );
        assert_eq!(
            (whole[3].event.as_deref(), whole[3].id.as_deref()),
            (None, None)
        );
        // Empty chunks included (i == j), as after a `\r` that ended the chunk before (found by
        // the `sse` fuzz target: an empty chunk used to forget that `\r`).
        for i in 0..=stream.len() {
            for j in i..=stream.len() {
                let parts = [&stream[..i], &stream[i..j], &stream[j..]];
                assert_eq!(parse_all(&parts), whole, "split at {i},{j}");
            }
        }
    }

    #[test]
    fn byte_at_a_time_keeps_only_the_open_line() {
        let mut p = SseParser::new();
        let mut n = 0;
        for _ in 0..1000 {
            for b in b"data: {\"x\":\"0123456789\"}\n\n" {
                p.feed(std::slice::from_ref(b), |_| n += 1);
                assert!(p.buffered() < 64);
            }
        }
        assert_eq!(n, 1000);
    }

    #[test]
    fn a_long_event_does_not_keep_its_buffer() {
        let mut p = SseParser::new();
        let long = format!("data: {}\n\n", "x".repeat(100_000));
        assert_eq!(p.feed_collect(long.as_bytes())[0].data.len(), 100_000);
        assert!(p.pending.data.capacity() <= KEPT_EVENT_CAPACITY);
        // The same event split across chunks goes through the line buffer.
        let (head, tail) = long.as_bytes().split_at(50_000);
        assert!(p.feed_collect(head).is_empty());
        assert_eq!(p.feed_collect(tail)[0].data.len(), 100_000);
        assert!(p.line.capacity() <= KEPT_EVENT_CAPACITY);
        assert_eq!(data(&p.feed_collect(b"data: short\n\n")), vec!["short"]);
    }

    #[test]
    fn unterminated_event_is_not_dispatched() {
        assert!(parse_all(&[b"data: partial"]).is_empty());
        assert!(parse_all(&[b"data: partial\n"]).is_empty());
    }
}
