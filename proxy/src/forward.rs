//! One request's exchange with the replicas: pick, send, retry on another replica while nothing
//! has reached the client, then relay the response chunk by chunk (never buffered), watching the
//! client so that its disconnect cancels the upstream request.
//!
//! The request body is read whole by the proxy first (routing needs the prompt), so any retry
//! re-sends exactly the bytes the client sent, whatever their size.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures_util::future::Either;
use headroom_workload::measure::ResponseMeter;
use http::header;
use pingora::http::{RequestHeader, ResponseHeader};
use pingora::protocols::http::client::HttpSession as UpstreamSession;
use pingora::proxy::Session;
use pingora::upstreams::peer::HttpPeer;

use crate::admission::{self, Ask, Pick as AdmissionPick, Refusal, Room};
use crate::app::{Headroom, RequestCtx};
use crate::client_conn::RelayClient;
use crate::error::{ErrorKind, ProxyError};
use crate::routing::{BackendView, RouteRequest, RoutingPolicy};
use crate::upstreams::{Backend, InFlight, h1};

/// Request headers never forwarded: the ones that belong to one connection (RFC 9110 §7.6.1),
/// the ones the proxy sets itself, and `accept-encoding`, since the proxy reads every response it
/// relays (a compressed stream could be neither measured nor cut, and would be held whole for
/// want of event boundaries).
const HOP_BY_HOP: &[&str] = &[
    "accept-encoding",
    "connection",
    "keep-alive",
    "proxy-connection",
    "proxy-authorization",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "expect",
    "host",
    "content-length",
];

/// Statuses after which another replica is tried: the replica could not take the request.
const RETRY_STATUSES: &[u16] = &[502, 503];

/// A request sent to a replica, for its routing policy: dropped when the attempt ends however it
/// ends (answered, failed, retried elsewhere, client gone), it tells the policy the replica freed
/// the prompt's blocks, if the policy was told it had them.
struct Running<'a> {
    policy: &'a dyn RoutingPolicy,
    route: &'a RouteRequest<'a>,
    backend: usize,
    recorded: AtomicBool,
}

impl Drop for Running<'_> {
    fn drop(&mut self) {
        if self.recorded.load(Ordering::Relaxed) {
            self.policy.finished(self.route, self.backend);
        }
    }
}

/// The fleet as one pick sees it.
struct FleetLook {
    views: Vec<BackendView>,
    /// Per replica, whether its model list names the requested model (`None`: not read yet).
    serves: Option<Vec<Option<bool>>>,
}

impl FleetLook {
    /// The replicas among `members` a request may go to: healthy, not ejected, not tried already,
    /// and serving its model. A model that some member serves, even one that is down now, goes
    /// only to its own replicas (none healthy: the proxy's 503 with `Retry-After`, not another
    /// replica's 404); a model that no member lists goes anywhere, for an engine to answer with
    /// its own error.
    fn candidates(&self, members: &[bool], tried: &[usize]) -> Vec<BackendView> {
        let member = |id: usize| members.get(id).copied().unwrap_or(false);
        let mut views = self.views.clone();
        for v in &mut views {
            v.healthy &= member(v.id);
        }
        if let Some(serves) = &self.serves {
            // Only a list that names the model closes the pool to the others (and to replicas
            // whose list is not known): a replica down since start, whose list was never read,
            // does not capture a model nobody lists.
            if views
                .iter()
                .any(|v| member(v.id) && serves[v.id] == Some(true))
            {
                for v in &mut views {
                    v.healthy &= serves[v.id] != Some(false);
                }
            }
        }
        for v in views.iter_mut().filter(|v| tried.contains(&v.id)) {
            v.healthy = false;
        }
        views
    }
}

/// Why a replica's response was cut off after it started.
#[derive(Debug, Clone, Copy)]
enum Cut {
    /// The connection closed or failed.
    Closed,
    /// Nothing arrived for this long.
    Silent(Duration),
    /// An event grew past this many bytes without ending.
    Oversized(usize),
}

/// How a forwarded request ended, once it could no longer be answered by the proxy.
#[derive(Debug)]
pub enum Ended {
    /// The response was relayed to its end.
    Complete,
    /// The client went away; the upstream request was cancelled by closing its connection.
    ClientGone,
    /// The replica cut the response or fell silent past the idle timeout after it started.
    UpstreamCut,
}

impl Ended {
    /// The reason the access log gives for a response that did not end whole.
    pub fn reason(&self) -> Option<&'static str> {
        match self {
            Ended::Complete => None,
            Ended::ClientGone => Some("client_gone"),
            Ended::UpstreamCut => Some("upstream_cut"),
        }
    }
}

/// What to forward.
#[derive(Debug)]
pub struct Outgoing<'a> {
    /// The request body, exactly as the client sent it.
    pub body: Bytes,
    /// Routing input.
    pub route: RouteRequest<'a>,
    /// Whether to tell the policy where the request went (generation requests only).
    pub record: bool,
    /// The requested model: replicas known not to serve it are skipped, unless none serves it
    /// (then an engine answers the client with its own error).
    pub model: Option<&'a str>,
    /// The requested output limit.
    pub max_tokens: Option<i64>,
}

/// Output tokens the token budget plans for a request that sets no limit.
pub const UNSET_MAX_TOKENS: u64 = 512;

/// What the proxy removes from, or sets on, each forwarded request's headers.
#[derive(Debug, Clone)]
pub struct HeaderRules {
    /// The client's `Authorization` is for the proxy while API keys are configured (the serving
    /// config's, as for the key check itself): then never forwarded.
    pub keys: crate::auth::KeySlot,
    /// Keep and extend the client's forwarding headers (behind a trusted load balancer).
    pub trust_forwarded: bool,
    /// The class header is the proxy's input, not the engine's.
    pub class_header: String,
    /// `X-Forwarded-Proto`: `https` on a TLS listener.
    pub proto: &'static str,
}

/// The header names a `Connection` header lists: they describe the client's connection only and
/// go no further than the proxy (RFC 9110 §7.6.1). Borrowed, so the usual request (no such
/// header, or `keep-alive` alone) allocates at most the list.
fn connection_listed(headers: &http::HeaderMap) -> Vec<&str> {
    headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(str::trim)
        .filter(|t| !t.is_empty())
        .collect()
}

/// Client-supplied headers that claim where the request came from.
fn is_forwarding(name: &str) -> bool {
    name.starts_with("x-forwarded-") || name == "forwarded" || name == "x-real-ip"
}

