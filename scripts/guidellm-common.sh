# Shared by scripts/guidellm-run.sh and scripts/agreement-guidellm.sh: the pinned guidellm venv, the
# local tokenizer, offline mode, and one simulator on an ephemeral loopback port. Source it after
# setting ROOT, GUIDELLM_VERSION, VENV, PYTHON, HEADROOM, TOKENIZER_DIR, OUT_DIR and SIM_ARGS.

log() { printf '==> %s\n' "$*" >&2; }
die() { printf 'error: %s\n' "$*" >&2; exit 1; }

# Creates (or reuses) the venv with the pinned guidellm, trains the local tokenizer, and turns every
# hub lookup off. Sets PY.
guidellm_setup() {
  [[ -x "$HEADROOM" ]] || die "$HEADROOM not found; build it with: cargo build --release"
  command -v curl >/dev/null || die "curl is required"
  if [[ ! -x "$VENV/bin/python" ]]; then
    log "creating venv $VENV"
    mkdir -p "$(dirname "$VENV")"
    "$PYTHON" -m venv "$VENV"
  fi
  local installed
  installed="$("$VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("guidellm"))' 2>/dev/null || true)"
  if [[ "$installed" != "$GUIDELLM_VERSION" ]]; then
    log "installing guidellm==$GUIDELLM_VERSION into $VENV (from PyPI; pulls torch, several GB)"
    "$VENV/bin/python" -m pip install --disable-pip-version-check --quiet "guidellm==$GUIDELLM_VERSION"
  fi
  PY="$VENV/bin/python"
  log "guidellm $("$PY" -c 'import importlib.metadata as m; print(m.version("guidellm"))')"
  # Everything below runs offline: no Hugging Face hub, no telemetry, no proxy for loopback.
  export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1
  export NO_PROXY=127.0.0.1,localhost no_proxy=127.0.0.1,localhost
  "$PY" scripts/make_tokenizer.py "$TOKENIZER_DIR" >&2
}

source "$(dirname "${BASH_SOURCE[0]}")/pin.sh"

# Starts "$HEADROOM" "${SIM_ARGS[@]}" (on the system-under-test cores with PIN=1), stops it on exit, waits for /health 200. Sets URL and SIM_PID.
start_sim() {
  mkdir -p "$OUT_DIR"
  SIM_STDOUT="$(mktemp)"
  SIM_PID=""
  trap 'if [[ -n "$SIM_PID" ]] && kill -0 "$SIM_PID" 2>/dev/null; then kill -TERM "$SIM_PID" 2>/dev/null || true; wait "$SIM_PID" 2>/dev/null || true; fi; rm -f "$SIM_STDOUT"; pin_cleanup' EXIT
  trap 'exit 130' INT
  trap 'exit 143' TERM
  log "starting $HEADROOM ${SIM_ARGS[*]}"
  "${sut_on[@]}" "$HEADROOM" "${SIM_ARGS[@]}" >"$SIM_STDOUT" 2>"$OUT_DIR/sim.log" &
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
  local healthy=0 code
  for _ in $(seq 60); do  # up to ~30 s for /health 200
    code="$(curl --noproxy '*' -s -o /dev/null -w '%{http_code}' --max-time 2 "$URL/health" || true)"
    [[ "$code" == 200 ]] && { healthy=1; break; }
    kill -0 "$SIM_PID" 2>/dev/null || { cat "$OUT_DIR/sim.log" >&2; die "simulator exited early"; }
    sleep 0.5
  done
  [[ "$healthy" == 1 ]] || die "simulator at $URL never answered /health with 200"
  log "simulator healthy at $URL"
}
