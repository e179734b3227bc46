//! The PostgreSQL store (feature `durable-postgres`): processes on several machines share one
//! database. The database's clock is the one clock (every statement reads it itself, and claims
//! return it); claims skip the rows other workers hold (`FOR UPDATE SKIP LOCKED`), so workers
//! never wait on one another. tokio-postgres, a few connections used in turn, every shared
//! statement prepared once per connection; a connection that broke is opened again on next use.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use tokio_postgres::types::ToSql;
use tokio_postgres::{Client, Config, GenericClient, NoTls, Statement, ToStatement, Transaction};

use super::store::{dialect, i64_of, u64_of, Claimed, ReplaceArgs, Row, WriteArgs, NAMES, POSTGRES_SQL};
use super::DurableError;

/// The advisory lock every host's store takes around the schema's creation.
const SCHEMA_LOCK: i64 = 7_467_001;

/// A store in PostgreSQL. Cheap to clone: clones share the connections.
#[derive(Clone)]
pub struct PostgresStore {
    inner: Arc<Inner>,
}

struct Inner {
    config: Config,
    sql: BTreeMap<String, String>,
    slots: Vec<tokio::sync::Mutex<Option<Arc<Conn>>>>,
    next: AtomicUsize,
}

struct Conn {
    client: Client,
    stmts: HashMap<&'static str, Statement>,
}

impl std::fmt::Debug for PostgresStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PostgresStore")
            .field("hosts", &self.inner.config.get_hosts())
            .field("dbname", &self.inner.config.get_dbname())
            .field("connections", &self.inner.slots.len())
            .finish_non_exhaustive()
    }
}

impl From<tokio_postgres::Error> for DurableError {
    fn from(e: tokio_postgres::Error) -> DurableError {
        DurableError::Store(Box::new(e))
    }
}

fn row_of(r: &tokio_postgres::Row) -> Result<Row, tokio_postgres::Error> {
    Ok(Row {
        id: r.try_get(0)?,
        handler: r.try_get(1)?,
        status: r.try_get(2)?,
        next_at: r.try_get(3)?,
        attempts: i64::from(r.try_get::<_, i32>(4)?),
        lease_owner: r.try_get(5)?,
        record: r.try_get(6)?,
        result: r.try_get(7)?,
        error: r.try_get(8)?,
        idempotency_key: r.try_get(9)?,
    })
}

impl PostgresStore {
    /// Connect to the database `conninfo` names (a libpq keyword/value string,
    /// `host=127.0.0.1 dbname=app user=app`, or a `postgres://` URL) without TLS, with up to 4
    /// connections, and create the table when it is missing.
    pub async fn connect(conninfo: &str) -> Result<PostgresStore, DurableError> {
        let config: Config = conninfo.parse()?;
        PostgresStore::with_config(config, 4).await
    }

    /// [`PostgresStore::connect`] from a parsed [`Config`] with `connections` connections (at
    /// least 1; each pipelines the statements the executor's tasks send at once).
    pub async fn with_config(config: Config, connections: usize) -> Result<PostgresStore, DurableError> {
        let sql = dialect(POSTGRES_SQL, "postgres")?;
        let slots = (0..connections.max(1)).map(|_| tokio::sync::Mutex::new(None)).collect();
        // The table first, on a connection of its own (the statements are prepared against it),
        // one process at a time (the advisory lock every host's store takes); the simple
        // protocol runs the two statements of `schema`.
        let client = connect(&config).await?;
        client.execute("SELECT pg_advisory_lock($1)", &[&SCHEMA_LOCK]).await?;
        let created = client.batch_execute(sql.get("schema").map(String::as_str).unwrap_or_default()).await;
        let unlocked = client.execute("SELECT pg_advisory_unlock($1)", &[&SCHEMA_LOCK]).await;
        created.map_err(|e| DurableError::Store(format!("creating the table: {e}").into()))?;
        unlocked?;
        let store = PostgresStore { inner: Arc::new(Inner { config, sql, slots, next: AtomicUsize::new(0) }) };
        store.conn().await?; // a first connection now: a bad address fails here, not in `run`
        Ok(store)
    }

