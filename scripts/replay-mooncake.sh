#!/usr/bin/env bash
# Replays the first ROWS rows of the real Mooncake conversation trace against one simulated replica
# and checks what docs/benchmarks.md records: every request's usage.prompt_tokens equals its
# input_length, the replica's prefix-cache hit rate agrees with the one the hash ids imply for the
# same cache size, and how punctually requests were sent. Loopback only; about 11 minutes at
# TIME_SCALE=1 (the trace's own pace). PIN=1 puts the replica on a core of its own and the replay
# on the others (scripts/pin.sh), so that a burst's prompts being read by the replica do not delay
# the sends. PRESTAGE=1 replays with --prestage (each request complete at the target on schedule,
# its headers and body but the last byte sent ahead).
set -euo pipefail
cd "$(dirname "$0")/.."
ROWS=${ROWS:-2000}
TIME_SCALE=${TIME_SCALE:-1}
BLOCKS=${BLOCKS:-100000}
TRACE=${TRACE:-../shared/traces/mooncake_conversation.jsonl}
OUT=${OUT:-results/replay-mooncake}
send_args=()
[ "${PRESTAGE:-0}" = 1 ] && send_args=(--prestage)
mkdir -p "$OUT"
[ -f "$TRACE" ] || { echo "trace not found: $TRACE" >&2; exit 2; }
cargo build --release --locked -q
source scripts/pin.sh
# Constant step times keep one replica ahead of the trace; the checks are about lengths, caching
# and send times, not speed.
"${sut_on[@]}" target/release/headroom sim --port 0 --latency-model constant --time-to-first-token 2 \
  --inter-token-latency 1 --num-gpu-blocks "$BLOCKS" >"$OUT/sim.url" 2>"$OUT/sim.log" &
sim=$!
trap 'kill -INT $sim 2>/dev/null || true; wait $sim 2>/dev/null || true; pin_cleanup' EXIT
for _ in $(seq 100); do grep -q http "$OUT/sim.url" 2>/dev/null && break; sleep 0.1; done
url=$(grep -m1 http "$OUT/sim.url")
"${load_on[@]}" target/release/headroom replay --trace "$TRACE" --max-requests "$ROWS" --time-scale "$TIME_SCALE" "${send_args[@]}" \
  --target "$url" --hardware "headroom sim, constant 2 ms/1 ms steps, $BLOCKS KV blocks; $placement" --out "$OUT"
python3 - "$OUT/result.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
s, t = d["summary"], d["target_observed"]
rows = d["requests"]
mismatch = sum(1 for r in rows if r["prompt_tokens"] != r["input_length"])
hit, offline = t["prefix_cache_hit_rate"], t["offline_prefix_hit_rate"]
print(f"prompt_tokens != input_length: {mismatch} of {len(rows)}")
print(f"prefix-cache hit rate: replica {100*hit:.2f}%, offline from hash ids {100*offline:.2f}% (diff {100*abs(hit-offline):.2f} points)")
print(f"send lateness: p50 {s['send_lateness']['p50_ms']:.2f} ms, p99 {s['send_lateness']['p99_ms']:.2f} ms")
ok = mismatch == 0 and abs(hit - offline) <= 0.02 and s["failed"] == 0
print("OK" if ok else "FAIL")
sys.exit(0 if ok else 1)
PY
