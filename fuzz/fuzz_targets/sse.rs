//! The SSE parser and the response meter on bytes from a replica: no panic, and the same events
//! and the same bytes to the client however the stream is cut into chunks.
#![no_main]

use std::time::Instant;

use bytes::Bytes;
use headroom_workload::measure::ResponseMeter;
use headroom_workload::sse::SseParser;
use libfuzzer_sys::fuzz_target;

/// Chunk boundaries from the input's first bytes; the rest is the stream.
fn split(data: &[u8]) -> (Vec<usize>, &[u8]) {
    let n = usize::from(data.first().copied().unwrap_or(0) % 8);
    let cuts_end = (1 + n).min(data.len());
    let stream = &data[cuts_end..];
    let mut cuts: Vec<usize> = data[1.min(data.len())..cuts_end]
        .iter()
        .map(|b| usize::from(*b) * stream.len() / 256)
        .collect();
    cuts.sort_unstable();
    (cuts, stream)
}

fn chunks<'a>(stream: &'a [u8], cuts: &[usize]) -> Vec<&'a [u8]> {
    let mut out = Vec::new();
    let mut start = 0;
    for &c in cuts {
        out.push(&stream[start..c]);
        start = c;
    }
    out.push(&stream[start..]);
    out
}

fn events(pieces: &[&[u8]]) -> Vec<(Option<String>, String)> {
    let mut p = SseParser::new();
    let mut out = Vec::new();
    for piece in pieces {
        p.feed(piece, |e| out.push((e.event.clone(), e.data.clone())));
        // Bounded by the input: the parser holds the stream's own bytes, never more.
        assert!(p.buffered() <= pieces.iter().map(|x| x.len()).sum::<usize>());
    }
    out
}

fn relayed(pieces: &[&[u8]], strip: bool) -> Vec<u8> {
    let now = Instant::now();
    let mut m = ResponseMeter::new(true, strip);
    let mut out = Vec::new();
    for piece in pieces {
        if let Some(b) = m.on_chunk(Bytes::copy_from_slice(piece), now).forward {
            out.extend_from_slice(&b);
        }
        m.delivered(now);
    }
    if let Some(b) = m.finish(now, true) {
        out.extend_from_slice(&b);
    }
    out
}

fuzz_target!(|data: &[u8]| {
    let (cuts, stream) = split(data);
    let pieces = chunks(stream, &cuts);
    assert_eq!(events(&[stream]), events(&pieces));
    // Without usage stripping the client gets exactly the replica's bytes.
    assert_eq!(relayed(&pieces, false), stream);
    assert_eq!(relayed(&[stream], true), relayed(&pieces, true));
});
