//! Server-sent events: a writer for `data:` events and an incremental parser that keeps only the
//! current unfinished line and event, never the whole stream.
//!
//! The parser follows the WHATWG event-stream rules that matter for LLM streams: lines end in
//! `\n`, `\r\n` or `\r` (a `\r\n` split across two chunks is still one line end), a blank line
//! dispatches the event, several `data:` lines join with `\n`, one space after the colon is dropped,
//! `:` lines are comments, and an event with no data is not dispatched.

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

    /// The event as text: bytes that are not UTF-8 read as U+FFFD, as a browser's `EventSource`
    /// reads them.
    fn set_from(&mut self, raw: &RawEvent<'_>) {
        self.data.clear();
        self.data.push_str(&String::from_utf8_lossy(raw.data));
        self.event = raw.event.map(|e| String::from_utf8_lossy(e).into_owned());
        self.id = raw.id.map(|i| String::from_utf8_lossy(i).into_owned());
    }
}

/// One dispatched event as the stream carried it, lent by the parser: its data not yet read as
/// text (an event that came whole in one chunk is that chunk's own bytes, not a copy).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RawEvent<'a> {
    /// The `data:` lines joined with `\n`.
    pub data: &'a [u8],
    /// The `event:` field, when one was given.
    pub event: Option<&'a [u8]>,
    /// The `id:` field, when one was given.
    pub id: Option<&'a [u8]>,
}

/// Incremental SSE parser. Feed it bytes as they arrive; it returns the events they complete.
#[derive(Debug, Default)]
pub struct SseParser {
    line: Vec<u8>,
    /// The previous chunk ended in `\r`: a `\n` at the start of the next one belongs to it.
    after_cr: bool,
    /// The data of the event being read, once it is not (or no longer) a slice of one chunk.
    data: Vec<u8>,
    /// The data of the event being read is `chunk[start..end]` of the chunk being fed (its one
    /// data line so far came whole in it): nothing copied unless the event goes on.
    borrowed: Option<(usize, usize)>,
    event: Option<Vec<u8>>,
    id: Option<Vec<u8>>,
    has_data: bool,
    /// The text form [`Self::feed`] lends, its buffers reused from event to event.
    text: SseEvent,
}

impl SseParser {
    /// A parser at the start of a stream.
    pub fn new() -> Self {
        Self::default()
    }

    /// Parses `chunk`, calling `on_event` for each event it completes, read as text. The event
    /// is lent: the parser reuses its buffers for the next one (clone it to keep it).
    pub fn feed(&mut self, chunk: &[u8], mut on_event: impl FnMut(&SseEvent)) {
        let mut text = std::mem::take(&mut self.text);
        self.feed_with_ends(chunk, |_, ev| {
            if let Some(ev) = ev {
                text.set_from(&ev);
                on_event(&text);
            }
        });
        if text.data.capacity() > KEPT_EVENT_CAPACITY {
            text.data = String::new();
        }
        self.text = text;
    }