/// The client's headers a shadow copy carries: what forwarding would keep, less the ones that
/// describe the client's connection (the copy comes from the proxy).
pub(crate) fn mirrored_headers(
    down: &RequestHeader,
    rules: &HeaderRules,
    strip: bool,
) -> http::HeaderMap {
    let mut out = http::HeaderMap::with_capacity(down.headers.len());
    let listed = connection_listed(&down.headers);
    for (name, value) in &down.headers {
        let n = name.as_str();
        if rules.forwards(name, &listed, strip) && n != "x-request-id" && !is_forwarding(n) {
            out.append(name.clone(), value.clone());
        }
    }
    out
}

impl HeaderRules {
    /// Whether the client's `Authorization` stays at the proxy: when its request was checked
    /// against keys, or keys are configured now (the serving config's).
    pub(crate) fn strips_authorization(&self, checked_with_keys: bool) -> bool {
        checked_with_keys || self.keys.is_set()
    }

    /// Whether a client request header is passed on to a replica; `listed` are the names its
    /// `Connection` header lists, `strip_authorization` whether API keys are configured.
    fn forwards(
        &self,
        name: &http::HeaderName,
        listed: &[&str],
        strip_authorization: bool,
    ) -> bool {
        let n = name.as_str();
        !(HOP_BY_HOP.contains(&n)
            || listed.iter().any(|l| l.eq_ignore_ascii_case(n))
            || n == self.class_header
            || (strip_authorization && name == header::AUTHORIZATION)
            || (!self.trust_forwarded && is_forwarding(n)))
    }
}

/// What a request's header for a replica is made from.
struct Outbound<'a> {
    session: &'a Session,
    backend: &'a Backend,
    body_len: usize,
    request_id: &'a str,
    rules: &'a HeaderRules,
    /// Whether the client's `Authorization` stays at the proxy.
    strip_authorization: bool,
}

/// The header fields a replica gets for a client request, in order, each handed to `field`: the
/// client's own that the rules pass on, then the proxy's (`host`, `content-length`,
/// `x-request-id`, the engine's key, the forwarding pair). Where the proxy sets a field, the
/// client's is left out.
fn upstream_fields(out: &Outbound, mut field: impl FnMut(&str, &[u8])) {
    let Outbound {
        session,
        backend,
        body_len,
        request_id,
        rules,
        strip_authorization: strip,
    } = *out;
    let down = session.req_header();
    // A preflight (the only OPTIONS forwarded without a client key) goes without the engine's
    // key: engines answer preflights unauthenticated, and nothing keyless goes out with it.
    let engine_key = backend
        .authorization
        .as_ref()
        .filter(|_| down.method != http::Method::OPTIONS);
    let client_ip = session
        .client_addr()
        .and_then(|a| a.as_inet())
        .map(|a| a.ip());
    let set_proto = client_ip.is_some()
        && (!down.headers.contains_key("x-forwarded-proto") || !rules.trust_forwarded);
    let listed = connection_listed(&down.headers);
    for (name, value) in &down.headers {
        let set_here = name == "x-request-id"
            || (engine_key.is_some() && name == header::AUTHORIZATION)
            || (client_ip.is_some() && name == "x-forwarded-for")
            || (set_proto && name == "x-forwarded-proto");
        if !set_here && rules.forwards(name, &listed, strip) {
            field(name.as_str(), value.as_bytes());
        }
    }
    field("host", backend.authority.as_bytes());
    field("content-length", body_len.to_string().as_bytes());
    field("x-request-id", request_id.as_bytes());
    if let Some(key) = engine_key {
        field("authorization", key.as_bytes());
    }
    if let Some(ip) = client_ip {
        let previous = down
            .headers
            .get("x-forwarded-for")
            .and_then(|v| v.to_str().ok())
            .filter(|_| rules.trust_forwarded);
        let xff = match previous {
            Some(prev) => format!("{prev}, {ip}"),
            None => ip.to_string(),
        };
        field("x-forwarded-for", xff.as_bytes());
        if set_proto {
            field("x-forwarded-proto", rules.proto.as_bytes());
        }
    }
}

/// The request header for a replica, as pingora's connector takes it (replicas reached over TLS).
fn upstream_header(out: &Outbound) -> Result<RequestHeader, ProxyError> {
    let down = out.session.req_header();
    let bad = |e: Box<pingora::Error>| ProxyError::new(ErrorKind::BadRequest, e.to_string());
    let mut up = RequestHeader::build(
        down.method.clone(),
        request_target(down),
        Some(down.headers.len() + 4),
    )
    .map_err(bad)?;
    let mut failed = None;
    upstream_fields(out, |name, value| {
        if failed.is_none() {
            if let Err(e) = up.append_header(name.to_owned(), value) {
                failed = Some(bad(e));
            }
        }
    });
    failed.map_or(Ok(up), Err)
}

/// The request header for a replica as HTTP/1.1 bytes (replicas spoken to by headroom's own
/// client): the same fields as [`upstream_header`], written straight into the buffer that goes
/// out, without building pingora's header first.
fn upstream_head(out: &Outbound) -> Result<Vec<u8>, ProxyError> {
    let down = out.session.req_header();
    let target = request_target(down);
    // RFC 9112 §3.2: none of these can be sent in a request target.
    if target.iter().any(|b| matches!(b, 0 | b'\n' | b'\r' | b' ')) {
        return Err(ProxyError::new(
            ErrorKind::BadRequest,
            "the request target holds a byte HTTP/1.1 forbids there",
        ));
    }
    let mut head = Vec::with_capacity(512);
    head.extend_from_slice(down.method.as_str().as_bytes());
    head.push(b' ');
    head.extend_from_slice(target);
    head.extend_from_slice(b" HTTP/1.1\r\n");
    let mut unsendable = None;
    upstream_fields(out, |name, value| {
        // The client's values were parsed as header values; the proxy's own are checked here.
        if value.iter().any(|b| matches!(b, 0 | b'\n' | b'\r')) {
            unsendable.get_or_insert_with(|| name.to_owned());
            return;
        }
        head.extend_from_slice(name.as_bytes());
        head.extend_from_slice(b": ");
        head.extend_from_slice(value);
        head.extend_from_slice(b"\r\n");
    });
    if let Some(name) = unsendable {
        return Err(ProxyError::new(
            ErrorKind::BadRequest,
            format!("the {name} field's value holds a byte a header cannot carry"),
        ));
    }
    head.extend_from_slice(b"\r\n");
    Ok(head)
}

/// The client's request target, as it goes to the replica.
fn request_target(down: &RequestHeader) -> &[u8] {
    down.uri
        .path_and_query()
        .map_or("/", |p| p.as_str())
        .as_bytes()
}

