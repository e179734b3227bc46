//! The durable executor's decisions, sans I/O (issue 40).
//!
//! Each host's executor (Python, Go, JS, Rust) runs the same loop: claim due calls, write each
//! one's record before its attempt, run the handler under the attempt's timeout while renewing
//! the lease, write the outcome, sleep until the next call is due. The record's transitions
//! were the core's already ([`crate::durable`]); this machine takes the loop's own decisions,
//! its constants and its texts, so that a host keeps only its store's statements, the handler
//! dispatch, its timers and cancellation.
//!
//! The host feeds the machine what happened, with its monotonic clock (`now`, ns), and carries
//! out the [`Command`]s it answers, in order:
//!
//! | the host calls | after |
//! |---|---|
//! | [`Executor::poll`] | starting, waking (a submission, an attempt's end) or a `Sleep` ending |
//! | [`Executor::claimed`] | the store's `claim` statement returned rows (or failed: [`Executor::claim_failed`]) |
//! | [`Executor::written`] | a `Write` was applied, refused by the fence (lost) or failed |
//! | [`Executor::renew`] | a `Run`'s renewal timer fired |
//! | [`Executor::finished`] | a handler returned (or timed out) |
//! | [`Executor::next_due`] | the store's `next_due` statement answered |
//!
//! A call moves through: claimed → its record written (`running`, or a `wait` left to whoever
//! finds it due) → the handler run, the lease renewed every third of it (at least
//! [`RENEW_FLOOR`]) → the outcome written. A write the fence refuses means another process (or
//! an operator) holds the call now: the machine drops it, and answers `Abandon` for a running
//! handler. A write that fails leaves the call to be resumed when its claim or lease lapses.
//! A renewal that fails is tried again at the next tick until the lease would have run out.

use crate::durable::{Action, DurableStep, Record};
use crate::engine::Engine;
use crate::error::LoadError;
use crate::time::{MILLISECOND, SECOND};
use crate::types::OutcomeKind;

/// Calls one process runs at once, unless configured.
pub const DEFAULT_CONCURRENCY: u32 = 16;
/// The longest the executor sleeps before looking at the store again, unless configured.
pub const DEFAULT_POLL: u64 = SECOND;
/// How long a claim keeps calls out of other processes' due window until their record is
/// written, unless configured.
pub const DEFAULT_CLAIM_HOLD: u64 = 5 * SECOND;
/// The shortest interval between two renewals of a lease.
pub const RENEW_FLOOR: u64 = 50 * MILLISECOND;
/// Compare-and-set tries of an operator's cancel or retry against concurrent writers.
pub const OPERATOR_TRIES: u32 = 10;
/// The error message of an attempt the executor timed out.
pub const TIMEOUT_MESSAGE: &str = "the attempt timed out";
/// The error column of a call an operator cancelled.
pub const CANCELLED_MESSAGE: &str = "cancelled by an operator";

/// What the executor is configured with.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Config {
    /// This process's name in leases (unique per process).
    pub owner: String,
    /// Calls run at once (at least 1).
    pub concurrency: u32,
    /// The longest sleep between two looks at the store, ns.
    pub poll: u64,
    /// How long a claim holds the calls it returns, ns.
    pub claim_hold: u64,
    /// Answer [`Command::Idle`] once no call is pending or running (run until idle).
    pub until_idle: bool,
}

impl Config {
    /// The defaults, for `owner`.
    pub fn new(owner: &str) -> Config {
        Config {
            owner: owner.to_string(),
            concurrency: DEFAULT_CONCURRENCY,
            poll: DEFAULT_POLL,
            claim_hold: DEFAULT_CLAIM_HOLD,
            until_idle: false,
        }
    }
}

/// A row the store's `claim` statement returned.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Claimed {
    /// The call's id.
    pub id: i64,
    /// The handler's name.
    pub handler: String,
    /// The record as stored.
    pub record: Vec<u8>,
    /// The store's wall clock when the claim ran (ns since the Unix epoch).
    pub db_now: u64,
}

