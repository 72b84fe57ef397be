//! Plaintext HTTP/1.1 to the replicas, done here rather than through pingora's client: a pool of
//! idle connections per address, the request written in one go, the response header parsed with
//! httparse, and the body read straight from the socket with its chunked framing decoded in the
//! read buffer, so each chunk reaches the relay as a slice of that buffer (no copy, and no layer
//! between the socket and the relay). Replicas reached over TLS still go through pingora.
//!
//! ```text
//! body framing (RFC 9112 §6.3), first rule that applies:
//!   HEAD request, or status 1xx / 204 / 304    no body
//!   Transfer-Encoding, last coding chunked     chunked (trailer fields read and dropped)
//!   Transfer-Encoding, any other               until the replica closes the connection
//!   Content-Length, one value (or all equal)   that many bytes; differing values are an error
//!   neither                                    until the replica closes the connection
//!
//! reuse: the body read to its end, HTTP/1.1, no `Connection: close`, no byte after the body;
//!   idle at most `timeouts.pool_idle_ms`, at most IDLE_PER_ADDR connections per address
//! stale: a pooled connection that fails in the write, or within STALE_WITHIN of it before any
//!   byte of the answer (the replica closed it while it was idle), is replaced by a new one once,
//!   to the same replica; a later failure is the request's, never sent again
//! write: the request must be taken within `timeouts.first_byte_ms`, as the answer must begin
//!   within it once the request was sent
//! ```
//!
//! | limit | value | why |
//! |---|---|---|
//! | `MAX_HEAD_BYTES` | 64 KiB | a response header larger than this is a broken replica |
//! | `MAX_HEADERS` | 128 | the same, counted in fields |
//! | `MAX_CHUNK_LINE` | 4 KiB | a chunk-size line (with extensions) or trailer line longer than this |
//! | `IDLE_PER_ADDR` | 128 | idle connections kept per replica address |
//! | `STALE_WITHIN` | 1 s | an idle close shows within a round trip of the write |
//! | `READ_ROOM` → `MAX_READ_ROOM` | 8 → 64 KiB | room per read, doubled after a read that filled it |

use std::collections::HashMap;
use std::io::{self, IoSlice};
use std::net::SocketAddr;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use bytes::{Buf, Bytes, BytesMut};
use http::header;
use pingora::http::ResponseHeader;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::error::{ErrorKind, ProxyError};

/// The largest response header read.
pub const MAX_HEAD_BYTES: usize = 64 * 1024;
/// The most header fields in a response.
pub const MAX_HEADERS: usize = 128;
/// The longest chunk-size or trailer line.
pub const MAX_CHUNK_LINE: usize = 4096;
/// Idle connections kept per replica address.
pub const IDLE_PER_ADDR: usize = 128;
/// Free room the read buffer makes before a read, at first; doubled, up to `MAX_READ_ROOM`, after
/// a read that filled it (a large body is read in large pieces, a stream's events in small ones).
const READ_ROOM: usize = 8 * 1024;
/// The most room one read is given.
const MAX_READ_ROOM: usize = 64 * 1024;
/// How soon after the request was written a pooled connection must fail, with no byte of an
/// answer, to count as one the replica had closed while idle (such a close shows within a round
/// trip). A later failure may be a replica that worked on the request: it is not sent again.
const STALE_WITHIN: Duration = Duration::from_secs(1);

/// Idle connections to the replicas, newest last, by address.
#[derive(Debug)]
pub struct Pool {
    idle: Mutex<HashMap<SocketAddr, Vec<Idle>>>,
    /// Counts pooled connections found closed only once a request was written to them.
    stale: prometheus::IntCounter,
}

#[derive(Debug)]
struct Idle {
    tcp: TcpStream,
    until: Instant,
}

impl Pool {
    /// An empty pool that counts its stale connections in `stale`.
    pub fn new(stale: prometheus::IntCounter) -> Self {
        Self {
            idle: Mutex::default(),
            stale,
        }
    }

    /// The newest idle connection to `addr` that is still open and within its idle time.
    fn take(&self, addr: SocketAddr) -> Option<TcpStream> {
        let mut idle = self.idle.lock().expect("pool lock");
        let conns = idle.get_mut(&addr)?;
        let now = Instant::now();
        while let Some(conn) = conns.pop() {
            if conn.until > now && still_open(&conn.tcp) {
                return Some(conn.tcp);
            }
        }
        None
    }

    /// Keeps `tcp` for the next request to `addr` until `until`.
    fn put(&self, addr: SocketAddr, tcp: TcpStream, until: Instant) {
        let now = Instant::now();
        if until <= now {
            return;
        }
        let mut idle = self.idle.lock().expect("pool lock");
        let conns = idle.entry(addr).or_default();
        conns.retain(|c| c.until > now);
        if conns.len() >= IDLE_PER_ADDR {
            // The oldest goes: the newest are the likeliest to be open still.
            conns.remove(0);
        }
        conns.push(Idle { tcp, until });
    }

