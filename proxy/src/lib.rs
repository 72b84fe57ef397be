//! headroom-proxy: the data plane (classify → admit → route → forward → measure → record).
//!
//! Built so far: routing (`routing/`), pure and synchronous. The pingora data plane that calls it
//! (`headroom serve`) arrives with the rest of the proxy issue.

pub mod routing;
