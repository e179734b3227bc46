//! # levee-core
//!
//! The sans-I/O policy core of Levee. It never reads a clock, never sleeps and never draws
//! OS randomness: hosts pass a monotonic `now` (nanoseconds) at every step, and jitter comes
//! from a seeded PRNG inside the engine ([`rng`]). The same policy, seed and trace of
//! `(now, outcome)` give bit-identical decisions on every platform.
//!
//! The public API mirrors `wit/levee.wit` one to one: [`Engine::load`], [`Engine::start`],
//! [`Engine::acquire`], [`Engine::report`], [`Engine::report_fallback`], [`Engine::cancel`],
//! [`Engine::drain_events`], state export and import. Hot-path operations return a packed
//! [`Verdict`].
//!
//! Nothing reachable from input panics: the crate denies `unwrap`, `expect`, `panic!` and
//! unchecked indexing, and every policy error is returned with its field path.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod adaptive;
pub mod analysis;
pub mod breaker;
pub mod budget;
pub mod bulkhead;
pub mod classify;
pub mod deadline;
pub mod doc;
pub mod durable;
pub mod durable_exec;
mod engine;
pub mod error;
pub mod fallback;
pub mod fleet;
pub mod grpc;
pub mod hedge;
mod leb128;
mod order;
pub mod policy;
pub mod rate;
mod read;
pub mod retry;
pub mod rng;
pub mod scope;
mod share;
pub mod state;
mod table;
pub mod time;
pub mod types;

pub use retry::{backoff, retry_after};

pub use analysis::Analysis;
pub use engine::{
    CallInfo, Engine, PolicyInfo, FLAG_CALLER_NO_RETRY, FLAG_CALLER_RETRY, FLAG_IDEMPOTENCY_KEY, FLAG_NON_IDEMPOTENT, FLAG_OVERLOADED,
    MAX_KEY_BYTES, MAX_LIVE_CALLS, MAX_PENDING_EVENTS, OVERFLOW_KEY, STATE_PAGE_BYTES,
};
pub use error::LoadError;
pub use hedge::HedgeCommand;
pub use policy::Policy;
pub use types::{BreakerState, Event, EventKind, InvalidCode, OutcomeKind, Reason, Verdict, VerdictKind};
