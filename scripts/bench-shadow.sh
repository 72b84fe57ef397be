#!/usr/bin/env bash
# Shadow traffic: a slice of the real Mooncake conversation trace replayed through `headroom serve`
# in front of 4 simulated Llama-3.1-8B/H100 replicas, with FRACTION of the requests copied to a
# candidate pool. One replay contract (same slice, same timestamps, same prompts: --prompt-salt),
# one run per candidate:
#   baseline     no shadowing (run first and again last: the run-to-run noise)
#   h200         2 replicas on H200 (the upgrade under test; half the replicas for half the
#                traffic, so each candidate replica carries what each primary one does)
#   overloaded   1 H100 replica for half the primary's traffic (copies queue, wait and are dropped)
#   dead         a candidate URL where nothing listens
#   perturbed    2 H200 replicas that generate different text for PERTURB % of requests
#   bounded      the overloaded replica with room for 8 copies in flight and 8 waiting (drops)
# Records the primary's client-side TTFT/TPOT per run, the shadow counters from /stats, the
# capture's primary-vs-shadow comparison (`headroom report compare capture.jsonl`), and whether
# the shipped alert HeadroomShadowDisagreement fires on the counters the proxy exported (promtool,
# the rule file unchanged). Loopback only; bounded by ROWS.
#
#   ROWS=300 TIME_SCALE=1 scripts/bench-shadow.sh          # ~2 minutes per run, 7 runs
#   SUMMARY_ONLY=1 scripts/bench-shadow.sh                  # the table again, from the results
set -euo pipefail
cd "$(dirname "$0")/.."
ROWS=${ROWS:-300}
START=${START:-0}
TIME_SCALE=${TIME_SCALE:-1}
FRACTION=${FRACTION:-0.5}
PERTURB=${PERTURB:-5}
SALT=${SALT:-7}
SLO=${SLO:-ttft=2000,tpot=50}
RUNS=${RUNS:-baseline h200 overloaded bounded dead perturbed baseline2}
TRACE=${TRACE:-../shared/traces/mooncake_conversation.jsonl}
OUT=${OUT:-results/bench-shadow}
[ -f "$TRACE" ] || { echo "trace not found: $TRACE" >&2; exit 2; }
command -v promtool >/dev/null || { echo "promtool not found (make check-deploy installs it)" >&2; exit 2; }
mkdir -p "$OUT"
if [ -z "${SUMMARY_ONLY:-}" ]; then
cargo build --release --locked -q
bin=target/release/headroom

slice="$OUT/trace.jsonl"
sed -n "$((START + 1)),$((START + ROWS))p" "$TRACE" >"$slice"

source scripts/bench-common.sh

start_sims 4 "$OUT/primary.url" --profile llama-3.1-8b --gpu h100
start_sims 2 "$OUT/h200.url" --profile llama-3.1-8b --gpu h200
start_sims 1 "$OUT/overloaded.url" --profile llama-3.1-8b --gpu h100
start_sims 2 "$OUT/perturbed.url" --profile llama-3.1-8b --gpu h200 --perturb-text-rate "$PERTURB"
# A port nothing listens on: bound, then released.
echo "http://127.0.0.1:$(free_port)" >"$OUT/dead.url"
all_urls=$(cat "$OUT"/{primary,h200,overloaded,perturbed}.url)
# names PREFIX FILE: "p0", "p1", … one per line of FILE.
names() { seq 0 $(($(wc -l <"$2") - 1)) | sed "s/.*/\"$1&\"/" | paste -sd, - | sed 's/,/, /g'; }

