//! Why the proxy answered a request itself, and the one place such a reason becomes an HTTP status,
//! an OpenAI-shaped error body and, when the client may try again, a `Retry-After`.

use std::fmt;

/// Where a proxy-made answer comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    /// API keys are configured and the request carries none.
    MissingKey,
    /// The request's API key is not one of the configured keys.
    InvalidKey,
    /// The API key is over its rate limit.
    RateLimited,
    /// The path is not one headroom serves.
    UnknownRoute,
    /// The method is not allowed on the path.
    MethodNotAllowed,
    /// The body could not be read as the endpoint's request.
    BadRequest,
    /// The request's header could not be parsed (malformed, framed two ways, not HTTP/1.x).
    MalformedHeader,
    /// The body is larger than `limits.max_body_bytes`.
    BodyTooLarge,
    /// The header block is over `limits.max_header_bytes` or `limits.max_headers`.
    HeadersTooLarge,
    /// The body did not arrive within `timeouts.body_read_ms`.
    BodyTimeout,
    /// The client's body could not be read (it went away or stalled).
    ClientBody,
    /// No replica is configured, healthy and not ejected.
    NoBackend,
    /// Connecting to or writing the request to a replica failed.
    UpstreamConnect,
    /// A replica closed the connection or failed before sending a response header.
    UpstreamReset,
    /// A replica sent no response header within `timeouts.first_byte_ms`.
    UpstreamTimeout,
    /// Every replica is at its cap and the class's queue is full.
    QueueFull,
    /// The request waited at the proxy until its class's deadline.
    QueueTimeout,
    /// The request was still waiting at the proxy when its shutdown's grace period ended (it was
    /// never sent to a replica).
    ShuttingDown,
}

/// A failure with its cause; `retryable` says whether another replica may be tried.
#[derive(Debug)]
pub struct ProxyError {
    /// What failed.
    pub kind: ErrorKind,
    /// Whether trying another replica could succeed (nothing has reached the client yet).
    pub retryable: bool,
    /// Human-readable detail, safe to show the client (never prompt text).
    pub detail: String,
    /// Seconds to wait before trying again, where the proxy estimated it.
    pub retry_after_s: Option<u32>,
    /// The methods the path takes, for the `Allow` header of a 405.
    pub allow: Option<&'static str>,
}

impl ProxyError {
    /// An error of `kind` with `detail`; retryability follows the kind.
    pub fn new(kind: ErrorKind, detail: impl Into<String>) -> Self {
        let retryable = matches!(kind, ErrorKind::UpstreamConnect | ErrorKind::UpstreamReset);
        Self {
            kind,
            retryable,
            detail: detail.into(),
            retry_after_s: None,
            allow: None,
        }
    }

    /// A 405 for `method` on `path`, which takes `allow` only.
    pub fn method_not_allowed(method: &http::Method, path: &str, allow: &'static str) -> Self {
        let mut e = Self::new(
            ErrorKind::MethodNotAllowed,
            format!("{method} is not allowed on {path} (it takes {allow})"),
        );
        e.allow = Some(allow);
        e
    }

    /// The same error with an estimated `Retry-After`.
    pub fn with_retry_after(mut self, seconds: u32) -> Self {
        self.retry_after_s = Some(seconds);
        self
    }

    /// The HTTP status the client receives.
    pub fn status(&self) -> u16 {
        match self.kind {
            ErrorKind::MissingKey | ErrorKind::InvalidKey => 401,
            ErrorKind::RateLimited => 429,
            ErrorKind::UnknownRoute => 404,
            ErrorKind::MethodNotAllowed => 405,
            ErrorKind::BadRequest | ErrorKind::MalformedHeader => 400,
            ErrorKind::BodyTooLarge => 413,
            ErrorKind::HeadersTooLarge => 431,
            ErrorKind::BodyTimeout => 408,
            ErrorKind::ClientBody => 400,
            ErrorKind::NoBackend => 503,
            ErrorKind::UpstreamConnect | ErrorKind::UpstreamReset => 502,
            ErrorKind::UpstreamTimeout => 504,
            ErrorKind::QueueFull => 429,
            ErrorKind::QueueTimeout | ErrorKind::ShuttingDown => 503,
        }
    }

