//! The trace capture writer: finished requests become JSONL trace records (docs/trace-format.md),
//! handed over through a bounded queue to one writer thread, which writes them in batches (so the
//! request path neither waits on the disk nor wakes the writer per record) and runs in the batch
//! scheduling class (its wake-ups never preempt a worker relaying streams). A record that cannot
//! be queued or written is counted and logged, never silently lost.
//!
//! Each file is a standalone trace: `timestamp` is milliseconds from the file's opening. Files
//! rotate by size and age; the finished one is renamed `<stem>.<UTC start>.jsonl`. Records are
//! written as requests finish, so arrival timestamps are not in file order; readers sort them.

use std::fs::{File, OpenOptions};
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, SyncSender, TrySendError, sync_channel};
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use headroom_config::serve::CaptureConfig;
use headroom_workload::inspect::{Endpoint, InspectConfig, inspect};
use headroom_workload::trace::{TraceRecord, capture_hash_ids};
use prometheus::{IntCounter, IntCounterVec};

/// A finished request waiting to be written.
#[derive(Debug)]
pub struct Pending {
    /// When it arrived.
    pub arrival: SystemTime,
    /// Everything but `timestamp` and `hash_ids`.
    pub record: TraceRecord,
    /// The prompt's chain of block hashes (the routing blocks).
    pub blocks: Vec<u64>,
    /// Tokens per routing block.
    pub block_tokens: u32,
    /// The prompt's tail hash, when it was hashed whole.
    pub tail_hash: Option<u64>,
    /// Distinguishes this request where its prompt was not hashed.
    pub unique: u64,
    /// A prompt longer than routing hashes: its body, hashed whole by the writer (off the request
    /// path) so the trace keeps its sharing beyond the routing cap.
    pub rehash: Option<Rehash>,
}

/// A request body to hash again without the routing cap.
#[derive(Debug)]
pub struct Rehash {
    /// Its endpoint.
    pub endpoint: Endpoint,
    /// The body as the client sent it (shared, not copied).
    pub body: Bytes,
    /// The routing inspection settings (the cap is lifted).
    pub inspect: InspectConfig,
}

/// How long the writer lets records gather after the first of a batch before writing them all.
const BATCH_PAUSE: Duration = Duration::from_millis(20);

/// Request bodies queued for re-hashing at most; beyond it long prompts keep capped ids.
pub const MAX_QUEUED_BODY_BYTES: usize = 64 << 20;

enum Msg {
    Record(Box<Pending>),
    Flush(SyncSender<()>),
}

/// Counters the writer updates.
#[derive(Debug, Clone)]
pub struct CaptureCounters {
    /// Records written.
    pub written: IntCounter,
    /// Records lost, by reason (`buffer_full`, `write_error`).
    pub dropped: IntCounterVec,
    /// Files rotated.
    pub rotations: IntCounter,
}

/// The capture: a queue to the writer thread.
#[derive(Debug)]
pub struct Capture {
    tx: Option<SyncSender<Msg>>,
    queued_body_bytes: Arc<AtomicUsize>,
    thread: Option<JoinHandle<()>>,
    sample_below: u64,
    counters: CaptureCounters,
}

/// Why the capture could not start.
#[derive(Debug, thiserror::Error)]
#[error("capture file {path}: {error}")]
pub struct CaptureError {
    path: String,
    /// In the message, not a separate source: printed once in an error chain.
    error: std::io::Error,
}

