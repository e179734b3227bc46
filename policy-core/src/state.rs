//! Engine state as versioned bytes. Each strategy writes and reads its own state
//! (`Breaker::to_json`, `BreakerCfg::import`, ...); this module frames them.
//!
//! The state is UTF-8 JSON: `{"format": "levee-state", "version": 1, "rng": [4 words],
//! "tick": n, "policies": [{"name", "keys": [{"key", "last_used", "breaker", "limiter",
//! "budget"}]}]}`. Live calls are not state: they belong to the process that runs them.
//!
//! Import keeps what still applies to the current policies, matched by name: a breaker's
//! state and trip count if the policy still has a breaker (its window only if the window
//! is configured the same), a limiter's arrival time if it still has a limiter (clamped to
//! one full burst ahead), a budget's level if the budget is of the same kind (clamped to the
//! new bounds; `Engine::reload`, which knows the old bounds, rescales a token budget instead).
//! Keys are exported sorted by name, so the bytes never depend on the key table's layout. Everything is validated before anything changes: garbage or a foreign version
//! is an error and leaves the engine as it was.

use crate::breaker::Breaker;
use crate::budget::BudgetState;
use crate::doc::{self, obj, Value};
use crate::engine::{holds_protection, refile, Engine, KeyState, Keys, BUSY, GUARD, OVERFLOW, OVERFLOW_KEY, REST, SHARED};
use crate::error::LoadError;
use crate::order;
use crate::policy::Policy;
use crate::rate::Gcra;
use crate::read::u64_at;
use crate::rng::Rng;
use std::sync::Arc;

const FORMAT: &str = "levee-state";

/// The entries read for each policy of a document (by index), before they are filed.
type Staged = Vec<(usize, Vec<(Arc<str>, KeyState)>)>;

/// Largest state `import-state` reads (bytes): what `export-state` gives for 200,000 keys with
/// a small breaker window, and far more keys holding protection than a recovery snapshot
/// (`export-snapshot`) carries in practice. It stays well inside the guest's 512 MiB with the
/// parsed tree beside it.
pub const MAX_STATE_BYTES: usize = 64 << 20;
const VERSION: u64 = 1;

impl Engine {
    /// The whole engine state as versioned bytes.
    pub fn export_state(&self) -> Vec<u8> {
        Writer::new(false).fill(self, usize::MAX)
    }

    /// What a fresh engine would not reproduce, in the format of [`export_state`](Self::export_state):
    /// the keys holding protection (`engine::holds_protection`, judged at each key's own latest
    /// time, so a protection that may have ended since is kept), with the RNG and the tick.
    /// It reads the guarded list, the busy one and the overflow entry, never the keys at rest:
    /// its cost follows the keys holding protection or attempts, not the table's size.
    pub fn export_snapshot(&self) -> Vec<u8> {
        Writer::new(true).fill(self, usize::MAX)
    }

    /// One page of [`export_state`](Self::export_state) (or, with `snapshot`, of
    /// [`export_snapshot`](Self::export_snapshot)): the document's bytes from offset `cursor`,
    /// at most [`STATE_PAGE_BYTES`](crate::STATE_PAGE_BYTES) of them, and the cursor of the next
    /// page (0 once the document is complete). The pages of one export, concatenated, are
    /// exactly the bytes of the whole export, provided nothing changes the engine between them
    /// (hosts hold the engine's lock across the pages of one export). The engine keeps its place
    /// between pages, with the names of one policy's keys, never the document; a cursor it did
    /// not give last starts the document again and skips to that offset.
    pub fn export_state_page(&mut self, cursor: u64, snapshot: bool) -> StatePage {
        self.export_page_sized(cursor, snapshot, crate::STATE_PAGE_BYTES)
    }

    /// [`export_state_page`](Self::export_state_page) with pages of at most `page` bytes
    /// (at least 1): for tests of the page boundaries.
    pub fn export_page_sized(&mut self, cursor: u64, snapshot: bool, page: usize) -> StatePage {
        let page = page.max(1);
        let mut w = match self.pages.export.take() {
            Some(w) if cursor != 0 && w.offset == cursor && w.snapshot == snapshot => w,
            _ => {
                let mut w = Box::new(Writer::new(snapshot));
                while w.offset < cursor && !w.done() {
                    let skip = usize::try_from(cursor - w.offset).unwrap_or(usize::MAX).min(page.max(1 << 16));
                    w.fill(self, skip);
                }
                w
            }
        };
        let bytes = w.fill(self, page);
        if w.done() {
            StatePage { bytes, next: 0 }
        } else {
            let next = w.offset;
            self.pages.export = Some(w);
            StatePage { bytes, next }
        }
    }

