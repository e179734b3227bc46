//! Levee conformance: replay the vectors of `conformance/vectors` against any [`Target`]:
//! the native `levee-core` engine and the component running in wasmtime.
//!
//! Every result is turned into the JSON form of `conformance/README.md` and compared with the
//! vector's expectation, field by field.
#![allow(clippy::too_many_arguments)]

pub mod component;

use std::path::{Path, PathBuf};

use levee_core::durable_exec::{self as dx, Claimed, Command, Finished, RowWrite, Written};
use levee_core::{Analysis, BreakerState, CallInfo, Event, HedgeCommand, OutcomeKind, PolicyInfo, Verdict, VerdictKind};
use serde_json::{json, Map, Value};

/// An error from `load` or `reload`: (path, message).
pub type Errors = Vec<(String, String)>;

/// Something that runs the step protocol: the native engine or a component instance.
pub trait Target: Sized {
    /// Load a document.
    fn load(doc: &str, seed: u64) -> Result<Self, Errors>;
    /// `policy-index`.
    fn policy_index(&mut self, name: &str) -> Option<u32>;
    /// `start`.
    fn start(&mut self, call: u64, policy: u32, key: &str, flags: u32, now: u64, sc: u64, sa: u64, se: u64) -> u64;
    /// `acquire`.
    fn acquire(&mut self, call: u64, now: u64) -> u64;
    /// `report`.
    fn report(&mut self, call: u64, now: u64, elapsed: u64, kind: OutcomeKind, code: i32, text: &str, wall: u64, flags: u32) -> u64;
    /// `report-fallback`.
    fn report_fallback(&mut self, call: u64, now: u64, ok: bool) -> u64;
    /// `hedge-step`: the commands and whether events are pending.
    fn hedge_step(&mut self, call: u64, now: u64) -> (Vec<HedgeCommand>, bool);
    /// `report-attempt`: the commands and whether events are pending.
    fn report_attempt(
        &mut self,
        call: u64,
        attempt: u32,
        now: u64,
        elapsed: u64,
        kind: OutcomeKind,
        code: i32,
        text: &str,
        wall: u64,
        flags: u32,
    ) -> (Vec<HedgeCommand>, bool);
    /// `cancel`.
    fn cancel(&mut self, call: u64, now: u64);
    /// `take-wakes`.
    fn take_wakes(&mut self) -> Vec<u64>;
    /// `drain-events`.
    fn drain_events(&mut self) -> Vec<Event>;
    /// `breaker-state`.
    fn breaker_state(&mut self, policy: u32, key: &str, now: u64) -> Option<BreakerState>;
    /// `set-breaker-state`.
    fn set_breaker_state(&mut self, policy: u32, key: &str, state: BreakerState, now: u64) -> Result<(), String>;
    /// `call-info`.
    fn call_info(&mut self, call: u64) -> Option<CallInfo>;
    /// `policy-info`.
    fn policy_info(&mut self, policy: u32) -> Option<PolicyInfo>;
    /// `analyze`.
    fn analyze(&mut self, policy: u32, layers: u32) -> Option<Analysis>;
    /// `export-state`.
    fn export_state(&mut self) -> Vec<u8>;
    /// `export-snapshot`.
    fn export_snapshot(&mut self) -> Vec<u8>;
    /// `import-state`.
    fn import_state(&mut self, bytes: &[u8]) -> Result<(), (String, String)>;
    /// `reload`.
    fn reload(&mut self, doc: &str) -> Result<(), Errors>;
    /// One of the `durable-*` functions.
    fn durable(&mut self, call: &DurableCall) -> Result<DurableOut, (String, String)>;
    /// One of the `fleet-*` functions.
    fn fleet(&mut self, call: &FleetCall) -> Result<FleetOut, (String, String)>;
    /// A method of the trace's `executor` (made by [`ExecCall::New`]); `Err` for a vector that
    /// uses one before making it.
    fn exec(&mut self, call: &ExecCall) -> Result<ExecOut, String>;
}

/// The arguments of an `executor` method (the durable executor's machine, docs/durable.md).
#[derive(Clone, Debug)]
pub enum ExecCall {
    /// The constructor, then `register` of each name; replaces the trace's executor.
    New { config: dx::Config, register: Vec<String> },
    /// `feed`.
    Feed { now: u64, event: dx::Event },
    /// `forget`.
    Forget { id: i64 },
    /// `running`.
    Running,
    /// `operator`.
    Operator { id: i64, record: Vec<u8>, revive: bool, wall_now: u64 },
}

/// What an `executor` method answered.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ExecOut {
    /// The commands, in order.
    Commands(Vec<Command>),
    /// `running`.
    Running(u32),
    /// `forget` and the constructor.
    Unit,
    /// `operator`: the row to write for the call, or the core's error.
    Operator(Result<RowWrite, (String, String)>),
}

