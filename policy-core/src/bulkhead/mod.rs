//! Concurrency limit (bulkhead): attempts in flight at once, per policy and key. A slot is
//! taken per attempt and held only while the attempt runs, never during the sleep between
//! attempts.
//!
//! # The queue
//! With `queue: n` (cockatiel's `bulkhead(limit, queue)`, Polly's concurrency limiter's queue
//! limit), an attempt that finds the bulkhead full, or finds others already waiting, joins a
//! FIFO queue of at most `n` per key and is told to **wait** (reason `bulkhead-full`) for at
//! most `queue-timeout` (and never past the deadline); with the queue full it is rejected.
//! A call that arrives while others wait queues behind them even if a slot is free, so nobody
//! is overtaken.
//!
//! The core names the calls to wake. Whenever a slot frees on a key with waiters (a report,
//! a cancel, an eviction, a call ending by deadline or breaker, a hedged attempt closing:
//! every path that lowers the attempts in flight, and a granted call that leaves without
//! taking its slot), the slot is **granted** to the oldest waiter: it is reserved for that
//! call (no newcomer or hedge can take it), the call leaves the queue, and its id is recorded
//! for the host, which learns of it from a verdict's wakes bit and `take-wakes`. The host
//! wakes exactly those calls; each acquires again and takes its slot. A waiter that acquires
//! without a grant (its timer fired first) is told to wait again for the rest of its time,
//! or, once that has passed, rejected (`bulkhead-full`); one holding a grant takes the slot
//! whenever it acquires. A waiting call that ends or is cancelled leaves the queue; a granted
//! one gives its reservation to the next waiter.
//!
//! Cost: the queue is an intrusive doubly linked list threaded through the live calls (each
//! call's [`Ticket`] holds its links), so joining, leaving from anywhere, granting and
//! admitting are constant time whatever the number of waiters. A queue is identified by a
//! number unique in its engine: a ticket of a queue that no longer exists (its key was
//! evicted, the policies reloaded, state imported) is recognised as stale and ignored.

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

/// No call: the end of a queue.
const NIL: u32 = u32::MAX;

/// Most granted calls kept for `take-wakes`; older ones are dropped first. A host that takes
/// its wakes holds a handful at a time; the bound is for one that never does (it wakes every
/// parked call itself, correct but slower): the list then stays bounded. It matches the bound
/// on live calls, so a host that takes them never loses one.
pub const MAX_PENDING_WAKES: usize = 131_072;

/// The calls granted a slot since the host last took them, in grant order.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Wakes(std::collections::VecDeque<u64>);

impl Wakes {
    /// Record a call to wake.
    pub(crate) fn push(&mut self, call: u64) {
        if self.0.len() >= MAX_PENDING_WAKES {
            self.0.pop_front();
        }
        self.0.push_back(call);
    }

    /// Take them, in grant order.
    pub fn take(&mut self) -> Vec<u64> {
        self.0.drain(..).collect()
    }

    /// Whether a grant waits to be taken.
    #[inline]
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

/// A key's queue: the ends of a list threaded through the calls' [`Ticket`]s (by their index
/// in the engine's call table), oldest first, and the slots granted and not yet taken.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Queue {
    /// Unique in the engine: tickets of this queue carry it.
    id: u64,
    front: u32,
    back: u32,
    /// Calls in the list.
    waiting: u32,
    /// Slots reserved for granted calls that have not acquired yet.
    granted: u32,
}

/// Where a live call stands in its key's queue.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Ticket {
    /// Not queued.
    #[default]
    None,
    /// In queue `queue`'s list until `until` (the wait's end), between `prev` and `next`.
    Waiting {
        /// The queue's id.
        queue: u64,
        /// When the wait ends.
        until: u64,
        /// The call before (older), or none.
        prev: u32,
        /// The call after (younger), or none.
        next: u32,
    },
    /// Granted a slot of queue `queue`, reserved until it acquires.
    Granted {
        /// The queue's id.
        queue: u64,
    },
}

impl Ticket {
    fn queue(&self) -> Option<u64> {
        match *self {
            Ticket::None => None,
            Ticket::Waiting { queue, .. } | Ticket::Granted { queue } => Some(queue),
        }
    }
}

/// The calls a queue is threaded through: the engine's live-call table, by index.
pub(crate) trait Waiters {
    /// The ticket of the call at `at`.
    fn ticket(&mut self, at: u32) -> Option<&mut Ticket>;
    /// The id of the call at `at`.
    fn call_id(&self, at: u32) -> Option<u64>;
}

impl Queue {
    /// An empty queue with a unique id.
    pub(crate) fn new(id: u64) -> Self {
        Queue { id, front: NIL, back: NIL, waiting: 0, granted: 0 }
    }

