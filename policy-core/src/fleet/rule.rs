//! The fleet's decisions: merging a process's evidence into the shared state, and applying
//! the shared state to the process's engine (see the module documentation of `fleet`).

use std::collections::BTreeMap;

use super::wire::{Record, Shared, FLEET_OPENED, MAX_NODE, MAX_RECORDS};
use crate::breaker::{Window, WindowState};
use crate::budget::{self, BudgetCfg, BudgetState, RATIO_SLOTS};
use crate::engine::push_event;
use crate::error::LoadError;
use crate::types::{BreakerState as S, Event, EventKind};
use crate::Engine;

/// Most keys whose fleet marks an engine keeps; past it they are forgotten, and the next
/// publication of a forgotten key adopts the fleet's budget level without adding a change.
const MAX_MARKS: usize = 65_536;
const MS: u64 = 1_000_000;

/// What an engine remembers of its last exchange with the fleet, per policy and key.
#[derive(Clone, Debug, Default)]
pub struct Marks {
    keys: BTreeMap<(u32, String), Mark>,
}

#[derive(Clone, Debug, Default)]
struct Mark {
    /// The local budget level right after the last apply, less what changed locally between
    /// that publication's merge and its apply: the base of the next change to publish.
    applied: Option<i64>,
    /// The same for a ratio budget, slot by slot (local slot numbers).
    ratio_applied: Option<Vec<(u64, i64)>>,
    /// The breaker's `trips` when the quorum opened it (that episode is the fleet's, not ours).
    fleet_trips: Option<u32>,
}

impl Marks {
    fn get(&self, policy: u32, key: &str) -> Mark {
        self.keys.get(&(policy, key.to_string())).cloned().unwrap_or_default()
    }
    fn set(&mut self, policy: u32, key: &str, m: Mark) {
        if self.keys.len() >= MAX_MARKS && !self.keys.contains_key(&(policy, key.to_string())) {
            self.keys.clear();
        }
        self.keys.insert((policy, key.to_string()), m);
    }
}

fn open_ish(s: S) -> bool {
    matches!(s, S::Open | S::HalfOpen)
}

fn ms_ceil(ns: u64) -> u64 {
    ns.div_ceil(MS)
}

fn prune(sh: &mut Shared, wall: u64) {
    sh.records.retain(|r| r.expires > wall);
    if !sh.probe.is_empty() && sh.probe_until <= wall {
        sh.probe.clear();
        sh.probe_until = 0;
    }
}

/// A ratio budget's current local slot and the store's, at `now` and `wall` ms.
fn ratio_clocks(local: &[(u64, i64)], now: u64, wall: u64, ttl: u64) -> (u64, u64) {
    let l_now = budget::current_slot(local, now, ttl);
    (l_now, wall.saturating_mul(MS) / BudgetCfg::slot_len(ttl))
}

/// Whether store slot `w` still counts when the store's clock is in slot `now`.
fn live(w: u64, now: u64) -> bool {
    w.saturating_add(RATIO_SLOTS) > now && w <= now
}

fn balance_at(slots: &[(u64, i64)], slot: u64) -> i64 {
    slots.iter().find(|(s, _)| *s == slot).map(|(_, b)| *b).unwrap_or(0)
}

fn add(slots: &mut Vec<(u64, i64)>, slot: u64, change: i64) {
    match slots.iter_mut().find(|(s, _)| *s == slot) {
        Some((_, b)) => *b = b.saturating_add(change),
        None => slots.push((slot, change)),
    }
}

fn sorted(mut slots: Vec<(u64, i64)>) -> Vec<(u64, i64)> {
    crate::order::sort_by(&mut slots, |(a, _), (b, _)| a.cmp(b));
    slots
}

fn check_node(node: &str) -> Result<(), LoadError> {
    if node.is_empty() || node.len() > MAX_NODE {
        return Err(LoadError::new("node", format!("must be 1 to {MAX_NODE} bytes")));
    }
    Ok(())
}

impl Engine {
    fn fleet_cfg(&self, policy: u32) -> Result<(&crate::Policy, &super::FleetCfg), LoadError> {
        let p = self.policy(policy).ok_or_else(|| LoadError::new("", format!("no policy with index {policy}")))?;
        let f = p.fleet.as_ref().ok_or_else(|| LoadError::new("", format!("policy `{}` has no `fleet` section", p.name)))?;
        Ok((p, f))
    }