/// An executor method as the core's types say (shared by the native target).
pub fn exec_native(e: &levee_core::Engine, x: &mut Option<dx::Executor>, call: &ExecCall) -> Result<ExecOut, String> {
    if let ExecCall::New { config, register } = call {
        let mut m = dx::Executor::new(config.clone());
        register.iter().for_each(|h| m.register(h));
        *x = Some(m);
        return Ok(ExecOut::Unit);
    }
    if let ExecCall::Operator { record, revive, wall_now, .. } = call {
        let step = if *revive { e.durable_revive(record, *wall_now) } else { e.durable_cancel(record, *wall_now) };
        return Ok(ExecOut::Operator(dx::operator_write(step).map_err(|e| (e.path, e.message))));
    }
    let m = x.as_mut().ok_or("an executor step before the `executor` step")?;
    Ok(match call {
        ExecCall::New { .. } | ExecCall::Operator { .. } => ExecOut::Unit,
        ExecCall::Feed { now, event } => ExecOut::Commands(m.feed(e, *now, event.clone())),
        ExecCall::Forget { id } => {
            m.forget(*id);
            ExecOut::Unit
        }
        ExecCall::Running => ExecOut::Running(m.running().min(u32::MAX as usize) as u32),
    })
}

/// The JSON form of a row to write: `{"id", "status", "next_at", "attempts", "record_hex",
/// "lease", "keep_result", "error"}`.
pub fn row_json(id: i64, w: &RowWrite) -> Value {
    json!({"id": id, "status": w.status, "next_at": w.next_at, "attempts": w.attempts, "record_hex": hex(&w.record),
        "lease": w.lease, "keep_result": w.result, "error": w.error})
}

/// The JSON form of an executor's commands (conformance/README.md, "Executor steps").
pub fn commands_json(commands: &[Command]) -> Value {
    let level = |l: dx::Level| match l {
        dx::Level::Warn => "warn",
        dx::Level::Error => "error",
    };
    Value::Array(
        commands
            .iter()
            .map(|c| match c {
                Command::Claim { limit, hold } => json!({"claim": {"limit": limit, "hold": hold}}),
                Command::Write { id, row } => json!({"write": row_json(*id, row)}),
                Command::Run { id, attempt, timeout, renew_every } => {
                    json!({"run": {"id": id, "attempt": attempt, "timeout": timeout, "renew_every": renew_every}})
                }
                Command::Abandon { id } => json!({"abandon": id}),
                Command::Quarantine { id, error } => json!({"quarantine": {"id": id, "error": error}}),
                Command::NextDue => json!("next_due"),
                Command::Sleep { until } => json!({"sleep": until}),
                Command::Idle => json!("idle"),
                Command::Log { level: l, id, text } => json!({"log": {"level": level(*l), "id": id, "text": text}}),
            })
            .collect(),
    )
}

/// The status column's texts, for a target whose answer carries them as strings.
pub fn status_text(s: &str) -> &'static str {
    ["running", "scheduled", "done", "dead", "cancelled"].into_iter().find(|t| *t == s).unwrap_or("?")
}

/// The arguments of a `fleet-*` function (docs/fleet.md).
#[derive(Clone, Debug)]
pub enum FleetCall {
    /// `fleet-plan`.
    Plan {
        /// Policy index.
        policy: u32,
    },
    /// `fleet-merge` (`apply: false`) or `fleet-apply` (`apply: true`).
    Sync {
        /// Apply rather than merge.
        apply: bool,
        /// Policy index.
        policy: u32,
        /// Key.
        key: String,
        /// Node name.
        node: String,
        /// Host monotonic ns.
        now: u64,
        /// Store wall-clock ms.
        wall_ms: u64,
        /// Shared bytes.
        shared: Vec<u8>,
    },
    /// `fleet-inspect`.
    Inspect {
        /// Shared bytes.
        shared: Vec<u8>,
    },
}

/// What a `fleet-*` function answered.
#[derive(Clone, Debug)]
pub enum FleetOut {
    /// `fleet-plan`.
    Plan(Option<String>),
    /// `fleet-merge`'s bytes.
    Bytes(Vec<u8>),
    /// `fleet-apply`.
    Unit,
    /// `fleet-inspect`'s JSON.
    Json(String),
}

/// A fleet function as the core's types say (shared by the native target).
pub fn fleet_native(e: &mut levee_core::Engine, call: &FleetCall) -> Result<FleetOut, (String, String)> {
    let le = |e: levee_core::LoadError| (e.path, e.message);
    match call {
        FleetCall::Plan { policy } => Ok(FleetOut::Plan(e.fleet_plan(*policy))),
        FleetCall::Sync { apply: false, policy, key, node, now, wall_ms, shared } => {
            e.fleet_merge(*policy, key, node, *now, *wall_ms, shared).map(FleetOut::Bytes).map_err(le)
        }
        FleetCall::Sync { apply: true, policy, key, node, now, wall_ms, shared } => {
            e.fleet_apply(*policy, key, node, *now, *wall_ms, shared).map(|()| FleetOut::Unit).map_err(le)
        }
        FleetCall::Inspect { shared } => levee_core::Engine::fleet_inspect(shared).map(FleetOut::Json).map_err(le),
    }
}

