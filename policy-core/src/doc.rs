//! The policy document as a plain tree, parsed from YAML or JSON, a JSON writer, and a reader
//! that names the field path of every error.
//!
//! The parser reads the YAML a policy document needs, and JSON (as YAML flow syntax):
//! block mappings and sequences by indentation, flow collections `[...]` and `{...}` (which
//! may span lines), plain, single-quoted and double-quoted scalars, comments, and one
//! optional `---` marker. It refuses, with a line and column, what a policy never needs and
//! a reader could misread: anchors, aliases, tags, block scalars (`|`, `>`), several
//! documents. It is small on purpose: it keeps the component far below its size budget and
//! has no recursion deeper than [`MAX_DEPTH`].

use crate::error::LoadError;

/// Largest document accepted (bytes).
pub const MAX_DOCUMENT_BYTES: usize = 1 << 20;
/// Largest exported state accepted by `import-state` (bytes): the state of about 60,000 keys
/// with a small breaker window. It is far above [`MAX_DOCUMENT_BYTES`] because the state of
/// more than about 4,000 keys is larger than any policy document, and a host restores it after
/// a trap.
pub const MAX_STATE_BYTES: usize = 16 << 20;
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
    let mut p = Parser { chars: text.chars().collect(), pos: 0, line: 1, col: 1, path: Vec::new() };
    p.skip_document_start()?;
    let value = p.block(0, 0)?;
    p.skip_blank();
    if p.at("---") || p.at("...") {
        return Err(p.err("the YAML stream holds several documents; put every policy in one document"));
    }
    if p.peek().is_some() {
        return Err(p.err("unexpected text here (is the indentation consistent?)"));
    }
    Ok(value)
}

struct Parser {
    chars: Vec<char>,
    pos: usize,
    line: usize,
    col: usize,
    /// Keys and list positions from the root to the node being read (for error paths).
    path: Vec<String>,
}

/// The keys of one mapping as they are read, with where each starts, so that a key given
/// twice is one error at its second place (not a silent choice of one of the values).
struct Keys(Vec<(usize, usize)>);

impl Keys {
    /// Check the keys of a finished mapping (sorting, not comparing every pair: a document
    /// may hold 4096 policies).
    fn check(&self, entries: &[(String, Value)], p: &Parser) -> Result<(), LoadError> {
        let mut order: Vec<usize> = (0..entries.len()).collect();
        order.sort_by(|&a, &b| entries.get(a).map(|e| &e.0).cmp(&entries.get(b).map(|e| &e.0)).then(a.cmp(&b)));
        let mut second: Option<(usize, usize)> = None;
        for pair in order.windows(2) {
            if let [a, b] = *pair {
                if entries.get(a).map(|e| &e.0) == entries.get(b).map(|e| &e.0) && second.is_none_or(|(s, _)| b < s) {
                    second = Some((b, a));
                }
            }
        }
        let Some((dup, first)) = second else {
            return Ok(());
        };
        let key = entries.get(dup).map(|e| e.0.as_str()).unwrap_or_default();
        let (line, col) = self.0.get(dup).copied().unwrap_or((0, 0));
        let (first_line, first_col) = self.0.get(first).copied().unwrap_or((0, 0));
        let mut path = String::new();
        for part in p.path.iter().map(String::as_str).chain([key]) {
            path = if part.starts_with('[') { format!("{path}{part}") } else { join(&path, part) };
        }
        Err(LoadError::new(
            &path,
            format!(
                "invalid document at line {line}, column {col}: `{key}` is given twice (first at line {first_line}, column {first_col}); keep one"
            ),
        ))
    }
}

impl Parser {
    fn peek(&self) -> Option<char> {
        self.chars.get(self.pos).copied()
    }
    fn peek_at(&self, offset: usize) -> Option<char> {
        self.chars.get(self.pos + offset).copied()
    }
    fn at(&self, s: &str) -> bool {
        s.chars().enumerate().all(|(i, c)| self.peek_at(i) == Some(c))
    }
    fn bump(&mut self) -> Option<char> {
        let c = self.peek()?;
        self.pos += 1;
        if c == '\n' {
            self.line += 1;
            self.col = 1;
        } else {
            self.col += 1;
        }
        Some(c)
    }
    fn err(&self, message: &str) -> LoadError {
        LoadError::new("", format!("invalid document at line {}, column {}: {message}", self.line, self.col))
    }

