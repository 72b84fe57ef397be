#!/usr/bin/env bash
# Agreement check against vLLM's own benchmark client: `headroom replay` and `vllm bench serve`
# (vLLM 0.33.0) measure the same simulator AT THE SAME TIME, each sending its half of the load, and
# their TTFT and TPOT p50/p99 are compared. Running both at once means both sample the same server
# (the same step clock, the same queue), so what differs is each client's own work; the simulator's
# own TTFT (arrival to first token, vllm:time_to_first_token_seconds) is printed beside them as the
# reference neither client can move.
#
#   scripts/agreement-vllm-bench.sh            # outputs in results/agreement-vllm-bench/
#
# 1. reuses (or creates) the guidellm venv and local tokenizer (scripts/guidellm-common.sh: it holds
#    torch and transformers), and beside it a venv with vLLM's wheel without its engine dependencies
#    (`pip install --no-deps vllm==0.33.0` plus what `vllm bench serve` imports; no GPU needed);
# 2. starts ONE `headroom sim` (SIM_PROFILE, roofline timing) on 127.0.0.1;
# 3. calibrates: 10 requests of vLLM's random dataset (INPUT_TOKENS by the local tokenizer), whose
#    prompt lengths the simulator reports back, become the replay trace's lengths;
# 4. starts `vllm bench serve` (REQUESTS at RATE req/s, Poisson, seed SEED, OUTPUT_TOKENS with
#    ignore_eos) and, once its main run starts, `headroom replay` of REQUESTS rows at RATE req/s
#    (Poisson, its own seed), with those lengths and unique hash ids (no prefix sharing);
# 5. prints both clients' TTFT and TPOT p50/p99 and means, the simulator's own mean TTFT over both,
#    and exits non-zero if a p50/p99 differs by more than TOLERANCE_PCT (relative to vLLM's).
#
# Definitions: vLLM's TTFT is first chunk - just before the POST; its TPOT is (latency - TTFT) /
# (output tokens - 1); headroom replay's are the same (docs/measurement.md). Percentiles by linear
# interpolation (np.percentile), over each client's completed requests.
#
# Environment: SIM_PROFILE (llama-3.1-70b), INPUT_TOKENS (1024 local ≈ 450 simulator tokens),
# OUTPUT_TOKENS (64), RATE (2 req/s per client), REQUESTS (200 per client), SEED (6),
# TOLERANCE_PCT (5), PIN / NOIDLE (scripts/pin.sh), GUIDELLM_VENV, VLLM_BENCH_VENV.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

GUIDELLM_VERSION=0.8.1
VLLM_VERSION=0.33.0
VENV="${GUIDELLM_VENV:-.cache/guidellm-venv}"
VLLM_VENV="${VLLM_BENCH_VENV:-.cache/vllm-bench-venv}"
PYTHON="${PYTHON:-python3}"
HEADROOM="${HEADROOM_BIN:-target/release/headroom}"
TOKENIZER_DIR=.cache/guidellm-tokenizer
OUT_DIR=results/agreement-vllm-bench
TOLERANCE_PCT="${TOLERANCE_PCT:-5}"
SIM_PROFILE=${SIM_PROFILE:-llama-3.1-70b}
MODEL_NAME=sim-$SIM_PROFILE
INPUT_TOKENS=${INPUT_TOKENS:-1024}
OUTPUT_TOKENS=${OUTPUT_TOKENS:-64}
RATE=${RATE:-2}
REQUESTS=${REQUESTS:-200}
SEED=${SEED:-6}
SIM_ARGS=(sim --host 127.0.0.1 --port 0 --profile "$SIM_PROFILE" --served-model-name "$MODEL_NAME")

source scripts/guidellm-common.sh
command -v timeout >/dev/null || die "timeout (coreutils) is required"
guidellm_setup

# vLLM's benchmark client without vLLM's engine: the wheel without dependencies, torch and
# transformers from the guidellm venv (a .pth file, below this venv's own packages), and the few
# modules `vllm bench serve` imports on its way.
if ! "$VLLM_VENV/bin/vllm" bench serve --help >/dev/null 2>&1; then
  log "installing vllm==$VLLM_VERSION (no engine dependencies) into $VLLM_VENV"
  "$PY" -m venv "$VLLM_VENV"
  site=$("$VLLM_VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  "$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])' >"$site/guidellm-venv.pth"
  "$VLLM_VENV/bin/pip" install --disable-pip-version-check --quiet --no-deps "vllm==$VLLM_VERSION"
  "$VLLM_VENV/bin/pip" install --disable-pip-version-check --quiet aiohttp cbor2 psutil pyzmq \
    urllib3 requests openai-harmony openai msgspec cloudpickle pillow pybase64 cachetools \
    py-cpuinfo fastapi prometheus_client partial-json-parser uvicorn xgrammar llguidance \
    watchfiles orjson einops 2>&1 | grep -v "dependency resolver\|requires\|incompatible" >&2 || true
  "$VLLM_VENV/bin/vllm" bench serve --help >/dev/null 2>&1 || die "vllm bench serve does not start in $VLLM_VENV"
fi
export VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1

mkdir -p "$OUT_DIR"
rm -rf "$OUT_DIR"/{replay,vllm,trace.jsonl,comparison.txt}
start_sim