/// The arguments of a `durable-*` function.
#[derive(Clone, Debug)]
pub enum DurableCall {
    /// `durable-begin`.
    Begin { policy: u32, key: String, idempotency_key: String, flags: u32, wall_now: u64 },
    /// `durable-step`.
    Step { record: Vec<u8>, owner: String, wall_now: u64, elapsed: u64 },
    /// `durable-renew`.
    Renew { record: Vec<u8>, owner: String, wall_now: u64, elapsed: u64 },
    /// `durable-outcome`.
    Outcome {
        record: Vec<u8>,
        owner: String,
        wall_now: u64,
        elapsed: u64,
        kind: OutcomeKind,
        code: i32,
        text: String,
        message: String,
        flags: u32,
    },
    /// `durable-cancel`.
    Cancel { record: Vec<u8>, wall_now: u64 },
    /// `durable-revive`.
    Revive { record: Vec<u8>, wall_now: u64 },
    /// `durable-inspect`.
    Inspect { record: Vec<u8> },
}

/// What a `durable-*` function answered.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DurableOut {
    /// A durable step, its enums by name.
    Step {
        action: String,
        attempt: u32,
        wait: u64,
        timeout: u64,
        next_at: u64,
        lease_until: u64,
        reason: String,
        policy_changed: bool,
        bytes: Vec<u8>,
    },
    /// `durable-inspect`'s JSON.
    Json(String),
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(text: &str) -> Vec<u8> {
    (0..text.len() / 2).filter_map(|i| text.get(2 * i..2 * i + 2).and_then(|h| u8::from_str_radix(h, 16).ok())).collect()
}

/// The durable step as the core's types say (shared by the native target).
pub fn durable_native(e: &mut levee_core::Engine, call: &DurableCall) -> Result<DurableOut, (String, String)> {
    let step = match call {
        DurableCall::Begin { policy, key, idempotency_key, flags, wall_now } => {
            e.durable_begin(*policy, key, idempotency_key, *flags, *wall_now)
        }
        DurableCall::Step { record, owner, wall_now, elapsed } => e.durable_step(record, owner, *wall_now, *elapsed),
        DurableCall::Renew { record, owner, wall_now, elapsed } => e.durable_renew(record, owner, *wall_now, *elapsed),
        DurableCall::Outcome { record, owner, wall_now, elapsed, kind, code, text, message, flags } => {
            e.durable_outcome(record, owner, *wall_now, *elapsed, *kind, *code, text, message, *flags)
        }
        DurableCall::Cancel { record, wall_now } => e.durable_cancel(record, *wall_now),
        DurableCall::Revive { record, wall_now } => e.durable_revive(record, *wall_now),
        DurableCall::Inspect { record } => {
            return levee_core::durable::inspect(record).map(DurableOut::Json).map_err(|e| (e.path, e.message))
        }
    };
    let s = step.map_err(|e| (e.path, e.message))?;
    let action = match s.action {
        levee_core::durable::Action::Run => "run",
        levee_core::durable::Action::Wait => "wait",
        levee_core::durable::Action::Done => "done",
        levee_core::durable::Action::Dead => "dead",
        levee_core::durable::Action::Cancelled => "cancelled",
    };
    Ok(DurableOut::Step {
        action: action.to_string(),
        attempt: s.attempt,
        wait: s.wait,
        timeout: s.timeout,
        next_at: s.next_at,
        lease_until: s.lease_until,
        reason: s.reason.name().to_string(),
        policy_changed: s.policy_changed,
        bytes: s.record,
    })
}

/// The native engine, and the trace's executor once made.
pub struct Native(pub levee_core::Engine, pub Option<dx::Executor>);

fn errs(v: Vec<levee_core::LoadError>) -> Errors {
    v.into_iter().map(|e| (e.path, e.message)).collect()
}

