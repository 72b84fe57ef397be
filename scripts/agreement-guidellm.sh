#!/usr/bin/env bash
# Agreement check: `headroom replay` and guidellm 0.8.1 measure the same TTFT and
# TPOT on the same simulator under the same run shape.
#
#   scripts/agreement-guidellm.sh
#
# 1. reuses (or creates) the guidellm venv and local tokenizer of
#    scripts/guidellm-run.sh (docs/guidellm.md);
# 2. starts ONE `headroom sim` on 127.0.0.1 (ephemeral port, roofline timing);
# 3. runs guidellm against /v1/completions: constant 4 req/s, 40 requests,
#    synthetic 256-token prompts (local tokenizer), 64 output tokens;
# 4. writes a trace of the same shape: 40 rows 250 ms apart, row i's
#    input_length = the prompt_tokens the simulator reported for guidellm's
#    i-th request (in scheduled order), output_length 64, one unique hash id
#    per row (no prefix sharing), and replays it with `headroom replay` at the
#    trace's timestamps against the same simulator (guidellm first, then
#    replay, sequentially);
# 5. prints TTFT and TPOT p50/p99 from both and exits non-zero if any differs
#    by more than 5 % (relative to guidellm).
#
# Field mapping (both are per request, percentiles by linear interpolation as
# np.percentile, over the 40 completed requests):
#   TTFT: guidellm time_to_first_token_ms  <-> headroom summary.ttft
#   TPOT: guidellm inter_token_latency_ms  <-> headroom summary.tpot
#         (guidellm: (last token - first token) / (output tokens - 1), which is
#          vLLM's TPOT; guidellm's time_per_output_token_ms includes the TTFT
#          and divides by all output tokens, so it is NOT compared.)
#
# Outputs in results/agreement-guidellm/: guidellm.json, guidellm.log,
# trace.jsonl, replay/ (result.json, requests.csv, summary.txt), replay.log, sim.log,
# comparison.txt.
#
# Environment: GUIDELLM_VENV (default .cache/guidellm-venv), PYTHON (default
# python3, only to create the venv), HEADROOM_BIN (default
# target/release/headroom), TOLERANCE_PCT (default 5), SIM_PROFILE (default
# llama-3.1-8b), PIN (1: the simulator on a core of its own, the two clients on
# the others) and NOIDLE (1: cores poll instead of halting; both scripts/pin.sh).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

GUIDELLM_VERSION=0.8.1
VENV="${GUIDELLM_VENV:-.cache/guidellm-venv}"
PYTHON="${PYTHON:-python3}"
HEADROOM="${HEADROOM_BIN:-target/release/headroom}"
TOKENIZER_DIR=.cache/guidellm-tokenizer
OUT_DIR=results/agreement-guidellm
TOLERANCE_PCT="${TOLERANCE_PCT:-5}"

# Run shape (the same as scripts/guidellm-run.sh, completions only). SIM_PROFILE picks the simulated
# model: with llama-3.1-70b each step is longer, so a client's own per-request overhead is a smaller
# share of the TTFT both tools measure.
SIM_PROFILE=${SIM_PROFILE:-llama-3.1-8b}
MODEL_NAME=sim-$SIM_PROFILE
ENDPOINT=/v1/completions
RATE=${RATE:-4}            # requests/s, constant (evenly spaced) arrivals
REQUESTS=${REQUESTS:-40}
MAX_SECONDS=120   # guidellm's max_duration constraint
PROMPT_TOKENS=${PROMPT_TOKENS:-256} # by the local tokenizer; the simulator counts ~93
OUTPUT_TOKENS=${OUTPUT_TOKENS:-64}
SIM_ARGS=(sim --host 127.0.0.1 --port 0 --profile "$SIM_PROFILE" --served-model-name "$MODEL_NAME")

# PIN=1 (scripts/pin.sh, through guidellm-common.sh): the simulator on a core of its own, guidellm
# and headroom replay on the others.
source scripts/guidellm-common.sh
command -v timeout >/dev/null || die "timeout (coreutils) is required"
guidellm_setup
mkdir -p "$OUT_DIR"
rm -rf "$OUT_DIR/replay" "$OUT_DIR/guidellm.json" "$OUT_DIR/trace.jsonl" "$OUT_DIR/comparison.txt"
start_sim

# --- 3. guidellm ---------------------------------------------------------------
log "guidellm: constant $RATE req/s, $REQUESTS requests, ${PROMPT_TOKENS}/${OUTPUT_TOKENS} tokens -> $ENDPOINT"
if ! "${load_on[@]}" timeout 300 env -u GUIDELLM_VENV "$VENV/bin/guidellm" run \
    --backend "kind=openai_http,target=$URL,model=$MODEL_NAME,request_format=$ENDPOINT" \
    --profile "kind=constant,rate=$RATE" \
    --constraint "kind=max_requests,count=$REQUESTS" \
    --constraint "kind=max_duration,seconds=$MAX_SECONDS" \
    --tokenizer "kind=hf_auto,model=$ROOT/$TOKENIZER_DIR" \
    --data "kind=synthetic_text,prompt_tokens=$PROMPT_TOKENS,output_tokens=$OUTPUT_TOKENS" \
    --output "kind=json,path=$ROOT/$OUT_DIR/guidellm.json" \
    --disable-console-interactive \
    >"$OUT_DIR/guidellm.log" 2>&1; then
  tail -n 40 "$OUT_DIR/guidellm.log" >&2
  die "guidellm failed (log: $OUT_DIR/guidellm.log)"
