//! One replica's admission cap, adapted from the engine's own gauges: cut multiplicatively when the
//! replica shows it is holding too much, raised additively while the cap is what holds work back
//! and the replica is quiet.
//!
//! ```text
//! cap_0 = configured max_in_flight, else plan = ⌊headroom · KV_tokens / context⌋ once the engine
//!         reports its KV capacity (vllm:cache_config_info), else unlimited until then; context is
//!         the mean length of the replica's recent requests once known (`context.rs`)
//! plan moved by more than 10% since the cap last followed it → cap ← cap · plan_new / plan_old,
//!         raised at most twofold (or by α) at a time
//! per scrape:
//!   preempting = preemptions rose
//!   warning    = KV usage ≥ kv_high ∨ (waiting ≥ 2 ∧ waiting grew)
//!   queue      = waiting ≥ max(2, running / 10): the engine holds more than arrives between steps
//!   standing   = queue on this scrape and the one before (the engine cannot take what it holds:
//!                its sequence limit, max_num_seqs, or its cache)
//!   every cut below waits until no more are admitted than the cap (else the pressure is the
//!   backlog of a higher cap, still draining, and a cut would change nothing but overshoot)
//!   preempting, no cut in the last `cooldown` scrapes → cap ← max(min_cap, ⌊β·cap⌋)
//!   warning only, no cut in the last `cooldown` scrapes → cap ← max(min_cap, ⌊β_soft·cap⌋)
//!   standing, no cut in the last `cooldown` scrapes   → cap ← max(min_cap, min(⌊β·cap⌋ or
//!                                                       ⌊β_soft·cap⌋ as above, ⌈running⌉ + α))
//!   room       = KV usage or running unknown ∨ usage · (running + α) / running ≤ kv_raise_below
//!   ¬pressure ∧ ¬queue ∧ room ∧ the cap turned work away since the last scrape
//!                                                     → cap ← min(max_cap, cap + α)
//!   a plan that would raise the cap while the engine holds a queue waits until the queue clears
//! ```
//!
//! A standing engine queue is work the proxy should be holding: in its queue it waits in priority
//! order and can be refused with a `Retry-After`; in the engine's it waits unordered.
//!
//! `room` projects the KV usage of α more sequences of the size the running ones have on average:
//! the cap never probes into the preemption zone to find it, so a workload the derived cap already
//! fits runs with no preemption at all.
//!
//! | parameter | meaning | default |
//! |---|---|---|
//! | β | cut when the engine preempted | 0.8 |
//! | β_soft | cut on an early warning (KV nearly full, engine queue growing) | 0.95 |
//! | α | additive raise per quiet scrape | 2 |
//! | kv_high | KV cache usage that counts as pressure | 0.95 |
//! | kv_raise_below | projected KV usage above which the cap is not raised | 0.85 |
//! | cooldown | scrapes after a cut before the next cut | 2 |
//! | min_cap, max_cap | bounds | 1, 4096 |

/// How the cap moves.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CapParams {
    /// Multiplicative cut when the engine preempted.
    pub beta: f64,
    /// Multiplicative cut on an early warning only.
    pub soft_beta: f64,
    /// Additive raise.
    pub alpha: u32,
    /// KV usage that counts as pressure.
    pub kv_high: f64,
    /// KV usage projected for α more running sequences above which the cap is not raised.
    pub kv_raise_below: f64,
    /// Scrapes after a cut before another.
    pub cooldown: u32,
    /// Lowest cap.
    pub min_cap: u32,
    /// Highest cap.
    pub max_cap: u32,
}

impl Default for CapParams {
    fn default() -> Self {
        Self {
            beta: 0.8,
            soft_beta: 0.95,
            alpha: 2,
            kv_high: 0.95,
            kv_raise_below: 0.85,
            cooldown: 2,
            min_cap: 1,
            max_cap: 4096,
        }
    }
}