for run in $RUNS; do
  for u in $all_urls; do curl -sf -X POST "$u/reset_prefix_cache" >/dev/null; done
  dir="$OUT/$run"
  rm -rf "$dir"
  mkdir -p "$dir"
  candidate=${run%2}
  slots="max_in_flight = 64\nmax_queue = 64"
  if [ "$run" = bounded ]; then candidate=overloaded; slots="max_in_flight = 8\nmax_queue = 8"; fi
  {
    echo 'listen = "127.0.0.1:0"'
    echo 'admin_listen = "127.0.0.1:0"'
    i=0
    for u in $(cat "$OUT/primary.url"); do printf '[[backends]]\nname = "p%d"\nurl = "%s"\n' $i "$u"; i=$((i + 1)); done
    if [ "$candidate" != baseline ]; then
      i=0
      for u in $(cat "$OUT/$candidate.url"); do printf '[[backends]]\nname = "c%d"\nurl = "%s"\n' $i "$u"; i=$((i + 1)); done
    fi
    printf '[routing]\npolicy = "prefix_affinity"\n'
    printf '[capture]\npath = "%s/capture.jsonl"\n' "$dir"
    printf '[[pools]]\nname = "live"\nbackends = [%s]\n' "$(names p "$OUT/primary.url")"
    if [ "$candidate" != baseline ]; then
      printf '[pools.shadow]\npool = "candidate"\nfraction = %s\n%b\n' "$FRACTION" "$slots"
      printf '[[pools]]\nname = "candidate"\nbackends = [%s]\n' "$(names c "$OUT/$candidate.url")"
    fi
    printf '[classes.default]\npool = "live"\n'
  } >"$dir/headroom.toml"
  $bin serve --config "$dir/headroom.toml" >"$dir/serve.url" 2>"$dir/serve.log" &
  serve=$!
  wait_line "$dir/serve.log" "admin http"
  proxy=$(grep -m1 http "$dir/serve.url")
  admin=$(grep -o 'admin http://[0-9.:]*' "$dir/serve.log" | cut -d' ' -f2)
  # The shadow counters every 15 s, as Prometheus would scrape them.
  (
    while sleep 15; do
      echo "# t=$(date +%s)"
      curl -sf "$admin/metrics" | grep -E '^headroom_shadow_(compared|sent|dropped)_total' || true
    done
  ) >"$dir/scrapes.txt" &
  scraper=$!
  echo "== $run (proxy $proxy)" >&2
  $bin replay --trace "$slice" --time-scale "$TIME_SCALE" --target "$proxy" --endpoint chat \
    --prompt-salt "$SALT" --slo "$SLO" \
    --hardware "headroom sim: 4 × Llama-3.1-8B-Instruct on H100 (roofline) behind headroom serve; shadow: $candidate" \
    --out "$dir" >"$dir/replay.txt"
  # Copies still in flight or waiting finish before the proxy stops (at most 120 s).
  for _ in $(seq 240); do
    busy=$(curl -sf "$admin/stats" | python3 -c 'import json,sys; s=json.load(sys.stdin)["shadow"]; print(0 if not s else sum(p["in_flight"]+p["waiting"] for p in s["pools"]))')
    [ "$busy" = 0 ] && break
    sleep 0.5
  done
  echo "# t=$(date +%s)" >>"$dir/scrapes.txt"
  curl -sf "$admin/metrics" | grep -E '^headroom_shadow_(compared|sent|dropped)_total' >>"$dir/scrapes.txt" || true
  kill "$scraper" 2>/dev/null || true
  curl -sf "$admin/stats" >"$dir/stats.json"
  kill -INT "$serve"; wait "$serve" 2>/dev/null || true
  if [ "$candidate" != baseline ]; then
    $bin report compare "$dir/capture.jsonl" >"$dir/compare.txt"
  fi
done
fi

python3 - "$OUT" $RUNS <<'PY'
import json, os, re, subprocess, sys
out, runs = sys.argv[1], sys.argv[2:]

