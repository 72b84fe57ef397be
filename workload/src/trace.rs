//! The headroom trace: one JSON object per line, a superset of Mooncake's
//! (`timestamp` ms, `input_length`, `output_length`, `hash_ids`), so public tools replay it and
//! headroom's own captures carry what they measured. Never prompt text. Importers turn Mooncake JSONL,
//! Azure LLM inference CSV and BurstGPT CSV into it. Field reference: docs/trace-format.md.

use std::io::{BufRead, Write};

use serde::{Deserialize, Serialize};

/// Tokens per hash id in Mooncake traces (and the default for headroom's).
pub const MOONCAKE_BLOCK_TOKENS: u32 = 512;

/// One request of a trace.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct TraceRecord {
    /// Arrival, milliseconds from the start of the trace.
    pub timestamp: u64,
    /// Prompt tokens.
    pub input_length: u32,
    /// Output tokens.
    pub output_length: u32,
    /// One id per block of the prompt; equal ids at equal positions after equal parents mean equal
    /// content. `ceil(input_length / block_tokens)` of them.
    #[serde(default)]
    pub hash_ids: Vec<u64>,
    /// Tokens per hash id when not 512.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub block_tokens: Option<u32>,
    /// Conversation or session the request belongs to.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session_id: Option<String>,
    /// Request id (joins client and proxy records).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub request_id: Option<String>,
    /// Model requested.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    /// `chat` or `completions`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub endpoint: Option<String>,
    /// Traffic class (interactive, batch, …).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub class: Option<String>,
    /// Pool the request was routed in.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pool: Option<String>,
    /// Replica that served it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub backend: Option<String>,
    /// HTTP status.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<u16>,
    /// `max_tokens` as requested.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_tokens: Option<u32>,
    /// Streamed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stream: Option<bool>,
    /// Measured time in the proxy's queue, ms.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub queue_ms: Option<f64>,
    /// Measured time to first token, ms.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ttft_ms: Option<f64>,
    /// Time per output token after the first, ms.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tpot_ms: Option<f64>,
    /// Mean inter-token latency, ms.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub itl_mean_ms: Option<f64>,
    /// Median inter-token gap, ms.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub itl_p50_ms: Option<f64>,
    /// 99th-percentile inter-token gap, ms.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub itl_p99_ms: Option<f64>,
    /// Largest inter-token gap, ms.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub itl_max_ms: Option<f64>,
    /// End-to-end latency, ms.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub e2e_ms: Option<f64>,
    /// `stop`, `length`, `abort`, ….
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub finish_reason: Option<String>,
    /// Prompt tokens the engine served from its prefix cache, when it reports them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cached_tokens: Option<u64>,
    /// Prompt tokens the proxy's prefix-aware routing expected the replica it first chose to hold
    /// cached (beside `cached_tokens`, what the engine found: how well the router knows the
    /// caches).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub predicted_cached_tokens: Option<u64>,
    /// Whether it met its class's latency objectives.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub good: Option<bool>,
    /// Set on a shadow copy's record: the candidate pool's answer to a mirrored request (same
    /// `request_id` as the primary's record). Replays skip these records.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shadow: Option<ShadowFields>,
}

/// How a shadow copy's output compared with the primary's.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShadowFields {
    /// Byte-identical outputs (deterministic requests that both completed; else absent).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output_match: Option<bool>,
    /// First output token at which they differ.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub diverged_at: Option<u32>,
    /// Shadow output tokens − primary output tokens.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub length_diff: Option<i64>,
}

impl TraceRecord {
    /// Tokens per hash id.
    pub fn block_tokens(&self) -> u32 {
        self.block_tokens.unwrap_or(MOONCAKE_BLOCK_TOKENS)
    }
}

/// Why a trace could not be read.
#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    /// Reading failed.
    #[error("reading line {line}: {error}")]
    Io {
        /// 1-based line.
        line: usize,
        /// The I/O error (in the message, not a separate source: printed once in an error chain).
        error: std::io::Error,
    },
    /// A line is not a valid record.
    #[error("line {line}: {reason}")]
    Invalid {
        /// 1-based line.
        line: usize,
        /// What is wrong.
        reason: String,
    },
}

