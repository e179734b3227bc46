//! The Levee policy component: `levee-core` behind `wit/levee.wit`, nothing else.
//!
//! Built for `wasm32-unknown-unknown` and encoded as a component by `levee-build`; it has
//! zero imports. Every function converts between the WIT types and `levee-core`'s and
//! forwards; no decision is made here.

use std::cell::{Cell, RefCell};
use std::rc::Rc;

// SAFETY: the component is single-threaded wasm; talc's wasm allocator grows linear memory itself.
#[cfg(target_family = "wasm")]
#[global_allocator]
static ALLOCATOR: talc::TalckWasm = unsafe { talc::TalckWasm::new_global() };

use exports::levee::policy::engine_api::{Engine as EngineHandle, Guest, GuestEngine};
use exports::levee::policy::types as wit;
use levee_core as core;

mod executor;

wit_bindgen::generate!({
    world: "levee",
    path: "../../wit",
});

// Native builds (clippy, `cargo test --workspace`) compile and check this layer, but only the
// wasm build exports it: the canonical-ABI export names (`levee:policy/engine-api@0.1.0#...`)
// are not valid symbols in a native linker's version script.
#[cfg_attr(not(target_arch = "wasm32"), allow(dead_code))]
struct Component;

/// The `engine` resource: one `levee_core::Engine`, also reachable by its id (`start-unkeyed`).
pub struct EngineResource {
    id: u32,
    engine: Rc<RefCell<core::Engine>>,
}

/// The live engines by id, for the functions that name an engine by its id instead of a
/// borrowed handle. An instance holds one engine or a few: a short list searched in order.
struct Engines {
    live: RefCell<Vec<(u32, Rc<RefCell<core::Engine>>)>>,
    last_id: Cell<u32>,
}

// A component instance is single-threaded: its globals are per thread, of which it has one.
thread_local! {
    static ENGINES: Engines = const { Engines { live: RefCell::new(Vec::new()), last_id: Cell::new(0) } };
}

impl EngineResource {
    fn new(engine: core::Engine) -> EngineResource {
        let engine = Rc::new(RefCell::new(engine));
        ENGINES.with(|all| {
            let mut live = all.live.borrow_mut();
            // Ids count up from 1; only after 2^32 - 1 loads do they come round again, and then
            // an id still in use is skipped.
            let mut id = all.last_id.get();
            loop {
                id = id.wrapping_add(1).max(1);
                if !live.iter().any(|(used, _)| *used == id) {
                    break;
                }
            }
            all.last_id.set(id);
            live.push((id, Rc::clone(&engine)));
            EngineResource { id, engine }
        })
    }

    fn get(&self) -> std::cell::Ref<'_, core::Engine> {
        self.engine.borrow()
    }

    fn get_mut(&self) -> std::cell::RefMut<'_, core::Engine> {
        self.engine.borrow_mut()
    }
}

impl Drop for EngineResource {
    fn drop(&mut self) {
        let id = self.id;
        ENGINES.with(|all| all.live.borrow_mut().retain(|(live, _)| *live != id));
    }
}

impl Guest for Component {
    type Engine = EngineResource;
    type Executor = executor::ExecutorResource;

    fn start_unkeyed(
        engine: u32,
        call: u64,
        policy: u32,
        flags: u32,
        now: u64,
        settle_call: u64,
        settle_at: u64,
        settle_elapsed: u64,
    ) -> u64 {
        ENGINES.with(|all| match all.live.borrow().iter().find(|(id, _)| *id == engine) {
            Some((_, e)) => e.borrow_mut().start(call, policy, "", flags, now, settle_call, settle_at, settle_elapsed).0,
            None => core::Verdict::invalid(core::InvalidCode::UnknownEngine).0,
        })
    }
}

fn load_error(e: core::LoadError) -> wit::LoadError {
    wit::LoadError { path: e.path, message: e.message }
}

macro_rules! convert_enum {
    ($from:ty => $to:ty { $($v:ident),* $(,)? }) => {
        impl From<$from> for $to {
            fn from(x: $from) -> $to {
                match x { $(<$from>::$v => <$to>::$v,)* }
            }
        }
    };
}