/// A row to write, fenced by this process's ownership (the store's `write` statement).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RowWrite {
    /// The status column (`running`, `scheduled`, `done`, `dead`, `cancelled`).
    pub status: &'static str,
    /// The due column (wall ns; 0 once finished).
    pub next_at: u64,
    /// The attempts column.
    pub attempts: u32,
    /// The record to store.
    pub record: Vec<u8>,
    /// Hold the lease: the lease-owner column is this process's name (else cleared).
    pub lease: bool,
    /// Store the handler's result (the call succeeded).
    pub result: bool,
    /// The error column (a call given up: its reason and last error).
    pub error: Option<String>,
}

/// How bad a [`Command::Log`] is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Level {
    /// Tried again by itself.
    Warn,
    /// Left to another look (a claim lapsing, the next poll).
    Error,
}

/// What the host does next.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Command {
    /// Run the store's `claim` for up to `limit` calls held for `hold` ns; then
    /// [`Executor::claimed`] (or [`Executor::claim_failed`]).
    Claim {
        /// Calls to claim at most.
        limit: u32,
        /// How long the claim holds them, ns.
        hold: u64,
    },
    /// Write call `id`'s row; then [`Executor::written`].
    Write {
        /// The call.
        id: i64,
        /// What to write.
        row: RowWrite,
    },
    /// Run attempt `attempt` of call `id` with the handler named in its row; cancel it after
    /// `timeout` ns (0 = none) and report [`Executor::finished`]; call [`Executor::renew`]
    /// every `renew_every` ns while it runs.
    Run {
        /// The call.
        id: i64,
        /// The attempt (counting the first).
        attempt: u32,
        /// The attempt's timeout, ns (0 = none).
        timeout: u64,
        /// The renewal period, ns.
        renew_every: u64,
    },
    /// Cancel call `id`'s running handler and forget it: the call is lost to another process
    /// (or its lease ran out); nothing is recorded.
    Abandon {
        /// The call.
        id: i64,
    },
    /// Set call `id`'s row aside with `error` (the store's `quarantine`).
    Quarantine {
        /// The call.
        id: i64,
        /// Why.
        error: String,
    },
    /// Ask the store when the next call is due; then [`Executor::next_due`].
    NextDue,
    /// Sleep until `until` (the host's monotonic clock, ns) or until woken; then
    /// [`Executor::poll`].
    Sleep {
        /// When to look again.
        until: u64,
    },
    /// Nothing is pending or running ([`Config::until_idle`]): stop.
    Idle,
    /// Report what no caller can be told.
    Log {
        /// How bad.
        level: Level,
        /// The call (0: none).
        id: i64,
        /// What happened.
        text: String,
    },
}

/// A write's fate.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Written {
    /// The row was written.
    Applied,
    /// The fence refused it: another process or an operator holds the call now.
    Lost,
    /// The store failed (its error).
    Failed(String),
}

/// What happened, for [`Executor::feed`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Event {
    /// Look at the store: at start, when woken, when a [`Command::Sleep`] ends.
    Poll,
    /// The claim returned these rows.
    Claimed(Vec<Claimed>),
    /// The claim failed with the store's error.
    ClaimFailed(String),
    /// The store's answer to [`Command::NextDue`]: due in this many ns (`None`: none pending).
    NextDue(Option<u64>),
    /// Call `id`'s write came to this.
    Written(i64, Written),
    /// Call `id`'s renewal timer fired.
    Renew(i64),
    /// Call `id`'s handler ended.
    Finished(i64, Finished),
}

/// What a handler's attempt came to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Finished {
    /// The outcome as for `report` (a timeout by the executor is [`OutcomeKind::Timeout`]).
    pub kind: OutcomeKind,
    /// Its code (HTTP status, gRPC code).
    pub code: i32,
    /// Its text (a Retry-After value, an error class).
    pub text: String,
    /// The error's message for the record (the core cuts it to 4,096 bytes; the timeout's own text
    /// when empty and `kind` is a timeout).
    pub message: String,
    /// The response was marked overloaded.
    pub overloaded: bool,
}

