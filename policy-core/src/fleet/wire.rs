//! The fleet's shared state for one policy and key, as bytes: the same from every host.
//!
//! Format version 1, integers as LEB128 (signed ones zigzagged), strings as a length then
//! UTF-8 bytes, times in the store's wall-clock milliseconds:
//!
//! ```text
//! 0x4c 0x46 ("LF"), 1,
//! cleared (the last successful probe, 0 = none),
//! probe holder (string, "" = none), probe until,
//! budget: 0 none | 1 then tokens (milli-tokens, signed) | 2 then a ratio ledger: n, then n
//!   (slot, balance) pairs: the fleet's deposits less its withdrawals (milli-units, signed) per
//!   slot of `ttl / 10` of the store's clock (slot = store ms * 10^6 / slot length in ns),
//! n records, then for each: node (string), state (breaker-state index), flags (bit 0: opened
//!                           by the fleet's quorum, not by its own window), since, expires,
//!                           calls, failures, trips, seen (milli-tokens, signed), and with a
//!                           ratio ledger: n, then n (slot, balance) pairs, the process's own
//!                           slots (by its monotonic clock) when it published
//! ```
//!
//! Decoding never trusts the bytes: a bad magic, version, truncation, an out-of-range state,
//! more than [`MAX_RECORDS`] records, a node name longer than [`MAX_NODE`] bytes or trailing
//! bytes is an error that names what is wrong, and the host keeps its local decisions.

use crate::doc::{obj, Value};
use crate::error::LoadError;
use crate::leb128::{put, put_i, put_s, Reader};
use crate::types::BreakerState;

/// Format version.
pub const VERSION: u8 = 1;
/// Most processes recorded for one policy and key.
pub const MAX_RECORDS: usize = 1024;
/// Longest node name, in bytes.
pub const MAX_NODE: usize = 128;
/// [`Record::flags`]: opened by the quorum (such a record never counts toward it).
pub const FLEET_OPENED: u8 = 1;
/// Most slots of a ratio ledger (a ratio budget keeps 10; a ledger may hold one more while
/// its oldest expires, and the bound leaves room).
pub const MAX_SLOTS: u64 = 32;

/// One process's published evidence.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Record {
    /// The process's node name.
    pub node: String,
    /// Its breaker's state when it published.
    pub state: BreakerState,
    /// Bit 0 ([`FLEET_OPENED`]): its breaker is open because of the quorum, not its own window.
    pub flags: u8,
    /// When it entered that state (store milliseconds; the publication that first saw it).
    pub since: u64,
    /// When this record stops counting (store milliseconds).
    pub expires: u64,
    /// Calls in its breaker's window.
    pub calls: u32,
    /// Failures in its breaker's window.
    pub failures: u32,
    /// Its breaker's consecutive trips.
    pub trips: u32,
    /// Its local budget level when it published (milli-tokens).
    pub seen: i64,
    /// Its ratio budget's slots when it published (by its own clock), with a ratio ledger.
    pub ratio_seen: Vec<(u64, i64)>,
}

/// The shared state of one policy and key.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Shared {
    /// When the fleet's last probe succeeded (store ms; 0 = never).
    pub cleared: u64,
    /// The process holding the probe lease ("" = none).
    pub probe: String,
    /// When the probe lease ends (store ms).
    pub probe_until: u64,
    /// The fleet's token-budget level (milli-tokens), once a process has published one.
    pub tokens: Option<i64>,
    /// The fleet's ratio ledger, `(slot of the store's clock, balance)` sorted by slot, once a
    /// process has published one (never with `tokens`).
    pub ratio: Option<Vec<(u64, i64)>>,
    /// One record per live process.
    pub records: Vec<Record>,
}

/// What the fleet's shared bytes are called in errors.
const FORMAT: &str = "Levee fleet state";

fn bad(what: &str) -> LoadError {
    LoadError::new("", format!("not {FORMAT}: {what}"))
}

