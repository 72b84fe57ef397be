//! The proxy's lifecycle: requests open at the proxy (counted by a guard each request's context
//! holds), and draining — what a terminating proxy does so that no client sees it go.
//!
//! | phase | listener | `/readyz` | keep-alive | ends |
//! |---|---|---|---|---|
//! | serving | accepting | 200 | kept | at SIGTERM |
//! | announcing | accepting (no request refused) | 503 `draining` | closed after each response; idle ones at once | after `shutdown.drain_ms` |
//! | finishing | closed | 503 | closed | when no request is open, or after `shutdown.grace_ms` |
//! | closing | closed | 503 | closed | requests still queued (never sent to a replica) are answered 503 `shutting_down` with `Retry-After`; then the rest are cut |

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use prometheus::IntGauge;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

/// Shared by the application, the admin listener and the handle.
#[derive(Debug)]
pub struct Lifecycle {
    draining: AtomicBool,
    /// Cancelled when draining starts: client connections idle between requests close then.
    drain_started: CancellationToken,
    queue_closed: AtomicBool,
    queue_closing: Notify,
    /// Requests waiting for admission now.
    waiting: std::sync::atomic::AtomicI64,
    open: IntGauge,
    closed: Notify,
}

impl Lifecycle {
    /// A serving proxy whose open requests are shown in `open`.
    pub fn new(open: IntGauge) -> Arc<Self> {
        Arc::new(Self {
            draining: AtomicBool::new(false),
            drain_started: CancellationToken::new(),
            queue_closed: AtomicBool::new(false),
            queue_closing: Notify::new(),
            waiting: std::sync::atomic::AtomicI64::new(0),
            open,
            closed: Notify::new(),
        })
    }

    /// Whether the proxy is draining.
    pub fn draining(&self) -> bool {
        self.draining.load(Ordering::Acquire)
    }

    /// Starts draining.
    pub fn start_draining(&self) {
        self.draining.store(true, Ordering::Release);
        self.drain_started.cancel();
    }

    /// Cancelled once draining starts: a client connection idle between requests then closes at
    /// once (a client learns it from the close before it would send another request on it, and
    /// reconnects, through its load balancer, to a proxy that is staying), where it would
    /// otherwise stay open until its keep-alive time or the process's exit.
    pub fn drain_started(&self) -> CancellationToken {
        self.drain_started.clone()
    }

    /// Ends the wait of every request queued at the proxy, now and from now on (see
    /// [`Self::queue_closed`]).
    pub fn close_queue(&self) {
        self.queue_closed.store(true, Ordering::Release);
        self.queue_closing.notify_waiters();
    }

    /// Resolves once the queue is closed: a request waiting for admission then stops waiting.
    pub async fn queue_closed(&self) {
        loop {
            let woken = self.queue_closing.notified();
            if self.queue_closed.load(Ordering::Acquire) {
                return;
            }
            woken.await;
        }
    }

    /// Requests open at the proxy (read, queued, forwarded or being relayed).
    pub fn open(&self) -> i64 {
        self.open.get()
    }

    /// Counts a request open until the guard is dropped.
    pub fn open_request(self: &Arc<Self>) -> OpenRequest {
        self.open.inc();
        OpenRequest(self.clone())
    }

    /// Waits until no request is open.
    pub async fn all_closed(&self) {
        self.open_at_most(0).await;
    }

    /// Waits until at most `n` requests are open.
    pub async fn open_at_most(&self, n: i64) {
        loop {
            let woken = self.closed.notified();
            if self.open.get() <= n {
                return;
            }
            woken.await;
        }
    }

    /// Counts a request waiting for admission until the guard is dropped.
    pub fn waiting_for_admission(self: &Arc<Self>) -> Waiting {
        self.waiting.fetch_add(1, Ordering::AcqRel);
        Waiting(self.clone())
    }

    /// Requests waiting for admission now.
    pub fn waiting(&self) -> i64 {
        self.waiting.load(Ordering::Acquire)
    }
}

/// One request waiting for admission; dropping it ends the wait.
#[derive(Debug)]
pub struct Waiting(Arc<Lifecycle>);

impl Drop for Waiting {
    fn drop(&mut self) {
        self.0.waiting.fetch_sub(1, Ordering::AcqRel);
    }
}

/// One open request; dropping it closes it, whichever way the request ended.
#[derive(Debug)]
pub struct OpenRequest(Arc<Lifecycle>);

impl Drop for OpenRequest {
    fn drop(&mut self) {
        self.0.open.dec();
        // Only a drain waits for requests to close (for a count short of zero too); the
        // notification is skipped on every other request's way out.
        if self.0.draining() || self.0.open.get() <= 0 {
            self.0.closed.notify_waiters();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn waits_for_the_last_open_request() {
        let l = Lifecycle::new(IntGauge::new("open", "open").unwrap());
        let (a, b) = (l.open_request(), l.open_request());
        assert_eq!(l.open(), 2);
        let waiter = tokio::spawn({
            let l = l.clone();
            async move { l.all_closed().await }
        });
        drop(a);
        tokio::task::yield_now().await;
        assert!(!waiter.is_finished());
        drop(b);
        waiter.await.unwrap();
        assert_eq!(l.open(), 0);
        // Nothing open: returns at once.
        l.all_closed().await;
    }
}
