#!/usr/bin/env bash
# Precise routing under cache pressure: a contiguous slice of the real Mooncake conversation trace
# replayed through `headroom serve` to 4 simulated Llama-3.1-8B/H100 replicas whose KV caches
# together hold KV_FRACTION of the slice's prefix working set (the distinct 512-token blocks that
# more than one request uses), publishing KV events over ZMQ. Once per policy with one proxy, then
# with 2 and 4 proxies in front of the same replicas (requests spread over them in turn, as a
# Service spreads connections) for the history-based and the event-based policy. Each run starts
# from empty prefix caches. Records per run: the replicas' own prefix-cache hit rate beside the
# ideal, TTFT p50/p90/p99, TPOT p99, throughput, goodput, preemptions, and each proxy's view of
# every replica's event stream. Loopback only; bounded by ROWS.
#
#   ROWS=1000 TIME_SCALE=1 scripts/bench-kv-events.sh       # ~6 minutes per run, 8 runs
#   PROXY_COUNTS= POLICIES="prefix_affinity kv_events" ...   # one proxy only
#   ENTRY=first ...   # several proxies running, every request through the first (a control: the
#                     # others' processes and event streams without their share of the traffic)
#   SHARE=gauges ...  # several proxies see each other's work as estimated from the engines' gauges
#                     # (routing.foreign_load) instead of polling each other ([peers], the default)
#   SPREAD=8000 ...   # routing.spread_tokens of every proxy (default 0)
#   PUSH=0 ...        # peers.push_interval_ms: 0 polls only; default 5 (each proxy pushes its work
#                     # to the others as it changes, between the 100 ms polls)
#   RELOAD_EVERY=60 ... # every proxy reloads its (unchanged) config every 60 s of the replay
#                     # (SIGHUP, as a config rollout does); default 0, never
#   SERVE_BIN=/tmp/headroom-b ... # another build as the proxies (an A/B of builds; the replicas and
#                     # the load stay this one's). This script builds target/release/headroom: copy
#                     # build B aside first.
set -euo pipefail
# SERVE_BIN is resolved where it was given, before the move to the repository's root.
if [ -n "${SERVE_BIN:-}" ]; then
  [ -x "$SERVE_BIN" ] || { echo "SERVE_BIN=$SERVE_BIN is not an executable" >&2; exit 1; }
  SERVE_BIN=$(realpath "$SERVE_BIN")
fi
cd "$(dirname "$0")/.."
RELOAD_EVERY=${RELOAD_EVERY:-0}
ROWS=${ROWS:-1000}
START=${START:-0}
TIME_SCALE=${TIME_SCALE:-1}
KV_FRACTION=${KV_FRACTION:-0.7}
POLICIES=${POLICIES:-round_robin least_load prefix_affinity kv_events}
MULTI_POLICIES=${MULTI_POLICIES-prefix_affinity kv_events}
PROXY_COUNTS=${PROXY_COUNTS-2 4}
SLO=${SLO:-ttft=2000,tpot=50}
# How much of each prompt the proxies hash (routing.max_hashed_tokens): the whole of the trace's
# longest prompts (120k tokens), so a long conversation's cached prefix is seen past the 32k default.
MAX_HASHED=${MAX_HASHED:-131072}
ENTRY=${ENTRY:-all}
case $ENTRY in all | first) ;; *) echo "ENTRY must be all or first, got $ENTRY" >&2; exit 2 ;; esac
SHARE=${SHARE:-peers}
case $SHARE in peers | gauges) ;; *) echo "SHARE must be peers or gauges, got $SHARE" >&2; exit 2 ;; esac
# Proxy k's admin listener, when the proxies poll each other: ADMIN_PORT + k.
ADMIN_PORT=${ADMIN_PORT:-25757}
SPREAD=${SPREAD:-0}
PUSH=${PUSH:-5}
# Replica i publishes on EVENTS_PORT + i and answers replays on REPLAY_PORT + i.
EVENTS_PORT=${EVENTS_PORT:-25557}
REPLAY_PORT=${REPLAY_PORT:-25657}
TRACE=${TRACE:-../shared/traces/mooncake_conversation.jsonl}
OUT=${OUT:-results/bench-kv-events}
[ -f "$TRACE" ] || { echo "trace not found: $TRACE" >&2; exit 2; }
mkdir -p "$OUT"
cargo build --release --locked -q
bin=target/release/headroom
if [ -n "${SERVE_BIN:-}" ] && [ "$SERVE_BIN" = "$(realpath "$bin")" ]; then
  echo "SERVE_BIN is target/release/headroom, which this script has just rebuilt: copy build B aside first" >&2
  exit 1