/// Whether `resp`, about to be written, has a chunked body (its last transfer coding `chunked`,
/// and a body allowed: not `HEAD`, 204 or 304), whose chunks the relay may frame itself.
fn chunked_body(session: &Session, resp: &ResponseHeader) -> bool {
    resp.headers
        .get_all(header::TRANSFER_ENCODING)
        .iter()
        .next_back()
        .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"chunked"))
        && !matches!(resp.status.as_u16(), 100..=199 | 204 | 304)
        && session.req_header().method != http::Method::HEAD
}

/// Ends the client's connection where it stands: nothing more is written to it (see
/// [`ClientConn::abort`]), and it is not kept for another request, which a response with nothing
/// left to write would otherwise be.
///
/// [`ClientConn::abort`]: crate::client_conn::ClientConn::abort
pub(crate) fn end_client_connection(session: &mut Session) {
    session.set_keepalive(None);
    if let Some(conn) = crate::app::client_conn(session) {
        conn.abort();
    }
}

/// One of pingora's writes to the client, within `limit`; false when it failed or ran out of
/// time, and the caller ends the connection. pingora bounds a body's writes by the session's write
/// timeout but not a response header's nor a chunked body's last chunk (a plain `write_all`): a
/// client that reads nothing would hold its request, the admission permit and the replica's slot
/// for as long as it stays connected.
pub(crate) async fn write_within<T>(
    limit: Duration,
    write: impl std::future::Future<Output = pingora::Result<T>>,
) -> bool {
    matches!(tokio::time::timeout(limit, write).await, Ok(Ok(_)))
}

/// Lets the chunks of streams under way that arrived during this request's last stage go out
/// before its next one: the task steps back until the runtime has looked for ready sockets
/// (tokio runs a yielded task again after its next poll of the I/O driver). Without it a chunk
/// that arrives as a request comes in waits for the whole request path, about 100 µs of one
/// core's work; with it, for one stage of it (benchmarks.md, "Streams first"). The request in
/// turn waits for every task that was ready to run.
pub(crate) async fn let_streams_through() {
    tokio::task::yield_now().await;
}

/// How a relay's pump ended.
enum Pumped {
    /// The replica's body ended (or its last bytes went out).
    Complete,
    /// The client went away or stopped taking bytes.
    ClientGone,
    /// The replica cut the body off.
    Cut(Cut),
}

/// What the pump is held to, from the config.
#[derive(Clone, Copy)]
struct PumpLimits {
    write_timeout: Duration,
    first_byte: Duration,
    idle: Duration,
    max_event: usize,
    /// The engine ends its body by closing its connection, which says nothing of whether it
    /// finished.
    close_delimited: bool,
}

/// Where the pump sends a body's chunks and watches for the client leaving.
enum ClientSide<'a> {
    /// Through the request's session (`direct`: a chunked body straight to a plaintext socket).
    Session {
        session: &'a mut Session,
        direct: bool,
    },
    /// Through the relay's own handle on a plaintext client, from a task of its own.
    Relay { client: &'a RelayClient },
}

impl<'a> ClientSide<'a> {
    /// Passes one chunk on; false when the client is gone or took nothing in time.
    async fn send(&mut self, bytes: Bytes, timeout: Duration) -> bool {
        match self {
            ClientSide::Session { session, direct } => {
                send_chunk(session, bytes, *direct, timeout).await
            }
            ClientSide::Relay { client } => client.write_chunk(&bytes, timeout).await.is_ok(),
        }
    }

    /// The relay's own handle on the client, when the pump writes through one.
    fn relay(&self) -> Option<&'a RelayClient> {
        match self {
            ClientSide::Relay { client } => Some(client),
            ClientSide::Session { .. } => None,
        }
    }

    /// Returns when the client of the request's own session has gone; never for a relay's.
    async fn session_gone(&mut self) {
        match self {
            ClientSide::Session { session, .. } => {
                let _ = session.as_downstream_mut().read_body_or_idle(true).await;
            }
            ClientSide::Relay { .. } => std::future::pending::<()>().await,
        }
    }
}

/// Returns when a relay's client has gone; never once the client's next request has begun to
/// arrive (it is not leaving, and its bytes would read as new at every look), nor without a relay.
async fn relay_client_gone(client: Option<&RelayClient>) {
    if let Some(client) = client {
        if client.closed().await {
            return;
        }
    }
    std::future::pending::<()>().await
}

/// Moves the body from the replica to the client through the meter until the replica ends it,
/// fails, falls silent, or the client goes away.
async fn pump(
    up: &mut Upstream,
    meter: &mut ResponseMeter,
    guard: &mut InFlight,
    mut client: ClientSide<'_>,
    limits: PumpLimits,
) -> Pumped {
    // Engines send the header at once and the first chunk after queueing and prefill, so the
    // silence before the first chunk is bounded by the first-byte timeout, not the idle one.
    let mut wait = limits.first_byte;
    // One timer for the whole response, re-armed only when it fires early: re-registering a
    // timer per chunk would cost more than relaying the chunk.
    let mut last_chunk = tokio::time::Instant::now();
    let silence = tokio::time::sleep_until(last_chunk + wait);
    tokio::pin!(silence);
    // A relay's watch on its client lasts as long as the relay: made afresh for each chunk it
    // would add a waiter to the socket's list and take it off again every time. A session's
    // watch needs the session itself, which each chunk's write takes, so it is made anew.
    let relay_gone = relay_client_gone(client.relay());
    tokio::pin!(relay_gone);
    loop {
        tokio::select! {
            // The replica first: an end of stream that is already there wins over a client that
            // hung up after reading it.
            biased;
            r = up.read_body() => match r {
                Ok(Some(chunk)) => {
                    last_chunk = tokio::time::Instant::now();
                    if wait != limits.idle {
                        // The first chunk: from now on silence is measured against idle_ms.
                        wait = limits.idle;
                        silence.as_mut().reset(last_chunk + limits.idle);
                    }
                    let passed = meter.on_chunk(chunk, last_chunk.into_std());
                    if meter.buffered() > limits.max_event {
                        // A line that never ends would grow without bound: cut it off.
                        return Pumped::Cut(Cut::Oversized(limits.max_event));
                    }
                    if passed.first_output {
                        guard.first_output();
                    }
                    if let Some(bytes) = passed.forward {
                        if !client.send(bytes, limits.write_timeout).await {
                            return Pumped::ClientGone;
                        }
                    }
                    // Output instants are when the client's connection got the bytes.
                    meter.delivered(std::time::Instant::now());
                    if up.done() {
                        // The last bytes (a body of known length): the client may have them and
                        // hang up at once, which is a finished request, not a lost one.
                        return Pumped::Complete;
                    }
                }
                Ok(None) if meter.broken_off() || (limits.close_delimited && meter.unfinished()) => {
                    return Pumped::Cut(Cut::Closed);
                }
                Ok(None) => return Pumped::Complete,
                Err(_) => return Pumped::Cut(Cut::Closed),
            },
            () = &mut silence => {
                let deadline = last_chunk + wait;
                if tokio::time::Instant::now() >= deadline {
                    return Pumped::Cut(Cut::Silent(wait));
                }
                silence.as_mut().reset(deadline);
            }
            () = &mut relay_gone => return Pumped::ClientGone,
            () = client.session_gone() => return Pumped::ClientGone,
        }
    }
}

