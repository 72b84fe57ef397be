//! headroom-sim: a GPU-free vLLM replica. It schedules like vLLM's v1 engine (token budget,
//! chunked prefill, prefix cache, preemption), takes the time a roofline model says a real GPU
//! would, and answers vLLM's HTTP API and metrics byte for byte where the shapes are known.

pub mod api;
pub mod cli;
pub mod core;
pub mod engine;
pub mod faults;
pub mod kv;
pub mod kv_events;
pub mod metrics;
/// Model and GPU profiles live in headroom-workload, shared with the proxy's capacity model.
pub use headroom_workload::profile;
pub mod server;
pub mod timing;

pub use cli::{RunningReplica, SimArgs, start_fleet, start_replica};
