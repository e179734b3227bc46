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
//! The executor is a driver, like the in-process call driver: it asks the core
//! (`RawEngine::try_durable_*`) at every step and does what the answer says. The core decides
//! when a call is due, what a record found after a crash means, whether to retry and how long to
//! wait; the executor persists the record the core returns before each attempt and after each
//! outcome, through the shared statements of `durable/sqlite.sql` and `durable/postgres.sql`.
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

use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::future::Future;
use std::hash::{BuildHasher, Hasher};
use std::pin::Pin;
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use levee_core::durable::{Action, DurableStep, Record};
use levee_core::LoadError;
use tokio::task::JoinSet;

use crate::outcome::{IntoOutcome, Outcome};
use crate::raw::{RawEngine, Trap};
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
    concurrency: usize,
    poll: Duration,
    hold: Duration,
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
        self.concurrency = n.max(1);
        self
    }

    /// The longest the executor sleeps before it looks at the store again (default 1 s): calls
    /// other processes submit are seen within it.
    pub fn poll_interval(mut self, d: Duration) -> Self {
        self.poll = d;
        self
    }

    /// How long a claim keeps calls out of other processes' due window until the core's answer
    /// is written, milliseconds later (default 5 s): a process that dies right after claiming
    /// delays its claimed calls by that much.
    pub fn claim_hold(mut self, d: Duration) -> Self {
        self.hold = d;
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
                    Err(e) => Err((e.outcome(), truncate(e.to_string(), 4096))),
                }
            })
        });
        let reg = Registered { f, policy, idempotent: self.idempotent };
        self.executor.inner.handlers.write().unwrap_or_else(|p| p.into_inner()).insert(self.name, reg);
        Ok(())
    }
}

