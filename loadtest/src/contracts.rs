//! Named workload contracts that `headroom trace synth` turns into traces: heavy-tailed lengths,
//! prefix sharing expressed as hash ids, Poisson arrivals, all from a seed.
//!
//! | contract | prompt tokens | output tokens | prefix sharing |
//! |---|---|---|---|
//! | `rag` (prefill-heavy) | log-normal, median 3,500, σ 0.25, 1,100..16,000 | log-normal, median 200, σ 0.3, 16..1,024 | a 1,024-token system prefix shared by every request |
//! | `chat` (decode-heavy) | log-normal, median 80, σ 0.6, 8..2,048 | log-normal, median 600, σ 0.4, 32..4,096 | none |
//! | `multiturn` | first turn log-normal median 300, σ 0.5; each later turn adds the previous answer and a new message (median 80) | log-normal, median 250, σ 0.5, 16..2,048 | each turn extends the last turn's full blocks |
//!
//! `multiturn` sessions have 2–8 turns (uniform) separated by a log-normal think time (median 8 s,
//! σ 0.5) after the previous turn; sessions start as a Poisson process at rate/5 so the request
//! rate averages the asked one.

use headroom_workload::trace::{MOONCAKE_BLOCK_TOKENS, TraceRecord};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::synth::{lognormal_len, poisson_gap};

/// A named contract.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Contract {
    /// Long prompts with a shared system prefix, short answers.
    Rag,
    /// Short prompts, long answers, nothing shared.
    Chat,
    /// Conversations whose context grows turn by turn.
    Multiturn,
}

const BT: u32 = MOONCAKE_BLOCK_TOKENS;

struct Ids(u64);

impl Ids {
    fn fresh(&mut self, n: u32) -> Vec<u64> {
        let out = (self.0..self.0 + u64::from(n)).collect();
        self.0 += u64::from(n);
        out
    }
}

/// Generates `requests` records of `contract` arriving at `rate` per second.
pub fn synthesize(contract: Contract, requests: usize, rate: f64, seed: u64) -> Vec<TraceRecord> {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut ids = Ids(1_000);
    let mut out = Vec::with_capacity(requests);
    match contract {
        Contract::Rag | Contract::Chat => {
            let mut t = 0.0;
            for i in 0..requests {
                if i > 0 {
                    t += poisson_gap(&mut rng, rate);
                }
                let (input, output, hash_ids) = if contract == Contract::Rag {
                    let input = lognormal_len(&mut rng, 3500.0, 0.25, 1100, 16_000);
                    let mut h = vec![0, 1];
                    h.extend(ids.fresh(input.div_ceil(BT) - 2));
                    (input, lognormal_len(&mut rng, 200.0, 0.3, 16, 1024), h)
                } else {
                    let input = lognormal_len(&mut rng, 80.0, 0.6, 8, 2048);
                    (
                        input,
                        lognormal_len(&mut rng, 600.0, 0.4, 32, 4096),
                        ids.fresh(input.div_ceil(BT)),
                    )
                };
                out.push(TraceRecord {
                    timestamp: (t * 1e3) as u64,
                    input_length: input,
                    output_length: output,
                    hash_ids,
                    ..TraceRecord::default()
                });
            }
        }
        Contract::Multiturn => {
            let mut session_start = 0.0;
            let mut session = 0;
            while out.len() < requests {
                session_start += poisson_gap(&mut rng, rate / 5.0);
                let turns = rng.random_range(2..=8);
                let mut t = session_start;
                let mut context = 0u32;
                let mut hash_ids: Vec<u64> = Vec::new();
                for turn in 0..turns {
                    if out.len() == requests {
                        break;
                    }
                    let message = if turn == 0 {
                        lognormal_len(&mut rng, 300.0, 0.5, 16, 8000)
                    } else {
                        lognormal_len(&mut rng, 80.0, 0.6, 4, 2000)
                    };
                    let input = (context + message).min(120_000);
                    // Full blocks of the previous context keep their ids; the rest is new.
                    hash_ids.truncate((context / BT) as usize);
                    let have = hash_ids.len() as u32;
                    hash_ids.extend(ids.fresh(input.div_ceil(BT) - have));
                    let output = lognormal_len(&mut rng, 250.0, 0.5, 16, 2048);
                    out.push(TraceRecord {
                        timestamp: (t * 1e3) as u64,
                        input_length: input,
                        output_length: output,
                        hash_ids: hash_ids.clone(),
                        session_id: Some(format!("s{session}")),
                        ..TraceRecord::default()
                    });
                    context = input + output;
                    t += f64::from(lognormal_len(&mut rng, 8_000.0, 0.5, 500, 120_000)) / 1e3;
                }
                session += 1;
            }
            out.sort_by_key(|r| r.timestamp);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn contracts_are_seeded_and_consistent() {
        for c in [Contract::Rag, Contract::Chat, Contract::Multiturn] {
            let a = synthesize(c, 300, 5.0, 1);
            assert_eq!(a, synthesize(c, 300, 5.0, 1));
            assert_ne!(a, synthesize(c, 300, 5.0, 2));
            assert_eq!(a.len(), 300);
            assert!(a.windows(2).all(|w| w[0].timestamp <= w[1].timestamp));
            for r in &a {
                assert_eq!(
                    r.hash_ids.len() as u32,
                    r.input_length.div_ceil(BT),
                    "{c:?}"
                );
            }
        }
    }

    #[test]
    fn rag_shares_its_system_prefix_and_chat_shares_nothing() {
        let rag = synthesize(Contract::Rag, 100, 5.0, 3);
        assert!(rag.iter().all(|r| r.hash_ids[..2] == [0, 1]));
        let chat = synthesize(Contract::Chat, 100, 5.0, 3);
        let mut all: Vec<u64> = chat.iter().flat_map(|r| r.hash_ids.clone()).collect();
        let n = all.len();
        all.sort_unstable();
        all.dedup();
        assert_eq!(all.len(), n);
        let mean_out = chat.iter().map(|r| f64::from(r.output_length)).sum::<f64>() / 100.0;
        assert!(mean_out > 400.0, "decode-heavy: {mean_out}");
    }

    #[test]
    fn multiturn_contexts_grow_and_keep_their_full_blocks() {
        let t = synthesize(Contract::Multiturn, 400, 5.0, 4);
        let mut by_session: std::collections::HashMap<&str, Vec<&TraceRecord>> = Default::default();
        for r in &t {
            by_session
                .entry(r.session_id.as_deref().unwrap())
                .or_default()
                .push(r);
        }
        let mut checked = 0;
        for turns in by_session.values().filter(|v| v.len() > 1) {
            for w in turns.windows(2) {
                assert!(w[1].input_length > w[0].input_length);
                let kept = ((w[0].input_length + w[0].output_length).min(120_000) / BT) as usize;
                let kept = kept.min(w[0].hash_ids.len()).min(w[1].hash_ids.len());
                assert_eq!(w[0].hash_ids[..kept], w[1].hash_ids[..kept]);
                checked += 1;
            }
        }
        assert!(checked > 50);
    }
}
