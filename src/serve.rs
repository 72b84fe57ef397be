//! `headroom serve`: the proxy, from a config file or from flags for the quick case.

use std::path::PathBuf;

use anyhow::Context;
use clap::Args;
use headroom_config::serve::{BackendConfig, POLICIES, ServeConfig};

/// Flags of `headroom serve`.
#[derive(Debug, Clone, Args)]
pub struct ServeArgs {
    /// TOML config (see config/examples/headroom.toml); the flags below override it.
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
    /// Address to listen on [default: 0.0.0.0:8080].
    #[arg(long, value_name = "ADDR")]
    listen: Option<String>,
    /// Admin listener for /metrics, /stats, /healthz, /readyz [default: 127.0.0.1:9090].
    #[arg(long, value_name = "ADDR")]
    admin_listen: Option<String>,
    /// Replica base URLs, comma-separated (replaces the config's backends, which the file may then leave out).
    #[arg(long, value_name = "URL,URL,…", value_delimiter = ',')]
    backends: Vec<String>,
    /// Routing policy [default: prefix_affinity].
    #[arg(long, value_name = "NAME", value_parser = clap::builder::PossibleValuesParser::new(POLICIES))]
    policy: Option<String>,
    /// Record every finished request to this JSONL trace (docs/trace-format.md).
    #[arg(long, value_name = "FILE")]
    capture: Option<String>,
    /// The engines' KV event endpoints (tcp://host:port), one per backend in order, for the
    /// kv_events policy.
    #[arg(long, value_name = "ENDPOINT,…", value_delimiter = ',')]
    kv_events: Vec<String>,
    /// The engines' KV event replay endpoints, one per backend in order (fills gaps in the stream).
    #[arg(long, value_name = "ENDPOINT,…", value_delimiter = ',')]
    kv_events_replay: Vec<String>,
    /// Check the config (and the flags given), and the files it names (TLS, tokenizer), then exit
    /// without serving: 0 when it would start (with a warning for a replica name that does not
    /// resolve now), 1 with the errors otherwise.
    #[arg(long)]
    check: bool,
}

impl ServeArgs {
    /// The config these flags describe, validated.
    pub fn config(&self) -> anyhow::Result<ServeConfig> {
        let mut cfg = match &self.config {
            // The flags' backends complete the file, which may then leave them out: the whole
            // is validated below.
            Some(path) if !self.backends.is_empty() => {
                headroom_config::load_toml_unvalidated::<ServeConfig>(path)?
            }
            Some(path) => headroom_config::load_toml::<ServeConfig>(path)?,
            None if self.backends.is_empty() => anyhow::bail!(
                "headroom serve needs --config FILE or --backends URL,URL,… (see config/examples/headroom.toml)"
            ),
            None => ServeConfig::quick("0.0.0.0:8080", &self.backends, "prefix_affinity"),
        };
        if let Some(l) = &self.listen {
            cfg.listen = l.clone();
        }
        if let Some(a) = &self.admin_listen {
            cfg.admin_listen = a.clone();
        }
        if let Some(p) = &self.policy {
            cfg.routing.policy = p.clone();
        }
        if let Some(c) = &self.capture {
            cfg.capture.path = Some(c.clone());
        }
        if !self.backends.is_empty() {
            cfg.backends = self.backends.iter().map(|u| BackendConfig::at(u)).collect();
        }
        for (flag, list, replay) in [
            ("--kv-events", &self.kv_events, false),
            ("--kv-events-replay", &self.kv_events_replay, true),
        ] {
            if list.is_empty() {
                continue;
            }
            if list.len() != cfg.backends.len() {
                anyhow::bail!(
                    "{flag} lists {} endpoints for {} backends: give one per backend, in order",
                    list.len(),
                    cfg.backends.len()
                );
            }
            for (b, ep) in cfg.backends.iter_mut().zip(list) {
                let slot = if replay {
                    &mut b.kv_events_replay
                } else {
                    &mut b.kv_events
                };
                *slot = Some(ep.clone());
            }
        }
        cfg.validated().map_err(|errors| {
            let list: Vec<String> = errors.iter().map(|e| format!("  - {e}")).collect();
            let origin = match &self.config {
                Some(path) => format!(" ({} and the flags given)", path.display()),
                None => String::new(),
            };
            anyhow::anyhow!("invalid serve settings{origin}:\n{}", list.join("\n"))
        })
    }
}

