"""Tests of stop_process.py: its schedule, and a real process stopped and let go."""
import json
import os
import subprocess
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import stop_process  # noqa: E402


class Schedule(unittest.TestCase):
    def test_the_same_seed_gives_the_same_instants(self):
        a = stop_process.schedule(30, 500, 3, seed=4)
        self.assertEqual(a, stop_process.schedule(30, 500, 3, seed=4))
        self.assertNotEqual(a, stop_process.schedule(30, 500, 3, seed=5))

    def test_stops_neither_overlap_nor_pass_the_end(self):
        stop_s = 0.003
        starts = stop_process.schedule(20, 5, 3, seed=1)
        self.assertGreater(len(starts), 100)
        for a, b in zip(starts, starts[1:]):
            self.assertGreaterEqual(b - a, stop_s)
        self.assertLessEqual(starts[-1] + stop_s, 20)

    def test_the_mean_gap_is_the_one_asked_for(self):
        # Gaps between stops are exponential with the asked mean, plus the stop itself.
        starts = stop_process.schedule(2000, 100, 1, seed=2)
        mean_gap_ms = 1000 * (starts[-1] - starts[0]) / (len(starts) - 1)
        self.assertAlmostEqual(mean_gap_ms, 101, delta=5)


class OnAProcess(unittest.TestCase):
    def test_a_process_is_stopped_and_let_go(self):
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
        try:
            with tempfile.TemporaryDirectory() as d:
                out = os.path.join(d, "stops.json")
                run = subprocess.run([sys.executable, os.path.join(HERE, "stop_process.py"), "1",
                                      "--pids", str(child.pid), "--every-ms", "50", "--stop-ms", "5",
                                      "--json", out], capture_output=True, text=True, timeout=20)
                self.assertEqual(run.returncode, 0, run.stderr)
                result = json.load(open(out))
            self.assertGreater(result["stops"], 3)
            self.assertTrue(all(s >= 5 for s in result["stopped_ms"]))
            self.assertGreater(result["stopped_frac"], 0)
            # Let go: the process runs (state R or S in /proc, never T).
            state = open(f"/proc/{child.pid}/stat").read().rsplit(")", 1)[1].split()[0]
            self.assertNotEqual(state, "T")
            self.assertIsNone(child.poll())
        finally:
            child.kill()
            child.wait()

    def test_a_core_that_cannot_be_taken_is_a_clear_error(self):
        run = subprocess.run([sys.executable, os.path.join(HERE, "stop_process.py"), "1",
                              "--occupy", "4095"], capture_output=True, text=True, timeout=20)
        self.assertNotEqual(run.returncode, 0)
        self.assertIn("cannot take CPU 4095", run.stderr)

    def test_a_missing_process_is_a_clear_error(self):
        run = subprocess.run([sys.executable, os.path.join(HERE, "stop_process.py"), "1",
                              "--pids", "notapid"], capture_output=True, text=True, timeout=20)
        self.assertNotEqual(run.returncode, 0)
        self.assertIn("--pids must be process ids", run.stderr)


if __name__ == "__main__":
    unittest.main()