fi
SERVE_BIN=${SERVE_BIN:-$bin}

slice="$OUT/trace.jsonl"
sed -n "$((START + 1)),$((START + ROWS))p" "$TRACE" >"$slice"

# The working set and the per-replica KV cache that holds KV_FRACTION of it across 4 replicas.
read -r working_set blocks < <(python3 - "$slice" "$KV_FRACTION" <<'PY'
import collections, json, math, sys
uses = collections.Counter(h for line in open(sys.argv[1]) for h in json.loads(line)["hash_ids"])
working_set = sum(1 for n in uses.values() if n > 1) * 512
per_replica = float(sys.argv[2]) * working_set / 4
print(working_set, math.ceil(per_replica / 16) + 1)
PY
)
echo "prefix working set $working_set tokens; $blocks KV blocks per replica ($(( (blocks - 1) * 16 )) tokens)" >&2

source scripts/bench-common.sh

kv_config="{\"enable_kv_cache_events\":true,\"publisher\":\"zmq\",\"endpoint\":\"tcp://*:$EVENTS_PORT\",\"replay_endpoint\":\"tcp://*:$REPLAY_PORT\"}"
start_sims 4 "$OUT/sims.url" --profile llama-3.1-8b --gpu h100 --num-gpu-blocks "$blocks" \
  --kv-events-config "$kv_config"
urls=$(paste -sd, "$OUT/sims.url")

preemptions() {
  for u in $(cat "$OUT/sims.url"); do curl -sf "$u/metrics"; done |
    awk '/^vllm:num_preemptions_total/ {s += $2} END {print s + 0}'
}

