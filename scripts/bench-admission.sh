#!/usr/bin/env bash
# Admission under overload, side by side in one run: the same open-loop RAG workload (trace synth
# --contract rag: ~3,500-token prompts sharing a system prefix, ~200-token answers) offered at RATE
# req/s to REPLICAS simulated Llama-3.1-8B/H100 replicas through `headroom serve`, once with
# admission off and once on (the cap derived from the engines' KV capacity at CONTEXT tokens per
# sequence, then adapted from their preemptions; a queue deadline of QUEUE_TIMEOUT_MS (the TTFT
# objective less the prefill, so a request admitted at its deadline can still be good), after which a
# request is refused with 503 and Retry-After rather than left to miss its SLO). SWEEP_RATES adds
# runs with admission off at lower rates, to find the best goodput the fleet gives at all. Records,
# per run: completed and refused requests, the engines' preemptions, goodput against SLO, TTFT and
# TPOT, and the proxy's permit and queue gauges at rest (they must be 0). Loopback only; bounded by
# REQUESTS.
#
#   REPLICAS=4 RATE=90 SWEEP_RATES="20 30" scripts/bench-admission.sh
#   RELOAD_EVERY=3 ...   # the proxy reloads its (unchanged) config every 3 s of each replay (SIGHUP)
#   SERVE_BIN=/tmp/headroom-b ... # another build as the proxy (an A/B of builds; this script builds
#                        # target/release/headroom: copy build B aside first)
set -euo pipefail
# SERVE_BIN is resolved where it was given, before the move to the repository's root.
if [ -n "${SERVE_BIN:-}" ]; then
  [ -x "$SERVE_BIN" ] || { echo "SERVE_BIN=$SERVE_BIN is not an executable" >&2; exit 1; }
  SERVE_BIN=$(realpath "$SERVE_BIN")
fi
cd "$(dirname "$0")/.."
RELOAD_EVERY=${RELOAD_EVERY:-0}
REPLICAS=${REPLICAS:-4}
REQUESTS=${REQUESTS:-1200}
RATE=${RATE:-90}
SWEEP_RATES=${SWEEP_RATES:-}
CONTEXT=${CONTEXT:-3800}
QUEUE_TIMEOUT_MS=${QUEUE_TIMEOUT_MS:-1500}
SLO=${SLO:-ttft=2000,tpot=100}
SEED=${SEED:-5}
OUT=${OUT:-results/bench-admission}
rm -rf "$OUT"
mkdir -p "$OUT"
cargo build --release --locked -q
bin=target/release/headroom
if [ -n "${SERVE_BIN:-}" ] && [ "$SERVE_BIN" = "$(realpath "$bin")" ]; then
  echo "SERVE_BIN is target/release/headroom, which this script has just rebuilt: copy build B aside first" >&2
  exit 1
fi
SERVE_BIN=${SERVE_BIN:-$bin}

source scripts/bench-common.sh

start_sims "$REPLICAS" "$OUT/sims.url" --profile llama-3.1-8b --gpu h100

preemptions() {
  local total=0 u n
  for u in $(cat "$OUT/sims.url"); do
    n=$(curl -sf "$u/metrics" | awk '/^vllm:num_preemptions_total/ {print $2}' | head -1)
    total=$(python3 -c "print(int(${total} + ${n:-0}))")
  done
  echo "$total"
}

