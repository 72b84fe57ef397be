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