/// What a scrape said about the replica.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Feedback {
    /// Preemptions since the engine started.
    pub preemptions_total: Option<f64>,
    /// KV cache usage, 0..1.
    pub kv_usage: Option<f64>,
    /// Sequences waiting in the engine.
    pub waiting: Option<f64>,
    /// Sequences running in the engine.
    pub running: Option<f64>,
}

/// Whether a scrape found the engine holding a queue of its own: more waiting than arrives
/// between two of its steps (at least 2, and at least a tenth of what runs).
fn engine_queue(f: &Feedback) -> bool {
    matches!((f.waiting, f.running), (Some(w), Some(r)) if w >= (r / 10.0).max(2.0))
}

/// A new plan within this fraction of the one the cap last followed leaves the cap alone.
pub const REPLAN_STEP: f64 = 0.1;

/// How the cap changed on a scrape.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Change {
    /// Unchanged.
    Held,
    /// Raised.
    Raised,
    /// Cut.
    Cut,
}

/// The cap of one replica.
#[derive(Debug, Clone)]
pub struct CapController {
    params: CapParams,
    cap: Option<u32>,
    binding: bool,
    last: Feedback,
    since_cut: u32,
    /// The plan the cap last followed.
    plan: Option<u32>,
    /// The last scrape found the engine holding a queue.
    queue: bool,
    /// Requests admitted to the replica when the scrape came (set by the caller; None: unknown).
    pub admitted: Option<u32>,
}

impl CapController {
    /// A cap starting at `initial` (None: unlimited until set).
    pub fn new(initial: Option<u32>, params: CapParams) -> Self {
        Self {
            params,
            cap: initial.map(|c| c.clamp(params.min_cap, params.max_cap)),
            binding: false,
            last: Feedback::default(),
            since_cut: u32::MAX,
            plan: None,
            queue: false,
            admitted: None,
        }
    }

    /// The cap; None is unlimited.
    pub fn cap(&self) -> Option<u32> {
        self.cap
    }

    /// Follows the planned cap (`context.rs`). An unset cap starts at the first plan (a configured
    /// one is only anchored to it); afterwards a plan more than [`REPLAN_STEP`] from the one the cap
    /// last followed scales the cap in proportion, keeping what feedback learnt on top of the plan.
    pub fn replan(&mut self, plan: u32) -> Change {
        let bounded = |c: u32| c.clamp(self.params.min_cap, self.params.max_cap);
        let plan = plan.max(1);
        let Some(old) = self.plan else {
            self.plan = Some(plan);
            if self.cap.is_none() {
                self.cap = Some(bounded(plan));
            }
            return Change::Held;
        };
        let ratio = f64::from(plan) / f64::from(old);
        if (ratio - 1.0).abs() <= REPLAN_STEP {
            return Change::Held;
        }
        let Some(cap) = self.cap else {
            self.plan = Some(plan);
            self.cap = Some(bounded(plan));
            return Change::Held;
        };
        let target = bounded((f64::from(cap) * ratio).round() as u32);
        // Raised at most twofold per step: what feedback learnt may hold the cap below the plan
        // for reasons the plan does not see (the engine's sequence limit), and the scrapes
        // between steps check each one.
        let next = target.min(cap.saturating_mul(2).max(cap + self.params.alpha));
        if next > cap && self.queue {
            // More fits in the cache, but the engine already holds a queue it cannot run: the
            // plan is not followed yet (nor taken as the anchor), and is once the queue clears.
            return Change::Held;
        }
        // A step short of the plan anchors where it got to, so the next replan goes on.
        self.plan = Some(if next < target {
            ((f64::from(old) * f64::from(next) / f64::from(cap)).round() as u32).max(1)
        } else {
            plan
        });
        self.cap = Some(next);
        match next.cmp(&cap) {
            std::cmp::Ordering::Greater => Change::Raised,
            std::cmp::Ordering::Less => Change::Cut,
            std::cmp::Ordering::Equal => Change::Held,
        }
    }

