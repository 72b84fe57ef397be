#!/usr/bin/env python3
"""What a proxy itself adds to each request and each streamed event, read off the wire.

A loopback packet capture of one proxy's traffic holds both of its legs: client <-> proxy and
proxy <-> replica. Each request is matched across the legs by its x-request-id, each SSE event of
its answer by content (in order), and the proxy's residence is the time between the packet that
completed the message on one leg and the packet that completed it on the other:

  residence(request)  = t(last byte of the request to the replica) - t(last byte of the request from the client)
  residence(event k)  = t(last byte of event k to the client) - t(last byte of event k from the replica)
  proxy's TTFT share  = residence(request) + residence(first output-bearing event)

  | input              | meaning                                                            |
  |--------------------|--------------------------------------------------------------------|
  | CAPTURE.pcap       | tcpdump -i lo -s 0 (nanosecond or microsecond timestamps)          |
  | --proxy-port P     | the proxy's listening port: the client leg                         |
  | --replica-port R   | the replica's port: the upstream leg                               |
  | --direct           | no proxy: the client speaks to the replica (only its TTFT is read) |
  | --dropped N        | packets tcpdump reported dropped (only reported; gaps are detected) |
  | --per-request CSV  | also each request's times by x-request-id (µs): request, first      |
  |                    | event, replica's TTFT on the wire                                  |

The replica's TTFT on the wire (its request's last byte in to its first output-bearing event out)
is read in both modes: subtracted from the TTFT a client measured for the same request, it leaves
what the path (the client's own sends and wake-ups, and the proxy's hop) added, without the
replica's own lateness.

On loopback the kernel stamps a packet once, as its sender's system call hands it down, so the
times do not depend on when the capture program, the client or the replica next get a CPU. What
is left between the legs is the proxy's own time: its wake-up, its reads, its work and its writes.
A client measures that plus its own wake-ups, which a proxy on another core makes cross-core ones.

Output: a summary on stdout and, with --json, the distributions (microseconds) for the benchmark's
report. Connections whose capture has a gap (a dropped packet) are counted and left out from the gap.
"""
import argparse
import bisect
import csv
import json
import math
import re
import struct
import sys

MASK = 0xFFFFFFFF


class Flow:
    """One direction of one TCP connection: its bytes in order and when each packet carrying them was
    sent, the first copy and, for bytes sent again (a retransmission), the last."""

    __slots__ = ("next_seq", "parts", "ends", "first", "last", "held", "broken", "size", "resent")

    # Segments that arrive ahead of a gap wait this long (bytes) for it to fill before the gap is
    # taken for a loss.
    HOLD_BYTES = 1 << 20

    def __init__(self, next_seq=None):
        self.next_seq = next_seq
        self.parts, self.ends, self.first, self.last = [], [], [], []
        self.held = {}  # relative sequence -> (ts, payload), segments captured ahead of a gap
        self.broken = False
        self.size = 0
        self.resent = 0

    def add(self, seq, ts, payload):
        if self.broken:
            return
        if self.next_seq is None:
            self.next_seq = seq
        ahead = (seq - self.next_seq) & MASK
        if ahead != 0 and ahead < 1 << 31:
            # Captured ahead of bytes not seen yet: reordered in the capture, or a packet it lost.
            self.held[seq] = (ts, payload)
            if ahead > self.HOLD_BYTES:
                self.broken = True  # a gap that does not fill: the bytes after it cannot be framed
            return
        if ahead != 0:
            behind = (self.next_seq - seq) & MASK
            self.resent += 1
            # Bytes sent again reached their reader with the last copy.
            start = self.size - behind
            k = bisect.bisect_right(self.ends, start)
            while k < len(self.ends) and (k == 0 or self.ends[k - 1] < start + len(payload)):
                self.last[k] = max(self.last[k], ts)
                k += 1
            if behind >= len(payload):
                return
            payload = payload[behind:]
        self.append(ts, payload)
        # Segments held for a gap this one filled.
        while self.held:
            for held_seq, (held_ts, held) in list(self.held.items()):
                behind = (self.next_seq - held_seq) & MASK
                if behind < 1 << 31:  # it starts at or before the next byte wanted
                    del self.held[held_seq]
                    if behind < len(held):
                        self.append(held_ts, held[behind:])
                    break
            else:
                break

    def append(self, ts, payload):
        self.parts.append(payload)
        self.size += len(payload)
        self.ends.append(self.size)
        self.first.append(ts)
        self.last.append(ts)
        self.next_seq = (self.next_seq + len(payload)) & MASK

    def finish(self):
        """Bytes still held for a gap at the end of the capture: the gap was a loss."""
        if self.held:
            self.broken = True

    def data(self):
        return b"".join(self.parts)

    def time_of(self, offset, last=False):
        """When the packet holding byte `offset` was sent (ns): its first copy, or with `last` the
        last one (the copy a reader got)."""
        k = bisect.bisect_right(self.ends, offset)
        return (self.last if last else self.first)[k]