impl Target for Native {
    fn load(doc: &str, seed: u64) -> Result<Self, Errors> {
        levee_core::Engine::load(doc, seed).map(|e| Native(e, None)).map_err(errs)
    }
    fn policy_index(&mut self, name: &str) -> Option<u32> {
        self.0.policy_index(name)
    }
    fn start(&mut self, call: u64, policy: u32, key: &str, flags: u32, now: u64, sc: u64, sa: u64, se: u64) -> u64 {
        self.0.start(call, policy, key, flags, now, sc, sa, se).0
    }
    fn acquire(&mut self, call: u64, now: u64) -> u64 {
        self.0.acquire(call, now).0
    }
    fn report(&mut self, call: u64, now: u64, elapsed: u64, kind: OutcomeKind, code: i32, text: &str, wall: u64, flags: u32) -> u64 {
        self.0.report(call, now, elapsed, kind, code, text, wall, flags).0
    }
    fn report_fallback(&mut self, call: u64, now: u64, ok: bool) -> u64 {
        self.0.report_fallback(call, now, ok).0
    }
    fn hedge_step(&mut self, call: u64, now: u64) -> (Vec<HedgeCommand>, bool) {
        let c = self.0.hedge_step(call, now);
        (c, self.0.has_events())
    }
    fn report_attempt(
        &mut self,
        call: u64,
        attempt: u32,
        now: u64,
        elapsed: u64,
        kind: OutcomeKind,
        code: i32,
        text: &str,
        wall: u64,
        flags: u32,
    ) -> (Vec<HedgeCommand>, bool) {
        let c = self.0.report_attempt(call, attempt, now, elapsed, kind, code, text, wall, flags);
        (c, self.0.has_events())
    }
    fn cancel(&mut self, call: u64, now: u64) {
        self.0.cancel(call, now)
    }
    fn take_wakes(&mut self) -> Vec<u64> {
        self.0.take_wakes()
    }
    fn drain_events(&mut self) -> Vec<Event> {
        self.0.drain_events()
    }
    fn breaker_state(&mut self, policy: u32, key: &str, now: u64) -> Option<BreakerState> {
        self.0.breaker_state(policy, key, now)
    }
    fn set_breaker_state(&mut self, policy: u32, key: &str, state: BreakerState, now: u64) -> Result<(), String> {
        self.0.set_breaker_state(policy, key, state, now)
    }
    fn call_info(&mut self, call: u64) -> Option<CallInfo> {
        self.0.call_info(call)
    }
    fn policy_info(&mut self, policy: u32) -> Option<PolicyInfo> {
        self.0.policy_info(policy)
    }
    fn analyze(&mut self, policy: u32, layers: u32) -> Option<Analysis> {
        self.0.analyze(policy, layers)
    }
    fn export_state(&mut self) -> Vec<u8> {
        self.0.export_state()
    }
    fn export_snapshot(&mut self) -> Vec<u8> {
        self.0.export_snapshot()
    }
    fn import_state(&mut self, bytes: &[u8]) -> Result<(), (String, String)> {
        self.0.import_state(bytes).map_err(|e| (e.path, e.message))
    }
    fn reload(&mut self, doc: &str) -> Result<(), Errors> {
        self.0.reload(doc).map_err(errs)
    }
    fn durable(&mut self, call: &DurableCall) -> Result<DurableOut, (String, String)> {
        durable_native(&mut self.0, call)
    }
    fn fleet(&mut self, call: &FleetCall) -> Result<FleetOut, (String, String)> {
        fleet_native(&mut self.0, call)
    }
    fn exec(&mut self, call: &ExecCall) -> Result<ExecOut, String> {
        exec_native(&self.0, &mut self.1, call)
    }
}

/// The JSON form of a verdict.
pub fn verdict_json(raw: u64) -> Value {
    let v = Verdict(raw);
    let kind = v.kind();
    let mut m = Map::new();
    m.insert("verdict".into(), json!(raw));
    m.insert("kind".into(), json!(kind.map(VerdictKind::name).unwrap_or("?")));
    m.insert("detail".into(), json!(v.detail()));
    if matches!(kind, Some(VerdictKind::Wait | VerdictKind::Retry | VerdictKind::Fallback | VerdictKind::Fail)) {
        m.insert("reason".into(), json!(v.reason().name()));
    }
    m.insert("payload".into(), json!(v.payload()));
    m.insert("events_pending".into(), json!(v.events_pending()));
    Value::Object(m)
}

/// The JSON form of a hedged call's answer: `{"commands": [...], "events_pending": b}`, each
/// command `{"start": {"attempt", "timeout"}}`, `{"cancel": n}`, `{"wait": ns}` or
/// `{"end": {"attempt", "verdict": <verdict JSON>}}`.
pub fn hedge_json(commands: &[HedgeCommand], events_pending: bool) -> Value {
    let commands: Vec<Value> = commands
        .iter()
        .map(|c| match *c {
            HedgeCommand::Start { attempt, timeout } => json!({"start": {"attempt": attempt, "timeout": timeout}}),
            HedgeCommand::Cancel { attempt } => json!({"cancel": attempt}),
            HedgeCommand::Wait { delay } => json!({"wait": delay}),
            HedgeCommand::End { attempt, verdict } => json!({"end": {"attempt": attempt, "verdict": verdict_json(verdict.0)}}),
        })
        .collect();
    json!({"commands": commands, "events_pending": events_pending})
}

/// The JSON form of an event.
pub fn event_json(e: &Event) -> Value {
    json!({
        "at": e.at, "kind": e.kind.name(), "policy": e.policy, "key": e.key, "call": e.call,
        "attempt": e.attempt, "reason": e.reason.name(), "duration": e.duration,
        "state_from": e.state_from.name(), "state_to": e.state_to.name(), "name": e.name, "value": e.value,
    })
}

