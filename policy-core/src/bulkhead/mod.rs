//! Concurrency limit (bulkhead): attempts in flight at once, per policy and key. A slot is
//! taken per attempt and held only while the attempt runs, never during the sleep between
//! attempts.
//!
//! # The queue
//! With `queue: n` (cockatiel's `bulkhead(limit, queue)`, Polly's concurrency limiter's queue
//! limit), an attempt that finds the bulkhead full, or finds others already waiting, joins a
//! FIFO queue of at most `n` per key and is told to **wait** (reason `bulkhead-full`) for at
//! most `queue-timeout` (and never past the deadline); with the queue full it is rejected.
//! The host sleeps until the wait elapses *or* until it reports or cancels an attempt of the
//! same policy and key (a slot may have freed), then acquires again. The core admits the
//! queue's oldest calls first: a waiter is admitted when fewer calls wait before it than
//! there are free slots; otherwise it is told to wait again for the rest of its time, or, once
//! that has passed, rejected (`bulkhead-full`). A call that arrives while others wait queues
//! behind them even if a slot is free, so nobody is overtaken. Cancelling a waiting call
//! takes it out of the queue.

use crate::doc::{obj, Fields, Value};
use crate::error::LoadError;
use crate::read::{opt_duration, uint};
use crate::time::{format_duration, SECOND};

/// Default attempts in flight at once.
pub const DEFAULT_MAX_CONCURRENT: u32 = 25;
/// Largest `max-concurrent`.
pub const MAX_CONCURRENT: u32 = 1_000_000;
/// Default queue length: no queue, a full bulkhead rejects at once.
pub const DEFAULT_QUEUE: u32 = 0;
/// Longest queue accepted.
pub const MAX_QUEUE: u32 = 100_000;
/// Default longest wait in the queue.
pub const DEFAULT_QUEUE_TIMEOUT: u64 = SECOND;
/// The fields of `bulkhead`.
pub const FIELDS: &[&str] = &["max-concurrent", "queue", "queue-timeout"];

/// Concurrency limit configuration.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BulkheadCfg {
    /// Attempts in flight at once, per policy and key (default [`DEFAULT_MAX_CONCURRENT`]).
    pub max_concurrent: u32,
    /// Calls that may wait for a slot, per policy and key (default [`DEFAULT_QUEUE`]).
    pub queue: u32,
    /// Longest wait in the queue (default [`DEFAULT_QUEUE_TIMEOUT`]).
    pub queue_timeout: u64,
}

/// What a call that wants a slot is told (see the module documentation).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Admit {
    /// Take a slot.
    Slot,
    /// Wait (at most this long), then acquire again.
    Wait(u64),
    /// Rejected: full, and the queue is full or the wait is over.
    Full,
}

/// The waiting calls of a key: `(call, when it joined)`, oldest first.
pub type Queue = std::collections::VecDeque<(u64, u64)>;

/// Parse `bulkhead`.
pub(crate) fn parse(path: &str, v: &Value, errors: &mut Vec<LoadError>) -> Option<BulkheadCfg> {
    let mut b = Fields::new(path, v, errors)?;
    let max_concurrent = uint(&mut b, "max-concurrent", DEFAULT_MAX_CONCURRENT, 1, MAX_CONCURRENT, errors);
    let queue = uint(&mut b, "queue", DEFAULT_QUEUE, 0, MAX_QUEUE, errors);
    let queue_timeout = opt_duration(&mut b, "queue-timeout", errors, true).unwrap_or(DEFAULT_QUEUE_TIMEOUT);
    b.finish(FIELDS, errors);
    Some(BulkheadCfg { max_concurrent, queue, queue_timeout })
}

impl BulkheadCfg {
    /// As the policy's JSON shows it.
    pub(crate) fn to_json(&self) -> Value {
        obj([
            ("max-concurrent", self.max_concurrent.into()),
            ("queue", self.queue.into()),
            ("queue-timeout", format_duration(self.queue_timeout).into()),
        ])
    }

    /// Whether `call`, wanting a slot at `now` with `in_flight` attempts running, takes one,
    /// waits in `queue`, or is rejected; `deadline` bounds the wait. Updates the queue.
    pub fn admit(&self, queue: &mut Queue, call: u64, in_flight: u32, now: u64, deadline: Option<u64>) -> Admit {
        let free = self.max_concurrent.saturating_sub(in_flight) as usize;
        let until = |joined: u64| {
            let end = joined.saturating_add(self.queue_timeout);
            deadline.map_or(end, |d| end.min(d))
        };
        match queue.iter().position(|(c, _)| *c == call) {
            Some(i) if i < free => {
                queue.remove(i);
                Admit::Slot
            }
            Some(i) => {
                let end = queue.get(i).map_or(now, |(_, joined)| until(*joined));
                if now >= end {
                    queue.remove(i);
                    Admit::Full
                } else {
                    Admit::Wait(end - now)
                }
            }
            None if queue.is_empty() && free > 0 => Admit::Slot,
            None if queue.len() < self.queue as usize && until(now) > now => {
                queue.push_back((call, now));
                Admit::Wait(until(now) - now)
            }
            None => Admit::Full,
        }
    }

    /// Whether one more attempt may start with `in_flight` running.
    #[inline]
    pub fn admits(&self, in_flight: u32) -> bool {
        in_flight < self.max_concurrent
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::doc;

    #[test]
    fn parse_defaults_and_bounds() {
        let mut errors = Vec::new();
        let v = doc::parse("{}").unwrap_or(Value::Null);
        assert_eq!(
            parse("b", &v, &mut errors),
            Some(BulkheadCfg { max_concurrent: DEFAULT_MAX_CONCURRENT, queue: 0, queue_timeout: DEFAULT_QUEUE_TIMEOUT })
        );
        let v = doc::parse("{ max-concurrent: 0 }").unwrap_or(Value::Null);
        let _ = parse("b", &v, &mut errors);
        assert_eq!(errors.len(), 1);
        assert_eq!(errors[0].path, "b.max-concurrent");
        let cfg = BulkheadCfg { max_concurrent: 2, queue: 0, queue_timeout: SECOND };
        assert!(cfg.admits(1) && !cfg.admits(2));
    }

    #[test]
    fn the_queue_is_fifo_and_bounded() {
        let cfg = BulkheadCfg { max_concurrent: 1, queue: 2, queue_timeout: 100 };
        let mut q = Queue::new();
        assert_eq!(cfg.admit(&mut q, 1, 0, 0, None), Admit::Slot);
        assert_eq!(cfg.admit(&mut q, 2, 1, 0, None), Admit::Wait(100));
        assert_eq!(cfg.admit(&mut q, 3, 1, 10, Some(60)), Admit::Wait(50), "the deadline bounds the wait");
        assert_eq!(cfg.admit(&mut q, 4, 1, 10, None), Admit::Full, "the queue is full");
        assert_eq!(cfg.admit(&mut q, 3, 0, 20, Some(60)), Admit::Wait(40), "2 is first in line for the one free slot");
        assert_eq!(cfg.admit(&mut q, 2, 0, 20, None), Admit::Slot);
        assert_eq!(cfg.admit(&mut q, 5, 0, 20, None), Admit::Wait(100), "a newcomer queues behind 3 even with a slot free");
        assert_eq!(cfg.admit(&mut q, 3, 1, 60, Some(60)), Admit::Full, "3's wait is over");
        assert_eq!(cfg.admit(&mut q, 5, 0, 150, None), Admit::Slot, "a slot free at re-acquire wins over a passed wait");
        assert!(q.is_empty());
    }
}
