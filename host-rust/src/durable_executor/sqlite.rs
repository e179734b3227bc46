//! The SQLite store (feature `durable-sqlite`): one file in WAL mode, for one machine. Several
//! processes may share the file; claims run in `BEGIN IMMEDIATE` transactions. Its clock is this
//! host's. rusqlite is synchronous, so every statement runs on tokio's blocking pool, one at a
//! time on the store's one connection.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use rusqlite::{params, Connection, OptionalExtension, TransactionBehavior};

use super::store::{dialect, i64_of, u64_of, Claimed, ReplaceArgs, Row, WriteArgs, SQLITE_SQL};
use super::DurableError;

/// A store in one SQLite file (WAL mode). Cheap to clone: clones share the connection.
#[derive(Clone)]
pub struct SqliteStore {
    conn: Arc<Mutex<Connection>>,
    sql: Arc<BTreeMap<String, String>>,
    path: Arc<PathBuf>,
    /// The file's canonical path (symbolic links resolved), taken when it was opened: a
    /// caller's transaction must be on this file.
    canonical: Arc<PathBuf>,
}

impl std::fmt::Debug for SqliteStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SqliteStore").field("path", &self.path).finish_non_exhaustive()
    }
}

impl From<rusqlite::Error> for DurableError {
    fn from(e: rusqlite::Error) -> DurableError {
        DurableError::Store(Box::new(e))
    }
}

/// This host's wall clock, ns since the Unix epoch.
fn wall_now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)).unwrap_or(0)
}

fn row_of(r: &rusqlite::Row<'_>) -> rusqlite::Result<Row> {
    Ok(Row {
        id: r.get(0)?,
        handler: r.get(1)?,
        status: r.get(2)?,
        next_at: r.get(3)?,
        attempts: r.get(4)?,
        lease_owner: r.get(5)?,
        record: r.get(6)?,
        result: r.get(7)?,
        error: r.get(8)?,
        idempotency_key: r.get(9)?,
    })
}

impl SqliteStore {
    /// Open (creating when missing) the store in the SQLite file at `path`.
    pub async fn open(path: impl AsRef<Path>) -> Result<SqliteStore, DurableError> {
        let path = path.as_ref().to_path_buf();
        let sql = Arc::new(dialect(SQLITE_SQL, "sqlite")?);
        let (p, schema) = (path.clone(), sql.get("schema").cloned().unwrap_or_default());
        let conn = tokio::task::spawn_blocking(move || -> Result<Connection, rusqlite::Error> {
            let conn = Connection::open(&p)?;
            conn.busy_timeout(Duration::from_secs(30))?;
            conn.execute_batch("PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;")?;
            conn.execute_batch(&schema)?;
            Ok(conn)
        })
        .await
        .map_err(|e| DurableError::Store(Box::new(e)))?
        .map_err(|e| DurableError::Store(format!("opening {}: {e}", path.display()).into()))?;
        let canonical = std::fs::canonicalize(&path).unwrap_or_else(|_| path.clone());
        Ok(SqliteStore { conn: Arc::new(Mutex::new(conn)), sql, path: Arc::new(path), canonical: Arc::new(canonical) })
    }

