//! `headroom demo`: the main job on the embedded default.

/// Flags of `headroom demo`.
#[derive(Debug, clap::Args)]
pub struct DemoArgs {}

/// Runs the demo.
pub async fn run(_args: DemoArgs) -> anyhow::Result<()> {
    anyhow::bail!("the demo is being built")
}
