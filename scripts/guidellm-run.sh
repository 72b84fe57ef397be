#!/usr/bin/env bash
# Prove that a real third-party benchmark client, guidellm (PyPI), completes a
# constant-rate run against `headroom sim`, fully offline.
#
#   scripts/guidellm-run.sh
#
# 1. creates (or reuses) a venv with a pinned guidellm (pip, PyPI);
# 2. trains a tiny local tokenizer (scripts/make_tokenizer.py), so nothing is
#    fetched from the Hugging Face hub;
# 3. starts target/release/headroom sim on 127.0.0.1 (ephemeral port) and waits
#    for /health;
# 4. runs guidellm at a constant rate against /v1/completions, then
#    /v1/chat/completions, writing JSON under results/guidellm/;
# 5. prints a summary; exits non-zero if any request errored or none completed.
#
# Environment: GUIDELLM_VENV (default .cache/guidellm-venv), PYTHON (default
# python3, used only to create the venv), HEADROOM_BIN (default
# target/release/headroom). Relative paths are taken from the repo root.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

GUIDELLM_VERSION=0.8.1
VENV="${GUIDELLM_VENV:-.cache/guidellm-venv}"
PYTHON="${PYTHON:-python3}"
HEADROOM="${HEADROOM_BIN:-target/release/headroom}"
TOKENIZER_DIR=.cache/guidellm-tokenizer
OUT_DIR=results/guidellm

# Workload contract.
MODEL_NAME=sim-llama-3.1-8b
RATE=4            # requests/s, constant (evenly spaced) arrivals
REQUESTS=40       # requests per run
MAX_SECONDS=120   # hard cap per run
PROMPT_TOKENS=256 # synthetic prompt length, counted by the local tokenizer
OUTPUT_TOKENS=64  # max_tokens / max_completion_tokens, with ignore_eos
ENDPOINTS=(/v1/completions /v1/chat/completions)
SIM_ARGS=(sim --host 127.0.0.1 --port 0 --served-model-name "$MODEL_NAME" --seed 0)

source scripts/guidellm-common.sh
guidellm_setup
mkdir -p "$OUT_DIR"
"$PY" -m pip freeze --disable-pip-version-check >"$OUT_DIR/pip-freeze.txt"
start_sim

# --- 4. guidellm runs --------------------------------------------------------
status=0
outputs=()
for endpoint in "${ENDPOINTS[@]}"; do
  if ! kill -0 "$SIM_PID" 2>/dev/null; then
    log "simulator is no longer running (see $OUT_DIR/sim.log); skipping $endpoint"
    status=1
    continue
  fi
  name="${endpoint#/v1/}"; name="${name//\//-}"
  out="$OUT_DIR/$name.json"
  rm -f "$out"
  log "guidellm: constant $RATE req/s, $REQUESTS requests, ${PROMPT_TOKENS}/${OUTPUT_TOKENS} tokens -> $endpoint"
  # (GUIDELLM_* variables are guidellm settings; drop ours so it does not warn.)
  if ! env -u GUIDELLM_VENV "$VENV/bin/guidellm" run \
      --backend "kind=openai_http,target=$URL,model=$MODEL_NAME,request_format=$endpoint" \
      --profile "kind=constant,rate=$RATE" \
      --constraint "kind=max_requests,count=$REQUESTS" \
      --constraint "kind=max_duration,seconds=$MAX_SECONDS" \
      --tokenizer "kind=hf_auto,model=$ROOT/$TOKENIZER_DIR" \
      --data "kind=synthetic_text,prompt_tokens=$PROMPT_TOKENS,output_tokens=$OUTPUT_TOKENS" \
      --output "kind=json,path=$ROOT/$out" \
      --disable-console-interactive \
      >"$OUT_DIR/$name.log" 2>&1; then
    tail -n 40 "$OUT_DIR/$name.log" >&2
    log "guidellm failed for $endpoint (log: $OUT_DIR/$name.log)"
    status=1
    continue
  fi
  [[ -s "$out" ]] || { log "guidellm wrote no $out"; status=1; continue; }
  kill -0 "$SIM_PID" 2>/dev/null || log "warning: the simulator stopped during the $endpoint run (see $OUT_DIR/sim.log)"
  outputs+=("$endpoint=$out")
done

# --- 5. summary --------------------------------------------------------------
if ((${#outputs[@]})); then
  "$VENV/bin/python" - "${outputs[@]}" <<'EOF' || status=1
import json, sys

ok = True
rows = []
for arg in sys.argv[1:]:
    endpoint, path = arg.split("=", 1)
    bench = json.load(open(path))["benchmarks"][0]
    m = bench["metrics"]
    totals = m["request_totals"]
    s = lambda k: m[k]["successful"]
    rows.append((
        endpoint, totals["successful"], totals["errored"], totals["incomplete"],
        s("time_to_first_token_ms")["median"], s("time_to_first_token_ms")["percentiles"]["p99"],
        s("inter_token_latency_ms")["median"],
        m["output_tokens_per_second"]["total"]["mean"],
        s("prompt_token_count")["median"], s("output_token_count")["median"],
    ))
    if totals["errored"] > 0 or totals["successful"] == 0:
        ok = False

head = ("endpoint", "completed", "errored", "incomplete", "TTFT p50 ms", "TTFT p99 ms",
        "ITL p50 ms", "out tok/s", "prompt tok p50", "out tok p50")
print(" | ".join(head))
for r in rows:
    print(" | ".join([r[0], *map(str, r[1:4]), *(f"{v:.1f}" for v in r[4:])]))
print("PASS" if ok else "FAIL: errored requests or none completed")
sys.exit(0 if ok else 1)
EOF
else
  status=1
fi
exit "$status"
