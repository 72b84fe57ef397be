//! The engine core: vLLM v1's scheduler over the KV block pool, stepping in modelled time. Pure and
//! synchronous: the real-time loop (`engine`) and tests both drive it, the latter with a virtual
//! clock.
//!
//! Each step (`vllm/v1/core/sched/scheduler.py`, `schedule()`):
//! 1. `budget = max_num_batched_tokens`.
//! 2. Running requests in order: `n = min(num_tokens − num_computed, budget,
//!    max_model_len − 1 − num_computed)`; if its slots cannot be allocated, preempt the most
//!    recently admitted running request (free its blocks, `num_computed = 0`, back to the head of
//!    the waiting queue, counted) and retry; stop if the victim is the request itself.
//! 3. Only if nothing was preempted: waiting requests from the head while budget remains and fewer
//!    than `max_num_seqs` run. Prefix hit = cached full blocks, capped at `num_tokens − 1`;
//!    `n = min(num_tokens − hit, budget)` (chunked prefill); allocation failure stops admission
//!    (head-of-line). Prefix-cache queries/hits are counted at the first admission only.
//! 4. At the step's end: `num_computed += n`; a request whose tokens are all computed samples one
//!    token; it finishes on EOS (after `min_tokens`, unless `ignore_eos`), `max_tokens` or
//!    `max_model_len`, and its blocks return to the pool, last block first.
//!
//! With a per-request timer (`StepTimer::Fixed`) there are no steps: [`Core::admit_per_request`]
//! admits waiting requests as step 3 does (whole prompt, no token budget), each due its first token
//! one TTFT after admission, and [`Core::emit_due`] produces the tokens that are due, each request
//! then due again one ITL later; a request whose next slot cannot be allocated is preempted itself.

use std::collections::{BTreeSet, HashMap, VecDeque};
use std::time::Duration;

use headroom_workload::tokenizer::piece_id;
use headroom_workload::words::{WORDS, spaced_word};
use headroom_workload::{BlockHash, BlockHasher};
use rand::SeedableRng;
use rand::rngs::StdRng;
use xxhash_rust::xxh3::xxh3_64_with_seed;

use crate::kv::{BlockId, BlockPool, KvEvent};
use crate::metrics::Metrics;
use crate::timing::{StepShape, StepTimer};

/// Engine limits and cache settings.
#[derive(Debug, Clone)]
pub struct CoreConfig {
    /// Tokens per KV block.
    pub block_size: u32,
    /// Blocks in the pool, including the null block.
    pub num_gpu_blocks: u64,
    /// Token budget per step.
    pub max_num_batched_tokens: u32,
    /// Most requests running at once.
    pub max_num_seqs: u32,
    /// Longest sequence (prompt + output).
    pub max_model_len: u32,
    /// Prefix caching on.
    pub enable_prefix_caching: bool,
    /// Seed of the block hash chain.
    pub hash_seed: u64,
    /// Record KV events for a publisher.
    pub record_kv_events: bool,
}

/// Why a request ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// End of sequence sampled.
    Stop,
    /// `max_tokens` or `max_model_len` reached.
    Length,
    /// Cancelled (client gone).
    Abort,
}

impl FinishReason {
    /// The OpenAI / vLLM string.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Stop => "stop",
            Self::Length => "length",
            Self::Abort => "abort",
        }
    }
}

/// A request handed to the engine (already validated and tokenized).
#[derive(Debug, Clone)]
pub struct NewRequest {
    /// Engine-wide key, unique per replica.
    pub key: u64,
    /// Prompt token ids.
    pub prompt: Vec<u32>,
    /// Output limit after vLLM's clamping.
    pub max_tokens: u32,
    /// Output tokens before EOS may be sampled.
    pub min_tokens: u32,
    /// Never sample EOS.
    pub ignore_eos: bool,
    /// Output length at which EOS is sampled (when not ignored).
    pub natural_len: u32,
    /// Seed of the generated text.
    pub seed: u64,
    /// Output token from which the text differs from what `seed` gives (a fault).
    pub perturb_from: Option<u32>,
    /// Bytes mixed into the first block hash (cache salt, LoRA).
    pub hash_extra: Vec<u8>,
}

/// One generated token, or the end of an aborted request.
#[derive(Debug, Clone, PartialEq)]
pub struct Output {
    /// The request.
    pub key: u64,
    /// Token text (empty for an abort).
    pub text: &'static str,
    /// Token id.
    pub token_id: u32,
    /// Output tokens so far, this one included.
    pub completion_tokens: u32,
    /// Prompt tokens.
    pub prompt_tokens: u32,
    /// Prompt tokens found in the prefix cache at first admission.
    pub cached_tokens: u32,
    /// Set on the last output of the request.
    pub finish: Option<FinishReason>,
    /// Engine time of the step that produced it.
    pub at: Duration,
}

#[derive(Debug)]
struct Seq {
    tokens: Vec<u32>,
    prompt_len: u32,
    max_tokens: u32,
    eos_at: Option<u32>,
    seed: u64,
    perturb_from: Option<u32>,
    hash_extra: Vec<u8>,
    hashes: Vec<BlockHash>,
    num_computed: u32,
    blocks: Vec<BlockId>,
    num_cached_blocks: usize,
    cached_tokens: Option<u32>,
    arrival: Duration,
    first_scheduled: Option<Duration>,
    first_token: Option<Duration>,
    last_token: Option<Duration>,
    /// Per-request timing: when its next token is due.
    due: Option<Duration>,
    /// Per-request timing: it waited for a slot, so its TTFT counts from admission, not arrival.
    held: bool,
}

