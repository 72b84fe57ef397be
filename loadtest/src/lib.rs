//! headroom-loadtest: streaming clients that measure what users feel, load drivers and reports.

pub mod agreement;
pub mod analysis;
pub mod cli;
pub mod client;
pub mod closed_loop;
pub mod compare;
pub mod contracts;
pub mod html;
pub mod outputs;
pub mod pages;
pub mod replay;
pub mod report;
pub mod stalls;
pub mod stats;
pub mod synth;
