//! Closed-loop streaming load against one or more OpenAI-compatible URLs, for the simulator's
//! cost benchmark (scripts/bench-sim.sh). Prints one JSON line of results.
//!
//! Usage: stream_load CONCURRENCY SECONDS PROMPT_TOKENS OUTPUT_TOKENS URL [URL…]

use std::sync::Arc;
use std::time::{Duration, Instant};

use headroom_loadtest::replay::Counters as Progress;
use headroom_loadtest::stats::LatencyHistogram;
use headroom_loadtest::{closed_loop, synth};
use serde_json::json;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    anyhow::ensure!(
        args.len() >= 5,
        "usage: stream_load CONCURRENCY SECONDS PROMPT_TOKENS OUTPUT_TOKENS URL [URL…]"
    );
    let concurrency: usize = args[0].parse()?;
    let seconds: f64 = args[1].parse()?;
    let prompt: usize = args[2].parse()?;
    let output: u64 = args[3].parse()?;
    let urls: Vec<String> = args[4..]
        .iter()
        .map(|u| format!("{u}/v1/completions"))
        .collect();
    let make = Arc::new(move |i: usize, n: usize| {
        json!({"prompt": synth::text(prompt, (i as u64) << 32 | n as u64), "max_tokens": output,
               "ignore_eos": true, "stream": true, "stream_options": {"include_usage": true}})
    });
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(concurrency)
        .build()?;
    let started = Instant::now();
    let timings = closed_loop::run(
        client,
        urls,
        concurrency,
        Duration::from_secs_f64(seconds),
        make,
        Arc::new(Progress::default()),
    )
    .await;
    let elapsed = started.elapsed().as_secs_f64();
    let (mut ttft, mut itl) = (LatencyHistogram::default(), LatencyHistogram::default());
    let mut tokens = 0;
    for t in timings.iter().filter(|t| t.ok()) {
        if let Some(d) = t.ttft {
            ttft.record(d);
        }
        for d in &t.itl {
            itl.record(*d);
        }
        tokens += t.completion_tokens;
    }
    let failed = timings.iter().filter(|t| !t.ok()).count();
    println!(
        "{}",
        json!({"requests": timings.len(), "failed": failed, "elapsed_s": elapsed,
               "output_tokens_per_s": tokens as f64 / elapsed, "ttft": ttft.percentiles(), "itl": itl.percentiles()})
    );
    Ok(())
}
