#!/usr/bin/env bash
# Soak: a sustained load at a fraction of the fleet's capacity through `headroom serve`, with
# clients that give up early and replicas killed (SIGKILL) and restarted, for DURATION seconds.
# Records the proxy's RSS and live heap every 10 s, every request's outcome and TTFT (headroom replay), and at
# the end the proxy's gauges at rest. Loopback only; bounded by DURATION.
#
#   scripts/soak.sh                         # 30 minutes at 80% of capacity, a kill every 2 minutes
#   DURATION=120 KILL_EVERY=30 scripts/soak.sh
#
# Capacity: each simulated replica runs at most MAX_SEQS sequences with constant step times
# (TTFT_MS for a step with prefill, ITL_MS otherwise), so it completes MAX_SEQS / (request time)
# requests per second; the load is LOAD of that over REPLICAS replicas, Poisson.
# vLLM's own default is 256 sequences: MAX_SEQS=256 ITL_MS=100 keeps this machine's event rate near
# the default run's while the engines' queue stops forming at 80% (docs/reliability.md#soak). The
# client waits TIMEOUT seconds (default: twice the longest answer's unqueued time, at least 120) and
# the SLO's TPOT is SLO_TPOT_MS (default: twice ITL_MS).
#
# Tail stability: with REPEAT_EVERY=S the arrival pattern and lengths of the first S seconds repeat
# for the whole run (each repetition with fresh prompt text, so no cache carries over), so the first
# and the last windows of S seconds get the same workload and differ only by what the proxy does over
# time; REPEAT_EVERY=0 (the default) is one Poisson process for the whole run.
#
# Memory: the proxy's bounded structures must be full before growth means a leak. The largest is the
# prefix index, sized by default from each engine's KV capacity (some 29,000 blocks per simulated
# replica, which this load would take ~40 minutes to fill); INDEX_BLOCKS caps it so it is full within
# the first minutes (0: the engine-sized default). Its size is sampled beside the RSS.
set -euo pipefail
cd "$(dirname "$0")/.."
DURATION=${DURATION:-1800}
LOAD=${LOAD:-0.8}
REPLICAS=${REPLICAS:-2}
MAX_SEQS=${MAX_SEQS:-48}
TTFT_MS=${TTFT_MS:-30}
ITL_MS=${ITL_MS:-25}
KILL_EVERY=${KILL_EVERY:-120}
ABORTS_PER_S=${ABORTS_PER_S:-2}
SEED=${SEED:-1}
INDEX_BLOCKS=${INDEX_BLOCKS:-2048}
REPEAT_EVERY=${REPEAT_EVERY:-0}
OUT=${OUT:-results/soak}
rm -rf "$OUT"
mkdir -p "$OUT"
cargo build --release --locked -q
bin=target/release/headroom
source scripts/bench-common.sh
# Restarted replicas are not children the shared cleanup knows: stop them too.
soak_cleanup() {
  for f in "$OUT"/sim-*.pid; do [ -f "$f" ] && kill -KILL "$(cat "$f")" 2>/dev/null || true; done
  cleanup
}
trap soak_cleanup EXIT

# The chat contract (short prompts, long heavy-tailed answers), enough rows for the whole run.
$bin trace synth --contract chat --requests 200000 --rate 10 --seed "$SEED" -o "$OUT/pool.jsonl" >/dev/null
read -r mean_out rate rows longest_s < <(python3 - "$OUT/pool.jsonl" "$MAX_SEQS" "$TTFT_MS" "$ITL_MS" "$REPLICAS" "$LOAD" "$DURATION" <<'PY'
import json, math, sys
path, seqs, ttft, itl, n, load, duration = sys.argv[1], *map(float, sys.argv[2:])
outs = [json.loads(l)["output_length"] for l in open(path)]
mean_out = sum(outs) / len(outs)
request_s = (ttft + itl * (mean_out - 1)) / 1000
rate = load * n * seqs / request_s
longest_s = (ttft + itl * (max(outs) - 1)) / 1000
print(round(mean_out, 1), round(rate, 3), int(rate * duration * 1.1) + 100, math.ceil(longest_s))
PY
)
# The client waits for the longest answer the contract holds (twice its unqueued time), so that a
# slow engine's long answers are not counted as unanswered; the SLO's TPOT is twice the engine's.
TIMEOUT=${TIMEOUT:-$((longest_s * 2 > 120 ? longest_s * 2 : 120))}
SLO_TPOT_MS=${SLO_TPOT_MS:-$((ITL_MS * 2))}
if [ "$REPEAT_EVERY" -gt 0 ]; then
  # The pool's own Poisson timestamps are at 10 req/s: respace the first segment at the soak's rate,
  # then repeat it with the hash ids moved past every earlier repetition's.
  python3 - "$OUT/pool.jsonl" "$rate" "$REPEAT_EVERY" "$DURATION" "$SEED" >"$OUT/trace.jsonl" <<'PY'
import json, random, sys
path, rate, every, duration, seed = sys.argv[1], float(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4]), int(sys.argv[5])
rng = random.Random(seed)
rows, t = [], 0.0
for line in open(path):
    r = json.loads(line)
    if t >= every:
        break
    r["timestamp"] = int(t * 1000)
    rows.append(r)
    t += rng.expovariate(rate)
