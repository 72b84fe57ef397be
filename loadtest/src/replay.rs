//! Trace replay: turns trace records into requests and sends them open-loop (at the trace's own
//! timestamps, or at a Poisson/gamma rate) or closed-loop (fixed concurrency).
//!
//! Open-loop sends are released by a dedicated OS thread that hands each request to the async
//! runtime shortly before its time and sleeps until the time itself to let it go: a late response
//! never delays a later send (no coordinated omission), a thread's sleep is accurate to tens of
//! microseconds where the async timer rounds to milliseconds, and no task spins while it waits.
//! Each request's actual send time is recorded beside its schedule.
//!
//! | arrivals | gap before request k |
//! |---|---|
//! | trace | `(timestamp_k − timestamp_0) · time_scale` |
//! | rate R, burstiness b | Gamma(shape b, scale 1/(R·b)); b = 1 is Poisson (vLLM bench's definition) |
//! | concurrency N | none: N clients, each sending when its last request ended |

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use headroom_workload::trace::TraceRecord;
use rand::SeedableRng;
use rand::rngs::StdRng;
use rand_distr::{Distribution, Gamma};
use serde_json::{Value, json};

use crate::client::{Failure, Release, Timing, Trigger, send_streaming_at, send_streaming_with};
use crate::synth::{Endpoint, prompt_for};

/// How requests arrive.
#[derive(Debug, Clone, PartialEq)]
pub enum Arrivals {
    /// At the trace's timestamps, stretched by `time_scale` (0.5 = twice as fast).
    Trace {
        /// Multiplier on the trace's gaps.
        time_scale: f64,
    },
    /// At a mean rate with gamma-distributed gaps.
    Rate {
        /// Requests per second.
        rate: f64,
        /// Gamma shape: 1 is Poisson, below 1 burstier, above 1 smoother.
        burstiness: f64,
    },
    /// A fixed number of requests in flight.
    Concurrency(usize),
}

/// What to replay and how.
#[derive(Debug, Clone)]
pub struct ReplayOptions {
    /// Base URLs of the targets; request k goes to `targets[k % len]` (several replicas without a
    /// proxy in front are visited round-robin).
    pub targets: Vec<String>,
    /// Endpoint the prompts are rendered for.
    pub endpoint: Endpoint,
    /// `model` sent with each request (None: omitted).
    pub model: Option<String>,
    /// Arrival process.
    pub arrivals: Arrivals,
    /// Stop sending after this long.
    pub duration: Option<Duration>,
    /// Leading requests whose numbers are discarded.
    pub warmup: usize,
    /// Seed of the arrival process and of the prompt text.
    pub seed: u64,
    /// Mixed into every prompt's text: a fresh salt per run keeps a run from hitting the cache an
    /// earlier run warmed (the contract records it, so a run can be repeated exactly).
    pub prompt_salt: u64,
    /// Send times, one per record, in time order, when the caller planned them (a shard of a
    /// larger plan); None: planned here from `arrivals`.
    pub plan: Option<Vec<Duration>>,
    /// Row of the whole trace each record is (a shard's rows); None: record i is row i.
    pub rows: Option<Vec<usize>>,
    /// Give up on a request after this long.
    pub timeout: Duration,
    /// Prefix of every `x-request-id`.
    pub run_id: String,
    /// Extra headers sent with every request (e.g. the proxy's class header).
    pub headers: Vec<(String, String)>,
    /// Open loop: send each request's headers and body up to its last byte ahead of its time and
    /// the last byte on time, so that the server holds a burst of large requests complete on
    /// schedule; send times and client timings then start at the last byte.
    pub prestage: bool,
    /// Set to stop the run early (an interrupt): nothing more is sent, the requests in flight
    /// get [`STOP_GRACE`] to finish, and what finished is returned.
    pub stop: Arc<AtomicBool>,
}

/// The latest send time a schedule keeps (ten years).
const LATEST_SEND: Duration = Duration::from_secs(10 * 365 * 24 * 3600);