    /// Skip spaces and tabs on the current line.
    fn skip_spaces(&mut self) {
        while matches!(self.peek(), Some(' ') | Some('\t')) {
            self.bump();
        }
    }
    /// Skip a comment to the end of the line.
    fn skip_comment(&mut self) {
        if self.peek() == Some('#') {
            while !matches!(self.peek(), None | Some('\n')) {
                self.bump();
            }
        }
    }
    /// Skip blank lines, comments and whitespace up to the next content.
    fn skip_blank(&mut self) {
        loop {
            self.skip_spaces();
            self.skip_comment();
            match self.peek() {
                Some('\n') | Some('\r') => {
                    self.bump();
                }
                _ => return,
            }
        }
    }
    fn skip_document_start(&mut self) -> Result<(), LoadError> {
        if self.peek() == Some('\u{feff}') {
            self.bump();
        }
        self.skip_blank();
        if self.at("%") {
            return Err(self.err("YAML directives are not supported"));
        }
        if self.at("---") && matches!(self.peek_at(3), None | Some(' ') | Some('\n') | Some('\r')) {
            for _ in 0..3 {
                self.bump();
            }
        }
        Ok(())
    }

    /// Column (0-based) of the next content, after blank lines; None at the end.
    fn next_indent(&mut self) -> Option<usize> {
        self.skip_blank();
        self.peek()?;
        Some(self.col - 1)
    }

    /// A block node whose lines are indented at least `min`.
    fn block(&mut self, min: usize, depth: usize) -> Result<Value, LoadError> {
        if depth > MAX_DEPTH {
            return Err(self.err(&format!("the document nests deeper than {MAX_DEPTH} levels")));
        }
        let Some(indent) = self.next_indent() else {
            return Ok(Value::Null);
        };
        if indent < min {
            return Ok(Value::Null);
        }
        if self.is_sequence_entry() {
            return self.sequence(indent, depth);
        }
        if self.starts_mapping_entry()? {
            return self.mapping(indent, depth);
        }
        let v = self.inline(depth)?;
        self.end_of_line()?;
        Ok(v)
    }

    fn is_sequence_entry(&self) -> bool {
        self.peek() == Some('-') && matches!(self.peek_at(1), None | Some(' ') | Some('\n') | Some('\r') | Some('\t'))
    }

    /// Whether the line from here reads `key: ...` (outside quotes and brackets).
    fn starts_mapping_entry(&self) -> Result<bool, LoadError> {
        let mut i = self.pos;
        let first = self.chars.get(i).copied();
        if matches!(first, Some('[') | Some('{')) {
            return Ok(false);
        }
        if let Some(q @ ('"' | '\'')) = first {
            // A quoted key is a key only when `:` follows the closing quote.
            i += 1;
            while let Some(c) = self.chars.get(i).copied() {
                i += 1;
                if c == q {
                    if q == '\'' && self.chars.get(i) == Some(&'\'') {
                        i += 1;
                        continue;
                    }
                    break;
                }
                if c == '\\' && q == '"' {
                    i += 1;
                }
                if c == '\n' {
                    return Ok(false);
                }
            }
            while self.chars.get(i) == Some(&' ') {
                i += 1;
            }
            return Ok(self.chars.get(i) == Some(&':'));
        }
        while let Some(c) = self.chars.get(i).copied() {
            match c {
                '\n' | '\r' => return Ok(false),
                '#' if i > self.pos && matches!(self.chars.get(i - 1), Some(' ') | Some('\t')) => return Ok(false),
                ':' if matches!(self.chars.get(i + 1).copied(), None | Some(' ') | Some('\n') | Some('\r') | Some('\t')) => {
                    return Ok(true)
                }
                _ => i += 1,
            }
        }
        Ok(false)
    }

