//! The filter's configuration: a Levee policy document, and what the filter needs besides it.
//!
//! The plugin configuration is YAML or JSON, either a Levee document alone (`policies: ...`;
//! the key is then the upstream cluster and the document must name exactly one policy), or:
//!
//! ```yaml
//! document: { policies: { upstream: { attempts: 3, breaker: { ... } } } }
//! policy: upstream              # which policy of the document (optional with one policy)
//! key: { header: x-tenant }     # the key; default `cluster` (the route's upstream cluster)
//! fallbacks:                    # what each fallback the policy names does
//!   cached: { status: 200, body: "{\"items\": []}", content-type: application/json }
//!   spare:  { cluster: spare, authority: spare.internal, timeout: 1s }
//! cas-retries: 8                # compare-and-swap mismatches before failing open
//! ```
//!
//! or, for the filter's second place, among a cluster's upstream HTTP filters (once per
//! attempt, before the router decides on a retry), `role: upstream` alone: see [`Plugin`].
//!
//! Everything is validated at configure time; every error names its field path (the
//! document's own paths under `document.`).

use levee_core::doc::{self, Fields, Value};
use levee_core::time::parse_duration;
use levee_core::{Engine, LoadError};

/// Where a request's key comes from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum KeySource {
    /// The route's upstream cluster (`xds.cluster_name`).
    Cluster,
    /// A request header (a request without it has the key "").
    Header(String),
}

/// What a fallback does.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FallbackAction {
    /// Answer locally.
    Local {
        /// Status.
        status: u16,
        /// Body.
        body: String,
        /// Content type.
        content_type: String,
    },
    /// Send the request to another cluster (`dispatch_http_call`) and answer with its response.
    Cluster {
        /// Cluster name.
        cluster: String,
        /// `:authority` of the call (default: the request's).
        authority: Option<String>,
        /// Timeout in ns.
        timeout: u64,
    },
}

/// A validated filter configuration.
#[derive(Clone, Debug)]
pub struct FilterConfig {
    /// The loaded document (no state yet).
    pub engine: Engine,
    /// Index of the policy requests run under.
    pub policy: u32,
    /// Where the key comes from.
    pub key: KeySource,
    /// An action per fallback of the policy, in the policy's order.
    pub fallbacks: Vec<FallbackAction>,
    /// CAS mismatches tolerated per operation before failing open.
    pub cas_retries: u32,
}

/// What a plugin configuration makes of the filter.
#[derive(Clone, Debug)]
pub enum Plugin {
    /// The request filter before the router (`role: downstream`, the default): it decides.
    Downstream(Box<FilterConfig>),
    /// An upstream HTTP filter of a cluster (`role: upstream`): it sees each attempt's
    /// response before the router and marks an overloaded one so that the router never
    /// retries it ([`crate::envoy::attempt_response_marks`]). It holds no policy.
    Upstream,
}

const FIELDS: &[&str] = &["document", "policy", "key", "fallbacks", "cas-retries", "role"];
const ROLES: &str = "expected downstream (the request filter, the default) or upstream (a cluster's upstream HTTP filter)";

/// Parse and validate a plugin configuration, in either role.
pub fn parse_plugin(text: &str) -> Result<Plugin, Vec<LoadError>> {
    let root = doc::parse(text).map_err(|e| vec![e])?;
    match root.get("role") {
        None => {}
        Some(r) => match r.as_str() {
            Some("downstream") => {}
            Some("upstream") => {
                let mut errors = Vec::new();
                if let Some(mut f) = Fields::new("", &root, &mut errors) {
                    f.take("role");
                    f.finish(&["role"], &mut errors);
                }
                return if errors.is_empty() { Ok(Plugin::Upstream) } else { Err(errors) };
            }
            _ => return Err(vec![err("role", ROLES)]),
        },
    }
    parse(text).map(|c| Plugin::Downstream(Box::new(c)))
}

fn err(path: &str, msg: impl Into<String>) -> LoadError {
    LoadError::new(path, msg)
}

