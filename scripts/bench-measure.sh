#!/usr/bin/env bash
# Passive measurement against its clients, and the capture's round trip. A contiguous slice of the
# real Mooncake conversation trace is replayed by `headroom replay` through `headroom serve` (capture
# on) to 4 simulated Llama-3.1-8B/H100 replicas. Then:
#   1. agreement: the replay's rows and the proxy's capture joined by x-request-id
#      (`headroom report agreement`): per-request |client TTFT - proxy TTFT|, TPOT percentiles from
#      both sides, exact token counts; pooled ITL p50/p99 of the client against the proxy's /stats;
#   2. round trip: the capture is replayed again (cold caches, capture on) and both captures are
#      summarized beside the slice (`headroom trace info`): the same length distributions and the
#      same offline ideal hit rate;
#   3. with guidellm installed (GUIDELLM=1, docs/guidellm.md), guidellm 0.8.1 runs through the proxy
#      and its TTFT/TPOT percentiles are set beside the proxy's capture of the same requests.
# Loopback only; bounded by ROWS. PIN=1 (scripts/pin.sh) puts the proxy and the replicas on a core
# of their own and the clients on the others, so that the client's own scheduling delays, which no
# proxy can see, leave the comparison. LIGHT_ONLY=1 stops after the light-load agreement.
#
#   ROWS=300 scripts/bench-measure.sh
set -euo pipefail
cd "$(dirname "$0")/.."
ROWS=${ROWS:-300}
START=${START:-0}
TIME_SCALE=${TIME_SCALE:-1}
TRACE=${TRACE:-../shared/traces/mooncake_conversation.jsonl}
OUT=${OUT:-results/bench-measure}
GUIDELLM=${GUIDELLM:-0}
[ -f "$TRACE" ] || { echo "trace not found: $TRACE" >&2; exit 2; }
rm -rf "$OUT"
mkdir -p "$OUT"
cargo build --release --locked -q
bin=target/release/headroom

slice="$OUT/slice.jsonl"
sed -n "$((START + 1)),$((START + ROWS))p" "$TRACE" >"$slice"

source scripts/bench-common.sh

start_sims 4 "$OUT/sims.url" --profile llama-3.1-8b --gpu h100
urls=$(paste -sd, "$OUT/sims.url")
kv_tokens=$(curl -sf "$(head -1 "$OUT/sims.url")/metrics" | grep -o 'num_gpu_blocks="[0-9]*"' | grep -o '[0-9]*')
fleet_cache_tokens=$(( kv_tokens * 16 * 4 ))

# run NAME TRACE: one replay through a fresh proxy with capture on, from cold caches.
run() {
  local name=$1 trace=$2 dir="$OUT/$1"
  mkdir -p "$dir"
  for u in $(cat "$OUT/sims.url"); do curl -sf -X POST "$u/reset_prefix_cache" >/dev/null; done
  "${sut_on[@]}" $bin serve --listen 127.0.0.1:0 --admin-listen 127.0.0.1:0 --backends "$urls" \
    --capture "$dir/capture.jsonl" >"$dir/serve.url" 2>"$dir/serve.log" &
  local serve=$!
  wait_line "$dir/serve.log" "admin http"
  local proxy admin
  proxy=$(grep -m1 http "$dir/serve.url")
  admin=$(grep -o 'admin http://[0-9.:]*' "$dir/serve.log" | cut -d' ' -f2)
  echo "== $name: replay $trace through $proxy" >&2
  "${load_on[@]}" $bin replay --trace "$trace" --time-scale "$TIME_SCALE" --target "$proxy" --endpoint chat \
    --hardware "headroom sim: 4 × Llama-3.1-8B-Instruct on H100 (roofline), behind headroom serve (prefix_affinity, capture on); $placement" \
    --out "$dir" >"$dir/replay.txt"
  curl -sf "$admin/stats" >"$dir/stats.json"
  # SIGTERM: the proxy flushes its capture before it exits.
  kill -TERM "$serve"; wait "$serve" 2>/dev/null || true
}

# Agreement first at a light load (the RAG contract: ~3,500-token prompts sharing a system prefix,
# 3 req/s), where the client and the proxy have the cores to themselves, then on the slice.
$bin trace synth --contract rag --requests "${LIGHT_REQUESTS:-150}" --rate 3 --seed 3 -o "$OUT/rag.jsonl"
run light "$OUT/rag.jsonl"
$bin report agreement --result "$OUT/light/result.json" --capture "$OUT/light/capture.jsonl" \
  --stats "$OUT/light/stats.json" --json "$OUT/agreement-light.json" | tee "$OUT/agreement-light.txt"
