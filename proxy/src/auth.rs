//! Client API keys: the `Authorization: Bearer` token is hashed and compared with every
//! configured SHA-256 digest in constant time; a key may fix the request's class and carries an
//! optional rate limit (GCRA, `governor`).
//!
//! | step | on failure |
//! |---|---|
//! | a `Bearer` token is present | 401 `missing_key` |
//! | its SHA-256 equals a configured digest (all compared, no early exit) | 401 `invalid_key` |
//! | the key's limiter has a cell free (`rate_per_s`, `burst`) | 429 `rate_limited`, `Retry-After` = wait |

use std::num::NonZeroU32;
use std::sync::Arc;
use std::time::Duration;

use governor::clock::{Clock, DefaultClock};
use governor::{DefaultDirectRateLimiter, Quota, RateLimiter};
use headroom_config::serve::{ApiKeyConfig, SecurityConfig};
use sha2::{Digest, Sha256};
use subtle::{ConditionallySelectable, ConstantTimeEq};

use crate::error::{ErrorKind, ProxyError};

/// One configured key.
#[derive(Debug)]
pub struct ClientKey {
    /// Its name in metrics and logs.
    pub name: String,
    /// The class every request made with it gets.
    pub class: Option<String>,
    digest: [u8; 32],
    limiter: Option<DefaultDirectRateLimiter>,
}

/// The configured keys.
#[derive(Debug)]
pub struct Keys {
    keys: Vec<ClientKey>,
}

/// A key could not be set up from its config.
#[derive(Debug, thiserror::Error)]
#[error("security.api_keys `{name}`: {reason}")]
pub struct KeyConfigError {
    name: String,
    reason: String,
}

fn digest_of(key: &ApiKeyConfig) -> Result<[u8; 32], KeyConfigError> {
    let fail = |reason: String| KeyConfigError {
        name: key.name.clone(),
        reason,
    };
    match (&key.sha256, &key.env) {
        (Some(hex), None) => {
            let mut d = [0u8; 32];
            for (i, byte) in d.iter_mut().enumerate() {
                *byte = hex
                    .get(2 * i..2 * i + 2)
                    .and_then(|h| u8::from_str_radix(h, 16).ok())
                    .ok_or_else(|| fail(format!("sha256 `{hex}` is not 64 hex digits")))?;
            }
            Ok(d)
        }
        (None, Some(var)) => match std::env::var(var) {
            Ok(v) if !v.is_empty() => Ok(Sha256::digest(v.as_bytes()).into()),
            _ => Err(fail(format!("environment variable {var} is not set"))),
        },
        _ => Err(fail("give exactly one of sha256 or env".into())),
    }
}

fn limiter_of(key: &ApiKeyConfig) -> Result<Option<DefaultDirectRateLimiter>, KeyConfigError> {
    let Some(rate) = key.rate_per_s else {
        return Ok(None);
    };
    let quota = Duration::try_from_secs_f64(1.0 / rate)
        .ok()
        .and_then(Quota::with_period)
        .zip(NonZeroU32::new(key.burst_or_default()))
        .map(|(q, burst)| q.allow_burst(burst))
        .ok_or_else(|| KeyConfigError {
            name: key.name.clone(),
            reason: format!("rate_per_s {rate} is not a usable rate"),
        })?;
    Ok(Some(RateLimiter::direct(quota)))
}

impl Keys {
    /// The keys of `cfg`; `None` when no key is configured (the proxy is open).
    pub fn from_config(cfg: &SecurityConfig) -> Result<Option<Self>, KeyConfigError> {
        if cfg.api_keys.is_empty() {
            return Ok(None);
        }
        let keys = cfg
            .api_keys
            .iter()
            .map(|k| {
                Ok(ClientKey {
                    name: k.name.clone(),
                    class: k.class.clone(),
                    digest: digest_of(k)?,
                    limiter: limiter_of(k)?,
                })
            })
            .collect::<Result<_, KeyConfigError>>()?;
        Ok(Some(Self { keys }))
    }

    /// The key at `index` (as returned by [`Keys::authenticate`]).
    pub fn get(&self, index: usize) -> &ClientKey {
        &self.keys[index]
    }

    /// The index of the key in the `Authorization` header's `Bearer` token. The token's digest
    /// is compared with every configured digest, so the time taken says nothing about which
    /// key (or how much of one) matched.
    pub fn authenticate(&self, authorization: Option<&[u8]>) -> Result<usize, ProxyError> {
        let token = authorization.and_then(bearer_token).ok_or_else(|| {
            ProxyError::new(
                ErrorKind::MissingKey,
                "an API key is required: send `Authorization: Bearer <key>`",
            )
        })?;
        let presented: [u8; 32] = Sha256::digest(token).into();
        let mut found = subtle::Choice::from(0);
        let mut index = 0u32;
        for (i, k) in self.keys.iter().enumerate() {
            let hit = presented.ct_eq(&k.digest);
            index.conditional_assign(&(i as u32), hit);
            found |= hit;
        }
        if bool::from(found) {
            Ok(index as usize)
        } else {
            Err(ProxyError::new(
                ErrorKind::InvalidKey,
                "the API key is not valid",
            ))
        }
    }

