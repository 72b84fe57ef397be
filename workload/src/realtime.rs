//! Real-time scheduling for the few threads whose wake-ups must be punctual (the simulator's engine
//! steps, the load tester's send dispatcher): on a busy machine a normal thread can wake
//! milliseconds late, a SCHED_FIFO one within tens of microseconds.

/// Asks for SCHED_FIFO at its lowest priority for the calling thread; returns whether it was
/// granted (it needs root or CAP_SYS_NICE). Such threads must sleep most of the time.
pub fn raise_current_thread() -> bool {
    #[cfg(target_os = "linux")]
    {
        use thread_priority::unix::{
            RealtimeThreadSchedulePolicy, ThreadSchedulePolicy, set_thread_priority_and_policy,
            thread_native_id,
        };
        let policy = ThreadSchedulePolicy::Realtime(RealtimeThreadSchedulePolicy::Fifo);
        set_thread_priority_and_policy(
            thread_native_id(),
            thread_priority::ThreadPriority::Min,
            policy,
        )
        .is_ok()
    }
    #[cfg(not(target_os = "linux"))]
    {
        false
    }
}