fn errors_json(e: &[(String, String)]) -> Value {
    Value::Array(e.iter().map(|(p, m)| json!({"path": p, "message": m})).collect())
}

fn analysis_json(a: &Analysis) -> Value {
    json!({"worst_attempts": a.worst_attempts, "worst_latency": a.worst_latency, "amplification": a.amplification, "amplification_with_budget": a.amplification_with_budget})
}

/// Replay one vector. Returns the vector with every expectation filled in from this target
/// (for `bless`) and the list of mismatches against the expectations it had.
pub fn replay<T: Target>(vector: &Value) -> Result<(Value, Vec<String>), String> {
    let name = vector.get("name").and_then(Value::as_str).unwrap_or("?").to_string();
    let doc = vector.get("document").and_then(Value::as_str).ok_or(format!("{name}: no document"))?;
    let seed = vector.get("seed").and_then(Value::as_u64).ok_or(format!("{name}: no seed"))?;
    let mut out = vector.clone();
    let mut mismatches = Vec::new();
    let mut target = match T::load(doc, seed) {
        Err(e) => {
            let actual = errors_json(&e);
            if let Some(expected) = vector.get("load_errors").filter(|v| !v.is_null()) {
                // `true` marks a document that must not load, its errors not yet written out.
                if *expected != Value::Bool(true) && *expected != actual {
                    mismatches.push(format!("{name}: load errors differ\n  expected {expected}\n  actual   {actual}"));
                }
            } else {
                mismatches.push(format!("{name}: the document did not load: {actual}"));
            }
            set(&mut out, "load_errors", actual);
            return Ok((out, mismatches));
        }
        Ok(t) => {
            if vector.get("load_errors").is_some_and(|v| !v.is_null()) {
                mismatches.push(format!("{name}: the document loaded but errors were expected"));
            }
            set(&mut out, "load_errors", Value::Null);
            t
        }
    };
    let steps = vector.get("steps").and_then(Value::as_array).cloned().unwrap_or_default();
    let mut new_steps = Vec::with_capacity(steps.len());
    let mut record = Vec::new();
    let mut shared = Vec::new();
    for (i, step) in steps.iter().enumerate() {
        let actual = run_step(&mut target, step, doc, seed, &mut record, &mut shared).map_err(|e| format!("{name} step {i}: {e}"))?;
        let mut s = step.clone();
        if let Some(actual) = actual {
            if let Some(expected) = step.get("expect") {
                if !matches_expectation(expected, &actual) {
                    mismatches
                        .push(format!("{name} step {i} ({}): expected {expected}, got {actual}", step.get("op").unwrap_or(&Value::Null)));
                }
            }
            set(&mut s, "expect", actual);
        }
        new_steps.push(s);
    }
    set(&mut out, "steps", Value::Array(new_steps));
    Ok((out, mismatches))
}

fn set(target: &mut Value, key: &str, value: Value) {
    if let Some(map) = target.as_object_mut() {
        map.insert(key.to_string(), value);
    }
}

/// Whether `actual` satisfies `expected`: objects compare the fields `expected` names,
/// everything else compares exactly.
pub fn matches_expectation(expected: &Value, actual: &Value) -> bool {
    match (expected, actual) {
        (Value::Object(e), Value::Object(a)) => e.iter().all(|(k, v)| a.get(k).is_some_and(|av| matches_expectation(v, av))),
        (Value::Array(e), Value::Array(a)) => e.len() == a.len() && e.iter().zip(a).all(|(x, y)| matches_expectation(x, y)),
        (e, a) => e == a,
    }
}

fn arg_u64(step: &Value, field: &str) -> u64 {
    step.get(field).and_then(Value::as_u64).unwrap_or(0)
}

fn arg_str<'a>(step: &'a Value, field: &str) -> &'a str {
    step.get(field).and_then(Value::as_str).unwrap_or("")
}

/// The policy a step names, resolved by name; a name that does not exist resolves to
/// `u32::MAX` (the unknown-policy path), but a `policy` that is not a string is a broken vector.
fn policy_arg<T: Target>(t: &mut T, step: &Value) -> Result<u32, String> {
    match step.get("policy") {
        Some(Value::String(name)) => Ok(t.policy_index(name).unwrap_or(u32::MAX)),
        other => Err(format!("`policy` must be a policy name, found {other:?}")),
    }
}

