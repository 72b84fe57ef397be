# Sourced by the benchmark scripts: where their processes run.
#
# CPU placement. PIN=1 gives the system under test (SUT) cores of its own, as it has in production,
# so that its numbers are not run-queue waits behind the load generator (and the other way round):
# commands prefixed with "${sut_on[@]}" run on SUT_CPUS (default: the last core), those prefixed with
# "${load_on[@]}" on LOAD_CPUS (default: the other cores). Each script says what its SUT is.
# `sut_workers` is how many cores the SUT has (for worker counts); `placement` describes the choice
# for the summary. PIN=0 (the default) leaves everything where the kernel puts it.
PIN=${PIN:-0}
sut_on=() load_on=() sut_workers=auto
placement="not pinned: every process shares every core"
if [ "$PIN" = 1 ]; then
  cores=$(nproc)
  if [ "$cores" -lt 2 ] || ! command -v taskset >/dev/null; then
    echo "PIN=1 needs at least 2 cores and taskset (have $cores cores)" >&2
    exit 2
  fi
  SUT_CPUS=${SUT_CPUS:-$((cores - 1))}
  LOAD_CPUS=${LOAD_CPUS:-0-$((cores - 2))}
  sut_on=(taskset -c "$SUT_CPUS")
  load_on=(taskset -c "$LOAD_CPUS")
  sut_workers=$(taskset -c "$SUT_CPUS" nproc)
  placement="pinned: system under test on CPU $SUT_CPUS, load generator on CPU $LOAD_CPUS"
  # The script itself moves to the load cores too, so what it starts without a placement (its
  # subshells, sleep, grep, perf, the packet capture's reader and analysis) never takes the
  # SUT's cores; "${sut_on[@]}" still places a command there.
  taskset -cp "$LOAD_CPUS" $$ >/dev/null
  echo "$placement" >&2
fi

# Isolation. ISOLATE=1 (with PIN=1) also moves everything else that may move off the SUT's cores
# for the script's life, as isolcpus or tuna would on a production proxy's cores: every thread of
# the machine that may run elsewhere (its daemons, its agent, unbound kernel threads such as
# DAMON's kdamond), the unbound kernel workqueues and the device interrupts that accept it
# (scripts/isolate_cpus.py; what cannot move, per-CPU kernel threads and managed interrupts, is
# printed). Everything is put back when the script ends. It changes the machine, not the
# software, and gives every proxy of a comparison the same core; the summary says it was on.
# Needs root.
ISOLATE=${ISOLATE:-0}
if [ "$ISOLATE" = 1 ]; then
  if [ "$PIN" != 1 ] || [ "$(id -u)" != 0 ]; then
    echo "ISOLATE=1 needs PIN=1 (it clears the SUT's cores) and root" >&2
    exit 2
  fi
  isolation_saved=$(mktemp)
  isolation_tool=$(realpath "$(dirname "${BASH_SOURCE[0]}")/isolate_cpus.py")
  # The script and the shells above it stay as they are (the script is on the load cores already):
  # a shell that starts benchmarks one after another must not hand the confinement on.
  python3 "$isolation_tool" --away "$SUT_CPUS" --save "$isolation_saved" --keep $$
  # Put back by the script's exit trap (pin_cleanup, called by every script that sources this
  # file), before the next command of its caller starts; and, should the script be killed
  # outright, by a holder that outlives it (as NOIDLE's), which finds the saved file still there.
  isolation_owner=$$
  (
    (
      while kill -0 "$isolation_owner" 2>/dev/null; do sleep 1; done
      if [ -f "$isolation_saved" ]; then
        python3 "$isolation_tool" --restore "$isolation_saved" 2>/dev/null
        rm -f "$isolation_saved"
      fi
    ) &
  )
  placement="$placement; everything else that may move kept off CPU $SUT_CPUS"
fi

# Idle states. NOIDLE=1 keeps every core out of its idle (halt) state for the script's life by
# holding the kernel's CPU latency request at 0 µs (/dev/cpu_dma_latency, as tuned's
# latency-performance profile does): a core waiting for the next chunk then polls instead of
# halting, and on a virtual machine its wake-up stops costing an exit to the hypervisor. It changes
# the machine, not the software, and applies to every path of a comparison alike; the summary says
# it was on. Needs write access to /dev/cpu_dma_latency (root).
NOIDLE=${NOIDLE:-0}
if [ "$NOIDLE" = 1 ]; then
  if [ ! -w /dev/cpu_dma_latency ]; then
    echo "NOIDLE=1 needs write access to /dev/cpu_dma_latency (run as root)" >&2
    exit 2
  fi
  # The request holds while the file is open: a holder that outlives nothing but this script. It
  # is started from a subshell, so it is not this script's child: an exit trap's `wait` does not
  # wait for it (it waits for the script).
  noidle_owner=$$
  (
    (
      exec 9>/dev/cpu_dma_latency
      printf 0 >&9
      while kill -0 "$noidle_owner" 2>/dev/null; do sleep 1; done
    ) &
  )
  placement="$placement; cores kept out of idle states (cpu_dma_latency 0)"
  echo "cores kept out of idle states while this script runs" >&2
fi

# Priority. LOAD_NICE=N runs what "${load_on[@]}" starts (the load generator; in bench-overhead.sh
# also the replica beside it) N nice levels from this script's own (negative needs root): the
# machine's own daemons (on this VM, its agent runs at nice -10 on every core) then no longer
# preempt the client for milliseconds just as a burst is due. It changes the machine, not the
# software; the summary says it was used.
LOAD_NICE=${LOAD_NICE:-}
if [ -n "$LOAD_NICE" ]; then
  want=$(( $(nice) + LOAD_NICE ))
  [ "$want" -lt -20 ] && want=-20
  [ "$want" -gt 19 ] && want=19
  if [ "$(nice -n "$LOAD_NICE" nice 2>/dev/null)" != "$want" ]; then
    echo "LOAD_NICE=$LOAD_NICE: cannot run at nice $want (negative values need root)" >&2
    exit 2
  fi
  load_on=(nice -n "$LOAD_NICE" "${load_on[@]}")
  placement="$placement; load generator at nice $want"
  echo "load generator at nice $want" >&2
fi

# pin_cleanup: what pin.sh changed that must be put back when the script ends (ISOLATE's moves);
# each script that sources this file calls it from its exit trap.
pin_cleanup() {
  if [ -n "${isolation_saved:-}" ] && [ -f "$isolation_saved" ]; then
    python3 "$isolation_tool" --restore "$isolation_saved" 2>/dev/null || true
    rm -f "$isolation_saved"
  fi
}
