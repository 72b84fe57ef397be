//! A client connection between and into its requests: after a response, the connection may stay
//! idle for `timeouts.keepalive_ms` before it is closed, and once the next request's first byte
//! arrives its whole header must follow within `timeouts.header_read_ms` (slowloris). The first
//! request of a plaintext connection is bounded before the connection gets here
//! ([`ConnLimits::read_first_header`]: the accept loop reads the header as it arrives and the
//! connection replays those bytes first; a header longer than what is read up front brings what is
//! left of its time here); over TLS the bound applies here from the start.
//!
//! ```text
//! phase   Off ──(response done)──▶ Idle ──(first byte)──▶ Header ──(header parsed)──▶ Off
//! Idle    reads past `keepalive_ms`, or once the proxy starts draining, end the connection
//!         quietly (end of file: a closed keep-alive)
//! Header  reads past `header_read_ms` from its first byte fail (counted as a slow header)
//! ```
//!
//! The proxy moves the phase from its request phases (a parsed header: `header_parsed`; a finished
//! request: `response_done`) through an atomic the reading side takes on its next read, so a read
//! in the Off phase, a relayed chunk's disconnect watch included, costs one atomic load. (A relay
//! in a task of its own watches through its [`RelayClient`] instead.)
//!
//! A plaintext connection holds its socket itself (not pingora's stream around it), so the relay
//! can write a stream's chunks straight to it ([`ClientConn::write_chunk`]) while pingora holds
//! the connection: the chunk costs one `writev` and no pass through pingora's body writer.

use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::{Arc, OnceLock};
use std::task::{Context, Poll};
use std::time::{Duration, SystemTime};

use pingora::protocols::{
    GetProxyDigest, GetSocketDigest, GetTimingDigest, Peek, Shutdown, SocketDigest, Ssl, Stream,
    UniqueID, UniqueIDType,
};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, ReadBuf};
use tokio::time::Sleep;
use tokio_util::sync::WaitForCancellationFutureOwned;

/// No change asked for.
const KEEP: u8 = 0;
/// A response ended: wait for the next request, at most the keep-alive time.
const ARM_IDLE: u8 = 1;
/// A request header was parsed: stop watching.
const DISARM: u8 = 2;

/// The limits a client connection is held to at its start and between its requests.
#[derive(Debug, Clone)]
pub struct ConnLimits {
    /// How long a header may take from its first byte (a new connection's first header, or its
    /// TLS handshake: from the connection's opening).
    pub header: Duration,
    /// How long a kept-alive connection may wait idle for its next request.
    pub keepalive: Duration,
    /// How much of a new plaintext connection's first header is read before the connection is
    /// handed on: the request line and header block at most; a longer header is handed on as read
    /// so far (the header limits then answer 431).
    pub first_header_bytes: usize,
    /// Counts the connections closed for a slow header.
    pub slow_headers: prometheus::IntCounter,
    /// Cancelled when the proxy starts draining: an idle connection ends then.
    pub draining: tokio_util::sync::CancellationToken,
}

impl ConnLimits {
    /// Reads `io` until its first request header is complete (up to its empty line) or
    /// `first_header_bytes` are in, within `header`, and returns what was read (it may hold the
    /// body's first bytes too): the connection replays it before reading on
    /// ([`ClientConn::plain`]). `None` when the client closed, failed or ran out of time
    /// (counted in `slow_headers`).
    ///
    /// Each read wakes on the socket's readiness and scans only the bytes it brought, so a header
    /// split across segments is served as its last segment lands, and a client that trickles
    /// costs one wake-up per segment and no re-parse of what came before.
    pub async fn read_first_header<R: AsyncRead + Unpin>(&self, io: &mut R) -> Option<FirstHeader> {
        let max_bytes = self.first_header_bytes;
        let deadline = tokio::time::Instant::now() + self.header;
        let read = async {
            let mut buf = vec![0u8; max_bytes.min(4096)];
            let mut filled = 0;
            let mut scan = HeaderScan::default();
            loop {
                if filled == buf.len() {
                    if filled >= max_bytes {
                        return Some(FirstHeader {
                            bytes: buf,
                            unfinished_by: Some(deadline),
                        });
                    }
                    buf.resize((filled * 2).min(max_bytes), 0);
                }
                match io.read(&mut buf[filled..]).await {
                    Ok(0) | Err(_) => return None,
                    Ok(n) => filled += n,
                }
                if scan.complete(&buf[..filled]) {
                    buf.truncate(filled);
                    return Some(FirstHeader {
                        bytes: buf,
                        unfinished_by: None,
                    });
                }
            }
        };
        match tokio::time::timeout_at(deadline, read).await {
            Ok(header) => header,
            Err(_) => {
                self.slow_headers.inc();
                None
            }
        }
    }
}

