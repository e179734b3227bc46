//! The engine: policies, per-key state, live calls and the step protocol of `wit/levee.wit`.
//!
//! Composition, outside in: deadline -> fallback -> retry and its budget -> circuit breaker
//! -> rate and concurrency limits -> per-attempt timeout -> the call. Every attempt passes
//! the breaker; the concurrency slot is taken per attempt and never held while sleeping.

use std::collections::VecDeque;
use std::sync::Arc;

use crate::table::Table;

use crate::adaptive::{Limit, Signal};
use crate::breaker::{Breaker, Check, WindowState};
use crate::budget::{BudgetCfg, BudgetState};
use crate::bulkhead::{Admit, Queue, Ticket, Waiters, Wakes};
use crate::classify::{self, Observed};
use crate::deadline;
use crate::error::LoadError;
use crate::fallback;
use crate::hedge::{self, Hedge, HedgeCommand, Preset};
use crate::policy::{self, Policy};
use crate::rate::Gcra;
use crate::retry::retry_after::{parse_pushback, parse_retry_after, ServerDelay};
use crate::retry::{self, Decision, Failure};
use crate::rng::Rng;
use crate::scope::{Scope, Scopes};
use crate::types::{BreakerState, Event, EventKind, InvalidCode, OutcomeKind, Reason, Verdict, VerdictKind};

/// Most live calls an engine tracks; starting one more evicts the one started longest ago
/// (event `call-evicted`; its next step answers `invalid`, unknown call).
///
/// Why 2^17: a live call costs 199 bytes (`cargo bench -p levee-benches --bench memory`), so
/// a full table is 26.1 MB, which a guest's linear memory holds next to its keys under the
/// hosts' memory limits. The bound exists for a host that leaks calls (never reports or
/// cancels them): the engine stays bounded. Production load is far below it (the scaling
/// benchmarks run 60,000 calls in flight at the cost of one), and since every table
/// operation is constant time, the bound costs nothing until it is reached.
pub const MAX_LIVE_CALLS: usize = 131_072;
/// Most undrained events kept; older ones are dropped first.
pub const MAX_PENDING_EVENTS: usize = 4_096;

/// `start` flag: the operation is not idempotent.
pub const FLAG_NON_IDEMPOTENT: u32 = 1;
/// `start` flag: the call carries an idempotency key.
pub const FLAG_IDEMPOTENCY_KEY: u32 = 2;
pub use crate::classify::{FLAG_CALLER_NO_RETRY, FLAG_CALLER_RETRY, FLAG_OVERLOADED};

/// What a host needs to know of a policy.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PolicyInfo {
    /// Name.
    pub name: String,
    /// Attempts, counting the first.
    pub max_attempts: u32,
    /// Per-attempt timeout in ns (0 = none).
    pub attempt_timeout: u64,
    /// Deadline in ns (0 = none).
    pub deadline: u64,
    /// Fallback chain.
    pub fallbacks: Vec<String>,
}

/// What the engine knows of a live call.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CallInfo {
    /// Policy index.
    pub policy: u32,
    /// Key.
    pub key: String,
    /// Attempts started.
    pub attempts: u32,
    /// Absolute deadline (0 = none).
    pub deadline: u64,
    /// Reason of the last failure or refusal.
    pub last_reason: Reason,
    /// Whether an attempt is in flight.
    pub in_flight: bool,
}

/// State of one policy and key.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct KeyState {
    pub(crate) last_used: u64,
    pub(crate) breaker: Option<Breaker>,
    pub(crate) limiter: Option<Gcra>,
    pub(crate) budget: Option<BudgetState>,
    /// Boxed: most keys have none, and it would double the size of every key.
    pub(crate) adaptive: Option<Box<Limit>>,
    /// Calls waiting for a bulkhead slot (a bulkhead with a queue; made when first needed).
    pub(crate) queue: Option<Box<Queue>>,
    pub(crate) in_flight: u32,
}

impl KeyState {
    pub(crate) fn fresh(p: &Policy, tick: u64) -> Self {
        KeyState {
            last_used: tick,
            breaker: p.breaker.as_ref().map(|b| b.fresh()),
            limiter: p.rate_limit.as_ref().map(|r| r.fresh()),
            budget: p.budget.as_ref().map(|b| b.fresh()),
            adaptive: p.concurrency.as_ref().map(|c| Box::new(c.fresh())),
            queue: None,
            in_flight: 0,
        }
    }

    /// Make this the state of a new key, as [`KeyState::fresh`] makes it, keeping the count
    /// window's buffer (an evicted key's entry reused for the key that evicted it: under churn,
    /// one allocation and one free fewer per new key).
    pub(crate) fn reset(&mut self, p: &Policy, tick: u64) {
        let mut buffer = match self.breaker.as_mut().map(|b| &mut b.window) {
            Some(WindowState::Count { ring, .. }) => std::mem::take(ring),
            _ => Vec::new(),
        };
        *self = KeyState::fresh(p, tick);
        if let Some(Breaker { window: WindowState::Count { ring, .. }, .. }) = self.breaker.as_mut() {
            buffer.clear();
            *ring = buffer;
        }
    }
}

/// The state one call decides against: each strategy's from the call's key, or, for a
/// strategy of `scope: policy`, from the policy's shared entry (`crate::scope`).
pub(crate) struct View<'a> {
    pub(crate) breaker: &'a mut Option<Breaker>,
    pub(crate) limiter: &'a mut Option<Gcra>,
    pub(crate) budget: &'a mut Option<BudgetState>,
    pub(crate) adaptive: &'a mut Option<Box<Limit>>,
    pub(crate) queue: &'a mut Option<Box<Queue>>,
    /// Attempts in flight, counted with the concurrency limit.
    pub(crate) in_flight: &'a mut u32,
}

impl<'a> View<'a> {
    /// Every strategy from one entry.
    #[inline(always)]
    fn own(s: &'a mut KeyState) -> Self {
        View {
            breaker: &mut s.breaker,
            limiter: &mut s.limiter,
            budget: &mut s.budget,
            adaptive: &mut s.adaptive,
            queue: &mut s.queue,
            in_flight: &mut s.in_flight,
        }
    }

    /// Each strategy from the key's entry or the shared one, by its scope.
    fn split(own: &'a mut KeyState, shared: &'a mut KeyState, s: &Scopes) -> Self {
        let limit = s.limit == Scope::Policy;
        View {
            breaker: if s.breaker == Scope::Policy { &mut shared.breaker } else { &mut own.breaker },
            limiter: if s.rate_limit == Scope::Policy { &mut shared.limiter } else { &mut own.limiter },
            budget: if s.budget == Scope::Policy { &mut shared.budget } else { &mut own.budget },
            adaptive: if limit { &mut shared.adaptive } else { &mut own.adaptive },
            queue: if limit { &mut shared.queue } else { &mut own.queue },
            in_flight: if limit { &mut shared.in_flight } else { &mut own.in_flight },
        }
    }
}

/// The key whose state a strategy of `scope` decides with for a call's `key`: the key
/// itself, or the shared entry's `""`. Events of that state (a breaker's transitions) and
/// lookups by key name it.
#[inline]
pub(crate) fn state_key(scope: Scope, key: &str) -> &str {
    match scope {
        Scope::Key => key,
        Scope::Policy => "",
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    Ready,
    /// `timeout`: the attempt's timeout as the verdict gave it (0 none): an outcome whose
    /// `elapsed` reaches it arrived late and is a timeout.
    InFlight {
        permit: bool,
        slot: bool,
        timeout: u64,
    },
    Fallback {
        index: usize,
        reason: Reason,
    },
    /// A hedged call's attempts are running: they are in the call's [`Hedged`].
    Hedged,
    /// The call has ended, and attempts it cancelled have not all been reported closed yet:
    /// they still hold their slots until they are.
    Closing,
}

/// Slots of [`Hedged::held`]: one per attempt number (1 ..= the most a preset allows).
const HELD: usize = hedge::MAX_ATTEMPTS_POLLY as usize + 1;

/// What a hedged attempt holds until the host reports it closed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Held {
    open: bool,
    permit: bool,
    slot: bool,
    /// The attempt's timeout as its command gave it (0 none): a later outcome is a timeout.
    timeout: u64,
}

/// A hedged call: the strategy's state machine and what each attempt holds (by number).
#[derive(Clone, Debug, PartialEq, Eq)]
struct Hedged {
    machine: Hedge,
    held: [Held; HELD],
}

impl Hedged {
    /// Whether an attempt still holds something (has not been reported closed).
    fn any_open(&self) -> bool {
        self.held.iter().any(|h| h.open)
    }

    /// Close every attempt: the slots they held, and whether one held a breaker permit.
    fn close_all(&mut self) -> (u32, bool) {
        let (mut slots, mut permit) = (0u32, false);
        for h in self.held.iter_mut().filter(|h| h.open) {
            slots += u32::from(h.slot);
            permit |= h.permit;
            *h = Held::default();
        }
        (slots, permit)
    }
}

/// A live call's key: the key table's `Arc` of the name (cloning it does not allocate), or
/// nothing for "", the key of every unkeyed call, which then costs no reference count.
#[derive(Clone, Debug)]
struct CallKey(Option<Arc<str>>);

impl CallKey {
    /// The call's key for the table's `Arc` of its name.
    #[inline]
    fn of(name: &Arc<str>) -> CallKey {
        CallKey((!name.is_empty()).then(|| Arc::clone(name)))
    }

    /// Whether `name`, a key of the table, is this key (by identity for a named key).
    #[inline]
    fn is(&self, name: &Arc<str>) -> bool {
        match &self.0 {
            Some(own) => Arc::ptr_eq(own, name),
            None => name.is_empty(),
        }
    }
}

impl std::ops::Deref for CallKey {
    type Target = str;

    #[inline]
    fn deref(&self) -> &str {
        self.0.as_deref().unwrap_or("")
    }
}

#[derive(Clone, Debug)]
struct Call {
    policy: usize,
    key: CallKey,
    /// Where the key's state was last found: lets acquire and report skip the lookup.
    key_at: u32,
    flags: u32,
    /// The latest `now` this call was given: an earlier one counts as no time passed.
    seen: u64,
    deadline: Option<u64>,
    attempts: u32,
    phase: Phase,
    last_reason: Reason,
    /// Where the call's backoff stands (see `retry::BackoffState`).
    backoff: retry::BackoffState,
    reserved_at: Option<u64>,
    /// A hedged call's attempts (boxed: most calls are not hedged).
    hedge: Option<Box<Hedged>>,
    /// Where the call stands in its key's bulkhead queue (the queue's links run through it).
    ticket: Ticket,
}

