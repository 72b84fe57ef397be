"""Tests of wire_latency.py on captures written here, packet by packet, with known send times."""
import csv
import json
import os
import struct
import subprocess
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
CLIENT, PROXY, PROXY_OUT, REPLICA = 50000, 8000, 40000, 9000


class Capture:
    """A loopback pcap (nanosecond stamps, Ethernet framing as Linux writes lo) built in order."""

    def __init__(self):
        self.records = []
        self.seq = {}

    def send(self, t, sport, dport, payload, skip=False, seq=None, flags=0x18):
        """`payload` from sport to dport at `t` seconds; `skip` leaves the packet out (a drop), `seq`
        sends it at a sequence number of its own (a reordered or repeated segment)."""
        if seq is None:
            seq = self.seq.get((sport, dport), 1000)
            self.seq[(sport, dport)] = seq + len(payload) + (1 if flags & 0x02 else 0)
        if skip:
            return seq
        self.frame(t, sport, dport, seq, flags, payload)
        return seq

    def frame(self, t, sport, dport, seq, flags, payload):
        tcp = struct.pack("!HHIIBBHHH", sport, dport, seq, 0, 5 << 4, flags, 65535, 0, 0)
        ip = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + len(tcp) + len(payload), 0, 0, 64, 6, 0,
                         bytes([127, 0, 0, 1]), bytes([127, 0, 0, 1]))
        frame = bytes(12) + b"\x08\x00" + ip + tcp + payload
        ns = round(t * 1e9)
        self.records.append(struct.pack("<IIII", ns // 10**9, ns % 10**9, len(frame), len(frame)) + frame)

    def write(self, path):
        with open(path, "wb") as f:
            f.write(struct.pack("<IHHiIII", 0xA1B23C4D, 2, 4, 0, 0, 262144, 1))
            f.writelines(self.records)


def chunk(data):
    return b"%x\r\n%s\r\n" % (len(data), data)


ROLE = b'data: {"choices":[{"delta":{"role":"assistant"}}]}\n\n'
OUTPUT = b'data: {"choices":[{"text":"a"}]}\n\n'
USAGE = b'data: {"choices":[],"usage":{"completion_tokens":1}}\n\n'
DONE = b"data: [DONE]\n\n"
SSE_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


def one_stream(cap, drop_upstream_role=False):
    """A request through the proxy and its stream; the proxy cuts the usage chunk."""
    request = b'POST /v1/completions HTTP/1.1\r\nx-request-id: r1\r\ncontent-length: 2\r\n\r\n'
    cap.send(1.000000, CLIENT, PROXY, request)
    cap.send(1.000010, CLIENT, PROXY, b"{}")
    cap.send(1.000150, PROXY_OUT, REPLICA, request + b"{}")
    # A health probe on its own connection: no request id, left out.
    cap.send(1.000200, PROXY_OUT + 1, REPLICA, b"GET /health HTTP/1.1\r\ncontent-length: 0\r\n\r\n")
    cap.send(1.000300, REPLICA, PROXY_OUT + 1, b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
    cap.send(1.020000, REPLICA, PROXY_OUT, SSE_HEAD)
    cap.send(1.020100, REPLICA, PROXY_OUT, chunk(ROLE), skip=drop_upstream_role)
    # The output event arrives in two packets: it is complete with the second.
    out = chunk(OUTPUT)
    cap.send(1.020200, REPLICA, PROXY_OUT, out[:9])
    cap.send(1.020300, REPLICA, PROXY_OUT, out[9:])
    cap.send(1.030000, REPLICA, PROXY_OUT, chunk(USAGE))
    cap.send(1.031000, REPLICA, PROXY_OUT, chunk(DONE) + b"0\r\n\r\n")
    cap.send(1.020050, PROXY, CLIENT, SSE_HEAD)
    cap.send(1.020150, PROXY, CLIENT, chunk(ROLE))
    cap.send(1.020400, PROXY, CLIENT, chunk(OUTPUT))
    cap.send(1.031200, PROXY, CLIENT, chunk(DONE) + b"0\r\n\r\n")


def run(cap, *extra):
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "wire.pcap")
        cap.write(path)
        out = os.path.join(d, "wire.json")
        p = subprocess.run([sys.executable, os.path.join(HERE, "wire_latency.py"), path, "--proxy-port", str(PROXY),
                            "--replica-port", str(REPLICA), "--json", out, *extra], capture_output=True, text=True)
        if not os.path.exists(out):
            return p, None
        with open(out) as f:
            return p, json.load(f)


def run_direct(cap, *extra):
    """wire_latency.py --direct on `cap`: (process, json, per-request CSV lines)."""
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "wire.pcap")
        cap.write(path)
        out, rows = os.path.join(d, "wire.json"), os.path.join(d, "requests.csv")
        p = subprocess.run([sys.executable, os.path.join(HERE, "wire_latency.py"), path, "--direct",
                            "--replica-port", str(REPLICA), "--json", out, "--per-request", rows, *extra],
                           capture_output=True, text=True)
        if not os.path.exists(out):
            return p, None, None
        with open(out) as f, open(rows) as g:
            return p, json.load(f), g.read().splitlines()


class WireLatency(unittest.TestCase):
    def test_a_capture_without_a_proxy_gives_each_requests_ttft_at_the_replica(self):
        cap = Capture()
        request = b'POST /v1/completions HTTP/1.1\r\nx-request-id: d1\r\ncontent-length: 2\r\n\r\n'
        cap.send(2.000000, CLIENT, REPLICA, request)
        cap.send(2.000020, CLIENT, REPLICA, b"{}")
        cap.send(2.020000, REPLICA, CLIENT, SSE_HEAD)
        cap.send(2.020100, REPLICA, CLIENT, chunk(ROLE))
        cap.send(2.020500, REPLICA, CLIENT, chunk(OUTPUT))
        cap.send(2.031000, REPLICA, CLIENT, chunk(DONE) + b"0\r\n\r\n")
        p, r, rows = run_direct(cap)
        self.assertEqual(p.returncode, 0, p.stderr)
        self.assertEqual(r["requests"], 1)
        # From the request's last byte to the first output-bearing event (the role-only one is not).
        self.assertAlmostEqual(r["replica_ttft_us"]["p50"], 20500 - 20, places=3)
        self.assertEqual(rows, ["request_id,request_us,first_event_us,replica_ttft_us", "d1,,,20480.000"])
        # A proxy's port and --direct together are refused, as is neither.
        p, _, _ = run_direct(cap, "--proxy-port", str(PROXY))
        self.assertNotEqual(p.returncode, 0)

    def one_stream_writing(self, option):
        """One stream's capture read with `option FILE`: the summary and FILE's lines."""
        cap = Capture()
        one_stream(cap)
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "out.csv")
            p, r = run(cap, option, path)
            self.assertEqual(p.returncode, 0, p.stderr)
            with open(path) as f:
                return r, f.read().splitlines()

    def test_each_requests_times_are_written_by_its_id(self):
        _, lines = self.one_stream_writing("--per-request")
        self.assertEqual(lines[1], "r1,140.000,100.000,20150.000")

    def test_every_event_is_written_in_the_order_it_came_in(self):
        r, lines = self.one_stream_writing("--events")
        rows = list(csv.DictReader(lines))
        self.assertEqual(len(rows), r["event_us"]["n"])
        self.assertEqual([x["held_us"] for x in rows], ["50.000", "100.000", "200.000"])
        for x in rows:
            self.assertAlmostEqual((int(x["out_ns"]) - int(x["in_ns"])) / 1000, float(x["held_us"]), places=3)
        self.assertEqual({x["request_id"] for x in rows}, {"r1"})

    def test_residences_are_read_from_the_packets_that_complete_each_message(self):
        cap = Capture()
        one_stream(cap)
        p, r = run(cap)
        self.assertEqual(p.returncode, 0, p.stderr)
        self.assertEqual((r["requests"], r["events_unmatched"], r["broken_flows"]), (1, 0, 0))
        # The request: its body's packet in, the forwarded request's packet out.
        self.assertAlmostEqual(r["request_us"]["p50"], 150 - 10, places=3)
        # Role 50 µs, the output event 100 µs (from its second packet), [DONE] 200 µs; the usage
        # chunk the proxy cut is not matched to anything.
        self.assertEqual(r["event_us"]["n"], 3)
        self.assertAlmostEqual(r["event_us"]["max"], 200, places=3)
        self.assertAlmostEqual(r["event_us"]["p50"], 100, places=3)
        self.assertAlmostEqual(r["first_event_us"]["p50"], 100, places=3)
        self.assertAlmostEqual(r["ttft_share_us"]["p50"], 240, places=3)
        self.assertAlmostEqual(r["replica_ttft_us"]["p50"], 20300 - 150, places=3)

    def test_a_dropped_packet_is_counted_and_what_follows_it_is_left_out(self):
        cap = Capture()
        one_stream(cap, drop_upstream_role=True)
        p, r = run(cap)
        self.assertEqual(r["broken_flows"], 1)
        self.assertEqual(r["event_us"]["n"], 0)
        # Every event the client got is counted as unmatched, and the request as one without a
        # first output event.
        self.assertEqual(r["events_unmatched"], 3)
        self.assertEqual(r["requests_without_first_event"], 1)

    def test_a_capture_without_matching_requests_fails_clearly(self):
        cap = Capture()
        cap.send(1.0, CLIENT, PROXY, b"GET /v1/models HTTP/1.1\r\n\r\n")
        p, _ = run(cap)
        self.assertNotEqual(p.returncode, 0)
        self.assertIn("no request was matched", p.stderr)

    def test_a_file_that_is_not_a_pcap_is_refused(self):
        with tempfile.NamedTemporaryFile(suffix=".pcap") as f:
            f.write(b"\x0a\x0d\x0d\x0a" + bytes(40))
            f.flush()
            p = subprocess.run([sys.executable, os.path.join(HERE, "wire_latency.py"), f.name,
                                "--proxy-port", "1", "--replica-port", "2"], capture_output=True, text=True)
        self.assertNotEqual(p.returncode, 0)
        self.assertIn("pcapng is not read", p.stderr)


    def test_reordered_and_resent_segments_are_put_back_in_order_and_timed_by_their_reader(self):
        cap = Capture()
        request = b"POST /v1/completions HTTP/1.1\r\nx-request-id: r1\r\ncontent-length: 2\r\n\r\n{}"
        cap.send(1.0, CLIENT, PROXY, request)
        cap.send(1.0001, PROXY_OUT, REPLICA, request)
        cap.send(1.02, REPLICA, PROXY_OUT, SSE_HEAD)
        first = chunk(OUTPUT)
        # The replica's output event is captured after the [DONE] behind it, and sent twice: the
        # proxy got it with the second copy.
        at = cap.send(1.0201, REPLICA, PROXY_OUT, first, skip=True)
        cap.send(1.0300, REPLICA, PROXY_OUT, chunk(DONE) + b"0\r\n\r\n")
        cap.frame(1.0202, REPLICA, PROXY_OUT, at, 0x18, first)
        cap.frame(1.0250, REPLICA, PROXY_OUT, at, 0x18, first)
        cap.send(1.02005, PROXY, CLIENT, SSE_HEAD)
        cap.send(1.0252, PROXY, CLIENT, chunk(OUTPUT))
        cap.send(1.0301, PROXY, CLIENT, chunk(DONE) + b"0\r\n\r\n")
        p, r = run(cap)
        self.assertEqual(p.returncode, 0, p.stderr)
        self.assertEqual((r["broken_flows"], r["resent_segments"], r["event_us"]["n"]), (0, 1, 2))
        self.assertAlmostEqual(r["first_event_us"]["p50"], 200, places=3)
        self.assertAlmostEqual(r["event_us"]["max"], 200, places=3)

    def test_a_reused_connection_head_answers_crlf_events_rewritten_events_and_repeated_ids(self):
        cap = Capture()
        head = b"HEAD /health HTTP/1.1\r\nx-request-id: h1\r\ncontent-length: 0\r\n\r\n"
        cap.send(1.0, CLIENT, PROXY, head)
        cap.send(1.0001, PROXY_OUT, REPLICA, head)
        # A HEAD answer names a length but has no body: the next answer follows at once.
        cap.send(1.0002, REPLICA, PROXY_OUT, b"HTTP/1.1 200 OK\r\ncontent-length: 500\r\n\r\n")
        cap.send(1.0003, PROXY, CLIENT, b"HTTP/1.1 200 OK\r\ncontent-length: 500\r\n\r\n")
        request = b"POST /v1/chat/completions HTTP/1.1\r\nx-request-id: r2\r\ncontent-length: 2\r\n\r\n{}"
        cap.send(1.1, CLIENT, PROXY, request)
        # A first attempt refused on another connection, then the one answered on the pooled one.
        cap.send(1.1001, PROXY_OUT + 7, REPLICA, request)
        cap.send(1.1002, REPLICA, PROXY_OUT + 7, b"HTTP/1.1 503 Busy\r\ncontent-length: 0\r\n\r\n")
        cap.send(1.1003, PROXY_OUT, REPLICA, request)
        crlf = b"data: {\"choices\":[{\"delta\":{\"content\":\"x\"}}]}\r\n\r\n"
        cap.send(1.12, REPLICA, PROXY_OUT, SSE_HEAD + chunk(crlf))
        cap.send(1.13, REPLICA, PROXY_OUT, chunk(DONE) + b"0\r\n\r\n")
        cap.send(1.1201, PROXY, CLIENT, SSE_HEAD + chunk(crlf))
        # An event the proxy made itself (a comment), then [DONE]: the stream is still matched.
        cap.send(1.1250, PROXY, CLIENT, chunk(b": made here\n\n"))
        cap.send(1.1302, PROXY, CLIENT, chunk(DONE) + b"0\r\n\r\n")
        # The client's port used again for a new connection: a SYN starts it.
        cap.send(1.2, CLIENT, PROXY, b"", flags=0x02, seq=5)
        again = b"POST /v1/completions HTTP/1.1\r\nx-request-id: r3\r\ncontent-length: 2\r\n\r\n{}"
        cap.frame(1.2001, CLIENT, PROXY, 6, 0x18, again)
        cap.send(1.2002, PROXY_OUT, REPLICA, again)
        cap.send(1.22, REPLICA, PROXY_OUT, SSE_HEAD + chunk(OUTPUT) + chunk(DONE) + b"0\r\n\r\n")
        cap.send(1.2, PROXY, CLIENT, b"", flags=0x12, seq=77)
        cap.frame(1.2205, PROXY, CLIENT, 78, 0x18, SSE_HEAD + chunk(OUTPUT) + chunk(DONE) + b"0\r\n\r\n")
        p, r = run(cap)
        self.assertEqual(p.returncode, 0, p.stderr)
        self.assertEqual((r["requests"], r["unanswered"], r["repeated_ids"]), (3, 0, 1))
        self.assertEqual((r["events_unmatched"], r["requests_without_first_event"]), (1, 1))
        # r2's answered attempt went 300 µs after the client's last byte (the refused one 100 µs),
        # its CRLF event 100 µs after the replica's; r3, on the new connection, 100 and 500 µs.
        self.assertAlmostEqual(r["request_us"]["max"], 300, places=3)
        self.assertEqual(sorted((r["ttft_share_us"]["p50"], r["ttft_share_us"]["max"])), [500, 600])


if __name__ == "__main__":
    unittest.main()
