//! The Rust executor (`levee::durable`) against real stores, through its public API: an SQLite
//! file per test, and PostgreSQL when `LEVEE_TEST_POSTGRES` names a database (durable/tests/run.sh
//! sets it for the server it starts; each test then works in a schema of its own).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

use std::fmt;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use levee::core::durable::Action;
use levee::durable::*;
use levee::{IntoOutcome, Levee, Outcome};

/// The copies the crate embeds are the repository's shared files, byte for byte.
#[test]
fn the_statements_are_the_shared_files() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join("..");
    for (name, embedded) in [("sqlite", SQLITE_SQL), ("postgres", POSTGRES_SQL)] {
        let shared = std::fs::read_to_string(root.join(format!("{name}.sql"))).unwrap();
        assert!(
            shared == embedded,
            "host-rust/src/durable_executor/sql/{name}.sql differs from durable/{name}.sql: copy it \
             (cp durable/{name}.sql host-rust/src/durable_executor/sql/)"
        );
        let stmts = statements(embedded);
        for n in
            ["schema", "insert", "find_by_key", "claim", "write", "quarantine", "get", "replace", "list", "list_dead", "next_due", "counts"]
        {
            assert!(stmts.contains_key(n), "{name}: no statement `{n}`");
        }
        assert!(stmts["schema"].starts_with("CREATE TABLE IF NOT EXISTS levee_durable_calls"));
    }
    assert!(statements(POSTGRES_SQL)["claim"].contains("FOR UPDATE OF c SKIP LOCKED"));
}

#[test]
fn statements_split_at_names() {
    let s = statements("-- header\n\n-- name: a\n-- a comment\nSELECT 1;\n\n-- name: b\nSELECT 2;\n");
    assert_eq!(s.len(), 2);
    assert_eq!(s["a"], "-- a comment\nSELECT 1;");
    assert_eq!(s["b"], "SELECT 2;");
    assert_eq!(statements("-- name: only\nSELECT 3;")["only"], "SELECT 3;");
}

#[test]
fn states_round_trip() {
    for s in ["scheduled", "running", "done", "dead", "cancelled", "quarantined"] {
        assert_eq!(CallState::parse(s).map(CallState::as_str), Some(s));
    }
    assert_eq!(CallState::parse("lost"), None);
    assert!(CallState::Quarantined.is_finished() && !CallState::Running.is_finished());
}

const DOC: &str = "
policies:
  quick:
    attempts: 3
    attempt-timeout: 5s
    backoff: { kind: constant, base: 50ms, cap: 50ms, jitter: none }
    durable: { lease: 2s, max-crashes: 2 }
  other:
    attempts: 2
    backoff: { kind: constant, base: 50ms, cap: 50ms, jitter: none }
  short:
    attempts: 2
    attempt-timeout: 100ms
    backoff: { kind: constant, base: 10ms, cap: 10ms, jitter: none }
  leased:
    attempts: 2
    backoff: { kind: constant, base: 10ms, cap: 10ms, jitter: none }
    durable: { lease: 300ms }
";

/// A fresh store of each kind available, with a way to run raw SQL on it.
struct Fixture {
    store: Store,
    raw: Raw,
}

enum Raw {
    Sqlite(std::path::PathBuf),
    Postgres(Box<tokio_postgres::Config>),
}

impl Fixture {
    /// `UPDATE levee_durable_calls SET <column> = value WHERE id = <id>`.
    async fn set<T: rusqlite::ToSql + tokio_postgres::types::ToSql + Sync>(&self, column: &str, value: T, id: i64) {
        match &self.raw {
            Raw::Sqlite(path) => {
                let c = rusqlite::Connection::open(path).unwrap();
                c.execute(&format!("UPDATE levee_durable_calls SET {column} = ?1 WHERE id = ?2"), rusqlite::params![value, id]).unwrap();
            }
            Raw::Postgres(cfg) => {
                let (c, conn) = cfg.connect(tokio_postgres::NoTls).await.unwrap();
                tokio::spawn(conn);
                c.execute(&format!("UPDATE levee_durable_calls SET {column} = $1 WHERE id = $2"), &[&value, &id]).await.unwrap();
            }
        }
    }

