//! The request handler: each client connection's HTTP/1 requests are read with pingora's session
//! (`serve_connection`), classified by route and answered (`answer`): generation requests are
//! inspected, routed and forwarded (forward.rs), `/v1/models` is merged over the fleet, `/health`
//! and `/tokenize` are passed through, and anything else is a 404 that never reaches an engine.

use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use bytes::{Bytes, BytesMut};
use headroom_config::serve::ServeConfig;
use headroom_workload::inspect::{
    Endpoint, InspectConfig, InspectError, Inspected, ask_for_usage, inspect,
};
use headroom_workload::measure::ResponseMeter;
use http::{Method, header};
use pingora::apps::{HttpPersistentSettings, ReusedHttpStream};
use pingora::connectors::http::Connector;
use pingora::http::{RequestHeader, ResponseHeader};
use pingora::protocols::Stream;
use pingora::proxy::Session;
use tokio::sync::watch;

use crate::auth::Keys;
use crate::error::{ErrorKind, ProxyError};
use crate::forward::{Ended, HeaderRules, Outgoing, end_client_connection, write_within};
use crate::lifecycle::{Lifecycle, OpenRequest};
use crate::record::PromptFacts;
use crate::routing::{LeastLoad, RouteRequest, RoutingPolicy};
use crate::telemetry::Metrics;
use crate::telemetry::capture::Capture;
use crate::upstreams::Fleet;

/// Request bodies at least this large (about 8,000 prompt tokens, ~0.2 ms of inspection) are
/// inspected on the blocking pool rather than on an async worker; smaller ones cost less than the
/// hand-off between threads.
pub const INSPECT_OFF_WORKER_BYTES: usize = 32 * 1024;

/// The proxy: shared by every connection.
pub struct Headroom {
    /// The replicas.
    pub fleet: Arc<Fleet>,
    /// The configured routing policy (generation requests).
    pub policy: Arc<dyn RoutingPolicy>,
    /// Passing-through routes go to the least-loaded replica.
    pub passthrough: LeastLoad,
    /// Metrics.
    pub metrics: Arc<Metrics>,
    /// Pooled upstream connections to replicas reached over TLS; none when the config names no
    /// `https://` replica (building pingora's connector parses the system's CA bundle twice).
    pub connector: Option<Arc<Connector>>,
    /// Pooled upstream connections to plaintext replicas.
    pub h1_pool: Arc<crate::upstreams::h1::Pool>,
    /// The config it was built from.
    pub cfg: Arc<ServeConfig>,
    /// Prompt hashing settings.
    pub inspect: InspectConfig,
    /// Large-body inspections running at once on the blocking pool, at most one per core: a
    /// burst of long prompts queues here instead of starting a thread each.
    pub inspect_slots: Arc<tokio::sync::Semaphore>,
    /// For fan-out requests (`/v1/models`).
    pub http: reqwest::Client,
    /// Where finished requests are recorded.
    pub recorder: Arc<crate::record::Recorder>,
    /// Pools whose requests are copied to a candidate pool.
    pub shadows: Option<Arc<crate::shadow::Shadows>>,
    /// The trace capture, when configured.
    pub capture: Option<Arc<Capture>>,
    /// Per-replica caps and the queue, when enabled.
    pub admission: Option<Arc<crate::admission::Admission>>,
    /// The pools, with their members as backend masks.
    pub pools: Vec<PoolPlan>,
    /// Client API keys: the serving config's, whichever config this request runs on.
    pub keys: crate::auth::KeySlot,
    /// What forwarding removes from and sets on request headers.
    pub headers: HeaderRules,
    /// Open requests and draining.
    pub lifecycle: Arc<Lifecycle>,
    /// Set when a reloaded config replaced this one.
    pub retired: Arc<std::sync::atomic::AtomicBool>,
    /// Retries as a bounded share of requests.
    pub retry_budget: crate::retry_budget::RetryBudget,
}

/// A pool resolved against the fleet.
#[derive(Debug, Clone)]
pub struct PoolPlan {
    /// Its name.
    pub name: String,
    /// `members[backend id]`: the backend belongs to the pool.
    pub members: Vec<bool>,
    /// Backends of the pools it may borrow from.
    pub borrowable: Vec<bool>,
    /// A borrowed backend is used below this fraction of its cap.
    pub borrow_below: f64,
    /// `members` for admission: what its waiting requests hold back from those behind them.
    pub claim: crate::admission::Reach,
    /// `members` or `borrowable`: the replicas whose releases wake its waiting requests.
    pub reach: crate::admission::Reach,
}