if [ "${LIGHT_ONLY:-0}" = 1 ]; then
  echo "LIGHT_ONLY=1: stopping after the light-load agreement ($OUT/agreement-light.txt)" >&2
  exit 0
fi
run first "$slice"
$bin report agreement --result "$OUT/first/result.json" --capture "$OUT/first/capture.jsonl" \
  --stats "$OUT/first/stats.json" --json "$OUT/agreement.json" | tee "$OUT/agreement.txt"
run second "$OUT/first/capture.jsonl"

# Mooncake's timestamps are whole seconds (300 rows share 35 of them), so requests that tie are
# sent together and reach the proxy in any order; an LRU cache's ideal depends on that order. The
# capture put back in the slice's order (by the row in each request id) shows the structure alone.
python3 - "$OUT/first/capture.jsonl" "$OUT/first-capture-in-slice-order.jsonl" <<'PY'
import json, sys
recs = [json.loads(l) for l in open(sys.argv[1])]
recs.sort(key=lambda r: int(r["request_id"].rsplit("-", 1)[1]))
with open(sys.argv[2], "w") as f:
    for i, r in enumerate(recs):
        r["timestamp"] = i
        f.write(json.dumps(r) + "\n")
PY
python3 - "$slice" "$OUT/slice-in-row-order.jsonl" <<'PY'
import json, sys
with open(sys.argv[2], "w") as f:
    for i, l in enumerate(open(sys.argv[1])):
        r = json.loads(l)
        r["timestamp"] = i
        f.write(json.dumps(r) + "\n")
PY
for t in slice first/capture second/capture slice-in-row-order first-capture-in-slice-order; do
  $bin trace info "$OUT/$t.jsonl" --cache-tokens "$fleet_cache_tokens" --json >"$OUT/info-${t//\//-}.json"
done

if [ "$GUIDELLM" = 1 ]; then
  GUIDELLM_VENV=${GUIDELLM_VENV:-.cache/guidellm-venv}
  [ -x "$GUIDELLM_VENV/bin/guidellm" ] || { echo "guidellm not installed: run scripts/guidellm-run.sh first" >&2; exit 2; }
  dir="$OUT/guidellm"
  mkdir -p "$dir"
  "${sut_on[@]}" $bin serve --listen 127.0.0.1:0 --admin-listen 127.0.0.1:0 --backends "$urls" \
    --capture "$dir/capture.jsonl" >"$dir/serve.url" 2>"$dir/serve.log" &
  serve=$!
  wait_line "$dir/serve.log" "admin http"
  proxy=$(grep -m1 http "$dir/serve.url")
  model=$(curl -sf "$proxy/v1/models" | python3 -c 'import json,sys; print(json.load(sys.stdin)["data"][0]["id"])')
  echo "== guidellm through $proxy" >&2
  HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1 \
    "${load_on[@]}" timeout 600 "$GUIDELLM_VENV/bin/guidellm" run \
    --backend "kind=openai_http,target=$proxy,model=$model,request_format=/v1/chat/completions" \
    --profile "kind=constant,rate=${GUIDELLM_RATE:-4}" \
    --constraint "kind=max_requests,count=${GUIDELLM_REQUESTS:-200}" \
    --constraint "kind=max_duration,seconds=300" \
    --tokenizer "kind=hf_auto,model=$PWD/.cache/guidellm-tokenizer" \
    --data "kind=synthetic_text,prompt_tokens=1024,output_tokens=128" \
    --output "kind=json,path=$PWD/$dir/guidellm.json" \
    --disable-console-interactive >"$dir/guidellm.log" 2>&1 || { tail -20 "$dir/guidellm.log" >&2; exit 1; }
  kill -TERM "$serve"; wait "$serve" 2>/dev/null || true
fi