    async fn set_bytes(&self, column: &str, value: &[u8], id: i64) {
        self.set(column, value.to_vec(), id).await
    }

    async fn set_text(&self, column: &str, value: &str, id: i64) {
        self.set(column, value.to_string(), id).await
    }

    /// The record column, as stored.
    async fn record(&self, id: i64) -> Vec<u8> {
        match &self.raw {
            Raw::Sqlite(path) => {
                let c = rusqlite::Connection::open(path).unwrap();
                c.query_row("SELECT record FROM levee_durable_calls WHERE id = ?1", [id], |r| r.get(0)).unwrap()
            }
            Raw::Postgres(cfg) => {
                let (c, conn) = cfg.connect(tokio_postgres::NoTls).await.unwrap();
                tokio::spawn(conn);
                c.query_one("SELECT record FROM levee_durable_calls WHERE id = $1", &[&id]).await.unwrap().get(0)
            }
        }
    }
}

static N: AtomicU32 = AtomicU32::new(0);

async fn fixtures(test: &str) -> Vec<Fixture> {
    let mut out = Vec::new();
    let n = N.fetch_add(1, Ordering::Relaxed);
    {
        let dir = std::env::temp_dir().join(format!("levee-durable-rs-{}-{n}-{test}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("calls.db");
        out.push(Fixture { store: SqliteStore::open(&path).await.unwrap().into(), raw: Raw::Sqlite(path) });
    }
    match std::env::var("LEVEE_TEST_POSTGRES") {
        Ok(dsn) if !dsn.is_empty() => {
            let schema = format!("levee_rs_{}_{n}_{test}", std::process::id());
            let mut cfg: tokio_postgres::Config = dsn.parse().unwrap();
            let (c, conn) = cfg.connect(tokio_postgres::NoTls).await.unwrap();
            tokio::spawn(conn);
            c.batch_execute(&format!("DROP SCHEMA IF EXISTS {schema} CASCADE; CREATE SCHEMA {schema}")).await.unwrap();
            cfg.options(format!("-c search_path={schema}"));
            out.push(Fixture {
                store: PostgresStore::with_config(cfg.clone(), 2).await.unwrap().into(),
                raw: Raw::Postgres(Box::new(cfg)),
            });
        }
        _ => eprintln!("{test}: LEVEE_TEST_POSTGRES is not set: SQLite only"),
    }
    let _ = test;
    out
}

fn executor(store: Store) -> Executor {
    executor_of(Levee::from_str(DOC).unwrap(), store)
}

fn executor_of(levee: Levee, store: Store) -> Executor {
    Executor::builder(levee, store).owner("test").poll_interval(Duration::from_millis(20)).claim_hold(Duration::from_secs(1)).build()
}

async fn idle(x: &Executor) {
    tokio::time::timeout(Duration::from_secs(30), x.run_until_idle()).await.expect("the executor went idle");
}

async fn status_of(x: &Executor, id: i64) -> CallStatus {
    x.status(id).await.unwrap().expect("the call is in the store")
}

fn reset() -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::ConnectionReset, "reset")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failure_is_retried_after_its_backoff_then_done() {
    for f in fixtures("retry").await {
        let x = executor(f.store);
        let seen = Arc::new(Mutex::new(Vec::new()));
        let s = seen.clone();
        x.handler("send")
            .policy("quick")
            .register(move |payload, c| {
                let s = s.clone();
                async move {
                    s.lock().unwrap().push((c.attempt, Instant::now()));
                    if c.attempt == 1 {
                        return Err(reset());
                    }
                    assert_eq!((c.idempotency_key.as_deref(), payload.as_slice()), (Some("k-1"), b"hello".as_slice()));
                    Ok(b"sent".to_vec())
                }
            })
            .unwrap();
        let id = x.submit("send", b"hello".to_vec(), Some("k-1")).await.unwrap();
        assert_eq!(x.submit("send", b"hello".to_vec(), Some("k-1")).await.unwrap(), id, "one call per idempotency key");
        let st = status_of(&x, id).await;
        assert_eq!(st.state, CallState::Scheduled);
        assert_eq!(st.record.as_ref().map(|r| r.policy.as_str()), Some("quick"));
        idle(&x).await;
        let st = status_of(&x, id).await;
        assert_eq!(
            (st.state, st.attempts, st.result.as_deref(), st.lease_owner.as_deref()),
            (CallState::Done, 2, Some(&b"sent"[..]), None)
        );
        let rec = st.record.unwrap();
        assert_eq!((rec.failures, rec.error_class.as_str()), (1, "connection-error"));
        assert_eq!(x.counts().await.unwrap().get("done"), Some(&1));
        let seen = seen.lock().unwrap().clone();
        assert_eq!(seen.iter().map(|s| s.0).collect::<Vec<_>>(), [1, 2]);
        // The clock rule: the retry never starts before its backoff (50 ms) has passed.
        assert!(seen[1].1 - seen[0].1 >= Duration::from_millis(50), "the retry ran after {:?}", seen[1].1 - seen[0].1);
    }
}

#[derive(Debug)]
struct Refused;

impl fmt::Display for Refused {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("no such order")
    }
}