    /// Start a paged import (`import_state_page`, then `import_state_end`), dropping one not
    /// ended. Nothing changes until `import_state_end` succeeds.
    pub fn import_state_begin(&mut self) {
        self.pages.import = Some(Box::default());
    }

    /// The next bytes of a document being imported (any split: a page may end anywhere, in a
    /// key's entry or a string). Each entry is read and checked as soon as it is complete;
    /// the bytes are not kept. On error the import is over and nothing has changed.
    pub fn import_state_page(&mut self, bytes: &[u8]) -> Result<(), LoadError> {
        let Some(mut r) = self.pages.import.take() else {
            return Err(LoadError::new("", "no paged import in progress (import-state-begin starts one)"));
        };
        r.feed(self, bytes)?;
        self.pages.import = Some(r);
        Ok(())
    }

    /// End a paged import: the document must be complete and valid; its state replaces the
    /// engine's as [`import_state`](Self::import_state) would. On error nothing changes.
    pub fn import_state_end(&mut self) -> Result<(), LoadError> {
        let Some(r) = self.pages.import.take() else {
            return Err(LoadError::new("", "no paged import in progress (import-state-begin starts one)"));
        };
        let (words, tick, staged) = r.finish()?;
        self.commit(words, tick, staged);
        Ok(())
    }

    /// Restore exported state; see the module documentation. On error nothing changes.
    pub fn import_state(&mut self, bytes: &[u8]) -> Result<(), LoadError> {
        let text = std::str::from_utf8(bytes).map_err(|_| LoadError::new("", "not Levee state: not UTF-8"))?;
        let trimmed = text.trim_start();
        if !trimmed.starts_with('{') {
            return Err(LoadError::new("", "not Levee state: expected a JSON object"));
        }
        let doc =
            doc::parse_json_limited(text, MAX_STATE_BYTES).map_err(|e| LoadError::new("", format!("not Levee state: {}", e.message)))?;
        let obj = &doc;
        let (words, tick) = read_header(obj.get("format"), obj.get("version"), obj.get("rng"), obj.get("tick"))?;
        let policies = obj.get("policies").and_then(Value::as_list).ok_or_else(|| LoadError::new("policies", "is missing"))?;

        let mut staged = Vec::new();
        for (i, entry) in policies.iter().enumerate() {
            let path = format!("policies[{i}]");
            let name = entry.get("name").and_then(Value::as_str).ok_or_else(|| LoadError::new(&path, "has no name"))?;
            let keys = entry.get("keys").and_then(Value::as_list).ok_or_else(|| LoadError::new(&path, "has no keys"))?;
            let Some(target) = Target::of(self, name, entry.get("fingerprint")) else {
                continue; // the policy is gone: nothing of it applies
            };
            let mut parsed = Vec::with_capacity(keys.len());
            for (j, k) in keys.iter().enumerate() {
                target.read(self, k, &format!("{path}.keys[{j}]"), &mut parsed)?;
            }
            staged.push((target.policy, parsed));
        }
        self.commit(words, tick, staged);
        Ok(())
    }

    /// Replace the key tables with the entries read (per policy of the document, in its order),
    /// the RNG and the tick.
    fn commit(&mut self, words: [u64; 4], tick: u64, staged: Staged) {
        let mut new_keys: Vec<Keys> = self.empty_keys();
        for (pi, parsed) in staged {
            let (Some(p), Some(target)) = (self.policies.get(pi), new_keys.get_mut(pi)) else { continue };
            file_keys(target, p, parsed);
        }
        self.keys = new_keys;
        self.rng = Rng::from_state(words);
        self.tick = self.tick.max(tick);
    }
}

/// The header's checks, in this order: the format, the version, the RNG, the tick.
fn read_header(
    format: Option<&Value>,
    version: Option<&Value>,
    rng: Option<&Value>,
    tick: Option<&Value>,
) -> Result<([u64; 4], u64), LoadError> {
    check_format(format)?;
    check_version(version)?;
    let rng_words = rng.and_then(Value::as_list).ok_or_else(|| LoadError::new("rng", "is missing"))?;
    let mut words = [0u64; 4];
    if rng_words.len() != 4 {
        return Err(LoadError::new("rng", "must hold 4 words"));
    }
    for (w, v) in words.iter_mut().zip(rng_words) {
        *w = v.as_u64().ok_or_else(|| LoadError::new("rng", "words must be unsigned 64-bit integers"))?;
    }
    let tick = tick.and_then(Value::as_u64).ok_or_else(|| LoadError::new("tick", "is missing"))?;
    Ok((words, tick))
}

