//! Routing hot paths on realistic prefixes: a 4,096-token prompt (256 blocks of 16) against a fleet
//! of 8 replicas whose indices hold 20,000 blocks each, half of them sharing the prompt's first 128
//! blocks; request inspection (parse, render, tokenize, hash) of chat bodies of 4k and 32k
//! prompt tokens, which the proxy does once per generation request; and the response meter on one
//! vLLM-shaped token chunk, which runs once per relayed chunk; and reading a replica's `/metrics`
//! (the simulator's vLLM-shaped exposition), which the proxy's workers do once per replica per
//! scrape interval.

use criterion::{Criterion, criterion_group, criterion_main};
use headroom_proxy::routing::{
    BackendView, ConsistentHash, PrefixAffinity, PrefixIndex, RouteRequest, RoutingPolicy,
};

fn setup() -> (PrefixAffinity, Vec<BackendView>, Vec<u64>) {
    let mut index = PrefixIndex::new();
    let prompt: Vec<u64> = (0..256u64)
        .map(|i| i.wrapping_mul(0x9E37_79B9_7F4A_7C15))
        .collect();
    for b in 0..8usize {
        index.set_capacity(b, 20_000);
        for j in 0..78u64 {
            let blocks: Vec<u64> = (0..256u64)
                .map(|i| (b as u64 * 1_000_003 + j * 7919 + i) | 1)
                .collect();
            index.record(b, &blocks);
        }
        if b % 2 == 0 {
            index.record(b, &prompt[..128]);
        }
    }
    let fleet = (0..8)
        .map(|id| BackendView {
            id,
            key: id as u64 * 31 + 7,
            healthy: true,
            in_flight: 10,
            pending_prefill_tokens: 5_000,
            decoding: 8,
            foreign: Default::default(),
        })
        .collect();
    (PrefixAffinity::new(index), fleet, prompt)
}

fn bench(c: &mut Criterion) {
    let (policy, fleet, prompt) = setup();
    let req = RouteRequest {
        blocks: &prompt,
        block_tokens: 16,
        prompt_tokens: 4096,
        session: None,
        not_engine_chain: false,
    };
    c.bench_function("prefix_index_overlaps_256_blocks_8_replicas", |b| {
        b.iter(|| policy.with_index(|ix| ix.overlaps(std::hint::black_box(&prompt))))
    });
    c.bench_function("prefix_affinity_select", |b| {
        b.iter(|| policy.select(std::hint::black_box(&req), &fleet))
    });
    // A request's whole index work: recorded (held) when sent, released when it ends.
    c.bench_function("prefix_affinity_record_and_finished_256_blocks", |b| {
        b.iter(|| {
            policy.record(
                std::hint::black_box(&req),
                &headroom_proxy::routing::Pick {
                    backend: 3,
                    matched_tokens: 0,
                },
            );
            policy.finished(std::hint::black_box(&req), 3);
        })
    });
    // A 100,000-token prompt (6,250 blocks) never seen before, recorded into a replica whose
    // index is full (30,000 blocks, about an 8B model's KV cache on one H100): every block is new
    // and evicts one, as for a long conversation's first turn.
    let mut fresh = 1u64 << 40;
    c.bench_function("prefix_index_record_6250_new_blocks_full_index", |b| {
        b.iter(|| {
            fresh += 6_250;
            let blocks: Vec<u64> = (fresh..fresh + 6_250).collect();
            policy.with_index(|ix| {
                ix.set_capacity(5, 30_000);
                ix.record(5, std::hint::black_box(&blocks))
            })
        })
    });
    let consistent = ConsistentHash::default();
    c.bench_function("consistent_hash_select_8_replicas", |b| {
        b.iter(|| consistent.select(std::hint::black_box(&req), &fleet))
    });
    // What `consistent_hash` learns once per request, under its lock: how the prompt's first
    // blocks (up to BRANCH_DEPTH) continue. Prompts of 256 blocks share their first 64 (a system
    // prompt) and then go their own way, so every one adds continuations.
    let prompts: Vec<Vec<u64>> = (1..=4096u64)
        .map(|n| {
            prompt[..64]
                .iter()
                .copied()
                .chain((0..192u64).map(|i| (n << 20) | i))
                .collect()
        })
        .collect();
    let mut next = prompts.iter().cycle();
    let pick = headroom_proxy::routing::Pick {
        backend: 0,
        matched_tokens: 0,
    };
    c.bench_function("consistent_hash_record_256_blocks", |b| {
        b.iter(|| {
            let blocks = next.next().expect("a cycle never ends");
            let r = RouteRequest {
                blocks,
                block_tokens: 16,
                prompt_tokens: 4096,
                session: None,
                not_engine_chain: false,
            };
            consistent.record(std::hint::black_box(&r), &pick)
        })
    });
}

