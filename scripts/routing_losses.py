#!/usr/bin/env python3
"""Where a prefix-aware policy's hit rate went: replays a headroom capture (the proxy's trace of a
run, in arrival order) through LRU caches of each replica's KV capacity, offline.

    scripts/routing_losses.py CAPTURE.jsonl [SERVE.log] [--kv-tokens N] [--block-tokens 512]

Prints, as shares of all prompt tokens:
  pooled      one LRU of the fleet's combined capacity (the benchmark's ideal, full blocks only)
  assignment  one LRU per replica, each request where the proxy actually sent it, holding its
              blocks from dispatch to its end and then freeing them as the most recent (the
              engine's order): what the routing's choices allow a perfect cache to hit
  sticky      a reference assignment: the replica holding the deepest match when it is at least
              two blocks, else the one with the least uncached prompt tokens over the last 100
              requests (load-aware only through that window)
and the requests that went to a replica holding fewer of their blocks than another did at the
time (by the same offline caches): the tokens lost, split by why when the proxy's debug log
(RUST_LOG=headroom_proxy::forward=debug) is given: displaced by admission (full, queued, waited)
or the routing cost's own choice (spill: the replica holding more had more work queued, or the
proxy's index no longer listed what this offline cache still held).

The capture's hash ids are the proxy's own 512-token-equivalent blocks (keyed per process), so
prefix structure is compared within one capture only.
"""
import argparse
import collections
import json
import re
import sys
from collections import OrderedDict


class Lru:
    def __init__(self, blocks):
        self.cap, self.d, self.held = blocks, OrderedDict(), collections.Counter()

    def depth(self, keys):
        n = 0
        for k in keys:
            if k not in self.d:
                break
            n += 1
        return n

    def put(self, keys, hold=0):
        # A request's blocks become most recent, its last block the first to go (tail first);
        # `hold` +1 while a request runs with them (not evictable), -1 when it ends.
        for k in reversed(keys):
            self.d[k] = True
            self.d.move_to_end(k)
            if hold:
                self.held[k] += hold
                if self.held[k] <= 0:
                    del self.held[k]
        passed = 0
        while len(self.d) > self.cap and passed < len(self.d):
            k = next(iter(self.d))
            if k in self.held:
                self.d.move_to_end(k)
                passed += 1
            else:
                self.d.popitem(last=False)


def chain(rec, bt):
    keys, h = [], 0
    for i in rec["hash_ids"][: rec["input_length"] // bt]:
        h = hash((h, i))
        keys.append(h)
    return keys


def hit(rec, depth, bt):
    return min(depth * bt, rec["input_length"] - 1)


def displaced_from_log(path):
    out = {}
    ansi = re.compile(r"\x1b\[[0-9;]*m")
    for line in open(path, errors="replace"):
        line = ansi.sub("", line)
        if "admission displaced" not in line:
            continue
        rid = re.search(r"request_id=(\S+)", line)
        why = re.search(r'why="?(\w+)', line)
        if rid and why:
            out[rid.group(1)] = why.group(1)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("capture")
    ap.add_argument("serve_log", nargs="?")
    ap.add_argument("--kv-tokens", type=int, default=460_496, help="KV tokens per replica")
    ap.add_argument("--block-tokens", type=int, default=512)
    a = ap.parse_args()
    bt = a.block_tokens
    try:
        recs = [json.loads(l) for l in open(a.capture) if l.strip()]
    except (OSError, json.JSONDecodeError) as e:
        sys.exit(f"cannot read the capture {a.capture}: {e}")
    recs = [r for r in recs if r.get("status") == 200 and r.get("backend") and "shadow" not in r]
    if not recs:
        sys.exit(f"{a.capture}: no answered requests with a backend")
    recs.sort(key=lambda r: r["timestamp"])
    try:
        why = displaced_from_log(a.serve_log) if a.serve_log else {}
    except OSError as e:
        sys.exit(f"cannot read the proxy's log {a.serve_log}: {e}")
    total = sum(r["input_length"] for r in recs)
    backends = sorted({r["backend"] for r in recs})
    blocks = a.kv_tokens // bt

    pooled, hits = Lru(blocks * len(backends)), 0
    for r in recs:
        k = chain(r, bt)
        hits += hit(r, pooled.depth(k), bt)
        pooled.put(k)
    pooled_rate = hits / total

    # In the engine's order: a request holds its blocks from dispatch to its end, then frees them
    # as the most recent (starts before ends at the same instant).
    events = []
    for i, r in enumerate(recs):
        start = r["timestamp"] + (r.get("queue_ms") or 0)
        events.append((start, 0, i))
        events.append((max(start, r["timestamp"] + (r.get("e2e_ms") or 0)), 1, i))
    events.sort()
    caches = {b: Lru(blocks) for b in backends}
    hits, loss, count, worst = 0, collections.Counter(), collections.Counter(), []
    for _, ended, i in events:
        r = recs[i]
        k = chain(r, bt)
        if ended:
            caches[r["backend"]].put(k, hold=-1)
            continue
        depth = {b: c.depth(k) for b, c in caches.items()}
        got, best = hit(r, depth[r["backend"]], bt), hit(r, max(depth.values()), bt)
        hits += got
        if best > got:
            if r.get("request_id") in why:
                cause = f"displaced ({why[r['request_id']]})"
            else:
                # Without the debug log (or with no displacement in it) the two are not told apart.
                cause = "spill" if why else "elsewhere"
            loss[cause] += best - got
            count[cause] += 1
            worst.append((best - got, cause, r.get("request_id"), r["input_length"]))
        caches[r["backend"]].put(k, hold=1)
    assigned_rate = hits / total

    caches, recent, load, hits = [Lru(blocks) for _ in backends], collections.deque(), [0] * len(backends), 0
    for r in recs:
        k = chain(r, bt)
        depth = [c.depth(k) for c in caches]
        deepest = max(depth)
        pool = [i for i, d in enumerate(depth) if d == deepest] if deepest >= 2 else range(len(caches))
        b = min(pool, key=lambda i: load[i])
        hits += hit(r, depth[b], bt)
        caches[b].put(k)
        fresh = r["input_length"] - depth[b] * bt
        recent.append((b, fresh))
        load[b] += fresh
        if len(recent) > 100:
            ob, of = recent.popleft()
            load[ob] -= of
    sticky_rate = hits / total

    pct = lambda x: f"{100 * x:.2f}%"
    of_pooled = lambda x: f"{100 * x / pooled_rate:.0f}% of pooled" if pooled_rate else "nothing to hit"
    print(f"{len(recs)} requests, {total:,} prompt tokens, {len(backends)} replicas of {a.kv_tokens:,} KV tokens")
    print(f"pooled LRU (ideal): {pct(pooled_rate)}; per-replica LRUs, the proxy's assignment: "
          f"{pct(assigned_rate)} ({of_pooled(assigned_rate)}); "
          f"sticky reference: {pct(sticky_rate)} ({of_pooled(sticky_rate)})")
    for cause in sorted(loss):
        print(f"  sent where fewer blocks were cached, {cause}: {count[cause]} requests, "
              f"{loss[cause]:,} tokens ({pct(loss[cause] / total)} of prompt tokens)")
    for w in sorted(worst, reverse=True)[:10]:
        print(f"    lost {w[0]:,} of {w[3]:,} prompt tokens: {w[2]} ({w[1]})")


if __name__ == "__main__":
    main()