fn check_format(format: Option<&Value>) -> Result<(), LoadError> {
    if format.and_then(Value::as_str) != Some(FORMAT) {
        return Err(LoadError::new("format", "not Levee state (format is not \"levee-state\")"));
    }
    Ok(())
}

fn check_version(version: Option<&Value>) -> Result<(), LoadError> {
    match version.and_then(Value::as_u64) {
        Some(VERSION) => Ok(()),
        Some(v) => Err(LoadError::new("version", format!("state version {v} is not supported (this engine reads version {VERSION})"))),
        None => Err(LoadError::new("version", "is missing")),
    }
}

/// The policy of this engine a document's policy entry restores, and how.
#[derive(Clone, Copy, Debug)]
struct Target {
    policy: usize,
    same_window: bool,
}

impl Target {
    /// The engine's policy named `name` (`None`: it is gone, and nothing of it applies).
    fn of(e: &Engine, name: &str, old_fingerprint: Option<&Value>) -> Option<Target> {
        let policy = e.policies.iter().position(|p| p.name == name)?;
        let p = e.policies.get(policy)?;
        let old = old_fingerprint.cloned().unwrap_or(Value::Null);
        Some(Target { policy, same_window: old.get("window") == fingerprint(p).get("window") })
    }

    /// Read one key's entry into `parsed`. A document may list more entries than the policy
    /// keeps: past twice its bound they are ranked and cut to it (see [`rank`]), so that
    /// what is held follows the bound, not the document.
    fn read(self, e: &Engine, v: &Value, path: &str, parsed: &mut Vec<(Arc<str>, KeyState)>) -> Result<(), LoadError> {
        let Some(p) = e.policies.get(self.policy) else { return Ok(()) };
        let (k, st) = key_from_json(p, v, path, self.same_window)?;
        parsed.push((Arc::from(k), st));
        let bound = (p.max_keys as usize).saturating_mul(2).saturating_add(1024);
        if parsed.len() > bound {
            let kept = rank(p, std::mem::take(parsed));
            *parsed = kept;
        }
        Ok(())
    }
}

/// The entries a policy keeps, least recently used first: the overflow entry and the policy's
/// shared entry (the most recent one of each given), then the keys holding protection, then the most recently used keys within the
/// bound (ties by name, the order they were exported in). A name given twice keeps its most
/// recent entry.
fn rank(p: &Policy, mut parsed: Vec<(Arc<str>, KeyState)>) -> Vec<(Arc<str>, KeyState)> {
    // In place: at a million keys a second copy of the entries would not fit the guest.
    // The overflow entry: the most recent one given (the first of equals).
    let overflow = take_most_recent(&mut parsed, OVERFLOW_KEY);
    // The policy's shared entry (`scope: policy`), kept outside the bound as the overflow entry is.
    let shared = if p.scopes.any() { take_most_recent(&mut parsed, "") } else { None };
    // A name given twice: its most recent entry.
    order::sort_by(&mut parsed, |(a, sa), (b, sb)| a.cmp(b).then_with(|| sb.last_used.cmp(&sa.last_used)));
    parsed.dedup_by(|(b, _), (a, _)| a == b);
    // Protection first, then recency, then the name (names are unique by now).
    let protected: Vec<bool> = parsed.iter().map(|(_, st)| holds_protection(p, st, 0)).collect();
    let keep = order::permutation(parsed.len(), &|a, b| {
        let at =
            |i: usize| (!protected.get(i).copied().unwrap_or(false), parsed.get(i).map(|(k, st)| (std::cmp::Reverse(st.last_used), k)));
        at(a).cmp(&at(b))
    });
    order::apply(&mut parsed, keep);
    parsed.truncate(p.max_keys as usize);
    order::sort_by(&mut parsed, |(a, sa), (b, sb)| sa.last_used.cmp(&sb.last_used).then_with(|| b.cmp(a)));
    parsed.extend(overflow);
    parsed.extend(shared);
    parsed
}

