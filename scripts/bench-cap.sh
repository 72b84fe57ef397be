#!/usr/bin/env bash
# Where the admission cap settles, against where the simulator really starts to preempt. One
# simulated Llama-3.1-8B/H100 replica, the RAG contract (trace synth --contract rag), closed loop:
#   1. the preemption point: direct to the replica at each concurrency in LEVELS for LEVEL_SECONDS,
#      the engine's preemption counter read before and after; the knee is the first level with any;
#   2. through `headroom serve` with admission from a wrong starting cap (each of STARTS), at
#      concurrency OFFERED for RUN_SECONDS; the proxy's headroom_admission_cap is read every 2 s, and
#      its mean over the last SETTLE_SECONDS is where it settled.
# Loopback only; bounded in time.
#
#   scripts/bench-cap.sh
set -euo pipefail
cd "$(dirname "$0")/.."
LEVELS=${LEVELS:-100 120 140 160 180 200 240}
LEVEL_SECONDS=${LEVEL_SECONDS:-20}
STARTS=${STARTS:-20 1000}
OFFERED=${OFFERED:-400}
RUN_SECONDS=${RUN_SECONDS:-120}
SETTLE_SECONDS=${SETTLE_SECONDS:-40}
OUT=${OUT:-results/bench-cap}
rm -rf "$OUT"
mkdir -p "$OUT"
cargo build --release --locked -q
bin=target/release/headroom

source scripts/bench-common.sh

$bin trace synth --contract rag --requests 20000 --rate 100 --seed 9 -o "$OUT/trace.jsonl" 2>/dev/null
$bin sim --port 0 --profile llama-3.1-8b --gpu h100 >"$OUT/sim.url" 2>"$OUT/sim.log" &
pids+=($!)
wait_line "$OUT/sim.url" http
sim=$(grep -m1 http "$OUT/sim.url")
preemptions() { curl -sf "$sim/metrics" | awk '/^vllm:num_preemptions_total/ {print $2}' | head -1; }

echo "concurrency preemptions" >"$OUT/knee.txt"
for c in $LEVELS; do
  curl -sf -X POST "$sim/reset_prefix_cache" >/dev/null
  before=$(preemptions)
  echo "== direct, concurrency $c" >&2
  $bin replay --trace "$OUT/trace.jsonl" --target "$sim" --endpoint chat --concurrency "$c" \
    --duration "$LEVEL_SECONDS" --out "$OUT/direct-$c" >/dev/null 2>&1
  after=$(preemptions)
  echo "$c $(python3 -c "print(int($after - $before))")" >>"$OUT/knee.txt"
done

for start in $STARTS; do
  dir="$OUT/start-$start"
  mkdir -p "$dir"
  curl -sf -X POST "$sim/reset_prefix_cache" >/dev/null
  printf 'listen = "127.0.0.1:0"\nadmin_listen = "127.0.0.1:0"\n[[backends]]\nurl = "%s"\n[admission]\nmax_in_flight = %s\n[classes.default]\nqueue_timeout_ms = 600000\nmax_queue = 100000\n' \
    "$sim" "$start" >"$dir/headroom.toml"
  $bin serve --config "$dir/headroom.toml" >"$dir/serve.url" 2>"$dir/serve.log" &
  serve=$!
  wait_line "$dir/serve.log" "admin http"
  proxy=$(grep -m1 http "$dir/serve.url")
  admin=$(grep -o 'admin http://[0-9.:]*' "$dir/serve.log" | cut -d' ' -f2)
  echo "== admission from a cap of $start, concurrency $OFFERED" >&2
  $bin replay --trace "$OUT/trace.jsonl" --target "$proxy" --endpoint chat --concurrency "$OFFERED" \
    --duration "$RUN_SECONDS" --timeout 900 --out "$dir/replay" >/dev/null 2>&1 &
  replay=$!
  t=0
  while kill -0 "$replay" 2>/dev/null; do
    cap=$(curl -sf "$admin/metrics" | awk '/^headroom_admission_cap\{/ {print $2}' | head -1)
    echo "$t ${cap:-nan}" >>"$dir/cap.txt"
    sleep 2
    t=$((t + 2))
  done
  wait "$replay" || true
  kill -TERM "$serve"; wait "$serve" 2>/dev/null || true
done

python3 - "$OUT" "$STARTS" "$RUN_SECONDS" "$SETTLE_SECONDS" <<'PY' | tee "$OUT/summary.md"
import sys
out, starts, run_s, settle_s = sys.argv[1], sys.argv[2].split(), float(sys.argv[3]), float(sys.argv[4])
levels = [tuple(map(int, l.split())) for l in open(f"{out}/knee.txt").read().split("\n")[1:] if l.strip()]
knee = next((c for c, p in levels if p > 0), None)
print("| concurrency (direct) | preemptions |")
print("|---:|---:|")
for c, p in levels:
    print(f"| {c} | {p} |")
print(f"\nthe first concurrency that preempts: {knee}\n")
print("| starting cap | settled cap (mean of the last %.0f s) | min / max there | vs the preemption point |" % settle_s)
print("|---:|---:|---|---:|")
for s in starts:
    pts = [tuple(map(float, l.split())) for l in open(f"{out}/start-{s}/cap.txt") if "nan" not in l]
    end = max(t for t, _ in pts)
    tail = [c for t, c in pts if t >= end - settle_s]
    mean = sum(tail) / len(tail)
    rel = f"{(mean / knee - 1) * 100:+.0f}%" if knee else "-"
    print(f"| {s} | {mean:.0f} | {min(tail):.0f} / {max(tail):.0f} | {rel} |")
PY