python3 - "$OUT" "$GUIDELLM" <<'PY' | tee "$OUT/summary.md"
import json, sys
out, with_guidellm = sys.argv[1], sys.argv[2] == "1"
for run, agreement, title in [("light", "agreement-light", "RAG contract, 3 req/s"), ("first", "agreement", "the Mooncake slice at its own pace")]:
  a = json.load(open(f"{out}/{agreement}.json"))
  r = json.load(open(f"{out}/{run}/result.json"))
  stats = json.load(open(f"{out}/{run}/stats.json"))
  g = a["ttft_gap"]
  print(f"## Agreement, {title}: headroom replay vs the proxy's capture ({a['joined']} requests joined by x-request-id)\n")
  print(f"token counts equal on both sides: {a['tokens_equal']} of {a['joined']}\n")
  print(f"|client TTFT - proxy TTFT| per request: p50 {g['p50_ms']:.3f} ms, p99 {g['p99_ms']:.3f} ms, max {g['max_ms']:.3f} ms\n")
  print("| measure | client p50 | proxy p50 | client p90 | proxy p90 | client p99 | proxy p99 | largest diff |")
  print("|---|---|---|---|---|---|---|---|")
  def row(name, c, p):
      diffs = [abs(p[k] - c[k]) / c[k] * 100 for k in ("p50_ms", "p90_ms", "p99_ms") if c[k]]
      print(f"| {name} | {c['p50_ms']:.2f} | {p['p50_ms']:.2f} | {c['p90_ms']:.2f} | {p['p90_ms']:.2f} | {c['p99_ms']:.2f} | {p['p99_ms']:.2f} | {max(diffs):.2f}% |")
  row("TTFT ms", a["ttft_client"], a["ttft_proxy"])
  row("TPOT ms", a["tpot_client"], a["tpot_proxy"])
  row("E2E ms", a["e2e_client"], a["e2e_proxy"])
  w = next(x for x in stats["windows"]["5m"])
  ci, pi = r["summary"]["itl"], w["latency"]["itl_ms"]
  print(f"| ITL ms (pooled; proxy from /stats) | {ci['p50_ms']:.2f} | {pi['p50']:.2f} | {ci['p90_ms']:.2f} | - | {ci['p99_ms']:.2f} | {pi['p99']:.2f} | {max(abs(pi['p50']-ci['p50_ms'])/ci['p50_ms'], abs(pi['p99']-ci['p99_ms'])/ci['p99_ms'])*100:.2f}% |")
  st = r.get("client_stalls")
  if st:
      # The client's own stalls are in its ITL tail and in none of the proxy's numbers.
      steal = f", CPU steal {st['steal_s']:.2f} s ({100 * st['steal_share']:.2f}%)" if st.get("steal_s") is not None else ""
      print(f"\nclient stalls (1 ms sleeps overshot): p99 {st['p99_ms']:.3f} ms, max {st['max_ms']:.3f} ms, {st['over_1ms']} over 1 ms ({st['over_1ms_total_ms']:.1f} ms in all){steal}")
  print()
print("## Round trip: the slice, its capture, and the capture of the capture's replay\n")
print("| trace | requests | input p50 / p99 / max | output p50 / p99 / max | input tokens | output tokens | ideal hit rate, fleet cache | ideal, unbounded |")
print("|---|---|---|---|---|---|---|---|")
for t in ("slice", "first-capture", "second-capture", "slice-in-row-order", "first-capture-in-slice-order"):
    d = json.load(open(f"{out}/info-{t}.json"))
    i, o = d["input_length"], d["output_length"]
    print(f"| {t} | {d['requests']} | {i['p50']:.0f} / {i['p99']:.0f} / {i['max']:.0f} | {o['p50']:.0f} / {o['p99']:.0f} / {o['max']:.0f} | {d['input_tokens_total']} | {d['output_tokens_total']} | {d['ideal_hit_rate_at_cache']:.4f} | {d['ideal_hit_rate_unbounded']:.4f} |")
if with_guidellm:
    def pct(v, p):
        v = sorted(v); k = p / 100 * (len(v) - 1); lo = int(k); hi = min(lo + 1, len(v) - 1)
        return v[lo] + (v[hi] - v[lo]) * (k - lo)
    gj = json.load(open(f"{out}/guidellm/guidellm.json"))["benchmarks"][0]["requests"]["successful"]
    cap = [json.loads(l) for l in open(f"{out}/guidellm/capture.jsonl")]
    print(f"\n## guidellm 0.8.1 through the proxy ({len(gj)} requests) against the proxy's capture ({len(cap)} records)\n")
    print("| measure | guidellm p50 | proxy p50 | guidellm p99 | proxy p99 | diff p50 | diff p99 |")
    print("|---|---|---|---|---|---|---|")
    for name, gv, pv in [("TTFT ms", [x["time_to_first_token_ms"] for x in gj], [c["ttft_ms"] for c in cap]),
                         ("TPOT ms (guidellm: inter_token_latency)", [x["inter_token_latency_ms"] for x in gj], [c["tpot_ms"] for c in cap if "tpot_ms" in c])]:
        g50, g99, p50, p99 = pct(gv, 50), pct(gv, 99), pct(pv, 50), pct(pv, 99)
        print(f"| {name} | {g50:.2f} | {p50:.2f} | {g99:.2f} | {p99:.2f} | {(p50-g50)/g50*100:+.2f}% | {(p99-g99)/g99*100:+.2f}% |")
PY
