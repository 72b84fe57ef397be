//! The headroom text tokenizer: deterministic, documented, dependency-free, so that a prompt's token
//! count is the same in the simulator, the proxy and the load generator.
//!
//! It stands in for a real model's BPE tokenizer where none is available (the simulator). Rules,
//! applied left to right over the text; each rule yields one token:
//!
//! | rule | piece | example (tokens shown between `|`) |
//! |---|---|---|
//! | special | `<|` + `[a-z0-9_]+` + `|>` | `|<|eot_id|>|` |
//! | word | an optional single space, then a run of alphanumeric characters, cut every 8 characters | `| hello| internat|ionaliza|tion|` |
//! | symbol | an optional single space, then one other non-space character | `|,| !|` |
//! | space | a run of whitespace; when it is followed by a word or symbol and ends in a plain space, that last space goes to the next token instead | `|\n\n|`, `|  | x|` |
//!
//! Consequences a load generator can rely on: every word of [`crate::words::WORDS`] written as
//! `" word"` is exactly one token, so `n` such words are exactly `n` tokens.
//!
//! Token ids: specials have fixed ids from 128000 (as Llama 3 numbers them); every other piece gets
//! `FIRST_ORDINARY_ID + xxh3_64(piece) mod ORDINARY_ID_COUNT`, so equal text gives equal ids.

use xxhash_rust::xxh3::xxh3_64;

/// Vocabulary size reported by the tokenizer (Llama 3's).
pub const VOCAB_SIZE: u32 = 128_256;
/// Longest run of alphanumeric characters in one token.
pub const MAX_WORD_CHARS: usize = 8;
const FIRST_ORDINARY_ID: u32 = 256;
const ORDINARY_ID_COUNT: u32 = 128_000 - FIRST_ORDINARY_ID;

/// Special tokens with the ids Llama 3 gives them; any other `<|name|>` hashes into 128010..128256.
const SPECIALS: &[(&str, u32)] = &[
    ("<|begin_of_text|>", 128_000),
    ("<|end_of_text|>", 128_001),
    ("<|start_header_id|>", 128_006),
    ("<|end_header_id|>", 128_007),
    ("<|eom_id|>", 128_008),
    ("<|eot_id|>", 128_009),
];

/// The deterministic tokenizer. Stateless; a unit struct so call sites read as a tokenizer.
#[derive(Debug, Clone, Copy, Default)]
pub struct Tokenizer;

impl Tokenizer {
    /// Token ids of `text`.
    pub fn encode(&self, text: &str) -> Vec<u32> {
        let mut ids = Vec::with_capacity(text.len() / 4 + 1);
        for_each_piece(text, |piece| ids.push(piece_id(piece)));
        ids
    }

    /// Number of tokens in `text`, without allocating the ids.
    pub fn count(&self, text: &str) -> usize {
        let mut n = 0;
        for_each_piece(text, |_| n += 1);
        n
    }

    /// The pieces of `text`, one string per token (for `/tokenize` and for tests).
    pub fn pieces<'a>(&self, text: &'a str) -> Vec<&'a str> {
        let mut out = Vec::new();
        for_each_piece(text, |p| out.push(p));
        out
    }
}

/// The id of one piece produced by the rules above.
pub fn piece_id(piece: &str) -> u32 {
    // Every special starts with `<|`: an ordinary piece skips the lookups.
    if piece.starts_with("<|") {
        if let Some(&(_, id)) = SPECIALS.iter().find(|(s, _)| *s == piece) {
            return id;
        }
        if is_special(piece.as_bytes()).is_some() {
            return 128_010 + (xxh3_64(piece.as_bytes()) % 246) as u32;
        }
    }
    FIRST_ORDINARY_ID + (xxh3_64(piece.as_bytes()) % u64::from(ORDINARY_ID_COUNT)) as u32
}

/// Length in bytes of a special token at the start of `b`, if there is one.
fn is_special(b: &[u8]) -> Option<usize> {
    if b.len() < 5 || &b[..2] != b"<|" {
        return None;
    }
    let mut i = 2;
    while i < b.len() && (b[i].is_ascii_lowercase() || b[i].is_ascii_digit() || b[i] == b'_') {
        i += 1;
    }
    (i > 2 && i + 1 < b.len() && &b[i..i + 2] == b"|>").then_some(i + 2)
}

