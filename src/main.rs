//! The `headroom` command line: parses, dispatches to the crates, sets the exit code.

use std::process::ExitCode;

use clap::{Parser, Subcommand};

#[cfg(feature = "jemalloc")]
mod allocator;
mod capacity;
mod demo;
mod serve;

/// headroom: a reverse proxy that keeps vLLM fleets below the knee, and the tools to prove it.
#[derive(Debug, Parser)]
#[command(name = "headroom", version, about, long_about = None)]
struct Cli {
    /// Log lines as text or as one JSON object each (for log pipelines).
    #[arg(long, global = true, value_enum, default_value_t = LogFormat::Text, env = "HEADROOM_LOG_FORMAT")]
    log_format: LogFormat,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Clone, Copy, clap::ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run the proxy in front of vLLM (or simulated) replicas.
    Serve(Box<serve::ServeArgs>),
    /// Run GPU-free simulated vLLM replicas (API, metrics, scheduler and timing of vLLM 0.33).
    Sim(Box<headroom_sim::SimArgs>),
    /// Start simulated replicas, drive a workload through them and print what users felt.
    Demo(demo::DemoArgs),
    /// Replay a trace against a target and measure what users would feel, with the contract.
    Replay(Box<headroom_loadtest::cli::ReplayArgs>),
    /// Reports over traces and results: tail, compare, merge, html, agreement.
    Report {
        #[command(subcommand)]
        command: headroom_loadtest::cli::ReportCommand,
    },
    /// The capacity note: KV capacity, the decode step's memory split, the knee and the
    /// recommended admission cap for a model on a GPU.
    Capacity(capacity::CapacityArgs),
    /// Import public traces, synthesize traces from workload contracts, or describe a trace (info).
    Trace {
        #[command(subcommand)]
        command: headroom_loadtest::cli::TraceCommand,
    },
    /// The `headroom serve` config: its reference and its JSON Schema, from the config types.
    Config {
        #[command(subcommand)]
        command: ConfigCommand,
    },
}

#[derive(Debug, Subcommand)]
enum ConfigCommand {
    /// Every setting with its type, default and meaning, as Markdown (docs/configuration.md).
    Reference,
    /// The JSON Schema of the config file, for editors and validators.
    Schema,
}

/// Adds the allocator's statistics (`headroom_allocator_bytes`) to a proxy's `/metrics`; nothing in
/// a build with the system's malloc.
fn export_allocator_metrics(metrics: &headroom_proxy::telemetry::Metrics) -> anyhow::Result<()> {
    #[cfg(feature = "jemalloc")]
    metrics
        .register(Box::new(allocator::AllocatorCollector::new()))
        .map_err(|e| anyhow::anyhow!("registering the allocator's metrics: {e}"))?;
    #[cfg(not(feature = "jemalloc"))]
    let _ = metrics;
    Ok(())
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let logs = tracing_subscriber::fmt()
        .with_env_filter(
            // pingora's connector logs an ERROR when a pooled upstream connection is still held
            // by its idle watcher at reuse, then simply opens a new one: not an error of the
            // request, which the proxy reports itself when one is (RUST_LOG shows it again).
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "info,pingora_core::connectors=off".into()),
        )
        .with_writer(std::io::stderr);
    match cli.log_format {
        LogFormat::Text => logs.init(),
        LogFormat::Json => logs.json().flatten_event(true).init(),
    }
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let result = runtime.block_on(async {
        match cli.command {
            Command::Serve(args) => serve::run(*args).await,
            Command::Sim(args) => run_sim(*args).await,
            Command::Demo(args) => demo::run(args).await,
            Command::Replay(args) => headroom_loadtest::cli::run_replay(*args).await.map(drop),
            Command::Trace { command } => headroom_loadtest::cli::run_trace(command),
            Command::Capacity(args) => capacity::run(args),
            Command::Report { command } => headroom_loadtest::cli::run_report(command),
            Command::Config { command } => {
                match command {
                    ConfigCommand::Reference => {
                        print!("{}", headroom_config::reference::markdown())
                    }
                    ConfigCommand::Schema => println!(
                        "{}",
                        serde_json::to_string_pretty(&headroom_config::reference::schema())?
                    ),
                }
                Ok(())
            }
        }
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

async fn run_sim(args: headroom_sim::SimArgs) -> anyhow::Result<()> {
    if args.table {
        print!("{}", headroom_sim::cli::knee_table(&args, 2300)?);
        return Ok(());
    }
    let fleet = headroom_sim::start_fleet(&args).await?;
    for r in &fleet {
        println!("{}", r.url());
    }
    eprintln!(
        "headroom sim: {} replica(s) serving {} — Ctrl-C to stop",
        fleet.len(),
        args.served_model_name
            .as_deref()
            .or(args.model.as_deref())
            .unwrap_or(&args.profile)
    );
    // Ctrl-C, or SIGTERM from a process manager (in a container the simulator is PID 1).
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    tokio::select! {
        r = tokio::signal::ctrl_c() => r?,
        _ = term.recv() => {}
    }
    eprintln!("headroom sim: stopping");
    for r in fleet {
        r.shutdown().await?;
    }
    Ok(())
}