/// The most recent entry named `name` (the first of equals), taken out with every other of
/// that name.
fn take_most_recent(parsed: &mut Vec<(Arc<str>, KeyState)>, name: &str) -> Option<(Arc<str>, KeyState)> {
    let mut best: Option<usize> = None;
    for (i, (k, st)) in parsed.iter().enumerate() {
        if &**k == name && best.and_then(|b| parsed.get(b)).is_none_or(|(_, o)| st.last_used > o.last_used) {
            best = Some(i);
        }
    }
    let found = best.filter(|&b| b < parsed.len()).map(|b| parsed.swap_remove(b));
    parsed.retain(|(k, _)| &**k != name);
    found
}

/// File the entries `rank` keeps, each on its list.
fn file_keys(target: &mut Keys, p: &Policy, parsed: Vec<(Arc<str>, KeyState)>) {
    for (k, st) in rank(p, parsed) {
        if &*k == OVERFLOW_KEY {
            if target.find(OVERFLOW_KEY).is_none() {
                target.insert(k, st, OVERFLOW);
            }
        } else if k.is_empty() && p.scopes.any() {
            if target.find("").is_none() {
                target.insert(k, st, SHARED);
            }
        } else if target.find(&*k).is_none() {
            let at = target.insert(k, st, REST);
            refile(target, p, at, 0);
        }
    }
}

/// One page of a paged export: its bytes and the cursor of the next page (0: the document is
/// complete).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StatePage {
    /// The document's bytes from the cursor asked for.
    pub bytes: Vec<u8>,
    /// The cursor of the next page; 0 once the document is complete.
    pub next: u64,
}

/// A paged export or import in progress.
#[derive(Clone, Debug, Default)]
pub(crate) struct Pages {
    export: Option<Box<Writer>>,
    import: Option<Box<Reader>>,
}

/// Where a [`Writer`] is in the document.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Step {
    Header,
    /// The opening of policy `n` (or the end of the document past the last).
    Policy(usize),
    /// The keys of policy `n`.
    Keys(usize),
    Done,
}

/// Writes the state document piece by piece: the header, then each policy's opening, its keys
/// (sorted by name, one entry at a time), its closing. `export_state` is all of it at once,
/// `export_state_page` a page at a time: the same bytes.
#[derive(Clone, Debug)]
struct Writer {
    snapshot: bool,
    /// Bytes given so far.
    offset: u64,
    step: Step,
    /// The current policy's keys, sorted, and the next one to write.
    names: Vec<Arc<str>>,
    next: usize,
    /// Whether the current policy's list has an entry yet (the separator before the next).
    wrote: bool,
    /// A piece written but not yet given, from `carry_at`.
    carry: Vec<u8>,
    carry_at: usize,
}

impl Writer {
    fn new(snapshot: bool) -> Writer {
        Writer { snapshot, offset: 0, step: Step::Header, names: Vec::new(), next: 0, wrote: false, carry: Vec::new(), carry_at: 0 }
    }

    fn done(&self) -> bool {
        self.step == Step::Done && self.carry_at >= self.carry.len()
    }

    /// The next bytes of the document, at most `max`.
    fn fill(&mut self, e: &Engine, max: usize) -> Vec<u8> {
        let mut out = Vec::new();
        loop {
            let rest = self.carry.get(self.carry_at..).unwrap_or_default();
            let n = rest.len().min(max - out.len());
            out.extend_from_slice(rest.get(..n).unwrap_or_default());
            self.carry_at += n;
            if out.len() >= max || self.step == Step::Done && self.carry_at >= self.carry.len() {
                break;
            }
            self.carry.clear();
            self.carry_at = 0;
            self.piece(e);
        }
        self.offset += out.len() as u64;
        out
    }