struct Conv;
impl Conv {
    fn reason(r: core::Reason) -> wit::Reason {
        use core::Reason as R;
        match r {
            R::None => wit::Reason::None,
            R::Deadline => wit::Reason::Deadline,
            R::RetriesExhausted => wit::Reason::RetriesExhausted,
            R::NonRetryable => wit::Reason::NonRetryable,
            R::Budget => wit::Reason::Budget,
            R::BreakerOpen => wit::Reason::BreakerOpen,
            R::RateLimited => wit::Reason::RateLimited,
            R::BulkheadFull => wit::Reason::BulkheadFull,
            R::NonIdempotent => wit::Reason::NonIdempotent,
            R::RetryAfterTooLong => wit::Reason::RetryAfterTooLong,
            R::Pushback => wit::Reason::Pushback,
            R::Cancelled => wit::Reason::Cancelled,
            R::FallbacksFailed => wit::Reason::FallbacksFailed,
        }
    }
    fn state(s: core::BreakerState) -> wit::BreakerState {
        use core::BreakerState as S;
        match s {
            S::Closed => wit::BreakerState::Closed,
            S::Open => wit::BreakerState::Open,
            S::HalfOpen => wit::BreakerState::HalfOpen,
            S::ForcedOpen => wit::BreakerState::ForcedOpen,
            S::ForcedClosed => wit::BreakerState::ForcedClosed,
            S::Disabled => wit::BreakerState::Disabled,
        }
    }
    fn state_in(s: wit::BreakerState) -> core::BreakerState {
        use core::BreakerState as S;
        match s {
            wit::BreakerState::Closed => S::Closed,
            wit::BreakerState::Open => S::Open,
            wit::BreakerState::HalfOpen => S::HalfOpen,
            wit::BreakerState::ForcedOpen => S::ForcedOpen,
            wit::BreakerState::ForcedClosed => S::ForcedClosed,
            wit::BreakerState::Disabled => S::Disabled,
        }
    }
    fn hedge(commands: Vec<core::HedgeCommand>, events_pending: bool) -> wit::HedgeAnswer {
        use core::HedgeCommand as C;
        let commands = commands
            .into_iter()
            .map(|c| match c {
                C::Start { attempt, timeout } => wit::HedgeCommand::Start(wit::HedgeStart { attempt, timeout }),
                C::Cancel { attempt } => wit::HedgeCommand::Cancel(attempt),
                C::Wait { delay } => wit::HedgeCommand::Wait(delay),
                C::End { attempt, verdict } => wit::HedgeCommand::End(wit::HedgeEnd { attempt, verdict: verdict.0 }),
            })
            .collect();
        wit::HedgeAnswer { commands, events_pending }
    }

    fn kind(k: core::EventKind) -> wit::EventKind {
        use core::EventKind as K;
        match k {
            K::RetryScheduled => wit::EventKind::RetryScheduled,
            K::GaveUp => wit::EventKind::GaveUp,
            K::Rejected => wit::EventKind::Rejected,
            K::BudgetRefused => wit::EventKind::BudgetRefused,
            K::BreakerTransition => wit::EventKind::BreakerTransition,
            K::FallbackChosen => wit::EventKind::FallbackChosen,
            K::RateLimitWait => wit::EventKind::RateLimitWait,
            K::KeyEvicted => wit::EventKind::KeyEvicted,
            K::KeyOverflow => wit::EventKind::KeyOverflow,
            K::CallEvicted => wit::EventKind::CallEvicted,
            K::PermitExpired => wit::EventKind::PermitExpired,
            K::HedgeStarted => wit::EventKind::HedgeStarted,
        }
    }
}

fn durable(r: Result<core::durable::DurableStep, core::LoadError>) -> Result<wit::DurableStep, wit::LoadError> {
    use core::durable::{Action as A, DurableReason as R};
    let s = r.map_err(load_error)?;
    Ok(wit::DurableStep {
        action: match s.action {
            A::Run => wit::DurableAction::Run,
            A::Wait => wit::DurableAction::Wait,
            A::Done => wit::DurableAction::Done,
            A::Dead => wit::DurableAction::Dead,
            A::Cancelled => wit::DurableAction::Cancelled,
        },
        attempt: s.attempt,
        wait: s.wait,
        timeout: s.timeout,
        next_at: s.next_at,
        lease_until: s.lease_until,
        reason: match s.reason {
            R::None => wit::DurableReason::None,
            R::Deadline => wit::DurableReason::Deadline,
            R::RetriesExhausted => wit::DurableReason::RetriesExhausted,
            R::NonRetryable => wit::DurableReason::NonRetryable,
            R::NonIdempotent => wit::DurableReason::NonIdempotent,
            R::RetryAfterTooLong => wit::DurableReason::RetryAfterTooLong,
            R::Pushback => wit::DurableReason::Pushback,
            R::Cancelled => wit::DurableReason::Cancelled,
            R::UnknownOutcome => wit::DurableReason::UnknownOutcome,
            R::CrashLimit => wit::DurableReason::CrashLimit,
        },
        policy_changed: s.policy_changed,
        bytes: s.record,
    })
}

