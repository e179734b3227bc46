//! Durable calls: a call record that survives a process restart, and every decision about it.
//!
//! A host persists the record (SQLite, PostgreSQL) **before** each attempt and **after** each
//! outcome; the core decides everything else, including what a record found after a crash
//! means. The record is bytes in a fixed, versioned, little-endian layout, so a record written
//! by one host is byte-for-byte what any other host would write and can be resumed by it.
//!
//! # Clocks
//! Stored times are **wall-clock** nanoseconds since the Unix epoch, taken from one authority
//! where there is one (PostgreSQL's `now()`; the host's clock for an SQLite file). Every
//! operation takes `wall_now` and a monotonic `elapsed` since the host last held these bytes
//! (0 for bytes just read from the store), and works at
//! `now = max(wall_now, last_seen + elapsed)`: a wall clock that went backwards never moves a
//! call back in time, and between two operations in one process only the monotonic clock
//! counts. The wait left on restore is `next_at - now`, clamped to `[0, the policy's largest
//! delay]` (the larger of `backoff.cap` and `retry-after.cap`), so a record written by a host
//! whose clock ran ahead never sleeps longer than the policy ever would.
//!
//! # Crashes
//! A record found `running` has an attempt whose outcome nobody knows: the process died
//! during it, or between its outcome and the write. It counts as a crash. It is retried only
//! when the operation is idempotent or carries an idempotency key (reason `unknown-outcome`
//! otherwise), and `durable.max-crashes` crashes give the call up as a poison call
//! (`crash-limit`). A live lease of another owner is never taken over.
//!
//! # Record layout, version 1
//! | offset | size | field |
//! |---|---|---|
//! | 0 | 4 | magic `LVDR` |
//! | 4 | 1 | version, 1 |
//! | 5 | 1 | state: 0 scheduled, 1 running, 2 done, 3 dead, 4 cancelled |
//! | 6 | 1 | reason ([`DurableReason`]), 0 unless dead or cancelled |
//! | 7 | 1 | flags: bit 0 the operation is not idempotent; other bits zero |
//! | 8 | 4 | attempts started (u32) |
//! | 12 | 4 | failures (u32) |
//! | 16 | 4 | crashes (u32) |
//! | 20 | 8 | first-at (u64 wall ns) |
//! | 28 | 8 | next-at (0 once finished) |
//! | 36 | 8 | deadline-at (0 = none) |
//! | 44 | 8 | last wall time seen |
//! | 52 | 8 | lease-until (0 = no lease) |
//! | 60 | 8 | previous delay (decorrelated backoff) |
//! | 68 | 32 | the jitter generator's position: xoshiro256** words s0..s3 |
//! | 100 | 8 | FNV-1a 64 of the policy's definition (its JSON with every default) |
//! | 108 | 8 | last error: at |
//! | 116 | 4 | last error: attempt (0 = no error yet) |
//! | 120 | 4 | attempts started when the last server-directed delay was used (0 = none): the backoff restarts there |
//! | 124 | .. | six strings, each a u16 length and UTF-8 bytes: policy name (1-128), key (<= 4096), idempotency key (<= 1024), lease owner (<= 256), last error class (<= 256), last error message (<= 4096) |
//! | end-8 | 8 | FNV-1a 64 of every byte before it |
//!
//! Integers are little-endian. Arithmetic on counts and times saturates.

use crate::doc::{obj, to_json, Value};
use crate::engine::Engine;
use crate::error::LoadError;
use crate::policy::Policy;
use crate::retry::{self, BackoffState, Decision, Failure};
use crate::retry_after::ServerDelay;
use crate::rng::Rng;
use crate::time::SECOND;
use crate::types::{OutcomeKind, Reason};

/// The record format version this core writes and reads.
pub const VERSION: u8 = 1;
const MAGIC: &[u8; 4] = b"LVDR";
const FIXED: usize = 124;
const LIMITS: [(&str, usize); 6] =
    [("policy", 128), ("key", 4096), ("idempotency-key", 1024), ("lease-owner", 256), ("error-class", 256), ("error-message", 4096)];

/// `begin` flag: the operation is not idempotent (retried only with an idempotency key).
pub const FLAG_NON_IDEMPOTENT: u32 = 1;
pub use crate::classify::{FLAG_CALLER_NO_RETRY, FLAG_CALLER_RETRY, FLAG_OVERLOADED};

/// Where a durable call is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum State {
    /// Waiting for `next_at`.
    Scheduled = 0,
    /// An attempt was started and its outcome is not recorded yet.
    Running = 1,
    /// Succeeded.
    Done = 2,
    /// Given up (the reason says why).
    Dead = 3,
    /// Cancelled by an operator or the caller.
    Cancelled = 4,
}

impl State {
    const ALL: [State; 5] = [State::Scheduled, State::Running, State::Done, State::Dead, State::Cancelled];
    /// Name in inspections.
    pub fn name(self) -> &'static str {
        match self {
            State::Scheduled => "scheduled",
            State::Running => "running",
            State::Done => "done",
            State::Dead => "dead",
            State::Cancelled => "cancelled",
        }
    }
    fn finished(self) -> bool {
        matches!(self, State::Done | State::Dead | State::Cancelled)
    }
}

