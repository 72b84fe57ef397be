//! The KV event subscriber: one task per replica that has an event endpoint, feeding the exact
//! prefix index (routing/kv_index.rs) from the engine's ZMQ stream and filling gaps from its replay
//! socket.
//!
//! | step | what happens |
//! |---|---|
//! | connect | SUB to `kv_events` (retried every second until it holds; the socket reconnects by itself after that) |
//! | catch up | with a replay endpoint: ask for every buffered batch from the next expected number (0 at first); an empty answer means the engine has published nothing, so its cache is empty |
//! | disconnect | the replica is `missing` (routing falls back to the approximate index) until the socket reconnects; then the replay of the last batch applied must show the same engine timestamp (else: restarted, or nothing to check against: the picture is rebuilt) before it catches up as above |
//! | each batch | `[topic, seq, payload]`: in order → applied; ahead → the missed range is replayed first; behind → the engine restarted, its picture is cleared |
//! | undecodable batch | counted; the picture is cleared and marked partial (it would otherwise miss that batch's evictions) |
//!
//! The replay request is vLLM's: a DEALER sends `["", start_seq]`; the ROUTER answers with
//! `["", seq, payload]` for each buffered batch from `start_seq`, then `["", 0xFF×8, ""]`.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use futures_util::StreamExt;
use headroom_workload::kv_events::decode_batch;
use tokio::sync::watch;
use zeromq::{Socket, SocketEvent, SocketRecv, SocketSend, ZmqMessage};

use crate::routing::kv_index::{Applied, KvIndex, SeqCheck};
use crate::routing::{BackendId, RoutingPolicy};
use crate::telemetry::Metrics;

/// Where one replica publishes.
#[derive(Debug, Clone)]
pub struct EventSource {
    /// The replica.
    pub id: BackendId,
    /// Its name in metrics.
    pub name: String,
    /// The PUB endpoint.
    pub endpoint: String,
    /// The replay (ROUTER) endpoint, if any.
    pub replay: Option<String>,
    /// Topic prefix to subscribe to.
    pub topic: String,
    /// How long a replay may take.
    pub replay_timeout: Duration,
    /// The routing policy, told when the events reveal a restart so that its approximate history
    /// (the fallback while a stream is partial, stale or missing) forgets the replica too.
    pub policy: Arc<dyn RoutingPolicy>,
}

/// Why a replay did not return what was asked.
#[derive(Debug, thiserror::Error)]
enum ReplayError {
    #[error("connecting: {0}")]
    Connect(String),
    #[error("no answer within {0:?}")]
    Timeout(Duration),
    #[error("socket: {0}")]
    Socket(String),
}

type Index = Arc<Mutex<KvIndex>>;

fn lock(index: &Index) -> std::sync::MutexGuard<'_, KvIndex> {
    index.lock().unwrap_or_else(|e| e.into_inner())
}

/// Follows `src`'s stream until `stop` turns true.
pub async fn subscribe_loop(
    src: EventSource,
    index: Index,
    metrics: Arc<Metrics>,
    mut stop: watch::Receiver<bool>,
) {
    let m = StreamMetrics::new(&metrics.kv_events, &src.name);
    // However the task ends (stopped, or a panic), routing stops trusting the picture.
    let _missing = MarkMissing {
        index: index.clone(),
        id: src.id,
    };
    loop {
        let mut sub = zeromq::SubSocket::new();
        let connected = tokio::select! {
            r = tokio::time::timeout(Duration::from_secs(2), sub.connect(&src.endpoint)) => matches!(r, Ok(Ok(()))),
            () = stopped(&mut stop) => return,
        };
        if !connected || sub.subscribe(&src.topic).await.is_err() {
            tokio::select! {
                _ = tokio::time::sleep(Duration::from_secs(1)) => continue,
                () = stopped(&mut stop) => return,
            }
        }
        let mut monitor = sub.monitor();
        tracing::info!(backend = %src.name, endpoint = %src.endpoint, "following KV events");
        // Sequence numbers a replay covered: live copies of them may still be queued.
        let mut replayed = rejoin(&src, &index, &m).await;
        lock(&index).set_connected(src.id, true);
        loop {
            tokio::select! {
                () = stopped(&mut stop) => return,
                ev = monitor.next() => match ev {
                    Some(SocketEvent::Disconnected(_)) => {
                        lock(&index).set_connected(src.id, false);
                        replayed = None;
                    }
                    Some(SocketEvent::Connected(..)) => {
                        // Back after a disconnect (the socket reconnects by itself): the picture
                        // is trusted again only once the engine is known to be the same process
                        // and what it published meanwhile is replayed.
                        replayed = rejoin(&src, &index, &m).await;
                        lock(&index).set_connected(src.id, true);
                    }
                    Some(_) => {}
                    None => break,
                },
                msg = sub.recv() => match msg {
                    Ok(msg) => on_message(&src, &index, &m, msg, &mut replayed).await,
                    Err(e) => {
                        tracing::warn!(backend = %src.name, "KV event stream: {e}");
                        break;
                    }
                },
            }
        }
        lock(&index).set_connected(src.id, false);
    }
}

