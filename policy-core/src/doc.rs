//! The policy document as a plain tree, parsed from YAML or JSON, a JSON writer, and a reader
//! that names the field path of every error.
//!
//! Documents are read by `saphyr-parser`, a YAML 1.2 event parser that passes the YAML test
//! suite; a JSON document is read through it too (YAML 1.2 is a superset of JSON), while
//! exported engine state, JSON the core writes, is read by serde_json ([`parse_json_limited`]).
//! On top of the parser's events the reader builds the tree, resolves plain scalars by the
//! YAML 1.2 core schema, keeps the limits ([`MAX_DOCUMENT_BYTES`], [`MAX_DEPTH`]) and refuses, with a line and column, what a
//! policy never needs and what two readers could read two ways: anchors and aliases, tags,
//! directives, several documents, keys that are not text, a key given twice, numbers it cannot
//! hold exactly and integers with a leading zero. Whatever it accepts, it reads as YAML 1.2
//! does (`policy-core/tests/yaml_test_suite.rs` runs it over every case of the suite). The
//! parser keeps its state on the heap, not in recursion, and the reader stops at the first
//! node deeper than [`MAX_DEPTH`].

use saphyr_parser::{Event, Parser, ScalarStyle};

use crate::error::LoadError;

/// Largest document accepted (bytes).
pub const MAX_DOCUMENT_BYTES: usize = 1 << 20;
/// Deepest nesting accepted.
pub const MAX_DEPTH: usize = 64;

/// A parsed document node.
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    /// `null` / `~` / empty.
    Null,
    /// A boolean.
    Bool(bool),
    /// An integer (wide enough for every `i64` and `u64`).
    Int(i128),
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
    /// A field of a mapping.
    pub fn get(&self, key: &str) -> Option<&Value> {
        match self {
            Value::Map(entries) => entries.iter().find(|(k, _)| k == key).map(|(_, v)| v),
            _ => None,
        }
    }
    /// As an unsigned integer.
    pub fn as_u64(&self) -> Option<u64> {
        match self {
            Value::Int(i) => u64::try_from(*i).ok(),
            _ => None,
        }
    }
    /// As a signed integer.
    pub fn as_i64(&self) -> Option<i64> {
        match self {
            Value::Int(i) => i64::try_from(*i).ok(),
            _ => None,
        }
    }
    /// As a string.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::Str(s) => Some(s),
            _ => None,
        }
    }
    /// As a list.
    pub fn as_list(&self) -> Option<&[Value]> {
        match self {
            Value::List(items) => Some(items),
            _ => None,
        }
    }
    /// Whether this is `null`.
    pub fn is_null(&self) -> bool {
        matches!(self, Value::Null)
    }
}

/// Build a mapping from `(key, value)` pairs.
pub fn obj<const N: usize>(entries: [(&str, Value); N]) -> Value {
    Value::Map(entries.into_iter().map(|(k, v)| (k.to_string(), v)).collect())
}

impl From<u64> for Value {
    fn from(v: u64) -> Value {
        Value::Int(i128::from(v))
    }
}
impl From<u32> for Value {
    fn from(v: u32) -> Value {
        Value::Int(i128::from(v))
    }
}
impl From<i64> for Value {
    fn from(v: i64) -> Value {
        Value::Int(i128::from(v))
    }
}
impl From<f64> for Value {
    fn from(v: f64) -> Value {
        Value::Float(v)
    }
}
impl From<bool> for Value {
    fn from(v: bool) -> Value {
        Value::Bool(v)
    }
}
impl From<&str> for Value {
    fn from(v: &str) -> Value {
        Value::Str(v.to_string())
    }
}
impl From<String> for Value {
    fn from(v: String) -> Value {
        Value::Str(v)
    }
}
impl<T: Into<Value>> From<Option<T>> for Value {
    fn from(v: Option<T>) -> Value {
        v.map(Into::into).unwrap_or(Value::Null)
    }
}
impl<T: Into<Value>> From<Vec<T>> for Value {
    fn from(v: Vec<T>) -> Value {
        Value::List(v.into_iter().map(Into::into).collect())
    }
}