def alert_fires(run):
    """The shipped rule file, unchanged, over this run's scraped counters (15 s apart), held flat
    for 8 minutes after the run: does HeadroomShadowDisagreement fire?"""
    samples, t = {}, None
    for line in open(f"{out}/{run}/scrapes.txt"):
        if line.startswith("# t="):
            t = int(line[4:]); continue
        m = re.match(r'(headroom_shadow_compared_total\{[^}]*\}) (\S+)', line)
        if m and t is not None:
            samples.setdefault(m.group(1), {})[t] = float(m.group(2))
    if not samples:
        return None
    times = sorted({t for s in samples.values() for t in s})
    t0 = times[0]
    steps = (times[-1] - t0) // 15 + 1
    series = []
    for name, s in samples.items():
        vals, last = [], 0.0
        for i in range(steps):
            near = [v for tt, v in s.items() if t0 + 15 * i <= tt < t0 + 15 * (i + 1)]
            last = near[-1] if near else last
            vals.append(last)
        vals += [vals[-1]] * 32  # 8 minutes flat after the run
        series.append({"series": name, "values": " ".join(f"{v:g}" for v in vals)})
    end = 15 * (steps + 30)
    rules = os.path.abspath("deploy/prometheus/alerts.yaml")
    test = {"rule_files": [rules], "evaluation_interval": "15s",
            "tests": [{"interval": "15s", "input_series": series,
                       "alert_rule_test": [{"eval_time": f"{end}s", "alertname": "HeadroomShadowDisagreement",
                                            "exp_alerts": []}]}]}
    path = f"{out}/{run}/alert.test.yaml"
    json.dump(test, open(path, "w"))  # JSON is YAML
    # Expecting silence: promtool passes when the alert is quiet, and when it fires it fails
    # showing what fired.
    r = subprocess.run(["promtool", "test", "rules", path], capture_output=True, text=True)
    open(path + ".out", "w").write(r.stdout + r.stderr)
    if r.returncode == 0:
        return "no"
    fired = re.search(r'alertname="HeadroomShadowDisagreement", pool="live".*?summary="([^"]*)"', r.stdout + r.stderr, re.S)
    return f"yes ({fired.group(1)})" if fired else "error"

rows = []
for run in runs:
    d = json.load(open(f"{out}/{run}/result.json"))
    s = d["summary"]
    st = json.load(open(f"{out}/{run}/stats.json"))
    sh = (st.get("shadow") or {"pools": [{}]})["pools"][0]
    cmp = {}
    try:
        text = open(f"{out}/{run}/compare.txt").read()
        for line in text.splitlines():
            m = re.match(r'(TTFT|TPOT) (p50|p99) ms\s+(\S+)\s+(\S+)', line)
            if m:
                cmp[f"{m.group(1)} {m.group(2)}"] = (m.group(3), m.group(4))
    except FileNotFoundError:
        pass
    fires = alert_fires(run) if sh else None
    rows.append((run, s, sh, cmp, fires))
contract = json.load(open(f"{out}/{runs[0]}/result.json"))["contract"]
lines = [
    f"trace: {contract['trace']['path']} (sha256 {contract['trace']['sha256'][:16]}…), {contract['trace']['requests']} requests, "
    f"time scale {contract['load'].get('time_scale')}, prompt_salt {contract['prompt_salt']}",
    "",
    "| run | primary TTFT p50 ms | primary TTFT p99 ms | primary TPOT p99 ms | failed | copies sent | dropped busy/late/no_backend | compared | agreement | shadow TTFT p50 / p99 ms | shadow TPOT p50 / p99 ms | alert fires |",
    "|---|---:|---:|---:|---:|---:|---|---:|---:|---|---|---|",
]
for run, s, sh, cmp, fires in rows:
    dropped = sh.get("dropped") or {}
    agreement = sh.get("agreement")
    lines.append(
        f"| {run} | {s['ttft']['p50_ms']:.0f} | {s['ttft']['p99_ms']:.0f} | {s['tpot']['p99_ms']:.1f} | {s['failed']} | "
        f"{sh.get('sent', '-')} | {dropped.get('busy', '-')}/{dropped.get('late', '-')}/{dropped.get('no_backend', '-')} | "
        f"{sh.get('compared', '-')} | {'-' if agreement is None else f'{100*agreement:.1f}%'} | "
        f"{cmp.get('TTFT p50', ('', '-'))[1]} / {cmp.get('TTFT p99', ('', '-'))[1]} | "
        f"{cmp.get('TPOT p50', ('', '-'))[1]} / {cmp.get('TPOT p99', ('', '-'))[1]} | "
        f"{fires or '-'} |")
text = "\n".join(lines)
open(f"{out}/summary.md", "w").write(text + "\n")
print(text)
PY
