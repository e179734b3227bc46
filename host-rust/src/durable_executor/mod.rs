//! Durable calls (features `durable-sqlite`, `durable-postgres`): retries that survive a
//! process restart (docs/durable.md).
//!
//! ```no_run
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! use levee::durable::{Executor, SqliteStore};
//!
//! let levee = levee::Levee::from_str("policies:\n  email:\n    attempts: 5\n    attempt-timeout: 10s\n")?;
//! let executor = Executor::new(levee, SqliteStore::open("calls.db").await?);
//! executor.handler("send-invoice").policy("email").not_idempotent().register(|payload, call| async move {
//!     // send `payload`, giving the mail API `call.idempotency_key`
//!     Ok::<_, std::io::Error>(())
//! })?;
//! let id = executor.submit("send-invoice", b"{\"order\": 17}".to_vec(), Some("invoice-17")).await?;
//! // Resumes what is due at start-up, then sleeps until the next call is due, until the
//! // shutdown future resolves (here: never).
//! executor.run(std::future::pending()).await;
//! # let _ = id; Ok(()) }
//! ```
//!
//! The executor is a driver of the core's executor machine ([`RawExecutor`], the WIT's
//! `executor` resource; docs/durable.md, "The executor"): it feeds the machine what happened
//! (a poll, the rows a claim returned, each write's fate, a renewal's tick, a handler's end)
//! and carries out the commands it answers (claim, write, run a handler under its timeout,
//! abandon it, quarantine, sleep). The core decides when a call is due, what a record found
//! after a crash means, whether to retry and how long to wait, when to renew a lease and when
//! to give a call up; the executor persists the rows the core gives before each attempt and
//! after each outcome, through the shared statements of `durable/sqlite.sql` and
//! `durable/postgres.sql`.
//! The record bytes and the rows are the same in every host: a call a Python, Go or JS process
//! wrote is resumed by a Rust process, and the other way round.
//!
//! Every write is fenced by the row's holder (`lease_owner`): a process that lost a call (its
//! lease lapsed and another process took it, or an operator cancelled it) has its writes
//! refused, so it never records an outcome for a call it no longer holds. A record the core
//! refuses (corrupt, another version, a policy no longer loaded) is quarantined with the core's
//! error, which names it; so is a call whose handler this process did not register.

#[cfg(feature = "durable-postgres")]
mod postgres;
#[cfg(feature = "durable-sqlite")]
mod sqlite;
mod store;

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::fmt;
use std::future::Future;
use std::hash::{BuildHasher, Hasher};
use std::pin::Pin;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use levee_core::durable::{DurableStep, Record};
use levee_core::durable_exec as dx;
use levee_core::LoadError;
use tokio::task::{AbortHandle, JoinSet};
use tokio::time::Instant;

use crate::outcome::{IntoOutcome, Outcome};
use crate::raw::{RawEngine, RawExecutor, Trap};
use crate::Levee;

#[cfg(feature = "durable-postgres")]
pub use store::PostgresStore;
#[cfg(feature = "durable-sqlite")]
pub use store::SqliteStore;
pub use store::{statements, CallState, Store, POSTGRES_SQL, SQLITE_SQL};
use store::{Backend, Claimed, ReplaceArgs, Row, WriteArgs};

/// What went wrong in a durable operation.
#[derive(Debug)]
#[non_exhaustive]
pub enum DurableError {
    /// The store failed (its driver's error).
    Store(Box<dyn std::error::Error + Send + Sync>),
    /// The store accepted no row for a submission (and found none with its idempotency key).
    NotAccepted,
    /// No handler of that name is registered in this executor.
    UnknownHandler(String),
    /// The policy is not in the loaded document.
    UnknownPolicy(crate::UnknownPolicy),
    /// The core refused the operation; the error names the field and the reason.
    Core(LoadError),
    /// The engine faulted (see [`crate::raw`]); it restored itself.
    Engine(Trap),
    /// The key is longer than the bound (docs/policy.md, "Keys"): refused before the core and
    /// the store, as every entry that takes a key.
    KeyTooLong(crate::KeyTooLong),
    /// A caller's transaction given to a `submit_*_in_*` method cannot hold a call of this
    /// executor: it is of the other store's kind (a PostgreSQL transaction for an SQLite store,
    /// or the other way round), or an SQLite connection not in a transaction or on another file.
    /// The text names what was given and what the store is; nothing was written.
    WrongTransaction(String),
}

impl fmt::Display for DurableError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DurableError::Store(e) => write!(f, "levee durable: the store: {e}"),
            DurableError::NotAccepted => f.write_str("levee durable: the store did not accept the call"),
            DurableError::UnknownHandler(h) => write!(f, "levee durable: no durable handler named `{h}` is registered"),
            DurableError::UnknownPolicy(p) => write!(f, "levee durable: {p}"),
            DurableError::Core(e) => write!(f, "levee durable: {e}"),
            DurableError::Engine(t) => write!(f, "levee durable: {t}"),
            DurableError::KeyTooLong(k) => write!(f, "levee durable: {k}"),
            DurableError::WrongTransaction(w) => write!(f, "levee durable: the caller's transaction: {w}"),
        }
    }
}

impl std::error::Error for DurableError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            DurableError::Store(e) => Some(&**e),
            DurableError::KeyTooLong(k) => Some(k),
            _ => None,
        }
    }
}

