//! Scheduling classes for the few threads that need one: real time for those whose wake-ups must
//! be punctual (the simulator's engine steps, the load tester's send dispatcher), batch for
//! background writers that must not cut into the threads relaying streams (the trace capture).
//!
//! On a busy machine a normal thread can wake milliseconds late, a SCHED_FIFO one within tens of
//! microseconds. A SCHED_BATCH thread keeps its fair share of the CPU (its nice value is kept) but
//! its wake-ups never preempt a running normal thread: it runs when that thread next blocks or at
//! the next scheduler tick.

/// Asks for SCHED_FIFO at its lowest priority for the calling thread; returns whether it was
/// granted (it needs root or CAP_SYS_NICE). Such threads must sleep most of the time.
pub fn raise_current_thread() -> bool {
    #[cfg(target_os = "linux")]
    {
        use thread_priority::unix::{RealtimeThreadSchedulePolicy, ThreadSchedulePolicy};
        set_current(
            thread_priority::ThreadPriority::Min,
            ThreadSchedulePolicy::Realtime(RealtimeThreadSchedulePolicy::Fifo),
        )
    }
    #[cfg(not(target_os = "linux"))]
    {
        false
    }
}

/// Puts the calling thread in SCHED_BATCH at nice 0; returns whether it is now there (any thread
/// may ask). A thread of a process started at another nice value is left as it is (its nice is
/// the operator's choice, and raising it back needs privileges), as is every thread off Linux.
pub fn lower_current_thread() -> bool {
    #[cfg(target_os = "linux")]
    {
        use thread_priority::unix::{NormalThreadSchedulePolicy, ThreadSchedulePolicy};
        if current_thread_sched() != Some((0, SCHED_OTHER)) {
            return false;
        }
        // The crate sets a normal policy's nice from a 0-99 scale, on which nice 0 is 46-48.
        set_current(
            thread_priority::ThreadPriority::Crossplatform(
                47u8.try_into().expect("47 is on the 0-99 scale"),
            ),
            ThreadSchedulePolicy::Normal(NormalThreadSchedulePolicy::Batch),
        );
        current_thread_sched() == Some((0, SCHED_BATCH))
    }
    #[cfg(not(target_os = "linux"))]
    {
        false
    }
}

#[cfg(target_os = "linux")]
const SCHED_OTHER: u32 = 0;
#[cfg(target_os = "linux")]
const SCHED_BATCH: u32 = 3;

/// The calling thread under `policy` at `priority`.
#[cfg(target_os = "linux")]
fn set_current(
    priority: thread_priority::ThreadPriority,
    policy: thread_priority::unix::ThreadSchedulePolicy,
) -> bool {
    thread_priority::unix::set_thread_priority_and_policy(
        thread_priority::unix::thread_native_id(),
        priority,
        policy,
    )
    .is_ok()
}

/// The calling thread's nice value and scheduling policy (see [`sched_of_stat`]).
#[cfg(target_os = "linux")]
pub fn current_thread_sched() -> Option<(i32, u32)> {
    sched_of_stat(&std::fs::read_to_string("/proc/thread-self/stat").ok()?)
}

/// A thread's nice value and scheduling policy (0 normal, 3 batch) from the text of its
/// `/proc/…/stat`: fields 19 and 41, counted from 1; the command name before them, in
/// parentheses, may hold spaces and parentheses itself.
pub fn sched_of_stat(stat: &str) -> Option<(i32, u32)> {
    let fields: Vec<&str> = stat
        .get(stat.rfind(')')? + 1..)?
        .split_whitespace()
        .collect();
    // fields[0] is field 3 (the state).
    Some((fields.get(16)?.parse().ok()?, fields.get(38)?.parse().ok()?))
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use super::*;

    #[test]
    fn a_lowered_thread_is_in_the_batch_class_at_its_nice_value() {
        let (before, after) = std::thread::spawn(|| {
            let before = current_thread_sched().expect("this thread's stat");
            let lowered = lower_current_thread();
            (
                before,
                (lowered, current_thread_sched().expect("this thread's stat")),
            )
        })
        .join()
        .unwrap();
        if before == (0, SCHED_OTHER) {
            assert_eq!(after, (true, (0, SCHED_BATCH)));
        } else {
            // Run under another nice value or class: left as it was.
            assert_eq!(after, (false, before));
        }
        // Only the thread that asked.
        assert_eq!(current_thread_sched().map(|(_, p)| p), Some(before.1));
    }
}