    /// The shared state `shared` (as read from the store, whose clock read `wall` ms) with this
    /// engine's evidence for `policy` and `key` merged in, as `node`: the bytes to write back
    /// under compare-and-set. Changes nothing in the engine; on a conflict call it again with
    /// the bytes the store holds.
    #[allow(clippy::too_many_arguments)]
    pub fn fleet_merge(&mut self, policy: u32, key: &str, node: &str, now: u64, wall: u64, shared: &[u8]) -> Result<Vec<u8>, LoadError> {
        check_node(node)?;
        let (p, cfg) = self.fleet_cfg(policy)?;
        let mut sh = Shared::decode(shared)?;
        prune(&mut sh, wall);
        let mark = self.fleet.get(policy, key);
        let ks = self.keys.get(policy as usize).and_then(|k| k.find(key).and_then(|i| k.get(i))).map(|(_, s)| s);
        let prev = sh.records.iter().position(|r| r.node == node);
        let mut rec = Record {
            node: node.to_string(),
            state: S::Closed,
            flags: 0,
            since: wall,
            expires: wall.saturating_add(ms_ceil(cfg.ttl)),
            calls: 0,
            failures: 0,
            trips: 0,
            seen: 0,
            ratio_seen: Vec::new(),
        };
        if let Some(bcfg) = &p.breaker {
            let fresh;
            let b = match ks.and_then(|s| s.breaker.as_ref()) {
                Some(b) => b,
                None => {
                    fresh = bcfg.fresh();
                    &fresh
                }
            };
            let state = b.peek(now);
            let (calls, failures, _) = b.totals(bcfg, now);
            rec.state = state;
            rec.calls = calls;
            rec.failures = failures;
            rec.trips = b.trips;
            if open_ish(state) && mark.fleet_trips == Some(b.trips) {
                rec.flags |= FLEET_OPENED;
            }
            if let Some(old) = prev.and_then(|i| sh.records.get(i)) {
                if open_ish(old.state) == open_ish(state) && old.trips == b.trips && old.flags == rec.flags {
                    rec.since = old.since;
                }
            }
            // Probe coordination: one process at a time runs the half-open trials.
            let soon = now.saturating_add(cfg.publish_every);
            let about_to_probe = (b.state == S::Open && b.open_until <= soon) || b.state == S::HalfOpen;
            if sh.probe == node {
                if state == S::Closed {
                    sh.probe.clear();
                    sh.probe_until = 0;
                    sh.cleared = wall;
                } else if b.state == S::Open && b.open_until > soon {
                    // The trials failed and the breaker opened again: let another try later.
                    sh.probe.clear();
                    sh.probe_until = 0;
                }
            } else if sh.probe.is_empty() && about_to_probe {
                sh.probe = node.to_string();
                sh.probe_until = wall.saturating_add(ms_ceil(cfg.probe_lease));
            }
        }
        if let (true, Some(BudgetCfg::Token { max_milli, .. })) = (cfg.budget, &p.budget) {
            let local = ks.and_then(|s| s.budget.as_ref()).and_then(|b| b.tokens()).unwrap_or(*max_milli);
            let change = mark.applied.map(|a| local.saturating_sub(a)).unwrap_or(0);
            sh.tokens = Some(match sh.tokens {
                None => local,
                Some(t) => t.saturating_add(change).clamp(0, *max_milli),
            });
            rec.seen = local;
        }
        if let (true, Some(BudgetCfg::Ratio { ttl, .. })) = (cfg.budget, &p.budget) {
            let local = match ks.and_then(|s| s.budget.as_ref()) {
                Some(BudgetState::Ratio { slots }) => sorted(slots.clone()),
                _ => Vec::new(),
            };
            let (l_now, w_now) = ratio_clocks(&local, now, wall, *ttl);
            let mut ledger = sh.ratio.take().unwrap_or_default();
            ledger.retain(|(w, _)| live(*w, w_now));
            let applied = mark.ratio_applied.as_deref().unwrap_or_default();
            for (l, b) in &local {
                let change = b.saturating_sub(balance_at(applied, *l));
                // Local slot `l` is store slot `l + w_now - l_now`.
                match (l.saturating_add(w_now)).checked_sub(l_now) {
                    Some(w) if change != 0 && live(w, w_now) => add(&mut ledger, w, change),
                    _ => {}
                }
            }
            sh.tokens = None;
            sh.ratio = Some(sorted(ledger));
            rec.ratio_seen = local;
        }
        match prev {
            Some(i) => {
                if let Some(slot) = sh.records.get_mut(i) {
                    *slot = rec;
                }
            }
            None => {
                if sh.records.len() >= MAX_RECORDS {
                    // The record closest to expiry makes room (it would be gone soonest anyway).
                    if let Some(i) = sh.records.iter().enumerate().min_by_key(|(_, r)| r.expires).map(|(i, _)| i) {
                        sh.records.remove(i);
                    }
                }
                sh.records.push(rec);
            }
        }
        Ok(sh.encode())
    }

