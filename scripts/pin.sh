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
  echo "$placement" >&2
fi