fi
[[ -s "$OUT_DIR/guidellm.json" ]] || die "guidellm wrote no $OUT_DIR/guidellm.json"

# --- 4. the same shape as a trace ------------------------------------------------
# Row i: arrival i/RATE s; prompt = the simulator's prompt_tokens for guidellm's
# i-th request (by scheduled time); output 64; one unique hash id (ceil(N/512) = 1).
"$PY" - "$OUT_DIR/guidellm.json" "$OUT_DIR/trace.jsonl" "$RATE" "$REQUESTS" "$OUTPUT_TOKENS" <<'EOF'
import json, math, sys

src, dst, rate, n, out_tokens = sys.argv[1], sys.argv[2], float(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
bench = json.load(open(src))["benchmarks"][0]
reqs = bench["requests"]
ok = sorted(reqs["successful"], key=lambda r: r["info"]["timings"]["targeted_start"])
bad = len(reqs.get("errored") or []) + len(reqs.get("incomplete") or [])
if len(ok) != n or bad:
    sys.exit(f"guidellm completed {len(ok)} of {n} requests ({bad} errored/incomplete)")
if any(r["output_tokens"] != out_tokens for r in ok):
    sys.exit("guidellm: some request did not produce exactly %d output tokens" % out_tokens)
with open(dst, "w") as f:
    for i, r in enumerate(ok):
        p = int(r["prompt_tokens"])
        row = {"timestamp": round(i * 1000 / rate), "input_length": p, "output_length": out_tokens,
               "hash_ids": [(i + 1) * 1000 + k for k in range(math.ceil(p / 512))]}
        f.write(json.dumps(row) + "\n")
lens = sorted(int(r["prompt_tokens"]) for r in ok)
print(f"==> trace: {n} rows, prompt tokens min {lens[0]} median {lens[len(lens)//2]} max {lens[-1]}",
      file=sys.stderr)
EOF

# --- 5. headroom replay against the same simulator ----------------------------------
kill -0 "$SIM_PID" 2>/dev/null || die "the simulator stopped (see $OUT_DIR/sim.log)"
log "headroom replay: $OUT_DIR/trace.jsonl at its timestamps -> $ENDPOINT"
"${load_on[@]}" timeout 300 "$HEADROOM" replay --trace "$OUT_DIR/trace.jsonl" --target "$URL" \
  --endpoint completions --model "$MODEL_NAME" --time-scale 1 --timeout 60 \
  --out "$OUT_DIR/replay" >"$OUT_DIR/replay.log" 2>&1 \
  || { cat "$OUT_DIR/replay.log" >&2; die "headroom replay failed"; }

# --- 6. compare --------------------------------------------------------------------
"$PY" - "$OUT_DIR/guidellm.json" "$OUT_DIR/replay/result.json" "$TOLERANCE_PCT" "$REQUESTS" <<'EOF' | tee "$OUT_DIR/comparison.txt"
import json, sys

sys.path.insert(0, "scripts")
from agreement import gate, pct

g_path, h_path, tol, n = sys.argv[1], sys.argv[2], float(sys.argv[3]), int(sys.argv[4])

g = json.load(open(g_path))["benchmarks"][0]["requests"]["successful"]
h = json.load(open(h_path))
hs = h["summary"]
if hs["completed"] != n or hs["failed"]:
    sys.exit(f"headroom replay completed {hs['completed']} of {n} ({hs['failed']} failed)")

g_ttft = [r["time_to_first_token_ms"] for r in g]
g_tpot = [r["inter_token_latency_ms"] for r in g]
# vLLM's E2EL (to the last token) from guidellm's timings, for information only.
g_e2el = [1000 * (r["info"]["timings"]["last_token_iteration"] - r["info"]["timings"]["request_start"]) for r in g]

rows = [
    ("TTFT p50", pct(g_ttft, 50), hs["ttft"]["p50_ms"], True),
    ("TTFT p99", pct(g_ttft, 99), hs["ttft"]["p99_ms"], True),
    ("TPOT p50", pct(g_tpot, 50), hs["tpot"]["p50_ms"], True),
    ("TPOT p99", pct(g_tpot, 99), hs["tpot"]["p99_ms"], True),
    ("E2EL p50 (info)", pct(g_e2el, 50), hs["e2el"]["p50_ms"], False),
    ("E2EL p99 (info)", pct(g_e2el, 99), hs["e2el"]["p99_ms"], False),
]
g_prompt = sorted(r["prompt_tokens"] for r in g)
h_prompt = sorted(r["prompt_tokens"] for r in h["requests"]) if h["requests"] and "prompt_tokens" in h["requests"][0] else None
print(f"requests: guidellm {len(g)} completed, headroom replay {hs['completed']} completed")
print(f"prompt tokens (simulator usage): guidellm {g_prompt[0]}..{g_prompt[-1]}"
      + (f", replay {h_prompt[0]}..{h_prompt[-1]}" if h_prompt else "")
      + f"; replay prompt mismatches vs trace: {hs['lengths']['prompt_mismatches']}")
print(f"replay send lateness p99: {hs['send_lateness']['p99_ms']:.3f} ms; "
      f"replay per-chunk ITL min {hs['itl']['min_ms']:.3f} ms (near 0: chunks arrived coalesced)")
print()
gate("guidellm", rows, tol)
EOF