    /// Write the next piece into `carry`.
    fn piece(&mut self, e: &Engine) {
        let mut s = String::new();
        match self.step {
            Step::Header => {
                s.push_str("{\"format\":");
                s.push_str(&doc::to_json(&FORMAT.into()));
                s.push_str(",\"version\":");
                s.push_str(&doc::to_json(&VERSION.into()));
                s.push_str(",\"rng\":");
                s.push_str(&doc::to_json(&e.rng.state().to_vec().into()));
                s.push_str(",\"tick\":");
                s.push_str(&doc::to_json(&e.tick.into()));
                s.push_str(",\"policies\":[");
                self.step = Step::Policy(0);
            }
            Step::Policy(i) => match (e.policies.get(i), e.keys.get(i)) {
                (Some(p), Some(keys)) => {
                    if i > 0 {
                        s.push(',');
                    }
                    s.push_str("{\"name\":");
                    s.push_str(&doc::to_json(&p.name.as_str().into()));
                    s.push_str(",\"fingerprint\":");
                    s.push_str(&doc::to_json(&fingerprint(p)));
                    s.push_str(",\"keys\":[");
                    // By name: the bytes never depend on the table's layout.
                    self.names = select(p, keys, self.snapshot);
                    order::sort(&mut self.names);
                    self.next = 0;
                    self.wrote = false;
                    self.step = Step::Keys(i);
                }
                _ => {
                    s.push_str("]}");
                    self.step = Step::Done;
                }
            },
            Step::Keys(i) => {
                let name = self.names.get(self.next).cloned();
                self.next += 1;
                match (name, e.policies.get(i), e.keys.get(i)) {
                    (Some(k), Some(p), Some(keys)) => {
                        // A key gone since the names were taken (the engine changed between
                        // pages) is left out.
                        if let Some((k, st)) = keys.find(&*k).and_then(|at| keys.get(at)) {
                            if self.wrote {
                                s.push(',');
                            }
                            s.push_str(&doc::to_json(&key_to_json(p, k, st)));
                            self.wrote = true;
                        }
                    }
                    _ => {
                        s.push_str("]}");
                        self.names = Vec::new();
                        self.step = Step::Policy(i + 1);
                    }
                }
            }
            Step::Done => {}
        }
        self.carry = s.into_bytes();
    }
}

/// The keys of one policy an export writes: every key, or (for a snapshot) those holding
/// protection (see `export_snapshot`).
fn select(p: &Policy, keys: &Keys, snapshot: bool) -> Vec<Arc<str>> {
    if !snapshot {
        return keys.iter().map(|(_, k, _)| k.clone()).collect();
    }
    let mut out = Vec::new();
    for list in [GUARD, BUSY, OVERFLOW, SHARED] {
        let mut at = keys.front(list);
        while let Some(i) = at {
            at = keys.next(i);
            if let Some((k, s)) = keys.get(i) {
                if list == GUARD || holds_protection(p, s, 0) {
                    out.push(k.clone());
                }
            }
        }
    }
    out
}

/// Where a [`Reader`] is in the document: in which object or list, and what may come next.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
enum At {
    /// Before the document's `{`.
    #[default]
    Start,
    /// In the document's object (`policy: false`) or a policy's.
    Object { policy: bool, expect: Expect },
    /// After a member's name and `:`, before its value.
    Member { policy: bool, member: Member },
    /// In the `policies` list (`keys: false`) or a policy's `keys`.
    List { keys: bool, expect: Expect },
    /// After the document's `}`.
    Done,
}

/// What may come next in an object or a list.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Expect {
    /// A member or an element, or the end (just after the opening).
    First,
    /// A member or an element (after a comma).
    Next,
    /// A comma or the end.
    After,
}

/// A member the reader knows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Member {
    Format,
    Version,
    Rng,
    Tick,
    Policies,
    Name,
    Fingerprint,
    Keys,
    Other,
}

/// The policy entry being read.
#[derive(Clone, Debug, Default)]
struct PolicyIn {
    name: Option<Value>,
    fingerprint: Option<Value>,
    keys_seen: bool,
    /// Known once the name and the fingerprint are (`None` inside: the policy is gone).
    target: Option<Option<Target>>,
    /// Entries given before the name and the fingerprint, kept until the object's end.
    waiting: Vec<Value>,
    parsed: Vec<(Arc<str>, KeyState)>,
    entries: usize,
}

/// Reads a state document page by page: the document's object and its `policies` list are
/// followed byte by byte, and every other value (the header's members, a policy's name and
/// fingerprint, each key's entry) is parsed once complete, then its bytes dropped. It keeps
/// the entries read (as state, not bytes) until the end, when they replace the engine's.
#[derive(Clone, Debug, Default)]
struct Reader {
    buf: Vec<u8>,
    /// Bytes of `buf` already read.
    pos: usize,
    /// Bytes of the document dropped from `buf` (for error positions).
    base: u64,
    /// How far the value starting at `pos` has been scanned: `(end, depth, in_string, escaped)`.
    scan: Option<(usize, u32, bool, bool)>,
    at: At,
    format: Option<Value>,
    version: Option<Value>,
    rng: Option<Value>,
    tick: Option<Value>,
    policies_seen: bool,
    policy_count: usize,
    policy: PolicyIn,
    staged: Staged,
}

