#!/usr/bin/env bash
# Proxy overhead, side by side in one run: the same streaming load (a constant-latency simulated
# replica, RATE req/s, TOKENS-token streams) sent direct to the replica, through `headroom serve`,
# and through nginx configured as a plain unbuffered SSE reverse proxy. Each configuration runs
# ROUNDS times, interleaved, so drift on a shared machine hits all three alike. Records TTFT and ITL
# percentiles per configuration, what each proxy adds over direct, and each proxy's CPU time per
# relayed chunk (from /proc, all of its processes and threads). Loopback only; bounded by DURATION.
#
#   scripts/bench-overhead.sh                    # RATE=200 TOKENS=100 DURATION=30 ROUNDS=2 CAPTURE=1
#                                                # WARMUP=5 (s of unmeasured load through each path
#                                                # before the first round; 0: none)
#   MODEL=constant scripts/bench-overhead.sh     # the replica's timing model (default fixed: every
#                                                # request's first token TTFT_MS after its arrival,
#                                                # then one per ITL_MS, no shared steps, so what a
#                                                # hop adds is not rounded to an engine step)
#   PIN=1 scripts/bench-overhead.sh              # each proxy on a core of its own (bench-common.sh)
#   SYSCALLS=1 scripts/bench-overhead.sh         # also count each proxy's system calls by kind
#                                                # (perf stat on its processes, every thread) and
#                                                # print them per relayed chunk, side by side
#   PROFILE=1 scripts/bench-overhead.sh          # also sample each proxy's CPU (perf record -g, 999 Hz,
#                                                # every thread) and split its CPU per chunk into user
#                                                # space and the kernel by system call; the samples stay
#                                                # in OUT/<proxy>-<round>/perf.data for perf report
#   SCHED=1 PIN=1 scripts/bench-overhead.sh     # also trace the scheduler on the proxies' core
#                                                # during each proxy round (perf sched record) and
#                                                # say how long the proxy's threads sat runnable but
#                                                # not running, and what ran meanwhile
#                                                # (scripts/sched_preemptions.py; OUT/<proxy>-<round>/
#                                                # sched.txt, sched.json, sched.data)
#   MIX=1 scripts/bench-overhead.sh              # also ROUNDS rounds with the three paths in turn,
#                                                # request by request, MIX_RATE (RATE) req/s in
#                                                # all: added TTFT against direct requests of the
#                                                # same moments, free of drift between rounds
#   WIRE=1 scripts/bench-overhead.sh             # also capture each proxy round's loopback packets
#                                                # (tcpdump) and read off them what the proxy itself
#                                                # holds each request and each event, free of the
#                                                # client's and the replica's wake-ups
#                                                # (scripts/wire_latency.py); KEEP_PCAP=1 keeps the
#                                                # captures in OUT/<proxy>-<round>/wire.pcap; with
#                                                # PIN=1 also what the machine takes from the proxies'
#                                                # core (scripts/cpu_pauses.py, direct rounds); the
#                                                # direct rounds are captured too, and each path's
#                                                # share of every request's TTFT (the client's TTFT
#                                                # less the replica's own on the wire) is reported,
#                                                # free of the replica's lateness on the load core;
#                                                # scripts/overhead_tally.py OUT... counts, over many
#                                                # such runs, the rounds each proxy held the targets
#   STOPS=200:2 scripts/bench-overhead.sh        # a noisy machine, made repeatable: in each proxy
#                                                # round the proxy (every process) is stopped for
#                                                # 2 ms (SIGSTOP, then SIGCONT) at seeded Poisson
#                                                # instants 200 ms apart on average, the same
#                                                # instants in both proxies' rounds of a round
#                                                # (scripts/stop_process.py, on the load cores at
#                                                # real-time priority). STOPS=200:2:occupy takes
#                                                # the proxies' core instead (PIN=1), walking memory
#                                                # meanwhile: the caches as another tenant leaves them
#   QUIET=0.3 PIN=1 scripts/bench-overhead.sh    # a shared machine's quiet moments: each path of
#                                                # each round starts only once a QUIET_PROBE-second
#                                                # (10) probe of the proxies' core finds the machine
#                                                # taking at most 0.3% of it (scripts/quiet_gate.py),
#                                                # waiting up to QUIET_WAIT s (900) before it goes
#                                                # ahead regardless; the summary says what each path
#                                                # waited, and which went ahead noisy (MIX=1's mixed
#                                                # rounds are not gated)
#   LONG_EVERY=25 scripts/bench-overhead.sh      # every 25th request a LONG_TOKENS-token (100,000)
#                                                # prompt with a 1-token answer; TTFT split short/long
#   SERVE_BIN=/tmp/headroom-b scripts/bench-overhead.sh    # another build as the proxy (an A/B of
#                                                # builds: the replica and the load stay this one's).
#   Build B, copy it aside, then run: this script builds target/release/headroom itself, e.g.
#   cargo build --release --no-default-features && cp target/release/headroom /tmp/headroom-b
#   SERVE_PROFILE=release-lto scripts/bench-overhead.sh  # the proxy built with the release-lto
#                                                # profile (fat LTO, one codegen unit)
#
# With PIN=1 the system under test is the proxy (one worker per pinned core; nginx alike), and the
# replica runs beside the load generator: what a proxy adds is then its own work and hop, not
# run-queue waits behind the load generator and the replica.
set -euo pipefail
# SERVE_BIN is resolved where it was given, before the move to the repository's root.
if [ -n "${SERVE_BIN:-}" ]; then
  [ -x "$SERVE_BIN" ] || { echo "SERVE_BIN=$SERVE_BIN is not an executable" >&2; exit 1; }
  SERVE_BIN=$(realpath "$SERVE_BIN")
fi
cd "$(dirname "$0")/.."
RATE=${RATE:-200}
TOKENS=${TOKENS:-100}
DURATION=${DURATION:-30}
ROUNDS=${ROUNDS:-2}
WARMUP=${WARMUP:-5}
ITL_MS=${ITL_MS:-10}
TTFT_MS=${TTFT_MS:-20}
MODEL=${MODEL:-fixed}
case $MODEL in fixed | constant) ;; *) echo "MODEL must be fixed or constant, got $MODEL" >&2; exit 2 ;; esac
OUT=${OUT:-results/bench-overhead}
STOPS=${STOPS:-}
if [ -n "$STOPS" ] && { ! [[ $STOPS =~ ^[0-9]+(\.[0-9]+)?:[0-9]+(\.[0-9]+)?(:occupy)?$ ]] ||
  ! awk -F: '{ exit !($1 > 0 && $2 > 0) }' <<<"$STOPS"; }; then
  echo "STOPS must be EVERY_MS:STOP_MS or EVERY_MS:STOP_MS:occupy, both positive (e.g. 200:2), got $STOPS" >&2
  exit 2
