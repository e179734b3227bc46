//! The `executor` resource: one `levee_core::durable_exec::Executor`, converted and forwarded.

use std::cell::RefCell;

use crate::exports::levee::policy::engine_api::{EngineBorrow, GuestExecutor};
use crate::exports::levee::policy::types as wit;
use crate::{load_error, EngineResource};
use levee_core::durable_exec as x;

/// The `executor` resource.
pub struct ExecutorResource(RefCell<x::Executor>);

fn engine<'a>(e: &'a EngineBorrow<'_>) -> std::cell::Ref<'a, levee_core::Engine> {
    e.get::<EngineResource>().get()
}

fn row(id: i64, w: x::RowWrite) -> wit::RowWrite {
    wit::RowWrite {
        id,
        status: w.status.to_string(),
        next_at: w.next_at,
        attempts: w.attempts,
        bytes: w.record,
        lease: w.lease,
        keep_result: w.result,
        error: w.error,
    }
}

fn commands(out: Vec<x::Command>) -> Vec<wit::ExecCommand> {
    use x::Command as C;
    out.into_iter()
        .map(|c| match c {
            C::Claim { limit, hold } => wit::ExecCommand::Claim(wit::ExecClaim { limit, hold }),
            C::Write { id, row: w } => wit::ExecCommand::Write(row(id, w)),
            C::Run { id, attempt, timeout, renew_every } => wit::ExecCommand::Run(wit::ExecRun { id, attempt, timeout, renew_every }),
            C::Abandon { id } => wit::ExecCommand::Abandon(id),
            C::Quarantine { id, error } => wit::ExecCommand::Quarantine(wit::ExecQuarantine { id, error }),
            C::NextDue => wit::ExecCommand::NextDue,
            C::Sleep { until } => wit::ExecCommand::Sleep(until),
            C::Idle => wit::ExecCommand::Idle,
            C::Log { level, id, text } => wit::ExecCommand::Log(wit::ExecLog {
                level: match level {
                    x::Level::Warn => wit::LogLevel::Warn,
                    x::Level::Error => wit::LogLevel::Error,
                },
                id,
                text,
            }),
        })
        .collect()
}

fn event(e: wit::ExecEvent) -> x::Event {
    use wit::ExecEvent as E;
    match e {
        E::Poll => x::Event::Poll,
        E::Claimed(rows) => x::Event::Claimed(
            rows.into_iter().map(|r| x::Claimed { id: r.id, handler: r.handler, record: r.bytes, db_now: r.db_now }).collect(),
        ),
        E::ClaimFailed(error) => x::Event::ClaimFailed(error),
        E::NextDue(due_in) => x::Event::NextDue(due_in),
        E::Written(w) => x::Event::Written(
            w.id,
            match w.result {
                wit::WriteResult::Applied => x::Written::Applied,
                wit::WriteResult::Lost => x::Written::Lost,
                wit::WriteResult::Failed(error) => x::Written::Failed(error),
            },
        ),
        E::Renew(id) => x::Event::Renew(id),
        E::Finished(f) => x::Event::Finished(
            f.id,
            x::Finished {
                kind: f.kind.into(),
                code: f.code,
                text: f.text,
                message: f.message,
                overloaded: f.flags & levee_core::durable::FLAG_OVERLOADED != 0,
            },
        ),
    }
}

impl GuestExecutor for ExecutorResource {
    fn new(config: wit::ExecutorConfig) -> ExecutorResource {
        ExecutorResource(RefCell::new(x::Executor::new(x::Config {
            owner: config.owner,
            concurrency: config.concurrency,
            poll: config.poll,
            claim_hold: config.claim_hold,
            until_idle: config.until_idle,
        })))
    }

    fn register(&self, name: String) {
        self.0.borrow_mut().register(&name);
    }

    fn running(&self) -> u32 {
        self.0.borrow().running().min(u32::MAX as usize) as u32
    }

    fn feed(&self, e: EngineBorrow<'_>, now: u64, ev: wit::ExecEvent) -> Vec<wit::ExecCommand> {
        commands(self.0.borrow_mut().feed(&engine(&e), now, event(ev)))
    }

    fn forget(&self, id: i64) {
        self.0.borrow_mut().forget(id);
    }

    fn operator(e: EngineBorrow<'_>, id: i64, bytes: Vec<u8>, revive: bool, wall_now: u64) -> Result<wit::RowWrite, wit::LoadError> {
        let engine = engine(&e);
        let step = if revive { engine.durable_revive(&bytes, wall_now) } else { engine.durable_cancel(&bytes, wall_now) };
        x::operator_write(step).map(|w| row(id, w)).map_err(load_error)
    }
}
