//! `levee durable list|show|retry|cancel|prune STORE`: read and change a durable-call store (an SQLite
//! file) through the shared statements of `durable/sqlite.sql`; the records are decoded and
//! changed by the core (`levee_core::durable`), never by this tool.

use std::path::Path;

use levee_core::durable::{inspect, Action, DurableStep};
use levee_core::Engine;
use rusqlite::{params, Connection, OptionalExtension};
use serde_json::Value;

const SQL: &str = include_str!("../../durable/sqlite.sql");

fn statement(name: &str) -> Result<&'static str, String> {
    SQL.split("-- name: ")
        .skip(1)
        .find_map(|block| {
            let (head, body) = block.split_once('\n')?;
            (head.trim() == name).then_some(body.trim())
        })
        .ok_or_else(|| format!("durable/sqlite.sql has no statement `{name}`"))
}

fn open(store: &Path) -> Result<Connection, String> {
    if !store.is_file() {
        return Err(format!("{}: no such store (an SQLite file of durable calls)", store.display()));
    }
    let c = Connection::open(store).map_err(|e| format!("{}: {e}", store.display()))?;
    c.busy_timeout(std::time::Duration::from_secs(30)).map_err(|e| e.to_string())?;
    // SQLite opens any file lazily: compile a statement of the shared schema now, so that a
    // file that is not a store is named in the error (not a bare "file is not a database" or
    // "no such table" at the first query).
    c.prepare(statement("list")?).map_err(|e| format!("{}: not a store of durable calls ({e})", store.display()))?;
    Ok(c)
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

fn row(r: &rusqlite::Row<'_>) -> rusqlite::Result<Row> {
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

fn wall_now() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(0)
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

fn last_error(record: &[u8]) -> String {
    match inspect(record).ok().and_then(|j| serde_json::from_str::<Value>(&j).ok()) {
        Some(v) => match v.get("last-error") {
            Some(e) if !e.is_null() => format!(
                "attempt {}: {}: {}",
                e.get("attempt").and_then(Value::as_u64).unwrap_or(0),
                e.get("class").and_then(Value::as_str).unwrap_or(""),
                e.get("message").and_then(Value::as_str).unwrap_or("")
            ),
            _ => String::new(),
        },
        None => String::new(),
    }
}

/// `levee durable list`.
pub fn list(store: &Path, dead: bool, json: bool) -> Result<Vec<String>, String> {
    let c = open(store)?;
    let mut q = c.prepare(statement(if dead { "list_dead" } else { "list" })?).map_err(|e| e.to_string())?;
    let rows: Vec<Row> = q.query_map([], row).map_err(|e| e.to_string())?.collect::<Result<_, _>>().map_err(|e| e.to_string())?;
    let now = wall_now();
    let mut out = Vec::new();
    if json {
        for r in rows {
            out.push(
                serde_json::json!({"id": r.id, "handler": r.handler, "status": r.status, "next_at": r.next_at,
                "attempts": r.attempts, "lease_owner": r.owner, "idempotency_key": r.key, "error": r.error,
                "last_error": last_error(&r.record)})
                .to_string(),
            );
        }
        return Ok(out);
    }
    out.push(format!("{:>6}  {:<16} {:<12} {:>8}  {:<16} last error", "id", "handler", "status", "attempts", "next attempt"));
    for r in rows {
        let next = if matches!(r.status.as_str(), "scheduled" | "running") { when(r.next_at, now) } else { "-".to_string() };
        let err = r.error.clone().unwrap_or_else(|| last_error(&r.record));
        out.push(format!("{:>6}  {:<16} {:<12} {:>8}  {:<16} {}", r.id, r.handler, r.status, r.attempts, next, err));
    }
    Ok(out)
}

fn get(c: &Connection, id: i64) -> Result<Row, String> {
    c.query_row(statement("get")?, params![id], row)
        .optional()
        .map_err(|e| e.to_string())?
        .ok_or_else(|| format!("no call {id} in the store"))
}

/// `levee durable show`.
pub fn show(store: &Path, id: i64) -> Result<Vec<String>, String> {
    let c = open(store)?;
    let r = get(&c, id)?;
    let record: Value = match inspect(&r.record) {
        Ok(j) => serde_json::from_str(&j).map_err(|e| e.to_string())?,
        Err(e) => Value::String(format!("unreadable record: {e}")),
    };
    let v = serde_json::json!({"id": r.id, "handler": r.handler, "status": r.status, "next_at": r.next_at,
        "attempts": r.attempts, "lease_owner": r.owner, "idempotency_key": r.key, "error": r.error, "record": record});
    Ok(vec![serde_json::to_string_pretty(&v).map_err(|e| e.to_string())?])
}

fn status_of(s: &DurableStep) -> &'static str {
    match s.action {
        Action::Run => "running",
        Action::Wait => "scheduled",
        Action::Done => "done",
        Action::Dead => "dead",
        Action::Cancelled => "cancelled",
    }
}

fn replace(c: &Connection, id: i64, old: &[u8], s: &DurableStep, error: Option<&str>) -> Result<(), String> {
    let n = c
        .execute(
            statement("replace")?,
            params![status_of(s), s.next_at as i64, i64::from(s.attempt), s.record, error, wall_now() as i64, id, old],
        )
        .map_err(|e| e.to_string())?;
    if n != 1 {
        return Err(format!("call {id} changed while this command ran; try again"));
    }
    Ok(())
}

/// `levee durable cancel`.
pub fn cancel(store: &Path, id: i64) -> Result<Vec<String>, String> {
    let c = open(store)?;
    let r = get(&c, id)?;
    // Cancelling needs no policy: any engine decodes and changes the record.
    let engine = Engine::load("policies:\n  any: {}\n", 0).map_err(|e| format!("{e:?}"))?;
    let s = engine.durable_cancel(&r.record, wall_now()).map_err(|e| format!("call {id}: {e}"))?;
    replace(&c, id, &r.record, &s, Some(levee_core::durable_exec::CANCELLED_MESSAGE))?;
    Ok(vec![format!("call {id} cancelled")])
}

/// `levee durable retry`: a dead or cancelled call gets a fresh set of attempts under POLICY.
pub fn retry(store: &Path, id: i64, policy_doc: &str) -> Result<Vec<String>, String> {
    let c = open(store)?;
    let r = get(&c, id)?;
    let engine = Engine::load(policy_doc, 0).map_err(|errs| errs.iter().map(|e| e.to_string()).collect::<Vec<_>>().join("; "))?;
    let s = engine.durable_revive(&r.record, wall_now()).map_err(|e| format!("call {id}: {e}"))?;
    replace(&c, id, &r.record, &s, None)?;
    Ok(vec![format!("call {id} is due again with a fresh set of attempts")])
}

/// The statuses `prune` may delete: the finished ones.
const FINISHED: [&str; 3] = ["done", "dead", "cancelled"];

/// `levee durable prune`: delete the finished calls of `statuses` last written at least
/// `older_than` ago, in one transaction; one line per status with the count deleted.
pub fn prune(store: &Path, older_than: &str, statuses: &[String]) -> Result<Vec<String>, String> {
    let retention = levee_core::time::parse_duration(older_than).map_err(|e| format!("--older-than: {e}"))?;
    for s in statuses {
        if !FINISHED.contains(&s.as_str()) {
            return Err(format!(
                "--status: `{s}` is not a finished status: use done, dead or cancelled (a scheduled or running call, or a quarantined record, is never pruned)"
            ));
        }
    }
    let before = wall_now().saturating_sub(retention);
    let mut c = open(store)?;
    let tx = c.transaction().map_err(|e| e.to_string())?;
    let mut lines = Vec::new();
    for s in FINISHED.iter().filter(|f| statuses.iter().any(|s| s == *f)) {
        let n = tx.execute(statement("prune")?, params![s, before as i64]).map_err(|e| format!("{}: {e}", store.display()))?;
        lines.push(format!("{n} {s} call{} deleted", if n == 1 { "" } else { "s" }));
    }
    tx.commit().map_err(|e| format!("{}: {e}", store.display()))?;
    Ok(lines)
}