#[derive(Debug)]
enum Phase {
    /// The record the claim gave was written, or is being written.
    Begin(DurableStep),
    /// The handler runs.
    Running(Attempt),
    /// The outcome is being written.
    Ending,
}

#[derive(Debug)]
struct Attempt {
    /// The latest record and the monotonic time the core gave it (renewals change both).
    record: Vec<u8>,
    got: u64,
    /// The lease the core grants, ns, and when it runs out (monotonic).
    lease: u64,
    expires: u64,
    /// A renewal being written: its record and when it was asked for.
    renewing: Option<(Vec<u8>, u64)>,
    /// The outcome, held while a renewal is being written.
    outcome: Option<(Finished, u64)>,
}

#[derive(Debug)]
struct Call {
    /// The claim's store clock and when the claim was asked for (monotonic): the record's
    /// last-seen is `db_now`, so elapsed time counts from before the statement ran, and a
    /// retry may start late, never early.
    db_now: u64,
    got: u64,
    phase: Phase,
}

/// The executor machine of one process.
#[derive(Debug)]
pub struct Executor {
    config: Config,
    handlers: Vec<String>,
    /// The calls held, at most `concurrency` of them: a short list searched by id (it is
    /// bounded by the configuration, and every step that reads it also writes to a store).
    calls: Vec<(i64, Call)>,
    claiming: bool,
    /// When the claim in flight was asked for (monotonic).
    claim_at: u64,
}

impl Executor {
    /// A machine with `config`; a zero concurrency, poll or claim hold takes the default (an
    /// owner the core refuses is refused by the first step of a claimed call).
    pub fn new(mut config: Config) -> Executor {
        if config.concurrency == 0 {
            config.concurrency = DEFAULT_CONCURRENCY;
        }
        if config.poll == 0 {
            config.poll = DEFAULT_POLL;
        }
        if config.claim_hold == 0 {
            config.claim_hold = DEFAULT_CLAIM_HOLD;
        }
        Executor { config, handlers: Vec::new(), calls: Vec::new(), claiming: false, claim_at: 0 }
    }

    /// The configuration.
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// Let calls of handler `name` run in this process.
    pub fn register(&mut self, name: &str) {
        if !self.handlers.iter().any(|h| h == name) {
            self.handlers.push(name.to_string());
        }
    }

    /// Calls this process holds now (claimed, running or being written).
    pub fn running(&self) -> usize {
        self.calls.len()
    }

    /// What happened at `now` (the host's monotonic clock, ns): the commands to carry out, in
    /// order. `engine` runs the calls' policies.
    pub fn feed(&mut self, engine: &Engine, now: u64, event: Event) -> Vec<Command> {
        match event {
            Event::Poll => self.poll(now),
            Event::Claimed(rows) => self.claimed(engine, now, rows),
            Event::ClaimFailed(error) => self.claim_failed(now, &error),
            Event::NextDue(due_in) => self.next_due(now, due_in),
            Event::Written(id, w) => self.written(engine, id, now, w),
            Event::Renew(id) => self.renew(engine, id, now),
            Event::Finished(id, f) => self.finished(engine, id, now, f),
        }
    }

    fn call(&mut self, id: i64) -> Option<&mut Call> {
        self.calls.iter_mut().find(|(held, _)| *held == id).map(|(_, c)| c)
    }

    fn remove(&mut self, id: i64) {
        self.calls.retain(|(held, _)| *held != id);
    }

    /// Look at the store: claim as many calls as there are free slots, or ask when the next
    /// one is due.
    pub fn poll(&mut self, now: u64) -> Vec<Command> {
        if self.claiming {
            return Vec::new();
        }
        let free = (self.config.concurrency as usize).saturating_sub(self.calls.len());
        if free == 0 {
            return vec![Command::Sleep { until: now.saturating_add(self.config.poll) }];
        }
        self.claiming = true;
        self.claim_at = now;
        vec![Command::Claim { limit: free.min(u32::MAX as usize) as u32, hold: self.config.claim_hold }]
    }