impl IntoOutcome for Refused {
    fn outcome(&self) -> Outcome {
        Outcome::error("Refused")
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_up_calls_are_listed_with_their_last_error() {
    for f in fixtures("dead").await {
        let x = executor(f.store);
        x.handler("refuse").policy("quick").register(|_, _| async { Err::<(), _>(Refused) }).unwrap();
        x.handler("bare").policy("quick").not_idempotent().register(|_, _| async { Err::<(), _>(reset()) }).unwrap();
        x.handler("boom")
            .policy("other")
            .register(|_, c| async move {
                if c.attempt > 0 {
                    panic!("the handler's bug");
                }
                Ok::<_, std::io::Error>(())
            })
            .unwrap();
        let a = x.submit("refuse", Vec::new(), None).await.unwrap();
        let b = x.submit("bare", Vec::new(), None).await.unwrap();
        let p = x.submit("boom", Vec::new(), None).await.unwrap();
        idle(&x).await;
        let dead = x.dead().await.unwrap();
        assert_eq!(dead.iter().map(|d| d.id).collect::<Vec<_>>(), [a, b, p]);
        let err = |i: usize| dead[i].error.clone().unwrap_or_default();
        assert_eq!(err(0), "non-retryable: attempt 1 failed with `Refused`: no such order");
        assert!(err(1).starts_with("non-idempotent: attempt 1 failed with `connection-error`"), "{}", err(1));
        assert_eq!(dead[1].attempts, 1, "a non-idempotent call without a key never runs again");
        // A panic is an error of class `panic`, retried as the policy says (`other`: 2 attempts).
        assert_eq!(err(2), "non-retryable: attempt 1 failed with `panic`: the handler panicked: the handler's bug");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_records_are_quarantined_naming_them() {
    for f in fixtures("quarantine").await {
        let x = executor(f.store.clone());
        x.handler("ok").policy("quick").register(|_, _| async { Ok::<_, std::io::Error>(()) }).unwrap();
        let good = x.submit("ok", Vec::new(), None).await.unwrap();
        let corrupt = x.submit("ok", Vec::new(), Some("c")).await.unwrap();
        let version = x.submit("ok", Vec::new(), Some("v")).await.unwrap();
        let orphan = x.submit("ok", Vec::new(), Some("o")).await.unwrap();
        let mut rec = f.record(corrupt).await;
        if let Some(b) = rec.get_mut(20) {
            *b ^= 0xff;
        }
        f.set_bytes("record", &rec, corrupt).await;
        let mut rec = f.record(version).await;
        rec[4] = 2;
        f.set_bytes("record", &rec, version).await;
        f.set_text("handler", "gone", orphan).await;
        idle(&x).await;
        assert_eq!(status_of(&x, good).await.state, CallState::Done);
        let st = status_of(&x, corrupt).await;
        assert_eq!(st.state, CallState::Quarantined);
        assert_eq!(st.error.as_deref(), Some("record: is corrupt: its checksum does not match its contents"));
        assert!(st.record.is_none());
        let st = status_of(&x, version).await;
        assert_eq!(st.error.as_deref(), Some("record.version: is 2; this core reads version 1 records only"));
        let st = status_of(&x, orphan).await;
        assert_eq!(
            (st.state, st.error.as_deref()),
            (CallState::Quarantined, Some("handler: no durable handler named `gone` is registered"))
        );
        assert_eq!(x.dead().await.unwrap().len(), 3, "dead() lists the quarantined records");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_policy_gone_after_a_reload_is_quarantined() {
    for f in fixtures("reload").await {
        let levee = Levee::from_str(DOC).unwrap();
        let x = executor_of(levee.clone(), f.store);
        x.handler("o").policy("other").register(|_, _| async { Ok::<_, std::io::Error>(()) }).unwrap();
        let id = x.submit("o", Vec::new(), None).await.unwrap();
        levee.reload("policies:\n  quick:\n    attempts: 3\n").unwrap();
        idle(&x).await;
        let st = status_of(&x, id).await;
        assert_eq!(st.state, CallState::Quarantined);
        let e = st.error.unwrap_or_default();
        assert!(e.starts_with("record.policy: ") && e.contains("other"), "{e}");
        assert!(matches!(x.submit("o", Vec::new(), None).await, Err(DurableError::Core(_))));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_then_retry() {
    for f in fixtures("cancel").await {
        let x = executor(f.store);
        let runs = Arc::new(AtomicU32::new(0));
        let r = runs.clone();
        x.handler("ok")
            .policy("quick")
            .register(move |_, _| {
                r.fetch_add(1, Ordering::Relaxed);
                async { Ok::<_, std::io::Error>("y") }
            })
            .unwrap();
        let id = x.submit("ok", Vec::new(), None).await.unwrap();
        assert!(x.cancel(id).await.unwrap());
        let st = status_of(&x, id).await;
        assert_eq!((st.state, st.error.as_deref()), (CallState::Cancelled, Some("cancelled by an operator")));
        idle(&x).await;
        assert_eq!(runs.load(Ordering::Relaxed), 0, "a cancelled call ran");
        assert!(!x.cancel(id).await.unwrap(), "a finished call was cancelled again");
        assert!(x.retry(id).await.unwrap());
        idle(&x).await;
        let st = status_of(&x, id).await;
        assert_eq!((st.state, st.result.as_deref(), runs.load(Ordering::Relaxed)), (CallState::Done, Some(&b"y"[..]), 1));
        assert!(x.status(999_999).await.unwrap().is_none());
        assert!(!x.cancel(999_999).await.unwrap());
    }
}

/// An attempt cut off by a crash (a running record whose lease lapsed, written by another
/// owner) is retried when the call has a key, counting a crash; without a key, a
/// non-idempotent call gives up with `unknown-outcome`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crashed_attempt_is_resumed_or_given_up() {
    for f in fixtures("crash").await {
        let levee = Levee::from_str(DOC).unwrap();
        let x = executor_of(levee.clone(), f.store.clone());
        let h = |_: Vec<u8>, c: DurableCall| async move {
            if c.attempt == 1 {
                std::future::pending::<()>().await; // never: the first attempt is cut off below
            }
            Ok::<_, std::io::Error>(())
        };
        x.handler("ok").policy("quick").register(h).unwrap();
        x.handler("bare").policy("quick").not_idempotent().register(h).unwrap();
        let keyed = x.submit("ok", Vec::new(), Some("key")).await.unwrap();
        let bare = x.submit("bare", Vec::new(), None).await.unwrap();
        // Another process took the calls up 3 s ago (its 2 s lease has lapsed), wrote them
        // running, and died.
        let then = f.store.now().await.unwrap() - 3_000_000_000;
        for id in [keyed, bare] {
            let rec = f.record(id).await;
            let step = levee.with_raw(|r| r.try_durable_step(&rec, "dead-process", then, 0)).unwrap().unwrap();
            assert_eq!(step.action, Action::Run);
            f.set_text("status", "running", id).await;
            f.set_text("lease_owner", "dead-process", id).await;
            f.set("next_at", step.next_at as i64, id).await;
            f.set("attempts", i32::try_from(step.attempt).unwrap(), id).await;
            f.set_bytes("record", &step.record, id).await;
        }
        idle(&x).await;
        let st = status_of(&x, keyed).await;
        assert_eq!((st.state, st.attempts, st.record.map(|r| r.crashes)), (CallState::Done, 2, Some(1)));
        let st = status_of(&x, bare).await;
        assert_eq!((st.state, st.attempts), (CallState::Dead, 1));
        assert!(st.error.unwrap_or_default().starts_with("unknown-outcome"));
    }
}

/// An attempt longer than its lease is renewed while it runs: a second process polling the
/// store never takes it over. An attempt past its timeout is dropped and retried.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_attempt_keeps_its_lease_and_a_timeout_is_retried() {
    for f in fixtures("lease").await {
        let a = executor(f.store.clone());
        let levee = Levee::from_str(DOC).unwrap();
        let b = Executor::builder(levee, f.store.clone()).owner("other").poll_interval(Duration::from_millis(20)).build();
        let starts = Arc::new(AtomicU32::new(0));
        for x in [&a, &b] {
            let s = starts.clone();
            x.handler("long")
                .policy("leased")
                .register(move |_, _| {
                    s.fetch_add(1, Ordering::Relaxed);
                    async {
                        tokio::time::sleep(Duration::from_millis(1200)).await; // 4 leases
                        Ok::<_, std::io::Error>(())
                    }
                })
                .unwrap();
            x.handler("stuck")
                .policy("short")
                .register(|_, c| async move {
                    if c.attempt == 1 {
                        tokio::time::sleep(Duration::from_secs(30)).await;
                    }
                    Ok::<_, std::io::Error>(())
                })
                .unwrap();
        }
        let long = a.submit("long", Vec::new(), Some("l")).await.unwrap();
        let stuck = a.submit("stuck", Vec::new(), None).await.unwrap();
        let (other, stop) = tokio::sync::oneshot::channel::<()>();
        let bx = b.clone();
        let polling = tokio::spawn(async move {
            bx.run(async {
                let _ = stop.await;
            })
            .await
        });
        tokio::time::sleep(Duration::from_millis(50)).await;
        idle(&a).await;
        let _ = other.send(());
        polling.await.unwrap();
        let st = status_of(&a, long).await;
        assert_eq!((st.state, st.attempts, starts.load(Ordering::Relaxed)), (CallState::Done, 1, 1), "{st:?}");
        let st = status_of(&a, stuck).await;
        assert_eq!((st.state, st.attempts), (CallState::Done, 2));
        assert_eq!(st.record.map(|r| r.error_class), Some("timeout".to_string()));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn register_needs_a_policy_and_submit_a_handler() {
    for f in fixtures("register").await {
        let x = executor(f.store);
        let e = x.register("nope", |_, _| async { Ok::<_, std::io::Error>(()) }).unwrap_err();
        assert!(matches!(e, DurableError::UnknownPolicy(_)), "{e}");
        let e = x.submit("nope", Vec::new(), None).await.unwrap_err();
        assert_eq!(e.to_string(), "levee durable: no durable handler named `nope` is registered");
    }
}

/// A key longer than the bound (issue 41) is refused by `submit_keyed` before the core and the
/// store, as by every entry that takes a key; the longest allowed key is taken.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn submit_keyed_refuses_a_key_longer_than_the_bound() {
    for f in fixtures("longkey").await {
        let x = executor(f.store);
        x.handler("ok").policy("quick").register(|_, _| async { Ok::<_, std::io::Error>(()) }).unwrap();
        let max = levee::constants::GUARD_MAX_KEY_BYTES as usize;
        let long = "k".repeat(max + 1);
        let e = x.submit_keyed("ok", Vec::new(), None, &long).await.unwrap_err();
        assert!(matches!(&e, DurableError::KeyTooLong(k) if k.bytes == max + 1), "{e}");
        assert!(e.to_string().ends_with("longer than the 1024 a key may be (docs/policy.md, Keys)"), "{e}");
        assert!(x.calls().await.unwrap().is_empty(), "nothing reached the store");
        x.submit_keyed("ok", Vec::new(), None, &long[..max]).await.unwrap();
    }
}

/// A connection of the application's own to a fixture's database: the outbox tests' caller,
/// with a table of its own (`orders`).
enum Caller {
    Sqlite(rusqlite::Connection),
    Postgres(tokio_postgres::Client),
}

impl Fixture {
    async fn caller(&self) -> Caller {
        match &self.raw {
            Raw::Sqlite(path) => {
                let c = rusqlite::Connection::open(path).unwrap();
                c.busy_timeout(Duration::from_secs(30)).unwrap();
                c.execute_batch("CREATE TABLE IF NOT EXISTS orders (id INTEGER PRIMARY KEY, note TEXT NOT NULL)").unwrap();
                Caller::Sqlite(c)
            }
            Raw::Postgres(cfg) => {
                let (c, conn) = cfg.connect(tokio_postgres::NoTls).await.unwrap();
                tokio::spawn(conn);
                c.batch_execute("CREATE TABLE IF NOT EXISTS orders (id BIGINT PRIMARY KEY, note TEXT NOT NULL)").await.unwrap();
                Caller::Postgres(c)
            }
        }
    }
}

fn send<T: Send>(_: &T) {}

impl Caller {
    /// In one transaction of the caller's: the row `order` of its table, then a call of `ship`
    /// per idempotency key in `keys` (the order's id as the payload), then commit (`commit`) or
    /// roll back. The ids `submit_in_*` returned, and the calls the transaction saw at its end.
    async fn order(&mut self, x: &Executor, order: i64, keys: &[&str], commit: bool) -> (Vec<i64>, i64) {
        let payload = order.to_string();
        let count = "SELECT count(*) FROM levee_durable_calls";
        match self {
            Caller::Sqlite(c) => {
                let tx = c.transaction_with_behavior(rusqlite::TransactionBehavior::Immediate).unwrap();
                tx.execute("INSERT INTO orders (id, note) VALUES (?1, 'placed')", [order]).unwrap();
                let ids = keys.iter().map(|k| x.submit_in_sqlite(&tx, "ship", &payload, Some(k)).unwrap()).collect();
                let seen: i64 = tx.query_row(count, [], |r| r.get(0)).unwrap();
                if commit {
                    tx.commit().unwrap()
                } else {
                    tx.rollback().unwrap()
                }
                (ids, seen)
            }
            Caller::Postgres(c) => {
                let tx = c.transaction().await.unwrap();
                tx.execute("INSERT INTO orders (id, note) VALUES ($1, 'placed')", &[&order]).await.unwrap();
                let mut ids = Vec::new();
                for k in keys {
                    let submitted = x.submit_in_postgres(&tx, "ship", &payload, Some(k));
                    send(&submitted); // usable in a spawned task (a web handler)
                    ids.push(submitted.await.unwrap());
                }
                let seen: i64 = tx.query_one(count, &[]).await.unwrap().get(0);
                if commit {
                    tx.commit().await.unwrap()
                } else {
                    tx.rollback().await.unwrap()
                }
                (ids, seen)
            }
        }
    }

    /// The caller's committed orders.
    async fn orders(&self) -> Vec<i64> {
        let q = "SELECT id FROM orders ORDER BY id";
        match self {
            Caller::Sqlite(c) => c.prepare(q).unwrap().query_map([], |r| r.get(0)).unwrap().map(Result::unwrap).collect(),
            Caller::Postgres(c) => c.query(q, &[]).await.unwrap().iter().map(|r| r.get(0)).collect(),
        }
    }
}

/// The outbox (issue 40): a call submitted inside the caller's own transaction, with a row of
/// the caller's, exists exactly when that transaction commits. Rolled back: neither the row nor
/// the call, and the handler never runs; committed: a running executor takes the call up at its
/// next poll, without being woken, and it ends done; an idempotency key given twice in the
/// transaction, or again after the commit, is the first call.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_submitted_in_the_callers_transaction_exists_when_it_commits() {
    for f in fixtures("outbox").await {
        let x = executor(f.store.clone());
        let ran = Arc::new(Mutex::new(Vec::new()));
        let r = ran.clone();
        x.handler("ship")
            .policy("quick")
            .register(move |payload, _| {
                r.lock().unwrap().push(String::from_utf8(payload).unwrap());
                async { Ok::<_, std::io::Error>("shipped") }
            })
            .unwrap();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let bx = x.clone();
        let running = tokio::spawn(async move {
            bx.run(async {
                let _ = stopped.await;
            })
            .await
        });
        let mut db = f.caller().await;

        let (ids, seen) = db.order(&x, 1, &["ship-1"], false).await;
        assert_eq!(seen, 1, "the transaction saw its call");
        assert!(x.status(ids[0]).await.unwrap().is_none(), "a rolled-back call is in the store");
        assert!(x.calls().await.unwrap().is_empty());
        assert!(db.orders().await.is_empty(), "a rolled-back order is in the table");

        let (ids, seen) = db.order(&x, 2, &["ship-2", "ship-2"], true).await;
        assert_eq!(ids[0], ids[1], "the key's second submission in the transaction returned the first id");
        assert_eq!(seen, 1, "the key's second submission in the transaction added a call");
        assert_eq!(db.orders().await, [2]);
        let id = ids[0];
        let deadline = Instant::now() + Duration::from_secs(10);
        let st = loop {
            let st = status_of(&x, id).await;
            if st.state.is_finished() || Instant::now() > deadline {
                break st;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        assert_eq!(
            (st.state, st.attempts, st.result.as_deref(), st.idempotency_key.as_deref()),
            (CallState::Done, 1, Some(&b"shipped"[..]), Some("ship-2")),
            "{st:?}"
        );
        assert_eq!(st.record.map(|r| r.policy), Some("quick".to_string()), "the record of the core's durable-begin");

        assert_eq!(x.submit("ship", b"2".to_vec(), Some("ship-2")).await.unwrap(), id, "submit after the commit");
        let (again, seen) = db.order(&x, 3, &["ship-2"], false).await;
        assert_eq!((again, seen), (vec![id], 1), "a later transaction with the key");

        let _ = stop.send(());
        running.await.unwrap();
        assert_eq!(*ran.lock().unwrap(), ["2"], "the handler ran once, for the committed order");
        assert_eq!(x.calls().await.unwrap().len(), 1);
    }
}

/// What `submit_in_*` refuses, each a `DurableError` naming it, with nothing written: a
/// transaction of the other store's kind, an SQLite connection not in a transaction, or on
/// another file or in memory; and, as `submit`, an unknown handler and a key too long.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn submit_in_a_transaction_refuses_what_cannot_hold_the_call() {
    let wrong = |e: DurableError, has: &str| match e {
        DurableError::WrongTransaction(ref w) if w.contains(has) => {
            assert!(e.to_string().starts_with("levee durable: the caller's transaction: "), "{e}")
        }
        e => panic!("not WrongTransaction with `{has}`: {e:?}"),
    };
    let long = "k".repeat(levee::constants::GUARD_MAX_KEY_BYTES as usize + 1);
    for f in fixtures("outbox_refused").await {
        let x = executor(f.store.clone());
        x.handler("ship").policy("quick").register(|_, _| async { Ok::<_, std::io::Error>(()) }).unwrap();
        let mut db = f.caller().await;
        match (&f.raw, &mut db) {
            (Raw::Sqlite(path), Caller::Sqlite(c)) => {
                wrong(x.submit_in_sqlite(c, "ship", b"", None).unwrap_err(), "not in a transaction (autocommit mode)");
                let dir = path.parent().unwrap();
                let mut other = rusqlite::Connection::open(dir.join("other.db")).unwrap();
                wrong(
                    x.submit_in_sqlite(&other.transaction().unwrap(), "ship", b"", None).unwrap_err(),
                    "other.db, not on the store's file",
                );
                let mut memory = rusqlite::Connection::open_in_memory().unwrap();
                wrong(x.submit_in_sqlite(&memory.transaction().unwrap(), "ship", b"", None).unwrap_err(), "in-memory");
                let tx = c.transaction().unwrap();
                let e = x.submit_in_sqlite(&tx, "nope", b"", None).unwrap_err();
                assert!(matches!(&e, DurableError::UnknownHandler(h) if h == "nope"), "{e}");
                let e = x.submit_keyed_in_sqlite(&tx, "ship", b"", None, &long).unwrap_err();
                assert!(matches!(e, DurableError::KeyTooLong(_)), "{e}");
                tx.commit().unwrap();
            }
            (Raw::Postgres(_), Caller::Postgres(c)) => {
                let mut memory = rusqlite::Connection::open_in_memory().unwrap();
                let e = x.submit_in_sqlite(&memory.transaction().unwrap(), "ship", b"", None).unwrap_err();
                wrong(e, "is an SQLite transaction, but this executor's store is PostgreSQL");
                let dir = std::env::temp_dir().join(format!("levee-durable-rs-{}-outbox-kind", std::process::id()));
                std::fs::create_dir_all(&dir).unwrap();
                let on_sqlite = executor(SqliteStore::open(dir.join("calls.db")).await.unwrap().into());
                on_sqlite.handler("ship").policy("quick").register(|_, _| async { Ok::<_, std::io::Error>(()) }).unwrap();
                let tx = c.transaction().await.unwrap();
                let e = on_sqlite.submit_in_postgres(&tx, "ship", b"", None).await.unwrap_err();
                assert_eq!(
                    e.to_string(),
                    "levee durable: the caller's transaction: is a PostgreSQL transaction, but this executor's store is \
                     SQLite: submit with `submit` or a transaction on its store"
                );
                let e = x.submit_in_postgres(&tx, "nope", b"", None).await.unwrap_err();
                assert!(matches!(&e, DurableError::UnknownHandler(h) if h == "nope"), "{e}");
                let e = x.submit_keyed_in_postgres(&tx, "ship", b"", None, &long).await.unwrap_err();
                assert!(matches!(e, DurableError::KeyTooLong(_)), "{e}");
                tx.commit().await.unwrap(); // nothing failed in the transaction: nothing was sent
                assert!(on_sqlite.calls().await.unwrap().is_empty());
                let _ = std::fs::remove_dir_all(&dir);
            }
            _ => panic!("a caller of another kind than the fixture"),
        }
        assert!(x.calls().await.unwrap().is_empty(), "a refused submission wrote a call");
    }
}