    /// Closes the connections past their idle time (and forgets addresses with none left), so a
    /// quiet proxy does not hold sockets its replicas have long closed. It does not peek at each
    /// socket (that is [`Pool::take`]'s job): the lock every request takes stays short.
    pub fn sweep(&self) {
        let now = Instant::now();
        let mut idle = self.idle.lock().expect("pool lock");
        idle.retain(|_, conns| {
            conns.retain(|c| c.until > now);
            !conns.is_empty()
        });
    }

    /// Idle connections held, all addresses.
    pub fn idle(&self) -> usize {
        self.idle
            .lock()
            .expect("pool lock")
            .values()
            .map(Vec::len)
            .sum()
    }
}

/// Whether an idle connection is still open: no end of file and no stray byte waiting (an idle
/// connection has nothing to read). It asks the socket itself (one non-blocking peek), not the
/// runtime's last readiness, which may not have seen a close or a late byte yet.
fn still_open(tcp: &TcpStream) -> bool {
    let mut byte = [std::mem::MaybeUninit::<u8>::uninit()];
    matches!(socket2::SockRef::from(tcp).peek(&mut byte), Err(e) if e.kind() == io::ErrorKind::WouldBlock)
}

/// What the exchange is held to.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// How long a new connection may take.
    pub connect: Duration,
    /// How long the response header may take once the request was sent.
    pub first_byte: Duration,
}

/// A request as it goes on the wire.
#[derive(Debug, Clone, Copy)]
pub struct Request<'a> {
    /// The request line and header fields, through the empty line.
    pub head: &'a [u8],
    /// The body, after the head.
    pub body: &'a [u8],
    /// A `HEAD` request: the answer has no body whatever its header says.
    pub head_only: bool,
}

/// One request's exchange with the replica at `addr` (called `name` in errors), up to its
/// response header; the body is read from the returned [`Body`]. `on_sent` runs once, when the
/// whole request was first written to a connection, and not at all when it never was (a pooled
/// connection found closed after that is replaced by a new one to the same replica).
pub async fn exchange(
    pool: &Pool,
    addr: SocketAddr,
    name: &str,
    req: Request<'_>,
    limits: Limits,
    on_sent: impl FnOnce(),
) -> Result<(ResponseHeader, Body), ProxyError> {
    let mut on_sent = Some(on_sent);
    let mut sent = || {
        if let Some(f) = on_sent.take() {
            f();
        }
    };
    if let Some(tcp) = pool.take(addr) {
        match send_and_read_head(tcp, addr, name, req, limits, &mut sent).await {
            Err(Failure::Stale(_)) => pool.stale.inc(),
            Err(Failure::Failed(e)) => return Err(e),
            Ok(answer) => return Ok(answer),
        }
    }
    let tcp = connect(addr, name, limits.connect).await?;
    match send_and_read_head(tcp, addr, name, req, limits, &mut sent).await {
        Ok(answer) => Ok(answer),
        Err(Failure::Failed(e)) => Err(e),
        Err(Failure::Stale(why)) => Err(reset(format!("{name} {why}"))),
    }
}

async fn connect(addr: SocketAddr, name: &str, limit: Duration) -> Result<TcpStream, ProxyError> {
    let failed = |why: String| ProxyError::new(ErrorKind::UpstreamConnect, why);
    let tcp = match tokio::time::timeout(limit, TcpStream::connect(addr)).await {
        Err(_) => {
            return Err(failed(format!(
                "connect: {name} did not accept within {limit:?}"
            )));
        }
        Ok(Err(e)) => return Err(failed(format!("connect: {name}: {e}"))),
        Ok(Ok(tcp)) => tcp,
    };
    // Each event is its own small write: Nagle's wait would hold it back.
    tcp.set_nodelay(true)
        .map_err(|e| failed(format!("connect: {name}: {e}")))?;
    Ok(tcp)
}

enum Failure {
    /// The connection failed in writing the request, or soon after it without any byte of an
    /// answer: a pooled one the replica had closed while idle. What happened, for a new one.
    Stale(String),
    Failed(ProxyError),
}