impl PoolPlan {
    /// The pools of `cfg` over its backends, in config order.
    pub fn all(cfg: &ServeConfig) -> Vec<Self> {
        let names: Vec<String> = cfg.backends.iter().map(|b| b.display_name()).collect();
        let pools = cfg.pool_list();
        let mask = |members: &[String]| -> Vec<bool> {
            names.iter().map(|n| members.contains(n)).collect()
        };
        pools
            .iter()
            .map(|p| {
                let borrowed: Vec<String> = pools
                    .iter()
                    .filter(|o| p.borrow.contains(&o.name))
                    .flat_map(|o| o.backends.iter().cloned())
                    .filter(|b| !p.backends.contains(b))
                    .collect();
                let members = mask(&p.backends);
                let borrowable = mask(&borrowed);
                let reach = members.iter().zip(&borrowable).map(|(m, b)| *m || *b);
                Self {
                    name: p.name.clone(),
                    claim: members.as_slice().into(),
                    reach: reach.collect(),
                    members,
                    borrowable,
                    borrow_below: p.borrow_below,
                }
            })
            .collect()
    }
}

impl std::fmt::Debug for Headroom {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Headroom")
            .field("fleet", &self.fleet)
            .field("policy", &self.policy.name())
            .finish_non_exhaustive()
    }
}

/// Per-request state.
#[derive(Debug)]
pub struct RequestCtx {
    /// When the request header arrived.
    pub start: Instant,
    /// The route's name in metrics.
    pub route: &'static str,
    /// The replica that answered, if one did.
    pub backend: Option<String>,
    /// Prompt tokens a prefix-aware policy expected its first choice of replica to hold cached.
    pub predicted_cached_tokens: Option<u32>,
    /// The status sent to the client.
    pub status: u16,
    /// The response header has been sent.
    pub response_started: bool,
    /// The client's `x-request-id`, or one made up for it.
    pub request_id: String,
    /// Wall-clock arrival (trace timestamps).
    pub arrival: SystemTime,
    /// Pool the request belongs to.
    pub pool: String,
    /// Class the request belongs to.
    pub class: String,
    /// The class was found (from the request, or its key's): a request refused before that
    /// (no key, a bad key, a malformed request) is of no class, and counts in no class's numbers.
    pub classified: bool,
    /// Why the proxy answered with an error of its own (`x-headroom-error`), if it did.
    pub error: Option<&'static str>,
    /// First dispatch to a replica (the end of queueing at the proxy).
    pub dispatched: Option<Instant>,
    /// The last attempt's dispatch.
    pub sent: Option<Instant>,
    /// The proxy asked for a usage chunk the client did not; it is cut out of the response.
    pub strip_usage: bool,
    /// What the response looked like, as it passed.
    pub meter: Option<ResponseMeter>,
    /// The response was relayed to its end.
    pub completed: bool,
    /// What inspection learnt (generation requests).
    pub prompt: Option<PromptFacts>,
    /// The client's API key (its index in `keys`), once checked.
    pub key: Option<usize>,
    /// The keys it was checked against.
    pub keys: Option<Arc<Keys>>,
    /// Counts the request open until the context is dropped.
    pub open: OpenRequest,
    /// The shadow copy of this request, waiting to hear how the primary ended.
    pub mirror: Option<crate::shadow::MirrorLink>,
}

enum Route {
    Generate(Endpoint),
    Models,
    /// A CORS preflight on a served path.
    Preflight,
    PassThrough,
    Unknown,
}

/// A browser's CORS preflight: `OPTIONS` with `Origin` and `Access-Control-Request-Method`, and
/// no body.
fn is_preflight(req: &RequestHeader) -> bool {
    let h = &req.headers;
    req.method == Method::OPTIONS
        && h.contains_key(header::ORIGIN)
        && h.contains_key(header::ACCESS_CONTROL_REQUEST_METHOD)
        && !h.contains_key(header::TRANSFER_ENCODING)
        && h.get(header::CONTENT_LENGTH)
            .is_none_or(|v| v.as_bytes() == b"0")
}

fn route_of(path: &str) -> (Route, &'static str) {
    if let Some(e) = Endpoint::from_path(path) {
        let name = match e {
            Endpoint::Chat => "chat",
            Endpoint::Completions => "completions",
        };
        return (Route::Generate(e), name);
    }
    match path {
        "/v1/models" => (Route::Models, "models"),
        "/health" => (Route::PassThrough, "health"),
        "/tokenize" => (Route::PassThrough, "tokenize"),
        "/detokenize" => (Route::PassThrough, "detokenize"),
        _ => (Route::Unknown, "unknown"),
    }
}

impl Headroom {
    /// The pool named `name` (the first pool when no pool has that name).
    pub(crate) fn pool_plan(&self, name: &str) -> &PoolPlan {
        self.pools
            .iter()
            .find(|p| p.name == name)
            .unwrap_or(&self.pools[0])
    }

