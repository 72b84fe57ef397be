//! headroom-workload: what a request stream is and how it is measured. Shared by the simulator,
//! the proxy and the load tester; depends on neither pingora nor the other headroom crates.

pub mod blocks;
pub mod capacity;
pub mod digest;
pub mod engine_metrics;
pub mod engine_tokenizer;
pub mod inspect;
pub mod json_digest;
pub mod kv_events;
pub mod measure;
pub mod openai;
pub mod profile;
pub mod realtime;
pub mod sse;
pub mod tokenizer;
pub mod trace;
pub mod vllm_hash;
pub mod words;

pub use blocks::{BlockHash, BlockHasher};
pub use tokenizer::Tokenizer;