/// What [`ConnLimits::read_first_header`] read of a new plaintext connection.
#[derive(Debug)]
pub struct FirstHeader {
    /// The bytes read, replayed to the connection's first reads.
    pub bytes: Vec<u8>,
    /// Set when the header was handed on before its end (longer than `first_header_bytes`):
    /// when its time runs out. The rest must still arrive by then, or the read fails as a slow
    /// header, instead of waiting for as long as the parser's own size limit lets a client trickle.
    pub unfinished_by: Option<tokio::time::Instant>,
}

/// Finds a request header's end (its empty line) in bytes that grow between calls, looking only at
/// what is new. A line may end in CRLF or a bare LF, as the parser accepts (RFC 9112 §2.2), so the
/// header ends at the first `\n\n` or `\n\r\n`. Empty lines before the request line are skipped,
/// as the parser skips them: a blank line there is not the end of a header.
#[derive(Debug, Default)]
struct HeaderScan {
    /// Where the request line starts, once a byte other than CR or LF has arrived.
    start: Option<usize>,
    /// Bytes looked at so far.
    scanned: usize,
}

impl HeaderScan {
    /// Whether `bytes` (what was given before, and more) hold a whole header.
    fn complete(&mut self, bytes: &[u8]) -> bool {
        let start = match self.start {
            Some(start) => start,
            None => match bytes[self.scanned..]
                .iter()
                .position(|b| !matches!(b, b'\r' | b'\n'))
            {
                Some(i) => *self.start.insert(self.scanned + i),
                None => {
                    self.scanned = bytes.len();
                    return false;
                }
            },
        };
        // The empty line may straddle the previous read's end: look back two bytes.
        let from = self.scanned.saturating_sub(2).max(start);
        self.scanned = bytes.len();
        let new = &bytes[from..];
        (0..new.len()).any(|i| matches!(&new[i..], [b'\n', b'\n', ..] | [b'\n', b'\r', b'\n', ..]))
    }
}

enum Phase {
    Off,
    /// Until the keep-alive time, or until the proxy starts draining.
    Idle(Pin<Box<Sleep>>),
    Header(Pin<Box<Sleep>>),
}

/// A client's stream, held to [`ConnLimits`] between and at the start of its requests.
pub struct ClientConn {
    inner: Inner,
    ctl: AtomicU8,
    /// Set by [`ClientConn::abort`]: every later write fails.
    aborted: AtomicBool,
    phase: Phase,
    limits: ConnLimits,
    /// The relay's handle, once a stream has needed one ([`ClientConn::relay_handle`]).
    relay: OnceLock<Arc<RelayClient>>,
    /// Resolves once the proxy starts draining; made when the connection first waits idle.
    drain_wait: Option<Pin<Box<WaitForCancellationFutureOwned>>>,
}

/// What a client connection reads and writes through.
enum Inner {
    /// A plaintext socket, held here.
    Plain(PlainTcp),
    /// Anything else pingora reads (a TLS stream).
    Wrapped(Stream),
}

/// A plaintext client socket and what pingora asks of it.
struct PlainTcp {
    tcp: tokio::net::TcpStream,
    /// Bytes read from the socket before the connection was made
    /// ([`ConnLimits::read_first_header`]), served to its first reads; freed once served.
    replay: Vec<u8>,
    socket: Option<Arc<SocketDigest>>,
    established: SystemTime,
    proxy: Option<Arc<pingora::protocols::raw_connect::ProxyDigest>>,
}

impl std::fmt::Debug for ClientConn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let phase = match self.phase {
            Phase::Off => "off",
            Phase::Idle(_) => "idle",
            Phase::Header(_) => "header",
        };
        let mut d = f.debug_struct("ClientConn");
        match &self.inner {
            Inner::Plain(p) => d.field("tcp", &p.tcp),
            Inner::Wrapped(s) => d.field("inner", s),
        };
        d.field("phase", &phase).finish()
    }
}

