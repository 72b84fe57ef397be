//! KV cache events over ZMQ in vLLM 0.33's wire format (`--kv-events-config`), off by default.
//!
//! | part | format |
//! |---|---|
//! | socket | PUB; binds when the endpoint holds `*`, `::`, `ipc://` or `inproc://`, else connects |
//! | message | multipart `[topic, seq (u64 big-endian, from 0), msgpack(batch)]`, one per engine step with events |
//! | batch | `[ts (float, Unix seconds), [event, …], dp_rank]` |
//! | event (0.33) | msgpack map tagged `"type"`: `BlockStored{block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, lora_name}`, `BlockRemoved{block_hashes, medium}`, `AllBlocksCleared{}` |
//! | event (`"format": "legacy"`) | arrays: `["BlockStored", hashes, parent, tokens, block_size, lora_id, "GPU"]`, `["BlockRemoved", hashes, "GPU"]`, `["AllBlocksCleared"]` |
//! | replay | ROUTER at `replay_endpoint`: `[id, "", start_seq]` → every buffered `[id, "", seq, payload]` with seq ≥ start_seq, then `[id, "", 0xFF×8, ""]` |
//!
//! Replica `i` of a multi-replica process publishes on the endpoint's port + i (as vLLM's data
//! parallel rank `r` uses port + r), and so does its replay socket.

use std::collections::VecDeque;
use std::sync::mpsc;

use anyhow::{Context, bail};
use serde::Deserialize;
use zeromq::{Socket, SocketRecv, SocketSend, ZmqMessage};

use crate::engine::KvBatch;
use headroom_workload::kv_events::encode_batch;

/// vLLM's `KVEventsConfig` (plus `format`, the simulator's choice of event encoding).
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KvEventsConfig {
    /// Publish at all.
    #[serde(default)]
    pub enable_kv_cache_events: bool,
    /// Only `zmq` is supported.
    #[serde(default = "default_publisher")]
    pub publisher: String,
    /// PUB endpoint.
    #[serde(default = "default_endpoint")]
    pub endpoint: String,
    /// ROUTER endpoint for replay, if any.
    #[serde(default)]
    pub replay_endpoint: Option<String>,
    /// Batches kept for replay.
    #[serde(default = "default_buffer_steps")]
    pub buffer_steps: usize,
    /// Accepted for compatibility.
    #[serde(default)]
    pub hwm: Option<u64>,
    /// Accepted for compatibility.
    #[serde(default)]
    pub max_queue_size: Option<u64>,
    /// First frame of every message.
    #[serde(default)]
    pub topic: String,
    /// `v033` (maps, default) or `legacy` (positional arrays, vLLM ≤ 0.11).
    #[serde(default = "default_format")]
    pub format: String,
}

fn default_publisher() -> String {
    "zmq".into()
}
fn default_endpoint() -> String {
    "tcp://*:5557".into()
}
fn default_buffer_steps() -> usize {
    10_000
}
fn default_format() -> String {
    "v033".into()
}

impl KvEventsConfig {
    /// Parses the `--kv-events-config` JSON.
    pub fn parse(json: &str) -> anyhow::Result<Self> {
        let c: Self = serde_json::from_str(json)
            .context("--kv-events-config is not a valid KV events config")?;
        if c.publisher != "zmq" {
            bail!(
                "--kv-events-config publisher {:?}: only \"zmq\" is supported",
                c.publisher
            );
        }
        if c.format != "v033" && c.format != "legacy" {
            bail!(
                "--kv-events-config format {:?}: use \"v033\" or \"legacy\"",
                c.format
            );
        }
        Ok(c)
    }
}

/// Rewrites `tcp://*:5557` for replica `index`: `*` becomes all interfaces, the port grows by
/// `index`. Returns the endpoint and whether to bind (rather than connect).
pub fn endpoint_for(endpoint: &str, index: usize) -> anyhow::Result<(String, bool)> {
    let bind = endpoint.contains('*')
        || endpoint.contains("::")
        || endpoint.starts_with("ipc://")
        || endpoint.starts_with("inproc://");
    let Some(rest) = endpoint.strip_prefix("tcp://") else {
        return Ok((endpoint.to_owned(), bind));
    };
    let (host, port) = rest
        .rsplit_once(':')
        .with_context(|| format!("endpoint {endpoint:?} has no port"))?;
    let port: u16 = port
        .parse()
        .with_context(|| format!("endpoint {endpoint:?} has a bad port"))?;
    let port = port
        .checked_add(index as u16)
        .context("endpoint port overflows")?;
    let host = if host == "*" { "0.0.0.0" } else { host };
    Ok((format!("tcp://{host}:{port}"), bind))
}

/// Starts the publisher thread of replica `index`: binds (or connects) its sockets and returns
/// the sender the engine publishes through.
pub fn start_publisher(
    cfg: &KvEventsConfig,
    index: usize,
) -> anyhow::Result<mpsc::Sender<KvBatch>> {
    {
        let (endpoint, bind) = endpoint_for(&cfg.endpoint, index)?;
        let replay = cfg
            .replay_endpoint
            .as_deref()
            .map(|e| endpoint_for(e, index))
            .transpose()?;
        let (tx, rx) = mpsc::channel::<KvBatch>();
        let (ready_tx, ready_rx) = mpsc::channel::<anyhow::Result<()>>();
        let topic = cfg.topic.clone().into_bytes();
        let legacy = cfg.format == "legacy";
        let buffer_steps = cfg.buffer_steps.max(1);
        std::thread::Builder::new()
            .name(format!("kv-events-{index}"))
            .spawn(move || {
                let rt = match tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                {
                    Ok(rt) => rt,
                    Err(e) => {
                        let _ = ready_tx.send(Err(e.into()));
                        return;
                    }
                };
                rt.block_on(publish_loop(
                    rx,
                    ready_tx,
                    endpoint,
                    bind,
                    replay,
                    topic,
                    legacy,
                    buffer_steps,
                ));
            })?;
        ready_rx
            .recv()
            .context("KV events publisher thread died")??;
        Ok(tx)
    }
}