impl Capture {
    /// Opens the capture file (creating its directory) and starts the writer.
    pub fn start(
        cfg: &CaptureConfig,
        counters: CaptureCounters,
    ) -> Result<Option<Self>, CaptureError> {
        let Some(path) = cfg.path.clone() else {
            return Ok(None);
        };
        let path = PathBuf::from(path);
        let shown = path.display().to_string();
        let err = |error| CaptureError {
            path: shown.clone(),
            error,
        };
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(err)?;
        }
        let file = CaptureFile::open(&path).map_err(err)?;
        // Both reasons exist from the start at 0, so the first loss is an increase a rate or an
        // alert sees (a series born at its first value shows none).
        for reason in ["buffer_full", "write_error"] {
            counters.dropped.with_label_values(&[reason]);
        }
        let key = match &cfg.id_key {
            Some(k) => k.as_bytes().to_vec(),
            None => random_key(),
        };
        let (tx, rx) = sync_channel(cfg.buffer_records);
        let capacity = cfg.buffer_records;
        let queued_body_bytes = Arc::new(AtomicUsize::new(0));
        let writer = Writer {
            queued_body_bytes: queued_body_bytes.clone(),
            path,
            file: Some(file),
            key,
            rotate_bytes: cfg.rotate_bytes,
            rotate_after: (cfg.rotate_secs > 0).then(|| Duration::from_secs(cfg.rotate_secs)),
            keep_files: cfg.keep_files as usize,
            counters: counters.clone(),
            errors_logged: 0,
        };
        let thread = std::thread::Builder::new()
            .name("headroom-capture".into())
            .spawn(move || {
                // The writer's wake-ups (every batch) must not preempt the workers relaying
                // streams on the same core: it runs when they next wait, at its full share.
                if !headroom_workload::realtime::lower_current_thread() {
                    tracing::debug!("capture writer left in the normal scheduling class");
                }
                writer.run(rx, capacity)
            })
            .map_err(err)?;
        let sample_below = if cfg.sample >= 1.0 {
            u64::MAX
        } else {
            (cfg.sample * u64::MAX as f64) as u64
        };
        Ok(Some(Self {
            tx: Some(tx),
            queued_body_bytes,
            thread: Some(thread),
            sample_below,
            counters,
        }))
    }

    /// Whether the request with this id is sampled.
    pub fn sampled(&self, request_id: &str) -> bool {
        self.sample_below == u64::MAX
            || xxhash_rust::xxh3::xxh3_64(request_id.as_bytes()) < self.sample_below
    }

    /// Whether a body of `len` bytes may be queued for re-hashing (and if so, counts it).
    pub fn reserve_body(&self, len: usize) -> bool {
        let prev = self.queued_body_bytes.fetch_add(len, Ordering::Relaxed);
        if prev + len > MAX_QUEUED_BODY_BYTES {
            self.queued_body_bytes.fetch_sub(len, Ordering::Relaxed);
            return false;
        }
        true
    }

    /// Queues a record without waiting; a full queue drops it (counted, logged).
    pub fn submit(&self, p: Pending) {
        let Some(tx) = &self.tx else { return };
        match tx.try_send(Msg::Record(Box::new(p))) {
            Ok(()) => {}
            Err(TrySendError::Full(Msg::Record(p))) => {
                if let Some(r) = &p.rehash {
                    self.queued_body_bytes
                        .fetch_sub(r.body.len(), Ordering::Relaxed);
                }
                let n = self.counters.dropped.with_label_values(&["buffer_full"]);
                n.inc();
                if n.get().is_power_of_two() {
                    tracing::warn!(
                        dropped = n.get(),
                        "capture queue full: trace records dropped (capture.buffer_records)"
                    );
                }
            }
            Err(TrySendError::Full(Msg::Flush(_))) => {}
            Err(TrySendError::Disconnected(_)) => {
                self.counters
                    .dropped
                    .with_label_values(&["write_error"])
                    .inc();
            }
        }
    }

    /// Waits until every record queued so far is written and flushed (at most `timeout`).
    pub fn flush(&self, timeout: Duration) -> bool {
        let Some(tx) = &self.tx else { return false };
        let (ack, done) = sync_channel(1);
        if tx.send(Msg::Flush(ack)).is_err() {
            return false;
        }
        done.recv_timeout(timeout).is_ok()
    }
}