    /// A key's class, when this config has it (a request checked against a newer config's keys
    /// may name a class this one lacks: the other rules then classify it).
    fn key_class<'k>(&self, key: Option<&'k crate::auth::ClientKey>) -> Option<&'k String> {
        key.and_then(|k| k.class.as_ref())
            .filter(|c| self.cfg.classes.contains_key(*c))
    }

    /// The key a request was let in with.
    fn client_key(ctx: &RequestCtx) -> Option<&crate::auth::ClientKey> {
        ctx.key.zip(ctx.keys.as_ref()).map(|(i, keys)| keys.get(i))
    }

    /// The class of a request: its API key's, when the key has one; else its header's, when it
    /// names a class; else the first class (by name) listing its model, then its path; else the
    /// class of the longest prompt threshold it reaches; else the default class.
    fn classify(
        &self,
        key: Option<&crate::auth::ClientKey>,
        header: Option<String>,
        model: Option<&str>,
        path: &str,
        prompt_tokens: Option<u32>,
    ) -> String {
        let classes = &self.cfg.classes;
        if let Some(c) = self.key_class(key) {
            return c.clone();
        }
        if let Some(c) = header.filter(|c| classes.contains_key(c)) {
            return c;
        }
        if let Some(m) = model {
            if let Some((name, _)) = classes
                .iter()
                .find(|(_, c)| c.models.iter().any(|x| x == m))
            {
                return name.clone();
            }
        }
        if let Some((name, _)) = classes
            .iter()
            .find(|(_, c)| c.paths.iter().any(|p| p == path))
        {
            return name.clone();
        }
        if let Some(n) = prompt_tokens {
            let by_length = classes
                .iter()
                .filter_map(|(name, c)| c.min_prompt_tokens.filter(|&t| n >= t).map(|t| (t, name)))
                .max();
            if let Some((_, name)) = by_length {
                return name.clone();
            }
        }
        self.cfg.measure.default_class.clone()
    }

    async fn handle(&self, session: &mut Session, ctx: &mut RequestCtx) -> Result<(), ProxyError> {
        let path = session.req_header().uri.path().to_owned();
        let method = session.req_header().method.clone();
        let (mut route, mut name) = route_of(&path);
        if !matches!(route, Route::Unknown) && is_preflight(session.req_header()) {
            // A browser's CORS preflight carries no credentials and starts no work: the engine
            // answers it as it would directly (vLLM allows every origin unless told otherwise).
            (route, name) = (Route::Preflight, "preflight");
        }
        ctx.route = name;
        check_headers(session, &self.cfg.limits)?;
        // Cheap refusals first: the key and its rate (a key probing unknown paths spends its
        // rate too), the allow-list; then the body.
        if let Some(keys) = self
            .keys
            .current()
            .filter(|_| !matches!(name, "health" | "preflight"))
        {
            let auth = session.req_header().headers.get(header::AUTHORIZATION);
            let i = keys.authenticate(auth.map(|v| v.as_bytes()))?;
            ctx.key = Some(i);
            ctx.keys = Some(keys.clone());
            // A key's class is known before its rate is checked: its refusals count in it.
            if let Some(class) = self.key_class(Some(keys.get(i))) {
                ctx.pool = self.cfg.pool_of(class);
                ctx.class = class.clone();
                ctx.classified = true;
            }
            let admitted = keys.admit(i);
            let outcome = if admitted.is_ok() {
                "accepted"
            } else {
                "rate_limited"
            };
            self.metrics
                .key_requests
                .with_label_values(&[keys.get(i).name.as_str(), outcome])
                .inc();
            admitted?;
        }
        match route {
            Route::Unknown => Err(ProxyError::new(
                ErrorKind::UnknownRoute,
                format!("headroom does not serve {path}"),
            )),
            Route::Generate(endpoint) => {
                if method != Method::POST {
                    return Err(ProxyError::method_not_allowed(&method, &path, "POST"));
                }
                let body = self.read_body(session).await?;
                self.generate(session, ctx, endpoint, &path, body).await
            }
            Route::Models => {
                if method != Method::GET {
                    return Err(ProxyError::method_not_allowed(&method, &path, "GET"));
                }
                self.models(session, ctx).await
            }
            // Without the engine's key (its CORS middleware answers preflights unasked for one),
            // and without a body.
            Route::Preflight => self.pass_through(session, ctx, Bytes::new()).await,
            // The probe needs no key, so it takes no more than a probe: GET or HEAD, no body.
            Route::PassThrough if name == "health" => {
                if method != Method::GET && method != Method::HEAD {
                    return Err(ProxyError::method_not_allowed(&method, &path, "GET, HEAD"));
                }
                if !session.as_downstream_mut().is_body_empty() {
                    return Err(ProxyError::new(
                        ErrorKind::BadRequest,
                        "a health probe carries no body",
                    ));
                }
                self.pass_through(session, ctx, Bytes::new()).await
            }
            Route::PassThrough => {
                let body = self.read_body(session).await?;
                self.pass_through(session, ctx, body).await
            }
        }
    }

    /// Forwards a request that is neither generation nor routed by prompt, to the least-loaded
    /// replica, unrecorded.
    async fn pass_through(
        &self,
        session: &mut Session,
        ctx: &mut RequestCtx,
        body: Bytes,
    ) -> Result<(), ProxyError> {
        let out = Outgoing {
            body,
            route: RouteRequest::default(),
            record: false,
            model: None,
            max_tokens: None,
        };
        ctx.error = self
            .forward(session, ctx, out, &self.passthrough)
            .await?
            .reason();
        Ok(())
    }

    async fn generate(
        &self,
        session: &mut Session,
        ctx: &mut RequestCtx,
        endpoint: Endpoint,
        path: &str,
        body: Bytes,
    ) -> Result<(), ProxyError> {
        // The request has been read in one go (pingora's parse, the body): before inspecting it,
        // chunks that came in meanwhile go out.
        crate::forward::let_streams_through().await;
        // A body the inspector cannot read still goes to an engine, whose own error is the
        // authoritative one; it is routed without prefix information. A body that is not JSON at
        // all (or nests past serde_json's recursion limit) no engine could accept: refused here.
        let inspected = match self.inspect_off_worker(endpoint, &body).await {
            Ok(i) => Some(i),
            Err(e @ InspectError::NotJson(_)) => {
                return Err(ProxyError::new(ErrorKind::BadRequest, e.to_string()));
            }
            Err(_) => None,
        };
        match &inspected {
            None => self.metrics.uninspectable.inc(),
            Some(i) => {
                if let Some(e) = &i.engine_error {
                    self.metrics.engine_tokens_failed.inc();
                    tracing::debug!("the engine's tokens could not be made: {e}");
                }
            }
        }
        let header = |name: &str| {
            session
                .req_header()
                .headers
                .get(name)
                .and_then(|v| v.to_str().ok())
                .map(str::to_owned)
        };
        let session_key = header(self.cfg.routing.session_header.as_str());
        ctx.class = self.classify(
            Self::client_key(ctx),
            header(self.cfg.measure.class_header.as_str()),
            inspected.as_ref().and_then(|i| i.model.as_deref()),
            path,
            inspected.as_ref().map(|i| i.prompt_tokens),
        );
        ctx.pool = self.cfg.pool_of(&ctx.class);
        ctx.classified = true;
        // A prompt longer than routing hashes is hashed whole for the capture, off the request path.
        let long_body = inspected
            .as_ref()
            .filter(|i| i.tail_hash.is_none() && self.capture.is_some())
            .map(|_| (endpoint, body.clone()));
        let body = match inspected.as_ref() {
            Some(i) if self.cfg.measure.inject_usage => match ask_for_usage(&body, i) {
                Some(rewritten) => {
                    ctx.strip_usage = true;
                    Bytes::from(rewritten)
                }
                None => body,
            },
            _ => body,
        };
        if let Some((shadows, shadow)) = self
            .shadows
            .as_ref()
            .and_then(|s| Some((s, s.sampling(&ctx.pool, &ctx.request_id)?)))
        {
            let copy = crate::shadow::Copy {
                class: ctx.class.clone(),
                request_id: ctx.request_id.clone(),
                path: session
                    .req_header()
                    .uri
                    .path_and_query()
                    .map_or_else(|| path.to_owned(), |p| p.as_str().to_owned()),
                headers: crate::forward::mirrored_headers(
                    session.req_header(),
                    &self.headers,
                    self.headers.strips_authorization(ctx.keys.is_some()),
                ),
                body: body.clone(),
                facts: inspected
                    .clone()
                    .map(|i| PromptFacts::of(ctx.route, i, session_key.clone(), None)),
                deterministic: inspected.as_ref().is_some_and(|i| i.deterministic),
                arrival: ctx.arrival,
            };
            ctx.mirror = shadows.mirror(shadow, copy);
        }
        let route = RouteRequest {
            blocks: inspected.as_ref().map_or(&[], |i| &i.blocks),
            block_tokens: self.inspect.block_tokens,
            prompt_tokens: inspected
                .as_ref()
                .map_or((body.len() / 4) as u32, |i| i.prompt_tokens),
            session: session_key.as_deref(),
            not_engine_chain: inspected.as_ref().is_some_and(|i| i.engine_error.is_some()),
        };
        let out = Outgoing {
            body,
            route,
            record: true,
            model: inspected.as_ref().and_then(|i| i.model.as_deref()),
            max_tokens: inspected.as_ref().and_then(|i| i.max_tokens),
        };
        let ended = self.forward(session, ctx, out, self.policy.as_ref()).await;
        ctx.prompt = inspected.map(|i| PromptFacts::of(ctx.route, i, session_key, long_body));
        let ended = ended?;
        ctx.error = ended.reason();
        match ended {
            Ended::ClientGone => ctx.status = 499,
            Ended::Complete => ctx.completed = true,
            Ended::UpstreamCut => {}
        }
        Ok(())
    }

    /// Inspects `body`, on the blocking pool when it is large: parsing, rendering and hashing
    /// cost about 23 µs per 1,000 prompt tokens (routing.md#cost), and an async worker busy
    /// for milliseconds with one long prompt delays every stream whose next chunk it was due to
    /// relay. Below [`INSPECT_OFF_WORKER_BYTES`] the hand-off would cost more than it saves.
    async fn inspect_off_worker(
        &self,
        endpoint: Endpoint,
        body: &Bytes,
    ) -> Result<Inspected, InspectError> {
        let started = Instant::now();
        let (result, on) = if body.len() < INSPECT_OFF_WORKER_BYTES {
            (inspect(endpoint, body, &self.inspect), "worker")
        } else {
            // The semaphore is never closed, so a permit always comes.
            let slot = self.inspect_slots.clone().acquire_owned().await;
            let (body, cfg) = (body.clone(), self.inspect.clone());
            let result = tokio::task::spawn_blocking(move || {
                let _slot = slot;
                inspect(endpoint, &body, &cfg)
            })
            .await
            // Only a panic in the inspector lands here: the request is still served,
            // unrouted by prefix, like any body headroom cannot read.
            .unwrap_or_else(|e| Err(InspectError::Body(format!("inspection failed: {e}"))));
            (result, "blocking_pool")
        };
        self.metrics
            .inspect_seconds
            .with_label_values(&[on])
            .observe(started.elapsed().as_secs_f64());
        result
    }

    /// Reads the whole request body, refusing one over `limits.max_body_bytes`.
    async fn read_body(&self, session: &mut Session) -> Result<Bytes, ProxyError> {
        let read = self.read_body_within_limits(session).await;
        if read
            .as_ref()
            .is_err_and(|e| matches!(e.kind, ErrorKind::ClientBody | ErrorKind::BodyTimeout))
        {
            // What is left of a body framed wrongly, or still on its way, would be read as the
            // next request on this connection: it is closed after the answer instead. (A body
            // over the limit is left to pingora, which drains or closes without a reset.)
            session.set_keepalive(None);
        }
        read
    }

    async fn read_body_within_limits(&self, session: &mut Session) -> Result<Bytes, ProxyError> {
        let max = self.cfg.limits.max_body_bytes;
        let too_large = || {
            ProxyError::new(
                ErrorKind::BodyTooLarge,
                format!("the request body is larger than {max} bytes (limits.max_body_bytes)"),
            )
        };
        let declared = session
            .req_header()
            .headers
            .get(header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u64>().ok());
        if declared.is_some_and(|n| n > max) {
            return Err(too_large());
        }
        let expects_continue = session
            .req_header()
            .headers
            .get(header::EXPECT)
            .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"100-continue"))
            // An HTTP/1.0 client cannot take an interim response (RFC 9110 §10.1.1).
            && session.req_header().version != http::Version::HTTP_10;
        if expects_continue {
            let limit = self.client_write_limit();
            if !write_within(limit, session.as_downstream_mut().write_continue_response()).await {
                // Part of the interim answer may be out: nothing more is written after it, and
                // the error's answer does not wait on the client a second time.
                end_client_connection(session);
                return Err(ProxyError::new(
                    ErrorKind::ClientBody,
                    "the client did not take the 100 Continue within timeouts.client_write_ms",
                ));
            }
        }
        let mut body = BytesMut::with_capacity(declared.unwrap_or(0).min(max) as usize);
        let budget = Duration::from_millis(self.cfg.timeouts.body_read_ms);
        let deadline = tokio::time::Instant::now() + budget;
        loop {
            let Ok(read) = tokio::time::timeout_at(deadline, session.read_request_body()).await
            else {
                return Err(ProxyError::new(
                    ErrorKind::BodyTimeout,
                    format!(
                        "the request body did not arrive within {budget:?} (timeouts.body_read_ms)"
                    ),
                ));
            };
            match read {
                Ok(Some(chunk)) => {
                    if (body.len() + chunk.len()) as u64 > max {
                        return Err(too_large());
                    }
                    body.extend_from_slice(&chunk);
                }
                Ok(None) => return Ok(body.freeze()),
                Err(e) => {
                    return Err(ProxyError::new(
                        ErrorKind::ClientBody,
                        format!("reading the request body: {}", e.to_string().trim()),
                    ));
                }
            }
        }
    }

    /// `/v1/models`: the models of every available replica, each listed once.
    async fn models(&self, session: &mut Session, ctx: &mut RequestCtx) -> Result<(), ProxyError> {
        let asks = self
            .fleet
            .backends
            .iter()
            .filter(|b| self.fleet.is_available(b))
            .map(|b| {
                let req = self
                    .http
                    .get(format!("{}/v1/models", b.url))
                    .timeout(Duration::from_millis(self.cfg.health.timeout_ms.max(2_000)));
                async move {
                    let resp = req.send().await.ok()?;
                    if !resp.status().is_success() {
                        return None;
                    }
                    resp.json::<serde_json::Value>().await.ok()
                }
            });
        let answers = futures_util::future::join_all(asks).await;
        let mut seen = std::collections::HashSet::new();
        let mut data = Vec::new();
        let mut answered = false;
        for list in answers.into_iter().flatten() {
            answered = true;
            let Some(models) = list.get("data").and_then(|d| d.as_array()) else {
                continue;
            };
            for m in models {
                let id = m.get("id").and_then(|i| i.as_str()).unwrap_or_default();
                if seen.insert(id.to_owned()) {
                    data.push(m.clone());
                }
            }
        }
        if !answered {
            return Err(ProxyError::new(
                ErrorKind::NoBackend,
                "no replica answered /v1/models",
            ));
        }
        let body = serde_json::to_vec(&serde_json::json!({"object": "list", "data": data}))
            .unwrap_or_default();
        ctx.status = 200;
        respond(
            session,
            self.client_write_limit(),
            200,
            "application/json",
            body,
            None,
            &ctx.request_id,
        )
        .await;
        Ok(())
    }
}