impl Call {
    /// `now` as this call may use it: never earlier than one it was already given.
    #[inline]
    fn observe(&mut self, now: u64) -> u64 {
        self.seen = self.seen.max(now);
        self.seen
    }
}

/// The key table's lists (docs/policy.md, "Keys"). A key is filed by what it holds, each list
/// least recently used first:
/// - [`REST`]: no attempt in flight and no protection (what a fresh key would decide the same);
///   the only keys evicted without a look;
/// - [`BUSY`]: attempts in flight (their slots and permits are the key's); never evicted;
/// - [`GUARD`]: no attempt in flight, and protection that a fresh key would forget (a breaker
///   not closed, a limiter in debt, a budget below full, an adaptive limit below its start):
///   evicted only once that protection has ended by itself;
/// - [`OVERFLOW`]: the one entry, named [`OVERFLOW_KEY`], that new keys share when every other
///   key holds protection; never evicted, and not counted against `keys.max`.
pub(crate) const REST: usize = 0;
/// See [`REST`].
pub(crate) const BUSY: usize = 1;
/// See [`REST`].
pub(crate) const GUARD: usize = 2;
/// See [`REST`].
pub(crate) const OVERFLOW: usize = 3;
/// The policy's shared entry, the key `""`, when the policy has a strategy of `scope: policy`
/// (`crate::scope`): that strategy's state for every key. Never evicted, and not counted
/// against `keys.max`.
pub(crate) const SHARED: usize = 4;

/// The key whose state new keys share when the table is full and no key may be evicted
/// without forgetting protection. A caller's own key of this name is that shared state too.
pub const OVERFLOW_KEY: &str = "levee:overflow";

/// Longest key, in UTF-8 bytes. Hosts refuse a longer one with an error (wit/constants.json,
/// `MAX_KEY_BYTES`); one that reaches the engine anyway is decided against the overflow entry
/// (event `key-overflow`, `name` its first bytes), so that no key can make the state too large
/// to export and import again.
pub const MAX_KEY_BYTES: usize = 1024;

/// Most bytes one page of a paged export carries (`export-state-page`; wit/constants.json,
/// `STATE_PAGE_BYTES`): what one crossing copies, whatever the state's size.
pub const STATE_PAGE_BYTES: usize = 1 << 20;

/// Most keys of the guarded list looked at for one eviction (each one still protected moves
/// to the back of the list), so that making a key costs the same at any number of keys.
const GUARD_PROBES: usize = 8;

/// One policy's per-key state.
pub(crate) type Keys = Table<Arc<str>, KeyState, 5>;
/// The live calls, on one list in the order they started (the oldest is evicted first).
type Calls = Table<u64, Call, 1>;

/// The bulkhead queues are threaded through the live calls' tickets.
impl Waiters for Calls {
    #[inline]
    fn ticket(&mut self, at: u32) -> Option<&mut Ticket> {
        self.get_mut(at).map(|(_, c)| &mut c.ticket)
    }

    #[inline]
    fn call_id(&self, at: u32) -> Option<u64> {
        self.get(at).map(|(&id, _)| id)
    }
}

/// A Levee engine. See the crate documentation and `wit/levee.wit`.
#[derive(Clone, Debug)]
pub struct Engine {
    pub(crate) policies: Vec<Policy>,
    pub(crate) keys: Vec<Keys>,
    calls: Calls,
    pub(crate) events: VecDeque<Event>,
    pub(crate) rng: Rng,
    pub(crate) tick: u64,
    /// Seeds the tables' hasher (never a decision: see `table`).
    pub(crate) hash_seed: u64,
    /// What this engine last took from and gave to the fleet's shared state (see `fleet`).
    pub(crate) fleet: crate::fleet::Marks,
    /// Calls granted a bulkhead slot, for the host to wake (`take-wakes`).
    wakes: Wakes,
    /// The last bulkhead queue id given out (ids are never reused in an engine).
    queue_ids: u64,
    /// A key whose reserved slot an `acquire` used up and may not take (it waits for the rate
    /// limiter, or is refused after the bulkhead): its free slots are granted again after it.
    regrant: Option<(usize, u32)>,
    /// The key an `acquire` or `report` is changing, `(policy, index, now)`: filed by what it
    /// holds once the operation is over (see [`refile`]).
    touched: Option<(usize, u32, u64)>,
    /// A paged export or import in progress (`state::Pages`).
    pub(crate) pages: crate::state::Pages,
}

pub(crate) fn push_event(events: &mut VecDeque<Event>, e: Event) {
    if events.len() >= MAX_PENDING_EVENTS {
        events.pop_front();
    }
    events.push_back(e);
}

#[inline(always)]
fn transition_events(events: &mut VecDeque<Event>, t: &[(BreakerState, BreakerState)], expired: &[u64], at: u64, policy: usize, key: &str) {
    if t.is_empty() && expired.is_empty() {
        return;
    }
    transition_events_slow(events, t, expired, at, policy, key);
}

#[cold]
fn transition_events_slow(
    events: &mut VecDeque<Event>,
    t: &[(BreakerState, BreakerState)],
    expired: &[u64],
    at: u64,
    policy: usize,
    key: &str,
) {
    for c in expired {
        let mut e = Event::new(at, EventKind::PermitExpired, policy as u32, key);
        e.call = *c;
        push_event(events, e);
    }
    for (from, to) in t {
        let mut e = Event::new(at, EventKind::BreakerTransition, policy as u32, key);
        e.state_from = *from;
        e.state_to = *to;
        push_event(events, e);
    }
}

/// Whether a key holds protection at `now`: state that a fresh key would not have, and
/// without which its decisions would be looser (a breaker not closed, a limiter in debt, a
/// budget below full, an adaptive limit below a fresh one's). A time-bound protection (a
/// limiter's debt, a ratio budget's withdrawals) ends by itself; a breaker, a token budget,
/// the AWS client rate and an adaptive limit return to rest only through calls.
pub(crate) fn holds_protection(p: &Policy, s: &KeyState, now: u64) -> bool {
    if s.breaker.as_ref().is_some_and(|b| b.state != BreakerState::Closed) {
        return true;
    }
    if let Some(g) = &s.limiter {
        if g.tat > now.max(g.last_now) {
            return true;
        }
    }
    if let (Some(cfg), Some(b)) = (&p.budget, &s.budget) {
        if !b.at_rest(cfg, now) {
            return true;
        }
    }
    if let (Some(cfg), Some(l)) = (&p.concurrency, s.adaptive.as_deref()) {
        if l.current(cfg) < cfg.fresh_current() {
            return true;
        }
    }
    false
}

/// The list a key belongs on, from what it holds at `now`.
#[inline]
fn list_for(p: &Policy, s: &KeyState, now: u64) -> usize {
    if s.in_flight > 0 {
        BUSY
    } else if holds_protection(p, s, now) {
        GUARD
    } else {
        REST
    }
}

/// Put a key on the list its state now calls for (after an operation changed it). It was
/// touched earlier in the same operation, so it is the most recent of either list. The
/// overflow entry stays where it is.
#[inline]
pub(crate) fn refile(keys: &mut Keys, p: &Policy, at: u32, now: u64) {
    let want = match keys.get(at) {
        Some((_, s)) => list_for(p, s, now),
        None => return,
    };
    match keys.list_of(at) {
        Some(OVERFLOW) | None => {}
        Some(SHARED) if p.scopes.any() => {}
        Some(list) if list == want => {}
        Some(_) => keys.move_to_back(at, want),
    }
}

/// File the key an `acquire` or `report` changed (see `file_touched`): to the most recent end of
/// the list its state now calls for. Its touch for the LRU was left to here (`call_key_state`
/// with `touch_now` false), so one move does both, and its node is read once. The overflow
/// entry and the policy's shared entry stay on their lists.
#[inline]
fn file_at_back(keys: &mut Keys, p: &Policy, at: u32, now: u64) {
    let want = match keys.get_on_list(at) {
        Some((OVERFLOW, _)) => OVERFLOW,
        Some((SHARED, _)) if p.scopes.any() => SHARED,
        Some((_, s)) => list_for(p, s, now),
        None => return,
    };
    keys.move_to_back(at, want);
}

/// The key to evict for a new one at `now`, if one may go: the least recently used key at
/// rest, else the first of a few guarded keys whose protection has ended by itself. The
/// guarded keys looked at and still protected move to the back of their list.
fn victim(keys: &mut Keys, p: &Policy, now: u64) -> Option<u32> {
    if let Some(i) = keys.front(REST) {
        return Some(i);
    }
    for _ in 0..GUARD_PROBES.min(keys.list_len(GUARD)) {
        let i = keys.front(GUARD)?;
        let (_, s) = keys.get(i)?;
        if !holds_protection(p, s, now) {
            return Some(i);
        }
        keys.move_to_back(i, GUARD);
    }
    None
}

/// Index of the state of `key`, made when absent. At the policy's bound a key at rest makes
/// room (see [`victim`]); when none may go, the new key is decided against the shared
/// overflow entry (event `key-overflow`), never looser than a fresh key of its own.
fn key_position(keys: &mut Keys, p: &Policy, policy: usize, key: &str, tick: u64, now: u64, events: &mut VecDeque<Event>) -> u32 {
    if key.is_empty() && p.scopes.any() {
        return shared_position(keys, p, tick);
    }
    if let Some(i) = keys.find_recent(key) {
        return i;
    }
    if key == OVERFLOW_KEY {
        return overflow_position(keys, p, tick);
    }
    if key.len() > MAX_KEY_BYTES {
        return overflow_for(keys, p, policy, key, tick, now, events);
    }
    if keys.len() - keys.list_len(OVERFLOW) - keys.list_len(SHARED) >= p.max_keys as usize {
        match victim(keys, p, now) {
            Some(i) => {
                // The victim's entry becomes the new key's, in place.
                if let Some(victim) = keys.rekey(i, Arc::from(key), REST) {
                    if let Some((_, state)) = keys.get_mut(i) {
                        state.reset(p, tick);
                    }
                    let mut e = Event::new(now, EventKind::KeyEvicted, policy as u32, &victim);
                    e.name = e.key.clone(); // the same name (a copy, not a trip through `Display`)
                    push_event(events, e);
                    return i;
                }
            }
            None => return overflow_for(keys, p, policy, key, tick, now, events),
        }
    }
    keys.insert(Arc::from(key), KeyState::fresh(p, tick), REST)
}