fi
if [[ $STOPS == *:occupy ]] && [ "${PIN:-0}" != 1 ]; then
  echo "STOPS=...:occupy takes the proxies' core, so it needs PIN=1" >&2
  exit 2
fi
QUIET=${QUIET:-}
QUIET_PROBE=${QUIET_PROBE:-10}
QUIET_WAIT=${QUIET_WAIT:-900}
if [ -n "$QUIET" ]; then
  if [ "${PIN:-0}" != 1 ]; then
    echo "QUIET=$QUIET probes the proxies' core, so it needs PIN=1" >&2
    exit 2
  fi
  if ! awk -v q="$QUIET" -v p="$QUIET_PROBE" -v w="$QUIET_WAIT" \
    'BEGIN { exit !(q ~ /^[0-9]+(\.[0-9]+)?$/ && p ~ /^[0-9]+(\.[0-9]+)?$/ && p > 0 && w ~ /^[0-9]+(\.[0-9]+)?$/) }'; then
    echo "QUIET must be a percentage (e.g. 0.3), QUIET_PROBE positive seconds and QUIET_WAIT seconds; got $QUIET, $QUIET_PROBE, $QUIET_WAIT" >&2
    exit 2
  fi
fi
mkdir -p "$OUT"

if ! command -v nginx >/dev/null 2>&1 && [ ! -x /usr/sbin/nginx ]; then
  echo "installing nginx-light (the reference proxy)" >&2
  if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
  $SUDO apt-get update -qq && $SUDO apt-get install -y -qq nginx-light >/dev/null
fi
NGINX=$(command -v nginx || echo /usr/sbin/nginx)
WIRE=${WIRE:-0}
# The tools a run needs, checked before the builds rather than minutes after.
source scripts/tools.sh
[ "$WIRE" = 1 ] && need_tcpdump
if [ "${SYSCALLS:-0}" = 1 ] && ! perf stat -e raw_syscalls:sys_enter -- true >/dev/null 2>&1; then
  echo "SYSCALLS=1 needs perf with access to the syscall tracepoints (linux-perf; run as root)" >&2
  exit 2
fi
if [ "${SCHED:-0}" = 1 ] && { [ "${PIN:-0}" != 1 ] || ! perf sched record -q -o /dev/null -- true >/dev/null 2>&1; }; then
  echo "SCHED=1 needs PIN=1 (it traces the SUT's cores) and perf allowed to record scheduler events (linux-perf; run as root)" >&2
  exit 2
fi
if [ "${PROFILE:-0}" = 1 ] && ! perf record -q -g -o /dev/null -- true >/dev/null 2>&1; then
  echo "PROFILE=1 needs perf allowed to sample with call graphs (linux-perf; run as root)" >&2
  exit 2
fi

cargo build --release --locked -q
bin=target/release/headroom
if [ -n "${SERVE_BIN:-}" ] && [ "$SERVE_BIN" = "$(realpath "$bin")" ]; then
  echo "SERVE_BIN is target/release/headroom, which this script has just rebuilt: copy build B aside first" >&2
  exit 1
fi
# The proxy under test as `cargo build --release` makes it; SERVE_PROFILE=release-lto measures the
# whole program optimised as one unit (its first build takes ~9 min on 2 cores, then it is reused).
SERVE_PROFILE=${SERVE_PROFILE:-release}
if [ -z "${SERVE_BIN:-}" ]; then
  if [ "$SERVE_PROFILE" != release ]; then
    echo "building the proxy under test (cargo build --profile $SERVE_PROFILE)" >&2
    cargo build --profile "$SERVE_PROFILE" --locked -q --bin headroom
  fi
  SERVE_BIN=$(realpath "target/$SERVE_PROFILE/headroom")
fi

source scripts/bench-common.sh
# WIRE=1's packet capture reads on the load cores (pinned), never on the proxy's.
wire_on=()
[ "$PIN" = 1 ] && wire_on=(taskset -c "$LOAD_CPUS")

counted_syscalls="read recvfrom recvmsg write writev sendto sendmsg epoll_wait epoll_pwait epoll_ctl futex accept4 close fcntl setsockopt getsockopt getpeername getsockname ioctl mmap munmap madvise brk sched_yield clock_nanosleep nanosleep"
# RATE × DURATION requests (and some slack); with LONG_EVERY=N every Nth prompt is a long one,
# which the proxy must read and hash whole.
export LONG_EVERY=${LONG_EVERY:-0}
export LONG_TOKENS=${LONG_TOKENS:-100000}
export MIX_RATE=${MIX_RATE:-$RATE}
# A mixed round of an earlier run in OUT must not be reported as this run's.
rm -rf "$OUT"/mix-[0-9]*
most=$RATE
[ "${MIX:-0}" = 1 ] && [ "$MIX_RATE" -gt "$most" ] && most=$MIX_RATE
stream_trace "$OUT/trace.jsonl" "$((most * DURATION + most))" "$TOKENS" "$LONG_EVERY" "$LONG_TOKENS"

start_stream_replica "$MODEL" "$TTFT_MS" "$ITL_MS" "$OUT"
sim=$replica_url
sim_hostport=${sim#http://}

# Measurement is always on; the trace capture too (CAPTURE=0 turns it off), so the overhead
# measured is the proxy's whole request path.
capture_flags=()
[ "${CAPTURE:-1}" = 1 ] && capture_flags=(--capture "$OUT/capture.jsonl")
rm -f "$OUT/capture.jsonl"
# The long prompts are hashed whole (routing.max_hashed_tokens), as a fleet serving them would be set.
printf '[[backends]]\nurl = "%s"\n[routing]\nmax_hashed_tokens = %s\n' "$sim" \
  "$(( LONG_TOKENS > 131072 ? LONG_TOKENS : 131072 ))" >"$OUT/headroom.toml"
"${sut_on[@]}" "$SERVE_BIN" serve --config "$OUT/headroom.toml" --listen 127.0.0.1:0 --admin-listen 127.0.0.1:0 \
  "${capture_flags[@]}" \
  >"$OUT/headroom.url" 2>"$OUT/headroom.log" &
headroom_pid=$!
pids+=($headroom_pid)
wait_line "$OUT/headroom.log" "admin http"
headroom=$(grep -m1 http "$OUT/headroom.url")

nginx_port=$(free_port)
ndir=$(cd "$OUT" && pwd)/nginx
nginx_conf "$ndir" "$nginx_port" "$sim_hostport" "$sut_workers"
"${sut_on[@]}" "$NGINX" -p "$ndir" -c "$ndir/nginx.conf" -g 'daemon off;' 2>"$ndir/logs/stderr.log" &
nginx_pid=$!
pids+=($nginx_pid)
for _ in $(seq 100); do curl -sf "http://127.0.0.1:$nginx_port/health" >/dev/null && break; sleep 0.05; done
nginx="http://127.0.0.1:$nginx_port"

# The replica's own TTFT (from its arrival to its first token: vllm:time_to_first_token_seconds), sum
# and count. A hop's delay can also move a request to another engine step; the difference between
# the client's added TTFT and the engine's is the proxy's own share.
engine_ttft() {
  curl -sf "$sim/metrics" | awk '/^vllm:time_to_first_token_seconds_sum/ {s += $NF}
    /^vllm:time_to_first_token_seconds_count/ {c += $NF} END {print s + 0, c + 0}'
}

# path_of CONFIG: sets `url`, where CONFIG's load goes, and `watch`, the proxy process whose CPU is
# counted (none for direct).
# proxy_pids: the measured proxy's processes (nginx: its master and workers), comma-separated.
proxy_pids() { echo $watch $(pgrep -P "$watch") | tr ' ' ,; }

path_of() {
  case $1 in
    direct) url=$sim; watch="" ;;
    headroom) url=$headroom; watch=$headroom_pid ;;
    nginx) url=$nginx; watch=$nginx_pid ;;
  esac
}

