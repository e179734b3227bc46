//! The error a guarded call returns when the policy gives up.

use std::fmt;
use std::time::Duration;

use levee_core::{InvalidCode, LoadError, Reason};

use crate::raw::Trap;

/// Why a call guarded by a policy did not produce a value.
///
/// `reason` is the core's (a rejection by the breaker, the rate limiter, the bulkhead or the
/// budget; the deadline; retries exhausted; a non-retryable outcome; ...), `last` the last
/// error an attempt returned, if one ran and failed with an error.
pub struct LeveeError<E> {
    /// Why the policy stopped.
    pub reason: Reason,
    /// The policy's name.
    pub policy: String,
    /// Attempts that ran.
    pub attempts: u32,
    /// A retry-after hint from the core (a breaker's remaining open time, a rate limiter's
    /// wait), when it gave one.
    pub retry_after: Option<Duration>,
    /// The last error an attempt returned.
    pub last: Option<E>,
    /// What the last attempt reported (`Timeout` for one that timed out, whose `last` is
    /// `None`), when one ran.
    pub outcome: Option<crate::Outcome>,
    /// The error of the last fallback that failed, if one ran.
    pub fallback_error: Option<E>,
    /// The trap that sent the call down the recovery path, if one did.
    pub trap: Option<Trap>,
    /// Why the call finished degraded (docs/hosts.md, section 3), if it did. With `reason`
    /// `none`, `last` is the user's own error of the attempt or fallback that ended the call.
    pub fault: Option<crate::telemetry::Fault>,
    /// A protocol error between host and core (a host bug, or an unknown policy name).
    pub invalid: Option<InvalidCode>,
    /// Fallbacks the policy's chain named that no function was registered for (they count as
    /// failed; the message says so).
    pub unregistered: Vec<String>,
    /// With `invalid` = `unknown-policy`: the names the document does have.
    pub known_policies: Vec<String>,
    /// Fallbacks the policy's chain named that are registered only for other result types
    /// than this call's (they count as failed; the message names the types).
    pub mistyped: Vec<MistypedFallback>,
    /// The call's key was longer than a key may be: refused before the engine saw it.
    pub key_too_long: Option<KeyTooLong>,
}

/// A key longer than [`crate::constants::GUARD_MAX_KEY_BYTES`] UTF-8 bytes, refused by the host
/// at every entry that takes a key (docs/policy.md, "Keys"): one that reached the engine would
/// be decided against the shared overflow entry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KeyTooLong {
    /// The key's length in bytes.
    pub bytes: usize,
}

impl KeyTooLong {
    /// The bound on a key, in UTF-8 bytes.
    pub const MAX: usize = crate::constants::GUARD_MAX_KEY_BYTES as usize;

    /// `Ok` for a key within the bound.
    pub fn check(key: &str) -> Result<(), KeyTooLong> {
        if key.len() > Self::MAX {
            return Err(KeyTooLong { bytes: key.len() });
        }
        Ok(())
    }
}

impl fmt::Display for KeyTooLong {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let text = crate::constants::TEXT_KEY_TOO_LONG.replace("{bytes}", &self.bytes.to_string()).replace("{max}", &Self::MAX.to_string());
        f.write_str(&text)
    }
}

impl std::error::Error for KeyTooLong {}

/// A fallback registered under the name a policy's chain uses, but only for result types
/// other than the call's ([`crate::Levee::register_fallback`] keys by name and type).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MistypedFallback {
    /// The fallback's name.
    pub name: String,
    /// The result types it is registered for (`Result<T, E>`, by `std::any::type_name`).
    pub registered: Vec<String>,
    /// The call's result type.
    pub call: String,
}

impl fmt::Display for MistypedFallback {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "fallback '{}' is registered for {}, not for this call's {}", self.name, self.registered.join(", "), self.call)
    }
}

/// `Result<T, E>` by the names of `T` and `E` (`std::any::type_name`).
pub(crate) fn result_name<T, E>() -> String {
    format!("Result<{}, {}>", std::any::type_name::<T>(), std::any::type_name::<E>())
}

/// What every host says of fallbacks named by a policy but never registered.
pub(crate) fn unregistered_message(names: &[String]) -> String {
    let listed = names.iter().map(|n| format!("'{n}'")).collect::<Vec<_>>().join(", ");
    if names.len() == 1 {
        format!("fallback {listed} is named by the policy but not registered")
    } else {
        format!("fallbacks {listed} are named by the policy but not registered")
    }
}

impl<E> LeveeError<E> {
    pub(crate) fn new(reason: Reason, policy: &str) -> Self {
        LeveeError {
            reason,
            policy: policy.to_string(),
            attempts: 0,
            retry_after: None,
            last: None,
            outcome: None,
            fallback_error: None,
            trap: None,
            fault: None,
            invalid: None,
            unregistered: Vec::new(),
            known_policies: Vec::new(),
            mistyped: Vec::new(),
            key_too_long: None,
        }
    }

    /// Whether the call was refused before its first attempt ran (breaker, rate limit,
    /// bulkhead, deadline).
    pub fn is_rejected(&self) -> bool {
        self.attempts == 0 && self.last.is_none()
    }

