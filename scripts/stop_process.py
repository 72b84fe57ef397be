#!/usr/bin/env python3
"""Stops processes for a fixed time at seeded random instants: a noisy machine, made repeatable.

A proxy on a shared machine is now and then stopped (the hypervisor runs another guest on its
virtual CPU, an interrupt storm, a kernel thread): the streams' chunks and the new requests that
arrive meanwhile wait, and the proxy then drains them. How fast each proxy recovers is what its
tail latencies on a noisy machine come from, and a machine's own pauses differ from round to round.
This sends SIGSTOP to every PID, waits --stop-ms (spinning, for precision), sends SIGCONT, and does
so at instants of a Poisson process with a mean gap of --every-ms (seeded), for SECONDS.

With --occupy CPU it stops nothing: it takes that core itself for --stop-ms at each instant (pinned
there, real-time priority, so whatever ran there waits), writing a byte in each cache line of a
--walk-kib buffer meanwhile, going on where the last stop left off (about half a MiB in 2 ms at
Python's pace: more than the first-level caches, about half a second-level one), so the caches are
left more as another guest or task would leave them than as the stopped program left them. A program whose hot path fits the caches loses only the time; one whose path does not also
pays the misses when it resumes.

  | output       | meaning                                                           |
  |--------------|-------------------------------------------------------------------|
  | stops        | how many times the processes were stopped                         |
  | stopped_ms   | each stop's length, from the first SIGSTOP to the last SIGCONT    |
  | stopped_frac | time stopped / SECONDS                                            |
  | began_unix_s | each stop's start, wall clock (as packet captures stamp packets)  |

usage: stop_process.py SECONDS (--pids P[,P...] | --occupy CPU [--walk-kib 4096])
                       [--every-ms 500] [--stop-ms 3] [--seed 1] [--json OUT]
With --pids, run it off the stopped processes' cores (it sleeps while they are stopped, and spins
only the last 0.2 ms); --occupy needs the right to real-time priority (root, or CAP_SYS_NICE).
"""
import argparse
import json
import os
import random
import signal
import sys
import time


def schedule(seconds, every_ms, stop_ms, seed):
    """Start instants (s from the beginning) of the stops: Poisson arrivals with a mean gap of
    every_ms, each stop ending before the next starts and before SECONDS."""
    rng = random.Random(seed)
    starts, t = [], 0.0
    while True:
        t += rng.expovariate(1000.0 / every_ms)
        if t + stop_ms / 1000.0 > seconds:
            return starts
        starts.append(t)
        t += stop_ms / 1000.0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("seconds", type=float)
    how = ap.add_mutually_exclusive_group(required=True)
    how.add_argument("--pids", help="comma-separated process ids to stop")
    how.add_argument("--occupy", type=int, metavar="CPU", help="take this core instead")
    ap.add_argument("--walk-kib", type=int, default=4096)
    ap.add_argument("--every-ms", type=float, default=500.0)
    ap.add_argument("--stop-ms", type=float, default=3.0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json")
    args = ap.parse_args()
    if args.seconds <= 0 or args.every_ms <= 0 or args.stop_ms <= 0:
        ap.error("SECONDS, --every-ms and --stop-ms must be positive")
    pids = []
    if args.pids is not None:
        try:
            pids = [int(p) for p in args.pids.split(",") if p]
        except ValueError:
            ap.error(f"--pids must be process ids, got {args.pids!r}")
        if not pids:
            ap.error("--pids names no process")
    else:
        try:
            os.sched_setaffinity(0, {args.occupy})
            os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(50))
        except (OSError, ValueError) as e:
            raise SystemExit(f"stop_process.py: cannot take CPU {args.occupy} at real-time priority: {e}")
    # One byte in every cache line of the walk, written, going on where the last stop left off: the
    # lines the stopped work had are gone.
    walk = bytearray(max(args.walk_kib, 1) * 1024)
    line = 0
    # Terminated or hung up: the stopped processes are let go all the same (the finally below).
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda n, _: sys.exit(128 + n))
    clock = time.perf_counter
    begin = clock()
    stopped, began = [], []
    try:
        for at in schedule(args.seconds, args.every_ms, args.stop_ms, args.seed):
            wait = begin + at - clock()
            if wait > 0:
                time.sleep(wait)
            t0 = clock()
            began.append(time.time())
            for p in pids:
                os.kill(p, signal.SIGSTOP)
            until = t0 + args.stop_ms / 1000.0
            if pids:
                # Asleep, not spinning, for all but the stop's last 0.2 ms: the stopper must not
                # take the core it runs on (the load generator's, the replica's) from them.
                rest = until - clock() - 0.0002
                if rest > 0:
                    time.sleep(rest)
            while clock() < until:
                if not pids:
                    # 64 lines between looks at the clock: the walk, not the clock, takes the time.
                    for _ in range(64):
                        walk[line] = (walk[line] + 1) & 0xFF
                        line = (line + 64) % len(walk)
            for p in pids:
                os.kill(p, signal.SIGCONT)
            stopped.append((clock() - t0) * 1000.0)
    except ProcessLookupError as e:
        raise SystemExit(f"stop_process.py: a process is gone: {e}")
    finally:
        # Never leave a process stopped, however this ends.
        for p in pids:
            try:
                os.kill(p, signal.SIGCONT)
            except ProcessLookupError:
                pass
    total = clock() - begin
    result = {
        "seconds": total, "every_ms": args.every_ms, "stop_ms": args.stop_ms, "seed": args.seed,
        "how": "stop" if pids else f"occupy CPU {args.occupy}, walking through {args.walk_kib} KiB",
        "stops": len(stopped), "stopped_ms": [round(s, 3) for s in stopped],
        "began_unix_s": [round(t, 6) for t in began],
        "stopped_frac": sum(stopped) / 1000.0 / total if total > 0 else 0.0,
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    print(f"{len(stopped)} stops of {args.stop_ms:g} ms (longest {max(stopped, default=0):.2f} ms) in "
          f"{total:.1f} s, {100 * result['stopped_frac']:.2f}% of the time")


if __name__ == "__main__":
    main()
