//! Output agreement without keeping the text: a response's output is reduced, as it passes, to a
//! hash of the whole and a short hash per streamed event, and two such digests are compared.
//!
//! ```text
//! exact match  = whole-text hashes equal and byte lengths equal           (xxh3-64 over the text)
//! diverged at  = index of the first event whose 32-bit piece hashes differ  (streams only)
//!                (vLLM sends one token per event by default, so this is a token position)
//! length diff  = shadow output tokens − primary output tokens             (from usage)
//! ```
//!
//! | parameter | value | why |
//! |---|---|---|
//! | piece hash | 32 bits of xxh3 | 4 bytes per token kept until the other side finishes |
//! | pieces kept | [`MAX_PIECES`] | bounds memory for very long outputs; past it only the whole hash |
//! | compared text | choice 0's `content`, `reasoning_content`/`reasoning`, or `text` | tool calls are not compared |
//!
//! Only requests whose sampling is deterministic (temperature 0 or a fixed seed) are compared: any
//! other pair may differ and still both be right.

use serde::{Deserialize, Serialize};
use xxhash_rust::xxh3::{Xxh3, xxh3_64};

/// Piece hashes kept per response (a 16k-token answer: 64 KiB).
pub const MAX_PIECES: usize = 16_384;

/// Accumulates one response's output text.
#[derive(Clone, Default)]
pub struct OutputDigest {
    whole: Xxh3,
    bytes: u64,
    pieces: Vec<u32>,
}

impl std::fmt::Debug for OutputDigest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OutputDigest")
            .field("bytes", &self.bytes)
            .field("pieces", &self.pieces.len())
            .finish_non_exhaustive()
    }
}

/// A finished digest: what is kept of a response's output.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Fingerprint {
    /// xxh3-64 of the whole output text.
    pub hash: u64,
    /// Its length in bytes.
    pub bytes: u64,
    /// 32-bit hash of each streamed output event's text, in order (empty for a JSON body, or
    /// truncated at [`MAX_PIECES`]).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub pieces: Vec<u32>,
}

/// How two fingerprints of the same deterministic request compare.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Comparison {
    /// Byte-identical outputs.
    pub exact: bool,
    /// First output event (token) that differs; `None` when exact, or when the difference lies
    /// where no pieces were kept (a JSON body, or past [`MAX_PIECES`]).
    pub diverged_at: Option<u32>,
}

impl OutputDigest {
    /// An empty digest.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds one streamed output event's text.
    pub fn event(&mut self, text: &str) {
        self.add(text);
        if self.pieces.len() < MAX_PIECES {
            self.pieces.push(xxh3_64(text.as_bytes()) as u32);
        }
    }

    /// Adds text that came in one piece (a JSON body's content).
    pub fn whole(&mut self, text: &str) {
        self.add(text);
    }

    fn add(&mut self, text: &str) {
        self.whole.update(text.as_bytes());
        self.bytes += text.len() as u64;
    }

    /// The fingerprint of the text seen so far.
    pub fn finish(&self) -> Fingerprint {
        Fingerprint {
            hash: self.whole.digest(),
            bytes: self.bytes,
            pieces: self.pieces.clone(),
        }
    }
}

/// The choice with `index` 0 of a `choices` array (a choice without an index counts as 0): with
/// `n > 1` an engine may send the choices in any order, so the first by position need not be it.
pub fn choice_zero(choices: &serde_json::Value) -> Option<&serde_json::Value> {
    choices.as_array()?.iter().find(|c| {
        c.get("index")
            .and_then(serde_json::Value::as_u64)
            .unwrap_or(0)
            == 0
    })
}

/// A choice's output text, as a JSON value: of `delta` in a stream chunk, of `message` in a whole
/// body ([`output_text`]).
pub fn choice_text(choice: &serde_json::Value) -> String {
    fn field<'a>(v: Option<&'a serde_json::Value>, k: &str) -> Option<&'a str> {
        v.and_then(|v| v.get(k)).and_then(serde_json::Value::as_str)
    }
    let inner = choice.get("delta").or_else(|| choice.get("message"));
    output_text(
        field(inner, "reasoning_content"),
        field(inner, "reasoning"),
        field(inner, "content"),
        field(Some(choice), "text"),
    )
}