# run NAME RATE ADMISSION
run() {
  local name=$1 rate=$2 admission=$3 dir="$OUT/$1"
  mkdir -p "$dir"
  for u in $(cat "$OUT/sims.url"); do curl -sf -X POST "$u/reset_prefix_cache" >/dev/null; done
  local requests
  requests=$(python3 -c "print(min($REQUESTS, max(100, int($rate * $REQUESTS / $RATE))))")
  $bin trace synth --contract rag --requests "$requests" --rate "$rate" --seed "$SEED" -o "$dir/trace.jsonl" 2>/dev/null
  {
    echo 'listen = "127.0.0.1:0"'
    echo 'admin_listen = "127.0.0.1:0"'
    for u in $(cat "$OUT/sims.url"); do printf '[[backends]]\nurl = "%s"\n' "$u"; done
    printf '[admission]\nenabled = %s\ncontext_tokens = %s\n' "$admission" "$CONTEXT"
    printf '[classes.default]\nqueue_timeout_ms = %s\nmax_queue = 100000\n' "$QUEUE_TIMEOUT_MS"
  } >"$dir/headroom.toml"
  "$SERVE_BIN" serve --config "$dir/headroom.toml" >"$dir/serve.url" 2>"$dir/serve.log" &
  local serve=$!
  wait_line "$dir/serve.log" "admin http"
  local proxy admin before after
  proxy=$(grep -m1 http "$dir/serve.url")
  admin=$(grep -o 'admin http://[0-9.:]*' "$dir/serve.log" | cut -d' ' -f2)
  # Let the first scrape set the caps.
  sleep 1.5
  before=$(preemptions)
  echo "== $name: $requests requests at $rate req/s, admission $admission" >&2
  $bin replay --trace "$dir/trace.jsonl" --target "$proxy" --endpoint chat --slo "$SLO" --timeout 600 \
    --hardware "headroom sim: $REPLICAS × Llama-3.1-8B-Instruct on H100 (roofline), behind headroom serve (admission $admission; config reloaded every ${RELOAD_EVERY}s (0: never); proxy build $(basename "$SERVE_BIN"))" \
    --out "$dir" >"$dir/replay.txt" &
  local replay=$! reloads=0
  if [ "$RELOAD_EVERY" != 0 ]; then
    while kill -0 "$replay" 2>/dev/null; do
      sleep "$RELOAD_EVERY" & wait $! || true
      kill -0 "$replay" 2>/dev/null || break
      kill -HUP "$serve"
      reloads=$((reloads + 1))
    done
  fi
  wait "$replay"
  echo "$reloads" >"$dir/reloads"
  after=$(preemptions)
  echo "$before $after" >"$dir/preemptions"
  curl -sf "$admin/metrics" >"$dir/proxy-metrics.txt"
  kill -TERM "$serve"; wait "$serve" 2>/dev/null || true
}

run overload-off "$RATE" false
run overload-on "$RATE" true
for r in $SWEEP_RATES; do run "sweep-off-$r" "$r" false; done

python3 - "$OUT" "$RATE" "$SLO" <<'PY' | tee "$OUT/summary.md"
import json, os, re, sys
out, rate, slo = sys.argv[1], sys.argv[2], sys.argv[3]
runs = sorted(d for d in os.listdir(out) if os.path.isfile(f"{out}/{d}/result.json"))
print(f"SLO {slo}; offered {rate} req/s in the overload runs\n")
print("| run | offered req/s | requests | completed | refused 503/429 | preemptions | preemptions per request | goodput req/s | goodput tok/s | TTFT p50 / p99 ms | TPOT p99 ms | permits / queued at rest | reloads |")
print("|---|---:|---:|---:|---|---:|---:|---:|---:|---|---:|---|---:|")
for d in runs:
    r = json.load(open(f"{out}/{d}/result.json"))
    s = r["summary"]
    b, a = map(float, open(f"{out}/{d}/preemptions").read().split())
    kinds = s.get("errors_by_kind") or s.get("errors") or {}
    refused = f"{kinds.get('status_503', 0)}/{kinds.get('status_429', 0)}"
    m = open(f"{out}/{d}/proxy-metrics.txt").read()
    held = sum(float(x) for x in re.findall(r'^headroom_admission_in_flight\{[^}]*\} (\S+)', m, re.M))
    queued = sum(float(x) for x in re.findall(r'^headroom_queue_depth\{[^}]*\} (\S+)', m, re.M))
    g = s["goodput"]
    n = s["requests"] if "requests" in s else s["measured"]
    reloads = open(f"{out}/{d}/reloads").read().strip() if os.path.exists(f"{out}/{d}/reloads") else "0"
    print(f"| {d} | {re.sub('[^0-9.]', '', d.split('-')[-1]) if d.startswith('sweep') else rate} | {n} | {s['completed']} | {refused} | {a-b:.0f} | {(a-b)/max(n,1):.4f} | {g['requests_per_s']:.2f} | {g['output_tokens_per_s']:.0f} | {s['ttft']['p50_ms']:.0f} / {s['ttft']['p99_ms']:.0f} | {s['tpot']['p99_ms']:.1f} | {held:.0f} / {queued:.0f} | {reloads} |")
PY