    /// A live connection, in turn (one that broke is opened again).
    async fn conn(&self) -> Result<Arc<Conn>, DurableError> {
        let n = self.inner.slots.len().max(1);
        let i = self.inner.next.fetch_add(1, Ordering::Relaxed) % n;
        let Some(slot) = self.inner.slots.get(i) else { return Err(DurableError::Store("no connection slot".into())) };
        let mut slot = slot.lock().await;
        if let Some(c) = slot.as_ref() {
            if !c.client.is_closed() {
                return Ok(c.clone());
            }
        }
        let client = connect(&self.inner.config).await?;
        let mut stmts = HashMap::new();
        for name in NAMES.into_iter().chain(["clock"]).filter(|n| *n != "schema") {
            let text = self.inner.sql.get(name).ok_or_else(|| DurableError::Store(format!("no statement `{name}`").into()))?;
            stmts.insert(name, client.prepare(text).await?);
        }
        let c = Arc::new(Conn { client, stmts });
        *slot = Some(c.clone());
        Ok(c)
    }

    pub(crate) async fn now(&self) -> Result<u64, DurableError> {
        let c = self.conn().await?;
        let n: i64 = c.client.query_one(c.stmt("clock")?, &[]).await?.try_get(0)?;
        Ok(u64_of(n))
    }

    pub(crate) async fn insert(
        &self,
        handler: &str,
        payload: Vec<u8>,
        key: Option<&str>,
        next_at: u64,
        record: Vec<u8>,
    ) -> Result<i64, DurableError> {
        let c = self.conn().await?;
        insert_on(&c.client, c.stmt("insert")?, c.stmt("find_by_key")?, handler, &payload, key, next_at, &record).await
    }

    /// [`PostgresStore::now`] on a caller's transaction: the same `clock` statement, the same
    /// database's clock.
    pub(crate) async fn now_in(&self, tx: &Transaction<'_>) -> Result<u64, DurableError> {
        let n: i64 = tx.query_one(self.text("clock")?, &[]).await?.try_get(0)?;
        Ok(u64_of(n))
    }

    /// [`PostgresStore::insert`] inside a caller's transaction, which it commits or rolls back:
    /// the same statements (sent as text: they are prepared on the caller's connection),
    /// nothing committed here.
    pub(crate) async fn insert_in(
        &self,
        tx: &Transaction<'_>,
        handler: &str,
        payload: &[u8],
        key: Option<&str>,
        next_at: u64,
        record: &[u8],
    ) -> Result<i64, DurableError> {
        insert_on(tx, self.text("insert")?, self.text("find_by_key")?, handler, payload, key, next_at, record).await
    }

    /// A shared statement's text.
    fn text(&self, name: &str) -> Result<&str, DurableError> {
        self.inner.sql.get(name).map(String::as_str).ok_or_else(|| DurableError::Store(format!("no statement `{name}`").into()))
    }

    pub(crate) async fn claim(&self, owner: &str, hold: u64, limit: usize) -> Result<Vec<Claimed>, DurableError> {
        let c = self.conn().await?;
        let rows = c.client.query(c.stmt("claim")?, &[&owner, &i64_of(hold), &i64_of(limit as u64)]).await?;
        rows.iter()
            .map(|r| {
                Ok(Claimed {
                    id: r.try_get(0)?,
                    handler: r.try_get(1)?,
                    payload: r.try_get(2)?,
                    record: r.try_get(3)?,
                    db_now: u64_of(r.try_get(4)?),
                    idempotency_key: r.try_get(5)?,
                })
            })
            .collect()
    }

    pub(crate) async fn write(&self, id: i64, owner: &str, w: WriteArgs<'_>) -> Result<bool, DurableError> {
        let c = self.conn().await?;
        let attempts = i32::try_from(w.attempts).unwrap_or(i32::MAX);
        let args: [&(dyn ToSql + Sync); 9] =
            [&w.status, &i64_of(w.next_at), &attempts, &w.lease_owner, &w.record, &w.result, &w.error, &id, &owner];
        Ok(c.client.execute(c.stmt("write")?, &args).await? == 1)
    }

