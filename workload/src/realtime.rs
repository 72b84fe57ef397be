//! A real-time scheduling class for the few threads whose wake-ups must be punctual (the
//! simulator's engine steps, the load tester's send dispatcher): on a busy machine a normal thread
//! can wake milliseconds late, a SCHED_FIFO one within tens of microseconds.

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
