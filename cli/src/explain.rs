//! `levee explain`: replay a trace of (time, outcome) through the engine and print every
//! decision with its reason. The trace format is documented in `docs/cli.md`.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap, VecDeque};

use serde_json::Value;

use crate::engine::core::{OutcomeKind, Verdict, VerdictKind};
use crate::engine::{self, describe, describe_event, event_json, human, reason_text, verdict_json, Engine};
use crate::term::Style;

/// One line of a trace.
#[derive(Clone, Debug, PartialEq)]
pub struct Line {
    /// Line number in the file (1-based).
    pub number: usize,
    /// Call id (default 1).
    pub call: u64,
    /// When the attempt starts (ns from the trace origin); `None`: as soon as the engine allows.
    pub at: Option<u64>,
    /// What to do.
    pub what: What,
}

/// What a line reports.
#[derive(Clone, Debug, PartialEq)]
pub enum What {
    /// An attempt's outcome.
    Outcome { kind: OutcomeKind, code: i32, text: String, elapsed: Option<u64>, wall_secs: u64, overloaded: bool, key: String, flags: u32 },
    /// The fallback chosen last succeeded (`true`) or failed.
    Fallback(bool),
}

const METHODS: [&str; 10] = ["", "GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "TRACE", "CONNECT"];

fn duration_field(obj: &serde_json::Map<String, Value>, field: &str) -> Result<Option<u64>, String> {
    match obj.get(field) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Number(n)) => {
            n.as_u64().map(Some).ok_or_else(|| format!("`{field}` must be a duration such as \"250ms\" or whole nanoseconds"))
        }
        Some(Value::String(s)) => engine::parse_duration(s).map(Some).map_err(|e| format!("`{field}`: {e}")),
        Some(_) => Err(format!("`{field}` must be a duration such as \"250ms\" or whole nanoseconds")),
    }
}

/// Parse an outcome such as `success`, `timeout`, `connection-error`, `http:503`, `grpc:14`,
/// `error:IOError`.
pub fn parse_outcome(text: &str) -> Result<(OutcomeKind, i32, String), String> {
    let t = text.trim();
    let (head, tail) = t.split_once(':').map(|(h, r)| (h, Some(r))).unwrap_or((t, None));
    let code = |r: Option<&str>| -> Result<i32, String> {
        r.and_then(|c| c.trim().parse::<i32>().ok()).ok_or_else(|| format!("`{t}` needs a number after `:` (such as \"http:503\")"))
    };
    match (head, tail) {
        ("success" | "ok", None) => Ok((OutcomeKind::Success, 0, String::new())),
        ("timeout", None) => Ok((OutcomeKind::Timeout, 0, String::new())),
        ("connection-error", None) => Ok((OutcomeKind::ConnectionError, 0, String::new())),
        ("http", r) => Ok((OutcomeKind::HttpStatus, code(r)?, String::new())),
        ("grpc", r) => Ok((OutcomeKind::GrpcStatus, code(r)?, String::new())),
        ("error", Some(class)) if !class.trim().is_empty() => Ok((OutcomeKind::ErrorClass, 0, class.trim().to_string())),
        _ => Err(format!("unknown outcome `{t}`: use success, timeout, connection-error, http:STATUS, grpc:CODE or error:CLASS")),
    }
}

