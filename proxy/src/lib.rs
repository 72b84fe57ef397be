//! headroom-proxy: the data plane (classify → admit → route → forward → measure → record).
//!
//! Not built yet: this crate holds its place in the workspace so dependencies already point the
//! way ARCHITECTURE.md draws them. `headroom serve` arrives with the proxy issue.