/// The output text of one choice from its fields, in the order an engine produces it: the
/// reasoning, then the content, then a completion's `text`. Engines name the reasoning
/// `reasoning_content` or `reasoning` (some send both): one of them counts.
pub fn output_text(
    reasoning_content: Option<&str>,
    reasoning: Option<&str>,
    content: Option<&str>,
    text: Option<&str>,
) -> String {
    let reasoning = reasoning_content.filter(|r| !r.is_empty()).or(reasoning);
    [reasoning, content, text].into_iter().flatten().collect()
}

impl Fingerprint {
    /// Compares `self` (the reference) with `other`.
    pub fn compare(&self, other: &Self) -> Comparison {
        let exact = self.hash == other.hash && self.bytes == other.bytes;
        if exact {
            return Comparison {
                exact,
                diverged_at: None,
            };
        }
        // A side without pieces (a JSON body) cannot say where the texts part.
        if self.pieces.is_empty() || other.pieces.is_empty() {
            return Comparison {
                exact,
                diverged_at: None,
            };
        }
        let common = self.pieces.len().min(other.pieces.len());
        let first_differing = self
            .pieces
            .iter()
            .zip(&other.pieces)
            .position(|(a, b)| a != b);
        let diverged_at = match first_differing {
            Some(i) => Some(i),
            // Identical as far as both go and one is longer: they part where the shorter ends
            // (unless that is where pieces stopped being kept).
            None if self.pieces.len() != other.pieces.len() => {
                (common < MAX_PIECES).then_some(common)
            }
            // Pieces equal throughout but the texts differ: a collision of the short hashes; the
            // position is unknown.
            None => None,
        };
        Comparison {
            exact,
            diverged_at: diverged_at.map(|i| u32::try_from(i).unwrap_or(u32::MAX)),
        }
    }

    /// The fingerprint as a compact string for result files: `hash:bytes:pieces`, the whole
    /// hash in hex, then 16 bits of each piece as four hex digits (a file's pieces only locate a
    /// divergence; the whole hash decides a match). Compare decoded fingerprints with each other.
    pub fn encode(&self) -> String {
        let mut s = format!("{:016x}:{}:", self.hash, self.bytes);
        for p in &self.pieces {
            s.push_str(&format!("{:04x}", p & 0xffff));
        }
        s
    }

