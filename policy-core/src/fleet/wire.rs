//! The fleet's shared state for one policy and key, as bytes: the same from every host.
//!
//! Format version 1, integers as LEB128 (signed ones zigzagged), strings as a length then
//! UTF-8 bytes, times in the store's wall-clock milliseconds:
//!
//! ```text
//! 0x4c 0x46 ("LF"), 1,
//! cleared (the last successful probe, 0 = none),
//! probe holder (string, "" = none), probe until,
//! budget present (0 | 1), then tokens (milli-tokens, signed),
//! n records, then for each: node (string), state (breaker-state index), flags (bit 0: opened
//!                           by the fleet's quorum, not by its own window), since, expires,
//!                           calls, failures, trips, seen (milli-tokens, signed)
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

impl Shared {
    /// Encode (version 1).
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(16 + self.records.len() * 24);
        out.extend_from_slice(b"LF");
        out.push(VERSION);
        put(&mut out, self.cleared);
        put_s(&mut out, &self.probe);
        put(&mut out, self.probe_until);
        match self.tokens {
            None => out.push(0),
            Some(t) => {
                out.push(1);
                put_i(&mut out, t);
            }
        }
        put(&mut out, self.records.len() as u64);
        for r in &self.records {
            put_s(&mut out, &r.node);
            put(&mut out, r.state as u64);
            put(&mut out, u64::from(r.flags));
            for v in [r.since, r.expires, u64::from(r.calls), u64::from(r.failures), u64::from(r.trips)] {
                put(&mut out, v);
            }
            put_i(&mut out, r.seen);
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
        let tokens = match r.u64()? {
            0 => None,
            1 => Some(r.i64()?),
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
            if records.iter().any(|x: &Record| x.node == node) {
                return Err(bad("a node recorded twice"));
            }
            records.push(Record { node, state, flags, since, expires, calls, failures, trips, seen });
        }
        if !r.bytes.is_empty() {
            return Err(bad("trailing bytes"));
        }
        Ok(Shared { cleared, probe, probe_until, tokens, records })
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
                ])
            })
            .collect::<Vec<_>>();
        crate::doc::to_json(&obj([
            ("cleared", self.cleared.into()),
            ("probe", self.probe.as_str().into()),
            ("probe-until", self.probe_until.into()),
            ("tokens", self.tokens.map(|t| Value::Int(i128::from(t))).unwrap_or(Value::Null)),
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
            }],
        };
        let b = s.encode();
        assert_eq!(Shared::decode(&b), Ok(s));
        for cut in 1..b.len() {
            assert!(Shared::decode(b.get(..cut).unwrap_or_default()).is_err(), "cut at {cut}");
        }
        let mut extra = b.clone();
        extra.push(0);
        assert!(Shared::decode(&extra).is_err());
        assert!(Shared::decode(b"XX\x01").is_err());
        assert_eq!(Shared::decode(&[]), Ok(Shared::default()));
    }
}