// The rules scan bytes where the text is ASCII (an ASCII byte is its own char, classified by a
// table that agrees with the `char` methods; note that `char::is_whitespace` counts `\x0b`, which
// `u8::is_ascii_whitespace` does not) and decode a char only where it is not; the tests hold this
// to the rules as first written, char by char. Positions are byte offsets into `text`, always on
// char boundaries.
fn for_each_piece<'a>(text: &'a str, mut emit: impl FnMut(&'a str)) {
    let bytes = text.as_bytes();
    let mut pos = 0;
    while pos < bytes.len() {
        if let Some(len) = is_special(&bytes[pos..]) {
            emit(&text[pos..pos + len]);
            pos += len;
            continue;
        }
        let end = whitespace_end(text, pos);
        if end > pos {
            // A whitespace run: does a word or symbol follow it?
            let followed = end < bytes.len() && is_special(&bytes[end..]).is_none();
            if followed && bytes[end - 1] == b' ' {
                if end - 1 > pos {
                    emit(&text[pos..end - 1]);
                }
                // The run's last space is taken by the word/symbol rule.
                let stop = word_or_symbol_end(text, end);
                emit(&text[end - 1..stop]);
                pos = stop;
            } else {
                emit(&text[pos..end]);
                pos = end;
            }
            continue;
        }
        let stop = word_or_symbol_end(text, pos);
        emit(&text[pos..stop]);
        pos = stop;
    }
}

/// How the rules see an ASCII byte; any byte from 0x80 up starts or continues a multi-byte char.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Class {
    Space,
    AlphaNum,
    Other,
    NonAscii,
}

const CLASS: [Class; 256] = {
    let mut t = [Class::Other; 256];
    let mut b = 0;
    while b < 256 {
        let c = b as u8;
        t[b] = if c >= 0x80 {
            Class::NonAscii
        } else if c == b' ' || (c >= b'\t' && c <= b'\r') {
            Class::Space
        } else if c.is_ascii_alphanumeric() {
            Class::AlphaNum
        } else {
            Class::Other
        };
        b += 1;
    }
    t
};

/// The char starting at byte `i` of `s` (on a boundary, in range) and its length in bytes.
fn decode_at(s: &str, i: usize) -> (char, usize) {
    let c = s[i..].chars().next().expect("in range, on a boundary");
    (c, c.len_utf8())
}

/// The end of the run of whitespace starting at byte `pos` (`pos` itself when there is none).
fn whitespace_end(s: &str, mut pos: usize) -> usize {
    let bytes = s.as_bytes();
    while pos < bytes.len() {
        match CLASS[usize::from(bytes[pos])] {
            Class::Space => pos += 1,
            Class::NonAscii => match decode_at(s, pos) {
                (c, n) if c.is_whitespace() => pos += n,
                _ => break,
            },
            _ => break,
        }
    }
    pos
}

/// The end of the word or symbol token whose first char (not whitespace) starts at byte `pos`:
/// one symbol char, or up to [`MAX_WORD_CHARS`] alphanumeric chars.
fn word_or_symbol_end(s: &str, pos: usize) -> usize {
    let Some(first) = alphanumeric_len(s, pos) else {
        return match s.as_bytes().get(pos) {
            None => s.len(),
            Some(&b) if b.is_ascii() => pos + 1,
            Some(_) => pos + decode_at(s, pos).1,
        };
    };
    let mut end = pos + first;
    for _ in 1..MAX_WORD_CHARS {
        match alphanumeric_len(s, end) {
            Some(n) => end += n,
            None => break,
        }
    }
    end
}

