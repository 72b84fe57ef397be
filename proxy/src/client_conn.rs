//! A client connection between and into its requests: after a response, the connection may stay
//! idle for `timeouts.keepalive_ms` before it is closed, and once the next request's first byte
//! arrives its whole header must follow within `timeouts.header_read_ms` (slowloris). The first
//! request of a plaintext connection is bounded before the connection gets here (a peek in the
//! accept loop); over TLS the bound applies here from the start.
//!
//! ```text
//! phase   Off ──(response done)──▶ Idle ──(first byte)──▶ Header ──(header parsed)──▶ Off
//! Idle    reads past `keepalive_ms` end the connection quietly (end of file: a closed keep-alive)
//! Header  reads past `header_read_ms` from its first byte fail (counted as a slow header)
//! ```
//!
//! The proxy moves the phase from its request phases (a parsed header: `header_parsed`; a finished
//! request: `response_done`) through an atomic the reading side takes on its next read, so a read
//! in the Off phase, every chunk's disconnect watch included, costs one atomic load.

use std::pin::Pin;
use std::sync::atomic::{AtomicU8, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use pingora::protocols::{
    GetProxyDigest, GetSocketDigest, GetTimingDigest, Peek, Shutdown, SocketDigest, Ssl, Stream,
    UniqueID, UniqueIDType,
};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::Sleep;

/// No change asked for.
const KEEP: u8 = 0;
/// A response ended: wait for the next request, at most the keep-alive time.
const ARM_IDLE: u8 = 1;
/// A request header was parsed: stop watching.
const DISARM: u8 = 2;

/// The limits a client connection is held to between its requests.
#[derive(Debug, Clone)]
pub struct ConnLimits {
    /// How long a header may take from its first byte.
    pub header: Duration,
    /// How long a kept-alive connection may wait idle for its next request.
    pub keepalive: Duration,
    /// Counts the connections closed for a slow header.
    pub slow_headers: prometheus::IntCounter,
}

enum Phase {
    Off,
    Idle(Pin<Box<Sleep>>),
    Header(Pin<Box<Sleep>>),
}

/// A client's stream, held to [`ConnLimits`] between and at the start of its requests.
pub struct ClientConn {
    inner: Stream,
    ctl: AtomicU8,
    phase: Phase,
    limits: ConnLimits,
}

impl std::fmt::Debug for ClientConn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let phase = match self.phase {
            Phase::Off => "off",
            Phase::Idle(_) => "idle",
            Phase::Header(_) => "header",
        };
        f.debug_struct("ClientConn")
            .field("inner", &self.inner)
            .field("phase", &phase)
            .finish()
    }
}

impl ClientConn {
    /// `stream` whose first request's header has been bounded already (`header_pending` false)
    /// or must arrive within `limits.header` from now (`true`: a TLS connection).
    pub fn new(stream: Stream, limits: ConnLimits, header_pending: bool) -> Self {
        let phase = if header_pending {
            Phase::Header(Box::pin(tokio::time::sleep(limits.header)))
        } else {
            Phase::Off
        };
        Self {
            inner: stream,
            ctl: AtomicU8::new(KEEP),
            phase,
            limits,
        }
    }

    /// The connection of a pingora stream, when it is one.
    pub fn of(stream: &Stream) -> Option<&ClientConn> {
        stream.as_any().downcast_ref::<ClientConn>()
    }

    /// The request's header was parsed: its reads (body, disconnect watch) are not limited here.
    pub fn header_parsed(&self) {
        self.ctl.store(DISARM, Ordering::Release);
    }

    /// The request ended: the connection may now wait for its next one, for the keep-alive time.
    pub fn response_done(&self) {
        self.ctl.store(ARM_IDLE, Ordering::Release);
    }

    fn take_ctl(&mut self) {
        if self.ctl.load(Ordering::Relaxed) == KEEP {
            return;
        }
        match self.ctl.swap(KEEP, Ordering::Acquire) {
            ARM_IDLE => {
                self.phase = Phase::Idle(Box::pin(tokio::time::sleep(self.limits.keepalive)));
            }
            DISARM => self.phase = Phase::Off,
            _ => {}
        }
    }

