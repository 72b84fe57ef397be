#!/usr/bin/env python3
"""The TTFT p99 no routing policy can beat on a trace: its longest prefills, each alone.

    scripts/ttft_floor.py pick TRACE.jsonl [--block-tokens 512] > ROWS.jsonl
    scripts/ttft_floor.py floor REQUESTS.csv --requests N

A request's time to first token is at least its own prefill of the tokens no cache could hold for
it. `pick` replays the trace (Mooncake hash ids, in timestamp order) through an unbounded prefix
cache (one that never forgets: no fleet and no routing can serve more of a prompt from cache) and
writes, for the k requests with the most tokens that cache could not serve, a cold prompt of
just those tokens (their uncached hash ids, timestamp 0, one output token), longest first, where

    i = floor(0.99 · (n − 1))     the 0-based rank p99 interpolates from (numpy's linear method)
    k = n − i                     requests at or above it: p99 ≥ the k-th largest TTFT

`floor` reads what `headroom replay --concurrency 1` measured for those prompts against one idle
replica with prefix caching off, and prints the k-th largest TTFT: with every other request served
instantly and no queueing anywhere, a run's TTFT p99 cannot be lower (a cached prefix still costs
attention, so the true floor is a little higher).
"""
import argparse
import csv
import json
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from routing_losses import Lru, chain, hit  # noqa: E402


def rank_count(n):
    """How many of n values sit at or above the one numpy's linear p99 interpolates from."""
    return n - math.floor(0.99 * (n - 1))


def cold_parts(recs, bt):
    """Each request's tokens an unbounded cache could not serve, as (uncached tokens, row)."""
    pooled = Lru(math.inf)
    out = []
    for r in sorted(recs, key=lambda r: r["timestamp"]):
        k = chain(r, bt)
        cached = hit(r, pooled.depth(k), bt)
        pooled.put(k)
        skip = cached // bt
        row = dict(r)
        row["timestamp"] = 0
        row["output_length"] = 1  # only the first token is timed
        row["input_length"] = r["input_length"] - skip * bt
        row["hash_ids"] = r["hash_ids"][skip:]
        out.append((row["input_length"], row))
    return out


def pick(a):
    try:
        recs = [json.loads(l) for l in open(a.trace) if l.strip()]
    except (OSError, json.JSONDecodeError) as e:
        sys.exit(f"cannot read the trace {a.trace}: {e}")
    if not recs:
        sys.exit(f"{a.trace}: no requests")
    for i, r in enumerate(recs):
        if not all(f in r for f in ("timestamp", "input_length", "hash_ids")):
            sys.exit(f"{a.trace}: row {i + 1} lacks timestamp, input_length or hash_ids")
    parts = cold_parts(recs, a.block_tokens)
    parts.sort(key=lambda p: -p[0])
    for _, row in parts[: rank_count(len(recs))]:
        print(json.dumps(row))


def floor(a):
    try:
        rows = list(csv.DictReader(open(a.requests_csv)))
    except OSError as e:
        sys.exit(f"cannot read {a.requests_csv}: {e}")
    ttfts = sorted((float(r["ttft_ms"]) for r in rows if r.get("status") == "200" and r.get("ttft_ms")),
                   reverse=True)
    k = rank_count(a.requests)
    if len(ttfts) < k:
        sys.exit(f"{a.requests_csv}: {len(ttfts)} answered prompts, {k} needed")
    print(f"{ttfts[k - 1]:.0f}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("pick", help="write the prompts that set the floor")
    p.add_argument("trace")
    p.add_argument("--block-tokens", type=int, default=512)
    p.set_defaults(run=pick)
    f = sub.add_parser("floor", help="the floor from their measured TTFTs, in ms")
    f.add_argument("requests_csv")
    f.add_argument("--requests", type=int, required=True, help="requests in the whole trace")
    f.set_defaults(run=floor)
    a = ap.parse_args()
    a.run(a)


if __name__ == "__main__":
    main()
