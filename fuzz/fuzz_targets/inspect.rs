//! The request inspector on client bodies: no panic for either endpoint, the hashed blocks bounded
//! by the configured cap, and a usage rewrite of a JSON body (when made) still JSON, asking for
//! usage. (serde skips unknown members without checking them, so a body the inspector reads need
//! not be JSON throughout; the rewrite keeps its bytes as they were.)
#![no_main]

use headroom_workload::inspect::{Endpoint, InspectConfig, ask_for_usage, inspect};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let cfg = InspectConfig {
        max_hashed_tokens: 4096,
        ..InspectConfig::default()
    };
    for endpoint in [Endpoint::Chat, Endpoint::Completions] {
        if let Ok(i) = inspect(endpoint, data, &cfg) {
            let most = cfg.max_hashed_tokens.div_ceil(cfg.block_tokens) as usize;
            assert!(i.blocks.len() <= most, "{} blocks", i.blocks.len());
            let is_json = serde_json::from_slice::<serde_json::Value>(data).is_ok();
            if let Some(rewritten) = ask_for_usage(data, &i).filter(|_| is_json) {
                let v: serde_json::Value = serde_json::from_slice(&rewritten)
                    .expect("the rewritten body is JSON");
                assert_eq!(v["stream_options"]["include_usage"], true);
            }
        }
    }
});