    /// Reads [`Self::encode`]'s form.
    pub fn decode(s: &str) -> Result<Self, String> {
        let bad = || {
            format!(
                "not an output fingerprint: `{}`",
                s.chars().take(40).collect::<String>()
            )
        };
        let mut parts = s.splitn(3, ':');
        let hash = u64::from_str_radix(parts.next().ok_or_else(bad)?, 16).map_err(|_| bad())?;
        let bytes = parts.next().ok_or_else(bad)?.parse().map_err(|_| bad())?;
        let list = parts.next().ok_or_else(bad)?;
        if list.len() % 4 != 0 || !list.is_ascii() {
            return Err(bad());
        }
        let pieces = (0..list.len())
            .step_by(4)
            .map(|i| u32::from_str_radix(&list[i..i + 4], 16).map_err(|_| bad()))
            .collect::<Result<_, _>>()?;
        Ok(Self {
            hash,
            bytes,
            pieces,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn streamed(words: &[&str]) -> Fingerprint {
        let mut d = OutputDigest::new();
        for w in words {
            d.event(w);
        }
        d.finish()
    }

    #[test]
    fn choice_zero_is_found_by_index_not_position() {
        let v: serde_json::Value =
            serde_json::from_str(r#"[{"index":1,"text":" second"},{"index":0,"text":" first"}]"#)
                .unwrap();
        assert_eq!(choice_text(choice_zero(&v).unwrap()), " first");
        let unindexed: serde_json::Value = serde_json::from_str(r#"[{"text":" only"}]"#).unwrap();
        assert_eq!(choice_text(choice_zero(&unindexed).unwrap()), " only");
        let other: serde_json::Value =
            serde_json::from_str(r#"[{"index":2,"text":" x"}]"#).unwrap();
        assert!(choice_zero(&other).is_none());
        assert!(choice_zero(&serde_json::json!([])).is_none());
    }

    #[test]
    fn equal_streams_match_and_chunking_does_not_change_the_whole_hash() {
        let a = streamed(&[" the", " cat", " sat"]);
        let b = streamed(&[" the", " cat", " sat"]);
        assert_eq!(
            a.compare(&b),
            Comparison {
                exact: true,
                diverged_at: None
            }
        );
        let mut whole = OutputDigest::new();
        whole.whole(" the cat sat");
        let w = whole.finish();
        assert_eq!((w.hash, w.bytes), (a.hash, a.bytes));
        assert!(w.compare(&a).exact);
    }

    #[test]
    fn the_first_differing_event_is_the_divergence() {
        let a = streamed(&[" the", " cat", " sat", " down"]);
        let b = streamed(&[" the", " cat", " ran", " down"]);
        assert_eq!(a.compare(&b).diverged_at, Some(2));
        assert!(!a.compare(&b).exact);
        // One is a prefix of the other: they part where the shorter ends.
        let short = streamed(&[" the", " cat"]);
        assert_eq!(a.compare(&short).diverged_at, Some(2));
        assert_eq!(short.compare(&a).diverged_at, Some(2));
        // A difference in the first event.
        assert_eq!(
            streamed(&[" a"]).compare(&streamed(&[" b"])).diverged_at,
            Some(0)
        );
    }

    #[test]
    fn a_side_without_pieces_has_no_divergence_position() {
        let mut json = OutputDigest::new();
        json.whole(" the dog");
        let c = json.finish().compare(&streamed(&[" the", " cat"]));
        assert_eq!((c.exact, c.diverged_at), (false, None));
    }

    #[test]
    fn json_bodies_compare_whole() {
        let mut a = OutputDigest::new();
        a.whole("yes");
        let mut b = OutputDigest::new();
        b.whole("no");
        assert_eq!(
            a.finish().compare(&b.finish()),
            Comparison {
                exact: false,
                diverged_at: None
            }
        );
    }

    #[test]
    fn encoding_round_trips_and_rejects_garbage() {
        let a = streamed(&[" the", " cat"]);
        let decoded = Fingerprint::decode(&a.encode()).unwrap();
        assert_eq!((decoded.hash, decoded.bytes), (a.hash, a.bytes));
        assert_eq!(decoded.pieces[1], a.pieces[1] & 0xffff);
        let b = Fingerprint::decode(&streamed(&[" the", " dog"]).encode()).unwrap();
        assert_eq!(decoded.compare(&b).diverged_at, Some(1));
        let mut w = OutputDigest::new();
        w.whole("x");
        let w = w.finish();
        assert_eq!(Fingerprint::decode(&w.encode()).unwrap(), w);
        assert!(Fingerprint::decode("zz:1:").is_err());
        assert!(Fingerprint::decode("12").is_err());
        assert!(Fingerprint::decode("12:3:q").is_err());
        assert!(Fingerprint::decode("12:3:abcde").is_err());
    }

    #[test]
    fn choice_text_reads_deltas_messages_and_completions() {
        let t = |v: serde_json::Value| choice_text(&v);
        assert_eq!(t(serde_json::json!({"delta": {"content": " hi"}})), " hi");
        assert_eq!(
            t(serde_json::json!({"message": {"reasoning_content": "hm", "content": "yes"}})),
            "hmyes"
        );
        assert_eq!(t(serde_json::json!({"text": " x", "index": 0})), " x");
        assert_eq!(t(serde_json::json!({"delta": {"role": "assistant"}})), "");
    }
}
