//! The deployment files agree with the code: every `headroom_*` metric the alert rules and the
//! dashboard query is one the proxy exports, the dashboard is valid JSON, and the configs shipped
//! in deploy/ pass `headroom serve --check`. (promtool and the Kubernetes schemas check the rest in
//! `make check-deploy`.)

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn files_under(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            files_under(&path, out);
        } else {
            out.push(path);
        }
    }
}

/// Every `headroom_…` identifier in `text`.
fn metric_names(text: &str) -> BTreeSet<String> {
    let bytes = text.as_bytes();
    let mut names = BTreeSet::new();
    let mut i = 0;
    while let Some(at) = text[i..].find("headroom_") {
        let start = i + at;
        let boundary =
            start == 0 || !(bytes[start - 1].is_ascii_alphanumeric() || bytes[start - 1] == b'_');
        let mut end = start;
        while end < bytes.len()
            && (bytes[end].is_ascii_lowercase()
                || bytes[end].is_ascii_digit()
                || bytes[end] == b'_')
        {
            end += 1;
        }
        if boundary {
            names.insert(text[start..end].to_owned());
        }
        i = end;
    }
    names
}

/// The metric families the proxy registers: the quoted `"headroom_…"` names in its source and the
/// binary's.
fn exported() -> BTreeSet<String> {
    let mut files = Vec::new();
    files_under(&root().join("proxy/src"), &mut files);
    // The binary's own collectors (the allocator's statistics).
    files_under(&root().join("src"), &mut files);
    let mut names = BTreeSet::new();
    for f in files
        .iter()
        .filter(|f| f.extension().is_some_and(|e| e == "rs"))
    {
        let text = std::fs::read_to_string(f).unwrap();
        for n in metric_names(&text) {
            if text.contains(&format!("\"{n}\"")) {
                names.insert(n);
            }
        }
    }
    names
}

#[test]
fn alerts_and_dashboard_query_only_metrics_the_proxy_exports() {
    let exported = exported();
    assert!(
        exported.contains("headroom_request_ttft_seconds"),
        "{exported:?}"
    );
    let mut files = Vec::new();
    files_under(&root().join("deploy/prometheus"), &mut files);
    files_under(&root().join("deploy/grafana"), &mut files);
    let mut unknown = Vec::new();
    let mut seen = 0;
    for f in &files {
        let text = std::fs::read_to_string(f).unwrap();
        if f.extension().is_some_and(|e| e == "json") {
            let dash: serde_json::Value = serde_json::from_str(&text)
                .unwrap_or_else(|e| panic!("{} is not JSON: {e}", f.display()));
            assert!(dash["panels"].as_array().is_some_and(|p| !p.is_empty()));
        }
        for name in metric_names(&text) {
            seen += 1;
            let family = ["_bucket", "_sum", "_count"]
                .iter()
                .find_map(|s| name.strip_suffix(s).filter(|f| exported.contains(*f)))
                .unwrap_or(&name);
            if !exported.contains(family) {
                unknown.push(format!("{}: {name}", f.display()));
            }
        }
    }
    assert!(seen > 10, "the deploy files query {seen} metrics");
    assert!(
        unknown.is_empty(),
        "metrics the proxy does not export: {unknown:#?}"
    );
}

#[test]
fn the_shipped_configs_pass_serve_check() {
    for config in [
        "deploy/kubernetes/base/headroom.toml",
        "config/examples/headroom.toml",
    ] {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_headroom"))
            .args(["serve", "--check", "--config"])
            .arg(root().join(config))
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{config}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(String::from_utf8_lossy(&out.stdout).starts_with("config ok"));
    }
}