async fn send_and_read_head(
    mut tcp: TcpStream,
    addr: SocketAddr,
    name: &str,
    req: Request<'_>,
    limits: Limits,
    sent: &mut impl FnMut(),
) -> Result<(ResponseHeader, Body), Failure> {
    // A replica that takes no more of the request within the first-byte time is as stuck as one
    // that does not answer it.
    let write = write_request(&mut tcp, req.head, req.body);
    match tokio::time::timeout(limits.first_byte, write).await {
        Err(_) => {
            return Err(Failure::Failed(ProxyError::new(
                ErrorKind::UpstreamTimeout,
                format!(
                    "{name} took no more of the request within {:?}",
                    limits.first_byte
                ),
            )));
        }
        Ok(Err(e)) => return Err(Failure::Stale(format!("failed sending the request: {e}"))),
        Ok(Ok(())) => {}
    }
    let written = tokio::time::Instant::now();
    sent();
    let mut buf = BytesMut::with_capacity(READ_ROOM);
    // Whether any byte of an answer came: after one, a failure is no stale connection.
    let mut answered = false;
    let deadline = written + limits.first_byte;
    let mut head = loop {
        if let Some(parsed) = parse_head(&buf, name).map_err(Failure::Failed)? {
            buf.advance(parsed.len);
            if parsed.header.status.is_informational() {
                // Interim answers (`100 Continue`, `103 Early Hints`) come before the final one
                // and are read past: the client asked for neither.
                continue;
            }
            break parsed;
        }
        if buf.len() >= MAX_HEAD_BYTES {
            return Err(Failure::Failed(reset(format!(
                "{name} sent a response header over {MAX_HEAD_BYTES} bytes"
            ))));
        }
        let read = tokio::time::timeout_at(deadline, read_more(&mut tcp, &mut buf, READ_ROOM));
        let why = match read.await {
            Err(_) => {
                return Err(Failure::Failed(ProxyError::new(
                    ErrorKind::UpstreamTimeout,
                    format!(
                        "{name} sent no response header within {:?}",
                        limits.first_byte
                    ),
                )));
            }
            Ok(Ok(0)) if answered => "closed the connection in its response header".to_owned(),
            Ok(Ok(0)) => "closed the connection before answering".to_owned(),
            Ok(Ok(_)) => {
                answered = true;
                continue;
            }
            Ok(Err(e)) if answered => format!("failed in its response header: {e}"),
            Ok(Err(e)) => format!("failed before answering: {e}"),
        };
        if !answered && written.elapsed() < STALE_WITHIN {
            return Err(Failure::Stale(why));
        }
        return Err(Failure::Failed(reset(format!("{name} {why}"))));
    };
    let framing = framing(&head.header, req.head_only)
        .map_err(|why| Failure::Failed(reset(format!("{name} sent {why}"))))?;
    if head.header.headers.contains_key(header::TRANSFER_ENCODING) {
        // The transfer coding frames the body and a length beside it is wrong: it must not reach
        // the client (RFC 9112 §6.3).
        head.header.remove_header(&header::CONTENT_LENGTH);
    }
    let body = Body {
        tcp,
        addr,
        dec: Decoder {
            buf,
            state: framing,
            room: READ_ROOM,
        },
        // A body that ends with the connection leaves none to reuse.
        keep_alive: head.keep_alive && framing != State::UntilClose,
        last_read: Instant::now(),
    };
    Ok((head.header, body))
}

fn reset(why: String) -> ProxyError {
    ProxyError::new(ErrorKind::UpstreamReset, why)
}

/// The request in as few writes as the socket allows: header and body together.
async fn write_request(tcp: &mut TcpStream, head: &[u8], body: &[u8]) -> io::Result<()> {
    let mut slices = [IoSlice::new(head), IoSlice::new(body)];
    let mut bufs = &mut slices[..];
    IoSlice::advance_slices(&mut bufs, 0);
    while !bufs.is_empty() {
        let n = tcp.write_vectored(bufs).await?;
        if n == 0 {
            return Err(io::ErrorKind::WriteZero.into());
        }
        IoSlice::advance_slices(&mut bufs, n);
    }
    Ok(())
}

/// One read into `buf`'s free room, made `room` when under half of it; the count read, 0 at end
/// of file.
async fn read_more(tcp: &mut TcpStream, buf: &mut BytesMut, room: usize) -> io::Result<usize> {
    if buf.capacity() - buf.len() < room / 2 {
        buf.reserve(room);
    }
    tcp.read_buf(buf).await
}

struct Head {
    header: ResponseHeader,
    /// Bytes of the header, through its empty line.
    len: usize,
    keep_alive: bool,
}

