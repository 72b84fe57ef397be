#!/usr/bin/env bash
# Instructions, not seconds: `headroom serve` under valgrind's callgrind while it relays N streams of
# TOKENS tokens from a fixed-clock simulated replica (the overhead contract's trace, at RATE req/s;
# callgrind slows the proxy ~50×, so keep RATE low). Counts are repeatable for the same binary and
# inputs whatever else the machine does, so two builds compare exactly. Prints the run's total and
# the request path's largest parts, inclusive; the whole profile is left for callgrind_annotate.
#
#   scripts/profile-proxy.sh                   # N=100 RATE=5 TOKENS=100
#   SERVE_BIN=/tmp/headroom-b scripts/profile-proxy.sh   # another build as the proxy
set -euo pipefail
if [ -n "${SERVE_BIN:-}" ]; then
  [ -x "$SERVE_BIN" ] || { echo "SERVE_BIN=$SERVE_BIN is not an executable" >&2; exit 1; }
  SERVE_BIN=$(realpath "$SERVE_BIN")
fi
cd "$(dirname "$0")/.."
N=${N:-100}
RATE=${RATE:-5}
TOKENS=${TOKENS:-100}
OUT=${OUT:-results/profile-proxy}
mkdir -p "$OUT"
if ! command -v valgrind >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
  $SUDO apt-get update -qq && $SUDO apt-get install -y -qq valgrind >/dev/null
fi
cargo build --release --locked -q
bin=target/release/headroom
SERVE_BIN=${SERVE_BIN:-$bin}
source scripts/bench-common.sh
load_on=()
trap cleanup EXIT

stream_trace "$OUT/trace.jsonl" "$N" "$TOKENS"
start_stream_replica fixed 20 10 "$OUT"
printf '[[backends]]\nurl = "%s"\n' "$replica_url" >"$OUT/headroom.toml"
rm -f "$OUT"/callgrind.out.*
valgrind --tool=callgrind --callgrind-out-file="$OUT/callgrind.out.%p" "$SERVE_BIN" serve \
  --config "$OUT/headroom.toml" --listen 127.0.0.1:0 --admin-listen 127.0.0.1:0 \
  --capture "$OUT/capture.jsonl" >"$OUT/headroom.url" 2>"$OUT/headroom.log" &
proxy_pid=$!
pids+=($proxy_pid)
# Start-up under callgrind is slow (seconds): wait up to 2 minutes.
for _ in $(seq 1200); do grep -q "admin http" "$OUT/headroom.log" 2>/dev/null && break; sleep 0.1; done
grep -q "admin http" "$OUT/headroom.log" || { echo "the proxy did not start: $OUT/headroom.log" >&2; exit 1; }
url=$(grep -m1 http "$OUT/headroom.url")
$bin replay --trace "$OUT/trace.jsonl" --rate "$RATE" --target "$url" --seed 7 --out "$OUT/replay" \
  >"$OUT/replay.txt" 2>"$OUT/replay.log"
kill -INT "$proxy_pid"
wait "$proxy_pid" || true
profile=$(ls "$OUT"/callgrind.out.* | head -1)
chunks=$(( N * (TOKENS + 1) ))
echo "profile: $profile ($N requests, $chunks relayed events)"
callgrind_annotate --inclusive=yes "$profile" 2>/dev/null |
  grep -E 'PROGRAM TOTALS|forward::<impl headroom_proxy::app::Headroom>::forward::\{\{closure\}\} \[|ResponseMeter::(on_chunk|whole_events)[^ ]* \[|measure::read_event \[|Session::write_response_body::\{\{closure\}\} \[|BodyReader::read_body::\{\{closure\}\} \[|finish_record \[' |
  awk -v c="$chunks" '{n=$1; gsub(",", "", n); f=$0; sub(/^[^)]*\)[ ]+/, "", f);
    sub(/ \[.*$/, "", f); sub(/^[^:]*:/, "", f);
    printf "%14s  %7.0f per event  %s\n", $1, n / c, substr(f, 1, 110)}'