/// Refuses a header block over the limits (431). (A body framed two ways at once, Content-Length
/// and Transfer-Encoding, pingora already reads as chunked, as RFC 9112 §6.3 says, and closes the
/// connection after it, so nothing smuggled behind it is read as a request.)
fn check_headers(
    session: &mut Session,
    limits: &headroom_config::serve::LimitConfig,
) -> Result<(), ProxyError> {
    let headers = &session.req_header().headers;
    let (fields, bytes) = (
        headers.len(),
        headers
            .iter()
            .map(|(n, v)| n.as_str().len() + v.len() + 4)
            .sum::<usize>(),
    );
    if fields <= limits.max_headers as usize && bytes as u64 <= limits.max_header_bytes {
        return Ok(());
    }
    // The body was not read: the connection cannot carry another request.
    session.set_keepalive(None);
    Err(ProxyError::new(
        ErrorKind::HeadersTooLarge,
        format!(
            "{fields} header fields, {bytes} bytes: at most {} fields and {} bytes \
             (limits.max_headers, limits.max_header_bytes)",
            limits.max_headers, limits.max_header_bytes
        ),
    ))
}

/// Writes a complete response, each write within `limit`; a client that has gone away is not an
/// error worth reporting, and one that takes nothing has its connection ended. It carries the
/// request's id, as a replica's answer does.
#[allow(clippy::too_many_arguments)]
async fn respond(
    session: &mut Session,
    limit: Duration,
    status: u16,
    content_type: &str,
    body: Vec<u8>,
    error: Option<&ProxyError>,
    request_id: &str,
) {
    let Some(resp) = answer_header(status, content_type, body.len(), error, request_id) else {
        return;
    };
    let written = write_within(limit, session.write_response_header(Box::new(resp), false)).await
        && write_within(limit, session.write_response_body(Some(body.into()), true)).await;
    if !written {
        end_client_connection(session);
    }
}

