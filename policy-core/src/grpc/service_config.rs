//! gRPC's service config, both ways (`docs/grpc.md`, "The service config").
//!
//! **Import** ([`import`]): a service config JSON into a Levee policy document (YAML, with
//! comments), one policy per method name pattern of `methodConfig[].name`:
//!
//! | gRPC | Levee |
//! |---|---|
//! | `{}` or `{"service": ""}` (every method) | policy `default` |
//! | `{"service": "pkg.Svc"}` (every method of a service) | policy `pkg.Svc` |
//! | `{"service": "pkg.Svc", "method": "Get"}` | policy `pkg.Svc-Get` |
//! | `retryPolicy.maxAttempts` (2 or more; above 5 read as 5) | `attempts` |
//! | `initialBackoff`, `maxBackoff`, `backoffMultiplier` | `backoff: { kind: exponential, base, cap, multiplier, jitter: full }` |
//! | `retryableStatusCodes` (names or numbers) | `retry-on: ["grpc:..."]` |
//! | `hedgingPolicy.maxAttempts`, `hedgingDelay` (default 0), `nonFatalStatusCodes` (default none) | `hedge: { attempts, delay, non-fatal, preset: grpc }` |
//! | `timeout` | `deadline` |
//! | neither policy | `attempts: 1` |
//! | `retryThrottling.maxTokens` (0 < x <= 1000), `tokenRatio` (3 decimals) | `budget: { kind: token, ... }` on every policy that retries or hedges |
//!
//! `-` never occurs in a protobuf name, so the policy names read back unambiguously.
//! Durations are gRPC's JSON form (`"1.5s"`: seconds, up to 9 decimals, an `s`). What a
//! policy cannot express, or what gRPC itself refuses, is an error naming the JSON path
//! (`methodConfig[0].retryPolicy.backoffMultiplier: ...`); what stays the channel's
//! (`waitForReady`, message sizes, load balancing) is a note, written as a comment.
//!
//! **Export** ([`export`]): from a policy document, the service config a plain gRPC client
//! follows as closely as gRPC can, and notes for what gRPC cannot express (breakers, rate
//! and concurrency limits, fallbacks, per-key state, jitter other than full, backoff kinds,
//! per-attempt timeouts, the pushback cap, ...).

use crate::backoff::{Jitter, Kind};
use crate::budget::BudgetCfg;
use crate::classify::{Observed, Rule, Rules, GRPC_CODES};
use crate::doc::{self, Value};
use crate::error::{escape, LoadError};
use crate::hedge::{self, HedgeCfg, Preset};
use crate::policy::{self, Policy};
use crate::time::{format_duration, MILLISECOND, SECOND};
use crate::types::OutcomeKind;

/// Most attempts gRPC makes of a call, retries or hedges (A6: `maxAttempts` above 5 is 5).
pub const MAX_ATTEMPTS: u32 = hedge::MAX_ATTEMPTS;
/// Most tokens of `retryThrottling`, in thousandths (A6: `maxTokens` at most 1000).
pub const MAX_MILLI_TOKENS: i64 = 1_000_000;
/// The policy name of the method config that applies to every method (`"name": [{}]`).
pub const DEFAULT_POLICY: &str = "default";
/// Longest duration protobuf's JSON `Duration` holds, in seconds (10,000 years).
const MAX_DURATION_SECONDS: u64 = 315_576_000_000;
/// Longest policy name (`docs/policy.md`).
const MAX_POLICY_NAME: usize = 128;

const TOP_FIELDS: &[&str] = &["methodConfig", "retryThrottling"];
const TOP_CHANNEL_FIELDS: &[&str] = &["loadBalancingPolicy", "loadBalancingConfig", "healthCheckConfig"];
const METHOD_FIELDS: &[&str] = &["name", "timeout", "waitForReady", "retryPolicy", "hedgingPolicy"];
const METHOD_CHANNEL_FIELDS: &[&str] = &["maxRequestMessageBytes", "maxResponseMessageBytes"];
const NAME_FIELDS: &[&str] = &["service", "method"];
const RETRY_FIELDS: &[&str] = &["maxAttempts", "initialBackoff", "maxBackoff", "backoffMultiplier", "retryableStatusCodes"];
const HEDGING_FIELDS: &[&str] = &["maxAttempts", "hedgingDelay", "nonFatalStatusCodes"];
const THROTTLING_FIELDS: &[&str] = &["maxTokens", "tokenRatio"];

/// A gRPC status's name as the service config writes it (`UNAVAILABLE`), by code (0 to 16).
pub fn status_name(code: i32) -> Option<String> {
    let kebab = GRPC_CODES.get(usize::try_from(code).ok()?)?;
    Some(kebab.to_ascii_uppercase().replace('-', "_"))
}

/// A gRPC status's code from its service config name, exactly as gRPC writes it
/// (`UNAVAILABLE`; not `unavailable` or `Unavailable`).
pub fn status_code(name: &str) -> Option<i32> {
    (0..GRPC_CODES.len() as i32).find(|c| status_name(*c).as_deref() == Some(name))
}

/// Parse a duration in protobuf's JSON form, as gRPC reads it: seconds with up to 9 decimals
/// and an `s` (`"1.5s"`, `"0.100s"`, `".5s"`, `"2s"`). Nanoseconds.
pub fn parse_grpc_duration(text: &str) -> Result<u64, String> {
    let bad = || format!("`{text}` is not a gRPC duration: seconds with up to 9 decimals and an `s`, such as \"1.5s\" or \"0.1s\"");
    let body = text.strip_suffix('s').ok_or_else(bad)?;
    let (secs, frac) = body.split_once('.').unwrap_or((body, ""));
    if (secs.is_empty() && frac.is_empty()) || !secs.bytes().chain(frac.bytes()).all(|b| b.is_ascii_digit()) {
        return Err(bad());
    }
    if frac.len() > 9 {
        return Err(format!("`{text}` has more than 9 decimals: gRPC durations stop at nanoseconds"));
    }
    let too_long = || format!("`{text}` is too long: a Levee duration stays below 292 years");
    let digits = secs.trim_start_matches('0');
    let whole: u64 = if digits.is_empty() {
        0
    } else if digits.len() > 15 {
        u64::MAX
    } else {
        digits.parse::<u64>().map_err(|_| bad())?
    };
    if whole > MAX_DURATION_SECONDS {
        return Err(format!("`{text}` is above protobuf's longest duration ({MAX_DURATION_SECONDS}s)"));
    }
    let mut nanos: u64 = 0;
    for (i, b) in frac.bytes().enumerate() {
        nanos += u64::from(b - b'0') * 10u64.pow(8 - i as u32);
    }
    let total = whole.checked_mul(SECOND).and_then(|n| n.checked_add(nanos)).ok_or_else(too_long)?;
    if total > i64::MAX as u64 {
        return Err(too_long());
    }
    Ok(total)
}

