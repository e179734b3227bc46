//! `levee durable list|counts|show|retry|cancel|prune STORE`: read and change a durable-call
//! store, an SQLite file or a PostgreSQL database, through the shared statements of
//! `durable/sqlite.sql` and `durable/postgres.sql`; the records are decoded and changed by the
//! core (`levee_core::durable`, `levee_core::durable_exec`), never by this tool.

use levee_core::durable::inspect;
use levee_core::durable_exec::{operator_write, RowWrite};
use levee_core::Engine;
use serde_json::Value;

const SQLITE: &str = include_str!("../../durable/sqlite.sql");
const POSTGRES: &str = include_str!("../../durable/postgres.sql");

/// The statuses `prune` may delete: the finished ones.
const FINISHED: [&str; 3] = ["done", "dead", "cancelled"];
/// Every status a row may hold.
const STATUSES: [&str; 6] = ["scheduled", "running", "done", "dead", "cancelled", "quarantined"];
/// Rows read per statement while a listing filters on what only the record holds.
const PAGE: i64 = 500;

fn statement(sql: &'static str, name: &str) -> Result<&'static str, String> {
    sql.split("-- name: ")
        .skip(1)
        .find_map(|block| {
            let (head, body) = block.split_once('\n')?;
            (head.trim() == name).then_some(body.trim())
        })
        .ok_or_else(|| format!("the shared SQL has no statement `{name}`"))
}

/// Whether STORE names a PostgreSQL database: a URL (`postgres://`, `postgresql://`) or a
/// conninfo string of `key=value` words; anything else is an SQLite file.
fn is_postgres(store: &str) -> bool {
    store.starts_with("postgres://") || store.starts_with("postgresql://") || store.split_whitespace().any(|w| w.contains('='))
}

/// A store named for messages: an SQLite path as given, a PostgreSQL conninfo without its password.
fn display(store: &str) -> String {
    if !is_postgres(store) {
        return store.to_string();
    }
    if let Some((scheme, rest)) = store.split_once("://") {
        if let Some((userinfo, host)) = rest.split_once('@') {
            let user = userinfo.split(':').next().unwrap_or("");
            return format!("{scheme}://{user}@{host}");
        }
        return store.to_string();
    }
    store.split_whitespace().filter(|w| !w.starts_with("password=")).collect::<Vec<_>>().join(" ")
}

enum Conn {
    Sqlite(rusqlite::Connection),
    Postgres(Box<postgres::Client>),
}

/// An open store.
struct Store {
    name: String,
    conn: Conn,
}

struct Row {
    id: i64,
    handler: String,
    status: String,
    next_at: i64,
    attempts: i64,
    owner: Option<String>,
    record: Vec<u8>,
    error: Option<String>,
    key: Option<String>,
}

fn sqlite_row(r: &rusqlite::Row<'_>) -> rusqlite::Result<Row> {
    Ok(Row {
        id: r.get(0)?,
        handler: r.get(1)?,
        status: r.get(2)?,
        next_at: r.get(3)?,
        attempts: r.get(4)?,
        owner: r.get(5)?,
        record: r.get(6)?,
        error: r.get(8)?,
        key: r.get(9)?,
    })
}

fn postgres_row(r: &postgres::Row) -> Result<Row, postgres::Error> {
    Ok(Row {
        id: r.try_get(0)?,
        handler: r.try_get(1)?,
        status: r.try_get(2)?,
        next_at: r.try_get(3)?,
        attempts: i64::from(r.try_get::<_, i32>(4)?),
        owner: r.try_get(5)?,
        record: r.try_get(6)?,
        error: r.try_get(8)?,
        key: r.try_get(9)?,
    })
}

fn local_wall_now() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(0)
}

impl Store {
    fn open(store: &str) -> Result<Store, String> {
        let name = display(store);
        if is_postgres(store) {
            let mut c = postgres::Client::connect(store, postgres::NoTls).map_err(|e| format!("{name}: {e}"))?;
            // Name a database without the durable-call table now, not at the first query.
            c.prepare(statement(POSTGRES, "list")?).map_err(|e| format!("{name}: not a store of durable calls ({e})"))?;
            return Ok(Store { name, conn: Conn::Postgres(Box::new(c)) });
        }
        if !std::path::Path::new(store).is_file() {
            return Err(format!("{store}: no such store (an SQLite file of durable calls, or a PostgreSQL conninfo)"));
        }
        let c = rusqlite::Connection::open(store).map_err(|e| format!("{name}: {e}"))?;
        c.busy_timeout(std::time::Duration::from_secs(30)).map_err(|e| e.to_string())?;
        // SQLite opens any file lazily: compile a statement of the shared schema now, so that a
        // file that is not a store is named in the error (not a bare "file is not a database" or
        // "no such table" at the first query).
        c.prepare(statement(SQLITE, "list")?).map_err(|e| format!("{name}: not a store of durable calls ({e})"))?;
        Ok(Store { name, conn: Conn::Sqlite(c) })
    }

