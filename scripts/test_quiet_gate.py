"""Tests of quiet_gate.py: the CPU list, when the gate opens and when it gives up."""
import json
import os
import subprocess
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import quiet_gate  # noqa: E402


def probes_losing(*percents):
    """A probe that finds the machine taking each percentage in turn, on every core asked."""
    left = list(percents)

    def probe(cpus, seconds):
        pct = left.pop(0)
        return {c: {"lost_fraction": pct / 100, "pauses": 1, "max_ms": 0.1} for c in cpus}
    return probe


class CpuList(unittest.TestCase):
    def test_single_ranges_and_lists(self):
        self.assertEqual(quiet_gate.parse_cpus("0"), [0])
        if (os.cpu_count() or 1) >= 2:
            self.assertEqual(quiet_gate.parse_cpus("0-1"), [0, 1])
            self.assertEqual(quiet_gate.parse_cpus("1,0,1"), [0, 1])

    def test_bad_lists_are_named(self):
        for bad in ("", "a", "1-", "3-1", "0,,1", "1-2-3", "4095"):
            with self.assertRaises(ValueError) as e:
                quiet_gate.parse_cpus(bad)
            self.assertIn("CPU", str(e.exception))


class Gate(unittest.TestCase):
    def test_it_opens_on_the_first_quiet_probe(self):
        seen = []
        r = quiet_gate.wait_quiet([0, 1], 0.3, 3, 900, on_probe=lambda *a: seen.append(a),
                                  probe_with=probes_losing(2.0, 0.8, 0.25, 0.1))
        self.assertTrue(r["passed"])
        self.assertEqual(r["probes"], 3)
        self.assertEqual(r["lost_pct"], [2.0, 0.8, 0.25])
        self.assertEqual([passed for _, _, passed in seen], [False, False, True])
        self.assertEqual(sorted(r["last"]), ["0", "1"])

    def test_the_worst_core_decides(self):
        def one_noisy_core(cpus, seconds):
            return {c: {"lost_fraction": 0.02 if c == 1 else 0.0} for c in cpus}
        r = quiet_gate.wait_quiet([0, 1], 0.3, 3, 0, probe_with=one_noisy_core)
        self.assertFalse(r["passed"])
        self.assertEqual(r["lost_pct"], [2.0])

    def test_it_gives_up_after_the_wait_and_says_so(self):
        r = quiet_gate.wait_quiet([0], 0.3, 3, 0, probe_with=probes_losing(1.5))
        self.assertFalse(r["passed"])
        self.assertEqual(r["probes"], 1)

    def test_a_probe_at_the_threshold_passes(self):
        r = quiet_gate.wait_quiet([0], 0.3, 3, 0, probe_with=probes_losing(0.3))
        self.assertTrue(r["passed"])


class Exit(unittest.TestCase):
    """main()'s exit status and its record, with the probe stood in for."""

    def run_main(self, probe, *args):
        saved_probe, saved_argv = quiet_gate.probe, sys.argv
        quiet_gate.probe = probe
        try:
            with tempfile.TemporaryDirectory() as d:
                out = os.path.join(d, "quiet.json")
                sys.argv = ["quiet_gate.py", "--cpus", "0", "--below", "0.3", "--json", out, *args]
                status = quiet_gate.main()
                with open(out) as f:
                    return status, json.load(f)
        finally:
            quiet_gate.probe, sys.argv = saved_probe, saved_argv

    def test_giving_up_exits_3_and_records_it(self):
        status, r = self.run_main(probes_losing(1.5), "--wait", "0")
        self.assertEqual(status, 3)
        self.assertFalse(r["passed"])
        self.assertEqual(r["lost_pct"], [1.5])

    def test_a_quiet_probe_exits_0(self):
        status, r = self.run_main(probes_losing(0.1), "--wait", "0")
        self.assertEqual(status, 0)
        self.assertTrue(r["passed"])


class Command(unittest.TestCase):
    def run_gate(self, *args):
        return subprocess.run([sys.executable, os.path.join(HERE, "quiet_gate.py"), *args],
                              capture_output=True, text=True, timeout=60)

    def test_a_real_probe_opens_a_gate_that_allows_everything(self):
        with tempfile.TemporaryDirectory() as d:
            out = os.path.join(d, "quiet.json")
            cpu = str(min(os.sched_getaffinity(0)))
            run = self.run_gate("--cpus", cpu, "--below", "100", "--probe", "0.2", "--json", out)
            self.assertEqual(run.returncode, 0, run.stderr)
            with open(out) as f:
                r = json.load(f)
        self.assertTrue(r["passed"])
        self.assertEqual(r["probes"], 1)
        self.assertGreater(r["last"][cpu]["seconds"], 0.19)
        self.assertIn("quiet", run.stderr)

    def test_bad_arguments_are_clear_errors(self):
        for args, says in ((["--cpus", "x", "--below", "1"], "not a CPU list"),
                           (["--cpus", "4095", "--below", "1"], "no CPU 4095"),
                           (["--cpus", "0", "--below", "-1"], "at least 0"),
                           (["--cpus", "0", "--below", "1", "--wait", "-1"], "--wait"),
                           (["--cpus", "0", "--below", "1", "--probe", "0"], "--probe must be positive")):
            run = self.run_gate(*args)
            self.assertEqual(run.returncode, 2, args)
            self.assertIn(says, run.stderr)


if __name__ == "__main__":
    unittest.main()
