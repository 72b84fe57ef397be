"""Tests of routing_losses.py on small captures whose caches can be worked out by hand."""
import json
import os
import subprocess
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))


def record(ts, blocks, backend, rid):
    return {"timestamp": ts, "input_length": 512 * len(blocks) + 1, "output_length": 1,
            "hash_ids": blocks, "backend": backend, "status": 200, "request_id": rid}


class RoutingLosses(unittest.TestCase):
    def run_script(self, records, log_lines=None, kv_tokens=512 * 8):
        with tempfile.TemporaryDirectory() as d:
            cap = os.path.join(d, "capture.jsonl")
            with open(cap, "w") as f:
                for r in records:
                    f.write(json.dumps(r) + "\n")
            args = [sys.executable, os.path.join(HERE, "routing_losses.py"), cap]
            if log_lines is not None:
                log = os.path.join(d, "serve.log")
                with open(log, "w") as f:
                    f.write("\n".join(log_lines) + "\n")
                args.append(log)
            args += ["--kv-tokens", str(kv_tokens)]
            out = subprocess.run(args, capture_output=True, text=True)
            return out

    def test_a_conversation_split_across_replicas_is_counted_by_why(self):
        # Turn 1 on a, turn 2 (sharing 3 blocks) on b: b held none of it, a held 3 blocks.
        recs = [
            record(0, [1, 2, 3], "a", "r1"),
            record(10, [1, 2, 3, 4], "b", "r2"),
            record(20, [7, 8], "a", "r3"),
            record(30, [7, 8, 9], "a", "r4"),
        ]
        log = ['DEBUG admission displaced the request from its routing choice request_id=r2 '
               'pool=default why="waited" matched_tokens_lost=1536']
        out = self.run_script(recs, log)
        self.assertEqual(out.returncode, 0, out.stderr)
        self.assertIn("displaced (waited): 1 requests, 1,536 tokens", out.stdout)
        self.assertNotIn("spill", out.stdout)
        # Pooled: r2 hits 3 blocks and r4 hits 2; the assignment loses r2's.
        total = sum(r["input_length"] for r in recs)
        self.assertIn(f"pooled LRU (ideal): {100 * 5 * 512 / total:.2f}%", out.stdout)
        self.assertIn(f"the proxy's assignment: {100 * 2 * 512 / total:.2f}%", out.stdout)
        # Without the log the cause is unknown.
        out = self.run_script(recs)
        self.assertIn("elsewhere: 1 requests, 1,536 tokens", out.stdout)

    def test_a_replica_forgets_what_its_capacity_cannot_hold_tail_first(self):
        recs = [
            record(0, [1, 2], "a", "r1"),
            record(1, [5, 6], "a", "r2"),
            record(2, [1, 2, 3], "a", "r3"),
        ]
        total = sum(r["input_length"] for r in recs)
        # Three blocks: r2 evicts r1's tail (block 2), its head stays.
        out = self.run_script(recs, kv_tokens=512 * 3)
        self.assertEqual(out.returncode, 0, out.stderr)
        self.assertIn(f"the proxy's assignment: {100 * 512 / total:.2f}%", out.stdout)
        # Two blocks: r2 evicts all of r1.
        out = self.run_script(recs, kv_tokens=512 * 2)
        self.assertIn("the proxy's assignment: 0.00%", out.stdout)
        self.assertNotIn("sent where fewer", out.stdout)

    def test_bad_input_is_named(self):
        with tempfile.TemporaryDirectory() as d:
            cap = os.path.join(d, "capture.jsonl")
            with open(cap, "w") as f:
                f.write("{not json\n")
            out = subprocess.run([sys.executable, os.path.join(HERE, "routing_losses.py"), cap],
                                 capture_output=True, text=True)
            self.assertNotEqual(out.returncode, 0)
            self.assertIn("cannot read the capture", out.stderr)


if __name__ == "__main__":
    unittest.main()