/// What a handler knows of the attempt it runs.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct DurableCall {
    /// The call's id in the store.
    pub id: i64,
    /// The attempt, counting the first.
    pub attempt: u32,
    /// The call's idempotency key: use it to make a second run of an attempt whose outcome was
    /// lost harmless.
    pub idempotency_key: Option<String>,
    /// The attempt's timeout (the core's, already bounded by the call's deadline); the executor
    /// drops the handler's future when it fires.
    pub timeout: Option<Duration>,
}

/// What a handler's success returns: stored in the `result` column (`()` stores nothing).
pub trait IntoResultBytes {
    /// The bytes to store, `None` for none.
    fn into_result_bytes(self) -> Option<Vec<u8>>;
}

impl IntoResultBytes for () {
    fn into_result_bytes(self) -> Option<Vec<u8>> {
        None
    }
}

impl IntoResultBytes for Vec<u8> {
    fn into_result_bytes(self) -> Option<Vec<u8>> {
        Some(self)
    }
}

impl IntoResultBytes for Option<Vec<u8>> {
    fn into_result_bytes(self) -> Option<Vec<u8>> {
        self
    }
}

impl IntoResultBytes for String {
    fn into_result_bytes(self) -> Option<Vec<u8>> {
        Some(self.into_bytes())
    }
}

impl IntoResultBytes for &'static str {
    fn into_result_bytes(self) -> Option<Vec<u8>> {
        Some(self.as_bytes().to_vec())
    }
}

/// A status of a call: what the store holds for it.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct CallStatus {
    /// The call's id.
    pub id: i64,
    /// The handler's name.
    pub handler: String,
    /// Where the call is.
    pub state: CallState,
    /// When it is next due, wall ns since the Unix epoch (0 once finished).
    pub next_at: i64,
    /// Attempts started.
    pub attempts: i64,
    /// The process holding it.
    pub lease_owner: Option<String>,
    /// Its idempotency key.
    pub idempotency_key: Option<String>,
    /// For a dead call the reason and the last error; for a quarantined one the core's error.
    pub error: Option<String>,
    /// What the handler returned, once done.
    pub result: Option<Vec<u8>>,
    /// The core's record, decoded by the core; `None` for one it cannot read (`error` says why).
    pub record: Option<Record>,
}

/// The result of an attempt as the executor sees it: the bytes to store, or the outcome the
/// error stands for and its message.
type Attempted = Result<Option<Vec<u8>>, (Outcome, String)>;
type BoxedFuture = Pin<Box<dyn Future<Output = Attempted> + Send>>;
type HandlerFn = Arc<dyn Fn(Vec<u8>, DurableCall) -> BoxedFuture + Send + Sync>;
type AttemptDoneFn = Arc<dyn Fn(i64, u32, &Outcome) + Send + Sync>;

#[derive(Clone)]
struct Registered {
    f: HandlerFn,
    policy: String,
    idempotent: bool,
}

/// Builds an [`Executor`].
pub struct ExecutorBuilder {
    levee: Levee,
    store: Store,
    owner: Option<String>,
    /// What the user configured; the core's default otherwise.
    concurrency: Option<usize>,
    poll: Option<Duration>,
    hold: Option<Duration>,
    on_attempt_done: Option<AttemptDoneFn>,
}

impl ExecutorBuilder {
    /// The name this process holds leases under; it must be unique per process (default: the
    /// host name, the pid and a random suffix).
    pub fn owner(mut self, owner: impl Into<String>) -> Self {
        self.owner = Some(owner.into());
        self
    }

    /// The calls this process runs at once (default 16).
    pub fn concurrency(mut self, n: usize) -> Self {
        self.concurrency = Some(n.max(1));
        self
    }

    /// The longest the executor sleeps before it looks at the store again (default 1 s): calls
    /// other processes submit are seen within it.
    pub fn poll_interval(mut self, d: Duration) -> Self {
        self.poll = Some(d);
        self
    }

    /// How long a claim keeps calls out of other processes' due window until the core's answer
    /// is written, milliseconds later (default 5 s): a process that dies right after claiming
    /// delays its claimed calls by that much.
    pub fn claim_hold(mut self, d: Duration) -> Self {
        self.hold = Some(d);
        self
    }

    /// Call `f(call id, attempt, outcome)` after an attempt's outcome is known and before it is
    /// persisted (for metrics; the crash tests kill the process there).
    pub fn on_attempt_done(mut self, f: impl Fn(i64, u32, &Outcome) + Send + Sync + 'static) -> Self {
        self.on_attempt_done = Some(Arc::new(f));
        self
    }

    /// The executor.
    pub fn build(self) -> Executor {
        Executor {
            inner: Arc::new(Inner {
                levee: self.levee,
                store: self.store,
                owner: self.owner.unwrap_or_else(default_owner),
                concurrency: self.concurrency,
                poll: self.poll,
                hold: self.hold,
                on_attempt_done: self.on_attempt_done,
                handlers: RwLock::new(HashMap::new()),
                wake: tokio::sync::Notify::new(),
            }),
        }
    }
}

/// The host name, the pid and a random suffix.
fn default_owner() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .or_else(|| std::env::var("HOSTNAME").ok())
        .map(|h| h.trim().to_string())
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "localhost".to_string());
    // `RandomState` keys come from the OS random source.
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u32(std::process::id());
    format!("{host}:{}:{:08x}", std::process::id(), h.finish() as u32)
}

/// Registers a handler ([`Executor::handler`]).
#[must_use = "a handler is registered by `register`"]
pub struct HandlerBuilder<'a> {
    executor: &'a Executor,
    name: String,
    policy: Option<String>,
    idempotent: bool,
}