    /// Takes one request from the key's rate limit.
    pub fn admit(&self, index: usize) -> Result<(), ProxyError> {
        let key = &self.keys[index];
        let Some(limiter) = &key.limiter else {
            return Ok(());
        };
        limiter.check().map_err(|not_until| {
            let wait = not_until.wait_time_from(DefaultClock::default().now());
            ProxyError::new(
                ErrorKind::RateLimited,
                format!(
                    "API key `{}` is over its rate limit; retry in {:.1} s",
                    key.name,
                    wait.as_secs_f64()
                ),
            )
            .with_retry_after(wait.as_secs_f64().ceil().max(1.0) as u32)
        })
    }
}

/// The token of an `Authorization: Bearer <token>` header (scheme case-insensitive).
pub(crate) fn bearer_token(value: &[u8]) -> Option<&[u8]> {
    let (scheme, rest) = value.split_at_checked(7)?;
    if !scheme.eq_ignore_ascii_case(b"bearer ") {
        return None;
    }
    let token = rest.trim_ascii();
    (!token.is_empty()).then_some(token)
}

/// The API keys of the config now serving, shared by every config still finishing requests:
/// a reload that removes a key stops it on connections opened before the reload too.
#[derive(Debug, Clone, Default)]
pub struct KeySlot(Arc<std::sync::RwLock<Option<Arc<Keys>>>>);

impl KeySlot {
    /// The keys of now (`None`: no keys are configured, every request passes).
    pub fn current(&self) -> Option<Arc<Keys>> {
        self.0.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Whether keys are configured now (without taking a reference to them).
    pub fn is_set(&self) -> bool {
        self.0.read().unwrap_or_else(|e| e.into_inner()).is_some()
    }

    /// Makes `keys` the ones every request is checked against from now on.
    pub fn set(&self, keys: Option<Arc<Keys>>) {
        *self.0.write().unwrap_or_else(|e| e.into_inner()) = keys;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(name: &str, secret: &str) -> ApiKeyConfig {
        let d: [u8; 32] = Sha256::digest(secret.as_bytes()).into();
        ApiKeyConfig {
            name: name.into(),
            sha256: Some(d.iter().map(|b| format!("{b:02x}")).collect()),
            env: None,
            class: None,
            rate_per_s: None,
            burst: None,
        }
    }

    fn keys(list: Vec<ApiKeyConfig>) -> Keys {
        Keys::from_config(&SecurityConfig {
            api_keys: list,
            trust_forwarded_headers: false,
        })
        .unwrap()
        .unwrap()
    }

    #[test]
    fn finds_the_key_among_several_and_refuses_others() {
        let k = keys(vec![key("a", "alpha-secret"), key("b", "beta-secret")]);
        assert_eq!(k.authenticate(Some(b"Bearer beta-secret")).unwrap(), 1);
        assert_eq!(k.authenticate(Some(b"bearer  alpha-secret ")).unwrap(), 0);
        let e = k.authenticate(Some(b"Bearer beta-secreT")).unwrap_err();
        assert_eq!((e.status(), e.reason()), (401, "invalid_key"));
        for missing in [
            None,
            Some(&b"Basic YWxwaGE="[..]),
            Some(b"Bearer "),
            Some(b"Bearer"),
        ] {
            let e = k.authenticate(missing).unwrap_err();
            assert_eq!(e.reason(), "missing_key", "{missing:?}");
        }
    }

    #[test]
    fn no_keys_configured_means_open() {
        assert!(
            Keys::from_config(&SecurityConfig::default())
                .unwrap()
                .is_none()
        );
    }

    #[test]
    fn a_key_from_the_environment_and_a_bad_digest() {
        // A variable no environment sets: the key cannot be read, and the error names it.
        let var = "HEADROOM_TEST_AUTH_KEY_FROM_ENV";
        let mut cfg = key("env", "unused");
        cfg.sha256 = None;
        cfg.env = Some(var.into());
        assert!(
            Keys::from_config(&SecurityConfig {
                api_keys: vec![cfg.clone()],
                trust_forwarded_headers: false,
            })
            .unwrap_err()
            .to_string()
            .contains(var)
        );
        let mut bad = key("bad", "x");
        bad.sha256 = Some("zz".repeat(32));
        let e = Keys::from_config(&SecurityConfig {
            api_keys: vec![bad],
            trust_forwarded_headers: false,
        })
        .unwrap_err();
        assert!(e.to_string().contains("`bad`"), "{e}");
    }

    #[test]
    fn rate_limit_allows_the_burst_then_refuses_with_a_wait() {
        let mut limited = key("slow", "s");
        limited.rate_per_s = Some(0.01);
        limited.burst = Some(3);
        let k = keys(vec![limited, key("free", "f")]);
        for _ in 0..3 {
            k.admit(0).unwrap();
        }
        let e = k.admit(0).unwrap_err();
        assert_eq!((e.status(), e.reason()), (429, "rate_limited"));
        // One request per 100 s: the wait is most of that period.
        assert!(e.retry_after().unwrap() > 90, "{:?}", e.retry_after());
        for _ in 0..100 {
            k.admit(1).unwrap();
        }
    }
}