/// The header of an answer of the proxy's own: its type and length, the request's id (when one
/// was read), and for an error its reason, `Retry-After`, `Allow` and `WWW-Authenticate`.
fn answer_header(
    status: u16,
    content_type: &str,
    len: usize,
    error: Option<&ProxyError>,
    request_id: &str,
) -> Option<ResponseHeader> {
    let mut resp = ResponseHeader::build(status, Some(5)).ok()?;
    let _ = resp.insert_header(header::CONTENT_TYPE, content_type);
    let _ = resp.insert_header(header::CONTENT_LENGTH, len.to_string());
    if !request_id.is_empty() {
        let _ = resp.insert_header("x-request-id", request_id);
    }
    if let Some(e) = error {
        let _ = resp.insert_header("x-headroom-error", e.reason());
        if e.status() == 401 {
            let _ = resp.insert_header(header::WWW_AUTHENTICATE, "Bearer");
        }
        if let Some(allow) = e.allow {
            let _ = resp.insert_header(header::ALLOW, allow);
        }
        if let Some(s) = e.retry_after() {
            let _ = resp.insert_header(header::RETRY_AFTER, s.to_string());
        }
    }
    Some(resp)
}

/// How long a refused connection's close waits for the client to stop sending (at most).
const LINGER: Duration = Duration::from_secs(2);