/// Write a value as compact JSON.
pub fn to_json(v: &Value) -> String {
    let mut out = String::new();
    write_json(v, &mut out);
    out
}

fn write_json(v: &Value, out: &mut String) {
    match v {
        Value::Null => out.push_str("null"),
        Value::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
        Value::Int(i) => out.push_str(&i.to_string()),
        Value::Float(x) if x.is_finite() => {
            let text = format_number(*x);
            out.push_str(&text);
            if !text.as_bytes().contains(&b'.') {
                out.push_str(".0");
            }
        }
        Value::Float(_) => out.push_str("null"),
        Value::Str(s) => write_string(s, out),
        Value::List(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                write_json(item, out);
            }
            out.push(']');
        }
        Value::Map(entries) => {
            out.push('{');
            for (i, (k, item)) in entries.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                write_string(k, out);
                out.push(':');
                write_json(item, out);
            }
            out.push('}');
        }
    }
}

fn write_string(s: &str, out: &mut String) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
}

/// Parse a YAML or JSON document.
pub fn parse(text: &str) -> Result<Value, LoadError> {
    parse_limited(text, MAX_DOCUMENT_BYTES)
}

/// Parse a document of at most `limit` bytes (exported state has its own bound).
pub fn parse_limited(text: &str, limit: usize) -> Result<Value, LoadError> {
    if text.len() > limit {
        return Err(LoadError::new("", format!("the document is {} bytes; the limit is {limit}", text.len())));
    }
    Reader { text, stack: Vec::new(), root: None, documents: 0 }.read()
}

/// A line and a column, both from 1.
type Place = (usize, usize);

fn invalid((line, col): Place, message: &str) -> LoadError {
    LoadError::new("", format!("invalid document at line {line}, column {col}: {message}"))
}

/// A collection being read.
enum Open {
    List(Vec<Value>),
    /// The entries so far, where each key starts, and the key whose value comes next.
    Map(Vec<(String, Value)>, Vec<Place>, Option<String>),
}

/// Builds the tree from the parser's events, refusing what a policy never needs.
struct Reader<'a> {
    text: &'a str,
    stack: Vec<Open>,
    root: Option<Value>,
    documents: usize,
}

