//! The trace readers on files from anywhere: no panic, and a JSONL trace that reads writes back
//! to the same records.
#![no_main]

use headroom_workload::trace::{import_azure, import_burstgpt, read_jsonl, write_jsonl};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(records) = read_jsonl(data) {
        let mut out = Vec::new();
        write_jsonl(&mut out, &records).expect("writes to memory");
        let again = read_jsonl(&out[..]).expect("what was written reads back");
        assert_eq!(records, again);
    }
    let _ = import_azure(data);
    let _ = import_burstgpt(data);
});