/// A duration in protobuf's JSON form (`"0.1s"`, `"2s"`, `"0s"`).
pub fn format_grpc_duration(ns: u64) -> String {
    let secs = ns / SECOND;
    let frac = ns % SECOND;
    if frac == 0 {
        return format!("{secs}s");
    }
    let digits = format!("{frac:09}");
    format!("{secs}.{}s", digits.trim_end_matches('0'))
}

/// One entry of a method config's `name`: a service and a method, either empty.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct MethodName {
    /// The fully qualified service (`pkg.Svc`), or empty for every service.
    pub service: String,
    /// The method (`Get`), or empty for every method of the service.
    pub method: String,
}

fn is_ident(s: &str) -> bool {
    let mut bytes = s.bytes();
    matches!(bytes.next(), Some(b) if b.is_ascii_alphabetic() || b == b'_') && bytes.all(|b| b.is_ascii_alphanumeric() || b == b'_')
}

fn is_full_name(s: &str) -> bool {
    s.split('.').all(is_ident)
}

impl MethodName {
    /// The policy name that stands for this pattern: `default`, `pkg.Svc` or `pkg.Svc-Get`.
    pub fn policy_name(&self) -> String {
        match (self.service.is_empty(), self.method.is_empty()) {
            (true, _) => DEFAULT_POLICY.to_string(),
            (false, true) => self.service.clone(),
            (false, false) => format!("{}-{}", self.service, self.method),
        }
    }

    /// The pattern a policy name stands for, when it reads as one (the inverse of
    /// [`MethodName::policy_name`]): `default`, a protobuf full name, or one followed by `-`
    /// and a method name.
    pub fn from_policy_name(name: &str) -> Option<MethodName> {
        if name == DEFAULT_POLICY {
            return Some(MethodName::default());
        }
        let (service, method) = name.split_once('-').unwrap_or((name, ""));
        let ok = is_full_name(service) && (method.is_empty() && !name.ends_with('-') || is_ident(method));
        ok.then(|| MethodName { service: service.to_string(), method: method.to_string() })
    }

    /// As the service config writes it: `{}`, `{"service"}` or `{"service", "method"}`.
    pub fn to_json(&self) -> Value {
        let mut entries = Vec::new();
        if !self.service.is_empty() {
            entries.push(("service".to_string(), Value::from(self.service.as_str())));
        }
        if !self.method.is_empty() {
            entries.push(("method".to_string(), Value::from(self.method.as_str())));
        }
        Value::Map(entries)
    }

    fn describe(&self) -> String {
        match (self.service.is_empty(), self.method.is_empty()) {
            (true, _) => "every method".to_string(),
            (false, true) => format!("every method of service {}", self.service),
            (false, false) => format!("service {}, method {}", self.service, self.method),
        }
    }
}

// ---------------------------------------------------------------------------------------
// Reading the JSON
// ---------------------------------------------------------------------------------------

/// A JSON object's fields, with the JSON path of each and a record of those read.
struct Obj<'a> {
    path: String,
    entries: &'a [(String, Value)],
    used: Vec<bool>,
}

impl<'a> Obj<'a> {
    fn new(path: &str, v: &'a Value, errors: &mut Vec<LoadError>) -> Option<Obj<'a>> {
        match v {
            Value::Map(entries) => Some(Obj { path: path.to_string(), entries, used: vec![false; entries.len()] }),
            other => {
                errors.push(LoadError::new(path, format!("must be a JSON object, found {}", other.type_name())));
                None
            }
        }
    }

    fn path_of(&self, field: &str) -> String {
        doc::join(&self.path, field)
    }

    /// A field by its exact name, or else by the name in another case (grpc-go reads field
    /// names ignoring case: its own retry example writes `MaxAttempts`), with a note. JSON
    /// `null` reads as absent, as protobuf's JSON mapping has it.
    fn take(&mut self, field: &str, notes: &mut Vec<LoadError>) -> Option<&'a Value> {
        let index = match self.entries.iter().position(|(k, _)| k == field) {
            Some(i) => i,
            None => {
                let i = self.entries.iter().position(|(k, _)| k.eq_ignore_ascii_case(field))?;
                if let Some((k, _)) = self.entries.get(i) {
                    notes.push(LoadError::new(
                        &self.path_of(k),
                        format!("read as `{field}` (grpc-go reads field names ignoring case; grpc-java and the C core do not)"),
                    ));
                }
                i
            }
        };
        if let Some(u) = self.used.get_mut(index) {
            *u = true;
        }
        match self.entries.get(index) {
            Some((_, Value::Null)) | None => None,
            Some((_, v)) => Some(v),
        }
    }

    /// Fields never read: a note for those that stay the channel's, an error for the rest.
    fn finish(self, known: &[&str], channel: &[&str], errors: &mut Vec<LoadError>, notes: &mut Vec<LoadError>) {
        for ((key, _), used) in self.entries.iter().zip(self.used.iter()) {
            if *used {
                continue;
            }
            let path = doc::join(&self.path, key);
            if channel.contains(&key.as_str()) {
                notes.push(LoadError::new(
                    &path,
                    "is the channel's, not a resilience policy's: not imported (keep it in the service config the channel is given)",
                ));
                continue;
            }
            let mut all: Vec<&str> = known.to_vec();
            all.extend_from_slice(channel);
            let hint = doc::closest(key, &all).map(|k| format!("; did you mean `{k}`?")).unwrap_or_default();
            errors.push(LoadError::new(
                &path,
                format!("is not a field of a gRPC service config here{hint} (known fields: {})", doc::list(&all)),
            ));
        }
    }
}

fn required<'a>(o: &mut Obj<'a>, field: &str, what: &str, errors: &mut Vec<LoadError>, notes: &mut Vec<LoadError>) -> Option<&'a Value> {
    let v = o.take(field, notes);
    if v.is_none() {
        errors.push(LoadError::new(&o.path_of(field), format!("is required: {what}")));
    }
    v
}

fn number(v: &Value, path: &str, errors: &mut Vec<LoadError>) -> Option<f64> {
    match v {
        Value::Int(i) => Some(*i as f64),
        Value::Float(x) if x.is_finite() => Some(*x),
        other => {
            errors.push(LoadError::new(path, format!("must be a JSON number, found {}", other.type_name())));
            None
        }
    }
}

fn whole(v: &Value, path: &str, errors: &mut Vec<LoadError>) -> Option<i128> {
    match v {
        Value::Int(i) => Some(*i),
        Value::Float(x) if x.is_finite() && x.fract() == 0.0 && x.abs() < 1e18 => Some(*x as i128),
        other => {
            errors.push(LoadError::new(path, format!("must be a whole number, found {}", describe(other))));
            None
        }
    }
}

fn describe(v: &Value) -> String {
    match v {
        Value::Float(x) => format!("{x}"),
        Value::Str(s) => format!("the string \"{s}\""),
        other => other.type_name().to_string(),
    }
}