/// Marks the replica's stream missing when dropped.
struct MarkMissing {
    index: Index,
    id: BackendId,
}

impl Drop for MarkMissing {
    fn drop(&mut self) {
        lock(&self.index).set_connected(self.id, false);
    }
}

/// After (re)connecting: checks that the engine is still the process the picture describes (its
/// replay still holds the last batch applied, with the same timestamp), then catches up. A
/// different timestamp is a restart; no such batch (or no replay socket) leaves nothing to check
/// against, so the picture is rebuilt from what the replay and the stream bring. Returns the range
/// a replay covered.
async fn rejoin(src: &EventSource, index: &Index, m: &StreamMetrics) -> Option<(u64, u64)> {
    let (next, last) = {
        let ix = lock(index);
        (ix.next_seq(src.id), ix.last_batch(src.id))
    };
    let Some(endpoint) = &src.replay else {
        if next.is_some() {
            lock(index).forget(src.id);
        }
        return None;
    };
    let Some((seq, ts)) = last.filter(|_| next.is_some()) else {
        return catch_up(src, index, m, next.unwrap_or(0), None).await;
    };
    let batches = match replay(endpoint, seq, src.replay_timeout).await {
        Ok(b) => b,
        Err(e) => {
            m.replay_failed.inc();
            tracing::warn!(backend = %src.name, "KV event replay from {seq} failed: {e}");
            lock(index).forget(src.id);
            m.losses.inc();
            return None;
        }
    };
    // The same engine still holds batch `seq` (it is in its buffer, or newer batches pushed it
    // out); an empty answer or another timestamp at `seq` means a new process.
    let first = batches
        .first()
        .map(|(s, p)| (*s, decode_batch(p).map(|b| b.ts).ok()));
    match first {
        Some((s, Some(t))) if s == seq && t == ts => {
            m.replay_filled.inc();
            for (s, payload) in &batches {
                apply(src, index, m, *s, payload);
            }
            batches.last().map(|(l, _)| (seq, *l))
        }
        Some((s, _)) if s > seq => {
            m.replay_short.inc();
            m.losses.inc();
            lock(index).forget(src.id);
            catch_up(src, index, m, 0, None).await
        }
        _ => {
            tracing::info!(backend = %src.name, "engine restarted while disconnected: its cached blocks are forgotten");
            forget_restarted(src, index, m);
            catch_up(src, index, m, 0, None).await
        }
    }
}

/// A restarted engine holds nothing it held before: its picture and the policy's approximate
/// history of it are both cleared, and the restart is counted.
fn forget_restarted(src: &EventSource, index: &Index, m: &StreamMetrics) {
    m.restarts.inc();
    lock(index).restarted(src.id);
    src.policy.forget(src.id);
}

async fn stopped(stop: &mut watch::Receiver<bool>) {
    // Holding the receiver's guard across an await would make the task unsendable.
    let _ = stop.wait_for(|s| *s).await.map(|_| ());
}

/// The counters of one replica's stream.
#[derive(Debug, Clone)]
pub struct StreamMetrics {
    batches: prometheus::IntCounter,
    gaps: prometheus::IntCounter,
    losses: prometheus::IntCounter,
    restarts: prometheus::IntCounter,
    decode_errors: prometheus::IntCounter,
    unknown_events: prometheus::IntCounter,
    replay_filled: prometheus::IntCounter,
    replay_short: prometheus::IntCounter,
    replay_failed: prometheus::IntCounter,
}

impl StreamMetrics {
    /// The counters under `vecs` for `backend`.
    pub fn new(vecs: &crate::telemetry::KvEventCounters, backend: &str) -> Self {
        let b = [backend];
        let replay = |result: &str| vecs.replays.with_label_values(&[backend, result]);
        Self {
            batches: vecs.batches.with_label_values(&b),
            gaps: vecs.gaps.with_label_values(&b),
            losses: vecs.losses.with_label_values(&b),
            restarts: vecs.restarts.with_label_values(&b),
            decode_errors: vecs.decode_errors.with_label_values(&b),
            unknown_events: vecs.unknown_events.with_label_values(&b),
            replay_filled: replay("filled"),
            replay_short: replay("short"),
            replay_failed: replay("failed"),
        }
    }
}

fn frames(msg: ZmqMessage) -> Option<(u64, Bytes)> {
    // `[topic, seq, payload]`; the topic frame is not needed once subscribed.
    let mut f = msg.into_vec();
    let payload = f.pop()?;
    let seq = f.pop()?;
    let seq = u64::from_be_bytes(<[u8; 8]>::try_from(seq.as_ref()).ok()?);
    Some((seq, payload))
}

