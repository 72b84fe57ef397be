//! Scheduling classes for the threads whose timing matters: real-time for the few whose wake-ups
//! must be punctual (the simulator's engine steps, the load tester's send dispatcher): on a busy
//! machine a normal thread can wake milliseconds late, a SCHED_FIFO one within tens of
//! microseconds; idle for work done ahead of time (the load tester's body builder), which must
//! never take a core from the threads that send and read.

/// Asks for SCHED_FIFO at its lowest priority for the calling thread; returns whether it was
/// granted (it needs root or CAP_SYS_NICE). Such threads must sleep most of the time.
pub fn raise_current_thread() -> bool {
    #[cfg(target_os = "linux")]
    {
        use thread_priority::unix::{RealtimeThreadSchedulePolicy, ThreadSchedulePolicy};
        set_current(ThreadSchedulePolicy::Realtime(
            RealtimeThreadSchedulePolicy::Fifo,
        ))
    }
    #[cfg(not(target_os = "linux"))]
    {
        false
    }
}

/// Puts the calling thread in SCHED_IDLE: it runs only on a core nothing else wants, so work done
/// ahead of time (building request bodies) never delays the threads that send and read on their
/// schedule. Needs no privileges; returns whether it was applied.
pub fn lower_current_thread() -> bool {
    #[cfg(target_os = "linux")]
    {
        use thread_priority::unix::{NormalThreadSchedulePolicy, ThreadSchedulePolicy};
        set_current(ThreadSchedulePolicy::Normal(
            NormalThreadSchedulePolicy::Idle,
        ))
    }
    #[cfg(not(target_os = "linux"))]
    {
        false
    }
}

/// The calling thread under `policy` at that policy's lowest priority.
#[cfg(target_os = "linux")]
fn set_current(policy: thread_priority::unix::ThreadSchedulePolicy) -> bool {
    thread_priority::unix::set_thread_priority_and_policy(
        thread_priority::unix::thread_native_id(),
        thread_priority::ThreadPriority::Min,
        policy,
    )
    .is_ok()
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use thread_priority::unix::{
        NormalThreadSchedulePolicy, ThreadSchedulePolicy, thread_schedule_policy,
    };

    #[test]
    fn a_lowered_thread_runs_in_the_idle_class_and_others_do_not() {
        let (lowered, policy) = std::thread::spawn(|| {
            let lowered = super::lower_current_thread();
            (
                lowered,
                thread_schedule_policy().expect("reading the policy"),
            )
        })
        .join()
        .expect("the thread ran");
        assert!(lowered, "SCHED_IDLE needs no privileges");
        assert_eq!(
            policy,
            ThreadSchedulePolicy::Normal(NormalThreadSchedulePolicy::Idle)
        );
        // Only the calling thread changed.
        assert_eq!(
            thread_schedule_policy().expect("reading the policy"),
            ThreadSchedulePolicy::Normal(NormalThreadSchedulePolicy::Other)
        );
    }
}
