//! The real-time engine: one OS thread per replica runs the [`Core`] step by step, sleeping until
//! each step's modelled end, and hands tokens to the HTTP side over channels.
//!
//! A thread rather than a tokio task because tokio's timer has millisecond resolution and the
//! steps must fire within a millisecond of their modelled time; `thread::sleep` is accurate to
//! tens of microseconds. While busy, step k starts exactly when step k−1 was modelled to end, so
//! the small cost of the bookkeeping between steps never accumulates into drift. Requests and
//! cancellations reach the thread through an inbox it drains at each step boundary, as vLLM's
//! engine core picks up new requests between steps.
//!
//! With a per-request timer (`--latency-model fixed`) there are no steps: the thread sleeps until
//! the next token any request is due (or until a request arrives), emits every token due by then
//! and every decode token due within [`EMIT_WINDOW`] after it, each stamped with its own due
//! instant, and admits arrivals (and requests that blocks freed by finished ones now fit) as soon
//! as it is back at the top of its loop. The window bounds the wake-ups: one per token cost two
//! context switches each (engine, then the HTTP worker), which at 20,000 tokens/s took two thirds
//! of a core. A first token never leaves early, so TTFT is exact; a later one leaves at most the
//! window early. A wake-up late by more than an ITL sends a request's missed tokens together
//! (stamped with their due instants); `headroom_sim_step_lateness_seconds` records each wake-up's
//! lateness.
//!
//! On a busy machine a sleeping thread can wake milliseconds late, so the engine thread asks for
//! the lowest real-time priority (SCHED_FIFO 1) when it may (root or CAP_SYS_NICE); it sleeps for
//! nearly all of every step, so it takes little from other work. Refused, it runs as a normal
//! thread and `headroom_sim_step_lateness_seconds` shows the cost.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use tokio::sync::mpsc;

use crate::core::{Core, NewRequest, Output};
use crate::kv::KvEvent;
use crate::metrics::Metrics;

/// A batch of KV events from one step: (wall-clock seconds since the Unix epoch, events).
pub type KvBatch = (f64, Vec<KvEvent>);

/// Per-request timing: decode tokens due this soon after a wake-up leave with it.
const EMIT_WINDOW: Duration = Duration::from_micros(250);

/// Past this much lateness the timeline restarts from now instead of catching up in a burst.
const MAX_CATCH_UP: Duration = Duration::from_millis(20);

#[derive(Debug, Default)]
struct Inbox {
    submits: Vec<(NewRequest, Instant, mpsc::UnboundedSender<Output>)>,
    aborts: Vec<u64>,
    reset_prefix_cache: bool,
    shutdown: bool,
}

impl Inbox {
    fn is_empty(&self) -> bool {
        self.submits.is_empty()
            && self.aborts.is_empty()
            && !self.reset_prefix_cache
            && !self.shutdown
    }
}

#[derive(Debug)]
struct Shared {
    inbox: Mutex<Inbox>,
    wake: Condvar,
    next_key: AtomicU64,
    /// Requests the core has waiting plus those still in the inbox (for the queue cap).
    waiting: AtomicUsize,
    /// Set when the engine thread has exited (shut down or panicked): the replica is dead.
    dead: AtomicBool,
    epoch: Instant,
}

/// Marks the engine dead when its thread ends, however it ends, and closes every request still
/// in the inbox so no handler waits for an engine that is gone.
struct DeadOnExit<'a>(&'a Shared);

impl Drop for DeadOnExit<'_> {
    fn drop(&mut self) {
        self.0.dead.store(true, Ordering::SeqCst);
        self.0.inbox().submits.clear();
    }
}