def read_pcap(path, flows):
    """Fills `flows` ((src, sport, dst, dport, connection) -> Flow) from a pcap file; returns the
    packet count."""
    with open(path, "rb") as f:
        buf = f.read()
    if len(buf) < 24:
        raise SystemExit(f"{path}: not a pcap file (shorter than its header)")
    magic = buf[:4]
    formats = {b"\xd4\xc3\xb2\xa1": ("<", 1000), b"\x4d\x3c\xb2\xa1": ("<", 1),
               b"\xa1\xb2\xc3\xd4": (">", 1000), b"\xa1\xb2\x3c\x4d": (">", 1)}
    if magic not in formats:
        raise SystemExit(f"{path}: not a pcap file (magic {magic.hex()}; pcapng is not read: write with tcpdump -w)")
    endian, to_ns = formats[magic]
    linktype = struct.unpack(endian + "I", buf[20:24])[0] & 0xFFFF
    # 1: Ethernet (Linux loopback), 113: Linux cooked, 276: Linux cooked v2, 0: BSD loopback.
    link_len = {1: 14, 113: 16, 276: 20, 0: 4}.get(linktype)
    if link_len is None:
        raise SystemExit(f"{path}: link type {linktype} is not read (capture on lo with tcpdump -i lo)")
    record = struct.Struct(endian + "IIII")
    pos, count, generations = 24, 0, {}
    while pos + 16 <= len(buf):
        sec, frac, incl, orig = record.unpack_from(buf, pos)
        pos += 16
        pkt = buf[pos:pos + incl]
        pos += incl
        if len(pkt) < incl:
            break  # the capture was cut inside its last record
        if incl < orig:
            raise SystemExit(f"{path}: packets cut at {incl} bytes: capture with -s 0")
        count += 1
        ip = pkt[link_len:]
        if not ip:
            continue
        version = ip[0] >> 4
        if version == 4:
            ihl = (ip[0] & 15) * 4
            if ip[9] != 6:
                continue
            # A total length of 0 is a segment larger than 64 KiB (offloaded): its frame's length.
            total = struct.unpack_from("!H", ip, 2)[0] or len(ip)
            src, dst, tcp = ip[12:16], ip[16:20], ip[ihl:total]
        elif version == 6:
            if ip[6] != 6:
                continue  # extension headers are not followed: loopback TCP has none
            total = 40 + struct.unpack_from("!H", ip, 4)[0]
            src, dst, tcp = ip[8:24], ip[24:40], ip[40:total]
        else:
            continue
        if len(tcp) < 20:
            continue
        sport, dport, seq = struct.unpack_from("!HHI", tcp, 0)
        offset = (tcp[12] >> 4) * 4
        flags = tcp[13]
        # A connection's flows are keyed by their addresses and which connection between them it
        # is: a SYN after bytes starts the next one (the same ports, used again).
        pair = (src, sport, dst, dport)
        gen = generations.get(pair, 0)
        flow = flows.get(pair + (gen,))
        if flags & 0x02:  # SYN: data starts one past it
            if flow is not None and (flow.size or flow.held) and flow.next_seq != (seq + 1) & MASK:
                gen = generations[pair] = gen + 1
                flow = None
            if flow is None:
                flow = flows[pair + (gen,)] = Flow()
            flow.next_seq = (seq + 1) & MASK
        if flow is None:
            flow = flows[pair + (gen,)] = Flow()
        payload = tcp[offset:]
        if payload:
            flow.add(seq, sec * 1_000_000_000 + frac * to_ns, payload)
    for flow in flows.values():
        flow.finish()
    return count