impl HandlerBuilder<'_> {
    /// Run the handler under the named policy (default: the handler's name).
    pub fn policy(mut self, policy: impl Into<String>) -> Self {
        self.policy = Some(policy.into());
        self
    }

    /// The operation is not idempotent: a call of it without an idempotency key is not retried
    /// after a failure, nor after a crash (its outcome is unknown).
    pub fn not_idempotent(mut self) -> Self {
        self.idempotent = false;
        self
    }

    /// Register `f`: `f(payload, call)` runs one attempt. An `Err` is described by
    /// [`IntoOutcome`] (an `std::io::Error` of kind `ConnectionReset` is a connection error, an
    /// [`Outcome`] says it directly) and its text is the record's last error; the policy decides
    /// what follows. The future is dropped when the attempt's timeout fires, when this process
    /// loses the call, and when the executor stops. A handler that panics is an error of class
    /// `panic`. The policy must exist now.
    pub fn register<F, Fut, T, E>(self, f: F) -> Result<(), DurableError>
    where
        F: Fn(Vec<u8>, DurableCall) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<T, E>> + Send + 'static,
        T: IntoResultBytes,
        E: IntoOutcome + fmt::Display,
    {
        let policy = self.policy.unwrap_or_else(|| self.name.clone());
        if self.executor.inner.levee.policy_info(&policy).is_none() {
            return Err(DurableError::UnknownPolicy(crate::UnknownPolicy::new(&policy, self.executor.inner.levee.policy_names())));
        }
        let f: HandlerFn = Arc::new(move |payload, call| -> BoxedFuture {
            let fut = f(payload, call);
            Box::pin(async move {
                match fut.await {
                    Ok(v) => Ok(v.into_result_bytes()),
                    Err(e) => Err((e.outcome(), e.to_string())), // the core cuts the message
                }
            })
        });
        let reg = Registered { f, policy, idempotent: self.idempotent };
        self.executor.inner.handlers.write().unwrap_or_else(|p| p.into_inner()).insert(self.name, reg);
        Ok(())
    }
}

/// Runs durable calls from a store: at most one process at a time per call, under a lease.
/// Cheap to clone (clones share everything); every method takes `&self`.
#[derive(Clone)]
pub struct Executor {
    inner: Arc<Inner>,
}

struct Inner {
    levee: Levee,
    store: Store,
    owner: String,
    /// What the user configured; the core's default otherwise.
    concurrency: Option<usize>,
    poll: Option<Duration>,
    hold: Option<Duration>,
    on_attempt_done: Option<AttemptDoneFn>,
    handlers: RwLock<HashMap<String, Registered>>,
    wake: tokio::sync::Notify,
}

impl Inner {
    fn registered(&self, name: &str) -> Option<Registered> {
        self.handlers.read().unwrap_or_else(|p| p.into_inner()).get(name).cloned()
    }

    fn handler_names(&self) -> Vec<String> {
        self.handlers.read().unwrap_or_else(|p| p.into_inner()).keys().cloned().collect()
    }
}

impl fmt::Debug for Executor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Executor")
            .field("store", &self.inner.store.dialect())
            .field("owner", &self.inner.owner)
            .field("concurrency", &self.inner.concurrency)
            .finish_non_exhaustive()
    }
}

fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

impl Executor {
    /// An executor of the handle's policies on the store, with the defaults.
    pub fn new(levee: Levee, store: impl Into<Store>) -> Executor {
        Executor::builder(levee, store).build()
    }

    /// A builder (owner, concurrency, poll interval, claim hold, attempt hook).
    pub fn builder(levee: Levee, store: impl Into<Store>) -> ExecutorBuilder {
        ExecutorBuilder { levee, store: store.into(), owner: None, concurrency: None, poll: None, hold: None, on_attempt_done: None }
    }

    /// The name this process holds leases under.
    pub fn owner(&self) -> &str {
        &self.inner.owner
    }

    /// The store.
    pub fn store(&self) -> &Store {
        &self.inner.store
    }