/// How long the requests in flight may still finish once a run is stopped; the rest are cut and
/// left out of its results.
pub const STOP_GRACE: Duration = Duration::from_secs(5);

/// One request's outcome with its place in the plan.
#[derive(Debug, Clone)]
pub struct RequestResult {
    /// Row of the whole trace.
    pub index: usize,
    /// The `x-request-id` sent.
    pub request_id: String,
    /// Planned send time from the start of the run (open loop only).
    pub scheduled: Option<Duration>,
    /// Actual send time from the start of the run.
    pub sent: Duration,
    /// Discarded as warm-up.
    pub warmup: bool,
    /// Contracted prompt tokens.
    pub input_length: u32,
    /// Contracted output tokens.
    pub output_length: u32,
    /// What the client measured.
    pub timing: Timing,
}

/// Live counts for a progress display.
#[derive(Debug, Default)]
pub struct Counters {
    /// Sent so far.
    pub sent: AtomicUsize,
    /// Finished so far.
    pub done: AtomicUsize,
    /// Failed so far.
    pub failed: AtomicUsize,
}

/// `x-request-id` and the configured extra headers.
fn request_headers<'a>(opts: &'a ReplayOptions, request_id: &'a str) -> Vec<(&'a str, &'a str)> {
    let mut h = vec![("x-request-id", request_id)];
    h.extend(opts.headers.iter().map(|(k, v)| (k.as_str(), v.as_str())));
    h
}

/// The request body for a record.
pub fn body_for(record: &TraceRecord, opts: &ReplayOptions) -> Value {
    let text = prompt_for(record, opts.endpoint, opts.seed ^ opts.prompt_salt);
    let max_tokens = record.output_length.max(1);
    let mut body = match opts.endpoint {
        Endpoint::Chat => {
            json!({"messages": [{"role": "user", "content": text}], "max_completion_tokens": max_tokens})
        }
        Endpoint::Completions => json!({"prompt": text, "max_tokens": max_tokens}),
    };
    let obj = body.as_object_mut().expect("a JSON object");
    if let Some(m) = &opts.model {
        obj.insert("model".into(), json!(m));
    }
    obj.insert("stream".into(), json!(true));
    obj.insert("stream_options".into(), json!({"include_usage": true}));
    obj.insert("ignore_eos".into(), json!(true));
    obj.insert("temperature".into(), json!(0));
    body
}

/// Planned send offsets for open-loop arrivals (None for closed loop).
/// `s` seconds as a duration; beyond what a duration holds, the longest one (a run that long is
/// refused by its caller, never waited out).
fn seconds(s: f64) -> Duration {
    Duration::try_from_secs_f64(s).unwrap_or(Duration::MAX)
}

pub fn schedule(records: &[TraceRecord], arrivals: &Arrivals, seed: u64) -> Option<Vec<Duration>> {
    match arrivals {
        Arrivals::Trace { time_scale } => {
            let t0 = records.first().map_or(0, |r| r.timestamp);
            Some(
                records
                    .iter()
                    .map(|r| seconds((r.timestamp - t0) as f64 / 1e3 * time_scale))
                    .collect(),
            )
        }
        Arrivals::Rate { rate, burstiness } => {
            let mut rng = StdRng::seed_from_u64(seed ^ 0x5EED_A77E);
            let gamma = Gamma::new(*burstiness, 1.0 / (rate * burstiness)).ok()?;
            let mut t = 0.0;
            Some(
                records
                    .iter()
                    .enumerate()
                    .map(|(i, _)| {
                        if i > 0 {
                            t += gamma.sample(&mut rng);
                        }
                        seconds(t)
                    })
                    .collect(),
            )
        }
        Arrivals::Concurrency(_) => None,
    }
}