/// Index of the overflow entry for a key that gets no entry of its own (event `key-overflow`).
#[cold]
fn overflow_for(keys: &mut Keys, p: &Policy, policy: usize, key: &str, tick: u64, now: u64, events: &mut VecDeque<Event>) -> u32 {
    let mut e = Event::new(now, EventKind::KeyOverflow, policy as u32, OVERFLOW_KEY);
    let mut end = key.len().min(MAX_KEY_BYTES);
    while !key.is_char_boundary(end) {
        end -= 1;
    }
    e.name = key.get(..end).unwrap_or_default().into();
    push_event(events, e);
    overflow_position(keys, p, tick)
}

/// Index of the policy's shared entry (see [`SHARED`]), made when absent. The key `""` may
/// already be on another list (imported, or kept over a reload that gave the policy its
/// first `scope: policy`): it then moves to the shared list, with what it holds.
#[inline]
fn shared_position(keys: &mut Keys, p: &Policy, tick: u64) -> u32 {
    match keys.front(SHARED) {
        Some(i) => i,
        None => make_shared(keys, p, tick),
    }
}

#[cold]
fn make_shared(keys: &mut Keys, p: &Policy, tick: u64) -> u32 {
    match keys.find("") {
        Some(i) => {
            keys.move_to_back(i, SHARED);
            i
        }
        None => keys.insert(Arc::from(""), KeyState::fresh(p, tick), SHARED),
    }
}

/// The state a call of the key at `at` decides with (see [`View`]); nothing is touched.
#[inline(always)]
fn view_of<'a>(keys: &'a mut Keys, p: &Policy, at: u32, tick: u64) -> Option<View<'a>> {
    if p.scopes.any() {
        return split_view(keys, p, at, tick);
    }
    keys.get_mut(at).map(|(_, s)| View::own(s))
}

#[inline(never)]
fn split_view<'a>(keys: &'a mut Keys, p: &Policy, at: u32, tick: u64) -> Option<View<'a>> {
    let shared = shared_position(keys, p, tick);
    if shared == at {
        return keys.get_mut(at).map(|(_, s)| View::own(s));
    }
    let (own, shared) = keys.get2_mut(at, shared)?;
    Some(View::split(own, shared, &p.scopes))
}

/// Index of the overflow entry, made when absent.
#[cold]
fn overflow_position(keys: &mut Keys, p: &Policy, tick: u64) -> u32 {
    match keys.front(OVERFLOW) {
        Some(i) => i,
        None => keys.insert(Arc::from(OVERFLOW_KEY), KeyState::fresh(p, tick), OVERFLOW),
    }
}

/// The state of `key` by name (made when absent, as `key_position`), touched for the LRU:
/// its index, the table's `Arc` of the name, and the state.
#[allow(clippy::too_many_arguments)]
#[inline]
fn named_key_state<'a>(
    keys: &'a mut Keys,
    p: &Policy,
    policy: usize,
    key: &str,
    tick: &mut u64,
    now: u64,
    events: &mut VecDeque<Event>,
) -> Option<(u32, &'a Arc<str>, &'a mut KeyState)> {
    *tick = tick.wrapping_add(1);
    let at = key_position(keys, p, policy, key, *tick, now, events);
    touch(keys, at);
    let (name, state) = keys.get_mut(at)?;
    state.last_used = *tick;
    Some((at, name, state))
}

/// Move a key to the most recent end of its list.
#[inline]
fn touch(keys: &mut Keys, at: u32) {
    if let Some(list) = keys.list_of(at) {
        keys.move_to_back(at, list);
    }
}

/// The state of a live call's key, touched for the LRU. `at` is where the call last found
/// it: when the table still holds the call's own key there, nothing is searched; otherwise
/// (the key was evicted, and is made again) it is found by name and `at` and `name` are
/// brought up to date.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn call_key_state<'a>(
    keys: &'a mut Keys,
    p: &Policy,
    policy: usize,
    name: &mut CallKey,
    at: &mut u32,
    tick: &mut u64,
    now: u64,
    events: &mut VecDeque<Event>,
    touch_now: bool,
) -> Option<View<'a>> {
    *tick = tick.wrapping_add(1);
    let t = *tick;
    if !keys.get(*at).is_some_and(|(k, _)| name.is(k)) {
        relocate_key(keys, p, policy, name, at, t, now, events);
    }
    if touch_now {
        touch(keys, *at);
    }
    if p.scopes.any() {
        return touched_split_view(keys, p, *at, t);
    }
    let (_, state) = keys.get_mut(*at)?;
    state.last_used = t;
    Some(View::own(state))
}

#[inline(never)]
fn touched_split_view<'a>(keys: &'a mut Keys, p: &Policy, at: u32, tick: u64) -> Option<View<'a>> {
    if let Some((_, state)) = keys.get_mut(at) {
        state.last_used = tick;
    }
    split_view(keys, p, at, tick)
}

#[cold]
#[inline(never)]
#[allow(clippy::too_many_arguments)]
fn relocate_key(
    keys: &mut Keys,
    p: &Policy,
    policy: usize,
    name: &mut CallKey,
    at: &mut u32,
    tick: u64,
    now: u64,
    events: &mut VecDeque<Event>,
) {
    let key = name.clone();
    *at = key_position(keys, p, policy, &key, tick, now, events);
    if let Some((k, _)) = keys.get(*at) {
        *name = CallKey::of(k);
    }
}

/// The state of a key, if it has one (a lookup that touches nothing).
fn key_state<'a>(keys: &'a Keys, key: &str) -> Option<&'a KeyState> {
    keys.find(key).and_then(|i| keys.get(i)).map(|(_, s)| s)
}

/// What an attempt's outcome teaches an adaptive limit (see `crate::adaptive`): the
/// dependency's answers are latency samples, a timeout is a drop, the rest is ignored.
#[inline(never)]
fn observe_limit(cfg: &crate::adaptive::AdaptiveCfg, lim: &mut Limit, kind: OutcomeKind, elapsed: u64, in_flight: u32, now: u64) {
    let signal = match kind {
        OutcomeKind::Success | OutcomeKind::HttpStatus | OutcomeKind::GrpcStatus => Signal::Sample { rtt: elapsed, in_flight },
        OutcomeKind::Timeout => Signal::Drop,
        OutcomeKind::ConnectionError | OutcomeKind::ErrorClass => return,
    };
    lim.observe(cfg, signal, now);
}

/// A late outcome: the attempt outlived the timeout its verdict or command gave (0: none), as
/// with a host that could not stop waiting, such as a blocking function. Whatever it produced,
/// it is a timeout, decided here once so that every host's late attempt means the same thing.
#[inline(always)]
fn late_is_timeout(timeout: u64, elapsed: u64, kind: OutcomeKind, code: i32, text: &str) -> (OutcomeKind, i32, &str) {
    if timeout > 0 && elapsed >= timeout && kind != OutcomeKind::Timeout {
        (OutcomeKind::Timeout, 0, "")
    } else {
        (kind, code, text)
    }
}

/// An attempt's outcome as the policy reads it: the delay the server asked for (Retry-After,
/// gRPC pushback, when the policy honours them; `wall_secs` dates an HTTP date) and the outcome
/// as classification sees it. A plain call's, a hedged attempt's and a durable call's alike.
#[inline]
pub(crate) fn observe<'t>(p: &Policy, kind: OutcomeKind, code: i32, text: &'t str, wall_secs: u64) -> (ServerDelay, Observed<'t>) {
    let server = match kind {
        OutcomeKind::HttpStatus if p.retry_after.honor => parse_retry_after(text, wall_secs),
        OutcomeKind::GrpcStatus if p.retry_after.honor => parse_pushback(text),
        _ => ServerDelay::None,
    };
    let observed = Observed {
        kind,
        code,
        class: if kind == OutcomeKind::ErrorClass { text } else { "" },
        has_pushback: kind == OutcomeKind::GrpcStatus && matches!(server, ServerDelay::After(_)),
    };
    (server, observed)
}

/// Record an attempt's outcome in the key's budget and breaker, as for every attempt (a plain
/// call's `report`, a hedged attempt's `report-attempt`): what the server said about a delay,
/// the outcome as classification sees it, and whether it is a success (a success also refills
/// a token budget).
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn record_outcome<'t>(
    p: &Policy,
    ks: &mut View<'_>,
    call: u64,
    (kind, code, text): (OutcomeKind, i32, &'t str),
    wall_secs: u64,
    flags: u32,
    elapsed: u64,
    now: u64,
    events: &mut VecDeque<Event>,
    policy: usize,
    key: &str,
) -> (ServerDelay, Observed<'t>, bool) {
    let (server, observed) = observe(p, kind, code, text, wall_secs);
    let success = classify::succeeded(&observed, flags);
    if let (Some(cfg), Some(b)) = (&p.budget, ks.budget.as_mut()) {
        b.on_outcome(cfg, &observed, now);
    }
    if let (Some(cfg), Some(b)) = (&p.breaker, ks.breaker.as_mut()) {
        // A result the caller's predicate calls a failure is not the dependency failing.
        let failure = !observed.is_success() && cfg.failure_on.matches(&observed);
        let slow = elapsed >= cfg.slow_call_duration;
        let mut t = Vec::new();
        b.record(cfg, call, now, failure, slow, &mut t);
        transition_events(events, &t, &[], now, policy, state_key(p.scopes.breaker, key));
    }
    if success {
        if let (Some(cfg), Some(b)) = (&p.budget, ks.budget.as_mut()) {
            b.on_success(cfg);
        }
    }
    (server, observed, success)
}

/// An attempt's outcome as `report-attempt` gives it.
struct AttemptOutcome<'a> {
    attempt: u32,
    elapsed: u64,
    kind: OutcomeKind,
    code: i32,
    text: &'a str,
    wall_secs: u64,
    flags: u32,
}