    /// Start registering a handler named `name` (see [`HandlerBuilder::register`]).
    pub fn handler(&self, name: impl Into<String>) -> HandlerBuilder<'_> {
        HandlerBuilder { executor: self, name: name.into(), policy: None, idempotent: true }
    }

    /// Register an idempotent handler under the policy of its name.
    pub fn register<F, Fut, T, E>(&self, name: impl Into<String>, f: F) -> Result<(), DurableError>
    where
        F: Fn(Vec<u8>, DurableCall) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<T, E>> + Send + 'static,
        T: IntoResultBytes,
        E: IntoOutcome + fmt::Display,
    {
        self.handler(name).register(f)
    }

    fn registered(&self, name: &str) -> Option<Registered> {
        self.inner.registered(name)
    }

    /// Ask the core.
    fn core<T>(&self, f: impl FnOnce(&mut RawEngine) -> Result<Result<T, LoadError>, Trap>) -> Result<Result<T, LoadError>, Trap> {
        self.inner.levee.with_raw(f)
    }

    /// Persist a new call of `handler` and return its id. A second submission with the same
    /// idempotency key returns the first call's id and adds nothing (`None` or `""`: no key).
    /// To submit in a transaction of your own (the call is kept exactly when your transaction
    /// commits), see `submit_in_sqlite` and `submit_in_postgres` (features `durable-sqlite`,
    /// `durable-postgres`).
    pub async fn submit(&self, handler: &str, payload: impl Into<Vec<u8>>, idempotency_key: Option<&str>) -> Result<i64, DurableError> {
        self.submit_keyed(handler, payload, idempotency_key, "").await
    }

    /// [`Executor::submit`] with the policy's key (the key of its per-key state, as for a call).
    pub async fn submit_keyed(
        &self,
        handler: &str,
        payload: impl Into<Vec<u8>>,
        idempotency_key: Option<&str>,
        key: &str,
    ) -> Result<i64, DurableError> {
        let (reg, idem) = self.accept(handler, idempotency_key, key)?;
        let now = self.inner.store.now().await?;
        let step = self.begin(&reg, key, idem, now)?;
        let id = self.inner.store.insert(handler, payload.into(), idem, step.next_at, step.record).await?;
        self.inner.wake.notify_one();
        Ok(id)
    }

    /// [`Executor::submit`] inside the caller's own SQLite transaction (feature
    /// `durable-sqlite`), the outbox pattern: the call's row is inserted on `tx` and not
    /// committed, so it exists exactly when the caller's transaction commits, with the
    /// application's own rows. Pass a `&rusqlite::Transaction` (or a `Savepoint`, or a
    /// connection after `BEGIN`) on the store's file; begin it with
    /// `TransactionBehavior::Immediate` and give the connection a busy timeout, as for any
    /// write in a file that the executor writes too.
    ///
    /// The same checks, record and errors as `submit`; the idempotency key is looked up on `tx`
    /// too, so a second submission with the same key, in this transaction or after another
    /// one committed, returns the first call's id and adds nothing. Synchronous, as rusqlite
    /// is: it runs the two shared statements on `tx` (from async code, in `spawn_blocking` as
    /// any rusqlite call). After the commit the call runs when a running executor next looks at
    /// the store: at the latest after its poll interval (default 1 s), at once after
    /// [`Executor::wake`]. A rolled-back transaction leaves no call.
    ///
    /// A connection that is not in a transaction, or is on another file or an in-memory
    /// database, or an executor on PostgreSQL, is [`DurableError::WrongTransaction`].
    #[cfg(feature = "durable-sqlite")]
    pub fn submit_in_sqlite(
        &self,
        tx: &rusqlite::Connection,
        handler: &str,
        payload: impl AsRef<[u8]>,
        idempotency_key: Option<&str>,
    ) -> Result<i64, DurableError> {
        self.submit_keyed_in_sqlite(tx, handler, payload, idempotency_key, "")
    }

    /// [`Executor::submit_in_sqlite`] with the policy's key (as [`Executor::submit_keyed`]).
    #[cfg(feature = "durable-sqlite")]
    pub fn submit_keyed_in_sqlite(
        &self,
        tx: &rusqlite::Connection,
        handler: &str,
        payload: impl AsRef<[u8]>,
        idempotency_key: Option<&str>,
        key: &str,
    ) -> Result<i64, DurableError> {
        let (reg, idem) = self.accept(handler, idempotency_key, key)?;
        #[allow(unreachable_patterns)] // only SQLite with the feature `durable-postgres` off
        let store = match &self.inner.store.0 {
            Backend::Sqlite(s) => s,
            _ => return Err(self.wrong_kind("an SQLite transaction")),
        };
        store.check_caller(tx)?;
        let now = store.wall_now(); // SqliteStore::now's clock
        let step = self.begin(&reg, key, idem, now)?;
        store.insert_in(tx, handler, payload.as_ref(), idem, step.next_at, &step.record)
    }

    /// [`Executor::submit`] inside the caller's own PostgreSQL transaction (feature
    /// `durable-postgres`), the outbox pattern: the call's row is inserted on `tx` and not
    /// committed, so it exists exactly when the caller's transaction commits, with the
    /// application's own rows. `tx` must be on the store's database (where
    /// `levee_durable_calls` is, on its `search_path`).
    ///
    /// The same checks, record, clock (the database's, read on `tx` by the shared `clock`
    /// statement) and errors as `submit`; the idempotency key is looked up on `tx` too, so a
    /// second submission with the same key, in this transaction or after another one committed,
    /// returns the first call's id and adds nothing. Under READ COMMITTED (PostgreSQL's
    /// default) a submission whose key another open transaction holds waits for it, as `submit`
    /// does; under REPEATABLE READ or SERIALIZABLE it may fail with a serialization error
    /// ([`DurableError::Store`]), and the transaction is to be retried. After the commit the call
    /// runs when an executor next looks at the store: at the latest after its poll interval
    /// (default 1 s), at once after [`Executor::wake`]. A rolled-back transaction leaves no call.
    ///
    /// An executor on SQLite is [`DurableError::WrongTransaction`].
    #[cfg(feature = "durable-postgres")]
    pub async fn submit_in_postgres(
        &self,
        tx: &tokio_postgres::Transaction<'_>,
        handler: &str,
        payload: impl AsRef<[u8]>,
        idempotency_key: Option<&str>,
    ) -> Result<i64, DurableError> {
        self.submit_keyed_in_postgres(tx, handler, payload, idempotency_key, "").await
    }

    /// [`Executor::submit_in_postgres`] with the policy's key (as [`Executor::submit_keyed`]).
    #[cfg(feature = "durable-postgres")]
    pub async fn submit_keyed_in_postgres(
        &self,
        tx: &tokio_postgres::Transaction<'_>,
        handler: &str,
        payload: impl AsRef<[u8]>,
        idempotency_key: Option<&str>,
        key: &str,
    ) -> Result<i64, DurableError> {
        let (reg, idem) = self.accept(handler, idempotency_key, key)?;
        #[allow(unreachable_patterns)] // only PostgreSQL with the feature `durable-sqlite` off
        let store = match &self.inner.store.0 {
            Backend::Postgres(s) => s,
            _ => return Err(self.wrong_kind("a PostgreSQL transaction")),
        };
        let now = store.now_in(tx).await?;
        let step = self.begin(&reg, key, idem, now)?;
        store.insert_in(tx, handler, payload.as_ref(), idem, step.next_at, &step.record).await
    }

    /// Have a running executor look at the store now rather than at its next poll: after a
    /// transaction that submitted calls commits. (`submit` wakes it itself.)
    pub fn wake(&self) {
        self.inner.wake.notify_one();
    }

    /// What every submission checks first, before the clock, the core and the store: the key's
    /// length and the handler. The handler's registration and the idempotency key (`""`: none).
    fn accept<'k>(
        &self,
        handler: &str,
        idempotency_key: Option<&'k str>,
        key: &str,
    ) -> Result<(Registered, Option<&'k str>), DurableError> {
        crate::KeyTooLong::check(key).map_err(DurableError::KeyTooLong)?;
        let reg = self.registered(handler).ok_or_else(|| DurableError::UnknownHandler(handler.to_string()))?;
        Ok((reg, idempotency_key.filter(|k| !k.is_empty())))
    }

    /// The core's `durable-begin` for a submission at `now` (the store's clock): the record to
    /// insert and when the call is due.
    fn begin(&self, reg: &Registered, key: &str, idem: Option<&str>, now: u64) -> Result<DurableStep, DurableError> {
        let flags = if reg.idempotent { 0 } else { levee_core::durable::FLAG_NON_IDEMPOTENT };
        self.core(|r| match r.try_policy_index(&reg.policy)? {
            Some(index) => r.try_durable_begin(index, key, idem.unwrap_or_default(), flags, now),
            None => Ok(Err(LoadError::new("policy", format!("`{}` is not a policy of the loaded document", reg.policy)))),
        })
        .map_err(DurableError::Engine)?
        .map_err(DurableError::Core)
    }

    /// The error for a caller's transaction (`given`) of the other kind than this executor's store.
    #[allow(dead_code)] // with one store feature only, no transaction can be of the other kind
    fn wrong_kind(&self, given: &str) -> DurableError {
        let store = match self.inner.store.dialect() {
            "sqlite" => "SQLite",
            _ => "PostgreSQL",
        };
        DurableError::WrongTransaction(format!(
            "is {given}, but this executor's store is {store}: submit with `submit` or a transaction on its store"
        ))
    }

    /// What the store holds for a call (`None`: no such call).
    pub async fn status(&self, id: i64) -> Result<Option<CallStatus>, DurableError> {
        Ok(match self.inner.store.get(id).await? {
            Some(r) => Some(status(r)?),
            None => None,
        })
    }

    /// Every call of the store.
    pub async fn calls(&self) -> Result<Vec<CallStatus>, DurableError> {
        self.inner.store.rows(false).await?.into_iter().map(status).collect()
    }

    /// The calls given up, and the quarantined records, with their last error.
    pub async fn dead(&self) -> Result<Vec<CallStatus>, DurableError> {
        self.inner.store.rows(true).await?.into_iter().map(status).collect()
    }

    /// How many calls the store holds in each state.
    pub async fn counts(&self) -> Result<BTreeMap<String, i64>, DurableError> {
        self.inner.store.counts().await
    }

    /// Cancel a call that has not finished. An attempt running now may still complete; its
    /// outcome is then refused. `false`: the call is unknown or finished already.
    pub async fn cancel(&self, id: i64) -> Result<bool, DurableError> {
        self.operator(id, false).await
    }

    /// Give a dead or cancelled call a fresh set of attempts, due now.
    pub async fn retry(&self, id: i64) -> Result<bool, DurableError> {
        let ok = self.operator(id, true).await;
        self.inner.wake.notify_one();
        ok
    }

    /// The core's `operator` (what a cancel or retry writes), compare-and-set against the
    /// record read, tried `DURABLE_OPERATOR_TRIES` times against concurrent writers.
    async fn operator(&self, id: i64, revive: bool) -> Result<bool, DurableError> {
        for _ in 0..crate::constants::DURABLE_OPERATOR_TRIES {
            let Some(row) = self.inner.store.get(id).await? else { return Ok(false) };
            let now = self.inner.store.now().await?;
            let Ok(w) = self.core(|r| r.try_executor_operator(id, &row.record, revive, now)).map_err(DurableError::Engine)? else {
                return Ok(false); // finished already, or a record the core cannot use
            };
            let r = ReplaceArgs {
                status: w.status,
                next_at: w.next_at,
                attempts: w.attempts,
                record: &w.record,
                error: w.error.as_deref(),
                old: &row.record,
            };
            if self.inner.store.replace(id, r).await? {
                return Ok(true);
            }
        }
        Ok(false)
    }

    /// Claim and run due calls until `shutdown` resolves, then drop the attempts still running
    /// (their calls stay running in the store and are resumed, by this process or another, once
    /// their lease lapses). Calls found due at start-up, including ones cut off by a crash once
    /// their lease lapses, are resumed first. Dropping the future stops the same way.
    pub async fn run(&self, shutdown: impl Future<Output = ()>) {
        self.run_loop(shutdown, false).await
    }

    /// [`Executor::run`] that also returns once no call is pending in the store.
    pub async fn run_until_idle(&self) {
        self.run_loop(std::future::pending(), true).await
    }

    async fn run_loop(&self, shutdown: impl Future<Output = ()>, until_idle: bool) {
        let inner = &*self.inner;
        // A zero is the core's default: only what the user configured is passed.
        let config = dx::Config {
            owner: inner.owner.clone(),
            concurrency: inner.concurrency.map_or(0, |n| u32::try_from(n).unwrap_or(u32::MAX)),
            poll: inner.poll.map_or(0, |d| nanos(d).max(1)),
            claim_hold: inner.hold.map_or(0, |d| nanos(d).max(1)),
            until_idle,
        };
        let mut x = RawExecutor::new(config);
        for name in inner.handler_names() {
            x.register(&name);
        }
        let mut d = Driver {
            inner,
            x: Some(x),
            tasks: JoinSet::new(),
            awaited: 0,
            held: HashMap::new(),
            events: VecDeque::from([dx::Event::Poll]),
            sleep: None,
            idle: false,
            base: Instant::now(),
        };
        let mut shutdown = std::pin::pin!(shutdown);
        loop {
            while let Some(e) = d.events.pop_front() {
                d.feed(e);
            }
            if d.idle {
                d.idle = false;
                // An `idle` answered while a statement the machine waits for is in flight (a
                // claim a wake-up asked for) is overtaken by that statement's answer.
                if d.awaited == 0 {
                    while let Some(r) = d.tasks.join_next().await {
                        d.completed(r); // the quarantines still being written
                    }
                    break;
                }
            }
            let (sleep, renew) = (d.sleep, d.next_renewal());
            tokio::select! {
                _ = &mut shutdown => break,
                _ = inner.wake.notified() => d.events.push_back(dx::Event::Poll),
                Some(r) = d.tasks.join_next(), if !d.tasks.is_empty() => d.completed(r),
                _ = until(sleep) => {
                    d.sleep = None;
                    d.events.push_back(dx::Event::Poll);
                }
                _ = until(renew) => d.renew_due(),
            }
        }
        d.tasks.shutdown().await;
    }
}