vllm_bench() { # NAME COUNT SEED
  "${load_on[@]}" timeout 600 "$VLLM_VENV/bin/vllm" bench serve --backend openai --base-url "$URL" \
    --endpoint /v1/completions --model "$MODEL_NAME" --tokenizer "$ROOT/$TOKENIZER_DIR" \
    --dataset-name random --random-input-len "$INPUT_TOKENS" --random-output-len "$OUTPUT_TOKENS" \
    --num-prompts "$2" --request-rate "$RATE" --seed "$3" --ignore-eos \
    --save-result --save-detailed --result-dir "$ROOT/$OUT_DIR/vllm" --result-filename "$1.json"
}
server_ttft() {
  curl --noproxy '*' -sf "$URL/metrics" |
    awk '/^vllm:time_to_first_token_seconds_sum/ {s += $NF} /^vllm:time_to_first_token_seconds_count/ {c += $NF} END {print s + 0, c + 0}'
}

log "calibration: 10 requests of vLLM's random dataset (${INPUT_TOKENS} local tokens)"
vllm_bench calibration 10 "$SEED" >"$OUT_DIR/calibration.log" 2>&1 || { tail -20 "$OUT_DIR/calibration.log" >&2; die "vllm bench serve failed"; }
"$PY" - "$OUT_DIR/vllm/calibration.json" "$OUT_DIR/trace.jsonl" "$RATE" "$REQUESTS" "$OUTPUT_TOKENS" "$SEED" <<'EOF'
import json, math, random, sys
src, dst, rate, n, out, seed = sys.argv[1], sys.argv[2], float(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6])
lens = json.load(open(src))["input_lens"]
rng, t = random.Random(seed + 1000), 0.0
with open(dst, "w") as f:
    for i in range(n):
        t += rng.expovariate(rate)
        p = lens[i % len(lens)]
        f.write(json.dumps({"timestamp": round(t * 1000), "input_length": p, "output_length": out,
                            "hash_ids": [(i + 1) * 1000 + k for k in range(math.ceil(p / 512))]}) + "\n")
print(f"==> trace: {n} rows at {rate:g} req/s (Poisson), prompt tokens {min(lens)}..{max(lens)} "
      f"(the simulator's count of vLLM's prompts)", file=sys.stderr)
EOF

curl --noproxy '*' -sf -X POST "$URL/reset_prefix_cache" >/dev/null
log "vllm bench serve and headroom replay at once: $REQUESTS requests each at $RATE req/s -> /v1/completions"
vllm_bench run "$REQUESTS" "$SEED" >"$OUT_DIR/vllm.log" 2>&1 &
vllm_pid=$!
for _ in $(seq 1200); do  # its dataset is built first: up to 2 minutes
  grep -q "Starting main benchmark run" "$OUT_DIR/vllm.log" 2>/dev/null && break
  kill -0 "$vllm_pid" 2>/dev/null || break
  sleep 0.1
done
grep -q "Starting main benchmark run" "$OUT_DIR/vllm.log" || { tail -20 "$OUT_DIR/vllm.log" >&2; die "vllm bench serve did not start its run"; }
before=$(server_ttft)
"${load_on[@]}" timeout 600 "$HEADROOM" replay --trace "$OUT_DIR/trace.jsonl" --target "$URL" \
  --endpoint completions --model "$MODEL_NAME" --time-scale 1 --timeout 60 \
  --hardware "headroom sim ($SIM_PROFILE, roofline), beside vllm bench serve; $placement" \
  --out "$OUT_DIR/replay" >"$OUT_DIR/replay.log" 2>&1 || { cat "$OUT_DIR/replay.log" >&2; die "headroom replay failed"; }
wait "$vllm_pid" || { tail -20 "$OUT_DIR/vllm.log" >&2; die "vllm bench serve failed"; }
after=$(server_ttft)

"$PY" - "$OUT_DIR/vllm/run.json" "$OUT_DIR/replay/result.json" "$TOLERANCE_PCT" "$REQUESTS" "$before" "$after" "$placement" <<'EOF' | tee "$OUT_DIR/comparison.txt"
import json, sys
sys.path.insert(0, "scripts")
from agreement import gate, pct

v_path, h_path, tol, n = sys.argv[1], sys.argv[2], float(sys.argv[3]), int(sys.argv[4])
s0, c0 = map(float, sys.argv[5].split()); s1, c1 = map(float, sys.argv[6].split())

v = json.load(open(v_path))
ok = [i for i, t in enumerate(v["ttfts"]) if t and v["output_lens"][i]]
if v["completed"] != n or len(ok) != n:
    sys.exit(f"vllm bench serve completed {v['completed']} of {n}")
v_ttft = [1000 * v["ttfts"][i] for i in ok]
v_tpot = [1000 * (v["latencies"][i] - v["ttfts"][i]) / (v["output_lens"][i] - 1) for i in ok if v["output_lens"][i] > 1]
h = json.load(open(h_path))["summary"]
if h["completed"] != n or h["failed"]:
    sys.exit(f"headroom replay completed {h['completed']} of {n} ({h['failed']} failed)")
print(f"placement: {sys.argv[7]}")
print(f"requests: vllm bench serve {len(ok)}, headroom replay {h['completed']}, at once; "
      f"replay prompt mismatches vs trace: {h['lengths']['prompt_mismatches']}")
print(f"mean TTFT: vllm bench serve {sum(v_ttft)/len(v_ttft):.2f} ms, headroom replay {h['ttft']['mean_ms']:.2f} ms; "
      f"the simulator's own (arrival to first token, both clients' {int(c1 - c0)} requests) {1000 * (s1 - s0) / max(c1 - c0, 1):.2f} ms")
print()
gate("vllm bench serve", [
    ("TTFT p50", pct(v_ttft, 50), h["ttft"]["p50_ms"], True), ("TTFT p99", pct(v_ttft, 99), h["ttft"]["p99_ms"], True),
    ("TPOT p50", pct(v_tpot, 50), h["tpot"]["p50_ms"], True), ("TPOT p99", pct(v_tpot, 99), h["tpot"]["p99_ms"], True),
], tol)
EOF