/// Parse and validate a plugin configuration.
pub fn parse(text: &str) -> Result<FilterConfig, Vec<LoadError>> {
    let root = doc::parse(text).map_err(|e| vec![e])?;
    let mut errors = Vec::new();
    let bare = root.get("policies").is_some() && root.get("document").is_none();
    let empty = Value::Null;
    let (document, mut top) = if bare {
        (&root, None)
    } else {
        let Some(mut f) = Fields::new("", &root, &mut errors) else { return Err(errors) };
        let d = f.take("document");
        if d.is_none() {
            errors.push(err("document", "is required: the Levee policy document the filter runs"));
        }
        (d.unwrap_or(&empty), Some(f))
    };
    let engine = match Engine::load(&doc::to_json(document), 0) {
        Ok(e) => Some(e),
        Err(errs) => {
            let prefix = if bare { "" } else { "document" };
            errors.extend(errs.into_iter().map(|e| err(&doc::join(prefix, &e.path), e.message)));
            None
        }
    };
    let (mut policy_name, mut key, mut cas_retries, mut fallback_map) = (None, KeySource::Cluster, 8u32, None);
    if let Some(f) = top.as_mut() {
        if let Some(v) = f.take("policy") {
            match v.as_str() {
                Some(s) => policy_name = Some(s.to_string()),
                None => errors.push(err("policy", format!("expected a policy name, found {}", v.type_name()))),
            }
        }
        if let Some(v) = f.take("key") {
            key = parse_key(v, &mut errors);
        }
        if let Some(v) = f.take("cas-retries") {
            match v.as_u64().filter(|n| (1..=64).contains(n)) {
                Some(n) => cas_retries = n as u32,
                None => errors.push(err("cas-retries", "expected an integer from 1 to 64")),
            }
        }
        fallback_map = f.take("fallbacks");
        if let Some(v) = f.take("role") {
            if v.as_str() != Some("downstream") {
                errors.push(err("role", ROLES));
            }
        }
    }
    if let Some(f) = top {
        f.finish(FIELDS, &mut errors);
    }
    let Some(engine) = engine else { return Err(errors) };
    let policy = match &policy_name {
        Some(name) => engine.policy_index(name).or_else(|| {
            errors.push(err("policy", format!("the document has no policy `{name}`")));
            None
        }),
        None if engine.policy_count() == 1 => Some(0),
        None => {
            errors.push(err("policy", "is required: the document names more than one policy"));
            None
        }
    };
    // The filter shares each key's state between Envoy's workers under compare-and-swap, one
    // key per request: a state of `scope: policy` would stay per worker, and N workers would
    // admit N times what the policy says.
    if let Some(p) = policy.and_then(|i| engine.policy(i)).filter(|p| p.scopes.any()) {
        errors.push(err(
            "policy",
            format!("policy `{}` has a strategy of `scope: policy`, which the filter cannot share between Envoy's workers yet: use `scope: key`", p.name),
        ));
    }
    let mut fallbacks = Vec::new();
    if let Some(info) = policy.and_then(|i| engine.policy_info(i)) {
        let mut actions = fallback_map.and_then(|v| Fields::new("fallbacks", v, &mut errors));
        let entries = actions.as_mut().map(|a| a.entries()).unwrap_or_default();
        for (name, _) in entries {
            if !info.fallbacks.contains(name) {
                errors.push(err(&doc::join("fallbacks", name), format!("policy `{}` has no fallback of this name", info.name)));
            }
        }
        for name in &info.fallbacks {
            let path = doc::join("fallbacks", name);
            match entries.iter().find(|(n, _)| n == name) {
                Some((_, v)) => {
                    if let Some(a) = parse_fallback(&path, v, &mut errors) {
                        fallbacks.push(a);
                    }
                }
                None => errors.push(err(&path, "is required: the policy names this fallback; say what it does (status or cluster)")),
            }
        }
    }
    match (errors.is_empty(), policy) {
        (true, Some(policy)) => Ok(FilterConfig { engine, policy, key, fallbacks, cas_retries }),
        _ => Err(errors),
    }
}

fn parse_key(v: &Value, errors: &mut Vec<LoadError>) -> KeySource {
    if v.as_str() == Some("cluster") {
        return KeySource::Cluster;
    }
    if let Some(mut f) = Fields::new("key", v, errors) {
        let header = f.take("header").and_then(Value::as_str).map(str::to_ascii_lowercase);
        f.finish(&["header"], errors);
        match header {
            Some(h) if !h.is_empty() && h.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_') => {
                return KeySource::Header(h)
            }
            _ => errors.push(err("key.header", "expected a header name (letters, digits, - and _)")),
        }
    }
    KeySource::Cluster
}