impl Seq {
    fn num_tokens(&self) -> u32 {
        self.tokens.len() as u32
    }

    fn output_len(&self) -> u32 {
        self.num_tokens() - self.prompt_len
    }
}

/// A scheduled step: what runs, for how long.
#[derive(Debug, Clone)]
pub struct Step {
    /// Modelled duration.
    pub duration: Duration,
    /// What the step computes.
    pub shape: StepShape,
    scheduled: Vec<(u64, u32)>,
}

/// The scheduler, KV pool and clock-free bookkeeping of one replica.
#[derive(Debug)]
pub struct Core {
    cfg: CoreConfig,
    pool: BlockPool,
    hasher: BlockHasher,
    timer: StepTimer,
    rng: StdRng,
    seqs: HashMap<u64, Seq>,
    waiting: VecDeque<u64>,
    running: Vec<u64>,
    /// Per-request timing: (due, key) of every running request.
    dues: BTreeSet<(Duration, u64)>,
    word_ids: Vec<u32>,
    metrics: Metrics,
}

impl Core {
    /// A core with an empty cache.
    pub fn new(cfg: CoreConfig, timer: StepTimer, seed: u64, metrics: Metrics) -> Self {
        Self {
            pool: BlockPool::new(cfg.num_gpu_blocks as usize, cfg.record_kv_events),
            hasher: BlockHasher::new(cfg.block_size as usize, cfg.hash_seed),
            timer,
            rng: StdRng::seed_from_u64(seed),
            seqs: HashMap::new(),
            waiting: VecDeque::new(),
            running: Vec::new(),
            dues: BTreeSet::new(),
            word_ids: (0..WORDS.len() as u64)
                .map(|i| piece_id(spaced_word(i)))
                .collect(),
            metrics,
            cfg,
        }
    }

    /// The limits in force.
    pub fn config(&self) -> &CoreConfig {
        &self.cfg
    }

    /// The replica's metrics.
    pub fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    /// Whether requests run on their own clocks (no shared steps).
    pub fn is_per_request(&self) -> bool {
        self.timer.is_per_request()
    }