fn not_state(what: impl std::fmt::Display) -> LoadError {
    LoadError::new("", format!("not Levee state: {what}"))
}

fn is_space(b: u8) -> bool {
    matches!(b, b' ' | b'\t' | b'\n' | b'\r')
}

impl Reader {
    fn feed(&mut self, e: &Engine, bytes: &[u8]) -> Result<(), LoadError> {
        if self.pos > 0 {
            self.buf.drain(..self.pos.min(self.buf.len()));
            if let Some((end, ..)) = &mut self.scan {
                *end -= self.pos;
            }
            self.base += self.pos as u64;
            self.pos = 0;
        }
        self.buf.extend_from_slice(bytes);
        while self.step(e)? {}
        Ok(())
    }

    /// The next byte that is not white space (moving past the white space), if any yet.
    fn peek(&mut self) -> Option<u8> {
        while let Some(&b) = self.buf.get(self.pos) {
            if !is_space(b) {
                return Some(b);
            }
            self.pos += 1;
        }
        None
    }

    fn unexpected(&self, what: &str) -> LoadError {
        not_state(format!("expected {what} at byte {}", self.base + self.pos as u64))
    }

    /// The end of the JSON value starting at `pos`, once all of it is here.
    fn extent(&mut self) -> Result<Option<usize>, LoadError> {
        let (mut end, mut depth, mut in_str, mut esc) = self.scan.unwrap_or((self.pos, 0, false, false));
        let first = self.buf.get(self.pos).copied().unwrap_or(b' ');
        let scalar = !matches!(first, b'{' | b'[' | b'"');
        while let Some(&b) = self.buf.get(end) {
            end += 1;
            if in_str {
                if esc {
                    esc = false;
                } else if b == b'\\' {
                    esc = true;
                } else if b == b'"' {
                    in_str = false;
                    if depth == 0 {
                        self.scan = None;
                        return Ok(Some(end));
                    }
                }
                continue;
            }
            if scalar {
                if is_space(b) || matches!(b, b',' | b'}' | b']') {
                    self.scan = None;
                    return Ok(Some(end - 1));
                }
                continue;
            }
            match b {
                b'"' => in_str = true,
                b'{' | b'[' => depth += 1,
                b'}' | b']' => {
                    depth = depth.saturating_sub(1);
                    if depth == 0 {
                        self.scan = None;
                        return Ok(Some(end));
                    }
                }
                _ => {}
            }
        }
        if end - self.pos > MAX_STATE_BYTES {
            return Err(not_state(format!("a value at byte {} is longer than {MAX_STATE_BYTES} bytes", self.base + self.pos as u64)));
        }
        self.scan = Some((end, depth, in_str, esc));
        Ok(None)
    }

    /// The complete value at `pos`, parsed, and `pos` past it; `None` until all of it is here.
    fn value(&mut self) -> Result<Option<Value>, LoadError> {
        let Some(end) = self.extent()? else { return Ok(None) };
        let bytes = self.buf.get(self.pos..end).unwrap_or_default();
        let text = std::str::from_utf8(bytes).map_err(|_| not_state("not UTF-8"))?;
        let v = doc::parse_json_limited(text, MAX_STATE_BYTES).map_err(|e| not_state(e.message))?;
        self.pos = end;
        Ok(Some(v))
    }

