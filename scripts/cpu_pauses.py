#!/usr/bin/env python3
"""How often, and for how long, the machine takes a core away from a program that wants it.

Spins on the core it is pinned to for SECONDS, reading the monotonic clock in a loop; any gap
between two reads longer than --min-us is a pause: the hypervisor running something else on the
virtual CPU (steal), an interrupt, a kernel thread. A proxy on that core pays every such pause, so
they are the floor under its tail latencies on this machine, whatever the proxy.

  | output          | meaning                                                    |
  |-----------------|------------------------------------------------------------|
  | pauses          | gaps longer than --min-us (default 50 µs)                  |
  | over_500us, 1ms | of them, those longer than 0.5 ms and 1 ms                 |
  | lost_fraction   | time inside pauses / SECONDS                               |
  | max_ms          | the longest pause                                          |

usage: taskset -c CPU cpu_pauses.py SECONDS [--min-us 50] [--json OUT]
"""
import argparse
import json
import time


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("seconds", type=float)
    ap.add_argument("--min-us", type=float, default=50.0)
    ap.add_argument("--json")
    args = ap.parse_args()
    if args.seconds <= 0:
        ap.error("SECONDS must be positive")
    floor = int(args.min_us * 1000)
    clock = time.perf_counter_ns
    start = last = clock()
    end = start + int(args.seconds * 1e9)
    gaps = []
    while last < end:
        now = clock()
        if now - last > floor:
            gaps.append(now - last)
        last = now
    total = last - start
    gaps.sort()
    result = {
        "seconds": total / 1e9, "min_us": args.min_us, "pauses": len(gaps),
        "over_500us": sum(g > 500_000 for g in gaps), "over_1ms": sum(g > 1_000_000 for g in gaps),
        "lost_fraction": sum(gaps) / total, "max_ms": gaps[-1] / 1e6 if gaps else 0.0,
        "longest_ms": [g / 1e6 for g in gaps[-10:][::-1]],
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    print(f"{result['pauses']} pauses over {args.min_us:.0f} µs in {result['seconds']:.1f} s "
          f"({result['over_500us']} over 0.5 ms, {result['over_1ms']} over 1 ms), "
          f"{100 * result['lost_fraction']:.2f}% of the time lost, longest {result['max_ms']:.2f} ms")


if __name__ == "__main__":
    main()