/// Whether a call's request may be sent twice: it carries an idempotency key, or it is
/// idempotent (not flagged otherwise, and its HTTP method is one the policy calls idempotent).
fn may_resend(p: &Policy, flags: u32) -> bool {
    let method = (flags >> 8) & 0xF;
    flags & FLAG_IDEMPOTENCY_KEY != 0 || (flags & FLAG_NON_IDEMPOTENT == 0 && p.method_idempotent(method))
}

/// Whether one more hedge of a call may start at `now`, and what it then holds: checked in
/// this order, as a retry's attempt is (a refusal leaves what earlier checks took): the
/// deadline; idempotency (a hedge is a second request: never for an operation that is not
/// idempotent and has no idempotency key); the breaker, which must be closed (a half-open
/// breaker's trials are single attempts); the concurrency limit, with no call waiting in the
/// bulkhead's queue (a hedge never overtakes it); the retry budget, as for a retry (A6: only
/// while the throttle holds more than half its tokens); the rate limit, with no waiting.
#[allow(clippy::too_many_arguments)]
fn admit_hedge(
    p: &Policy,
    cfg: &hedge::HedgeCfg,
    ks: &mut View<'_>,
    deadline: Option<u64>,
    flags: u32,
    now: u64,
    events: &mut VecDeque<Event>,
    policy: usize,
    key: &str,
    (call, attempt): (u64, u32),
) -> Result<Held, Reason> {
    if deadline::passed(deadline, now) {
        return Err(Reason::Deadline);
    }
    if !may_resend(p, flags) {
        return Err(Reason::NonIdempotent);
    }
    if let (Some(bc), Some(b)) = (&p.breaker, ks.breaker.as_mut()) {
        let (mut t, mut expired) = (Vec::new(), Vec::new());
        let check = b.check(bc, now, &mut t, &mut expired);
        transition_events(events, &t, &expired, now, policy, state_key(p.scopes.breaker, key));
        if check != (Check::Allow { permit: false }) {
            return Err(Reason::BreakerOpen);
        }
    }
    if let Some(bh) = &p.bulkhead {
        if !bh.admits(*ks.in_flight) || ks.queue.as_ref().is_some_and(|q| !q.is_clear()) {
            return Err(Reason::BulkheadFull);
        }
    }
    if let (Some(ac), Some(lim)) = (&p.concurrency, ks.adaptive.as_deref()) {
        if *ks.in_flight >= lim.current(ac) {
            return Err(Reason::BulkheadFull);
        }
    }
    if let (Some(bc), Some(b)) = (&p.budget, ks.budget.as_mut()) {
        match bc {
            BudgetCfg::AwsAdaptive(_) => {
                if b.try_acquire(bc, now).is_err() {
                    return Err(Reason::RateLimited);
                }
            }
            _ => {
                if let (false, level) = b.try_retry(bc, now) {
                    let mut e = Event::new(now, EventKind::BudgetRefused, policy as u32, key);
                    e.call = call;
                    e.attempt = attempt;
                    e.reason = Reason::Budget;
                    e.value = level;
                    push_event(events, e);
                    return Err(Reason::Budget);
                }
            }
        }
    }
    if let (Some(rc), Some(g)) = (&p.rate_limit, ks.limiter.as_mut()) {
        if g.try_take(rc, now).is_err() {
            return Err(Reason::RateLimited);
        }
    }
    let slot = p.bulkhead.is_some() || p.concurrency.is_some();
    if slot {
        *ks.in_flight = ks.in_flight.saturating_add(1);
    }
    let per_try = if cfg.preset == Preset::Envoy { None } else { p.attempt_timeout };
    Ok(Held { open: true, permit: false, slot, timeout: deadline::attempt_timeout(per_try, deadline, now) })
}

/// A hedged attempt closed: free what it held and, when it was still live (not cancelled by
/// the core), record its outcome as any attempt's (budget, breaker, adaptive limit) and
/// classify it for the strategy. A cancelled attempt is neither a failure nor a sample.
#[allow(clippy::too_many_arguments)]
fn close_attempt(
    p: &Policy,
    cfg: &hedge::HedgeCfg,
    ks: &mut View<'_>,
    call: u64,
    h: Held,
    live: bool,
    o: &AttemptOutcome<'_>,
    now: u64,
    events: &mut VecDeque<Event>,
    policy: usize,
    key: &str,
) -> Option<hedge::Outcome> {
    let (kind, code, text) = late_is_timeout(h.timeout, o.elapsed, o.kind, o.code, o.text);
    if h.slot {
        if let (true, Some(ac), Some(lim)) = (live, &p.concurrency, ks.adaptive.as_deref_mut()) {
            observe_limit(ac, lim, kind, o.elapsed, *ks.in_flight, now);
        }
        *ks.in_flight = ks.in_flight.saturating_sub(1);
    }
    if !live {
        if h.permit {
            if let Some(b) = ks.breaker.as_mut() {
                b.give_back(call);
            }
        }
        return None;
    }
    let (server, observed, success) =
        record_outcome(p, ks, call, (kind, code, text), o.wall_secs, o.flags, o.elapsed, now, events, policy, key);
    if success {
        return Some(hedge::Outcome::Ok);
    }
    if !classify::retryable(&cfg.non_fatal, &p.never_retry, &observed, o.flags) {
        return Some(hedge::Outcome::Fatal);
    }
    if let (Some(bc), Some(b)) = (&p.budget, ks.budget.as_mut()) {
        b.on_failure(bc);
    }
    let pushback = match (kind, server) {
        (OutcomeKind::GrpcStatus, ServerDelay::After(d)) => Some(Some(d)),
        (OutcomeKind::GrpcStatus, ServerDelay::Stop) => Some(None),
        _ => None,
    };
    Some(hedge::Outcome::NonFatal { pushback })
}

/// The tables' hasher seed for an engine seed (a different stream from the jitter PRNG's).
fn hash_seed_of(seed: u64) -> u64 {
    Rng::new(seed ^ 0x7461_626c_6573_6565).next_u64()
}

impl Engine {
    /// Parse, validate and fill defaults; every error names its field path.
    pub fn load(document: &str, seed: u64) -> Result<Engine, Vec<LoadError>> {
        let policies = policy::parse_document(document)?;
        Ok(Engine::from_policies(policies, seed))
    }

    pub(crate) fn from_policies(policies: Vec<Policy>, seed: u64) -> Engine {
        Engine::with_tables(policies, Rng::new(seed), hash_seed_of(seed))
    }

    fn with_tables(policies: Vec<Policy>, rng: Rng, hash_seed: u64) -> Engine {
        let keys = policies.iter().map(|_| Keys::with_seed(hash_seed)).collect();
        Engine {
            policies,
            keys,
            calls: Calls::with_seed(hash_seed),
            events: VecDeque::new(),
            rng,
            tick: 0,
            hash_seed,
            fleet: Default::default(),
            wakes: Wakes::default(),
            queue_ids: 0,
            regrant: None,
            touched: None,
            pages: Default::default(),
        }
    }

    /// Empty key tables for the current policies (with this engine's hasher seed).
    pub(crate) fn empty_keys(&self) -> Vec<Keys> {
        self.policies.iter().map(|_| Keys::with_seed(self.hash_seed)).collect()
    }

    /// Replace the policies, keeping the state that still applies (see `import_state`) and the
    /// live calls whose policy still exists. On error nothing changes.
    pub fn reload(&mut self, document: &str) -> Result<(), Vec<LoadError>> {
        let policies = policy::parse_document(document)?;
        let snapshot = self.export_state();
        let mut next = Engine::with_tables(policies, self.rng.clone(), self.hash_seed);
        next.import_state(&snapshot).map_err(|e| vec![e])?;
        next.rescale_token_budgets(self);
        // Live calls and their slots move over by policy name, oldest first (their order
        // decides which is evicted first).
        let mut at = self.calls.front(0);
        while let Some(i) = at {
            at = self.calls.next(i);
            let Some((&id, call)) = self.calls.get(i) else { continue };
            let Some(name) = self.policies.get(call.policy).map(|p| p.name.as_str()) else { continue };
            let Some(index) = next.policies.iter().position(|p| p.name == name) else { continue };
            let mut moved = call.clone();
            moved.policy = index;
            moved.key_at = u32::MAX; // found again by name in the new table
            if moved.ticket != Ticket::None {
                // The queues do not move (a new policy may differ): a queued or granted call
                // is woken to acquire again, in the new queue.
                moved.ticket = Ticket::None;
                self.wakes.push(id);
            }
            if let (Some(old), Some(new)) =
                (self.keys.get(call.policy).and_then(|k| k.find(&*call.key).and_then(|i| k.get(i))), next.keys.get_mut(index))
            {
                if let (Some(j), Some(p)) = (new.find(&*call.key), next.policies.get(index)) {
                    if let Some((_, ks)) = new.get_mut(j) {
                        ks.in_flight = old.1.in_flight;
                    }
                    refile(new, p, j, 0);
                }
            }
            next.calls.insert(id, moved, 0);
        }
        next.events = std::mem::take(&mut self.events);
        next.wakes = std::mem::take(&mut self.wakes);
        next.queue_ids = self.queue_ids;
        *self = next;
        Ok(())
    }

    /// After a reload, a token budget whose `max-tokens` changed keeps its level in
    /// proportion (gRPC's retry throttling: "if we're already throttling retries on the old
    /// scale, we will start out doing the same thing on the new one").
    fn rescale_token_budgets(&mut self, old: &Engine) {
        for (pi, p) in self.policies.iter().enumerate() {
            let Some(BudgetCfg::Token { max_milli: new_max, .. }) = p.budget else { continue };
            let Some(oi) = old.policies.iter().position(|o| o.name == p.name) else { continue };
            let Some(BudgetCfg::Token { max_milli: old_max, .. }) = old.policies.get(oi).and_then(|o| o.budget.clone()) else { continue };
            if old_max == new_max || old_max <= 0 {
                continue;
            }
            let (Some(old_keys), Some(keys)) = (old.keys.get(oi), self.keys.get_mut(pi)) else { continue };
            for (_, name, old_state) in old_keys.iter() {
                let Some(BudgetState::Token { tokens }) = old_state.budget else { continue };
                let Some((_, ks)) = keys.find(&**name).and_then(|i| keys.get_mut(i)) else { continue };
                let scaled = i128::from(tokens.clamp(0, old_max)) * i128::from(new_max) / i128::from(old_max);
                ks.budget = Some(BudgetState::Token { tokens: scaled.clamp(0, i128::from(new_max)) as i64 });
            }
        }
    }