/// Parse a trace (JSON lines; `#` comments and blank lines are ignored).
pub fn parse_trace(text: &str) -> Result<Vec<Line>, String> {
    let mut out = Vec::new();
    for (i, raw) in text.lines().enumerate() {
        let number = i + 1;
        let s = raw.trim();
        if s.is_empty() || s.starts_with('#') {
            continue;
        }
        let err = |m: String| format!("trace line {number}: {m}");
        let v: Value = serde_json::from_str(s).map_err(|e| err(format!("not JSON: {e}")))?;
        let Value::Object(obj) = v else { return Err(err("must be a JSON object".into())) };
        const KNOWN: [&str; 11] =
            ["at", "call", "outcome", "retry_after", "elapsed", "wall_secs", "overloaded", "key", "method", "idempotency_key", "fallback"];
        if let Some(k) = obj.keys().find(|k| !KNOWN.contains(&k.as_str())) {
            return Err(err(format!("unknown field `{k}` (known: {})", KNOWN.join(", "))));
        }
        let call = match obj.get("call") {
            None => 1,
            Some(v) => v.as_u64().filter(|c| *c > 0).ok_or_else(|| err("`call` must be a whole number above 0".into()))?,
        };
        let at = duration_field(&obj, "at").map_err(err)?;
        let what = match (obj.get("outcome"), obj.get("fallback")) {
            (Some(_), Some(_)) => return Err(err("a line has `outcome` or `fallback`, not both".into())),
            (None, Some(f)) => match f.as_str() {
                Some("ok") => What::Fallback(true),
                Some("failed") => What::Fallback(false),
                _ => return Err(err("`fallback` must be \"ok\" or \"failed\"".into())),
            },
            (None, None) => return Err(err("needs `outcome` (or `fallback`)".into())),
            (Some(o), None) => {
                let o = o.as_str().ok_or_else(|| err("`outcome` must be a string such as \"http:503\"".into()))?;
                let (kind, code, mut text) = parse_outcome(o).map_err(err)?;
                if let Some(ra) = obj.get("retry_after") {
                    let ra = match ra {
                        Value::String(s) => s.clone(),
                        Value::Number(n) => n.to_string(),
                        _ => return Err(err("`retry_after` must be the raw header text, such as \"2\"".into())),
                    };
                    if !matches!(kind, OutcomeKind::HttpStatus | OutcomeKind::GrpcStatus) {
                        return Err(err("`retry_after` applies only to http:STATUS and grpc:CODE outcomes".into()));
                    }
                    text = ra;
                }
                let method = match obj.get("method") {
                    None => 0u32,
                    Some(m) => {
                        let m = m.as_str().unwrap_or("").to_ascii_uppercase();
                        match METHODS.iter().position(|x| !x.is_empty() && *x == m) {
                            Some(p) => p as u32,
                            None if !m.is_empty() => 15,
                            None => return Err(err("`method` must be a string such as \"POST\"".into())),
                        }
                    }
                };
                let idem = obj.get("idempotency_key").and_then(Value::as_bool).unwrap_or(false);
                What::Outcome {
                    kind,
                    code,
                    text,
                    elapsed: duration_field(&obj, "elapsed").map_err(err)?,
                    wall_secs: obj.get("wall_secs").and_then(Value::as_u64).unwrap_or(0),
                    overloaded: obj.get("overloaded").and_then(Value::as_bool).unwrap_or(false),
                    key: obj.get("key").and_then(Value::as_str).unwrap_or("").to_string(),
                    flags: (method << 8) | if idem { 2 } else { 0 },
                }
            }
        };
        out.push(Line { number, call, at, what });
    }
    Ok(out)
}

#[derive(Clone, Copy, Debug)]
enum CallState {
    /// The call waits to acquire its next attempt, no earlier than `earliest`.
    Acquire { earliest: u64 },
    /// The engine chose a fallback.
    Fallback,
}

/// A step of the replay, due at a time: the trace's lines are replayed in the order their
/// steps happen (by time, then by line), not in file order, so that overlapping calls see
/// the engine's state as it was at their own times.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Step {
    /// Start the line: acquire its attempt (or report its fallback's result).
    Begin,
    /// Acquire again after a `wait` verdict.
    Acquire,
    /// Report the line's outcome; its attempt ran under `timeout`.
    Report { timeout: u64 },
}

/// Replays a trace and prints (text or JSON lines).
struct Replay<'a> {
    eng: Engine,
    policy: u32,
    fallbacks: Vec<String>,
    json: bool,
    style: Style,
    calls: BTreeMap<u64, CallState>,
    clock: u64,
    out: &'a mut Vec<String>,
    lines: &'a [Line],
    /// Per call id, the positions of its lines not yet finished, in file order.
    pending: BTreeMap<u64, VecDeque<usize>>,
    /// Steps due: (time, line position, step).
    due: BinaryHeap<Reverse<(u64, usize, Step)>>,
    /// A call's first line without `at` starts when the line before it in the file has been
    /// replayed (the latest time seen then): previous line's position -> its position.
    after: BTreeMap<usize, usize>,
}