span = 1 + max(i for r in rows for i in r["hash_ids"])
for k in range(int(duration // every) + 1):
    for r in rows:
        c = dict(r, timestamp=r["timestamp"] + int(k * every * 1000), hash_ids=[i + k * span for i in r["hash_ids"]])
        print(json.dumps(c))
PY
  load_flags=(--time-scale 1)
else
  head -n "$rows" "$OUT/pool.jsonl" >"$OUT/trace.jsonl"
  load_flags=(--rate "$rate")
fi
rm "$OUT/pool.jsonl"
echo "soak: $REPLICAS replicas × $MAX_SEQS sequences, mean output $mean_out tokens; $rate req/s (${LOAD} of capacity) for ${DURATION}s; arrivals repeat every ${REPEAT_EVERY}s (0: never)" >&2

# One process per replica, so each can be killed; restarted on the same port.
sim_flags=(--latency-model constant --time-to-first-token "$TTFT_MS" --inter-token-latency "$ITL_MS"
  --max-num-seqs "$MAX_SEQS" --max-model-len 200000)
ports=()
sim_pids=()
for i in $(seq 0 $((REPLICAS - 1))); do
  $bin sim --port 0 "${sim_flags[@]}" >"$OUT/sim-$i.url" 2>>"$OUT/sims.log" &
  sim_pids[i]=$!
  pids+=($!)
  wait_line "$OUT/sim-$i.url" http
  ports[i]=$(grep -o '[0-9]*$' "$OUT/sim-$i.url")
done
urls=$(for p in "${ports[@]}"; do printf 'http://127.0.0.1:%s,' "$p"; done)
urls=${urls%,}

{
  echo 'listen = "127.0.0.1:0"'
  echo 'admin_listen = "127.0.0.1:0"'
  for p in "${ports[@]}"; do printf '[[backends]]\nurl = "http://127.0.0.1:%s"\n' "$p"; done
  if [ "$INDEX_BLOCKS" -gt 0 ]; then printf '[routing]\nindex_blocks = %s\n' "$INDEX_BLOCKS"; fi
} >"$OUT/headroom.toml"
$bin serve --config "$OUT/headroom.toml" >"$OUT/serve.url" 2>"$OUT/serve.log" &
serve=$!
pids+=($!)
wait_line "$OUT/serve.log" "admin http"
proxy=$(grep -m1 http "$OUT/serve.url")
admin=$(grep -o 'admin http://[0-9.:]*' "$OUT/serve.log" | cut -d' ' -f2)

start_precise=$(date +%s.%N)
start=${start_precise%.*}
# The proxy's resident memory and live heap (the allocator's own count) every 10 s.
(
  echo "elapsed_s,rss_kb,index_blocks,heap_kb"
  while kill -0 "$serve" 2>/dev/null; do
    m=$(curl -sf "$admin/metrics")
    index=$(awk '/^headroom_prefix_index_blocks\{/ {s += $2} END {print s + 0}' <<<"$m")
    heap=$(awk '/^headroom_allocator_bytes\{state="allocated"\}/ {printf "%d", $2 / 1024}' <<<"$m")
    echo "$(($(date +%s) - start)),$(awk '/VmRSS/ {print $2}' "/proc/$serve/status"),$index,$heap"
    sleep 10
  done
) >"$OUT/rss.csv" &
pids+=($!)

# Clients that give up after 0.1–0.9 s (mid-queue or mid-stream), ABORTS_PER_S of them a second on
# a seeded schedule (with REPEAT_EVERY, the same schedule in every window).
python3 - "$DURATION" "$ABORTS_PER_S" "$REPEAT_EVERY" "$SEED" >"$OUT/aborts.txt" <<'PY'
import random, sys
duration, rate, every, seed = float(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
period = every if every > 0 else duration
rng = random.Random(seed)
one, t = [], 0.0
while t < period:
    one.append((t, rng.randint(1, 9) / 10))
    t += 1 / rate
k = 0
while k * period < duration:
    for t, timeout in one:
        if k * period + t < duration:
            print(f"{k * period + t:.3f} {timeout:.1f}")
    k += 1
PY
(
  body='{"model":"'"$(curl -sf "$proxy/v1/models" | python3 -c 'import json,sys; print(json.load(sys.stdin)["data"][0]["id"])')"'","prompt":"a client that will not wait","max_tokens":200,"ignore_eos":true,"stream":true}'
  n=0
  while read -r at timeout; do
    pause=$(awk -v a="$at" -v s="$start_precise" -v now="$(date +%s.%N)" 'BEGIN {d = s + a - now; print (d > 0 ? d : 0)}')
    sleep "$pause"
    curl -s -o /dev/null -m "$timeout" -H 'content-type: application/json' \
      -d "$body" "$proxy/v1/completions" &
    n=$((n + 1))
  done <"$OUT/aborts.txt"
  wait
  echo "$n" >"$OUT/aborting-clients.txt"
) &
pids+=($!)

# A replica killed (SIGKILL) every KILL_EVERY s, in turn, and restarted 2 s later on its port.
if [ "$KILL_EVERY" -gt 0 ]; then
  (
    k=0
    while sleep "$KILL_EVERY" && [ $(($(date +%s) - start)) -lt "$((DURATION - KILL_EVERY / 2))" ]; do
      i=$((k % REPLICAS))
      kill -KILL "$(cat "$OUT/sim-$i.pid" 2>/dev/null || echo "${sim_pids[i]}")" 2>/dev/null || true
      echo "$(($(date +%s) - start)) killed replica $i" >>"$OUT/kills.log"
      sleep 2
      $bin sim --port "${ports[i]}" "${sim_flags[@]}" >/dev/null 2>>"$OUT/sims.log" &
      echo $! >"$OUT/sim-$i.pid"
      k=$((k + 1))
    done
  ) &
  pids+=($!)
fi

$bin replay --trace "$OUT/trace.jsonl" --target "$proxy" "${load_flags[@]}" --duration "$DURATION" \
  --seed "$SEED" --timeout "$TIMEOUT" --slo "ttft=2000,tpot=$SLO_TPOT_MS" \
  --hardware "headroom sim: $REPLICAS constant-latency replicas (TTFT ${TTFT_MS} ms, ITL ${ITL_MS} ms, ${MAX_SEQS} seqs), behind headroom serve" \
  --out "$OUT" >"$OUT/replay.txt"
sleep 5
curl -sf "$admin/metrics" >"$OUT/metrics-at-rest.txt"
curl -sf "$admin/stats" >"$OUT/stats.json"

python3 - "$OUT" "$DURATION" <<'PY' | tee "$OUT/summary.md"
import csv, sys
out, duration = sys.argv[1], float(sys.argv[2])
rows = list(csv.DictReader(open(f"{out}/requests.csv")))
no_answer = [r for r in rows if r["status"] in ("", "0")]
ok = [r for r in rows if r["status"] == "200" and not r["error"]]
failed = len(rows) - len(ok) - len(no_answer)
def p99(window):
    xs = sorted(float(r["ttft_ms"]) for r in window if r["ttft_ms"])
    return xs[int(0.99 * (len(xs) - 1))] if xs else float("nan")
first = [r for r in ok if float(r["scheduled_ms"]) < 300_000]
last = [r for r in ok if float(r["scheduled_ms"]) >= (duration - 300) * 1000]
rss = [(float(r["elapsed_s"]), float(r["rss_kb"]), float(r.get("index_blocks") or 0), float(r.get("heap_kb") or 0)) for r in csv.DictReader(open(f"{out}/rss.csv")) if r["rss_kb"]]
# Under load only: the answers still streaming after DURATION (minutes, for long ones) drain the
# proxy's buffers, and memory that falls then says nothing about growth while it works.
rss = [x for x in rss if x[0] <= duration] or rss
after = [x for x in rss if x[0] >= 600] or rss
growth = (after[-1][1] - after[0][1]) / 1024 / max((after[-1][0] - after[0][0]) / 600, 1e-9)
last10 = [x for x in rss if x[0] >= rss[-1][0] - 600]
growth_last = (last10[-1][1] - last10[0][1]) / 1024 / max((last10[-1][0] - last10[0][0]) / 600, 1e-9)
heap_growth = (after[-1][3] - after[0][3]) / 1024 / max((after[-1][0] - after[0][0]) / 600, 1e-9)
gauges = [l for l in open(f"{out}/metrics-at-rest.txt") if l.startswith(("headroom_open_requests ", "headroom_backend_in_flight{", "headroom_admission_in_flight{", "headroom_queue_depth{"))]
kills = sum(1 for _ in open(f"{out}/kills.log")) if __import__("os").path.exists(f"{out}/kills.log") else 0
print(f"| requests | answered 200 | answered with an error | no answer | kills | p99 TTFT first 5 min | p99 TTFT last 5 min | change | RSS at 10 min | RSS at end | growth per 10 min (from 10 min) | growth, last 10 min | live heap at 10 min → end (growth per 10 min) | index blocks at 10 min / end | gauges at rest |")
print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
change = (p99(last) / p99(first) - 1) * 100
nonzero = [g.strip() for g in gauges if not g.strip().endswith(" 0")]
# The live heap is the allocator's own count: absent from a build with the system's malloc.
heap = f"{after[0][3]/1024:.1f} → {after[-1][3]/1024:.1f} MiB ({heap_growth:+.2f} MiB)" if any(x[3] for x in rss) else "–"
print(f"| {len(rows)} | {len(ok)} | {failed} | {len(no_answer)} | {kills} | {p99(first):.0f} ms | {p99(last):.0f} ms | {change:+.1f}% | {after[0][1]/1024:.1f} MiB | {after[-1][1]/1024:.1f} MiB | {growth:+.2f} MiB | {growth_last:+.2f} MiB | {heap} | {after[0][2]:.0f} / {after[-1][2]:.0f} | {'all 0' if not nonzero else '; '.join(nonzero)} ({len(gauges)} gauges) |")
PY