/// Bodies prepared ahead of their send time.
const LOOKAHEAD: usize = 256;
/// The body builder keeps off the core from this long before a send is due ...
const BUILDER_QUIET_BEFORE: Duration = Duration::from_millis(20);
/// ... until this long after it: a slice the builder is given while the sends of a burst wait to
/// go out delays them by milliseconds.
const BUILDER_QUIET_AFTER: Duration = Duration::from_millis(3);
/// How long after the last send's time the dispatcher thread stays (asleep) before it exits.
const DISPATCHER_LINGER: Duration = Duration::from_millis(20);
/// The builder only keeps off while at least this many bodies are ready.
const BUILDER_MIN_AHEAD: usize = 32;
/// How long before its time a request is handed to the runtime: a prestaged one sends its head
/// meanwhile; each then waits, asleep, for the dispatcher to let it go at its time.
const EARLY_RELEASE: Duration = Duration::from_millis(10);

struct Shared {
    client: reqwest::Client,
    urls: Vec<String>,
    records: Vec<TraceRecord>,
    opts: ReplayOptions,
    counters: Arc<Counters>,
    start: Instant,
}

/// The serialized body of request `index`.
fn body_bytes(shared: &Shared, index: usize) -> bytes::Bytes {
    bytes::Bytes::from(
        serde_json::to_vec(&body_for(&shared.records[index], &shared.opts)).unwrap_or_default(),
    )
}

/// Sends request `index` with its prepared body when its release comes (open loop; prestaged, the
/// body's last byte waits for it) or at once (closed loop); the send time is taken just before the
/// POST (prestaged: when the last byte went).
async fn send_one(
    shared: Arc<Shared>,
    index: usize,
    scheduled: Option<Duration>,
    release: Option<Release>,
    body: bytes::Bytes,
) -> RequestResult {
    let when = scheduled.map(|at| shared.start + at);
    let (release, prestaged) = match release {
        Some(r) if shared.opts.prestage => (None, Some(r)),
        other => (other, None),
    };
    if let Some(release) = release {
        release.wait().await;
    }
    let record = &shared.records[index];
    let row = shared.opts.rows.as_ref().map_or(index, |rows| rows[index]);
    let url = &shared.urls[row % shared.urls.len()];
    let request_id = format!("{}-{row}", shared.opts.run_id);
    let started = Instant::now();
    shared.counters.sent.fetch_add(1, Ordering::Relaxed);
    let headers = request_headers(&shared.opts, &request_id);
    let exchange = async {
        match prestaged {
            Some(release) => send_streaming_at(&shared.client, url, body, &headers, release).await,
            None => (
                send_streaming_with(&shared.client, url, body, &headers).await,
                started,
            ),
        }
    };
    let (timing, sent_at) = match tokio::time::timeout(shared.opts.timeout, exchange).await {
        Ok(t) => t,
        Err(_) => (
            Timing {
                failure: Some(Failure::Timeout(format!(
                    "no answer within {:?}",
                    shared.opts.timeout
                ))),
                e2e: shared.opts.timeout,
                target: url.clone(),
                ..Timing::default()
            },
            when.map_or(started, |w| w.max(started)),
        ),
    };
    let sent = sent_at.saturating_duration_since(shared.start);
    if !timing.ok() {
        shared.counters.failed.fetch_add(1, Ordering::Relaxed);
    }
    shared.counters.done.fetch_add(1, Ordering::Relaxed);
    RequestResult {
        index: row,
        request_id,
        scheduled,
        sent,
        warmup: row < shared.opts.warmup,
        input_length: record.input_length,
        output_length: record.output_length,
        timing,
    }
}

/// Replays `records` against the target; returns one result per request sent, in trace order.
/// How long after the call [`run`] starts its clock: open-loop schedules start a moment after
/// now, so the body builder is ahead from the first send; a closed loop starts at once.
pub fn start_lead(open_loop: bool) -> Duration {
    if open_loop {
        Duration::from_millis(200)
    } else {
        Duration::ZERO
    }
}