    fn end_of_line(&mut self) -> Result<(), LoadError> {
        self.skip_spaces();
        self.skip_comment();
        match self.peek() {
            None | Some('\n') | Some('\r') => Ok(()),
            Some(_) => Err(self.err("unexpected text after the value")),
        }
    }

    fn mapping(&mut self, indent: usize, depth: usize) -> Result<Value, LoadError> {
        let mut entries: Vec<(String, Value)> = Vec::new();
        let mut keys = Keys(Vec::new());
        loop {
            keys.0.push((self.line, self.col));
            let key = self.key()?;
            self.path.push(key.clone());
            self.skip_spaces();
            if self.bump() != Some(':') {
                return Err(self.err("expected `:` after the key"));
            }
            self.skip_spaces();
            self.skip_comment();
            let value = if matches!(self.peek(), None | Some('\n') | Some('\r')) {
                // The value is on the following lines: deeper, or a sequence at this indent.
                match self.next_indent() {
                    Some(i) if i > indent => self.block(i, depth + 1)?,
                    Some(i) if i == indent && self.is_sequence_entry() => self.sequence(i, depth + 1)?,
                    _ => Value::Null,
                }
            } else {
                let v = self.inline(depth + 1)?;
                self.end_of_line()?;
                v
            };
            self.path.pop();
            entries.push((key, value));
            match self.next_indent() {
                Some(i) if i == indent && !self.is_sequence_entry() => continue,
                Some(i) if i > indent => return Err(self.err("this line is indented more than the mapping it belongs to")),
                _ => {
                    keys.check(&entries, self)?;
                    return Ok(Value::Map(entries));
                }
            }
        }
    }

    fn key(&mut self) -> Result<String, LoadError> {
        match self.peek() {
            Some('"') | Some('\'') => self.quoted(),
            _ => {
                let mut key = String::new();
                while let Some(c) = self.peek() {
                    if c == ':' && matches!(self.peek_at(1), None | Some(' ') | Some('\n') | Some('\r') | Some('\t')) {
                        break;
                    }
                    if c == '\n' {
                        break;
                    }
                    key.push(c);
                    self.bump();
                }
                let key = key.trim_end().to_string();
                if key.starts_with(['&', '*', '!', '?']) {
                    return Err(self.err("anchors, aliases, tags and complex keys are not supported"));
                }
                Ok(key)
            }
        }
    }

    fn sequence(&mut self, indent: usize, depth: usize) -> Result<Value, LoadError> {
        let mut items = Vec::new();
        loop {
            self.path.push(format!("[{}]", items.len()));
            self.bump(); // '-'
            self.skip_spaces();
            self.skip_comment();
            let item = if matches!(self.peek(), None | Some('\n') | Some('\r')) {
                match self.next_indent() {
                    Some(i) if i > indent => self.block(i, depth + 1)?,
                    _ => Value::Null,
                }
            } else {
                // `- key: value` opens a mapping indented at the item's text.
                let item_indent = self.col - 1;
                if self.is_sequence_entry() {
                    self.sequence(item_indent, depth + 1)?
                } else if self.starts_mapping_entry()? {
                    self.mapping(item_indent, depth + 1)?
                } else {
                    let v = self.inline(depth + 1)?;
                    self.end_of_line()?;
                    v
                }
            };
            self.path.pop();
            items.push(item);
            match self.next_indent() {
                Some(i) if i == indent && self.is_sequence_entry() => continue,
                Some(i) if i > indent => return Err(self.err("this line is indented more than the list it belongs to")),
                _ => return Ok(Value::List(items)),
            }
        }
    }

