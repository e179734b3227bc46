//! Classification of outcomes by declarative rules.
//!
//! A rule is a string:
//!
//! | rule | matches |
//! |---|---|
//! | `timeout` | the per-attempt timeout fired |
//! | `connection-error` | the connection failed |
//! | `http:503`, `http:500-599`, `http:5xx` | an HTTP status, a range, or a class |
//! | `grpc:unavailable`, `grpc:14` | a gRPC status by name (kebab or UPPER_SNAKE) or number |
//! | `grpc:resource-exhausted+pushback` | that status, only when the server sent a valid pushback |
//! | `error:ThrottlingError`, `error:*` | a named error class, or any |
//!
//! An HTTP status below 400 and gRPC `OK` are successes; everything else is a failure.
//! A failure is retryable when a `retry-on` rule matches it and no `never-retry` rule does.

use crate::doc::{self, Fields, Value};
use crate::error::LoadError;
use crate::read::describe;
use crate::types::OutcomeKind;

/// gRPC status names, by code.
pub const GRPC_CODES: [&str; 17] = [
    "ok",
    "cancelled",
    "unknown",
    "invalid-argument",
    "deadline-exceeded",
    "not-found",
    "already-exists",
    "permission-denied",
    "resource-exhausted",
    "failed-precondition",
    "aborted",
    "out-of-range",
    "unimplemented",
    "internal",
    "unavailable",
    "data-loss",
    "unauthenticated",
];

/// One classification rule.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Rule {
    /// `timeout`.
    Timeout,
    /// `connection-error`.
    ConnectionError,
    /// `http:LO-HI` (inclusive).
    Http(i32, i32),
    /// `grpc:CODE`, optionally only with a pushback.
    Grpc {
        /// The status code.
        code: i32,
        /// Match only when the server sent a valid pushback.
        needs_pushback: bool,
    },
    /// `error:NAME`; `None` is `error:*`.
    Error(Option<String>),
}

/// An outcome as the classifier sees it.
#[derive(Clone, Copy, Debug)]
pub struct Observed<'a> {
    /// The kind.
    pub kind: OutcomeKind,
    /// HTTP or gRPC status.
    pub code: i32,
    /// Error class name (for `error-class`).
    pub class: &'a str,
    /// Whether a valid pushback came with a gRPC status.
    pub has_pushback: bool,
}

impl Observed<'_> {
    /// Whether the outcome is a success.
    pub fn is_success(&self) -> bool {
        match self.kind {
            OutcomeKind::Success => true,
            OutcomeKind::HttpStatus => (0..400).contains(&self.code),
            OutcomeKind::GrpcStatus => self.code == 0,
            _ => false,
        }
    }
}

impl Rule {
    /// Parse a rule; the error says what is expected.
    pub fn parse(text: &str) -> Result<Rule, String> {
        let t = text.trim();
        match t {
            "timeout" => return Ok(Rule::Timeout),
            "connection-error" => return Ok(Rule::ConnectionError),
            _ => {}
        }
        let Some((kind, spec)) = t.split_once(':') else {
            return Err(format!(
                "`{t}` is not a rule: use timeout, connection-error, http:CODE, http:LO-HI, http:5xx, grpc:NAME, or error:CLASS"
            ));
        };
        match kind {
            "http" => parse_http(spec)
                .ok_or_else(|| format!("`{t}`: expected an HTTP status (100-599), a range like 500-599, or a class like 5xx")),
            "grpc" => {
                let (name, needs_pushback) = match spec.strip_suffix("+pushback") {
                    Some(n) => (n, true),
                    None => (spec, false),
                };
                let code = grpc_code(name)
                    .ok_or_else(|| format!("`{t}`: unknown gRPC status `{name}` (use a name such as unavailable, or a number 0-16)"))?;
                Ok(Rule::Grpc { code, needs_pushback })
            }
            "error" => match spec.trim() {
                "" => Err(format!("`{t}`: name the error class, or use error:*")),
                "*" => Ok(Rule::Error(None)),
                name => Ok(Rule::Error(Some(name.to_string()))),
            },
            other => Err(format!("`{t}`: unknown rule kind `{other}` (use http, grpc or error)")),
        }
    }

    /// Whether this rule matches an outcome.
    pub fn matches(&self, o: &Observed<'_>) -> bool {
        match (self, o.kind) {
            (Rule::Timeout, OutcomeKind::Timeout) => true,
            (Rule::ConnectionError, OutcomeKind::ConnectionError) => true,
            (Rule::Http(lo, hi), OutcomeKind::HttpStatus) => (*lo..=*hi).contains(&o.code),
            (Rule::Grpc { code, needs_pushback }, OutcomeKind::GrpcStatus) => *code == o.code && (!needs_pushback || o.has_pushback),
            (Rule::Error(None), OutcomeKind::ErrorClass) => true,
            (Rule::Error(Some(name)), OutcomeKind::ErrorClass) => name == o.class,
            _ => false,
        }
    }

