//! The component in wasmtime, as a [`Target`](crate::Target).

use levee_core::{Analysis, BreakerState, CallInfo, Event, EventKind, HedgeCommand, OutcomeKind, PolicyInfo, Reason, Verdict};
use wasmtime::component::{Component, Linker, ResourceAny};
use wasmtime::{Config, Engine, Store};

use crate::{DurableCall, DurableOut, Errors, ExecCall, ExecOut, Target};
use levee_core::durable_exec as dx;

wasmtime::component::bindgen!({
    path: "../../wit",
    world: "levee",
});

use exports::levee::policy::types as wit;

/// The component bytes built by `levee-build` for this crate.
pub static COMPONENT: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/levee_policy.wasm"));

/// A compiled component, shared by every instance.
pub struct Compiled {
    engine: Engine,
    component: Component,
    linker: Linker<()>,
}

impl Compiled {
    /// Compile the component (no imports are linked: it has none).
    pub fn new() -> wasmtime::Result<Self> {
        let mut config = Config::new();
        config.concurrency_support(false);
        let engine = Engine::new(&config)?;
        let component = Component::new(&engine, COMPONENT)?;
        Ok(Compiled { linker: Linker::new(&engine), engine, component })
    }

    /// A fresh instance.
    pub fn instantiate(&self) -> wasmtime::Result<(Store<()>, Levee)> {
        let mut store = Store::new(&self.engine, ());
        let levee = Levee::instantiate(&mut store, &self.component, &self.linker)?;
        Ok((store, levee))
    }
}

thread_local! {
    static COMPILED: Compiled = match Compiled::new() {
        Ok(c) => c,
        Err(e) => { eprintln!("compiling the component failed: {e:#}"); std::process::abort() }
    };
}

/// One engine resource in one instance, started through `engine.start`.
pub type Wasm = WasmWith<false>;

/// As [`Wasm`], but calls without a key start through `start-unkeyed` (the engine named by
/// its id), as hosts do on their hot path: the vectors prove both give the same decisions.
pub type WasmUnkeyed = WasmWith<true>;

/// One engine resource in one instance; `UNKEYED` picks how calls without a key start.
pub struct WasmWith<const UNKEYED: bool> {
    store: Store<()>,
    levee: Levee,
    engine: ResourceAny,
    id: u32,
    executor: Option<ResourceAny>,
}

fn reason(r: wit::Reason) -> Reason {
    Reason::from_index(r as u32).unwrap_or(Reason::None)
}

fn state(s: wit::BreakerState) -> BreakerState {
    BreakerState::from_index(s as u32).unwrap_or(BreakerState::Closed)
}

fn state_in(s: BreakerState) -> wit::BreakerState {
    match s {
        BreakerState::Closed => wit::BreakerState::Closed,
        BreakerState::Open => wit::BreakerState::Open,
        BreakerState::HalfOpen => wit::BreakerState::HalfOpen,
        BreakerState::ForcedOpen => wit::BreakerState::ForcedOpen,
        BreakerState::ForcedClosed => wit::BreakerState::ForcedClosed,
        BreakerState::Disabled => wit::BreakerState::Disabled,
    }
}

fn kind_in(k: OutcomeKind) -> wit::OutcomeKind {
    match k {
        OutcomeKind::Success => wit::OutcomeKind::Success,
        OutcomeKind::Timeout => wit::OutcomeKind::Timeout,
        OutcomeKind::ConnectionError => wit::OutcomeKind::ConnectionError,
        OutcomeKind::HttpStatus => wit::OutcomeKind::HttpStatus,
        OutcomeKind::GrpcStatus => wit::OutcomeKind::GrpcStatus,
        OutcomeKind::ErrorClass => wit::OutcomeKind::ErrorClass,
    }
}

