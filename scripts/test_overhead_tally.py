"""Tests of overhead_tally.py on run directories laid out as bench-overhead.sh writes them."""
import io
import json
import os
import sys
import tempfile
import unittest
from contextlib import redirect_stdout

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import overhead_tally  # noqa: E402


def make_run(root, name, build, ratio, headroom, nginx):
    """A run directory: summary.md naming the build and the CPU ratio, and one wire.json per round
    with the given (TTFT share p99, every event p99) in µs."""
    run = os.path.join(root, name)
    os.makedirs(run)
    with open(os.path.join(run, "summary.md"), "w") as f:
        f.write(f"load: 200 req/s; warm-up 5 s per path; headroom build: {build}\n\n")
        if ratio is not None:
            f.write(f"headroom CPU per chunk / nginx's: {ratio:.2f}×\n")
    for proxy, rounds in (("headroom", headroom), ("nginx", nginx)):
        for i, (share, event) in enumerate(rounds, 1):
            d = os.path.join(run, f"{proxy}-{i}")
            os.makedirs(d)
            with open(os.path.join(d, "wire.json"), "w") as f:
                json.dump({"ttft_share_us": {"p99": share}, "event_us": {"p99": event}}, f)
    return run


class Tally(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.root = self.tmp.name

    def tearDown(self):
        self.tmp.cleanup()

    def test_counts_rounds_within_each_target_and_takes_medians(self):
        a = make_run(self.root, "a", "target/pgo/headroom", 1.01,
                     [(336, 199), (352, 139), (2051, 362)], [(293, 209), (205, 188), (396, 264)])
        b = make_run(self.root, "b", "target/release-lto/headroom", 1.14,
                     [(626, 244), (415, 165)], [(191, 127), (313, 176)])
        t = overhead_tally.tally([overhead_tally.run_rounds(a), overhead_tally.run_rounds(b)],
                                 1000, 200)
        self.assertEqual(list(t), ["headroom, target/pgo/headroom",
                                   "headroom, target/release-lto/headroom", "nginx"])
        pgo = t["headroom, target/pgo/headroom"]
        self.assertEqual((pgo["rounds"], pgo["share_within"], pgo["event_within"]), (3, 2, 2))
        self.assertEqual((pgo["share_p99_median"], pgo["event_p99_median"]), (352, 199))
        self.assertEqual(pgo["cpu_ratios"], [1.01])
        ngx = t["nginx"]
        # nginx's rounds of both runs, pooled.
        self.assertEqual((ngx["rounds"], ngx["share_within"], ngx["event_within"]), (5, 5, 3))
        self.assertEqual(ngx["event_p99_median"], 188)

    def test_a_target_is_held_at_its_value_and_thresholds_are_settable(self):
        a = make_run(self.root, "a", "x", None, [(1000, 200)], [(1001, 201)])
        t = overhead_tally.tally([overhead_tally.run_rounds(a)], 1000, 200)
        self.assertEqual((t["headroom, x"]["share_within"], t["headroom, x"]["event_within"]), (1, 1))
        self.assertEqual((t["nginx"]["share_within"], t["nginx"]["event_within"]), (0, 0))
        t = overhead_tally.tally([overhead_tally.run_rounds(a)], 2000, 300)
        self.assertEqual((t["nginx"]["share_within"], t["nginx"]["event_within"]), (1, 1))
        self.assertEqual(t["headroom, x"]["cpu_ratios"], [None])

    def test_names_put_one_build_run_from_two_paths_in_one_column(self):
        a = make_run(self.root, "a", "target/pgo/headroom", 1.0, [(300, 150)], [(200, 100)])
        b = make_run(self.root, "b", "/tmp/copy", 1.2, [(500, 250)], [(200, 100)])
        out = io.StringIO()
        with redirect_stdout(out):
            overhead_tally.main(["--name", "target/pgo/headroom=trained", "--name",
                                 "/tmp/copy=trained", a, b])
        text = out.getvalue()
        self.assertIn("headroom, trained (2 rounds)", text)
        self.assertIn("nginx (2 rounds)", text)
        self.assertIn("| 1.00, 1.20 |", text)
        self.assertNotIn("/tmp/copy", text)

    def test_a_run_without_the_wire_reading_is_refused_by_name(self):
        a = make_run(self.root, "a", "x", 1.0, [(300, 150)], [(200, 100)])
        os.remove(os.path.join(a, "nginx-1", "wire.json"))
        with self.assertRaises(SystemExit) as e:
            overhead_tally.run_rounds(a)
        self.assertIn("WIRE=1", str(e.exception))
        with self.assertRaises(SystemExit) as e:
            overhead_tally.run_rounds(os.path.join(self.root, "nothing"))
        self.assertIn("summary.md", str(e.exception))

    def test_a_bad_name_is_an_error(self):
        with self.assertRaises(SystemExit), redirect_stdout(io.StringIO()), \
                open(os.devnull, "w") as devnull:
            sys.stderr, saved = devnull, sys.stderr
            try:
                overhead_tally.main(["--name", "no-equals", self.root])
            finally:
                sys.stderr = saved


if __name__ == "__main__":
    unittest.main()