/// The length in bytes of the char at byte `i` of `s` when it is alphanumeric.
fn alphanumeric_len(s: &str, i: usize) -> Option<usize> {
    let &b = s.as_bytes().get(i)?;
    match CLASS[usize::from(b)] {
        Class::AlphaNum => Some(1),
        Class::NonAscii => match decode_at(s, i) {
            (c, n) if c.is_alphanumeric() => Some(n),
            _ => None,
        },
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // The rules as first written, char by char: the byte-scanning version must cut every text
    // exactly as this does.
    fn reference_pieces<'a>(text: &'a str, mut emit: impl FnMut(&'a str)) {
        let bytes = text.as_bytes();
        let mut pos = 0;
        while pos < text.len() {
            let rest = &text[pos..];
            if let Some(len) = is_special(&bytes[pos..]) {
                emit(&rest[..len]);
                pos += len;
                continue;
            }
            let Some(first) = rest.chars().next() else {
                break;
            };
            if first.is_whitespace() {
                // The whitespace run, then whether the next char starts a word or symbol.
                let mut end = rest.len();
                for (i, c) in rest.char_indices() {
                    if !c.is_whitespace() {
                        end = i;
                        break;
                    }
                }
                let followed = end < rest.len() && is_special(&bytes[pos + end..]).is_none();
                if followed && rest.as_bytes()[end - 1] == b' ' {
                    if end > 1 {
                        emit(&rest[..end - 1]);
                    }
                    pos += end - 1;
                    // The remaining single space is taken by the word/symbol rule below.
                    let len = reference_word_or_symbol(&rest[end - 1..], true);
                    emit(&rest[end - 1..end - 1 + len]);
                    pos += len;
                } else {
                    emit(&rest[..end]);
                    pos += end;
                }
                continue;
            }
            let len = reference_word_or_symbol(rest, false);
            emit(&rest[..len]);
            pos += len;
        }
    }

    // Byte length of the word or symbol token at the start of `s` (which starts with one space when
    // `leading_space`).
    fn reference_word_or_symbol(s: &str, leading_space: bool) -> usize {
        let start = usize::from(leading_space);
        let body = &s[start..];
        let mut it = body.char_indices();
        let Some((_, c0)) = it.next() else {
            return s.len();
        };
        if !c0.is_alphanumeric() {
            return start + c0.len_utf8();
        }
        let mut end = c0.len_utf8();
        for (i, c) in it.take(MAX_WORD_CHARS - 1) {
            if !c.is_alphanumeric() {
                break;
            }
            end = i + c.len_utf8();
        }
        start + end
    }

    #[test]
    fn byte_scanning_cuts_as_the_char_by_char_rules_do() {
        let alphabet: Vec<char> =
            "ab Z09 \t\n\r\x0b\x0c.,!-_<|>é😀\u{3000}\u{a0}\u{85}\u{2028}ß中x"
                .chars()
                .collect();
        let mut x = 0x9E37_79B9_7F4A_7C15u64;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        let fixed = [
            "<|eot_id|>",
            "<|a_1|>",
            "<|",
            "|>",
            "aaaaaaaaaaaaaaaaa",
            "   ",
        ];
        for _ in 0..20_000 {
            let len = (next() % 40) as usize;
            let mut text = String::new();
            while text.chars().count() < len {
                if next() % 8 == 0 {
                    text.push_str(fixed[(next() % fixed.len() as u64) as usize]);
                } else {
                    text.push(alphabet[(next() % alphabet.len() as u64) as usize]);
                }
            }
            let mut expected = Vec::new();
            reference_pieces(&text, |p| expected.push(p));
            assert_eq!(Tokenizer.pieces(&text), expected, "{text:?}");
        }
    }

    fn pieces(s: &str) -> Vec<&str> {
        Tokenizer.pieces(s)
    }

    #[test]
    fn words_take_their_leading_space() {
        assert_eq!(
            pieces("Hello world, again!"),
            vec!["Hello", " world", ",", " again", "!"]
        );
    }

    #[test]
    fn long_words_are_cut_every_eight_chars() {
        assert_eq!(
            pieces(" internationalization"),
            vec![" internat", "ionaliza", "tion"]
        );
    }

    #[test]
    fn whitespace_runs_give_their_last_space_away() {
        assert_eq!(pieces("a  b"), vec!["a", " ", " b"]);
        assert_eq!(pieces("a\n\nb"), vec!["a", "\n\n", "b"]);
        assert_eq!(pieces("a \n b "), vec!["a", " \n", " b", " "]);
        assert_eq!(pieces("  "), vec!["  "]);
    }

    #[test]
    fn specials_are_single_tokens_even_after_spaces() {
        assert_eq!(
            pieces("<|begin_of_text|>hi <|eot_id|>"),
            vec!["<|begin_of_text|>", "hi", " ", "<|eot_id|>"]
        );
        assert_eq!(Tokenizer.encode("<|eot_id|>"), vec![128_009]);
        // Not a special: uppercase inside.
        assert_eq!(pieces("<|X|>"), vec!["<", "|", "X", "|", ">"]);
    }

    #[test]
    fn unicode_is_handled_per_char() {
        assert_eq!(pieces("héllo 😀!"), vec!["héllo", " 😀", "!"]);
    }

    #[test]
    fn pieces_cover_the_text_exactly() {
        let samples = [
            "The quick brown fox\tjumps  over\n\n\nthe lazy dog. ",
            " \u{3000}x<|eot_id|> <|nope",
            "",
            "<|",
            "1234567890123 --- ok",
        ];
        for s in samples {
            assert_eq!(pieces(s).concat(), s, "{s:?}");
            assert_eq!(Tokenizer.count(s), pieces(s).len());
            assert_eq!(Tokenizer.encode(s).len(), pieces(s).len());
        }
    }

    #[test]
    fn ids_are_stable_and_in_range() {
        let a = Tokenizer.encode("stable ids across runs");
        assert_eq!(a, Tokenizer.encode("stable ids across runs"));
        assert!(a.iter().all(|&id| id < VOCAB_SIZE));
        assert!(
            a.iter()
                .all(|&id| (FIRST_ORDINARY_ID..128_000).contains(&id))
        );
    }
}