    /// The file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Run `f` on the connection on tokio's blocking pool.
    async fn blocking<T: Send + 'static>(
        &self,
        f: impl FnOnce(&mut Connection, &BTreeMap<String, String>) -> Result<T, rusqlite::Error> + Send + 'static,
    ) -> Result<T, DurableError> {
        let (conn, sql) = (self.conn.clone(), self.sql.clone());
        tokio::task::spawn_blocking(move || {
            let mut conn = conn.lock().unwrap_or_else(|p| p.into_inner());
            f(&mut conn, &sql)
        })
        .await
        .map_err(|e| DurableError::Store(Box::new(e)))?
        .map_err(DurableError::from)
    }

    pub(crate) async fn now(&self) -> Result<u64, DurableError> {
        Ok(wall_now())
    }

    pub(crate) async fn insert(
        &self,
        handler: &str,
        payload: Vec<u8>,
        key: Option<&str>,
        next_at: u64,
        record: Vec<u8>,
    ) -> Result<i64, DurableError> {
        let (handler, key) = (handler.to_string(), key.map(str::to_string));
        let id = self
            .blocking(move |conn, sql| {
                let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
                let id = insert_on(&tx, sql, &handler, &payload, key.as_deref(), next_at, &record)?;
                tx.commit()?;
                Ok(id)
            })
            .await?;
        id.ok_or(DurableError::NotAccepted)
    }

    /// The clock [`SqliteStore::insert`]'s callers read (this host's), without a task.
    pub(crate) fn wall_now(&self) -> u64 {
        wall_now()
    }

    /// [`SqliteStore::insert`] on a caller's connection, inside the transaction it has open,
    /// which it commits or rolls back: the same statements, nothing committed here. The
    /// caller checked the connection first ([`SqliteStore::check_caller`]).
    pub(crate) fn insert_in(
        &self,
        conn: &Connection,
        handler: &str,
        payload: &[u8],
        key: Option<&str>,
        next_at: u64,
        record: &[u8],
    ) -> Result<i64, DurableError> {
        insert_on(conn, &self.sql, handler, payload, key, next_at, record)?.ok_or(DurableError::NotAccepted)
    }

    /// A caller's connection can hold a call of this store: it is in a transaction, on this file.
    pub(crate) fn check_caller(&self, conn: &Connection) -> Result<(), DurableError> {
        if conn.is_autocommit() {
            return Err(DurableError::WrongTransaction(
                "the SQLite connection is not in a transaction (autocommit mode): the call would be committed at once; \
                 pass a rusqlite::Transaction (or a connection after BEGIN)"
                    .into(),
            ));
        }
        let on = conn.path().unwrap_or_default();
        if on.is_empty() {
            return Err(DurableError::WrongTransaction(format!(
                "the SQLite transaction is on an in-memory or temporary database, not on the store's file {}",
                self.path.display()
            )));
        }
        let canonical = std::fs::canonicalize(on).unwrap_or_else(|_| PathBuf::from(on));
        if canonical != *self.canonical {
            return Err(DurableError::WrongTransaction(format!(
                "the SQLite transaction is on {on}, not on the store's file {}",
                self.path.display()
            )));
        }
        Ok(())
    }

    pub(crate) async fn claim(&self, owner: &str, hold: u64, limit: usize) -> Result<Vec<Claimed>, DurableError> {
        let owner = owner.to_string();
        self.blocking(move |conn, sql| {
            let now = i64_of(wall_now());
            let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
            let out = {
                let mut st = tx.prepare_cached(stmt(sql, "claim"))?;
                let rows = st.query_map(params![owner, now.saturating_add(i64_of(hold)), now, i64_of(limit as u64)], |r| {
                    Ok(Claimed {
                        id: r.get(0)?,
                        handler: r.get(1)?,
                        payload: r.get(2)?,
                        record: r.get(3)?,
                        db_now: u64_of(r.get(4)?),
                        idempotency_key: r.get(5)?,
                    })
                })?;
                rows.collect::<Result<Vec<_>, _>>()?
            };
            tx.commit()?;
            Ok(out)
        })
        .await
    }

    pub(crate) async fn write(&self, id: i64, owner: &str, w: WriteArgs<'_>) -> Result<bool, DurableError> {
        let owner = owner.to_string();
        let (status, next_at, attempts) = (w.status, i64_of(w.next_at), i64::from(w.attempts));
        let lease_owner = w.lease_owner.map(str::to_string);
        let (record, result, error) = (w.record.to_vec(), w.result.map(<[u8]>::to_vec), w.error.map(str::to_string));
        self.blocking(move |conn, sql| {
            let n = conn.prepare_cached(stmt(sql, "write"))?.execute(params![
                status,
                next_at,
                attempts,
                lease_owner,
                record,
                result,
                error,
                i64_of(wall_now()),
                id,
                owner
            ])?;
            Ok(n == 1)
        })
        .await
    }

    pub(crate) async fn quarantine(&self, id: i64, msg: &str) -> Result<(), DurableError> {
        let msg = msg.to_string();
        self.blocking(move |conn, sql| {
            conn.prepare_cached(stmt(sql, "quarantine"))?.execute(params![msg, i64_of(wall_now()), id])?;
            Ok(())
        })
        .await
    }

    pub(crate) async fn replace(&self, id: i64, r: ReplaceArgs<'_>) -> Result<bool, DurableError> {
        let (status, next_at, attempts) = (r.status, r.next_at, r.attempts);
        let (record, msg, old) = (r.record.to_vec(), r.error.map(str::to_string), r.old.to_vec());
        self.blocking(move |conn, sql| {
            let n = conn.prepare_cached(stmt(sql, "replace"))?.execute(params![
                status,
                i64_of(next_at),
                i64::from(attempts),
                record,
                msg,
                i64_of(wall_now()),
                id,
                old
            ])?;
            Ok(n == 1)
        })
        .await
    }

    pub(crate) async fn get(&self, id: i64) -> Result<Option<Row>, DurableError> {
        self.blocking(move |conn, sql| conn.prepare_cached(stmt(sql, "get"))?.query_row(params![id], row_of).optional()).await
    }

    pub(crate) async fn rows(&self, dead_only: bool) -> Result<Vec<Row>, DurableError> {
        self.blocking(move |conn, sql| {
            let mut st = conn.prepare_cached(stmt(sql, if dead_only { "list_dead" } else { "list" }))?;
            let rows = st.query_map([], row_of)?;
            rows.collect()
        })
        .await
    }

    pub(crate) async fn next_due_in(&self) -> Result<Option<i64>, DurableError> {
        let next: Option<i64> =
            self.blocking(move |conn, sql| conn.prepare_cached(stmt(sql, "next_due"))?.query_row([], |r| r.get(0))).await?;
        Ok(next.map(|n| n.saturating_sub(i64_of(wall_now()))))
    }

    pub(crate) async fn counts(&self) -> Result<BTreeMap<String, i64>, DurableError> {
        self.blocking(move |conn, sql| {
            let mut st = conn.prepare_cached(stmt(sql, "counts"))?;
            let rows = st.query_map([], |r| Ok((r.get::<_, String>(0)?, r.get::<_, i64>(1)?)))?;
            rows.collect()
        })
        .await
    }
}

/// The shared `insert`, then, when it added nothing, `find_by_key`: the id of the new call, or of
/// the call that holds the idempotency key already (`None`: neither). On whatever transaction
/// `conn` has open: the store's own (`BEGIN IMMEDIATE`) or a caller's.
fn insert_on(
    conn: &Connection,
    sql: &BTreeMap<String, String>,
    handler: &str,
    payload: &[u8],
    key: Option<&str>,
    next_at: u64,
    record: &[u8],
) -> Result<Option<i64>, rusqlite::Error> {
    let mut id: Option<i64> = conn
        .prepare_cached(stmt(sql, "insert"))?
        .query_row(params![handler, payload, key, i64_of(next_at), record, i64_of(wall_now())], |r| r.get(0))
        .optional()?;
    if id.is_none() {
        if let Some(k) = key {
            id = conn.prepare_cached(stmt(sql, "find_by_key"))?.query_row(params![k], |r| r.get(0)).optional()?;
        }
    }
    Ok(id)
}

/// A statement by name (every name is present: [`dialect`] checked it when the store opened).
fn stmt<'a>(sql: &'a BTreeMap<String, String>, name: &str) -> &'a str {
    sql.get(name).map(String::as_str).unwrap_or_default()
}