pub async fn run(
    records: Vec<TraceRecord>,
    opts: ReplayOptions,
    counters: Arc<Counters>,
) -> Vec<RequestResult> {
    let concurrency = match opts.arrivals {
        Arrivals::Concurrency(n) => n.max(1),
        _ => 1024,
    };
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(concurrency)
        .build()
        .unwrap_or_default();
    let urls: Vec<String> = opts
        .targets
        .iter()
        .map(|t| format!("{}{}", t.trim_end_matches('/'), opts.endpoint.path()))
        .collect();
    let plan = match (&opts.arrivals, &opts.plan) {
        (Arrivals::Concurrency(_), _) => None,
        (_, Some(p)) => Some(p.clone()),
        (arrivals, None) => schedule(&records, arrivals, opts.seed),
    }
    // Send times are added to instants: a schedule past any run's end (a rate of 1e-20 under a
    // --duration) is cut to a time an instant holds, which the run's end comes before.
    .map(|p| {
        p.into_iter()
            .map(|at| at.min(LATEST_SEND))
            .collect::<Vec<_>>()
    });
    let lead = start_lead(plan.is_some());
    let shared = Arc::new(Shared {
        client,
        urls,
        records,
        opts,
        counters,
        start: Instant::now() + lead,
    });
    let deadline = shared.opts.duration.map(|d| shared.start + d);
    let mut results = match plan {
        Some(offsets) => open_loop(shared.clone(), offsets, deadline).await,
        None => closed_loop(shared.clone(), concurrency, deadline).await,
    };
    results.sort_by_key(|r| r.index);
    results
}

async fn open_loop(
    shared: Arc<Shared>,
    offsets: Vec<Duration>,
    deadline: Option<Instant>,
) -> Vec<RequestResult> {
    let (tx, mut rx) =
        tokio::sync::mpsc::unbounded_channel::<tokio::task::JoinHandle<RequestResult>>();
    let runtime = tokio::runtime::Handle::current();
    // A builder thread prepares bodies ahead (bounded) so that bursts of simultaneous arrivals are
    // released on time; the dispatcher thread only sleeps and releases.
    let (ready_tx, ready_rx) =
        std::sync::mpsc::sync_channel::<(usize, Duration, bytes::Bytes)>(LOOKAHEAD);
    // The index of the next request the dispatcher will hand over.
    let released = Arc::new(AtomicUsize::new(0));
    let builder = {
        let shared = shared.clone();
        let released = released.clone();
        std::thread::Builder::new()
            .name("replay-build".into())
            .spawn(move || {
                // Bodies are built up to LOOKAHEAD ahead, so the builder can wait: it must not
                // take the core from the sends of a burst (each send frees a place it refills).
                // It keeps off by sleeping, in the normal scheduling class: in the idle class it
                // starved on a saturated core, the dispatcher ran dry and sends went late.
                for (index, &at) in offsets.iter().enumerate() {
                    if deadline.is_some_and(|d| shared.start + at > d) || stopped(&shared) {
                        break;
                    }
                    keep_off_sends(&shared, &offsets, &released, index);
                    if ready_tx
                        .send((index, at, body_bytes(&shared, index)))
                        .is_err()
                    {
                        break;
                    }
                }
            })
            .expect("spawning the replay body builder")
    };
    let dispatcher = {
        let shared = shared.clone();
        std::thread::Builder::new()
            .name("replay-dispatch".into())
            .spawn(move || {
                // Refused without privileges; the send lateness in the summary shows the cost.
                headroom_workload::realtime::raise_current_thread();
                dispatch(&shared, &runtime, &ready_rx, &released, &tx);
            })
            .expect("spawning the replay dispatcher")
    };
    let mut handles = Vec::new();
    while let Some(h) = rx.recv().await {
        handles.push(h);
    }
    let _ = builder.join();
    let _ = dispatcher.join();
    let mut out = Vec::with_capacity(handles.len());
    let mut grace = None;
    for mut h in handles {
        if stopped(&shared) {
            let until = *grace.get_or_insert_with(|| tokio::time::Instant::now() + STOP_GRACE);
            match tokio::time::timeout_at(until, &mut h).await {
                Ok(Ok(r)) => out.push(r),
                Ok(Err(_)) => {}
                Err(_) => h.abort(),
            }
        } else if let Ok(r) = h.await {
            out.push(r);
        }
    }
    out
}