# run POLICY PROXIES
run() {
  local policy=$1 n=$2 dir="$OUT/$1-x$2"
  mkdir -p "$dir"
  for u in $(cat "$OUT/sims.url"); do curl -sf -X POST "$u/reset_prefix_cache" >/dev/null; done
  {
    echo 'listen = "127.0.0.1:0"'
    local i=0
    for u in $(cat "$OUT/sims.url"); do
      printf '[[backends]]\nurl = "%s"\nkv_events = "tcp://127.0.0.1:%d"\nkv_events_replay = "tcp://127.0.0.1:%d"\n' \
        "$u" $((EVENTS_PORT + i)) $((REPLAY_PORT + i))
      i=$((i + 1))
    done
    printf '[routing]\npolicy = "%s"\nforeign_load = %s\nmax_hashed_tokens = %s\nspread_tokens = %s\n' "$policy" \
      "$([ "$n" -gt 1 ] && [ "$SHARE" = gauges ] && echo true || echo false)" "$MAX_HASHED" "$SPREAD"
    if [ "$n" -gt 1 ] && [ "$SHARE" = peers ]; then
      printf '[peers]\naddresses = [%s]\npush_interval_ms = %s\n' \
        "$(for k in $(seq "$n"); do printf '"127.0.0.1:%d",' $((ADMIN_PORT + k)); done)" "$PUSH"
    fi
  } >"$dir/headroom.toml"
  local proxies=() admins=() serve_pids=()
  for k in $(seq "$n"); do
    local admin='127.0.0.1:0'
    if [ "$n" -gt 1 ] && [ "$SHARE" = peers ]; then admin="127.0.0.1:$((ADMIN_PORT + k))"; fi
    { echo "admin_listen = \"$admin\""; cat "$dir/headroom.toml"; } >"$dir/headroom-$k.toml"
    "$SERVE_BIN" serve --config "$dir/headroom-$k.toml" >"$dir/serve-$k.url" 2>"$dir/serve-$k.log" &
    serve_pids+=($!)
    pids+=($!)
    wait_line "$dir/serve-$k.log" "admin http"
    proxies+=("$(grep -m1 http "$dir/serve-$k.url")")
    admins+=("$(grep -o 'admin http://[0-9.:]*' "$dir/serve-$k.log" | cut -d' ' -f2)")
  done
  # Event-following proxies start once every stream is live (the reset above is in each replay).
  if [ "$policy" = kv_events ]; then
    for a in "${admins[@]}"; do
      for _ in $(seq 100); do
        [ "$(curl -sf "$a/stats" | python3 -c 'import json,sys; print(all(b["kv_events"]["state"]=="live" for b in json.load(sys.stdin)["backends"]))')" = True ] && break
        sleep 0.1
      done
    done
  fi
  # Proxies that poll each other start once each hears every other one.
  if [ "$n" -gt 1 ] && [ "$SHARE" = peers ]; then
    for a in "${admins[@]}"; do
      for _ in $(seq 100); do
        [ "$(curl -sf "$a/metrics" | awk '$1 == "headroom_peers_live" {print $2}')" = $((n - 1)) ] && break
        sleep 0.1
      done
    done
  fi
  for k in $(seq "$n"); do curl -sf "${admins[$((k - 1))]}/metrics" >"$dir/proxy-$k-metrics-before.txt"; done
  preemptions >"$dir/preemptions-before.txt"
  echo "== $policy × $n proxies (requests through: $ENTRY; other proxies' work: $SHARE)" >&2
  local targets
  targets=$(IFS=,; echo "${proxies[*]}")
  if [ "$ENTRY" = first ]; then targets=${proxies[0]}; fi
  $bin replay --trace "$slice" --time-scale "$TIME_SCALE" --target "$targets" --observe "$urls" \
    --slo "$SLO" --hardware "headroom sim: 4 × Llama-3.1-8B-Instruct on H100 (roofline), $blocks KV blocks each ($KV_FRACTION of the slice's prefix working set across the fleet), behind $n × headroom serve (policy $policy, spread_tokens $SPREAD; requests through $ENTRY; other proxies' work from $SHARE, push_interval_ms $PUSH; config reloaded every ${RELOAD_EVERY}s (0: never); proxy build $(basename "$SERVE_BIN"))" \
    --out "$dir" >"$dir/replay.txt" &
  local replay_pid=$!
  local reloads=0
  if [ "$RELOAD_EVERY" != 0 ]; then
    while kill -0 "$replay_pid" 2>/dev/null; do
      sleep "$RELOAD_EVERY" & wait $! || true
      kill -0 "$replay_pid" 2>/dev/null || break
      for p in "${serve_pids[@]}"; do kill -HUP "$p"; done
      reloads=$((reloads + 1))
    done
  fi
  wait "$replay_pid"
  echo "$reloads" >"$dir/reloads.txt"
  preemptions >"$dir/preemptions-after.txt"
  for k in $(seq "$n"); do
    curl -sf "${admins[$((k - 1))]}/metrics" >"$dir/proxy-$k-metrics-after.txt"
    curl -sf "${admins[$((k - 1))]}/stats" >"$dir/proxy-$k-stats.json"
  done
  for p in "${serve_pids[@]}"; do kill -INT "$p"; wait "$p" 2>/dev/null || true; done
}

for policy in $POLICIES; do run "$policy" 1; done
for n in $PROXY_COUNTS; do
  for policy in $MULTI_POLICIES; do run "$policy" "$n"; done
done

python3 - "$OUT" "$working_set" "$blocks" "$ENTRY" "$SHARE" "$SPREAD" "$PUSH" "$RELOAD_EVERY" "$SERVE_BIN" <<'PY'
import glob, json, os, re, sys
out, working_set, blocks, entry, share, spread, push = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5], sys.argv[6], sys.argv[7]
reload_every, serve_bin = sys.argv[8], sys.argv[9]
def run_dirs():
    dirs = [d for d in glob.glob(f"{out}/*-x*") if os.path.exists(f"{d}/result.json")]
    return sorted(dirs, key=lambda d: (int(d.rsplit("-x", 1)[1]), os.path.getmtime(d)))
