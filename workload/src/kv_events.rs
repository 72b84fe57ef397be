//! vLLM's KV cache event wire format: the msgpack payload of one engine step's batch, encoded (for
//! the simulator's publisher) and decoded (for the proxy's subscriber).
//!
//! | part | format |
//! |---|---|
//! | message | ZMQ multipart `[topic, seq (u64 big-endian, from 0 per engine process), payload]` |
//! | payload | msgpack `[ts (float, Unix seconds), [event, …], dp_rank]` (`dp_rank` may be absent) |
//! | event (0.33) | map tagged `"type"`: `BlockStored{block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, lora_name, …}`, `BlockRemoved{block_hashes, medium, …}`, `AllBlocksCleared{}`; fields at their default may be omitted, unknown fields are ignored |
//! | event (≤ 0.11, positional) | `["BlockStored", hashes, parent, tokens, block_size, lora_id, medium]`, `["BlockRemoved", hashes, medium]`, `["AllBlocksCleared"]` |
//! | hash | unsigned integer (`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1`, the default: the low 64 bits of the big-endian digest) or the digest's bytes (then their last 8 bytes, big-endian, give the same integer) |
//!
//! Events on a medium other than the GPU (CPU offload tiers) are decoded and marked, so an index of
//! what a replica can serve from its GPU cache skips them.

use rmpv::ValueRef;

use crate::blocks::BlockHash;

/// A KV cache event as vLLM publishes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KvEvent {
    /// Consecutive blocks of one request became full and cached.
    BlockStored {
        /// Hashes of the new blocks, in order.
        block_hashes: Vec<BlockHash>,
        /// Hash of the block before the first one, if any.
        parent_block_hash: Option<BlockHash>,
        /// Token ids of all the new blocks.
        token_ids: Vec<u32>,
        /// Tokens per block.
        block_size: u32,
    },
    /// Cached blocks were evicted.
    BlockRemoved {
        /// Hashes of the evicted blocks.
        block_hashes: Vec<BlockHash>,
    },
    /// The whole prefix cache was reset.
    AllBlocksCleared,
}

/// One step's events, as decoded.
#[derive(Debug, Clone, PartialEq)]
pub struct DecodedBatch {
    /// When the engine published it (Unix seconds).
    pub ts: f64,
    /// Events on the GPU medium, in order. Token ids are not kept (routing needs only hashes).
    pub events: Vec<KvEvent>,
    /// Events skipped because they concern another medium (e.g. CPU offload).
    pub other_medium: usize,
    /// Events of a type this version does not know (skipped, so one new event kind does not
    /// make every batch unreadable).
    pub unknown: usize,
    /// The data-parallel rank that published it.
    pub dp_rank: u32,
}

/// Why a payload could not be decoded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    /// Not msgpack at all.
    #[error("not msgpack: {0}")]
    Msgpack(String),
    /// Msgpack, but not a KV event batch.
    #[error("not a KV event batch: {0}")]
    Shape(String),
}

fn shape(what: impl Into<String>) -> DecodeError {
    DecodeError::Shape(what.into())
}

