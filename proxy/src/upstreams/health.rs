//! Background loops over the fleet: active health probes (which also learn the models each replica
//! serves, from `/v1/models`), and scraping each replica's `/metrics` for the engine's own gauges
//! (and its KV capacity, which sizes the prefix index).

use std::sync::Arc;
use std::sync::RwLock;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use headroom_config::serve::{HealthConfig, ScrapeConfig};
use headroom_workload::engine_metrics::EngineGauges;
use tokio::sync::watch;

use super::{Backend, Fleet, Scraped};

/// Runs `visit` on every replica at once, each `interval`, until `stop` turns true. The first round
/// runs at once; a slow round delays the next instead of piling up.
async fn every_round<F, Fut>(
    fleet: &Fleet,
    interval: Duration,
    mut stop: watch::Receiver<bool>,
    visit: F,
) where
    F: Fn(Arc<Backend>) -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = stop.changed() => return,
        }
        futures_util::future::join_all(fleet.backends.iter().cloned().map(&visit)).await;
    }
}

/// `GET url` within `timeout`, when it answers with a success status.
async fn get_ok(
    client: &reqwest::Client,
    url: String,
    timeout: Duration,
) -> Option<reqwest::Response> {
    let resp = client.get(url).timeout(timeout).send().await.ok()?;
    resp.status().is_success().then_some(resp)
}

/// Called when a probe round finds a replica's routability (healthy and not ejected) changed since
/// the round before, with the new one.
pub type OnRoutable = Arc<dyn Fn(&Backend, bool) + Send + Sync>;

/// Probes every replica each `interval_ms` until `stop` turns true; a passing replica's model list
/// is refreshed too.
pub async fn probe_loop(
    fleet: Arc<Fleet>,
    cfg: HealthConfig,
    client: reqwest::Client,
    on_routable: OnRoutable,
    stop: watch::Receiver<bool>,
) {
    let timeout = Duration::from_millis(cfg.timeout_ms);
    // Routable at the last round, by replica id: a fresh proxy presumes its replicas are. An
    // ejection that ended between rounds is found at the next one.
    let routable: Vec<AtomicBool> = fleet
        .backends
        .iter()
        .map(|_| AtomicBool::new(true))
        .collect();
    let (client, fleet_ref, path, routable) = (&client, &fleet, &cfg.path, &routable);
    let on_routable = &on_routable;
    every_round(
        &fleet,
        Duration::from_millis(cfg.interval_ms),
        stop,
        |b| async move {
            // A replica whose name resolves nowhere fails its probe without one being sent.
            let passed = b.resolve().await.is_some()
                && get_ok(client, format!("{}{path}", b.url), timeout)
                    .await
                    .is_some();
            fleet_ref.probe_result(&b, passed);
            let now = fleet_ref.is_available(&b);
            let before = routable
                .get(b.id)
                .is_none_or(|r| r.swap(now, Ordering::Relaxed));
            if now != before {
                on_routable(&b, now);
            }
            if passed {
                if let Some(models) = models(client, &b, timeout).await {
                    b.set_models(models);
                }
            }
        },
    )
    .await;
}

async fn models(client: &reqwest::Client, b: &Backend, timeout: Duration) -> Option<Vec<String>> {
    let resp = get_ok(client, format!("{}/v1/models", b.url), timeout).await?;
    let v: serde_json::Value = resp.json().await.ok()?;
    let ids = v.get("data")?.as_array()?.iter();
    Some(
        ids.filter_map(|m| Some(m.get("id")?.as_str()?.to_owned()))
            .collect(),
    )
}

/// Called with each successful scrape, and whether it found the engine restarted since the one
/// before ([`EngineGauges::restarted_since`]).
pub type OnScrape = Arc<dyn Fn(&Backend, &EngineGauges, bool) + Send + Sync>;

/// Restarts of one replica closer together than this are logged at debug level only (an address
/// whose every scrape finds a new engine is several engines behind one load balancer; the
/// restart counter shows it without a line per scrape).
const RESTART_LOG_QUIET: Duration = Duration::from_secs(60);

/// Scrapes every replica's `/metrics` each `interval_ms` until `stop` turns true (never when 0).
pub async fn scrape_loop(
    fleet: Arc<Fleet>,
    cfg: ScrapeConfig,
    client: reqwest::Client,
    on_scrape: OnScrape,
    held: Arc<RwLock<bool>>,
    stop: watch::Receiver<bool>,
) {
    if cfg.interval_ms == 0 {
        return;
    }
    let timeout = Duration::from_millis(cfg.timeout_ms);
    let (client, on_scrape, held) = (&client, &on_scrape, &held);
    every_round(
        &fleet,
        Duration::from_millis(cfg.interval_ms),
        stop,
        |b| async move {
            let Some(resp) = get_ok(client, format!("{}/metrics", b.url), timeout).await else {
                return;
            };
            let Ok(body) = resp.bytes().await else {
                return;
            };
            // An exposition is UTF-8: checked in one pass, copied and repaired only if it is not.
            let text = match std::str::from_utf8(&body) {
                Ok(text) => std::borrow::Cow::Borrowed(text),
                Err(_) => String::from_utf8_lossy(&body),
            };
            let own_in_flight = b.load().in_flight;
            let gauges = EngineGauges::parse(&text);
            let now = Instant::now();
            // From the check to the end of `on_scrape`, a reload waits to copy this state (it
            // takes `held` to write), and once it has begun this scrape is dropped unread: each
            // restart is found, counted and forgotten by exactly one config, the one whose state
            // carries on. Nothing here awaits.
            let held = held.read().unwrap_or_else(|e| e.into_inner());
            if *held {
                return;
            }
            let (restarted, last_restart, kept) = {
                let mut scraped = b.engine.lock().unwrap_or_else(|e| e.into_inner());
                let restarted = gauges.restarted_since(&scraped.gauges);
                let last_restart = scraped.last_restart;
                let mut kept = gauges.clone();
                if !restarted {
                    kept.keep_totals_of(&scraped.gauges);
                }
                *scraped = Scraped {
                    gauges: kept.clone(),
                    at: Some(now),
                    own_in_flight,
                    last_restart: if restarted { Some(now) } else { last_restart },
                };
                (restarted, last_restart, kept)
            };
            if restarted {
                if last_restart.is_some_and(|t| now.duration_since(t) < RESTART_LOG_QUIET) {
                    tracing::debug!(backend = %b.name, "engine restarted again within a minute");
                } else {
                    tracing::info!(
                        backend = %b.name,
                        "engine restarted (its start time changed or its counters went back): \
                         its prefix cache is empty, and prefix routing forgets what it sent it"
                    );
                }
            }
            // The totals as kept, so that counters re-exported from them do not jump by an
            // engine's whole count after a scrape that lacked one.
            on_scrape(&b, &kept, restarted);
            drop(held);
        },
    )
    .await;
}