/// Why a durable call ended. Numbered as the WIT's `durable-reason`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum DurableReason {
    /// Not ended, or succeeded.
    None = 0,
    /// The wall-clock deadline passed, or the next retry could not start before it.
    Deadline = 1,
    /// The last allowed attempt failed.
    RetriesExhausted = 2,
    /// The outcome is classified as never to be retried.
    NonRetryable = 3,
    /// Retryable, but the operation is not idempotent and has no idempotency key.
    NonIdempotent = 4,
    /// The server asked for a wait above the policy's `retry-after.cap`.
    RetryAfterTooLong = 5,
    /// gRPC pushback said not to retry.
    Pushback = 6,
    /// Cancelled.
    Cancelled = 7,
    /// A process died during an attempt of a non-idempotent call without an idempotency key:
    /// whether it took effect is unknown, so it is not run again.
    UnknownOutcome = 8,
    /// The call's attempts were cut off by process deaths `durable.max-crashes` times.
    CrashLimit = 9,
}

impl DurableReason {
    const ALL: [DurableReason; 10] = [
        DurableReason::None,
        DurableReason::Deadline,
        DurableReason::RetriesExhausted,
        DurableReason::NonRetryable,
        DurableReason::NonIdempotent,
        DurableReason::RetryAfterTooLong,
        DurableReason::Pushback,
        DurableReason::Cancelled,
        DurableReason::UnknownOutcome,
        DurableReason::CrashLimit,
    ];
    /// Name in the WIT, vectors and inspections.
    pub fn name(self) -> &'static str {
        match self {
            DurableReason::None => "none",
            DurableReason::Deadline => "deadline",
            DurableReason::RetriesExhausted => "retries-exhausted",
            DurableReason::NonRetryable => "non-retryable",
            DurableReason::NonIdempotent => "non-idempotent",
            DurableReason::RetryAfterTooLong => "retry-after-too-long",
            DurableReason::Pushback => "pushback",
            DurableReason::Cancelled => "cancelled",
            DurableReason::UnknownOutcome => "unknown-outcome",
            DurableReason::CrashLimit => "crash-limit",
        }
    }
}

/// What the host does next.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Action {
    /// Run attempt `attempt` now, under `timeout` (0 = none), holding the lease until
    /// `lease_until`. The record (state running) must be persisted first.
    Run,
    /// Persist the record and sleep `wait` on the monotonic clock (or leave the call to
    /// whichever process finds it due at `next_at`), then `step` again.
    Wait,
    /// The call succeeded.
    Done,
    /// The call was given up: `reason` says why; the record holds the last error.
    Dead,
    /// The call was cancelled.
    Cancelled,
}

/// The core's answer to a durable operation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DurableStep {
    /// What to do.
    pub action: Action,
    /// For `run`, the attempt starting (counting the first); otherwise the attempts started.
    pub attempt: u32,
    /// For `wait`, nanoseconds to sleep on the monotonic clock.
    pub wait: u64,
    /// For `run`, the attempt's timeout in ns (0 = none; already bounded by the deadline).
    pub timeout: u64,
    /// When the call is next due, wall ns (the store's index column); 0 once finished, and
    /// for `run` the time the lease expires (the attempt's deadline for a rescue).
    pub next_at: u64,
    /// When the lease expires (wall ns), 0 when no lease is held.
    pub lease_until: u64,
    /// Why the call ended (`dead`, `cancelled`), else `none`.
    pub reason: DurableReason,
    /// The policy's definition differs from the one the record last ran under (a reload
    /// changed it); the call goes on under the new one.
    pub policy_changed: bool,
    /// The record to persist.
    pub record: Vec<u8>,
}

/// A decoded durable call record (see the module documentation for the layout).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Record {
    /// Where the call is.
    pub state: State,
    /// Why it ended.
    pub reason: DurableReason,
    /// The operation is not idempotent.
    pub non_idempotent: bool,
    /// Attempts started.
    pub attempts: u32,
    /// Attempts that failed (reported outcomes other than success).
    pub failures: u32,
    /// Attempts cut off by a process death.
    pub crashes: u32,
    /// When the call was submitted.
    pub first_at: u64,
    /// When it is next due (0 once finished).
    pub next_at: u64,
    /// Its deadline (0 = none).
    pub deadline_at: u64,
    /// The latest wall time any operation saw.
    pub last_seen: u64,
    /// When the lease expires (0 = none).
    pub lease_until: u64,
    /// The previous retry delay (decorrelated backoff; 0 after a server-directed delay).
    pub prev_delay: u64,
    /// Attempts started when the last server-directed delay was used (0 = none): the backoff
    /// counts its retries from there (`crate::retry::BackoffState`).
    pub backoff_from: u32,
    /// The jitter generator's position.
    pub rng: [u64; 4],
    /// FNV-1a 64 of the policy definition the record last ran under.
    pub policy_hash: u64,
    /// When the last error happened.
    pub error_at: u64,
    /// The attempt of the last error (0 = none yet).
    pub error_attempt: u32,
    /// The policy's name.
    pub policy: String,
    /// The key (such as a downstream host).
    pub key: String,
    /// The idempotency key ("" = none).
    pub idempotency_key: String,
    /// Who holds the lease ("" = nobody).
    pub lease_owner: String,
    /// The last error's class (`timeout`, `http:503`, an exception type, `crash`).
    pub error_class: String,
    /// The last error's message.
    pub error_message: String,
}

