#!/usr/bin/env bash
# Mixed traffic on one fleet: interactive chat (trace synth --contract chat, INTERACTIVE_RATE req/s,
# header x-headroom-class: interactive) and, at the same time, a batch job (--contract rag,
# BATCH_REQUESTS requests arriving at BATCH_RATE req/s, header x-headroom-class: batch), through
# `headroom serve` in front of REPLICAS simulated Llama-3.1-8B/H100 replicas, twice:
#   shared: one pool, both classes alike, no admission: what a plain router does;
#   pools:  interactive on REPLICAS-1 replicas (priority 10), batch on the last one (priority -10,
#           long queue deadline) borrowing interactive replicas below BORROW_BELOW of their cap;
#           admission on.
# Records interactive TTFT/TPOT percentiles and goodput against INTERACTIVE_SLO, and how much of the
# batch job completed and how long it took. Loopback only; bounded by the request counts.
#
#   scripts/bench-pools.sh
set -euo pipefail
cd "$(dirname "$0")/.."
REPLICAS=${REPLICAS:-4}
INTERACTIVE_REQUESTS=${INTERACTIVE_REQUESTS:-300}
INTERACTIVE_RATE=${INTERACTIVE_RATE:-5}
BATCH_REQUESTS=${BATCH_REQUESTS:-1500}
BATCH_RATE=${BATCH_RATE:-100}
INTERACTIVE_SLO=${INTERACTIVE_SLO:-ttft=1000,tpot=100}
BORROW_BELOW=${BORROW_BELOW:-0.25}
OUT=${OUT:-results/bench-pools}
rm -rf "$OUT"
mkdir -p "$OUT"
cargo build --release --locked -q
bin=target/release/headroom

source scripts/bench-common.sh

$bin trace synth --contract chat --requests "$INTERACTIVE_REQUESTS" --rate "$INTERACTIVE_RATE" --seed 11 -o "$OUT/interactive.jsonl" 2>/dev/null
$bin trace synth --contract rag --requests "$BATCH_REQUESTS" --rate "$BATCH_RATE" --seed 12 -o "$OUT/batch.jsonl" 2>/dev/null

start_sims "$REPLICAS" "$OUT/sims.url" --profile llama-3.1-8b --gpu h100
mapfile -t urls <"$OUT/sims.url"

config() {
  local mode=$1 i
  echo 'listen = "127.0.0.1:0"'
  echo 'admin_listen = "127.0.0.1:0"'
  for i in "${!urls[@]}"; do printf '[[backends]]\nurl = "%s"\nname = "r%s"\n' "${urls[$i]}" "$i"; done
  if [ "$mode" = shared ]; then
    printf '[admission]\nenabled = false\n'
    printf '[classes.default]\n[classes.interactive]\n[classes.batch]\n'
  else
    local last=$(( ${#urls[@]} - 1 )) list=""
    for i in $(seq 0 $(( last - 1 ))); do list+="\"r$i\", "; done
    printf '[admission]\nenabled = true\ncontext_tokens = 3800\n'
    printf '[[pools]]\nname = "interactive"\nbackends = [%s]\n' "${list%, }"
    printf '[[pools]]\nname = "batch"\nbackends = ["r%s"]\nborrow = ["interactive"]\nborrow_below = %s\n' "$last" "$BORROW_BELOW"
    printf '[classes.default]\npool = "interactive"\n'
    printf '[classes.interactive]\npriority = 10\npool = "interactive"\n'
    printf '[classes.batch]\npriority = -10\nqueue_timeout_ms = 600000\nmax_queue = 100000\npool = "batch"\n'
  fi
}

for mode in shared pools; do
  dir="$OUT/$mode"
  mkdir -p "$dir"
  for u in "${urls[@]}"; do curl -sf -X POST "$u/reset_prefix_cache" >/dev/null; done
  config "$mode" >"$dir/headroom.toml"
  $bin serve --config "$dir/headroom.toml" >"$dir/serve.url" 2>"$dir/serve.log" &
  serve=$!
  wait_line "$dir/serve.log" "admin http"
  proxy=$(grep -m1 http "$dir/serve.url")
  sleep 1.5
  echo "== $mode: interactive and batch through $proxy" >&2
  $bin replay --trace "$OUT/batch.jsonl" --target "$proxy" --endpoint chat --header "x-headroom-class: batch" \
    --timeout 900 --hardware "headroom sim: $REPLICAS × Llama-3.1-8B-Instruct on H100 (roofline), headroom serve ($mode)" \
    --out "$dir/batch" >"$dir/batch.txt" 2>"$dir/batch.log" &
  batch=$!
  $bin replay --trace "$OUT/interactive.jsonl" --target "$proxy" --endpoint chat --header "x-headroom-class: interactive" \
    --slo "$INTERACTIVE_SLO" --timeout 900 \
    --hardware "headroom sim: $REPLICAS × Llama-3.1-8B-Instruct on H100 (roofline), headroom serve ($mode)" \
    --out "$dir/interactive" >"$dir/interactive.txt" 2>"$dir/interactive.log"
  wait "$batch"
  kill -TERM "$serve"; wait "$serve" 2>/dev/null || true
done

python3 - "$OUT" "$INTERACTIVE_SLO" <<'PY' | tee "$OUT/summary.md"
import json, sys
out, slo = sys.argv[1], sys.argv[2]
print(f"interactive SLO {slo}\n")
print("| fleet | interactive TTFT p50 / p99 ms | interactive TPOT p99 ms | interactive good | batch completed | batch failed | batch duration s | batch TTFT p50 ms |")
print("|---|---|---:|---:|---:|---:|---:|---:|")
for mode in ("shared", "pools"):
    i = json.load(open(f"{out}/{mode}/interactive/result.json"))["summary"]
    b = json.load(open(f"{out}/{mode}/batch/result.json"))["summary"]
    g = i["goodput"]
    print(f"| {mode} | {i['ttft']['p50_ms']:.0f} / {i['ttft']['p99_ms']:.0f} | {i['tpot']['p99_ms']:.1f} | {g['good_requests']} of {i['measured']} | {b['completed']} of {b['measured']} | {b['failed']} | {b['duration_s']:.1f} | {b['ttft']['p50_ms']:.0f} |")
PY