/// What a relay's task hands back: how the pump ended and what it moved.
type PumpedBack = (Pumped, Upstream, ResponseMeter, InFlight);

/// [`pump`] as a task of its own, writing to the relay's own handle on the client; what it moved
/// comes back with how it ended. The request's task waits for it; dropped (that task cancelled),
/// the handle stops the relay too. `None` when the runtime cancelled the task (shutting down); a
/// panic in it is raised again here.
async fn pump_in_own_task(
    mut up: Upstream,
    mut meter: ResponseMeter,
    mut guard: InFlight,
    client: std::sync::Arc<RelayClient>,
    limits: PumpLimits,
) -> Option<PumpedBack> {
    let task = tokio::task::spawn(async move {
        let side = ClientSide::Relay { client: &client };
        let end = pump(&mut up, &mut meter, &mut guard, side, limits).await;
        // Boxed: the runtime moves a task's `Poll<output>` through its frames on every poll,
        // pending or not, so an output the size of the meter and the body would be copied
        // once per chunk.
        Box::new((end, up, meter, guard))
    });
    match tokio_util::task::AbortOnDropHandle::new(task).await {
        Ok(back) => Some(*back),
        Err(e) => match e.try_into_panic() {
            Ok(panic) => std::panic::resume_unwind(panic),
            Err(_) => None,
        },
    }
}

/// Passes one chunk on to the client: a chunked body's straight to a plaintext client's socket
/// (`direct`), anything else through pingora. False when the client is gone or took nothing.
async fn send_chunk(session: &mut Session, bytes: Bytes, direct: bool, timeout: Duration) -> bool {
    if direct {
        let written = match crate::app::client_conn(session) {
            Some(conn) => conn.write_chunk(&bytes, timeout).await,
            None => None,
        };
        if let Some(written) = written {
            return written.is_ok();
        }
    }
    session
        .write_response_body(Some(bytes), false)
        .await
        .is_ok()
}

fn classify(e: &pingora::Error, stage: &str) -> ProxyError {
    use pingora::ErrorType as T;
    let kind = match e.etype() {
        T::ConnectTimedout
        | T::ConnectRefused
        | T::ConnectNoRoute
        | T::ConnectError
        | T::BindError
        | T::ConnectProxyFailure
        | T::SocketError => ErrorKind::UpstreamConnect,
        _ => ErrorKind::UpstreamReset,
    };
    ProxyError::new(kind, format!("{stage}: {e}"))
}

/// An upstream exchange that has its response header.
struct Started {
    up: Upstream,
    resp: ResponseHeader,
}

/// The connection a response body comes over: headroom's own for a plaintext replica, pingora's
/// for one reached over TLS.
enum Upstream {
    Plain(h1::Body),
    Pingora {
        session: Box<UpstreamSession>,
        peer: Box<HttpPeer>,
    },
}

impl Upstream {
    /// The next piece of the body, None at its end; an error is a cut.
    async fn read_body(&mut self) -> Result<Option<Bytes>, ()> {
        match self {
            Upstream::Plain(body) => body.next().await.map_err(drop),
            Upstream::Pingora { session, .. } => session.read_response_body().await.map_err(drop),
        }
    }

    /// Whether the body has been read to its end.
    fn done(&mut self) -> bool {
        match self {
            Upstream::Plain(body) => body.done(),
            Upstream::Pingora { session, .. } => session.response_done(),
        }
    }
}

enum Attempt {
    Started(Box<Started>),
    Failed(ProxyError),
    ClientGone,
}

impl Headroom {
    /// The 503 for a pool none of whose replicas (own or borrowed) can take a request now: why,
    /// and a `Retry-After` from when one may again.
    fn unavailable(&self, plan: &crate::app::PoolPlan) -> ProxyError {
        let (why, wait) = self.fleet.unavailable(&plan.reach);
        ProxyError::new(
            ErrorKind::NoBackend,
            format!("no replica of pool {} can take requests: {why}", plan.name),
        )
        .with_retry_after(wait)
    }