fn request_id(session: &Session) -> String {
    session
        .req_header()
        .headers
        .get("x-request-id")
        .and_then(|v| v.to_str().ok())
        .filter(|v| !v.is_empty() && v.len() <= 128)
        .map_or_else(|| format!("{:016x}", rand_id()), str::to_owned)
}

fn rand_id() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    xxhash_rust::xxh3::xxh3_64_with_seed(&n.to_le_bytes(), t ^ u64::from(std::process::id()))
}

impl Headroom {
    /// How long a client may take to accept one of the proxy's writes (`timeouts.client_write_ms`).
    pub(crate) fn client_write_limit(&self) -> Duration {
        Duration::from_millis(self.cfg.timeouts.client_write_ms)
    }

    /// Closes a connection whose request is not served, after the answer to `refusal` when there
    /// is one (in the shape of every other answer of the proxy's, counted with them); each write
    /// within the write limit (over TLS the close is written too: close_notify).
    async fn close(&self, session: &mut Session, refusal: Option<ProxyError>, request_id: &str) {
        let limit = self.client_write_limit();
        let answered = refusal.is_some();
        if let Some(e) = refusal {
            self.metrics
                .proxy_errors
                .with_label_values(&[e.reason()])
                .inc();
            let body = e.body();
            if let Some(resp) = answer_header(
                e.status(),
                "application/json",
                body.len(),
                Some(&e),
                request_id,
            ) {
                let answer = session
                    .downstream_session
                    .write_error_response(resp, body.into());
                write_within(limit, answer).await;
            }
            // Counted and logged as every other request the proxy refused (route "unknown").
            let mut ctx = self.new_ctx();
            ctx.status = e.status();
            ctx.error = Some(e.reason());
            ctx.request_id = request_id.to_owned();
            self.account(&mut ctx);
        }
        if answered {
            self.lingering_close(session).await;
        } else {
            let _ = tokio::time::timeout(limit, session.downstream_session.shutdown()).await;
        }
    }