    /// The rule's canonical text.
    pub fn text(&self) -> String {
        match self {
            Rule::Timeout => "timeout".into(),
            Rule::ConnectionError => "connection-error".into(),
            Rule::Http(lo, hi) if lo == hi => format!("http:{lo}"),
            Rule::Http(lo, hi) => format!("http:{lo}-{hi}"),
            Rule::Grpc { code, needs_pushback } => {
                let name = GRPC_CODES.get(*code as usize).copied().unwrap_or("?");
                format!("grpc:{name}{}", if *needs_pushback { "+pushback" } else { "" })
            }
            Rule::Error(None) => "error:*".into(),
            Rule::Error(Some(n)) => format!("error:{n}"),
        }
    }
}

fn parse_http(spec: &str) -> Option<Rule> {
    let spec = spec.trim();
    let status = |s: &str| s.trim().parse::<i32>().ok().filter(|c| (100..=599).contains(c));
    if let Some(class) = spec.strip_suffix("xx") {
        let d = class.parse::<i32>().ok().filter(|d| (1..=5).contains(d))?;
        return Some(Rule::Http(d * 100, d * 100 + 99));
    }
    if let Some((lo, hi)) = spec.split_once('-') {
        let (lo, hi) = (status(lo)?, status(hi)?);
        return (lo <= hi).then_some(Rule::Http(lo, hi));
    }
    status(spec).map(|c| Rule::Http(c, c))
}

/// A gRPC status code from a name (`unavailable`, `UNAVAILABLE`) or number.
pub fn grpc_code(name: &str) -> Option<i32> {
    let n = name.trim();
    if let Ok(code) = n.parse::<i32>() {
        return (0..=16).contains(&code).then_some(code);
    }
    let kebab = n.to_ascii_lowercase().replace('_', "-");
    GRPC_CODES.iter().position(|c| *c == kebab).map(|p| p as i32)
}

/// A set of rules.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Rules(pub Vec<Rule>);

impl Rules {
    /// Parse every rule, naming the failing entries.
    pub fn parse_all(texts: &[&str]) -> Result<Rules, String> {
        texts.iter().map(|t| Rule::parse(t)).collect::<Result<Vec<_>, _>>().map(Rules)
    }
    /// Whether any rule matches.
    pub fn matches(&self, o: &Observed<'_>) -> bool {
        self.0.iter().any(|r| r.matches(o))
    }
    /// The rules as text.
    pub fn texts(&self) -> Vec<String> {
        self.0.iter().map(Rule::text).collect()
    }
}

/// Default `retry-on`: what can go away.
pub const DEFAULT_RETRY_ON: &[&str] = &[
    "timeout",
    "connection-error",
    "http:429",
    "http:502",
    "http:503",
    "http:504",
    "grpc:unavailable",
    "grpc:resource-exhausted+pushback",
];

/// Default `never-retry`: what never goes away by retrying.
pub const DEFAULT_NEVER_RETRY: &[&str] = &["http:400", "http:401", "http:403", "http:404", "http:422"];

/// Default breaker `failure-on`: what says the dependency is unhealthy (client errors do not).
pub const DEFAULT_BREAKER_FAILURE_ON: &[&str] = &[
    "timeout",
    "connection-error",
    "http:500-599",
    "grpc:unavailable",
    "grpc:internal",
    "grpc:unknown",
    "grpc:deadline-exceeded",
    "grpc:data-loss",
    "error:*",
];

