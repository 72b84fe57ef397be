//! Helpers shared by the proxy's integration tests.

use headroom_sim::{RunningReplica, SimArgs, start_replica};

/// A simulated replica on port 0 with constant step times (`ttft_ms` for a step with prefill,
/// `itl_ms` otherwise), room for long prompts, and `extra` flags after those (later flags win).
pub async fn sim(ttft_ms: u32, itl_ms: u32, extra: &[&str]) -> RunningReplica {
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
    let args = SimArgs::from_flags(flags).expect("valid simulator flags");
    start_replica(
        args.build_replica(0).expect("a replica"),
        "127.0.0.1:0".parse().expect("an address"),
    )
    .await
    .expect("the replica starts")
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