    /// Apply shared state the store accepted (read or written at the store's `wall` ms) to this
    /// engine, as `node`: a closed breaker opens when the quorum holds (event
    /// `breaker-transition` named `fleet-quorum`, its value the count of processes open); an
    /// open breaker waits while another process holds the probe and goes half-open at once
    /// after the fleet's probe succeeded; the shared budget level is adopted.
    #[allow(clippy::too_many_arguments)]
    pub fn fleet_apply(&mut self, policy: u32, key: &str, node: &str, now: u64, wall: u64, shared: &[u8]) -> Result<(), LoadError> {
        check_node(node)?;
        let (p, cfg) = self.fleet_cfg(policy)?;
        let (bcfg, budget, quorum) = (p.breaker.clone(), if cfg.budget { p.budget.clone() } else { None }, cfg.quorum);
        let (within, publish_every) = (cfg.within, cfg.publish_every);
        let mut sh = Shared::decode(shared)?;
        prune(&mut sh, wall);
        let start = wall.saturating_sub(ms_ceil(within)).max(if sh.cleared > 0 { sh.cleared.saturating_add(1) } else { 0 });
        let opens = sh.records.iter().filter(|r| open_ish(r.state) && r.flags & FLEET_OPENED == 0 && r.since >= start).count();
        let me = sh.records.iter().find(|r| r.node == node).cloned();
        let other_probe = (!sh.probe.is_empty() && sh.probe != node).then_some(sh.probe_until.saturating_sub(wall));
        let cleared = sh.cleared;
        let mut mark = self.fleet.get(policy, key);
        let changed = self.with_key_state(policy as usize, key, |ks| {
            let mut opened = None;
            if let (Some(bcfg), Some(b)) = (&bcfg, ks.breaker.as_mut()) {
                b.last_now = b.last_now.max(now);
                let now = b.last_now;
                if b.state == S::Closed && opens >= quorum as usize {
                    b.trips = b.trips.saturating_add(1);
                    b.open_until = now.saturating_add(bcfg.open_for(b.trips));
                    b.window = match bcfg.window {
                        Window::Count(_) => WindowState::Count { ring: Vec::new(), pos: 0, failures: 0, slow: 0 },
                        Window::Time { .. } => WindowState::Time { buckets: Vec::new() },
                    };
                    b.state = S::Open;
                    mark.fleet_trips = Some(b.trips);
                    opened = Some(now);
                } else if b.state == S::Open {
                    match other_probe {
                        Some(left) => {
                            let until = now.saturating_add(left.saturating_mul(MS)).saturating_add(publish_every);
                            b.open_until = b.open_until.max(until);
                        }
                        None => {
                            let before_probe = me.as_ref().is_some_and(|r| open_ish(r.state) && r.since <= cleared);
                            if cleared > 0 && before_probe {
                                b.open_until = b.open_until.min(now);
                            }
                        }
                    }
                }
            }
            if let (Some(BudgetCfg::Token { max_milli, .. }), Some(BudgetState::Token { tokens }), Some(fleet), Some(me)) =
                (&budget, ks.budget.as_mut(), sh.tokens, me.as_ref())
            {
                let local = *tokens;
                let target = local.saturating_add(fleet.saturating_sub(me.seen)).clamp(0, *max_milli);
                *tokens = target;
                mark.applied = Some(me.seen.saturating_add(target - local));
            }
            if let (Some(BudgetCfg::Ratio { ttl, .. }), Some(BudgetState::Ratio { slots }), Some(ledger), Some(me)) =
                (&budget, ks.budget.as_mut(), sh.ratio.as_ref(), me.as_ref())
            {
                let (l_now, w_now) = ratio_clocks(slots, now, wall, *ttl);
                // The fleet's ledger in local slot numbers: the base of the next change.
                let fleet: Vec<(u64, i64)> = ledger
                    .iter()
                    .filter(|(w, _)| live(*w, w_now))
                    .filter_map(|(w, b)| (w.saturating_add(l_now)).checked_sub(w_now).map(|l| (l, *b)))
                    .collect();
                // What changed here since the merge that published `me` is not in it yet.
                let mut target = fleet.clone();
                for (l, b) in slots.iter() {
                    let change = b.saturating_sub(balance_at(&me.ratio_seen, *l));
                    if change != 0 {
                        add(&mut target, *l, change);
                    }
                }
                // A slot the clocks' phases put one ahead of ours is kept, not dropped.
                let current = l_now.max(target.iter().map(|(s, _)| *s).max().unwrap_or(0));
                budget::expire(&mut target, current);
                *slots = sorted(target);
                mark.ratio_applied = Some(fleet);
            }
            opened
        });
        self.fleet.set(policy, key, mark);
        if let Some(Some(at)) = changed {
            let mut e = Event::new(at, EventKind::BreakerTransition, policy, key);
            e.state_from = S::Closed;
            e.state_to = S::Open;
            e.name = "fleet-quorum".to_string();
            e.value = opens as i64;
            push_event(&mut self.events, e);
        }
        Ok(())
    }

