#!/usr/bin/env python3
"""Moves every task and interrupt that may move off some CPUs for a while, and puts them back.

What `isolcpus` or `tuna --isolate` do for a production proxy's cores, for the length of one
benchmark: each thread of the machine whose allowed CPUs include any of --away and also others
loses --away from its mask (kernel threads bound to one CPU cannot move, and are reported), and so
do the unbound kernel workqueues (/sys/devices/virtual/workqueue/cpumask) and each device
interrupt that accepts a new affinity (/proc/irq/N/smp_affinity_list). What was there before is
saved, and --restore puts it back (for the threads still there). Threads started later are placed
by the kernel as usual; the benchmark scripts place their own.

    scripts/isolate_cpus.py --away 1 --save /tmp/masks.json    # prints what moved and what stayed
    scripts/isolate_cpus.py --restore /tmp/masks.json

| parameter | meaning |
|---|---|
| --away | the CPUs to clear, as taskset writes them (1, 2-3, 1,3) |
| --save | where what was there before goes (JSON) |
| --keep | process ids to leave where they are, with their ancestors (the benchmark script: the shell that started it, waiting, must not pass the confinement on to the next thing it starts) |
| --restore | put the masks saved in this file back |
"""
import argparse
import collections
import json
import os
import sys


def cpu_list(text):
    """CPUs of a list as taskset writes it: 1, 0-3, 0,2-3."""
    cpus = set()
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def threads():
    """(pid, tid, name) of every thread on the machine."""
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                with open(f"/proc/{pid}/task/{tid}/comm") as f:
                    name = f.read().strip()
            except OSError:
                continue
            yield int(pid), int(tid), name


def ancestors(pid):
    """`pid` and the processes above it, up to init."""
    chain = set()
    while pid > 1 and pid not in chain:
        chain.add(pid)
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
            pid = int(stat[stat.rfind(")") + 1:].split()[1])
        except (OSError, ValueError, IndexError):
            break
    return chain


def isolate(away, keep):
    """Moves what may move; returns (saved masks, moved count, names of what stayed)."""
    saved, moved, stayed = {}, 0, collections.Counter()
    for pid, tid, name in threads():
        if pid in keep:
            continue
        try:
            mask = os.sched_getaffinity(tid)
        except OSError:
            continue  # gone
        if not mask & away:
            continue
        rest = mask - away
        if not rest:
            stayed[name] += 1  # bound to the CPUs being cleared: a per-CPU kernel thread
            continue
        try:
            os.sched_setaffinity(tid, rest)
        except OSError:
            stayed[name] += 1  # a kernel thread that refuses to move, or one gone meanwhile
            continue
        saved[str(tid)] = sorted(mask)
        moved += 1
    return saved, moved, stayed


WORKQUEUES = "/sys/devices/virtual/workqueue/cpumask"


def hex_mask(cpus):
    return format(sum(1 << c for c in cpus), "x")


def isolate_kernel(away):
    """Clears `away` from the unbound workqueues' mask and every interrupt's that allows it;
    returns what to put back: {"workqueues": hex mask, "irqs": {irq: cpu list text}}."""
    saved = {"irqs": {}, "irqs_stayed": []}
    try:
        with open(WORKQUEUES) as f:
            before = f.read().strip()
        mask = {c for c in range(int(before, 16).bit_length()) if int(before, 16) >> c & 1}
        if mask & away and mask - away:
            with open(WORKQUEUES, "w") as f:
                f.write(hex_mask(mask - away))
            saved["workqueues"] = before
    except (OSError, ValueError):
        pass  # no such file, or not writable: the workqueues stay where they are
    for irq in sorted(os.listdir("/proc/irq")):
        path = f"/proc/irq/{irq}/smp_affinity_list"
        try:
            with open(path) as f:
                before = f.read().strip()
            mask = cpu_list(before)
            if mask & away and mask - away:
                with open(path, "w") as f:
                    f.write(",".join(map(str, sorted(mask - away))))
                saved["irqs"][irq] = before
        except (OSError, ValueError):
            if irq.isdigit():
                saved["irqs_stayed"].append(irq)  # one whose affinity the kernel manages
    return saved


def restore(saved):
    """Puts back each saved mask whose thread is still there, then the kernel's; returns how
    many threads."""
    back = 0
    for tid, mask in saved.get("threads", {}).items():
        try:
            os.sched_setaffinity(int(tid), set(mask))
            back += 1
        except OSError:
            pass  # the thread has ended
    kernel = saved.get("kernel", {})
    for irq, before in kernel.get("irqs", {}).items():
        try:
            with open(f"/proc/irq/{irq}/smp_affinity_list", "w") as f:
                f.write(before)
        except OSError:
            pass
    if "workqueues" in kernel:
        try:
            with open(WORKQUEUES, "w") as f:
                f.write(kernel["workqueues"])
        except OSError:
            pass
    return back


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--away", help="the CPUs to clear (taskset's list form)")
    ap.add_argument("--save", help="where the previous masks are written")
    ap.add_argument("--keep", default="", help="comma-separated process ids to leave alone, with their ancestors")
    ap.add_argument("--restore", help="a file --save wrote: put its masks back")
    a = ap.parse_args()
    if a.restore:
        with open(a.restore) as f:
            saved = json.load(f)
        print(f"put {restore(saved)} of {len(saved.get('threads', {}))} moved threads back, and the "
              f"kernel's workqueues and interrupts", file=sys.stderr)
        return
    if not a.away or not a.save:
        ap.error("give --away and --save, or --restore")
    try:
        away = cpu_list(a.away)
        keep = set().union(*(ancestors(int(p)) for p in a.keep.split(",") if p.strip()))
    except ValueError:
        ap.error(f"--away must be a CPU list like 1 or 2-3, --keep process ids; got {a.away!r}, {a.keep!r}")
    if not away:
        ap.error("--away names no CPU")
    if away - set(range(os.cpu_count() or 0)):
        ap.error(f"--away {a.away} names CPUs this machine does not have")
    saved, moved, stayed = isolate(away, keep)
    kernel = isolate_kernel(away)
    with open(a.save, "w") as f:
        json.dump({"threads": saved, "kernel": kernel}, f)
    bound = ", ".join(f"{n}" + (f" ×{c}" if c > 1 else "") for n, c in sorted(stayed.items()))
    print(f"CPU {a.away}: moved {moved} threads, {len(kernel['irqs'])} interrupts"
          f"{' and the unbound workqueues' if 'workqueues' in kernel else ''} off; "
          f"stayed (bound to it): {bound or 'none'}"
          f"{'; interrupts that stayed: ' + ', '.join(kernel['irqs_stayed']) if kernel['irqs_stayed'] else ''}",
          file=sys.stderr)


if __name__ == "__main__":
    main()