/// Runs the proxy until Ctrl-C or SIGTERM, then drains (`[shutdown]`); a second signal stops at
/// once. SIGHUP reloads the config file (and the flags given), refusing a bad one.
pub async fn run(args: ServeArgs) -> anyhow::Result<()> {
    let cfg = args.config()?;
    let (policy, n) = (cfg.routing.policy.clone(), cfg.backends.len());
    let a = &cfg.admission;
    let admission = match (a.enabled, a.max_in_flight) {
        (false, _) => "admission off".to_owned(),
        (true, Some(cap)) => format!("admission on (caps start at {cap})"),
        (true, None) if cfg.scrape.interval_ms == 0 => "admission on but without caps: no \
            admission.max_in_flight and no engine scrapes (scrape.interval_ms = 0) to derive one \
            from, so no request waits"
            .to_owned(),
        (true, None) => format!(
            "admission on (caps from each engine's KV capacity at {} tokens per sequence)",
            a.context_tokens
        ),
    };
    let capture = cfg
        .capture
        .path
        .as_ref()
        .map_or_else(|| "capture off".to_owned(), |p| format!("capture to {p}"));
    let pools = cfg.pool_list().len();
    let (drain, grace) = (
        std::time::Duration::from_millis(cfg.shutdown.drain_ms),
        std::time::Duration::from_millis(cfg.shutdown.grace_ms),
    );
    if args.check {
        for warning in headroom_proxy::preflight(&cfg)? {
            eprintln!("warning: {warning}");
        }
        println!(
            "config ok: listen {}, admin {}, {n} backend(s), policy {policy}, {pools} pool(s), {admission}, {capture}",
            cfg.listen, cfg.admin_listen
        );
        return Ok(());
    }
    let handle = headroom_proxy::start(cfg)
        .await
        .context("starting the proxy")?;
    crate::export_allocator_metrics(&handle.metrics)?;
    println!("http://{}", handle.addr);
    eprintln!(
        "headroom serve: listening on {} (admin http://{}), {n} backend(s), policy {policy} — Ctrl-C to stop",
        handle.addr, handle.admin_addr
    );
    eprintln!("headroom serve: {pools} pool(s), {admission}, {capture}");
    let mut handle = handle;
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    let mut hangup = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup())?;
    loop {
        tokio::select! {
            r = tokio::signal::ctrl_c() => { r?; break; }
            _ = term.recv() => break,
            _ = hangup.recv() => match args.config() {
                // The file is read again and validated; a bad one changes nothing.
                // Logged, not printed: a log pipeline (--log-format json) sees refusals as it sees
                // the reloads that succeed.
                Err(e) => tracing::error!(error = %format!("{e:#}"), "reload refused, still serving the previous config"),
                Ok(cfg) => match handle.reload(cfg).await {
                    Ok(()) => eprintln!("headroom serve: config reloaded; requests in progress finish on the previous one"),
                    Err(e) => tracing::error!(error = %e, "reload refused, still serving the previous config"),
                },
            },
        }
    }
    eprintln!(
        "headroom serve: draining ({} open): still serving for {drain:?} while /readyz says 503, \
         then up to {grace:?} for open requests — signal again to stop now",
        handle.lifecycle.open()
    );
    let draining = handle.drain(drain, grace);
    tokio::select! {
        left = draining => {
            if left > 0 {
                eprintln!("headroom serve: grace period over, {left} request(s) cut");
            } else {
                eprintln!("headroom serve: drained, every request finished");
            }
        }
        r = tokio::signal::ctrl_c() => { r?; eprintln!("headroom serve: stopped before the drain ended"); }
        _ = term.recv() => eprintln!("headroom serve: stopped before the drain ended"),
    }
    Ok(())
}