impl Shared {
    fn inbox(&self) -> MutexGuard<'_, Inbox> {
        // A poisoned inbox means the engine thread panicked; keep serving what can be served.
        self.inbox.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Handle to a running engine; cheap to clone. Dropping the last [`Engine`] stops the thread.
#[derive(Debug, Clone)]
pub struct EngineHandle {
    shared: Arc<Shared>,
    metrics: Metrics,
}

/// Owns the engine thread.
#[derive(Debug)]
pub struct Engine {
    handle: EngineHandle,
    thread: Option<JoinHandle<()>>,
}

impl Engine {
    /// Starts the engine thread for `core`; KV events go to `kv_sink` when given; `realtime` asks
    /// for real-time scheduling of the thread.
    pub fn start(
        core: Core,
        kv_sink: Option<std::sync::mpsc::Sender<KvBatch>>,
        name: &str,
        realtime: bool,
    ) -> Self {
        let shared = Arc::new(Shared {
            inbox: Mutex::new(Inbox::default()),
            wake: Condvar::new(),
            next_key: AtomicU64::new(1),
            waiting: AtomicUsize::new(0),
            dead: AtomicBool::new(false),
            epoch: Instant::now(),
        });
        let handle = EngineHandle {
            shared: shared.clone(),
            metrics: core.metrics().clone(),
        };
        let thread = std::thread::Builder::new()
            .name(format!("engine-{name}"))
            .spawn(move || {
                if realtime && !headroom_workload::realtime::raise_current_thread() {
                    tracing::debug!(
                        "engine thread stays at normal priority (real-time scheduling refused)"
                    );
                }
                if core.is_per_request() {
                    run_per_request(&shared, core, kv_sink);
                } else {
                    run(&shared, core, kv_sink);
                }
            })
            .expect("spawning the engine thread");
        Self {
            handle,
            thread: Some(thread),
        }
    }

    /// A handle for request handlers.
    pub fn handle(&self) -> EngineHandle {
        self.handle.clone()
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.handle.shared.inbox().shutdown = true;
        self.handle.shared.wake.notify_one();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// A submitted request: its outputs arrive on `outputs`; dropping it before the last output
/// cancels the request in the engine (a client that went away frees its KV blocks).
#[derive(Debug)]
pub struct Submission {
    /// The engine key.
    pub key: u64,
    /// Tokens as they are produced; the last carries `finish`.
    pub outputs: mpsc::UnboundedReceiver<Output>,
    cancel: CancelOnDrop,
}

impl Submission {
    /// Marks the request as complete so that dropping it cancels nothing.
    pub fn finished(&mut self) {
        self.cancel.armed = false;
    }
}

#[derive(Debug)]
struct CancelOnDrop {
    key: u64,
    shared: Arc<Shared>,
    armed: bool,
}

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        if self.armed {
            self.shared.inbox().aborts.push(self.key);
            self.shared.wake.notify_one();
        }
    }
}

impl EngineHandle {
    /// A fresh request key.
    pub fn next_key(&self) -> u64 {
        self.shared.next_key.fetch_add(1, Ordering::Relaxed)
    }

    /// Whether the engine thread is still running.
    pub fn is_alive(&self) -> bool {
        !self.shared.dead.load(Ordering::SeqCst)
    }

    /// Requests waiting for a slot (engine queue and not yet picked up).
    pub fn waiting(&self) -> usize {
        self.shared.waiting.load(Ordering::Relaxed) + self.shared.inbox().submits.len()
    }

    /// The replica's metrics.
    pub fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    /// Hands a request (with `req.key` from [`Self::next_key`]) to the engine.
    pub fn submit(&self, req: NewRequest) -> Submission {
        let (tx, rx) = mpsc::unbounded_channel();
        let key = req.key;
        if self.is_alive() {
            self.shared.inbox().submits.push((req, Instant::now(), tx));
        }
        self.shared.wake.notify_one();
        Submission {
            key,
            outputs: rx,
            cancel: CancelOnDrop {
                key,
                shared: self.shared.clone(),
                armed: true,
            },
        }
    }

