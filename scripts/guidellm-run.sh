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

log() { printf '==> %s\n' "$*" >&2; }
die() { printf 'error: %s\n' "$*" >&2; exit 1; }

[[ -x "$HEADROOM" ]] || die "$HEADROOM not found; build it with: cargo build --release"
command -v curl >/dev/null || die "curl is required"

# --- 1. venv with pinned guidellm --------------------------------------------
if [[ ! -x "$VENV/bin/python" ]]; then
  log "creating venv $VENV"
  mkdir -p "$(dirname "$VENV")"
  "$PYTHON" -m venv "$VENV"
fi
installed="$("$VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("guidellm"))' 2>/dev/null || true)"
if [[ "$installed" != "$GUIDELLM_VERSION" ]]; then
  log "installing guidellm==$GUIDELLM_VERSION into $VENV (from PyPI; pulls torch, several GB)"
  "$VENV/bin/python" -m pip install --disable-pip-version-check --quiet "guidellm==$GUIDELLM_VERSION"
fi
log "guidellm $("$VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("guidellm"))')"

# Everything below runs offline: no Hugging Face hub, no telemetry, no proxy
# for loopback traffic.
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1
export NO_PROXY=127.0.0.1,localhost no_proxy=127.0.0.1,localhost

# --- 2. local tokenizer ------------------------------------------------------
"$VENV/bin/python" scripts/make_tokenizer.py "$TOKENIZER_DIR" >&2

# --- 3. simulator ------------------------------------------------------------
mkdir -p "$OUT_DIR"
"$VENV/bin/python" -m pip freeze --disable-pip-version-check >"$OUT_DIR/pip-freeze.txt"
SIM_STDOUT="$(mktemp)"
SIM_PID=""
cleanup() {
  if [[ -n "$SIM_PID" ]] && kill -0 "$SIM_PID" 2>/dev/null; then
    kill -TERM "$SIM_PID" 2>/dev/null || true
    wait "$SIM_PID" 2>/dev/null || true
  fi
  rm -f "$SIM_STDOUT"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

log "starting $HEADROOM ${SIM_ARGS[*]}"
"$HEADROOM" "${SIM_ARGS[@]}" >"$SIM_STDOUT" 2>"$OUT_DIR/sim.log" &
SIM_PID=$!

URL=""
for _ in $(seq 100); do  # up to 10 s for the URL line
  if [[ "$(wc -l <"$SIM_STDOUT")" -ge 1 ]]; then  # a complete first line
    URL="$(head -n 1 "$SIM_STDOUT")"
    break
  fi
  kill -0 "$SIM_PID" 2>/dev/null || { cat "$OUT_DIR/sim.log" >&2; die "simulator exited early"; }
  sleep 0.1
done
[[ "$URL" =~ ^http://127\.0\.0\.1:[0-9]+$ ]] || die "unexpected simulator URL: '$URL'"

healthy=0
for _ in $(seq 60); do  # up to ~30 s for /health 200
  code="$(curl --noproxy '*' -s -o /dev/null -w '%{http_code}' --max-time 2 "$URL/health" || true)"
  [[ "$code" == 200 ]] && { healthy=1; break; }
  kill -0 "$SIM_PID" 2>/dev/null || { cat "$OUT_DIR/sim.log" >&2; die "simulator exited early"; }
  sleep 0.5
done
[[ "$healthy" == 1 ]] || die "simulator at $URL never answered /health with 200"
log "simulator healthy at $URL"

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