fn hedge_out(a: wit::HedgeAnswer) -> (Vec<HedgeCommand>, bool) {
    let commands = a
        .commands
        .into_iter()
        .map(|c| match c {
            wit::HedgeCommand::Start(s) => HedgeCommand::Start { attempt: s.attempt, timeout: s.timeout },
            wit::HedgeCommand::Cancel(attempt) => HedgeCommand::Cancel { attempt },
            wit::HedgeCommand::Wait(delay) => HedgeCommand::Wait { delay },
            wit::HedgeCommand::End(e) => HedgeCommand::End { attempt: e.attempt, verdict: Verdict(e.verdict) },
        })
        .collect();
    (commands, a.events_pending)
}

fn must<T>(r: wasmtime::Result<T>) -> T {
    match r {
        Ok(v) => v,
        Err(e) => {
            eprintln!("the component trapped: {e:#}");
            std::process::abort()
        }
    }
}

fn row_out(w: wit::RowWrite) -> dx::RowWrite {
    dx::RowWrite {
        status: crate::status_text(&w.status),
        next_at: w.next_at,
        attempts: w.attempts,
        record: w.bytes,
        lease: w.lease,
        result: w.keep_result,
        error: w.error,
    }
}

fn commands_out(c: Vec<wit::ExecCommand>) -> Vec<dx::Command> {
    use wit::ExecCommand as W;
    c.into_iter()
        .map(|c| match c {
            W::Claim(c) => dx::Command::Claim { limit: c.limit, hold: c.hold },
            W::Write(w) => dx::Command::Write { id: w.id, row: row_out(w) },
            W::Run(r) => dx::Command::Run { id: r.id, attempt: r.attempt, timeout: r.timeout, renew_every: r.renew_every },
            W::Abandon(id) => dx::Command::Abandon { id },
            W::Quarantine(q) => dx::Command::Quarantine { id: q.id, error: q.error },
            W::NextDue => dx::Command::NextDue,
            W::Sleep(until) => dx::Command::Sleep { until },
            W::Idle => dx::Command::Idle,
            W::Log(l) => dx::Command::Log {
                level: match l.level {
                    wit::LogLevel::Warn => dx::Level::Warn,
                    wit::LogLevel::Error => dx::Level::Error,
                },
                id: l.id,
                text: l.text,
            },
        })
        .collect()
}

impl<const UNKEYED: bool> WasmWith<UNKEYED> {
    fn exec_call(&mut self, call: &ExecCall) -> Result<ExecOut, String> {
        let api = self.levee.levee_policy_engine_api().executor();
        let (st, e) = (&mut self.store, self.engine);
        if let ExecCall::New { config, register } = call {
            let c = wit::ExecutorConfig {
                owner: config.owner.clone(),
                concurrency: config.concurrency,
                poll: config.poll,
                claim_hold: config.claim_hold,
                until_idle: config.until_idle,
            };
            let x = must(api.call_constructor(&mut *st, &c));
            for h in register {
                must(api.call_register(&mut *st, x, h));
            }
            if let Some(old) = self.executor.replace(x) {
                must(old.resource_drop(&mut *st));
            }
            return Ok(ExecOut::Unit);
        }
        if let ExecCall::Operator { id, record, revive, wall_now } = call {
            let r = must(api.call_operator(&mut *st, e, *id, record, *revive, *wall_now));
            return Ok(ExecOut::Operator(r.map(row_out).map_err(|e| (e.path, e.message))));
        }
        let x = self.executor.ok_or("an executor step before the `executor` step")?;
        Ok(match call {
            ExecCall::New { .. } | ExecCall::Operator { .. } => ExecOut::Unit,
            ExecCall::Feed { now, event } => ExecOut::Commands(commands_out(must(api.call_feed(st, x, e, *now, &event_in(event))))),
            ExecCall::Forget { id } => {
                must(api.call_forget(st, x, *id));
                ExecOut::Unit
            }
            ExecCall::Running => ExecOut::Running(must(api.call_running(st, x))),
        })
    }
}

