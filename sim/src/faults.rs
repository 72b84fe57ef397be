//! Faults on demand, from replica flags or per request from the `x-headroom-fault` header (and
//! llm-d's `X-Return-Error: <status>`), so proxies and clients can be tested against a replica
//! that misbehaves the way real ones do.
//!
//! Header syntax: comma-separated `key=value` items (or bare `hang`):
//!
//! | item | effect |
//! |---|---|
//! | `error=STATUS` | answer STATUS with a vLLM-shaped error body instead of generating |
//! | `stall-first-ms=MS` | hold the first token back MS ms (response headers are already sent) |
//! | `stall-after=N`, `stall-ms=MS` | pause the stream MS ms after N tokens |
//! | `drop-after=N` | cut the connection after N tokens, with no `[DONE]` |
//! | `hang` | accept the request and never answer |
//! | `perturb-after=N` | generate different text from output token N on (as a broken quantisation or chat template would) |

use std::time::Duration;

/// The faults that apply to one request.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Faults {
    /// Answer with this status instead of generating.
    pub error: Option<u16>,
    /// Delay before the first token.
    pub stall_first: Option<Duration>,
    /// Pause after this many tokens…
    pub stall_after: Option<u32>,
    /// …for this long.
    pub stall: Duration,
    /// Cut the connection after this many tokens.
    pub drop_after: Option<u32>,
    /// Never answer.
    pub hang: bool,
    /// Generate different text from this output token on.
    pub perturb_after: Option<u32>,
}

impl Faults {
    /// Parses the `x-headroom-fault` header.
    pub fn parse(header: &str) -> Result<Self, String> {
        let mut f = Self::default();
        for item in header.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            let (key, value) = item.split_once('=').unwrap_or((item, ""));
            let number = |what: &str| -> Result<u64, String> {
                value
                    .trim()
                    .parse()
                    .map_err(|_| format!("fault `{key}` needs a number ({what}), got `{value}`"))
            };
            match key.trim() {
                "error" => {
                    let status = number("an HTTP status")?;
                    if !(400..600).contains(&status) {
                        return Err(format!(
                            "fault `error` needs a status in 400..599, got {status}"
                        ));
                    }
                    f.error = Some(status as u16);
                }
                "stall-first-ms" => {
                    f.stall_first = Some(Duration::from_millis(number("milliseconds")?))
                }
                "stall-after" => f.stall_after = Some(number("tokens")? as u32),
                "stall-ms" => f.stall = Duration::from_millis(number("milliseconds")?),
                "drop-after" => f.drop_after = Some(number("tokens")? as u32),
                "hang" => f.hang = true,
                "perturb-after" => f.perturb_after = Some(number("tokens")? as u32),
                other => {
                    return Err(format!(
                        "unknown fault `{other}`; known: error, stall-first-ms, stall-after, stall-ms, drop-after, hang, perturb-after"
                    ));
                }
            }
        }
        if f.stall_after.is_some() && f.stall.is_zero() {
            return Err("fault `stall-after` needs `stall-ms` too".to_owned());
        }
        Ok(f)
    }

    /// These faults with `other`'s set fields taking precedence.
    pub fn overridden_by(&self, other: &Self) -> Self {
        Self {
            error: other.error.or(self.error),
            stall_first: other.stall_first.or(self.stall_first),
            stall_after: other.stall_after.or(self.stall_after),
            stall: if other.stall_after.is_some() {
                other.stall
            } else {
                self.stall
            },
            drop_after: other.drop_after.or(self.drop_after),
            hang: other.hang || self.hang,
            perturb_after: other.perturb_after.or(self.perturb_after),
        }
    }
}

/// vLLM-style error type and a default message for an injected status.
pub fn injected_error(status: u16) -> (&'static str, &'static str) {
    match status {
        400 => ("BadRequestError", "Injected fault: invalid request."),
        401 => ("AuthenticationError", "Injected fault: invalid API key."),
        404 => ("NotFoundError", "Injected fault: model not found."),
        429 => ("RateLimitError", "Injected fault: rate limit exceeded."),
        503 => (
            "Service Unavailable",
            "The engine is currently busy and cannot accept new requests. Please try again later or on a different instance.",
        ),
        500..=599 => (
            "InternalServerError",
            "Injected fault: internal server error.",
        ),
        _ => ("BadRequestError", "Injected fault."),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_items_parse() {
        let f = Faults::parse("error=503").unwrap();
        assert_eq!(f.error, Some(503));
        let f =
            Faults::parse(" stall-first-ms=250, drop-after=7 ,stall-after=3,stall-ms=40").unwrap();
        assert_eq!(f.stall_first, Some(Duration::from_millis(250)));
        assert_eq!(f.drop_after, Some(7));
        assert_eq!(
            (f.stall_after, f.stall),
            (Some(3), Duration::from_millis(40))
        );
        assert!(Faults::parse("hang").unwrap().hang);
        assert_eq!(
            Faults::parse("perturb-after=5").unwrap().perturb_after,
            Some(5)
        );
    }

    #[test]
    fn bad_items_say_what_is_wrong() {
        assert!(Faults::parse("error=200").unwrap_err().contains("400..599"));
        assert!(
            Faults::parse("drop-after=x")
                .unwrap_err()
                .contains("needs a number")
        );
        assert!(
            Faults::parse("explode")
                .unwrap_err()
                .contains("unknown fault `explode`")
        );
        assert!(
            Faults::parse("stall-after=2")
                .unwrap_err()
                .contains("stall-ms")
        );
    }

    #[test]
    fn request_faults_override_replica_faults() {
        let replica = Faults {
            drop_after: Some(10),
            ..Faults::default()
        };
        let request = Faults::parse("drop-after=2,hang").unwrap();
        let f = replica.overridden_by(&request);
        assert_eq!(f.drop_after, Some(2));
        assert!(f.hang);
    }
}
