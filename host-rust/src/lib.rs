//! # levee
//!
//! Retries with backoff and jitter, classification, retry budgets, circuit breakers, rate and
//! concurrency limits, deadlines and fallbacks for Rust, decided by the Levee policy core:
//! the zero-import Wasm component this crate carries (run in wasmtime), or the same core
//! linked natively (`native` feature, or [`Backend::Native`]). Hosts do the I/O; every
//! decision is the core's.
//!
//! - [`RawEngine`]: the low-level, synchronous engine, one method per WIT operation.
//! - [`Levee`] (feature `tokio`): the async handle; [`Levee::call`] runs a closure under a
//!   named policy and returns a [`LeveeError`] when the policy gives up. A policy with `hedge`
//!   runs several attempts of the closure at once, as the core commands (README, "Hedging";
//!   [`AttemptLease`]).
//! - [`layer`] (feature `tower`): a `tower::Layer` for `http` services.
//! - [`grpc`] (feature `grpc`): that layer for a tonic channel, with gRPC's semantics (status
//!   classification, pushback, deadlines, the A6 commit rule).
//! - [`client`] (feature `reqwest`): a `reqwest` client wrapper and a `reqwest-middleware`
//!   middleware.
//! - [`fleet`] (feature `fleet-redis`): breaker evidence, retry budgets and rate limits shared
//!   by every process of a fleet through Redis (redis-rs), the hot path kept local.
//! - [`telemetry`]: the schema of docs/telemetry.md, to `tracing` and the `metrics` facade by
//!   default, or to a [`Telemetry`] sink of your own ([`Builder::telemetry`]).
//! - [`time`]: the clock of `now`, timeouts and sleeps; [`time::TokioClock`] follows tokio's
//!   paused time (`#[tokio::test(start_paused = true)]`, `tokio::time::advance`), and
//!   [`Builder::clock`] injects any [`time::Clock`].
// One function may use `unsafe`: the cache's call of wasmtime's `Component::deserialize`
// (`cache::deserialize`, with its `SAFETY` comment); everything else is safe code.
#![deny(unsafe_code)]
#![warn(missing_docs)]

#[cfg(feature = "wasm")]
mod cache;
#[allow(missing_docs)]
pub mod constants;
pub mod outcome;
pub mod raw;

#[cfg(feature = "tokio")]
mod call;
#[cfg(feature = "tokio")]
mod driver;
#[cfg(feature = "tokio")]
mod error;
#[cfg(feature = "tokio")]
mod handle;
#[cfg(feature = "tokio")]
mod hedge;
#[cfg(feature = "tokio")]
mod park;
#[cfg(feature = "tokio")]
mod runtime;
#[cfg(feature = "tokio")]
pub mod telemetry;
#[cfg(feature = "tokio")]
pub mod time;

/// The policy core's own types (`levee-core`), re-exported.
pub use levee_core as core;
pub use outcome::{IntoOutcome, Outcome};
pub use raw::{Backend, Limits, RawEngine, RawExecutor, Trap};

#[cfg(feature = "tokio")]
pub use call::{Attempt, Attempted, BoxFuture, Call, FallbackContext, FallbackFn, RetryIf};
#[cfg(feature = "tokio")]
pub use call::{FaultOp, FaultPlan, RetryInfo};
#[cfg(feature = "tokio")]
pub use error::{KeyTooLong, LeveeError, LoadErrors, MistypedFallback, UnknownPolicy};
#[cfg(feature = "tokio")]
pub use handle::{Builder, Levee};
#[cfg(feature = "tokio")]
pub use hedge::AttemptLease;
pub use outcome::ErrorClass;
#[cfg(feature = "tokio")]
pub use runtime::Step;
#[cfg(feature = "tokio")]
pub use telemetry::{Fault, Telemetry};

#[cfg(feature = "reqwest")]
pub mod client;
#[cfg(any(feature = "durable-sqlite", feature = "durable-postgres"))]
#[path = "durable_executor/mod.rs"]
pub mod durable;
#[cfg(feature = "fleet-redis")]
pub mod fleet;
#[cfg(feature = "grpc")]
pub mod grpc;
#[cfg(feature = "tower")]
pub mod layer;