/// Sleep until `at`; forever for `None`.
async fn until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// What a task of the loop came to: a store statement's answer, or a handler's end.
enum Io {
    /// An answer the machine waits for: a claim's failure, the next due time, a write's fate.
    Event(dx::Event),
    /// The rows a claim returned.
    Claimed(Vec<Claimed>),
    Finished(i64, u32, Ended),
    /// A quarantine was written (or its failure logged).
    Quarantined,
}

/// How a handler's attempt ended.
enum Ended {
    Returned(Attempted),
    TimedOut,
    Panicked(String),
    /// The runtime cancelled it (it shuts down).
    Cancelled,
}

/// A call this process holds: what its handler needs, and what runs or is written for it. The
/// machine holds a call exactly while a write of its row is in flight or its handler runs.
struct Held {
    handler: String,
    payload: Vec<u8>,
    idempotency_key: Option<String>,
    writing: bool,
    running: Option<Running>,
    /// The handler's result, for the write of its success.
    result: Option<Vec<u8>>,
}

/// A handler running: its attempt, its task, and when the machine is told to renew the lease.
struct Running {
    attempt: u32,
    task: AbortHandle,
    renew_at: Instant,
    every: Duration,
}

/// One `run` of the executor: it feeds the core's machine what happened and carries out the
/// commands it answers (docs/durable.md, "The executor"). The store's statements and the
/// handlers run as tasks, whose ends are the next events.
struct Driver<'a> {
    inner: &'a Inner,
    /// The machine (`None` once given back).
    x: Option<RawExecutor>,
    tasks: JoinSet<Io>,
    /// Statements in flight whose answer the machine waits for (claims, next-due, writes).
    awaited: usize,
    held: HashMap<i64, Held>,
    events: VecDeque<dx::Event>,
    /// When the machine's `sleep` ends.
    sleep: Option<Instant>,
    /// The machine answered `idle`.
    idle: bool,
    /// The machine's monotonic clock counts from here.
    base: Instant,
}

