#!/usr/bin/env python3
"""Waits until the machine leaves the given cores alone: a benchmark's gate on a shared machine.

Every probe spins for --probe seconds on each of --cpus at once (cpu_pauses.py, one per core) and
reads the share of the probe the machine took from each core in pauses over 50 µs (the
hypervisor, interrupts, kernel threads). The gate opens when every core lost at most --below
percent in one probe. After --wait seconds it stops waiting and says so: the caller goes on, and
what it measures then ran on a noisy machine, which its summary says.

A lost share, not the longest pause, is the criterion: a p99 is moved by how much of the time the
core was gone (1% of the events held through pauses), a single long pause moves only the max.

  | output        | meaning                                                              |
  |---------------|----------------------------------------------------------------------|
  | passed        | the last probe found every core at most --below percent taken        |
  | waited_s      | from the start to the end of the last probe                          |
  | probes        | probes taken                                                         |
  | lost_pct      | each probe's worst core, percent of the probe lost                   |
  | last          | the last probe, per core (cpu_pauses.py's fields)                    |

usage: quiet_gate.py --cpus LIST --below PCT [--probe 10] [--wait 900] [--json OUT]
exit status: 0 the gate opened, 3 it gave up waiting, 2 bad arguments or a probe that failed
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def parse_cpus(text):
    """A CPU list as taskset takes it: "1", "2-3", "0,2-3"."""
    cpus = []
    for part in text.split(","):
        lo, sep, hi = part.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"not a CPU list: {text!r} (e.g. 1, 2-3, 0,2)")
        first, last = int(lo), int(hi) if sep else int(lo)
        if last < first:
            raise ValueError(f"not a CPU list: {text!r} ({part} runs backwards)")
        cpus.extend(range(first, last + 1))
    # The caller may be confined to other cores (a benchmark's script sits on its load cores).
    missing = sorted(c for c in set(cpus) if c >= (os.cpu_count() or 1))
    if missing:
        raise ValueError(f"no CPU {missing[0]} on this machine (it has {os.cpu_count()})")
    return sorted(set(cpus))


def probe(cpus, seconds):
    """One probe of every core at once: cpu_pauses.py's result for each, by core."""
    with tempfile.TemporaryDirectory() as d:
        running = []
        try:
            for cpu in cpus:
                out = os.path.join(d, f"{cpu}.json")
                child = subprocess.Popen(
                    [sys.executable, os.path.join(HERE, "cpu_pauses.py"), str(seconds), "--json", out],
                    stdout=subprocess.DEVNULL,
                    preexec_fn=lambda cpu=cpu: os.sched_setaffinity(0, {cpu}))
                running.append((cpu, out, child))
            results = {}
            for cpu, out, child in running:
                if child.wait() != 0:
                    raise RuntimeError(f"the probe of CPU {cpu} failed (status {child.returncode})")
                with open(out) as f:
                    results[cpu] = json.load(f)
            return results
        finally:
            # A probe that failed leaves none of the others spinning on the cores it watched.
            for _, _, child in running:
                if child.poll() is None:
                    child.kill()
                    child.wait()


def wait_quiet(cpus, below_pct, probe_s, wait_s, on_probe=None, probe_with=None):
    """Probes until one finds every core at most below_pct taken, or wait_s has passed."""
    probe_with = probe_with or probe
    began = time.monotonic()
    history = []
    while True:
        last = probe_with(cpus, probe_s)
        worst = max(100 * r["lost_fraction"] for r in last.values())
        history.append(worst)
        waited = time.monotonic() - began
        passed = worst <= below_pct
        if on_probe:
            on_probe(worst, waited, passed)
        if passed or waited >= wait_s:
            return {"passed": passed, "below_pct": below_pct, "probe_s": probe_s, "wait_s": wait_s,
                    "waited_s": round(waited, 1), "probes": len(history), "lost_pct": history,
                    "last": {str(c): r for c, r in last.items()}}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cpus", required=True, help="the cores to watch, as taskset takes them")
    ap.add_argument("--below", type=float, required=True, help="percent of a probe the machine may take")
    ap.add_argument("--probe", type=float, default=10.0, help="seconds per probe")
    ap.add_argument("--wait", type=float, default=900.0, help="seconds before going ahead regardless")
    ap.add_argument("--json")
    args = ap.parse_args()
    try:
        cpus = parse_cpus(args.cpus)
    except ValueError as e:
        ap.error(str(e))
    if args.below < 0:
        ap.error("--below must be a percentage, at least 0")
    if args.probe <= 0 or args.wait < 0:
        ap.error("--probe must be positive and --wait at least 0")

    def say(worst, waited, passed):
        verdict = "quiet" if passed else "noisy"
        print(f"{waited:.0f} s: the machine took {worst:.2f}% of CPU {args.cpus} ({verdict}; "
              f"the gate wants at most {args.below}%)", file=sys.stderr, flush=True)

    try:
        result = wait_quiet(cpus, args.below, args.probe, args.wait, on_probe=say)
    except (OSError, ValueError, RuntimeError, subprocess.SubprocessError) as e:
        print(f"quiet_gate: cannot probe CPU {args.cpus}: {e}", file=sys.stderr)
        return 2
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    if not result["passed"]:
        print(f"gave up waiting after {result['waited_s']:.0f} s: going ahead on a noisy machine",
              file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