    fn err(&self, e: impl std::fmt::Display) -> String {
        format!("{}: {e}", self.name)
    }

    /// The store's clock, wall ns: the database's for PostgreSQL (its one clock), this
    /// machine's for an SQLite file.
    fn now(&mut self) -> Result<u64, String> {
        match &mut self.conn {
            Conn::Sqlite(_) => Ok(local_wall_now()),
            Conn::Postgres(c) => {
                let r = c.query_one(statement(POSTGRES, "clock")?, &[]).map_err(|e| format!("{}: {e}", self.name))?;
                let ns: i64 = r.try_get(0).map_err(|e| format!("{}: {e}", self.name))?;
                Ok(ns.max(0) as u64)
            }
        }
    }

    /// One page of rows in id order after `after`, of `status` and `handler` when given.
    fn page(&mut self, after: i64, status: Option<&str>, handler: Option<&str>, limit: i64) -> Result<Vec<Row>, String> {
        let r = match &mut self.conn {
            Conn::Sqlite(c) => {
                let mut q = c.prepare(statement(SQLITE, "page")?).map_err(|e| e.to_string())?;
                let rows = q.query_map(rusqlite::params![after, status, handler, limit], sqlite_row).map_err(|e| e.to_string())?;
                rows.collect::<Result<Vec<_>, _>>().map_err(|e| e.to_string())
            }
            Conn::Postgres(c) => c
                .query(statement(POSTGRES, "page")?, &[&after, &status, &handler, &limit])
                .map_err(|e| e.to_string())
                .and_then(|rows| rows.iter().map(postgres_row).collect::<Result<Vec<_>, _>>().map_err(|e| e.to_string())),
        };
        r.map_err(|e| self.err(e))
    }

    fn get(&mut self, id: i64) -> Result<Row, String> {
        let r = match &mut self.conn {
            Conn::Sqlite(c) => {
                use rusqlite::OptionalExtension;
                c.query_row(statement(SQLITE, "get")?, [id], sqlite_row).optional().map_err(|e| e.to_string())
            }
            Conn::Postgres(c) => c
                .query_opt(statement(POSTGRES, "get")?, &[&id])
                .map_err(|e| e.to_string())
                .and_then(|r| r.as_ref().map(postgres_row).transpose().map_err(|e| e.to_string())),
        };
        r.map_err(|e| self.err(e))?.ok_or_else(|| format!("no call {id} in the store"))
    }

    /// The operator's compare-and-set write: false when the record changed meanwhile.
    fn replace(&mut self, id: i64, old: &[u8], w: &RowWrite) -> Result<bool, String> {
        let (next_at, attempts) = (w.next_at.min(i64::MAX as u64) as i64, w.attempts);
        let n = match &mut self.conn {
            Conn::Sqlite(c) => c
                .execute(
                    statement(SQLITE, "replace")?,
                    rusqlite::params![w.status, next_at, i64::from(attempts), w.record, w.error, local_wall_now() as i64, id, old],
                )
                .map(|n| n as u64)
                .map_err(|e| e.to_string()),
            Conn::Postgres(c) => {
                let attempts = attempts.min(i32::MAX as u32) as i32;
                c.execute(statement(POSTGRES, "replace")?, &[&w.status, &next_at, &attempts, &w.record, &w.error, &id, &old])
                    .map_err(|e| e.to_string())
            }
        };
        Ok(n.map_err(|e| self.err(e))? == 1)
    }

    fn counts(&mut self) -> Result<Vec<(String, i64)>, String> {
        let r = match &mut self.conn {
            Conn::Sqlite(c) => {
                let mut q = c.prepare(statement(SQLITE, "counts")?).map_err(|e| e.to_string())?;
                let rows = q.query_map([], |r| Ok((r.get(0)?, r.get(1)?))).map_err(|e| e.to_string())?;
                rows.collect::<Result<Vec<_>, _>>().map_err(|e| e.to_string())
            }
            Conn::Postgres(c) => c.query(statement(POSTGRES, "counts")?, &[]).map_err(|e| e.to_string()).and_then(|rows| {
                rows.iter()
                    .map(|r| Ok((r.try_get(0)?, r.try_get(1)?)))
                    .collect::<Result<Vec<_>, postgres::Error>>()
                    .map_err(|e| e.to_string())
            }),
        };
        r.map_err(|e| self.err(e))
    }