fn event_in(e: &dx::Event) -> wit::ExecEvent {
    use dx::Event as E;
    match e {
        E::Poll => wit::ExecEvent::Poll,
        E::Claimed(rows) => wit::ExecEvent::Claimed(
            rows.iter()
                .map(|r| wit::ClaimedCall { id: r.id, handler: r.handler.clone(), bytes: r.record.clone(), db_now: r.db_now })
                .collect(),
        ),
        E::ClaimFailed(error) => wit::ExecEvent::ClaimFailed(error.clone()),
        E::NextDue(due_in) => wit::ExecEvent::NextDue(*due_in),
        E::Written(id, w) => wit::ExecEvent::Written(wit::ExecWritten {
            id: *id,
            result: match w {
                dx::Written::Applied => wit::WriteResult::Applied,
                dx::Written::Lost => wit::WriteResult::Lost,
                dx::Written::Failed(m) => wit::WriteResult::Failed(m.clone()),
            },
        }),
        E::Renew(id) => wit::ExecEvent::Renew(*id),
        E::Finished(id, f) => wit::ExecEvent::Finished(wit::ExecFinished {
            id: *id,
            kind: kind_in(f.kind),
            code: f.code,
            text: f.text.clone(),
            message: f.message.clone(),
            flags: if f.overloaded { levee_core::FLAG_OVERLOADED } else { 0 },
        }),
    }
}

