//! Synthetic text of exact token lengths under the headroom tokenizer, and seeded length draws.
//!
//! Text is built from [`headroom_workload::words`]: each `" word"` is one token, so a prompt of
//! `n` words is `n` tokens on the simulator. Equal seeds give byte-identical text, so prompts
//! that share a seeded prefix share KV-cache blocks.

use headroom_workload::words::spaced_word;
use rand::Rng;
use rand::rngs::StdRng;
use rand_distr::{Distribution, LogNormal};

/// `n` tokens of deterministic text for `seed`.
pub fn text(n: usize, seed: u64) -> String {
    let mut out = String::with_capacity(n * 7);
    let mut x = seed ^ 0x9E37_79B9_7F4A_7C15;
    for _ in 0..n {
        // splitmix64 step: a cheap, well-mixed word index per position.
        x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = x;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        out.push_str(spaced_word(z ^ (z >> 31)));
    }
    out
}

/// A heavy-tailed length: log-normal with the given median and shape σ, clamped to [lo, hi].
pub fn lognormal_len(rng: &mut StdRng, median: f64, sigma: f64, lo: u32, hi: u32) -> u32 {
    let draw = LogNormal::new(median.ln(), sigma).map_or(median, |d| d.sample(rng));
    (draw.round() as u32).clamp(lo, hi)
}

/// Exponential inter-arrival gap for a Poisson process of `rate` per second.
pub fn poisson_gap(rng: &mut StdRng, rate: f64) -> f64 {
    let u: f64 = rng.random_range(f64::EPSILON..1.0);
    -u.ln() / rate
}

#[cfg(test)]
mod tests {
    use super::*;
    use headroom_workload::Tokenizer;
    use rand::SeedableRng;

    #[test]
    fn text_has_exact_token_counts_and_is_seeded() {
        for n in [0, 1, 17, 1000] {
            assert_eq!(Tokenizer.count(&text(n, 7)), n);
        }
        assert_eq!(text(50, 1), text(50, 1));
        assert_ne!(text(50, 1), text(50, 2));
        assert!(
            text(100, 3).starts_with(&text(40, 3)),
            "same seed, shared prefix"
        );
    }

    #[test]
    fn lognormal_lengths_respect_bounds_and_median() {
        let mut rng = StdRng::seed_from_u64(0);
        let mut v: Vec<u32> = (0..2001)
            .map(|_| lognormal_len(&mut rng, 200.0, 0.8, 10, 5000))
            .collect();
        assert!(v.iter().all(|&x| (10..=5000).contains(&x)));
        v.sort_unstable();
        assert!((170..=230).contains(&v[1000]), "median {}", v[1000]);
    }
}

/// Which OpenAI endpoint a prompt is rendered for.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize, clap::ValueEnum,
)]
#[serde(rename_all = "lowercase")]
pub enum Endpoint {
    /// `/v1/chat/completions`, one user message.
    Chat,
    /// `/v1/completions`, a text prompt.
    Completions,
}

impl Endpoint {
    /// The path.
    pub fn path(self) -> &'static str {
        match self {
            Self::Chat => "/v1/chat/completions",
            Self::Completions => "/v1/completions",
        }
    }

    /// Tokens the engine adds before the text (Llama 3: `<|begin_of_text|>`, plus the chat header
    /// `<|start_header_id|>user<|end_header_id|>\n\n`) and after it (chat: `<|eot_id|>` and the
    /// assistant generation prompt).
    pub fn overhead(self) -> (u32, u32) {
        match self {
            Self::Completions => (1, 0),
            Self::Chat => (5, 6),
        }
    }
}

/// The prompt text of a trace record: hash id `h` at position `i` becomes the block of text seeded
/// by `(h, salt)`, so records sharing leading hash ids share a byte-identical text prefix; the
/// text is cut so that, with the endpoint's template tokens, the prompt is `input_length` tokens
/// on the simulator. Records with fewer tokens than the template still get one word.
pub fn prompt_for(
    record: &headroom_workload::trace::TraceRecord,
    endpoint: Endpoint,
    salt: u64,
) -> String {
    let (head, tail) = endpoint.overhead();
    let block = record.block_tokens() as usize;
    let mut remaining = record.input_length.saturating_sub(head + tail).max(1) as usize;
    let mut out = String::with_capacity(remaining * 7);
    for (i, id) in record.hash_ids.iter().enumerate() {
        if remaining == 0 {
            break;
        }
        let size = if i == 0 {
            block.saturating_sub(head as usize).max(1)
        } else {
            block
        };
        let n = size.min(remaining);
        out.push_str(&text(n, id.wrapping_mul(0x2545_F491_4F6C_DD1D) ^ salt));
        remaining -= n;
    }
    if remaining > 0 {
        // More tokens than the hash ids cover (a trace without ids): unshared filler.
        out.push_str(&text(
            remaining,
            u64::from(record.input_length) ^ record.timestamp ^ salt ^ 0xA5A5,
        ));
    }
    out
}

#[cfg(test)]
mod trace_prompt_tests {
    use super::*;
    use headroom_workload::Tokenizer;
    use headroom_workload::openai::{ChatMessage, MessageContent, render_chat};
    use headroom_workload::trace::TraceRecord;

    fn record(input: u32, ids: Vec<u64>) -> TraceRecord {
        TraceRecord {
            input_length: input,
            output_length: 1,
            hash_ids: ids,
            ..TraceRecord::default()
        }
    }

    #[test]
    fn prompts_hit_input_length_exactly_on_both_endpoints() {
        for (input, ids) in [
            (1200, vec![1, 2, 3]),
            (512, vec![9]),
            (40, vec![4]),
            (513, vec![1, 7]),
        ] {
            let r = record(input, ids);
            let completion = prompt_for(&r, Endpoint::Completions, 0);
            assert_eq!(
                Tokenizer.count(&completion) + 1,
                input as usize,
                "completions {input}"
            );
            let chat = prompt_for(&r, Endpoint::Chat, 0);
            let messages = vec![ChatMessage {
                role: "user".into(),
                content: Some(MessageContent::Text(chat)),
            }];
            assert_eq!(
                Tokenizer.count(&render_chat(&messages)),
                input as usize,
                "chat {input}"
            );
        }
    }

    #[test]
    fn shared_hash_prefixes_share_text_prefixes() {
        let a = prompt_for(&record(1500, vec![0, 1, 2]), Endpoint::Completions, 5);
        let b = prompt_for(&record(1100, vec![0, 1, 9]), Endpoint::Completions, 5);
        let c = prompt_for(&record(1100, vec![0, 8, 9]), Endpoint::Completions, 5);
        let common =
            |x: &str, y: &str| x.bytes().zip(y.bytes()).take_while(|(p, q)| p == q).count();
        let block0 = text(511, 0u64.wrapping_mul(0x2545_F491_4F6C_DD1D) ^ 5).len();
        let block1 = text(512, 1u64.wrapping_mul(0x2545_F491_4F6C_DD1D) ^ 5).len();
        assert!(common(&a, &b) >= block0 + block1);
        assert!(common(&a, &c) >= block0 && common(&a, &c) < block0 + block1);
        assert_ne!(
            prompt_for(&record(600, vec![0, 1]), Endpoint::Completions, 6),
            prompt_for(&record(600, vec![0, 1]), Endpoint::Completions, 5)
        );
    }
}