    /// The first bytes of the next request start its header's clock. The phase ends only when
    /// the proxy has parsed the header (`header_parsed`): a scan for the blank line would be
    /// fooled by the empty lines a parser skips before a request line.
    fn bytes_arrived(&mut self) {
        if matches!(self.phase, Phase::Idle(_)) {
            self.phase = Phase::Header(Box::pin(tokio::time::sleep(self.limits.header)));
        }
    }
}

impl AsyncRead for ClientConn {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        this.take_ctl();
        if let Phase::Off = this.phase {
            return Pin::new(&mut this.inner).poll_read(cx, buf);
        }
        let before = buf.filled().len();
        match Pin::new(&mut this.inner).poll_read(cx, buf) {
            Poll::Ready(Ok(())) => {
                if buf.filled().len() > before {
                    this.bytes_arrived();
                }
                Poll::Ready(Ok(()))
            }
            Poll::Ready(Err(e)) => Poll::Ready(Err(e)),
            Poll::Pending => match &mut this.phase {
                Phase::Off => Poll::Pending,
                // Idle past the keep-alive time: the end of the connection, as a client closing it.
                Phase::Idle(idle) => match idle.as_mut().poll(cx) {
                    Poll::Ready(()) => Poll::Ready(Ok(())),
                    Poll::Pending => Poll::Pending,
                },
                Phase::Header(deadline) => match deadline.as_mut().poll(cx) {
                    Poll::Ready(()) => {
                        this.limits.slow_headers.inc();
                        Poll::Ready(Err(std::io::Error::new(
                            std::io::ErrorKind::TimedOut,
                            "the request header did not arrive within timeouts.header_read_ms",
                        )))
                    }
                    Poll::Pending => Poll::Pending,
                },
            },
        }
    }
}

impl AsyncWrite for ClientConn {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

#[async_trait::async_trait]
impl Shutdown for ClientConn {
    async fn shutdown(&mut self) {
        self.inner.shutdown().await;
    }
}

impl UniqueID for ClientConn {
    fn id(&self) -> UniqueIDType {
        self.inner.id()
    }
}

impl Ssl for ClientConn {
    fn get_ssl(&self) -> Option<&pingora::protocols::tls::TlsRef> {
        self.inner.get_ssl()
    }

    fn get_ssl_digest(&self) -> Option<std::sync::Arc<pingora::protocols::tls::SslDigest>> {
        self.inner.get_ssl_digest()
    }

    fn selected_alpn_proto(&self) -> Option<pingora::protocols::ALPN> {
        self.inner.selected_alpn_proto()
    }
}

impl GetTimingDigest for ClientConn {
    fn get_timing_digest(&self) -> Vec<Option<pingora::protocols::TimingDigest>> {
        self.inner.get_timing_digest()
    }

    fn get_read_pending_time(&self) -> Duration {
        self.inner.get_read_pending_time()
    }

    fn get_write_pending_time(&self) -> Duration {
        self.inner.get_write_pending_time()
    }
}

impl GetProxyDigest for ClientConn {
    fn get_proxy_digest(
        &self,
    ) -> Option<std::sync::Arc<pingora::protocols::raw_connect::ProxyDigest>> {
        self.inner.get_proxy_digest()
    }

    fn set_proxy_digest(&mut self, digest: pingora::protocols::raw_connect::ProxyDigest) {
        self.inner.set_proxy_digest(digest);
    }
}

impl GetSocketDigest for ClientConn {
    fn get_socket_digest(&self) -> Option<std::sync::Arc<SocketDigest>> {
        self.inner.get_socket_digest()
    }

    fn set_socket_digest(&mut self, digest: SocketDigest) {
        self.inner.set_socket_digest(digest);
    }
}

#[async_trait::async_trait]
impl Peek for ClientConn {
    async fn try_peek(&mut self, buf: &mut [u8]) -> std::io::Result<bool> {
        self.inner.try_peek(buf).await
    }
}