convert_enum!(wit::OutcomeKind => core::OutcomeKind { Success, Timeout, ConnectionError, HttpStatus, GrpcStatus, ErrorClass });

impl GuestEngine for EngineResource {
    fn load(document: String, seed: u64) -> Result<EngineHandle, Vec<wit::LoadError>> {
        core::Engine::load(&document, seed)
            .map(|e| EngineHandle::new(EngineResource::new(e)))
            .map_err(|errs| errs.into_iter().map(load_error).collect())
    }

    fn reload(&self, document: String) -> Result<(), Vec<wit::LoadError>> {
        self.get_mut().reload(&document).map_err(|errs| errs.into_iter().map(load_error).collect())
    }

    fn policy_count(&self) -> u32 {
        self.get().policy_count()
    }

    fn policy_index(&self, name: String) -> Option<u32> {
        self.get().policy_index(&name)
    }

    fn policy_info(&self, policy: u32) -> Option<wit::PolicyInfo> {
        self.get().policy_info(policy).map(|i| wit::PolicyInfo {
            name: i.name,
            max_attempts: i.max_attempts,
            attempt_timeout: i.attempt_timeout,
            deadline: i.deadline,
            fallbacks: i.fallbacks,
        })
    }

    fn policy_json(&self, policy: u32) -> Option<String> {
        self.get().policy_json(policy)
    }

    fn analyze(&self, policy: u32, layers: u32) -> Option<wit::Analysis> {
        self.get().analyze(policy, layers).map(|a| wit::Analysis {
            worst_attempts: a.worst_attempts,
            worst_latency: a.worst_latency,
            amplification: a.amplification,
            amplification_with_budget: a.amplification_with_budget,
        })
    }

    fn start(
        &self,
        call: u64,
        policy: u32,
        key: String,
        flags: u32,
        now: u64,
        settle_call: u64,
        settle_at: u64,
        settle_elapsed: u64,
    ) -> u64 {
        self.get_mut().start(call, policy, &key, flags, now, settle_call, settle_at, settle_elapsed).0
    }

    fn id(&self) -> u32 {
        self.id
    }

    fn acquire(&self, call: u64, now: u64) -> u64 {
        self.get_mut().acquire(call, now).0
    }

    fn report(
        &self,
        call: u64,
        now: u64,
        elapsed: u64,
        kind: wit::OutcomeKind,
        code: i32,
        text: String,
        wall_secs: u64,
        flags: u32,
    ) -> u64 {
        self.get_mut().report(call, now, elapsed, kind.into(), code, &text, wall_secs, flags).0
    }

    fn report_fallback(&self, call: u64, now: u64, ok: bool) -> u64 {
        self.get_mut().report_fallback(call, now, ok).0
    }

    fn hedge_step(&self, call: u64, now: u64) -> wit::HedgeAnswer {
        let mut engine = self.get_mut();
        let commands = engine.hedge_step(call, now);
        Conv::hedge(commands, engine.has_events())
    }

    #[allow(clippy::too_many_arguments)]
    fn report_attempt(
        &self,
        call: u64,
        attempt: u32,
        now: u64,
        elapsed: u64,
        kind: wit::OutcomeKind,
        code: i32,
        text: String,
        wall_secs: u64,
        flags: u32,
    ) -> wit::HedgeAnswer {
        let mut engine = self.get_mut();
        let commands = engine.report_attempt(call, attempt, now, elapsed, kind.into(), code, &text, wall_secs, flags);
        Conv::hedge(commands, engine.has_events())
    }

    fn cancel(&self, call: u64, now: u64) {
        self.get_mut().cancel(call, now)
    }

    fn take_wakes(&self) -> Vec<u64> {
        self.get_mut().take_wakes()
    }

    fn call_info(&self, call: u64) -> Option<wit::CallInfo> {
        self.get().call_info(call).map(|c| wit::CallInfo {
            policy: c.policy,
            key: c.key,
            attempts: c.attempts,
            deadline: c.deadline,
            last_reason: Conv::reason(c.last_reason),
            in_flight: c.in_flight,
        })
    }

    fn drain_events(&self) -> Vec<wit::Event> {
        self.get_mut()
            .drain_events()
            .into_iter()
            .map(|e| wit::Event {
                at: e.at,
                kind: Conv::kind(e.kind),
                policy: e.policy,
                key: e.key,
                call: e.call,
                attempt: e.attempt,
                reason: Conv::reason(e.reason),
                duration: e.duration,
                state_from: Conv::state(e.state_from),
                state_to: Conv::state(e.state_to),
                name: e.name,
                value: e.value,
            })
            .collect()
    }