/// FNV-1a, 64 bits.
pub fn fnv1a64(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in bytes {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// The hash of a policy's definition recorded in its durable calls.
pub fn policy_hash(p: &Policy) -> u64 {
    fnv1a64(crate::policy::to_json(p).as_bytes())
}

fn err(path: &str, message: impl Into<String>) -> LoadError {
    LoadError::new(path, message)
}

struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], LoadError> {
        let end = self
            .at
            .checked_add(n)
            .filter(|e| *e <= self.bytes.len())
            .ok_or_else(|| err("record", format!("is truncated: {} bytes, more needed at offset {}", self.bytes.len(), self.at)))?;
        let out = self.bytes.get(self.at..end).ok_or_else(|| err("record", "is truncated"))?;
        self.at = end;
        Ok(out)
    }
    fn u8(&mut self) -> Result<u8, LoadError> {
        Ok(self.take(1)?.first().copied().unwrap_or(0))
    }
    fn u32(&mut self) -> Result<u32, LoadError> {
        let mut a = [0u8; 4];
        a.copy_from_slice(self.take(4)?);
        Ok(u32::from_le_bytes(a))
    }
    fn u64(&mut self) -> Result<u64, LoadError> {
        let mut a = [0u8; 8];
        a.copy_from_slice(self.take(8)?);
        Ok(u64::from_le_bytes(a))
    }
    fn string(&mut self, field: &str, limit: usize) -> Result<String, LoadError> {
        let mut a = [0u8; 2];
        a.copy_from_slice(self.take(2)?);
        let n = usize::from(u16::from_le_bytes(a));
        if n > limit {
            return Err(err(&format!("record.{field}"), format!("is {n} bytes long, above its limit of {limit}")));
        }
        let raw = self.take(n)?;
        core::str::from_utf8(raw).map(str::to_string).map_err(|_| err(&format!("record.{field}"), "is not valid UTF-8"))
    }
}

impl Record {
    /// Decode and check a record. Every error names what is wrong; nothing panics.
    pub fn decode(bytes: &[u8]) -> Result<Record, LoadError> {
        if bytes.len() < 5 || bytes.get(..4) != Some(MAGIC.as_slice()) {
            return Err(err("record", "is not a Levee durable call record (no `LVDR` magic)"));
        }
        let version = bytes.get(4).copied().unwrap_or(0);
        if version != VERSION {
            return Err(err("record.version", format!("is {version}; this core reads version {VERSION} records only")));
        }
        let Some(body_len) = bytes.len().checked_sub(8).filter(|n| *n >= FIXED) else {
            return Err(err("record", format!("is truncated: {} bytes, a record has at least {}", bytes.len(), FIXED + 20)));
        };
        let (body, sum) = bytes.split_at(body_len);
        let mut a = [0u8; 8];
        a.copy_from_slice(sum);
        if fnv1a64(body) != u64::from_le_bytes(a) {
            return Err(err("record", "is corrupt: its checksum does not match its contents"));
        }
        let mut r = Reader { bytes: body, at: 5 };
        let state = r.u8()?;
        let state = *State::ALL.get(usize::from(state)).ok_or_else(|| err("record.state", format!("{state} is not a state")))?;
        let reason = r.u8()?;
        let reason =
            *DurableReason::ALL.get(usize::from(reason)).ok_or_else(|| err("record.reason", format!("{reason} is not a reason")))?;
        let flags = r.u8()?;
        if flags & !1 != 0 {
            return Err(err("record.flags", format!("has unknown bits set ({flags:#04x})")));
        }
        let mut rec = Record {
            state,
            reason,
            non_idempotent: flags & 1 != 0,
            attempts: r.u32()?,
            failures: r.u32()?,
            crashes: r.u32()?,
            first_at: r.u64()?,
            next_at: r.u64()?,
            deadline_at: r.u64()?,
            last_seen: r.u64()?,
            lease_until: r.u64()?,
            prev_delay: r.u64()?,
            rng: [r.u64()?, r.u64()?, r.u64()?, r.u64()?],
            policy_hash: r.u64()?,
            error_at: r.u64()?,
            error_attempt: r.u32()?,
            backoff_from: r.u32()?,
            policy: String::new(),
            key: String::new(),
            idempotency_key: String::new(),
            lease_owner: String::new(),
            error_class: String::new(),
            error_message: String::new(),
        };
        let mut strings = Vec::with_capacity(6);
        for (field, limit) in LIMITS {
            strings.push(r.string(field, limit)?);
        }
        if r.at != body.len() {
            return Err(err("record", format!("has {} unexpected bytes after its last field", body.len() - r.at)));
        }
        let mut it = strings.into_iter();
        rec.policy = it.next().unwrap_or_default();
        rec.key = it.next().unwrap_or_default();
        rec.idempotency_key = it.next().unwrap_or_default();
        rec.lease_owner = it.next().unwrap_or_default();
        rec.error_class = it.next().unwrap_or_default();
        rec.error_message = it.next().unwrap_or_default();
        if rec.policy.is_empty() {
            return Err(err("record.policy", "is empty"));
        }
        Ok(rec)
    }

