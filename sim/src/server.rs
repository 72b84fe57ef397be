//! One simulated replica's HTTP surface: vLLM's OpenAI routes, `/health`, `/version`,
//! `/metrics`, `/tokenize`, with vLLM's validation order, error bodies and streaming behaviour.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::serve::ListenerExt;
use headroom_workload::openai::{
    ChatCompletionRequest, ChatMessage, CompletionRequest, GenerationParams, Prompt, render_chat,
};
use headroom_workload::sse;
use headroom_workload::tokenizer::Tokenizer;
use rand::rngs::StdRng;
use rand::{Rng, RngCore, SeedableRng};
use serde::Deserialize;
use serde_json::json;

use crate::api::{ChunkWriter, Completed, Endpoint, Usage, error_body, full_response, quote};
use crate::core::NewRequest;
use crate::engine::{Engine, EngineHandle, Submission};
use crate::faults::{Faults, injected_error};

/// The vLLM version the simulator answers as.
pub const VLLM_VERSION: &str = "0.33.0";
/// Largest request body accepted (a 131k-token prompt as text is a few MB).
const MAX_BODY_BYTES: usize = 256 << 20;
/// Llama 3's `<|begin_of_text|>`, prepended to text completion prompts as its tokenizer does.
const BOS: u32 = 128_000;

/// Serving settings of one replica (everything but the engine's own limits).
#[derive(Debug, Clone)]
pub struct ServeSettings {
    /// Name clients use in `model`.
    pub served_model_name: String,
    /// `root` in `/v1/models` (the `--model` path or id).
    pub model_root: String,
    /// Longest prompt + output.
    pub max_model_len: u32,
    /// Role of generated chat messages.
    pub response_role: String,
    /// 503 when this many requests already wait (`--max-num-queued-reqs`).
    pub max_num_queued_reqs: Option<usize>,
    /// Send the usage chunk even when not asked (`--enable-force-include-usage`).
    pub force_include_usage: bool,
    /// `usage.prompt_tokens_details.cached_tokens` in the final usage
    /// (`--enable-prompt-tokens-details`).
    pub prompt_tokens_details: bool,
    /// Mean output length when EOS is not ignored (exponentially distributed).
    pub mean_output_tokens: u32,
    /// Faults applied to every request.
    pub faults: Faults,
    /// Share of requests answered with an injected error, in [0, 1].
    pub failure_rate: f64,
    /// Share of requests whose text is perturbed, in [0, 1].
    pub perturb_rate: f64,
    /// Statuses injected at `failure_rate`, one drawn per failure.
    pub failure_statuses: Vec<u16>,
    /// `/health` answers 503 (and generation refuses) for this long after start.
    pub startup_duration: Duration,
    /// Seed of per-request randomness (output text, output length, injected failures).
    pub seed: u64,
}

/// A replica: settings, engine and the randomness of its request handling.
#[derive(Debug)]
pub struct Replica {
    settings: ServeSettings,
    engine: EngineHandle,
    _owner: Engine,
    started: Instant,
    rng: Mutex<StdRng>,
    fingerprint: String,
}

impl Replica {
    /// A replica around a running engine.
    pub fn new(settings: ServeSettings, engine: Engine) -> Self {
        let fingerprint = format!(
            "vllm-{VLLM_VERSION}-{:08x}",
            xxhash_rust::xxh3::xxh3_64(settings.model_root.as_bytes()) as u32
        );
        Self {
            rng: Mutex::new(StdRng::seed_from_u64(settings.seed)),
            engine: engine.handle(),
            _owner: engine,
            started: Instant::now(),
            fingerprint,
            settings,
        }
    }

    /// The engine handle (metrics, queue).
    pub fn engine(&self) -> &EngineHandle {
        &self.engine
    }

    /// vLLM's 404 for a `model` it does not serve (an absent `model` is accepted).
    fn check_model(&self, model: Option<&str>) -> Result<(), ApiError> {
        match model {
            Some(m) if m != self.settings.served_model_name => Err(ApiError {
                status: 404,
                kind: "NotFoundError",
                message: format!(
                    "The model `{m}` does not exist. Valid aliases: {}.",
                    self.settings.served_model_name
                ),
                param: Some("model".to_owned()),
            }),
            _ => Ok(()),
        }
    }