/// A durable step's arguments: the record is `record_hex` when the step gives it, else the
/// record of the last durable step that succeeded in this vector.
fn durable_call<T: Target>(t: &mut T, op: &str, step: &Value, current: &[u8]) -> Result<DurableCall, String> {
    let record = match step.get("record_hex").and_then(Value::as_str) {
        Some(h) => unhex(h),
        None => current.to_vec(),
    };
    let (owner, wall_now, elapsed) = (arg_str(step, "owner").to_string(), arg_u64(step, "wall_now"), arg_u64(step, "elapsed"));
    Ok(match op {
        "durable_begin" => DurableCall::Begin {
            policy: policy_arg(t, step)?,
            key: arg_str(step, "key").to_string(),
            idempotency_key: arg_str(step, "idempotency_key").to_string(),
            flags: arg_u64(step, "flags") as u32,
            wall_now,
        },
        "durable_step" => DurableCall::Step { record, owner, wall_now, elapsed },
        "durable_renew" => DurableCall::Renew { record, owner, wall_now, elapsed },
        "durable_outcome" => DurableCall::Outcome {
            record,
            owner,
            wall_now,
            elapsed,
            kind: OutcomeKind::from_name(arg_str(step, "kind")).ok_or_else(|| format!("unknown outcome kind {:?}", step.get("kind")))?,
            code: step.get("code").and_then(Value::as_i64).unwrap_or(0) as i32,
            text: arg_str(step, "text").to_string(),
            message: arg_str(step, "message").to_string(),
            flags: arg_u64(step, "flags") as u32,
        },
        "durable_cancel" => DurableCall::Cancel { record, wall_now },
        "durable_revive" => DurableCall::Revive { record, wall_now },
        _ => DurableCall::Inspect { record },
    })
}

/// A fleet step: `fleet_merge` and `fleet_apply` work on `shared_hex` when the step gives it,
/// else on the bytes the last successful `fleet_merge` returned (none at first).
fn fleet_step<T: Target>(t: &mut T, op: &str, step: &Value, shared: &mut Vec<u8>) -> Result<Value, String> {
    let bytes = match step.get("shared_hex").and_then(Value::as_str) {
        Some(h) => unhex(h),
        None => shared.clone(),
    };
    let call = match op {
        "fleet_plan" => FleetCall::Plan { policy: policy_arg(t, step)? },
        "fleet_inspect" => FleetCall::Inspect { shared: bytes },
        _ => FleetCall::Sync {
            apply: op == "fleet_apply",
            policy: policy_arg(t, step)?,
            key: arg_str(step, "key").to_string(),
            node: arg_str(step, "node").to_string(),
            now: arg_u64(step, "now"),
            wall_ms: arg_u64(step, "wall_ms"),
            shared: bytes,
        },
    };
    Ok(match t.fleet(&call) {
        Ok(FleetOut::Plan(p)) => json!(p),
        Ok(FleetOut::Unit) => json!({"ok": null}),
        Ok(FleetOut::Json(text)) => json!({"ok": text}),
        Ok(FleetOut::Bytes(b)) => {
            let state = match t.fleet(&FleetCall::Inspect { shared: b.clone() }) {
                Ok(FleetOut::Json(text)) => serde_json::from_str::<Value>(&text).map_err(|e| format!("fleet-inspect: {e}"))?,
                other => return Err(format!("fleet-inspect of merged bytes: {other:?}")),
            };
            let out = json!({"ok": {"hex": hex(&b), "state": state}});
            *shared = b;
            out
        }
        Err((p, m)) => json!({"err": {"path": p, "message": m}}),
    })
}

fn arg_i64(step: &Value, field: &str) -> i64 {
    step.get(field).and_then(Value::as_i64).unwrap_or(0)
}