/// Encodes one step's batch as vLLM's msgpack payload (`legacy`: the positional ≤ 0.11 events).
pub fn encode_batch(ts: f64, events: &[KvEvent], dp_rank: u32, legacy: bool) -> Vec<u8> {
    use rmp::encode::{
        write_array_len, write_f64, write_map_len, write_nil, write_str, write_u32, write_uint,
    };
    let mut b = Vec::with_capacity(64 + events.len() * 64);
    // Writing into a Vec cannot fail.
    let hashes = |b: &mut Vec<u8>, hs: &[u64]| {
        let _ = write_array_len(b, hs.len() as u32);
        for &h in hs {
            let _ = write_uint(b, h);
        }
    };
    // In the 0.33 map format every value is preceded by its key; the positional one has none.
    let key = |b: &mut Vec<u8>, k: &str| {
        if !legacy {
            let _ = write_str(b, k);
        }
    };
    let _ = write_array_len(&mut b, 3);
    let _ = write_f64(&mut b, ts);
    let _ = write_array_len(&mut b, events.len() as u32);
    for e in events {
        match e {
            KvEvent::BlockStored {
                block_hashes,
                parent_block_hash,
                token_ids,
                block_size,
            } => {
                if legacy {
                    let _ = write_array_len(&mut b, 7);
                } else {
                    let _ = write_map_len(&mut b, 8);
                    let _ = write_str(&mut b, "type");
                }
                let _ = write_str(&mut b, "BlockStored");
                key(&mut b, "block_hashes");
                hashes(&mut b, block_hashes);
                key(&mut b, "parent_block_hash");
                match parent_block_hash {
                    Some(p) => drop(write_uint(&mut b, *p)),
                    None => drop(write_nil(&mut b)),
                }
                key(&mut b, "token_ids");
                let _ = write_array_len(&mut b, token_ids.len() as u32);
                for &t in token_ids {
                    let _ = write_u32(&mut b, t);
                }
                key(&mut b, "block_size");
                let _ = write_u32(&mut b, *block_size);
                key(&mut b, "lora_id");
                let _ = write_nil(&mut b);
                key(&mut b, "medium");
                let _ = write_str(&mut b, "GPU");
                if !legacy {
                    let _ = write_str(&mut b, "lora_name");
                    let _ = write_nil(&mut b);
                }
            }
            KvEvent::BlockRemoved { block_hashes } => {
                if legacy {
                    let _ = write_array_len(&mut b, 3);
                } else {
                    let _ = write_map_len(&mut b, 3);
                    let _ = write_str(&mut b, "type");
                }
                let _ = write_str(&mut b, "BlockRemoved");
                key(&mut b, "block_hashes");
                hashes(&mut b, block_hashes);
                key(&mut b, "medium");
                let _ = write_str(&mut b, "GPU");
            }
            KvEvent::AllBlocksCleared => {
                if legacy {
                    let _ = write_array_len(&mut b, 1);
                } else {
                    let _ = write_map_len(&mut b, 1);
                    let _ = write_str(&mut b, "type");
                }
                let _ = write_str(&mut b, "AllBlocksCleared");
            }
        }
    }
    let _ = write_uint(&mut b, u64::from(dp_rank));
    b
}

/// Decodes one batch payload, in either event format (the format is told per event).
pub fn decode_batch(payload: &[u8]) -> Result<DecodedBatch, DecodeError> {
    let mut rd = payload;
    let v =
        rmpv::decode::read_value_ref(&mut rd).map_err(|e| DecodeError::Msgpack(e.to_string()))?;
    let ValueRef::Array(top) = v else {
        return Err(shape("the batch is not an array"));
    };
    let ts = match top.first() {
        Some(ValueRef::F64(t)) => *t,
        Some(ValueRef::F32(t)) => f64::from(*t),
        Some(ValueRef::Integer(i)) => i.as_f64().unwrap_or(0.0),
        _ => return Err(shape("the batch does not start with a timestamp")),
    };
    let Some(ValueRef::Array(raw)) = top.get(1) else {
        return Err(shape("the batch's second element is not a list of events"));
    };
    let dp_rank = match top.get(2) {
        Some(ValueRef::Integer(i)) => i.as_u64().unwrap_or(0) as u32,
        _ => 0,
    };
    let mut events = Vec::with_capacity(raw.len());
    let mut other_medium = 0;
    let mut unknown = 0;
    for e in raw {
        match decode_event(e)? {
            None => unknown += 1,
            Some((_, false)) => other_medium += 1,
            Some((ev, true)) => events.push(ev),
        }
    }
    Ok(DecodedBatch {
        ts,
        events,
        other_medium,
        unknown,
        dp_rank,
    })
}

/// An event and whether it concerns the GPU cache; None for an event type not known here.
fn decode_event(v: &ValueRef<'_>) -> Result<Option<(KvEvent, bool)>, DecodeError> {
    match v {
        ValueRef::Map(fields) => {
            let get = |k: &str| {
                fields
                    .iter()
                    .find(|(key, _)| matches!(key, ValueRef::String(s) if s.as_str() == Some(k)))
                    .map(|(_, v)| v)
            };
            let kind = get("type")
                .and_then(as_str)
                .ok_or_else(|| shape("an event map without \"type\""))?;
            event_from(
                kind,
                get("block_hashes"),
                get("parent_block_hash"),
                get("medium"),
            )
        }
        ValueRef::Array(items) => {
            let kind = items
                .first()
                .and_then(as_str)
                .ok_or_else(|| shape("a positional event without its tag"))?;
            match kind {
                "BlockStored" => event_from(kind, items.get(1), items.get(2), items.get(6)),
                "BlockRemoved" => event_from(kind, items.get(1), None, items.get(2)),
                _ => event_from(kind, None, None, None),
            }
        }
        _ => Err(shape("an event that is neither a map nor an array")),
    }
}

