//! Concurrency limit (bulkhead): attempts in flight at once, per policy and key. A slot is
//! taken per attempt and held only while the attempt runs, never during the sleep between
//! attempts.

use crate::doc::{obj, Fields, Value};
use crate::error::LoadError;
use crate::read::uint;

/// Default attempts in flight at once.
pub const DEFAULT_MAX_CONCURRENT: u32 = 25;
/// Largest `max-concurrent`.
pub const MAX_CONCURRENT: u32 = 1_000_000;
/// The fields of `bulkhead`.
pub const FIELDS: &[&str] = &["max-concurrent"];

/// Concurrency limit configuration.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BulkheadCfg {
    /// Attempts in flight at once, per policy and key (default [`DEFAULT_MAX_CONCURRENT`]).
    pub max_concurrent: u32,
}

/// Parse `bulkhead`.
pub(crate) fn parse(path: &str, v: &Value, errors: &mut Vec<LoadError>) -> Option<BulkheadCfg> {
    let mut b = Fields::new(path, v, errors)?;
    let max_concurrent = uint(&mut b, "max-concurrent", DEFAULT_MAX_CONCURRENT, 1, MAX_CONCURRENT, errors);
    b.finish(FIELDS, errors);
    Some(BulkheadCfg { max_concurrent })
}

impl BulkheadCfg {
    /// As the policy's JSON shows it.
    pub(crate) fn to_json(&self) -> Value {
        obj([("max-concurrent", self.max_concurrent.into())])
    }

    /// Whether one more attempt may start with `in_flight` running.
    #[inline]
    pub fn admits(&self, in_flight: u32) -> bool {
        in_flight < self.max_concurrent
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::doc;

    #[test]
    fn parse_defaults_and_bounds() {
        let mut errors = Vec::new();
        let v = doc::parse("{}").unwrap_or(Value::Null);
        assert_eq!(parse("b", &v, &mut errors), Some(BulkheadCfg { max_concurrent: DEFAULT_MAX_CONCURRENT }));
        let v = doc::parse("{ max-concurrent: 0 }").unwrap_or(Value::Null);
        let _ = parse("b", &v, &mut errors);
        assert_eq!(errors.len(), 1);
        assert_eq!(errors[0].path, "b.max-concurrent");
        let cfg = BulkheadCfg { max_concurrent: 2 };
        assert!(cfg.admits(1) && !cfg.admits(2));
    }
}