/// Reads a headroom or Mooncake JSONL trace. Blank lines are skipped; `hash_ids`, when present,
/// must cover the prompt. Records come back in timestamp order: a capture writes each request
/// when it finishes, so its arrival timestamps are not in file order (the sort is stable).
pub fn read_jsonl(reader: impl BufRead) -> Result<Vec<TraceRecord>, TraceError> {
    let mut out: Vec<TraceRecord> = Vec::new();
    let mut sorted = true;
    for (i, line) in reader.lines().enumerate() {
        let line_no = i + 1;
        let line = line.map_err(|error| TraceError::Io {
            line: line_no,
            error,
        })?;
        // A byte-order mark some editors write before the first line is not part of the JSON.
        let text = if line_no == 1 {
            line.trim_start_matches('\u{feff}')
        } else {
            line.as_str()
        };
        if text.trim().is_empty() {
            continue;
        }
        // serde reads a struct from a JSON array too (its fields in order): a record is an object.
        if !text.trim_start().starts_with('{') {
            return Err(TraceError::Invalid {
                line: line_no,
                reason: "a trace record is a JSON object ({\"timestamp\": …}), one per line".into(),
            });
        }
        let r: TraceRecord = serde_json::from_str(text).map_err(|e| TraceError::Invalid {
            line: line_no,
            // serde's own position is within this line: the column is what it adds.
            reason: e.to_string().replace(" at line 1 column ", " at column "),
        })?;
        if r.block_tokens == Some(0) {
            return Err(TraceError::Invalid {
                line: line_no,
                reason: "block_tokens is 0 (tokens per hash id: at least 1)".into(),
            });
        }
        sorted &= out.last().is_none_or(|p| p.timestamp <= r.timestamp);
        if r.input_length == 0 {
            return Err(TraceError::Invalid {
                line: line_no,
                reason: "input_length is 0".into(),
            });
        }
        let needed = r.input_length.div_ceil(r.block_tokens().max(1)) as usize;
        if !r.hash_ids.is_empty() && r.hash_ids.len() != needed {
            return Err(TraceError::Invalid {
                line: line_no,
                reason: format!(
                    "{} hash_ids for input_length {} at {} tokens per id (expected {needed})",
                    r.hash_ids.len(),
                    r.input_length,
                    r.block_tokens()
                ),
            });
        }
        out.push(r);
    }
    if !sorted {
        out.sort_by_key(|r| r.timestamp);
    }
    Ok(out)
}

/// Writes records as JSONL.
pub fn write_jsonl(mut w: impl Write, records: &[TraceRecord]) -> std::io::Result<()> {
    for r in records {
        serde_json::to_writer(&mut w, r)?;
        w.write_all(b"\n")?;
    }
    w.flush()
}

/// Gives every record without `hash_ids` fresh ids (no sharing), continuing after the largest id
/// in use: sources without prefix information replay as prompts that share nothing.
pub fn fill_unique_hash_ids(records: &mut [TraceRecord]) {
    let mut next = records
        .iter()
        .flat_map(|r| r.hash_ids.iter())
        .max()
        .map_or(0, |m| m + 1);
    for r in records.iter_mut().filter(|r| r.hash_ids.is_empty()) {
        let n = r.input_length.div_ceil(r.block_tokens().max(1));
        r.hash_ids = (next..next + u64::from(n)).collect();
        next += u64::from(n);
    }
}