fn as_str<'a>(v: &'a ValueRef<'a>) -> Option<&'a str> {
    match v {
        ValueRef::String(s) => s.as_str(),
        _ => None,
    }
}

fn event_from(
    kind: &str,
    hashes: Option<&ValueRef<'_>>,
    parent: Option<&ValueRef<'_>>,
    medium: Option<&ValueRef<'_>>,
) -> Result<Option<(KvEvent, bool)>, DecodeError> {
    // An absent or nil medium is the GPU (older publishers and the map format's default).
    let on_gpu = medium
        .and_then(as_str)
        .is_none_or(|m| m.eq_ignore_ascii_case("gpu"));
    let event = match kind {
        "BlockStored" => KvEvent::BlockStored {
            block_hashes: hash_list(hashes)?,
            parent_block_hash: match parent {
                None | Some(ValueRef::Nil) => None,
                Some(v) => Some(hash_of(v)?),
            },
            token_ids: Vec::new(),
            block_size: 0,
        },
        "BlockRemoved" => KvEvent::BlockRemoved {
            block_hashes: hash_list(hashes)?,
        },
        "AllBlocksCleared" => KvEvent::AllBlocksCleared,
        _ => return Ok(None),
    };
    Ok(Some((event, on_gpu)))
}

fn hash_list(v: Option<&ValueRef<'_>>) -> Result<Vec<BlockHash>, DecodeError> {
    match v {
        Some(ValueRef::Array(items)) => items.iter().map(hash_of).collect(),
        _ => Err(shape("block_hashes is not a list")),
    }
}