fn parse_fallback(path: &str, v: &Value, errors: &mut Vec<LoadError>) -> Option<FallbackAction> {
    let mut f = Fields::new(path, v, errors)?;
    let text = |f: &mut Fields<'_>, name: &str, errors: &mut Vec<LoadError>| -> Option<String> {
        let v = f.take(name)?;
        match v.as_str() {
            Some(s) => Some(s.to_string()),
            None => {
                errors.push(err(&f.path_of(name), format!("expected a string, found {}", v.type_name())));
                None
            }
        }
    };
    let status = f.take("status");
    let cluster = text(&mut f, "cluster", errors);
    let action = match (status, cluster) {
        (Some(s), None) => {
            let status = s.as_u64().filter(|c| (200..=599).contains(c)).map(|c| c as u16);
            if status.is_none() {
                errors.push(err(&f.path_of("status"), "expected an HTTP status from 200 to 599"));
            }
            let body = text(&mut f, "body", errors).unwrap_or_default();
            let content_type = text(&mut f, "content-type", errors).unwrap_or_else(|| "text/plain".to_string());
            f.finish(&["status", "body", "content-type"], errors);
            FallbackAction::Local { status: status?, body, content_type }
        }
        (None, Some(cluster)) => {
            let authority = text(&mut f, "authority", errors);
            let timeout = match text(&mut f, "timeout", errors) {
                None => 1_000_000_000,
                Some(t) => match parse_duration(&t) {
                    Ok(ns) if ns > 0 => ns,
                    Ok(_) => {
                        errors.push(err(&f.path_of("timeout"), "must be above 0"));
                        0
                    }
                    Err(e) => {
                        errors.push(err(&f.path_of("timeout"), e));
                        0
                    }
                },
            };
            f.finish(&["cluster", "authority", "timeout"], errors);
            FallbackAction::Cluster { cluster, authority, timeout }
        }
        (Some(_), Some(_)) => {
            errors.push(err(path, "give status (a local response) or cluster, not both"));
            return None;
        }
        (None, None) => {
            errors.push(err(path, "expected status (a local response) or cluster (a fallback cluster)"));
            return None;
        }
    };
    Some(action)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn errors(text: &str) -> Vec<String> {
        match parse(text) {
            Ok(_) => Vec::new(),
            Err(e) => e.iter().map(|e| format!("{}: {}", e.path, e.message)).collect(),
        }
    }

    #[test]
    fn a_bare_document_is_a_configuration() {
        let c = parse("policies: { p: { attempts: 2 } }").expect("config");
        assert_eq!((c.policy, c.key, c.cas_retries), (0, KeySource::Cluster, 8));
    }

    #[test]
    fn the_wrapper_names_policy_key_and_fallbacks() {
        let c = parse(
            r#"
document:
  policies:
    a: {}
    b: { fallbacks: [{ name: cached, on: [breaker-open] }, { name: spare, on: [retries-exhausted] }] }
policy: b
key: { header: X-Tenant }
fallbacks:
  cached: { status: 200, body: "[]", content-type: application/json }
  spare: { cluster: spare, timeout: 250ms }
"#,
        )
        .expect("config");
        assert_eq!(c.policy, 1);
        assert_eq!(c.key, KeySource::Header("x-tenant".into()));
        assert_eq!(c.fallbacks.len(), 2);
        assert!(matches!(&c.fallbacks[1], FallbackAction::Cluster { timeout: 250_000_000, .. }));
    }

    #[test]
    fn every_error_names_its_field_path() {
        let e =
            errors("document: { policies: { p: { atempts: 3, backoff: { base: 250 } } } }\nkey: { header: '' }\ncas-retries: 0\nextra: 1");
        let text = e.join("\n");
        for want in [
            "document.policies.p.atempts:",
            "document.policies.p.backoff.base:",
            "key.header:",
            "cas-retries:",
            "extra: is not a known field",
        ] {
            assert!(text.contains(want), "{want} in\n{text}");
        }
        assert!(errors("policies: { p: { attempts: 0 } }").iter().any(|e| e.starts_with("policies.p.attempts:")));
        assert!(errors("document: { policies: { a: {}, b: {} } }").iter().any(|e| e.starts_with("policy:")));
        let e = errors("document: { policies: { p: { fallbacks: [{ name: f, on: [breaker-open] }] } } }");
        assert!(e.iter().any(|e| e.starts_with("fallbacks.f: is required")), "{e:?}");
        assert!(!errors("{not json").is_empty());
    }

    #[test]
    fn a_policy_of_scope_policy_is_refused_with_its_reason() {
        // Shared between workers per key, a state of the policy would admit once per worker.
        let e = errors("document: { policies: { p: { rate-limit: { rate: 5, scope: policy } } } }");
        assert!(e.iter().any(|e| e.starts_with("policy:") && e.contains("scope: policy")), "{e:?}");
        assert!(errors("document: { policies: { p: { rate-limit: { rate: 5, scope: key } } } }").is_empty());
    }

    #[test]
    fn the_upstream_role_takes_no_policy() {
        assert!(matches!(parse_plugin("role: upstream"), Ok(Plugin::Upstream)));
        assert!(matches!(parse_plugin("role: downstream\ndocument: { policies: { p: {} } }"), Ok(Plugin::Downstream(_))));
        assert!(matches!(parse_plugin("policies: { p: {} }"), Ok(Plugin::Downstream(_))));
        let paths = |text: &str| match parse_plugin(text) {
            Ok(_) => Vec::new(),
            Err(e) => e.into_iter().map(|e| e.path).collect::<Vec<_>>(),
        };
        assert_eq!(paths("role: upstream\ndocument: { policies: { p: {} } }"), vec!["document"]);
        assert_eq!(paths("role: sideways"), vec!["role"]);
    }
}