    /// Shuts the proxy's side of a connection whose answer is written, then reads past what the
    /// client still sends (a body, a pipelined request) until it stops ([`LINGER`] at most): a
    /// close with bytes unread would reset the connection under the answer.
    async fn lingering_close(&self, session: &mut Session) {
        let limit = self.client_write_limit();
        let _ = tokio::time::timeout(limit, session.downstream_session.shutdown()).await;
        if let Some(conn) = client_conn(session) {
            conn.linger(LINGER).await;
        }
    }

    fn new_ctx(&self) -> RequestCtx {
        RequestCtx {
            start: Instant::now(),
            route: "unknown",
            backend: None,
            predicted_cached_tokens: None,
            status: 0,
            response_started: false,
            request_id: String::new(),
            arrival: SystemTime::now(),
            pool: self.pools[0].name.clone(),
            class: self.cfg.measure.default_class.clone(),
            classified: false,
            error: None,
            dispatched: None,
            sent: None,
            strip_usage: false,
            meter: None,
            completed: false,
            prompt: None,
            key: None,
            keys: None,
            open: self.lifecycle.open_request(),
            mirror: None,
        }
    }

    /// Serves a client connection's HTTP/1 requests, one after another, until it closes or is not
    /// kept alive. pingora's HTTP session reads and parses each request and writes the answer;
    /// this loop stands where pingora's `HttpProxy` would, without its proxy machinery: headroom
    /// answers every request itself, and the request's future is part of the connection's task,
    /// not a new ~18 KB box per request.
    pub(crate) async fn serve_connection(
        &self,
        mut stream: Stream,
        shutdown: &watch::Receiver<bool>,
    ) {
        let mut carried: Option<HttpPersistentSettings> = None;
        loop {
            let mut session = Session::new_h1(stream);
            match carried.take() {
                Some(settings) => settings.apply_to_session(&mut session.downstream_session),
                // Kept alive without a timeout of pingora's (0: none): the client connection
                // (client_conn.rs) bounds each header's read and ends an idle connection after
                // `timeouts.keepalive_ms` itself, where pingora's timeout would cap that at its
                // own 60 s and arm a timer for every request's read.
                None => session.set_keepalive(Some(0)),
            }
            match session.downstream_session.read_request().await {
                Ok(true) => {}
                // Closed before a request, or an idle keep-alive connection timed out.
                Ok(false) => return,
                Err(e) => {
                    // A client gone mid-header is ordinary traffic, not an error of the proxy's.
                    tracing::debug!("client connection: {e}");
                    // The reason names no byte of what was sent: it could be anything.
                    let malformed = (e.etype == pingora::ErrorType::InvalidHTTPHeader).then(|| {
                        ProxyError::new(
                            ErrorKind::MalformedHeader,
                            "the request's header could not be read: it is malformed, its body \
                             is framed two ways, or it is not HTTP/1.1 or HTTP/1.0 (headroom \
                             speaks HTTP/1.x; an HTTP/2 client must use HTTP/1.1 here)",
                        )
                    });
                    self.close(&mut session, malformed, "").await;
                    return;
                }
            }
            if *shutdown.borrow() {
                // A request read once the listener stopped is the connection's last.
                session.set_keepalive(None);
            }
            if session.req_header().method == Method::CONNECT {
                // A tunnel changes how the connection is framed: never served.
                let mut refusal =
                    ProxyError::new(ErrorKind::MethodNotAllowed, "headroom opens no tunnels");
                refusal.allow = Some("GET, HEAD, POST, OPTIONS");
                let id = request_id(&session);
                self.close(&mut session, Some(refusal), &id).await;
                return;
            }
            let mut ctx = self.new_ctx();
            self.answer(&mut session, &mut ctx).await;
            self.log(&mut session, &mut ctx);
            let settings = HttpPersistentSettings::for_session(&session.downstream_session);
            if !session.as_downstream_mut().is_body_done() && ctx.status >= 400 {
                // Refused before its body was read (too large, a bad key, …), and so not kept
                // alive: the client may still be sending that body.
                self.lingering_close(&mut session).await;
                return;
            }
            // A body not ended yet gets its end here (a last chunk pingora writes unbounded).
            let finished = tokio::time::timeout(
                self.client_write_limit(),
                session.downstream_session.finish(),
            );
            let Ok(Ok(Some(reusable))) = finished.await else {
                return;
            };
            // The settings carry any bytes of a pipelined next request already read.
            let (next, settings) =
                ReusedHttpStream::from_reusable_stream(reusable, settings).consume();
            carried = settings;
            stream = next;
        }
    }