    /// Calls waiting (not yet granted).
    pub fn waiting(&self) -> u32 {
        self.waiting
    }

    /// Slots granted and not yet taken.
    pub fn granted(&self) -> u32 {
        self.granted
    }

    /// Whether no call waits or holds a grant: a hedge or a newcomer may take a free slot.
    #[inline]
    pub fn is_clear(&self) -> bool {
        self.waiting == 0 && self.granted == 0
    }

    /// Whether `ticket` is one of this queue's.
    fn owns(&self, ticket: &Ticket) -> bool {
        ticket.queue() == Some(self.id)
    }

    fn link_back(&mut self, calls: &mut impl Waiters, at: u32, until: u64) {
        let back = self.back;
        if let Some(t) = calls.ticket(at) {
            *t = Ticket::Waiting { queue: self.id, until, prev: back, next: NIL };
        }
        match calls.ticket(back) {
            Some(Ticket::Waiting { next, .. }) => *next = at,
            _ => self.front = at,
        }
        self.back = at;
        self.waiting += 1;
    }

    /// Take the call at `at` (waiting in this queue) out of the list.
    fn unlink(&mut self, calls: &mut impl Waiters, at: u32) {
        let Some(&mut Ticket::Waiting { prev, next, .. }) = calls.ticket(at) else { return };
        match calls.ticket(prev) {
            Some(Ticket::Waiting { next: n, .. }) => *n = next,
            _ => self.front = next,
        }
        match calls.ticket(next) {
            Some(Ticket::Waiting { prev: p, .. }) => *p = prev,
            _ => self.back = prev,
        }
        self.waiting = self.waiting.saturating_sub(1);
        if let Some(t) = calls.ticket(at) {
            *t = Ticket::None;
        }
    }

    /// A call leaves the queue (it ends, is cancelled or evicted): out of the list, or its
    /// grant given up. Returns whether a grant was given up (a slot to grant again).
    pub(crate) fn leave(&mut self, calls: &mut impl Waiters, at: u32) -> bool {
        let Some(t) = calls.ticket(at) else { return false };
        let ticket = *t;
        if !self.owns(&ticket) {
            *t = Ticket::None; // stale: of a queue that is gone
            return false;
        }
        match ticket {
            Ticket::Waiting { .. } => {
                self.unlink(calls, at);
                false
            }
            Ticket::Granted { .. } => {
                *t = Ticket::None;
                self.granted = self.granted.saturating_sub(1);
                true
            }
            Ticket::None => false,
        }
    }
}

