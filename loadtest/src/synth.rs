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