/// An executor step's arguments. A claimed row without `record_hex` carries the trace's record:
/// that of the last durable step that answered `ok`, or of the last `write` an executor step
/// answered, or of an `exec_operator` that answered `ok`.
fn exec_call(op: &str, step: &Value, current: &[u8]) -> Result<ExecCall, String> {
    let (now, id) = (arg_u64(step, "now"), arg_i64(step, "id"));
    let record = |v: &Value| match v.get("record_hex").and_then(Value::as_str) {
        Some(h) => unhex(h),
        None => current.to_vec(),
    };
    Ok(match op {
        "executor" => {
            let c = step.get("config").ok_or("`executor` needs a `config`")?;
            let config = dx::Config {
                owner: arg_str(c, "owner").to_string(),
                concurrency: arg_u64(c, "concurrency") as u32,
                poll: arg_u64(c, "poll"),
                claim_hold: arg_u64(c, "claim_hold"),
                until_idle: c.get("until_idle").and_then(Value::as_bool).unwrap_or(false),
            };
            let register = step.get("register").and_then(Value::as_array).into_iter().flatten();
            ExecCall::New { config, register: register.filter_map(Value::as_str).map(str::to_string).collect() }
        }
        "exec_poll" => ExecCall::Feed { now, event: dx::Event::Poll },
        "exec_claim_failed" => ExecCall::Feed { now, event: dx::Event::ClaimFailed(arg_str(step, "error").to_string()) },
        "exec_claimed" => {
            let rows = step.get("rows").and_then(Value::as_array).ok_or("`exec_claimed` needs `rows`")?;
            let rows = rows
                .iter()
                .map(|r| Claimed {
                    id: arg_i64(r, "id"),
                    handler: arg_str(r, "handler").to_string(),
                    record: record(r),
                    db_now: arg_u64(r, "db_now"),
                })
                .collect();
            ExecCall::Feed { now, event: dx::Event::Claimed(rows) }
        }
        "exec_next_due" => ExecCall::Feed { now, event: dx::Event::NextDue(step.get("due_in").and_then(Value::as_u64)) },
        "exec_written" => {
            let result = match step.get("result") {
                Some(Value::String(s)) if s == "applied" => Written::Applied,
                Some(Value::String(s)) if s == "lost" => Written::Lost,
                Some(Value::Object(m)) if m.contains_key("failed") => {
                    Written::Failed(arg_str(&Value::Object(m.clone()), "failed").to_string())
                }
                other => return Err(format!("`result` must be \"applied\", \"lost\" or {{\"failed\": text}}, found {other:?}")),
            };
            ExecCall::Feed { now, event: dx::Event::Written(id, result) }
        }
        "exec_renew" => ExecCall::Feed { now, event: dx::Event::Renew(id) },
        "exec_finished" => ExecCall::Feed {
            now,
            event: dx::Event::Finished(
                id,
                Finished {
                    kind: OutcomeKind::from_name(arg_str(step, "kind"))
                        .ok_or_else(|| format!("unknown outcome kind {:?}", step.get("kind")))?,
                    code: arg_i64(step, "code") as i32,
                    text: arg_str(step, "text").to_string(),
                    message: arg_str(step, "message").to_string(),
                    overloaded: arg_u64(step, "flags") & u64::from(levee_core::FLAG_OVERLOADED) != 0,
                },
            ),
        },
        "exec_forget" => ExecCall::Forget { id },
        "exec_running" => ExecCall::Running,
        _ => ExecCall::Operator {
            id,
            record: record(step),
            revive: step.get("revive").and_then(Value::as_bool).unwrap_or(false),
            wall_now: arg_u64(step, "wall_now"),
        },
    })
}

