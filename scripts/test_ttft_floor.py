"""Tests of ttft_floor.py on traces whose unbounded cache can be worked out by hand."""
import json
import os
import subprocess
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import ttft_floor  # noqa: E402


def row(ts, blocks, extra=100):
    return {"timestamp": ts, "input_length": 512 * len(blocks) + extra, "output_length": 5,
            "hash_ids": blocks}


class TtftFloor(unittest.TestCase):
    def run_script(self, *args):
        return subprocess.run([sys.executable, os.path.join(HERE, "ttft_floor.py"), *args],
                              capture_output=True, text=True)

    def test_rank_count_matches_numpy_linear_p99(self):
        # p99 of 1000 values interpolates between the 11th and 10th largest: 11 sit at or above.
        self.assertEqual(ttft_floor.rank_count(1000), 11)
        self.assertEqual(ttft_floor.rank_count(100), 2)
        self.assertEqual(ttft_floor.rank_count(1), 1)

    def test_pick_keeps_only_what_the_pooled_cache_could_not_serve(self):
        # A long first turn, its continuation (cached but for one block), and short cold prompts.
        trace = [row(0, [1, 2, 3, 4, 5, 6])] + [row(1 + i, [100 + i]) for i in range(98)]
        trace.append(row(200, [1, 2, 3, 4, 5, 6, 7]))
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "trace.jsonl")
            with open(path, "w") as f:
                f.writelines(json.dumps(r) + "\n" for r in trace)
            out = self.run_script("pick", path)
        self.assertEqual(out.returncode, 0, out.stderr)
        rows = [json.loads(l) for l in out.stdout.splitlines()]
        # 100 requests: the 2 largest uncached parts are the first turn (6 blocks) and the
        # continuation's one new block with its tail, beside many 1-block prompts.
        self.assertEqual(len(rows), 2)
        self.assertEqual(rows[0]["hash_ids"], [1, 2, 3, 4, 5, 6])
        self.assertEqual(rows[0]["input_length"], 512 * 6 + 100)
        self.assertTrue(all(r["timestamp"] == 0 and r["output_length"] == 1 for r in rows))
        self.assertEqual(rows[1]["input_length"], 612)
        self.assertNotIn(7, rows[0]["hash_ids"])

    def test_floor_is_the_kth_largest_answered_ttft(self):
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "requests.csv")
            with open(path, "w") as f:
                f.write("index,status,ttft_ms\n0,200,900\n1,200,500\n2,500,\n3,200,700\n")
            out = self.run_script("floor", path, "--requests", "100")
            self.assertEqual(out.returncode, 0, out.stderr)
            self.assertEqual(out.stdout.strip(), "700")
            short = self.run_script("floor", path, "--requests", "1000")
            self.assertNotEqual(short.returncode, 0)
            self.assertIn("11 needed", short.stderr)

    def test_a_row_without_hash_ids_is_named(self):
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "trace.jsonl")
            with open(path, "w") as f:
                f.write(json.dumps(row(0, [1])) + "\n" + json.dumps({"timestamp": 1}) + "\n")
            out = self.run_script("pick", path)
        self.assertNotEqual(out.returncode, 0)
        self.assertIn("row 2", out.stderr)


if __name__ == "__main__":
    unittest.main()