    /// Whether `in_flight` leaves room for one more, without counting it as work turned away.
    pub fn fits(&self, in_flight: u32) -> bool {
        self.cap.is_none_or(|c| in_flight < c)
    }

    /// Whether `in_flight` leaves room for one more; when not, the cap is binding.
    pub fn has_room(&mut self, in_flight: u32) -> bool {
        let fits = self.fits(in_flight);
        self.binding |= !fits;
        fits
    }

    /// Adapts the cap to a scrape.
    pub fn on_feedback(&mut self, f: Feedback) -> Change {
        let p = self.params;
        let preempted = matches!(
            (f.preemptions_total, self.last.preemptions_total),
            (Some(now), Some(before)) if now > before
        );
        let full = f.kv_usage.is_some_and(|u| u >= p.kv_high);
        let queueing = matches!(
            (f.waiting, self.last.waiting),
            (Some(now), Some(before)) if now >= 2.0 && now > before
        );
        let queue = engine_queue(&f);
        // Pressure that outlasts a cut comes from the backlog admitted under the higher cap
        // before it: cutting again before that has drained changes nothing now (nothing is
        // admitted meanwhile) and would only overshoot.
        let drained = match (self.admitted, self.cap) {
            (Some(n), Some(cap)) => n <= cap,
            _ => true,
        };
        let standing = queue && engine_queue(&self.last);
        self.queue = queue;
        self.last = f;
        self.since_cut = self.since_cut.saturating_add(1);
        let binding = std::mem::take(&mut self.binding);
        let Some(cap) = self.cap else {
            return Change::Held;
        };
        if preempted || full || queueing || standing {
            if self.since_cut <= p.cooldown || !drained {
                return Change::Held;
            }
            let beta = if preempted { p.beta } else { p.soft_beta };
            let mut cut = (f64::from(cap) * beta).floor() as u32;
            if let (true, Some(running)) = (standing, f.running) {
                cut = cut.min(running.ceil() as u32 + p.alpha);
            }
            let cut = cut.max(p.min_cap);
            self.since_cut = 0;
            if cut < cap {
                self.cap = Some(cut);
                return Change::Cut;
            }
            return Change::Held;
        }
        let room = match (f.kv_usage, f.running) {
            (Some(usage), Some(running)) if running >= 1.0 => {
                usage * (running + f64::from(p.alpha)) / running <= p.kv_raise_below
            }
            _ => true,
        };
        if binding && room && !queue && cap < p.max_cap {
            self.cap = Some((cap + p.alpha).min(p.max_cap));
            return Change::Raised;
        }
        Change::Held
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn quiet(preemptions: f64) -> Feedback {
        Feedback {
            preemptions_total: Some(preemptions),
            kv_usage: Some(0.5),
            waiting: Some(0.0),
            running: None,
        }
    }

    #[test]
    fn a_standing_engine_queue_brings_the_cap_down_to_what_the_engine_runs() {
        // An engine that runs at most 4 sequences (its max_num_seqs) with a nearly empty cache:
        // the cache alone would allow 40, and 24 clients keep it busy.
        let mut c = CapController::new(Some(40), CapParams::default());
        let scrape = |cap: u32| {
            let admitted = f64::from(cap.min(24));
            let running = admitted.min(4.0);
            Feedback {
                preemptions_total: Some(0.0),
                kv_usage: Some(0.1),
                waiting: Some(admitted - running),
                running: Some(running),
            }
        };
        assert_eq!(c.replan(40), Change::Held, "the first plan anchors");
        let mut caps = Vec::new();
        for i in 0..30 {
            let cap = c.cap().unwrap();
            // Clients wait at the proxy: the cap binds.
            assert!(!c.has_room(cap));
            c.on_feedback(scrape(cap));
            if i == 10 {
                // The cache says ten times as many would fit: not while the engine queues.
                assert_eq!(c.replan(400), Change::Held);
                assert_eq!(c.replan(4_000), Change::Held);
            }
            caps.push(c.cap().unwrap());
        }
        // A backlog admitted under a higher cap is not cut for again while it drains.
        let mut draining = CapController::new(Some(10), CapParams::default());
        draining.admitted = Some(40);
        let backlog = scrape(40);
        draining.on_feedback(backlog);
        assert_eq!(draining.on_feedback(backlog), Change::Held);
        assert_eq!(draining.cap(), Some(10));
        // Nor for preemptions: they cut once the backlog is down to the cap.
        let mut pre = CapController::new(Some(100), CapParams::default());
        pre.on_feedback(quiet(0.0));
        pre.admitted = Some(150);
        assert_eq!(pre.on_feedback(quiet(5.0)), Change::Held);
        pre.admitted = Some(90);
        assert_eq!(pre.on_feedback(quiet(9.0)), Change::Cut);
        assert_eq!(pre.cap(), Some(80));
        // Cut to what it runs plus α at the second scrape, then within α of it from there on.
        assert_eq!(caps[1], 6, "{caps:?}");
        assert!(caps[2..].iter().all(|&c| (5..=7).contains(&c)), "{caps:?}");
        // The queue clears (the clients went away): the plan held back is followed.
        let idle = Feedback {
            preemptions_total: Some(0.0),
            kv_usage: Some(0.01),
            waiting: Some(0.0),
            running: Some(1.0),
        };
        c.on_feedback(idle);
        let before = c.cap().unwrap();
        assert_eq!(c.replan(400), Change::Raised);
        assert_eq!(c.cap(), Some(before * 2), "twofold at most per step");
        // A plan far above the cap is reached in doublings, one per replan.
        let mut c = CapController::new(None, CapParams::default());
        c.replan(14);
        assert_eq!(c.cap(), Some(14));
        let steps: Vec<u32> = (0..4)
            .map(|_| {
                c.replan(100);
                c.cap().unwrap()
            })
            .collect();
        assert_eq!(steps, vec![28, 56, 100, 100]);
        // A busy healthy engine (a few requests arrived since its last step) is no queue: the cap
        // still rises while it binds.
        let mut c = CapController::new(Some(150), CapParams::default());
        let busy = Feedback {
            preemptions_total: Some(0.0),
            kv_usage: Some(0.5),
            waiting: Some(4.0),
            running: Some(150.0),
        };
        for _ in 0..3 {
            assert!(!c.has_room(c.cap().unwrap()));
            assert_eq!(c.on_feedback(busy), Change::Raised);
        }
        assert_eq!(c.cap(), Some(156));
    }

    #[test]
    fn preemptions_cut_and_quiet_binding_periods_raise() {
        let mut c = CapController::new(Some(100), CapParams::default());
        assert_eq!(c.on_feedback(quiet(0.0)), Change::Held);
        // A quiet scrape raises the cap only if it turned work away.
        assert_eq!(c.on_feedback(quiet(0.0)), Change::Held);
        assert!(!c.has_room(100));
        assert_eq!(c.on_feedback(quiet(0.0)), Change::Raised);
        assert_eq!(c.cap(), Some(102));
        // Preemptions rose: cut by β, then no second cut within the cooldown.
        assert_eq!(c.on_feedback(quiet(3.0)), Change::Cut);
        assert_eq!(c.cap(), Some(81));
        assert_eq!(c.on_feedback(quiet(5.0)), Change::Held);
        assert_eq!(c.on_feedback(quiet(7.0)), Change::Held);
        assert_eq!(c.on_feedback(quiet(9.0)), Change::Cut);
        assert_eq!(c.cap(), Some(64));
        // KV nearly full is pressure too; so is an engine queue that keeps growing.
        let mut c = CapController::new(Some(50), CapParams::default());
        c.on_feedback(quiet(0.0));
        let full = Feedback {
            kv_usage: Some(0.97),
            ..quiet(0.0)
        };
        assert_eq!(c.on_feedback(full), Change::Cut);
        // An early warning cuts gently; only preemption cuts hard.
        assert_eq!(c.cap(), Some(47));
        let mut c = CapController::new(Some(50), CapParams::default());
        for (w, want) in [(0.0, Change::Held), (3.0, Change::Cut), (5.0, Change::Held)] {
            let f = Feedback {
                waiting: Some(w),
                ..quiet(0.0)
            };
            assert_eq!(c.on_feedback(f), want, "waiting {w}");
        }
    }

    #[test]
    fn an_unset_cap_waits_for_the_engines_capacity_and_stays_in_bounds() {
        let mut c = CapController::new(None, CapParams::default());
        assert!(c.has_room(1_000_000));
        assert_eq!(c.on_feedback(quiet(5.0)), Change::Held);
        c.replan(180);
        assert_eq!(c.cap(), Some(180));
        // A plan within 10% leaves the cap where feedback put it.
        c.replan(190);
        assert_eq!(c.cap(), Some(180));
        // Longer requests: the plan halves, and so does the cap.
        assert_eq!(c.replan(90), Change::Cut);
        assert_eq!(c.cap(), Some(90));
        assert_eq!(c.replan(135), Change::Raised);
        assert_eq!(c.cap(), Some(135));
        // A configured cap is anchored to the first plan, then follows its moves.
        let mut set = CapController::new(Some(40), CapParams::default());
        assert_eq!(set.replan(180), Change::Held);
        assert_eq!(set.cap(), Some(40));
        set.replan(90);
        assert_eq!(set.cap(), Some(20));
        let mut low = CapController::new(Some(1), CapParams::default());
        low.on_feedback(quiet(0.0));
        low.on_feedback(quiet(1.0));
        assert_eq!(low.cap(), Some(1));
    }

    /// A replica that preempts above `knee` sequences: from a cap far too high and from one far too
    /// low, the cap settles within 20% below the knee.
    #[test]
    fn the_cap_settles_near_the_preemption_point_from_either_side() {
        for start in [20, 1000] {
            let knee = 180;
            let mut c = CapController::new(Some(start), CapParams::default());
            let mut preemptions = 0.0;
            let mut caps = Vec::new();
            for _ in 0..600 {
                // Demand always exceeds the cap: the replica runs at the cap.
                let running = c.cap().unwrap();
                c.has_room(running);
                if running > knee {
                    preemptions += f64::from(running - knee);
                }
                c.on_feedback(quiet(preemptions));
                caps.push(c.cap().unwrap());
            }
            let tail = &caps[400..];
            let mean = tail.iter().map(|&x| f64::from(x)).sum::<f64>() / tail.len() as f64;
            assert!(
                (0.8 * f64::from(knee)..=f64::from(knee) * 1.05).contains(&mean),
                "from {start}: mean cap {mean}"
            );
        }
    }

    /// Sequences that each take 5% of the KV cache (the engine preempts above 20): the cap rises
    /// only while α more of them would still fit under `kv_raise_below`, so it stops short of the
    /// preemption point instead of probing into it.
    #[test]
    fn the_cap_rises_only_while_the_cache_has_room_for_more() {
        let mut c = CapController::new(Some(8), CapParams::default());
        for _ in 0..50 {
            let running = c.cap().unwrap();
            assert!(!c.has_room(running));
            c.on_feedback(Feedback {
                preemptions_total: Some(0.0),
                kv_usage: Some(0.05 * f64::from(running)),
                waiting: Some(0.0),
                running: Some(f64::from(running)),
            });
        }
        // 16 running use 80%; 18 would use 90% > 85%.
        assert_eq!(c.cap(), Some(16));
    }
}
