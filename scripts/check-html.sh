#!/usr/bin/env bash
# Opens headroom HTML reports in headless Chromium and checks that every chart was drawn (each
# becomes a uPlot canvas); saves a screenshot beside each report (REPORT.png). Usage:
#   scripts/check-html.sh results/replay/report.html [more.html …]
# Needs Debian's chromium (apt-get install chromium); loopback-free: reports are local files.
set -euo pipefail
browser=$(command -v chromium || command -v chromium-browser || command -v google-chrome || true)
[ -n "$browser" ] || { echo "chromium not found: apt-get install -y chromium" >&2; exit 2; }
flags=(--headless --no-sandbox --disable-gpu --disable-quic --no-first-run --disable-background-networking
       --disable-component-update --disable-sync --hide-scrollbars --virtual-time-budget=5000)
status=0
for report in "$@"; do
  profile=$(mktemp -d)
  abs=$(realpath "$report")
  dom=$("$browser" "${flags[@]}" --user-data-dir="$profile" --dump-dom "file://$abs" 2>/dev/null)
  expected=$(grep -o 'class="chart" id="chart[0-9]*"' "$report" | wc -l)
  drawn=$(grep -o '<canvas' <<<"$dom" | wc -l)
  declared=$(grep -o 'data-charts="[0-9]*"' <<<"$dom" | grep -o '[0-9]*' || echo 0)
  "$browser" "${flags[@]}" --user-data-dir="$profile" --window-size=1200,2400 --screenshot="${report%.html}.png" "file://$abs" >/dev/null 2>&1 || true
  rm -rf "$profile"
  if [ "$expected" -gt 0 ] && [ "$drawn" -ge "$expected" ] && [ "$declared" = "$expected" ]; then
    echo "ok   $report: $drawn of $expected charts drawn (screenshot ${report%.html}.png)"
  else
    echo "FAIL $report: $drawn canvases for $expected charts (script ran: ${declared:-no})"; status=1
  fi
done
exit $status
