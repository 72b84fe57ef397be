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
    let scratch = tempfile::tempdir().expect("a scratch directory");
    let out_dir = scratch.path().join("out");
    let out = headroom(&[
        "demo",
        "--requests",
        "12",
        "--rate",
        "40",
        "--batch-requests",
        "6",
        "--batch-rate",
        "40",
        "--batch-after",
        "0.1",
        "--out",
        out_dir.to_str().unwrap(),
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("TTFT p99"), "{stdout}");
    assert!(stdout.contains("preemptions"), "{stdout}");
    assert!(stdout.contains("round-robin, no admission"), "{stdout}");
    assert!(
        stdout.contains("headroom (pools, affinity, admission)"),
        "{stdout}"
    );
    let read = |run: &str, class: &str| -> serde_json::Value {
        let path = out_dir.join(run).join(class).join("result.json");
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
    };
    for (class, n) in [("interactive", 12), ("batch", 6)] {
        let (direct, proxied) = (read("round_robin", class), read("headroom", class));
        for result in [&direct, &proxied] {
            assert_eq!(result["contract"]["trace"]["requests"], n);
            assert_eq!(result["summary"]["completed"], n, "{class}");
            assert_eq!(result["summary"]["lengths"]["prompt_mismatches"], 0);
        }
        // The plain balancer spreads over the four replicas; the other run goes to the proxy.
        assert_eq!(
            direct["contract"]["target"]["urls"]
                .as_array()
                .unwrap()
                .len(),
            4
        );
        assert_eq!(
            proxied["contract"]["target"]["urls"]
                .as_array()
                .unwrap()
                .len(),
            1
        );
        // One workload contract: the same trace and the same prompt text in both runs.
        assert_eq!(
            direct["contract"]["trace"]["sha256"],
            proxied["contract"]["trace"]["sha256"]
        );
        assert_eq!(
            direct["contract"]["prompt_salt"],
            proxied["contract"]["prompt_salt"]
        );
        assert!(
            out_dir
                .join(format!("round_robin/{class}/report.html"))
                .exists()
        );
        assert!(
            out_dir
                .join(format!("headroom/{class}/report.html"))
                .exists()
        );
    }
    assert!(read("headroom", "interactive")["contract"]["slo"].is_object());
    let page = std::fs::read_to_string(out_dir.join("report.html")).unwrap();
    assert!(page.contains("TTFT of the chat turns"));
    // The proxy recorded every request it served, with its class, and measured them itself.
    let capture = std::fs::read_to_string(out_dir.join("headroom/capture.jsonl")).unwrap();
    assert_eq!(capture.lines().count(), 18);
    assert_eq!(
        capture.matches(r#""class":"batch""#).count(),
        6,
        "{capture}"
    );
    let config = std::fs::read_to_string(out_dir.join("headroom/headroom.toml")).unwrap();
    assert!(config.contains("[[pools]]"), "{config}");
    let stats: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(out_dir.join("headroom/stats.json")).unwrap(),
    )
    .unwrap();
    let requests: u64 = stats["windows"]["5m"]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| w["requests"].as_u64().unwrap())
        .sum();
    assert_eq!(requests, 18);
    assert!(
        stdout.contains("headroom's own passive measurement"),
        "{stdout}"
    );
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
fn the_capacity_note_of_8b_on_h100() {
    let out = headroom(&["capacity", "--model", "llama-3.1-8b", "--gpu", "h100"]);
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("KV per token           131072 bytes"),
        "{text}"
    );
    assert!(
        text.contains("KV reads overtake weight reads at batch 49.8"),
        "{text}"
    );
    assert!(
        text.contains("recommended admission cap: 180 sequences"),
        "{text}"
    );
    let scratch = tempfile::tempdir().expect("a scratch directory");
    let dir = scratch.path();
    let config = dir.join("config.json");
    std::fs::write(
        &config,
        r#"{"hidden_size": 4096, "intermediate_size": 14336, "max_position_embeddings": 131072,
            "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
            "vocab_size": 128256}"#,
    )
    .unwrap();
    let out = headroom(&[
        "capacity",
        "--model",
        config.to_str().unwrap(),
        "--gpu",
        "h100",
        "--kv-dtype",
        "fp8",
        "--json",
    ]);
    assert!(out.status.success());
    let note: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(note["kv_bytes_per_token"], 65536.0);
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
                "--check",
                "--backends",
                "http://a:1",
                "--listen",
                "nowhere",
            ],
            "listen = nowhere",
        ),
        (
            vec!["capacity", "--model", "gpt-9", "--gpu", "h100"],
            "unknown model `gpt-9`",
        ),
        (
            vec!["capacity", "--model", "70b", "--gpu", "h100", "--tp", "1"],
            "does not fit on 1 × H100",
        ),
        (
            vec![
                "capacity",
                "--model",
                "/nonexistent/config.json",
                "--gpu",
                "h100",
            ],
            "reading /nonexistent/config.json",
        ),
        (
            vec![
                "serve",
                "--backends",
                "https://a:1/v1,http://b",
                "--listen",
                "x",
            ],
            "backends[0].url = https://a:1/v1: must be http://host:port or https://host:port",
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

#[test]
fn a_config_file_may_leave_the_backends_to_the_flag_and_errors_print_once() {
    let scratch = tempfile::tempdir().expect("a scratch directory");
    let dir = scratch.path();
    let no_backends = dir.join("routing-only.toml");
    std::fs::write(&no_backends, "[routing]\nmax_hashed_tokens = 131072\n").unwrap();
    let path = no_backends.to_str().unwrap();

    let ok = headroom(&[
        "serve",
        "--check",
        "--config",
        path,
        "--backends",
        "http://a:1",
    ]);
    let stdout = String::from_utf8_lossy(&ok.stdout);
    assert!(
        ok.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&ok.stderr)
    );
    assert!(stdout.contains("1 backend(s)"), "{stdout}");

    let missing = headroom(&["serve", "--check", "--config", path]);
    assert!(!missing.status.success());
    let stderr = String::from_utf8_lossy(&missing.stderr);
    assert!(
        stderr.contains("at least one backend is needed"),
        "{stderr}"
    );

    // With --backends the file is checked after the flags are in, and still named.
    let bad_listen = dir.join("bad-listen.toml");
    std::fs::write(&bad_listen, "listen = \"nowhere\"\n").unwrap();
    let out = headroom(&[
        "serve",
        "--check",
        "--config",
        bad_listen.to_str().unwrap(),
        "--backends",
        "http://a:1",
    ]);
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("listen = nowhere"), "{stderr}");
    assert!(
        stderr.contains("bad-listen.toml and the flags given"),
        "{stderr}"
    );

    // A TOML error carries its line and column, and is printed once, not once more as its cause.
    let bad = dir.join("bad.toml");
    std::fs::write(&bad, "listen = 5\n").unwrap();
    let out = headroom(&["serve", "--check", "--config", bad.to_str().unwrap()]);
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(stderr.matches("TOML parse error").count(), 1, "{stderr}");
    assert!(stderr.contains("line 1, column 10"), "{stderr}");
}

