//! KV cache events over ZMQ: a subscriber sees BlockStored for a prompt's full blocks with the
//! hashes the request side computes, in vLLM 0.33's multipart framing, and the replay socket
//! returns buffered batches followed by the end marker.

use std::time::Duration;

use headroom_sim::{SimArgs, start_replica};
use headroom_workload::BlockHasher;
use serde_json::json;
use zeromq::{Socket, SocketRecv, SocketSend, ZmqMessage};

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stored_blocks_are_published_with_request_side_hashes() {
    // A loopback endpoint without `*` connects, as vLLM's publisher does: bind the subscriber
    // first, on a port of its own choosing (one picked free and bound later could be taken
    // meanwhile).
    let mut sub = zeromq::SubSocket::new();
    let zeromq::Endpoint::Tcp(_, port) = sub.bind("tcp://127.0.0.1:0").await.unwrap() else {
        panic!("a TCP endpoint");
    };
    sub.subscribe("").await.unwrap();
    let replay_port = free_port();
    let config = json!({"enable_kv_cache_events": true, "publisher": "zmq",
        "endpoint": format!("tcp://127.0.0.1:{port}"), "replay_endpoint": format!("tcp://127.0.0.1:{replay_port}"),
        "topic": "kv"});
    let args = SimArgs::from_flags([
        "--latency-model",
        "constant",
        "--time-to-first-token",
        "2",
        "--inter-token-latency",
        "1",
        "--max-model-len",
        "4096",
        "--kv-events-config",
        &config.to_string(),
    ])
    .unwrap();
    let r = start_replica(
        args.build_replica(0).unwrap(),
        "127.0.0.1:0".parse().unwrap(),
    )
    .await
    .unwrap();

    // The publisher connects lazily and PUB drops what is sent before the subscription arrives:
    // send fresh prompts (each stores new blocks) until one batch is heard, within a bound.
    let client = reqwest::Client::new();
    let mut attempt = 0u32;
    let (prompt, message) = loop {
        attempt += 1;
        assert!(attempt <= 100, "no KV event heard after 100 requests");
        let prompt: Vec<u32> = (0..40).map(|i| i + attempt * 1000).collect();
        client
            .post(format!("{}/v1/completions", r.url()))
            .json(&json!({"prompt": prompt, "max_tokens": 1}))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        if let Ok(Ok(m)) = tokio::time::timeout(Duration::from_millis(200), sub.recv()).await {
            break (prompt, m);
        }
    };
    let frames = message.into_vec();
    assert_eq!(frames.len(), 3);
    assert_eq!(&frames[0][..], b"kv");
    let seq = u64::from_be_bytes(frames[1][..].try_into().unwrap());
    let batch: rmpv::Value = rmpv::decode::read_value(&mut &frames[2][..]).unwrap();
    let events = batch[1].as_array().unwrap();
    let stored = events
        .iter()
        .find(|e| e["type"].as_str() == Some("BlockStored"))
        .expect("a BlockStored event");
    let hashes: Vec<u64> = stored["block_hashes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|h| h.as_u64().unwrap())
        .collect();
    assert_eq!(hashes, BlockHasher::new(16, 0).hash_all(&prompt, b""));
    assert_eq!(stored["block_size"].as_u64(), Some(16));
    assert_eq!(stored["token_ids"].as_array().unwrap().len(), 32);

    // Replay from the first sequence number: at least this batch, then the end marker.
    let mut dealer = zeromq::DealerSocket::new();
    dealer
        .connect(&format!("tcp://127.0.0.1:{replay_port}"))
        .await
        .unwrap();
    let mut ask = ZmqMessage::from(Vec::<u8>::new());
    ask.push_back(0u64.to_be_bytes().to_vec().into());
    dealer.send(ask).await.unwrap();
    let mut seen = Vec::new();
    loop {
        let reply = tokio::time::timeout(Duration::from_secs(5), dealer.recv())
            .await
            .unwrap()
            .unwrap()
            .into_vec();
        let s = &reply[reply.len() - 2];
        if s[..] == [0xFF; 8] {
            assert!(reply.last().unwrap().is_empty());
            break;
        }
        seen.push(u64::from_be_bytes(s[..].try_into().unwrap()));
    }
    assert!(seen.contains(&seq), "replayed {seen:?}, wanted {seq}");
}