impl Drop for Capture {
    fn drop(&mut self) {
        // Closing the queue lets the writer drain it, flush and exit.
        self.tx.take();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// 32 bytes from the standard library's per-process random hasher keys (seeded by the OS).
fn random_key() -> Vec<u8> {
    use std::hash::BuildHasher;
    (0..4u64)
        .flat_map(|i| {
            std::collections::hash_map::RandomState::new()
                .hash_one(i)
                .to_le_bytes()
        })
        .collect()
}

struct CaptureFile {
    out: BufWriter<File>,
    opened: SystemTime,
    opened_at: Instant,
    bytes: u64,
    /// Records in `out`'s buffer not yet flushed to the file: written once a flush succeeds, lost
    /// if it fails.
    unflushed: u64,
}

impl CaptureFile {
    fn open(path: &Path) -> std::io::Result<Self> {
        let file = OpenOptions::new().create(true).append(true).open(path)?;
        let bytes = file.metadata()?.len();
        Ok(Self {
            out: BufWriter::with_capacity(256 << 10, file),
            opened: SystemTime::now(),
            opened_at: Instant::now(),
            bytes,
            unflushed: 0,
        })
    }
}

struct Writer {
    queued_body_bytes: Arc<AtomicUsize>,
    path: PathBuf,
    file: Option<CaptureFile>,
    key: Vec<u8>,
    rotate_bytes: u64,
    rotate_after: Option<Duration>,
    keep_files: usize,
    counters: CaptureCounters,
    errors_logged: u64,
}

impl Writer {
    fn run(mut self, rx: Receiver<Msg>, capacity: usize) {
        let mut pause = true;
        loop {
            match rx.recv_timeout(Duration::from_secs(1)) {
                Ok(Msg::Record(p)) => {
                    self.write(&p);
                    // Records are written in batches: while this thread sleeps, the request path
                    // queues without waking it (a wake-up per record was two context switches
                    // per request on the proxy's core). A queue found half full is drained
                    // again at once, so the pause never makes the queue overflow.
                    if pause {
                        std::thread::sleep(BATCH_PAUSE);
                    }
                    let mut drained = 0;
                    while let Ok(m) = rx.try_recv() {
                        drained += 1;
                        match m {
                            Msg::Record(p) => self.write(&p),
                            Msg::Flush(ack) => {
                                self.flush();
                                let _ = ack.send(());
                            }
                        }
                    }
                    pause = drained < capacity / 2;
                    // Flush when the queue is empty, not per record.
                    self.flush();
                }
                Ok(Msg::Flush(ack)) => {
                    self.flush();
                    let _ = ack.send(());
                }
                Err(RecvTimeoutError::Timeout) => self.rotate_if_due(),
                Err(RecvTimeoutError::Disconnected) => {
                    self.flush();
                    return;
                }
            }
        }
    }

    fn write(&mut self, p: &Pending) {
        let mut rehashed = None;
        if let Some(r) = &p.rehash {
            let cfg = InspectConfig {
                max_hashed_tokens: u32::MAX,
                ..r.inspect.clone()
            };
            rehashed = inspect(r.endpoint, &r.body, &cfg).ok();
            self.queued_body_bytes
                .fetch_sub(r.body.len(), Ordering::Relaxed);
        }
        let (blocks, tail_hash) = match &rehashed {
            Some(i) => (i.blocks.as_slice(), i.tail_hash),
            None => (p.blocks.as_slice(), p.tail_hash),
        };
        self.rotate_if_due();
        if self.file.is_none() {
            match CaptureFile::open(&self.path) {
                Ok(f) => self.file = Some(f),
                Err(e) => return self.failed(&e, 1),
            }
        }
        let Some(f) = self.file.as_mut() else { return };
        let mut r = p.record.clone();
        r.timestamp = p
            .arrival
            .duration_since(f.opened)
            .map_or(0, |d| d.as_millis() as u64);
        r.hash_ids = capture_hash_ids(
            blocks,
            p.block_tokens,
            tail_hash,
            r.input_length,
            &self.key,
            p.unique,
        );
        let mut line = match serde_json::to_vec(&r) {
            Ok(l) => l,
            Err(e) => return self.failed(&std::io::Error::other(e), 1),
        };
        line.push(b'\n');
        // The buffer is flushed here, not inside `write_all`, so that every record is counted
        // written or lost by the flush that took it.
        if f.out.buffer().len() + line.len() > f.out.capacity() {
            self.flush();
        }
        let Some(f) = self.file.as_mut() else {
            return self.failed(&std::io::Error::other("the capture file was lost"), 1);
        };
        match f.out.write_all(&line) {
            Ok(()) if f.out.buffer().is_empty() => {
                // A line larger than the buffer goes straight to the file.
                f.bytes += line.len() as u64;
                self.counters.written.inc();
            }
            Ok(()) => {
                f.bytes += line.len() as u64;
                f.unflushed += 1;
            }
            Err(e) => {
                // This record and every one still buffered are lost with the file.
                let lost = f.unflushed + 1;
                self.drop_file();
                self.failed(&e, lost);
            }
        }
    }

    fn flush(&mut self) {
        if let Some(f) = self.file.as_mut() {
            let buffered = std::mem::take(&mut f.unflushed);
            match f.out.flush() {
                Ok(()) => self.counters.written.inc_by(buffered),
                Err(e) => {
                    self.drop_file();
                    self.failed(&e, buffered);
                }
            }
        }
    }

    /// Lets the file go after a failed write, discarding what its buffer holds (counted lost):
    /// dropping the writer would try to write it once more, past the records counted.
    fn drop_file(&mut self) {
        if let Some(f) = self.file.take() {
            let _ = f.out.into_parts();
        }
    }

    /// `lost` records could not be written: counted, and logged (at powers of two of failures).
    fn failed(&mut self, e: &std::io::Error, lost: u64) {
        self.counters
            .dropped
            .with_label_values(&["write_error"])
            .inc_by(lost);
        self.errors_logged += 1;
        if self.errors_logged.is_power_of_two() {
            tracing::error!(
                path = %self.path.display(),
                error = %e,
                failures = self.errors_logged,
                "trace capture record lost: cannot write the capture file"
            );
        }
    }

    fn rotate_if_due(&mut self) {
        let Some(f) = &self.file else { return };
        let too_big = f.bytes >= self.rotate_bytes;
        let too_old = self
            .rotate_after
            .is_some_and(|a| f.opened_at.elapsed() >= a);
        if !(too_big || too_old) || f.bytes == 0 {
            return;
        }
        let opened = f.opened;
        self.flush();
        self.file = None;
        let target = rotated_name(&self.path, opened);
        match std::fs::rename(&self.path, &target) {
            Ok(()) => {
                self.counters.rotations.inc();
                tracing::info!(file = %target.display(), "trace capture rotated");
                if self.keep_files > 0 {
                    prune_rotated(&self.path, self.keep_files);
                }
            }
            Err(e) => tracing::error!(error = %e, "trace capture rotation failed"),
        }
        match CaptureFile::open(&self.path) {
            Ok(f) => self.file = Some(f),
            Err(e) => tracing::error!(error = %e, "cannot reopen the capture file"),
        }
    }
}

/// Deletes the oldest files rotated from `path` beyond the newest `keep` (their names sort by
/// their UTC start).
fn prune_rotated(path: &Path, keep: usize) {
    let (Some(stem), Some(ext)) = (path.file_stem(), path.extension()) else {
        return;
    };
    let (prefix, suffix) = (
        format!("{}.", stem.to_string_lossy()),
        format!(".{}", ext.to_string_lossy()),
    );
    let dir = path
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or_else(|| Path::new("."));
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    let mut rotated: Vec<PathBuf> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.file_name()
                .map(|n| n.to_string_lossy())
                .and_then(|n| {
                    let stamp = n.strip_prefix(&prefix)?.strip_suffix(&suffix)?;
                    Some(stamp.len() >= 16 && stamp.starts_with(|c: char| c.is_ascii_digit()))
                })
                .unwrap_or(false)
        })
        .collect();
    rotated.sort();
    let excess = rotated.len().saturating_sub(keep);
    for old in &rotated[..excess] {
        match std::fs::remove_file(old) {
            Ok(()) => tracing::info!(file = %old.display(), "old trace capture deleted"),
            Err(e) => {
                tracing::warn!(file = %old.display(), error = %e, "cannot delete an old trace capture")
            }
        }
    }
}