/// Whether the run was stopped early.
fn stopped(shared: &Shared) -> bool {
    shared.opts.stop.load(Ordering::Relaxed)
}

/// The dispatcher thread's loop: hands each prepared request to the runtime [`EARLY_RELEASE`]
/// before its time, then fires its release at the time itself, sleeping in between; the two
/// interleave, since a request is handed over while earlier ones still wait for their time.
fn dispatch(
    shared: &Arc<Shared>,
    runtime: &tokio::runtime::Handle,
    ready: &std::sync::mpsc::Receiver<(usize, Duration, bytes::Bytes)>,
    released: &AtomicUsize,
    tasks: &tokio::sync::mpsc::UnboundedSender<tokio::task::JoinHandle<RequestResult>>,
) {
    use std::sync::mpsc::RecvTimeoutError;
    // Handed over, not yet let go; in time order, as the plan is.
    let mut waiting: VecDeque<Trigger> = VecDeque::new();
    let mut next = None;
    let mut more = true;
    let mut last_due = None;
    loop {
        if stopped(shared) {
            // Requests handed over but not let go wait for their time on the runtime's timer.
            return;
        }
        if next.is_none() && more {
            // Waiting for the builder must not hold back a release that falls due meanwhile.
            let got = match waiting.front() {
                None => ready.recv().map_err(|_| RecvTimeoutError::Disconnected),
                Some(t) => ready.recv_timeout(t.at().saturating_duration_since(Instant::now())),
            };
            match got {
                Ok(item) => next = Some(item),
                Err(RecvTimeoutError::Disconnected) => more = false,
                Err(RecvTimeoutError::Timeout) => {}
            }
        }
        let hand_over_at = next.as_ref().map(|(_, at, _)| {
            (shared.start + *at)
                .checked_sub(EARLY_RELEASE)
                .unwrap_or(shared.start)
        });
        // Nothing to hand over and nothing waiting happens only once the builder is done.
        let Some(first) = hand_over_at
            .into_iter()
            .chain(waiting.front().map(Trigger::at))
            .min()
        else {
            break;
        };
        sleep_until(first);
        let now = Instant::now();
        while waiting.front().is_some_and(|t| t.at() <= now) {
            if let Some(t) = waiting.pop_front() {
                t.fire();
            }
        }
        if let Some((index, at, body)) = next.take_if(|_| hand_over_at.is_some_and(|h| h <= now)) {
            let (release, trigger) = Release::new(shared.start + at);
            let task = runtime.spawn(send_one(
                shared.clone(),
                index,
                Some(at),
                Some(release),
                body,
            ));
            released.store(index + 1, Ordering::Release);
            // Plans are in time order, so this is the back; a plan that is not still fires in order.
            let place = waiting.partition_point(|t| t.at() <= trigger.at());
            waiting.insert(place, trigger);
            last_due = Some(shared.start + at);
            if tasks.send(task).is_err() {
                break;
            }
        }
    }
    // This thread's exit (at real-time priority) and the collector it wakes must not take the
    // core while the last burst's sends wait to go out.
    if let Some(due) = last_due {
        sleep_until(due + DISPATCHER_LINGER);
    }
}

/// Sleeps the current thread until `t` (not at all when it has passed).
fn sleep_until(t: Instant) {
    let now = Instant::now();
    if t > now {
        std::thread::sleep(t - now);
    }
}

/// Holds the body builder, about to build body `index`, while [`builder_pause`] says so.
fn keep_off_sends(shared: &Shared, offsets: &[Duration], released: &AtomicUsize, index: usize) {
    loop {
        let next = released.load(Ordering::Acquire);
        let due = |i: usize| offsets.get(i).map(|&at| shared.start + at);
        let last_due = next.checked_sub(1).and_then(due);
        match builder_pause(Instant::now(), index - next.min(index), last_due, due(next)) {
            Some(pause) => std::thread::sleep(pause),
            None => return,
        }
    }
}