impl Reader<'_> {
    fn read(mut self) -> Result<Value, LoadError> {
        let mut parser = Parser::new_from_str(self.text);
        while let Some(next) = parser.next_event() {
            let (event, span) = next.map_err(|e| invalid((e.marker().line(), e.marker().col() + 1), e.info()))?;
            let at = (span.start.line(), span.start.col() + 1);
            match event {
                Event::DocumentStart(explicit) => {
                    self.documents += 1;
                    if self.documents > 1 {
                        return Err(invalid(at, "the YAML stream holds several documents; put every policy in one document"));
                    }
                    // Directives come before the first `---`: `%YAML 1.1` would ask for other
                    // rules (`yes` a boolean, `010` octal), `%TAG` only serves tags.
                    if let Some(line) = self
                        .text
                        .lines()
                        .take(at.0.saturating_sub(1))
                        .position(|l| l.trim_start_matches('\u{feff}').starts_with('%'))
                        .filter(|_| explicit)
                    {
                        return Err(invalid((line + 1, 1), "YAML directives (%YAML, %TAG) are not supported"));
                    }
                }
                Event::Alias(_) => return Err(invalid(at, ANCHORS)),
                Event::Scalar(text, style, anchor, tag) => {
                    refuse_properties(anchor, tag.is_some(), at)?;
                    if let Some(Open::Map(_, places, key @ None)) = self.stack.last_mut() {
                        let name = match style {
                            ScalarStyle::Plain => match plain(&text).map_err(|m| invalid(at, &m))? {
                                Value::Str(s) => s,
                                Value::Null => return Err(invalid(at, "a key must be text: this key is empty (YAML reads it as null)")),
                                other => {
                                    return Err(invalid(
                                        at,
                                        &format!(
                                            "a key must be text: YAML reads `{text}` as {} (quote it if it is a name)",
                                            other.type_name()
                                        ),
                                    ))
                                }
                            },
                            _ => text.into_owned(),
                        };
                        places.push(at);
                        *key = Some(name);
                    } else {
                        let value = match style {
                            ScalarStyle::Plain => plain(&text).map_err(|m| invalid(at, &m))?,
                            _ => Value::Str(text.into_owned()),
                        };
                        self.add(value);
                    }
                }
                Event::SequenceStart(anchor, ref tag) | Event::MappingStart(anchor, ref tag) => {
                    refuse_properties(anchor, tag.is_some(), at)?;
                    if let Some(Open::Map(_, _, None)) = self.stack.last() {
                        return Err(invalid(at, "a key must be text, not a list or a mapping"));
                    }
                    if self.stack.len() > MAX_DEPTH {
                        return Err(invalid(at, &format!("the document nests deeper than {MAX_DEPTH} levels")));
                    }
                    let open = if matches!(event, Event::SequenceStart(..)) {
                        Open::List(Vec::new())
                    } else {
                        Open::Map(Vec::new(), Vec::new(), None)
                    };
                    self.stack.push(open);
                }
                Event::SequenceEnd | Event::MappingEnd => match self.stack.pop() {
                    Some(Open::List(items)) => self.add(Value::List(items)),
                    Some(Open::Map(entries, places, _)) => {
                        self.check_keys(&entries, &places)?;
                        self.add(Value::Map(entries));
                    }
                    None => {}
                },
                Event::StreamEnd => break,
                Event::StreamStart | Event::DocumentEnd | Event::Nothing => {}
            }
        }
        Ok(self.root.take().unwrap_or(Value::Null))
    }

    /// A finished node: the root, an item, or the value of the pending key.
    fn add(&mut self, value: Value) {
        match self.stack.last_mut() {
            None => self.root = Some(value),
            Some(Open::List(items)) => items.push(value),
            Some(Open::Map(entries, _, key)) => {
                if let Some(k) = key.take() {
                    entries.push((k, value));
                }
            }
        }
    }

    /// A key given twice in one mapping is one error at its second place (not a silent choice
    /// of one of the values).
    fn check_keys(&self, entries: &[(String, Value)], places: &[Place]) -> Result<(), LoadError> {
        let Some((dup, first)) = first_duplicate(entries) else {
            return Ok(());
        };
        let key = entries.get(dup).map(|e| e.0.as_str()).unwrap_or_default();
        let (line, col) = places.get(dup).copied().unwrap_or((0, 0));
        let (first_line, first_col) = places.get(first).copied().unwrap_or((0, 0));
        // The path of the mapping: what holds it, down from the root, then the key.
        let mut path = String::new();
        for open in &self.stack {
            match open {
                Open::List(items) => path = format!("{path}[{}]", items.len()),
                Open::Map(_, _, k) => path = join(&path, k.as_deref().unwrap_or_default()),
            }
        }
        Err(LoadError::new(
            &join(&path, key),
            format!("invalid document at line {line}, column {col}: `{key}` is given twice (first at line {first_line}, column {first_col}); keep one"),
        ))
    }
}

/// The first key given twice in a mapping, as (second place, first place): sorting, not
/// comparing every pair, since a document may hold 4096 policies.
fn first_duplicate(entries: &[(String, Value)]) -> Option<(usize, usize)> {
    let order = crate::order::permutation(entries.len(), &|a, b| entries.get(a).map(|e| &e.0).cmp(&entries.get(b).map(|e| &e.0)));
    let mut second: Option<(usize, usize)> = None;
    for pair in order.windows(2) {
        if let [a, b] = *pair {
            if entries.get(a).map(|e| &e.0) == entries.get(b).map(|e| &e.0) && second.is_none_or(|(s, _)| b < s) {
                second = Some((b, a));
            }
        }
    }
    second
}