/// `dir/stem.YYYYMMDDTHHMMSSZ.jsonl` for a file opened at `opened` (a counter is added if taken).
fn rotated_name(path: &Path, opened: SystemTime) -> PathBuf {
    let secs = opened.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
    let (days, rem) = (secs / 86_400, secs % 86_400);
    let (y, m, d) = civil_from_days(days as i64);
    let stamp = format!(
        "{y:04}{m:02}{d:02}T{:02}{:02}{:02}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    );
    let stem = path
        .file_stem()
        .map_or_else(|| "capture".into(), |s| s.to_string_lossy().into_owned());
    let ext = path
        .extension()
        .map_or_else(|| "jsonl".into(), |s| s.to_string_lossy().into_owned());
    let dir = path.parent().unwrap_or_else(|| Path::new(""));
    let mut candidate = dir.join(format!("{stem}.{stamp}.{ext}"));
    let mut n = 1;
    while candidate.exists() {
        candidate = dir.join(format!("{stem}.{stamp}-{n}.{ext}"));
        n += 1;
    }
    candidate
}

/// (year, month, day) of a day count since 1970-01-01 (Howard Hinnant's algorithm).
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = if z >= 0 { z } else { z - 146_096 } / 146_097;
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    (yoe + era * 400 + i64::from(m <= 2), m, d)
}