    /// Number of policies.
    pub fn policy_count(&self) -> u32 {
        self.policies.len() as u32
    }

    /// Index of a named policy.
    pub fn policy_index(&self, name: &str) -> Option<u32> {
        self.policies.iter().position(|p| p.name == name).map(|i| i as u32)
    }

    /// The validated policy at an index.
    pub fn policy(&self, index: u32) -> Option<&Policy> {
        self.policies.get(index as usize)
    }

    /// What a host needs to know of a policy.
    pub fn policy_info(&self, index: u32) -> Option<PolicyInfo> {
        let p = self.policy(index)?;
        Some(PolicyInfo {
            name: p.name.clone(),
            max_attempts: p.attempts,
            attempt_timeout: p.attempt_timeout.unwrap_or(0),
            deadline: p.deadline.unwrap_or(0),
            fallbacks: p.fallbacks.iter().map(|f| f.name.clone()).collect(),
        })
    }

    /// The policy with every default, as JSON.
    pub fn policy_json(&self, index: u32) -> Option<String> {
        self.policy(index).map(policy::to_json)
    }

    /// Worst cases of a policy run by `layers` layers.
    pub fn analyze(&self, index: u32, layers: u32) -> Option<crate::Analysis> {
        self.policy(index).map(|p| crate::analysis::analyze(p, layers))
    }

    fn finish(&self, v: Verdict) -> Verdict {
        v.with_events(!self.events.is_empty()).with_wakes(!self.wakes.is_empty())
    }

    /// Begin a call and acquire its first attempt (see the WIT for `flags` and settling).
    #[allow(clippy::too_many_arguments)]
    pub fn start(
        &mut self,
        call: u64,
        policy: u32,
        key: &str,
        flags: u32,
        now: u64,
        settle_call: u64,
        settle_at: u64,
        settle_elapsed: u64,
    ) -> Verdict {
        if settle_call != 0 {
            // A held-back success; its answer is `done` (or invalid, a host bug that the host
            // learns of when the call's next operation fails). A late one (held back against
            // the protocol) is a timeout whose answer nobody hears: end the call so that
            // nothing it holds outlives it.
            let v = self.report(settle_call, settle_at, settle_elapsed, OutcomeKind::Success, 0, "", 0, 0);
            if !matches!(v.kind(), Some(VerdictKind::Done | VerdictKind::Invalid)) {
                self.cancel(settle_call, settle_at);
            }
        }
        if call == 0 || self.calls.find(&call).is_some() {
            return self.finish(Verdict::invalid(InvalidCode::DuplicateCall));
        }
        let pi = policy as usize;
        if pi >= self.policies.len() {
            return self.finish(Verdict::invalid(InvalidCode::UnknownPolicy));
        }
        if self.calls.len() >= MAX_LIVE_CALLS {
            self.evict_oldest_call(now);
        }
        let (Some(p), Some(keys)) = (self.policies.get(pi), self.keys.get_mut(pi)) else {
            return self.finish(Verdict::invalid(InvalidCode::UnknownPolicy));
        };
        let Some((key_at, key_arc, _)) = named_key_state(keys, p, pi, key, &mut self.tick, now, &mut self.events) else {
            return self.finish(Verdict::invalid(InvalidCode::UnknownPolicy));
        };
        let key = CallKey::of(key_arc);
        if let (Some(cfg), Some(ks)) = (&p.budget, view_of(keys, p, key_at, self.tick)) {
            if let Some(b) = ks.budget.as_mut() {
                b.on_call(cfg, now);
            }
        }
        let deadline = deadline::starting_at(p.deadline, now);
        let slot = self.calls.insert(
            call,
            Call {
                policy: pi,
                key,
                key_at,
                flags,
                seen: now,
                deadline,
                attempts: 0,
                phase: Phase::Ready,
                last_reason: Reason::None,
                backoff: retry::BackoffState::default(),
                reserved_at: None,
                hedge: None,
                ticket: Ticket::None,
            },
            0,
        );
        self.acquire_at(slot, now)
    }

    /// Make room for one more live call: the call started longest ago goes (event
    /// `call-evicted`), releasing what it holds. Its host learns it at its next step, which
    /// answers `invalid` (unknown call).
    fn evict_oldest_call(&mut self, now: u64) {
        let Some(i) = self.calls.front(0) else { return };
        let Some((&id, c)) = self.calls.get(i) else { return };
        let mut e = Event::new(now, EventKind::CallEvicted, c.policy as u32, &c.key);
        e.call = id;
        e.attempt = c.attempts;
        push_event(&mut self.events, e);
        self.leave_queue(i);
        self.release_at(i, now);
        self.calls.delete(i);
    }

    /// Take a call out of its key's bulkhead queue, if it waits there or holds a grant (it
    /// ends, is cancelled or evicted); a grant it gives up goes to the next waiter.
    fn leave_queue(&mut self, i: u32) {
        let Some((_, c)) = self.calls.get(i) else { return };
        if c.ticket == Ticket::None {
            return;
        }
        let pi = c.policy;
        let key_at = self.keys.get(pi).and_then(|keys| {
            if keys.get(c.key_at).is_some_and(|(k, _)| c.key.is(k)) {
                Some(c.key_at)
            } else {
                keys.find(&*c.key)
            }
        });
        let tick = self.tick;
        let view = match (key_at, self.policies.get(pi), self.keys.get_mut(pi)) {
            (Some(at), Some(p), Some(keys)) => view_of(keys, p, at, tick),
            _ => None,
        };
        let queue = view.and_then(|v| v.queue.as_deref_mut());
        let gave_up = match queue {
            Some(q) => q.leave(&mut self.calls, i),
            None => {
                if let Some(t) = self.calls.ticket(i) {
                    *t = Ticket::None; // its queue is gone
                }
                false
            }
        };
        if let (true, Some(at)) = (gave_up, key_at) {
            self.grant_at(pi, at);
        }
    }

    /// Grant the free slots of the key at `key_at` of policy `pi` to its oldest waiters (see
    /// `bulkhead`): after anything that lowers its attempts in flight or gives a grant up.
    #[inline]
    fn grant_at(&mut self, pi: usize, key_at: u32) {
        let Some(p) = self.policies.get(pi) else { return };
        let Some(bh) = p.bulkhead.as_ref() else { return };
        let Some(ks) = self.keys.get_mut(pi).and_then(|k| view_of(k, p, key_at, self.tick)) else { return };
        if let Some(q) = ks.queue.as_deref_mut() {
            bh.grant(q, &mut self.calls, *ks.in_flight, &mut self.wakes);
        }
    }

    /// The calls granted a bulkhead slot since the last take, in grant order: the host wakes
    /// exactly these parked calls (docs/policy.md, "The queue").
    pub fn take_wakes(&mut self) -> Vec<u64> {
        self.wakes.take()
    }

    /// Whether granted calls wait to be woken.
    pub fn has_wakes(&self) -> bool {
        !self.wakes.is_empty()
    }

    /// Give back what an in-flight attempt holds (no outcome recorded).
    fn release_at(&mut self, i: u32, now: u64) {
        let Some((&call, c)) = self.calls.get_mut(i) else { return };
        let (slots, permit) = match c.phase {
            Phase::InFlight { permit, slot, .. } => {
                c.phase = Phase::Ready;
                (u32::from(slot), permit)
            }
            _ => match c.hedge.as_deref_mut() {
                Some(h) => h.close_all(),
                None => return,
            },
        };
        if slots == 0 && !permit {
            return;
        }
        let now = c.observe(now);
        let (Some(p), Some(keys)) = (self.policies.get(c.policy), self.keys.get_mut(c.policy)) else { return };
        let Some(ks) = call_key_state(keys, p, c.policy, &mut c.key, &mut c.key_at, &mut self.tick, now, &mut self.events, true) else {
            return;
        };
        *ks.in_flight = ks.in_flight.saturating_sub(slots);
        if permit {
            if let Some(b) = ks.breaker.as_mut() {
                b.give_back(call);
            }
        }
        refile(keys, p, c.key_at, now);
        let (pi, key_at) = (c.policy, c.key_at);
        if slots > 0 {
            self.grant_at(pi, key_at);
        }
    }

    /// Acquire the next attempt of a call.
    pub fn acquire(&mut self, call: u64, now: u64) -> Verdict {
        match self.calls.find(&call) {
            Some(slot) => self.acquire_at(slot, now),
            None => self.finish(Verdict::invalid(InvalidCode::UnknownCall)),
        }
    }

    /// Acquire the next attempt of the call at an index of the call table.
    fn acquire_at(&mut self, slot: u32, now: u64) -> Verdict {
        let v = self.acquire_step(slot, now);
        self.file_touched();
        match self.regrant.take() {
            None => v,
            Some((pi, key_at)) => {
                // A reserved slot used up by a call that did not take it is free again.
                self.grant_at(pi, key_at);
                v.with_wakes(self.has_wakes())
            }
        }
    }

