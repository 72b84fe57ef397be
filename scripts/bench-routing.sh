#!/usr/bin/env bash
# Routing quality: a contiguous slice of the real Mooncake conversation trace replayed through
# `headroom serve` to 4 simulated Llama-3.1-8B/H100 replicas, once per policy, each run starting
# from cold prefix caches. Records, per policy: the replicas' own prefix-cache hit rate beside the
# trace's ideal (one LRU cache as large as the whole fleet's), TTFT p50/p99, TPOT p99, goodput and
# load imbalance (max/mean of each replica's time-averaged in-flight requests, from the proxy's
# headroom_backend_in_flight_seconds_total). For the prefix-aware policies, the proxy's capture
# (OUT/<policy>/capture.jsonl, the engines reporting prompt_tokens_details) also says how much of the
# prompts its index expected the chosen replicas to hold, against what they found. Loopback only;
# bounded by ROWS.
#
#   ROWS=1000 TIME_SCALE=1 scripts/bench-routing.sh       # ~6 minutes per policy
# It ends with the TTFT p99 no policy can beat on the slice (scripts/ttft_floor.py; FLOOR=0 skips it).
# For the prefix-aware policies it ends with scripts/routing_losses.py over the capture.
# Each run's proxy config is written beside its results (headroom.toml).
set -euo pipefail
cd "$(dirname "$0")/.."
ROWS=${ROWS:-1000}
START=${START:-0}
TIME_SCALE=${TIME_SCALE:-1}
POLICIES=${POLICIES:-round_robin least_load session consistent_hash prefix_affinity}
SLO=${SLO:-ttft=2000,tpot=50}
# Extra [routing] lines for every run, e.g. ROUTING_EXTRA='recompute_weight = 2.0'.
ROUTING_EXTRA=${ROUTING_EXTRA:-}
TRACE=${TRACE:-../shared/traces/mooncake_conversation.jsonl}
OUT=${OUT:-results/bench-routing}
[ -f "$TRACE" ] || { echo "trace not found: $TRACE" >&2; exit 2; }
mkdir -p "$OUT"
cargo build --release --locked -q
bin=target/release/headroom

# The slice, as its own trace file, so its digest is in every contract.
slice="$OUT/trace.jsonl"
sed -n "$((START + 1)),$((START + ROWS))p" "$TRACE" >"$slice"

source scripts/bench-common.sh

start_sims 4 "$OUT/sims.url" --profile llama-3.1-8b --gpu h100 --enable-prompt-tokens-details
urls=$(paste -sd, "$OUT/sims.url")

for policy in $POLICIES; do
  for u in $(cat "$OUT/sims.url"); do curl -sf -X POST "$u/reset_prefix_cache" >/dev/null; done
  dir="$OUT/$policy"
  mkdir -p "$dir"
  {
    echo 'listen = "127.0.0.1:0"'
    echo 'admin_listen = "127.0.0.1:0"'
    for u in $(cat "$OUT/sims.url"); do printf '[[backends]]\nurl = "%s"\n' "$u"; done
    printf '[routing]\npolicy = "%s"\n%b\n' "$policy" "$ROUTING_EXTRA"
    printf '[capture]\npath = "%s"\n' "$dir/capture.jsonl"
  } >"$dir/headroom.toml"
  rm -f "$dir/capture.jsonl"
  $bin serve --config "$dir/headroom.toml" >"$dir/serve.url" 2>"$dir/serve.log" &
  serve=$!
  wait_line "$dir/serve.log" "admin http"
  proxy=$(grep -m1 http "$dir/serve.url")
  admin=$(grep -o 'admin http://[0-9.:]*' "$dir/serve.log" | cut -d' ' -f2)
  curl -sf "$admin/metrics" >"$dir/proxy-metrics-before.txt"
  echo "== $policy (proxy $proxy)" >&2
  $bin replay --trace "$slice" --time-scale "$TIME_SCALE" --target "$proxy" --observe "$urls" \
    --slo "$SLO" --hardware "headroom sim: 4 × Llama-3.1-8B-Instruct on H100 (roofline), behind headroom serve (policy $policy${ROUTING_EXTRA:+; $ROUTING_EXTRA})" \
    --out "$dir" >"$dir/replay.txt"
  curl -sf "$admin/metrics" >"$dir/proxy-metrics-after.txt"
  kill -INT "$serve"; wait "$serve" 2>/dev/null || true
done

python3 - "$OUT" $POLICIES <<'PY'
import json, re, sys
out, policies = sys.argv[1], sys.argv[2:]
def integrals(path):
    vals = {}
    for line in open(path):
        m = re.match(r'headroom_backend_in_flight_seconds_total\{backend="([^"]+)"\} (\S+)', line)
        if m:
            vals[m.group(1)] = float(m.group(2))
    return vals
rows = []
for p in policies:
    d = json.load(open(f"{out}/{p}/result.json"))
    s, t = d["summary"], d["target_observed"]
    b, a = integrals(f"{out}/{p}/proxy-metrics-before.txt"), integrals(f"{out}/{p}/proxy-metrics-after.txt")
    loads = [a[k] - b.get(k, 0.0) for k in a]
    imbalance = max(loads) / (sum(loads) / len(loads)) if loads and sum(loads) > 0 else float("nan")
    hit, ideal = t.get("prefix_cache_hit_rate", 0.0), t.get("offline_prefix_hit_rate", float("nan"))
    rows.append((p, hit, ideal, t.get("offline_unbounded_hit_rate", float("nan")), s, imbalance))