/// A child process whose stdout's first line is its URL; killed when dropped.
struct Child {
    proc: std::process::Child,
    url: String,
    stderr: std::thread::JoinHandle<String>,
}

impl Child {
    fn start(args: &[&str]) -> Self {
        use std::io::{BufRead, Read};
        let mut proc = Command::new(env!("CARGO_BIN_EXE_headroom"))
            .args(args)
            .env("RUST_LOG", "debug")
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("the binary runs");
        let mut lines = std::io::BufReader::new(proc.stdout.take().unwrap()).lines();
        let url = lines.next().unwrap().unwrap();
        let mut err = proc.stderr.take().unwrap();
        let stderr = std::thread::spawn(move || {
            let mut s = String::new();
            let _ = err.read_to_string(&mut s);
            // Whatever else went to stdout is a log line too.
            for l in lines.map_while(Result::ok) {
                s.push_str(&l);
                s.push('\n');
            }
            s
        });
        Self { proc, url, stderr }
    }

    /// SIGTERM, then everything the process wrote.
    fn stop(mut self) -> String {
        let _ = Command::new("kill")
            .args(["-TERM", &self.proc.id().to_string()])
            .status();
        let _ = self.proc.wait();
        self.stderr.join().unwrap()
    }
}

/// Each thread of process `pid`: its name, nice value and scheduling policy (0 normal, 3 batch).
#[cfg(target_os = "linux")]
fn thread_classes(pid: u32) -> Vec<(String, i32, u32)> {
    let mut out = Vec::new();
    for task in std::fs::read_dir(format!("/proc/{pid}/task")).unwrap() {
        let stat = std::fs::read_to_string(task.unwrap().path().join("stat")).unwrap();
        let name = &stat[stat.find('(').unwrap() + 1..stat.rfind(')').unwrap()];
        let (nice, policy) = headroom_workload::realtime::sched_of_stat(&stat).unwrap();
        out.push((name.to_owned(), nice, policy));
    }
    out
}