/// A string cut to at most `n` bytes, on a character boundary.
fn truncate(mut s: String, n: usize) -> String {
    if s.len() > n {
        let mut at = n;
        while !s.is_char_boundary(at) {
            at -= 1;
        }
        s.truncate(at);
    }
    s
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
    concurrency: usize,
    poll: Duration,
    hold: Duration,
    on_attempt_done: Option<AttemptDoneFn>,
    handlers: RwLock<HashMap<String, Registered>>,
    wake: tokio::sync::Notify,
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

/// This process no longer holds the call (a fenced write was refused), or the executor stops.
struct Lost;

/// Why a step of a call ended early.
enum Halt {
    /// Nothing to record: another process or an operator holds the call now.
    Lost,
    /// The store failed; the call is resumed when its claim lapses.
    Store(DurableError),
}

impl From<DurableError> for Halt {
    fn from(e: DurableError) -> Halt {
        Halt::Store(e)
    }
}

fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

fn status_of(a: Action) -> CallState {
    match a {
        Action::Run => CallState::Running,
        Action::Wait => CallState::Scheduled,
        Action::Done => CallState::Done,
        Action::Dead => CallState::Dead,
        Action::Cancelled => CallState::Cancelled,
    }
}

impl Executor {
    /// An executor of the handle's policies on the store, with the defaults.
    pub fn new(levee: Levee, store: impl Into<Store>) -> Executor {
        Executor::builder(levee, store).build()
    }

    /// A builder (owner, concurrency, poll interval, claim hold, attempt hook).
    pub fn builder(levee: Levee, store: impl Into<Store>) -> ExecutorBuilder {
        ExecutorBuilder {
            levee,
            store: store.into(),
            owner: None,
            concurrency: 16,
            poll: Duration::from_secs(1),
            hold: Duration::from_secs(5),
            on_attempt_done: None,
        }
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
        self.inner.handlers.read().unwrap_or_else(|p| p.into_inner()).get(name).cloned()
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
        self.operator(id, |r, rec, now| r.try_durable_cancel(rec, now)).await
    }

    /// Give a dead or cancelled call a fresh set of attempts, due now.
    pub async fn retry(&self, id: i64) -> Result<bool, DurableError> {
        let ok = self.operator(id, |r, rec, now| r.try_durable_revive(rec, now)).await;
        self.inner.wake.notify_one();
        ok
    }

    async fn operator(
        &self,
        id: i64,
        op: impl Fn(&mut RawEngine, &[u8], u64) -> Result<Result<DurableStep, LoadError>, Trap>,
    ) -> Result<bool, DurableError> {
        for _ in 0..10 {
            // compare-and-set against concurrent writers
            let Some(row) = self.inner.store.get(id).await? else { return Ok(false) };
            let now = self.inner.store.now().await?;
            let step = match self.core(|r| op(r, &row.record, now)).map_err(DurableError::Engine)? {
                Ok(s) => s,
                Err(_) => return Ok(false), // finished already, or a record the core cannot use
            };
            let msg = (step.action == Action::Cancelled).then_some(levee_core::durable_exec::CANCELLED_MESSAGE);
            let st = status_of(step.action);
            let r = ReplaceArgs {
                status: st,
                next_at: step.next_at,
                attempts: step.attempt,
                record: &step.record,
                error: msg,
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
        let shutdown = std::pin::pin!(shutdown);
        let mut shutdown = shutdown;
        let mut stopped = false;
        let mut tasks: JoinSet<()> = JoinSet::new();
        let inner = &self.inner;
        loop {
            while let Some(r) = tasks.try_join_next() {
                log_join(r);
            }
            if stopped {
                break;
            }
            let free = inner.concurrency.saturating_sub(tasks.len());
            let mut claimed = Vec::new();
            let mut failed = false;
            if free > 0 {
                // The records' last-seen becomes the claim's db_now, read while the statement
                // runs: the monotonic clock counts from before it (`Claimed::got`), so that the
                // time the claim takes to return (or the writes that follow) never shortens a
                // wait: a retry may start late, never early.
                match inner.store.claim(&inner.owner, nanos(inner.hold), free).await {
                    Ok(c) => claimed = c,
                    Err(e) => {
                        failed = true;
                        tracing::error!(target: "levee", error = %e, "levee durable: claiming due calls");
                    }
                }
            }
            let got_some = !claimed.is_empty();
            for c in claimed {
                let x = self.clone();
                tasks.spawn(async move { x.drive(c).await });
            }
            if got_some && tasks.len() < inner.concurrency {
                continue;
            }
            let mut wait = inner.poll;
            if !failed {
                match inner.store.next_due_in().await {
                    Err(e) => tracing::error!(target: "levee", error = %e, "levee durable: reading the next due time"),
                    Ok(None) if until_idle && tasks.is_empty() => break,
                    Ok(None) => {}
                    Ok(Some(ns)) => wait = wait.min(Duration::from_nanos(u64::try_from(ns).unwrap_or(0))),
                }
            }
            tokio::select! {
                _ = &mut shutdown => stopped = true,
                _ = inner.wake.notified() => {}
                Some(r) = tasks.join_next(), if !tasks.is_empty() => log_join(r),
                _ = tokio::time::sleep(wait) => {}
            }
        }
        tasks.shutdown().await;
    }

    async fn write(&self, c: &Claimed, step: &DurableStep, result: Option<&[u8]>) -> Result<(), Halt> {
        let dead = (step.action == Action::Dead).then(|| dead_reason(step));
        let w = WriteArgs {
            status: status_of(step.action),
            next_at: step.next_at,
            attempts: step.attempt,
            lease_owner: (step.action == Action::Run).then_some(self.inner.owner.as_str()),
            record: &step.record,
            result: if step.action == Action::Done { result } else { None },
            error: dead.as_deref(),
        };
        if self.inner.store.write(c.id, &self.inner.owner, w).await? {
            Ok(())
        } else {
            Err(Halt::Lost)
        }
    }

    async fn quarantine(&self, c: &Claimed, msg: &str) {
        if let Err(e) = self.inner.store.quarantine(c.id, msg).await {
            tracing::error!(target: "levee", call = c.id, reason = msg, error = %e, "levee durable: quarantining a record");
        }
    }

    /// A core's answer: a [`LoadError`] names what is wrong with the record (quarantine it);
    /// a trap is the engine's own fault (leave the call to be resumed when its claim lapses).
    async fn answer(&self, c: &Claimed, r: Result<Result<DurableStep, LoadError>, Trap>) -> Option<DurableStep> {
        match r {
            Ok(Ok(step)) => Some(step),
            Ok(Err(e)) => {
                self.quarantine(c, &e.to_string()).await;
                None
            }
            Err(t) => {
                tracing::error!(target: "levee", call = c.id, error = %t, "levee durable: the engine failed; the call is resumed when its claim lapses");
                None
            }
        }
    }

    async fn drive(&self, c: Claimed) {
        let Some(reg) = self.registered(&c.handler) else {
            self.quarantine(&c, &format!("handler: no durable handler named `{}` is registered", c.handler)).await;
            return;
        };
        let owner = self.inner.owner.as_str();
        let Some(step) = self.answer(&c, self.core(|r| r.try_durable_step(&c.record, owner, c.db_now, 0))).await else { return };
        match self.run_step(&c, &reg, &step).await {
            Ok(()) | Err(Halt::Lost) => {} // another process (or an operator) holds the call now
            Err(Halt::Store(e)) => {
                tracing::error!(target: "levee", call = c.id, error = %e, "levee durable: writing a call; it is resumed when its claim lapses")
            }
        }
    }

    /// Persist the core's answer, then, for `run`, run the attempt and persist its outcome.
    async fn run_step(&self, c: &Claimed, reg: &Registered, step: &DurableStep) -> Result<(), Halt> {
        self.write(c, step, None).await?; // before the attempt
        if step.action != Action::Run {
            return Ok(()); // a wait: the call is due again at next_at, for whichever process finds it
        }
        let a = self.attempt(c, reg, step).await.map_err(|Lost| Halt::Lost)?;
        if let Some(f) = &self.inner.on_attempt_done {
            f(c.id, step.attempt, &a.outcome);
        }
        // After the claim only the monotonic clock counts: the core works at max(the claim's
        // wall time, last seen + the monotonic time since it gave these bytes).
        let (kind, code, text, flags) = a.outcome.parts();
        let elapsed = nanos(a.got.elapsed());
        let owner = self.inner.owner.as_str();
        let answer = self.core(|r| r.try_durable_outcome(&a.record, owner, c.db_now, elapsed, kind, code, text, &a.message, flags));
        if let Some(after) = self.answer(c, answer).await {
            self.write(c, &after, a.result.as_deref()).await?;
        }
        Ok(())
    }

    /// Run the handler under the attempt's timeout, renewing the lease every third of it.
    /// `Lost`: the call was lost (a renewal refused, or the lease ran out while the store could
    /// not be reached); nothing is to be recorded.
    async fn attempt(&self, c: &Claimed, reg: &Registered, step: &DurableStep) -> Result<AttemptResult, Lost> {
        let owner = self.inner.owner.as_str();
        // step.record's last-seen is the claim's db_now: count from before the claim.
        let (mut record, mut got) = (step.record.clone(), c.got);
        let lease = Duration::from_nanos(step.lease_until.saturating_sub(c.db_now)); // as the core granted it
        let every = (lease / 3).max(Duration::from_millis(50));
        let mut expires = got + lease;
        let timeout = (step.timeout > 0).then(|| Duration::from_nanos(step.timeout));
        let call = DurableCall { id: c.id, attempt: step.attempt, idempotency_key: c.idempotency_key.clone(), timeout };
        let mut task = AbortOnDrop(tokio::spawn((reg.f)(c.payload.clone(), call)));
        let timer = async {
            match timeout {
                Some(t) => tokio::time::sleep(t).await,
                None => std::future::pending().await,
            }
        };
        tokio::pin!(timer);
        let mut renew_at = tokio::time::Instant::now() + every;
        let ended = loop {
            tokio::select! {
                biased;
                r = &mut task.0 => break Some(r),
                _ = &mut timer => {
                    task.0.abort();
                    break None;
                }
                _ = tokio::time::sleep_until(renew_at) => {
                    // The renewal runs to its end before the handler's end is looked at: an
                    // outcome is never written while a renewal's write is in flight.
                    renew_at += every;
                    let asked = Instant::now(); // the renewed record's last-seen is this moment
                    let since = nanos(asked.saturating_duration_since(got));
                    let r = match self.core(|e| e.try_durable_renew(&record, owner, c.db_now, since)) {
                        Ok(Ok(r)) => r,
                        Ok(Err(_)) => return Err(Lost),
                        Err(t) => {
                            tracing::warn!(target: "levee", call = c.id, error = %t, "levee durable: renewing a lease");
                            if Instant::now() > expires { return Err(Lost) }
                            continue;
                        }
                    };
                    match self.write(c, &r, None).await {
                        Ok(()) => {
                            record = r.record;
                            got = asked;
                            expires = got + lease;
                        }
                        Err(Halt::Lost) => return Err(Lost),
                        Err(Halt::Store(e)) => {
                            if Instant::now() > expires { return Err(Lost) }
                            tracing::warn!(target: "levee", call = c.id, error = %e, "levee durable: renewing a lease"); // tried again next tick
                        }
                    }
                }
            }
        };
        let (result, outcome, message) = match ended {
            None => (None, Outcome::Timeout, "the attempt timed out".to_string()),
            Some(Ok(Ok(v))) => (v, Outcome::Success, String::new()),
            Some(Ok(Err((o, m)))) => (None, o, m),
            Some(Err(e)) if e.is_panic() => {
                let p = e.into_panic();
                let text: Cow<'_, str> = match (p.downcast_ref::<&str>(), p.downcast_ref::<String>()) {
                    (Some(s), _) => Cow::Borrowed(s),
                    (_, Some(s)) => Cow::Borrowed(s.as_str()),
                    _ => Cow::Borrowed("a non-string payload"),
                };
                (None, Outcome::error("panic"), truncate(format!("the handler panicked: {text}"), 4096))
            }
            Some(Err(_)) => return Err(Lost), // cancelled: the runtime shuts down
        };
        Ok(AttemptResult { record, got, result, outcome, message })
    }
}

struct AttemptResult {
    /// The latest record (renewals change it).
    record: Vec<u8>,
    /// When the core gave it (monotonic).
    got: Instant,
    result: Option<Vec<u8>>,
    outcome: Outcome,
    message: String,
}

/// A handler's task, aborted when the attempt is dropped (the executor stops).
struct AbortOnDrop<T>(tokio::task::JoinHandle<T>);

impl<T> Drop for AbortOnDrop<T> {
    fn drop(&mut self) {
        self.0.abort();
    }
}

fn log_join(r: Result<(), tokio::task::JoinError>) {
    if let Err(e) = r {
        if e.is_panic() {
            tracing::error!(target: "levee", error = %e, "levee durable: a call's driver panicked");
        }
    }
}

/// The error column of a call given up: the reason, then the last error as the record holds it
/// (the same text in every host).
fn dead_reason(step: &DurableStep) -> String {
    let reason = step.reason.name();
    match Record::decode(&step.record) {
        Err(_) => reason.to_string(),
        Ok(r) if r.error_attempt == 0 && r.error_class.is_empty() => format!("{reason}: attempt 0 failed with ``: "),
        Ok(r) => format!("{reason}: attempt {} failed with `{}`: {}", r.error_attempt, r.error_class, r.error_message),
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