# Every path is warmed before the first round with WARMUP seconds of the same load, unmeasured:
# without it each proxy's first round also carried its cold start (its first connections to the
# replica, its heap growing to its working size), which headroom, with more to allocate, paid
# for more (its worst round was the first in five of six runs, 2026-12-06).
if [ "$WARMUP" != 0 ]; then
  for config in direct headroom nginx; do
    path_of "$config"
    echo "== warm-up: $config, ${WARMUP} s" >&2
    "${load_on[@]}" $bin replay --trace "$OUT/trace.jsonl" --rate "$RATE" --duration "$WARMUP" \
      --target "$url" --seed 8 --out "$OUT/warmup-$config" >"$OUT/warmup-$config.txt" 2>&1 || true
  done
fi

for round in $(seq "$ROUNDS"); do
  for config in direct headroom nginx; do
    path_of "$config"
    dir="$OUT/$config-$round"
    rm -f "$dir/quiet.json" "$dir-quiet.json"
    if [ -n "$QUIET" ]; then
      echo "== round $round: $config waits until the machine leaves CPU $SUT_CPUS alone (at most $QUIET% taken)" >&2
      # 3: it gave up waiting, and the round goes ahead (the summary says so); anything else is an error.
      gate=0
      python3 scripts/quiet_gate.py --cpus "$SUT_CPUS" --below "$QUIET" --probe "$QUIET_PROBE" \
        --wait "$QUIET_WAIT" --json "$dir-quiet.json" || gate=$?
      [ "$gate" = 0 ] || [ "$gate" = 3 ] || exit "$gate"
    fi
    before=$([ -n "$watch" ] && cpu_split_of "$watch" || echo 0 0)
    engine_before=$(engine_ttft)
    echo "== round $round: $config ($url)" >&2
    counting=""
    if [ "${SYSCALLS:-0}" = 1 ] && [ -n "$watch" ]; then
      # Every thread of the proxy's processes (nginx: the master and its worker). raw_syscalls
      # counts all of them; the named ones say which.
      perf stat -x, -o "$dir-syscalls.csv" -e raw_syscalls:sys_enter,page-faults,context-switches \
        -e "$(printf 'syscalls:sys_enter_%s,' $counted_syscalls | sed 's/,$//')" \
        -p "$(proxy_pids)" 2>/dev/null &
      counting=$!
      sleep 0.5
    fi
    profiling=""
    if [ "${PROFILE:-0}" = 1 ] && [ -n "$watch" ]; then
      perf record -q -g -F 999 -o "$dir-perf.data" -p "$(proxy_pids)" \
        >/dev/null 2>&1 &
      profiling=$!
      sleep 0.5
    fi
    scheduling=""
    rm -f "$dir/sched.data" "$dir/sched.json" "$dir/sched.txt" "$dir-sched.data"
    if [ "${SCHED:-0}" = 1 ] && [ -n "$watch" ]; then
      # The SUT's cores only (SCHED=1 needs PIN=1); perf itself runs where this script does.
      perf sched record -q -C "$SUT_CPUS" -o "$dir-sched.data" >/dev/null 2>&1 &
      scheduling=$!
      sleep 0.5
    fi
    wiring=""
    pausing=""
    # Nothing of an earlier run in this OUT may be read as this round's.
    rm -f "$dir"/wire.* "$dir"/pauses.json "$dir-wire.pcap" "$dir-wire.log" "$dir-pauses.json"
    if [ "$WIRE" = 1 ] && [ -z "$watch" ] && [ "$PIN" = 1 ]; then
      # The proxies' core is idle while direct traffic runs: what the machine itself takes from
      # it (steal, interrupts) is measured there, the floor under either proxy's tails.
      taskset -c "$SUT_CPUS" python3 scripts/cpu_pauses.py "$DURATION" --json "$dir-pauses.json" >/dev/null &
      pausing=$!
    fi
    if [ "$WIRE" = 1 ]; then
      # Direct rounds are captured too (the replica's port alone: the url is the replica's), for
      # the replica's own TTFT on the wire.
      proxy_port=${url##*:}
      start_wire_capture "$dir-wire.pcap" "$dir-wire.log" "$proxy_port" "${sim_hostport##*:}"
      wiring=$wire_pid
    fi
    stopping=""
    rm -f "$dir-stops.json" "$dir/stops.json" "$dir/drain.json" "$dir/drain.txt" "$dir/events.csv"
    if [ -n "$STOPS" ] && [ -n "$watch" ]; then
      # Seeded by the round: both proxies are stopped at the same instants of their round. The
      # stopper runs at real-time priority where it can, so its stops last what they are asked
      # to beside a load generator at a high priority.
      IFS=: read -r stop_every stop_ms stop_how <<<"$STOPS"
      stop_rt=()
      if [ "$stop_how" = occupy ]; then
        # It sets its own core and priority, and fails clearly if it cannot.
        stop_on=(--occupy "${SUT_CPUS%%[,-]*}")
      else
        stop_on=(--pids "$(proxy_pids)")
        if chrt -f 50 true 2>/dev/null; then stop_rt=(chrt -f 50); fi
      fi
      "${wire_on[@]}" "${stop_rt[@]}" python3 scripts/stop_process.py "$DURATION" "${stop_on[@]}" \
        --every-ms "$stop_every" --stop-ms "$stop_ms" --seed "$round" --json "$dir-stops.json" >/dev/null &
      stopping=$!
      # Interrupted, the script's cleanup stops the stopper, which lets the proxy go first.
      pids+=($stopping)
    fi
    "${load_on[@]}" $bin replay --trace "$OUT/trace.jsonl" --rate "$RATE" --duration "$DURATION" --target "$url" \
      --seed 7 --hardware "headroom sim, $MODEL ${TTFT_MS} ms TTFT / ${ITL_MS} ms ITL; $config" \
      --out "$dir" >"$dir.txt" 2>"$dir.log" || true
    after=$([ -n "$watch" ] && cpu_split_of "$watch" || echo 0 0)
    if [ -n "$scheduling" ]; then
      kill -INT "$scheduling"; wait "$scheduling" || true
      mv "$dir-sched.data" "$dir/sched.data"
      python3 scripts/sched_preemptions.py "$dir/sched.data" --pids "$(proxy_pids)" \
        --json "$dir/sched.json" >"$dir/sched.txt" 2>&1 || cat "$dir/sched.txt" >&2
    fi
    if [ -n "$counting" ]; then kill -INT "$counting"; wait "$counting" || true; mv "$dir-syscalls.csv" "$dir/syscalls.csv"; fi
    if [ -n "$pausing" ]; then wait "$pausing" || true; mv "$dir-pauses.json" "$dir/pauses.json"; fi
    # The replay makes its directory when it ends; one that failed early made none.
    if [ -f "$dir-quiet.json" ]; then mkdir -p "$dir" && mv "$dir-quiet.json" "$dir/quiet.json"; fi
    if [ -n "$stopping" ]; then wait "$stopping" || true; mv "$dir-stops.json" "$dir/stops.json" 2>/dev/null || true; fi
    if [ -n "$wiring" ]; then
      # The last packets are still in the capture's ring buffer when the replay ends.
      sleep 1
      kill -INT "$wiring"; wait "$wiring" || true
      mv "$dir-wire.pcap" "$dir/wire.pcap"; mv "$dir-wire.log" "$dir/wire.log"
      dropped=$(sed -n 's/^\([0-9]*\) packets dropped by kernel.*/\1/p' "$dir/wire.log")
      legs=(--proxy-port "$proxy_port")
      [ -z "$watch" ] && legs=(--direct)
      every_event=()
      [ -f "$dir/stops.json" ] && every_event=(--events "$dir/events.csv")
      python3 scripts/wire_latency.py "$dir/wire.pcap" "${legs[@]}" --replica-port "${sim_hostport##*:}" \
        --dropped "${dropped:-0}" --json "$dir/wire.json" --per-request "$dir/wire_requests.csv" \
        "${every_event[@]}" >"$dir/wire.txt" 2>&1 || {
        cat "$dir/wire.txt" >&2
        echo "the capture is kept for a look: $dir/wire.pcap" >&2
        KEEP_PCAP=1
      }
      [ "${KEEP_PCAP:-0}" = 1 ] || rm -f "$dir/wire.pcap"
      if [ -f "$dir/events.csv" ]; then
        # STOPS with WIRE=1: the proxy's hold of each event by the time since a stop began.
        python3 scripts/stop_drain.py "$dir/events.csv" "$dir/stops.json" --json "$dir/drain.json" \
          >"$dir/drain.txt" 2>&1 || cat "$dir/drain.txt" >&2
        [ "${KEEP_PCAP:-0}" = 1 ] || rm -f "$dir/events.csv"
      fi
    fi
    if [ -n "$profiling" ]; then
      kill -INT "$profiling"; wait "$profiling" || true
      mv "$dir-perf.data" "$dir/perf.data"
      # Inclusive shares (each system call's whole kernel path) and self shares (user against kernel).
      perf report -i "$dir/perf.data" --children --sort sym -g none --stdio >"$dir/perf-children.txt" 2>/dev/null || true
      perf report -i "$dir/perf.data" --no-children --sort sym --stdio >"$dir/perf-self.txt" 2>/dev/null || true
    fi
    read -r user0 system0 <<<"$before"
    read -r user1 system1 <<<"$after"
    echo "$(( user1 + system1 - user0 - system0 ))" >"$dir/cpu_ticks"
    echo "$(( system1 - system0 ))" >"$dir/cpu_system_ticks"
    echo "$engine_before $(engine_ttft)" >"$dir/engine_ttft"
  done
done

# MIX=1: ROUNDS more rounds in which the three paths take turns request by request (the load
# generator's targets round-robin: direct, headroom, nginx), MIX_RATE req/s in all (default RATE:
# a third of it per path; 3 × RATE keeps RATE per path where the load generator's core can
# take it), so that what each proxy adds to TTFT is measured against direct
# requests of the same moments, free of the drift between rounds. The proxies share their core in
# these rounds (each one's CPU is still its own, from /proc).
if [ "${MIX:-0}" = 1 ]; then
  for round in $(seq "$ROUNDS"); do
    dir="$OUT/mix-$round"
    echo "== mixed round $round: direct, headroom and nginx in turn at $MIX_RATE req/s" >&2
    hb=$(cpu_split_of "$headroom_pid") nb=$(cpu_split_of "$nginx_pid")
    "${load_on[@]}" $bin replay --trace "$OUT/trace.jsonl" --rate "$MIX_RATE" --duration "$DURATION" \
      --target "$sim,$headroom,$nginx" --seed 7 \
      --hardware "headroom sim, $MODEL ${TTFT_MS} ms TTFT / ${ITL_MS} ms ITL; direct, headroom, nginx in turn" \
      --out "$dir" >"$dir.txt" 2>"$dir.log" || true
    echo "$hb $(cpu_split_of "$headroom_pid")" >"$dir/headroom_cpu"
    echo "$nb $(cpu_split_of "$nginx_pid")" >"$dir/nginx_cpu"
    printf '%s\n%s\n%s\n' "$sim" "$headroom" "$nginx" >"$dir/paths"
  done
fi

# Where headroom's added time goes: each round's requests joined with its capture by x-request-id
# (the client's TTFT against the proxy's own, arrival at the proxy to the first output event handed
# to the client; the difference is the two legs between client and proxy).
if [ -s "$OUT/capture.jsonl" ]; then
  for round in $(seq "$ROUNDS"); do
    $bin report agreement --result "$OUT/headroom-$round/result.json" --capture "$OUT/capture.jsonl" \
      >"$OUT/headroom-$round/agreement.txt" 2>&1 || true
  done
fi

build="; warm-up ${WARMUP} s per path; headroom build: ${SERVE_BIN#"$PWD"/}"
python3 - "$OUT" "$ROUNDS" "$(getconf CLK_TCK)" "$RATE" "$TOKENS" "$DURATION" "$placement$build" "$MODEL $TTFT_MS ms TTFT / $ITL_MS ms ITL" <<'PY'
import json, statistics, sys
out, rounds, hz = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
rate, tokens, duration = sys.argv[4], sys.argv[5], sys.argv[6]
def load(config):
    ttft, itl, chunks, cpu, system, failed = {}, {}, 0, 0, 0, 0
    engine_s, engine_n = 0.0, 0
    runs = []
    for r in range(1, rounds + 1):
        d = json.load(open(f"{out}/{config}-{r}/result.json"))
        s = d["summary"]
        runs.append(s)
        # Each completed stream relays one event per token and [DONE].
        chunks += sum((x["completion_tokens"] or 0) + 1 for x in d["requests"] if not x.get("error_kind"))
        cpu += int(open(f"{out}/{config}-{r}/cpu_ticks").read())
        system += int(open(f"{out}/{config}-{r}/cpu_system_ticks").read())
        s0, n0, s1, n1 = map(float, open(f"{out}/{config}-{r}/engine_ttft").read().split())
        engine_s, engine_n = engine_s + s1 - s0, engine_n + n1 - n0
        failed += s["failed"]
    # The median over rounds: one round disturbed by something else on the machine (a daemon, the
    # hypervisor) moves a mean of p99s by milliseconds and a median hardly at all.
    median = lambda k, p: statistics.median(s[k][p] for s in runs)
    return {"ttft_p50": median("ttft", "p50_ms"), "ttft_p99": median("ttft", "p99_ms"),
            "ttft_mean": median("ttft", "mean_ms"), "engine_ttft_mean": 1e3 * engine_s / max(engine_n, 1),
            "itl_p50": median("itl", "p50_ms"), "itl_p99": median("itl", "p99_ms"),
            "rounds": [(s["ttft"]["p50_ms"], s["ttft"]["p99_ms"], s["itl"]["p99_ms"]) for s in runs],
            "late_p99": [s["send_lateness"]["p99_ms"] for s in runs],
            "chunks": chunks, "cpu_s": cpu / hz, "system_s": system / hz, "failed": failed}
res = {c: load(c) for c in ("direct", "headroom", "nginx")}
d = res["direct"]
placement = sys.argv[7]
import os
every = int(os.environ.get("LONG_EVERY", "0"))
longs = f", 1 request in {every} a {os.environ['LONG_TOKENS']}-token prompt with a 1-token answer" if every else ""
lines = [f"load: {rate} req/s (Poisson), {tokens}-token streams{longs}, {duration} s × {rounds} rounds per configuration, interleaved; replica: {sys.argv[8]}; {placement}",
         "percentiles: the median over rounds of each round's value", "",
         "| path | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms | added TTFT p50 / p99 ms | added ITL p99 ms | proxy CPU µs per chunk | of it in the kernel | failed |",
         "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
for c, r in res.items():
    added = "" if c == "direct" else f"{r['ttft_p50']-d['ttft_p50']:+.2f} / {r['ttft_p99']-d['ttft_p99']:+.2f}"
    added_itl = "" if c == "direct" else f"{r['itl_p99']-d['itl_p99']:+.2f}"
    cpu = "" if c == "direct" else f"{1e6*r['cpu_s']/max(r['chunks'],1):.2f}"
    kernel = "" if c == "direct" else f"{1e6*r['system_s']/max(r['chunks'],1):.2f}"
    lines.append(f"| {c} | {r['ttft_p50']:.2f} | {r['ttft_p99']:.2f} | {r['itl_p50']:.2f} | {r['itl_p99']:.2f} | {added} | {added_itl} | {cpu} | {kernel} | {r['failed']} |")
lines += ["", "Where the added mean TTFT goes: the replica's own TTFT (arrival to first token) moves when a hop's",
          "delay puts a request into another engine step; the rest is the proxy's hop.", "",
          "| path | client TTFT mean ms | replica TTFT mean ms | added at the client | added at the replica | the hop's own |",
          "|---|---:|---:|---:|---:|---:|"]
for c, r in res.items():
    if c == "direct":
        lines.append(f"| {c} | {r['ttft_mean']:.2f} | {r['engine_ttft_mean']:.2f} | | | |")
        continue
    at_client, at_engine = r["ttft_mean"] - d["ttft_mean"], r["engine_ttft_mean"] - d["engine_ttft_mean"]
    lines.append(f"| {c} | {r['ttft_mean']:.2f} | {r['engine_ttft_mean']:.2f} | {at_client:+.2f} | {at_engine:+.2f} | {at_client - at_engine:+.2f} |")
lines += ["", "Each round, TTFT p50 / TTFT p99 / ITL p99 ms (the load generator's send lateness p99):", ""]
for c, r in res.items():
    lines.append(f"- {c}: " + "; ".join(f"{a:.2f} / {b:.2f} / {i:.2f} (late {late:.2f})"
                                         for (a, b, i), late in zip(r["rounds"], r["late_p99"])))
# A load generator that fell behind its schedule sends bunched requests: the tails then measure its
# queue, not the proxies (scripts/bench-loadgen.sh measures what it can keep up with).
behind = [f"{c} round {k}: {late:.1f} ms" for c, r in res.items() for k, late in enumerate(r["late_p99"], 1) if late > 5.0]
if behind:
    lines += ["", "WARNING: the load generator sent late (send lateness p99 over 5 ms) in " + "; ".join(behind)
              + ": those rounds' tails measure its queue, not the proxies."]
gaps = []
for r in range(1, rounds + 1):
    try:
        gaps += [l.strip() for l in open(f"{out}/headroom-{r}/agreement.txt") if l.startswith("|client TTFT")]
    except OSError:
        pass
if gaps:
    lines += ["", "|client TTFT - headroom's own TTFT (from its capture)| per request, each round:", ""]
    lines += [f"- round {i}: {g.split(': ', 1)[-1]}" for i, g in enumerate(gaps, 1)]
def per_round(name, paths=("headroom", "nginx")):
    """{path: [(round, the JSON its round wrote as `name`)]}, of the rounds that wrote one."""
    found = {}
    for c in paths:
        for r in range(1, rounds + 1):
            try:
                data = json.load(open(f"{out}/{c}-{r}/{name}"))
            except (OSError, ValueError):
                continue
            found.setdefault(c, []).append((r, data))
    return found
# WIRE=1: what each proxy itself held each request and each event, from its rounds' packet captures.
wire = {c: [w for _, w in rows] for c, rows in per_round("wire.json").items()}
if wire:
    def at(rows, k, p):
        values = [w[k][p] for w in rows if w[k]["n"]]
        return statistics.median(values) if values else float("nan")
    lines += ["", "Read off the wire (WIRE=1: each proxy round's loopback packets, stamped by the kernel as each is sent;",
              "scripts/wire_latency.py): how long the proxy itself held each request (its last byte in from the client",
              "to its last byte out to the replica) and each SSE event (from the replica to the client), µs, median",
              "over rounds. The TTFT share is the request's plus the first output event's: what the proxy adds to TTFT",
              "before any wake-up of the client.", "",
              "The last column: of the slowest 1% of events, the share whose time in the proxy spans its forwarding",
              "of some request (its request path ran on the core meanwhile), against the share holds as long would",
              "span by chance (forwards a Poisson stream at the round's rate).", "",
              "| proxy | request p50 / p99 | first event p50 / p99 | TTFT share p50 / p99 / p99.9 | every event p50 / p99 / p99.9 | events | dropped packets, gaps | slowest 1% spanning a forward / by chance |",
              "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for c, rows in wire.items():
        lines.append(f"| {c} | {at(rows, 'request_us', 'p50'):.0f} / {at(rows, 'request_us', 'p99'):.0f} | "
                     f"{at(rows, 'first_event_us', 'p50'):.0f} / {at(rows, 'first_event_us', 'p99'):.0f} | "
                     f"{at(rows, 'ttft_share_us', 'p50'):.0f} / {at(rows, 'ttft_share_us', 'p99'):.0f} / {at(rows, 'ttft_share_us', 'p999'):.0f} | "
                     f"{at(rows, 'event_us', 'p50'):.0f} / {at(rows, 'event_us', 'p99'):.0f} / {at(rows, 'event_us', 'p999'):.0f} | "
                     f"{sum(w['event_us']['n'] for w in rows)} | {sum(w['dropped'] for w in rows)}, {sum(w['broken_flows'] for w in rows)} | "
                     f"{100 * statistics.median(w['slowest_1pct_spanning_a_forward'] for w in rows):.0f}% / "
                     f"{100 * statistics.median(w.get('slowest_1pct_by_chance', float('nan')) for w in rows):.0f}% |")
    pauses = []
    for r in range(1, rounds + 1):
        try:
            pauses.append(json.load(open(f"{out}/direct-{r}/pauses.json")))
        except (OSError, ValueError):
            pass
    if pauses:
        lines += ["", "What the machine itself took from the proxies' core (scripts/cpu_pauses.py spinning on it during",
                  "the direct rounds, when no proxy ran there), each round: " + "; ".join(
                      f"{p['pauses']} pauses over {p['min_us']:.0f} µs ({p['over_500us']} over 0.5 ms, {p['over_1ms']} over 1 ms), "
                      f"{100 * p['lost_fraction']:.2f}% of the time, longest {p['max_ms']:.2f} ms" for p in pauses)]
    # A proxy (or the machine under it) that stops reading for longer than the sender's tail-loss
    # probe timeout (two round trips and a tick) draws segments sent again although none was lost:
    # many of them in a round mark a long stall, whichever proxy was measured.
    lines += ["", "Each round, TTFT share p50 / p99 and every event p50 / p99 µs, the longest an event was "
              "held, and the segments sent again (tail-loss probes: a reader that stopped reading):", ""]
    for c, rows in wire.items():
        lines.append(f"- {c}: " + "; ".join(f"{w['ttft_share_us']['p50']:.0f} / {w['ttft_share_us']['p99']:.0f} and "
                                             f"{w['event_us']['p50']:.0f} / {w['event_us']['p99']:.0f}, "
                                             f"{w['event_us']['max'] / 1000:.1f} ms, {w.get('resent_segments', 0)} resent"
                                             for w in rows if w["event_us"]["n"] and w["ttft_share_us"]["n"]))
def pct(xs, q):
    xs = sorted(xs)
    if not xs:
        return float("nan")
    k = (len(xs) - 1) * q
    f = int(k)
    return xs[f] + (xs[min(f + 1, len(xs) - 1)] - xs[f]) * (k - f)
# WIRE=1: each request's TTFT at the client less the replica's own TTFT on the wire for the same
# request (by x-request-id): what the path added (the client's sends and wake-ups, and a proxy's
# hop), free of the replica's own lateness, which on the shared load core moves every path's p99
# by milliseconds from round to round.
import csv
def path_shares(config, r):
    try:
        with open(f"{out}/{config}-{r}/wire_requests.csv") as f:
            replica = {row["request_id"]: float(row["replica_ttft_us"]) / 1e3
                       for row in csv.DictReader(f) if row["replica_ttft_us"]}
        with open(f"{out}/{config}-{r}/requests.csv") as f:
            client = {row["request_id"]: float(row["ttft_ms"]) for row in csv.DictReader(f)
                      if row["status"] == "200" and row["ttft_ms"] and row["warmup"] != "true"}
    except (OSError, ValueError, KeyError):
        return []
    return [client[k] - replica[k] for k in client.keys() & replica.keys()]
shares = {c: [x for x in (path_shares(c, r) for r in range(1, rounds + 1)) if x]
          for c in ("direct", "headroom", "nginx")}
if shares["direct"] and (shares["headroom"] or shares["nginx"]):
    def share_at(c, q):
        return statistics.median(pct(x, q) for x in shares[c])
    lines += ["", "The path's share of each request's TTFT (WIRE=1): the client's TTFT less the replica's own on the",
              "wire for the same request (its request's last byte in to its first output event out), so the",
              "replica's lateness on the shared load core, which moves every path's TTFT p99 by milliseconds",
              "between rounds, cancels out; what is left is the client's own sends and wake-ups and, through a",
              "proxy, its hop. Percentiles of each round's requests, median over rounds; added: against direct.", "",
              "| path | requests joined | share p50 / p99 ms | added p50 / p99 ms | each round p50 / p99 ms |",
              "|---|---:|---:|---:|---|"]
    for c in ("direct", "headroom", "nginx"):
        if not shares[c]:
            continue
        added = "" if c == "direct" else \
            f"{share_at(c, 0.5) - share_at('direct', 0.5):+.2f} / {share_at(c, 0.99) - share_at('direct', 0.99):+.2f}"
        lines.append(f"| {c} | {sum(map(len, shares[c]))} | {share_at(c, 0.5):.2f} / {share_at(c, 0.99):.2f} | {added} | "
                     + "; ".join(f"{pct(x, 0.5):.2f} / {pct(x, 0.99):.2f}" for x in shares[c]) + " |")
# SCHED=1: how long each proxy's threads sat runnable but not running on their core, and what ran.
sched = per_round("sched.json")
if sched:
    lines += ["", "The scheduler on the proxies' core (SCHED=1, perf sched; scripts/sched_preemptions.py): how long the",
              "proxy's busiest thread (its worker) was runnable but not running (preempted, or woken and not yet on",
              "the core), each round, and what ran on the core meanwhile (steal and the wake-up itself show as",
              "nothing); then all of the proxy's threads. sched.txt in each round's directory has every thread.", "",
              "The worker's runs: from a wake-up to its next wait (what arrives meanwhile waits for the rest of it).", "",
              "| proxy | round | worker | its waits | ms | behind, ms | its runs p50 / p99 / p99.9 ms | over 0.5 ms | all threads: waits | ms | over 0.5 ms | longest ms |",
              "|---|---:|---|---:|---:|---|---:|---:|---:|---:|---:|---:|"]
    for c, rows in sched.items():
        for k, w in rows:
            if not w.get("threads"):
                continue
            name, t = next(iter(w["threads"].items()))
            behind = ", ".join(f"{n} {b['ms']:.1f}" for n, b in list(t["takers"].items())[:4])
            q = t["run_ms"]
            lines.append(f"| {c} | {k} | {name} | {t['waits']} | {t['wait_ms']:.1f} | {behind} | "
                         f"{q['p50']:.2f} / {q['p99']:.2f} / {q['p99.9']:.2f} | {t['long_runs']} | {w['waits']} | "
                         f"{w['wait_ms']:.1f} | {w['long_waits']} | {w['max_wait_ms']:.2f} |")
# The mixed rounds (MIX=1): each path's TTFT percentiles over its own turns, each round, and what
# each proxy adds to the direct turns of the same round.
mixed = []
for r in range(1, rounds + 1):
    try:
        d = json.load(open(f"{out}/mix-{r}/result.json"))
        paths = open(f"{out}/mix-{r}/paths").read().split()
    except OSError:
        break
    by = {name: [x for x in d["requests"] if x["target"].startswith(url + "/") and not x.get("warmup")]
          for name, url in zip(("direct", "headroom", "nginx"), paths)}
    ok = {k: [x for x in v if not x.get("error_kind") and x.get("ttft_ms") is not None] for k, v in by.items()}
    row = {k: (pct([x["ttft_ms"] for x in v], 0.5), pct([x["ttft_ms"] for x in v], 0.99), len(v),
               len(by[k]) - len(v)) for k, v in ok.items()}
    cpu = {}
    for proxy in ("headroom", "nginx"):
        u0, s0, u1, s1 = map(int, open(f"{out}/mix-{r}/{proxy}_cpu").read().split())
        chunks = sum((x["completion_tokens"] or 0) + 1 for x in ok[proxy])
        cpu[proxy] = 1e6 * (u1 + s1 - u0 - s0) / int(sys.argv[3]) / max(chunks, 1)
    mixed.append((row, cpu, d["summary"]["send_lateness"]["p99_ms"]))
if mixed:
    lines += ["", f"Mixed rounds (MIX=1): the three paths in turn, request by request, {os.environ.get('MIX_RATE', '')} req/s in all;",
              "TTFT percentiles over each path's own requests (linear interpolation), added = proxy − direct",
              "of the same round:", "",
              "| round | direct TTFT p50 / p99 ms | headroom added p50 / p99 ms | nginx added p50 / p99 ms | headroom / nginx CPU µs per chunk | requests per path | failed | send lateness p99 ms |",
              "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for i, (row, cpu, late) in enumerate(mixed, 1):
        dp50, dp99 = row["direct"][0], row["direct"][1]
        add = lambda p: f"{row[p][0] - dp50:+.2f} / {row[p][1] - dp99:+.2f}"
        lines.append(f"| {i} | {dp50:.2f} / {dp99:.2f} | {add('headroom')} | {add('nginx')} | "
                     f"{cpu['headroom']:.2f} / {cpu['nginx']:.2f} ({cpu['headroom'] / max(cpu['nginx'], 1e-9):.2f}×) | "
                     f"{row['direct'][2]}, {row['headroom'][2]}, {row['nginx'][2]} | "
                     f"{row['direct'][3] + row['headroom'][3] + row['nginx'][3]} | {late:.2f} |")
# System calls per relayed chunk by kind (SYSCALLS=1): perf stat's CSV rows are count,unit,event,...
def syscalls(config):
    counts = {}
    for r in range(1, rounds + 1):
        try:
            rows = open(f"{out}/{config}-{r}/syscalls.csv").read().splitlines()
        except OSError:
            return None
        for row in rows:
            f = row.split(",")
            if len(f) > 2 and f[0].strip().isdigit():
                name = f[2].replace("syscalls:sys_enter_", "").replace("raw_syscalls:sys_enter", "all system calls")
                counts[name] = counts.get(name, 0) + int(f[0])
    return counts
calls = {c: syscalls(c) for c in ("headroom", "nginx")}
if all(calls.values()):
    names = sorted({k for v in calls.values() for k, n in v.items() if n}, key=lambda k: (k.startswith("all") is False, "-" not in k, k))
    per = lambda c, k: calls[c].get(k, 0) / max(res[c]["chunks"], 1)
    lines += ["", "System calls, page faults and context switches per relayed chunk (perf stat on every thread",
              "of each proxy):", "", "| event | headroom | nginx |", "|---|---:|---:|"]
    lines += [f"| {k} | {per('headroom', k):.3f} | {per('nginx', k):.3f} |" for k in names]
# Where each proxy's CPU per chunk goes (PROFILE=1): the sampled shares of user space and of each
# system call's kernel path, times the CPU per chunk measured from /proc.
import re
SYSCALL_PATHS = ("writev", "recvfrom", "sendto", "epoll_wait", "futex", "write", "read", "clock_nanosleep", "accept4")
def profile(config):
    user = kernel = 0.0
    calls = {}
    for r in range(1, rounds + 1):
        try:
            selfs = open(f"{out}/{config}-{r}/perf-self.txt").read().splitlines()
            children = open(f"{out}/{config}-{r}/perf-children.txt").read().splitlines()
        except OSError:
            return None
        for l in selfs:
            m = re.match(r"\s+([\d.]+)%\s+\[(.)\]", l)
            if m:
                if m.group(2) == "k":
                    kernel += float(m.group(1)) / rounds
                else:
                    user += float(m.group(1)) / rounds
        # A call's entry point can be inlined or tail-called away (writev's shows as do_writev):
        # its share is the largest of the frames that name it.
        found = {}
        for l in children:
            m = re.match(r"\s+([\d.]+)%\s+[\d.]+%\s+\[k\] (?:__x64_sys_|__sys_|do_)(\w+)$", l.rstrip())
            if m and m.group(2) in SYSCALL_PATHS:
                found[m.group(2)] = max(found.get(m.group(2), 0.0), float(m.group(1)))
        for k, v in found.items():
            calls[k] = calls.get(k, 0.0) + v / rounds
    return user, kernel, calls
prof = {c: profile(c) for c in ("headroom", "nginx")}
if all(prof.values()):
    per_chunk = {c: 1e6 * res[c]["cpu_s"] / max(res[c]["chunks"], 1) for c in prof}
    us = lambda c, share: per_chunk[c] * share / max(prof[c][0] + prof[c][1], 1e-9)
    top = sorted({k for c in prof for k, v in prof[c][2].items() if v >= 1.0},
                 key=lambda k: -max(prof[c][2].get(k, 0) for c in prof))
    lines += ["", "Where the CPU per chunk goes (perf record -g at 999 Hz on every thread of each proxy; µs per",
              "relayed chunk: each part's share of the samples times the CPU per chunk above):", "",
              "| part | headroom µs | nginx µs |", "|---|---:|---:|",
              f"| user space | {us('headroom', prof['headroom'][0]):.2f} | {us('nginx', prof['nginx'][0]):.2f} |",
              f"| kernel | {us('headroom', prof['headroom'][1]):.2f} | {us('nginx', prof['nginx'][1]):.2f} |"]
    for k in top:
        lines.append(f"| kernel: {k} (its whole path) | {us('headroom', prof['headroom'][2].get(k, 0)):.2f} | {us('nginx', prof['nginx'][2].get(k, 0)):.2f} |")
# QUIET: what each path of each round waited for the machine to leave the proxies' core alone.
quiet = per_round("quiet.json", ("direct", "headroom", "nginx"))
if quiet:
    q = next(iter(quiet.values()))[0][1]
    lines += ["", f"Quiet gate (QUIET={q['below_pct']:g}; scripts/quiet_gate.py): each path of each round started once a "
              f"{q['probe_s']:g} s probe of the proxies' core",
              f"found the machine taking at most {q['below_pct']:g}% of it, or after {q['wait_s']:g} s regardless. "
              "The wait and the last probe, each round:", ""]
    for c, rows in quiet.items():
        lines.append(f"- {c}: " + "; ".join(
            f"round {r} {x['waited_s']:.0f} s, {x['lost_pct'][-1]:.2f}%" + ("" if x["passed"] else " (went ahead noisy)")
            for r, x in rows))
# STOPS: what was injected into each proxy round, and (WIRE=1) how each proxy recovered.
stops = {c: [x for _, x in rows] for c, rows in per_round("stops.json").items()}
if stops:
    how = next(iter(stops.values()))[0].get("how", "stop")
    lines += ["", f"Injected into each proxy round (STOPS, {how}; scripts/stop_process.py, the same seeded",
              "instants for both proxies), each round: " + "; ".join(
                  f"{c} " + ", ".join(f"{x['stops']} × {x['stop_ms']:g} ms ({100 * x['stopped_frac']:.2f}% of the time)" for x in v)
                  for c, v in stops.items())]
    drains = {c: [d for _, d in rows] for c, rows in per_round("drain.json").items()}
    if len(drains) == 2:
        # Bins alike in every round (the same window): the median over rounds of each bin's mean.
        med = lambda xs: statistics.median(xs) if xs else float("nan")
        bins = drains["headroom"][0]["bins"]
        lines += ["", "How each proxy recovers from a stop (WIRE=1; scripts/stop_drain.py): the mean hold of the events",
                  "that came in at each time since a stop began, µs, median over rounds; then the hold away from",
                  "every stop's window and when the hold was back within 1.5× its mean, each round:", "",
                  "| ms since the stop began | " + " | ".join(f"{b['from_ms']:g}–{b['to_ms']:g}" for b in bins) + " |",
                  "|---|" + "---:|" * len(bins)]
        for c, ds in drains.items():
            lines.append(f"| {c} | " + " | ".join(
                f"{med([d['bins'][i]['mean_us'] for d in ds if d['bins'][i]['mean_us'] is not None]):.0f}"
                for i in range(len(bins))) + " |")
        lines.append("")
        for c, ds in drains.items():
            fmt = lambda v: "-" if v is None else f"{v:.0f}"
            lines.append(f"- {c}: " + "; ".join(
                f"away p50 / p99 {fmt(d['away']['p50_us'])} / {fmt(d['away']['p99_us'])} µs, back at "
                + ("-" if d["recovered_ms"] is None else f"{d['recovered_ms']:g} ms")
                for d in ds))
h, n = res["headroom"], res["nginx"]
ratio = (h["cpu_s"] / max(h["chunks"], 1)) / max(n["cpu_s"] / max(n["chunks"], 1), 1e-12)
lines += ["", f"headroom CPU per chunk / nginx's: {ratio:.2f}×"]
if every:
    # The short requests (what a long prompt passing through does to everyone else) and the long
    # ones (what the proxy's reading and hashing of it costs itself), TTFT from each request's row.
    def split(config):
        per_round = []
        for r in range(1, rounds + 1):
            rows = [x for x in json.load(open(f"{out}/{config}-{r}/result.json"))["requests"]
                    if not x.get("error_kind") and x.get("ttft_ms") is not None]
            short = [x["ttft_ms"] for x in rows if x["input_length"] < 1000]
            long_ = [x["ttft_ms"] for x in rows if x["input_length"] >= 1000]
            per_round.append((pct(short, .5), pct(short, .99), pct(long_, .5), pct(long_, .99)))
        return [statistics.median(v[i] for v in per_round) for i in range(4)]
    parts = {c: split(c) for c in res}
    ds = parts["direct"]
    lines += ["", "TTFT of the short and the long requests apart (median over rounds), and what each proxy adds:", "",
              "| path | short p50 ms | short p99 ms | long p50 ms | long p99 ms | added short p50 / p99 | added long p50 / p99 |",
              "|---|---:|---:|---:|---:|---:|---:|"]
    for c, v in parts.items():
        added = "" if c == "direct" else f"{v[0]-ds[0]:+.2f} / {v[1]-ds[1]:+.2f} | {v[2]-ds[2]:+.2f} / {v[3]-ds[3]:+.2f}"
        lines.append(f"| {c} | {v[0]:.2f} | {v[1]:.2f} | {v[2]:.2f} | {v[3]:.2f} | {added or ' | '} |")
text = "\n".join(lines)
open(f"{out}/summary.md", "w").write(text + "\n")
print(text)
PY