/// Trace hash ids for a request the proxy saw: one per [`MOONCAKE_BLOCK_TOKENS`] tokens of
/// `input_length`, derived from the prompt's chain of `block_tokens`-token block hashes.
///
/// ```text
/// id_k = key(blocks[512(k+1)/block_tokens − 1])   a full 512-token block the chain covers
///      = key(tail_hash)                           the last, partial block of a fully hashed prompt
///      = key(unique ‖ k)                          beyond what was hashed: shares nothing
/// key(x) = first 53 bits of sha256(id_key ‖ x)    (53 bits: exact as a JSON number everywhere)
/// ```
///
/// A block hash covers everything before it, so two requests get equal ids at position k exactly
/// when their prompts agree up to that block's end: Mooncake's meaning. Keying with a secret
/// `id_key` means nobody can test a guessed prompt against a capture.
pub fn capture_hash_ids(
    blocks: &[u64],
    block_tokens: u32,
    tail_hash: Option<u64>,
    input_length: u32,
    id_key: &[u8],
    unique: u64,
) -> Vec<u64> {
    use sha2::{Digest, Sha256};
    let key = |parts: &[u64]| {
        let mut h = Sha256::new();
        h.update(id_key);
        for p in parts {
            h.update(p.to_le_bytes());
        }
        let d = h.finalize();
        u64::from_le_bytes(d[..8].try_into().unwrap_or_default()) & ((1 << 53) - 1)
    };
    let per = MOONCAKE_BLOCK_TOKENS;
    let n = input_length.div_ceil(per);
    let bt = block_tokens.max(1);
    (0..n)
        .map(|k| {
            let end = (k + 1) * per;
            if end <= input_length && end % bt == 0 {
                if let Some(b) = blocks.get((end / bt) as usize - 1) {
                    return key(&[*b]);
                }
            }
            match tail_hash {
                Some(t) if k + 1 == n && end > input_length => key(&[t, 1]),
                _ => key(&[unique, u64::from(k), 2]),
            }
        })
        .collect()
}

/// Parses `YYYY-MM-DD HH:MM:SS[.fffffff]` into milliseconds since the Unix epoch (UTC).
fn parse_datetime_ms(s: &str) -> Option<f64> {
    let s = s.trim().trim_matches('"');
    let (date, time) = s.split_once([' ', 'T'])?;
    let mut d = date.split('-').map(|x| x.parse::<i64>().ok());
    let (y, m, day) = (d.next()??, d.next()??, d.next()??);
    let mut t = time.trim_end_matches('Z').split(':');
    let (hh, mm) = (
        t.next()?.parse::<i64>().ok()?,
        t.next()?.parse::<i64>().ok()?,
    );
    let ss: f64 = t.next()?.parse().ok()?;
    let month_days = match m {
        1 | 3 | 5 | 7 | 8 | 10 | 12 => 31,
        4 | 6 | 9 | 11 => 30,
        2 if y % 4 == 0 && (y % 100 != 0 || y % 400 == 0) => 29,
        2 => 28,
        _ => return None,
    };
    if !((1..=month_days).contains(&day)
        && (0..24).contains(&hh)
        && (0..60).contains(&mm)
        && (0.0..61.0).contains(&ss))
    {
        return None;
    }
    // Days from the civil date (Howard Hinnant's algorithm).
    let y = if m <= 2 { y - 1 } else { y };
    let era = if y >= 0 { y } else { y - 399 } / 400;
    let yoe = y - era * 400;
    let mp = (m + 9) % 12;
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    Some(((days * 86_400 + hh * 3600 + mm * 60) as f64 + ss) * 1e3)
}

/// Splits a CSV header into column indices by name.
fn columns(header: &[&str], wanted: &[&str]) -> Result<Vec<usize>, TraceError> {
    let names: Vec<String> = header
        .iter()
        .enumerate()
        // A byte-order mark some tools write before the header is not part of the first name.
        .map(|(i, c)| {
            let c = if i == 0 {
                c.trim_start_matches('\u{feff}')
            } else {
                c
            };
            c.trim().to_ascii_lowercase()
        })
        .collect();
    wanted
        .iter()
        .map(|w| {
            names
                .iter()
                .position(|n| n == &w.to_ascii_lowercase())
                .ok_or_else(|| TraceError::Invalid {
                    line: 1,
                    reason: format!("no `{w}` column (have: {})", names.join(", ")),
                })
        })
        .collect()
}

/// One CSV data row: its line number and a field getter by column index.
struct CsvRow<'a> {
    line: usize,
    fields: &'a csv::StringRecord,
}