def head_end(data, pos):
    end = data.find(b"\r\n\r\n", pos)
    return -1 if end < 0 else end + 4


def headers_of(head):
    lines = head.split(b"\r\n")
    fields = {}
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        fields[name.strip().lower()] = value.strip()
    return lines[0], fields


def chunked_pieces(data, pos):
    """The pieces (raw offset, length) of a chunked body from `pos`, and where the body ends (-1: cut)."""
    pieces = []
    while True:
        line_end = data.find(b"\r\n", pos)
        if line_end < 0:
            return pieces, -1
        size = size_of(data[pos:line_end].split(b";")[0].strip(), 16)
        pos = line_end + 2
        if size == 0:
            # Trailer fields, then the empty line.
            while True:
                line_end = data.find(b"\r\n", pos)
                if line_end < 0:
                    return pieces, -1
                if line_end == pos:
                    return pieces, pos + 2
                pos = line_end + 2
        if pos + size + 2 > len(data):
            pieces.append((pos, min(size, len(data) - pos)))
            return pieces, -1
        pieces.append((pos, size))
        pos += size + 2


class Unreadable(Exception):
    """A connection whose bytes are not HTTP/1.x as this reader knows it."""


def size_of(text, base=10):
    try:
        return int(text, base)
    except ValueError:
        raise Unreadable(f"bad length {text[:20]!r}") from None


def next_head(data, pos):
    """(first line, fields, where the body starts) of the message at `pos`; None if its head is cut."""
    end = head_end(data, pos)
    return None if end < 0 else (*headers_of(data[pos:end - 4]), end)


def is_chunked(fields):
    return fields.get(b"transfer-encoding", b"").lower().endswith(b"chunked")


def requests_of(flow, last):
    """[(x-request-id or None, method, when its last byte was sent)] in order; `last`: the time of
    the last copy of a byte sent more than once (what the proxy got), else the first."""
    data, pos, out = flow.data(), 0, []
    while (head := next_head(data, pos)) is not None:
        line, fields, end = head
        method = line.split(b" ")[0]
        if not method.isalpha():
            break  # not the start of a request: the capture began inside one
        if is_chunked(fields):
            _, body_end = chunked_pieces(data, end)
        else:
            body_end = end + size_of(fields.get(b"content-length", b"0"))
        if body_end < 0 or body_end > len(data):
            break
        rid = fields.get(b"x-request-id")
        out.append((rid.decode() if rid else None, method, flow.time_of(body_end - 1, last)))
        pos = body_end
    return out


EVENT_END = re.compile(rb"\r\n\r\n|\n\n|\r\r")


def events_of(flow, methods, last):
    """[[(event bytes, when its last byte was sent)] per response] in order, `methods` the requests'
    on the connection (a HEAD's answer has no body); non-SSE answers give []."""
    data, pos, out = flow.data(), 0, []
    while (head := next_head(data, pos)) is not None:
        line, fields, end = head
        if not line.startswith(b"HTTP/1."):
            break
        parts = line.split(b" ")
        status = size_of(parts[1]) if len(parts) > 1 else 0
        if 100 <= status < 200:
            pos = end
            continue
        method = methods[len(out)] if len(out) < len(methods) else b""
        if method == b"HEAD" or status in (204, 304):
            pieces, body_end = [], end  # RFC 9112 §6.3: no body, whatever the fields say
        elif is_chunked(fields):
            pieces, body_end = chunked_pieces(data, end)
        elif b"content-length" in fields:
            length = size_of(fields[b"content-length"])
            pieces, body_end = [(end, min(length, len(data) - end))], end + length
        else:
            pieces, body_end = [(end, len(data) - end)], len(data)
        sse = fields.get(b"content-type", b"").lower().startswith(b"text/event-stream")
        events = []
        if sse:
            body = b"".join(data[p:p + n] for p, n in pieces)
            starts, acc = [], 0
            for _, n in pieces:
                starts.append(acc)
                acc += n
            at = 0
            for sep in EVENT_END.finditer(body):
                final = sep.end() - 1  # the event's final byte, mapped back to the wire
                k = bisect.bisect_right(starts, final) - 1
                raw = pieces[k][0] + final - starts[k]
                events.append((body[at:sep.start()], flow.time_of(raw, last)))
                at = sep.end()
        out.append(events)
        if body_end < 0 or body_end > len(data):
            break
        pos = body_end
    return out