    fn acquire_step(&mut self, slot: u32, now: u64) -> Verdict {
        let Some((&call, mut c)) = self.calls.get_mut(slot) else {
            return self.finish(Verdict::invalid(InvalidCode::UnknownCall));
        };
        if c.phase != Phase::Ready {
            return self.finish(Verdict::invalid(InvalidCode::WrongStep));
        }
        let now = c.observe(now);
        let pi = c.policy;
        let (Some(p), Some(keys)) = (self.policies.get(pi), self.keys.get_mut(pi)) else {
            return self.finish(Verdict::invalid(InvalidCode::UnknownPolicy));
        };
        if deadline::passed(c.deadline, now) {
            return self.reject_at(slot, Reason::Deadline, 0, now);
        }
        if c.attempts >= p.attempts {
            // Cannot happen through `report`; kept so that no path exceeds the maximum.
            return self.end_at(slot, Reason::RetriesExhausted, 0, now);
        }
        // Its touch is left to `file_touched`, which files it once the operation is over.
        let Some(ks) = call_key_state(keys, p, pi, &mut c.key, &mut c.key_at, &mut self.tick, now, &mut self.events, false) else {
            return self.finish(Verdict::invalid(InvalidCode::UnknownPolicy));
        };
        self.touched = Some((pi, c.key_at, now));

        // Circuit breaker.
        let mut permit = false;
        if let (Some(cfg), Some(b)) = (&p.breaker, ks.breaker.as_mut()) {
            let (mut t, mut expired) = (Vec::new(), Vec::new());
            let check = b.check(cfg, now, &mut t, &mut expired);
            transition_events(&mut self.events, &t, &expired, now, pi, state_key(p.scopes.breaker, &c.key));
            match check {
                Check::Allow { permit: p } => permit = p,
                Check::Reject(hint) => return self.reject_at(slot, Reason::BreakerOpen, hint, now),
            }
        }
        // Concurrency limit: fixed (bulkhead) or adaptive.
        let bulkhead = p.bulkhead.is_some() || p.concurrency.is_some();
        if let Some(bh) = &p.bulkhead {
            if bh.queue == 0 {
                if !bh.admits(*ks.in_flight) {
                    return self.reject_at(slot, Reason::BulkheadFull, 0, now);
                }
            } else {
                let (deadline, key_at) = (c.deadline, c.key_at);
                let queue = ks.queue.get_or_insert_with(|| {
                    self.queue_ids += 1;
                    Box::new(Queue::new(self.queue_ids))
                });
                let admit = bh.admit(queue, &mut self.calls, slot, *ks.in_flight, now, deadline);
                if admit == Admit::Slot {
                    // Taken at the commit below; if the call stops short of it, the slot
                    // (a grant it used up) is granted again.
                    self.regrant = Some((pi, key_at));
                } else if let Admit::Wait(_) = admit {
                    // A newcomer behind a grant with more free: granted at once.
                    bh.grant(queue, &mut self.calls, *ks.in_flight, &mut self.wakes);
                }
                let Some((_, again)) = self.calls.get_mut(slot) else {
                    return self.finish(Verdict::invalid(InvalidCode::UnknownCall));
                };
                c = again;
                match admit {
                    Admit::Slot => {}
                    Admit::Wait(wait) => {
                        let mut e = Event::new(now, EventKind::RateLimitWait, pi as u32, &c.key);
                        e.call = call;
                        e.attempt = c.attempts.saturating_add(1);
                        e.reason = Reason::BulkheadFull;
                        e.duration = wait;
                        push_event(&mut self.events, e);
                        return self.finish(Verdict::new(VerdictKind::Wait, Reason::BulkheadFull as u8, wait));
                    }
                    Admit::Full => return self.reject_at(slot, Reason::BulkheadFull, 0, now),
                }
            }
        }
        if let (Some(cfg), Some(lim)) = (&p.concurrency, ks.adaptive.as_deref()) {
            if *ks.in_flight >= lim.current(cfg) {
                return self.reject_at(slot, Reason::BulkheadFull, 0, now);
            }
        }
        // Rate limit.
        if let (Some(cfg), Some(g)) = (&p.rate_limit, ks.limiter.as_mut()) {
            match c.reserved_at {
                Some(at) if now < at => return self.finish(Verdict::new(VerdictKind::Wait, Reason::RateLimited as u8, at - now)),
                Some(_) => c.reserved_at = None,
                None => {
                    if let Err(wait) = g.try_take(cfg, now) {
                        // The limiter's own clock: never earlier than a `now` it has seen.
                        let now = g.last_now;
                        let fits = c.deadline.is_none_or(|dl| now.saturating_add(wait) < dl);
                        if wait <= cfg.max_wait && fits {
                            g.reserve(cfg, now);
                            c.reserved_at = Some(now.saturating_add(wait));
                            let mut e = Event::new(now, EventKind::RateLimitWait, pi as u32, &c.key);
                            e.call = call;
                            e.attempt = c.attempts.saturating_add(1);
                            e.reason = Reason::RateLimited;
                            e.duration = wait;
                            push_event(&mut self.events, e);
                            return self.finish(Verdict::new(VerdictKind::Wait, Reason::RateLimited as u8, wait));
                        }
                        return self.reject_at(slot, Reason::RateLimited, wait, now);
                    }
                }
            }
        }
        // The AWS client rate (budget kind aws-adaptive; a policy with it has no rate-limit,
        // so `reserved_at` is its own).
        if let (Some(cfg @ BudgetCfg::AwsAdaptive(aws)), Some(b)) = (&p.budget, ks.budget.as_mut()) {
            match c.reserved_at {
                Some(at) if now < at => return self.finish(Verdict::new(VerdictKind::Wait, Reason::RateLimited as u8, at - now)),
                Some(_) => c.reserved_at = None,
                None => {
                    if let Err(wait) = b.try_acquire(cfg, now) {
                        let fits = c.deadline.is_none_or(|dl| now.saturating_add(wait) < dl);
                        if wait <= aws.max_wait && fits {
                            c.reserved_at = Some(now.saturating_add(wait));
                            let mut e = Event::new(now, EventKind::RateLimitWait, pi as u32, &c.key);
                            e.call = call;
                            e.attempt = c.attempts.saturating_add(1);
                            e.reason = Reason::RateLimited;
                            e.duration = wait;
                            push_event(&mut self.events, e);
                            return self.finish(Verdict::new(VerdictKind::Wait, Reason::RateLimited as u8, wait));
                        }
                        b.give_back();
                        return self.reject_at(slot, Reason::RateLimited, wait, now);
                    }
                }
            }
        }
        // Commit.
        if permit {
            if let Some(b) = ks.breaker.as_mut() {
                b.take_permit(call, now);
            }
        }
        if bulkhead {
            *ks.in_flight = ks.in_flight.saturating_add(1);
        }
        c.attempts = c.attempts.saturating_add(1);
        if let Some(h) = &p.hedge {
            // Under envoy the per-try timeout starts the next hedge and cancels nothing.
            let per_try = if h.preset == Preset::Envoy { None } else { p.attempt_timeout };
            let timeout = deadline::attempt_timeout(per_try, c.deadline, now);
            let mut held = [Held::default(); HELD];
            if let Some(first) = held.get_mut(1) {
                *first = Held { open: true, permit, slot: bulkhead, timeout };
            }
            let mut machine = Hedge::new(h, now);
            if !may_resend(p, c.flags) {
                // Never hedged: no wait for a hedge that would be refused.
                machine.stop(Reason::NonIdempotent);
            }
            c.hedge = Some(Box::new(Hedged { machine, held }));
            c.phase = Phase::Hedged;
            return self.finish(Verdict::new(VerdictKind::Hedge, 1, timeout));
        }
        let timeout = deadline::attempt_timeout(p.attempt_timeout, c.deadline, now);
        c.phase = Phase::InFlight { permit, slot: bulkhead, timeout };
        let v = Verdict::attempt(c.attempts, timeout);
        self.finish(v)
    }

    fn reject_at(&mut self, slot: u32, reason: Reason, hint: u64, now: u64) -> Verdict {
        if let Some((&call, c)) = self.calls.get(slot) {
            let mut e = Event::new(now, EventKind::Rejected, c.policy as u32, &c.key);
            e.call = call;
            e.attempt = c.attempts.saturating_add(1);
            e.reason = reason;
            e.duration = hint;
            push_event(&mut self.events, e);
        }
        self.end_at(slot, reason, hint, now)
    }

    /// The retry loop stopped without success: choose a fallback or fail.
    fn end_at(&mut self, slot: u32, reason: Reason, hint: u64, now: u64) -> Verdict {
        self.leave_queue(slot);
        let Some((&call, c)) = self.calls.get_mut(slot) else {
            return self.finish(Verdict::invalid(InvalidCode::UnknownCall));
        };
        c.last_reason = reason;
        let mut e = Event::new(now, EventKind::GaveUp, c.policy as u32, &c.key);
        e.call = call;
        e.attempt = c.attempts;
        e.reason = reason;
        e.duration = hint;
        push_event(&mut self.events, e);
        self.next_fallback(slot, 0, reason, now).unwrap_or_else(|| {
            self.retire(slot);
            self.finish(Verdict::new(VerdictKind::Fail, reason as u8, hint))
        })
    }

    /// A call has ended: it leaves the table, unless attempts it cancelled (a hedged call's)
    /// still hold their slots; it then waits in `Closing` for their reports.
    fn retire(&mut self, at: u32) {
        if let Some((_, c)) = self.calls.get_mut(at) {
            if c.hedge.as_deref().is_some_and(Hedged::any_open) {
                c.phase = Phase::Closing;
                return;
            }
        }
        self.calls.delete(at);
    }

    fn next_fallback(&mut self, slot: u32, from: usize, reason: Reason, now: u64) -> Option<Verdict> {
        let (&call, c) = self.calls.get_mut(slot)?;
        let p = self.policies.get(c.policy)?;
        let (index, fb) = fallback::next(&p.fallbacks, from, reason)?;
        c.phase = Phase::Fallback { index, reason };
        let mut e = Event::new(now, EventKind::FallbackChosen, c.policy as u32, &c.key);
        e.call = call;
        e.attempt = c.attempts;
        e.reason = reason;
        e.name = fb.name.clone();
        push_event(&mut self.events, e);
        Some(self.finish(Verdict::new(VerdictKind::Fallback, reason as u8, index as u64)))
    }

    /// Report the outcome of the attempt in flight.
    #[allow(clippy::too_many_arguments)]
    pub fn report(
        &mut self,
        call: u64,
        now: u64,
        elapsed: u64,
        kind: OutcomeKind,
        code: i32,
        text: &str,
        wall_secs: u64,
        flags: u32,
    ) -> Verdict {
        let v = self.report_step(call, now, elapsed, kind, code, text, wall_secs, flags);
        self.file_touched();
        v
    }

    /// File the key the operation changed by what it now holds.
    #[inline]
    fn file_touched(&mut self) {
        if let Some((pi, at, now)) = self.touched.take() {
            if let (Some(p), Some(keys)) = (self.policies.get(pi), self.keys.get_mut(pi)) {
                file_at_back(keys, p, at, now);
            }
        }
    }

