//! headroom-proxy: the data plane (classify → admit → route → forward → measure → record).
//!
//! - `server`: `headroom serve` — listeners, accept loop, background loops, admin endpoints
//! - `admission/`: per-replica caps (AIMD from engine gauges), the priority queue, permits
//! - `app`: the request handler; each connection's requests read (`serve_connection`) and answered (`answer`)
//! - `forward`: one request's exchange with the replicas (retries, streaming relay, cancellation)
//! - `routing/`: pure, synchronous policies and the prefix index
//! - `upstreams/`: the fleet, in-flight guards, health probes, engine-metrics scraping
//! - `record`: the end of each generation request's timing record (metrics, goodput, capture)
//! - `shadow`: copies of a pool's requests to a candidate pool, measured and compared, discarded
//! - `telemetry/`: Prometheus metrics, `/stats` windows, the trace capture writer
//! - `auth`: client API keys (constant-time check, class, rate limit)
//! - `client_conn`: a client connection's keep-alive idle limit and header deadline
//! - `retry_budget`: retries as a bounded share of requests
//! - `lifecycle`: open requests and draining at SIGTERM
//! - `error`: proxy-made answers and their HTTP statuses, in one place

pub mod admission;
pub mod app;
pub mod auth;
pub mod client_conn;
pub mod error;
pub mod forward;
pub mod lifecycle;
pub mod record;
pub mod retry_budget;
pub mod routing;
pub mod server;
pub mod shadow;
pub mod telemetry;
pub mod upstreams;

pub use server::{ServeError, ServeHandle, build_policy, preflight, start};