fn duration(v: &Value, path: &str, errors: &mut Vec<LoadError>) -> Option<u64> {
    match v {
        Value::Str(s) => parse_grpc_duration(s).map_err(|e| errors.push(LoadError::new(path, e))).ok(),
        other => {
            errors.push(LoadError::new(path, format!("must be a duration string such as \"0.1s\", found {}", describe(other))));
            None
        }
    }
}

/// Attempts as gRPC reads `maxAttempts`: 2 or more, above [`MAX_ATTEMPTS`] read as it.
fn max_attempts(o: &mut Obj<'_>, errors: &mut Vec<LoadError>, notes: &mut Vec<LoadError>) -> Option<u32> {
    let path = o.path_of("maxAttempts");
    let n = whole(required(o, "maxAttempts", "the attempts, counting the first (2 or more)", errors, notes)?, &path, errors)?;
    if n < 2 {
        errors.push(LoadError::new(&path, format!("must be 2 or more (attempts counting the first; gRPC refuses {n})")));
        return None;
    }
    if n > i128::from(MAX_ATTEMPTS) {
        notes.push(LoadError::new(
            &path,
            format!("is {n}: gRPC treats maxAttempts above {MAX_ATTEMPTS} as {MAX_ATTEMPTS}, and so does this import"),
        ));
        return Some(MAX_ATTEMPTS);
    }
    u32::try_from(n).ok()
}

/// Status codes by name (`UNAVAILABLE`) or number (14): a set to gRPC, so in the order of
/// their numbers, without repeats. `OK` is a success, never retried: dropped with a note.
fn status_codes(v: &Value, path: &str, errors: &mut Vec<LoadError>, notes: &mut Vec<LoadError>) -> Option<Vec<i32>> {
    let Value::List(items) = v else {
        errors.push(LoadError::new(path, format!("must be a list of status codes such as [\"UNAVAILABLE\"], found {}", v.type_name())));
        return None;
    };
    let before = errors.len();
    let mut codes = Vec::new();
    for (i, item) in items.iter().enumerate() {
        let at = format!("{path}[{i}]");
        let code = match item {
            Value::Str(s) => match status_code(s) {
                Some(c) => Some(c),
                None => {
                    let hint = crate::classify::grpc_code(s)
                        .filter(|_| s.parse::<i32>().is_err())
                        .and_then(status_name)
                        .map(|n| format!("; gRPC writes it {n}"))
                        .unwrap_or_default();
                    errors.push(LoadError::new(
                        &at,
                        format!("`{s}` is not a gRPC status name{hint} (names: OK, CANCELLED, ..., UNAUTHENTICATED; or a number 0 to 16)"),
                    ));
                    None
                }
            },
            Value::Int(n) if (0..=16).contains(n) => Some(*n as i32),
            other => {
                errors.push(LoadError::new(
                    &at,
                    format!("must be a gRPC status name such as \"UNAVAILABLE\" or a number 0 to 16, found {}", describe(other)),
                ));
                None
            }
        };
        match code {
            Some(0) => notes.push(LoadError::new(&at, "OK is a success, which is never retried: left out")),
            Some(c) if !codes.contains(&c) => codes.push(c),
            _ => {}
        }
    }
    crate::order::sort(&mut codes);
    (errors.len() == before).then_some(codes)
}

/// Thousandths, as gRPC keeps tokens and ratios ("up to 3 decimal places; further precision
/// is ignored"): truncated, with binary noise (0.29 * 1000 = 289.99999999999997) read as the
/// decimal it stands for.
fn milli(x: f64) -> i64 {
    let m = x * 1000.0;
    let r = m.round();
    if (m - r).abs() < 1e-6 {
        r as i64
    } else {
        m.floor() as i64
    }
}

fn milli_text(m: i64) -> String {
    doc::format_number(m as f64 / 1000.0)
}

/// A number for a policy document, exactly: its shortest form, which Levee reads back when it
/// has at most 15 significant digits.
fn exact_number(x: f64, path: &str, errors: &mut Vec<LoadError>) -> Option<String> {
    let text = format!("{x}");
    if doc::parse_number(&text) == Some(x) {
        Some(text)
    } else {
        errors.push(LoadError::new(path, format!("{x} has more significant digits than a policy document holds exactly (15)")));
        None
    }
}

fn rule_list(codes: &[i32]) -> String {
    let rules: Vec<String> = codes.iter().filter_map(|c| GRPC_CODES.get(*c as usize)).map(|n| format!("\"grpc:{n}\"")).collect();
    format!("[{}]", rules.join(", "))
}

// ---------------------------------------------------------------------------------------
// Import
// ---------------------------------------------------------------------------------------

/// A service config read into a policy document.
#[derive(Clone, Debug, PartialEq)]
pub struct Imported {
    /// The policy document: YAML, with a comment naming its source and one naming where each
    /// policy comes from. It loads in the core as it is.
    pub document: String,
    /// The policies, in document order, with the method name pattern each stands for.
    pub policies: Vec<(String, MethodName)>,
    /// What was read differently from how gRPC reads it, or is left to the channel (also in
    /// the document as comments): the JSON path and what happened.
    pub notes: Vec<LoadError>,
}

/// One method config's policy body (YAML lines), before it is given its names.
struct Body {
    lines: Vec<String>,
    retries: bool,
}

