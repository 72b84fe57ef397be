#!/usr/bin/env bash
# The load generator's own cost: `headroom replay` sending the overhead benchmark's load (Poisson
# RATE req/s, seed 7, 64-token prompts, TOKENS-token streams) straight to one simulated replica
# with a fixed per-request clock (first token TTFT_MS after arrival, then one every ITL_MS), with
# the replica and the load generator sharing the load cores as they do in bench-overhead.sh. Per
# build and round: the load generator's CPU (user + system) per chunk and as a share of a core, the replica's CPU beside it, how late sends went out against their schedule, and the
# TTFT / ITL it measured. A load generator that takes its core from the replica beside it, or sends
# late, measures itself; this says how far from that a rate is. Loopback only; bounded by DURATION.
#
#   scripts/bench-loadgen.sh                              # RATE=200 TOKENS=100 DURATION=20 ROUNDS=2
#   REPLAY_B=/tmp/headroom-b scripts/bench-loadgen.sh     # an A/B of builds as the load generator,
#                                                         # rounds alternating (the replica is A's)
#   PIN=1 NOIDLE=1 LOAD_NICE=-15 ...                      # as in bench-overhead.sh (bench-common.sh)
set -euo pipefail
if [ -n "${REPLAY_B:-}" ]; then
  [ -x "$REPLAY_B" ] || { echo "REPLAY_B=$REPLAY_B is not an executable" >&2; exit 1; }
  REPLAY_B=$(realpath "$REPLAY_B")
fi
cd "$(dirname "$0")/.."
RATE=${RATE:-200}
TOKENS=${TOKENS:-100}
DURATION=${DURATION:-20}
ROUNDS=${ROUNDS:-2}
TTFT_MS=${TTFT_MS:-20}
ITL_MS=${ITL_MS:-10}
OUT=${OUT:-results/bench-loadgen}
mkdir -p "$OUT"
cargo build --release --locked -q
bin=target/release/headroom

source scripts/bench-common.sh

stream_trace "$OUT/trace.jsonl" "$((RATE * DURATION + RATE))" "$TOKENS"
start_stream_replica fixed "$TTFT_MS" "$ITL_MS" "$OUT"
sim=$replica_url

builds=(a)
[ -n "${REPLAY_B:-}" ] && builds+=(b)
for round in $(seq "$ROUNDS"); do
  for build in "${builds[@]}"; do
    replay=$bin
    [ "$build" = b ] && replay=$REPLAY_B
    dir="$OUT/$build-$round"
    rm -rf "$dir"
    mkdir -p "$dir"
    echo "== round $round: build $build ($replay)" >&2
    sim_before=$(cpu_of "$replica_pid")
    start=$(date +%s.%N)
    # The subshell's `times` reports its children's CPU: the load generator's, all its threads (in
    # the C locale, whose decimal point the summary parses).
    (
      export LC_ALL=C
      "${load_on[@]}" "$replay" replay --trace "$OUT/trace.jsonl" --rate "$RATE" --duration "$DURATION" \
        --target "$sim" --seed 7 --hardware "headroom sim, fixed ${TTFT_MS} ms TTFT / ${ITL_MS} ms ITL; load generator build $build" \
        --out "$dir" >"$dir.txt" 2>"$dir.log" || echo "the replay exited with $? (see $dir.log)" >&2
      times >"$dir/times"
    )
    [ -f "$dir/result.json" ] || { echo "no result from build $build, round $round: see $dir.log" >&2; exit 1; }
    echo "$(( $(cpu_of "$replica_pid") - sim_before ))" >"$dir/sim_ticks"
    echo "$start $(date +%s.%N)" >"$dir/wall"
  done
done

python3 - "$OUT" "$ROUNDS" "$(getconf CLK_TCK)" "${builds[*]}" "$RATE" "$TOKENS" "$DURATION" "$placement" "$bin" "${REPLAY_B:-}" <<'PY'
import json, re, sys
out, rounds, hz, builds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4].split()
rate, tokens, duration, placement, bin_a, bin_b = sys.argv[5:11]
def seconds(s):
    m = re.fullmatch(r"(\d+)m([\d.]+)s", s)
    return int(m.group(1)) * 60 + float(m.group(2))
lines = [
    f"load: Poisson {rate} req/s for {duration} s, seed 7, 64-token prompts, {tokens}-token streams, completions endpoint; "
    f"one simulated replica, fixed clock; {placement}",
    f"build a: {bin_a}" + (f"; build b: {bin_b}" if bin_b else ""),
    "",
    "| build | round | requests | chunks | load generator CPU (share of the run's wall time) | µs per chunk | replica CPU | send late p50 / p99 / max ms | TTFT p50 / p99 ms | ITL p99 ms | stalls over 1 ms |",
    "|---|---:|---:|---:|---:|---:|---:|---|---|---:|---:|",
]
for r in range(1, rounds + 1):
    for b in builds:
        d = f"{out}/{b}-{r}"
        doc = json.load(open(f"{d}/result.json"))
        s = doc["summary"]
        chunks = sum((x["completion_tokens"] or 0) + 1 for x in doc["requests"] if not x.get("error_kind"))
        # `times`: the shell's own line, then its children's.
        user, system = open(f"{d}/times").read().split("\n")[1].split()
        cpu = seconds(user) + seconds(system)
        t0, t1 = map(float, open(f"{d}/wall").read().split())
        wall = t1 - t0
        sim = int(open(f"{d}/sim_ticks").read()) / hz
        late, ttft = s["send_lateness"], s["ttft"]
        stalls = doc.get("client_stalls") or {}
        lines.append(
            f"| {b} | {r} | {s['completed']} | {chunks} | {cpu:.2f} s ({100 * cpu / wall:.0f}% of a core) | {1e6 * cpu / max(chunks, 1):.1f} | "
            f"{100 * sim / wall:.0f}% | {late['p50_ms']:.3f} / {late['p99_ms']:.3f} / {late['max_ms']:.1f} | "
            f"{ttft['p50_ms']:.2f} / {ttft['p99_ms']:.2f} | {s['itl']['p99_ms']:.2f} | {stalls.get('over_1ms', '–')} |")
text = "\n".join(lines)
open(f"{out}/summary.md", "w").write(text + "\n")
print(text)
PY
