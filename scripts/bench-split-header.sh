#!/usr/bin/env bash
# New-connection latency with the request header whole or split across two segments
# (scripts/split_header.py): a simulated replica direct, through headroom, and through nginx (the
# overhead benchmark's configuration, when nginx is installed); BASE_BIN adds a second headroom
# build (e.g. one before a change) as another target, side by side in the same run.
#
#   scripts/bench-split-header.sh                        # N=200 GAP_US=200
#   BASE_BIN=/tmp/headroom-old scripts/bench-split-header.sh
set -euo pipefail
for b in ${SERVE_BIN:-} ${BASE_BIN:-}; do
  [ -x "$b" ] || { echo "$b is not an executable" >&2; exit 1; }
done
[ -n "${SERVE_BIN:-}" ] && SERVE_BIN=$(realpath "$SERVE_BIN")
[ -n "${BASE_BIN:-}" ] && BASE_BIN=$(realpath "$BASE_BIN")
cd "$(dirname "$0")/.."
N=${N:-200}
GAP_US=${GAP_US:-200}
OUT=${OUT:-results/split-header}
mkdir -p "$OUT"
cargo build --release --locked -q
bin=target/release/headroom
SERVE_BIN=${SERVE_BIN:-$bin}
source scripts/bench-common.sh
load_on=()
sut_on=()

# A replica that answers at once (1 ms to the first token): the split's cost is not hidden in
# the engine's time.
start_stream_replica fixed 1 1 "$OUT"
targets=("direct=${replica_url#http://}")

# start_headroom NAME BIN: a proxy in front of the replica, added to the targets.
start_headroom() {
  "$2" serve --listen 127.0.0.1:0 --admin-listen 127.0.0.1:0 --backends "$replica_url" \
    >"$OUT/$1.url" 2>"$OUT/$1.log" &
  pids+=($!)
  wait_line "$OUT/$1.log" "admin http"
  local url
  url=$(grep -m1 http "$OUT/$1.url")
  targets+=("$1=${url#http://}")
}
start_headroom headroom "$SERVE_BIN"
[ -n "${BASE_BIN:-}" ] && start_headroom base "$BASE_BIN"

NGINX=$(command -v nginx || echo /usr/sbin/nginx)
if [ -x "$NGINX" ]; then
  port=$(free_port)
  ndir=$(cd "$OUT" && pwd)/nginx
  nginx_conf "$ndir" "$port" "${replica_url#http://}" 1
  "$NGINX" -p "$ndir" -c "$ndir/nginx.conf" -g 'daemon off;' 2>"$ndir/logs/stderr.log" &
  pids+=($!)
  for _ in $(seq 100); do curl -sf "http://127.0.0.1:$port/health" >/dev/null && break; sleep 0.05; done
  targets+=("nginx=127.0.0.1:$port")
else
  echo "nginx not installed: measuring without it" >&2
fi

python3 scripts/split_header.py "${targets[@]}" --n "$N" --gap-us "$GAP_US" --json "$OUT/result.json" \
  | tee "$OUT/summary.md"
