#!/usr/bin/env bash
# Instructions, not seconds: `headroom serve` under valgrind's callgrind while it relays N streams of
# TOKENS tokens from a fixed-clock simulated replica (the overhead contract's trace, at RATE req/s;
# callgrind slows the proxy ~50×, so keep RATE low). Counts are repeatable for the same binary and
# inputs whatever else the machine does, so two builds compare exactly. Prints, per relayed event,
# the run's total and the worker's largest parts, inclusive; the whole profile is left for
# callgrind_annotate. Counters are zeroed once each proxy is up, so totals are the traffic's (and
# the idle work's meanwhile), without start-up. Read the profile inclusively
# (callgrind_annotate --inclusive=yes): after the zeroing, callgrind books to the frames that were
# already running (the threads' outermost) as their own what their callees ran, so those frames'
# self counts are not what they ran themselves.
#
#   scripts/profile-proxy.sh                   # N=100 RATE=5 TOKENS=100
#   SERVE_BIN=/tmp/headroom-b scripts/profile-proxy.sh   # another build as the proxy
#   CACHE=1 scripts/profile-proxy.sh           # also simulate the caches (callgrind --cache-sim):
#                                              # instruction (I1mr) and data (D1mr) first-level
#                                              # cache misses beside the instructions
#   NGINX=1 scripts/profile-proxy.sh           # also nginx (one process, the overhead benchmark's
#                                              # unbuffered SSE proxy) under callgrind, the same
#                                              # trace: its event loop per relayed event, side by side
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
CACHE=${CACHE:-0}
NGINX=${NGINX:-0}
callgrind=(valgrind --tool=callgrind)
[ "$CACHE" = 1 ] && callgrind+=(--cache-sim=yes)
chunks=$(( N * (TOKENS + 1) ))
# per_event PROFILE PATTERN...: each function's inclusive counts (Ir, and with CACHE=1 the first-level
# misses) divided by the relayed events.
per_event() {
  local profile=$1
  shift
  callgrind_annotate --inclusive=yes "$profile" 2>/dev/null | python3 -c '
import re, sys
chunks, cache = int(sys.argv[1]), sys.argv[2] == "1"
patterns = sys.argv[3:]
events, seen = None, set()
for line in sys.stdin:
    if line.startswith("Events recorded:"):
        events = line.split(":", 1)[1].split()
        continue
    for p in patterns:
        if p in seen or not re.search(p, line):
            continue
        seen.add(p)
        counts = [int(n.replace(",", "")) for n in re.findall(r"([\d,]+) \(\s*[\d.]+%\)", line)]
        row = dict(zip(events or ["Ir"], counts))
        name = re.sub(r"^.*%\)\s+", "", line.strip())
        name = re.sub(r" \[.*$", "", re.sub(r"^[^:]*:", "", name, count=1))
        cols = "%9.0f Ir" % (row["Ir"] / chunks)
        if cache:
            cols += "  %6.1f I1mr  %6.1f D1mr" % (row.get("I1mr", 0) / chunks, row.get("D1mr", 0) / chunks)
        print("%s  %s" % (cols, name[:100]))
' "$chunks" "$CACHE" "$@"
}

# zero_counters PID: start-up (TLS roots, config, the first scrapes) is not the traffic, so the
# profile counts from here. callgrind_control exits 0 whether or not it reached the process: its
# words say which.
zero_counters() {
  local said
  said=$(timeout 60 callgrind_control -z "$1" 2>&1 || true)
  if [[ "$said" != *"sending command zero"* || "$said" == *Error* ]]; then
    echo "could not zero the counters of $1 (callgrind_control -z): $said" >&2
    exit 1
  fi
}

if [ "$NGINX" = 1 ]; then
  ngx_bin=$(command -v nginx || echo /usr/sbin/nginx)
  [ -x "$ngx_bin" ] || { echo "NGINX=1 needs nginx (apt-get install nginx-light)" >&2; exit 1; }
  ngx_dir=$(realpath "$OUT")/nginx
  ngx_port=$(free_port)
  # The benchmark's nginx (bench-overhead.sh), in one process in the foreground for valgrind.
  nginx_conf "$ngx_dir" "$ngx_port" "${replica_url#http://}" 1 "daemon off; master_process off;"
  rm -f "$OUT"/callgrind.nginx
  "${callgrind[@]}" --callgrind-out-file="$OUT/callgrind.nginx" "$ngx_bin" -c "$ngx_dir/nginx.conf" \
    -p "$ngx_dir" 2>"$OUT/nginx.valgrind.log" &
  ngx_pid=$!
  pids+=($ngx_pid)
  # Start-up under callgrind is slow: up to 2 minutes.
  wait_port "$ngx_port" 120 "nginx under callgrind ($OUT/nginx.valgrind.log)"
  zero_counters "$ngx_pid"
  $bin replay --trace "$OUT/trace.jsonl" --rate "$RATE" --target "http://127.0.0.1:$ngx_port" --seed 7 \
    --out "$OUT/replay-nginx" >"$OUT/replay-nginx.txt" 2>"$OUT/replay-nginx.log"
  kill -QUIT "$ngx_pid"
  wait "$ngx_pid" || true
fi

rm -f "$OUT"/callgrind.out.*
"${callgrind[@]}" --callgrind-out-file="$OUT/callgrind.out.%p" "$SERVE_BIN" serve \
  --config "$OUT/headroom.toml" --listen 127.0.0.1:0 --admin-listen 127.0.0.1:0 \
  --capture "$OUT/capture.jsonl" >"$OUT/headroom.url" 2>"$OUT/headroom.log" &
proxy_pid=$!
pids+=($proxy_pid)
# Start-up under callgrind is slow (seconds): wait up to 2 minutes.
for _ in $(seq 1200); do grep -q "admin http" "$OUT/headroom.log" 2>/dev/null && break; sleep 0.1; done
grep -q "admin http" "$OUT/headroom.log" || { echo "the proxy did not start: $OUT/headroom.log" >&2; exit 1; }
zero_counters "$proxy_pid"
url=$(grep -m1 http "$OUT/headroom.url")
$bin replay --trace "$OUT/trace.jsonl" --rate "$RATE" --target "$url" --seed 7 --out "$OUT/replay" \
  >"$OUT/replay.txt" 2>"$OUT/replay.log"
kill -INT "$proxy_pid"
wait "$proxy_pid" || true
profile=$(ls "$OUT"/callgrind.out.* | head -1)
echo "headroom: $profile ($N requests, $chunks relayed events), per relayed event:"
# The worker's loop (every task and the runtime's own work), the relay's task, the request path,
# the meter and the request's record. Counters are zeroed once the proxy is up, so the total is the
# traffic's (and the idle work meanwhile: the scrapes, probes and timers).
per_event "$profile" 'PROGRAM TOTALS' 'worker::Context::run \[' 'worker::Context::run_task \[' \
  'pump_in_own_task::\{\{closure\}\}::\{\{closure\}\} \[' 'ServerApp>::process_new::\{\{closure\}\} \[' \
  'ResponseMeter::on_chunk$' 'Recorder::finish \['
if [ "$NGINX" = 1 ]; then
  echo "nginx: $OUT/callgrind.nginx, per relayed event:"
  per_event "$OUT/callgrind.nginx" 'PROGRAM TOTALS' 'ngx_process_events_and_timers'
fi