    /// The canonical bytes of this record (decode then encode is the identity).
    pub fn encode(&self) -> Vec<u8> {
        let strings = [&self.policy, &self.key, &self.idempotency_key, &self.lease_owner, &self.error_class, &self.error_message];
        let mut out = Vec::with_capacity(FIXED + 8 + 12 + strings.iter().map(|s| s.len()).sum::<usize>());
        out.extend_from_slice(MAGIC);
        out.push(VERSION);
        out.push(self.state as u8);
        out.push(self.reason as u8);
        out.push(u8::from(self.non_idempotent));
        for v in [self.attempts, self.failures, self.crashes] {
            out.extend_from_slice(&v.to_le_bytes());
        }
        for v in [self.first_at, self.next_at, self.deadline_at, self.last_seen, self.lease_until, self.prev_delay] {
            out.extend_from_slice(&v.to_le_bytes());
        }
        for v in self.rng {
            out.extend_from_slice(&v.to_le_bytes());
        }
        out.extend_from_slice(&self.policy_hash.to_le_bytes());
        out.extend_from_slice(&self.error_at.to_le_bytes());
        out.extend_from_slice(&self.error_attempt.to_le_bytes());
        out.extend_from_slice(&self.backoff_from.to_le_bytes());
        for (s, (_, limit)) in strings.iter().zip(LIMITS) {
            // Lengths are checked where strings enter; a longer one is cut at a char boundary.
            let s = truncate(s, limit);
            out.extend_from_slice(&(s.len() as u16).to_le_bytes());
            out.extend_from_slice(s.as_bytes());
        }
        let sum = fnv1a64(&out);
        out.extend_from_slice(&sum.to_le_bytes());
        out
    }

    /// The operation may run again after an unknown outcome.
    pub fn idempotent(&self) -> bool {
        !self.non_idempotent || !self.idempotency_key.is_empty()
    }

    /// The record as canonical JSON (fixed key order, no whitespace, integers exact).
    pub fn to_json(&self) -> String {
        let hex = |v: u64| Value::from(format!("{v:016x}"));
        let last_error = if self.error_attempt == 0 && self.error_class.is_empty() {
            Value::Null
        } else {
            obj([
                ("class", self.error_class.as_str().into()),
                ("message", self.error_message.as_str().into()),
                ("at", self.error_at.into()),
                ("attempt", self.error_attempt.into()),
            ])
        };
        to_json(&obj([
            ("version", u64::from(VERSION).into()),
            ("state", self.state.name().into()),
            ("reason", self.reason.name().into()),
            ("policy", self.policy.as_str().into()),
            ("policy-hash", hex(self.policy_hash)),
            ("key", self.key.as_str().into()),
            ("idempotency-key", self.idempotency_key.as_str().into()),
            ("non-idempotent", self.non_idempotent.into()),
            ("attempts", self.attempts.into()),
            ("failures", self.failures.into()),
            ("crashes", self.crashes.into()),
            ("first-at", self.first_at.into()),
            ("next-at", self.next_at.into()),
            ("deadline-at", self.deadline_at.into()),
            ("last-seen", self.last_seen.into()),
            ("lease-owner", self.lease_owner.as_str().into()),
            ("lease-until", self.lease_until.into()),
            ("prev-delay", self.prev_delay.into()),
            ("backoff-from", self.backoff_from.into()),
            ("rng", Value::List(self.rng.iter().map(|w| hex(*w)).collect())),
            ("last-error", last_error),
        ]))
    }
}

/// Decode a record and describe it as canonical JSON (for status pages and `levee durable`).
pub fn inspect(record: &[u8]) -> Result<String, LoadError> {
    Record::decode(record).map(|r| r.to_json())
}

fn truncate(s: &str, limit: usize) -> &str {
    if s.len() <= limit {
        return s;
    }
    let mut end = limit;
    while end > 0 && !s.is_char_boundary(end) {
        end -= 1;
    }
    s.get(..end).unwrap_or("")
}

fn check_len(path: &str, s: &str, limit: usize) -> Result<(), LoadError> {
    if s.len() > limit {
        return Err(err(path, format!("is {} bytes long, above its limit of {limit}", s.len())));
    }
    Ok(())
}

/// The longest wait the policy can ever ask for: a wait read back from a record never exceeds it.
pub fn largest_delay(p: &Policy) -> u64 {
    let server = if p.retry_after.honor { p.retry_after.cap } else { 0 };
    p.backoff.cap.max(server)
}

fn class_of(kind: OutcomeKind, code: i32, text: &str) -> String {
    match kind {
        OutcomeKind::Success => "success".to_string(),
        OutcomeKind::Timeout => "timeout".to_string(),
        OutcomeKind::ConnectionError => "connection-error".to_string(),
        OutcomeKind::HttpStatus => format!("http:{code}"),
        OutcomeKind::GrpcStatus => format!("grpc:{code}"),
        OutcomeKind::ErrorClass => truncate(text, 256).to_string(),
    }
}

struct Open<'p> {
    rec: Record,
    policy: &'p Policy,
    now: u64,
    changed: bool,
}