/// Parse a JSON text of at most `limit` bytes: exported engine state, which the core writes
/// itself ([`to_json`]). serde_json reads it: several times faster than the YAML parser on
/// large states, and it allocates each string once (the YAML parser's intermediate strings
/// made the component's allocator slow down more than linearly on states of thousands of
/// keys). A key given twice is refused, as in documents.
pub fn parse_json_limited(text: &str, limit: usize) -> Result<Value, LoadError> {
    if text.len() > limit {
        return Err(LoadError::new("", format!("the document is {} bytes; the limit is {limit}", text.len())));
    }
    let mut reader = serde_json::Deserializer::from_str(text);
    let value = serde::Deserializer::deserialize_any(&mut reader, JsonValue)
        .and_then(|v| reader.end().map(|()| v))
        .map_err(|e| invalid((e.line(), e.column()), &json_message(&e)))?;
    Ok(value)
}

/// serde_json's message without its own " at line L column C".
fn json_message(e: &serde_json::Error) -> String {
    let text = e.to_string();
    match text.rfind(" at line ") {
        Some(i) => text.get(..i).unwrap_or_default().to_string(),
        None => text,
    }
}

/// Builds a [`Value`] from serde_json's callbacks.
struct JsonValue;

impl<'de> serde::de::Visitor<'de> for JsonValue {
    type Value = Value;
    fn expecting(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.write_str("a JSON value")
    }
    fn visit_unit<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }
    fn visit_bool<E>(self, v: bool) -> Result<Value, E> {
        Ok(Value::Bool(v))
    }
    fn visit_i64<E>(self, v: i64) -> Result<Value, E> {
        Ok(Value::Int(i128::from(v)))
    }
    fn visit_u64<E>(self, v: u64) -> Result<Value, E> {
        Ok(Value::Int(i128::from(v)))
    }
    fn visit_f64<E>(self, v: f64) -> Result<Value, E> {
        Ok(Value::Float(v))
    }
    fn visit_str<E>(self, v: &str) -> Result<Value, E> {
        Ok(Value::Str(v.to_string()))
    }
    fn visit_string<E>(self, v: String) -> Result<Value, E> {
        Ok(Value::Str(v))
    }
    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
        let mut items = Vec::new();
        while let Some(item) = seq.next_element_seed(JsonSeed)? {
            items.push(item);
        }
        Ok(Value::List(items))
    }
    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
        let mut entries: Vec<(String, Value)> = Vec::new();
        while let Some(key) = map.next_key::<String>()? {
            let value = map.next_value_seed(JsonSeed)?;
            entries.push((key, value));
        }
        if let Some((dup, _)) = first_duplicate(&entries) {
            let key = entries.get(dup).map(|e| e.0.as_str()).unwrap_or_default();
            return Err(serde::de::Error::custom(format!("`{key}` is given twice")));
        }
        Ok(Value::Map(entries))
    }
}

/// [`JsonValue`] for the items of lists and mappings.
struct JsonSeed;

impl<'de> serde::de::DeserializeSeed<'de> for JsonSeed {
    type Value = Value;
    fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<Value, D::Error> {
        d.deserialize_any(JsonValue)
    }
}

const ANCHORS: &str = "anchors and aliases are not supported: write the value out where it is used";

/// Anchors (`&a`) and tags (`!t`) on a node are refused.
fn refuse_properties(anchor: usize, tagged: bool, at: Place) -> Result<(), LoadError> {
    if anchor != 0 {
        return Err(invalid(at, ANCHORS));
    }
    if tagged {
        return Err(invalid(at, "tags are not supported: remove the `!...` (a value's type comes from how it is written)"));
    }
    Ok(())
}