    /// Answers one request, whatever happens: an error becomes its response here.
    async fn answer(&self, session: &mut Session, ctx: &mut RequestCtx) {
        ctx.start = Instant::now();
        ctx.arrival = SystemTime::now();
        if let Some(conn) = client_conn(session) {
            conn.header_parsed();
        }
        ctx.request_id = request_id(session);
        if self.lifecycle.draining() || self.retired.load(std::sync::atomic::Ordering::Acquire) {
            // Clients reconnect: through the load balancer to a proxy that is staying, or to
            // this one's current config.
            session.set_keepalive(None);
        }
        session
            .as_downstream_mut()
            .set_write_timeout(Some(self.client_write_limit()));
        // A client that has every byte of a response (a whole JSON body) may send its next
        // request on the connection before the replica's end of stream reaches the proxy. Without
        // pipelining the relay's disconnect watch reads that request's first byte, takes it for a
        // client gone (a 499 in the record), closes the connection and loses the request; with it,
        // the bytes wait for the next request on this connection (RFC 9112 §9.3.2).
        session.as_downstream_mut().set_pipelining_enabled(true);
        if let Err(e) = self.handle(session, ctx).await {
            self.metrics
                .proxy_errors
                .with_label_values(&[e.reason()])
                .inc();
            ctx.status = e.status();
            ctx.error = Some(e.reason());
            if e.kind == ErrorKind::ShuttingDown || !session.as_downstream_mut().is_body_done() {
                // The process is about to exit, or the request was refused before its body was
                // read: the answer says `Connection: close` rather than inviting another request
                // on a connection that will not be there, or whose next request would have to
                // be found past a body nobody wants (a draining read the keep-alive limits
                // could not tell from the next request's header).
                session.set_keepalive(None);
            }
            if !ctx.response_started {
                let limit = self.client_write_limit();
                respond(
                    session,
                    limit,
                    e.status(),
                    "application/json",
                    e.body(),
                    Some(&e),
                    &ctx.request_id,
                )
                .await;
            }
        }
    }

    /// The request's end: its count, its record and its access-log line.
    fn log(&self, session: &mut Session, ctx: &mut RequestCtx) {
        if !session.as_downstream_mut().is_body_done() {
            // A body nobody read (a preflight's, say) would be drained as the connection's next
            // bytes, under the next header's clock: the connection closes instead.
            session.set_keepalive(None);
        }
        if let Some(conn) = client_conn(session) {
            conn.response_done();
        }
        self.account(ctx);
    }

    /// A request's count, its record and its access-log line.
    fn account(&self, ctx: &mut RequestCtx) {
        let status = ctx.status.to_string();
        self.metrics
            .requests
            .with_label_values(&[ctx.route, ctx.backend.as_deref().unwrap_or("none"), &status])
            .inc();
        if matches!(ctx.route, "chat" | "completions") && ctx.classified {
            self.finish_record(ctx);
        }
        if self.cfg.log.access {
            let key = Self::client_key(ctx).map(|k| k.name.as_str());
            let (pool, class) = if ctx.classified {
                (ctx.pool.as_str(), ctx.class.as_str())
            } else {
                ("-", "-")
            };
            tracing::info!(
                target: "headroom::access",
                // A string value is quoted and escaped: a client-chosen id cannot forge other fields.
                request_id = ctx.request_id.as_str(),
                route = ctx.route,
                status = ctx.status,
                backend = ctx.backend.as_deref().unwrap_or("none"),
                pool = %pool,
                class = %class,
                key = key.unwrap_or("-"),
                error = ctx.error.unwrap_or("-"),
                // To the microsecond: more digits are the float's noise, not the clock's.
                ms = (ctx.start.elapsed().as_secs_f64() * 1e6).round() / 1e3,
            );
        }
    }
}

/// The client connection a request came on (the accept loop wraps every one).
pub(crate) fn client_conn(session: &Session) -> Option<&crate::client_conn::ClientConn> {
    session
        .as_downstream()
        .stream()
        .and_then(crate::client_conn::ClientConn::of)
}
