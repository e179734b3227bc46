//! # levee-proxy-wasm
//!
//! Levee's policy core inside Envoy: a proxy-wasm HTTP filter built from the same `levee-core`
//! as every host. It admits or rejects each request locally (breaker, rate limit, bulkhead,
//! deadline), tells Envoy's router how many retries the policy and the retry budget allow and
//! what to retry, feeds every attempt back, and shares state across Envoy's workers through
//! shared data with compare-and-swap. See `docs/envoy.md`.
//!
//! The logic ([`config`], [`envoy`], [`gate`], [`headers`]) is plain Rust, tested natively; the ABI glue
//! (`filter`) exists only on `wasm32`.

pub mod config;
pub mod envoy;
pub mod gate;
pub mod headers;

#[cfg(target_arch = "wasm32")]
mod filter;