#[cfg(test)]
mod tests {
    use super::*;
    use prometheus::Opts;

    fn counters() -> CaptureCounters {
        CaptureCounters {
            written: IntCounter::new("w", "w").unwrap(),
            dropped: IntCounterVec::new(Opts::new("d", "d"), &["reason"]).unwrap(),
            rotations: IntCounter::new("r", "r").unwrap(),
        }
    }

    fn pending(i: u32, arrival: SystemTime) -> Pending {
        Pending {
            arrival,
            record: TraceRecord {
                input_length: 600,
                output_length: i,
                ..TraceRecord::default()
            },
            blocks: (0..37).collect(),
            block_tokens: 16,
            tail_hash: Some(99),
            unique: u64::from(i),
            rehash: None,
        }
    }

    #[test]
    fn records_are_written_rotated_and_read_back() {
        let scratch = tempfile::tempdir().expect("a scratch directory");
        let dir = scratch.path();
        let path = dir.join("sub/trace.jsonl");
        let cfg = CaptureConfig {
            path: Some(path.display().to_string()),
            rotate_bytes: 4096,
            id_key: Some("0123456789abcdef".into()),
            ..CaptureConfig::default()
        };
        let c = counters();
        let cap = Capture::start(&cfg, c.clone()).unwrap().unwrap();
        let t0 = SystemTime::now();
        // Finished out of arrival order.
        for i in (1..=60).rev() {
            cap.submit(pending(i, t0 + Duration::from_millis(u64::from(i))));
        }
        assert!(cap.flush(Duration::from_secs(10)));
        drop(cap);
        let mut files: Vec<_> = std::fs::read_dir(path.parent().unwrap())
            .unwrap()
            .map(|e| e.unwrap().path())
            .collect();
        files.sort();
        assert!(files.len() >= 2, "rotated: {files:?}");
        let mut all = Vec::new();
        for f in &files {
            let text = std::fs::read_to_string(f).unwrap();
            let recs =
                headroom_workload::trace::read_jsonl(std::io::BufReader::new(text.as_bytes()))
                    .unwrap();
            assert!(recs.windows(2).all(|w| w[0].timestamp <= w[1].timestamp));
            all.extend(recs);
        }
        assert_eq!(all.len(), 60);
        assert_eq!(c.written.get(), 60);
        assert!(c.rotations.get() >= 1);
        // Same prompt blocks, same key: the same ids in every record.
        assert!(
            all.iter()
                .all(|r| r.hash_ids == all[0].hash_ids && r.hash_ids.len() == 2)
        );
    }

    #[test]
    fn only_the_newest_rotated_files_are_kept() {
        let scratch = tempfile::tempdir().expect("a scratch directory");
        let dir = scratch.path();
        let path = dir.join("trace.jsonl");
        // Rotated files of earlier days, another capture's file and an unrelated one.
        for name in [
            "trace.20260101T000000Z.jsonl",
            "trace.20260102T000000Z.jsonl",
            "trace.20260103T000000Z.jsonl",
            "other.20260101T000000Z.jsonl",
            "trace.notes.jsonl",
        ] {
            std::fs::write(dir.join(name), "").unwrap();
        }
        prune_rotated(&path, 2);
        let mut left: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        left.sort();
        assert_eq!(
            left,
            [
                "other.20260101T000000Z.jsonl",
                "trace.20260102T000000Z.jsonl",
                "trace.20260103T000000Z.jsonl",
                "trace.notes.jsonl",
            ]
        );
    }