/// A node's name, at most [`MAX_NODE`] bytes of UTF-8.
fn string(r: &mut Reader<'_>) -> Result<String, LoadError> {
    let n = r.len(MAX_NODE as u64, "node name too long")?;
    String::from_utf8(r.take(n)?.to_vec()).map_err(|_| bad("node name is not UTF-8"))
}

fn put_pairs(out: &mut Vec<u8>, pairs: &[(u64, i64)]) {
    put(out, pairs.len() as u64);
    for (slot, balance) in pairs {
        put(out, *slot);
        put_i(out, *balance);
    }
}

/// A ratio ledger or a record's slots: at most [`MAX_SLOTS`], slots strictly increasing.
fn pairs(r: &mut Reader<'_>) -> Result<Vec<(u64, i64)>, LoadError> {
    let n = r.len(MAX_SLOTS, "too many ratio slots")?;
    let mut out: Vec<(u64, i64)> = Vec::with_capacity(n);
    for _ in 0..n {
        let slot = r.u64()?;
        if out.last().is_some_and(|(prev, _)| *prev >= slot) {
            return Err(bad("ratio slots out of order"));
        }
        out.push((slot, r.i64()?));
    }
    Ok(out)
}

fn pairs_json(pairs: &[(u64, i64)]) -> Value {
    Value::List(pairs.iter().map(|(s, b)| Value::List(vec![Value::from(*s), Value::Int(i128::from(*b))])).collect())
}

