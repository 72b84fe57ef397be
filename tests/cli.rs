//! The `headroom` binary as a user runs it: the demo end to end (small, both runs: round-robin and
//! through the proxy), the simulator's table, and bad input answered with a clear error and a
//! failing exit code.

use std::process::Command;

fn headroom(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_headroom"))
        .args(args)
        .output()
        .expect("the binary runs")
}

#[test]
fn a_small_demo_runs_end_to_end_and_writes_its_contract() {
    let out_dir = std::env::temp_dir().join(format!("headroom-demo-{}", std::process::id()));
    let out = headroom(&[
        "demo",
        "--requests",
        "12",
        "--rate",
        "40",
        "--out",
        out_dir.to_str().unwrap(),
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        stdout
            .matches("12 measured, 12 completed, 0 failed")
            .count(),
        2,
        "{stdout}"
    );
    assert!(stdout.contains("TTFT"));
    assert!(stdout.contains("round-robin, no proxy"), "{stdout}");
    assert!(stdout.contains("headroom (prefix_affinity)"), "{stdout}");
    let read = |run: &str| -> serde_json::Value {
        let path = out_dir.join(run).join("result.json");
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
    };
    let (direct, proxied) = (read("round_robin"), read("headroom"));
    for result in [&direct, &proxied] {
        assert_eq!(result["contract"]["trace"]["requests"], 12);
        assert_eq!(result["summary"]["completed"], 12);
        assert_eq!(result["summary"]["lengths"]["prompt_mismatches"], 0);
        // Both runs read the two replicas' own prefix-cache counters.
        assert_eq!(
            result["target_observed"]["targets"]
                .as_array()
                .unwrap()
                .len(),
            2
        );
    }
    assert_eq!(
        direct["contract"]["target"]["urls"]
            .as_array()
            .unwrap()
            .len(),
        2
    );
    assert_eq!(
        proxied["contract"]["target"]["urls"]
            .as_array()
            .unwrap()
            .len(),
        1
    );
    assert_eq!(
        direct["contract"]["trace"]["sha256"],
        proxied["contract"]["trace"]["sha256"]
    );
    assert!(out_dir.join("round_robin/report.html").exists());
    assert!(out_dir.join("headroom/report.html").exists());
}

#[test]
fn the_knee_table_is_computed_by_the_model() {
    let out = headroom(&["sim", "--table"]);
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("| 1 | 7.53 |"), "{text}");
    assert!(
        text.contains("Memory knee: the KV cache holds 200 sequences"),
        "{text}"
    );
}

#[test]
fn bad_input_gets_a_clear_error() {
    for (args, expected) in [
        (
            vec!["sim", "--profile", "gpt-9", "--table"],
            "unknown --profile",
        ),
        (
            vec!["sim", "--max-model-len", "999999999", "--port", "0"],
            "needs more KV cache",
        ),
        (
            vec![
                "replay",
                "--trace",
                "/nonexistent.jsonl",
                "--target",
                "http://127.0.0.1:9",
            ],
            "opening trace",
        ),
        (
            vec![
                "trace",
                "synth",
                "--contract",
                "rag",
                "--rate",
                "0",
                "-o",
                "/tmp/x.jsonl",
            ],
            "must be positive",
        ),
        (vec!["serve"], "needs --config FILE or --backends"),
        (
            vec![
                "serve",
                "--backends",
                "https://a:1,http://b",
                "--listen",
                "x",
            ],
            "backends[0].url = https://a:1: TLS to replicas is not supported yet",
        ),
        (
            vec!["serve", "--config", "/nonexistent/headroom.toml"],
            "cannot read config /nonexistent/headroom.toml",
        ),
    ] {
        let out = headroom(&args);
        assert!(!out.status.success(), "{args:?} should fail");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains(expected), "{args:?}: {stderr}");
    }
}
