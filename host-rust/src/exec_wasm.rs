// The durable executor's machine through the component (included in `raw::wasm`, which owns the
// instance): the `executor` resource's methods, its events converted to the WIT's types and its
// commands back to the core's, checked on the way (a status, level or renewal period the WIT
// cannot mean is a malformed answer, hence a trap).

use levee_core::durable_exec as dx;

fn exec_config(c: &dx::Config) -> wit::ExecutorConfig {
    wit::ExecutorConfig {
        owner: c.owner.clone(),
        concurrency: c.concurrency,
        poll: c.poll,
        claim_hold: c.claim_hold,
        until_idle: c.until_idle,
    }
}

fn exec_event(e: dx::Event) -> wit::ExecEvent {
    match e {
        dx::Event::Poll => wit::ExecEvent::Poll,
        dx::Event::Claimed(rows) => wit::ExecEvent::Claimed(
            rows.into_iter()
                .map(|c| wit::ClaimedCall { id: c.id, handler: c.handler, bytes: c.record, db_now: c.db_now })
                .collect(),
        ),
        dx::Event::ClaimFailed(error) => wit::ExecEvent::ClaimFailed(error),
        dx::Event::NextDue(due_in) => wit::ExecEvent::NextDue(due_in),
        dx::Event::Written(id, w) => wit::ExecEvent::Written(wit::ExecWritten {
            id,
            result: match w {
                dx::Written::Applied => wit::WriteResult::Applied,
                dx::Written::Lost => wit::WriteResult::Lost,
                dx::Written::Failed(e) => wit::WriteResult::Failed(e),
            },
        }),
        dx::Event::Renew(id) => wit::ExecEvent::Renew(id),
        dx::Event::Finished(id, f) => wit::ExecEvent::Finished(wit::ExecFinished {
            id,
            kind: kind_in(f.kind),
            code: f.code,
            text: f.text,
            message: f.message,
            flags: if f.overloaded { levee_core::durable::FLAG_OVERLOADED } else { 0 },
        }),
    }
}

/// A row from the guest: its status must be one the core writes.
fn row_of(r: wit::RowWrite) -> Result<dx::RowWrite, String> {
    use levee_core::durable::Action;
    let status = [Action::Run, Action::Wait, Action::Done, Action::Dead, Action::Cancelled]
        .into_iter()
        .map(dx::status)
        .find(|s| *s == r.status)
        .ok_or_else(|| format!("a row to write with status `{}`", r.status))?;
    Ok(dx::RowWrite {
        status,
        next_at: r.next_at,
        attempts: r.attempts,
        record: r.bytes,
        lease: r.lease,
        result: r.keep_result,
        error: r.error,
    })
}

fn exec_command(c: wit::ExecCommand) -> Result<dx::Command, String> {
    Ok(match c {
        wit::ExecCommand::Claim(c) => dx::Command::Claim { limit: c.limit, hold: c.hold },
        wit::ExecCommand::Write(r) => dx::Command::Write { id: r.id, row: row_of(r)? },
        wit::ExecCommand::Run(r) => {
            if r.renew_every == 0 {
                return Err(format!("a run of call {} renewed every 0 ns", r.id));
            }
            dx::Command::Run { id: r.id, attempt: r.attempt, timeout: r.timeout, renew_every: r.renew_every }
        }
        wit::ExecCommand::Abandon(id) => dx::Command::Abandon { id },
        wit::ExecCommand::Quarantine(q) => dx::Command::Quarantine { id: q.id, error: q.error },
        wit::ExecCommand::NextDue => dx::Command::NextDue,
        wit::ExecCommand::Sleep(until) => dx::Command::Sleep { until },
        wit::ExecCommand::Idle => dx::Command::Idle,
        wit::ExecCommand::Log(l) => dx::Command::Log {
            level: match l.level {
                wit::LogLevel::Warn => dx::Level::Warn,
                wit::LogLevel::Error => dx::Level::Error,
            },
            id: l.id,
            text: l.text,
        },
    })
}

impl Instance {
    /// The `executor` constructor, then `register` of each handler.
    pub(crate) fn executor_new(&mut self, config: &dx::Config, handlers: &[String]) -> Result<ResourceAny, String> {
        self.store.set_epoch_deadline(self.limits.call_ticks);
        let x = self.levee.levee_policy_engine_api().executor().call_constructor(&mut self.store, &exec_config(config)).map_err(msg)?;
        self.executor_register(x, handlers)?;
        Ok(x)
    }

    pub(crate) fn executor_register(&mut self, x: ResourceAny, handlers: &[String]) -> Result<(), String> {
        for h in handlers {
            self.store.set_epoch_deadline(self.limits.call_ticks);
            self.levee.levee_policy_engine_api().executor().call_register(&mut self.store, x, h).map_err(msg)?;
        }
        Ok(())
    }

    pub(crate) fn executor_feed(&mut self, x: ResourceAny, now: u64, event: dx::Event) -> Result<Vec<dx::Command>, String> {
        let bytes = match &event {
            dx::Event::Claimed(rows) => rows.iter().map(|c| c.record.len()).sum(),
            dx::Event::Finished(_, f) => f.message.len(),
            _ => 0,
        };
        self.store.set_epoch_deadline(self.limits.work_ticks(bytes));
        let engine = self.handle;
        let commands =
            self.levee.levee_policy_engine_api().executor().call_feed(&mut self.store, x, engine, now, &exec_event(event)).map_err(msg)?;
        commands.into_iter().map(exec_command).collect()
    }

    pub(crate) fn executor_forget(&mut self, x: ResourceAny, id: i64) -> Result<(), String> {
        self.store.set_epoch_deadline(self.limits.call_ticks);
        self.levee.levee_policy_engine_api().executor().call_forget(&mut self.store, x, id).map_err(msg)
    }

    pub(crate) fn executor_running(&mut self, x: ResourceAny) -> Result<u32, String> {
        self.store.set_epoch_deadline(self.limits.call_ticks);
        self.levee.levee_policy_engine_api().executor().call_running(&mut self.store, x).map_err(msg)
    }

    pub(crate) fn executor_operator(
        &mut self,
        id: i64,
        record: &[u8],
        revive: bool,
        wall_now: u64,
    ) -> Result<Result<dx::RowWrite, LoadError>, String> {
        self.store.set_epoch_deadline(self.limits.work_ticks(record.len()));
        let engine = self.handle;
        let r = self
            .levee
            .levee_policy_engine_api()
            .executor()
            .call_operator(&mut self.store, engine, id, record, revive, wall_now)
            .map_err(msg)?;
        match r {
            Ok(row) if row.id != id => Err(format!("an operator's row names call {} for call {id}", row.id)),
            Ok(row) => Ok(Ok(row_of(row)?)),
            Err(e) => Ok(Err(load_error(e))),
        }
    }

    /// Drop an executor resource (a failure leaves it to the instance).
    pub(crate) fn executor_drop(&mut self, x: ResourceAny) {
        self.store.set_epoch_deadline(self.limits.call_ticks);
        let _ = x.resource_drop(&mut self.store);
    }
}