/// How long the body builder waits before building its next body, `ahead` bodies ahead of the
/// dispatcher, when the last request handed over was due at `last_due` and the next is due at
/// `next_due`: while a send is near (from [`BUILDER_QUIET_BEFORE`] before the next one is due to
/// [`BUILDER_QUIET_AFTER`] after either is), in slices of at most 1 ms so that it sees the
/// dispatcher move on; never while fewer than [`BUILDER_MIN_AHEAD`] bodies are ready (a dense
/// schedule always has a send near, and the dispatcher must not run dry).
fn builder_pause(
    now: Instant,
    ahead: usize,
    last_due: Option<Instant>,
    next_due: Option<Instant>,
) -> Option<Duration> {
    if ahead < BUILDER_MIN_AHEAD {
        return None;
    }
    let after_last = last_due
        .map(|d| d + BUILDER_QUIET_AFTER)
        .filter(|&end| now < end);
    let around_next = next_due
        .filter(|&d| now >= d.checked_sub(BUILDER_QUIET_BEFORE).unwrap_or(d))
        .map(|d| d + BUILDER_QUIET_AFTER)
        .filter(|&end| now < end);
    let end = after_last.into_iter().chain(around_next).max()?;
    Some((end - now).min(Duration::from_millis(1)))
}

async fn closed_loop(
    shared: Arc<Shared>,
    concurrency: usize,
    deadline: Option<Instant>,
) -> Vec<RequestResult> {
    let next = Arc::new(AtomicUsize::new(0));
    let done = Arc::new(std::sync::Mutex::new(Vec::new()));
    let mut workers = Vec::new();
    for _ in 0..concurrency {
        let shared = shared.clone();
        let next = next.clone();
        let done = done.clone();
        workers.push(tokio::spawn(async move {
            loop {
                if deadline.is_some_and(|d| Instant::now() >= d) || stopped(&shared) {
                    break;
                }
                let index = next.fetch_add(1, Ordering::Relaxed);
                if index >= shared.records.len() {
                    break;
                }
                let body = body_bytes(&shared, index);
                let result = send_one(shared.clone(), index, None, None, body).await;
                // Kept outside the worker: a worker cut after a stop loses only its request in flight.
                lock(&done).push(result);
            }
        }));
    }
    let mut grace = None;
    for mut w in workers {
        if stopped(&shared) {
            let until = *grace.get_or_insert_with(|| tokio::time::Instant::now() + STOP_GRACE);
            if tokio::time::timeout_at(until, &mut w).await.is_err() {
                w.abort();
            }
        } else {
            let _ = w.await;
        }
    }
    std::mem::take(&mut *lock(&done))
}

fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn recs(ts: &[u64]) -> Vec<TraceRecord> {
        ts.iter()
            .map(|&t| TraceRecord {
                timestamp: t,
                input_length: 10,
                output_length: 2,
                ..TraceRecord::default()
            })
            .collect()
    }

    #[test]
    fn schedules_beyond_what_a_duration_holds_saturate_instead_of_panicking() {
        let far = recs(&[0, u64::MAX / 2]);
        let plan = schedule(&far, &Arrivals::Trace { time_scale: 1e300 }, 1).unwrap();
        assert_eq!(plan, vec![Duration::ZERO, Duration::MAX]);
        let slow = Arrivals::Rate {
            rate: 1e-30,
            burstiness: 1.0,
        };
        let plan = schedule(&recs(&[0, 1, 2]), &slow, 1).unwrap();
        assert_eq!(plan[0], Duration::ZERO);
        assert_eq!(plan[2], Duration::MAX);
    }

    #[test]
    fn the_builder_keeps_off_the_core_around_sends_while_it_is_well_ahead() {
        let now = Instant::now();
        let ms = Duration::from_millis;
        let ahead = BUILDER_MIN_AHEAD;
        // The next send due in 5 ms: wait, in slices of 1 ms.
        assert_eq!(
            builder_pause(now, ahead, None, Some(now + ms(5))),
            Some(ms(1))
        );
        // The last released send was due 2 ms ago (its task is sending now): wait 1 ms more, even
        // with the next far off.
        assert_eq!(
            builder_pause(now + ms(2), ahead, Some(now), Some(now + ms(500))),
            Some(ms(1))
        );
        let end = builder_pause(
            now + ms(2) + Duration::from_micros(500),
            ahead,
            Some(now),
            None,
        );
        assert_eq!(end, Some(Duration::from_micros(500)));
        // Both far: build now.
        assert_eq!(
            builder_pause(now + ms(9), ahead, Some(now), Some(now + ms(500))),
            None
        );
        // Few bodies ready (a dense schedule, or the dispatcher waiting): build now, whatever is due.
        assert_eq!(
            builder_pause(now, ahead - 1, Some(now), Some(now + ms(1))),
            None
        );
        assert_eq!(builder_pause(now, 0, None, Some(now + ms(1))), None);
        // Every request released long ago.
        assert_eq!(builder_pause(now + ms(50), ahead, Some(now), None), None);
    }

    #[test]
    fn trace_arrivals_follow_timestamps_scaled() {
        let s = schedule(
            &recs(&[100, 100, 600, 1100]),
            &Arrivals::Trace { time_scale: 0.5 },
            0,
        )
        .unwrap();
        assert_eq!(
            s,
            vec![
                Duration::ZERO,
                Duration::ZERO,
                Duration::from_millis(250),
                Duration::from_millis(500)
            ]
        );
    }

    #[test]
    fn gamma_arrivals_have_the_asked_rate_and_burstiness() {
        let records = recs(&vec![0; 20_001]);
        let gaps = |b: f64| {
            let s = schedule(
                &records,
                &Arrivals::Rate {
                    rate: 50.0,
                    burstiness: b,
                },
                7,
            )
            .unwrap();
            let g: Vec<f64> = s.windows(2).map(|w| (w[1] - w[0]).as_secs_f64()).collect();
            let mean = g.iter().sum::<f64>() / g.len() as f64;
            let var = g.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / g.len() as f64;
            (mean, var.sqrt() / mean)
        };
        let (mean, cv) = gaps(1.0);
        assert!((mean - 0.02).abs() < 0.001, "{mean}");
        assert!((cv - 1.0).abs() < 0.05, "Poisson: cv 1, got {cv}");
        let (_, bursty) = gaps(0.25);
        assert!(
            (bursty - 2.0).abs() < 0.15,
            "gamma shape 0.25: cv 2, got {bursty}"
        );
        assert_eq!(schedule(&records[..3], &Arrivals::Concurrency(4), 0), None);
    }

    #[test]
    fn bodies_pin_output_length_and_stream_usage() {
        let r = TraceRecord {
            input_length: 30,
            output_length: 7,
            hash_ids: vec![1],
            ..TraceRecord::default()
        };
        let opts = ReplayOptions {
            targets: vec!["http://x".into()],
            endpoint: Endpoint::Chat,
            model: Some("m".into()),
            arrivals: Arrivals::Concurrency(1),
            duration: None,
            warmup: 0,
            seed: 0,
            prompt_salt: 0,
            plan: None,
            rows: None,
            timeout: Duration::from_secs(1),
            run_id: "r".into(),
            headers: Vec::new(),
            prestage: false,
            stop: Default::default(),
        };
        let b = body_for(&r, &opts);
        assert_eq!(b["max_completion_tokens"], 7);
        assert_eq!(b["ignore_eos"], true);
        assert_eq!(b["stream_options"]["include_usage"], true);
        assert_eq!(b["model"], "m");
        let b = body_for(
            &r,
            &ReplayOptions {
                endpoint: Endpoint::Completions,
                model: None,
                ..opts
            },
        );
        assert_eq!(b["max_tokens"], 7);
        assert!(b.get("model").is_none());
    }
}
