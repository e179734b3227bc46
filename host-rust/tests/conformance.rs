//! Every conformance vector through BOTH backends of `RawEngine` (the component in wasmtime
#![allow(clippy::panic)]
//! and levee-core linked natively), with the replay logic of `levee-conformance`; the two
//! must match the vectors and each other exactly.

use levee::core::durable::{Action, DurableStep};
use levee::core::{Analysis, BreakerState, CallInfo, Event, HedgeCommand, OutcomeKind, PolicyInfo};
use levee::{Backend, Limits, RawEngine, RawExecutor};
use levee_conformance::{replay, vector_files, DurableCall, DurableOut, Errors, ExecCall, ExecOut, FleetCall, FleetOut, Target};
use serde_json::Value;

fn errs(v: Vec<levee::core::LoadError>) -> Errors {
    v.into_iter().map(|e| (e.path, e.message)).collect()
}

/// The core's durable step as the runner compares it (enums by name, the record's bytes).
fn durable_out(step: Result<Result<DurableStep, levee::core::LoadError>, levee::Trap>) -> Result<DurableOut, (String, String)> {
    let s = step.unwrap_or_else(|t| panic!("{t}")).map_err(|e| (e.path, e.message))?;
    let action = match s.action {
        Action::Run => "run",
        Action::Wait => "wait",
        Action::Done => "done",
        Action::Dead => "dead",
        Action::Cancelled => "cancelled",
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

fn has_op(vector: &Value, prefix: &str) -> bool {
    vector
        .get("steps")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .any(|s| s.get("op").and_then(Value::as_str).is_some_and(|o| o.starts_with(prefix)))
}

/// A `fleet-*` call through the host's `RawEngine` (either backend).
fn fleet(e: &mut RawEngine, call: &FleetCall) -> Result<FleetOut, (String, String)> {
    let le = |e: levee::core::LoadError| (e.path, e.message);
    let trap = |t: levee::Trap| -> ! { panic!("{t}") };
    match call {
        FleetCall::Plan { policy } => Ok(FleetOut::Plan(e.try_fleet_plan(*policy).unwrap_or_else(|t| trap(t)))),
        FleetCall::Sync { apply: false, policy, key, node, now, wall_ms, shared } => {
            e.try_fleet_merge(*policy, key, node, *now, *wall_ms, shared).unwrap_or_else(|t| trap(t)).map(FleetOut::Bytes).map_err(le)
        }
        FleetCall::Sync { apply: true, policy, key, node, now, wall_ms, shared } => {
            e.try_fleet_apply(*policy, key, node, *now, *wall_ms, shared).unwrap_or_else(|t| trap(t)).map(|()| FleetOut::Unit).map_err(le)
        }
        FleetCall::Inspect { shared } => e.try_fleet_inspect(shared).unwrap_or_else(|t| trap(t)).map(FleetOut::Json).map_err(le),
    }
}

/// A `durable-*` call through the host's `RawEngine` (either backend).
fn durable(e: &mut RawEngine, call: &DurableCall) -> Result<DurableOut, (String, String)> {
    match call {
        DurableCall::Begin { policy, key, idempotency_key, flags, wall_now } => {
            durable_out(e.try_durable_begin(*policy, key, idempotency_key, *flags, *wall_now))
        }
        DurableCall::Step { record, owner, wall_now, elapsed } => durable_out(e.try_durable_step(record, owner, *wall_now, *elapsed)),
        DurableCall::Renew { record, owner, wall_now, elapsed } => durable_out(e.try_durable_renew(record, owner, *wall_now, *elapsed)),
        DurableCall::Outcome { record, owner, wall_now, elapsed, kind, code, text, message, flags } => {
            durable_out(e.try_durable_outcome(record, owner, *wall_now, *elapsed, *kind, *code, text, message, *flags))
        }
        DurableCall::Cancel { record, wall_now } => durable_out(e.try_durable_cancel(record, *wall_now)),
        DurableCall::Revive { record, wall_now } => durable_out(e.try_durable_revive(record, *wall_now)),
        DurableCall::Inspect { record } => {
            e.try_durable_inspect(record).unwrap_or_else(|t| panic!("{t}")).map(DurableOut::Json).map_err(|e| (e.path, e.message))
        }
    }
}

/// An `executor` method through the host's `RawExecutor` (either backend): the trace's
/// executor is `x`, made by the `executor` step.
fn exec(e: &mut RawEngine, x: &mut Option<RawExecutor>, call: &ExecCall) -> Result<ExecOut, String> {
    let trap = |t: levee::Trap| -> ! { panic!("{t}") };
    match call {
        ExecCall::New { config, register } => {
            let mut m = RawExecutor::new(config.clone());
            register.iter().for_each(|h| m.register(h));
            if let Some(old) = x.replace(m) {
                e.drop_executor(old);
            }
            return Ok(ExecOut::Unit);
        }
        ExecCall::Operator { id, record, revive, wall_now } => {
            let row = e.try_executor_operator(*id, record, *revive, *wall_now).unwrap_or_else(|t| trap(t));
            return Ok(ExecOut::Operator(row.map_err(|e| (e.path, e.message))));
        }
        _ => {}
    }
    let m = x.as_mut().ok_or("an executor step before the `executor` step")?;
    Ok(match call {
        ExecCall::Feed { now, event } => ExecOut::Commands(e.try_executor_feed(m, *now, event.clone()).unwrap_or_else(|t| trap(t))),
        ExecCall::Forget { id } => {
            e.try_executor_forget(m, *id).unwrap_or_else(|t| trap(t));
            ExecOut::Unit
        }
        ExecCall::Running => ExecOut::Running(e.try_executor_running(m).unwrap_or_else(|t| trap(t))),
        ExecCall::New { .. } | ExecCall::Operator { .. } => ExecOut::Unit,
    })
}

macro_rules! target {
    ($name:ident, $backend:expr) => {
        struct $name(RawEngine, Option<RawExecutor>);

        impl Target for $name {
            fn durable(&mut self, call: &DurableCall) -> Result<DurableOut, (String, String)> {
                durable(&mut self.0, call)
            }
            fn fleet(&mut self, call: &FleetCall) -> Result<FleetOut, (String, String)> {
                fleet(&mut self.0, call)
            }
            fn exec(&mut self, call: &ExecCall) -> Result<ExecOut, String> {
                exec(&mut self.0, &mut self.1, call)
            }
            fn load(doc: &str, seed: u64) -> Result<Self, Errors> {
                RawEngine::load_with($backend, doc, seed, Limits::default()).map(|e| $name(e, None)).map_err(errs)
            }
            fn policy_index(&mut self, name: &str) -> Option<u32> {
                self.0.try_policy_index(name).unwrap_or_else(|t| panic!("{t}"))
            }
            fn start(&mut self, call: u64, policy: u32, key: &str, flags: u32, now: u64, sc: u64, sa: u64, se: u64) -> u64 {
                self.0.try_start(call, policy, key, flags, now, sc, sa, se).unwrap_or_else(|t| panic!("{t}")).0
            }
            fn acquire(&mut self, call: u64, now: u64) -> u64 {
                self.0.try_acquire(call, now).unwrap_or_else(|t| panic!("{t}")).0
            }
            fn report(
                &mut self,
                call: u64,
                now: u64,
                elapsed: u64,
                kind: OutcomeKind,
                code: i32,
                text: &str,
                wall: u64,
                flags: u32,
            ) -> u64 {
                self.0.try_report(call, now, elapsed, kind, code, text, wall, flags).unwrap_or_else(|t| panic!("{t}")).0
            }
            fn report_fallback(&mut self, call: u64, now: u64, ok: bool) -> u64 {
                self.0.try_report_fallback(call, now, ok).unwrap_or_else(|t| panic!("{t}")).0
            }
            fn cancel(&mut self, call: u64, now: u64) {
                self.0.try_cancel(call, now).unwrap_or_else(|t| panic!("{t}"))
            }
            fn take_wakes(&mut self) -> Vec<u64> {
                self.0.try_take_wakes().unwrap_or_else(|t| panic!("{t}"))
            }
            fn hedge_step(&mut self, call: u64, now: u64) -> (Vec<HedgeCommand>, bool) {
                self.0.try_hedge_step(call, now).unwrap_or_else(|t| panic!("{t}"))
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
                self.0.try_report_attempt(call, attempt, now, elapsed, kind, code, text, wall, flags).unwrap_or_else(|t| panic!("{t}"))
            }
            fn drain_events(&mut self) -> Vec<Event> {
                self.0.try_drain_events().unwrap_or_else(|t| panic!("{t}"))
            }
            fn breaker_state(&mut self, policy: u32, key: &str, now: u64) -> Option<BreakerState> {
                self.0.try_breaker_state(policy, key, now).unwrap_or_else(|t| panic!("{t}"))
            }
            fn set_breaker_state(&mut self, policy: u32, key: &str, state: BreakerState, now: u64) -> Result<(), String> {
                self.0.try_set_breaker_state(policy, key, state, now).unwrap_or_else(|t| panic!("{t}"))
            }
            fn call_info(&mut self, call: u64) -> Option<CallInfo> {
                self.0.try_call_info(call).unwrap_or_else(|t| panic!("{t}"))
            }
            fn policy_info(&mut self, policy: u32) -> Option<PolicyInfo> {
                self.0.try_policy_info(policy).unwrap_or_else(|t| panic!("{t}"))
            }
            fn analyze(&mut self, policy: u32, layers: u32) -> Option<Analysis> {
                self.0.try_analyze(policy, layers).unwrap_or_else(|t| panic!("{t}"))
            }
            fn export_state(&mut self) -> Vec<u8> {
                self.0.try_export_state().unwrap_or_else(|t| panic!("{t}"))
            }
            fn export_snapshot(&mut self) -> Vec<u8> {
                self.0.try_export_snapshot().unwrap_or_else(|t| panic!("{t}"))
            }
            fn import_state(&mut self, bytes: &[u8]) -> Result<(), (String, String)> {
                self.0.try_import_state(bytes).unwrap_or_else(|t| panic!("{t}")).map_err(|e| (e.path, e.message))
            }
            fn reload(&mut self, doc: &str) -> Result<(), Errors> {
                self.0.try_reload(doc).unwrap_or_else(|t| panic!("{t}")).map_err(errs)
            }
        }
    };
}

target!(WasmTarget, Backend::Wasm);
target!(NativeTarget, Backend::Native);

#[test]
fn every_vector_through_both_backends() {
    let files = vector_files();
    assert!(!files.is_empty(), "no conformance vectors found");
    let mut failures = Vec::new();
    let mut replayed = 0;
    let mut fleet_vectors = 0;
    let mut exec_vectors = 0;
    for path in &files {
        let text = std::fs::read_to_string(path).unwrap_or_default();
        let vector: Value = serde_json::from_str(&text).unwrap_or(Value::Null);
        assert!(vector.is_object(), "{} is not a JSON object", path.display());
        if has_op(&vector, "fleet_") {
            fleet_vectors += 1;
        }
        if has_op(&vector, "exec") {
            exec_vectors += 1;
        }
        let native = replay::<NativeTarget>(&vector);
        let wasm = replay::<WasmTarget>(&vector);
        match (native, wasm) {
            (Ok((n_out, n_bad)), Ok((w_out, w_bad))) => {
                failures.extend(n_bad.into_iter().map(|m| format!("native: {m}")));
                failures.extend(w_bad.into_iter().map(|m| format!("wasm: {m}")));
                if n_out != w_out {
                    failures.push(format!("{}: the backends differ", path.display()));
                }
            }
            (n, w) => failures.push(format!("{}: replay error: native {:?} wasm {:?}", path.display(), n.err(), w.err())),
        }
        replayed += 1;
    }
    assert!(failures.is_empty(), "{} of {replayed} vectors failed:\n{}", failures.len(), failures.join("\n"));
    assert!(fleet_vectors > 0, "no fleet-* vectors were replayed");
    assert!(exec_vectors >= 12, "{exec_vectors} executor vectors were replayed, not the 12 or more of durable-executor-*");
    eprintln!("{replayed} vectors replayed through both backends ({fleet_vectors} of them fleet-*, {exec_vectors} executor)");
}