fn chat_body(words: usize) -> Vec<u8> {
    let text: String = (0..words)
        .map(|i| headroom_workload::words::spaced_word(i as u64 * 7 + 3))
        .collect();
    serde_json::to_vec(&serde_json::json!({
        "model": "meta-llama/Llama-3.1-8B-Instruct",
        "stream": true,
        "messages": [
            {"role": "system", "content": text},
            {"role": "user", "content": "Summarise the above."},
        ],
    }))
    .expect("serializable")
}

fn inspection(c: &mut Criterion) {
    use headroom_workload::inspect::{Endpoint, InspectConfig, inspect};
    let cfg = InspectConfig::default();
    for (name, words) in [
        ("inspect_chat_4k_tokens", 4_000),
        ("inspect_chat_32k_tokens", 32_000),
    ] {
        let body = chat_body(words);
        c.bench_function(name, |b| {
            b.iter(|| inspect(Endpoint::Chat, std::hint::black_box(&body), &cfg))
        });
    }
    // A vision request: a question and a 1 MiB inline image, which inspection reads past and
    // digests (json_digest.rs) without copying it out of the body.
    let image: String = (0..1 << 20)
        .map(|i| (b'A' + (i % 26) as u8) as char)
        .collect();
    let body = serde_json::to_vec(&serde_json::json!({
            "model": "meta-llama/Llama-3.1-8B-Instruct",
            "max_tokens": 64,
            "messages": [{"role": "user", "content": [
                {"type": "text", "text": "What is in this image?"},
                {"type": "image_url", "image_url": {"url": format!("data:image/png;base64,{image}")}},
        ]}],
    }))
    .expect("serializable");
    c.bench_function("inspect_chat_1_mib_image", |b| {
        b.iter(|| inspect(Endpoint::Chat, std::hint::black_box(&body), &cfg))
    });
    // The tokenizer alone, on the 32k prompt's text: its share of inspection.
    let text: String = (0..32_000)
        .map(|i| headroom_workload::words::spaced_word(i as u64 * 7 + 3))
        .collect();
    c.bench_function("tokenize_32k_tokens", |b| {
        b.iter(|| headroom_workload::Tokenizer.encode(std::hint::black_box(&text)))
    });
}

fn metering(c: &mut Criterion) {
    use headroom_workload::measure::ResponseMeter;
    let chunk = bytes::Bytes::from_static(
        b"data: {\"id\":\"chatcmpl-8f3a\",\"object\":\"chat.completion.chunk\",\"created\":1796026245,\"model\":\"meta-llama/Llama-3.1-8B-Instruct\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\" together\"},\"logprobs\":null,\"finish_reason\":null}]}\n\n",
    );
    for (name, strip) in [
        ("meter_token_chunk", false),
        ("meter_token_chunk_cutting_usage", true),
    ] {
        let mut meter = ResponseMeter::new(true, strip);
        let now = std::time::Instant::now();
        c.bench_function(name, |b| {
            b.iter(|| meter.on_chunk(std::hint::black_box(chunk.clone()), now))
        });
    }
}

fn scraping(c: &mut Criterion) {
    use headroom_sim::metrics::{CacheInfo, Metrics};
    use headroom_workload::engine_metrics::EngineGauges;
    let cache = CacheInfo {
        block_size: 16,
        num_gpu_blocks: 30_000,
        gpu_memory_utilization: 0.9,
        cache_dtype: "auto".into(),
        enable_prefix_caching: true,
    };
    let text = Metrics::new("meta-llama/Llama-3.1-8B-Instruct", false, &cache, 131_072).render();
    assert!(EngineGauges::parse(&text).kv_capacity_tokens().is_some());
    c.bench_function(
        &format!("engine_metrics_parse_{}_kib", text.len() / 1024),
        |b| b.iter(|| EngineGauges::parse(std::hint::black_box(&text))),
    );
}

criterion_group!(benches, bench, inspection, metering, scraping);
criterion_main!(benches);