/// Resolve a plain scalar by the YAML 1.2 core schema (spec 10.3.2). A number the reader
/// cannot hold exactly, and an integer with a leading zero (octal to YAML 1.1 tools, decimal
/// to YAML 1.2), are refused rather than read otherwise.
fn plain(text: &str) -> Result<Value, String> {
    match text {
        "" | "~" | "null" | "Null" | "NULL" => return Ok(Value::Null),
        "true" | "True" | "TRUE" => return Ok(Value::Bool(true)),
        "false" | "False" | "FALSE" => return Ok(Value::Bool(false)),
        ".inf" | ".Inf" | ".INF" | "+.inf" | "+.Inf" | "+.INF" => return Ok(Value::Float(f64::INFINITY)),
        "-.inf" | "-.Inf" | "-.INF" => return Ok(Value::Float(f64::NEG_INFINITY)),
        ".nan" | ".NaN" | ".NAN" => return Ok(Value::Float(f64::NAN)),
        _ => {}
    }
    let inexact = || {
        format!("the number `{text}` cannot be read exactly (Levee reads integers of up to 38 digits and decimals of up to 15 significant digits with exponents up to 22)")
    };
    let unsigned = text.strip_prefix(['-', '+']).unwrap_or(text);
    let (radix, digits) = if let Some(octal) = text.strip_prefix("0o") {
        (8, octal)
    } else if let Some(hex) = text.strip_prefix("0x") {
        (16, hex)
    } else {
        (10, unsigned)
    };
    if !digits.is_empty() && digits.chars().all(|c| c.is_digit(radix)) {
        if radix == 10 && digits.len() > 1 && digits.starts_with('0') {
            return Err(format!(
                "`{text}` is an integer with a leading zero: YAML 1.1 tools read it as octal, YAML 1.2 as decimal; remove the zero (or write 0o{} for octal)",
                digits.trim_start_matches('0')
            ));
        }
        let magnitude = i128::from_str_radix(digits, radix).map_err(|_| inexact())?;
        return Ok(Value::Int(if text.starts_with('-') { -magnitude } else { magnitude }));
    }
    // [-+]? ( \. [0-9]+ | [0-9]+ ( \. [0-9]* )? ) ( [eE] [-+]? [0-9]+ )?
    let decimal = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    let (mantissa, exponent) = match unsigned.split_once(['e', 'E']) {
        Some((m, e)) => (m, Some(e.strip_prefix(['-', '+']).unwrap_or(e))),
        None => (unsigned, None),
    };
    let float = match mantissa.split_once('.') {
        Some(("", frac)) => decimal(frac),
        Some((int, frac)) => decimal(int) && (frac.is_empty() || decimal(frac)),
        None => decimal(mantissa),
    } && exponent.is_none_or(decimal);
    if float {
        return parse_number(text).map(Value::Float).ok_or_else(inexact);
    }
    Ok(Value::Str(text.to_string()))
}

/// Parse a decimal number exactly when it can be (Clinger's fast path: at most 15
/// significant digits and a power of ten up to 10^22, so one correctly rounded IEEE operation
/// gives the nearest `f64`). Policy numbers (ratios, rates, multipliers) always fit; anything
/// else is read as text and refused by the field that expected a number.
pub fn parse_number(text: &str) -> Option<f64> {
    let (negative, body) = match text.strip_prefix('-') {
        Some(rest) => (true, rest),
        None => (false, text.strip_prefix('+').unwrap_or(text)),
    };
    let (mantissa_text, exponent) = match body.split_once(['e', 'E']) {
        Some((m, e)) => (m, e.parse::<i32>().ok()?),
        None => (body, 0),
    };
    let (int_part, frac_part) = mantissa_text.split_once('.').unwrap_or((mantissa_text, ""));
    if int_part.is_empty() && frac_part.is_empty() {
        return None;
    }
    let digits = format!("{int_part}{frac_part}");
    let significant = digits.trim_start_matches('0').trim_end_matches('0');
    // Zeros at the end scale by ten: 1500000000000000000000.0 is 15 * 10^20.
    let zeros = digits.len() - digits.trim_end_matches('0').len();
    let digits = significant;
    if !digits.bytes().all(|b| b.is_ascii_digit()) || !int_part.bytes().chain(frac_part.bytes()).all(|b| b.is_ascii_digit()) {
        return None;
    }
    if digits.len() > 15 {
        return None;
    }
    let mantissa = if digits.is_empty() { 0 } else { digits.parse::<u64>().ok()? };
    let power = exponent.checked_sub(i32::try_from(frac_part.len()).ok()?)?.checked_add(if digits.is_empty() {
        0
    } else {
        i32::try_from(zeros).ok()?
    })?;
    const POW10: [f64; 23] =
        [1e0, 1e1, 1e2, 1e3, 1e4, 1e5, 1e6, 1e7, 1e8, 1e9, 1e10, 1e11, 1e12, 1e13, 1e14, 1e15, 1e16, 1e17, 1e18, 1e19, 1e20, 1e21, 1e22];
    let scale = *POW10.get(power.unsigned_abs() as usize)?;
    let value = if power >= 0 { mantissa as f64 * scale } else { mantissa as f64 / scale };
    Some(if negative { -value } else { value })
}