    /// Delete the finished calls of `statuses` last written before `before`, in one
    /// transaction: the count per status.
    fn prune(&mut self, statuses: &[&str], before: u64) -> Result<Vec<u64>, String> {
        let before = before.min(i64::MAX as u64) as i64;
        let r = match &mut self.conn {
            Conn::Sqlite(c) => {
                let sql = statement(SQLITE, "prune")?;
                (|| {
                    let tx = c.transaction()?;
                    let mut n = Vec::new();
                    for s in statuses {
                        n.push(tx.execute(sql, rusqlite::params![s, before])? as u64);
                    }
                    tx.commit()?;
                    Ok::<_, rusqlite::Error>(n)
                })()
                .map_err(|e| e.to_string())
            }
            Conn::Postgres(c) => {
                let sql = statement(POSTGRES, "prune")?;
                (|| {
                    let mut tx = c.transaction()?;
                    let mut n = Vec::new();
                    for s in statuses {
                        n.push(tx.execute(sql, &[s, &before])?);
                    }
                    tx.commit()?;
                    Ok::<_, postgres::Error>(n)
                })()
                .map_err(|e| e.to_string())
            }
        };
        r.map_err(|e| self.err(e))
    }
}

fn when(next_at: i64, now: u64) -> String {
    if next_at <= 0 {
        return "-".to_string();
    }
    let d = next_at as i128 - now as i128;
    let secs = d as f64 / 1e9;
    if d <= 0 {
        format!("due ({:.1}s ago)", -secs)
    } else {
        format!("in {secs:.1}s")
    }
}

/// The record as the core describes it (null for one it cannot read).
fn described(record: &[u8]) -> Value {
    inspect(record).ok().and_then(|j| serde_json::from_str::<Value>(&j).ok()).unwrap_or(Value::Null)
}

fn last_error(record: &Value) -> String {
    match record.get("last-error") {
        Some(e) if !e.is_null() => format!(
            "attempt {}: {}: {}",
            e.get("attempt").and_then(Value::as_u64).unwrap_or(0),
            e.get("class").and_then(Value::as_str).unwrap_or(""),
            e.get("message").and_then(Value::as_str).unwrap_or("")
        ),
        _ => String::new(),
    }
}

/// What `levee durable list` shows.
#[derive(Debug, Default)]
pub struct Filter {
    /// Only these statuses (empty: any).
    pub statuses: Vec<String>,
    /// Only calls of this handler.
    pub handler: Option<String>,
    /// Only calls of this policy (as the record names it).
    pub policy: Option<String>,
    /// Only calls of this key (the policy's per-key state, as the record holds it).
    pub key: Option<String>,
    /// Only calls with an id above this one (the next page).
    pub after: i64,
    /// At most this many calls (0: all).
    pub limit: u64,
}

/// `levee durable list`: the calls that pass `f`, in id order; a last line says how to see
/// the next page when there is more.
pub fn list(store: &str, f: &Filter, json: bool) -> Result<Vec<String>, String> {
    for s in &f.statuses {
        if !STATUSES.contains(&s.as_str()) {
            return Err(format!("--status: `{s}` is not a status: use {}", STATUSES.join(", ")));
        }
    }
    let mut st = Store::open(store)?;
    let now = st.now()?;
    // One status and the handler filter in the statement; more statuses, the policy and the
    // key (inside the record) here.
    let one = match f.statuses.as_slice() {
        [s] => Some(s.as_str()),
        _ => None,
    };
    let mut out = Vec::new();
    if !json {
        out.push(format!("{:>6}  {:<16} {:<12} {:>8}  {:<16} last error", "id", "handler", "status", "attempts", "next attempt"));
    }
    // `scan`: the last id read; `last`: the last id shown (where the next page starts).
    let (mut scan, mut last, mut shown, mut more) = (f.after, f.after, 0u64, false);
    'pages: loop {
        let rows = st.page(scan, one, f.handler.as_deref(), PAGE)?;
        let full = rows.len() as i64 == PAGE;
        for r in rows {
            scan = r.id;
            if !f.statuses.is_empty() && !f.statuses.contains(&r.status) {
                continue;
            }
            let record = described(&r.record);
            let field = |name: &str| record.get(name).and_then(Value::as_str).map(str::to_string);
            if f.policy.is_some() && field("policy") != f.policy || f.key.is_some() && field("key") != f.key {
                continue;
            }
            if f.limit > 0 && shown == f.limit {
                more = true;
                break 'pages;
            }
            shown += 1;
            last = r.id;
            if json {
                out.push(
                    serde_json::json!({"id": r.id, "handler": r.handler, "status": r.status, "next_at": r.next_at,
                    "attempts": r.attempts, "lease_owner": r.owner, "idempotency_key": r.key, "error": r.error,
                    "policy": field("policy"), "key": field("key"), "last_error": last_error(&record)})
                    .to_string(),
                );
                continue;
            }
            let next = if matches!(r.status.as_str(), "scheduled" | "running") { when(r.next_at, now) } else { "-".to_string() };
            let err = r.error.clone().unwrap_or_else(|| last_error(&record));
            out.push(format!("{:>6}  {:<16} {:<12} {:>8}  {:<16} {}", r.id, r.handler, r.status, r.attempts, next, err));
        }
        if !full {
            break;
        }
    }
    if more && !json {
        out.push(format!("(more: add --after {last})"));
    }
    Ok(out)
}