async fn on_message(
    src: &EventSource,
    index: &Index,
    m: &StreamMetrics,
    msg: ZmqMessage,
    replayed: &mut Option<(u64, u64)>,
) {
    // u64::MAX marks the end of a replay; it is never a batch's number.
    let Some((seq, payload)) = frames(msg).filter(|(s, _)| *s != u64::MAX) else {
        m.decode_errors.inc();
        return;
    };
    let check = lock(index).check(src.id, seq);
    match check {
        SeqCheck::Next => *replayed = None,
        // Published before the replay ended and applied from it: a duplicate.
        SeqCheck::Restarted if replayed.is_some_and(|(a, b)| (a..=b).contains(&seq)) => return,
        SeqCheck::Restarted => {
            *replayed = None;
            tracing::info!(backend = %src.name, seq, "engine restarted: its cached blocks are forgotten");
            forget_restarted(src, index, m);
            if seq > 0 {
                m.gaps.inc();
                catch_up(src, index, m, 0, Some(seq)).await;
            }
        }
        SeqCheck::Gap { from } => {
            m.gaps.inc();
            catch_up(src, index, m, from, Some(seq)).await;
        }
    }
    apply(src, index, m, seq, &payload);
}

fn apply(src: &EventSource, index: &Index, m: &StreamMetrics, seq: u64, payload: &[u8]) {
    match decode_batch(payload) {
        Ok(batch) => {
            let applied = {
                let mut ix = lock(index);
                let applied = ix.apply(src.id, seq, &batch.events);
                ix.note_batch_ts(src.id, seq, batch.ts);
                applied
            };
            if batch.unknown > 0 {
                m.unknown_events.inc_by(batch.unknown as u64);
            }
            match applied {
                Applied::InOrder => m.batches.inc(),
                Applied::AfterLoss => {
                    m.batches.inc();
                    m.losses.inc();
                    tracing::warn!(backend = %src.name, seq, "KV events lost: the replica's picture restarts from here (partial)");
                }
                Applied::Duplicate => {}
            }
        }
        Err(e) => {
            m.decode_errors.inc();
            tracing::warn!(backend = %src.name, seq, "undecodable KV event batch: {e}");
            if lock(index).lost(src.id, seq) {
                m.losses.inc();
            }
        }
    }
}

/// Replays batches `from..until` (or everything buffered from `from`) into the index. Returns
/// the range of sequence numbers it covered, whose live copies still queued in the socket are
/// then duplicates, not a restart.
async fn catch_up(
    src: &EventSource,
    index: &Index,
    m: &StreamMetrics,
    from: u64,
    until: Option<u64>,
) -> Option<(u64, u64)> {
    let Some(endpoint) = &src.replay else {
        return None;
    };
    match replay(endpoint, from, src.replay_timeout).await {
        Ok(batches) => {
            if batches.is_empty() && until.is_none() {
                lock(index).nothing_published(src.id);
            }
            let first = batches.first().map(|(s, _)| *s);
            for (seq, payload) in batches.iter().filter(|(s, _)| until.is_none_or(|u| *s < u)) {
                apply(src, index, m, *seq, payload);
            }
            let filled = match until {
                Some(u) => first == Some(from) || from >= u,
                None => first.is_none_or(|f| f == from),
            };
            if filled {
                m.replay_filled.inc();
            } else {
                m.replay_short.inc();
            }
            batches.last().map(|(last, _)| (from, *last))
        }
        Err(e) => {
            m.replay_failed.inc();
            tracing::warn!(backend = %src.name, "KV event replay from {from} failed: {e}");
            None
        }
    }
}

async fn replay(
    endpoint: &str,
    from: u64,
    limit: Duration,
) -> Result<Vec<(u64, Bytes)>, ReplayError> {
    let work = async {
        let mut d = zeromq::DealerSocket::new();
        d.connect(endpoint)
            .await
            .map_err(|e| ReplayError::Connect(e.to_string()))?;
        let mut req = ZmqMessage::from(Bytes::new());
        req.push_back(Bytes::copy_from_slice(&from.to_be_bytes()));
        d.send(req)
            .await
            .map_err(|e| ReplayError::Socket(e.to_string()))?;
        let mut out = Vec::new();
        loop {
            let msg = d
                .recv()
                .await
                .map_err(|e| ReplayError::Socket(e.to_string()))?;
            let Some((seq, payload)) = frames(msg) else {
                continue;
            };
            if seq == u64::MAX {
                return Ok(out);
            }
            out.push((seq, payload));
        }
    };
    tokio::time::timeout(limit, work)
        .await
        .map_err(|_| ReplayError::Timeout(limit))?
}