impl Shared {
    /// Encode (version 1).
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(16 + self.records.len() * 24);
        out.extend_from_slice(b"LF");
        out.push(VERSION);
        put(&mut out, self.cleared);
        put_s(&mut out, &self.probe);
        put(&mut out, self.probe_until);
        match (self.tokens, &self.ratio) {
            (Some(t), _) => {
                out.push(1);
                put_i(&mut out, t);
            }
            (None, Some(ledger)) => {
                out.push(2);
                put_pairs(&mut out, ledger);
            }
            (None, None) => out.push(0),
        }
        let ratio = self.tokens.is_none() && self.ratio.is_some();
        put(&mut out, self.records.len() as u64);
        for r in &self.records {
            put_s(&mut out, &r.node);
            put(&mut out, r.state as u64);
            put(&mut out, u64::from(r.flags));
            for v in [r.since, r.expires, u64::from(r.calls), u64::from(r.failures), u64::from(r.trips)] {
                put(&mut out, v);
            }
            put_i(&mut out, r.seen);
            if ratio {
                put_pairs(&mut out, &r.ratio_seen);
            }
        }
        out
    }

    /// Decode; empty bytes are the empty state (nothing published yet).
    pub fn decode(bytes: &[u8]) -> Result<Shared, LoadError> {
        if bytes.is_empty() {
            return Ok(Shared::default());
        }
        let rest = bytes.strip_prefix(b"LF").ok_or_else(|| bad("bad magic"))?;
        let mut r = Reader::new(rest, FORMAT);
        if r.u64()? != u64::from(VERSION) {
            return Err(bad("unknown version"));
        }
        let cleared = r.u64()?;
        let probe = string(&mut r)?;
        let probe_until = r.u64()?;
        let (tokens, ratio) = match r.u64()? {
            0 => (None, None),
            1 => (Some(r.i64()?), None),
            2 => (None, Some(pairs(&mut r)?)),
            _ => return Err(bad("budget flag")),
        };
        let n = r.u64()?;
        if n > MAX_RECORDS as u64 {
            return Err(bad("too many records"));
        }
        let mut records = Vec::with_capacity(n as usize);
        for _ in 0..n {
            let node = string(&mut r)?;
            let state = BreakerState::from_index(r.u32()?).ok_or_else(|| bad("breaker state"))?;
            let flags = u8::try_from(r.u64()?).ok().filter(|f| *f <= FLEET_OPENED).ok_or_else(|| bad("record flags"))?;
            let (since, expires) = (r.u64()?, r.u64()?);
            let (calls, failures, trips) = (r.u32()?, r.u32()?, r.u32()?);
            let seen = r.i64()?;
            let ratio_seen = if ratio.is_some() { pairs(&mut r)? } else { Vec::new() };
            if records.iter().any(|x: &Record| x.node == node) {
                return Err(bad("a node recorded twice"));
            }
            records.push(Record { node, state, flags, since, expires, calls, failures, trips, seen, ratio_seen });
        }
        if !r.bytes.is_empty() {
            return Err(bad("trailing bytes"));
        }
        Ok(Shared { cleared, probe, probe_until, tokens, ratio, records })
    }

    /// Canonical JSON, for tests and operators.
    pub fn to_json(&self) -> String {
        let records = self
            .records
            .iter()
            .map(|r| {
                obj([
                    ("node", r.node.as_str().into()),
                    ("state", r.state.name().into()),
                    ("fleet-opened", (r.flags & FLEET_OPENED != 0).into()),
                    ("since", r.since.into()),
                    ("expires", r.expires.into()),
                    ("calls", r.calls.into()),
                    ("failures", r.failures.into()),
                    ("trips", r.trips.into()),
                    ("seen", Value::Int(i128::from(r.seen))),
                    ("ratio-seen", pairs_json(&r.ratio_seen)),
                ])
            })
            .collect::<Vec<_>>();
        crate::doc::to_json(&obj([
            ("cleared", self.cleared.into()),
            ("probe", self.probe.as_str().into()),
            ("probe-until", self.probe_until.into()),
            ("tokens", self.tokens.map(|t| Value::Int(i128::from(t))).unwrap_or(Value::Null)),
            ("ratio", self.ratio.as_deref().map(pairs_json).unwrap_or(Value::Null)),
            ("records", Value::List(records)),
        ]))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_and_rejects_garbage() {
        let s = Shared {
            cleared: 5,
            probe: "a".into(),
            probe_until: 99,
            tokens: Some(-3),
            ratio: None,
            records: vec![Record {
                node: "a".into(),
                state: BreakerState::Open,
                flags: 1,
                since: 1,
                expires: 2,
                calls: 3,
                failures: 4,
                trips: 1,
                seen: 7000,
                ratio_seen: Vec::new(),
            }],
        };
        let b = s.encode();
        assert_eq!(Shared::decode(&b), Ok(s.clone()));
        for cut in 1..b.len() {
            assert!(Shared::decode(b.get(..cut).unwrap_or_default()).is_err(), "cut at {cut}");
        }
        // A ratio ledger, and each record's own slots with it.
        let mut r = s;
        r.tokens = None;
        r.ratio = Some(vec![(3, 5000), (4, -2000)]);
        if let Some(rec) = r.records.first_mut() {
            rec.ratio_seen = vec![(70, 1000)];
        }
        let rb = r.encode();
        assert_eq!(Shared::decode(&rb), Ok(r));
        for cut in 1..rb.len() {
            assert!(Shared::decode(rb.get(..cut).unwrap_or_default()).is_err(), "cut at {cut}");
        }
        // Slots out of order, or too many, are refused.
        let bad_order = Shared { ratio: Some(vec![(4, 1), (3, 1)]), ..Shared::default() }.encode();
        assert!(Shared::decode(&bad_order).is_err());
        let many = Shared { ratio: Some((0..=MAX_SLOTS).map(|i| (i, 1)).collect()), ..Shared::default() }.encode();
        assert!(Shared::decode(&many).is_err());
        let mut extra = b.clone();
        extra.push(0);
        assert!(Shared::decode(&extra).is_err());
        assert!(Shared::decode(b"XX\x01").is_err());
        assert_eq!(Shared::decode(&[]), Ok(Shared::default()));
    }
}