/// `levee durable counts`: how many calls the store holds in each status.
pub fn counts(store: &str, json: bool) -> Result<Vec<String>, String> {
    let mut st = Store::open(store)?;
    let counts = st.counts()?;
    let of = |s: &str| counts.iter().find(|(status, _)| status == s).map(|(_, n)| *n).unwrap_or(0);
    if json {
        let m: serde_json::Map<String, Value> = STATUSES.iter().map(|s| (s.to_string(), Value::from(of(s)))).collect();
        return Ok(vec![Value::Object(m).to_string()]);
    }
    let mut out: Vec<String> = STATUSES.iter().map(|s| format!("{s:<12} {:>10}", of(s))).collect();
    out.push(format!("{:<12} {:>10}", "total", counts.iter().map(|(_, n)| n).sum::<i64>()));
    Ok(out)
}

/// `levee durable show`.
pub fn show(store: &str, id: i64) -> Result<Vec<String>, String> {
    let r = Store::open(store)?.get(id)?;
    let record: Value = match inspect(&r.record) {
        Ok(j) => serde_json::from_str(&j).map_err(|e| e.to_string())?,
        Err(e) => Value::String(format!("unreadable record: {e}")),
    };
    let v = serde_json::json!({"id": r.id, "handler": r.handler, "status": r.status, "next_at": r.next_at,
        "attempts": r.attempts, "lease_owner": r.owner, "idempotency_key": r.key, "error": r.error, "record": record});
    Ok(vec![serde_json::to_string_pretty(&v).map_err(|e| e.to_string())?])
}

/// An operator's cancel or retry, compare-and-set against the record read, as the executors do
/// it (`DURABLE_OPERATOR_TRIES` tries against concurrent writers): what the core writes.
fn operator(store: &str, id: i64, engine: &Engine, revive: bool) -> Result<(), String> {
    let mut st = Store::open(store)?;
    for _ in 0..levee_core::durable_exec::OPERATOR_TRIES {
        let r = st.get(id)?;
        let now = st.now()?;
        let step = if revive { engine.durable_revive(&r.record, now) } else { engine.durable_cancel(&r.record, now) };
        let w = operator_write(step).map_err(|e| format!("call {id}: {e}"))?;
        if st.replace(id, &r.record, &w)? {
            return Ok(());
        }
    }
    Err(format!("call {id} kept changing while this command ran; try again"))
}

/// `levee durable cancel`.
pub fn cancel(store: &str, id: i64) -> Result<Vec<String>, String> {
    // Cancelling needs no policy: any engine decodes and changes the record.
    let engine = Engine::load("policies:\n  any: {}\n", 0).map_err(|e| format!("{e:?}"))?;
    operator(store, id, &engine, false)?;
    Ok(vec![format!("call {id} cancelled")])
}

/// `levee durable retry`: a dead or cancelled call gets a fresh set of attempts under POLICY.
pub fn retry(store: &str, id: i64, policy_doc: &str) -> Result<Vec<String>, String> {
    let engine = Engine::load(policy_doc, 0).map_err(|errs| errs.iter().map(|e| e.to_string()).collect::<Vec<_>>().join("; "))?;
    operator(store, id, &engine, true)?;
    Ok(vec![format!("call {id} is due again with a fresh set of attempts")])
}

/// `levee durable prune`: delete the finished calls of `statuses` last written at least
/// `older_than` ago (by the store's clock), in one transaction; one line per status with the
/// count deleted.
pub fn prune(store: &str, older_than: &str, statuses: &[String]) -> Result<Vec<String>, String> {
    let retention = levee_core::time::parse_duration(older_than).map_err(|e| format!("--older-than: {e}"))?;
    for s in statuses {
        if !FINISHED.contains(&s.as_str()) {
            return Err(format!(
                "--status: `{s}` is not a finished status: use done, dead or cancelled (a scheduled or running call, or a quarantined record, is never pruned)"
            ));
        }
    }
    let mut st = Store::open(store)?;
    let before = st.now()?.saturating_sub(retention);
    let chosen: Vec<&str> = FINISHED.iter().copied().filter(|f| statuses.iter().any(|s| s == f)).collect();
    let n = st.prune(&chosen, before)?;
    Ok(chosen.iter().zip(n).map(|(s, n)| format!("{n} {s} call{} deleted", if n == 1 { "" } else { "s" })).collect())
}