impl Drop for Driver<'_> {
    fn drop(&mut self) {
        if let Some(x) = self.x.take() {
            self.inner.levee.with_raw(|r| r.drop_executor(x));
        }
    }
}

impl Driver<'_> {
    fn now(&self) -> u64 {
        nanos(self.base.elapsed())
    }

    /// Feed the machine `event` and carry out its commands.
    fn feed(&mut self, event: dx::Event) {
        let id = match &event {
            dx::Event::Written(id, _) | dx::Event::Renew(id) | dx::Event::Finished(id, _) => Some(*id),
            _ => None,
        };
        let now = self.now();
        let Some(x) = self.x.as_mut() else { return };
        match self.inner.levee.with_raw(|r| r.try_executor_feed(x, now, event)) {
            Ok(commands) => commands.into_iter().for_each(|c| self.carry(c)),
            Err(t) => self.lost(&t),
        }
        if let Some(id) = id {
            self.release_if_done(id);
        }
    }

    /// The machine was lost with the engine's instance (a trap): it is new and holds no call.
    /// Abandon the calls the old one held (resumed once their leases lapse, as after a crash)
    /// and look again after the poll interval.
    fn lost(&mut self, t: &Trap) {
        tracing::error!(target: "levee", error = %t, calls = self.held.len(), "levee durable: the executor's machine was lost with the engine's instance; its calls are abandoned, resumed when their leases lapse");
        for (_, h) in self.held.drain() {
            if let Some(r) = h.running {
                r.task.abort();
            }
        }
        let poll = self.x.as_ref().map_or(0, |x| x.config().poll);
        let poll = if poll == 0 { dx::DEFAULT_POLL } else { poll };
        self.sleep = Some(Instant::now() + Duration::from_nanos(poll));
    }

    /// Tell the machine to forget call `id` (its handler is not running).
    fn forget(&mut self, id: i64) {
        let Some(x) = self.x.as_mut() else { return };
        if let Err(t) = self.inner.levee.with_raw(|r| r.try_executor_forget(x, id)) {
            self.lost(&t);
        }
        if let Some(h) = self.held.get_mut(&id) {
            h.running = None;
        }
        self.release_if_done(id);
    }

    /// A call the machine no longer holds (no write in flight, no handler running) is let go,
    /// and the store looked at again (an attempt's end frees a slot).
    fn release_if_done(&mut self, id: i64) {
        if self.held.get(&id).is_some_and(|h| !h.writing && h.running.is_none()) {
            self.held.remove(&id);
            self.events.push_back(dx::Event::Poll);
        }
    }

    fn carry(&mut self, command: dx::Command) {
        let (store, owner) = (self.inner.store.clone(), self.inner.owner.clone());
        match command {
            dx::Command::Claim { limit, hold } => {
                self.awaited += 1;
                self.tasks.spawn(async move {
                    match store.claim(&owner, hold, limit as usize).await {
                        Ok(rows) => Io::Claimed(rows),
                        Err(e) => Io::Event(dx::Event::ClaimFailed(store_error(e))),
                    }
                });
            }
            dx::Command::Write { id, row } => {
                let held = self.held.get_mut(&id);
                let result = held.and_then(|h| {
                    h.writing = true;
                    h.result.take().filter(|_| row.result)
                });
                self.awaited += 1;
                self.tasks.spawn(async move {
                    let w = WriteArgs {
                        status: row.status,
                        next_at: row.next_at,
                        attempts: row.attempts,
                        lease_owner: row.lease.then_some(owner.as_str()),
                        record: &row.record,
                        result: result.as_deref(),
                        error: row.error.as_deref(),
                    };
                    let written = match store.write(id, &owner, w).await {
                        Ok(true) => dx::Written::Applied,
                        Ok(false) => dx::Written::Lost,
                        Err(e) => dx::Written::Failed(store_error(e)),
                    };
                    Io::Event(dx::Event::Written(id, written))
                });
            }
            dx::Command::Run { id, attempt, timeout, renew_every } => self.start(id, attempt, timeout, renew_every),
            dx::Command::Abandon { id } => {
                if let Some(r) = self.held.get_mut(&id).and_then(|h| h.running.take()) {
                    r.task.abort();
                }
                self.release_if_done(id);
            }
            dx::Command::Quarantine { id, error } => {
                if let Some(r) = self.held.remove(&id).and_then(|h| h.running) {
                    r.task.abort();
                }
                self.tasks.spawn(async move {
                    if let Err(e) = store.quarantine(id, &error).await {
                        tracing::error!(target: "levee", call = id, reason = %error, error = %e, "levee durable: quarantining a record");
                    }
                    Io::Quarantined
                });
            }
            dx::Command::NextDue => {
                self.awaited += 1;
                self.tasks.spawn(async move {
                    let due_in = match store.next_due_in().await {
                        Ok(ns) => ns.map(|ns| u64::try_from(ns).unwrap_or(0)),
                        Err(e) => {
                            // Not known: the machine sleeps its poll interval at most.
                            tracing::error!(target: "levee", error = %e, "levee durable: reading the next due time");
                            Some(u64::MAX)
                        }
                    };
                    Io::Event(dx::Event::NextDue(due_in))
                });
            }
            dx::Command::Sleep { until } => self.sleep = Some(self.base + Duration::from_nanos(until)),
            dx::Command::Idle => self.idle = true,
            dx::Command::Log { level: dx::Level::Warn, id, text } => tracing::warn!(target: "levee", call = id, "{text}"),
            dx::Command::Log { level: dx::Level::Error, id, text } => tracing::error!(target: "levee", call = id, "{text}"),
        }
    }

    /// Run attempt `attempt` of call `id` as a task, cancelled after `timeout` ns (0: none).
    fn start(&mut self, id: i64, attempt: u32, timeout: u64, renew_every: u64) {
        let reg = self.held.get(&id).and_then(|h| self.inner.registered(&h.handler));
        let (Some(h), Some(reg)) = (self.held.get_mut(&id), reg) else {
            // Neither happens: the machine runs calls it was given, of handlers registered here.
            tracing::error!(target: "levee", call = id, "levee durable: no handler to run the call; it is resumed when its lease lapses");
            return self.forget(id);
        };
        let timeout = (timeout > 0).then(|| Duration::from_nanos(timeout));
        let call = DurableCall { id, attempt, idempotency_key: h.idempotency_key.clone(), timeout };
        let fut = (reg.f)(h.payload.clone(), call);
        let task = self.tasks.spawn(async move {
            let mut handler = AbortOnDrop(tokio::spawn(fut));
            let joined = match timeout {
                Some(t) => match tokio::time::timeout(t, &mut handler.0).await {
                    Ok(j) => j,
                    Err(_) => return Io::Finished(id, attempt, Ended::TimedOut),
                },
                None => (&mut handler.0).await,
            };
            Io::Finished(
                id,
                attempt,
                match joined {
                    Ok(r) => Ended::Returned(r),
                    Err(e) if e.is_panic() => Ended::Panicked(panic_text(e.into_panic())),
                    Err(_) => Ended::Cancelled,
                },
            )
        });
        let every = Duration::from_nanos(renew_every);
        h.running = Some(Running { attempt, task, renew_at: Instant::now() + every, every });
    }

    fn next_renewal(&self) -> Option<Instant> {
        self.held.values().filter_map(|h| h.running.as_ref().map(|r| r.renew_at)).min()
    }

    /// Tell the machine of the renewals due.
    fn renew_due(&mut self) {
        let now = Instant::now();
        let mut due = Vec::new();
        for (id, h) in self.held.iter_mut() {
            if let Some(r) = h.running.as_mut().filter(|r| r.renew_at <= now) {
                r.renew_at += r.every;
                due.push(*id);
            }
        }
        for id in due {
            self.feed(dx::Event::Renew(id));
        }
    }

    fn completed(&mut self, r: Result<Io, tokio::task::JoinError>) {
        let io = match r {
            Ok(io) => io,
            Err(e) => {
                if e.is_panic() {
                    tracing::error!(target: "levee", error = %e, "levee durable: a task of the executor panicked");
                }
                return; // else an abandoned handler's task
            }
        };
        match io {
            Io::Event(e) => {
                self.awaited = self.awaited.saturating_sub(1);
                if let Some(h) = match &e {
                    dx::Event::Written(id, _) => self.held.get_mut(id),
                    _ => None,
                } {
                    h.writing = false;
                }
                self.feed(e);
            }
            Io::Claimed(rows) => {
                self.awaited = self.awaited.saturating_sub(1);
                let mut claimed = Vec::with_capacity(rows.len());
                for c in rows {
                    // A handler registered while running is registered in the machine.
                    if let Some(x) = self.x.as_mut().filter(|x| !x.is_registered(&c.handler)) {
                        if self.inner.registered(&c.handler).is_some() {
                            x.register(&c.handler);
                        }
                    }
                    self.held.entry(c.id).or_insert_with(|| Held {
                        handler: c.handler.clone(),
                        payload: c.payload,
                        idempotency_key: c.idempotency_key,
                        writing: false,
                        running: None,
                        result: None,
                    });
                    claimed.push(dx::Claimed { id: c.id, handler: c.handler, record: c.record, db_now: c.db_now });
                }
                self.feed(dx::Event::Claimed(claimed));
            }
            Io::Finished(id, attempt, ended) => self.finished(id, attempt, ended),
            Io::Quarantined => {}
        }
    }

    /// Attempt `attempt` of call `id` ended: the hook, then the machine.
    fn finished(&mut self, id: i64, attempt: u32, ended: Ended) {
        let Some(h) = self.held.get_mut(&id) else { return };
        if !h.running.as_ref().is_some_and(|r| r.attempt == attempt) {
            return; // an attempt abandoned meanwhile
        }
        h.running = None;
        let (outcome, message) = match ended {
            Ended::Returned(Ok(result)) => {
                h.result = result;
                (Outcome::Success, String::new())
            }
            Ended::Returned(Err((o, m))) => (o, m),
            Ended::TimedOut => (Outcome::Timeout, String::new()),
            Ended::Panicked(text) => (Outcome::error("panic"), format!("the handler panicked: {text}")),
            Ended::Cancelled => return self.forget(id),
        };
        if let Some(f) = &self.inner.on_attempt_done {
            f(id, attempt, &outcome);
        }
        let (kind, code, text, flags) = outcome.parts();
        let overloaded = flags & crate::constants::REPORT_OVERLOADED != 0;
        self.feed(dx::Event::Finished(id, dx::Finished { kind, code, text: text.to_string(), message, overloaded }));
    }
}

