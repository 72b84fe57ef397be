#!/usr/bin/env python3
"""How often each proxy held the overhead targets, over many runs of the wire contract.

One run of three rounds says little about a p99 on a machine whose noise comes in spells: a round
of 3,000 requests loses its p99 to 30 of them. This reads every round of every run given (the
output directories of `WIRE=1 scripts/bench-overhead.sh`) and counts, per proxy, the rounds whose
p99s were within the targets, with the median over rounds of each p99. headroom's rounds are
grouped by the build each run names (its summary's `headroom build:`); nginx's rounds are pooled.

  | row                      | read from                                              |
  |--------------------------|--------------------------------------------------------|
  | TTFT share p99 ≤ SHARE   | each round's wire.json: `ttft_share_us.p99`            |
  | every event p99 ≤ EVENT  | each round's wire.json: `event_us.p99`                 |
  | medians                  | the same p99s, median over the group's rounds          |
  | CPU per chunk ÷ nginx's  | each run's summary.md (`headroom CPU per chunk / …`)   |

usage: overhead_tally.py [--share-us 1000] [--event-us 200] [--name BUILD=LABEL ...] RUN_DIR...

--name gives a build a label, and puts the runs of builds given the same label in one column (the
same binary run from two paths, say).
"""
import argparse
import json
import os
import re
import statistics
import sys

PROXIES = ("headroom", "nginx")


def run_rounds(run_dir):
    """(build, cpu ratio or None, {proxy: [(share p99, event p99) per round]}) of one run."""
    try:
        with open(os.path.join(run_dir, "summary.md")) as f:
            summary = f.read()
    except OSError as e:
        raise SystemExit(f"{run_dir}: no summary.md ({e.strerror}); is it a bench-overhead.sh run?")
    build = re.search(r"headroom build: ([^;\n]+)", summary)
    ratio = re.search(r"headroom CPU per chunk / nginx's: ([\d.]+)", summary)
    rounds = {}
    for proxy in PROXIES:
        found = []
        r = 1
        while os.path.isdir(os.path.join(run_dir, f"{proxy}-{r}")):
            path = os.path.join(run_dir, f"{proxy}-{r}", "wire.json")
            try:
                with open(path) as f:
                    w = json.load(f)
            except (OSError, ValueError) as e:
                raise SystemExit(f"{path}: unreadable ({e}); was the run made with WIRE=1?")
            found.append((w["ttft_share_us"]["p99"], w["event_us"]["p99"]))
            r += 1
        rounds[proxy] = found
    if not rounds["headroom"] or not rounds["nginx"]:
        raise SystemExit(f"{run_dir}: no rounds of both proxies (headroom-N/, nginx-N/)")
    return (build.group(1).strip() if build else "unnamed",
            float(ratio.group(1)) if ratio else None, rounds)


def tally(runs, share_us, event_us, names=None):
    """Columns in order: one per headroom build (in the order first met; `names` maps a build to
    its label), then nginx."""
    columns = {}
    for build, ratio, rounds in runs:
        label = (names or {}).get(build, build)
        col = columns.setdefault(f"headroom, {label}", {"rounds": [], "ratios": []})
        col["rounds"] += rounds["headroom"]
        col["ratios"].append(ratio)
    columns["nginx"] = {"rounds": [r for _, _, rounds in runs for r in rounds["nginx"]], "ratios": []}
    out = {}
    for name, col in columns.items():
        shares = [s for s, _ in col["rounds"]]
        events = [e for _, e in col["rounds"]]
        out[name] = {
            "rounds": len(col["rounds"]),
            "share_within": sum(s <= share_us for s in shares),
            "event_within": sum(e <= event_us for e in events),
            "share_p99_median": statistics.median(shares),
            "event_p99_median": statistics.median(events),
            "cpu_ratios": col["ratios"],
        }
    return out


def markdown(t, share_us, event_us):
    names = list(t)
    head = "| | " + " | ".join(f"{n} ({t[n]['rounds']} rounds)" for n in names) + " |"
    lines = [head, "|---|" + "---:|" * len(names)]
    row = lambda label, f: lines.append(f"| {label} | " + " | ".join(f(t[n]) for n in names) + " |")
    row(f"TTFT share p99 ≤ {share_us:g} µs, rounds", lambda c: str(c["share_within"]))
    row(f"every event p99 ≤ {event_us:g} µs, rounds", lambda c: str(c["event_within"]))
    row("TTFT share p99, median of rounds (µs)", lambda c: f"{c['share_p99_median']:.0f}")
    row("every event p99, median of rounds (µs)", lambda c: f"{c['event_p99_median']:.0f}")
    row("CPU per chunk ÷ nginx's, each run", lambda c: ", ".join(
        "?" if r is None else f"{r:.2f}" for r in c["cpu_ratios"]))
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("runs", nargs="+", metavar="RUN_DIR")
    ap.add_argument("--share-us", type=float, default=1000.0,
                    help="the TTFT share's p99 target, µs (the issue's 1 ms)")
    ap.add_argument("--event-us", type=float, default=200.0,
                    help="every event's p99 target, µs (the issue's 0.2 ms)")
    ap.add_argument("--name", action="append", default=[], metavar="BUILD=LABEL",
                    help="a label for a build as its runs name it; repeatable")
    args = ap.parse_args(argv)
    names = {}
    for n in args.name:
        build, sep, label = n.partition("=")
        if not sep or not build or not label:
            ap.error(f"--name {n!r}: expected BUILD=LABEL")
        names[build] = label
    runs = [run_rounds(d) for d in args.runs]
    print(markdown(tally(runs, args.share_us, args.event_us, names), args.share_us, args.event_us))


if __name__ == "__main__":
    sys.exit(main())