/// A hash as an integer, or the low 64 bits of a big-endian digest.
fn hash_of(v: &ValueRef<'_>) -> Result<BlockHash, DecodeError> {
    match v {
        ValueRef::Integer(i) => i
            .as_u64()
            .or_else(|| i.as_i64().map(|s| s as u64))
            .ok_or_else(|| shape("a block hash out of range")),
        ValueRef::Binary(b) if !b.is_empty() => {
            let tail = &b[b.len().saturating_sub(8)..];
            Ok(tail.iter().fold(0u64, |acc, &x| (acc << 8) | u64::from(x)))
        }
        _ => Err(shape("a block hash that is neither an integer nor bytes")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rmpv::Value;

    fn sample() -> Vec<KvEvent> {
        vec![
            KvEvent::BlockStored {
                block_hashes: vec![111, u64::MAX],
                parent_block_hash: None,
                token_ids: vec![1, 2],
                block_size: 16,
            },
            KvEvent::BlockRemoved {
                block_hashes: vec![99],
            },
            KvEvent::AllBlocksCleared,
        ]
    }

    #[test]
    fn encoded_batches_read_as_vllm_shapes() {
        let v = rmpv::decode::read_value(&mut &encode_batch(1.5, &sample(), 0, false)[..]).unwrap();
        let text = v.to_string();
        assert!(text.starts_with("[1.5, [{\"type\": \"BlockStored\", \"block_hashes\": [111, 18446744073709551615], \"parent_block_hash\": nil, \"token_ids\": [1, 2], \"block_size\": 16, \"lora_id\": nil, \"medium\": \"GPU\", \"lora_name\": nil}"), "{text}");
        assert!(
            text.contains(
                "{\"type\": \"BlockRemoved\", \"block_hashes\": [99], \"medium\": \"GPU\"}"
            ),
            "{text}"
        );
        assert!(
            text.ends_with("{\"type\": \"AllBlocksCleared\"}], 0]"),
            "{text}"
        );
        let legacy =
            rmpv::decode::read_value(&mut &encode_batch(1.5, &sample(), 0, true)[..]).unwrap();
        assert_eq!(
            legacy.to_string(),
            "[1.5, [[\"BlockStored\", [111, 18446744073709551615], nil, [1, 2], 16, nil, \"GPU\"], [\"BlockRemoved\", [99], \"GPU\"], [\"AllBlocksCleared\"]], 0]"
        );
    }

    fn encode(v: &Value) -> Vec<u8> {
        let mut b = Vec::new();
        rmpv::encode::write_value(&mut b, v).unwrap();
        b
    }

    fn s(x: &str) -> Value {
        Value::from(x)
    }

    #[test]
    fn map_events_decode_with_extra_fields_bytes_hashes_and_other_media() {
        // The shape vLLM 0.33 publishes (built here value by value, not with encode_batch), with
        // group_idx and extra_keys beside the known fields, one hash as a 32-byte digest, and an
        // offload tier's event that must not count as the GPU's.
        let mut digest = vec![0xAAu8; 24];
        digest.extend_from_slice(&0x0102_0304_0506_0708u64.to_be_bytes());
        let stored = Value::Map(vec![
            (s("type"), s("BlockStored")),
            (
                s("block_hashes"),
                Value::Array(vec![Value::from(111u64), Value::Binary(digest)]),
            ),
            (s("parent_block_hash"), Value::from(7u64)),
            (
                s("token_ids"),
                Value::Array((0..32).map(Value::from).collect()),
            ),
            (s("block_size"), Value::from(16)),
            (s("lora_id"), Value::Nil),
            (s("medium"), s("GPU")),
            (s("lora_name"), Value::Nil),
            (s("extra_keys"), Value::Nil),
            (s("group_idx"), Value::from(0)),
        ]);
        let offloaded = Value::Map(vec![
            (s("type"), s("BlockStored")),
            (s("block_hashes"), Value::Array(vec![Value::from(5u64)])),
            (s("medium"), s("CPU")),
        ]);
        let removed = Value::Map(vec![
            (s("type"), s("BlockRemoved")),
            (s("block_hashes"), Value::Array(vec![Value::from(99u64)])),
            (s("group_idx"), Value::from(0)),
        ]);
        let cleared = Value::Map(vec![(s("type"), s("AllBlocksCleared"))]);
        let batch = Value::Array(vec![
            Value::F64(1_760_000_000.5),
            Value::Array(vec![stored, offloaded, removed, cleared]),
            Value::from(0),
        ]);
        let d = decode_batch(&encode(&batch)).unwrap();
        assert_eq!(d.ts, 1_760_000_000.5);
        assert_eq!(d.other_medium, 1);
        assert_eq!(
            d.events,
            vec![
                KvEvent::BlockStored {
                    block_hashes: vec![111, 0x0102_0304_0506_0708],
                    parent_block_hash: Some(7),
                    token_ids: vec![],
                    block_size: 0,
                },
                KvEvent::BlockRemoved {
                    block_hashes: vec![99]
                },
                KvEvent::AllBlocksCleared,
            ]
        );
    }

    #[test]
    fn both_formats_round_trip_through_the_encoder() {
        for legacy in [false, true] {
            let d = decode_batch(&encode_batch(2.0, &sample(), 3, legacy)).unwrap();
            assert_eq!(d.dp_rank, 3);
            assert_eq!(d.events.len(), 3);
            assert!(
                matches!(&d.events[0], KvEvent::BlockStored { block_hashes, parent_block_hash: None, .. } if block_hashes == &vec![111, u64::MAX])
            );
        }
    }

    #[test]
    fn bad_payloads_are_errors_not_panics() {
        // Truncated: an array of three whose first element is cut off.
        assert!(matches!(
            decode_batch(b"\x93\xcb\x00"),
            Err(DecodeError::Msgpack(_))
        ));
        assert!(matches!(
            decode_batch(&encode(&Value::from(1))),
            Err(DecodeError::Shape(_))
        ));
        let unknown = Value::Array(vec![
            Value::F64(1.0),
            Value::Array(vec![Value::Map(vec![(s("type"), s("Teleported"))])]),
        ]);
        // An event type from a newer engine is skipped and counted, not fatal.
        assert_eq!(decode_batch(&encode(&unknown)).unwrap().unknown, 1);
        let no_hashes = Value::Array(vec![
            Value::F64(1.0),
            Value::Array(vec![Value::Array(vec![s("BlockRemoved")])]),
        ]);
        assert!(decode_batch(&encode(&no_hashes)).is_err());
        // A batch without dp_rank (older publishers) is rank 0.
        let bare = Value::Array(vec![Value::F64(1.0), Value::Array(vec![])]);
        assert_eq!(decode_batch(&encode(&bare)).unwrap().dp_rank, 0);
    }
}
