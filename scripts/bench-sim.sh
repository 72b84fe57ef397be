#!/usr/bin/env bash
# Simulator cost benchmark (docs/benchmarks.md): one `headroom sim` process with 4 replicas carrying
# CONCURRENCY closed-loop streams; reports the process's CPU use (cores) and how late its engine
# steps fired against their modelled time. Loopback only; bounded by DURATION.
set -euo pipefail
cd "$(dirname "$0")/.."
CONCURRENCY=${CONCURRENCY:-512}
DURATION=${DURATION:-40}
PROMPT=${PROMPT:-1000}
OUTPUT=${OUTPUT:-300}
REPLICAS=${REPLICAS:-4}
OUT=${OUT:-results/bench-sim}
mkdir -p "$OUT"

cargo build --release --locked -q
cargo build --release --locked -q -p headroom-loadtest --example stream_load

urls_file=$(mktemp)
target/release/headroom sim --replicas "$REPLICAS" --port 0 >"$urls_file" 2>/dev/null &
sim=$!
trap 'kill -INT $sim 2>/dev/null || true; wait $sim 2>/dev/null || true; rm -f "$urls_file"' EXIT
for _ in $(seq 100); do [ "$(grep -c http "$urls_file" || true)" -ge "$REPLICAS" ] && break; sleep 0.1; done
mapfile -t urls < <(grep http "$urls_file")
[ "${#urls[@]}" -eq "$REPLICAS" ] || { echo "simulator did not start" >&2; exit 1; }

cpu_ticks() { awk '{print $14 + $15}' "/proc/$sim/stat"; }
hz=$(getconf CLK_TCK)
before=$(cpu_ticks); t0=$(date +%s.%N)
/usr/bin/time -f "client cpu user %U sys %S wall %e" target/release/examples/stream_load "$CONCURRENCY" "$DURATION" "$PROMPT" "$OUTPUT" "${urls[@]}" >"$OUT/load.json"
after=$(cpu_ticks); t1=$(date +%s.%N)

for u in "${urls[@]}"; do curl -s "$u/metrics"; done >"$OUT/metrics.txt"
python3 - "$before" "$after" "$hz" "$t0" "$t1" "$OUT" <<PY
import json, sys
before, after, hz, t0, t1 = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]), float(sys.argv[5])
out_dir = sys.argv[6]
load = json.load(open(out_dir + "/load.json")); metrics = open(out_dir + "/metrics.txt").read(); out = out_dir + "/result.json"
cores = (after - before) / hz / (t1 - t0)
buckets = {}; count = 0.0
for line in metrics.splitlines():
    if line.startswith("headroom_sim_step_lateness_seconds_bucket"):
        le = line.split('le="')[1].split('"')[0]
        buckets[le] = buckets.get(le, 0.0) + float(line.rsplit(" ", 1)[1])
    elif line.startswith("headroom_sim_step_lateness_seconds_count"):
        count += float(line.rsplit(" ", 1)[1])
within_1ms = buckets.get("0.001", 0.0) / count if count else 0.0
p99_bound = next((le for le, c in sorted(((float(k) if k != "+Inf" else float("inf"), v) for k, v in buckets.items())) if c >= 0.99 * count), None)
result = {
    "contract": {"replicas": $REPLICAS, "concurrency": $CONCURRENCY, "duration_s": $DURATION, "prompt_tokens": $PROMPT,
                 "output_tokens": $OUTPUT, "endpoint": "/v1/completions stream", "profile": "llama-3.1-8b on h100, roofline",
                 "load": "closed loop, loadtest/examples/stream_load"},
    "sim_cpu_cores": round(cores, 3), "steps": int(count), "steps_within_1ms": round(within_1ms, 5),
    "step_lateness_p99_at_most_s": p99_bound, "load": load,
}
json.dump(result, open(out, "w"), indent=2)
print(json.dumps(result, indent=2))
PY