impl Engine {
    fn durable_open(&self, record: &[u8], wall_now: u64, elapsed: u64) -> Result<Open<'_>, LoadError> {
        let mut rec = Record::decode(record)?;
        let policy = self.policy_index(&rec.policy).and_then(|i| self.policy(i)).ok_or_else(|| {
            err("record.policy", format!("`{}` is not a policy of the loaded document (removed by a reload?)", rec.policy))
        })?;
        let hash = policy_hash(policy);
        let changed = hash != rec.policy_hash;
        rec.policy_hash = hash;
        let now = wall_now.max(rec.last_seen.saturating_add(elapsed));
        rec.last_seen = now;
        Ok(Open { rec, policy, now, changed })
    }

    /// Begin a durable call under policy `policy` (an index) at wall time `wall_now`.
    /// `flags`: bit 0 the operation is not idempotent. The answer is `wait` 0: persist the
    /// record, then `durable_step` it.
    pub fn durable_begin(
        &mut self,
        policy: u32,
        key: &str,
        idempotency_key: &str,
        flags: u32,
        wall_now: u64,
    ) -> Result<DurableStep, LoadError> {
        let p = self.policy(policy).ok_or_else(|| err("policy", format!("{policy} is not a policy index of this engine")))?;
        check_len("key", key, 4096)?;
        check_len("idempotency-key", idempotency_key, 1024)?;
        if flags & !FLAG_NON_IDEMPOTENT != 0 {
            return Err(err("flags", format!("has unknown bits set ({flags:#x}); bit 0 is the only flag")));
        }
        let name = p.name.clone();
        let deadline_at = p.deadline.map_or(0, |d| wall_now.saturating_add(d));
        let hash = policy_hash(p);
        let rng = Rng::new(self.rng.next_u64()).state();
        let rec = Record {
            state: State::Scheduled,
            reason: DurableReason::None,
            non_idempotent: flags & FLAG_NON_IDEMPOTENT != 0,
            attempts: 0,
            failures: 0,
            crashes: 0,
            first_at: wall_now,
            next_at: wall_now,
            deadline_at,
            last_seen: wall_now,
            lease_until: 0,
            prev_delay: 0,
            backoff_from: 0,
            rng,
            policy_hash: hash,
            error_at: 0,
            error_attempt: 0,
            policy: name,
            key: key.to_string(),
            idempotency_key: idempotency_key.to_string(),
            lease_owner: String::new(),
            error_class: String::new(),
            error_message: String::new(),
        };
        Ok(answer(rec, Action::Wait, 0, 0, false))
    }

    /// Take a call up: at start-up, when it is due, or after a wait. `owner` names this
    /// process (it becomes the lease holder); `elapsed` is the monotonic time since this
    /// process got these bytes from the core (0 when they were just read from the store).
    ///
    /// A scheduled call that is due starts its next attempt (`run`); one that is not answers
    /// `wait` with the time left. A running call whose lease is live and held by another
    /// owner is refused; otherwise its attempt was cut off by a crash (see the module docs).
    pub fn durable_step(&self, record: &[u8], owner: &str, wall_now: u64, elapsed: u64) -> Result<DurableStep, LoadError> {
        if owner.is_empty() {
            return Err(err("owner", "must name the process taking the call (1 to 256 bytes)"));
        }
        check_len("owner", owner, 256)?;
        let Open { mut rec, policy: p, now, changed } = self.durable_open(record, wall_now, elapsed)?;
        match rec.state {
            State::Done | State::Dead | State::Cancelled => Ok(finished(rec, changed)),
            State::Running => {
                if rec.lease_owner != owner && now < rec.lease_until {
                    return Err(err(
                        "record.lease",
                        format!(
                            "is held by `{}` for {} ns more: attempt {} may still be running there",
                            rec.lease_owner,
                            rec.lease_until - now,
                            rec.attempts
                        ),
                    ));
                }
                rec.crashes = rec.crashes.saturating_add(1);
                rec.error_class = "crash".to_string();
                rec.error_message = format!(
                    "the process running attempt {} (lease holder `{}`) stopped before its outcome was recorded",
                    rec.attempts, rec.lease_owner
                );
                rec.error_at = now;
                rec.error_attempt = rec.attempts;
                rec.lease_owner.clear();
                rec.lease_until = 0;
                if rec.crashes >= p.durable.max_crashes {
                    return Ok(dead(rec, DurableReason::CrashLimit, changed));
                }
                if !rec.idempotent() {
                    return Ok(dead(rec, DurableReason::UnknownOutcome, changed));
                }
                let failure = Failure {
                    stop: false,
                    retryable: true,
                    idempotent: true,
                    attempts: rec.attempts,
                    server: None,
                    now,
                    deadline: None,
                    open_until: None,
                };
                schedule(rec, p, failure, changed)
            }
            State::Scheduled => {
                if rec.deadline_at != 0 && now >= rec.deadline_at {
                    return Ok(dead(rec, DurableReason::Deadline, changed));
                }
                let left = rec.next_at.saturating_sub(now).min(largest_delay(p));
                if left > 0 {
                    rec.next_at = now.saturating_add(left);
                    return Ok(answer(rec, Action::Wait, left, 0, changed));
                }
                rec.attempts = rec.attempts.saturating_add(1);
                rec.state = State::Running;
                rec.lease_owner = owner.to_string();
                rec.lease_until = now.saturating_add(p.durable.lease);
                rec.next_at = rec.lease_until;
                let mut timeout = p.attempt_timeout.unwrap_or(0);
                if rec.deadline_at != 0 {
                    let left = rec.deadline_at - now;
                    timeout = if timeout == 0 { left } else { timeout.min(left) };
                }
                Ok(answer(rec, Action::Run, 0, timeout, changed))
            }
        }
    }

    /// Extend the lease of the attempt `owner` is running (call it every third of the lease).
    pub fn durable_renew(&self, record: &[u8], owner: &str, wall_now: u64, elapsed: u64) -> Result<DurableStep, LoadError> {
        let Open { mut rec, policy: p, now, changed } = self.durable_open(record, wall_now, elapsed)?;
        held_by(&rec, owner)?;
        rec.lease_until = now.saturating_add(p.durable.lease);
        rec.next_at = rec.lease_until;
        let timeout = if rec.deadline_at != 0 { rec.deadline_at.saturating_sub(now) } else { 0 };
        Ok(answer(rec, Action::Run, 0, timeout, changed))
    }

    /// Report the outcome of the attempt `owner` ran. `elapsed` is the attempt's monotonic
    /// duration; `kind`, `code` and `text` as for `report`; `message` is the error's text for
    /// the record (cut to 4096 bytes). `flags`: bit 0 the response is marked overloaded.
    #[allow(clippy::too_many_arguments)]
    pub fn durable_outcome(
        &self,
        record: &[u8],
        owner: &str,
        wall_now: u64,
        elapsed: u64,
        kind: OutcomeKind,
        code: i32,
        text: &str,
        message: &str,
        flags: u32,
    ) -> Result<DurableStep, LoadError> {
        let Open { mut rec, policy: p, now, changed } = self.durable_open(record, wall_now, elapsed)?;
        held_by(&rec, owner)?;
        rec.lease_owner.clear();
        rec.lease_until = 0;
        let (server, observed) = crate::engine::observe(p, kind, code, text, now / SECOND);
        if crate::classify::succeeded(&observed, flags) {
            rec.state = State::Done;
            rec.next_at = 0;
            return Ok(finished(rec, changed));
        }
        rec.failures = rec.failures.saturating_add(1);
        rec.error_class = class_of(kind, code, text);
        rec.error_message = truncate(message, 4096).to_string();
        rec.error_at = now;
        rec.error_attempt = rec.attempts;
        let failure = Failure {
            stop: server == ServerDelay::Stop,
            retryable: crate::classify::retryable(&p.retry_on, &p.never_retry, &observed, flags),
            idempotent: rec.idempotent(),
            attempts: rec.attempts,
            server: match server {
                ServerDelay::After(d) => Some(d),
                _ => None,
            },
            now,
            deadline: None,
            // A durable call passes no breaker.
            open_until: None,
        };
        schedule(rec, p, failure, changed)
    }

    /// Cancel a call that has not finished. An attempt running elsewhere may still complete;
    /// its outcome is then refused (the record is no longer running).
    pub fn durable_cancel(&self, record: &[u8], wall_now: u64) -> Result<DurableStep, LoadError> {
        let mut rec = Record::decode(record)?;
        if rec.state.finished() {
            return Err(err("record.state", format!("is `{}`: only a scheduled or running call can be cancelled", rec.state.name())));
        }
        rec.last_seen = rec.last_seen.max(wall_now);
        rec.state = State::Cancelled;
        rec.reason = DurableReason::Cancelled;
        rec.next_at = 0;
        rec.lease_owner.clear();
        rec.lease_until = 0;
        Ok(finished(rec, false))
    }

    /// Give a dead or cancelled call a fresh set of attempts, due now (an operator's retry).
    /// Failures and the last error are kept; attempts and crashes start again from 0, and
    /// the deadline from now.
    pub fn durable_revive(&self, record: &[u8], wall_now: u64) -> Result<DurableStep, LoadError> {
        let Open { mut rec, policy: p, now, changed } = self.durable_open(record, wall_now, 0)?;
        if !matches!(rec.state, State::Dead | State::Cancelled) {
            return Err(err("record.state", format!("is `{}`: only a dead or cancelled call can be retried", rec.state.name())));
        }
        rec.state = State::Scheduled;
        rec.reason = DurableReason::None;
        rec.attempts = 0;
        rec.crashes = 0;
        rec.prev_delay = 0;
        rec.backoff_from = 0;
        rec.next_at = now;
        rec.deadline_at = p.deadline.map_or(0, |d| now.saturating_add(d));
        Ok(answer(rec, Action::Wait, 0, 0, changed))
    }
}