/// A whole response header at the start of `buf`, or None while it is incomplete.
fn parse_head(buf: &[u8], name: &str) -> Result<Option<Head>, ProxyError> {
    let mut fields = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut parsed = httparse::Response::new(&mut fields);
    let len = match parsed.parse(buf) {
        Ok(httparse::Status::Complete(len)) => len,
        Ok(httparse::Status::Partial) => return Ok(None),
        Err(e) => {
            return Err(reset(format!(
                "{name} sent a malformed response header: {e}"
            )));
        }
    };
    let bad = |e: Box<pingora::Error>| reset(format!("{name} sent a response header: {e}"));
    let code = parsed.code.unwrap_or(0);
    let mut header = ResponseHeader::build(code, Some(parsed.headers.len())).map_err(bad)?;
    let http11 = parsed.version == Some(1);
    header.set_version(if http11 {
        http::Version::HTTP_11
    } else {
        http::Version::HTTP_10
    });
    if let Some(reason) = parsed.reason.filter(|r| !r.is_empty()) {
        header.set_reason_phrase(Some(reason)).map_err(bad)?;
    }
    let (mut close, mut keep_alive) = (false, false);
    for field in parsed.headers.iter() {
        if field.name.eq_ignore_ascii_case("connection") {
            for token in field.value.split(|&b| b == b',') {
                let token = token.trim_ascii();
                close |= token.eq_ignore_ascii_case(b"close");
                keep_alive |= token.eq_ignore_ascii_case(b"keep-alive");
            }
        }
        let value = http::HeaderValue::from_bytes(field.value)
            .map_err(|e| reset(format!("{name} sent header {}: {e}", field.name)))?;
        header
            .append_header(field.name.to_string(), value)
            .map_err(bad)?;
    }
    // HTTP/1.0 persists only when asked to, and never with a transfer coding (RFC 9112 §9.3).
    let chunked = header.headers.contains_key(header::TRANSFER_ENCODING);
    let persists = !close && (http11 || (keep_alive && !chunked));
    Ok(Some(Head {
        header,
        len,
        keep_alive: persists,
    }))
}

/// How the body after `header` is framed (the table at the top of this file).
fn framing(header: &ResponseHeader, head_request: bool) -> Result<State, String> {
    if head_request || matches!(header.status.as_u16(), 100..=199 | 204 | 304) {
        return Ok(State::Done);
    }
    if let Some(last) = header
        .headers
        .get_all(header::TRANSFER_ENCODING)
        .iter()
        .flat_map(|v| v.as_bytes().split(|&b| b == b','))
        .map(<[u8]>::trim_ascii)
        .rfind(|c| !c.is_empty())
    {
        return Ok(if last.eq_ignore_ascii_case(b"chunked") {
            State::Chunked(Chunk::Size)
        } else {
            State::UntilClose
        });
    }
    let mut length: Option<u64> = None;
    for value in header.headers.get_all(header::CONTENT_LENGTH) {
        for v in value.as_bytes().split(|&b| b == b',') {
            let n = std::str::from_utf8(v.trim_ascii())
                .ok()
                .filter(|s| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()))
                .and_then(|s| s.parse::<u64>().ok())
                .ok_or_else(|| format!("an invalid Content-Length {value:?}"))?;
            if length.is_some_and(|l| l != n) {
                return Err(format!("two different Content-Length values ({value:?})"));
            }
            length = Some(n);
        }
    }
    Ok(match length {
        Some(0) => State::Done,
        Some(n) => State::Length(n),
        None => State::UntilClose,
    })
}

/// Where the body is in its framing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Read to its end.
    Done,
    /// This many bytes still to come.
    Length(u64),
    /// Chunked, at this point of a chunk.
    Chunked(Chunk),
    /// Until the connection closes.
    UntilClose,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Chunk {
    /// A chunk-size line.
    Size,
    /// This many bytes of the chunk's data still to come.
    Data(u64),
    /// The line end after a chunk's data.
    DataEnd,
    /// Trailer fields, until the empty line.
    Trailer,
}

/// A response body, read from the replica's socket as it arrives.
#[derive(Debug)]
pub struct Body {
    tcp: TcpStream,
    addr: SocketAddr,
    dec: Decoder,
    keep_alive: bool,
    /// When the replica's last byte so far arrived: its own idle clock runs from about then.
    last_read: Instant,
}

impl Body {
    /// The next piece of the body (one chunk's data, or what one read brought), None at its end.
    /// An error is a cut: the connection failed, or ended or broke its framing before the end.
    pub async fn next(&mut self) -> io::Result<Option<Bytes>> {
        loop {
            match self.dec.decode()? {
                Step::Data(bytes) => return Ok(Some(bytes)),
                Step::End => return Ok(None),
                Step::More => {}
            }
            let room = self.dec.room;
            let n = read_more(&mut self.tcp, &mut self.dec.buf, room).await?;
            self.last_read = Instant::now();
            if n >= room {
                self.dec.room = (room * 2).min(MAX_READ_ROOM);
            }
            if n == 0 {
                if self.dec.state == State::UntilClose {
                    self.dec.state = State::Done;
                    return Ok(None);
                }
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "the replica closed the connection before the end of the body",
                ));
            }
        }
    }

    /// Whether the body has been read to its end.
    pub fn done(&self) -> bool {
        self.dec.state == State::Done
    }

    /// Gives the connection back to `pool` for the next request when it can carry one: the body
    /// read to its end with nothing after it, and the replica not closing it. Otherwise it closes.
    /// Its idle time counts from the replica's last byte, as the replica's own does, not from now
    /// (a client slow to take the end of a response would otherwise stretch it).
    pub fn release(self, pool: &Pool, idle_for: Duration) {
        if self.keep_alive && self.dec.state == State::Done && self.dec.buf.is_empty() {
            pool.put(self.addr, self.tcp, self.last_read + idle_for);
        }
    }
}