/// Print a number for people and JSON: whole numbers as integers, others with up to six
/// decimals (policy numbers are percentages, ratios and multipliers).
pub fn format_number(x: f64) -> String {
    if !x.is_finite() {
        return "null".to_string();
    }
    if x.fract() == 0.0 && x.abs() < 1e15 {
        return format!("{}", x as i64);
    }
    let scaled = (x.abs() * 1e6).round();
    if scaled >= 9.0e18 {
        return format!("{}", x as i64);
    }
    let scaled = scaled as u64;
    let (whole, frac) = (scaled / 1_000_000, scaled % 1_000_000);
    let sign = if x < 0.0 { "-" } else { "" };
    let frac = format!("{frac:06}");
    format!("{sign}{whole}.{}", frac.trim_end_matches('0'))
}

/// Join a parent path and a field.
pub fn join(path: &str, field: &str) -> String {
    if path.is_empty() {
        field.to_string()
    } else {
        format!("{path}.{field}")
    }
}

/// The error of a field given with no value.
pub const EMPTY_VALUE: &str = "has no value: give one, or leave the field out for its default (`{}` is an empty mapping)";

/// Reads the fields of one mapping, remembering which were used so that unknown fields
/// (typos) are reported with the list of known ones.
pub struct Fields<'a> {
    path: String,
    entries: &'a [(String, Value)],
    used: Vec<bool>,
}