    fn cold(&self) -> bool {
        self.started.elapsed() < self.settings.startup_duration
    }

    fn random_u64(&self) -> u64 {
        self.rng
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .next_u64()
    }

    fn random_failure(&self) -> Option<u16> {
        if self.settings.failure_rate <= 0.0 || self.settings.failure_statuses.is_empty() {
            return None;
        }
        let mut rng = self.rng.lock().unwrap_or_else(|e| e.into_inner());
        if rng.random::<f64>() >= self.settings.failure_rate {
            return None;
        }
        let i = rng.random_range(0..self.settings.failure_statuses.len());
        Some(self.settings.failure_statuses[i])
    }
}

/// The replica's routes.
pub fn router(replica: Arc<Replica>) -> Router {
    Router::new()
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .route("/v1/models", get(models))
        .route("/health", get(health))
        // vLLM's load-balancer probe, answered as /health is (GET or POST).
        .route("/ping", get(health).post(health))
        .route("/version", get(version))
        .route("/metrics", get(metrics))
        .route("/tokenize", post(tokenize))
        .route("/reset_prefix_cache", post(reset_prefix_cache))
        // FastAPI's answer to a path it does not serve.
        .fallback(|| async {
            (
                StatusCode::NOT_FOUND,
                axum::Json(json!({"detail": "Not Found"})),
            )
        })
        // vLLM bounds prompts by tokens (a 400 with its message), not bodies by bytes.
        .layer(axum::extract::DefaultBodyLimit::max(MAX_BODY_BYTES))
        .with_state(replica)
}

/// An error answered in vLLM's shape.
#[derive(Debug)]
struct ApiError {
    status: u16,
    kind: &'static str,
    message: String,
    param: Option<String>,
}

impl ApiError {
    fn bad_request(message: impl Into<String>, param: Option<&str>) -> Self {
        let mut message = message.into();
        if let Some(p) = param {
            message.push_str(&format!(" (parameter={p})"));
        }
        Self {
            status: 400,
            kind: "BadRequestError",
            message,
            param: param.map(str::to_owned),
        }
    }

    /// A body that failed to parse: pydantic's summary shape, type "Bad Request".
    fn validation(e: &serde_json::Error) -> Self {
        let kind = if e.is_data() {
            "value_error"
        } else {
            "json_invalid"
        };
        Self {
            status: 400,
            kind: "Bad Request",
            message: format!(
                "1 validation error:\n  {{'type': '{kind}', 'loc': 'body', 'msg': {}}}",
                quote(&e.to_string())
            ),
            param: Some("body".to_owned()),
        }
    }

