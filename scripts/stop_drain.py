#!/usr/bin/env python3
"""How a proxy recovers from a stop: its hold of each event by the time since a stop began.

Reads every event a proxy relayed (wire_latency.py --events: when it came in, how long the proxy
held it) and the stops injected into that round (stop_process.py --json: when each began, how long
it lasted), and averages over the stops the hold of the events that came in at each moment after a
stop's start: during the stop they wait for its end, after it for the backlog the stop left, until
the proxy is back to its ordinary hold. Averaged over tens of stops at known instants, this curve
compares two proxies' recovery far more steadily than a tail percentile does on a machine whose own
pauses differ from round to round.

  | output            | meaning                                                                   |
  |-------------------|---------------------------------------------------------------------------|
  | bins              | per window of time since a stop began (ms): events, mean and p99 hold µs |
  | away              | events that came in neither within a stop's window (--window-ms) nor in   |
  |                   | the 1 ms before a stop began (held through it): p50, p99, p99.9 µs        |
  | recovered_ms      | the first bin from the stop's asked length on whose mean hold is within   |
  |                   | 1.5× the away mean: when the backlog was drained (null: not in the window)|

An event belongs to the latest stop that began before it came in, so a stop soon after another
does not put its own wait into the first one's later bins.

usage: stop_drain.py EVENTS_CSV STOPS_JSON [--window-ms 12] [--json OUT]
"""
import argparse
import bisect
import csv
import json

EDGES_MS = (0, 0.5, 1, 1.5, 2, 2.5, 3, 3.5, 4, 5, 6, 8, 10, 12)
# An event that came in this long before a stop began may be held through it: neither away nor
# in the stop's bins.
BEFORE_MS = 1.0


def pct(sorted_xs, q):
    return sorted_xs[int(q * (len(sorted_xs) - 1))] if sorted_xs else None


def drain(events, stops, window_ms=12.0, stop_ms=None):
    """events: (in_ns, held_us) sorted by in_ns; stops: (began_ns, stopped_ms); stop_ms: the
    length the stops were asked to last (default: the median of their measured lengths, which
    run a little over)."""
    ins = [t for t, _ in events]
    edges = [e for e in EDGES_MS if e < window_ms] + [window_ms]
    per_bin = [[] for _ in edges[:-1]]
    near = bytearray(len(events))
    starts = sorted(b for b, _ in stops)
    for j, began in enumerate(starts):
        # Held through the stop: the events of the millisecond before it.
        for k in range(bisect.bisect_left(ins, began - int(BEFORE_MS * 1e6)), bisect.bisect_left(ins, began)):
            near[k] = 1
        # Its window, up to the next stop's start.
        end = began + int(window_ms * 1e6)
        if j + 1 < len(starts):
            end = min(end, starts[j + 1])
        for k in range(bisect.bisect_left(ins, began), bisect.bisect_left(ins, end)):
            near[k] = 1
            since = (ins[k] - began) / 1e6
            per_bin[bisect.bisect_right(edges, since) - 1].append(events[k][1])
    away = sorted(h for (_, h), n in zip(events, near) if not n)
    away_mean = sum(away) / len(away) if away else None
    lengths = sorted(ms for _, ms in stops)
    stop_end = stop_ms if stop_ms is not None else (lengths[len(lengths) // 2] if lengths else 0.0)
    bins, recovered = [], None
    for i, held in enumerate(per_bin):
        held.sort()
        mean = sum(held) / len(held) if held else None
        bins.append({"from_ms": edges[i], "to_ms": edges[i + 1], "events": len(held),
                     "mean_us": mean, "p99_us": pct(held, 0.99)})
        if (recovered is None and edges[i] >= stop_end and mean is not None and away_mean is not None
                and mean <= 1.5 * away_mean):
            recovered = edges[i]
    return {
        "stops": len(stops), "window_ms": window_ms, "bins": bins, "recovered_ms": recovered,
        "away": {"events": len(away), "mean_us": away_mean, "p50_us": pct(away, 0.5),
                 "p99_us": pct(away, 0.99), "p999_us": pct(away, 0.999)},
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("events")
    ap.add_argument("stops")
    ap.add_argument("--window-ms", type=float, default=12.0)
    ap.add_argument("--json")
    args = ap.parse_args()
    if args.window_ms <= 0:
        ap.error("--window-ms must be positive")
    with open(args.stops) as f:
        s = json.load(f)
    if "began_unix_s" not in s:
        raise SystemExit(f"{args.stops}: no stop instants (began_unix_s); rerun stop_process.py")
    stops = [(int(round(t * 1e9)), ms) for t, ms in zip(s["began_unix_s"], s["stopped_ms"])]
    with open(args.events) as f:
        events = sorted((int(r["in_ns"]), float(r["held_us"])) for r in csv.DictReader(f))
    result = drain(events, stops, args.window_ms, s.get("stop_ms"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    a = result["away"]
    fmt = lambda v: "-" if v is None else f"{v:.0f}"
    print(f"{result['stops']} stops; away from them {a['events']} events, hold p50 / p99 / p99.9 "
          f"{fmt(a['p50_us'])} / {fmt(a['p99_us'])} / {fmt(a['p999_us'])} µs; back to within 1.5× the "
          f"away mean {fmt(result['recovered_ms'])} ms after a stop began")
    for b in result["bins"]:
        print(f"  {b['from_ms']:5g}–{b['to_ms']:<5g} ms: {b['events']:6d} events, mean {fmt(b['mean_us'])} µs, "
              f"p99 {fmt(b['p99_us'])} µs")


if __name__ == "__main__":
    main()