/// Read a gRPC service config (JSON) into a Levee policy document. `source` names where it
/// came from (a file name) for the document's first comment. Every error names its JSON path.
pub fn import(text: &str, source: &str) -> Result<Imported, Vec<LoadError>> {
    let root = doc::parse_json_limited(text, doc::MAX_DOCUMENT_BYTES).map_err(|e| vec![e])?;
    let mut errors = Vec::new();
    let mut notes = Vec::new();
    let mut top = Obj::new("", &root, &mut errors).ok_or_else(|| errors.clone())?;
    let throttling = top.take("retryThrottling", &mut notes).and_then(|v| throttling(v, &mut errors, &mut notes));
    // (policy name, origin, pattern, body)
    let mut policies: Vec<(String, String, MethodName, usize)> = Vec::new();
    let mut bodies: Vec<Body> = Vec::new();
    match top.take("methodConfig", &mut notes) {
        None => errors
            .push(LoadError::new("methodConfig", "is required: the method configs to import (a service config without one has no policy)")),
        Some(Value::List(items)) => {
            for (i, mc) in items.iter().enumerate() {
                let path = format!("methodConfig[{i}]");
                if let Some((names, body)) = method_config(&path, mc, throttling, &mut errors, &mut notes) {
                    for (origin, name) in names {
                        let policy = name.policy_name();
                        if let Some((_, first, _, _)) = policies.iter().find(|(p, ..)| *p == policy) {
                            errors.push(LoadError::new(
                                &origin,
                                format!("names the same methods as {first} (gRPC refuses a name given twice)"),
                            ));
                            continue;
                        }
                        policies.push((policy, origin, name, bodies.len()));
                    }
                    bodies.push(body);
                }
            }
            if items.is_empty() {
                errors.push(LoadError::new("methodConfig", "is empty: there is no method config to import"));
            }
        }
        Some(other) => {
            errors.push(LoadError::new("methodConfig", format!("must be a list of method configs, found {}", other.type_name())))
        }
    }
    top.finish(TOP_FIELDS, TOP_CHANNEL_FIELDS, &mut errors, &mut notes);
    if errors.is_empty() && policies.is_empty() {
        errors.push(LoadError::new("methodConfig", "names no method: there is no policy to import"));
    }
    if !errors.is_empty() {
        return Err(errors);
    }
    let retries = bodies.iter().any(|b| b.retries);
    if throttling.is_some() && retries {
        notes.push(LoadError::new(
            "retryThrottling",
            "gRPC keeps one token bucket per server for every method of the channel; Levee keeps one per policy and key (by default the target): each policy below has its own",
        ));
    }
    if retries {
        notes.push(LoadError::new(
            "",
            "gRPC honours a server pushback of any length; a Levee policy gives up above retry-after.cap (300s unless written)",
        ));
    }
    let mut out = String::new();
    out.push_str(&format!("# A Levee policy document imported from the gRPC service config {}\n", escape(source)));
    out.push_str("# by `levee import grpc-service-config` (docs/grpc.md). One policy per method name:\n");
    out.push_str("# `SERVICE-METHOD`, `SERVICE` (every method of that service), `default` (every other method).\n");
    for n in &notes {
        let at = if n.path.is_empty() { String::new() } else { format!("{}: ", n.path) };
        out.push_str(&format!("# note: {at}{}\n", n.message));
    }
    out.push_str("version: 1\npolicies:\n");
    for (name, origin, pattern, body) in &policies {
        out.push_str(&format!("  # {origin}: {}\n", escape(&pattern.describe())));
        out.push_str(&format!("  {}:\n", yaml_key(name)));
        for line in bodies.get(*body).map(|b| b.lines.as_slice()).unwrap_or_default() {
            out.push_str(&format!("    {line}\n"));
        }
    }
    // The document must load as it is: a failure here is a bug of this import, reported as
    // errors rather than a document that does not load.
    policy::parse_document(&out)?;
    Ok(Imported { document: out, policies: policies.into_iter().map(|(p, _, n, _)| (p, n)).collect(), notes })
}

/// A policy name as a YAML key: plain when YAML 1.2 reads it as text, else quoted.
fn yaml_key(name: &str) -> String {
    let words = ["null", "Null", "NULL", "true", "True", "TRUE", "false", "False", "FALSE"];
    if is_full_name(name.split_once('-').map_or(name, |(s, _)| s)) && !words.contains(&name) {
        name.to_string()
    } else {
        doc::to_json(&Value::from(name))
    }
}

fn throttling(v: &Value, errors: &mut Vec<LoadError>, notes: &mut Vec<LoadError>) -> Option<(i64, i64)> {
    let before = errors.len();
    let mut o = Obj::new("retryThrottling", v, errors)?;
    let max = required(&mut o, "maxTokens", "the tokens of the bucket (above 0, at most 1000)", errors, notes)
        .and_then(|v| number(v, "retryThrottling.maxTokens", errors));
    let ratio = required(&mut o, "tokenRatio", "the tokens a success adds (above 0, 3 decimals)", errors, notes)
        .and_then(|v| number(v, "retryThrottling.tokenRatio", errors));
    o.finish(THROTTLING_FIELDS, &[], errors, notes);
    let max = match max {
        Some(m) if m <= 0.0 || m > 1000.0 => {
            errors
                .push(LoadError::new("retryThrottling.maxTokens", format!("must be above 0 and at most 1000 (gRPC's bounds), found {m}")));
            None
        }
        Some(m) if milli(m) == 0 => {
            errors.push(LoadError::new(
                "retryThrottling.maxTokens",
                format!("{m} is below 0.001: tokens are kept in thousandths, as gRPC keeps them"),
            ));
            None
        }
        Some(m) => Some(milli(m)),
        None => None,
    };
    let ratio = match ratio {
        Some(r) if r <= 0.0 => {
            errors.push(LoadError::new("retryThrottling.tokenRatio", format!("must be above 0 (gRPC's bound), found {r}")));
            None
        }
        Some(r) if milli(r) == 0 => {
            errors.push(LoadError::new(
                "retryThrottling.tokenRatio",
                format!("{r} is 0 in the 3 decimals gRPC reads: no success would ever refill the bucket"),
            ));
            None
        }
        Some(r) => {
            if (r * 1000.0 - milli(r) as f64).abs() >= 1e-6 {
                notes.push(LoadError::new(
                    "retryThrottling.tokenRatio",
                    format!("{r} is read to 3 decimals, as gRPC reads it: {}", milli_text(milli(r))),
                ));
            }
            if milli(r) > MAX_MILLI_TOKENS {
                // A ratio of at least maxTokens (at most 1000) fills the bucket in one success.
                notes.push(LoadError::new(
                    "retryThrottling.tokenRatio",
                    format!("{r}: above 1000 (the most tokens) it fills the bucket in one success, as 1000 does"),
                ));
            }
            Some(milli(r).min(MAX_MILLI_TOKENS))
        }
        None => None,
    };
    if errors.len() > before {
        return None;
    }
    Some((max?, ratio?))
}

fn method_config(
    path: &str,
    v: &Value,
    throttling: Option<(i64, i64)>,
    errors: &mut Vec<LoadError>,
    notes: &mut Vec<LoadError>,
) -> Option<(Vec<(String, MethodName)>, Body)> {
    let before = errors.len();
    let mut o = Obj::new(path, v, errors)?;
    let names = match o.take("name", notes) {
        None => {
            notes.push(LoadError::new(
                &o.path_of("name"),
                "is missing: gRPC applies this method config to no method, so it makes no policy",
            ));
            Vec::new()
        }
        Some(v) => method_names(&o.path_of("name"), v, errors, notes),
    };
    let timeout = o.take("timeout", notes).and_then(|v| duration(v, &o.path_of("timeout"), errors));
    if timeout == Some(0) {
        errors.push(LoadError::new(
            &o.path_of("timeout"),
            "must be above 0 (a Levee deadline is a positive duration; leave the timeout out for none)",
        ));
    }
    match o.take("waitForReady", notes) {
        None | Some(Value::Bool(false)) => {}
        Some(Value::Bool(true)) => notes.push(LoadError::new(
            &o.path_of("waitForReady"),
            "is a call option of the channel, not a decision of the policy: not imported (set it on the call, or keep it in the channel's service config)",
        )),
        Some(other) => errors.push(LoadError::new(&o.path_of("waitForReady"), format!("must be true or false, found {}", describe(other)))),
    }
    let retry = o.take("retryPolicy", notes);
    let hedging = o.take("hedgingPolicy", notes);
    o.finish(METHOD_FIELDS, METHOD_CHANNEL_FIELDS, errors, notes);
    let mut lines = Vec::new();
    let mut retries = false;
    match (retry, hedging) {
        (Some(_), Some(_)) => {
            errors.push(LoadError::new(path, "has both retryPolicy and hedgingPolicy: gRPC allows one of them"));
        }
        (Some(r), None) => {
            if let Some(mut l) = retry_policy(&format!("{path}.retryPolicy"), r, errors, notes) {
                let rest = l.split_off(1);
                lines.extend(l);
                if let Some(t) = timeout {
                    lines.push(format!("deadline: {}", format_duration(t)));
                }
                lines.extend(rest);
                retries = true;
            }
        }
        (None, Some(h)) => {
            if let Some(t) = timeout {
                lines.push(format!("deadline: {}", format_duration(t)));
            }
            if let Some(l) = hedging_policy(&format!("{path}.hedgingPolicy"), h, errors, notes) {
                lines.push(l);
                retries = true;
            }
        }
        (None, None) => {
            lines.push("attempts: 1".to_string());
            if let Some(t) = timeout {
                lines.push(format!("deadline: {}", format_duration(t)));
            }
        }
    }
    if let (Some((max, ratio)), true) = (throttling, retries) {
        lines.push(format!("budget: {{ kind: token, max-tokens: {}, token-ratio: {} }}", milli_text(max), milli_text(ratio)));
    }
    (errors.len() == before).then_some((names, Body { lines, retries }))
}