/// HTTP methods, numbered as in the `start` flags (bits 8-11).
pub const HTTP_METHODS: [&str; 10] = ["", "GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "TRACE", "CONNECT"];

/// RFC 9110 idempotent methods (the default of `idempotent-methods`).
pub const DEFAULT_IDEMPOTENT_METHODS: &[&str] = &["GET", "HEAD", "PUT", "DELETE", "OPTIONS", "TRACE"];

/// Parse a list of rules (`retry-on`, `never-retry`, `breaker.failure-on`); `default` when absent.
pub(crate) fn parse_rules(f: &mut Fields<'_>, field: &str, default: &[&str], errors: &mut Vec<LoadError>) -> Rules {
    let Some(v) = f.take(field) else {
        return Rules::parse_all(default).unwrap_or_default();
    };
    let path = f.path_of(field);
    let Value::List(items) = v else {
        errors.push(LoadError::new(&path, format!("must be a list of rules such as [timeout, \"http:503\"], found {}", v.type_name())));
        return Rules::default();
    };
    let mut out = Vec::new();
    for (i, item) in items.iter().enumerate() {
        let text = match item {
            Value::Str(s) => s.clone(),
            Value::Int(n) => format!("http:{n}"),
            other => {
                errors.push(LoadError::new(&format!("{path}[{i}]"), format!("must be a rule string, found {}", describe(other))));
                continue;
            }
        };
        match Rule::parse(&text) {
            Ok(r) => out.push(r),
            Err(e) => errors.push(LoadError::new(&format!("{path}[{i}]"), e)),
        }
    }
    Rules(out)
}

/// Parse `idempotent-methods` into a bit set (bit `i`: method number `i` of [`HTTP_METHODS`]).
pub(crate) fn parse_methods(f: &mut Fields<'_>, errors: &mut Vec<LoadError>) -> u16 {
    let names: Vec<String> = match f.take("idempotent-methods") {
        None => DEFAULT_IDEMPOTENT_METHODS.iter().map(|s| s.to_string()).collect(),
        Some(Value::List(items)) => items
            .iter()
            .enumerate()
            .filter_map(|(i, item)| match item {
                Value::Str(s) => Some(s.to_ascii_uppercase()),
                other => {
                    errors.push(LoadError::new(
                        &format!("{}[{i}]", f.path_of("idempotent-methods")),
                        format!("must be a method name, found {}", describe(other)),
                    ));
                    None
                }
            })
            .collect(),
        Some(other) => {
            errors.push(LoadError::new(
                &f.path_of("idempotent-methods"),
                format!("must be a list of HTTP methods, found {}", other.type_name()),
            ));
            Vec::new()
        }
    };
    let mut bits = 0u16;
    for (i, name) in names.iter().enumerate() {
        match HTTP_METHODS.iter().skip(1).position(|m| m == name) {
            Some(p) => bits |= 1 << (p + 1),
            None => errors.push(LoadError::new(
                &format!("{}[{i}]", f.path_of("idempotent-methods")),
                format!("`{name}` is not one of {}", doc::list(HTTP_METHODS.get(1..).unwrap_or_default())),
            )),
        }
    }
    bits
}

/// The method names of a bit set made by [`parse_methods`], in [`HTTP_METHODS`] order.
pub(crate) fn method_names(bits: u16) -> Vec<&'static str> {
    HTTP_METHODS.iter().enumerate().filter(|(i, _)| *i > 0 && bits & (1 << i) != 0).map(|(_, m)| *m).collect()
}

/// Whether an HTTP method (by its `start` flags number) is idempotent under a method bit set.
/// 0 (not an HTTP call) is; 15 (another method) is not.
#[inline]
pub fn method_idempotent(bits: u16, method: u32) -> bool {
    match method {
        0 => true,
        1..=9 => bits & (1 << method) != 0,
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn http(code: i32) -> Observed<'static> {
        Observed { kind: OutcomeKind::HttpStatus, code, class: "", has_pushback: false }
    }

    #[test]
    fn parses_every_rule_form() {
        assert_eq!(Rule::parse("http:503"), Ok(Rule::Http(503, 503)));
        assert_eq!(Rule::parse("http:500-599"), Ok(Rule::Http(500, 599)));
        assert_eq!(Rule::parse("http:5xx"), Ok(Rule::Http(500, 599)));
        assert_eq!(Rule::parse("grpc:UNAVAILABLE"), Ok(Rule::Grpc { code: 14, needs_pushback: false }));
        assert_eq!(Rule::parse("grpc:8+pushback"), Ok(Rule::Grpc { code: 8, needs_pushback: true }));
        assert_eq!(Rule::parse("error:*"), Ok(Rule::Error(None)));
        assert!(Rule::parse("http:600").is_err());
        assert!(Rule::parse("http:599-500").is_err());
        assert!(Rule::parse("grpc:nope").is_err());
        assert!(Rule::parse("bogus").is_err());
        assert!(Rule::parse("error:").is_err());
    }

    #[test]
    fn matches_and_success() {
        let rules = Rules::parse_all(DEFAULT_RETRY_ON).unwrap_or_default();
        assert!(rules.matches(&http(503)));
        assert!(!rules.matches(&http(500)));
        assert!(http(302).is_success());
        assert!(!http(404).is_success());
        let g = Observed { kind: OutcomeKind::GrpcStatus, code: 8, class: "", has_pushback: false };
        assert!(!rules.matches(&g));
        assert!(rules.matches(&Observed { has_pushback: true, ..g }));
        for t in DEFAULT_RETRY_ON.iter().chain(DEFAULT_NEVER_RETRY).chain(DEFAULT_BREAKER_FAILURE_ON) {
            let r = Rule::parse(t);
            assert_eq!(r.as_ref().map(Rule::text).ok().as_deref(), Some(*t));
        }
    }
}