#[test]
fn serve_captures_requests_and_no_prompt_text_reaches_a_file_or_a_log() {
    const CANARY: &str = "qqcanaryword4409";
    let scratch = tempfile::tempdir().expect("a scratch directory");
    let dir = scratch.path();
    let capture = dir.join("capture.jsonl");
    let sim = Child::start(&["sim", "--port", "0", "--latency-model", "constant"]);
    let config = dir.join("headroom.toml");
    std::fs::write(
        &config,
        format!(
            "listen = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\n[[backends]]\nurl = \"{}\"\n\
             [log]\naccess = true\n[shutdown]\ndrain_ms = 100\ngrace_ms = 2000\n",
            sim.url
        ),
    )
    .unwrap();
    let proxy = Child::start(&[
        "--log-format",
        "json",
        "serve",
        "--config",
        config.to_str().unwrap(),
        "--capture",
        capture.to_str().unwrap(),
    ]);
    let rt = tokio::runtime::Runtime::new().unwrap();
    let statuses: Vec<u16> = rt.block_on(async {
        let c = reqwest::Client::new();
        let bodies = [
            serde_json::json!({"messages": [{"role": "user", "content": CANARY}], "max_tokens": 4, "stream": true}),
            serde_json::json!({"messages": [{"role": "system", "content": format!("{CANARY} rules")}, {"role": "user", "content": "hi"}], "max_tokens": 2}),
            serde_json::json!({"prompt": format!("{CANARY} once"), "max_tokens": 3}),
            serde_json::json!({"messages": CANARY}),
            serde_json::json!({"prompt": [CANARY, 7]}),
        ];
        let mut out = Vec::new();
        for b in bodies {
            let path = if b.get("prompt").is_some() {
                "completions"
            } else {
                "chat/completions"
            };
            let r = c
                .post(format!("{}/v1/{path}", proxy.url))
                .json(&b)
                .send()
                .await
                .unwrap();
            out.push(r.status().as_u16());
            r.bytes().await.unwrap();
        }
        out
    });
    assert_eq!(&statuses[..3], &[200, 200, 200]);
    assert!(statuses[3..].iter().all(|s| *s == 400), "{statuses:?}");
    // Background threads never preempt the worker relaying streams: the capture writer runs in
    // the batch class (when the process runs at nice 0), and pingora's timeout clock does not
    // run at all with timeouts of a second or more (proxy/tests/threads.rs: and in the batch
    // class when one is shorter).
    #[cfg(target_os = "linux")]
    {
        let threads = thread_classes(proxy.proc.id());
        let main = threads
            .iter()
            .find(|t| t.0 == "headroom")
            .expect("the main thread");
        if (main.1, main.2) == (0, 0) {
            let capture = threads.iter().find(|t| t.0 == "headroom-captur");
            assert_eq!(capture.map(|t| t.2), Some(3), "{threads:?}");
            assert!(
                !threads.iter().any(|t| t.0 == "Timer thread"),
                "pingora's clock ticks with no timeout to fire: {threads:?}"
            );
            assert!(
                threads.iter().any(|t| t.0 == "tokio-rt-worker" && t.2 == 0),
                "the workers stay in the normal class: {threads:?}"
            );
        }
    }
    let logs = proxy.stop();
    sim.stop();
    let text = std::fs::read_to_string(&capture).unwrap();
    assert_eq!(text.lines().count(), 3, "{text}");
    assert!(!logs.is_empty());
    for (what, s) in [("capture", &text), ("logs", &logs)] {
        assert!(
            !s.contains(CANARY) && !s.contains("qqcanary"),
            "{what}: {s}"
        );
    }
    // One JSON access line per request, with its request id and without its text.
    let access: Vec<serde_json::Value> = logs
        .lines()
        .filter(|l| l.contains("\"headroom::access\""))
        .map(|l| serde_json::from_str(l).expect("a JSON log line"))
        .collect();
    assert_eq!(access.len(), 5, "{logs}");
    for a in &access {
        assert!(!a["request_id"].as_str().unwrap().is_empty(), "{a}");
        assert!(
            matches!(a["route"].as_str(), Some("chat" | "completions")),
            "{a}"
        );
    }
    // The capture feeds the reports and the replay unchanged.
    let tail_dir = dir.join("tail");
    let out = headroom(&[
        "report",
        "tail",
        "--trace",
        capture.to_str().unwrap(),
        "--out",
        tail_dir.to_str().unwrap(),
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(tail_dir.join("tail.html").exists());
    let out = headroom(&["trace", "info", capture.to_str().unwrap(), "--json"]);
    assert!(out.status.success());
    let info: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(info["requests"], 3);
    assert_eq!(info["output_tokens_total"], 4 + 2 + 3);
}