impl<'a> Fields<'a> {
    /// Read `value` (at `path`) as a mapping. A `null` document reads as an empty mapping; a
    /// field of the mapping whose value is `null` is an error ([`EMPTY_VALUE`]) and reads as
    /// absent.
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
        // An empty value (`attempts:` with nothing after it, `~`, `null`) is never read as
        // "use the default": that would turn a forgotten value into no deadline at all.
        for (key, v) in entries {
            if v.is_null() {
                errors.push(LoadError::new(&join(path, key), EMPTY_VALUE));
            }
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
                errors.push(LoadError::new(&join(&self.path, key), format!("is not a known field{hint} (known fields: {})", list(known))));
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

/// `a, b, c`: names for an error message (a loop, not `join`, which costs the component 1 KB).
pub fn list(names: &[&str]) -> String {
    let mut out = String::new();
    for (i, n) in names.iter().enumerate() {
        if i > 0 {
            out.push_str(", ");
        }
        out.push_str(n);
    }
    out
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

    fn ok(text: &str) -> Value {
        match parse(text) {
            Ok(v) => v,
            Err(e) => Value::Str(format!("ERROR {e}")),
        }
    }

    #[test]
    fn yaml_and_json_give_the_same_tree() {
        let y = ok("a: 1\nb: [x, 2.5, true]\nc: ~\n");
        let j = ok(r#"{"a": 1, "b": ["x", 2.5, true], "c": null}"#);
        assert_eq!(y, j);
        assert_eq!(y.get("a"), Some(&Value::Int(1)));
    }

    #[test]
    fn block_structures() {
        let v = ok("# top\npolicies:\n  p:\n    attempts: 3   # comment\n    retry-on:\n      - timeout\n      - \"http:503\"\n    fallbacks:\n    - name: cache\n      on: [breaker-open, any]\n    - plain\n");
        let p = v.get("policies").and_then(|p| p.get("p"));
        assert_eq!(p.and_then(|p| p.get("attempts")), Some(&Value::Int(3)));
        assert_eq!(
            p.and_then(|p| p.get("retry-on")),
            Some(&Value::List(vec![Value::Str("timeout".into()), Value::Str("http:503".into())]))
        );
        let fbs = p.and_then(|p| p.get("fallbacks")).and_then(Value::as_list).map(|l| l.len());
        assert_eq!(fbs, Some(2));
    }

    #[test]
    fn scalars() {
        assert_eq!(plain("250ms"), Ok(Value::Str("250ms".into())));
        assert_eq!(plain("-3"), Ok(Value::Int(-3)));
        assert_eq!(plain("1.5"), Ok(Value::Float(1.5)));
        assert_eq!(plain("1e3"), Ok(Value::Float(1000.0)));
        assert_eq!(plain("http:503"), Ok(Value::Str("http:503".into())));
        assert_eq!(plain("18446744073709551615").ok().and_then(|v| v.as_u64()), Some(u64::MAX));
        // The whole core schema: octal, hex, every spelling of infinity; signs only where
        // the schema has them.
        assert_eq!(plain("0o17"), Ok(Value::Int(15)));
        assert_eq!(plain("0x1F"), Ok(Value::Int(31)));
        assert_eq!(plain("-0x1F"), Ok(Value::Str("-0x1F".into())));
        assert_eq!(plain("+.INF"), Ok(Value::Float(f64::INFINITY)));
        assert_eq!(plain("1."), Ok(Value::Float(1.0)));
        assert_eq!(plain("1500000000000000000000.0"), Ok(Value::Float(1.5e21)));
        assert_eq!(plain("1.2.3"), Ok(Value::Str("1.2.3".into())));
        // What the reader cannot hold exactly, or YAML 1.1 reads otherwise, is refused.
        assert!(plain("1e400").is_err_and(|m| m.contains("cannot be read exactly")));
        assert!(plain("0.12345678901234567").is_err());
        assert!(plain("1234567890123456789012345678901234567890").is_err());
        assert!(plain("010").is_err_and(|m| m.contains("leading zero")));
        assert_eq!(plain("0"), Ok(Value::Int(0)));
        assert_eq!(ok("a: 'it''s'\nb: \"tab\\tA\\u0042\"\n").get("b"), Some(&Value::Str("tab\tAB".into())));
    }

    #[test]
    fn refuses_what_it_does_not_read_without_panicking() {
        for bad in [
            "[".repeat(10_000).as_str(),
            "a: [1, 2",
            "{\"a\" 1}",
            "--- a\n--- b\n",
            "a: &x 1\nb: *x\n",
            "a: !!str 1\n",
            "%YAML 1.1\n---\na: 1\n",
            "\u{feff}%YAML 1.1\n---\na: 1\n",
            "# c\n%TAG !e! tag:e.com,2000:\n---\na: 1\n",
            "? [a]\n: 1\n",
            "1: a\n",
            ": a\n",
            "a:\n\tb: 1\n",
            "a: b: c\n",
            "a:\n  b: 1\n   c: 2\n",
            "\"unterminated",
        ] {
            assert!(parse(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn reads_what_issue_45_found_misread_as_yaml_does() {
        // A quoted string over two lines folds the break and the indentation to one space.
        assert_eq!(ok("foo: \"bar\n  baz\"\n").get("foo"), Some(&Value::Str("bar baz".into())));
        assert_eq!(ok("foo: 'bar\n\n  baz'\n").get("foo"), Some(&Value::Str("bar\nbaz".into())));
        // A tab after `---` separates; a comment needs a space before `#`.
        assert_eq!(ok("---\tscalar\n"), Value::Str("scalar".into()));
        assert_eq!(ok("this is #not a: key\n"), Value::Str("this is".into()));
        assert_eq!(ok("{ ? explicit: entry }\n").get("explicit"), Some(&Value::Str("entry".into())));
        assert_eq!(ok("a: |\n  two\n  lines\n").get("a"), Some(&Value::Str("two\nlines\n".into())));
        // What YAML refuses is refused: a comment without a space, `\'` in double quotes, a
        // bare `-` in a flow list, document markers inside quotes, tabs as indentation.
        for bad in ["[a]#x\n", "a: \"it\\'s\"\n", "[-]\n", "\"a\n---\nb\"\n", "a:\n\tb: 1\n", "- a\n\t- b\n"] {
            assert!(parse(bad).is_err(), "{bad:?}");
        }
        // Two empty documents are several documents; a null key is not a name.
        assert!(parse("---\n---\n").is_err_and(|e| e.message.contains("several documents")));
        assert!(parse(": x\n").is_err_and(|e| e.message.contains("a key must be text")));
    }

    #[test]
    fn exported_state_is_read_as_json() {
        let v = parse_json_limited(r#"{"a": [1, -2, 0.25, "x\u0001", null, true], "b": {"c": 18446744073709551615}}"#, 100);
        assert_eq!(
            v.as_ref().ok().map(to_json),
            Some(r#"{"a":[1,-2,0.25,"x\u0001",null,true],"b":{"c":18446744073709551615}}"#.to_string())
        );
        let e = parse_json_limited("{\"a\": 1,\n \"a\": 2}", 100).err().map(|e| e.message);
        assert_eq!(e.as_deref(), Some("invalid document at line 2, column 8: `a` is given twice"));
        assert!(parse_json_limited("{} x", 100)
            .is_err_and(|e| e.message.starts_with("invalid document at line 1, column 4: trailing characters")));
        assert!(parse_json_limited("{\"a\": 1}", 3).is_err_and(|e| e.message.contains("the limit is 3")));
        assert!(parse_json_limited(&"[".repeat(100_000), 1 << 20).is_err());
    }

    #[test]
    fn numbers_without_core_float_formatting() {
        assert_eq!(parse_number("0.1"), Some(0.1));
        assert_eq!(parse_number("1.6"), Some(1.6));
        assert_eq!(parse_number("-2.5e3"), Some(-2500.0));
        assert_eq!(parse_number(".5"), Some(0.5));
        assert_eq!(parse_number("1234567890123456789.5"), None);
        assert_eq!(parse_number("1e400"), None);
        assert_eq!(format_number(50.0), "50");
        assert_eq!(format_number(0.1), "0.1");
        assert_eq!(format_number(-1.25), "-1.25");
        assert_eq!(format_number(0.333_333_3), "0.333333");
    }

    #[test]
    fn json_round_trip() {
        let v = ok(r#"{"s": "q\"\\\n", "n": -5, "f": 2.0, "l": [null, true], "m": {"k": 18446744073709551615}}"#);
        let text = to_json(&v);
        assert_eq!(ok(&text), v);
        assert!(text.contains("2.0"));
    }

    #[test]
    fn a_key_given_twice_is_one_error_with_its_place() {
        // Issue 14, item 13.
        let e = parse("policies:\n  p:\n    deadline: 1s\n    attempts: 2\n    deadline: 2s\n").err();
        assert_eq!(
            e,
            Some(LoadError::new(
                "policies.p.deadline",
                "invalid document at line 5, column 5: `deadline` is given twice (first at line 3, column 5); keep one"
            ))
        );
        let e = parse("policies:\n  p: { backoff: { base: 1s, cap: 2s, base: 3s } }\n").err().map(|e| (e.path, e.message));
        assert_eq!(
            e,
            Some((
                "policies.p.backoff.base".to_string(),
                "invalid document at line 2, column 38: `base` is given twice (first at line 2, column 19); keep one".to_string()
            ))
        );
        let e = parse("a:\n  - x: 1\n    x: 2\n").err().map(|e| e.path);
        assert_eq!(e.as_deref(), Some("a[0].x"));
        // The same key in two mappings is fine, and many keys are checked without pairs.
        assert!(parse("a: { x: 1 }\nb: { x: 1 }\n").is_ok());
        let many: String = (0..5000).map(|i| format!("k{i}: {i}\n")).collect();
        assert!(parse(&many).is_ok());
        assert!(parse(&format!("{many}k17: 0\n")).is_err_and(|e| e.path == "k17"));
    }

    #[test]
    fn suggests_the_nearest_field() {
        assert_eq!(closest("atempts", &["attempts", "deadline"]), Some("attempts"));
        assert_eq!(closest("zzzzzz", &["attempts", "deadline"]), None);
    }
}