    /// One step of reading; `false` when more bytes are needed.
    fn step(&mut self, e: &Engine) -> Result<bool, LoadError> {
        let Some(b) = self.peek() else { return Ok(false) };
        match self.at {
            At::Done => Err(self.unexpected("the end of the document")),
            At::Start => {
                if b != b'{' {
                    return Err(not_state("expected a JSON object"));
                }
                self.pos += 1;
                self.at = At::Object { policy: false, expect: Expect::First };
                Ok(true)
            }
            At::Object { policy, expect } => {
                if expect == Expect::After && b == b',' {
                    self.pos += 1;
                    self.at = At::Object { policy, expect: Expect::Next };
                    return Ok(true);
                }
                if expect != Expect::Next && b == b'}' {
                    self.pos += 1;
                    if policy {
                        self.end_policy(e)?;
                        self.at = At::List { keys: false, expect: Expect::After };
                    } else {
                        self.at = At::Done;
                    }
                    return Ok(true);
                }
                if expect == Expect::After || b != b'"' {
                    return Err(self.unexpected(if expect == Expect::After { "',' or '}'" } else { "a member's name" }));
                }
                // The name and its ':' are read together.
                let start = self.pos;
                let Some(name) = self.value()? else { return Ok(false) };
                let Some(colon) = self.peek() else {
                    self.pos = start;
                    return Ok(false);
                };
                if colon != b':' {
                    return Err(self.unexpected("':'"));
                }
                self.pos += 1;
                let member = match (policy, name.as_str().unwrap_or_default()) {
                    (false, "format") => Member::Format,
                    (false, "version") => Member::Version,
                    (false, "rng") => Member::Rng,
                    (false, "tick") => Member::Tick,
                    (false, "policies") => Member::Policies,
                    (true, "name") => Member::Name,
                    (true, "fingerprint") => Member::Fingerprint,
                    (true, "keys") => Member::Keys,
                    _ => Member::Other,
                };
                self.at = At::Member { policy, member };
                Ok(true)
            }
            At::Member { policy, member } => {
                let after = At::Object { policy, expect: Expect::After };
                if member == Member::Policies && b == b'[' && !self.policies_seen {
                    self.pos += 1;
                    self.policies_seen = true;
                    self.at = At::List { keys: false, expect: Expect::First };
                    return Ok(true);
                }
                if member == Member::Keys && b == b'[' && !self.policy.keys_seen {
                    self.pos += 1;
                    self.policy.keys_seen = true;
                    self.resolve(e, false)?;
                    self.at = At::List { keys: true, expect: Expect::First };
                    return Ok(true);
                }
                let Some(v) = self.value()? else { return Ok(false) };
                // A member given twice: the first counts (as `import-state` reads it).
                match member {
                    Member::Format if self.format.is_none() => {
                        check_format(Some(&v))?;
                        self.format = Some(v);
                    }
                    Member::Version if self.version.is_none() => {
                        check_version(Some(&v))?;
                        self.version = Some(v);
                    }
                    Member::Rng if self.rng.is_none() => self.rng = Some(v),
                    Member::Tick if self.tick.is_none() => self.tick = Some(v),
                    Member::Policies if !self.policies_seen => return Err(LoadError::new("policies", "is missing")),
                    Member::Name if self.policy.name.is_none() => self.policy.name = Some(v),
                    Member::Fingerprint if self.policy.fingerprint.is_none() => self.policy.fingerprint = Some(v),
                    Member::Keys if !self.policy.keys_seen => {
                        return Err(LoadError::new(&format!("policies[{}]", self.policy_count), "has no keys"))
                    }
                    _ => {}
                }
                self.at = after;
                Ok(true)
            }
            At::List { keys, expect } => {
                if expect == Expect::After && b == b',' {
                    self.pos += 1;
                    self.at = At::List { keys, expect: Expect::Next };
                    return Ok(true);
                }
                if expect != Expect::Next && b == b']' {
                    self.pos += 1;
                    self.at = At::Object { policy: keys, expect: Expect::After };
                    return Ok(true);
                }
                if expect == Expect::After {
                    return Err(self.unexpected("',' or ']'"));
                }
                if keys {
                    let Some(v) = self.value()? else { return Ok(false) };
                    self.entry(e, v)?;
                    self.at = At::List { keys, expect: Expect::After };
                    return Ok(true);
                }
                if b != b'{' {
                    // Not an object: it has no name.
                    return Err(LoadError::new(&format!("policies[{}]", self.policy_count), "has no name"));
                }
                self.pos += 1;
                self.policy = PolicyIn::default();
                self.at = At::Object { policy: true, expect: Expect::First };
                Ok(true)
            }
        }
    }

    /// Decide which policy the current entry restores, once its name and fingerprint are
    /// known (or, `at_end`, at the end of its object), and read the entries kept waiting.
    fn resolve(&mut self, e: &Engine, at_end: bool) -> Result<(), LoadError> {
        if self.policy.target.is_some() || !at_end && (self.policy.name.is_none() || self.policy.fingerprint.is_none()) {
            return Ok(());
        }
        let path = format!("policies[{}]", self.policy_count);
        let name = self.policy.name.as_ref().and_then(Value::as_str).ok_or_else(|| LoadError::new(&path, "has no name"))?;
        let target = Target::of(e, name, self.policy.fingerprint.as_ref());
        self.policy.target = Some(target);
        for (j, v) in std::mem::take(&mut self.policy.waiting).into_iter().enumerate() {
            if let Some(t) = target {
                t.read(e, &v, &format!("{path}.keys[{j}]"), &mut self.policy.parsed)?;
            }
        }
        Ok(())
    }