/// The most a lingering close reads and discards ([`ClientConn::linger`]).
pub const LINGER_BYTES: usize = 16 << 20;

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
            inner: Inner::Wrapped(stream),
            ctl: AtomicU8::new(KEEP),
            aborted: AtomicBool::new(false),
            phase,
            limits,
            relay: OnceLock::new(),
            drain_wait: None,
        }
    }

    /// A plaintext connection from `peer` whose first request's header has been bounded already;
    /// `first` is what was read from it meanwhile, served to its first reads (and, for a header
    /// handed on before its end, when the rest of it is due).
    pub fn plain(
        tcp: tokio::net::TcpStream,
        peer: std::net::SocketAddr,
        limits: ConnLimits,
        first: FirstHeader,
    ) -> Self {
        use std::os::fd::AsRawFd;
        // The client's address (X-Forwarded-For) as accept gave it, not asked of the socket again.
        let digest = SocketDigest::from_raw_fd(tcp.as_raw_fd());
        let _ = digest
            .peer_addr
            .set(Some(pingora::protocols::l4::socket::SocketAddr::Inet(peer)));
        let socket = Some(Arc::new(digest));
        Self {
            inner: Inner::Plain(PlainTcp {
                tcp,
                replay: first.bytes,
                socket,
                established: SystemTime::now(),
                proxy: None,
            }),
            ctl: AtomicU8::new(KEEP),
            aborted: AtomicBool::new(false),
            phase: match first.unfinished_by {
                Some(due) => Phase::Header(Box::pin(tokio::time::sleep_until(due))),
                None => Phase::Off,
            },
            limits,
            relay: OnceLock::new(),
            drain_wait: None,
        }
    }

    /// Writes one chunk of a chunked response body (its size line, `data` and the line end) to a
    /// plaintext client, straight to the socket. `None` for any other connection (write through
    /// pingora). A client that has not taken the chunk within `timeout` of the socket filling up
    /// fails the write, as pingora bounds its own writes.
    ///
    /// Only between a response header pingora wrote (chunked) and the end pingora writes: nothing
    /// else writes to the connection meanwhile, and nothing is buffered above the socket.
    pub async fn write_chunk(&self, data: &[u8], timeout: Duration) -> Option<std::io::Result<()>> {
        let Inner::Plain(plain) = &self.inner else {
            return None;
        };
        Some(write_chunk_to(&plain.tcp, data, timeout, || self.is_aborted()).await)
    }

    /// A second handle on a plaintext client's socket (a duplicated descriptor, registered with
    /// the runtime on its own), for a relay that runs as a task of its own while the request's
    /// task waits for it; `None` for any other connection. The connection stays this one's:
    /// dropping the handle leaves it open.
    ///
    /// Made at the connection's first relayed stream and kept for the later ones: a kept-alive
    /// connection's requests share it, so a stream costs no duplicate, no registration and no
    /// close (four system calls on the proxy's core per request).
    pub fn relay_handle(&self) -> Option<std::io::Result<Arc<RelayClient>>> {
        use std::os::fd::AsFd;
        let Inner::Plain(plain) = &self.inner else {
            return None;
        };
        if let Some(relay) = self.relay.get() {
            return Some(Ok(relay.clone()));
        }
        Some((|| {
            let fd = plain.tcp.as_fd().try_clone_to_owned()?;
            // The duplicate shares the socket's open file, non-blocking already.
            let tcp = tokio::net::TcpStream::from_std(std::net::TcpStream::from(fd))?;
            // Only the request's own task asks, one request at a time: the slot is empty here.
            Ok(self
                .relay
                .get_or_init(|| Arc::new(RelayClient { tcp }))
                .clone())
        })())
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

    /// Ends the connection where it stands: every later write fails, so the response is not
    /// finished (no last chunk after a cut one) and the connection closes instead of being
    /// kept alive.
    pub fn abort(&self) {
        self.aborted.store(true, Ordering::Release);
    }

    fn is_aborted(&self) -> bool {
        self.aborted.load(Ordering::Acquire)
    }

    /// Reads and discards what the client still sends after the proxy has answered and shut its
    /// own side, until the client closes its end, for at most `within` and [`LINGER_BYTES`]. A
    /// socket closed with bytes unread is reset, and a reset can destroy the answer before the
    /// client has read it (nginx's lingering close). Plaintext connections only: over TLS the
    /// close_notify already went out, and the raw bytes are not at hand.
    pub async fn linger(&self, within: Duration) {
        let Inner::Plain(p) = &self.inner else {
            return;
        };
        let deadline = tokio::time::Instant::now() + within;
        // On the heap: the connection task's future stays small (refusals are rare).
        let mut scratch = vec![0u8; 16 * 1024];
        let mut discarded = 0;
        while discarded < LINGER_BYTES {
            match tokio::time::timeout_at(deadline, p.tcp.readable()).await {
                Ok(Ok(())) => {}
                _ => return,
            }
            match p.tcp.try_read(&mut scratch) {
                Ok(0) => return,
                Ok(n) => discarded += n,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                Err(_) => return,
            }
        }
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

/// A relay's own handle on a plaintext client's socket ([`ClientConn::relay_handle`]): it writes
/// a chunked body's chunks and watches for the client going away, as the request's connection
/// would, while nothing else reads or writes the connection.
#[derive(Debug)]
pub struct RelayClient {
    tcp: tokio::net::TcpStream,
}

impl RelayClient {
    /// Writes one chunk of a chunked body, as [`ClientConn::write_chunk`] does.
    pub async fn write_chunk(&self, data: &[u8], timeout: Duration) -> std::io::Result<()> {
        write_chunk_to(&self.tcp, data, timeout, || false).await
    }

    /// Waits until the client's side of the connection has something to say: `true` when it has
    /// gone (its end closed or failed with nothing sent after its request), `false` when bytes
    /// arrived, the start of its next request (pipelining, RFC 9112 §9.3.2). Those stay in the
    /// socket for the connection's next read; the caller stops watching there, as pingora's
    /// watch does, and a client gone after them shows when a write fails.
    pub async fn closed(&self) -> bool {
        let mut probe = [0u8; 1];
        !matches!(self.tcp.peek(&mut probe).await, Ok(n) if n > 0)
    }
}

/// Writes one chunk (its size line, `data` and the line end) to `tcp`; a chunk of size 0 would end
/// the body, so empty data writes nothing. The client must take the whole chunk within `timeout`
/// of the first write that finds its socket full (a token stream's chunk is small: only a client
/// that stopped reading misses it). The socket reads as writable again only once about a third of
/// its buffer has drained, as it does for pingora's writes and nginx's.
async fn write_chunk_to(
    tcp: &tokio::net::TcpStream,
    data: &[u8],
    timeout: Duration,
    is_aborted: impl Fn() -> bool,
) -> std::io::Result<()> {
    if data.is_empty() {
        return Ok(());
    }
    let mut size = [0u8; 18];
    let size = chunk_size_line(data.len(), &mut size);
    let mut parts = [
        std::io::IoSlice::new(size),
        std::io::IoSlice::new(data),
        std::io::IoSlice::new(b"\r\n"),
    ];
    let mut left: &mut [std::io::IoSlice<'_>] = &mut parts;
    let mut deadline = None;
    while !left.is_empty() {
        if is_aborted() {
            return Err(aborted());
        }
        match tcp.try_write_vectored(left) {
            Ok(0) => return Err(std::io::ErrorKind::WriteZero.into()),
            Ok(n) => std::io::IoSlice::advance_slices(&mut left, n),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                let until = *deadline.get_or_insert_with(|| tokio::time::Instant::now() + timeout);
                match tokio::time::timeout_at(until, tcp.writable()).await {
                    Ok(Ok(())) => {}
                    Ok(Err(e)) => return Err(e),
                    Err(_) => {
                        return Err(std::io::Error::new(
                            std::io::ErrorKind::TimedOut,
                            "the client did not take a chunk within timeouts.client_write_ms",
                        ));
                    }
                }
            }
            Err(e) => return Err(e),
        }
    }
    Ok(())
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
            return this.inner.poll_read(cx, buf);
        }
        let before = buf.filled().len();
        match this.inner.poll_read(cx, buf) {
            Poll::Ready(Ok(())) => {
                if buf.filled().len() > before {
                    this.bytes_arrived();
                }
                Poll::Ready(Ok(()))
            }
            Poll::Ready(Err(e)) => Poll::Ready(Err(e)),
            Poll::Pending => match &mut this.phase {
                Phase::Off => Poll::Pending,
                // Idle past the keep-alive time, or as the proxy starts draining: the end of the
                // connection, as a client closing it.
                Phase::Idle(idle) => {
                    // The connection's one wait for the drain, made at its first idle time and
                    // kept: a token's clone and drop each take the token tree's lock.
                    let draining = this.drain_wait.get_or_insert_with(|| {
                        Box::pin(this.limits.draining.clone().cancelled_owned())
                    });
                    if idle.as_mut().poll(cx).is_ready() || draining.as_mut().poll(cx).is_ready() {
                        Poll::Ready(Ok(()))
                    } else {
                        Poll::Pending
                    }
                }
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
        if self.is_aborted() {
            return Poll::Ready(Err(aborted()));
        }
        match &mut self.get_mut().inner {
            Inner::Plain(p) => Pin::new(&mut p.tcp).poll_write(cx, buf),
            Inner::Wrapped(s) => Pin::new(s).poll_write(cx, buf),
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        if self.is_aborted() {
            return Poll::Ready(Err(aborted()));
        }
        match &mut self.get_mut().inner {
            Inner::Plain(p) => Pin::new(&mut p.tcp).poll_write_vectored(cx, bufs),
            Inner::Wrapped(s) => Pin::new(s).poll_write_vectored(cx, bufs),
        }
    }

    fn is_write_vectored(&self) -> bool {
        match &self.inner {
            Inner::Plain(p) => p.tcp.is_write_vectored(),
            Inner::Wrapped(s) => s.is_write_vectored(),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        if self.is_aborted() {
            return Poll::Ready(Err(aborted()));
        }
        match &mut self.get_mut().inner {
            Inner::Plain(p) => Pin::new(&mut p.tcp).poll_flush(cx),
            Inner::Wrapped(s) => Pin::new(s).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        match &mut self.get_mut().inner {
            Inner::Plain(p) => Pin::new(&mut p.tcp).poll_shutdown(cx),
            Inner::Wrapped(s) => Pin::new(s).poll_shutdown(cx),
        }
    }
}

impl Inner {
    fn poll_read(
        &mut self,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        match self {
            Inner::Plain(p) if !p.replay.is_empty() => {
                let n = p.replay.len().min(buf.remaining());
                buf.put_slice(&p.replay[..n]);
                if n == p.replay.len() {
                    p.replay = Vec::new();
                } else {
                    p.replay.drain(..n);
                }
                Poll::Ready(Ok(()))
            }
            Inner::Plain(p) => Pin::new(&mut p.tcp).poll_read(cx, buf),
            Inner::Wrapped(s) => Pin::new(s).poll_read(cx, buf),
        }
    }
}

fn aborted() -> std::io::Error {
    std::io::Error::new(
        std::io::ErrorKind::ConnectionAborted,
        "the proxy ended this connection in the middle of a response",
    )
}

/// `n` in hex and a line end, as a chunk's size line, in `buf`.
fn chunk_size_line(n: usize, buf: &mut [u8; 18]) -> &[u8] {
    let digits = ((usize::BITS - n.leading_zeros()).div_ceil(4) as usize).max(1);
    for i in 0..digits {
        buf[digits - 1 - i] = b"0123456789ABCDEF"[(n >> (4 * i)) & 0xF];
    }
    buf[digits] = b'\r';
    buf[digits + 1] = b'\n';
    &buf[..digits + 2]
}

#[async_trait::async_trait]
impl Shutdown for ClientConn {
    async fn shutdown(&mut self) {
        match &mut self.inner {
            Inner::Plain(p) => {
                use tokio::io::AsyncWriteExt;
                if let Err(e) = p.tcp.shutdown().await {
                    tracing::debug!("shutting down a client connection: {e}");
                }
            }
            Inner::Wrapped(s) => s.shutdown().await,
        }
    }
}

impl UniqueID for ClientConn {
    fn id(&self) -> UniqueIDType {
        match &self.inner {
            Inner::Plain(p) => {
                use std::os::fd::AsRawFd;
                p.tcp.as_raw_fd()
            }
            Inner::Wrapped(s) => s.id(),
        }
    }
}

impl Ssl for ClientConn {
    fn get_ssl(&self) -> Option<&pingora::protocols::tls::TlsRef> {
        match &self.inner {
            Inner::Plain(_) => None,
            Inner::Wrapped(s) => s.get_ssl(),
        }
    }

    fn get_ssl_digest(&self) -> Option<Arc<pingora::protocols::tls::SslDigest>> {
        match &self.inner {
            Inner::Plain(_) => None,
            Inner::Wrapped(s) => s.get_ssl_digest(),
        }
    }

    fn selected_alpn_proto(&self) -> Option<pingora::protocols::ALPN> {
        match &self.inner {
            Inner::Plain(_) => None,
            Inner::Wrapped(s) => s.selected_alpn_proto(),
        }
    }
}

impl GetTimingDigest for ClientConn {
    fn get_timing_digest(&self) -> Vec<Option<pingora::protocols::TimingDigest>> {
        match &self.inner {
            Inner::Plain(p) => vec![Some(pingora::protocols::TimingDigest {
                established_ts: p.established,
                ..Default::default()
            })],
            Inner::Wrapped(s) => s.get_timing_digest(),
        }
    }

    fn get_read_pending_time(&self) -> Duration {
        match &self.inner {
            Inner::Plain(_) => Duration::ZERO,
            Inner::Wrapped(s) => s.get_read_pending_time(),
        }
    }

    fn get_write_pending_time(&self) -> Duration {
        match &self.inner {
            Inner::Plain(_) => Duration::ZERO,
            Inner::Wrapped(s) => s.get_write_pending_time(),
        }
    }
}

impl GetProxyDigest for ClientConn {
    fn get_proxy_digest(&self) -> Option<Arc<pingora::protocols::raw_connect::ProxyDigest>> {
        match &self.inner {
            Inner::Plain(p) => p.proxy.clone(),
            Inner::Wrapped(s) => s.get_proxy_digest(),
        }
    }

    fn set_proxy_digest(&mut self, digest: pingora::protocols::raw_connect::ProxyDigest) {
        match &mut self.inner {
            Inner::Plain(p) => p.proxy = Some(Arc::new(digest)),
            Inner::Wrapped(s) => s.set_proxy_digest(digest),
        }
    }
}

impl GetSocketDigest for ClientConn {
    fn get_socket_digest(&self) -> Option<Arc<SocketDigest>> {
        match &self.inner {
            Inner::Plain(p) => p.socket.clone(),
            Inner::Wrapped(s) => s.get_socket_digest(),
        }
    }

    fn set_socket_digest(&mut self, digest: SocketDigest) {
        match &mut self.inner {
            Inner::Plain(p) => p.socket = Some(Arc::new(digest)),
            Inner::Wrapped(s) => s.set_socket_digest(digest),
        }
    }
}

#[async_trait::async_trait]
impl Peek for ClientConn {
    async fn try_peek(&mut self, buf: &mut [u8]) -> std::io::Result<bool> {
        match &mut self.inner {
            // Nothing here peeks (pingora asks only to detect h2c, which is off): a peek that
            // filled less than `buf` would mislead it, and one at the socket would miss the bytes
            // read before the connection was made, so say peeking is not supported.
            Inner::Plain(_) => Ok(false),
            Inner::Wrapped(s) => s.try_peek(buf).await,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncReadExt;

    fn limits() -> ConnLimits {
        ConnLimits {
            header: Duration::from_secs(5),
            keepalive: Duration::from_secs(5),
            first_header_bytes: 1 << 16,
            slow_headers: prometheus::IntCounter::new("slow", "slow headers").expect("counter"),
            draining: tokio_util::sync::CancellationToken::new(),
        }
    }

    /// The proxy's side of a plaintext connection, `replay` read from it already.
    fn plain(tcp: tokio::net::TcpStream, replay: &[u8]) -> ClientConn {
        plain_held_to(tcp, replay, limits())
    }

    /// The same, held to `lim`.
    fn plain_held_to(tcp: tokio::net::TcpStream, replay: &[u8], lim: ConnLimits) -> ClientConn {
        ClientConn::plain(
            tcp,
            "127.0.0.1:9".parse().expect("addr"),
            lim,
            FirstHeader {
                bytes: replay.to_vec(),
                unfinished_by: None,
            },
        )
    }

    /// A connected pair: the proxy's side and the client's.
    async fn pair() -> (tokio::net::TcpStream, tokio::net::TcpStream) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr");
        let (client, accepted) =
            tokio::join!(tokio::net::TcpStream::connect(addr), listener.accept());
        (accepted.expect("accept").0, client.expect("connect"))
    }

    #[test]
    fn size_lines_are_hex_with_a_line_end() {
        let mut buf = [0u8; 18];
        for (n, want) in [
            (1, "1\r\n"),
            (15, "F\r\n"),
            (16, "10\r\n"),
            (255, "FF\r\n"),
            (4096, "1000\r\n"),
            (usize::MAX, "FFFFFFFFFFFFFFFF\r\n"),
        ] {
            assert_eq!(chunk_size_line(n, &mut buf), want.as_bytes(), "{n}");
        }
    }

    #[tokio::test]
    async fn a_chunk_larger_than_the_socket_holds_arrives_whole_and_framed() {
        let (server, mut client) = pair().await;
        let conn = plain(server, b"");
        // More than loopback's socket buffers take at once: the write waits for the reader.
        let data: Vec<u8> = (0..32usize << 20).map(|i| (i % 251) as u8).collect();
        let reader = tokio::spawn(async move {
            let mut got = Vec::new();
            client.read_to_end(&mut got).await.expect("read");
            got
        });
        let written = conn.write_chunk(&data, Duration::from_secs(60)).await;
        assert!(matches!(written, Some(Ok(()))), "{written:?}");
        assert!(matches!(
            conn.write_chunk(b"", Duration::from_secs(1)).await,
            Some(Ok(()))
        ));
        drop(conn);
        let got = reader.await.expect("reader");
        let mut want = format!("{:X}\r\n", data.len()).into_bytes();
        want.extend_from_slice(&data);
        want.extend_from_slice(b"\r\n");
        assert_eq!(got.len(), want.len());
        assert!(got == want, "the bytes differ");
    }

    #[tokio::test(start_paused = true)]
    async fn a_client_that_takes_nothing_times_the_write_out() {
        let (server, _client) = pair().await;
        let conn = plain(server, b"");
        let data = vec![b'x'; 64 << 20];
        match conn.write_chunk(&data, Duration::from_millis(100)).await {
            Some(Err(e)) => assert_eq!(e.kind(), std::io::ErrorKind::TimedOut),
            other => panic!("expected a timeout, got {other:?}"),
        }
    }

    #[tokio::test]
    async fn an_aborted_connection_takes_no_more_bytes() {
        use tokio::io::AsyncWriteExt;
        let (server, mut client) = pair().await;
        let mut conn = plain(server, b"");
        conn.write_all(b"head").await.expect("write");
        conn.abort();
        assert!(conn.write_all(b"0\r\n\r\n").await.is_err());
        assert!(matches!(
            conn.write_chunk(b"x", Duration::from_secs(1)).await,
            Some(Err(_))
        ));
        drop(conn);
        let mut got = Vec::new();
        client.read_to_end(&mut got).await.expect("read");
        assert_eq!(got, b"head");
    }

    #[tokio::test]
    async fn a_relay_handle_writes_chunks_and_sees_the_client_leave() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let (server, mut client) = pair().await;
        let conn = plain(server, b"");
        let relay = conn.relay_handle().expect("plaintext").expect("dup");
        relay
            .write_chunk(b"data: x\n\n", Duration::from_secs(1))
            .await
            .expect("write");
        let mut got = [0u8; 14];
        client.read_exact(&mut got).await.expect("read");
        assert_eq!(&got, b"9\r\ndata: x\n\n\r\n");
        // Still there: the watch waits.
        assert!(
            tokio::time::timeout(Duration::from_millis(50), relay.closed())
                .await
                .is_err()
        );
        client.shutdown().await.expect("shutdown");
        assert!(
            tokio::time::timeout(Duration::from_secs(5), relay.closed())
                .await
                .expect("the watch sees the client's end"),
            "a client that closed has gone"
        );
        // The connection's later streams get the same handle, not another descriptor.
        let again = conn.relay_handle().expect("plaintext").expect("kept");
        assert!(Arc::ptr_eq(&relay, &again), "one handle per connection");
        // The handle is a second one: dropping it leaves the connection to the first.
        drop((relay, again));
        let mut conn = conn;
        conn.write_all(b"0\r\n\r\n")
            .await
            .expect("the connection is still open");
    }

    #[tokio::test]
    async fn a_pipelined_request_is_left_for_the_connection_and_not_taken_for_a_leave() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let (server, mut client) = pair().await;
        let mut conn = plain(server, b"");
        let relay = conn.relay_handle().expect("plaintext").expect("dup");
        client
            .write_all(b"GET / HTTP/1.1\r\n")
            .await
            .expect("write");
        // The next request's bytes arrived: the client is not gone, and they are not taken.
        let gone = tokio::time::timeout(Duration::from_secs(5), relay.closed())
            .await
            .expect("the watch sees the bytes");
        assert!(!gone, "a pipelined request is not a client leaving");
        drop(relay);
        let mut next = [0u8; 16];
        conn.read_exact(&mut next)
            .await
            .expect("the bytes wait for the connection");
        assert_eq!(&next, b"GET / HTTP/1.1\r\n");
    }

    fn first_header(max_bytes: usize) -> ConnLimits {
        ConnLimits {
            header: Duration::from_secs(10),
            first_header_bytes: max_bytes,
            ..limits()
        }
    }

    #[test]
    fn a_header_is_complete_at_its_blank_line_however_it_is_split() {
        // Every way of cutting the bytes in two, three and byte by byte: complete exactly once
        // the empty line's last byte is in, never on the empty lines before the request line;
        // with CRLF line ends, bare LF ones and a mix.
        for (request, end) in [
            (
                &b"\r\n\r\nPOST /v1/completions HTTP/1.1\r\nHost: a\r\nX: \r\n\r\n{\"p\":1}"[..],
                51,
            ),
            (&b"\n\nGET / HTTP/1.0\nHost: a\n\nbody"[..], 26),
            (&b"\r\nGET / HTTP/1.1\r\nHost: a\n\r\n\n"[..], 28),
        ] {
            assert!(matches!(&request[end - 2..end], b"\n\n" | b"\r\n"));
            complete_at(request, end);
        }
        let mut scan = HeaderScan::default();
        assert!(
            !scan.complete(b"\r\n\r\n\n\r\n"),
            "empty lines alone are not a header"
        );
    }

    /// Asserts that `request` is seen whole exactly at byte `end`, however it is cut.
    fn complete_at(request: &[u8], end: usize) {
        for cut in 0..=request.len() {
            for second in cut..=request.len() {
                let mut scan = HeaderScan::default();
                let mut done_at = None;
                for upto in [cut, second, request.len()] {
                    if done_at.is_none() && scan.complete(&request[..upto]) {
                        done_at = Some(upto);
                    }
                }
                let want = [cut, second, request.len()].into_iter().find(|&u| u >= end);
                assert_eq!(done_at, want, "cut at {cut} and {second}");
            }
        }
        let mut scan = HeaderScan::default();
        let done_at = (1..=request.len()).find(|&upto| scan.complete(&request[..upto]));
        assert_eq!(done_at, Some(end));
    }

    #[tokio::test(start_paused = true)]
    async fn a_split_first_header_is_read_as_its_last_part_lands_and_replayed() {
        use tokio::io::AsyncWriteExt;
        let (mut client, mut server) = tokio::io::duplex(1 << 16);
        let reader = first_header(1 << 16);
        let start = tokio::time::Instant::now();
        client
            .write_all(b"POST / HTTP/1.1\r\nHo")
            .await
            .expect("write");
        let reading = tokio::spawn(async move { reader.read_first_header(&mut server).await });
        tokio::task::yield_now().await;
        assert!(!reading.is_finished(), "waits for the rest of the header");
        client.write_all(b"st: a\r\n\r\nbody").await.expect("write");
        let first = reading.await.expect("task").expect("a whole header");
        assert_eq!(first.unfinished_by, None, "a whole header");
        let read = first.bytes;
        let header = b"POST / HTTP/1.1\r\nHost: a\r\n\r\n";
        assert!(read.starts_with(header));
        assert!(
            b"body".starts_with(&read[header.len()..]),
            "at most what was sent"
        );
        // Read as the bytes came: no timer ran (a back-off would have moved the paused clock).
        assert_eq!(tokio::time::Instant::now(), start);

        // The connection serves those bytes first, then the socket's.
        let (tcp, mut peer) = pair().await;
        let mut conn = plain(tcp, b"GET / HTTP/1.1\r\n\r\n");
        peer.write_all(b"next").await.expect("write");
        // Read in pieces smaller than what is replayed.
        let mut got = Vec::new();
        let mut piece = [0u8; 5];
        while got.len() < 22 {
            let n = conn.read(&mut piece).await.expect("read");
            assert!(n > 0, "ended early: {got:?}");
            got.extend_from_slice(&piece[..n]);
        }
        assert_eq!(got, b"GET / HTTP/1.1\r\n\r\nnext");
    }

    #[tokio::test(start_paused = true)]
    async fn a_first_header_that_never_ends_is_cut_at_the_budget_and_an_oversized_one_handed_on() {
        use tokio::io::AsyncWriteExt;
        let reader = first_header(64);
        let (mut client, mut server) = tokio::io::duplex(1 << 16);
        client
            .write_all(b"GET / HTTP/1.1\r\n")
            .await
            .expect("write");
        assert!(reader.read_first_header(&mut server).await.is_none());
        assert_eq!(reader.slow_headers.get(), 1, "counted as a slow header");

        // Past `max_bytes` without a blank line: handed on as read, for the header limits (431),
        // with what is left of its budget: the rest must come by then.
        let (mut client, mut server) = tokio::io::duplex(1 << 16);
        client.write_all(&[b'x'; 100]).await.expect("write");
        let start = tokio::time::Instant::now();
        let first = reader
            .read_first_header(&mut server)
            .await
            .expect("handed on");
        assert_eq!(first.bytes, vec![b'x'; 64]);
        assert_eq!(first.unfinished_by, Some(start + reader.header));
        let (tcp, mut peer) = pair().await;
        let mut conn = ClientConn::plain(
            tcp,
            "127.0.0.1:9".parse().expect("addr"),
            reader.clone(),
            first,
        );
        let mut buf = vec![0u8; 64];
        assert_eq!(conn.read(&mut buf).await.expect("the bytes read first"), 64);
        // The client trickles one more byte, then stops short of the header's end.
        peer.write_all(b"y").await.expect("write");
        assert_eq!(conn.read(&mut buf).await.expect("a byte"), 1);
        let err = conn.read(&mut buf).await.expect_err("the budget ran out");
        assert_eq!(err.kind(), std::io::ErrorKind::TimedOut);
        assert_eq!(tokio::time::Instant::now(), start + reader.header);
        assert_eq!(reader.slow_headers.get(), 2, "counted as a slow header");

        // A client that closes before its header ends: nothing to serve, not a slow header.
        let (mut client, mut server) = tokio::io::duplex(1 << 16);
        client.write_all(b"GET /").await.expect("write");
        drop(client);
        assert!(reader.read_first_header(&mut server).await.is_none());
        assert_eq!(reader.slow_headers.get(), 2);
    }

    #[tokio::test(start_paused = true)]
    async fn an_idle_connection_ends_when_draining_starts() {
        use tokio::io::AsyncWriteExt;
        let (tcp, mut peer) = pair().await;
        let lim = limits();
        let draining = lim.draining.clone();
        let mut conn = plain_held_to(tcp, b"", lim);
        let start = tokio::time::Instant::now();
        // Between requests: a request that arrives is read as ever.
        conn.response_done();
        peer.write_all(b"GET").await.expect("write");
        let mut buf = [0u8; 8];
        assert_eq!(conn.read(&mut buf).await.expect("read"), 3);
        conn.header_parsed();
        conn.response_done();
        let reading = tokio::spawn(async move {
            let n = conn.read(&mut buf).await;
            (n.map_err(|e| e.kind()), tokio::time::Instant::now())
        });
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert!(!reading.is_finished(), "idle, not ended");
        draining.cancel();
        let (n, at) = reading.await.expect("task");
        assert_eq!(n, Ok(0), "ended as a closed keep-alive");
        assert!(
            at - start < limits().keepalive,
            "ended by the drain, not the idle limit"
        );
    }

    #[tokio::test]
    async fn a_request_already_in_the_socket_is_read_though_draining_started() {
        use tokio::io::AsyncWriteExt;
        let (tcp, mut peer) = pair().await;
        peer.write_all(b"GET / HTTP/1.1\r\n").await.expect("write");
        // The bytes are in the socket and the runtime knows it.
        tcp.readable().await.expect("readable");
        let lim = limits();
        lim.draining.cancel();
        let mut conn = plain_held_to(tcp, b"", lim);
        conn.response_done();
        // The socket is read before the drain is looked at: bytes there are the next request.
        let mut buf = [0u8; 64];
        let mut got = Vec::new();
        while got.len() < 16 {
            let n = conn.read(&mut buf).await.expect("read");
            assert!(
                n > 0,
                "ended with the request's bytes in the socket: {got:?}"
            );
            got.extend_from_slice(&buf[..n]);
        }
        assert_eq!(got, b"GET / HTTP/1.1\r\n");
    }

    #[tokio::test]
    async fn a_wrapped_stream_is_written_through_pingora() {
        let (server, _client) = pair().await;
        let stream: Stream = Box::new(pingora::protocols::l4::stream::Stream::from(server));
        let conn = ClientConn::new(stream, limits(), false);
        assert!(
            conn.write_chunk(b"x", Duration::from_secs(1))
                .await
                .is_none()
        );
    }
}