#[allow(clippy::too_many_arguments)]
async fn publish_loop(
    rx: mpsc::Receiver<KvBatch>,
    ready: mpsc::Sender<anyhow::Result<()>>,
    endpoint: String,
    bind: bool,
    replay: Option<(String, bool)>,
    topic: Vec<u8>,
    legacy: bool,
    buffer_steps: usize,
) {
    let mut publisher = zeromq::PubSocket::new();
    // A bound endpoint must be ours at start; a connected one may come up later (libzmq connects
    // lazily too), so connecting is retried in the loop below and nothing is sent until it holds.
    let mut connected = bind;
    if bind {
        if let Err(e) = publisher.bind(&endpoint).await {
            let _ = ready.send(Err(anyhow::anyhow!("KV events endpoint {endpoint}: {e}")));
            return;
        }
    }
    let mut router = None;
    if let Some((replay_endpoint, _)) = replay {
        let mut r = zeromq::RouterSocket::new();
        if let Err(e) = r.bind(&replay_endpoint).await {
            let _ = ready.send(Err(anyhow::anyhow!(
                "KV events replay endpoint {replay_endpoint}: {e}"
            )));
            return;
        }
        router = Some(r);
    }
    let _ = ready.send(Ok(()));

    // The engine thread sends on a std channel; bridge it into this runtime.
    let (async_tx, mut async_rx) = tokio::sync::mpsc::unbounded_channel();
    std::thread::spawn(move || {
        while let Ok(batch) = rx.recv() {
            if async_tx.send(batch).is_err() {
                break;
            }
        }
    });
    let mut buffer: VecDeque<(u64, bytes::Bytes)> = VecDeque::new();
    let mut seq = 0u64;
    let mut retry = tokio::time::interval(std::time::Duration::from_millis(250));
    loop {
        tokio::select! {
            _ = retry.tick(), if !connected => {
                let attempt = tokio::time::timeout(std::time::Duration::from_millis(200), publisher.connect(&endpoint));
                connected = matches!(attempt.await, Ok(Ok(())));
            }
            batch = async_rx.recv() => {
                let Some((ts, events)) = batch else { return };
                let payload = bytes::Bytes::from(encode_batch(ts, &events, 0, legacy));
                let mut msg = ZmqMessage::from(topic.clone());
                msg.push_back(bytes::Bytes::copy_from_slice(&seq.to_be_bytes()));
                msg.push_back(payload.clone());
                // A PUB socket drops messages nobody subscribed to; errors only mean no peers.
                if connected {
                    let _ = publisher.send(msg).await;
                }
                buffer.push_back((seq, payload));
                if buffer.len() > buffer_steps {
                    buffer.pop_front();
                }
                seq += 1;
            }
            request = async { match router.as_mut() { Some(r) => r.recv().await, None => std::future::pending().await } } => {
                let Ok(request) = request else { continue };
                let frames = request.into_vec();
                let (Some(id), Some(start)) = (frames.first(), frames.last()) else { continue };
                let start = <[u8; 8]>::try_from(start.as_ref()).map_or(0, u64::from_be_bytes);
                let Some(r) = router.as_mut() else { continue };
                for (s, payload) in buffer.iter().filter(|(s, _)| *s >= start) {
                    let mut reply = ZmqMessage::from(id.clone());
                    reply.push_back(bytes::Bytes::new());
                    reply.push_back(bytes::Bytes::copy_from_slice(&s.to_be_bytes()));
                    reply.push_back(payload.clone());
                    let _ = r.send(reply).await;
                }
                let mut end = ZmqMessage::from(id.clone());
                end.push_back(bytes::Bytes::new());
                end.push_back(bytes::Bytes::copy_from_slice(&[0xFF; 8]));
                end.push_back(bytes::Bytes::new());
                let _ = r.send(end).await;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_parses_vllm_json_with_defaults() {
        let c = KvEventsConfig::parse(r#"{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://*:5557","replay_endpoint":null,"buffer_steps":10000,"hwm":100000,"max_queue_size":100000,"topic":""}"#).unwrap();
        assert!(c.enable_kv_cache_events);
        assert_eq!(c.format, "v033");
        assert!(KvEventsConfig::parse(r#"{"publisher":"nats"}"#).is_err());
        assert!(KvEventsConfig::parse(r#"{"bogus":1}"#).is_err());
    }

    #[test]
    fn endpoints_bind_on_wildcards_and_shift_by_replica() {
        assert_eq!(
            endpoint_for("tcp://*:5557", 2).unwrap(),
            ("tcp://0.0.0.0:5559".into(), true)
        );
        assert_eq!(
            endpoint_for("tcp://127.0.0.1:5557", 0).unwrap(),
            ("tcp://127.0.0.1:5557".into(), false)
        );
    }
}