/// A ticket of a queue that is gone is no ticket: forget it (the call is a newcomer).
pub(crate) fn forget_stale(queue: Option<&Queue>, ticket: &mut Ticket) {
    if ticket.queue().is_some() && !queue.is_some_and(|q| q.owns(ticket)) {
        *ticket = Ticket::None;
    }
}

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

    /// Whether the call at `at`, wanting a slot at `now` with `in_flight` attempts running,
    /// takes one, waits in `queue`, or is rejected; `deadline` bounds the wait. Updates the
    /// queue: a granted call's reservation is used up (the caller takes the slot, or calls
    /// [`BulkheadCfg::grant`] when it does not), a newcomer joins. Constant time.
    pub(crate) fn admit(
        &self,
        queue: &mut Queue,
        calls: &mut impl Waiters,
        at: u32,
        in_flight: u32,
        now: u64,
        deadline: Option<u64>,
    ) -> Admit {
        let Some(t) = calls.ticket(at) else { return Admit::Full };
        forget_stale(Some(queue), t);
        match *t {
            Ticket::Granted { .. } => {
                *t = Ticket::None;
                queue.granted = queue.granted.saturating_sub(1);
                Admit::Slot
            }
            Ticket::Waiting { until, .. } if now >= until => {
                queue.unlink(calls, at);
                Admit::Full
            }
            Ticket::Waiting { until, .. } => Admit::Wait(until - now),
            Ticket::None if queue.is_clear() && self.admits(in_flight) => Admit::Slot,
            Ticket::None => {
                let end = now.saturating_add(self.queue_timeout);
                let until = deadline.map_or(end, |d| end.min(d));
                if queue.waiting.saturating_add(queue.granted) < self.queue && until > now {
                    queue.link_back(calls, at, until);
                    Admit::Wait(until - now)
                } else {
                    Admit::Full
                }
            }
        }
    }

    /// Grant the slots free at `in_flight` (and not reserved) to the oldest waiters, in
    /// order, pushing each one's call id to `wakes`. Constant time per grant, and nothing
    /// to do costs one comparison.
    pub(crate) fn grant(&self, queue: &mut Queue, calls: &mut impl Waiters, in_flight: u32, wakes: &mut Wakes) {
        while queue.waiting > 0 && self.admits(in_flight.saturating_add(queue.granted)) {
            let at = queue.front;
            let Some(id) = calls.call_id(at) else {
                // A list that does not end where it says: cannot happen; stop rather than spin.
                queue.waiting = 0;
                queue.front = NIL;
                queue.back = NIL;
                return;
            };
            queue.unlink(calls, at);
            if let Some(t) = calls.ticket(at) {
                *t = Ticket::Granted { queue: queue.id };
            }
            queue.granted += 1;
            wakes.push(id);
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

    /// A call table for the tests: ticket `i` is call `i + 1`'s.
    struct Calls(Vec<Ticket>);

    impl Waiters for Calls {
        fn ticket(&mut self, at: u32) -> Option<&mut Ticket> {
            self.0.get_mut(at as usize)
        }
        fn call_id(&self, at: u32) -> Option<u64> {
            self.0.get(at as usize).map(|_| u64::from(at) + 1)
        }
    }

    #[test]
    fn the_queue_is_fifo_and_bounded() {
        let cfg = BulkheadCfg { max_concurrent: 1, queue: 2, queue_timeout: 100 };
        let mut q = Queue::new(1);
        let mut c = Calls(vec![Ticket::None; 6]);
        let mut wakes = Wakes::default();
        // Calls 1..=5 are at indices 0..=4.
        assert_eq!(cfg.admit(&mut q, &mut c, 0, 0, 0, None), Admit::Slot);
        assert_eq!(cfg.admit(&mut q, &mut c, 1, 1, 0, None), Admit::Wait(100));
        assert_eq!(cfg.admit(&mut q, &mut c, 2, 1, 10, Some(60)), Admit::Wait(50), "the deadline bounds the wait");
        assert_eq!(cfg.admit(&mut q, &mut c, 3, 1, 10, None), Admit::Full, "the queue is full");
        // Call 1's attempt ends: the slot goes to 2, the oldest waiter.
        cfg.grant(&mut q, &mut c, 0, &mut wakes);
        assert_eq!(wakes.0, [2]);
        assert_eq!(cfg.admit(&mut q, &mut c, 2, 0, 20, Some(60)), Admit::Wait(40), "3 holds no grant");
        assert_eq!(cfg.admit(&mut q, &mut c, 4, 0, 20, None), Admit::Full, "2 (granted) and 3 fill the queue");
        assert_eq!(cfg.admit(&mut q, &mut c, 1, 0, 20, None), Admit::Slot, "2 takes its grant");
        assert_eq!(cfg.admit(&mut q, &mut c, 4, 1, 20, None), Admit::Wait(100), "a newcomer queues behind 3");
        assert_eq!(cfg.admit(&mut q, &mut c, 2, 1, 60, Some(60)), Admit::Full, "3's wait is over");
        cfg.grant(&mut q, &mut c, 0, &mut wakes);
        assert_eq!(wakes.0, [2, 5]);
        assert_eq!(cfg.admit(&mut q, &mut c, 4, 0, 150, None), Admit::Slot, "a grant wins over a passed wait");
        assert!(q.is_clear() && c.0.iter().all(|t| *t == Ticket::None));
    }

    #[test]
    fn leaving_from_anywhere_keeps_the_order_and_a_grant_given_up_moves_on() {
        let cfg = BulkheadCfg { max_concurrent: 1, queue: 10, queue_timeout: 100 };
        let mut q = Queue::new(7);
        let mut c = Calls(vec![Ticket::None; 6]);
        let mut wakes = Wakes::default();
        assert_eq!(cfg.admit(&mut q, &mut c, 0, 0, 0, None), Admit::Slot);
        for at in 1..6 {
            assert_eq!(cfg.admit(&mut q, &mut c, at, 1, 0, None), Admit::Wait(100));
        }
        assert!(!q.leave(&mut c, 3), "the middle");
        assert!(!q.leave(&mut c, 5), "the back");
        assert!(!q.leave(&mut c, 1), "the front");
        assert_eq!(q.waiting(), 2);
        cfg.grant(&mut q, &mut c, 0, &mut wakes);
        assert_eq!(wakes.0, [3], "2 and 4 were taken out: 3 is the oldest left");
        assert!(q.leave(&mut c, 2), "a granted call gives its grant up");
        cfg.grant(&mut q, &mut c, 0, &mut wakes);
        assert_eq!(wakes.take(), [3, 5]);
        assert!(wakes.is_empty());
        assert_eq!((q.waiting(), q.granted()), (0, 1));
        // A ticket of another queue is stale: forgotten, nothing of this queue changes.
        let mut other = Queue::new(8);
        assert_eq!(cfg.admit(&mut other, &mut c, 4, 0, 0, None), Admit::Slot, "5's grant was of queue 7");
        assert_eq!(q.granted(), 1);
    }
}