fn method_names(path: &str, v: &Value, errors: &mut Vec<LoadError>, notes: &mut Vec<LoadError>) -> Vec<(String, MethodName)> {
    let Value::List(items) = v else {
        errors
            .push(LoadError::new(path, format!("must be a list of names such as [{{\"service\": \"pkg.Svc\"}}], found {}", v.type_name())));
        return Vec::new();
    };
    if items.is_empty() {
        notes.push(LoadError::new(path, "is empty: gRPC applies this method config to no method, so it makes no policy"));
    }
    let mut out = Vec::new();
    for (j, item) in items.iter().enumerate() {
        let at = format!("{path}[{j}]");
        let Some(mut o) = Obj::new(&at, item, errors) else { continue };
        let mut text = |field: &str, o: &mut Obj<'_>, errors: &mut Vec<LoadError>| match o.take(field, notes) {
            None => Some(String::new()),
            Some(Value::Str(s)) => Some(s.clone()),
            Some(other) => {
                errors.push(LoadError::new(&o.path_of(field), format!("must be a string, found {}", other.type_name())));
                None
            }
        };
        let service = text("service", &mut o, errors);
        let method = text("method", &mut o, errors);
        o.finish(NAME_FIELDS, &[], errors, notes);
        let (Some(service), Some(method)) = (service, method) else { continue };
        if service.is_empty() && !method.is_empty() {
            errors.push(LoadError::new(&at, "gives a method without its service (gRPC refuses it): add the service"));
            continue;
        }
        if !service.is_empty() && !is_full_name(&service) {
            errors.push(LoadError::new(
                &format!("{at}.service"),
                format!("`{service}` is not a protobuf service name (letters, digits and `_`, parts joined by `.`), so no policy name can stand for it"),
            ));
            continue;
        }
        if !method.is_empty() && !is_ident(&method) {
            errors.push(LoadError::new(
                &format!("{at}.method"),
                format!("`{method}` is not a protobuf method name (letters, digits and `_`), so no policy name can stand for it"),
            ));
            continue;
        }
        if service == DEFAULT_POLICY && method.is_empty() {
            errors.push(LoadError::new(
                &format!("{at}.service"),
                "a service named `default` cannot be told apart from the policy `default`, which stands for every method",
            ));
            continue;
        }
        let name = MethodName { service, method };
        if name.policy_name().len() > MAX_POLICY_NAME {
            errors.push(LoadError::new(&at, format!("makes a policy name longer than {MAX_POLICY_NAME} characters")));
            continue;
        }
        out.push((at, name));
    }
    out
}

/// `attempts`, `backoff` and `retry-on` lines (in that order) of a `retryPolicy`.
fn retry_policy(path: &str, v: &Value, errors: &mut Vec<LoadError>, notes: &mut Vec<LoadError>) -> Option<Vec<String>> {
    let before = errors.len();
    let mut o = Obj::new(path, v, errors)?;
    let attempts = max_attempts(&mut o, errors, notes);
    let mut dur = |field: &str, o: &mut Obj<'_>, errors: &mut Vec<LoadError>| {
        let at = o.path_of(field);
        let d = duration(required(o, field, "a duration above 0, such as \"0.1s\"", errors, notes)?, &at, errors)?;
        if d == 0 {
            errors.push(LoadError::new(&at, "must be above 0 (gRPC refuses 0)"));
            return None;
        }
        Some(d)
    };
    let initial = dur("initialBackoff", &mut o, errors);
    let max = dur("maxBackoff", &mut o, errors);
    let at = o.path_of("backoffMultiplier");
    let multiplier =
        required(&mut o, "backoffMultiplier", "the growth of the backoff (above 0)", errors, notes).and_then(|v| number(v, &at, errors));
    let multiplier = match multiplier {
        Some(m) if m <= 0.0 => {
            errors.push(LoadError::new(&at, format!("must be above 0 (gRPC refuses {m})")));
            None
        }
        Some(m) if m < 1.0 => {
            errors.push(LoadError::new(
                &at,
                format!("{m} (a backoff that shrinks) cannot be expressed: a Levee multiplier is from 1 to 1000"),
            ));
            None
        }
        Some(m) if m > crate::backoff::MAX_MULTIPLIER => {
            errors.push(LoadError::new(&at, format!("{m} cannot be expressed: a Levee multiplier is from 1 to 1000")));
            None
        }
        Some(m) => exact_number(m, &at, errors),
        None => None,
    };
    let at = o.path_of("retryableStatusCodes");
    let codes = required(&mut o, "retryableStatusCodes", "the statuses that are retried, such as [\"UNAVAILABLE\"]", errors, notes)
        .and_then(|v| status_codes(v, &at, errors, notes));
    if codes.as_ref().is_some_and(Vec::is_empty) {
        errors.push(LoadError::new(&at, "must name at least one status other than OK (gRPC refuses an empty list)"));
    }
    if o.take("perAttemptRecvTimeout", notes).is_some() {
        errors.push(LoadError::new(
            &o.path_of("perAttemptRecvTimeout"),
            "cannot be imported: it is experimental and not read alike by every gRPC implementation; remove it and write the policy's attempt-timeout by hand",
        ));
    }
    o.finish(RETRY_FIELDS, &[], errors, notes);
    if errors.len() > before {
        return None;
    }
    let (attempts, mut initial, max, multiplier, codes) = (attempts?, initial?, max?, multiplier?, codes?);
    if initial > max {
        // gRPC waits min(initialBackoff * multiplier^n, maxBackoff): maxBackoff every time.
        notes.push(LoadError::new(
            &format!("{path}.initialBackoff"),
            format!(
                "{} is above maxBackoff {}: gRPC waits up to maxBackoff every time, so the policy's base is {}",
                format_grpc_duration(initial),
                format_grpc_duration(max),
                format_duration(max)
            ),
        ));
        initial = max;
    }
    Some(vec![
        format!("attempts: {attempts}"),
        format!(
            "backoff: {{ kind: exponential, base: {}, multiplier: {multiplier}, cap: {}, jitter: full }}",
            format_duration(initial),
            format_duration(max)
        ),
        format!("retry-on: {}", rule_list(&codes)),
    ])
}