    /// Asks the engine to drop its prefix cache at the next step boundary.
    pub fn reset_prefix_cache(&self) {
        self.shared.inbox().reset_prefix_cache = true;
        self.shared.wake.notify_one();
    }
}

/// Hands what the inbox holds to the core; false when the engine is to shut down.
fn drain_inbox(
    shared: &Shared,
    core: &mut Core,
    senders: &mut HashMap<u64, mpsc::UnboundedSender<Output>>,
) -> bool {
    let since_epoch = |t: Instant| t.saturating_duration_since(shared.epoch);
    let inbox = std::mem::take(&mut *shared.inbox());
    if inbox.shutdown {
        return false;
    }
    for (req, arrived, tx) in inbox.submits {
        senders.insert(req.key, tx);
        core.submit(req, since_epoch(arrived));
    }
    for key in inbox.aborts {
        senders.remove(&key);
        core.abort(key, since_epoch(Instant::now()));
    }
    if inbox.reset_prefix_cache {
        core.reset_prefix_cache();
    }
    shared.waiting.store(core.num_waiting(), Ordering::Relaxed);
    true
}

/// Sends each output to its request's handler; requests whose handler has gone are aborted.
fn deliver(
    core: &mut Core,
    senders: &mut HashMap<u64, mpsc::UnboundedSender<Output>>,
    outputs: &mut Vec<Output>,
    at: Duration,
) {
    let mut gone = Vec::new();
    for out in outputs.drain(..) {
        let key = out.key;
        let last = out.finish.is_some();
        match senders.get(&key) {
            Some(tx) if tx.send(out).is_err() => gone.push(key),
            Some(_) if last => {
                senders.remove(&key);
            }
            _ => {}
        }
    }
    for key in gone {
        senders.remove(&key);
        core.abort(key, at);
    }
}

fn run(shared: &Shared, mut core: Core, kv_sink: Option<std::sync::mpsc::Sender<KvBatch>>) {
    let _dead_on_exit = DeadOnExit(shared);
    let mut senders: HashMap<u64, mpsc::UnboundedSender<Output>> = HashMap::new();
    let mut outputs = Vec::new();
    // End of the last step while the engine is busy; None when idle.
    let mut timeline: Option<Instant> = None;
    let since_epoch = |t: Instant| t.saturating_duration_since(shared.epoch);
    loop {
        if !drain_inbox(shared, &mut core, &mut senders) {
            return;
        }

        let step = core.schedule();
        // Requests admitted by this step are no longer waiting.
        shared.waiting.store(core.num_waiting(), Ordering::Relaxed);
        let Some(step) = step else {
            timeline = None;
            publish(&mut core, kv_sink.as_ref());
            let mut inbox = shared.inbox();
            while inbox.is_empty() {
                inbox = shared.wake.wait(inbox).unwrap_or_else(|e| e.into_inner());
            }
            continue;
        };
        let now = Instant::now();
        let start = match timeline {
            Some(t) if now.saturating_duration_since(t) < MAX_CATCH_UP => t,
            _ => now,
        };
        let deadline = start + step.duration;
        let before = Instant::now();
        if deadline > before {
            std::thread::sleep(deadline - before);
        }
        core.metrics().step_lateness.observe(
            Instant::now()
                .saturating_duration_since(deadline)
                .as_secs_f64(),
        );
        core.complete(step, since_epoch(deadline), &mut outputs);
        deliver(&mut core, &mut senders, &mut outputs, since_epoch(deadline));
        publish(&mut core, kv_sink.as_ref());
        timeline = Some(deadline);
    }
}

/// The loop of a per-request timer: no steps, every request on its own clock.
fn run_per_request(
    shared: &Shared,
    mut core: Core,
    kv_sink: Option<std::sync::mpsc::Sender<KvBatch>>,
) {
    let _dead_on_exit = DeadOnExit(shared);
    let mut senders: HashMap<u64, mpsc::UnboundedSender<Output>> = HashMap::new();
    let mut outputs = Vec::new();
    let since_epoch = |t: Instant| t.saturating_duration_since(shared.epoch);
    loop {
        if !drain_inbox(shared, &mut core, &mut senders) {
            return;
        }
        core.admit_per_request(since_epoch(Instant::now()));
        shared.waiting.store(core.num_waiting(), Ordering::Relaxed);
        publish(&mut core, kv_sink.as_ref());

        // Sleep until the next token is due, waking early for anything that arrives.
        let due = core.next_due().map(|d| shared.epoch + d);
        let mut inbox = shared.inbox();
        while inbox.is_empty() {
            match due {
                None => inbox = shared.wake.wait(inbox).unwrap_or_else(|e| e.into_inner()),
                Some(due) => {
                    let now = Instant::now();
                    if now >= due {
                        break;
                    }
                    inbox = shared
                        .wake
                        .wait_timeout(inbox, due - now)
                        .unwrap_or_else(|e| e.into_inner())
                        .0;
                }
            }
        }
        drop(inbox);
        let Some(due) = due.filter(|&d| Instant::now() >= d) else {
            continue; // woken by an arrival or a cancellation before anything was due
        };
        let now = Instant::now();
        core.metrics()
            .step_lateness
            .observe(now.saturating_duration_since(due).as_secs_f64());
        core.emit_due(since_epoch(now), EMIT_WINDOW, &mut outputs);
        deliver(&mut core, &mut senders, &mut outputs, since_epoch(now));
        publish(&mut core, kv_sink.as_ref());
    }
}

fn publish(core: &mut Core, sink: Option<&std::sync::mpsc::Sender<KvBatch>>) {
    let events = core.take_kv_events();
    if let Some(sink) = sink {
        if !events.is_empty() {
            let ts = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0.0, |d| d.as_secs_f64());
            let _ = sink.send((ts, events));
        }
    }
}
