//! The stores of durable calls: one SQLite file ([`SqliteStore`], feature `durable-sqlite`) or a
//! PostgreSQL database ([`PostgresStore`], feature `durable-postgres`). Both execute the shared
//! statements of the repository's `durable/sqlite.sql` and `durable/postgres.sql` as written
//! (this crate carries byte-identical copies in `src/durable_executor/sql/`, checked by its
//! tests, so that the packaged crate builds on its own); the rows and the record bytes are the
//! same whichever host wrote them.

use std::collections::BTreeMap;
use std::fmt;

#[cfg(feature = "durable-postgres")]
pub use super::postgres::PostgresStore;
#[cfg(feature = "durable-sqlite")]
pub use super::sqlite::SqliteStore;
use super::DurableError;

/// The shared SQLite statements (`durable/sqlite.sql`, byte for byte).
pub const SQLITE_SQL: &str = include_str!("sql/sqlite.sql");
/// The shared PostgreSQL statements (`durable/postgres.sql`, byte for byte).
pub const POSTGRES_SQL: &str = include_str!("sql/postgres.sql");

/// The statement names every dialect has.
pub(crate) const NAMES: [&str; 12] =
    ["schema", "insert", "find_by_key", "claim", "write", "quarantine", "get", "replace", "list", "list_dead", "next_due", "counts"];

/// The statements of a dialect's file by name, as every host reads them: a statement starts at
/// its `-- name:` line and ends at the next one (the comment lines under the name are kept: they
/// are SQL comments).
pub fn statements(text: &str) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    let mut blocks = text.split("\n-- name: ");
    // What precedes the first name is the file's header (a file that starts with a name has
    // none: the split leaves its `-- name: ` prefix on the first block).
    let first = blocks.next().unwrap_or_default();
    let mut rest: Vec<&str> = blocks.collect();
    if let Some(stripped) = first.strip_prefix("-- name: ") {
        rest.insert(0, stripped);
    }
    for block in rest {
        let (name, body) = block.split_once('\n').unwrap_or((block, ""));
        out.insert(name.trim().to_string(), body.trim().to_string());
    }
    out
}

/// The statements of a dialect, every name present (an error names the missing one).
pub(crate) fn dialect(text: &str, which: &str) -> Result<BTreeMap<String, String>, DurableError> {
    let stmts = statements(text);
    match NAMES.iter().find(|n| !stmts.contains_key(**n)) {
        Some(missing) => Err(DurableError::Store(format!("the {which} statements have no `{missing}`").into())),
        None => Ok(stmts),
    }
}

/// Where a call is, as the store's `status` column says.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CallState {
    /// Waiting until it is due.
    Scheduled,
    /// An attempt started and its outcome is not recorded yet.
    Running,
    /// Succeeded.
    Done,
    /// Given up: the error says why.
    Dead,
    /// Cancelled by an operator.
    Cancelled,
    /// A record the core could not use (corrupt, another version, a policy a reload removed,
    /// a handler no process registered): the error names it.
    Quarantined,
}

impl CallState {
    /// The column's text.
    pub fn as_str(self) -> &'static str {
        match self {
            CallState::Scheduled => "scheduled",
            CallState::Running => "running",
            CallState::Done => "done",
            CallState::Dead => "dead",
            CallState::Cancelled => "cancelled",
            CallState::Quarantined => "quarantined",
        }
    }

    /// The state a column's text names.
    pub fn parse(s: &str) -> Option<CallState> {
        [CallState::Scheduled, CallState::Running, CallState::Done, CallState::Dead, CallState::Cancelled, CallState::Quarantined]
            .into_iter()
            .find(|c| c.as_str() == s)
    }

    /// Whether the call has ended (done, dead, cancelled or quarantined).
    pub fn is_finished(self) -> bool {
        !matches!(self, CallState::Scheduled | CallState::Running)
    }
}

impl fmt::Display for CallState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A row of the shared `claim` statement (the same columns in both dialects).
#[derive(Clone, Debug)]
pub(crate) struct Claimed {
    pub(crate) id: i64,
    pub(crate) handler: String,
    pub(crate) payload: Vec<u8>,
    pub(crate) record: Vec<u8>,
    pub(crate) db_now: u64,
    pub(crate) idempotency_key: Option<String>,
}

/// The columns of the shared `write` statement.
#[derive(Clone, Debug)]
pub(crate) struct WriteArgs<'a> {
    /// The status column, as the core's machine names it.
    pub(crate) status: &'static str,
    pub(crate) next_at: u64,
    pub(crate) attempts: u32,
    pub(crate) lease_owner: Option<&'a str>,
    pub(crate) record: &'a [u8],
    pub(crate) result: Option<&'a [u8]>,
    pub(crate) error: Option<&'a str>,
}

