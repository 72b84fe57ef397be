#!/usr/bin/env python3
"""What kept a proxy from running on its own core: its threads' run-queue waits, and who ran then.

Reads a scheduler trace of the proxy's cores (`perf sched record -C CPUS`, as bench-overhead.sh's
SCHED=1 takes during each proxy round) through `perf sched timehist --state`, and for every thread
of the given processes adds up the time it was runnable but not running:

    wait(switch-in) = off-CPU time   if the thread left the CPU runnable (state R: preempted)
                    = sch delay      otherwise (from its wake-up to its switch-in)

Each wait is charged to the tasks that ran on that CPU inside it, by their run time there (the
proxy's own other threads included; the idle task and hypervisor steal are not tasks: the part of
a wait nothing ran in is charged to "(nothing: steal or idle)", which includes the switch itself).
Also reported: each of the proxy's threads' runs on the core (one wake-up to its next wait, as
percentiles, and how many lasted over 0.5 ms: what arrives meanwhile waits for the whole run),
and every other task's run time on the traced CPUs, with how many of its runs were over 0.5 ms.

    perf sched record -C 1 -o sched.data -- sleep 15
    scripts/sched_preemptions.py sched.data --pids 1234,1240 [--json out.json]
    scripts/sched_preemptions.py --timehist timehist.txt --pids 1234   # text already produced

| parameter | meaning |
|---|---|
| --pids | the proxy's process ids (every thread of each counts as the proxy) |
| --long-us | a wait or another task's run counted as long from here (500 µs) |
"""
import argparse
import bisect
import collections
import json
import subprocess
import sys

NOTHING = "(nothing: steal or idle)"


def parse(lines):
    """Rows of `perf sched timehist --state`: (end s, cpu, name, tid, pid, wait ms, sch ms, run ms, state)."""
    rows = []
    for line in lines:
        f = line.split()
        if len(f) < 7 or not f[1].startswith("["):
            continue
        try:
            end, wait, sch, run = float(f[0]), float(f[-4]), float(f[-3]), float(f[-2])
            cpu = int(f[1].strip("[]"))
        except ValueError:
            continue
        task = " ".join(f[2:-4])
        name, _, ids = task.partition("[")
        ids = ids.rstrip("]")
        tid, _, pid = ids.partition("/")
        try:
            tid = int(tid) if tid else -1
            pid = int(pid) if pid else tid
        except ValueError:
            tid = pid = -1
        rows.append((end, cpu, name or task, tid, pid, wait, sch, run, f[-1]))
    return rows


def analyse(rows, pids, long_us=500.0):
    long_ms = long_us / 1e3
    # cpu -> every task's runs there, in time order (runs on one CPU do not overlap, so their
    # ends and starts are both sorted): [end], [(start, end, name)].
    ends, runs_on = collections.defaultdict(list), collections.defaultdict(list)
    last_state = {}
    waits = []  # (cpu, start, end, the waiting thread)
    others = collections.defaultdict(lambda: {"runs": 0, "ms": 0.0, "long_runs": 0})
    # The proxy's threads one by one (name[tid]): their runs on the core (a wake-up to the next
    # wait or preemption: a long one is a stretch all the thread serves waits behind), and waits.
    threads = collections.defaultdict(lambda: {"run_list": [], "waits": 0, "wait_ms": 0.0})
    for end, cpu, name, tid, pid, wait, sch, run, state in rows:
        start = end - run / 1e3
        if name == "<idle>":
            continue
        if pid in pids:
            # The proxy's own other threads (a capture writer, a timer, a second worker) can keep
            # a worker off the core too: they are charged like any task, by thread.
            name = f"{name}[{tid}]"
            t = threads[name]
            t["run_list"].append(run)
            delay = wait if last_state.get(tid) == "R" else sch
            if delay > 0:
                waits.append((cpu, start - delay / 1e3, start, name))
                t["waits"] += 1
                t["wait_ms"] += delay
            last_state[tid] = state
        else:
            o = others[name]
            o["runs"] += 1
            o["ms"] += run
            o["long_runs"] += run > long_ms
        ends[cpu].append(end)
        runs_on[cpu].append((start, end, name))
    # What ran in each wait, by waiting thread: a worker held back is latency, a background thread
    # waiting for the worker is not.
    takers_of = collections.defaultdict(lambda: collections.defaultdict(lambda: {"times": 0, "ms": 0.0}))

    def charge(waiter, name, ms):
        t = takers_of[waiter][name]
        t["times"] += 1
        t["ms"] += ms

    for cpu, lo, hi, waiter in waits:
        charged = 0.0
        runs = runs_on[cpu]
        for k in range(bisect.bisect_right(ends[cpu], lo), len(runs)):
            start, end, name = runs[k]
            if start >= hi:
                break
            overlap = min(end, hi) - max(start, lo)
            if overlap > 0 and name != waiter:
                charge(waiter, name, overlap * 1e3)
                charged += overlap
        rest = (hi - lo) - charged
        if rest > 1e-6:
            charge(waiter, NOTHING, rest * 1e3)
    takers = collections.defaultdict(lambda: {"times": 0, "ms": 0.0})
    for by_taker in takers_of.values():
        for name, w in by_taker.items():
            takers[name]["times"] += w["times"]
            takers[name]["ms"] += w["ms"]
    for name, t in threads.items():
        t["takers"] = dict(sorted(takers_of[name].items(), key=lambda kv: -kv[1]["ms"]))
        runs = sorted(t.pop("run_list"))
        t["runs"], t["ms"] = len(runs), sum(runs)
        t["run_ms"] = {q: runs[min(len(runs) - 1, int(len(runs) * f))]
                       for q, f in (("p50", 0.5), ("p99", 0.99), ("p99.9", 0.999))}
        t["run_ms"]["max"] = runs[-1]
        t["long_runs"] = sum(r > long_ms for r in runs)
    ms = sorted((hi - lo) * 1e3 for _, lo, hi, _ in waits)
    return {
        "waits": len(ms),
        "wait_ms": sum(ms),
        "long_waits": sum(m > long_ms for m in ms),
        "max_wait_ms": ms[-1] if ms else 0.0,
        "long_us": long_us,
        "takers": dict(sorted(takers.items(), key=lambda kv: -kv[1]["ms"])),
        "others": dict(sorted(others.items(), key=lambda kv: -kv[1]["ms"])),
        "threads": dict(sorted(threads.items(), key=lambda kv: -kv[1]["ms"])),
    }