    /// Requests waiting (not yet running, or preempted).
    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }

    /// Requests running.
    pub fn num_running(&self) -> usize {
        self.running.len()
    }

    /// KV usage in [0, 1].
    pub fn kv_usage(&self) -> f64 {
        self.pool.usage()
    }

    /// Whether nothing is queued or running.
    pub fn is_idle(&self) -> bool {
        self.seqs.is_empty()
    }

    /// Block hashes of `prompt` as this replica computes them.
    pub fn block_hashes(&self, prompt: &[u32], extra: &[u8]) -> Vec<BlockHash> {
        self.hasher.hash_all(prompt, extra)
    }

    /// KV events recorded since the last call.
    pub fn take_kv_events(&mut self) -> Vec<KvEvent> {
        self.pool.take_events()
    }

    /// Resets the prefix cache when idle (vLLM's `/reset_prefix_cache`).
    pub fn reset_prefix_cache(&mut self) -> bool {
        self.pool.reset_prefix_cache()
    }

    /// Queues a request arriving at `now`.
    ///
    /// # Panics
    /// If the request cannot ever fit (prompt + max_tokens over `max_model_len`, or an empty
    /// prompt): callers validate first.
    pub fn submit(&mut self, req: NewRequest, now: Duration) {
        let prompt_len = req.prompt.len() as u32;
        assert!(prompt_len > 0, "empty prompt");
        assert!(
            prompt_len + req.max_tokens.max(1) <= self.cfg.max_model_len,
            "request over max_model_len"
        );
        let hashes = self.hasher.hash_all(&req.prompt, &req.hash_extra);
        let eos_at = (!req.ignore_eos).then(|| req.natural_len.max(req.min_tokens).max(1));
        let seq = Seq {
            tokens: req.prompt,
            prompt_len,
            max_tokens: req.max_tokens.max(1),
            eos_at,
            seed: req.seed,
            perturb_from: req.perturb_from,
            hash_extra: req.hash_extra,
            hashes,
            num_computed: 0,
            blocks: Vec::new(),
            num_cached_blocks: 0,
            cached_tokens: None,
            arrival: now,
            first_scheduled: None,
            first_token: None,
            last_token: None,
            due: None,
            held: false,
        };
        self.seqs.insert(req.key, seq);
        self.waiting.push_back(req.key);
        self.metrics.waiting.set(self.waiting.len() as i64);
    }

    /// Cancels a request wherever it is; returns its final output if it was still known.
    pub fn abort(&mut self, key: u64, now: Duration) -> Option<Output> {
        if !self.seqs.contains_key(&key) {
            return None;
        }
        if let Some(i) = self.running.iter().position(|&k| k == key) {
            self.running.remove(i);
        } else if let Some(i) = self.waiting.iter().position(|&k| k == key) {
            self.waiting.remove(i);
        }
        let out = self.finish(key, FinishReason::Abort, now, "", 0);
        self.update_gauges();
        Some(out)
    }

    /// Plans the next step, allocating its KV slots; `None` when there is nothing to run.
    pub fn schedule(&mut self) -> Option<Step> {
        let mut budget = self.cfg.max_num_batched_tokens;
        let mut scheduled: Vec<(u64, u32)> = Vec::new();
        let mut shape = StepShape::default();
        let mut preempted = false;

        let mut i = 0;
        while i < self.running.len() && budget > 0 {
            let key = self.running[i];
            let seq = &self.seqs[&key];
            let n = (seq.num_tokens() - seq.num_computed)
                .min(budget)
                .min(self.cfg.max_model_len - 1 - seq.num_computed);
            if n == 0 {
                i += 1;
                continue;
            }
            let mut self_preempted = false;
            while !self.allocate_slots(key, n, &[]) {
                let victim = self.running.pop().expect("the request itself is running");
                self.preempt(victim);
                preempted = true;
                if victim == key {
                    self_preempted = true;
                    break;
                }
            }
            if self_preempted {
                break;
            }
            self.add_to_shape(&mut shape, key, n);
            scheduled.push((key, n));
            budget -= n;
            i += 1;
        }

        if !preempted {
            while budget > 0 && self.running.len() < self.cfg.max_num_seqs as usize {
                let Some(&key) = self.waiting.front() else {
                    break;
                };
                let Some(n) = self.admit(key, budget) else {
                    break;
                };
                self.add_to_shape(&mut shape, key, n);
                scheduled.push((key, n));
                budget -= n;
            }
        }

        if scheduled.is_empty() {
            self.update_gauges();
            return None;
        }
        shape.running = self.running.len() as u64;
        self.update_gauges();
        let duration = self.timer.step_time(&shape, &mut self.rng);
        self.metrics.iteration_tokens.observe(shape.tokens as f64);
        Some(Step {
            duration,
            shape,
            scheduled,
        })
    }

    /// Moves the head of the waiting queue (`key`) to running if the first `budget` tokens of what
    /// its prefix-cache hit leaves to compute can be allocated; returns that count.
    fn admit(&mut self, key: u64, budget: u32) -> Option<u32> {
        let seq = &self.seqs[&key];
        let hit_blocks = if self.cfg.enable_prefix_caching {
            let usable = ((seq.num_tokens() - 1) / self.cfg.block_size) as usize;
            let mut hit = self
                .pool
                .lookup_prefix(&seq.hashes[..usable.min(seq.hashes.len())]);
            hit.truncate(usable);
            hit
        } else {
            Vec::new()
        };
        let hit_tokens = hit_blocks.len() as u32 * self.cfg.block_size;
        let n = (seq.num_tokens() - hit_tokens).min(budget);
        if !self.allocate_slots(key, n, &hit_blocks) {
            return None;
        }
        self.waiting.pop_front();
        let seq = self.seqs.get_mut(&key).expect("waiting request is known");
        seq.num_computed = hit_tokens;
        if seq.cached_tokens.is_none() {
            seq.cached_tokens = Some(hit_tokens);
            if self.cfg.enable_prefix_caching {
                let queried = u64::from(seq.num_tokens());
                self.metrics.prefix_queries.inc_by(queried);
                self.metrics.prefix_hits.inc_by(u64::from(hit_tokens));
            }
        }
        self.running.push(key);
        Some(n)
    }

    /// Per-request timing: admits waiting requests in order while they fit (KV blocks for the
    /// whole prompt, fewer than `max_num_seqs` running), each due its first token one TTFT after
    /// its arrival, or after `now` if it had to wait.
    pub fn admit_per_request(&mut self, now: Duration) {
        while self.running.len() < self.cfg.max_num_seqs as usize {
            let Some(&key) = self.waiting.front() else {
                break;
            };
            if self.admit(key, u32::MAX).is_none() {
                break;
            }
            let running = self.running.len() as u64;
            let delay = self
                .timer
                .per_request_interval(true, running, &mut self.rng);
            let seq = self.seqs.get_mut(&key).expect("admitted request is known");
            let start = if seq.held { now } else { seq.arrival };
            // A preempted request keeps its first admission (vLLM counts its queue time once).
            if seq.first_scheduled.is_none() {
                seq.first_scheduled = Some(start);
                self.metrics
                    .queue
                    .observe(start.saturating_sub(seq.arrival).as_secs_f64());
            }
            seq.due = Some(start + delay);
            self.dues.insert((start + delay, key));
        }
        for key in &self.waiting {
            if let Some(seq) = self.seqs.get_mut(key) {
                seq.held = true;
            }
        }
        self.update_gauges();
    }

    /// Per-request timing: the earliest instant a running request's next token is due.
    pub fn next_due(&self) -> Option<Duration> {
        self.dues.first().map(|&(due, _)| due)
    }

    /// Per-request timing: produces every token due at or before `now`, and every decode token
    /// due at or before `now + early` (a first token never leaves early), each stamped with its
    /// own due instant, appending them to `out`; each request is then due again one ITL later. A
    /// request whose next slot cannot be allocated is preempted; [`Self::admit_per_request`]
    /// takes it back when blocks come free.
    pub fn emit_due(&mut self, now: Duration, early: Duration, out: &mut Vec<Output>) {
        let decoding =
            |seq: &Seq| seq.first_token.is_some() && seq.num_computed + 1 == seq.num_tokens();
        let ready: Vec<(Duration, u64)> = self
            .dues
            .range(..=(now + early, u64::MAX))
            .filter(|&&(due, key)| due <= now || self.seqs.get(&key).is_some_and(decoding))
            .copied()
            .collect();
        for (due, key) in ready {
            self.dues.remove(&(due, key));
            let seq = self.seqs.get_mut(&key).expect("a due request is known");
            seq.due = None;
            let n = seq.num_tokens() - seq.num_computed;
            // Allocates nothing for a first token (admission did) and one slot for a later one.
            if !self.allocate_slots(key, n, &[]) {
                self.running.retain(|&k| k != key);
                self.preempt(key);
                continue;
            }
            if !self.compute(key, n, due, out) {
                let running = self.running.len() as u64;
                let next = due
                    + self
                        .timer
                        .per_request_interval(false, running, &mut self.rng);
                let seq = self
                    .seqs
                    .get_mut(&key)
                    .expect("an unfinished request is known");
                seq.due = Some(next);
                self.dues.insert((next, key));
            }
        }
        self.update_gauges();
    }

    /// Applies a step that ended at `now`, appending the tokens it produced to `out`.
    pub fn complete(&mut self, step: Step, now: Duration, out: &mut Vec<Output>) {
        for (key, n) in step.scheduled {
            let Some(seq) = self.seqs.get_mut(&key) else {
                continue;
            };
            if seq.first_scheduled.is_none() {
                seq.first_scheduled = Some(now - step.duration.min(now));
                let queued = seq
                    .first_scheduled
                    .unwrap_or(now)
                    .saturating_sub(seq.arrival);
                self.metrics.queue.observe(queued.as_secs_f64());
            }
            self.compute(key, n, now, out);
        }
        self.update_gauges();
    }

    /// Computes `n` more tokens of `key` at `now`; once all are computed, samples one and appends
    /// it to `out`. Returns whether the request finished.
    fn compute(&mut self, key: u64, n: u32, now: Duration, out: &mut Vec<Output>) -> bool {
        let seq = self.seqs.get_mut(&key).expect("computing a known request");
        seq.num_computed += n;
        if seq.num_computed < seq.num_tokens() {
            return false; // a partial prefill chunk emits nothing
        }
        let index = u64::from(seq.output_len());
        let word_for = |seed: u64| {
            (xxh3_64_with_seed(&index.to_le_bytes(), seed) % WORDS.len() as u64) as usize
        };
        let mut word = word_for(seq.seed);
        if seq.perturb_from.is_some_and(|p| index >= u64::from(p)) {
            // A different word at the perturbed position itself, then another sequence.
            let other = word_for(seq.seed ^ 0x9E37_79B9_7F4A_7C15);
            word = if other == word {
                (word + 1) % WORDS.len()
            } else {
                other
            };
        }
        let token_id = self.word_ids[word];
        seq.tokens.push(token_id);
        self.hasher
            .extend(&mut seq.hashes, &seq.tokens, &seq.hash_extra);
        let produced = seq.output_len();
        match seq.last_token {
            None => {
                seq.first_token = Some(now);
                self.metrics
                    .ttft
                    .observe(now.saturating_sub(seq.arrival).as_secs_f64());
                self.metrics.prompt_tokens.inc_by(u64::from(seq.prompt_len));
            }
            Some(last) => self
                .metrics
                .itl
                .observe(now.saturating_sub(last).as_secs_f64()),
        }
        seq.last_token = Some(now);
        self.metrics.generation_tokens.inc();
        let finish = if seq.eos_at == Some(produced) {
            Some(FinishReason::Stop)
        } else if produced >= seq.max_tokens || seq.num_tokens() >= self.cfg.max_model_len {
            Some(FinishReason::Length)
        } else {
            None
        };
        // An EOS token detokenizes to nothing: the last chunk of a `stop` carries "".
        let text = if finish == Some(FinishReason::Stop) {
            ""
        } else {
            spaced_word(word as u64)
        };
        match finish {
            Some(reason) => {
                self.running.retain(|&k| k != key);
                out.push(self.finish(key, reason, now, text, token_id));
                true
            }
            None => {
                out.push(Output {
                    key,
                    text,
                    token_id,
                    completion_tokens: produced,
                    prompt_tokens: seq.prompt_len,
                    cached_tokens: seq.cached_tokens.unwrap_or(0),
                    finish: None,
                    at: now,
                });
                false
            }
        }
    }

    fn update_gauges(&self) {
        self.metrics.running.set(self.running.len() as i64);
        self.metrics.waiting.set(self.waiting.len() as i64);
        self.metrics.kv_usage.set(self.pool.usage());
    }

    /// Removes a request, frees its blocks and records its end-of-request metrics.
    fn finish(
        &mut self,
        key: u64,
        reason: FinishReason,
        now: Duration,
        text: &'static str,
        token_id: u32,
    ) -> Output {
        let seq = self.seqs.remove(&key).expect("finishing a known request");
        if let Some(due) = seq.due {
            self.dues.remove(&(due, key));
        }
        self.pool.release(seq.blocks.iter().rev().copied());
        let m = &self.metrics;
        m.count_finished(reason.as_str());
        let produced = seq.output_len();
        m.e2e.observe(now.saturating_sub(seq.arrival).as_secs_f64());
        m.request_prompt_tokens.observe(f64::from(seq.prompt_len));
        m.request_generation_tokens.observe(f64::from(produced));
        m.request_params_n.observe(1.0);
        m.request_params_max_tokens
            .observe(f64::from(seq.max_tokens));
        m.request_max_num_generation_tokens
            .observe(f64::from(seq.max_tokens));
        if let (Some(sched), Some(first), Some(last)) =
            (seq.first_scheduled, seq.first_token, seq.last_token)
        {
            m.prefill.observe(first.saturating_sub(sched).as_secs_f64());
            m.decode.observe(last.saturating_sub(first).as_secs_f64());
            m.inference
                .observe(last.saturating_sub(sched).as_secs_f64());
            if produced > 1 {
                m.tpot
                    .observe(last.saturating_sub(first).as_secs_f64() / f64::from(produced - 1));
            }
        }
        Output {
            key,
            text,
            token_id,
            completion_tokens: produced,
            prompt_tokens: seq.prompt_len,
            cached_tokens: seq.cached_tokens.unwrap_or(0),
            finish: Some(reason),
            at: now,
        }
    }

    fn preempt(&mut self, key: u64) {
        let seq = self.seqs.get_mut(&key).expect("preempting a known request");
        self.pool.release(seq.blocks.drain(..).rev());
        seq.num_computed = 0;
        seq.num_cached_blocks = 0;
        seq.held = true;
        if let Some(due) = seq.due.take() {
            self.dues.remove(&(due, key));
        }
        self.waiting.push_front(key);
        self.metrics.preemptions.inc();
    }

    fn add_to_shape(&self, shape: &mut StepShape, key: u64, n: u32) {
        let seq = &self.seqs[&key];
        let decoding = n == 1 && seq.output_len() > 0 && seq.num_computed + 1 == seq.num_tokens();
        if decoding {
            shape.add_decode(u64::from(seq.num_computed));
        } else {
            shape.add_prefill(u64::from(n), u64::from(seq.num_computed));
        }
    }

    /// vLLM's `allocate_slots`: room for `n` new tokens after the `hit` blocks, then cache the
    /// blocks that will be full once this step has run.
    fn allocate_slots(&mut self, key: u64, n: u32, hit: &[BlockId]) -> bool {
        let bs = self.cfg.block_size;
        let seq = self
            .seqs
            .get_mut(&key)
            .expect("allocating for a known request");
        let computed = if hit.is_empty() {
            seq.num_computed
        } else {
            hit.len() as u32 * bs
        };
        let total_blocks = (computed + n).div_ceil(bs) as usize;
        let needed = total_blocks.saturating_sub(seq.blocks.len() + hit.len());
        if needed > self.pool.num_free() - self.pool.count_free(hit) {
            return false;
        }
        self.pool.touch(hit);
        seq.blocks.extend_from_slice(hit);
        if !hit.is_empty() {
            seq.num_cached_blocks = hit.len();
        }
        if let Some(new) = self.pool.allocate(needed) {
            seq.blocks.extend(new);
        }
        if self.cfg.enable_prefix_caching {
            let full = ((computed + n).min(seq.num_tokens()) / bs) as usize;
            let full = full.min(seq.hashes.len());
            if full > seq.num_cached_blocks {
                let from = seq.num_cached_blocks;
                let parent = from.checked_sub(1).map(|p| seq.hashes[p]);
                let tokens = &seq.tokens[from * bs as usize..full * bs as usize];
                self.pool.cache_blocks(
                    &seq.blocks[from..full],
                    &seq.hashes[from..full],
                    parent,
                    tokens,
                    bs,
                );
                seq.num_cached_blocks = full;
            }
        }
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::CacheInfo;
    use crate::profile::Deployment;
    use crate::timing::{Roofline, Variation};

    fn core(blocks: u64, max_model_len: u32) -> Core {
        let timer = StepTimer::Roofline(Roofline::new(Deployment::preset("8b", "h100").unwrap()));
        core_with(blocks, max_model_len, 1024, timer)
    }

    fn core_with(blocks: u64, max_model_len: u32, max_num_seqs: u32, timer: StepTimer) -> Core {
        let cfg = CoreConfig {
            block_size: 16,
            num_gpu_blocks: blocks,
            max_num_batched_tokens: 8192,
            max_num_seqs,
            max_model_len,
            enable_prefix_caching: true,
            hash_seed: 0,
            record_kv_events: true,
        };
        let info = CacheInfo {
            block_size: 16,
            num_gpu_blocks: blocks,
            gpu_memory_utilization: 0.92,
            cache_dtype: "auto".into(),
            enable_prefix_caching: true,
        };
        Core::new(
            cfg,
            timer,
            0,
            Metrics::new("m", false, &info, max_model_len),
        )
    }

    fn request(key: u64, prompt: Vec<u32>, max_tokens: u32) -> NewRequest {
        NewRequest {
            key,
            prompt,
            max_tokens,
            min_tokens: 0,
            ignore_eos: true,
            natural_len: 0,
            seed: key,
            perturb_from: None,
            hash_extra: vec![],
        }
    }

    /// Runs to completion in virtual time; arrivals are (time, request). Time jumps to the end of
    /// each step, or with a per-request timer to the next due token, or to the next arrival.
    fn run(
        core: &mut Core,
        mut arrivals: Vec<(Duration, NewRequest)>,
    ) -> HashMap<u64, Vec<Output>> {
        arrivals.sort_by_key(|(t, _)| *t);
        let mut arrivals: VecDeque<_> = arrivals.into();
        let mut now = Duration::ZERO;
        let mut outs = Vec::new();
        loop {
            while arrivals.front().is_some_and(|(t, _)| *t <= now) {
                let (t, r) = arrivals.pop_front().unwrap();
                core.submit(r, t);
            }
            let next_arrival = arrivals.front().map(|(t, _)| *t);
            if core.is_per_request() {
                core.admit_per_request(now);
                match core.next_due() {
                    Some(due) if next_arrival.is_none_or(|a| due < a) => {
                        now = due;
                        core.emit_due(now, Duration::ZERO, &mut outs);
                        continue;
                    }
                    _ => {}
                }
            } else if let Some(step) = core.schedule() {
                now += step.duration;
                core.complete(step, now, &mut outs);
                continue;
            }
            match next_arrival {
                Some(t) => now = t,
                None => break,
            }
        }
        assert!(core.is_idle());
        let mut by_key: HashMap<u64, Vec<Output>> = HashMap::new();
        for o in outs {
            by_key.entry(o.key).or_default().push(o);
        }
        by_key
    }

    /// A fixed per-request timer: 20 ms to the first token, then 10 ms apart.
    fn fixed_core(blocks: u64, max_num_seqs: u32) -> Core {
        let timer = StepTimer::Fixed {
            ttft: Duration::from_millis(20),
            itl: Duration::from_millis(10),
            variation: Variation {
                std_dev_fraction: 0.0,
                load_factor: 1.0,
                max_num_seqs: u64::from(max_num_seqs),
            },
        };
        core_with(blocks, 4096, max_num_seqs, timer)
    }

    fn tokens(seed: u32, n: usize) -> Vec<u32> {
        (0..n as u32)
            .map(|i| 1000 + (i * 7919 + seed * 104_729) % 100_000)
            .collect()
    }

    fn ms(d: Duration) -> f64 {
        d.as_secs_f64() * 1e3
    }

    #[test]
    fn lone_request_ttft_and_decode_steps_follow_the_roofline() {
        let mut c = core(28_000, 131_072);
        let out = run(
            &mut c,
            vec![(Duration::ZERO, request(1, tokens(1, 4000), 3))],
        );
        let o = &out[&1];
        assert_eq!(o.len(), 3);
        assert!((ms(o[0].at) - 94.0).abs() < 9.4, "TTFT {}", ms(o[0].at));
        let itl = ms(o[1].at - o[0].at);
        assert!((7.0..8.5).contains(&itl), "ITL at 4k context {itl}");
        assert_eq!(o[2].finish, Some(FinishReason::Length));
        assert_eq!(c.metrics().generation_tokens.get(), 3);
        assert_eq!(c.metrics().prompt_tokens.get(), 4000);
    }

    #[test]
    fn cached_prefix_cuts_ttft_and_counts_hits_in_tokens() {
        let mut c = core(28_000, 131_072);
        let first = tokens(1, 4000);
        let mut second = first[..3008].to_vec();
        second.extend(tokens(2, 992));
        run(&mut c, vec![(Duration::ZERO, request(1, first, 1))]);
        assert_eq!(c.metrics().prefix_hits.get(), 0);
        let out = run(
            &mut c,
            vec![(Duration::from_secs(1), request(2, second, 1))],
        );
        let ttft = ms(out[&2][0].at) - 1000.0;
        assert!((ttft - 25.4).abs() < 2.6, "cached TTFT {ttft}");
        assert_eq!(c.metrics().prefix_hits.get(), 3008);
        assert_eq!(c.metrics().prefix_queries.get(), 8000);
        assert_eq!(out[&2][0].cached_tokens, 3008);
    }

    #[test]
    fn prefix_hits_are_full_blocks_capped_below_the_prompt_length() {
        let mut c = core(1000, 4096);
        let base = tokens(3, 40);
        run(&mut c, vec![(Duration::ZERO, request(1, base.clone(), 1))]);
        // Same 40 tokens: 2 full blocks (32 tokens) hit.
        run(
            &mut c,
            vec![(Duration::from_secs(1), request(2, base.clone(), 1))],
        );
        assert_eq!(c.metrics().prefix_hits.get(), 32);
        // Exactly 32 tokens: only 1 block may hit, since the last token must be computed.
        run(
            &mut c,
            vec![(Duration::from_secs(2), request(3, base[..32].to_vec(), 1))],
        );
        assert_eq!(c.metrics().prefix_hits.get(), 48);
        // Diverging inside block 1: only block 0 hits.
        let mut diverged = base.clone();
        diverged[20] = 7;
        run(
            &mut c,
            vec![(Duration::from_secs(3), request(4, diverged, 1))],
        );
        assert_eq!(c.metrics().prefix_hits.get(), 64);
        // A cache salt isolates.
        let mut salted = request(5, base, 1);
        salted.hash_extra = b"tenant-b".to_vec();
        run(&mut c, vec![(Duration::from_secs(4), salted)]);
        assert_eq!(c.metrics().prefix_hits.get(), 64);
        assert_eq!(c.metrics().prefix_queries.get(), 40 + 40 + 32 + 40 + 40);
    }

    #[test]
    fn too_little_kv_cache_preempts_yet_every_request_completes() {
        // 64 usable blocks = 1024 tokens; eight 300-token prompts that each decode 200 tokens.
        let mut c = core(65, 1024);
        let arrivals = (0..8)
            .map(|k| (Duration::ZERO, request(k, tokens(k as u32 + 10, 300), 200)))
            .collect();
        let out = run(&mut c, arrivals);
        assert!(c.metrics().preemptions.get() > 0);
        assert_eq!(out.len(), 8);
        for o in out.values() {
            assert_eq!(o.len(), 200, "every token delivered exactly once");
            assert_eq!(o.last().unwrap().finish, Some(FinishReason::Length));
            assert!(
                o.windows(2)
                    .all(|w| w[0].completion_tokens + 1 == w[1].completion_tokens)
            );
        }
        assert_eq!(c.metrics().successes("length"), 8);
        assert_eq!(c.kv_usage(), 0.0);
    }

    #[test]
    fn long_prompts_are_chunked_by_the_token_budget() {
        let mut c = core(28_000, 131_072);
        c.submit(request(1, tokens(1, 10_000), 1), Duration::ZERO);
        let first = c.schedule().unwrap();
        assert_eq!(first.shape.prefill_tokens, 8192);
        let mut outs = Vec::new();
        c.complete(first, Duration::from_millis(200), &mut outs);
        assert!(outs.is_empty(), "a partial prefill emits nothing");
        let second = c.schedule().unwrap();
        assert_eq!(second.shape.prefill_tokens, 10_000 - 8192);
        assert_eq!(second.shape.prefill_context, 8192);
    }

    #[test]
    fn max_num_seqs_caps_the_running_batch() {
        let mut c = core(1000, 4096);
        c.cfg.max_num_seqs = 3;
        for k in 0..5 {
            c.submit(request(k, tokens(k as u32, 20), 5), Duration::ZERO);
        }
        let step = c.schedule().unwrap();
        assert_eq!(step.shape.requests, 3);
        assert_eq!(c.num_waiting(), 2);
    }

    #[test]
    fn eos_stops_after_min_tokens_unless_ignored() {
        let mut c = core(1000, 4096);
        let mut natural = request(1, tokens(1, 20), 50);
        natural.ignore_eos = false;
        natural.natural_len = 4;
        let mut floored = request(2, tokens(2, 20), 50);
        floored.ignore_eos = false;
        floored.natural_len = 4;
        floored.min_tokens = 9;
        let out = run(
            &mut c,
            vec![(Duration::ZERO, natural), (Duration::ZERO, floored)],
        );
        assert_eq!(out[&1].len(), 4);
        assert_eq!(out[&1][3].finish, Some(FinishReason::Stop));
        assert_eq!(out[&1][3].text, "", "EOS carries no text");
        assert_eq!(out[&1][3].completion_tokens, 4, "but counts as a token");
        assert_eq!(out[&2].len(), 9);
    }

    #[test]
    fn the_same_seed_gives_the_same_text_until_the_perturbed_token() {
        let mut c = core(1000, 4096);
        let plain = request(1, tokens(1, 20), 12);
        let mut same = request(2, tokens(2, 20), 12);
        same.seed = plain.seed;
        let mut perturbed = request(3, tokens(3, 20), 12);
        perturbed.seed = plain.seed;
        perturbed.perturb_from = Some(5);
        let out = run(
            &mut c,
            vec![
                (Duration::ZERO, plain),
                (Duration::ZERO, same),
                (Duration::ZERO, perturbed),
            ],
        );
        let text = |k: u64| -> Vec<&str> { out[&k].iter().map(|o| o.text).collect() };
        assert_eq!(text(1), text(2));
        assert_eq!(text(1)[..5], text(3)[..5]);
        assert_ne!(
            text(1)[5],
            text(3)[5],
            "differs at the perturbed token itself"
        );
        assert_eq!(text(3).len(), 12, "the length is unchanged");
    }

    #[test]
    fn per_request_timing_gives_every_request_its_own_clock() {
        let mut c = fixed_core(1000, 64);
        let arrivals = [0.0, 3.0, 7.5, 31.25];
        let out = run(
            &mut c,
            arrivals
                .iter()
                .enumerate()
                .map(|(i, &t)| {
                    let key = i as u64 + 1;
                    (
                        Duration::from_secs_f64(t / 1e3),
                        request(key, tokens(key as u32, 40 + 30 * key as usize), 4),
                    )
                })
                .collect(),
        );
        for (i, &t) in arrivals.iter().enumerate() {
            let o = &out[&(i as u64 + 1)];
            let at: Vec<f64> = o.iter().map(|o| ms(o.at)).collect();
            let want = [t + 20.0, t + 30.0, t + 40.0, t + 50.0];
            assert!(
                at.iter().zip(want).all(|(a, w)| (a - w).abs() < 1e-6),
                "request {}: tokens at {at:?}, want {want:?}",
                i + 1
            );
            assert_eq!(o[3].finish, Some(FinishReason::Length));
        }
        assert_eq!(c.metrics().generation_tokens.get(), 16);
        assert_eq!(c.kv_usage(), 0.0);
    }

    #[test]
    fn per_request_timing_holds_what_does_not_fit_and_times_it_from_admission() {
        let mut c = fixed_core(1000, 1);
        let out = run(
            &mut c,
            vec![
                (Duration::ZERO, request(1, tokens(1, 50), 2)),
                (Duration::from_millis(5), request(2, tokens(2, 50), 2)),
            ],
        );
        // Request 1 ends at 30 ms; request 2 is admitted then, its first token 20 ms later.
        assert_eq!(ms(out[&1][1].at), 30.0);
        assert_eq!(ms(out[&2][0].at), 50.0);
        assert_eq!(ms(out[&2][1].at), 60.0);
    }

    #[test]
    fn per_request_timing_counts_prefix_hits_and_survives_preemption() {
        let mut c = fixed_core(1000, 64);
        let prompt = tokens(9, 200);
        let out = run(
            &mut c,
            vec![
                (Duration::ZERO, request(1, prompt.clone(), 2)),
                (Duration::from_millis(100), request(2, prompt, 2)),
            ],
        );
        assert_eq!(out[&1][0].cached_tokens, 0);
        assert_eq!(out[&2][0].cached_tokens, 192);

        // Room for the prompts (4 blocks each) but not for both to grow past them.
        let mut c = fixed_core(10, 64);
        let out = run(
            &mut c,
            (1..=2)
                .map(|k| (Duration::ZERO, request(k, tokens(k as u32, 64), 40)))
                .collect(),
        );
        assert!(c.metrics().preemptions.get() > 0);
        for k in 1..=2 {
            assert_eq!(out[&k].last().unwrap().completion_tokens, 40, "request {k}");
        }
        // Queue time once per request, however often it was preempted.
        assert_eq!(c.metrics().queue.get_sample_count(), 2);
    }

    #[test]
    fn per_request_early_window_sends_decodes_ahead_but_never_a_first_token() {
        let mut c = fixed_core(1000, 64);
        let us = Duration::from_micros;
        c.submit(request(1, tokens(1, 50), 3), Duration::ZERO);
        c.submit(request(2, tokens(2, 50), 3), us(9_900));
        c.admit_per_request(us(9_900));
        let mut out = Vec::new();
        c.emit_due(us(20_000), Duration::ZERO, &mut out); // request 1's first token
        assert_eq!(out.len(), 1);
        // At 29.8 ms with a 250 µs window: request 2's first token (due 29.9 ms) waits, request 1's
        // second (due 30 ms) goes early, stamped with its due time.
        out.clear();
        c.emit_due(us(29_800), us(250), &mut out);
        assert_eq!(out.len(), 1);
        assert_eq!((out[0].key, out[0].at), (1, us(30_000)));
        assert_eq!(c.next_due(), Some(us(29_900)));
    }

    #[test]
    fn per_request_abort_leaves_nothing_due() {
        let mut c = fixed_core(1000, 64);
        c.submit(request(1, tokens(1, 100), 50), Duration::ZERO);
        c.admit_per_request(Duration::ZERO);
        assert_eq!(c.next_due(), Some(Duration::from_millis(20)));
        c.abort(1, Duration::from_millis(5));
        assert_eq!(c.next_due(), None);
        assert!(c.is_idle());
        assert_eq!(c.kv_usage(), 0.0);
    }

    #[test]
    fn abort_frees_everything_and_is_counted() {
        let mut c = core(1000, 4096);
        c.submit(request(1, tokens(1, 100), 50), Duration::ZERO);
        c.submit(request(2, tokens(2, 100), 50), Duration::ZERO);
        let step = c.schedule().unwrap();
        c.complete(step, Duration::from_millis(10), &mut Vec::new());
        assert!(c.kv_usage() > 0.0);
        assert_eq!(
            c.abort(1, Duration::from_millis(11)).unwrap().finish,
            Some(FinishReason::Abort)
        );
        assert_eq!(
            c.abort(2, Duration::from_millis(11)).unwrap().finish,
            Some(FinishReason::Abort)
        );
        assert!(c.abort(2, Duration::from_millis(12)).is_none());
        assert!(c.is_idle());
        assert_eq!(c.kv_usage(), 0.0);
        assert_eq!(c.metrics().successes("abort"), 2);
    }

    #[test]
    fn kv_events_report_stored_blocks_and_evictions() {
        let mut c = core(5, 64); // 4 usable blocks
        run(&mut c, vec![(Duration::ZERO, request(1, tokens(1, 33), 1))]);
        let events = c.take_kv_events();
        let stored: Vec<_> = events
            .iter()
            .filter_map(|e| match e {
                KvEvent::BlockStored { block_hashes, .. } => Some(block_hashes.clone()),
                _ => None,
            })
            .collect();
        assert_eq!(
            stored.concat(),
            c.block_hashes(&tokens(1, 33), b"")[..2].to_vec()
        );
        run(
            &mut c,
            vec![(Duration::from_secs(1), request(2, tokens(2, 60), 1))],
        );
        assert!(
            c.take_kv_events()
                .iter()
                .any(|e| matches!(e, KvEvent::BlockRemoved { .. }))
        );
    }
}