impl<const UNKEYED: bool> Target for WasmWith<UNKEYED> {
    fn load(doc: &str, seed: u64) -> Result<Self, Errors> {
        let (mut store, levee) = must(COMPILED.with(|c| c.instantiate()));
        let loaded = must(levee.levee_policy_engine_api().engine().call_load(&mut store, doc, seed));
        match loaded {
            Ok(engine) => {
                let id = must(levee.levee_policy_engine_api().engine().call_id(&mut store, engine));
                Ok(WasmWith { store, levee, engine, id, executor: None })
            }
            Err(e) => Err(e.into_iter().map(|e| (e.path, e.message)).collect()),
        }
    }
    fn policy_index(&mut self, name: &str) -> Option<u32> {
        let (e, api) = (self.engine, self.levee.levee_policy_engine_api().engine());
        must(api.call_policy_index(&mut self.store, e, name))
    }
    fn start(&mut self, call: u64, policy: u32, key: &str, flags: u32, now: u64, sc: u64, sa: u64, se: u64) -> u64 {
        if UNKEYED && key.is_empty() {
            let api = self.levee.levee_policy_engine_api();
            return must(api.call_start_unkeyed(&mut self.store, self.id, call, policy, flags, now, sc, sa, se));
        }
        let (e, api) = (self.engine, self.levee.levee_policy_engine_api().engine());
        must(api.call_start(&mut self.store, e, call, policy, key, flags, now, sc, sa, se))
    }
    fn acquire(&mut self, call: u64, now: u64) -> u64 {
        let (e, api) = (self.engine, self.levee.levee_policy_engine_api().engine());
        must(api.call_acquire(&mut self.store, e, call, now))
    }
    fn report(&mut self, call: u64, now: u64, elapsed: u64, kind: OutcomeKind, code: i32, text: &str, wall: u64, flags: u32) -> u64 {
        let (e, api) = (self.engine, self.levee.levee_policy_engine_api().engine());
        must(api.call_report(&mut self.store, e, call, now, elapsed, kind_in(kind), code, text, wall, flags))
    }
    fn report_fallback(&mut self, call: u64, now: u64, ok: bool) -> u64 {
        let (e, api) = (self.engine, self.levee.levee_policy_engine_api().engine());
        must(api.call_report_fallback(&mut self.store, e, call, now, ok))
    }
    fn hedge_step(&mut self, call: u64, now: u64) -> (Vec<HedgeCommand>, bool) {
        let (e, api) = (self.engine, self.levee.levee_policy_engine_api().engine());
        hedge_out(must(api.call_hedge_step(&mut self.store, e, call, now)))
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
        let (e, api) = (self.engine, self.levee.levee_policy_engine_api().engine());
        hedge_out(must(api.call_report_attempt(&mut self.store, e, call, attempt, now, elapsed, kind_in(kind), code, text, wall, flags)))
    }
    fn cancel(&mut self, call: u64, now: u64) {
        let (e, api) = (self.engine, self.levee.levee_policy_engine_api().engine());
        must(api.call_cancel(&mut self.store, e, call, now))
    }
    fn take_wakes(&mut self) -> Vec<u64> {
        let (e, api) = (self.engine, self.levee.levee_policy_engine_api().engine());
        must(api.call_take_wakes(&mut self.store, e))
    }
    fn drain_events(&mut self) -> Vec<Event> {
        let (e, api) = (self.engine, self.levee.levee_policy_engine_api().engine());
        must(api.call_drain_events(&mut self.store, e))
            .into_iter()
            .map(|w| Event {
                at: w.at,
                kind: EventKind::from_index(w.kind as u32).unwrap_or(EventKind::GaveUp),
                policy: w.policy,
                key: w.key,
                call: w.call,
                attempt: w.attempt,
                reason: reason(w.reason),
                duration: w.duration,
                state_from: state(w.state_from),
                state_to: state(w.state_to),
                name: w.name,
                value: w.value,
            })
            .collect()
    }
    fn breaker_state(&mut self, policy: u32, key: &str, now: u64) -> Option<BreakerState> {
        let (e, api) = (self.engine, self.levee.levee_policy_engine_api().engine());
        must(api.call_breaker_state(&mut self.store, e, policy, key, now)).map(state)
    }
    fn set_breaker_state(&mut self, policy: u32, key: &str, s: BreakerState, now: u64) -> Result<(), String> {
        let (e, api) = (self.engine, self.levee.levee_policy_engine_api().engine());
        must(api.call_set_breaker_state(&mut self.store, e, policy, key, state_in(s), now))
    }
    fn call_info(&mut self, call: u64) -> Option<CallInfo> {
        let (e, api) = (self.engine, self.levee.levee_policy_engine_api().engine());
        must(api.call_call_info(&mut self.store, e, call)).map(|c| CallInfo {
            policy: c.policy,
            key: c.key,
            attempts: c.attempts,
            deadline: c.deadline,
            last_reason: reason(c.last_reason),
            in_flight: c.in_flight,
        })
    }
    fn policy_info(&mut self, policy: u32) -> Option<PolicyInfo> {
        let (e, api) = (self.engine, self.levee.levee_policy_engine_api().engine());
        must(api.call_policy_info(&mut self.store, e, policy)).map(|i| PolicyInfo {
            name: i.name,
            max_attempts: i.max_attempts,
            attempt_timeout: i.attempt_timeout,
            deadline: i.deadline,
            fallbacks: i.fallbacks,
        })
    }
    fn analyze(&mut self, policy: u32, layers: u32) -> Option<Analysis> {
        let (e, api) = (self.engine, self.levee.levee_policy_engine_api().engine());
        must(api.call_analyze(&mut self.store, e, policy, layers)).map(|a| Analysis {
            worst_attempts: a.worst_attempts,
            worst_latency: a.worst_latency,
            amplification: a.amplification,
            amplification_with_budget: a.amplification_with_budget,
        })
    }
    fn export_state(&mut self) -> Vec<u8> {
        let (e, api) = (self.engine, self.levee.levee_policy_engine_api().engine());
        must(api.call_export_state(&mut self.store, e))
    }
    fn export_snapshot(&mut self) -> Vec<u8> {
        let (e, api) = (self.engine, self.levee.levee_policy_engine_api().engine());
        must(api.call_export_snapshot(&mut self.store, e))
    }
    fn import_state(&mut self, bytes: &[u8]) -> Result<(), (String, String)> {
        let (e, api) = (self.engine, self.levee.levee_policy_engine_api().engine());
        must(api.call_import_state(&mut self.store, e, bytes)).map_err(|e| (e.path, e.message))
    }
    fn reload(&mut self, doc: &str) -> Result<(), Errors> {
        let (e, api) = (self.engine, self.levee.levee_policy_engine_api().engine());
        must(api.call_reload(&mut self.store, e, doc)).map_err(|v| v.into_iter().map(|e| (e.path, e.message)).collect())
    }
    fn fleet(&mut self, call: &crate::FleetCall) -> Result<crate::FleetOut, (String, String)> {
        self.fleet_call(call)
    }
    fn exec(&mut self, call: &ExecCall) -> Result<ExecOut, String> {
        self.exec_call(call)
    }
    fn durable(&mut self, call: &DurableCall) -> Result<DurableOut, (String, String)> {
        let (e, api) = (self.engine, self.levee.levee_policy_engine_api().engine());
        let st = &mut self.store;
        let r = match call {
            DurableCall::Begin { policy, key, idempotency_key, flags, wall_now } => {
                must(api.call_durable_begin(st, e, *policy, key, idempotency_key, *flags, *wall_now))
            }
            DurableCall::Step { record, owner, wall_now, elapsed } => {
                must(api.call_durable_step(st, e, record, owner, *wall_now, *elapsed))
            }
            DurableCall::Renew { record, owner, wall_now, elapsed } => {
                must(api.call_durable_renew(st, e, record, owner, *wall_now, *elapsed))
            }
            DurableCall::Outcome { record, owner, wall_now, elapsed, kind, code, text, message, flags } => {
                must(api.call_durable_outcome(st, e, record, owner, *wall_now, *elapsed, kind_in(*kind), *code, text, message, *flags))
            }
            DurableCall::Cancel { record, wall_now } => must(api.call_durable_cancel(st, e, record, *wall_now)),
            DurableCall::Revive { record, wall_now } => must(api.call_durable_revive(st, e, record, *wall_now)),
            DurableCall::Inspect { record } => {
                return must(api.call_durable_inspect(st, e, record)).map(DurableOut::Json).map_err(|e| (e.path, e.message))
            }
        };
        let s = r.map_err(|e| (e.path, e.message))?;
        let action = match s.action {
            wit::DurableAction::Run => "run",
            wit::DurableAction::Wait => "wait",
            wit::DurableAction::Done => "done",
            wit::DurableAction::Dead => "dead",
            wit::DurableAction::Cancelled => "cancelled",
        };
        let reason = [
            "none",
            "deadline",
            "retries-exhausted",
            "non-retryable",
            "non-idempotent",
            "retry-after-too-long",
            "pushback",
            "cancelled",
            "unknown-outcome",
            "crash-limit",
        ]
        .get(s.reason as usize)
        .copied()
        .unwrap_or("?");
        Ok(DurableOut::Step {
            action: action.to_string(),
            attempt: s.attempt,
            wait: s.wait,
            timeout: s.timeout,
            next_at: s.next_at,
            lease_until: s.lease_until,
            reason: reason.to_string(),
            policy_changed: s.policy_changed,
            bytes: s.bytes,
        })
    }
}