    /// The claim failed: say so and look again after the poll interval.
    pub fn claim_failed(&mut self, now: u64, error: &str) -> Vec<Command> {
        self.claiming = false;
        vec![
            Command::Log { level: Level::Error, id: 0, text: format!("levee durable: claiming due calls: {error}") },
            Command::Sleep { until: now.saturating_add(self.config.poll) },
        ]
    }

    /// The claim returned `rows`: the first step of each (its record written before any
    /// attempt), then another claim while slots are free, else the next due time.
    pub fn claimed(&mut self, engine: &Engine, now: u64, rows: Vec<Claimed>) -> Vec<Command> {
        self.claiming = false;
        let any = !rows.is_empty();
        let mut out = Vec::new();
        for c in rows {
            if self.calls.iter().any(|(held, _)| *held == c.id) {
                continue; // already held here: a claim never returns a call its owner holds
            }
            if !self.handlers.contains(&c.handler) {
                let error = format!("handler: no durable handler named `{}` is registered", c.handler);
                out.push(Command::Quarantine { id: c.id, error });
                continue;
            }
            match engine.durable_step(&c.record, &self.config.owner, c.db_now, 0) {
                Ok(step) => {
                    out.push(Command::Write { id: c.id, row: row(&step, false) });
                    self.calls.push((c.id, Call { db_now: c.db_now, got: self.claim_at, phase: Phase::Begin(step) }));
                }
                Err(e) => out.push(Command::Quarantine { id: c.id, error: e.to_string() }),
            }
        }
        if any && self.calls.len() < self.config.concurrency as usize {
            out.extend(self.poll(now));
        } else {
            out.push(Command::NextDue);
        }
        out
    }

    /// The store's answer to `NextDue`: the next call is due in `due_in` ns (`None`: no call
    /// is pending).
    pub fn next_due(&mut self, now: u64, due_in: Option<u64>) -> Vec<Command> {
        match due_in {
            None if self.config.until_idle && self.calls.is_empty() => vec![Command::Idle],
            None => vec![Command::Sleep { until: now.saturating_add(self.config.poll) }],
            Some(d) => vec![Command::Sleep { until: now.saturating_add(d.min(self.config.poll)) }],
        }
    }

    /// Call `id`'s write came to `w`.
    pub fn written(&mut self, engine: &Engine, id: i64, now: u64, w: Written) -> Vec<Command> {
        let Some(call) = self.call(id) else { return Vec::new() };
        match &mut call.phase {
            Phase::Begin(step) => {
                if w != Written::Applied || step.action != Action::Run {
                    self.remove(id);
                    return ended(id, w, "writing a call");
                }
                let lease = step.lease_until.saturating_sub(call.db_now);
                let attempt = Attempt {
                    record: std::mem::take(&mut step.record),
                    got: call.got,
                    lease,
                    expires: call.got.saturating_add(lease),
                    renewing: None,
                    outcome: None,
                };
                let run = Command::Run { id, attempt: step.attempt, timeout: step.timeout, renew_every: RENEW_FLOOR.max(lease / 3) };
                call.phase = Phase::Running(attempt);
                vec![run]
            }
            Phase::Running(a) => {
                let Some((record, asked)) = a.renewing.take() else { return Vec::new() };
                let mut out = match w {
                    Written::Applied => {
                        a.record = record;
                        a.got = asked;
                        a.expires = asked.saturating_add(a.lease);
                        Vec::new()
                    }
                    Written::Lost => return self.abandon(id),
                    Written::Failed(e) if now >= a.expires => {
                        let mut out = vec![Command::Log {
                            level: Level::Error,
                            id,
                            text: format!("levee durable: renewing a lease: {e}; the lease ran out"),
                        }];
                        out.extend(self.abandon(id));
                        return out;
                    }
                    Written::Failed(e) => {
                        vec![Command::Log { level: Level::Warn, id, text: format!("levee durable: renewing a lease: {e}") }]
                    }
                };
                if let Some((f, at)) = a.outcome.take() {
                    out.extend(self.finished(engine, id, at, f));
                }
                out
            }
            Phase::Ending => {
                self.remove(id);
                ended(id, w, "writing a call")
            }
        }
    }