/// The `hedge` line of a `hedgingPolicy`.
fn hedging_policy(path: &str, v: &Value, errors: &mut Vec<LoadError>, notes: &mut Vec<LoadError>) -> Option<String> {
    let before = errors.len();
    let mut o = Obj::new(path, v, errors)?;
    let attempts = max_attempts(&mut o, errors, notes);
    let at = o.path_of("hedgingDelay");
    let delay = match o.take("hedgingDelay", notes) {
        None => Some(0),
        Some(v) => duration(v, &at, errors),
    };
    let at = o.path_of("nonFatalStatusCodes");
    let codes = match o.take("nonFatalStatusCodes", notes) {
        None => Some(Vec::new()),
        Some(v) => status_codes(v, &at, errors, notes),
    };
    o.finish(HEDGING_FIELDS, &[], errors, notes);
    if errors.len() > before {
        return None;
    }
    Some(format!(
        "hedge: {{ attempts: {}, delay: {}, non-fatal: {}, preset: grpc }}",
        attempts?,
        format_duration(delay?),
        rule_list(&codes?)
    ))
}

// ---------------------------------------------------------------------------------------
// Export
// ---------------------------------------------------------------------------------------

/// An object's fields, in order.
type Entries = Vec<(String, Value)>;

/// A service config written from policies.
#[derive(Clone, Debug, PartialEq)]
pub struct Exported {
    /// The service config, JSON (indented).
    pub json: String,
    /// What gRPC cannot express of the policies, each at its policy's field path.
    pub notes: Vec<LoadError>,
}

/// Which policies of a document [`export`] writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Select<'a> {
    /// The document's first policy, for every method of the channel (`"name": [{}]`).
    First,
    /// That policy, for every method of the channel.
    Named(&'a str),
    /// Every policy, each for the methods its name stands for
    /// ([`MethodName::from_policy_name`]: `default`, `pkg.Svc`, `pkg.Svc-Get`, as [`import`]
    /// names them); policies that come out the same share one method config.
    All,
}

/// The service config that makes a plain gRPC client behave as close to the policies of a
/// document as gRPC can (see [`Select`]).
pub fn export(document: &str, select: Select<'_>) -> Result<Exported, Vec<LoadError>> {
    let policies = policy::parse_document(document)?;
    let chosen: Vec<(MethodName, &Policy)> = match select {
        Select::First => {
            let p = policies.first().ok_or_else(|| vec![LoadError::new("policies", "names no policy")])?;
            vec![(MethodName::default(), p)]
        }
        Select::Named(name) => {
            let p = policies
                .iter()
                .find(|p| p.name == name)
                .ok_or_else(|| vec![LoadError::new("policies", format!("the document has no policy `{name}`"))])?;
            vec![(MethodName::default(), p)]
        }
        Select::All => {
            let mut errors = Vec::new();
            let mut out = Vec::new();
            for p in &policies {
                match MethodName::from_policy_name(&p.name) {
                    Some(n) => out.push((n, p)),
                    None => errors.push(LoadError::new(
                        &doc::join("policies", &p.name),
                        format!(
                            "is not a gRPC method name pattern (`default`, `pkg.Service` or `pkg.Service-Method`): export it alone (--policy {}), for every method of the channel",
                            p.name
                        ),
                    )),
                }
            }
            if !errors.is_empty() {
                return Err(errors);
            }
            out
        }
    };
    let mut notes = Vec::new();
    // (body without name, names)
    let mut configs: Vec<(Entries, Vec<Value>)> = Vec::new();
    let mut budgets: Vec<(String, Option<&BudgetCfg>)> = Vec::new();
    for (name, p) in &chosen {
        let path = doc::join("policies", &p.name);
        let body = method_config_of(p, &path, &mut notes);
        if body.iter().any(|(k, _)| k == "retryPolicy" || k == "hedgingPolicy") {
            budgets.push((path, p.budget.as_ref()));
        }
        match configs.iter_mut().find(|(b, _)| *b == body) {
            Some((_, names)) => names.push(name.to_json()),
            None => configs.push((body, vec![name.to_json()])),
        }
    }
    let mut root = Vec::new();
    let method_configs: Vec<Value> = configs
        .into_iter()
        .map(|(body, names)| {
            let mut entries = vec![("name".to_string(), Value::List(names))];
            entries.extend(body);
            Value::Map(entries)
        })
        .collect();
    root.push(("methodConfig".to_string(), Value::List(method_configs)));
    if let Some((max, ratio)) = throttling_of(&budgets, &mut notes) {
        root.push((
            "retryThrottling".to_string(),
            Value::Map(vec![("maxTokens".to_string(), milli_value(max)), ("tokenRatio".to_string(), milli_value(ratio))]),
        ));
    }
    let mut json = String::new();
    pretty(&Value::Map(root), 0, &mut json);
    json.push('\n');
    Ok(Exported { json, notes })
}

fn milli_value(m: i64) -> Value {
    if m % 1000 == 0 {
        Value::from(m / 1000)
    } else {
        Value::Float(m as f64 / 1000.0)
    }
}

fn number_value(x: f64) -> Value {
    if x.fract() == 0.0 && x.abs() < 1e15 {
        Value::from(x as i64)
    } else {
        Value::Float(x)
    }
}

/// One `retryThrottling` for the channel, from the token budgets of the policies that retry
/// or hedge.
fn throttling_of(budgets: &[(String, Option<&BudgetCfg>)], notes: &mut Vec<LoadError>) -> Option<(i64, i64)> {
    let mut chosen: Option<(i64, i64, &str)> = None;
    let mut without = Vec::new();
    for (path, b) in budgets {
        match b {
            Some(BudgetCfg::Token { max_milli, ratio_milli }) => match chosen {
                None => chosen = Some((*max_milli, *ratio_milli, path)),
                Some((m, r, first)) if (m, r) != (*max_milli, *ratio_milli) => notes.push(LoadError::new(
                    &format!("{path}.budget"),
                    format!("gRPC has one retryThrottling per channel: {first}'s is written, this one is not"),
                )),
                Some(_) => {}
            },
            Some(other) => {
                let kind = if matches!(other, BudgetCfg::Ratio { .. }) { "ratio" } else { "aws-adaptive" };
                notes.push(LoadError::new(
                    &format!("{path}.budget"),
                    format!("the {kind} budget has no gRPC form (gRPC's is retryThrottling, the token kind)"),
                ));
                without.push(path.as_str());
            }
            None => without.push(path.as_str()),
        }
    }
    let (max, ratio, _) = chosen?;
    notes.push(LoadError::new(
        "retryThrottling",
        "gRPC keeps one token bucket per server for every method of the channel; Levee keeps one per policy and key",
    ));
    if !without.is_empty() {
        notes.push(LoadError::new(
            "retryThrottling",
            format!(
                "applies to the retries and hedges of every method of the channel, also under {}, which have no token budget",
                without.join(", ")
            ),
        ));
    }
    Some((max, ratio))
}