fn held_by(rec: &Record, owner: &str) -> Result<(), LoadError> {
    if rec.state != State::Running {
        return Err(err("record.state", format!("is `{}`: no attempt of this call is running", rec.state.name())));
    }
    if rec.lease_owner != owner {
        return Err(err(
            "record.lease",
            format!("is held by `{}`, not `{owner}`: this process lost the call's lease and its outcome is not recorded", rec.lease_owner),
        ));
    }
    Ok(())
}

/// After a failure or a crash: the next retry, or the reason there is none (the retry
/// ladder, `crate::retry::decide`, with the record's deadline and no budget).
fn schedule(mut rec: Record, p: &Policy, mut failure: Failure, changed: bool) -> Result<DurableStep, LoadError> {
    failure.deadline = (rec.deadline_at != 0).then_some(rec.deadline_at);
    let (attempts, mut backoff) = (rec.attempts, BackoffState { prev: rec.prev_delay, from: rec.backoff_from });
    let mut rng = Rng::from_state(rec.rng);
    let decision = retry::decide(p.attempts, &p.retry_after, failure, || backoff.delay(&p.backoff, attempts, &mut rng), || Ok(()));
    rec.rng = rng.state();
    let reason = match decision {
        Decision::Retry(delay) => {
            backoff.retried(&failure, delay);
            (rec.prev_delay, rec.backoff_from) = (backoff.prev, backoff.from);
            rec.state = State::Scheduled;
            rec.next_at = failure.now.saturating_add(delay);
            return Ok(answer(rec, Action::Wait, delay, 0, changed));
        }
        Decision::Stop { reason, .. } => reason,
        // A durable call has no budget: the ladder never refuses one.
        Decision::Refused(_) => Reason::Budget,
    };
    let reason = match reason {
        Reason::Pushback => DurableReason::Pushback,
        Reason::NonRetryable => DurableReason::NonRetryable,
        Reason::NonIdempotent => DurableReason::NonIdempotent,
        Reason::RetryAfterTooLong => DurableReason::RetryAfterTooLong,
        Reason::Deadline => DurableReason::Deadline,
        _ => DurableReason::RetriesExhausted,
    };
    Ok(dead(rec, reason, changed))
}