    /// Call `id`'s renewal timer fired: extend its lease, unless a renewal is still being
    /// written or the lease ran out.
    pub fn renew(&mut self, engine: &Engine, id: i64, now: u64) -> Vec<Command> {
        let owner = self.config.owner.clone();
        let Some(call) = self.call(id) else { return Vec::new() };
        let Phase::Running(a) = &mut call.phase else { return Vec::new() };
        if a.renewing.is_some() || a.outcome.is_some() {
            return Vec::new();
        }
        match engine.durable_renew(&a.record, &owner, call.db_now, now.saturating_sub(a.got)) {
            Ok(step) => {
                a.renewing = Some((step.record.clone(), now));
                vec![Command::Write { id, row: row(&step, false) }]
            }
            Err(_) => self.abandon(id),
        }
    }

    /// Call `id`'s handler came to `f` at `now`: the outcome is written (after a renewal being
    /// written, if any).
    pub fn finished(&mut self, engine: &Engine, id: i64, now: u64, mut f: Finished) -> Vec<Command> {
        let owner = self.config.owner.clone();
        let Some(call) = self.call(id) else { return Vec::new() };
        let Phase::Running(a) = &mut call.phase else { return Vec::new() };
        if a.renewing.is_some() {
            a.outcome = Some((f, now));
            return Vec::new();
        }
        if f.kind == OutcomeKind::Timeout && f.message.is_empty() {
            f.message = TIMEOUT_MESSAGE.to_string();
        }
        let flags = if f.overloaded { crate::durable::FLAG_OVERLOADED } else { 0 };
        let elapsed = now.saturating_sub(a.got);
        match engine.durable_outcome(&a.record, &owner, call.db_now, elapsed, f.kind, f.code, &f.text, &f.message, flags) {
            Ok(step) => {
                call.phase = Phase::Ending;
                vec![Command::Write { id, row: row(&step, step.action == Action::Done) }]
            }
            Err(e) => {
                self.remove(id);
                vec![Command::Quarantine { id, error: e.to_string() }]
            }
        }
    }

    /// Forget call `id` (the host stopped its handler): its row stays as it was written, to be
    /// resumed by whichever process finds it once its lease lapses.
    pub fn forget(&mut self, id: i64) {
        self.remove(id);
    }

    fn abandon(&mut self, id: i64) -> Vec<Command> {
        self.remove(id);
        vec![Command::Abandon { id }]
    }
}

/// The row a step writes (`result`: store the handler's result).
fn row(step: &DurableStep, result: bool) -> RowWrite {
    RowWrite {
        status: status(step.action),
        next_at: step.next_at,
        attempts: step.attempt,
        record: step.record.clone(),
        lease: step.action == Action::Run,
        result,
        error: (step.action == Action::Dead).then(|| dead_reason(step)),
    }
}

/// A write that ended the machine's part in a call: nothing for `Applied` or `Lost` (another
/// process holds it now), a log line for a failure (the call is resumed when its claim lapses).
fn ended(id: i64, w: Written, what: &str) -> Vec<Command> {
    match w {
        Written::Failed(e) => {
            vec![Command::Log { level: Level::Error, id, text: format!("levee durable: {what}: {e}; it is resumed when its claim lapses") }]
        }
        Written::Applied | Written::Lost => Vec::new(),
    }
}

/// The status column for an action.
pub fn status(action: Action) -> &'static str {
    match action {
        Action::Run => "running",
        Action::Wait => "scheduled",
        Action::Done => "done",
        Action::Dead => "dead",
        Action::Cancelled => "cancelled",
    }
}

