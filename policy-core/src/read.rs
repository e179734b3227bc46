//! Typed readers shared by every strategy's parser (documents) and state import (JSON
//! state): each reports a clear error with the field path and leaves a default in place, so
//! that one bad field never hides the errors of the others.

use crate::doc::{self, Fields, Value};
use crate::error::LoadError;
use crate::time::parse_duration;

/// A value as an error message shows it.
pub(crate) fn describe(v: &Value) -> String {
    match v {
        Value::Int(i) => format!("{i}"),
        Value::Float(x) if x.is_nan() => ".nan (not a number)".to_string(),
        Value::Float(x) if x.is_infinite() => format!("{}.inf (infinity)", if *x < 0.0 { "-" } else { "" }),
        Value::Float(x) => doc::format_number(*x),
        Value::Str(s) => format!("\"{s}\""),
        Value::Bool(b) => format!("{b}"),
        other => other.type_name().to_string(),
    }
}

/// A whole number (an integral float counts).
pub(crate) fn int(v: &Value) -> Option<i64> {
    match v {
        Value::Int(i) => i64::try_from(*i).ok(),
        Value::Float(x) if x.fract() == 0.0 && x.abs() < 9.0e15 => Some(*x as i64),
        _ => None,
    }
}

/// Any number.
pub(crate) fn number(v: &Value) -> Option<f64> {
    match v {
        Value::Int(i) => Some(*i as f64),
        Value::Float(x) => Some(*x),
        _ => None,
    }
}

/// A whole number in `[lo, hi]`, `default` when absent.
pub(crate) fn uint(f: &mut Fields<'_>, field: &str, default: u32, lo: u32, hi: u32, errors: &mut Vec<LoadError>) -> u32 {
    match f.take(field) {
        None => default,
        Some(v) => match int(v) {
            Some(n) if (i64::from(lo)..=i64::from(hi)).contains(&n) => n as u32,
            _ => {
                errors.push(LoadError::new(&f.path_of(field), format!("must be a whole number from {lo} to {hi}, found {}", describe(v))));
                default
            }
        },
    }
}

/// A finite number in `[lo, hi]`, `default` when absent.
pub(crate) fn fraction(f: &mut Fields<'_>, field: &str, default: f64, lo: f64, hi: f64, errors: &mut Vec<LoadError>) -> f64 {
    match f.take(field) {
        None => default,
        Some(v) => match number(v) {
            Some(x) if x.is_finite() && x >= lo && x <= hi => x,
            _ => {
                errors.push(LoadError::new(
                    &f.path_of(field),
                    format!("must be a number from {} to {}, found {}", doc::format_number(lo), doc::format_number(hi), describe(v)),
                ));
                default
            }
        },
    }
}

/// A duration (`"250ms"`; a bare `0` is allowed), `None` when absent or wrong (reported).
/// `positive`: 0 is an error too.
pub(crate) fn opt_duration(f: &mut Fields<'_>, field: &str, errors: &mut Vec<LoadError>, positive: bool) -> Option<u64> {
    let v = f.take(field)?;
    let path = f.path_of(field);
    let parsed = match v {
        Value::Str(s) => parse_duration(s),
        Value::Int(0) => Ok(0),
        Value::Int(n) => Err(format!("`{n}` needs a unit: ns, us, ms, s, m or h (such as \"{n}ms\")")),
        other => Err(format!("must be a duration such as \"250ms\" or \"2s\", found {}", describe(other))),
    };
    match parsed {
        Ok(0) if positive => {
            errors.push(LoadError::new(&path, "must be above 0 (leave it out for none)"));
            None
        }
        Ok(d) => Some(d),
        Err(e) => {
            errors.push(LoadError::new(&path, e));
            None
        }
    }
}

/// One of a set of names.
pub(crate) fn choose<T: Copy>(path: &str, v: &Value, options: &[(&str, T)], errors: &mut Vec<LoadError>) -> Option<T> {
    let names: Vec<&str> = options.iter().map(|(n, _)| *n).collect();
    match v {
        Value::Str(s) => match options.iter().find(|(n, _)| n == s) {
            Some((_, t)) => Some(*t),
            None => {
                let hint = doc::closest(s, &names).map(|n| format!("; did you mean `{n}`?")).unwrap_or_default();
                errors.push(LoadError::new(path, format!("`{s}` is not one of {}{hint}", doc::list(&names))));
                None
            }
        },
        other => {
            errors.push(LoadError::new(path, format!("must be one of {}, found {}", doc::list(&names), describe(other))));
            None
        }
    }
}

// ---- state (JSON written by `export-state`) -------------------------------------------

/// A table of integer rows as JSON.
pub(crate) fn rows<T, const N: usize>(items: impl Iterator<Item = [T; N]>) -> Value
where
    T: Into<Value>,
{
    Value::List(items.map(|row| Value::List(row.into_iter().map(Into::into).collect())).collect())
}

/// An unsigned field of a state object.
pub(crate) fn u64_at(v: &Value, field: &str, path: &str) -> Result<u64, LoadError> {
    v.get(field).and_then(Value::as_u64).ok_or_else(|| LoadError::new(&format!("{path}.{field}"), "must be an unsigned integer"))
}

/// A `u32` field of a state object.
pub(crate) fn u32_at(v: &Value, field: &str, path: &str) -> Result<u32, LoadError> {
    u64_at(v, field, path).and_then(|n| u32::try_from(n).map_err(|_| LoadError::new(&format!("{path}.{field}"), "is out of range")))
}

/// A list of integer rows of `width` each.
pub(crate) fn pairs(v: Option<&Value>, path: &str, width: usize) -> Result<Vec<Vec<i64>>, LoadError> {
    let items = v.and_then(Value::as_list).ok_or_else(|| LoadError::new(path, "must be a list"))?;
    items
        .iter()
        .map(|item| {
            let row = item
                .as_list()
                .filter(|r| r.len() == width)
                .ok_or_else(|| LoadError::new(path, format!("entries must be lists of {width} integers")))?;
            row.iter().map(|x| x.as_i64().ok_or_else(|| LoadError::new(path, "entries must be integers"))).collect()
        })
        .collect()
}