    /// Forwards `out` to a replica picked by `policy`, retrying on others per the config, and
    /// relays the response. `Err` means nothing reached the client yet and the caller answers.
    pub(crate) async fn forward(
        &self,
        session: &mut Session,
        ctx: &mut RequestCtx,
        out: Outgoing<'_>,
        policy: &dyn RoutingPolicy,
    ) -> Result<Ended, ProxyError> {
        // What came before ran in one go (a generation request's inspection and class, a
        // pass-through's read): chunks that came in meanwhile go out before the request is
        // admitted, routed and written. Routing, the routing policy's record of the pick (on the
        // write) and the write itself stay one step, so a request that arrives right behind this
        // one routes with this one's prefix already recorded.
        let_streams_through().await;
        let mut tried: Vec<usize> = Vec::new();
        let mut last_err: Option<ProxyError> = None;
        self.retry_budget.on_request(Instant::now());
        // Whether one more attempt may be made: within the per-request count and the budget.
        let may_retry = |attempt: u32| {
            attempt < self.cfg.limits.retries && {
                let ok = self.retry_budget.try_retry(Instant::now());
                if !ok {
                    self.metrics.retries_over_budget.inc();
                }
                ok
            }
        };
        for attempt in 0..=self.cfg.limits.retries {
            let no_backend = |e: String| ProxyError::new(ErrorKind::NoBackend, e);
            let (pick, _permit) = match (&self.admission, out.record) {
                (Some(admission), true) => {
                    let class = self.cfg.classes.get(&ctx.class);
                    let plan = self.pool_plan(&ctx.pool);
                    let ask = Ask {
                        class: &ctx.class,
                        priority: class.map_or(0, |c| c.priority),
                        max_queue: class.map_or(1024, |c| c.max_queue),
                        timeout: Duration::from_millis(
                            class.map_or(30_000, |c| c.queue_timeout_ms),
                        ),
                        tokens: u64::from(out.route.prompt_tokens)
                            + out.max_tokens.map_or(UNSET_MAX_TOKENS, |m| {
                                // No engine serves more than u32::MAX tokens of output.
                                m.clamp(0, i64::from(u32::MAX)) as u64
                            }),
                        claim: plan.claim.clone(),
                        reach: plan.reach.clone(),
                        borrow_below: plan.borrow_below,
                    };
                    let mut chosen = None;
                    // Picks that found no room before the one that admitted (the request queued).
                    let mut no_room = 0u32;
                    // What routing would have chosen without the caps, when that was elsewhere.
                    let mut displaced: Option<(&'static str, u32, usize, usize)> = None;
                    // Until when the request may wait for its routing choice at its cap (as long
                    // as prefilling what it would lose elsewhere takes), once it started to; and
                    // whether it did.
                    let mut wait_until: Option<tokio::time::Instant> = None;
                    let mut waited = false;
                    // Times the pick was asked (more than once: the request waited).
                    let mut picks = 0u32;
                    let prefix_wait = &self.cfg.admission;
                    let acquired = {
                        let pick = |room: &[Room]| {
                            let route_start = Instant::now();
                            let look = self.look(out.model);
                            let own = look.candidates(&plan.members, &tried);
                            let borrowed = look.candidates(&plan.borrowable, &tried);
                            if !own.iter().chain(&borrowed).any(|v| v.healthy) {
                                return Err(());
                            }
                            // A prefix-aware policy's choice without the caps, only when a cap
                            // takes a replica out (so the uncapped path routes once); `select`
                            // of a history policy is pure, its record comes on the write.
                            let uncapped = (policy.history().is_some()
                                && own.iter().any(|v| v.healthy && !room[v.id].free))
                            .then(|| policy.select(&out.route, &own).ok())
                            .flatten();
                            // That choice is at its cap, and the request has not waited for it
                            // as long as it may yet.
                            let home = uncapped.filter(|u| {
                                !room[u.backend].free
                                    && attempt == 0
                                    && prefix_wait.prefill_tokens_per_s > 0.0
                                    && wait_until.is_none_or(|t| tokio::time::Instant::now() < t)
                            });
                            let others = home.map(|h| {
                                let mut v = own.clone();
                                for x in &mut v {
                                    x.healthy &= x.id != h.backend;
                                }
                                v
                            });
                            // Own replicas with room first, then borrowed ones below their floor.
                            let mut picked = None;
                            for (mut views, borrowing) in [(own, false), (borrowed, true)] {
                                for v in &mut views {
                                    let r = room[v.id];
                                    v.healthy &= if borrowing {
                                        r.below(plan.borrow_below)
                                    } else {
                                        r.free
                                    };
                                }
                                if let Ok(p) = policy.select(&out.route, &views) {
                                    picked = Some(p);
                                    break;
                                }
                            }
                            // Where it would go instead: the best replica with room, else the
                            // best other one once it has room.
                            let elsewhere = home.map(|_| {
                                picked
                                    .as_ref()
                                    .map(|p| p.matched_tokens)
                                    .or_else(|| {
                                        others
                                            .and_then(|v| policy.select(&out.route, &v).ok())
                                            .map(|p| p.matched_tokens)
                                    })
                                    .unwrap_or(0)
                            });
                            self.metrics
                                .route_seconds
                                .observe(route_start.elapsed().as_secs_f64());
                            let wait = home.zip(elsewhere).and_then(|(h, elsewhere)| {
                                let wait = admission::prefix_wait(
                                    h.matched_tokens.saturating_sub(elsewhere),
                                    prefix_wait.prefix_wait_min_tokens,
                                    prefix_wait.prefill_tokens_per_s,
                                    ask.timeout,
                                )?;
                                Some((h, wait))
                            });
                            picks += 1;
                            if let Some((h, wait)) = wait {
                                let until = *wait_until
                                    .get_or_insert_with(|| tokio::time::Instant::now() + wait);
                                // Admission may send it to the replica with room at once after
                                // all (no place in the queue, no time left): that is a
                                // displacement like any other.
                                displaced = picked.map(|p| {
                                    let why = if waited { "waited" } else { "full" };
                                    let lost = h.matched_tokens.saturating_sub(p.matched_tokens);
                                    (why, lost, h.backend, p.backend)
                                });
                                chosen = picked;
                                waited = true;
                                return Ok(AdmissionPick::WaitFor {
                                    replica: h.backend,
                                    until,
                                    instead: picked.map(|p| p.backend),
                                });
                            }
                            Ok(match picked {
                                Some(p) => {
                                    let b = p.backend;
                                    displaced = uncapped.filter(|u| u.backend != b).map(|u| {
                                        let why = if waited {
                                            "waited"
                                        } else if no_room > 0 {
                                            "queued"
                                        } else {
                                            "full"
                                        };
                                        let lost =
                                            u.matched_tokens.saturating_sub(p.matched_tokens);
                                        (why, lost, u.backend, b)
                                    });
                                    chosen = Some(p);
                                    AdmissionPick::Backend(b)
                                }
                                None => {
                                    no_room += 1;
                                    AdmissionPick::NoRoom
                                }
                            })
                        };
                        let _waiting = self.lifecycle.waiting_for_admission();
                        tokio::select! {
                            biased;
                            r = admission.acquire(&ask, pick) => r,
                            _ = self.lifecycle.queue_closed() => {
                                return Err(ProxyError::new(
                                    ErrorKind::ShuttingDown,
                                    "the proxy is shutting down; this request was not sent to any replica, so it is safe to retry",
                                )
                                .with_retry_after(1));
                            }
                            _ = session.as_downstream_mut().read_body_or_idle(true) => {
                                self.metrics
                                    .client_aborts
                                    .with_label_values(&["none"])
                                    .inc();
                                return Ok(Ended::ClientGone);
                            }
                        }
                    };
                    // Counted per request, as the routed tokens are: a retry is admitted again.
                    let first_attempt = attempt == 0;
                    if acquired.is_ok() && waited && picks > 1 && first_attempt {
                        self.metrics
                            .prefix_waits
                            .with_label_values(&[&ctx.pool])
                            .inc();
                    }
                    if let (Ok(_), Some((why, tokens, chosen, went)), true) =
                        (&acquired, displaced, first_attempt)
                    {
                        tracing::debug!(
                            request_id = %ctx.request_id,
                            pool = %ctx.pool,
                            why,
                            chosen = %self.fleet.backends[chosen].name,
                            went = %self.fleet.backends[went].name,
                            matched_tokens_lost = tokens,
                            prompt_tokens = out.route.prompt_tokens,
                            "admission displaced the request from its routing choice"
                        );
                        self.metrics
                            .displaced
                            .with_label_values(&[&ctx.pool, why])
                            .inc();
                        self.metrics
                            .displaced_matched_tokens
                            .with_label_values(&[&ctx.pool])
                            .inc_by(u64::from(tokens));
                    }
                    match (acquired, chosen) {
                        (Ok(permit), Some(pick)) => (pick, Some(permit)),
                        (Err(Err(())), _) => {
                            return Err(last_err.unwrap_or_else(|| self.unavailable(plan)));
                        }
                        (Err(Ok(refusal)), _) => {
                            let (kind, why) = match refusal {
                                Refusal::QueueFull => (
                                    ErrorKind::QueueFull,
                                    format!(
                                        "every replica is at its admission cap and {} requests of class {} are already waiting",
                                        ask.max_queue, ctx.class
                                    ),
                                ),
                                Refusal::QueueTimeout => (
                                    ErrorKind::QueueTimeout,
                                    format!(
                                        "waited {} ms for a replica with room (class {})",
                                        ask.timeout.as_millis(),
                                        ctx.class
                                    ),
                                ),
                            };
                            let e = ProxyError::new(kind, why)
                                .with_retry_after(admission.retry_after());
                            self.metrics
                                .refused
                                .with_label_values(&[&ctx.pool, &ctx.class, e.reason()])
                                .inc();
                            return Err(e);
                        }
                        (Ok(_), None) => return Err(no_backend("no replica picked".into())),
                    }
                }
                _ => {
                    let route_start = Instant::now();
                    let plan = self.pool_plan(&ctx.pool);
                    let look = self.look(out.model);
                    let mut views = look.candidates(&plan.members, &tried);
                    if !views.iter().any(|v| v.healthy) {
                        views = look.candidates(&plan.borrowable, &tried);
                    }
                    let pick = match policy.select(&out.route, &views) {
                        Ok(p) => p,
                        Err(_) if !views.iter().any(|v| v.healthy) => {
                            return Err(last_err.unwrap_or_else(|| self.unavailable(plan)));
                        }
                        Err(e) => return Err(last_err.unwrap_or_else(|| no_backend(e.to_string()))),
                    };
                    self.metrics
                        .route_seconds
                        .observe(route_start.elapsed().as_secs_f64());
                    (pick, None)
                }
            };
            let backend = self.fleet.backends[pick.backend].clone();
            if attempt == 0 {
                ctx.predicted_cached_tokens =
                    policy.history().is_some().then_some(pick.matched_tokens);
            }
            if attempt == 0 && out.record {
                self.metrics
                    .routed_prompt_tokens
                    .inc_by(u64::from(out.route.prompt_tokens));
                self.metrics
                    .routed_matched_tokens
                    .inc_by(u64::from(pick.matched_tokens));
            }
            self.metrics
                .routed
                .with_label_values(&[policy.name(), &backend.name])
                .inc();
            tried.push(backend.id);
            ctx.backend = Some(backend.name.clone());
            let uncached = out.route.prompt_tokens.saturating_sub(pick.matched_tokens);
            let guard = InFlight::new(backend.clone(), u64::from(uncached));

            // The replica holds the prompt's blocks while the request runs and frees them when
            // it ends: the policy is told both, however the attempt ends.
            let running = Running {
                policy,
                route: &out.route,
                backend: pick.backend,
                recorded: AtomicBool::new(false),
            };
            let now = Instant::now();
            ctx.dispatched.get_or_insert(now);
            ctx.sent = Some(now);
            let started = match self
                .start(
                    session,
                    &backend,
                    &out.body,
                    &ctx.request_id,
                    self.headers.strips_authorization(ctx.keys.is_some()),
                    // The replica is told once it has the prompt: every attempt that sent it (a
                    // retry's replica gets the prompt when the first never did), and none that
                    // could not connect.
                    || {
                        if out.record {
                            policy.record(&out.route, &pick);
                            running.recorded.store(true, Ordering::Relaxed);
                        }
                    },
                )
                .await
            {
                Attempt::Started(s) => s,
                Attempt::ClientGone => {
                    self.metrics
                        .client_aborts
                        .with_label_values(&[&backend.name])
                        .inc();
                    return Ok(Ended::ClientGone);
                }
                Attempt::Failed(e) => {
                    self.fleet.request_failed(&backend);
                    if e.retryable && may_retry(attempt) {
                        self.metrics.retries.with_label_values(&[e.reason()]).inc();
                        last_err = Some(e);
                        continue;
                    }
                    return Err(e);
                }
            };
            let status = started.resp.status.as_u16();
            // With no other replica to try, the engine's own answer (its message, its
            // Retry-After) is worth more to the client than the proxy's 502.
            let untried = || {
                let plan = self.pool_plan(&ctx.pool);
                let look = self.look(out.model);
                [&plan.members, &plan.borrowable]
                    .iter()
                    .any(|m| look.candidates(m, &tried).iter().any(|v| v.healthy))
            };
            if RETRY_STATUSES.contains(&status) && untried() && may_retry(attempt) {
                self.fleet.request_failed(&backend);
                self.metrics
                    .retries
                    .with_label_values(&[&format!("status_{status}")])
                    .inc();
                // Dropping the session closes its connection; the body is not wanted.
                last_err = Some(ProxyError::new(
                    ErrorKind::UpstreamReset,
                    format!("{} answered {status}", backend.name),
                ));
                continue;
            }
            if status >= 500 {
                self.fleet.request_failed(&backend);
            } else {
                self.fleet.request_succeeded(&backend);
            }
            ctx.status = status;
            return Ok(self.relay(session, ctx, started, guard).await);
        }
        Err(last_err.unwrap_or_else(|| ProxyError::new(ErrorKind::NoBackend, "no attempt made")))
    }

    /// One look at the fleet for a pick: every replica's view and, when a model was asked for,
    /// which replicas list it.
    fn look(&self, model: Option<&str>) -> FleetLook {
        FleetLook {
            views: self.fleet.views(),
            serves: model.map(|m| self.fleet.backends.iter().map(|b| b.serves(m)).collect()),
        }
    }

    /// Connects, sends the request and waits for the response header, while watching the client.
    async fn start(
        &self,
        session: &mut Session,
        backend: &Backend,
        body: &Bytes,
        request_id: &str,
        strip_authorization: bool,
        on_sent: impl FnOnce(),
    ) -> Attempt {
        let Some(addr) = backend.addr() else {
            return Attempt::Failed(ProxyError::new(
                ErrorKind::UpstreamConnect,
                format!("{}: {} has not resolved", backend.name, backend.authority),
            ));
        };
        let out = Outbound {
            session,
            backend,
            body_len: body.len(),
            request_id,
            rules: &self.headers,
            strip_authorization,
        };
        let head_only = session.req_header().method == http::Method::HEAD;
        let send = match &backend.tls_host {
            None => match upstream_head(&out) {
                Ok(head) => {
                    Either::Left(self.send_plain(backend, addr, head, head_only, body, on_sent))
                }
                Err(e) => return Attempt::Failed(e),
            },
            Some(host) => match upstream_header(&out) {
                // Boxed: pingora's connector makes this future ten times the plaintext one's
                // size, and every request would copy the larger of the two as it starts.
                Ok(header) => Either::Right(Box::pin(
                    self.send_tls(backend, addr, host, header, body, on_sent),
                )),
                Err(e) => return Attempt::Failed(e),
            },
        };
        tokio::select! {
            r = send => match r {
                Ok((up, resp)) => Attempt::Started(Box::new(Started { up, resp })),
                Err(e) => Attempt::Failed(e),
            },
            _ = session.as_downstream_mut().read_body_or_idle(true) => Attempt::ClientGone,
        }
    }

    /// Sends the request to a plaintext replica over headroom's own client and reads its
    /// response header.
    async fn send_plain(
        &self,
        backend: &Backend,
        addr: std::net::SocketAddr,
        head: Vec<u8>,
        head_only: bool,
        body: &Bytes,
        on_sent: impl FnOnce(),
    ) -> Result<(Upstream, ResponseHeader), ProxyError> {
        let t = &self.cfg.timeouts;
        let limits = h1::Limits {
            connect: Duration::from_millis(t.connect_ms),
            first_byte: Duration::from_millis(t.first_byte_ms),
        };
        let req = h1::Request {
            head: &head,
            body,
            head_only,
        };
        let (resp, body) =
            h1::exchange(&self.h1_pool, addr, &backend.name, req, limits, on_sent).await?;
        Ok((Upstream::Plain(body), resp))
    }

    /// Sends the request to a replica reached over TLS, through pingora's connector, and reads
    /// its response header.
    async fn send_tls(
        &self,
        backend: &Backend,
        addr: std::net::SocketAddr,
        host: &str,
        header: RequestHeader,
        body: &Bytes,
        on_sent: impl FnOnce(),
    ) -> Result<(Upstream, ResponseHeader), ProxyError> {
        let t = &self.cfg.timeouts;
        // The SNI is also the name the certificate is verified against (never empty for TLS:
        // pingora skips verification without one).
        let mut peer = HttpPeer::new(addr, true, host.to_owned());
        peer.options.connection_timeout = Some(Duration::from_millis(t.connect_ms));
        // Built whenever the config names a replica reached over TLS, as this one is.
        let connector = self.connector.as_ref().ok_or_else(|| {
            ProxyError::new(
                ErrorKind::UpstreamConnect,
                "connect: no TLS connector for this config",
            )
        })?;
        let (mut up, _reused) = connector
            .get_http_session(&peer)
            .await
            .map_err(|e| classify(&e, "connect"))?;
        up.write_request_header(Box::new(header))
            .await
            .map_err(|e| classify(&e, "sending request"))?;
        up.write_request_body(body.clone(), true)
            .await
            .map_err(|e| classify(&e, "sending body"))?;
        up.finish_request_body()
            .await
            .map_err(|e| classify(&e, "sending body"))?;
        on_sent();
        let first_byte = Duration::from_millis(t.first_byte_ms);
        let deadline = tokio::time::Instant::now() + first_byte;
        loop {
            match tokio::time::timeout_at(deadline, up.read_response_header()).await {
                Err(_) => {
                    return Err(ProxyError::new(
                        ErrorKind::UpstreamTimeout,
                        format!(
                            "{} sent no response header within {first_byte:?}",
                            backend.name
                        ),
                    ));
                }
                Ok(Err(e)) => return Err(classify(&e, "reading response header")),
                Ok(Ok(())) => {
                    let resp = up.response_header().cloned().ok_or_else(|| {
                        ProxyError::new(ErrorKind::UpstreamReset, "no response header")
                    })?;
                    // Interim answers (`100 Continue`, `103 Early Hints`) come before the final
                    // one and are read past: the client asked for neither.
                    if resp.status.is_informational() {
                        continue;
                    }
                    let up = Upstream::Pingora {
                        session: Box::new(up),
                        peer: Box::new(peer),
                    };
                    return Ok((up, resp));
                }
            }
        }
    }

    /// Relays the response to the client. Past this point every outcome is final.
    async fn relay(
        &self,
        session: &mut Session,
        ctx: &mut RequestCtx,
        started: Box<Started>,
        mut guard: InFlight,
    ) -> Ended {
        let Started { mut up, mut resp } = *started;
        let backend = guard.backend().clone();
        for h in ["connection", "keep-alive", "proxy-connection"] {
            resp.remove_header(h);
        }
        let _ = resp.insert_header("x-headroom-backend", backend.name.as_str());
        // The id the access log and the capture know the request by, for the client to quote. It
        // replaces one the engine sent: vLLM with --enable-request-id-headers echoes the same
        // one, and an id an engine made up would be one no record of the proxy's names.
        let _ = resp.insert_header("x-request-id", ctx.request_id.as_str());
        // An encoded (compressed) body is passed through as it is, unread: the proxy asks for
        // none (it drops the client's `Accept-Encoding`), so only an engine that compresses
        // unasked sends one.
        let encoded = resp
            .headers
            .get(header::CONTENT_ENCODING)
            .is_some_and(|v| !v.as_bytes().eq_ignore_ascii_case(b"identity"));
        let is_sse = !encoded
            && resp
                .headers
                .get(header::CONTENT_TYPE)
                .and_then(|v| v.to_str().ok())
                .is_some_and(headroom_workload::sse::is_event_stream);
        let has_length = resp.headers.contains_key(header::CONTENT_LENGTH);
        // An engine that ends its answer by closing the connection: its close is no proof of a
        // finished answer.
        let close_delimited = !has_length && !resp.headers.contains_key(header::TRANSFER_ENCODING);
        if has_length {
            // Framed by its length, whoever the client is.
        } else if session.req_header().version == http::Version::HTTP_10 {
            // An HTTP/1.0 client knows no chunked coding: its body ends when the connection
            // closes (RFC 9112 §6.1).
            resp.remove_header(&header::TRANSFER_ENCODING);
            session.set_keepalive(None);
        } else if !resp.headers.contains_key(header::TRANSFER_ENCODING)
            && !matches!(resp.status.as_u16(), 204 | 304)
            && session.req_header().method != http::Method::HEAD
        {
            // An engine that ends its answer by closing the connection (an HTTP/1.0 server, or
            // `Connection: close` without a length): the client gets it chunked, so its own
            // connection stays open and a cut still shows as one (no last chunk).
            let _ = resp.insert_header(header::TRANSFER_ENCODING, "chunked");
        }
        // The client speaks with this proxy, an HTTP/1.1 server, whatever version the engine
        // answered in (RFC 9110 §6.2).
        resp.set_version(http::Version::HTTP_11);
        let end_now = up.done();
        // A chunked body goes to a plaintext client straight to its socket, chunk by chunk
        // (pingora writes the header and the last chunk).
        let direct = chunked_body(session, &resp);
        let write_limit = self.client_write_limit();
        if !write_within(
            write_limit,
            session.write_response_header(Box::new(resp), false),
        )
        .await
        {
            return self.client_gone(session, &backend);
        }
        ctx.response_started = true;
        // A usage chunk the proxy asked for is cut out again; a response with a fixed length is
        // passed through whole (it cannot be shortened).
        let strip = ctx.strip_usage && !has_length && !encoded;
        let mut meter = ResponseMeter::new(is_sse, strip);
        if ctx.mirror.as_ref().is_some_and(|m| m.wants_digest()) {
            meter = meter.with_digest();
        }
        let pumped = if end_now {
            Pumped::Complete
        } else {
            let limits = PumpLimits {
                write_timeout: write_limit,
                first_byte: Duration::from_millis(self.cfg.timeouts.first_byte_ms),
                idle: Duration::from_millis(self.cfg.timeouts.idle_ms),
                max_event: self.cfg.limits.max_event_bytes as usize,
                close_delimited,
            };
            // A plaintext replica's body to a plaintext client goes through a task of its own:
            // each chunk then wakes and runs that small task alone, not the request's whole
            // stack of futures (pingora's and the proxy's, each touched cold once per chunk).
            let detached = match (&up, direct) {
                (Upstream::Plain(_), true) => {
                    crate::app::client_conn(session).and_then(|c| c.relay_handle())
                }
                _ => None,
            };
            match detached {
                Some(Ok(client)) => {
                    let Some(back) = pump_in_own_task(up, meter, guard, client, limits).await
                    else {
                        // Cancelled by the runtime shutting down: the stream ends with it (its
                        // meter went with the task; the record has no timing).
                        return self.client_gone(session, &backend);
                    };
                    let end;
                    (end, up, meter, guard) = back;
                    end
                }
                handle => {
                    if let Some(Err(e)) = handle {
                        tracing::debug!("the relay's own handle on the client failed: {e}");
                    }
                    let client = ClientSide::Session { session, direct };
                    pump(&mut up, &mut meter, &mut guard, client, limits).await
                }
            }
        };
        // A cut is told to the client (an error event, the body's end) before the timing record
        // closes, so the request's end counts that write.
        let ended = match pumped {
            Pumped::Complete => None,
            Pumped::ClientGone => Some(self.client_gone(session, &backend)),
            Pumped::Cut(cut) => {
                // An event can be added to a stream only where its end is the proxy's to write.
                let can_tell = is_sse && !has_length;
                Some(
                    self.upstream_cut(session, &backend, can_tell, cut, write_limit)
                        .await,
                )
            }
        };
        let rest = meter.finish(std::time::Instant::now(), ended.is_none());
        ctx.meter = Some(meter);
        if let Some(ended) = ended {
            return ended;
        }
        if rest.is_some()
            && !write_within(write_limit, session.write_response_body(rest, false)).await
        {
            return self.client_gone(session, &backend);
        }
        if !write_within(write_limit, session.write_response_body(None, true)).await {
            return self.client_gone(session, &backend);
        }
        if !is_sse && ctx.status == 200 {
            // A whole (non-streamed) answer: its tokens reached the client now.
            guard.first_output();
        }
        let pool_idle = Duration::from_millis(self.cfg.timeouts.pool_idle_ms);
        match up {
            Upstream::Plain(body) => body.release(&self.h1_pool, pool_idle),
            Upstream::Pingora { session, peer } => {
                if let Some(connector) = &self.connector {
                    connector
                        .release_http_session(*session, &*peer, Some(pool_idle))
                        .await;
                }
            }
        }
        Ended::Complete
    }

    /// The client went away or stopped taking bytes in the middle of a response: the connection
    /// ends as it is (pingora would end the body cleanly after a cut chunk, or wait on a client
    /// that takes nothing).
    fn client_gone(&self, session: &mut Session, backend: &Backend) -> Ended {
        end_client_connection(session);
        self.metrics
            .client_aborts
            .with_label_values(&[&backend.name])
            .inc();
        Ended::ClientGone
    }

    /// The replica failed mid-response: a stream whose end is the proxy's to write (chunked, or
    /// ended by the close) gets an SSE error event so the client sees a failure rather than a
    /// clean end; anything else, a stream framed by its length included (an event would be cut
    /// to fit, or leave the body short on a connection kept for the next response), is cut off.
    /// An event the client does not take within `write_limit` cuts the connection off too.
    async fn upstream_cut(
        &self,
        session: &mut Session,
        backend: &Backend,
        tell: bool,
        cut: Cut,
        write_limit: Duration,
    ) -> Ended {
        self.metrics
            .upstream_cut
            .with_label_values(&[&backend.name])
            .inc();
        self.fleet.request_failed(backend);
        if tell {
            let why = match cut {
                Cut::Closed => format!("{} closed the stream before it finished", backend.name),
                Cut::Silent(t) => format!("{} sent nothing for {} ms", backend.name, t.as_millis()),
                Cut::Oversized(n) => format!(
                    "{} sent an event longer than {n} bytes (limits.max_event_bytes)",
                    backend.name
                ),
            };
            let event = serde_json::json!({"error": {
                "message": why, "type": "UpstreamError", "param": null, "code": 502}});
            let mut buf = Vec::new();
            headroom_workload::sse::write_data(&mut buf, &event.to_string());
            if write_within(
                write_limit,
                session.write_response_body(Some(buf.into()), false),
            )
            .await
                && write_within(write_limit, session.write_response_body(None, true)).await
            {
                return Ended::UpstreamCut;
            }
            // Part of the event may be out: no last chunk after it, and no next response.
        }
        // Without an event the only honest signal is an abrupt close: no last chunk that would
        // make the cut body look whole.
        end_client_connection(session);
        Ended::UpstreamCut
    }
}
