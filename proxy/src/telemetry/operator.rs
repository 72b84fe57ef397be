//! The operator's numbers: each pool's utilisation (work in flight over capacity, averaged over
//! time: the largest lever on cost) and the cost per million tokens at the measured throughput,
//! beside a managed API's price for the build-versus-buy check.
//!
//! ```text
//! utilisation(pool)   = Σ_r ∫ in_flight_r dt / Σ_r ∫ cap_r dt      r in the pool, while cap_r is known
//! cost_per_hour       = replicas · replica_hour
//! cost_per_M(tokens)  = cost_per_hour / (tokens_per_s · 3600) · 10⁶   tokens: output, or prompt + output
//! vs_managed          = cost_per_M(prompt + output) / managed_per_million_tokens
//! ```
//!
//! | input | source |
//! |---|---|
//! | `cap_r` | the replica's admission cap (its capacity in sequences); no admission, no utilisation |
//! | `tokens_per_s` | the `/stats` 5-minute window, every pool and class |
//! | `replica_hour`, `managed_per_million_tokens` | `[cost]` in the config (any one currency) |

use std::collections::BTreeMap;

use headroom_config::serve::{CostConfig, ServeConfig};
use serde_json::{Value, json};

use crate::telemetry::stats::WindowStats;
use crate::upstreams::Fleet;

/// Each pool's replicas, capacity and work now, and its utilisation since the proxy started.
pub fn pools(cfg: &ServeConfig, fleet: &Fleet) -> Vec<Value> {
    cfg.pool_list()
        .iter()
        .map(|pool| {
            let members: Vec<_> = fleet
                .backends
                .iter()
                .filter(|b| pool.backends.contains(&b.name))
                .collect();
            let (mut busy, mut capacity, mut in_flight) = (0.0, 0.0, 0);
            for b in &members {
                let l = b.load();
                busy += l.capped_in_flight_seconds;
                capacity += l.capacity_seconds;
                in_flight += l.in_flight;
            }
            json!({
                "pool": pool.name,
                "replicas": members.len(),
                "in_flight": in_flight,
                "utilisation_since_start": (capacity > 0.0).then(|| busy / capacity),
            })
        })
        .collect()
}

/// The `/stats` window the throughput is read from.
const COST_WINDOW: &str = "5m";

/// The cost of the throughput in the `/stats` windows, when `[cost] replica_hour` is set.
pub fn cost(
    cost: &CostConfig,
    replicas: usize,
    windows: &BTreeMap<&'static str, Vec<WindowStats>>,
) -> Option<Value> {
    let replica_hour = cost.replica_hour?;
    let window = windows.get(COST_WINDOW).map_or(&[][..], Vec::as_slice);
    let output: f64 = window.iter().map(|w| w.output_tokens_per_s).sum();
    let prompt: f64 = window.iter().map(|w| w.prompt_tokens_per_s).sum();
    let per_hour = replicas as f64 * replica_hour;
    let per_million =
        |tokens_per_s: f64| (tokens_per_s > 0.0).then(|| per_hour / (tokens_per_s * 3600.0) * 1e6);
    let all = per_million(output + prompt);
    Some(json!({
        "replicas": replicas,
        "replica_hour": replica_hour,
        "per_hour": per_hour,
        "window": COST_WINDOW,
        "output_tokens_per_s": output,
        "prompt_tokens_per_s": prompt,
        "per_million_output_tokens": per_million(output),
        "per_million_tokens": all,
        "managed_per_million_tokens": cost.managed_per_million_tokens,
        "vs_managed": match (all, cost.managed_per_million_tokens) {
            (Some(a), Some(m)) if m > 0.0 => Some(a / m),
            _ => None,
        },
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn window(output: f64, prompt: f64) -> WindowStats {
        WindowStats {
            pool: "default".into(),
            class: "default".into(),
            seconds: 300.0,
            requests: 0,
            completed: 0,
            good: 0,
            goodput_rps: 0.0,
            goodput_tokens_per_s: 0.0,
            output_tokens_per_s: output,
            prompt_tokens_per_s: prompt,
            latency: Default::default(),
        }
    }

    #[test]
    fn cost_per_million_tokens_from_the_measured_throughput() {
        let cfg = CostConfig {
            replica_hour: Some(2.0),
            managed_per_million_tokens: Some(1.0),
        };
        // 4 replicas at 2 an hour = 8 an hour; 1,000 output + 3,000 prompt tokens/s = 14.4 M/h.
        let windows = |w: Vec<WindowStats>| BTreeMap::from([(COST_WINDOW, w)]);
        let c = cost(
            &cfg,
            4,
            &windows(vec![window(600.0, 2000.0), window(400.0, 1000.0)]),
        )
        .unwrap();
        let near = |v: &Value, x: f64| (v.as_f64().unwrap() - x).abs() < 1e-9;
        assert!(near(&c["per_hour"], 8.0));
        assert!(near(&c["per_million_output_tokens"], 8.0 / 3.6));
        assert!(near(&c["per_million_tokens"], 8.0 / 14.4));
        assert!(near(&c["vs_managed"], 8.0 / 14.4));
        // No throughput yet: no cost per token, and no config: nothing.
        assert!(cost(&cfg, 4, &windows(vec![])).unwrap()["per_million_tokens"].is_null());
        assert!(cost(&CostConfig::default(), 4, &windows(vec![window(1.0, 1.0)])).is_none());
    }
}
