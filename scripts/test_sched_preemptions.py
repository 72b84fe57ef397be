"""Tests of sched_preemptions.py: waits of the proxy's threads and who is charged for them."""
import unittest

import sched_preemptions as sp

# perf sched timehist --state: time (end of the run), cpu, task, wait ms, sch delay ms, run ms, state.
HEADER = """           time    cpu  task name                       wait time  sch delay   run time  state
                        [tid/pid]                          (msec)     (msec)     (msec)
--------------- ------  ------------------------------  ---------  ---------  ---------  -----
"""


def row(end, task, wait, sch, run, state, cpu=1):
    return f"{end:15.6f} [{cpu:04d}]  {task:30s}  {wait:9.3f}  {sch:9.3f}  {run:9.3f}  {state}"


class Waits(unittest.TestCase):
    def result(self, rows, pids={100}):
        return sp.analyse(sp.parse((HEADER + "\n".join(rows)).splitlines()), pids)

    def test_a_preemption_is_charged_to_what_ran_meanwhile(self):
        r = self.result([
            row(10.000100, "worker[101/100]", 0, 0, 0.100, "R"),       # preempted at 10.000100
            row(10.000700, "kdamond.0[83]", 0, 0, 0.600, "S"),         # ran 10.000100-10.000700
            row(10.000800, "worker[101/100]", 0.600, 0, 0.100, "S"),   # back at 10.000700
        ])
        self.assertEqual(r["waits"], 1)
        self.assertAlmostEqual(r["wait_ms"], 0.6, places=3)
        self.assertEqual(r["long_waits"], 1)
        self.assertEqual(list(r["takers"]), ["kdamond.0"])
        self.assertAlmostEqual(r["takers"]["kdamond.0"]["ms"], 0.6, places=3)
        self.assertEqual(r["others"]["kdamond.0"]["long_runs"], 1)

    def test_a_wake_up_delay_with_nothing_running_is_steal_or_idle(self):
        r = self.result([
            row(20.000050, "worker[101/100]", 0, 0, 0.050, "S"),
            # woken at 20.001000, on the core at 20.001300 with nothing else run: 0.3 ms of nothing.
            row(20.001400, "worker[101/100]", 0.950, 0.300, 0.100, "S"),
        ])
        self.assertEqual(r["waits"], 1)
        self.assertAlmostEqual(r["max_wait_ms"], 0.3, places=3)
        self.assertEqual(list(r["takers"]), [sp.NOTHING])
        self.assertEqual(r["long_waits"], 0)

    def test_sleeping_is_not_waiting_and_other_processes_are_not_the_proxy(self):
        r = self.result([
            row(30.000100, "worker[101/100]", 0, 0, 0.100, "S"),
            # 5 ms asleep (wait time, no sch delay): not a wait.
            row(30.005200, "worker[101/100]", 5.000, 0, 0.100, "S"),
            # another process preempted: not the proxy's wait.
            row(30.005300, "nginx[200]", 0, 0, 0.100, "R"),
            row(30.006300, "bash[300]", 0, 0, 1.000, "S"),
            row(30.006400, "nginx[200]", 1.000, 0, 0.100, "S"),
        ])
        self.assertEqual(r["waits"], 0)
        self.assertEqual(r["others"]["nginx"]["runs"], 2)

    def test_a_wait_is_split_between_the_tasks_that_ran_in_it_and_other_cpus_do_not_count(self):
        r = self.result([
            row(40.000100, "worker[101/100]", 0, 0, 0.100, "R"),
            row(40.000300, "ksoftirqd/1[24]", 0, 0, 0.200, "S"),
            row(40.000500, "bash[300]", 0, 0, 5.000, "S", cpu=0),    # another CPU: not charged
            row(40.001100, "Timer thread[102/100]", 0, 0.0, 0.800, "S"),  # the proxy's own thread
            row(40.001200, "worker[101/100]", 1.000, 0, 0.100, "S"),
        ])
        self.assertEqual(r["waits"], 1)
        self.assertAlmostEqual(r["takers"]["ksoftirqd/1"]["ms"], 0.2, places=3)
        self.assertNotIn("bash", r["takers"])
        # The proxy's own other thread is charged like any task, by thread id.
        self.assertAlmostEqual(r["takers"]["Timer thread[102]"]["ms"], 0.8, places=3)
        self.assertNotIn(sp.NOTHING, r["takers"])
        self.assertNotIn("Timer thread", r["others"])
        # And each of the proxy's threads says what it ran and what it waited.
        self.assertEqual(r["threads"]["worker[101]"]["waits"], 1)
        self.assertAlmostEqual(r["threads"]["worker[101]"]["wait_ms"], 1.0, places=3)
        self.assertAlmostEqual(r["threads"]["Timer thread[102]"]["ms"], 0.8, places=3)
        self.assertEqual(r["threads"]["worker[101]"]["run_ms"]["max"], 0.1)
        self.assertEqual(r["threads"]["Timer thread[102]"]["long_runs"], 1)

    def test_idle_is_not_a_task_and_malformed_lines_are_skipped(self):
        r = self.result([
            "garbage line",
            row(50.000100, "<idle>", 0, 0, 3.000, "I"),
            row(50.000200, "worker[101/100]", 0, 0, 0.100, "S"),
        ])
        self.assertNotIn("<idle>", r["others"])
        self.assertEqual(r["waits"], 0)


if __name__ == "__main__":
    unittest.main()