fn status_values(codes: &[i32]) -> Value {
    Value::List(codes.iter().filter_map(|c| status_name(*c)).map(Value::from).collect())
}

/// The statuses (1 to 16) that `rules` match and `never` does not.
fn codes_matched(rules: &Rules, never: &Rules) -> Vec<i32> {
    (1..GRPC_CODES.len() as i32)
        .filter(|c| {
            let o = Observed { kind: OutcomeKind::GrpcStatus, code: *c, class: "", has_pushback: false };
            rules.matches(&o) && !never.matches(&o)
        })
        .collect()
}

/// Notes for rules that have no gRPC form, under `field` (`retry-on`, `hedge.non-fatal`).
fn rule_notes(p: &Policy, rules: &Rules, path: &str, field: &str, notes: &mut Vec<LoadError>) {
    for r in &rules.0 {
        match r {
            Rule::Grpc { code, needs_pushback: true } => {
                let o = Observed { kind: OutcomeKind::GrpcStatus, code: *code, class: "", has_pushback: false };
                if !rules.matches(&o) {
                    notes.push(LoadError::new(
                        &format!("{path}.{field}"),
                        format!(
                            "{}: gRPC retries a status when it is listed, with or without a pushback: {} is left out (grpc-java retries any status that carries a pushback)",
                            r.text(),
                            status_name(*code).unwrap_or_default()
                        ),
                    ));
                }
            }
            Rule::Error(_) => notes.push(LoadError::new(
                &format!("{path}.{field}"),
                format!("{}: a named error class has no gRPC status; an interceptor reports statuses", r.text()),
            )),
            Rule::Timeout if p.attempt_timeout.is_some() => notes.push(LoadError::new(
                &format!("{path}.{field}"),
                "timeout: gRPC has no per-attempt timeout to retry after (DEADLINE_EXCEEDED ends the call)",
            )),
            _ => {}
        }
    }
}

/// A policy's method config, without its `name`.
fn method_config_of(p: &Policy, path: &str, notes: &mut Vec<LoadError>) -> Entries {
    let mut out = Vec::new();
    let note = |notes: &mut Vec<LoadError>, field: &str, message: String| notes.push(LoadError::new(&doc::join(path, field), message));
    if let Some(d) = p.deadline {
        out.push(("timeout".to_string(), Value::from(format_grpc_duration(d))));
    }
    if let Some(t) = p.attempt_timeout {
        note(
            notes,
            "attempt-timeout",
            format!("{}: gRPC has no per-attempt timeout; its timeout bounds the whole call", format_duration(t)),
        );
    }
    let mut repeats = false;
    if let Some(h) = &p.hedge {
        if let Some(v) = hedging_of(p, h, path, notes) {
            out.push(("hedgingPolicy".to_string(), v));
            repeats = true;
        }
    } else if p.attempts > 1 {
        if let Some(v) = retry_of(p, path, notes) {
            out.push(("retryPolicy".to_string(), v));
            repeats = true;
        }
    }
    if repeats {
        if p.retry_after.honor {
            note(
                notes,
                "retry-after",
                format!("gRPC honours a server pushback of any length: the cap ({}) is not expressed", format_duration(p.retry_after.cap)),
            );
        } else {
            note(notes, "retry-after.honor", "false: gRPC always honours a server pushback".to_string());
        }
    }
    if p.breaker.is_some() {
        note(notes, "breaker", "gRPC has no circuit breaker".to_string());
    }
    if p.rate_limit.is_some() {
        note(notes, "rate-limit", "gRPC has no client rate limit".to_string());
    }
    if p.bulkhead.is_some() {
        note(notes, "bulkhead", "gRPC has no concurrency limit (bulkhead)".to_string());
    }
    if p.concurrency.is_some() {
        note(notes, "concurrency", "gRPC has no adaptive concurrency limit".to_string());
    }
    if !p.fallbacks.is_empty() {
        note(notes, "fallbacks", "gRPC has no fallbacks: the call fails with its status".to_string());
    }
    if p.fleet.is_some() {
        note(notes, "fleet", "gRPC shares no state between processes".to_string());
    }
    out
}

fn retry_of(p: &Policy, path: &str, notes: &mut Vec<LoadError>) -> Option<Value> {
    let note = |notes: &mut Vec<LoadError>, field: &str, message: String| notes.push(LoadError::new(&doc::join(path, field), message));
    rule_notes(p, &p.retry_on, path, "retry-on", notes);
    let codes = codes_matched(&p.retry_on, &p.never_retry);
    if codes.is_empty() {
        note(
            notes,
            "retry-on",
            format!("retries no gRPC status: no retryPolicy (gRPC makes 1 attempt where the policy allows {})", p.attempts),
        );
        return None;
    }
    if p.attempts > MAX_ATTEMPTS {
        note(notes, "attempts", format!("{}: gRPC makes at most {MAX_ATTEMPTS} attempts of a call", p.attempts));
    }
    let b = &p.backoff;
    // (initial, max, multiplier): gRPC waits U(0, min(initial * multiplier^(n-1), max)).
    let (initial, max, multiplier) = match b.kind {
        Kind::Exponential => (b.base, b.cap, b.multiplier),
        Kind::Constant => (b.base, b.base.min(b.cap), 1.0),
        Kind::Linear => {
            // base * n, matched at the first and at the last retry gRPC makes.
            let m = match p.attempts.min(MAX_ATTEMPTS) {
                0..=3 => 2.0,
                4 => 1.732,
                _ => 1.587,
            };
            note(
                notes,
                "backoff.kind",
                format!("linear has no gRPC form: exponential from base with multiplier {m}, equal to it at the first and the last retry, up to cap"),
            );
            (b.base, b.cap, m)
        }
        Kind::Decorrelated => {
            note(
                notes,
                "backoff.kind",
                "decorrelated has no gRPC form: exponential from base with multiplier 3 (the top of its range), up to cap".to_string(),
            );
            (b.base, b.cap, 3.0)
        }
    };
    if !matches!(b.jitter, Jitter::Full | Jitter::Decorrelated) {
        note(notes, "backoff.jitter", format!("{}: gRPC's jitter is always full (a delay in [0, backoff])", b.jitter.name()));
    }
    let initial = if initial == 0 {
        note(notes, "backoff.base", "0: gRPC needs an initialBackoff above 0, and the C core reads milliseconds: 0.001s".to_string());
        MILLISECOND
    } else {
        initial
    };
    Some(Value::Map(vec![
        ("maxAttempts".to_string(), Value::from(p.attempts.min(MAX_ATTEMPTS))),
        ("initialBackoff".to_string(), Value::from(format_grpc_duration(initial))),
        ("maxBackoff".to_string(), Value::from(format_grpc_duration(max.max(initial)))),
        ("backoffMultiplier".to_string(), number_value(multiplier)),
        ("retryableStatusCodes".to_string(), status_values(&codes)),
    ]))
}