    #[allow(clippy::too_many_arguments)]
    #[inline(always)]
    fn report_step(
        &mut self,
        call: u64,
        now: u64,
        elapsed: u64,
        kind: OutcomeKind,
        code: i32,
        text: &str,
        wall_secs: u64,
        flags: u32,
    ) -> Verdict {
        let Some(at) = self.calls.find(&call) else {
            return self.finish(Verdict::invalid(InvalidCode::UnknownCall));
        };
        let Some((_, c)) = self.calls.get_mut(at) else {
            return self.finish(Verdict::invalid(InvalidCode::UnknownCall));
        };
        let Phase::InFlight { permit: _, slot, timeout } = c.phase else {
            return self.finish(Verdict::invalid(InvalidCode::WrongStep));
        };
        // A late outcome: the attempt outlived the timeout its verdict gave (a host that could
        // not stop waiting, such as a blocking function). Whatever it produced, it is a timeout,
        // decided here once so that every host's late attempt means the same thing.
        let (kind, code, text) = late_is_timeout(timeout, elapsed, kind, code, text);
        let pi = c.policy;
        let (Some(p), Some(keys)) = (self.policies.get(pi), self.keys.get_mut(pi)) else {
            return self.finish(Verdict::invalid(InvalidCode::UnknownPolicy));
        };
        c.phase = Phase::Ready;
        let now = c.observe(now);
        // Its touch is left to `file_touched`, which files it once the operation is over.
        let Some(mut ks) = call_key_state(keys, p, pi, &mut c.key, &mut c.key_at, &mut self.tick, now, &mut self.events, false) else {
            return self.finish(Verdict::invalid(InvalidCode::UnknownPolicy));
        };
        self.touched = Some((pi, c.key_at, now));
        if slot {
            if let (Some(cfg), Some(lim)) = (&p.concurrency, ks.adaptive.as_deref_mut()) {
                observe_limit(cfg, lim, kind, elapsed, *ks.in_flight, now);
            }
            *ks.in_flight = ks.in_flight.saturating_sub(1);
        }
        let (server, observed, success) =
            record_outcome(p, &mut ks, call, (kind, code, text), wall_secs, flags, elapsed, now, &mut self.events, pi, &c.key);
        if success {
            let key_at = c.key_at;
            self.calls.delete(at);
            if slot {
                self.grant_at(pi, key_at);
            }
            return self.finish(Verdict::new(VerdictKind::Done, 0, 0));
        }
        let retryable = classify::retryable(&p.retry_on, &p.never_retry, &observed, flags);
        let stop = server == ServerDelay::Stop;
        if let (Some(cfg), Some(b)) = (&p.budget, ks.budget.as_mut()) {
            if retryable || stop {
                b.on_failure(cfg);
            }
        }
        let key_at = c.key_at;
        if slot {
            self.grant_at(pi, key_at);
        }
        self.retry_decision(at, server, stop, retryable, now)
    }

    /// After a failed attempt that was recorded: retry, or end (fallback or fail), as the
    /// retry ladder (`crate::retry::decide`) says. Out of line: the success path stays small.
    #[inline(never)]
    fn retry_decision(&mut self, at: u32, server: ServerDelay, stop: bool, retryable: bool, now: u64) -> Verdict {
        let Some((&call, c)) = self.calls.get_mut(at) else {
            return self.finish(Verdict::invalid(InvalidCode::UnknownCall));
        };
        let pi = c.policy;
        let (Some(p), Some(keys)) = (self.policies.get(pi), self.keys.get_mut(pi)) else {
            return self.finish(Verdict::invalid(InvalidCode::UnknownPolicy));
        };
        let method = (c.flags >> 8) & 0xF;
        let idempotent = c.flags & FLAG_IDEMPOTENCY_KEY != 0 || (c.flags & FLAG_NON_IDEMPOTENT == 0 && p.method_idempotent(method));
        // The key's state was touched by this report already: found again without a touch.
        let ks = view_of(keys, p, c.key_at, self.tick);
        let open_until = ks.as_ref().and_then(|ks| ks.breaker.as_ref()).and_then(|b| b.rejects_until());
        let failure = Failure {
            stop,
            retryable,
            idempotent,
            attempts: c.attempts,
            server: match server {
                ServerDelay::After(d) => Some(d),
                _ => None,
            },
            now,
            deadline: c.deadline,
            open_until,
        };
        let (attempts, state, rng) = (c.attempts, c.backoff, &mut self.rng);
        let budget = ks.and_then(|ks| ks.budget.as_mut());
        let decision = retry::decide(
            p.attempts,
            &p.retry_after,
            failure,
            || state.delay(&p.backoff, attempts, rng),
            || match (&p.budget, budget) {
                (Some(cfg), Some(b)) => match b.try_retry(cfg, now) {
                    (true, _) => Ok(()),
                    (false, level) => Err(level),
                },
                _ => Ok(()),
            },
        );
        match decision {
            Decision::Retry(delay) => {
                c.backoff.retried(&failure, delay);
                let mut e = Event::new(now, EventKind::RetryScheduled, pi as u32, &c.key);
                e.call = call;
                e.attempt = c.attempts;
                e.duration = delay;
                push_event(&mut self.events, e);
                self.finish(Verdict::new(VerdictKind::Retry, 0, delay))
            }
            Decision::Stop { reason, hint } => self.end_at(at, reason, hint, now),
            Decision::Refused(level) => {
                let mut e = Event::new(now, EventKind::BudgetRefused, pi as u32, &c.key);
                e.call = call;
                e.attempt = c.attempts;
                e.reason = Reason::Budget;
                e.value = level;
                push_event(&mut self.events, e);
                self.end_at(at, Reason::Budget, 0, now)
            }
        }
    }

    /// Report whether the fallback the last verdict chose succeeded.
    pub fn report_fallback(&mut self, call: u64, now: u64, ok: bool) -> Verdict {
        let Some(at) = self.calls.find(&call) else {
            return self.finish(Verdict::invalid(InvalidCode::UnknownCall));
        };
        let Some((_, c)) = self.calls.get_mut(at) else {
            return self.finish(Verdict::invalid(InvalidCode::UnknownCall));
        };
        let Phase::Fallback { index, reason } = c.phase else {
            return self.finish(Verdict::invalid(InvalidCode::WrongStep));
        };
        let now = c.observe(now);
        if ok {
            self.retire(at);
            return self.finish(Verdict::new(VerdictKind::Done, 0, 0));
        }
        if let Some(v) = self.next_fallback(at, index.saturating_add(1), reason, now) {
            return v;
        }
        self.retire(at);
        self.finish(Verdict::new(VerdictKind::Fail, Reason::FallbacksFailed as u8, 0))
    }

    /// Advance a hedged call to `now` (after a `hedge` verdict, or a `wait` command): the
    /// commands to carry out, in order. A call that is not hedged, or has ended, answers
    /// `end` with an `invalid` verdict, or nothing while its cancelled attempts close.
    pub fn hedge_step(&mut self, call: u64, now: u64) -> Vec<HedgeCommand> {
        self.drive_hedge(call, now, None)
    }

    /// Report that attempt `attempt` of a hedged call closed, with its outcome (as `report`;
    /// a cancelled attempt's outcome is not looked at, only what it held is freed). The
    /// commands to carry out, in order.
    #[allow(clippy::too_many_arguments)]
    pub fn report_attempt(
        &mut self,
        call: u64,
        attempt: u32,
        now: u64,
        elapsed: u64,
        kind: OutcomeKind,
        code: i32,
        text: &str,
        wall_secs: u64,
        flags: u32,
    ) -> Vec<HedgeCommand> {
        self.drive_hedge(call, now, Some(AttemptOutcome { attempt, elapsed, kind, code, text, wall_secs, flags }))
    }

    fn hedge_invalid(&self, code: InvalidCode) -> Vec<HedgeCommand> {
        vec![HedgeCommand::End { attempt: 0, verdict: self.finish(Verdict::invalid(code)) }]
    }