def output_bearing(event):
    """An event that carries output: a choice with text, content, reasoning or tool calls."""
    for line in event.splitlines():
        if not line.startswith(b"data:"):
            continue
        payload = line[5:].strip()
        if payload == b"[DONE]":
            return False
        try:
            obj = json.loads(payload)
        except ValueError:
            return False
        choices = obj.get("choices") if isinstance(obj, dict) else None
        for choice in choices if isinstance(choices, list) else []:
            if not isinstance(choice, dict):
                continue
            delta = choice.get("delta") if isinstance(choice.get("delta"), dict) else {}
            if choice.get("text") or any(delta.get(k) for k in ("content", "reasoning_content", "reasoning", "tool_calls")):
                return True
    return False


def legs(flows, port, to_proxy, counts):
    """{x-request-id: (request sent, [(event, t)])} of the connections whose server side is `port`
    (`to_proxy`: the proxy's own port, so its requests come in and its answers go out; a byte sent
    twice counts from the copy that came in, the first that went out). Tallies in `counts`:
    connections not readable as HTTP/1.x, requests without an answer, ids seen more than once (a
    retry, a shadow copy: the answered attempt sent last is kept)."""
    attempts = {}
    for (src, sport, dst, dport, gen), flow in flows.items():
        if dport != port:
            continue
        answers = flows.get((dst, dport, src, sport, gen))
        try:
            reqs = requests_of(flow, last=to_proxy)
            resps = events_of(answers, [m for _, m, _ in reqs], last=not to_proxy) if answers else []
        except Unreadable:
            counts["unreadable"] += 1
            continue
        for i, (rid, _, t) in enumerate(reqs):
            if rid is None:
                continue  # health checks and scrapes
            if i >= len(resps):
                counts["unanswered"] += 1
                continue
            attempts.setdefault(rid, []).append((t, resps[i]))
    out = {}
    for rid, tries in attempts.items():
        counts["repeated_ids"] += len(tries) > 1
        out[rid] = max(tries, key=lambda a: (bool(a[1]), a[0]))
    return out


def summary(xs):
    xs = sorted(xs)
    if not xs:
        return {"n": 0}

    def q(p):
        k = (len(xs) - 1) * p
        f = int(k)
        return xs[f] + (xs[min(f + 1, len(xs) - 1)] - xs[f]) * (k - f)
    return {"n": len(xs), "mean": sum(xs) / len(xs), "p50": q(0.5), "p90": q(0.9), "p99": q(0.99),
            "p999": q(0.999), "max": xs[-1]}


def write_per_request(path, rows):
    """`rows` of (request id, request µs, first event µs, replica's TTFT µs) as CSV at `path`."""
    if not path:
        return
    with open(path, "w") as f:
        f.write("request_id,request_us,first_event_us,replica_ttft_us\n")
        for rid, req, first, replica in rows:
            cell = lambda v: "" if v is None else f"{v:.3f}"
            f.write(f"{rid},{cell(req)},{cell(first)},{cell(replica)}\n")