/// The body's framing, decoded from the bytes read so far.
#[derive(Debug)]
struct Decoder {
    buf: BytesMut,
    state: State,
    /// Room made for the next read.
    room: usize,
}

impl Decoder {
    /// What the bytes already read give, without reading.
    fn decode(&mut self) -> io::Result<Step> {
        let invalid = |why: String| io::Error::new(io::ErrorKind::InvalidData, why);
        loop {
            match self.state {
                State::Done => return Ok(Step::End),
                State::UntilClose | State::Length(_) | State::Chunked(Chunk::Data(_))
                    if self.buf.is_empty() =>
                {
                    return Ok(Step::More);
                }
                State::UntilClose => return Ok(Step::Data(self.buf.split().freeze())),
                State::Length(left) => {
                    let n = self.take(left);
                    self.state = if n as u64 == left {
                        State::Done
                    } else {
                        State::Length(left - n as u64)
                    };
                    return Ok(Step::Data(self.buf.split_to(n).freeze()));
                }
                State::Chunked(Chunk::Data(left)) => {
                    let n = self.take(left);
                    self.state = State::Chunked(if n as u64 == left {
                        Chunk::DataEnd
                    } else {
                        Chunk::Data(left - n as u64)
                    });
                    return Ok(Step::Data(self.buf.split_to(n).freeze()));
                }
                State::Chunked(Chunk::Size) => match httparse::parse_chunk_size(&self.buf) {
                    // httparse takes a line without digits as size 0, and a bare LF inside an
                    // extension: neither is a chunk-size line.
                    Ok(httparse::Status::Complete((used, _)))
                        if !self.buf[0].is_ascii_hexdigit()
                            || self.buf[..used - 1].contains(&b'\n') =>
                    {
                        return Err(invalid("a malformed chunk-size line".into()));
                    }
                    Ok(httparse::Status::Complete((used, size))) => {
                        self.buf.advance(used);
                        self.state = State::Chunked(if size == 0 {
                            Chunk::Trailer
                        } else {
                            Chunk::Data(size)
                        });
                    }
                    Ok(httparse::Status::Partial) if self.buf.len() < MAX_CHUNK_LINE => {
                        return Ok(Step::More);
                    }
                    Ok(httparse::Status::Partial) => {
                        return Err(invalid(format!(
                            "a chunk-size line over {MAX_CHUNK_LINE} bytes"
                        )));
                    }
                    Err(_) => return Err(invalid("a malformed chunk-size line".into())),
                },
                State::Chunked(Chunk::DataEnd) => {
                    if self.buf.len() < 2 {
                        return Ok(Step::More);
                    }
                    if &self.buf[..2] != b"\r\n" {
                        return Err(invalid("no line end after a chunk's data".into()));
                    }
                    self.buf.advance(2);
                    self.state = State::Chunked(Chunk::Size);
                }
                State::Chunked(Chunk::Trailer) => {
                    let Some(end) = self.buf.iter().position(|&b| b == b'\n') else {
                        if self.buf.len() >= MAX_CHUNK_LINE {
                            return Err(invalid(format!(
                                "a trailer line over {MAX_CHUNK_LINE} bytes"
                            )));
                        }
                        return Ok(Step::More);
                    };
                    let empty = end == 0 || (end == 1 && self.buf[0] == b'\r');
                    self.buf.advance(end + 1);
                    if empty {
                        self.state = State::Done;
                    }
                }
            }
        }
    }

    /// How much of the `left` bytes still due the buffer holds.
    fn take(&self, left: u64) -> usize {
        usize::try_from(left).map_or(self.buf.len(), |l| l.min(self.buf.len()))
    }
}

enum Step {
    Data(Bytes),
    More,
    End,
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::net::TcpListener;

    const LIMITS: Limits = Limits {
        connect: Duration::from_secs(10),
        first_byte: Duration::from_secs(10),
    };

    /// What the test replica does with the next request it reads.
    enum Answer {
        /// Writes these bytes and waits for the connection's next request.
        Send(&'static [u8]),
        /// Writes these bytes and closes the connection.
        SendAndClose(&'static [u8]),
        /// Closes the connection without an answer.
        Close,
    }

    /// A replica that takes requests (header only) on any connection and does with each the
    /// next of `answers`; it reports each request it read.
    async fn replica(
        answers: Vec<Answer>,
    ) -> (SocketAddr, tokio::sync::mpsc::UnboundedReceiver<Vec<u8>>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        tokio::spawn(async move {
            let mut answers = answers.into_iter();
            while let Ok((mut tcp, _)) = listener.accept().await {
                loop {
                    let mut req = Vec::new();
                    let mut chunk = [0u8; 4096];
                    while !req.ends_with(b"\r\n\r\n") {
                        match tcp.read(&mut chunk).await {
                            Ok(0) | Err(_) => break,
                            Ok(n) => req.extend_from_slice(&chunk[..n]),
                        }
                    }
                    if !req.ends_with(b"\r\n\r\n") {
                        break;
                    }
                    let _ = tx.send(req);
                    match answers.next() {
                        Some(Answer::Send(bytes)) => tcp.write_all(bytes).await.unwrap(),
                        Some(Answer::SendAndClose(bytes)) => {
                            tcp.write_all(bytes).await.unwrap();
                            break;
                        }
                        Some(Answer::Close) | None => break,
                    }
                }
            }
        });
        (addr, rx)
    }

    const GET: &[u8] = b"GET /x HTTP/1.1\r\nhost: r\r\n\r\n";

    fn test_pool() -> Pool {
        Pool::new(prometheus::IntCounter::new("stale", "stale connections").unwrap())
    }

    fn get() -> Request<'static> {
        Request {
            head: GET,
            body: b"",
            head_only: false,
        }
    }