    /// The core's reason (`none` when the call finished degraded with the user's own error).
    pub fn reason(&self) -> Reason {
        self.reason
    }

    /// The last error of an attempt, if any.
    pub fn into_last(self) -> Option<E> {
        self.last
    }

    /// Map the inner errors.
    pub fn map<F, G: FnMut(E) -> F>(self, mut g: G) -> LeveeError<F> {
        LeveeError {
            reason: self.reason,
            policy: self.policy,
            attempts: self.attempts,
            retry_after: self.retry_after,
            last: self.last.map(&mut g),
            outcome: self.outcome,
            fallback_error: self.fallback_error.map(&mut g),
            trap: self.trap,
            fault: self.fault,
            invalid: self.invalid,
            unregistered: self.unregistered,
            known_policies: self.known_policies,
            mistyped: self.mistyped,
            key_too_long: self.key_too_long,
        }
    }
}

impl<E: fmt::Debug> fmt::Debug for LeveeError<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LeveeError")
            .field("reason", &self.reason)
            .field("policy", &self.policy)
            .field("attempts", &self.attempts)
            .field("retry_after", &self.retry_after)
            .field("last", &self.last)
            .field("outcome", &self.outcome)
            .field("fallback_error", &self.fallback_error)
            .field("trap", &self.trap)
            .field("fault", &self.fault)
            .field("invalid", &self.invalid)
            .field("unregistered", &self.unregistered)
            .field("known_policies", &self.known_policies)
            .field("mistyped", &self.mistyped)
            .field("key_too_long", &self.key_too_long)
            .finish()
    }
}

impl<E: fmt::Display> fmt::Display for LeveeError<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some(k) = &self.key_too_long {
            return write!(f, "levee: policy `{}`: {k}", self.policy);
        }
        if self.invalid == Some(InvalidCode::UnknownPolicy) {
            return write!(f, "levee: {}", UnknownPolicy::new(&self.policy, self.known_policies.clone()));
        }
        if let Some(code) = self.invalid {
            return write!(f, "levee: policy `{}`: protocol error ({code})", self.policy);
        }
        if let (Some(fault), Reason::None) = (self.fault, self.reason) {
            write!(f, "levee: policy `{}`: the engine faulted ({fault}); the call finished degraded", self.policy)?;
        } else {
            write!(f, "levee: policy `{}` gave up after {} attempt(s): {}", self.policy, self.attempts, self.reason)?;
        }
        if let Some(d) = self.retry_after {
            write!(f, " (retry after {d:?})")?;
        }
        if let Some(e) = &self.last {
            write!(f, "; last error: {e}")?;
        }
        if !self.unregistered.is_empty() {
            write!(f, "; {}", unregistered_message(&self.unregistered))?;
        }
        for m in &self.mistyped {
            write!(f, "; {m}")?;
        }
        if let Some(t) = &self.trap {
            write!(f, "; {t}")?;
        }
        Ok(())
    }
}

impl<E: std::error::Error + 'static> std::error::Error for LeveeError<E> {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.last.as_ref().map(|e| e as &(dyn std::error::Error + 'static))
    }
}

/// A policy document did not load: every error names its field path.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LoadErrors(pub Vec<LoadError>);

impl fmt::Display for LoadErrors {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("the policy document is invalid")?;
        for e in &self.0 {
            if e.path.is_empty() {
                write!(f, "\n  {}", e.message)?;
            } else {
                write!(f, "\n  {}: {}", e.path, e.message)?;
            }
        }
        Ok(())
    }
}

impl std::error::Error for LoadErrors {}

/// A policy name the document does not have, refused where it is named ([`crate::Levee::policy`],
/// `Client::new`, `Middleware::new`, `LeveeLayer::new`), with the names it does have.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UnknownPolicy {
    /// The name asked for.
    pub name: String,
    /// The document's policy names, in document order.
    pub known: Vec<String>,
}

impl UnknownPolicy {
    pub(crate) fn new(name: &str, known: Vec<String>) -> Self {
        UnknownPolicy { name: name.to_string(), known }
    }
}

impl fmt::Display for UnknownPolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let name = levee_core::policy::escape(&self.name);
        write!(f, "no policy named `{name}` in the document")?;
        let known: Vec<&str> = self.known.iter().map(String::as_str).collect();
        if let Some(near) = levee_core::doc::closest(&self.name, &known) {
            write!(f, "; did you mean `{near}`?")?;
        }
        if known.is_empty() {
            return Ok(());
        }
        write!(f, " (its policies: {})", levee_core::doc::list(&known))
    }
}

impl std::error::Error for UnknownPolicy {}

impl crate::Levee {
    /// The named policy, or an [`UnknownPolicy`] error that lists the document's names. The
    /// integrations call it when they are built, so that a mistyped name fails there, not
    /// at the first request.
    pub fn policy(&self, name: &str) -> Result<levee_core::PolicyInfo, UnknownPolicy> {
        self.policy_info(name).ok_or_else(|| UnknownPolicy::new(name, self.policy_names()))
    }
}
