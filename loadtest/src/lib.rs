//! headroom-loadtest: streaming clients that measure what users feel, load drivers and reports.

pub mod client;
pub mod closed_loop;
pub mod open_loop;
pub mod stats;
pub mod synth;