def integrals(paths):
    vals = {}
    for path in paths:
        for line in open(path):
            m = re.match(r'headroom_backend_in_flight_seconds_total\{backend="([^"]+)"\} (\S+)', line)
            if m:
                vals[m.group(1)] = vals.get(m.group(1), 0.0) + float(m.group(2))
    return vals
rows, single = [], {}
for d in run_dirs():
    name = os.path.basename(d)
    policy, n = name.rsplit("-x", 1)
    n = int(n)
    r = json.load(open(f"{d}/result.json"))
    s, t = r["summary"], r["target_observed"]
    before = integrals(glob.glob(f"{d}/proxy-*-metrics-before.txt"))
    after = integrals(glob.glob(f"{d}/proxy-*-metrics-after.txt"))
    loads = [after[k] - before.get(k, 0.0) for k in after]
    imbalance = max(loads) / (sum(loads) / len(loads)) if loads and sum(loads) > 0 else float("nan")
    pre = float(open(f"{d}/preemptions-after.txt").read()) - float(open(f"{d}/preemptions-before.txt").read())
    states = set()
    for st in glob.glob(f"{d}/proxy-*-stats.json"):
        for b in json.load(open(st))["backends"]:
            if "kv_events" in b:
                k = b["kv_events"]
                states.add(f'{k["state"]}' + (f' ({k["losses"]} lost)' if k["losses"] else ""))
    hit, ideal = t.get("prefix_cache_hit_rate", 0.0), t.get("offline_prefix_hit_rate", float("nan"))
    if n == 1:
        single[policy] = hit
    reloads = open(f"{d}/reloads.txt").read().strip() if os.path.exists(f"{d}/reloads.txt") else "0"
    rows.append((policy, n, hit, ideal, s, imbalance, pre, ", ".join(sorted(states)) or "–", reloads))
contract = json.load(open(f"{run_dirs()[0]}/result.json"))["contract"]
lines = [
    f"trace: {contract['trace']['path']} (sha256 {contract['trace']['sha256'][:16]}…), {contract['trace']['requests']} requests, time scale {contract['load'].get('time_scale')}",
    "requests through: " + ("every proxy in turn" if entry == "all" else "the first proxy only (ENTRY=first: the others route nothing)"),
    "other proxies' work (several proxies): " + ("polled from each other every 100 ms ([peers])" + (f", and pushed as it changes (at most every {push} ms)" if push != "0" else ", no pushes") if share == "peers" else "estimated from the engines' gauges (routing.foreign_load)"),
    f"routing.spread_tokens: {spread}",
    f"proxy build: {serve_bin}; config reloaded (SIGHUP) " + (f"every {reload_every} s" if reload_every != "0" else "never"),
    f"prefix working set (blocks used by more than one request): {working_set:,} tokens; KV per replica {(blocks - 1) * 16:,} tokens, fleet {(blocks - 1) * 64:,} ({100 * (blocks - 1) * 64 / working_set:.0f}% of the working set)",
    "",
    "| policy | proxies | hit rate | of ideal | vs 1 proxy | TTFT p50 ms | TTFT p90 ms | TTFT p99 ms | TPOT p99 ms | output tok/s | goodput req/s | preemptions | imbalance | event streams | failed | reloads |",
    "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|",
]
for policy, n, hit, ideal, s, imb, pre, states, reloads in rows:
    delta = f"{100 * (hit - single[policy]):+.1f} pt" if policy in single and n > 1 else ""
    lines.append(f"| {policy} | {n} | {100*hit:.1f}% | {100*hit/ideal:.0f}% | {delta} | {s['ttft']['p50_ms']:.0f} | {s['ttft']['p90_ms']:.0f} | "
                 f"{s['ttft']['p99_ms']:.0f} | {s['tpot']['p99_ms']:.1f} | {s['output_token_throughput']:.0f} | {s['goodput']['requests_per_s']:.2f} | "
                 f"{pre:.0f} | {imb:.2f} | {states} | {s['failed']} | {reloads} |")
lines.append("")
lines.append(f"ideal hit rate (one LRU cache of the fleet's combined KV capacity): {100*rows[0][3]:.1f}%")
text = "\n".join(lines)
open(f"{out}/summary.md", "w").write(text + "\n")
print(text)
PY