def render(r, top=6):
    lines = [f"proxy runnable but not running: {r['waits']} waits, {r['wait_ms']:.1f} ms in all, "
             f"{r['long_waits']} over {r['long_us']:.0f} µs, longest {r['max_wait_ms']:.2f} ms"]
    for name, t in list(r["takers"].items())[:top]:
        lines.append(f"  meanwhile {name}: {t['times']} times, {t['ms']:.1f} ms")
    lines.append("the proxy's threads on its cores:")
    for name, t in r["threads"].items():
        q = t["run_ms"]
        lines.append(f"  {name}: {t['runs']} runs, {t['ms']:.1f} ms (each p50 {q['p50']:.3f}, p99 {q['p99']:.3f}, "
                     f"p99.9 {q['p99.9']:.3f}, max {q['max']:.3f} ms; {t['long_runs']} over {r['long_us']:.0f} µs); "
                     f"{t['waits']} waits, {t['wait_ms']:.1f} ms")
        for taker, w in list(t["takers"].items())[:top]:
            lines.append(f"    behind {taker}: {w['times']} times, {w['ms']:.1f} ms")
    lines.append("other tasks on the proxy's cores:")
    for name, o in list(r["others"].items())[:top]:
        lines.append(f"  {name}: {o['runs']} runs, {o['ms']:.1f} ms, {o['long_runs']} over {r['long_us']:.0f} µs")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("data", nargs="?", help="perf sched record output (perf.data)")
    ap.add_argument("--timehist", help="the text of `perf sched timehist --state` instead of a perf.data")
    ap.add_argument("--pids", required=True, help="the proxy's process ids, comma-separated")
    ap.add_argument("--long-us", type=float, default=500.0)
    ap.add_argument("--json", help="also write the result here")
    a = ap.parse_args()
    try:
        pids = {int(p) for p in a.pids.split(",") if p.strip()}
    except ValueError:
        ap.error(f"--pids must be comma-separated process ids, got {a.pids!r}")
    if not pids:
        ap.error("--pids names no process")
    if a.timehist:
        text = open(a.timehist).read()
    elif a.data:
        done = subprocess.run(["perf", "sched", "timehist", "--state", "-i", a.data],
                              capture_output=True, text=True)
        if done.returncode != 0:
            sys.exit(f"perf sched timehist failed on {a.data}: {done.stderr.strip()}")
        text = done.stdout
    else:
        ap.error("give a perf.data file or --timehist")
    rows = parse(text.splitlines())
    if not any(r[4] in pids for r in rows):
        sys.exit(f"no thread of processes {sorted(pids)} ran in the trace")
    result = analyse(rows, pids, a.long_us)
    print(render(result))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