impl CsvRow<'_> {
    fn get(&self, col: usize) -> &str {
        self.fields.get(col).unwrap_or("").trim()
    }

    fn parse<T: std::str::FromStr>(&self, col: usize, what: &str) -> Result<T, TraceError> {
        self.get(col).parse().map_err(|_| TraceError::Invalid {
            line: self.line,
            reason: format!("bad {what}: {:?}", self.get(col)),
        })
    }
}

/// Reads a CSV (RFC 4180: quoted fields may hold commas and quotes) with a header naming
/// `required` columns (and `optional` ones, when present), calling `row` for every non-blank data
/// line with the column indices found.
fn read_csv(
    reader: impl BufRead,
    required: &[&str],
    optional: &[&str],
    mut row: impl FnMut(&CsvRow<'_>, &[usize], &[Option<usize>]) -> Result<(), TraceError>,
) -> Result<(), TraceError> {
    let mut csv = csv::ReaderBuilder::new()
        .has_headers(false)
        .flexible(true)
        .from_reader(reader);
    let line_of = |r: &csv::StringRecord| r.position().map_or(0, |p| p.line() as usize);
    let invalid = |e: csv::Error| {
        let line = e.position().map_or(0, |p| p.line() as usize);
        match e.into_kind() {
            csv::ErrorKind::Io(error) => TraceError::Io { line, error },
            csv::ErrorKind::Utf8 { .. } => TraceError::Invalid {
                line,
                reason: "not UTF-8 text (a compressed file? decompress it first)".into(),
            },
            other => TraceError::Invalid {
                line,
                reason: format!("{other:?}"),
            },
        }
    };
    let mut records = csv.records();
    let header = match records.next() {
        Some(h) => h.map_err(invalid)?,
        None => return Ok(()),
    };
    let names: Vec<&str> = header.iter().collect();
    let cols = columns(&names, required)?;
    let opt: Vec<Option<usize>> = optional
        .iter()
        .map(|c| columns(&names, &[c]).ok().map(|v| v[0]))
        .collect();
    for record in records {
        let record = record.map_err(invalid)?;
        if record.iter().all(|f| f.trim().is_empty()) {
            continue;
        }
        let r = CsvRow {
            line: line_of(&record),
            fields: &record,
        };
        row(&r, &cols, &opt)?;
    }
    Ok(())
}

/// Imports the Azure LLM inference trace CSV (`TIMESTAMP,ContextTokens,GeneratedTokens`). Azure
/// has no prefix information: every request gets its own hash ids.
pub fn import_azure(reader: impl BufRead) -> Result<Import, TraceError> {
    let mut out = Vec::new();
    let mut arrivals = Vec::new();
    let mut skipped = 0;
    read_csv(
        reader,
        &["TIMESTAMP", "ContextTokens", "GeneratedTokens"],
        &[],
        |r, c, _| {
            let at = parse_datetime_ms(r.get(c[0])).ok_or_else(|| TraceError::Invalid {
                line: r.line,
                reason: format!(
                    "bad TIMESTAMP {:?}: a date and time, YYYY-MM-DD HH:MM:SS[.fraction]",
                    r.get(c[0])
                ),
            })?;
            let input: u32 = r.parse(c[1], "ContextTokens")?;
            let output: u32 = r.parse(c[2], "GeneratedTokens")?;
            if input > 0 {
                arrivals.push(at);
                out.push(TraceRecord {
                    input_length: input,
                    output_length: output,
                    ..TraceRecord::default()
                });
            } else {
                skipped += 1;
            }
            Ok(())
        },
    )?;
    finish_import(&mut out, &arrivals);
    Ok(Import {
        records: out,
        skipped_empty: skipped,
    })
}

/// Imports a BurstGPT CSV (`Timestamp` s, `Session ID`, `Model`, `Request tokens`,
/// `Response tokens`, …). No prefix information: fresh hash ids per request; the session id is kept.
pub fn import_burstgpt(reader: impl BufRead) -> Result<Import, TraceError> {
    let mut out = Vec::new();
    let mut arrivals = Vec::new();
    let mut skipped = 0;
    let required = ["Timestamp", "Model", "Request tokens", "Response tokens"];
    read_csv(reader, &required, &["Session ID"], |r, c, opt| {
        let at: f64 = r.parse(c[0], "Timestamp")?;
        // Seconds from the trace's start; as milliseconds they must fit a trace timestamp.
        if !(at.is_finite() && (0.0..=1e15).contains(&at)) {
            return Err(TraceError::Invalid {
                line: r.line,
                reason: format!(
                    "bad Timestamp {at:?}: seconds from the trace's start, at least 0 and at most 10^15"
                ),
            });
        }
        let input: u32 = r.parse(c[2], "Request tokens")?;
        let output: u32 = r.parse(c[3], "Response tokens")?;
        if input > 0 {
            arrivals.push(at * 1e3);
            out.push(TraceRecord {
                input_length: input,
                output_length: output,
                model: Some(r.get(c[1]).to_owned()).filter(|m| !m.is_empty()),
                session_id: opt[0]
                    .map(|k| r.get(k).to_owned())
                    .filter(|s| !s.is_empty()),
                ..TraceRecord::default()
            });
        } else {
            skipped += 1;
        }
        Ok(())
    })?;
    finish_import(&mut out, &arrivals);
    Ok(Import {
        records: out,
        skipped_empty: skipped,
    })
}

/// What an import read.
#[derive(Debug)]
pub struct Import {
    /// The requests, in arrival order.
    pub records: Vec<TraceRecord>,
    /// Rows left out because their prompt had no tokens (nothing to replay).
    pub skipped_empty: usize,
}

/// The prefix-cache hit rate (hit tokens / prompt tokens) the trace's hash ids imply for a
/// cache of `cache_tokens`, replaying requests in order through an LRU of blocks: a request
/// hits the leading run of its blocks still cached (at most `input_length − 1` tokens, as vLLM
/// always computes the last prompt token), then its blocks become most recently used, its last
/// block most evictable (vLLM frees a request's blocks tail first). A last, partial block is a
/// block of its own length: the same hash id at the same length (a repeated short prompt) hits
/// with its tokens, since an engine with smaller blocks than the trace's shares them too.
pub fn offline_prefix_hit_rate(records: &[TraceRecord], cache_tokens: u64) -> f64 {
    use std::collections::{BTreeMap, HashMap};
    let Some(first) = records.first() else {
        return 0.0;
    };
    let bt = u64::from(first.block_tokens().max(1));
    let capacity = (cache_tokens / bt) as usize;
    let mut last_use: HashMap<u64, u64> = HashMap::new();
    let mut order: BTreeMap<u64, u64> = BTreeMap::new();
    let mut tick = 0u64;
    let (mut queries, mut hits) = (0u64, 0u64);
    for r in records {
        let full = (u64::from(r.input_length) / bt) as usize;
        let partial = u64::from(r.input_length) % bt;
        // (chained key, tokens it covers)
        let mut keys = Vec::with_capacity(full + 1);
        let mut parent = 0x6865_6164_726f_6f6d_u64;
        for id in r.hash_ids.iter().take(full) {
            parent = xxhash_rust::xxh3::xxh3_64_with_seed(&id.to_le_bytes(), parent);
            keys.push((parent, bt));
        }
        if let (true, Some(id)) = (partial > 0, r.hash_ids.get(full)) {
            let mut bytes = id.to_le_bytes().to_vec();
            bytes.extend_from_slice(&partial.to_le_bytes());
            keys.push((
                xxhash_rust::xxh3::xxh3_64_with_seed(&bytes, parent),
                partial,
            ));
        }
        let hit_tokens: u64 = keys
            .iter()
            .take_while(|(k, _)| last_use.contains_key(k))
            .map(|(_, n)| n)
            .sum();
        queries += u64::from(r.input_length);
        hits += hit_tokens.min(u64::from(r.input_length).saturating_sub(1));
        if capacity == 0 {
            continue;
        }
        for (k, _) in keys.iter().rev() {
            tick += 1;
            if let Some(old) = last_use.insert(*k, tick) {
                order.remove(&old);
            }
            order.insert(tick, *k);
        }
        while last_use.len() > capacity {
            if let Some((_, k)) = order.pop_first() {
                last_use.remove(&k);
            }
        }
    }
    if queries == 0 {
        0.0
    } else {
        hits as f64 / queries as f64
    }
}

/// Sets each record's timestamp from its absolute arrival (ms, fractional), with time zero at the
/// earliest row wherever it stood in the file, then sorts and gives out hash ids.
fn finish_import(records: &mut [TraceRecord], arrivals_ms: &[f64]) {
    let t0 = arrivals_ms.iter().copied().fold(f64::INFINITY, f64::min);
    for (r, at) in records.iter_mut().zip(arrivals_ms) {
        r.timestamp = (at - t0).max(0.0).round() as u64;
    }
    records.sort_by_key(|r| r.timestamp);
    fill_unique_hash_ids(records);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mooncake_lines_round_trip_and_extras_are_omitted_when_absent() {
        let line =
            r#"{"timestamp": 27, "input_length": 600, "output_length": 5, "hash_ids": [0, 46]}"#;
        let recs = read_jsonl(line.as_bytes()).unwrap();
        assert_eq!(recs[0].hash_ids, vec![0, 46]);
        let mut out = Vec::new();
        write_jsonl(&mut out, &recs).unwrap();
        assert_eq!(
            String::from_utf8(out).unwrap(),
            "{\"timestamp\":27,\"input_length\":600,\"output_length\":5,\"hash_ids\":[0,46]}\n"
        );
    }

    #[test]
    fn bad_lines_are_named() {
        let out_of_order = read_jsonl("{\"timestamp\":5,\"input_length\":1,\"output_length\":1}\n{\"timestamp\":4,\"input_length\":2,\"output_length\":1}".as_bytes()).unwrap();
        assert_eq!(
            out_of_order
                .iter()
                .map(|r| r.input_length)
                .collect::<Vec<_>>(),
            vec![2, 1],
            "completion-ordered captures read back in arrival order"
        );
        let err = read_jsonl(
            "{\"timestamp\":1,\"input_length\":1000,\"output_length\":1,\"hash_ids\":[1]}"
                .as_bytes(),
        )
        .unwrap_err();
        assert!(err.to_string().contains("expected 2"), "{err}");
        let err = read_jsonl("not json".as_bytes()).unwrap_err();
        assert!(err.to_string().starts_with("line 1:"), "{err}");
        // An array has the fields in order, but a record is an object.
        let one = "{\"timestamp\":0,\"input_length\":10,\"output_length\":5}\n";
        let err = read_jsonl(format!("{one}[1,2,3]\n").as_bytes()).unwrap_err();
        assert!(
            err.to_string()
                .starts_with("line 2: a trace record is a JSON object"),
            "{err}"
        );
        let err = read_jsonl(
            "{\"timestamp\":0,\"input_length\":10,\"output_length\":5,\"block_tokens\":0}"
                .as_bytes(),
        )
        .unwrap_err();
        assert!(err.to_string().contains("block_tokens is 0"), "{err}");
        let err = read_jsonl("{\"timestamp\":0,\"input_length\":-1}".as_bytes()).unwrap_err();
        assert!(!err.to_string().contains("line 1 column"), "{err}");
        // A byte-order mark before the first line is read past.
        assert_eq!(
            read_jsonl(format!("\u{feff}{one}").as_bytes())
                .unwrap()
                .len(),
            1
        );
    }

    #[test]
    fn azure_csv_imports_relative_ms_and_unique_ids() {
        let csv = "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,374,44\n2023-11-16 18:15:50.9951690,1025,109\n";
        let recs = import_azure(csv.as_bytes()).unwrap().records;
        assert_eq!(recs.len(), 2);
        assert_eq!(recs[0].timestamp, 0);
        assert_eq!(recs[1].timestamp, 4315);
        assert_eq!(recs[0].hash_ids, vec![0]);
        assert_eq!(recs[1].hash_ids, vec![1, 2, 3]);
        assert!(
            import_azure("a,b\n".as_bytes())
                .unwrap_err()
                .to_string()
                .contains("no `TIMESTAMP` column")
        );
        for bad in [
            "2023-13-45 18:16:00.0",
            "2023-02-29 10:00:00",
            "2023-11-16 24:00:00",
        ] {
            let csv = format!("TIMESTAMP,ContextTokens,GeneratedTokens\n{bad},10,5\n");
            let err = import_azure(csv.as_bytes()).unwrap_err().to_string();
            assert!(err.contains("bad TIMESTAMP") && err.contains(bad), "{err}");
        }
        let leap = "TIMESTAMP,ContextTokens,GeneratedTokens\n2024-02-29 10:00:00,10,5\n";
        assert_eq!(import_azure(leap.as_bytes()).unwrap().records.len(), 1);
    }

    #[test]
    fn csv_fields_may_be_quoted_and_the_header_may_start_with_a_bom() {
        let csv = "\u{feff}Timestamp,Model,Request tokens,Response tokens\n0,\"GPT-4, turbo\",10,5\n1,\"say \"\"hi\"\"\",\"20\",5\n";
        let recs = import_burstgpt(csv.as_bytes()).unwrap().records;
        assert_eq!(recs[0].model.as_deref(), Some("GPT-4, turbo"));
        assert_eq!(recs[1].model.as_deref(), Some("say \"hi\""));
        assert_eq!(recs[1].input_length, 20);
        let err =
            import_burstgpt("Timestamp,Model,Request tokens,Response tokens\n0,m,x,5\n".as_bytes())
                .unwrap_err()
                .to_string();
        assert_eq!(err, "line 2: bad Request tokens: \"x\"");
    }

    #[test]
    fn burstgpt_timestamps_must_be_seconds_from_the_start() {
        for bad in ["-5", "nan", "inf", "1e300"] {
            let csv =
                format!("Timestamp,Model,Request tokens,Response tokens\n0,m,10,5\n{bad},m,10,5\n");
            let err = import_burstgpt(csv.as_bytes()).unwrap_err().to_string();
            assert!(err.starts_with("line 3: bad Timestamp"), "{bad}: {err}");
        }
    }

    #[test]
    fn burstgpt_csv_keeps_sessions_and_models() {
        let csv = "Timestamp,Session ID,Elapsed time,Model,Request tokens,Response tokens,Total tokens,Log Type\n5,s1,1.2,ChatGPT,100,20,120,Conversation log\n7.5,s1,0.9,ChatGPT,0,0,0,Conversation log\n9,s2,2.0,GPT-4,700,50,750,API log\n";
        let import = import_burstgpt(csv.as_bytes()).unwrap();
        assert_eq!(
            import.skipped_empty, 1,
            "zero-token rows are skipped, and counted"
        );
        let recs = import.records;
        assert_eq!(recs.len(), 2);
        assert_eq!((recs[0].timestamp, recs[1].timestamp), (0, 4000));
        assert_eq!(recs[1].session_id.as_deref(), Some("s2"));
        assert_eq!(recs[1].model.as_deref(), Some("GPT-4"));
        assert_eq!(recs[1].hash_ids.len(), 2);
    }

    #[test]
    fn offline_hit_rate_follows_shared_prefixes_and_cache_size() {
        let r = |ids: Vec<u64>| TraceRecord {
            input_length: 512 * ids.len() as u32,
            output_length: 1,
            hash_ids: ids,
            ..TraceRecord::default()
        };
        let trace = vec![r(vec![1, 2]), r(vec![1, 2]), r(vec![1, 3])];
        // Second: 1023 of 1024 (capped); third: block 1 of 2. Queries 3 × 1024.
        let expected = (1023.0 + 512.0) / 3072.0;
        assert!((offline_prefix_hit_rate(&trace, 1 << 20) - expected).abs() < 1e-9);
        assert_eq!(offline_prefix_hit_rate(&trace, 0), 0.0);
        // Room for one block: the second request's block 1 survives (block 2 goes first).
        let one = offline_prefix_hit_rate(&trace, 512);
        assert!((one - (512.0 + 512.0) / 3072.0).abs() < 1e-9, "{one}");
    }

    #[test]
    fn a_repeated_partial_block_hits_with_its_own_tokens() {
        let r = |len: u32, ids: Vec<u64>| TraceRecord {
            input_length: len,
            output_length: 1,
            hash_ids: ids,
            ..TraceRecord::default()
        };
        // A short prompt repeated: 399 of its 400 tokens hit from the second on.
        let same: Vec<_> = (0..100).map(|_| r(400, vec![7])).collect();
        let rate = offline_prefix_hit_rate(&same, 1 << 20);
        assert!((rate - 99.0 * 399.0 / 40_000.0).abs() < 1e-9, "{rate}");
        // The same id at another length is other content: no hit on it. A longer prompt whose
        // full blocks match hits them, and its own partial block only when repeated.
        let trace = vec![r(700, vec![1, 2]), r(600, vec![1, 2]), r(700, vec![1, 2])];
        let rate = offline_prefix_hit_rate(&trace, 1 << 20);
        assert!((rate - (512.0 + 699.0) / 2000.0).abs() < 1e-9, "{rate}");
    }

    #[test]
    fn csv_time_zero_is_the_earliest_row() {
        let csv = "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:50.0,10,1\n2023-11-16 18:15:46.0,10,1\n";
        let recs = import_azure(csv.as_bytes()).unwrap().records;
        assert_eq!((recs[0].timestamp, recs[1].timestamp), (0, 4000));
    }

    #[test]
    fn civil_dates_convert() {
        assert_eq!(parse_datetime_ms("1970-01-01 00:00:01.5"), Some(1500.0));
        assert_eq!(
            parse_datetime_ms("2023-11-16 18:15:46"),
            Some(1_700_158_546_000.0)
        );
    }

    #[test]
    fn capture_ids_share_exactly_the_shared_512_token_prefix() {
        use crate::inspect::{Endpoint, InspectConfig, inspect};
        let cfg = InspectConfig::default();
        let words = |seed: u64, n: usize| -> String {
            (0..n)
                .map(|i| crate::words::spaced_word(seed * 1_000_003 + i as u64))
                .collect()
        };
        // Completion prompts: BOS + text, so 1 + n tokens.
        let shared = words(1, 1023);
        let prompts = [
            format!("{shared}{}", words(2, 300)),
            format!("{shared}{}", words(3, 300)),
            format!("{}{}", words(4, 511), words(2, 812)),
        ];
        let ids: Vec<Vec<u64>> = prompts
            .iter()
            .enumerate()
            .map(|(i, p)| {
                let body = serde_json::json!({"model": "m", "prompt": p}).to_string();
                let r = inspect(Endpoint::Completions, body.as_bytes(), &cfg).unwrap();
                assert_eq!(r.prompt_tokens, 1324);
                capture_hash_ids(&r.blocks, 16, r.tail_hash, r.prompt_tokens, b"k", i as u64)
            })
            .collect();
        assert!(ids.iter().all(|v| v.len() == 3));
        assert_eq!(ids[0][..2], ids[1][..2]);
        assert_ne!(ids[0][2], ids[1][2]);
        assert_ne!(ids[0][0], ids[2][0]);
        assert!(ids.iter().flatten().all(|&id| id < 1 << 53));
        // Another key gives unrelated ids; beyond the hashed part ids are unique per request.
        let other = capture_hash_ids(&[7; 64], 16, None, 1100, b"other", 0);
        assert_ne!(
            other[0],
            capture_hash_ids(&[7; 64], 16, None, 1100, b"k", 0)[0]
        );
        assert_ne!(
            other[2],
            capture_hash_ids(&[7; 64], 16, None, 1100, b"other", 1)[2]
        );
        assert_eq!(
            other[1],
            capture_hash_ids(&[7; 64], 16, None, 1100, b"other", 1)[1]
        );
    }
}