    fn breaker_state(&self, policy: u32, key: String, now: u64) -> Option<wit::BreakerState> {
        self.get().breaker_state(policy, &key, now).map(Conv::state)
    }

    fn set_breaker_state(&self, policy: u32, key: String, state: wit::BreakerState, now: u64) -> Result<(), String> {
        self.get_mut().set_breaker_state(policy, &key, Conv::state_in(state), now)
    }

    fn export_state(&self) -> Vec<u8> {
        self.get().export_state()
    }

    fn export_snapshot(&self) -> Vec<u8> {
        self.get().export_snapshot()
    }

    fn import_state(&self, state: Vec<u8>) -> Result<(), wit::LoadError> {
        self.get_mut().import_state(&state).map_err(load_error)
    }

    fn export_state_page(&self, cursor: u64, snapshot: bool) -> wit::StatePage {
        let page = self.get_mut().export_state_page(cursor, snapshot);
        wit::StatePage { bytes: page.bytes, next: page.next }
    }

    fn import_state_begin(&self) {
        self.get_mut().import_state_begin()
    }

    fn import_state_page(&self, bytes: Vec<u8>) -> Result<(), wit::LoadError> {
        self.get_mut().import_state_page(&bytes).map_err(load_error)
    }

    fn import_state_end(&self) -> Result<(), wit::LoadError> {
        self.get_mut().import_state_end().map_err(load_error)
    }

    fn durable_begin(
        &self,
        policy: u32,
        key: String,
        idempotency_key: String,
        flags: u32,
        wall_now: u64,
    ) -> Result<wit::DurableStep, wit::LoadError> {
        durable(self.get_mut().durable_begin(policy, &key, &idempotency_key, flags, wall_now))
    }

    fn durable_step(&self, record: Vec<u8>, owner: String, wall_now: u64, elapsed: u64) -> Result<wit::DurableStep, wit::LoadError> {
        durable(self.get().durable_step(&record, &owner, wall_now, elapsed))
    }

    fn durable_renew(&self, record: Vec<u8>, owner: String, wall_now: u64, elapsed: u64) -> Result<wit::DurableStep, wit::LoadError> {
        durable(self.get().durable_renew(&record, &owner, wall_now, elapsed))
    }

    fn durable_outcome(
        &self,
        record: Vec<u8>,
        owner: String,
        wall_now: u64,
        elapsed: u64,
        kind: wit::OutcomeKind,
        code: i32,
        text: String,
        message: String,
        flags: u32,
    ) -> Result<wit::DurableStep, wit::LoadError> {
        durable(self.get().durable_outcome(&record, &owner, wall_now, elapsed, kind.into(), code, &text, &message, flags))
    }

    fn durable_cancel(&self, record: Vec<u8>, wall_now: u64) -> Result<wit::DurableStep, wit::LoadError> {
        durable(self.get().durable_cancel(&record, wall_now))
    }

    fn durable_revive(&self, record: Vec<u8>, wall_now: u64) -> Result<wit::DurableStep, wit::LoadError> {
        durable(self.get().durable_revive(&record, wall_now))
    }

    fn durable_inspect(&self, record: Vec<u8>) -> Result<String, wit::LoadError> {
        core::durable::inspect(&record).map_err(load_error)
    }

    fn fleet_plan(&self, policy: u32) -> Option<String> {
        self.get().fleet_plan(policy)
    }

    fn fleet_merge(
        &self,
        policy: u32,
        key: String,
        node: String,
        now: u64,
        wall_ms: u64,
        shared: Vec<u8>,
    ) -> Result<Vec<u8>, wit::LoadError> {
        self.get_mut().fleet_merge(policy, &key, &node, now, wall_ms, &shared).map_err(load_error)
    }

    fn fleet_apply(&self, policy: u32, key: String, node: String, now: u64, wall_ms: u64, shared: Vec<u8>) -> Result<(), wit::LoadError> {
        self.get_mut().fleet_apply(policy, &key, &node, now, wall_ms, &shared).map_err(load_error)
    }

    fn fleet_inspect(&self, shared: Vec<u8>) -> Result<String, wit::LoadError> {
        core::Engine::fleet_inspect(&shared).map_err(load_error)
    }
}

#[cfg(target_arch = "wasm32")]
export!(Component);