/// The error column of a call given up: its reason, then its last error as the record holds it.
pub fn dead_reason(step: &DurableStep) -> String {
    let reason = step.reason.name();
    match Record::decode(&step.record) {
        Ok(r) => format!("{reason}: attempt {} failed with `{}`: {}", r.error_attempt, r.error_class, r.error_message),
        Err(_) => reason.to_string(),
    }
}

/// What an operator's cancel or retry writes, compare-and-set against the record read: the
/// status, due time, attempts, record and error column ([`CANCELLED_MESSAGE`] for a cancel).
/// `Err`: the call is finished already, or its record is not one the core can use (the
/// operator's answer is "not changed", not a fault).
pub fn operator_write(step: Result<DurableStep, LoadError>) -> Result<RowWrite, LoadError> {
    let step = step?;
    Ok(RowWrite {
        status: status(step.action),
        next_at: step.next_at,
        attempts: step.attempt,
        error: (step.action == Action::Cancelled).then(|| CANCELLED_MESSAGE.to_string()),
        record: step.record,
        lease: false,
        result: false,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const T0: u64 = 1_800_000_000 * SECOND;
    const DOC: &str = "policies:\n  p:\n    attempts: 2\n    backoff: { kind: constant, base: 2s, cap: 2s, jitter: none }\n";

    fn engine() -> Engine {
        match Engine::load(DOC, 7) {
            Ok(e) => e,
            Err(errs) => panic!("{errs:?}"),
        }
    }

    /// A submitted call's record, as the store holds it.
    fn submitted(e: &mut Engine) -> Vec<u8> {
        match e.durable_begin(0, "", "", 0, T0) {
            Ok(s) => s.record,
            Err(err) => panic!("{err}"),
        }
    }

    fn machine(concurrency: u32) -> Executor {
        let mut x = Executor::new(Config { concurrency, until_idle: true, ..Config::new("w1") });
        x.register("send");
        x
    }

    fn claimed(id: i64, handler: &str, record: Vec<u8>) -> Claimed {
        Claimed { id, handler: handler.to_string(), record, db_now: T0 }
    }

    fn success() -> Finished {
        Finished { kind: OutcomeKind::Success, code: 0, text: String::new(), message: String::new(), overloaded: false }
    }

    fn timeout() -> Finished {
        Finished { kind: OutcomeKind::Timeout, ..success() }
    }

    /// The `Write` of `out` (exactly one command).
    fn write(out: &[Command]) -> (i64, RowWrite) {
        match out {
            [Command::Write { id, row }] => (*id, row.clone()),
            other => panic!("not one write: {other:?}"),
        }
    }

    /// Claim and run call 1 to its `Run`: (the machine's commands at the claim, at the write).
    fn started(e: &mut Engine, x: &mut Executor) -> Vec<Command> {
        let rec = submitted(e);
        assert_eq!(x.poll(0), vec![Command::Claim { limit: x.config().concurrency, hold: DEFAULT_CLAIM_HOLD }]);
        let out = x.claimed(e, 10, vec![claimed(1, "send", rec)]);
        let Some(Command::Write { id: 1, row }) = out.first() else { panic!("{out:?}") };
        assert_eq!((row.status, row.attempts, row.lease, row.next_at), ("running", 1, true, T0 + 30 * SECOND));
        x.written(e, 1, 20, Written::Applied)
    }

    #[test]
    fn a_call_is_claimed_written_run_and_its_success_written_with_the_result() {
        let mut e = engine();
        let mut x = machine(1);
        let run = started(&mut e, &mut x);
        // A third of the 30 s lease between renewals; no timeout in this policy.
        assert_eq!(run, vec![Command::Run { id: 1, attempt: 1, timeout: 0, renew_every: 10 * SECOND }]);
        assert_eq!(x.poll(30), vec![Command::Sleep { until: 30 + DEFAULT_POLL }], "no free slot: no claim");
        let (id, row) = write(&x.finished(&e, 1, 40, success()));
        assert_eq!((id, row.status, row.next_at, row.lease, row.result, row.error), (1, "done", 0, false, true, None));
        assert!(x.written(&e, 1, 50, Written::Applied).is_empty());
        assert_eq!(x.running(), 0);
        assert_eq!(x.poll(60), vec![Command::Claim { limit: 1, hold: DEFAULT_CLAIM_HOLD }]);
        assert_eq!(x.claimed(&e, 70, vec![]), vec![Command::NextDue]);
        assert_eq!(x.next_due(80, None), vec![Command::Idle]);
    }

    #[test]
    fn a_failure_is_scheduled_and_the_last_one_gives_up_with_its_reason() {
        let mut e = engine();
        let mut x = machine(4);
        started(&mut e, &mut x);
        let (_, row) = write(&x.finished(&e, 1, 5 * MILLISECOND, timeout()));
        assert_eq!((row.status, row.lease, row.error), ("scheduled", false, None));
        assert!(row.next_at > T0 + 2 * SECOND, "{}", row.next_at);
        assert!(x.written(&e, 1, 6 * MILLISECOND, Written::Applied).is_empty());
        // The claim the free slots started finds nothing more.
        assert_eq!(x.claimed(&e, 7 * MILLISECOND, vec![]), vec![Command::NextDue]);
        // Found due by a later claim: the second and last attempt, which fails too.
        assert_eq!(x.poll(3 * SECOND), vec![Command::Claim { limit: 4, hold: DEFAULT_CLAIM_HOLD }]);
        let mut due = claimed(1, "send", row.record);
        due.db_now = row.next_at;
        let (_, running) = write(&x.claimed(&e, 3 * SECOND, vec![due]).split_off(0)[..1]);
        assert_eq!((running.status, running.attempts), ("running", 2));
        assert!(matches!(x.written(&e, 1, 3 * SECOND, Written::Applied)[..], [Command::Run { attempt: 2, .. }]));
        let (_, dead) = write(&x.finished(&e, 1, 4 * SECOND, timeout()));
        assert_eq!(dead.status, "dead");
        assert_eq!(dead.error.as_deref(), Some("retries-exhausted: attempt 2 failed with `timeout`: the attempt timed out"));
        // An error class the policy never retries gives up at once, with the handler's message.
        let mut y = machine(1);
        started(&mut e, &mut y);
        let failed = Finished { kind: OutcomeKind::ErrorClass, text: "io".into(), message: "connection reset".into(), ..success() };
        let (_, dead) = write(&y.finished(&e, 1, SECOND, failed));
        assert_eq!(dead.error.as_deref(), Some("non-retryable: attempt 1 failed with `io`: connection reset"));
    }

    #[test]
    fn an_unknown_handler_or_a_bad_record_is_quarantined_with_its_reason() {
        let mut e = engine();
        let mut x = machine(4);
        x.poll(0);
        let rec = submitted(&mut e);
        let out = x.claimed(&e, 1, vec![claimed(1, "other", rec), claimed(2, "send", b"LVDR?".to_vec())]);
        let [Command::Quarantine { id: 1, error: a }, Command::Quarantine { id: 2, error: b }, Command::Claim { .. }] = &out[..] else {
            panic!("{out:?}")
        };
        assert_eq!(a, "handler: no durable handler named `other` is registered");
        assert!(b.starts_with("record"), "{b}");
        assert_eq!(x.running(), 0);
    }

    #[test]
    fn a_write_lost_drops_the_call_and_a_write_failed_is_logged() {
        let mut e = engine();
        let mut x = machine(4);
        x.poll(0);
        let (r1, r2) = (submitted(&mut e), submitted(&mut e));
        x.claimed(&e, 1, vec![claimed(1, "send", r1), claimed(2, "send", r2)]);
        assert!(x.written(&e, 1, 2, Written::Lost).is_empty());
        let out = x.written(&e, 2, 2, Written::Failed("disk full".into()));
        assert_eq!(
            out,
            vec![Command::Log {
                level: Level::Error,
                id: 2,
                text: "levee durable: writing a call: disk full; it is resumed when its claim lapses".into()
            }]
        );
        assert_eq!(x.running(), 0);
    }

    #[test]
    fn the_lease_is_renewed_and_a_renewal_lost_or_run_out_abandons_the_attempt() {
        let mut e = engine();
        let mut x = machine(4);
        started(&mut e, &mut x);
        // Renewed 10 s after the claim was asked for: the lease runs from there.
        let (_, row) = write(&x.renew(&e, 1, 10 * SECOND));
        assert_eq!((row.status, row.lease, row.next_at), ("running", true, T0 + 40 * SECOND));
        assert!(x.renew(&e, 1, 10 * SECOND + 1).is_empty(), "one renewal at a time");
        assert!(x.written(&e, 1, 10 * SECOND, Written::Applied).is_empty());
        // A renewal that fails is tried again while the lease lasts, then abandoned.
        write(&x.renew(&e, 1, 20 * SECOND));
        let out = x.written(&e, 1, 20 * SECOND, Written::Failed("timeout".into()));
        assert!(matches!(&out[..], [Command::Log { level: Level::Warn, .. }]), "{out:?}");
        write(&x.renew(&e, 1, 41 * SECOND));
        let out = x.written(&e, 1, 41 * SECOND, Written::Failed("timeout".into()));
        assert!(matches!(&out[..], [Command::Log { level: Level::Error, .. }, Command::Abandon { id: 1 }]), "{out:?}");
        assert_eq!(x.running(), 0);
        // Lost to another owner: abandoned at once.
        let mut y = machine(4);
        started(&mut e, &mut y);
        write(&y.renew(&e, 1, 10 * SECOND));
        assert_eq!(y.written(&e, 1, 10 * SECOND, Written::Lost), vec![Command::Abandon { id: 1 }]);
    }

    #[test]
    fn an_outcome_during_a_renewal_waits_for_it_and_uses_the_renewed_record() {
        let mut e = engine();
        let mut x = machine(4);
        started(&mut e, &mut x);
        write(&x.renew(&e, 1, 10 * SECOND));
        assert!(x.finished(&e, 1, 11 * SECOND, success()).is_empty());
        let (_, row) = write(&x.written(&e, 1, 12 * SECOND, Written::Applied));
        assert_eq!((row.status, row.result), ("done", true));
    }

    #[test]
    fn a_zero_in_the_configuration_takes_the_default() {
        let x = Executor::new(Config { concurrency: 0, poll: 0, claim_hold: 0, ..Config::new("w") });
        let c = x.config();
        assert_eq!((c.concurrency, c.poll, c.claim_hold), (DEFAULT_CONCURRENCY, DEFAULT_POLL, DEFAULT_CLAIM_HOLD));
    }

    #[test]
    fn next_due_sleeps_at_most_the_poll_interval() {
        let mut x = machine(1);
        assert_eq!(x.next_due(5, Some(SECOND / 4)), vec![Command::Sleep { until: 5 + SECOND / 4 }]);
        assert_eq!(x.next_due(5, Some(60 * SECOND)), vec![Command::Sleep { until: 5 + DEFAULT_POLL }]);
        x.config.until_idle = false;
        assert_eq!(x.next_due(5, None), vec![Command::Sleep { until: 5 + DEFAULT_POLL }]);
        let out = x.claim_failed(7, "connection refused");
        assert_eq!(out.get(1), Some(&Command::Sleep { until: 7 + DEFAULT_POLL }));
    }

    #[test]
    fn an_operator_cancel_writes_its_message_and_a_finished_call_is_refused() {
        let mut e = engine();
        let rec = submitted(&mut e);
        let w = match operator_write(e.durable_cancel(&rec, T0)) {
            Ok(w) => w,
            Err(err) => panic!("{err}"),
        };
        assert_eq!((w.status, w.error.as_deref()), ("cancelled", Some(CANCELLED_MESSAGE)));
        assert!(operator_write(e.durable_cancel(&w.record, T0)).is_err());
    }
}