fn dead(mut rec: Record, reason: DurableReason, changed: bool) -> DurableStep {
    rec.state = State::Dead;
    rec.reason = reason;
    rec.next_at = 0;
    rec.lease_owner.clear();
    rec.lease_until = 0;
    finished(rec, changed)
}

fn finished(rec: Record, changed: bool) -> DurableStep {
    let action = match rec.state {
        State::Done => Action::Done,
        State::Cancelled => Action::Cancelled,
        _ => Action::Dead,
    };
    answer(rec, action, 0, 0, changed)
}

fn answer(rec: Record, action: Action, wait: u64, timeout: u64, policy_changed: bool) -> DurableStep {
    DurableStep {
        action,
        attempt: rec.attempts,
        wait,
        timeout,
        next_at: rec.next_at,
        lease_until: rec.lease_until,
        reason: rec.reason,
        policy_changed,
        record: rec.encode(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::time::{MILLISECOND, SECOND};

    const T0: u64 = 1_800_000_000 * SECOND;

    fn engine(doc: &str) -> Engine {
        match Engine::load(doc, 7) {
            Ok(e) => e,
            Err(errs) => panic!("{errs:?}"),
        }
    }

    fn ok(r: Result<DurableStep, LoadError>) -> DurableStep {
        match r {
            Ok(s) => s,
            Err(e) => panic!("{e}"),
        }
    }

    const DOC: &str = "policies:\n  p:\n    attempts: 3\n    backoff: { kind: constant, base: 2s, cap: 2s, jitter: none }\n";

    #[test]
    fn a_call_runs_fails_waits_and_succeeds() {
        let mut e = engine(DOC);
        let s = ok(e.durable_begin(0, "k", "", 0, T0));
        assert_eq!((s.action, s.wait, s.next_at), (Action::Wait, 0, T0));
        let s = ok(e.durable_step(&s.record, "w1", T0, 0));
        assert_eq!((s.action, s.attempt, s.lease_until), (Action::Run, 1, T0 + 30 * SECOND));
        let s = ok(e.durable_outcome(&s.record, "w1", T0, 5 * MILLISECOND, OutcomeKind::Timeout, 0, "", "slow", 0));
        assert_eq!((s.action, s.wait, s.next_at), (Action::Wait, 2 * SECOND, T0 + 5 * MILLISECOND + 2 * SECOND));
        // Restored in another process one second later: one second left.
        let s = ok(e.durable_step(&s.record, "w2", T0 + 1_005 * MILLISECOND, 0));
        assert_eq!((s.action, s.wait), (Action::Wait, SECOND));
        let s = ok(e.durable_step(&s.record, "w2", T0, SECOND));
        assert_eq!((s.action, s.attempt), (Action::Run, 2));
        let s = ok(e.durable_outcome(&s.record, "w2", T0, 0, OutcomeKind::Success, 0, "", "", 0));
        assert_eq!(s.action, Action::Done);
        let r = Record::decode(&s.record).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!((r.attempts, r.failures, r.crashes, r.error_class.as_str()), (2, 1, 0, "timeout"));
    }

    #[test]
    fn a_backwards_clock_never_lengthens_the_wait() {
        let mut e = engine(DOC);
        let s = ok(e.durable_begin(0, "", "", 0, T0));
        let s = ok(e.durable_step(&s.record, "w", T0, 0));
        let s = ok(e.durable_outcome(&s.record, "w", T0, 0, OutcomeKind::Timeout, 0, "", "", 0));
        // The wall clock is an hour behind: the wait is still the 2 s left, not 1 h 2 s.
        let s2 = ok(e.durable_step(&s.record, "w", T0 - 3600 * SECOND, 0));
        assert_eq!(s2.wait, 2 * SECOND);
        // A record whose next-at is a year ahead waits the policy's largest delay at most (300 s).
        let mut r = Record::decode(&s.record).unwrap_or_else(|e| panic!("{e}"));
        r.next_at = T0 + 365 * 86_400 * SECOND;
        let s3 = ok(e.durable_step(&r.encode(), "w", T0, 0));
        assert_eq!(s3.wait, 300 * SECOND);
    }

    #[test]
    fn crashes_retry_idempotent_calls_and_stop_the_others() {
        let mut e = engine(DOC);
        let keyed = ok(e.durable_begin(0, "", "order-1", FLAG_NON_IDEMPOTENT, T0));
        let bare = ok(e.durable_begin(0, "", "", FLAG_NON_IDEMPOTENT, T0));
        let keyed = ok(e.durable_step(&keyed.record, "w1", T0, 0));
        let bare = ok(e.durable_step(&bare.record, "w1", T0, 0));
        // While w1's lease is live nobody else takes the call.
        assert_eq!(e.durable_step(&keyed.record, "w2", T0 + SECOND, 0).map_err(|e| e.path), Err("record.lease".to_string()));
        let after = T0 + 31 * SECOND;
        let k = ok(e.durable_step(&keyed.record, "w2", after, 0));
        assert_eq!((k.action, k.wait), (Action::Wait, 2 * SECOND));
        let b = ok(e.durable_step(&bare.record, "w2", after, 0));
        assert_eq!((b.action, b.reason), (Action::Dead, DurableReason::UnknownOutcome));
        let r = Record::decode(&b.record).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!((r.crashes, r.error_class.as_str(), r.error_attempt), (1, "crash", 1));
    }

    #[test]
    fn the_crash_cap_stops_a_poison_call() {
        let mut e = engine("policies:\n  p:\n    attempts: 100\n    durable: { max-crashes: 2, lease: 1s }\n    backoff: { kind: constant, base: 1s, cap: 1s, jitter: none }\n");
        let mut s = ok(e.durable_begin(0, "", "", 0, T0));
        let mut now = T0;
        let mut seen = Vec::new();
        for _ in 0..5 {
            s = ok(e.durable_step(&s.record, "w", now, 0));
            seen.push((s.action, s.reason));
            if s.action == Action::Dead {
                break;
            }
            now += 2 * SECOND;
        }
        assert_eq!(seen.last(), Some(&(Action::Dead, DurableReason::CrashLimit)));
    }

    #[test]
    fn bad_records_name_what_is_wrong() {
        let mut e = engine(DOC);
        let s = ok(e.durable_begin(0, "", "", 0, T0));
        let mut bad = s.record.clone();
        if let Some(b) = bad.get_mut(10) {
            *b ^= 1;
        }
        assert!(e.durable_step(&bad, "w", T0, 0).is_err_and(|e| e.message.contains("checksum")));
        let mut v2 = s.record.clone();
        if let Some(b) = v2.get_mut(4) {
            *b = 2;
        }
        assert!(e.durable_step(&v2, "w", T0, 0).is_err_and(|e| e.path == "record.version"));
        assert!(Record::decode(b"junk").is_err());
        let other = engine("policies:\n  q: {}\n");
        assert!(other.durable_step(&s.record, "w", T0, 0).is_err_and(|e| e.path == "record.policy"));
    }

    #[test]
    fn saturating_everywhere() {
        let mut e = engine("policies:\n  p:\n    attempts-preset: temporal\n    attempts: 0\n");
        assert_eq!(e.policy(0).map(|p| p.attempts), Some(u32::MAX));
        let s = ok(e.durable_begin(0, "", "", 0, u64::MAX - 5));
        let mut r = Record::decode(&s.record).unwrap_or_else(|e| panic!("{e}"));
        r.attempts = u32::MAX - 1;
        r.crashes = u32::MAX;
        let s = ok(e.durable_step(&r.encode(), "w", u64::MAX, u64::MAX));
        assert_eq!((s.action, s.attempt), (Action::Run, u32::MAX));
        let s = ok(e.durable_outcome(&s.record, "w", u64::MAX, u64::MAX, OutcomeKind::Timeout, 0, "", "", 0));
        assert_eq!((s.action, s.reason), (Action::Dead, DurableReason::RetriesExhausted));
    }

    #[test]
    fn presets_count_attempts_like_their_anchors() {
        let total = |doc: &str| engine(doc).policy(0).map(|p| p.attempts);
        assert_eq!(total("policies:\n  p: { attempts-preset: step-functions, attempts: 3 }\n"), Some(4));
        assert_eq!(total("policies:\n  p: { attempts-preset: step-functions, attempts: 0 }\n"), Some(1));
        assert_eq!(total("policies:\n  p: { attempts-preset: celery }\n"), Some(4));
        assert_eq!(total("policies:\n  p: { attempts-preset: sidekiq }\n"), Some(26));
        assert_eq!(total("policies:\n  p: { attempts-preset: temporal, attempts: 5 }\n"), Some(5));
        assert_eq!(total("policies:\n  p: { attempts-preset: durable-task, attempts: 5 }\n"), Some(5));
        assert!(Engine::load("policies:\n  p: { attempts-preset: durable-task, attempts: 0 }\n", 0).is_err());
    }
}