    pub(crate) async fn quarantine(&self, id: i64, msg: &str) -> Result<(), DurableError> {
        let c = self.conn().await?;
        c.client.execute(c.stmt("quarantine")?, &[&msg, &id]).await?;
        Ok(())
    }

    pub(crate) async fn replace(&self, id: i64, r: ReplaceArgs<'_>) -> Result<bool, DurableError> {
        let c = self.conn().await?;
        let attempts = i32::try_from(r.attempts).unwrap_or(i32::MAX);
        let args: [&(dyn ToSql + Sync); 7] = [&r.status, &i64_of(r.next_at), &attempts, &r.record, &r.error, &id, &r.old];
        Ok(c.client.execute(c.stmt("replace")?, &args).await? == 1)
    }

    pub(crate) async fn get(&self, id: i64) -> Result<Option<Row>, DurableError> {
        let c = self.conn().await?;
        match c.client.query_opt(c.stmt("get")?, &[&id]).await? {
            Some(r) => Ok(Some(row_of(&r)?)),
            None => Ok(None),
        }
    }

    pub(crate) async fn rows(&self, dead_only: bool) -> Result<Vec<Row>, DurableError> {
        let c = self.conn().await?;
        let rows = c.client.query(c.stmt(if dead_only { "list_dead" } else { "list" })?, &[]).await?;
        Ok(rows.iter().map(row_of).collect::<Result<_, _>>()?)
    }

    pub(crate) async fn next_due_in(&self) -> Result<Option<i64>, DurableError> {
        let c = self.conn().await?;
        Ok(c.client.query_one(c.stmt("next_due")?, &[]).await?.try_get(0)?)
    }

    pub(crate) async fn counts(&self) -> Result<BTreeMap<String, i64>, DurableError> {
        let c = self.conn().await?;
        let rows = c.client.query(c.stmt("counts")?, &[]).await?;
        Ok(rows.iter().map(|r| Ok((r.try_get(0)?, r.try_get(1)?))).collect::<Result<_, tokio_postgres::Error>>()?)
    }
}

/// The shared `insert`, then, when it added nothing, `find_by_key`: the id of the new call, or of
/// the call that holds the idempotency key already. On the store's own connection or in a
/// caller's transaction (the same key twice in one transaction: the second finds the first).
#[allow(clippy::too_many_arguments)]
async fn insert_on<C: GenericClient, S: ToStatement + ?Sized + Sync + Send>(
    c: &C,
    insert: &S,
    find_by_key: &S,
    handler: &str,
    payload: &[u8],
    key: Option<&str>,
    next_at: u64,
    record: &[u8],
) -> Result<i64, DurableError> {
    let args: [&(dyn ToSql + Sync); 5] = [&handler, &payload, &key, &i64_of(next_at), &record];
    if let Some(r) = c.query_opt(insert, &args).await? {
        return Ok(r.try_get(0)?);
    }
    // Another submission holds the key: ON CONFLICT waited for it to commit, so this
    // statement (a new snapshot under READ COMMITTED) sees its row. (Under REPEATABLE READ or
    // SERIALIZABLE, a caller's transaction that conflicts with a submission committed after
    // its snapshot fails with a serialization error instead: the transaction is to be retried.)
    if let Some(k) = key {
        if let Some(r) = c.query_opt(find_by_key, &[&k]).await? {
            return Ok(r.try_get(0)?);
        }
    }
    Err(DurableError::NotAccepted)
}

/// A connection, its I/O driven by a task of its own.
async fn connect(config: &Config) -> Result<Client, DurableError> {
    let (client, connection) = config.connect(NoTls).await?;
    tokio::spawn(async move {
        if let Err(e) = connection.await {
            tracing::warn!(target: "levee", error = %e, "levee durable: a PostgreSQL connection ended");
        }
    });
    Ok(client)
}

impl Conn {
    fn stmt(&self, name: &str) -> Result<&Statement, DurableError> {
        self.stmts.get(name).ok_or_else(|| DurableError::Store(format!("no prepared statement `{name}`").into()))
    }
}
