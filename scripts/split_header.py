#!/usr/bin/env python3
"""New-connection latency when a request's header arrives whole or in two segments.

Each sample opens a connection, sends one small completion request (max_tokens 1, not streamed)
and times from the connection's opening to the response header's first bytes. A *split* sample
sends the header's first half, waits --gap-us, then the rest with the body: what a client whose
header spans two TCP segments (headers past one segment, a client that writes them piecemeal)
looks like to the proxy. Whole and split samples alternate, on every target in turn, so the
machine's noise falls on all alike. The split's own gap is in every split sample: compare a
proxy's split against the replica's split, not against whole.

  | output column   | meaning                                                         |
  |-----------------|-----------------------------------------------------------------|
  | whole p50 / p99 | ms, header and body in one write                                |
  | split p50 / p99 | ms, header in two writes --gap-us apart                         |
  | split − whole   | ms at p50: what the split costs on this target                  |

usage: split_header.py NAME=HOST:PORT [NAME=HOST:PORT ...] [--n 200] [--gap-us 200] [--json OUT]
"""
import argparse
import json
import socket
import statistics
import time

BODY = json.dumps({"prompt": "hello there", "max_tokens": 1}).encode()


def request():
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
        b"Connection: close\r\nContent-Length: %d\r\n\r\n" % len(BODY)
    )
    return head, BODY


def sample(addr, split, gap):
    head, body = request()
    with socket.create_connection(addr, timeout=10) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        start = time.perf_counter()
        if split:
            half = len(head) // 2
            s.sendall(head[:half])
            time.sleep(gap)
            s.sendall(head[half:] + body)
        else:
            s.sendall(head + body)
        got = b""
        while b"\r\n" not in got:
            chunk = s.recv(65536)
            if not chunk:
                raise RuntimeError(f"{addr}: closed before a response")
            got += chunk
        took = time.perf_counter() - start
    status = got.split(b" ", 2)[1]
    if status != b"200":
        raise RuntimeError(f"{addr}: status {status.decode()}")
    return took * 1000


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("targets", nargs="+", help="NAME=HOST:PORT")
    ap.add_argument("--n", type=int, default=200, help="samples of each kind per target")
    ap.add_argument("--gap-us", type=float, default=200.0)
    ap.add_argument("--json")
    args = ap.parse_args()
    if args.n <= 0 or args.gap_us < 0:
        ap.error("--n must be positive and --gap-us not negative")
    targets = []
    for t in args.targets:
        name, sep, hostport = t.partition("=")
        host, _, port = hostport.rpartition(":")
        if not sep or not host or not port.isdigit():
            ap.error(f"{t!r} is not NAME=HOST:PORT")
        targets.append((name, (host, int(port))))
    times = {name: {"whole": [], "split": []} for name, _ in targets}
    for i in range(args.n):
        for name, addr in targets:
            for kind in ("whole", "split") if i % 2 == 0 else ("split", "whole"):
                times[name][kind].append(sample(addr, kind == "split", args.gap_us / 1e6))
    print(f"{args.n} samples of each, split {args.gap_us:.0f} µs apart; ms from connect to response")
    print("| target | whole p50 / p99 | split p50 / p99 | split − whole p50 |")
    print("|---|---:|---:|---:|")
    summary = {}
    for name, _ in targets:
        w, s = times[name]["whole"], times[name]["split"]
        row = {
            "whole_p50": statistics.median(w), "whole_p99": pct(w, 0.99),
            "split_p50": statistics.median(s), "split_p99": pct(s, 0.99),
        }
        summary[name] = row
        print(f"| {name} | {row['whole_p50']:.2f} / {row['whole_p99']:.2f} | "
              f"{row['split_p50']:.2f} / {row['split_p99']:.2f} | "
              f"{row['split_p50'] - row['whole_p50']:+.2f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"n": args.n, "gap_us": args.gap_us, "targets": summary}, f, indent=1)


if __name__ == "__main__":
    main()
