//! The KV event decoder on payloads from an engine's ZMQ socket: no panic, whatever the bytes.
#![no_main]

use headroom_workload::kv_events::decode_batch;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = decode_batch(data);
});