fn hedging_of(p: &Policy, h: &HedgeCfg, path: &str, notes: &mut Vec<LoadError>) -> Option<Value> {
    let note = |notes: &mut Vec<LoadError>, field: &str, message: String| notes.push(LoadError::new(&doc::join(path, field), message));
    rule_notes(p, &h.non_fatal, path, "hedge.non-fatal", notes);
    note(
        notes,
        "hedge",
        "grpc-java, grpc-js and .NET hedge; grpc-go and the C core (Python's grpcio) implement no hedgingPolicy and send one attempt"
            .to_string(),
    );
    if h.attempts > MAX_ATTEMPTS {
        note(notes, "hedge.attempts", format!("{}: gRPC makes at most {MAX_ATTEMPTS} attempts of a call", h.attempts));
    }
    match h.preset {
        Preset::Grpc | Preset::Envoy => {}
        Preset::Polly => {
            note(notes, "hedge.preset", "polly: when every attempt fails, gRPC returns the last failure, not the primary's".to_string())
        }
        Preset::Failsafe => {
            note(notes, "hedge.preset", "failsafe: gRPC also sends the next hedge at once after a non-fatal failure".to_string())
        }
    }
    let mut entries = vec![
        ("maxAttempts".to_string(), Value::from(h.attempts.min(MAX_ATTEMPTS))),
        ("hedgingDelay".to_string(), Value::from(format_grpc_duration(h.delay))),
    ];
    let codes = codes_matched(&h.non_fatal, &p.never_retry);
    if !codes.is_empty() {
        entries.push(("nonFatalStatusCodes".to_string(), status_values(&codes)));
    }
    Some(Value::Map(entries))
}

// ---------------------------------------------------------------------------------------
// JSON, indented
// ---------------------------------------------------------------------------------------

fn scalar(v: &Value) -> bool {
    !matches!(v, Value::List(_) | Value::Map(_))
}

/// Short lists and objects of scalars on one line, the rest indented by two.
fn pretty(v: &Value, indent: usize, out: &mut String) {
    let flat = match v {
        Value::List(items) => items.iter().all(|i| scalar(i) || matches!(i, Value::Map(e) if e.iter().all(|(_, x)| scalar(x)))),
        Value::Map(entries) => entries.iter().all(|(_, x)| scalar(x)) && entries.len() <= 3,
        _ => true,
    };
    let mut line = String::new();
    inline(v, &mut line);
    if flat && indent + line.len() <= 96 {
        out.push_str(&line);
        return;
    }
    let pad = " ".repeat(indent + 2);
    match v {
        Value::List(items) => {
            out.push_str("[\n");
            for (i, item) in items.iter().enumerate() {
                out.push_str(&pad);
                pretty(item, indent + 2, out);
                out.push_str(if i + 1 < items.len() { ",\n" } else { "\n" });
            }
            out.push_str(&" ".repeat(indent));
            out.push(']');
        }
        Value::Map(entries) => {
            out.push_str("{\n");
            for (i, (k, item)) in entries.iter().enumerate() {
                out.push_str(&pad);
                out.push_str(&doc::to_json(&Value::from(k.as_str())));
                out.push_str(": ");
                pretty(item, indent + 2, out);
                out.push_str(if i + 1 < entries.len() { ",\n" } else { "\n" });
            }
            out.push_str(&" ".repeat(indent));
            out.push('}');
        }
        other => inline(other, out),
    }
}

fn inline(v: &Value, out: &mut String) {
    match v {
        Value::Float(x) if x.is_finite() => out.push_str(&format!("{x}")),
        Value::List(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                inline(item, out);
            }
            out.push(']');
        }
        Value::Map(entries) => {
            out.push('{');
            for (i, (k, item)) in entries.iter().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                out.push_str(&doc::to_json(&Value::from(k.as_str())));
                out.push_str(": ");
                inline(item, out);
            }
            out.push('}');
        }
        other => out.push_str(&doc::to_json(other)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_read_as_grpc_reads_them() {
        for (text, ns) in [
            ("1s", SECOND),
            ("1.5s", 1_500 * MILLISECOND),
            ("0.100s", 100 * MILLISECOND),
            (".5s", 500 * MILLISECOND),
            ("1.s", SECOND),
            ("0s", 0),
            ("0.000000001s", 1),
            ("007s", 7 * SECOND),
        ] {
            assert_eq!(parse_grpc_duration(text), Ok(ns), "{text}");
        }
        for bad in ["", "s", ".s", "1", "1ms", "-1s", "+1s", "1.2.3s", "1e3s", " 1s", "1s ", "0x1s", "1.0000000001s"] {
            assert!(parse_grpc_duration(bad).is_err(), "{bad}");
        }
        assert!(parse_grpc_duration("315576000000s").is_err_and(|e| e.contains("292 years")));
        assert!(parse_grpc_duration("315576000001s").is_err_and(|e| e.contains("protobuf")));
        assert!(parse_grpc_duration("99999999999999999999999s").is_err());
        for (ns, text) in [(0, "0s"), (SECOND, "1s"), (100 * MILLISECOND, "0.1s"), (1, "0.000000001s"), (2_500 * MILLISECOND, "2.5s")] {
            assert_eq!(format_grpc_duration(ns), text);
            assert_eq!(parse_grpc_duration(text), Ok(ns));
        }
    }

    #[test]
    fn status_names_are_grpcs() {
        assert_eq!(status_name(14).as_deref(), Some("UNAVAILABLE"));
        assert_eq!(status_name(8).as_deref(), Some("RESOURCE_EXHAUSTED"));
        assert_eq!(status_name(17), None);
        assert_eq!(status_name(-1), None);
        for c in 0..17 {
            assert_eq!(status_name(c).as_deref().and_then(status_code), Some(c));
        }
        assert_eq!(status_code("unavailable"), None);
        assert_eq!(status_code("Unavailable"), None);
    }

    #[test]
    fn thousandths_are_truncated_as_grpc_reads_them() {
        assert_eq!(milli(0.1), 100);
        assert_eq!(milli(0.29), 290);
        assert_eq!(milli(0.1239), 123);
        assert_eq!(milli(1000.0), 1_000_000);
        assert_eq!(milli(0.0009), 0);
    }
}
