#!/usr/bin/env bash
# Two proxies on one core at the same time: each relays half of the overhead contract's streaming
# load (one fixed-clock simulated replica, 64-token prompts, TOKENS-token streams, RATE_EACH req/s
# through each), and each one's CPU per relayed chunk, user space and kernel, is read from /proc.
# Run side by side rather than in turn, the two share every pause, interrupt and cache the machine
# takes from that core, so a difference of a few percent shows on a machine whose drift between
# rounds is ±10% (docs/benchmarks.md, "A build trained on the contract's traffic"). Each proxy also
# evicts the other's code from the core's caches, as any other tenant would.
#
#   scripts/bench-twin.sh A B                  # A, B: headroom binaries, or `nginx` (the overhead
#                                              # benchmark's unbuffered SSE proxy, one worker)
#   REPS=3 DURATION=15 RATE_EACH=100 TOKENS=100 scripts/bench-twin.sh A B   # the defaults
#   SWAP=1 scripts/bench-twin.sh A B           # then the same again with the loads' roles swapped
#                                              # (whose load starts first, which seeds each gets)
#   WIRE=1 scripts/bench-twin.sh A B           # also read off the wire (tcpdump on lo,
#                                              # scripts/wire_latency.py) how long each proxy held
#                                              # each request and each event, under the same pauses:
#                                              # each proxy then has a replica of its own, so the
#                                              # two legs of each are told apart by port. Medians
#                                              # and p90s only: the two processes wait for each
#                                              # other's scheduler slices on the one core, which sets
#                                              # both tails (milliseconds); tails come from
#                                              # bench-overhead.sh, one proxy at a time.
#                                              # KEEP_PCAP=1 keeps each repetition's capture
#
# Always pinned (scripts/pin.sh, PIN=1): both proxies on SUT_CPUS (one core; default the last), the
# replica and both load generators on LOAD_CPUS; ISOLATE=1, NOIDLE=1 and LOAD_NICE=N work as in
# bench-overhead.sh. headroom runs with measurement and capture on, as in the contract. Prints each
# repetition and writes OUT/twin.json; any failed request stops the run (the CPU per chunk would
# count work that relayed nothing). Loopback only, bounded by REPS × DURATION.
set -euo pipefail
resolve() {
  if [ "$1" = nginx ]; then echo nginx; return; fi
  [ -x "$1" ] || { echo "$1 is not an executable (a headroom binary, or nginx)" >&2; exit 1; }
  realpath "$1"
}
[ $# = 2 ] || { awk 'NR > 1 && !/^#/ { exit } NR > 1' "$0" >&2; exit 1; }
A=$(resolve "$1")
B=$(resolve "$2")
cd "$(dirname "$0")/.."
REPS=${REPS:-3}
DURATION=${DURATION:-15}
RATE_EACH=${RATE_EACH:-100}
TOKENS=${TOKENS:-100}
SWAP=${SWAP:-0}
WIRE=${WIRE:-0}
OUT=${OUT:-results/twin}
mkdir -p "$OUT"
# tcpdump checked before the build rather than after it.
source scripts/tools.sh
[ "$WIRE" = 1 ] && need_tcpdump
cargo build --release --locked -q --bin headroom
bin=target/release/headroom
PIN=1
source scripts/bench-common.sh
[[ "$SUT_CPUS" =~ ^[0-9]+$ ]] || { echo "SUT_CPUS=$SUT_CPUS: the two proxies share one core" >&2; exit 1; }
# The capture's reader runs on the load cores.
wire_on=(taskset -c "$LOAD_CPUS")

stream_trace "$OUT/trace.jsonl" $((RATE_EACH * DURATION)) "$TOKENS"
# replica[NAME]: the replica behind proxy NAME (one for both, or with WIRE=1 one each).
declare -A replica
mkdir -p "$OUT/replica-a"
start_stream_replica fixed 20 10 "$OUT/replica-a"
replica[a]=$replica_url
replica[b]=$replica_url
if [ "$WIRE" = 1 ]; then
  mkdir -p "$OUT/replica-b"
  start_stream_replica fixed 20 10 "$OUT/replica-b"
  replica[b]=$replica_url
fi

# start_proxy WHAT NAME: a proxy on the SUT core in front of the replica; sets url[NAME] and
# pid[NAME].
declare -A url pid
start_proxy() {
  local what=$1 name=$2 replica_url=${replica[$2]}
  if [ "$what" = nginx ]; then
    command -v nginx >/dev/null || { echo "nginx is not installed (apt-get install nginx-light)" >&2; exit 1; }
    local port dir
    port=$(free_port)
    dir=$(realpath "$OUT")/nginx-$name
    nginx_conf "$dir" "$port" "${replica_url#http://}" 1 "daemon off;"
    "${sut_on[@]}" nginx -c "$dir/nginx.conf" -p "$dir" 2>"$dir.log" &
    pid[$name]=$!
    pids+=($!)
    wait_port "$port" 5 "nginx ($dir.log)"
    url[$name]=http://127.0.0.1:$port
  else
    "${sut_on[@]}" "$what" serve --backends "$replica_url" --listen 127.0.0.1:0 --admin-listen 127.0.0.1:0 \
      --capture "$OUT/$name.capture.jsonl" >"$OUT/$name.url" 2>"$OUT/$name.log" &
    pid[$name]=$!
    pids+=($!)
    wait_line "$OUT/$name.url" http
    url[$name]=$(grep -m1 http "$OUT/$name.url")
  fi
}
start_proxy "$A" a
start_proxy "$B" b

: >"$OUT/reps.jsonl"
# rep N FIRST SECOND: one repetition, FIRST's load started first.
rep() {
  local n=$1 first=$2 second=$3
  local p1=${pid[$first]} p2=${pid[$second]} c1 c2 r1 r2
  local wiring=""
  if [ "$WIRE" = 1 ]; then
    start_wire_capture "$OUT/wire-$n.pcap" "$OUT/wire-$n.log" \
      "${url[a]##*:}" "${url[b]##*:}" "${replica[a]##*:}" "${replica[b]##*:}"
    wiring=$wire_pid
  fi
  c1=$(cpu_split_of "$p1")
  c2=$(cpu_split_of "$p2")
  "${load_on[@]}" "$bin" replay --trace "$OUT/trace.jsonl" --rate "$RATE_EACH" --duration "$DURATION" \
    --target "${url[$first]}" --seed "$n" --out "$OUT/$first-$n" >"$OUT/$first-$n.txt" 2>"$OUT/$first-$n.log" &
  r1=$!
  "${load_on[@]}" "$bin" replay --trace "$OUT/trace.jsonl" --rate "$RATE_EACH" --duration "$DURATION" \
    --target "${url[$second]}" --seed "$((n + 1000))" --out "$OUT/$second-$n" >"$OUT/$second-$n.txt" \
    2>"$OUT/$second-$n.log" &
  r2=$!
  wait "$r1"
  wait "$r2"
  local held=()
  if [ -n "$wiring" ]; then
    # The last packets are still in the capture's ring buffer when the loads end.
    sleep 1
    kill -INT "$wiring"; wait "$wiring" || true
    local dropped name
    dropped=$(sed -n 's/^\([0-9]*\) packets dropped by kernel.*/\1/p' "$OUT/wire-$n.log")
    for name in a b; do
      python3 scripts/wire_latency.py "$OUT/wire-$n.pcap" --proxy-port "${url[$name]##*:}" \
        --replica-port "${replica[$name]##*:}" --dropped "${dropped:-0}" --json "$OUT/$name-$n/wire.json" \
        >"$OUT/$name-$n/wire.txt" 2>&1 || { cat "$OUT/$name-$n/wire.txt" >&2; exit 1; }
    done
    [ "${KEEP_PCAP:-0}" = 1 ] || rm -f "$OUT/wire-$n.pcap"
    held=(--wire)
  fi
  python3 - "$n" "$first" "$second" "$c1" "$(cpu_split_of "$p1")" "$c2" "$(cpu_split_of "$p2")" "$OUT" \
    "${held[@]}" >>"$OUT/reps.jsonl" <<'PY'
import csv, json, os, sys
n, first, second, c1a, c1b, c2a, c2b, out = sys.argv[1:9]
wire = sys.argv[9:] == ["--wire"]
tick = 1e6 / os.sysconf("SC_CLK_TCK")
def per_chunk(name, before, after):
    with open(os.path.join(out, f"{name}-{n}", "requests.csv")) as f:
        rows = list(csv.DictReader(f))
    ok = [r for r in rows if r["status"] == "200" and not r["error"]]
    if not ok or len(ok) < len(rows):
        sys.exit(f"repetition {n}: {len(rows) - len(ok)} of {len(rows)} requests through {name.upper()} "
                 f"failed ({out}/{name}-{n}/requests.csv): its CPU per chunk would not be comparable")
    chunks = sum(int(r["completion_tokens"] or 0) + 1 for r in ok)
    u0, s0 = map(int, before.split()); u1, s1 = map(int, after.split())
    got = {"chunks": chunks, "user_us": (u1 - u0) * tick / chunks,
           "kernel_us": (s1 - s0) * tick / chunks}
    if wire:
        with open(os.path.join(out, f"{name}-{n}", "wire.json")) as f:
            w = json.load(f)
        if not w["request_us"]["n"] or not w["event_us"]["n"]:
            sys.exit(f"repetition {n}: nothing through {name.upper()} was read off the wire "
                     f"({out}/{name}-{n}/wire.txt)")
        got["wire"] = {k: {q: w[k][q] for q in ("p50", "p90", "p99")}
                       for k in ("request_us", "ttft_share_us", "event_us")}
        for k in ("resent_segments", "dropped", "broken_flows", "requests_unmatched"):
            got["wire"][k] = w[k]
    return got
print(json.dumps({"rep": int(n), "first": first,
                  first: per_chunk(first, c1a, c1b), second: per_chunk(second, c2a, c2b)}))
PY
}
i=0
for _ in $(seq "$REPS"); do i=$((i + 1)); rep "$i" a b; done
if [ "$SWAP" = 1 ]; then
  for _ in $(seq "$REPS"); do i=$((i + 1)); rep "$i" b a; done
fi

python3 - "$OUT" "${A#"$PWD"/}" "${B#"$PWD"/}" "$RATE_EACH" "$DURATION" "$TOKENS" <<'PY'
import json, statistics, sys
out, a_name, b_name, rate, duration, tokens = sys.argv[1:]
reps = [json.loads(l) for l in open(f"{out}/reps.jsonl")]
print(f"Two proxies on one core at once, {rate} req/s of {tokens}-token streams through each for "
      f"{duration} s a repetition; A = {a_name}, B = {b_name}. CPU µs per relayed chunk:\n")
print("| rep | first | A user | A kernel | A total | B user | B kernel | B total | B/A user | B/A total |")
print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")
ratios_user, ratios_total = [], []
for r in reps:
    a, b = r["a"], r["b"]
    at, bt = a["user_us"] + a["kernel_us"], b["user_us"] + b["kernel_us"]
    ru, rt = b["user_us"] / max(a["user_us"], 1e-9), bt / max(at, 1e-9)
    ratios_user.append(ru); ratios_total.append(rt)
    print(f"| {r['rep']} | {r['first'].upper()} | {a['user_us']:.2f} | {a['kernel_us']:.2f} | {at:.2f} | "
          f"{b['user_us']:.2f} | {b['kernel_us']:.2f} | {bt:.2f} | {ru:.3f} | {rt:.3f} |")
summary = {"a": a_name, "b": b_name, "rate_each": float(rate), "duration_s": float(duration),
           "tokens": int(tokens), "reps": reps,
           "b_over_a_user": {"median": statistics.median(ratios_user), "min": min(ratios_user), "max": max(ratios_user)},
           "b_over_a_total": {"median": statistics.median(ratios_total), "min": min(ratios_total), "max": max(ratios_total)}}
print(f"\nB/A, median (range) over {len(reps)} repetitions: user space {summary['b_over_a_user']['median']:.3f} "
      f"({min(ratios_user):.3f}–{max(ratios_user):.3f}), all CPU {summary['b_over_a_total']['median']:.3f} "
      f"({min(ratios_total):.3f}–{max(ratios_total):.3f})")
if all("wire" in r["a"] for r in reps):
    print("\nHeld by each proxy, read off the wire, µs (p50 / p90; the same moments for both):\n")
    print("| rep | A request | B request | A TTFT share | B TTFT share | A every event | B every event | segments sent again, dropped (whole capture) | flows with a gap, requests unmatched: A; B |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in reps:
        a, b = r["a"]["wire"], r["b"]["wire"]
        cell = lambda w, k: f"{w[k]['p50']:.0f} / {w[k]['p90']:.0f}"
        print(f"| {r['rep']} | {cell(a, 'request_us')} | {cell(b, 'request_us')} | {cell(a, 'ttft_share_us')} | "
              f"{cell(b, 'ttft_share_us')} | {cell(a, 'event_us')} | {cell(b, 'event_us')} | "
              f"{a['resent_segments']}, {a['dropped']} | {a['broken_flows']}, {a['requests_unmatched']}; "
              f"{b['broken_flows']}, {b['requests_unmatched']} |")
    held = {}
    for k in ("request_us", "ttft_share_us", "event_us"):
        for q in ("p50", "p90"):
            rs = [r["b"]["wire"][k][q] / max(r["a"]["wire"][k][q], 1e-9) for r in reps]
            held[f"{k}_{q}"] = {"median": statistics.median(rs), "min": min(rs), "max": max(rs),
                                "b_lower_in": sum(x < 1 for x in rs)}
    summary["b_over_a_held"] = held
    print(f"\nB/A held, median (range) over {len(reps)} repetitions, and in how many B held less:")
    for k, v in held.items():
        print(f"- {k}: {v['median']:.3f} ({v['min']:.3f}–{v['max']:.3f}), B lower in {v['b_lower_in']} of {len(reps)}")
with open(f"{out}/twin.json", "w") as f:
    json.dump(summary, f, indent=1)
PY