/// A store's error as the machine's texts hold it (without this crate's prefix).
fn store_error(e: DurableError) -> String {
    match e {
        DurableError::Store(e) => e.to_string(),
        other => other.to_string(),
    }
}

/// A panic's text.
fn panic_text(p: Box<dyn std::any::Any + Send>) -> String {
    match (p.downcast_ref::<&str>(), p.downcast_ref::<String>()) {
        (Some(s), _) => (*s).to_string(),
        (_, Some(s)) => s.clone(),
        _ => "a non-string payload".to_string(),
    }
}

/// A handler's task, aborted when the attempt is dropped (the executor stops).
struct AbortOnDrop<T>(tokio::task::JoinHandle<T>);

impl<T> Drop for AbortOnDrop<T> {
    fn drop(&mut self) {
        self.0.abort();
    }
}

fn status(r: Row) -> Result<CallStatus, DurableError> {
    let state =
        CallState::parse(&r.status).ok_or_else(|| DurableError::Store(format!("call {}: unknown status `{}`", r.id, r.status).into()))?;
    Ok(CallStatus {
        id: r.id,
        handler: r.handler,
        state,
        next_at: r.next_at,
        attempts: r.attempts,
        lease_owner: r.lease_owner,
        idempotency_key: r.idempotency_key,
        error: r.error,
        result: r.result,
        record: Record::decode(&r.record).ok(),
    })
}
