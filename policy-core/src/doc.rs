//! The policy document as a plain tree, parsed from YAML or JSON, and a reader that names the
//! field path of every error.

use crate::policy::LoadError;

/// Largest document accepted (bytes).
pub const MAX_DOCUMENT_BYTES: usize = 1 << 20;
/// Deepest nesting accepted (flow brackets or block levels).
pub const MAX_DEPTH: usize = 64;

/// A parsed document node.
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    /// `null` / `~` / empty.
    Null,
    /// A boolean.
    Bool(bool),
    /// An integer.
    Int(i64),
    /// A floating-point number.
    Float(f64),
    /// A string.
    Str(String),
    /// A sequence.
    List(Vec<Value>),
    /// A mapping, in document order.
    Map(Vec<(String, Value)>),
}

impl Value {
    /// A short description of the node's type, for error messages.
    pub fn type_name(&self) -> &'static str {
        match self {
            Value::Null => "null",
            Value::Bool(_) => "a boolean",
            Value::Int(_) => "an integer",
            Value::Float(_) => "a number",
            Value::Str(_) => "a string",
            Value::List(_) => "a list",
            Value::Map(_) => "a mapping",
        }
    }
}

/// Parse a YAML or JSON document. JSON is recognised by a leading `{`.
pub fn parse(text: &str) -> Result<Value, LoadError> {
    if text.len() > MAX_DOCUMENT_BYTES {
        return Err(LoadError::new("", format!("the document is {} bytes; the limit is {MAX_DOCUMENT_BYTES}", text.len())));
    }
    if let Some(depth) = flow_depth_over_limit(text) {
        return Err(LoadError::new("", format!("the document nests deeper than {MAX_DEPTH} levels (at byte {depth})")));
    }
    let trimmed = text.trim_start();
    if trimmed.starts_with('{') {
        let json: serde_json::Value = serde_json::from_str(text)
            .map_err(|e| LoadError::new("", format!("invalid JSON at line {}, column {}: {e}", e.line(), e.column())))?;
        return from_json(&json, 0);
    }
    let docs = yaml_rust2::YamlLoader::load_from_str(text).map_err(|e| {
        let m = e.marker();
        LoadError::new("", format!("invalid YAML at line {}, column {}: {}", m.line(), m.col() + 1, e.info()))
    })?;
    match docs.len() {
        0 => Ok(Value::Null),
        1 => match docs.first() {
            Some(doc) => from_yaml(doc, 0),
            None => Ok(Value::Null),
        },
        n => Err(LoadError::new("", format!("the YAML stream holds {n} documents; put every policy in one document"))),
    }
}

/// Bytes offset where bracket nesting, or indentation levels, exceed [`MAX_DEPTH`].
fn flow_depth_over_limit(text: &str) -> Option<usize> {
    let mut depth = 0usize;
    let mut in_quote: Option<char> = None;
    for (i, c) in text.char_indices() {
        match (in_quote, c) {
            (Some(q), c) if c == q => in_quote = None,
            (Some(_), _) => {}
            (None, '"') | (None, '\'') => in_quote = Some(c),
            (None, '[') | (None, '{') => {
                depth += 1;
                if depth > MAX_DEPTH {
                    return Some(i);
                }
            }
            (None, ']') | (None, '}') => depth = depth.saturating_sub(1),
            (None, '\n') => in_quote = None,
            _ => {}
        }
    }
    // Block nesting needs indentation; a line indented past 2 * MAX_DEPTH columns is refused.
    let mut offset = 0usize;
    for line in text.split('\n') {
        let indent = line.len() - line.trim_start_matches([' ', '-']).len();
        if indent > 2 * MAX_DEPTH {
            return Some(offset);
        }
        offset += line.len() + 1;
    }
    None
}

fn too_deep() -> LoadError {
    LoadError::new("", format!("the document nests deeper than {MAX_DEPTH} levels"))
}

fn from_json(v: &serde_json::Value, depth: usize) -> Result<Value, LoadError> {
    if depth > MAX_DEPTH {
        return Err(too_deep());
    }
    Ok(match v {
        serde_json::Value::Null => Value::Null,
        serde_json::Value::Bool(b) => Value::Bool(*b),
        serde_json::Value::Number(n) => match n.as_i64() {
            Some(i) => Value::Int(i),
            None => Value::Float(n.as_f64().unwrap_or(f64::NAN)),
        },
        serde_json::Value::String(s) => Value::Str(s.clone()),
        serde_json::Value::Array(items) => Value::List(items.iter().map(|i| from_json(i, depth + 1)).collect::<Result<_, _>>()?),
        serde_json::Value::Object(map) => {
            Value::Map(map.iter().map(|(k, v)| Ok((k.clone(), from_json(v, depth + 1)?))).collect::<Result<_, LoadError>>()?)
        }
    })
}