fn outcome_text(kind: OutcomeKind, code: i32, text: &str) -> String {
    let base = match kind {
        OutcomeKind::HttpStatus => format!("http {code}"),
        OutcomeKind::GrpcStatus => format!("grpc {code}"),
        OutcomeKind::ErrorClass => format!("error {text}"),
        k => k.name().to_string(),
    };
    match kind {
        OutcomeKind::HttpStatus if !text.is_empty() => format!("{base} (Retry-After: {text})"),
        OutcomeKind::GrpcStatus if !text.is_empty() => format!("{base} (pushback {text}ms)"),
        _ => base,
    }
}

impl Replay<'_> {
    /// Whether the trace's next line for `call` says how its fallback went.
    fn fallback_line_follows(&self, call: u64) -> bool {
        self.pending.get(&call).and_then(|q| q.get(1)).and_then(|p| self.lines.get(*p)).is_some_and(|l| matches!(l.what, What::Fallback(_)))
    }

    fn schedule(&mut self, at: u64, pos: usize, step: Step) {
        // Never before what has been replayed: time does not go back.
        self.due.push(Reverse((at.max(self.clock), pos, step)));
    }

    /// The line at `pos` is replayed: schedule the next line of its call, and a new call's
    /// first line that waited for it.
    fn finish(&mut self, pos: usize) {
        let Some(call) = self.lines.get(pos).map(|l| l.call) else { return };
        let next = self.pending.get_mut(&call).and_then(|q| {
            q.pop_front();
            q.front().copied()
        });
        if let Some(n) = next {
            let at = match (self.lines.get(n).and_then(|l| l.at), self.calls.get(&call)) {
                (Some(at), _) => at,
                (None, Some(CallState::Acquire { earliest })) => *earliest,
                (None, _) => self.clock,
            };
            self.schedule(at, n, Step::Begin);
        }
        if let Some(n) = self.after.remove(&pos) {
            self.schedule(self.clock, n, Step::Begin);
        }
    }

    fn not_run(&mut self, line: &Line, input: &str) {
        let c = line.call;
        let msg = format!("line {}: `{input}` not run: the engine refused the attempt", line.number);
        if self.json {
            self.out.push(serde_json::json!({"line": line.number, "call": c, "op": "skip", "input": input, "note": msg}).to_string());
        } else {
            self.out.push(format!("{:>10}  {}", "", self.style.dim(&format!("({msg})"))));
        }
    }

    /// Run every step in time order.
    fn run(&mut self) -> Result<(), String> {
        let lines = self.lines;
        let mut previous: Option<usize> = None;
        for (pos, l) in lines.iter().enumerate() {
            let q = self.pending.entry(l.call).or_default();
            q.push_back(pos);
            if q.len() == 1 {
                match (l.at, previous) {
                    (None, Some(p)) => {
                        self.after.insert(p, pos);
                    }
                    (at, _) => self.schedule(at.unwrap_or(0), pos, Step::Begin),
                }
            }
            previous = Some(pos);
        }
        while let Some(Reverse((at, pos, step))) = self.due.pop() {
            let Some(line) = lines.get(pos) else { continue };
            self.clock = self.clock.max(at);
            self.step(line, pos, at, step)?;
        }
        Ok(())
    }

    /// The engine chose a fallback: wait for the trace's `fallback` line, or assume it worked.
    fn on_fallback(&mut self, line: usize, call: u64, now: u64) {
        if self.fallback_line_follows(call) {
            self.calls.insert(call, CallState::Fallback);
            return;
        }
        let v = self.eng.report_fallback(call, now, true);
        self.emit(line, now, call, "report_fallback", "ok", v, "assumed: no {\"fallback\": ...} line follows for this call");
        if v.kind() == Some(VerdictKind::Fallback) {
            self.on_fallback(line, call, now);
        } else {
            self.calls.remove(&call);
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn emit(&mut self, line: usize, at: u64, call: u64, op: &str, input: &str, v: Verdict, note: &str) {
        let events = self.eng.drain_events();
        let decision = describe(v, &self.fallbacks);
        let why = match v.kind() {
            Some(VerdictKind::Fail) | Some(VerdictKind::Fallback) | Some(VerdictKind::Wait) => reason_text(v.reason()).to_string(),
            Some(VerdictKind::Retry) => "the outcome is retryable and the policy allows another attempt".to_string(),
            Some(VerdictKind::Done) if op == "report_fallback" => "the fallback succeeded".to_string(),
            Some(VerdictKind::Done) => "the attempt succeeded".to_string(),
            Some(VerdictKind::Attempt) => "the breaker, limits and deadline allow it".to_string(),
            _ => String::new(),
        };
        if self.json {
            let reason = match v.kind() {
                Some(VerdictKind::Wait | VerdictKind::Retry | VerdictKind::Fallback | VerdictKind::Fail) => v.reason().name(),
                _ => "none",
            };
            let evs: Vec<Value> = events.iter().map(event_json).collect();
            let mut o = serde_json::json!({
                "line": line, "at": at, "call": call, "op": op, "input": input,
                "verdict": verdict_json(v), "decision": decision, "reason": reason, "why": why, "events": evs,
            });
            if !note.is_empty() {
                if let Some(m) = o.as_object_mut() {
                    m.insert("note".into(), Value::String(note.to_string()));
                }
            }
            self.out.push(o.to_string());
            return;
        }
        let s = self.style;
        let painted = match v.kind() {
            Some(VerdictKind::Done) => s.green(&decision),
            Some(VerdictKind::Fail) | Some(VerdictKind::Invalid) => s.red(&decision),
            Some(VerdictKind::Retry) | Some(VerdictKind::Wait) | Some(VerdictKind::Fallback) => s.yellow(&decision),
            _ => decision.clone(),
        };
        let what = if input.is_empty() { op.to_string() } else { format!("{op} {input}") };
        let why = if why.is_empty() { String::new() } else { s.dim(&format!("  ({why})")) };
        self.out.push(format!("{:>10}  call {call:<3} {what:<34} -> {painted}{why}", format!("t={}", human(at))));
        if !note.is_empty() {
            self.out.push(format!("{:>10}  {}", "", s.yellow(&format!("note: {note}"))));
        }
        for e in &events {
            self.out.push(format!("{:>10}  {}", "", s.dim(&format!("event: {}", describe_event(e)))));
        }
    }

    /// One step of a line, at `now`.
    fn step(&mut self, line: &Line, pos: usize, now: u64, step: Step) -> Result<(), String> {
        let c = line.call;
        let (kind, code, text, elapsed, wall_secs, overloaded, key, flags) = match &line.what {
            What::Fallback(ok) => {
                if !matches!(self.calls.get(&c), Some(CallState::Fallback)) {
                    return Err(format!("trace line {}: call {c} has no fallback pending", line.number));
                }
                let v = self.eng.report_fallback(c, now, *ok);
                self.emit(line.number, now, c, "report_fallback", if *ok { "ok" } else { "failed" }, v, "");
                match v.kind() {
                    Some(VerdictKind::Fallback) => self.on_fallback(line.number, c, now),
                    _ => {
                        self.calls.remove(&c);
                    }
                }
                self.finish(pos);
                return Ok(());
            }
            What::Outcome { kind, code, text, elapsed, wall_secs, overloaded, key, flags } => {
                (*kind, *code, text, *elapsed, *wall_secs, *overloaded, key, *flags)
            }
        };
        let input = outcome_text(kind, code, text);
        let (v, op, note) = match step {
            Step::Report { timeout } => {
                let took = elapsed.unwrap_or(if kind == OutcomeKind::Timeout { timeout } else { 0 });
                let v = self.eng.report(c, now, took, kind, code, text, wall_secs, u32::from(overloaded));
                let note = if timeout > 0 && took > timeout && kind != OutcomeKind::Timeout {
                    format!("the attempt took {} but its timeout was {}: a host would have reported a timeout", human(took), human(timeout))
                } else {
                    String::new()
                };
                self.emit(line.number, now, c, "report", &input, v, &note);
                match v.kind() {
                    Some(VerdictKind::Retry) => {
                        self.calls.insert(c, CallState::Acquire { earliest: now.saturating_add(v.payload()) });
                    }
                    Some(VerdictKind::Fallback) => self.on_fallback(line.number, c, now),
                    _ => {
                        self.calls.remove(&c);
                    }
                }
                self.finish(pos);
                return Ok(());
            }
            Step::Begin => match self.calls.get(&c).copied() {
                None => (self.eng.start(c, self.policy, key, flags, now, 0, 0, 0), "start", String::new()),
                Some(CallState::Acquire { earliest }) => {
                    let asked = line.at.unwrap_or(earliest);
                    let note = if asked < earliest {
                        format!("the trace retries at {}, before the delay ends at {}", human(asked), human(earliest))
                    } else {
                        String::new()
                    };
                    (self.eng.acquire(c, now), "acquire", note)
                }
                Some(CallState::Fallback) => {
                    return Err(format!(
                        "trace line {}: call {c} waits for its fallback's result: give a {{\"fallback\": \"ok\"}} line first",
                        line.number
                    ));
                }
            },
            Step::Acquire => (self.eng.acquire(c, now), "acquire", String::new()),
        };
        self.emit(line.number, now, c, op, "", v, &note);
        match v.kind() {
            Some(VerdictKind::Attempt) => {
                let timeout = v.payload();
                let took = elapsed.unwrap_or(if kind == OutcomeKind::Timeout { timeout } else { 0 });
                self.schedule(now.saturating_add(took), pos, Step::Report { timeout });
                return Ok(());
            }
            Some(VerdictKind::Wait) => {
                self.schedule(now.saturating_add(v.payload()), pos, Step::Acquire);
                return Ok(());
            }
            Some(VerdictKind::Fallback) => self.on_fallback(line.number, c, now),
            _ => {
                self.calls.remove(&c);
            }
        }
        self.not_run(line, &input);
        self.finish(pos);
        Ok(())
    }
}

/// Replay `trace` under policy `policy` of `document`; returns the printed lines.
pub fn replay(document: &str, policy: Option<&str>, seed: u64, trace: &[Line], json: bool, style: Style) -> Result<Vec<String>, String> {
    let eng = engine::load(document, seed).map_err(|errs| {
        let list: Vec<String> = errs.iter().map(|e| format!("  {e}")).collect();
        format!("the policy document is invalid (run `levee check`):\n{}", list.join("\n"))
    })?;
    let mut out = Vec::new();
    let mut r = Replay {
        eng,
        policy: 0,
        fallbacks: Vec::new(),
        json,
        style,
        calls: BTreeMap::new(),
        clock: 0,
        out: &mut out,
        lines: trace,
        pending: BTreeMap::new(),
        due: BinaryHeap::new(),
        after: BTreeMap::new(),
    };
    r.policy = match policy {
        Some(name) => engine::policy_named(&mut r.eng, name)?,
        None => 0,
    };
    let info = r.eng.policy_info(r.policy).ok_or_else(|| "the document has no policy".to_string())?;
    r.fallbacks = info.fallbacks.clone();
    if !json {
        r.out.push(style.bold(&format!(
            "policy `{}`: {} attempts, timeout {}, deadline {} (seed {seed})",
            info.name,
            info.max_attempts,
            if info.attempt_timeout == 0 { "none".into() } else { human(info.attempt_timeout) },
            if info.deadline == 0 { "none".into() } else { human(info.deadline) },
        )));
    }
    r.run()?;
    let left: Vec<(u64, CallState)> = r.calls.iter().map(|(k, v)| (*k, *v)).collect();
    for (c, st) in left {
        let msg = match st {
            CallState::Acquire { earliest } => format!("call {c} is still waiting to retry at {} (the trace ended)", human(earliest)),
            CallState::Fallback => format!("call {c} is waiting for its fallback's result (the trace ended)"),
        };
        if json {
            r.out.push(serde_json::json!({"call": c, "op": "end", "note": msg}).to_string());
        } else {
            r.out.push(style.dim(&format!("{:>10}  {msg}", "")));
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn outcomes_parse() {
        assert_eq!(parse_outcome("http:503"), Ok((OutcomeKind::HttpStatus, 503, String::new())));
        assert_eq!(parse_outcome("error:IOError"), Ok((OutcomeKind::ErrorClass, 0, "IOError".into())));
        assert!(parse_outcome("http").is_err());
        assert!(parse_outcome("boom").is_err());
    }

    #[test]
    fn trace_lines_parse_and_reject_unknown_fields() {
        let t = "# c\n{\"at\":\"1s\",\"outcome\":\"http:429\",\"retry_after\":2}\n\n{\"fallback\":\"ok\",\"call\":2}\n";
        let lines = parse_trace(t).unwrap_or_default();
        assert_eq!(lines.len(), 2);
        assert_eq!(lines.first().map(|l| l.at), Some(Some(1_000_000_000)));
        assert!(parse_trace("{\"outcome\":\"ok\",\"bogus\":1}").is_err());
        assert!(parse_trace("{\"at\":\"5\",\"outcome\":\"ok\"}").is_err());
    }
}