    async fn body_of(body: &mut Body) -> io::Result<Vec<u8>> {
        let mut all = Vec::new();
        while let Some(piece) = body.next().await? {
            all.extend_from_slice(&piece);
        }
        Ok(all)
    }

    #[tokio::test]
    async fn a_chunked_body_is_read_chunk_by_chunk_and_its_connection_reused() {
        let answer: &[u8] =
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nX-Case: Kept\r\n\r\n\
            5;ext=1\r\nhello\r\n6\r\n world\r\n0\r\nTrailer-Field: x\r\n\r\n";
        let (addr, mut requests) = replica(vec![Answer::Send(answer), Answer::Send(answer)]).await;
        let pool = test_pool();
        for _ in 0..2 {
            let (header, mut body) = exchange(&pool, addr, "r", get(), LIMITS, || {})
                .await
                .unwrap();
            assert_eq!(header.status, 200);
            let mut wire = Vec::new();
            header.header_to_h1_wire(&mut wire);
            let wire = String::from_utf8(wire).unwrap();
            assert!(
                wire.contains("X-Case: Kept\r\n"),
                "the name's case is kept: {wire}"
            );
            assert_eq!(body.next().await.unwrap().unwrap(), "hello");
            assert_eq!(body.next().await.unwrap().unwrap(), " world");
            assert_eq!(body.next().await.unwrap(), None);
            assert!(body.done());
            body.release(&pool, Duration::from_secs(60));
            assert_eq!(pool.idle(), 1);
        }
        assert_eq!(requests.recv().await.unwrap(), GET);
        assert_eq!(requests.recv().await.unwrap(), GET);
    }

