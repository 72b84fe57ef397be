//! Helpers shared by the proxy's integration tests (each test binary uses some of them).
#![allow(dead_code)]

use std::time::Duration;

use headroom_config::serve::ServeConfig;
use headroom_loadtest::replay::{Arrivals, ReplayOptions};
use headroom_loadtest::synth::Endpoint;
use headroom_proxy::ServeHandle;
use headroom_sim::{RunningReplica, SimArgs, start_replica};
use headroom_workload::trace::{TraceRecord, read_jsonl};

/// Flags of a simulated replica with constant step times (`ttft_ms` for a step with prefill,
/// `itl_ms` otherwise), room for long prompts, and `extra` flags after those (later flags win).
pub fn sim_args(ttft_ms: u32, itl_ms: u32, extra: &[&str]) -> SimArgs {
    let (ttft, itl) = (ttft_ms.to_string(), itl_ms.to_string());
    let mut flags = vec![
        "--latency-model",
        "constant",
        "--time-to-first-token",
        &ttft,
        "--inter-token-latency",
        &itl,
        "--max-model-len",
        "200000",
    ];
    flags.extend_from_slice(extra);
    SimArgs::from_flags(flags).expect("valid simulator flags")
}

/// A simulated replica of [`sim_args`] on port 0.
pub async fn sim(ttft_ms: u32, itl_ms: u32, extra: &[&str]) -> RunningReplica {
    start_replica(
        sim_args(ttft_ms, itl_ms, extra)
            .build_replica(0)
            .expect("a replica"),
        "127.0.0.1:0".parse().expect("an address"),
    )
    .await
    .expect("the replica starts")
}

/// The value of the unlabelled metric `name` in a Prometheus exposition (NaN when absent).
pub fn metric(exposition: &str, name: &str) -> f64 {
    exposition
        .lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
        .unwrap_or(f64::NAN)
}

/// The body of `GET url`, as text.
pub async fn get_text(url: &str) -> String {
    reqwest::get(url)
        .await
        .expect("the GET is answered")
        .text()
        .await
        .expect("a text body")
}

/// The model the simulator serves.
pub const MODEL: &str = "meta-llama/Llama-3.1-8B-Instruct";

/// A fresh temporary directory for this process.
pub fn temp_dir(name: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("headroom-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

/// The proxy in front of `urls` (prefix affinity), capturing to `capture` when given.
pub async fn proxy(urls: &[String], capture: Option<&std::path::Path>) -> ServeHandle {
    let mut cfg = ServeConfig::quick("127.0.0.1:0", urls, "prefix_affinity");
    cfg.admin_listen = "127.0.0.1:0".into();
    cfg.health.interval_ms = 200;
    cfg.scrape.interval_ms = 200;
    cfg.capture.path = capture.map(|p| p.display().to_string());
    cfg.capture.id_key = Some("a test key, 16+ chars".into());
    headroom_proxy::start(cfg.validated().unwrap())
        .await
        .unwrap()
}

/// The records of a capture file.
pub fn read_capture(path: &std::path::Path) -> Vec<TraceRecord> {
    let f = std::fs::File::open(path).unwrap();
    read_jsonl(std::io::BufReader::new(f)).unwrap()
}

/// Replay options for a chat trace at its own timestamps, scaled by `time_scale`.
pub fn options(target: String, seed: u64, time_scale: f64) -> ReplayOptions {
    ReplayOptions {
        targets: vec![target],
        endpoint: Endpoint::Chat,
        model: Some(MODEL.into()),
        arrivals: Arrivals::Trace { time_scale },
        duration: None,
        warmup: 0,
        seed,
        prompt_salt: 0,
        plan: None,
        rows: None,
        timeout: Duration::from_secs(60),
        run_id: format!("m{seed}"),
        headers: Vec::new(),
    }
}