    /// Fleet state bytes as canonical JSON.
    pub fn fleet_inspect(shared: &[u8]) -> Result<String, LoadError> {
        Ok(Shared::decode(shared)?.to_json())
    }
}

#[cfg(test)]
mod tests {
    use crate::types::{OutcomeKind, VerdictKind};
    use crate::Engine;

    const DOC: &str = r#"{"policies": {"p": {"attempts": 1,
        "breaker": {"window": {"kind": "count", "size": 4}, "minimum-calls": 2, "failure-rate": 50,
                    "open-duration": "1s", "half-open-permits": 1},
        "budget": {"kind": "token", "max-tokens": 10, "token-ratio": 1},
        "fleet": {"quorum": 2, "within": "30s", "ttl": "5s", "publish-every": "100ms"}}}}"#;
    const MS: u64 = 1_000_000;

    fn fail(e: &mut Engine, call: u64, now: u64) {
        let v = e.start(call, 0, "k", 0, now, 0, 0, 0);
        if v.kind() == Some(VerdictKind::Attempt) {
            e.report(call, now + 1, 1, OutcomeKind::Timeout, 0, "", 0, 0);
        }
    }

    fn sync(e: &mut Engine, node: &str, now: u64, wall: u64, shared: &mut Vec<u8>) {
        let next = e.fleet_merge(0, "k", node, now, wall, shared).expect("merge");
        e.fleet_apply(0, "k", node, now, wall, &next).expect("apply");
        *shared = next;
    }

    fn state(e: &Engine, now: u64) -> crate::BreakerState {
        e.breaker_state(0, "k", now).expect("breaker")
    }

    #[test]
    fn one_bad_node_alone_a_quorum_opens_all_and_one_probe() {
        let mut nodes: Vec<Engine> = (0..4).map(|i| Engine::load(DOC, i).expect("doc")).collect();
        let mut shared = Vec::new();
        let names = ["a", "b", "c", "d"];
        // a fails: only a opens.
        fail(&mut nodes[0], 1, 0);
        fail(&mut nodes[0], 2, 10);
        for (e, n) in nodes.iter_mut().zip(names) {
            sync(e, n, 100, 1_000, &mut shared);
        }
        assert_eq!(state(&nodes[0], 100), crate::BreakerState::Open);
        for e in &nodes[1..] {
            assert_eq!(state(e, 100), crate::BreakerState::Closed, "one bad node lowers only its own traffic");
        }
        // b fails too: the quorum of 2 opens c and d.
        fail(&mut nodes[1], 3, 200);
        fail(&mut nodes[1], 4, 210);
        for (e, n) in nodes.iter_mut().zip(names) {
            sync(e, n, 300, 1_200, &mut shared);
        }
        for e in &nodes {
            assert_eq!(state(e, 300), crate::BreakerState::Open);
        }
        let ev: Vec<_> = nodes[2].drain_events().into_iter().filter(|e| e.name == "fleet-quorum").collect();
        assert_eq!(ev.len(), 1);
        assert_eq!(ev[0].value, 2);
        // Near the end of the open time, one process takes the probe; the others wait for it.
        let t = 950 * MS;
        for (e, n) in nodes.iter_mut().zip(names) {
            sync(e, n, t, 1_850, &mut shared);
        }
        let s = Engine::fleet_inspect(&shared).expect("json");
        assert!(s.contains("\"probe\":\"a\""), "{s}");
        let probing: Vec<bool> = nodes.iter().map(|e| state(e, 1_100 * MS) == crate::BreakerState::HalfOpen).collect();
        assert_eq!(probing, vec![true, false, false, false], "one process probes at a time");
        // a's trial succeeds: it closes, clears the evidence, and the others go half-open.
        let v = nodes[0].start(10, 0, "k", 0, 1_100 * MS, 0, 0, 0);
        assert_eq!(v.kind(), Some(VerdictKind::Attempt));
        nodes[0].report(10, 1_101 * MS, 1, OutcomeKind::Success, 0, "", 0, 0);
        assert_eq!(state(&nodes[0], 1_101 * MS), crate::BreakerState::Closed);
        for (e, n) in nodes.iter_mut().zip(names) {
            sync(e, n, 1_150 * MS, 2_050, &mut shared);
        }
        assert_eq!(state(&nodes[0], 1_150 * MS), crate::BreakerState::Closed, "old evidence no longer counts");
        for e in &nodes[1..] {
            assert_eq!(state(e, 1_150 * MS), crate::BreakerState::HalfOpen);
        }
    }

    #[test]
    fn concurrent_updates_are_both_counted_and_budget_changes_merge() {
        let mut a = Engine::load(DOC, 1).expect("doc");
        let mut b = Engine::load(DOC, 2).expect("doc");
        let mut shared = Vec::new();
        sync(&mut a, "a", 0, 1, &mut shared);
        sync(&mut b, "b", 0, 1, &mut shared);
        // Both read the same bytes; a's write lands first, so b's compare-and-set fails and b
        // merges again into what a wrote.
        fail(&mut a, 1, 10);
        fail(&mut b, 2, 10);
        let read = shared.clone();
        let from_a = a.fleet_merge(0, "k", "a", 20, 2, &read).expect("merge");
        let _lost = b.fleet_merge(0, "k", "b", 20, 2, &read).expect("merge");
        let from_b = b.fleet_merge(0, "k", "b", 20, 2, &from_a).expect("merge");
        a.fleet_apply(0, "k", "a", 20, 2, &from_a).expect("apply");
        b.fleet_apply(0, "k", "b", 20, 2, &from_b).expect("apply");
        let s = Engine::fleet_inspect(&from_b).expect("json");
        assert!(
            s.contains(
                "\"node\":\"a\",\"state\":\"closed\",\"fleet-opened\":false,\"since\":1,\"expires\":5002,\"calls\":1,\"failures\":1"
            ),
            "{s}"
        );
        assert!(
            s.contains(
                "\"node\":\"b\",\"state\":\"closed\",\"fleet-opened\":false,\"since\":1,\"expires\":5002,\"calls\":1,\"failures\":1"
            ),
            "{s}"
        );
        // Each failure cost 1 token of 10: the fleet is at 8 and so are both engines after a sync.
        assert!(s.contains("\"tokens\":8000"), "{s}");
        shared = from_b;
        sync(&mut a, "a", 30, 3, &mut shared);
        assert_eq!(a.budget_tokens(0, "k"), Some(8000));
        assert_eq!(b.budget_tokens(0, "k"), Some(8000));
    }

    const RATIO: &str = r#"{"policies": {"p": {"attempts": 3,
        "budget": {"kind": "ratio", "percent": 20, "min-per-second": 0, "ttl": "10s"},
        "fleet": {"publish-every": "100ms"}}}}"#;

    fn call(e: &mut Engine, call: u64, now: u64, ok: bool) -> Option<VerdictKind> {
        let v = e.start(call, 0, "k", 0, now, 0, 0, 0);
        assert_eq!(v.kind(), Some(VerdictKind::Attempt));
        let kind = if ok { OutcomeKind::Success } else { OutcomeKind::Timeout };
        let v = e.report(call, now + 1, 1, kind, 0, "", 0, 0);
        if v.kind() == Some(VerdictKind::Retry) {
            e.cancel(call, now + 2);
        }
        v.kind()
    }

    #[test]
    fn a_ratio_budget_is_shared_deposits_and_withdrawals_merged() {
        // a takes 10 calls (10 deposits); b, whose monotonic clock is elsewhere, none.
        let mut a = Engine::load(RATIO, 1).expect("doc");
        let mut b = Engine::load(RATIO, 2).expect("doc");
        let mut alone = Engine::load(RATIO, 3).expect("doc");
        let b0 = 7_000 * MS;
        for i in 0..10 {
            assert_eq!(call(&mut a, 1 + i, i * MS, true), Some(VerdictKind::Done));
        }
        let mut shared = Vec::new();
        sync(&mut a, "a", 20 * MS, 1_000, &mut shared);
        sync(&mut b, "b", b0, 1_000, &mut shared);
        let s = Engine::fleet_inspect(&shared).expect("json");
        assert!(s.contains("\"ratio\":[[1,10000]]"), "{s}");
        // Alone, one call's deposit (1) does not pay a retry (5 at 20 %); with the fleet's it does.
        assert_eq!(call(&mut alone, 1, b0, false), Some(VerdictKind::Fail));
        assert_eq!(call(&mut b, 1, b0 + MS, false), Some(VerdictKind::Retry));
        assert_eq!(call(&mut b, 2, b0 + 2 * MS, false), Some(VerdictKind::Retry));
        // 10 + 2 deposits - 2 withdrawals of 5: 2 left, no third retry.
        assert_eq!(call(&mut b, 3, b0 + 3 * MS, false), Some(VerdictKind::Fail));
        // b's withdrawals reach a with the next sync: a's 10 deposits no longer pay two retries.
        sync(&mut b, "b", b0 + 10 * MS, 1_050, &mut shared);
        sync(&mut a, "a", 60 * MS, 1_050, &mut shared);
        let s = Engine::fleet_inspect(&shared).expect("json");
        assert!(s.contains("\"ratio\":[[1,3000]]"), "{s}");
        assert_eq!(call(&mut a, 20, 70 * MS, false), Some(VerdictKind::Fail), "4 deposits do not pay 5");
        // The deposits expire with the store's clock: 10 s later the ledger is empty.
        sync(&mut a, "a", 10_100 * MS, 11_100, &mut shared);
        let s = Engine::fleet_inspect(&shared).expect("json");
        assert!(s.contains("\"ratio\":[]"), "{s}");
    }

    #[test]
    fn a_node_opened_by_the_quorum_does_not_keep_it() {
        let mut nodes: Vec<Engine> = (0..3).map(|i| Engine::load(DOC, i).expect("doc")).collect();
        let names = ["a", "b", "c"];
        let mut shared = Vec::new();
        for e in nodes.iter_mut().take(2) {
            fail(e, 1, 0);
            fail(e, 2, 1);
        }
        for (e, n) in nodes.iter_mut().zip(names) {
            sync(e, n, 10, 10, &mut shared);
        }
        for (e, n) in nodes.iter_mut().zip(names) {
            sync(e, n, 20, 20, &mut shared);
        }
        let s = Engine::fleet_inspect(&shared).expect("json");
        assert!(s.contains("\"node\":\"c\",\"state\":\"open\",\"fleet-opened\":true"), "{s}");
        // Their records expire (the bad processes went away): c's own record does not count.
        let mut only_c = shared.clone();
        sync(&mut nodes[2], "c", 30, 5_025, &mut only_c);
        let s = Engine::fleet_inspect(&only_c).expect("json");
        assert!(!s.contains("\"node\":\"a\""), "{s}");
        assert!(Engine::fleet_inspect(b"junk").is_err());
        assert!(nodes[2].fleet_merge(0, "k", "", 0, 0, &[]).is_err());
    }
}