    fn entry(&mut self, e: &Engine, v: Value) -> Result<(), LoadError> {
        let j = self.policy.entries;
        self.policy.entries += 1;
        match self.policy.target {
            Some(Some(t)) => t.read(e, &v, &format!("policies[{}].keys[{j}]", self.policy_count), &mut self.policy.parsed),
            Some(None) => Ok(()),
            None => {
                self.policy.waiting.push(v);
                Ok(())
            }
        }
    }

    fn end_policy(&mut self, e: &Engine) -> Result<(), LoadError> {
        let path = format!("policies[{}]", self.policy_count);
        if self.policy.name.as_ref().and_then(Value::as_str).is_none() {
            return Err(LoadError::new(&path, "has no name"));
        }
        if !self.policy.keys_seen {
            return Err(LoadError::new(&path, "has no keys"));
        }
        self.resolve(e, true)?;
        let policy = std::mem::take(&mut self.policy);
        if let Some(Some(t)) = policy.target {
            self.staged.push((t.policy, policy.parsed));
        }
        self.policy_count += 1;
        Ok(())
    }

    /// The header and the entries read, once the document is complete.
    #[allow(clippy::type_complexity)]
    fn finish(mut self) -> Result<([u64; 4], u64, Staged), LoadError> {
        let end = self.base + self.buf.len() as u64;
        if self.at == At::Start {
            return Err(not_state("expected a JSON object"));
        }
        if self.at != At::Done {
            return Err(not_state(format!("the document ends early, at byte {end}")));
        }
        if self.peek().is_some() {
            return Err(self.unexpected("the end of the document"));
        }
        let (words, tick) = read_header(self.format.as_ref(), self.version.as_ref(), self.rng.as_ref(), self.tick.as_ref())?;
        if !self.policies_seen {
            return Err(LoadError::new("policies", "is missing"));
        }
        Ok((words, tick, self.staged))
    }
}

fn fingerprint(p: &Policy) -> Value {
    obj([("window", p.breaker.as_ref().map(|b| b.window.fingerprint()).unwrap_or(Value::Null))])
}

fn key_to_json(p: &Policy, key: &str, s: &KeyState) -> Value {
    let or_null = |v: Option<Value>| v.unwrap_or(Value::Null);
    let mut out = obj([
        ("key", key.into()),
        ("last_used", s.last_used.into()),
        ("breaker", or_null(s.breaker.as_ref().map(Breaker::to_json))),
        ("limiter", or_null(s.limiter.as_ref().map(Gcra::to_json))),
        ("budget", or_null(s.budget.as_ref().map(BudgetState::to_json))),
    ]);
    // Added after version 1's first release: present only when the policy has it.
    if let (Value::Map(entries), Some(cfg), Some(l)) = (&mut out, &p.concurrency, &s.adaptive) {
        entries.push(("concurrency".to_string(), l.to_json(cfg)));
    }
    out
}

fn key_from_json(p: &Policy, v: &Value, path: &str, same_window: bool) -> Result<(String, KeyState), LoadError> {
    let key = v.get("key").and_then(Value::as_str).ok_or_else(|| LoadError::new(&format!("{path}.key"), "must be a string"))?.to_string();
    let mut s = KeyState::fresh(p, u64_at(v, "last_used", path)?);
    if let (Some(cfg), Some(b)) = (&p.breaker, v.get("breaker").filter(|b| !b.is_null())) {
        s.breaker = Some(cfg.import(b, &format!("{path}.breaker"), same_window)?);
    }
    if let (Some(cfg), Some(g)) = (&p.rate_limit, v.get("limiter").filter(|g| !g.is_null())) {
        s.limiter = Some(cfg.import(g, &format!("{path}.limiter"))?);
    }
    if let (Some(cfg), Some(b)) = (&p.budget, v.get("budget").filter(|b| !b.is_null())) {
        s.budget = Some(cfg.import(b, &format!("{path}.budget"))?);
    }
    if let (Some(cfg), Some(c)) = (&p.concurrency, v.get("concurrency").filter(|c| !c.is_null())) {
        s.adaptive = Some(Box::new(cfg.import(c, &format!("{path}.concurrency"))?));
    }
    Ok((key, s))
}