def direct(args, flows, packets, counts):
    """A capture of a client speaking to the replica itself: each request's TTFT at the replica's
    socket (request's last byte in, first output-bearing event out)."""
    served = legs(flows, args.replica_port, False, counts)
    rows, no_first = [], 0
    for rid, (t_in, up) in served.items():
        first = next((t for e, t in up if output_bearing(e)), None)
        if first is None:
            no_first += 1
            continue
        rows.append((rid, None, None, (first - t_in) / 1000.0))
    result = {
        "packets": packets, "dropped": args.dropped,
        "broken_flows": sum(f.broken for f in flows.values()), "unreadable_connections": counts["unreadable"],
        "requests": len(rows), "unanswered": counts["unanswered"], "repeated_ids": counts["repeated_ids"],
        "requests_without_first_event": no_first, "replica_ttft_us": summary([r[3] for r in rows]),
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    write_per_request(args.per_request, rows)
    s = result["replica_ttft_us"]
    print(f"{packets} packets ({args.dropped} dropped by the kernel, {result['broken_flows']} connection directions "
          f"with a gap); {len(rows)} requests with a first output event ({no_first} without)")
    if rows:
        print(f"the replica's TTFT on the wire: p50 {s['p50']:.1f}, p99 {s['p99']:.1f}, max {s['max']:.1f} µs")
    else:
        sys.exit("no request with an output event was read: is the port right, and does the client send x-request-id?")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("pcap")
    ap.add_argument("--proxy-port", type=int)
    ap.add_argument("--direct", action="store_true")
    ap.add_argument("--per-request", metavar="CSV")
    ap.add_argument("--replica-port", type=int, required=True)
    ap.add_argument("--dropped", type=int, default=0)
    ap.add_argument("--json")
    ap.add_argument("--events", metavar="CSV",
                    help="also write every matched event: when it came in and went out (ns, the capture's "
                         "clock) and how long the proxy held it (µs)")
    ap.add_argument("--slowest", type=int, default=0, metavar="N",
                    help="also list the N slowest events, with when each came in (s from the capture's start)")
    args = ap.parse_args()
    if (args.proxy_port is None) == (not args.direct):
        ap.error("give --proxy-port (a proxy's capture) or --direct (a capture without a proxy)")
    flows = {}
    packets = read_pcap(args.pcap, flows)
    counts = {"unreadable": 0, "unanswered": 0, "repeated_ids": 0}
    if args.direct:
        direct(args, flows, packets, counts)
        return
    client = legs(flows, args.proxy_port, True, counts)
    upstream = legs(flows, args.replica_port, False, counts)
    us = lambda ns: ns / 1000.0
    request_res, first_res, ttft_share, replica_ttft = [], [], [], []
    events_unmatched, requests_unmatched, no_first = 0, 0, 0
    per_request = []  # (request id, request µs, first event µs, replica's TTFT µs)
    waits = []  # every matched event: (held ns, in, out, request id, index on the replica leg)
    for rid, (t_in, down) in client.items():
        if rid not in upstream:
            requests_unmatched += 1
            continue
        t_out, up = upstream[rid]
        request_res.append(us(t_out - t_in))
        j, first = 0, None
        first_up = next((k for k, (e, _) in enumerate(up) if output_bearing(e)), None)
        for event, t_down in down:
            k = j
            while k < len(up) and up[k][0] != event:
                k += 1
            if k == len(up):
                events_unmatched += 1  # one the proxy made or rewrote: the stream goes on
                continue
            j = k
            waits.append((t_down - up[j][1], up[j][1], t_down, rid, j))
            if j == first_up and first is None:
                first = t_down - up[j][1]
            j += 1
        if first is not None:
            first_res.append(us(first))
            ttft_share.append(us(t_out - t_in + first))
            replica_ttft.append(us(up[first_up][1] - t_out))
            per_request.append((rid, request_res[-1], first_res[-1], replica_ttft[-1]))
        else:
            no_first += 1
    # What the slowest events waited behind: the share of them whose time in the proxy spans the
    # moment it forwarded some request (its request path ran on the same core meanwhile), against
    # the share a hold of the same length would span by chance, forwards being a Poisson stream at
    # the capture's mean rate: 1 - exp(-rate * hold).
    forwarded = sorted(t for t, _ in upstream.values())
    rate = (len(forwarded) - 1) / max(forwarded[-1] - forwarded[0], 1) if len(forwarded) > 1 else 0.0

    def spans_a_forward(t_in, t_out):
        k = bisect.bisect_left(forwarded, t_in)
        return k < len(forwarded) and forwarded[k] <= t_out
    cut = sorted(w[0] for w in waits)[int(0.99 * (len(waits) - 1))] if waits else 0
    tail = [w for w in waits if w[0] >= cut]
    share = lambda ws: sum(spans_a_forward(w[1], w[2]) for w in ws) / len(ws) if ws else 0.0
    chance = lambda ws: sum(1 - math.exp(-rate * w[0]) for w in ws) / len(ws) if ws else 0.0
    result = {
        "packets": packets, "dropped": args.dropped,
        "broken_flows": sum(f.broken for f in flows.values()), "unreadable_connections": counts["unreadable"],
        "requests": len(request_res), "requests_unmatched": requests_unmatched,
        "unanswered": counts["unanswered"], "events_unmatched": events_unmatched,
        "request_us": summary(request_res), "first_event_us": summary(first_res),
        "ttft_share_us": summary(ttft_share), "event_us": summary([us(w[0]) for w in waits]),
        "replica_ttft_us": summary(replica_ttft),
        "slowest_1pct_spanning_a_forward": share(tail), "slowest_1pct_by_chance": chance(tail),
        "all_spanning_a_forward": share(waits), "resent_segments": sum(f.resent for f in flows.values()),
        "requests_without_first_event": no_first, "repeated_ids": counts["repeated_ids"],
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    write_per_request(args.per_request, per_request)
    if args.events:
        with open(args.events, "w", newline="") as f:
            out = csv.writer(f)
            out.writerow(["in_ns", "out_ns", "held_us", "request_id", "event"])
            for held, t_in, t_out, rid, k in sorted(waits, key=lambda w: w[1]):
                out.writerow([t_in, t_out, f"{us(held):.3f}", rid, k])
    fmt = lambda s: (f"n {s['n']}, mean {s['mean']:.1f}, p50 {s['p50']:.1f}, p90 {s['p90']:.1f}, p99 {s['p99']:.1f}, "
                     f"p99.9 {s['p999']:.1f}, max {s['max']:.1f} µs") if s["n"] else "none"
    print(f"{packets} packets ({args.dropped} dropped by the kernel, {result['broken_flows']} connection "
          f"directions with a gap, {result['resent_segments']} segments sent again); {len(request_res)} requests "
          f"matched across the legs ({requests_unmatched} not, {result['unanswered']} unanswered, "
          f"{result['repeated_ids']} ids sent more than once, {no_first} without a first output event), "
          f"{events_unmatched} events unmatched, {counts['unreadable']} connections not readable as HTTP/1.x")
    print(f"request, client leg to replica leg: {fmt(result['request_us'])}")
    print(f"first output event, replica leg to client leg: {fmt(result['first_event_us'])}")
    print(f"the proxy's share of TTFT (the two above): {fmt(result['ttft_share_us'])}")
    print(f"every event, replica leg to client leg: {fmt(result['event_us'])}")
    print(f"the replica's TTFT on the wire (request in to first output event out): {fmt(result['replica_ttft_us'])}")
    print(f"events in the slowest 1% that spanned the forwarding of a request: "
          f"{100 * result['slowest_1pct_spanning_a_forward']:.1f}%, against {100 * result['slowest_1pct_by_chance']:.1f}% "
          f"holds as long would span by chance (all events: {100 * result['all_spanning_a_forward']:.1f}%)")
    if args.slowest and waits:
        start = min(min(f.first) for f in flows.values() if f.first)
        print(f"the {args.slowest} slowest events (µs held; s into the capture; request id; event index):")
        for held, t, _, rid, k in sorted(waits, key=lambda w: w[0], reverse=True)[:args.slowest]:
            print(f"  {us(held):9.1f}  {(t - start) / 1e9:8.3f}  {rid}  {k}")
    if not request_res:
        sys.exit("no request was matched across the two legs: are the ports right, and does the proxy pass x-request-id on?")


if __name__ == "__main__":
    main()