contract = json.load(open(f"{out}/{policies[0]}/result.json"))["contract"]
lines = [
    f"trace: {contract['trace']['path']} (sha256 {contract['trace']['sha256'][:16]}…), {contract['trace']['requests']} requests, time scale {contract['load'].get('time_scale')}",
    "",
    "| policy | hit rate | of ideal | TTFT p50 ms | TTFT p99 ms | TPOT p99 ms | goodput req/s | imbalance | failed |",
    "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
]
rr_p99 = next((r[4]["ttft"]["p99_ms"] for r in rows if r[0] == "round_robin"), None)
for p, hit, ideal, unb, s, imb in rows:
    lines.append(f"| {p} | {100*hit:.1f}% | {100*hit/ideal:.0f}% | {s['ttft']['p50_ms']:.0f} | {s['ttft']['p99_ms']:.0f} | "
                 f"{s['tpot']['p99_ms']:.1f} | {s['goodput']['requests_per_s']:.2f} | {imb:.2f} | {s['failed']} |")
lines.append("")
lines.append(f"ideal hit rate (one LRU cache of the fleet's combined KV capacity): {100*rows[0][2]:.1f}%; unbounded cache: {100*rows[0][3]:.1f}%")
for p in policies:
    # What the proxy's prefix index expected the chosen replicas to hold, against what the
    # engines found (requests answered, first choice kept).
    pred = found = prompt = short = short_tokens = 0
    try:
        records = [json.loads(l) for l in open(f"{out}/{p}/capture.jsonl")]
    except OSError:
        continue
    for r in records:
        if r.get("status") != 200 or "predicted_cached_tokens" not in r or "cached_tokens" not in r:
            continue
        e, f = r["predicted_cached_tokens"], r["cached_tokens"]
        pred, found, prompt = pred + e, found + f, prompt + r["input_length"]
        if f < e:
            short, short_tokens = short + 1, short_tokens + e - f
    if prompt:
        lines.append(f"{p}: the index expected {100*pred/prompt:.1f}% of prompt tokens cached where it sent them, "
                     f"the replicas found {100*found/prompt:.1f}%; {short} requests found less than expected "
                     f"({short_tokens:,} tokens)")
if rr_p99:
    pa = next((r for r in rows if r[0] == "prefix_affinity"), None)
    if pa:
        lines.append(f"prefix_affinity: {100*pa[1]/pa[2]:.0f}% of ideal hit rate, TTFT p99 {pa[4]['ttft']['p99_ms']/rr_p99:.2f}× round_robin's, imbalance {pa[5]:.2f}")
text = "\n".join(lines)
open(f"{out}/summary.md", "w").write(text + "\n")
print(text)
PY

# Where each prefix-aware policy's hit rate went (offline caches over its capture; the split by
# admission's displacements needs RUST_LOG=info,headroom_proxy::forward=debug).
for policy in $POLICIES; do
  case $policy in prefix_affinity | kv_events) ;; *) continue ;; esac
  [ -s "$OUT/$policy/capture.jsonl" ] || continue
  {
    echo
    echo "$policy, where the hit rate went (scripts/routing_losses.py):"
    python3 scripts/routing_losses.py "$OUT/$policy/capture.jsonl" "$OUT/$policy/serve.log"
  } | tee -a "$OUT/summary.md"
done

# The TTFT p99 no policy can beat on this slice: the prompts that set it (the largest prefills not
# even a cache that never forgets could spare), each cold and alone on an idle replica of the same
# profile (scripts/ttft_floor.py). FLOOR=0 skips it.
if [ "${FLOOR:-1}" = 1 ]; then
  python3 scripts/ttft_floor.py pick "$slice" >"$OUT/ttft-floor.jsonl"
  start_sims 1 "$OUT/floor-sim.url" --profile llama-3.1-8b --gpu h100 --no-enable-prefix-caching
  $bin replay --trace "$OUT/ttft-floor.jsonl" --target "$(head -1 "$OUT/floor-sim.url")" --concurrency 1 \
    --hardware "headroom sim: 1 × Llama-3.1-8B-Instruct on H100 (roofline), idle, prefix caching off" \
    --out "$OUT/ttft-floor" >"$OUT/ttft-floor.txt"
  floor=$(python3 scripts/ttft_floor.py floor "$OUT/ttft-floor/requests.csv" --requests "$(wc -l <"$slice")")
  line="TTFT p99 floor (the slice's $(wc -l <"$OUT/ttft-floor.jsonl") largest uncached prefills, each alone on an idle replica): $floor ms"
  if [ -f "$OUT/round_robin/result.json" ]; then
    half=$(python3 -c 'import json,sys; print(round(json.load(open(sys.argv[1]))["summary"]["ttft"]["p99_ms"] / 2))' "$OUT/round_robin/result.json")
    line="$line; half of round_robin's p99: $half ms"
  fi
  echo | tee -a "$OUT/summary.md"
  echo "$line" | tee -a "$OUT/summary.md"
fi