fn from_yaml(v: &yaml_rust2::Yaml, depth: usize) -> Result<Value, LoadError> {
    use yaml_rust2::Yaml;
    if depth > MAX_DEPTH {
        return Err(too_deep());
    }
    Ok(match v {
        Yaml::Null | Yaml::BadValue => Value::Null,
        Yaml::Boolean(b) => Value::Bool(*b),
        Yaml::Integer(i) => Value::Int(*i),
        Yaml::Real(text) => match text.parse::<f64>() {
            Ok(f) => Value::Float(f),
            Err(_) => Value::Str(text.clone()),
        },
        Yaml::String(s) => Value::Str(s.clone()),
        Yaml::Array(items) => Value::List(items.iter().map(|i| from_yaml(i, depth + 1)).collect::<Result<_, _>>()?),
        Yaml::Hash(map) => {
            let mut out = Vec::with_capacity(map.len());
            for (k, v) in map.iter() {
                let key = match k {
                    Yaml::String(s) => s.clone(),
                    Yaml::Integer(i) => i.to_string(),
                    Yaml::Boolean(b) => b.to_string(),
                    Yaml::Real(r) => r.clone(),
                    other => {
                        return Err(LoadError::new("", format!("mapping keys must be plain scalars, found {other:?}")));
                    }
                };
                out.push((key, from_yaml(v, depth + 1)?));
            }
            Value::Map(out)
        }
        Yaml::Alias(_) => return Err(LoadError::new("", "YAML aliases are not supported in policy documents")),
    })
}

/// Join a parent path and a field.
pub fn join(path: &str, field: &str) -> String {
    if path.is_empty() {
        field.to_string()
    } else {
        format!("{path}.{field}")
    }
}

/// Reads the fields of one mapping, remembering which were used so that unknown fields
/// (typos) are reported with the list of known ones.
pub struct Fields<'a> {
    path: String,
    entries: &'a [(String, Value)],
    used: Vec<bool>,
}

impl<'a> Fields<'a> {
    /// Read `value` (at `path`) as a mapping. A `null` reads as an empty mapping.
    pub fn new(path: &str, value: &'a Value, errors: &mut Vec<LoadError>) -> Option<Self> {
        const EMPTY: &[(String, Value)] = &[];
        let entries: &'a [(String, Value)] = match value {
            Value::Map(entries) => entries,
            Value::Null => EMPTY,
            other => {
                errors.push(LoadError::new(path, format!("expected a mapping, found {}", other.type_name())));
                return None;
            }
        };
        let mut seen: Vec<&str> = Vec::new();
        for (key, _) in entries {
            if seen.contains(&key.as_str()) {
                errors.push(LoadError::new(&join(path, key), "is given twice"));
            }
            seen.push(key);
        }
        Some(Fields { path: path.to_string(), entries, used: vec![false; entries.len()] })
    }

    /// The path of a field of this mapping.
    pub fn path_of(&self, field: &str) -> String {
        join(&self.path, field)
    }

    /// The path of this mapping.
    pub fn path(&self) -> &str {
        &self.path
    }

    /// Take a field, if present (and not `null`).
    pub fn take(&mut self, field: &str) -> Option<&'a Value> {
        let index = self.entries.iter().position(|(k, _)| k == field)?;
        if let Some(flag) = self.used.get_mut(index) {
            *flag = true;
        }
        match self.entries.get(index) {
            Some((_, Value::Null)) | None => None,
            Some((_, v)) => Some(v),
        }
    }

    /// Report every field that was never taken.
    pub fn finish(self, known: &[&str], errors: &mut Vec<LoadError>) {
        for ((key, _), used) in self.entries.iter().zip(self.used.iter()) {
            if !used {
                let hint = closest(key, known).map(|k| format!("; did you mean `{k}`?")).unwrap_or_default();
                errors.push(LoadError::new(
                    &join(&self.path, key),
                    format!("is not a known field{hint} (known fields: {})", known.join(", ")),
                ));
            }
        }
    }

    /// The entries of this mapping (for maps keyed by user names).
    pub fn entries(&mut self) -> &'a [(String, Value)] {
        for flag in self.used.iter_mut() {
            *flag = true;
        }
        self.entries
    }
}

/// The known name nearest to `word` by edit distance, if close enough to be a typo.
pub fn closest<'k>(word: &str, known: &[&'k str]) -> Option<&'k str> {
    known.iter().map(|k| (edit_distance(word, k), *k)).filter(|(d, k)| *d <= 2.max(k.len() / 4)).min_by_key(|(d, _)| *d).map(|(_, k)| k)
}

fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut prev: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut cur = Vec::with_capacity(b.len() + 1);
        cur.push(i + 1);
        for (j, cb) in b.iter().enumerate() {
            let sub = prev.get(j).copied().unwrap_or(0) + usize::from(ca != *cb);
            let del = prev.get(j + 1).copied().unwrap_or(0) + 1;
            let ins = cur.get(j).copied().unwrap_or(0) + 1;
            cur.push(sub.min(del).min(ins));
        }
        prev = cur;
    }
    prev.last().copied().unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn yaml_and_json_give_the_same_tree() {
        let y = parse("a: 1\nb: [x, 2.5, true]\nc: ~\n").unwrap_or(Value::Null);
        let j = parse(r#"{"a": 1, "b": ["x", 2.5, true], "c": null}"#).unwrap_or(Value::Bool(false));
        assert_eq!(y, j);
    }

    #[test]
    fn refuses_deep_nesting_and_garbage_without_panicking() {
        let deep = "[".repeat(10_000);
        assert!(parse(&deep).is_err());
        let deep_json = format!("{{\"a\":{}", "[".repeat(200));
        assert!(parse(&deep_json).is_err());
        assert!(parse("a: [1, 2").is_err());
        assert!(parse("{\"a\": }").is_err());
        assert!(parse("--- a\n--- b\n").is_err());
        assert!(parse("&x a: *x").is_err() || parse("&x a: *x").is_ok());
    }

    #[test]
    fn suggests_the_nearest_field() {
        assert_eq!(closest("atempts", &["attempts", "deadline"]), Some("attempts"));
        assert_eq!(closest("zzzzzz", &["attempts", "deadline"]), None);
    }
}