    fn drive_hedge(&mut self, call: u64, now: u64, outcome: Option<AttemptOutcome<'_>>) -> Vec<HedgeCommand> {
        let Some(at) = self.calls.find(&call) else {
            return self.hedge_invalid(InvalidCode::UnknownCall);
        };
        let Some((_, c)) = self.calls.get_mut(at) else {
            return self.hedge_invalid(InvalidCode::UnknownCall);
        };
        let now = c.observe(now);
        let pi = c.policy;
        let (Some(p), Some(keys)) = (self.policies.get(pi), self.keys.get_mut(pi)) else {
            return self.hedge_invalid(InvalidCode::UnknownPolicy);
        };
        let (Some(cfg), Some(hedged)) = (&p.hedge, c.hedge.as_deref_mut()) else {
            return self.hedge_invalid(InvalidCode::WrongStep);
        };
        // The attempt reported must be open (started and not yet reported).
        let closing = match &outcome {
            None => None,
            Some(o) => match hedged.held.get_mut(o.attempt as usize).filter(|h| h.open) {
                Some(h) => Some(std::mem::take(h)),
                None => return self.hedge_invalid(InvalidCode::WrongStep),
            },
        };
        let Hedged { machine, held } = hedged;
        if closing.is_none() && machine.is_over() {
            return Vec::new();
        }
        let Some(mut ks) = call_key_state(keys, p, pi, &mut c.key, &mut c.key_at, &mut self.tick, now, &mut self.events, true) else {
            return self.hedge_invalid(InvalidCode::UnknownPolicy);
        };
        // The attempt that closed, first: what it frees is free for the next hedge.
        let reported = match (closing, &outcome) {
            (Some(h), Some(o)) => {
                let live = machine.is_in_flight(o.attempt);
                Some((o.attempt, close_attempt(p, cfg, &mut ks, call, h, live, o, now, &mut self.events, pi, &c.key)))
            }
            _ => None,
        };
        // Read before `admit` borrows the key: admitting a hedge only ever moves an open
        // breaker whose time is up to half-open, which this bound already allows.
        let open_until = ks.breaker.as_ref().and_then(Breaker::rejects_until);
        let mut out = Vec::new();
        let (deadline, flags) = (c.deadline, c.flags);
        let mut admit = |attempt: u32| -> Result<u64, Reason> {
            let h = admit_hedge(p, cfg, &mut ks, deadline, flags, now, &mut self.events, pi, &c.key, (call, attempt))?;
            if let Some(slot) = held.get_mut(attempt as usize) {
                *slot = h;
            }
            let mut e = Event::new(now, EventKind::HedgeStarted, pi as u32, &c.key);
            e.call = call;
            e.attempt = attempt;
            push_event(&mut self.events, e);
            Ok(h.timeout)
        };
        match reported {
            Some((attempt, Some(result))) => machine.report(attempt, now, result, &mut admit, &mut out),
            Some((_, None)) => {}
            None => machine.step(now, &mut admit, &mut out),
        }
        // A hedge due at or after the deadline can never start on time: no wait for it (a
        // host's wait never passes the deadline). The call goes on with the attempts in flight
        // (a non-fatal failure still sends the next hedge at once), or, when none is left,
        // fails for the deadline.
        // So is a hedge due while the key's breaker still rejects every attempt (open past that
        // time, or forced open): no wait ends in that refusal; with nothing in flight the call
        // fails for `breaker-open` now, as a plain call's retry does.
        if let Some(hedge::Command::Wait { until }) = out.last() {
            let stop = match (deadline, open_until) {
                (Some(d), _) if *until >= d => Some(Reason::Deadline),
                (_, Some(open)) if *until < open => Some(Reason::BreakerOpen),
                _ => None,
            };
            if let Some(reason) = stop {
                out.pop();
                if machine.in_flight().next().is_none() {
                    machine.stop(reason);
                    machine.step(now, &mut admit, &mut out);
                }
            }
        }
        let over = machine.is_over();
        c.attempts = c.attempts.max(machine.started());
        refile(keys, p, c.key_at, now);
        let key_at = c.key_at;
        let mut commands = Vec::with_capacity(out.len());
        for command in out {
            commands.push(match command {
                hedge::Command::Start { attempt, timeout } => HedgeCommand::Start { attempt, timeout },
                hedge::Command::Cancel { attempt } => HedgeCommand::Cancel { attempt },
                hedge::Command::Wait { until } => HedgeCommand::Wait { delay: until.saturating_sub(now) },
                hedge::Command::Done { attempt } => {
                    self.retire(at);
                    HedgeCommand::End { attempt, verdict: self.finish(Verdict::new(VerdictKind::Done, 0, 0)) }
                }
                hedge::Command::Fail { attempt, reason } => {
                    if let Some((_, c)) = self.calls.get_mut(at) {
                        c.phase = Phase::Ready;
                    }
                    HedgeCommand::End { attempt, verdict: self.end_at(at, reason, 0, now) }
                }
            });
        }
        // The last cancelled attempt of an ended call closed: the call leaves the table.
        if over {
            if let Some((_, c)) = self.calls.get(at) {
                if c.phase == Phase::Closing && !c.hedge.as_deref().is_some_and(Hedged::any_open) {
                    self.calls.delete(at);
                }
            }
        }
        // What the attempt that closed freed goes to the key's oldest waiters.
        self.grant_at(pi, key_at);
        if let Some(HedgeCommand::End { verdict, .. }) = commands.last_mut() {
            *verdict = self.finish(*verdict);
        }
        commands
    }

    /// Abandon a call: release what it holds.
    pub fn cancel(&mut self, call: u64, now: u64) {
        if let Some(at) = self.calls.find(&call) {
            self.leave_queue(at);
            self.release_at(at, now);
            self.calls.delete(at);
        }
    }

    /// What the engine knows of a live call.
    pub fn call_info(&self, call: u64) -> Option<CallInfo> {
        let (_, c) = self.calls.find(&call).and_then(|i| self.calls.get(i))?;
        Some(CallInfo {
            policy: c.policy as u32,
            key: c.key.to_string(),
            attempts: c.attempts,
            deadline: c.deadline.unwrap_or(0),
            last_reason: c.last_reason,
            in_flight: matches!(c.phase, Phase::InFlight { .. }) || c.hedge.as_deref().is_some_and(Hedged::any_open),
        })
    }

    /// Number of live calls.
    pub fn live_calls(&self) -> usize {
        self.calls.len()
    }

    /// Take the events recorded since the last drain, oldest first.
    pub fn drain_events(&mut self) -> Vec<Event> {
        self.events.drain(..).collect()
    }

    /// Whether events wait to be drained.
    pub fn has_events(&self) -> bool {
        !self.events.is_empty()
    }

    /// Breaker state of a policy and key at `now` (`None` when the policy has no breaker).
    pub fn breaker_state(&self, policy: u32, key: &str, now: u64) -> Option<BreakerState> {
        let p = self.policy(policy)?;
        p.breaker.as_ref()?;
        let key = state_key(p.scopes.breaker, key);
        let state = self
            .keys
            .get(policy as usize)
            .and_then(|k| key_state(k, key))
            .and_then(|s| s.breaker.as_ref())
            .map(|b| b.peek(now))
            .unwrap_or(BreakerState::Closed);
        Some(state)
    }

    /// Force a breaker state (forced-open, forced-closed, disabled; closed to return to normal).
    pub fn set_breaker_state(&mut self, policy: u32, key: &str, state: BreakerState, now: u64) -> Result<(), String> {
        let pi = policy as usize;
        let (Some(p), Some(keys)) = (self.policies.get(pi), self.keys.get_mut(pi)) else {
            return Err(format!("no policy with index {policy}"));
        };
        let Some(cfg) = &p.breaker else {
            return Err(format!("policy `{}` has no breaker", p.name));
        };
        // A breaker of `scope: policy` is the same one for every key.
        let key = state_key(p.scopes.breaker, key);
        let Some((at, _, _)) = named_key_state(keys, p, pi, key, &mut self.tick, now, &mut self.events) else {
            return Err(format!("no state for key `{key}`"));
        };
        if keys.list_of(at) == Some(OVERFLOW) && key != OVERFLOW_KEY {
            // Forcing the shared entry would force every key that overflows with it.
            return Err(format!(
                "key `{key}` has no state of its own: the {} keys of policy `{}` all hold protection (see keys.max)",
                p.max_keys, p.name
            ));
        }
        let Some((_, ks)) = keys.get_mut(at) else {
            return Err(format!("no state for key `{key}`"));
        };
        let b = ks.breaker.get_or_insert_with(|| cfg.fresh());
        let mut t = Vec::new();
        let forced = b.force(cfg, state, now, &mut t);
        transition_events(&mut self.events, &t, &[], now, pi, key);
        refile(keys, p, at, now);
        forced
    }

    /// Run `f` on the state of a key (made when absent, evicting as `start` does, and
    /// touched); the key is then filed by what it holds. `None` for an unknown policy.
    pub(crate) fn with_key_state<R>(&mut self, policy: usize, key: &str, f: impl FnOnce(&mut KeyState) -> R) -> Option<R> {
        let (Some(p), Some(keys)) = (self.policies.get(policy), self.keys.get_mut(policy)) else { return None };
        let now = 0;
        let (at, _, ks) = named_key_state(keys, p, policy, key, &mut self.tick, now, &mut self.events)?;
        let r = f(ks);
        refile(keys, p, at, now);
        Some(r)
    }

    /// In-flight attempts of a policy and key (for invariants and metrics).
    pub fn in_flight(&self, policy: u32, key: &str) -> u32 {
        let Some(p) = self.policy(policy) else { return 0 };
        let key = state_key(p.scopes.limit, key);
        self.keys.get(policy as usize).and_then(|k| key_state(k, key)).map(|s| s.in_flight).unwrap_or(0)
    }

    /// Half-open trial permits issued and not yet reported, expired or given back, of a
    /// policy and key (for invariants and metrics).
    pub fn breaker_trials(&self, policy: u32, key: &str) -> Option<u32> {
        let key = state_key(self.policy(policy)?.scopes.breaker, key);
        let b = key_state(self.keys.get(policy as usize)?, key)?.breaker.as_ref()?;
        Some(b.trials.get().permits.len() as u32)
    }

    /// Token-throttling level in milli-tokens of a policy and key, if it has one.
    pub fn budget_tokens(&self, policy: u32, key: &str) -> Option<i64> {
        let key = state_key(self.policy(policy)?.scopes.budget, key);
        key_state(self.keys.get(policy as usize)?, key)?.budget.as_ref()?.tokens()
    }

    /// Rate-limit tokens available at `now` for a policy and key, if it has a limiter.
    pub fn rate_tokens(&self, policy: u32, key: &str, now: u64) -> Option<u64> {
        let p = self.policy(policy)?;
        let cfg = p.rate_limit.as_ref()?;
        let key = state_key(p.scopes.rate_limit, key);
        let fresh = cfg.fresh();
        let g = key_state(self.keys.get(policy as usize)?, key).and_then(|s| s.limiter.as_ref()).unwrap_or(&fresh);
        Some(g.tokens(cfg, now))
    }

    /// The adaptive concurrency limit attempts of a policy and key are admitted under now,
    /// if the policy has one.
    pub fn concurrency_limit(&self, policy: u32, key: &str) -> Option<u32> {
        let p = self.policy(policy)?;
        let cfg = p.concurrency.as_ref()?;
        let key = state_key(p.scopes.limit, key);
        let fresh = cfg.fresh();
        let lim = key_state(self.keys.get(policy as usize)?, key).and_then(|s| s.adaptive.as_deref()).unwrap_or(&fresh);
        Some(lim.current(cfg))
    }

    /// Keys with state for a policy.
    pub fn key_count(&self, policy: u32) -> usize {
        self.keys.get(policy as usize).map(Table::len).unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]
    use super::*;

    /// A key's entry reused for another key is exactly a fresh one (only its buffer is kept).
    #[test]
    fn a_reset_key_state_is_a_fresh_one() {
        let doc = "policies:\n  p:\n    rate-limit: { rate: 10 }\n    breaker: { minimum-calls: 2, window: { kind: count, size: 4 } }\n";
        let e = Engine::load(doc, 1).unwrap();
        let p = &e.policies[0];
        let cfg = p.breaker.as_ref().unwrap();
        let mut s = KeyState::fresh(p, 1);
        let mut t = Vec::new();
        for (call, failure) in [(1, true), (2, true), (3, false)] {
            s.breaker.as_mut().unwrap().record(cfg, call, 10, failure, false, &mut t);
        }
        s.in_flight = 3;
        s.last_used = 9;
        assert_ne!(s, KeyState::fresh(p, 7));
        s.reset(p, 7);
        assert_eq!(s, KeyState::fresh(p, 7));
    }
}