impl<const UNKEYED: bool> WasmWith<UNKEYED> {
    fn fleet_call(&mut self, call: &crate::FleetCall) -> Result<crate::FleetOut, (String, String)> {
        use crate::{FleetCall, FleetOut};
        let (e, api) = (self.engine, self.levee.levee_policy_engine_api().engine());
        let st = &mut self.store;
        let le = |e: wit::LoadError| (e.path, e.message);
        match call {
            FleetCall::Plan { policy } => Ok(FleetOut::Plan(must(api.call_fleet_plan(st, e, *policy)))),
            FleetCall::Sync { apply: false, policy, key, node, now, wall_ms, shared } => {
                must(api.call_fleet_merge(st, e, *policy, key, node, *now, *wall_ms, shared)).map(FleetOut::Bytes).map_err(le)
            }
            FleetCall::Sync { apply: true, policy, key, node, now, wall_ms, shared } => {
                must(api.call_fleet_apply(st, e, *policy, key, node, *now, *wall_ms, shared)).map(|()| FleetOut::Unit).map_err(le)
            }
            FleetCall::Inspect { shared } => must(api.call_fleet_inspect(st, e, shared)).map(FleetOut::Json).map_err(le),
        }
    }
}

/// Imports of the component, for the zero-import test.
pub fn component_imports() -> wasmtime::Result<usize> {
    let c = Compiled::new()?;
    Ok(c.component.component_type().imports(&c.engine).count())
}