/// The columns of the shared `replace` statement: an operator's change of a call (cancel,
/// revive), made only if the record is still `old` (compare-and-set).
#[derive(Clone, Debug)]
pub(crate) struct ReplaceArgs<'a> {
    /// The status column, as the core names it.
    pub(crate) status: &'static str,
    pub(crate) next_at: u64,
    pub(crate) attempts: u32,
    pub(crate) record: &'a [u8],
    pub(crate) error: Option<&'a str>,
    pub(crate) old: &'a [u8],
}

/// A row of the shared `get`, `list` and `list_dead` statements.
#[derive(Clone, Debug)]
pub(crate) struct Row {
    pub(crate) id: i64,
    pub(crate) handler: String,
    pub(crate) status: String,
    pub(crate) next_at: i64,
    pub(crate) attempts: i64,
    pub(crate) lease_owner: Option<String>,
    pub(crate) record: Vec<u8>,
    pub(crate) result: Option<Vec<u8>>,
    pub(crate) error: Option<String>,
    pub(crate) idempotency_key: Option<String>,
}

/// A wall time or count for a BIGINT column (they are far below 2^63).
pub(crate) fn i64_of(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

/// A BIGINT column's wall time as the core's u64 (a negative one is 0).
pub(crate) fn u64_of(v: i64) -> u64 {
    u64::try_from(v).unwrap_or(0)
}

/// Where durable calls live: an SQLite file or a PostgreSQL database. Build one from
/// [`SqliteStore::open`] or [`PostgresStore::connect`] (`.into()`).
#[derive(Clone, Debug)]
pub struct Store(pub(crate) Backend);

#[derive(Clone, Debug)]
pub(crate) enum Backend {
    #[cfg(feature = "durable-sqlite")]
    Sqlite(SqliteStore),
    #[cfg(feature = "durable-postgres")]
    Postgres(PostgresStore),
}

#[cfg(feature = "durable-sqlite")]
impl From<SqliteStore> for Store {
    fn from(s: SqliteStore) -> Store {
        Store(Backend::Sqlite(s))
    }
}

#[cfg(feature = "durable-postgres")]
impl From<PostgresStore> for Store {
    fn from(s: PostgresStore) -> Store {
        Store(Backend::Postgres(s))
    }
}

/// The same call on whichever backend the store is.
macro_rules! each {
    ($self:expr, $s:ident => $e:expr) => {
        match &$self.0 {
            #[cfg(feature = "durable-sqlite")]
            Backend::Sqlite($s) => $e,
            #[cfg(feature = "durable-postgres")]
            Backend::Postgres($s) => $e,
        }
    };
}

impl Store {
    /// `sqlite` or `postgres`.
    pub fn dialect(&self) -> &'static str {
        match self.0 {
            #[cfg(feature = "durable-sqlite")]
            Backend::Sqlite(_) => "sqlite",
            #[cfg(feature = "durable-postgres")]
            Backend::Postgres(_) => "postgres",
        }
    }

    /// The store's wall clock, ns since the Unix epoch (the database's for PostgreSQL).
    pub async fn now(&self) -> Result<u64, DurableError> {
        each!(self, s => s.now().await)
    }

    pub(crate) async fn insert(
        &self,
        handler: &str,
        payload: Vec<u8>,
        key: Option<&str>,
        next_at: u64,
        record: Vec<u8>,
    ) -> Result<i64, DurableError> {
        each!(self, s => s.insert(handler, payload, key, next_at, record).await)
    }

    pub(crate) async fn claim(&self, owner: &str, hold: u64, limit: usize) -> Result<Vec<Claimed>, DurableError> {
        each!(self, s => s.claim(owner, hold, limit).await)
    }

    pub(crate) async fn write(&self, id: i64, owner: &str, w: WriteArgs<'_>) -> Result<bool, DurableError> {
        each!(self, s => s.write(id, owner, w).await)
    }

    pub(crate) async fn quarantine(&self, id: i64, msg: &str) -> Result<(), DurableError> {
        each!(self, s => s.quarantine(id, msg).await)
    }

    pub(crate) async fn replace(&self, id: i64, r: ReplaceArgs<'_>) -> Result<bool, DurableError> {
        each!(self, s => s.replace(id, r).await)
    }

    pub(crate) async fn get(&self, id: i64) -> Result<Option<Row>, DurableError> {
        each!(self, s => s.get(id).await)
    }

    pub(crate) async fn rows(&self, dead_only: bool) -> Result<Vec<Row>, DurableError> {
        each!(self, s => s.rows(dead_only).await)
    }

    /// How long until the next call is due, ns (negative: one is due now); `None` when no call
    /// is pending.
    pub(crate) async fn next_due_in(&self) -> Result<Option<i64>, DurableError> {
        each!(self, s => s.next_due_in().await)
    }

    /// How many calls the store holds in each status.
    pub async fn counts(&self) -> Result<BTreeMap<String, i64>, DurableError> {
        each!(self, s => s.counts().await)
    }
}