    #[tokio::test]
    async fn framing_follows_rfc_9112() {
        let cases: &[(&'static [u8], bool, &[u8], bool)] = &[
            // (answer, HEAD request, body, reusable)
            (b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\n\r\nabc", false, b"abc", true),
            (b"HTTP/1.1 200 OK\r\nContent-Length: 3, 3\r\n\r\nabc", false, b"abc", true),
            (b"HTTP/1.1 204 No Content\r\nContent-Length: 3\r\n\r\n", false, b"", true),
            (b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\n\r\n", true, b"", true),
            (b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok", false, b"ok", true),
            (b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\nok", false, b"ok", false),
            (b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\nok", false, b"ok", false),
            (b"HTTP/1.0 200 OK\r\n\r\nuntil close", false, b"until close", false),
            (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\nraw", false, b"raw", false),
            (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip, chunked\r\n\r\n3\r\nraw\r\n0\r\n\r\n", false, b"raw", true),
            // A byte past the body: the connection is out of step and goes.
            (b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nokX", false, b"ok", false),
            (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n\r\nX", false, b"ok", false),
            (b"HTTP/1.0 200 OK\r\nConnection: keep-alive\r\nContent-Length: 2\r\n\r\nok", false, b"ok", true),
            (b"HTTP/1.0 200 OK\r\nConnection: close, keep-alive\r\nContent-Length: 2\r\n\r\nok", false, b"ok", false),
            (b"HTTP/1.0 200 OK\r\nConnection: keep-alive\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n\r\n", false, b"ok", false),
        ];
        for &(answer, head_only, want, reusable) in cases {
            let (addr, _requests) = replica(vec![Answer::SendAndClose(answer)]).await;
            let pool = test_pool();
            let (_, mut body) = exchange(
                &pool,
                addr,
                "r",
                Request { head_only, ..get() },
                LIMITS,
                || {},
            )
            .await
            .unwrap();
            let got = body_of(&mut body).await;
            assert_eq!(
                got.as_deref().ok(),
                Some(want),
                "{}",
                String::from_utf8_lossy(answer)
            );
            if !reusable {
                body.release(&pool, Duration::from_secs(60));
                assert_eq!(pool.idle(), 0, "{}", String::from_utf8_lossy(answer));
            } else {
                body.release(&pool, Duration::from_secs(60));
                assert_eq!(pool.idle(), 1, "{}", String::from_utf8_lossy(answer));
            }
        }
    }

    #[tokio::test]
    async fn a_body_cut_or_broken_is_an_error_and_never_reused() {
        let cases: &[&'static [u8]] = &[
            b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc",
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhel",
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello",
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhelloXX",
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n",
            // A line without digits is no last chunk.
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n\r\n\r\n",
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n;x\r\n\r\n",
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n0;a\nb\r\n\r\n",
            // A size no body can have.
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n11111111111111111\r\nx",
        ];
        for &answer in cases {
            let (addr, _requests) = replica(vec![Answer::SendAndClose(answer)]).await;
            let pool = test_pool();
            let (_, mut body) = exchange(&pool, addr, "r", get(), LIMITS, || {})
                .await
                .unwrap();
            assert!(
                body_of(&mut body).await.is_err(),
                "{}",
                String::from_utf8_lossy(answer)
            );
            assert!(!body.done());
            body.release(&pool, Duration::from_secs(60));
            assert_eq!(pool.idle(), 0);
        }
    }

    /// A header over the size limit, and one over the field limit.
    fn oversized_headers() -> (&'static [u8], &'static [u8]) {
        let mut long = b"HTTP/1.1 200 OK\r\nX: ".to_vec();
        long.resize(70_000, b'a');
        let mut many = b"HTTP/1.1 200 OK\r\n".to_vec();
        for _ in 0..130 {
            many.extend_from_slice(b"A: b\r\n");
        }
        many.extend_from_slice(b"\r\n");
        (Vec::leak(long), Vec::leak(many))
    }

    #[tokio::test]
    async fn a_transfer_coding_drops_a_length_beside_it() {
        let answer: &[u8] = b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\
            Transfer-Encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n\r\n";
        let (addr, _requests) = replica(vec![Answer::Send(answer)]).await;
        let (header, mut body) = exchange(&test_pool(), addr, "r", get(), LIMITS, || {})
            .await
            .unwrap();
        assert!(!header.headers.contains_key(header::CONTENT_LENGTH));
        assert_eq!(body_of(&mut body).await.unwrap(), b"ok");
    }

    #[tokio::test]
    async fn a_bad_header_is_refused_with_its_reason() {
        let (long, many) = oversized_headers();
        let cases: &[(&'static [u8], &str)] = &[
            (
                b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n",
                "two different Content-Length",
            ),
            (
                b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n",
                "invalid Content-Length",
            ),
            (b"HTTP/1.1 2OO OK\r\n\r\n", "malformed response header"),
            (
                b"HTTP/1.1 200 OK\r\nContent-Le",
                "closed the connection in its response header",
            ),
            (long, "over 65536 bytes"),
            (many, "malformed response header"),
        ];
        for &(answer, why) in cases {
            let (addr, _requests) = replica(vec![Answer::SendAndClose(answer)]).await;
            let pool = test_pool();
            let e = exchange(&pool, addr, "r", get(), LIMITS, || {})
                .await
                .expect_err("refused");
            assert!(e.detail.contains(why), "{}: {}", why, e.detail);
            assert_eq!(e.kind, ErrorKind::UpstreamReset);
        }
    }

    #[tokio::test]
    async fn a_pooled_connection_the_replica_closed_is_replaced_once() {
        let ok: &[u8] = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok";
        let (addr, mut requests) =
            replica(vec![Answer::Send(ok), Answer::Close, Answer::Send(ok)]).await;
        let pool = test_pool();
        let mut sent = 0;
        let (_, mut body) = exchange(&pool, addr, "r", get(), LIMITS, || sent += 1)
            .await
            .unwrap();
        assert_eq!(body_of(&mut body).await.unwrap(), b"ok");
        body.release(&pool, Duration::from_secs(60));
        // The replica reads the second request and closes without an answer: the proxy cannot
        // tell that from a connection closed while idle, and sends it once more on a new one.
        let (_, mut body) = exchange(&pool, addr, "r", get(), LIMITS, || sent += 1)
            .await
            .unwrap();
        assert_eq!(body_of(&mut body).await.unwrap(), b"ok");
        assert_eq!(sent, 2, "on_sent runs once per exchange");
        assert_eq!(pool.stale.get(), 1);
        for _ in 0..3 {
            assert_eq!(requests.recv().await.unwrap(), GET);
        }
    }

    #[tokio::test]
    async fn a_pooled_connection_that_began_an_answer_is_not_sent_again() {
        let ok: &[u8] = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok";
        let (addr, mut requests) = replica(vec![
            Answer::Send(ok),
            Answer::SendAndClose(b"HTTP/1.1 200 OK\r\nContent-Le"),
            Answer::Send(ok),
        ])
        .await;
        let pool = test_pool();
        let (_, mut body) = exchange(&pool, addr, "r", get(), LIMITS, || {})
            .await
            .unwrap();
        body_of(&mut body).await.unwrap();
        body.release(&pool, Duration::from_secs(60));
        let e = exchange(&pool, addr, "r", get(), LIMITS, || {})
            .await
            .expect_err("cut");
        assert_eq!(e.kind, ErrorKind::UpstreamReset);
        requests.recv().await.unwrap();
        requests.recv().await.unwrap();
        assert!(requests.try_recv().is_err(), "sent twice, not three times");
    }

    #[tokio::test]
    async fn a_new_connection_closed_unanswered_is_not_sent_again() {
        let ok: &[u8] = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok";
        let (addr, mut requests) = replica(vec![Answer::Close, Answer::Send(ok)]).await;
        let e = exchange(&test_pool(), addr, "r", get(), LIMITS, || {})
            .await
            .expect_err("closed");
        assert_eq!(e.kind, ErrorKind::UpstreamReset);
        assert!(
            e.detail.contains("closed the connection before answering"),
            "{}",
            e.detail
        );
        requests.recv().await.unwrap();
        assert!(requests.try_recv().is_err());
    }

    #[tokio::test]
    async fn the_pool_hands_out_no_connection_its_replica_closed_or_wrote_on() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let pool = test_pool();
        let mut far = Vec::new();
        for _ in 0..3 {
            let tcp = TcpStream::connect(addr).await.unwrap();
            far.push(listener.accept().await.unwrap().0);
            pool.put(addr, tcp, Instant::now() + Duration::from_secs(60));
        }
        // The newest is closed by the replica, the next gets a stray byte; the oldest is fine.
        let mut newest = far.pop().unwrap();
        newest.shutdown().await.unwrap();
        drop(newest);
        far[1].write_all(b"X").await.unwrap();
        // On loopback the close and the byte are in the near sockets once the calls return.
        let taken = pool.take(addr).expect("the oldest is open");
        assert_eq!(taken.local_addr().unwrap(), far[0].peer_addr().unwrap());
        assert!(pool.take(addr).is_none());
        // One past its idle time is not kept.
        pool.put(addr, taken, Instant::now());
        assert_eq!(pool.idle(), 0);
    }

    #[tokio::test]
    async fn a_refused_connection_is_a_connect_error_and_nothing_was_sent() {
        // Bound and held, never listened on: refused, and no other test can take the port.
        let held =
            socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
        held.bind(&SocketAddr::from(([127, 0, 0, 1], 0)).into())
            .unwrap();
        let addr = held.local_addr().unwrap().as_socket().unwrap();
        let mut sent = false;
        let e = exchange(&test_pool(), addr, "r", get(), LIMITS, || sent = true)
            .await
            .expect_err("refused");
        assert_eq!(e.kind, ErrorKind::UpstreamConnect);
        assert!(!sent);
    }

    #[tokio::test]
    async fn a_replica_silent_after_the_request_times_out() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (ready, accepted) = tokio::sync::oneshot::channel();
        tokio::spawn(async move {
            let (tcp, _) = listener.accept().await.unwrap();
            let _ = ready.send(());
            // Holds the connection open and never answers.
            std::future::pending::<()>().await;
            drop(tcp);
        });
        let limits = Limits {
            first_byte: Duration::from_millis(200),
            ..LIMITS
        };
        let e = exchange(&test_pool(), addr, "r", get(), limits, || {})
            .await
            .expect_err("timed out");
        accepted.await.unwrap();
        assert_eq!(e.kind, ErrorKind::UpstreamTimeout);
    }

    #[test]
    fn chunks_split_anywhere_decode_the_same() {
        // Every split of a chunked body into two reads gives the same data and the same end.
        let wire: &[u8] =
            b"3\r\nabc\r\n10\r\n0123456789abcdef\r\n1;x=\"y\"\r\nz\r\n0\r\nT: v\r\n\r\n";
        let want = b"abc0123456789abcdefz";
        for cut in 0..=wire.len() {
            let mut state = State::Chunked(Chunk::Size);
            let mut got = Vec::new();
            let mut buf = BytesMut::new();
            for part in [&wire[..cut], &wire[cut..]] {
                buf.extend_from_slice(part);
                let (s, data) = decode_all(state, &mut buf);
                state = s;
                got.extend_from_slice(&data);
            }
            assert_eq!(got, want, "cut at {cut}");
            assert_eq!(state, State::Done, "cut at {cut}");
        }
    }

    /// Decodes what `buf` holds from `state` on, as [`Body::next`] does between reads.
    fn decode_all(state: State, buf: &mut BytesMut) -> (State, Vec<u8>) {
        let mut dec = Decoder {
            buf: buf.split(),
            state,
            room: READ_ROOM,
        };
        let mut data = Vec::new();
        while let Step::Data(b) = dec.decode().unwrap() {
            data.extend_from_slice(&b);
        }
        *buf = dec.buf;
        (dec.state, data)
    }
}