    /// A value on one line (or a flow collection spanning lines).
    fn inline(&mut self, depth: usize) -> Result<Value, LoadError> {
        match self.peek() {
            Some('[') | Some('{') => self.flow(depth),
            Some('"') | Some('\'') => self.quoted().map(Value::Str),
            Some('&') | Some('*') | Some('!') => Err(self.err("anchors, aliases and tags are not supported")),
            Some('|') | Some('>') => Err(self.err("block scalars (| and >) are not supported")),
            _ => {
                let mut text = String::new();
                while let Some(c) = self.peek() {
                    if c == '\n' || c == '\r' || (c == '#' && text.ends_with([' ', '\t'])) {
                        break;
                    }
                    if c == ':' && matches!(self.peek_at(1), None | Some(' ') | Some('\n')) {
                        return Err(self.err("a mapping cannot start here (use a new line, or quote the text)"));
                    }
                    text.push(c);
                    self.bump();
                }
                Ok(plain(text.trim()))
            }
        }
    }

    fn skip_flow_blank(&mut self) {
        loop {
            match self.peek() {
                Some(' ') | Some('\t') | Some('\n') | Some('\r') => {
                    self.bump();
                }
                Some('#') => self.skip_comment(),
                _ => return,
            }
        }
    }

    fn flow(&mut self, depth: usize) -> Result<Value, LoadError> {
        if depth > MAX_DEPTH {
            return Err(self.err(&format!("the document nests deeper than {MAX_DEPTH} levels")));
        }
        let open = self.bump();
        let close = if open == Some('[') { ']' } else { '}' };
        let mut items = Vec::new();
        let mut entries: Vec<(String, Value)> = Vec::new();
        let mut keys = Keys(Vec::new());
        loop {
            self.skip_flow_blank();
            if self.peek() == Some(close) {
                self.bump();
                break;
            }
            if close == ']' {
                self.path.push(format!("[{}]", items.len()));
                items.push(self.flow_value(depth)?);
                self.path.pop();
            } else {
                keys.0.push((self.line, self.col));
                let key = match self.flow_value(depth)? {
                    Value::Str(s) => s,
                    Value::Int(i) => i.to_string(),
                    Value::Bool(b) => b.to_string(),
                    Value::Null => String::new(),
                    _ => return Err(self.err("mapping keys must be plain scalars")),
                };
                self.skip_flow_blank();
                self.path.push(key.clone());
                let value = if self.peek() == Some(':') {
                    self.bump();
                    self.skip_flow_blank();
                    if matches!(self.peek(), Some(',') | Some('}')) {
                        Value::Null
                    } else {
                        self.flow_value(depth)?
                    }
                } else {
                    Value::Null
                };
                self.path.pop();
                entries.push((key, value));
            }
            self.skip_flow_blank();
            match self.bump() {
                Some(',') => continue,
                Some(c) if c == close => break,
                None => return Err(self.err(&format!("the document ends before `{close}`"))),
                Some(c) => return Err(self.err(&format!("expected `,` or `{close}`, found `{c}`"))),
            }
        }
        if close == ']' {
            return Ok(Value::List(items));
        }
        keys.check(&entries, self)?;
        Ok(Value::Map(entries))
    }

    fn flow_value(&mut self, depth: usize) -> Result<Value, LoadError> {
        match self.peek() {
            Some('[') | Some('{') => self.flow(depth + 1),
            Some('"') | Some('\'') => self.quoted().map(Value::Str),
            None => Err(self.err("the document ends inside a collection")),
            Some('&') | Some('*') | Some('!') => Err(self.err("anchors, aliases and tags are not supported")),
            _ => {
                let mut text = String::new();
                while let Some(c) = self.peek() {
                    let ends_key = c == ':' && matches!(self.peek_at(1), None | Some(' ') | Some('\n') | Some(',') | Some(']') | Some('}'));
                    if matches!(c, ',' | ']' | '}' | '[' | '{' | '\n' | '\r') || ends_key || (c == '#' && text.ends_with(' ')) {
                        break;
                    }
                    text.push(c);
                    self.bump();
                }
                if text.trim().is_empty() {
                    return Err(self.err("expected a value"));
                }
                Ok(plain(text.trim()))
            }
        }
    }