    fn injected(status: u16) -> Self {
        let (kind, message) = injected_error(status);
        Self {
            status,
            kind,
            message: message.to_owned(),
            param: None,
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = StatusCode::from_u16(self.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        let body = error_body(self.status, self.kind, &self.message, self.param.as_deref());
        (status, axum::Json(body)).into_response()
    }
}

async fn chat(State(r): State<Arc<Replica>>, headers: HeaderMap, body: Bytes) -> Response {
    generate(r, Endpoint::Chat, headers, body)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

async fn completions(State(r): State<Arc<Replica>>, headers: HeaderMap, body: Bytes) -> Response {
    generate(r, Endpoint::Completions, headers, body)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

fn request_faults(r: &Replica, headers: &HeaderMap) -> Result<Faults, ApiError> {
    let mut faults = r.settings.faults.clone();
    if let Some(v) = headers.get("x-headroom-fault") {
        let text = v
            .to_str()
            .map_err(|_| ApiError::bad_request("x-headroom-fault is not ASCII", None))?;
        let parsed = Faults::parse(text).map_err(|e| ApiError::bad_request(e, None))?;
        faults = faults.overridden_by(&parsed);
    }
    if let Some(v) = headers.get("x-return-error") {
        let status = v
            .to_str()
            .ok()
            .and_then(|s| s.trim().parse::<u16>().ok())
            .filter(|s| (400..600).contains(s));
        faults.error = Some(status.ok_or_else(|| {
            ApiError::bad_request("X-Return-Error needs a status in 400..599", None)
        })?);
    }
    Ok(faults)
}

/// Prompt token ids of a request, as vLLM's renderer would produce them.
fn prompt_tokens(
    endpoint: Endpoint,
    body: &Bytes,
) -> Result<(Vec<u32>, GenerationParams), ApiError> {
    match endpoint {
        Endpoint::Chat => {
            let req: ChatCompletionRequest =
                serde_json::from_slice(body).map_err(|e| ApiError::validation(&e))?;
            Ok((Tokenizer.encode(&render_chat(&req.messages)), req.params))
        }
        Endpoint::Completions => {
            let req: CompletionRequest =
                serde_json::from_slice(body).map_err(|e| ApiError::validation(&e))?;
            let tokens = match req.prompt {
                Prompt::Text(t) if !t.is_empty() => {
                    let mut ids = vec![BOS];
                    ids.extend(Tokenizer.encode(&t));
                    ids
                }
                Prompt::Tokens(ids) => ids,
                Prompt::TextBatch(v) if v.len() == 1 && !v[0].is_empty() => {
                    let mut ids = vec![BOS];
                    ids.extend(Tokenizer.encode(&v[0]));
                    ids
                }
                Prompt::TokensBatch(mut v) if v.len() == 1 => v.remove(0),
                Prompt::TextBatch(v) if v.len() > 1 => {
                    return Err(ApiError::bad_request(
                        "headroom sim serves one prompt per request",
                        Some("prompt"),
                    ));
                }
                Prompt::TokensBatch(v) if v.len() > 1 => {
                    return Err(ApiError::bad_request(
                        "headroom sim serves one prompt per request",
                        Some("prompt"),
                    ));
                }
                _ => Vec::new(),
            };
            if tokens.is_empty() {
                return Err(ApiError::bad_request(
                    "Either prompt or prompt_embeds must be provided and non-empty.",
                    Some("prompt"),
                ));
            }
            Ok((tokens, req.params))
        }
    }
}

/// vLLM 0.33's length checks and `max_tokens` clamping; returns the output limit.
fn output_limit(
    endpoint: Endpoint,
    n: u32,
    params: &GenerationParams,
    max_model_len: u32,
) -> Result<u32, ApiError> {
    let m = max_model_len;
    if n > m {
        return Err(ApiError::bad_request(
            format!(
                "This model's maximum context length is {m} tokens. However, your prompt contains {n} input tokens, which exceeds this limit even without any output tokens. Please reduce the length of the input prompt."
            ),
            None,
        ));
    }
    if n == m {
        return Err(ApiError::bad_request(
            format!(
                "The decoder prompt (length {n}) plus the number of requested output tokens (at least 1) is longer than the maximum model length of {m}. Make sure that `max_model_len` is no smaller than the number of text tokens plus multimodal tokens. For image inputs, the number of image tokens depends on the number of images, and therefore might not be obvious to the users."
            ),
            None,
        ));
    }
    let requested = match (params.requested_max_tokens(), endpoint) {
        (Some(k), _) if k < 1 => {
            return Err(ApiError::bad_request(
                format!("max_tokens must be at least 1, got {k}."),
                Some("max_tokens"),
            ));
        }
        (Some(k), _) if k > i64::from(m) => {
            return Err(ApiError::bad_request(
                format!(
                    "max_tokens={k} cannot be greater than max_model_len={m}. Please request fewer output tokens."
                ),
                Some("max_tokens"),
            ));
        }
        (Some(k), _) => k as u32,
        (None, Endpoint::Completions) => 16,
        (None, Endpoint::Chat) => m - n,
    };
    Ok(requested.min(m - n))
}

async fn generate(
    r: Arc<Replica>,
    endpoint: Endpoint,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    let faults = request_faults(&r, &headers)?;
    if !r.engine.is_alive() {
        return Err(ApiError {
            status: 500,
            kind: "InternalServerError",
            message: "The engine has stopped.".into(),
            param: None,
        });
    }
    if r.cold() {
        return Err(ApiError::injected(503));
    }
    if faults.hang {
        std::future::pending::<()>().await;
    }
    if let Some(status) = faults.error.or_else(|| r.random_failure()) {
        return Err(ApiError::injected(status));
    }
    let content_type = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    if !content_type.starts_with("application/json") {
        return Err(ApiError {
            status: 400,
            kind: "Bad Request",
            message:
                "1 validation error:\n  Unsupported Media Type: Only 'application/json' is allowed"
                    .to_owned(),
            param: None,
        });
    }
    let (prompt, params) = prompt_tokens(endpoint, &body)?;
    let s = &r.settings;
    r.check_model(params.model.as_deref())?;
    if params.stream_options.is_some() && !params.stream {
        return Err(ApiError::bad_request(
            "Stream options can only be defined when `stream=True`.",
            Some("stream_options"),
        ));
    }
    if let Some((message, field)) = params.sampling_error() {
        return Err(ApiError::bad_request(message, Some(field)));
    }
    if params.n.is_some_and(|n| n != 1) {
        return Err(ApiError::bad_request(
            "headroom sim serves n=1 only.",
            Some("n"),
        ));
    }
    let n = prompt.len() as u32;
    let max_tokens = output_limit(endpoint, n, &params, s.max_model_len)?;
    if let Some(cap) = s.max_num_queued_reqs {
        if r.engine.waiting() >= cap {
            return Err(ApiError::injected(503));
        }
    }

    let min_tokens = params.min_tokens.unwrap_or(0);
    if min_tokens < 0 {
        return Err(ApiError::bad_request(
            format!("min_tokens must be greater than or equal to 0, got {min_tokens}."),
            Some("min_tokens"),
        ));
    }
    if min_tokens > i64::from(max_tokens) {
        return Err(ApiError::bad_request(
            format!(
                "min_tokens must be less than or equal to max_tokens={max_tokens}, got {min_tokens}."
            ),
            Some("min_tokens"),
        ));
    }
    // Greedy sampling depends on the prompt alone: the same prompt gives the same text (and
    // length) on every replica, as on a real engine.
    let greedy = params.temperature == Some(0.0);
    let seed = match params.seed {
        Some(s) => s as u64,
        None if greedy => {
            let bytes: Vec<u8> = prompt.iter().flat_map(|t| t.to_le_bytes()).collect();
            xxhash_rust::xxh3::xxh3_64(&bytes)
        }
        None => r.random_u64(),
    };
    let draw = |what: &[u8]| {
        (xxhash_rust::xxh3::xxh3_64_with_seed(what, seed) as f64 + 1.0) / (u64::MAX as f64 + 2.0)
    };
    let perturb_from = faults.perturb_after.or_else(|| {
        (draw(b"perturb") < s.perturb_rate)
            .then(|| (draw(b"perturb-at") * f64::from(max_tokens)) as u32)
    });
    let mean = f64::from(s.mean_output_tokens.max(1));
    let u = draw(b"length");
    let natural_len = (1.0 - mean * u.ln()).min(f64::from(u32::MAX)) as u32;
    let key = r.engine.next_key();
    let submission = r.engine.submit(NewRequest {
        key,
        prompt,
        max_tokens,
        min_tokens: min_tokens as u32,
        ignore_eos: params.ignore_eos,
        natural_len,
        seed,
        perturb_from,
        hash_extra: params.cache_salt.clone().unwrap_or_default().into_bytes(),
    });

    let base_id = headers
        .get("x-request-id")
        .and_then(|v| v.to_str().ok())
        // Drawn from the system's entropy, not the replica's seeded generator: replicas behind
        // one proxy, or a replica restarted with the same seed, must not repeat each other's ids.
        .map_or_else(|| format!("{:016x}", rand::random::<u64>()), str::to_owned);
    let id = match endpoint {
        Endpoint::Chat => format!("chatcmpl-{base_id}"),
        Endpoint::Completions => format!("cmpl-{base_id}"),
    };
    let created = unix_now();
    if params.stream {
        let include_usage = params.include_usage() || s.force_include_usage;
        let writer = ChunkWriter::new(
            endpoint,
            &id,
            created,
            &s.served_model_name,
            &s.response_role,
            params.continuous_usage(),
        );
        Ok(stream_response(StreamState {
            sub: submission,
            writer,
            endpoint,
            faults,
            include_usage,
            prompt_tokens_details: s.prompt_tokens_details,
            prompt_tokens: n,
            sent: 0,
            done: false,
            cut_next: false,
            stall_next: false,
        }))
    } else {
        collect_response(&r, submission, endpoint, faults, &id, created, n).await
    }
}

struct StreamState {
    sub: Submission,
    writer: ChunkWriter,
    endpoint: Endpoint,
    faults: Faults,
    include_usage: bool,
    prompt_tokens_details: bool,
    prompt_tokens: u32,
    sent: u32,
    done: bool,
    /// `drop-after` reached: the connection is cut when the next token would go out.
    cut_next: bool,
    /// `stall-after` reached: the next token waits the stall first.
    stall_next: bool,
}

/// The SSE response that relays `state.sub`'s tokens as chunks, applying the stream faults.
fn stream_response(state: StreamState) -> Response {
    let stream = futures_util::stream::unfold(state, |mut st| async move {
        if st.done {
            return None;
        }
        // Both faults act before the next token, not with the last one sent: while this waits,
        // the server flushes the tokens before it, so the client has exactly N of them.
        if st.cut_next {
            // The server writes what the body yields until the body is pending, and only then
            // flushes; a next token already waiting would bring the cut into the same write and
            // lose the head and the N tokens with it. Pending once first, so they go out.
            tokio::task::yield_now().await;
            let _ = st.sub.outputs.recv().await;
            st.done = true;
            return Some((Err(std::io::Error::other("fault: connection dropped")), st));
        }
        if std::mem::take(&mut st.stall_next) {
            tokio::time::sleep(st.faults.stall).await;
        }
        let Some(out) = st.sub.outputs.recv().await else {
            st.done = true;
            let mut buf = Vec::new();
            let err = error_body(500, "InternalServerError", "The engine stopped.", None);
            sse::write_data(&mut buf, &err.to_string());
            sse::write_data(&mut buf, sse::DONE);
            return Some((Ok(Bytes::from(buf)), st));
        };
        if st.sent == 0 {
            if let Some(d) = st.faults.stall_first {
                tokio::time::sleep(d).await;
            }
        }
        let mut buf = Vec::with_capacity(512);
        if st.sent == 0 && st.endpoint == Endpoint::Chat {
            sse::write_data(&mut buf, &st.writer.role_chunk(st.prompt_tokens));
        }
        st.sent += 1;
        let usage = Usage {
            prompt: out.prompt_tokens,
            completion: out.completion_tokens,
            cached: st.prompt_tokens_details.then_some(out.cached_tokens),
        };
        let finish = out.finish.map(|f| f.as_str());
        sse::write_data(&mut buf, &st.writer.token_chunk(out.text, finish, usage));
        if finish.is_some() {
            st.sub.finished();
            if st.include_usage {
                sse::write_data(&mut buf, &st.writer.usage_chunk(usage));
            }
            sse::write_data(&mut buf, sse::DONE);
            st.done = true;
        } else if st.faults.drop_after == Some(st.sent) {
            st.cut_next = true;
        } else if st.faults.stall_after == Some(st.sent) {
            st.stall_next = true;
        }
        Some((Ok::<_, std::io::Error>(Bytes::from(buf)), st))
    });
    let mut resp = Response::new(Body::from_stream(stream));
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream; charset=utf-8"),
    );
    resp
}

async fn collect_response(
    r: &Replica,
    mut sub: Submission,
    endpoint: Endpoint,
    faults: Faults,
    id: &str,
    created: u64,
    prompt_tokens: u32,
) -> Result<Response, ApiError> {
    let mut text = String::new();
    let mut usage = Usage {
        prompt: prompt_tokens,
        ..Usage::default()
    };
    let finish = loop {
        let Some(out) = sub.outputs.recv().await else {
            return Err(ApiError {
                status: 500,
                kind: "InternalServerError",
                message: "The engine stopped.".into(),
                param: None,
            });
        };
        text.push_str(out.text);
        usage.completion = out.completion_tokens;
        usage.cached = r
            .settings
            .prompt_tokens_details
            .then_some(out.cached_tokens);
        if faults.drop_after == Some(usage.completion) && out.finish.is_none() {
            // Cut the connection without an answer.
            let body = Body::from_stream(futures_util::stream::once(async {
                Err::<Bytes, _>(std::io::Error::other("fault: connection dropped"))
            }));
            return Ok(Response::new(body));
        }
        if let Some(f) = out.finish {
            sub.finished();
            break f;
        }
    };
    if let Some(d) = faults.stall_first {
        tokio::time::sleep(d).await;
    }
    let s = &r.settings;
    let done = Completed {
        id,
        created,
        model: &s.served_model_name,
        fingerprint: &r.fingerprint,
        role: &s.response_role,
        finish: finish.as_str(),
        usage,
    };
    Ok(axum::Json(full_response(endpoint, &text, &done)).into_response())
}

async fn models(State(r): State<Arc<Replica>>) -> Response {
    let s = &r.settings;
    let created = unix_now();
    axum::Json(json!({
        "object": "list",
        "data": [{
            "id": s.served_model_name,
            "object": "model",
            "created": created,
            "owned_by": "vllm",
            "root": s.model_root,
            "parent": null,
            "max_model_len": s.max_model_len,
            "permission": [{
                "id": format!("modelperm-{:016x}", r.random_u64()),
                "object": "model_permission",
                "created": created,
                "allow_create_engine": false,
                "allow_sampling": true,
                "allow_logprobs": true,
                "allow_search_indices": false,
                "allow_view": true,
                "allow_fine_tuning": false,
                "organization": "*",
                "group": null,
                "is_blocking": false,
            }],
        }],
    }))
    .into_response()
}

async fn health(State(r): State<Arc<Replica>>) -> StatusCode {
    if r.cold() || !r.engine.is_alive() {
        StatusCode::SERVICE_UNAVAILABLE
    } else {
        StatusCode::OK
    }
}

async fn version() -> Response {
    axum::Json(json!({"version": VLLM_VERSION})).into_response()
}

async fn metrics(State(r): State<Arc<Replica>>) -> Response {
    (
        [(
            header::CONTENT_TYPE,
            HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"),
        )],
        r.engine.metrics().render(),
    )
        .into_response()
}

async fn reset_prefix_cache(State(r): State<Arc<Replica>>) -> StatusCode {
    r.engine.reset_prefix_cache();
    StatusCode::OK
}

#[derive(Debug, Deserialize)]
struct TokenizeRequest {
    prompt: Option<String>,
    messages: Option<Vec<ChatMessage>>,
    add_special_tokens: Option<bool>,
    #[serde(default)]
    return_token_strs: bool,
    model: Option<String>,
}

async fn tokenize(State(r): State<Arc<Replica>>, body: Bytes) -> Result<Response, ApiError> {
    let req: TokenizeRequest =
        serde_json::from_slice(&body).map_err(|e| ApiError::validation(&e))?;
    let s = &r.settings;
    r.check_model(req.model.as_deref())?;
    let (text, special_default) = match (req.prompt, req.messages) {
        (Some(p), None) => (p, true),
        (None, Some(m)) => (render_chat(&m), false),
        _ => {
            return Err(ApiError::bad_request(
                "Give exactly one of prompt or messages.",
                None,
            ));
        }
    };
    let mut tokens = Vec::new();
    let mut strs: Vec<String> = Vec::new();
    if req.add_special_tokens.unwrap_or(special_default) {
        tokens.push(BOS);
        strs.push("<|begin_of_text|>".to_owned());
    }
    tokens.extend(Tokenizer.encode(&text));
    let token_strs = req.return_token_strs.then(|| {
        strs.extend(Tokenizer.pieces(&text).into_iter().map(str::to_owned));
        strs
    });
    Ok(axum::Json(json!({
        "count": tokens.len(),
        "max_model_len": s.max_model_len,
        "tokens": tokens,
        "token_strs": token_strs,
    }))
    .into_response())
}

/// Serves `router` on `listener` (with TCP_NODELAY on every connection) until `shutdown` resolves.
pub async fn serve(
    listener: tokio::net::TcpListener,
    replica: Arc<Replica>,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    axum::serve(
        listener.tap_io(|tcp| {
            // As uvicorn does for vLLM: without it, Nagle's algorithm and delayed ACKs hold a reused
            // connection's first token back ~40 ms.
            let _ = tcp.set_nodelay(true);
        }),
        router(replica),
    )
    .with_graceful_shutdown(shutdown)
    .await
}