fn run_step<T: Target>(
    t: &mut T,
    step: &Value,
    doc: &str,
    seed: u64,
    record: &mut Vec<u8>,
    shared: &mut Vec<u8>,
) -> Result<Option<Value>, String> {
    let op = step.get("op").and_then(Value::as_str).ok_or("no op")?;
    Ok(Some(match op {
        "executor" | "exec_poll" | "exec_claim_failed" | "exec_claimed" | "exec_next_due" | "exec_written" | "exec_renew"
        | "exec_finished" | "exec_forget" | "exec_running" | "exec_operator" => match t.exec(&exec_call(op, step, record)?)? {
            ExecOut::Unit => return Ok(None),
            ExecOut::Running(n) => json!(n),
            ExecOut::Commands(c) => {
                if let Some(Command::Write { row, .. }) = c.iter().rev().find(|c| matches!(c, Command::Write { .. })) {
                    record.clone_from(&row.record);
                }
                commands_json(&c)
            }
            ExecOut::Operator(Ok(row)) => {
                let out = json!({"ok": row_json(arg_i64(step, "id"), &row)});
                *record = row.record;
                out
            }
            ExecOut::Operator(Err((p, m))) => json!({"err": {"path": p, "message": m}}),
        },
        "fleet_plan" | "fleet_merge" | "fleet_apply" | "fleet_inspect" => fleet_step(t, op, step, shared)?,
        "durable_begin" | "durable_step" | "durable_renew" | "durable_outcome" | "durable_cancel" | "durable_revive"
        | "durable_inspect" => {
            let call = durable_call(t, op, step, record)?;
            match t.durable(&call) {
                Ok(DurableOut::Json(text)) => json!({"ok": text}),
                Ok(DurableOut::Step { action, attempt, wait, timeout, next_at, lease_until, reason, policy_changed, bytes }) => {
                    let out = json!({"ok": {"action": action, "attempt": attempt, "wait": wait, "timeout": timeout, "next_at": next_at,
                        "lease_until": lease_until, "reason": reason, "policy_changed": policy_changed, "record_hex": hex(&bytes)}});
                    *record = bytes;
                    out
                }
                Err((p, m)) => json!({"err": {"path": p, "message": m}}),
            }
        }
        "start" => {
            let p = policy_arg(t, step)?;
            verdict_json(t.start(
                arg_u64(step, "call"),
                p,
                arg_str(step, "key"),
                arg_u64(step, "flags") as u32,
                arg_u64(step, "now"),
                arg_u64(step, "settle_call"),
                arg_u64(step, "settle_at"),
                arg_u64(step, "settle_elapsed"),
            ))
        }
        "acquire" => verdict_json(t.acquire(arg_u64(step, "call"), arg_u64(step, "now"))),
        "report" => {
            let kind =
                OutcomeKind::from_name(arg_str(step, "kind")).ok_or_else(|| format!("unknown outcome kind {:?}", step.get("kind")))?;
            let code = step.get("code").and_then(Value::as_i64).unwrap_or(0) as i32;
            verdict_json(t.report(
                arg_u64(step, "call"),
                arg_u64(step, "now"),
                arg_u64(step, "elapsed"),
                kind,
                code,
                arg_str(step, "text"),
                arg_u64(step, "wall_secs"),
                arg_u64(step, "flags") as u32,
            ))
        }
        "report_fallback" => verdict_json(t.report_fallback(
            arg_u64(step, "call"),
            arg_u64(step, "now"),
            step.get("ok").and_then(Value::as_bool).unwrap_or(false),
        )),
        "hedge_step" => {
            let (c, e) = t.hedge_step(arg_u64(step, "call"), arg_u64(step, "now"));
            hedge_json(&c, e)
        }
        "report_attempt" => {
            let kind =
                OutcomeKind::from_name(arg_str(step, "kind")).ok_or_else(|| format!("unknown outcome kind {:?}", step.get("kind")))?;
            let (c, e) = t.report_attempt(
                arg_u64(step, "call"),
                arg_u64(step, "attempt") as u32,
                arg_u64(step, "now"),
                arg_u64(step, "elapsed"),
                kind,
                step.get("code").and_then(Value::as_i64).unwrap_or(0) as i32,
                arg_str(step, "text"),
                arg_u64(step, "wall_secs"),
                arg_u64(step, "flags") as u32,
            );
            hedge_json(&c, e)
        }
        "cancel" => {
            t.cancel(arg_u64(step, "call"), arg_u64(step, "now"));
            return Ok(None);
        }
        "drain_events" => Value::Array(t.drain_events().iter().map(event_json).collect()),
        "take_wakes" => json!(t.take_wakes()),
        "breaker_state" => {
            let p = policy_arg(t, step)?;
            json!(t.breaker_state(p, arg_str(step, "key"), arg_u64(step, "now")).map(|s| s.name()))
        }
        "set_breaker_state" => {
            let p = policy_arg(t, step)?;
            let state = BreakerState::from_name(arg_str(step, "state")).ok_or("unknown breaker state")?;
            match t.set_breaker_state(p, arg_str(step, "key"), state, arg_u64(step, "now")) {
                Ok(()) => json!({"ok": null}),
                Err(e) => json!({"err": e}),
            }
        }
        "call_info" => match t.call_info(arg_u64(step, "call")) {
            None => Value::Null,
            Some(c) => {
                json!({"policy": c.policy, "key": c.key, "attempts": c.attempts, "deadline": c.deadline, "last_reason": c.last_reason.name(), "in_flight": c.in_flight})
            }
        },
        "policy_info" => {
            let p = policy_arg(t, step)?;
            match t.policy_info(p) {
                None => Value::Null,
                Some(i) => {
                    json!({"name": i.name, "max_attempts": i.max_attempts, "attempt_timeout": i.attempt_timeout, "deadline": i.deadline, "fallbacks": i.fallbacks})
                }
            }
        }
        "analyze" => {
            let p = policy_arg(t, step)?;
            t.analyze(p, arg_u64(step, "layers") as u32).as_ref().map(analysis_json).unwrap_or(Value::Null)
        }
        "export_import" | "snapshot_import" => {
            let op = arg_str(step, "op");
            let bytes = if op == "export_import" { t.export_state() } else { t.export_snapshot() };
            let mut fresh = T::load(doc, seed).map_err(|e| format!("reloading for {op}: {e:?}"))?;
            fresh.import_state(&bytes).map_err(|e| format!("import_state of an export failed: {e:?}"))?;
            *t = fresh;
            return Ok(None);
        }
        "reload" => match t.reload(arg_str(step, "document")) {
            Ok(()) => json!({"ok": null}),
            Err(e) => json!({"err": errors_json(&e)}),
        },
        "import_state" => {
            let hex = arg_str(step, "bytes_hex");
            let bytes: Vec<u8> =
                (0..hex.len() / 2).filter_map(|i| hex.get(2 * i..2 * i + 2).and_then(|h| u8::from_str_radix(h, 16).ok())).collect();
            match t.import_state(&bytes) {
                Ok(()) => json!({"ok": null}),
                Err((p, m)) => json!({"err": {"path": p, "message": m}}),
            }
        }
        other => return Err(format!("unknown op {other}")),
    }))
}

/// The vectors directory.
pub fn vectors_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join("vectors")
}

/// Every vector file, sorted.
pub fn vector_files() -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(vectors_dir())
        .map(|d| d.filter_map(|e| e.ok().map(|e| e.path())).filter(|p| p.extension().is_some_and(|x| x == "json")).collect())
        .unwrap_or_default();
    files.sort();
    files
}