    /// Parses `chunk`, calling `on_end(offset, event)` at every blank line, the end of an event
    /// in the byte stream: `offset` is where the next event starts in `chunk`, and `event` is the
    /// one dispatched there (`None` for a blank line after comments or nothing), as bytes.
    pub fn feed_with_ends(
        &mut self,
        chunk: &[u8],
        mut on_end: impl FnMut(usize, Option<RawEvent<'_>>),
    ) {
        // An empty chunk says nothing about what follows a `\r` that ended the last one.
        if chunk.is_empty() {
            return;
        }
        let mut at = 0;
        if self.after_cr {
            self.after_cr = false;
            if chunk[0] == b'\n' {
                at = 1;
            }
        }
        while let Some(i) = memchr::memchr2(b'\n', b'\r', &chunk[at..]) {
            let (piece_start, piece_end) = (at, at + i);
            at = piece_end + 1;
            if chunk[piece_end] == b'\r' {
                match chunk.get(at) {
                    Some(b'\n') => at += 1,
                    None => self.after_cr = true,
                    _ => {}
                }
            }
            let end = if self.line.is_empty() {
                self.process_line(chunk, piece_start, piece_end, true)
            } else {
                self.line.extend_from_slice(&chunk[piece_start..piece_end]);
                let line = std::mem::take(&mut self.line);
                let end = self.process_line(&line, 0, line.len(), false);
                // The line buffer is kept for the next split line, unless a long one grew it.
                if line.capacity() <= KEPT_EVENT_CAPACITY {
                    self.line = line;
                    self.line.clear();
                }
                end
            };
            match end {
                LineEnd::Field => {}
                LineEnd::Blank => on_end(at, None),
                LineEnd::Dispatch => {
                    let data = match self.borrowed {
                        Some((s, e)) => &chunk[s..e],
                        None => &self.data[..],
                    };
                    let event = RawEvent {
                        data,
                        event: self.event.as_deref(),
                        id: self.id.as_deref(),
                    };
                    on_end(at, Some(event));
                    self.clear_pending();
                }
            }
        }
        // An event that goes on past this chunk keeps its data line.
        self.own_data(chunk);
        self.line.extend_from_slice(&chunk[at..]);
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
        self.line.len() + self.data.len()
    }

    /// Copies the event's data out of the chunk it lies in, when it is still a slice of it.
    fn own_data(&mut self, chunk: &[u8]) {
        if let Some((s, e)) = self.borrowed.take() {
            self.data.extend_from_slice(&chunk[s..e]);
        }
    }

    /// Forgets the event being read, keeping its buffer unless one unusually long event grew it
    /// (a stream should not hold that for the rest of its life).
    fn clear_pending(&mut self) {
        if self.data.capacity() > KEPT_EVENT_CAPACITY {
            self.data = Vec::new();
        }
        self.data.clear();
        self.borrowed = None;
        self.event = None;
        self.id = None;
        self.has_data = false;
    }

    /// Processes the line `src[start..end]`: `src` is the chunk being fed when the line lies
    /// whole in it (`in_chunk`), else the line buffer.
    fn process_line(&mut self, src: &[u8], start: usize, end: usize, in_chunk: bool) -> LineEnd {
        let line = &src[start..end];
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
        let (field, value_start) = match memchr::memchr(b':', line) {
            Some(i) if line.get(i + 1) == Some(&b' ') => (&line[..i], start + i + 2),
            Some(i) => (&line[..i], start + i + 1),
            None => (line, end),
        };
        match field {
            b"data" => {
                if self.has_data {
                    // Data lent from the chunk is only ever set in this call, after the line
                    // buffer's one line (the first of a call): `src` is then the chunk.
                    debug_assert!(in_chunk || self.borrowed.is_none());
                    self.own_data(src);
                    self.data.push(b'\n');
                    self.data.extend_from_slice(&src[value_start..end]);
                } else if in_chunk {
                    self.borrowed = Some((value_start, end));
                } else {
                    self.data.extend_from_slice(&src[value_start..end]);
                }
                self.has_data = true;
            }
            b"event" => self.event = Some(src[value_start..end].to_vec()),
            b"id" => self.id = Some(src[value_start..end].to_vec()),
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

    /// `stream` cut in three anywhere gives the events `whole`: empty chunks included (i == j),
    /// as after a `\r` that ended the chunk before (found by the `sse` fuzz target: an empty
    /// chunk used to forget that `\r`).
    fn same_at_every_split(stream: &[u8], whole: &[SseEvent]) {
        for i in 0..=stream.len() {
            for j in i..=stream.len() {
                let parts = [&stream[..i], &stream[i..j], &stream[j..]];
                assert_eq!(parse_all(&parts), whole, "split at {i},{j}");
            }
        }
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
        same_at_every_split(stream, &whole);
    }

    #[test]
    fn bytes_that_are_not_utf8_read_as_replacement_characters_wherever_cut() {
        // Each line's invalid sequence is one U+FFFD, as if every line were read as text alone.
        let stream = b"event: e\xFF\ndata: a\xE2\x82\ndata: \xAC b\n\ndata: \xC3\n\n";
        let whole = parse_all(&[stream]);
        assert_eq!(data(&whole), vec!["a\u{FFFD}\n\u{FFFD} b", "\u{FFFD}"]);
        assert_eq!(whole[0].event.as_deref(), Some("e\u{FFFD}"));
        same_at_every_split(stream, &whole);
    }

    #[test]
    fn an_event_whole_in_its_chunk_is_lent_from_it() {
        let mut p = SseParser::new();
        let chunk = b"data: {\"a\":1}\n\ndata: two\ndata: lines\n\ndata: open";
        let mut seen = Vec::new();
        p.feed_with_ends(chunk, |end, ev| {
            let ev = ev.expect("data events only");
            let lent = chunk.as_ptr_range().contains(&ev.data.as_ptr());
            seen.push((end, ev.data.to_vec(), lent));
        });
        assert_eq!(
            seen,
            vec![
                (15, b"{\"a\":1}".to_vec(), true),
                (38, b"two\nlines".to_vec(), false),
            ]
        );
        // The open event's line waits in the line buffer; its end dispatches it.
        assert_eq!(p.buffered(), 10);
        assert_eq!(data(&p.feed_collect(b"\n\n")), vec!["open"]);
        assert_eq!(p.buffered(), 0);
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
        assert!(p.data.capacity() <= KEPT_EVENT_CAPACITY);
        assert!(p.text.data.capacity() <= KEPT_EVENT_CAPACITY);
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