    /// Seconds the client should wait before trying again, when it should.
    pub fn retry_after(&self) -> Option<u32> {
        self.retry_after_s.or_else(|| {
            matches!(
                self.kind,
                ErrorKind::NoBackend
                    | ErrorKind::UpstreamConnect
                    | ErrorKind::UpstreamReset
                    | ErrorKind::QueueFull
                    | ErrorKind::QueueTimeout
                    | ErrorKind::ShuttingDown
                    | ErrorKind::RateLimited
            )
            .then_some(1)
        })
    }

    /// A short stable name for metrics and the `x-headroom-error` header.
    pub fn reason(&self) -> &'static str {
        match self.kind {
            ErrorKind::MissingKey => "missing_key",
            ErrorKind::InvalidKey => "invalid_key",
            ErrorKind::RateLimited => "rate_limited",
            ErrorKind::UnknownRoute => "unknown_route",
            ErrorKind::MethodNotAllowed => "method_not_allowed",
            ErrorKind::BadRequest => "bad_request",
            ErrorKind::MalformedHeader => "malformed_header",
            ErrorKind::BodyTooLarge => "body_too_large",
            ErrorKind::HeadersTooLarge => "headers_too_large",
            ErrorKind::BodyTimeout => "body_timeout",
            ErrorKind::ClientBody => "client_body",
            ErrorKind::NoBackend => "no_backend",
            ErrorKind::UpstreamConnect => "upstream_connect",
            ErrorKind::UpstreamReset => "upstream_reset",
            ErrorKind::UpstreamTimeout => "upstream_timeout",
            ErrorKind::QueueFull => "queue_full",
            ErrorKind::QueueTimeout => "queue_timeout",
            ErrorKind::ShuttingDown => "shutting_down",
        }
    }

    /// The body, in the shape OpenAI-compatible servers use for errors.
    pub fn body(&self) -> Vec<u8> {
        let kind = match self.status() {
            400 | 408 | 413 | 431 => "BadRequestError",
            401 => "AuthenticationError",
            404 => "NotFoundError",
            405 => "MethodNotAllowedError",
            429 => "RateLimitError",
            502 => "BadGatewayError",
            504 => "GatewayTimeoutError",
            _ => "ServiceUnavailableError",
        };
        serde_json::to_vec(&serde_json::json!({
            "error": {
                "message": self.detail,
                "type": kind,
                "param": null,
                "code": self.status(),
            }
        }))
        .unwrap_or_default()
    }
}

impl fmt::Display for ProxyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.reason(), self.detail)
    }
}

impl std::error::Error for ProxyError {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statuses_and_retry_hints() {
        let e = ProxyError::new(ErrorKind::NoBackend, "no healthy replica");
        assert_eq!(
            (e.status(), e.retry_after(), e.retryable),
            (503, Some(1), false)
        );
        let e = ProxyError::new(ErrorKind::UpstreamConnect, "refused");
        assert_eq!((e.status(), e.retryable), (502, true));
        let e = ProxyError::new(ErrorKind::QueueFull, "full").with_retry_after(7);
        assert_eq!((e.status(), e.retry_after()), (429, Some(7)));
        let e = ProxyError::new(ErrorKind::UnknownRoute, "/admin");
        assert_eq!((e.status(), e.retry_after()), (404, None));
        let body: serde_json::Value = serde_json::from_slice(&e.body()).unwrap();
        assert_eq!(body["error"]["code"], 404);
        assert_eq!(body["error"]["message"], "/admin");
        let kind = |k| {
            let body = ProxyError::new(k, "x").body();
            serde_json::from_slice::<serde_json::Value>(&body).unwrap()["error"]["type"].clone()
        };
        assert_eq!(kind(ErrorKind::UpstreamConnect), "BadGatewayError");
        assert_eq!(kind(ErrorKind::UpstreamTimeout), "GatewayTimeoutError");
        assert_eq!(kind(ErrorKind::NoBackend), "ServiceUnavailableError");
    }
}
