// The `durable-*` functions through the component (included in `raw::wasm`, which owns the
// instance): the guest's answers are converted to the core's types, checked on the way (an
// enum the WIT does not have is a malformed answer, hence a trap).

fn durable_step_of(s: wit::DurableStep) -> levee_core::durable::DurableStep {
    use levee_core::durable::{Action, DurableReason as R};
    levee_core::durable::DurableStep {
        action: match s.action {
            wit::DurableAction::Run => Action::Run,
            wit::DurableAction::Wait => Action::Wait,
            wit::DurableAction::Done => Action::Done,
            wit::DurableAction::Dead => Action::Dead,
            wit::DurableAction::Cancelled => Action::Cancelled,
        },
        attempt: s.attempt,
        wait: s.wait,
        timeout: s.timeout,
        next_at: s.next_at,
        lease_until: s.lease_until,
        reason: match s.reason {
            wit::DurableReason::None => R::None,
            wit::DurableReason::Deadline => R::Deadline,
            wit::DurableReason::RetriesExhausted => R::RetriesExhausted,
            wit::DurableReason::NonRetryable => R::NonRetryable,
            wit::DurableReason::NonIdempotent => R::NonIdempotent,
            wit::DurableReason::RetryAfterTooLong => R::RetryAfterTooLong,
            wit::DurableReason::Pushback => R::Pushback,
            wit::DurableReason::Cancelled => R::Cancelled,
            wit::DurableReason::UnknownOutcome => R::UnknownOutcome,
            wit::DurableReason::CrashLimit => R::CrashLimit,
        },
        policy_changed: s.policy_changed,
        record: s.bytes,
    }
}

type DurableAnswer = Result<Result<levee_core::durable::DurableStep, LoadError>, String>;

impl Instance {
    pub(crate) fn durable_begin(&mut self, policy: u32, key: &str, idem: &str, flags: u32, wall_now: u64) -> DurableAnswer {
        Ok(call!(self, call_ticks, call_durable_begin(policy, key, idem, flags, wall_now))?.map(durable_step_of).map_err(load_error))
    }

    pub(crate) fn durable_step(&mut self, record: &[u8], owner: &str, wall_now: u64, elapsed: u64) -> DurableAnswer {
        Ok(call!(self, work(record.len()), call_durable_step(record, owner, wall_now, elapsed))?.map(durable_step_of).map_err(load_error))
    }

    pub(crate) fn durable_renew(&mut self, record: &[u8], owner: &str, wall_now: u64, elapsed: u64) -> DurableAnswer {
        Ok(call!(self, work(record.len()), call_durable_renew(record, owner, wall_now, elapsed))?.map(durable_step_of).map_err(load_error))
    }

    #[allow(clippy::too_many_arguments)]
    pub(crate) fn durable_outcome(
        &mut self,
        record: &[u8],
        owner: &str,
        wall_now: u64,
        elapsed: u64,
        kind: OutcomeKind,
        code: i32,
        text: &str,
        message: &str,
        flags: u32,
    ) -> DurableAnswer {
        let r = call!(
            self,
            work(record.len().saturating_add(message.len())),
            call_durable_outcome(record, owner, wall_now, elapsed, kind_in(kind), code, text, message, flags)
        )?;
        Ok(r.map(durable_step_of).map_err(load_error))
    }

    pub(crate) fn durable_cancel(&mut self, record: &[u8], wall_now: u64) -> DurableAnswer {
        Ok(call!(self, work(record.len()), call_durable_cancel(record, wall_now))?.map(durable_step_of).map_err(load_error))
    }

    pub(crate) fn durable_revive(&mut self, record: &[u8], wall_now: u64) -> DurableAnswer {
        Ok(call!(self, work(record.len()), call_durable_revive(record, wall_now))?.map(durable_step_of).map_err(load_error))
    }

    pub(crate) fn durable_inspect(&mut self, record: &[u8]) -> Result<Result<String, LoadError>, String> {
        Ok(call!(self, work(record.len()), call_durable_inspect(record))?.map_err(load_error))
    }
}
