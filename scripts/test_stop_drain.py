"""Tests of stop_drain.py on events whose holds are laid out around known stops."""
import csv
import json
import os
import subprocess
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import stop_drain  # noqa: E402

MS = 1_000_000


def laid_out(stops_at_ms, drain_ms, every_us=100):
    """An event every `every_us` for 1 s; 40 µs held, except within a stop (2 ms, held to its end
    plus 100 µs) and for `drain_ms` after it (held 500 µs)."""
    events = []
    for t_us in range(0, 1_000_000, every_us):
        t = t_us * 1000
        held = 40.0
        for s in stops_at_ms:
            since = (t - s * MS) / MS
            if 0 <= since < 2:
                held = (2 - since) * 1000 + 100
            elif 2 <= since < 2 + drain_ms:
                held = 500.0
        events.append((t, held))
    return events


class Drain(unittest.TestCase):
    def test_the_curve_shows_the_stop_the_backlog_and_the_recovery(self):
        stops_at = [100, 300, 500, 700]
        r = stop_drain.drain(laid_out(stops_at, drain_ms=1.5), [(s * MS, 2.0) for s in stops_at])
        by_start = {b["from_ms"]: b for b in r["bins"]}
        self.assertEqual(r["stops"], 4)
        # During the stop, an event waits for its end: from 2.1 ms down to just over 0.1 ms.
        self.assertGreater(by_start[0]["mean_us"], 1500)
        self.assertLess(by_start[1.5]["mean_us"], 500)
        # The backlog after it, then the ordinary hold: back at 3.5 ms.
        self.assertEqual(by_start[2.5]["mean_us"], 500)
        self.assertEqual(by_start[3.5]["mean_us"], 40)
        self.assertEqual(r["recovered_ms"], 3.5)
        self.assertEqual((r["away"]["p50_us"], r["away"]["p99_us"]), (40, 40))
        # Each stop's window is 12 ms: 120 events at one per 100 µs; the 10 of the millisecond
        # before each stop are set aside (held through it); the rest are away.
        self.assertEqual(sum(b["events"] for b in r["bins"]), 4 * 120)
        self.assertEqual(r["away"]["events"], 10_000 - 4 * 130)

    def test_stops_that_ran_a_little_over_and_one_long_one_do_not_move_the_recovery(self):
        # Measured lengths run over the asked 2 ms (the stopper's signals); one ran to 3.2 ms.
        stops_at = [100, 300, 500, 700]
        # No backlog after them: the proxy is back as each stop ends.
        events = laid_out(stops_at, drain_ms=0)
        measured = [(s * MS, ms) for s, ms in zip(stops_at, (2.02, 2.03, 2.01, 3.2))]
        self.assertEqual(stop_drain.drain(events, measured, stop_ms=2.0)["recovered_ms"], 2.0)
        # Without the asked length, the median measured one (2.03 ms): the first bin after it.
        self.assertEqual(stop_drain.drain(events, measured)["recovered_ms"], 2.5)

    def test_a_stop_soon_after_another_keeps_its_wait_to_itself(self):
        # Stops 6 ms apart: the second one's wait must not show in the first one's 6–8 ms bin.
        stops_at = [100, 106, 500]
        r = stop_drain.drain(laid_out(stops_at, drain_ms=1.0), [(s * MS, 2.0) for s in stops_at])
        by_start = {b["from_ms"]: b for b in r["bins"]}
        self.assertEqual(by_start[6]["mean_us"], 40)
        self.assertGreater(by_start[0]["mean_us"], 1500)

    def test_a_slower_drain_recovers_later(self):
        stops_at = [100, 400, 700]
        fast = stop_drain.drain(laid_out(stops_at, 1.0), [(s * MS, 2.0) for s in stops_at])
        slow = stop_drain.drain(laid_out(stops_at, 3.0), [(s * MS, 2.0) for s in stops_at])
        self.assertLess(fast["recovered_ms"], slow["recovered_ms"])

    def test_the_script_reads_what_wire_latency_and_stop_process_write(self):
        stops_at = [200, 600]
        with tempfile.TemporaryDirectory() as d:
            events, stops, out = (os.path.join(d, n) for n in ("events.csv", "stops.json", "drain.json"))
            with open(events, "w", newline="") as f:
                w = csv.writer(f)
                w.writerow(["in_ns", "out_ns", "held_us", "request_id", "event"])
                base = 1_700_000_000 * 10**9
                for t, held in laid_out(stops_at, 1.0):
                    w.writerow([base + t, base + t + int(held * 1000), f"{held:.3f}", "r", 0])
            with open(stops, "w") as f:
                json.dump({"stop_ms": 2.0, "stopped_ms": [2.02, 2.04],
                           "began_unix_s": [(base + s * MS) / 1e9 for s in stops_at]}, f)
            p = subprocess.run([sys.executable, os.path.join(HERE, "stop_drain.py"), events, stops,
                                "--json", out], capture_output=True, text=True)
            self.assertEqual(p.returncode, 0, p.stderr)
            with open(out) as f:
                r = json.load(f)
            self.assertEqual((r["stops"], r["recovered_ms"]), (2, 3.0))
            # Stops without their instants are refused with a clear message.
            with open(stops, "w") as f:
                json.dump({"stopped_ms": [2.0]}, f)
            p = subprocess.run([sys.executable, os.path.join(HERE, "stop_drain.py"), events, stops],
                               capture_output=True, text=True)
            self.assertNotEqual(p.returncode, 0)
            self.assertIn("no stop instants", p.stderr)


if __name__ == "__main__":
    unittest.main()