    fn quoted(&mut self) -> Result<String, LoadError> {
        let q = self.bump();
        let mut out = String::new();
        loop {
            match self.bump() {
                None => return Err(self.err("the document ends inside a quoted string")),
                Some('\'') if q == Some('\'') => {
                    if self.peek() == Some('\'') {
                        self.bump();
                        out.push('\'');
                    } else {
                        return Ok(out);
                    }
                }
                Some('"') if q == Some('"') => return Ok(out),
                Some('\\') if q == Some('"') => {
                    let c = self.bump().ok_or_else(|| self.err("the document ends inside an escape"))?;
                    match c {
                        'n' => out.push('\n'),
                        't' => out.push('\t'),
                        'r' => out.push('\r'),
                        '0' => out.push('\0'),
                        'b' => out.push('\u{8}'),
                        'f' => out.push('\u{c}'),
                        '/' | '\\' | '"' | '\'' | ' ' => out.push(c),
                        'u' => {
                            let mut code = 0u32;
                            for _ in 0..4 {
                                let d = self.bump().and_then(|d| d.to_digit(16)).ok_or_else(|| self.err("\\u needs four hex digits"))?;
                                code = code * 16 + d;
                            }
                            out.push(char::from_u32(code).unwrap_or('\u{fffd}'));
                        }
                        other => return Err(self.err(&format!("unknown escape `\\{other}`"))),
                    }
                }
                Some(c) => out.push(c),
            }
        }
    }
}

/// Resolve a plain scalar (YAML 1.2 core schema).
fn plain(text: &str) -> Value {
    match text {
        "" | "~" | "null" | "Null" | "NULL" => return Value::Null,
        "true" | "True" | "TRUE" => return Value::Bool(true),
        "false" | "False" | "FALSE" => return Value::Bool(false),
        ".inf" | "+.inf" | ".Inf" | "+.Inf" => return Value::Float(f64::INFINITY),
        "-.inf" | "-.Inf" => return Value::Float(f64::NEG_INFINITY),
        ".nan" | ".NaN" => return Value::Float(f64::NAN),
        _ => {}
    }
    let digits = text.strip_prefix(['-', '+']).unwrap_or(text);
    if !digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit()) {
        if let Ok(i) = text.parse::<i128>() {
            return Value::Int(i);
        }
    }
    if let Some(hex) = text.strip_prefix("0x") {
        if let Ok(i) = i128::from_str_radix(hex, 16) {
            return Value::Int(i);
        }
    }
    let numeric = !digits.is_empty()
        && digits.bytes().all(|b| b.is_ascii_digit() || matches!(b, b'.' | b'e' | b'E' | b'-' | b'+'))
        && digits.bytes().any(|b| b.is_ascii_digit())
        && digits.as_bytes().first().is_some_and(|b| b.is_ascii_digit() || *b == b'.');
    if numeric {
        if let Some(x) = parse_number(text) {
            return Value::Float(x);
        }
    }
    Value::Str(text.to_string())
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
    let digits = digits.trim_start_matches('0');
    if !digits.bytes().all(|b| b.is_ascii_digit()) || !int_part.bytes().chain(frac_part.bytes()).all(|b| b.is_ascii_digit()) {
        return None;
    }
    if digits.len() > 15 {
        return None;
    }
    let mantissa = if digits.is_empty() { 0 } else { digits.parse::<u64>().ok()? };
    let power = exponent.checked_sub(i32::try_from(frac_part.len()).ok()?)?;
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
        assert_eq!(plain("250ms"), Value::Str("250ms".into()));
        assert_eq!(plain("-3"), Value::Int(-3));
        assert_eq!(plain("1.5"), Value::Float(1.5));
        assert_eq!(plain("1e3"), Value::Float(1000.0));
        assert_eq!(plain("http:503"), Value::Str("http:503".into()));
        assert_eq!(plain("18446744073709551615").as_u64(), Some(u64::MAX));
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
            "a: |\n  text\n",
            "a: b: c\n",
            "a:\n  b: 1\n   c: 2\n",
            "\"unterminated",
        ] {
            assert!(parse(bad).is_err(), "{bad:?}");
        }
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
