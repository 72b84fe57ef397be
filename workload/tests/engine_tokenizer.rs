//! The engine's tokens and vLLM's block hashes against values Hugging Face's own libraries and
//! cbor2 computed (scripts/engine_tokenizer_fixture.py): the chat template rendered as
//! transformers renders it, the ids its tokenizer gives, the hashes vLLM would publish.

use std::path::PathBuf;
use std::sync::Arc;

use headroom_workload::engine_tokenizer::EngineTokenizer;
use headroom_workload::inspect::{Chain, Endpoint, InspectConfig, VllmChain, inspect};
use headroom_workload::vllm_hash::{SaltKeys, VllmHasher};
use serde_json::Value;

fn fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/engine-tokenizer")
}

fn vectors() -> Vec<Value> {
    let text = std::fs::read_to_string(fixture().join("vectors.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

/// vLLM's chain over the fixture tokenizer, PYTHONHASHSEED=0, 16-token blocks.
fn vllm_config() -> InspectConfig {
    let chain = Chain::Vllm(Arc::new(VllmChain {
        tokenizer: EngineTokenizer::load(&fixture().join("tokenizer.json"), None).unwrap(),
        hasher: VllmHasher::new(16, Some("0"), SaltKeys::Tagged),
    }));
    InspectConfig {
        chain,
        ..InspectConfig::default()
    }
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

#[test]
fn rendering_and_tokens_match_transformers() {
    let t = EngineTokenizer::load(&fixture().join("tokenizer.json"), None).unwrap();
    assert!(t.has_chat_template());
    for v in vectors() {
        let want_ids = ids(&v["ids"]);
        let got = match v["endpoint"].as_str().unwrap() {
            "chat" => {
                let rendered = t.render_chat(&v["body"]).unwrap();
                assert_eq!(rendered, v["rendered"].as_str().unwrap());
                t.encode(&rendered, false).unwrap()
            }
            _ => t.encode(v["rendered"].as_str().unwrap(), true).unwrap(),
        };
        assert_eq!(got, want_ids, "{}", v["rendered"]);
    }
}

#[test]
fn inspection_hashes_what_vllm_would_publish() {
    let cfg = vllm_config();
    for v in vectors() {
        let endpoint = match v["endpoint"].as_str().unwrap() {
            "chat" => Endpoint::Chat,
            _ => Endpoint::Completions,
        };
        let mut body = v["body"].clone();
        body["model"] = "m".into();
        let i = inspect(endpoint, &serde_json::to_vec(&body).unwrap(), &cfg).unwrap();
        assert_eq!(i.engine_error, None);
        assert_eq!(i.prompt_tokens as usize, ids(&v["ids"]).len());
        let want: Vec<u64> = v["vllm_hashes_seed0"]
            .as_array()
            .unwrap()
            .iter()
            .map(|h| h.as_u64().unwrap())
            .collect();
        assert!(!want.is_empty());
        assert_eq!(i.blocks, want);
    }
}

#[test]
fn a_template_that_fails_falls_back_to_headroom_hashes_with_the_reason() {
    let cfg = vllm_config();
    // The fixture's template refuses unknown roles with raise_exception.
    let body = br#"{"model":"m","messages":[{"role":"narrator","content":"Once upon a time"}]}"#;
    let i = inspect(Endpoint::Chat, body, &cfg).unwrap();
    assert!(
        i.engine_error
            .as_deref()
            .unwrap()
            .contains("unknown role narrator"),
        "{:?}",
        i.engine_error
    );
    assert!(i.prompt_tokens > 0);
}

#[test]
fn a_missing_tokenizer_is_a_clear_error() {
    let err = EngineTokenizer::load(&fixture().join("no-such-tokenizer.json"), None).unwrap_err();
    assert!(err.to_string().contains("no-such-tokenizer.json"), "{err}");
}
