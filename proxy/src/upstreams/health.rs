//! Background loops over the fleet: active health probes (which also learn the models each replica
//! serves, from `/v1/models`), and scraping each replica's `/metrics` for the engine's own gauges
//! (and its KV capacity, which sizes the prefix index).

use std::sync::Arc;
use std::time::{Duration, Instant};

use headroom_config::serve::{HealthConfig, ScrapeConfig};
use headroom_workload::engine_metrics::EngineGauges;
use tokio::sync::watch;

use super::{Backend, Fleet, Scraped};

/// Probes every replica each `interval_ms` until `stop` turns true. The first round runs at once.
pub async fn probe_loop(
    fleet: Arc<Fleet>,
    cfg: HealthConfig,
    client: reqwest::Client,
    mut stop: watch::Receiver<bool>,
) {
    let mut tick = tokio::time::interval(Duration::from_millis(cfg.interval_ms));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = stop.changed() => return,
        }
        let rounds = fleet.backends.iter().map(|b| {
            let (client, fleet, b) = (client.clone(), fleet.clone(), b.clone());
            let (path, timeout) = (cfg.path.clone(), Duration::from_millis(cfg.timeout_ms));
            async move {
                let passed = probe(&client, &b, &path, timeout).await;
                fleet.probe_result(&b, passed);
                if passed {
                    if let Some(models) = models(&client, &b, timeout).await {
                        b.set_models(models);
                    }
                }
            }
        });
        futures_util::future::join_all(rounds).await;
    }
}

async fn probe(client: &reqwest::Client, b: &Backend, path: &str, timeout: Duration) -> bool {
    let url = format!("{}{path}", b.url);
    matches!(
        client.get(url).timeout(timeout).send().await,
        Ok(r) if r.status().is_success()
    )
}

async fn models(client: &reqwest::Client, b: &Backend, timeout: Duration) -> Option<Vec<String>> {
    let url = format!("{}/v1/models", b.url);
    let resp = client.get(url).timeout(timeout).send().await.ok()?;
    if !resp.status().is_success() {
        return None;
    }
    let v: serde_json::Value = resp.json().await.ok()?;
    let ids = v.get("data")?.as_array()?.iter();
    Some(
        ids.filter_map(|m| Some(m.get("id")?.as_str()?.to_owned()))
            .collect(),
    )
}

/// Called with each successful scrape.
pub type OnScrape = Arc<dyn Fn(&Backend, &EngineGauges) + Send + Sync>;

/// Scrapes every replica's `/metrics` each `interval_ms` until `stop` turns true.
pub async fn scrape_loop(
    fleet: Arc<Fleet>,
    cfg: ScrapeConfig,
    client: reqwest::Client,
    on_scrape: OnScrape,
    mut stop: watch::Receiver<bool>,
) {
    if cfg.interval_ms == 0 {
        return;
    }
    let mut tick = tokio::time::interval(Duration::from_millis(cfg.interval_ms));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = stop.changed() => return,
        }
        let rounds = fleet.backends.iter().map(|b| {
            let (client, b, on_scrape) = (client.clone(), b.clone(), on_scrape.clone());
            let timeout = Duration::from_millis(cfg.timeout_ms);
            async move {
                let url = format!("{}/metrics", b.url);
                let Ok(resp) = client.get(url).timeout(timeout).send().await else {
                    return;
                };
                if !resp.status().is_success() {
                    return;
                }
                let Ok(text) = resp.text().await else {
                    return;
                };
                let gauges = EngineGauges::parse(&text);
                on_scrape(&b, &gauges);
                *b.engine.lock().unwrap_or_else(|e| e.into_inner()) = Scraped {
                    gauges,
                    at: Some(Instant::now()),
                };
            }
        });
        futures_util::future::join_all(rounds).await;
    }
}
