# Shared by the benchmark scripts (sourced): background processes stopped on exit, and waiting for
# a line a process prints when it is ready.

# PIDs to stop (SIGINT, then wait) when the script exits, however it exits.
pids=()
cleanup() { for p in "${pids[@]}"; do kill -INT "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap cleanup EXIT

# wait_line FILE PATTERN: waits up to 10 s for PATTERN to appear in FILE.
wait_line() {
  for _ in $(seq 200); do grep -q "$2" "$1" 2>/dev/null && return 0; sleep 0.05; done
  echo "timed out waiting for $2 in $1" >&2
  exit 1
}

# start_sims N URL_FILE [FLAG...]: starts N simulated replicas (one `headroom sim` process, $bin, on
# the system-under-test cores with PIN=1) on ephemeral ports, their URLs one per line in URL_FILE
# and their log beside it; waits up to 10 s.
start_sims() {
  local n=$1 file=$2
  shift 2
  "${sut_on[@]}" "$bin" sim --replicas "$n" --port 0 "$@" >"$file" 2>"${file%.url}.log" &
  pids+=($!)
  for _ in $(seq 200); do [ "$(grep -c http "$file" 2>/dev/null)" = "$n" ] && return 0; sleep 0.05; done
  echo "the simulator did not start: see ${file%.url}.log" >&2
  exit 1
}

source "$(dirname "${BASH_SOURCE[0]}")/pin.sh"