    #[test]
    fn long_prompts_are_hashed_whole_off_the_request_path() {
        let scratch = tempfile::tempdir().expect("a scratch directory");
        let dir = scratch.path();
        let path = dir.join("t.jsonl");
        let cfg = CaptureConfig {
            path: Some(path.display().to_string()),
            id_key: Some("0123456789abcdef".into()),
            ..CaptureConfig::default()
        };
        let cap = Capture::start(&cfg, counters()).unwrap().unwrap();
        // Routing hashed only the first 64 tokens; the prompts share their first 1,100.
        let routing = InspectConfig {
            block_tokens: 16,
            max_hashed_tokens: 64,
            ..InspectConfig::default()
        };
        let shared: String = (0..1099)
            .map(headroom_workload::words::spaced_word)
            .collect();
        for tail in [5_000u64, 9_000] {
            let text: String = (tail..tail + 400)
                .map(headroom_workload::words::spaced_word)
                .collect();
            let body = serde_json::json!({"prompt": format!("{shared}{text}")}).to_string();
            let routed = inspect(Endpoint::Completions, body.as_bytes(), &routing).unwrap();
            assert!(routed.tail_hash.is_none());
            let body = Bytes::from(body);
            assert!(cap.reserve_body(body.len()));
            cap.submit(Pending {
                arrival: SystemTime::now(),
                record: TraceRecord {
                    input_length: 1500,
                    output_length: 1,
                    ..TraceRecord::default()
                },
                blocks: routed.blocks,
                block_tokens: 16,
                tail_hash: None,
                unique: tail,
                rehash: Some(Rehash {
                    endpoint: Endpoint::Completions,
                    body,
                    inspect: routing.clone(),
                }),
            });
        }
        drop(cap);
        let text = std::fs::read_to_string(&path).unwrap();
        let recs =
            headroom_workload::trace::read_jsonl(std::io::BufReader::new(text.as_bytes())).unwrap();
        assert_eq!(recs[0].hash_ids[..2], recs[1].hash_ids[..2]);
        assert_ne!(recs[0].hash_ids[2], recs[1].hash_ids[2]);
    }

    #[test]
    fn records_a_failing_disk_loses_are_each_counted_and_none_as_written() {
        // Every write to /dev/full fails with ENOSPC, when the buffer is flushed.
        if !Path::new("/dev/full").exists() {
            return;
        }
        let cfg = CaptureConfig {
            path: Some("/dev/full".into()),
            ..CaptureConfig::default()
        };
        let c = counters();
        let cap = Capture::start(&cfg, c.clone()).unwrap().unwrap();
        // Both reasons are there at 0 before any loss.
        let reasons = |c: &CaptureCounters| {
            use prometheus::core::Collector;
            c.dropped
                .collect()
                .iter()
                .map(|f| f.get_metric().len())
                .sum::<usize>()
        };
        assert_eq!(reasons(&c), 2);
        // More than the writer's buffer holds: lost at its own flushes too, each counted once.
        for i in 0..3000 {
            cap.submit(pending(i, SystemTime::now()));
        }
        cap.flush(Duration::from_secs(10));
        drop(cap);
        assert_eq!(c.written.get(), 0);
        assert_eq!(c.dropped.with_label_values(&["write_error"]).get(), 3000);
    }

    #[test]
    fn a_full_queue_drops_and_counts() {
        let scratch = tempfile::tempdir().expect("a scratch directory");
        let dir = scratch.path();
        let path = dir.join("t.jsonl");
        let cfg = CaptureConfig {
            path: Some(path.display().to_string()),
            buffer_records: 1,
            ..CaptureConfig::default()
        };
        let c = counters();
        let cap = Capture::start(&cfg, c.clone()).unwrap().unwrap();
        for i in 0..2000 {
            cap.submit(pending(i, SystemTime::now()));
        }
        drop(cap);
        let written = c.written.get();
        let dropped = c.dropped.with_label_values(&["buffer_full"]).get();
        assert_eq!(written + dropped, 2000);
        assert!(dropped > 0);
    }

    #[test]
    fn rotated_names_carry_the_utc_start() {
        let t = UNIX_EPOCH + Duration::from_secs(1_796_026_245); // 2026-11-30T08:10:45Z
        let p = rotated_name(Path::new("/nonexistent/x/trace.jsonl"), t);
        assert_eq!(p, Path::new("/nonexistent/x/trace.20261130T081045Z.jsonl"));
    }
}
