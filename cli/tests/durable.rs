//! `levee durable` on a real SQLite store built with the shared schema and the core's records.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

use std::process::{Command, Output};

use levee_core::durable::Record;
use levee_core::{Engine, OutcomeKind};
use rusqlite::{params, Connection};

const DOC: &str = "policies:\n  p:\n    attempts: 2\n    backoff: { kind: constant, base: 1s, cap: 1s, jitter: none }\n";
const SQL: &str = include_str!("../../durable/sqlite.sql");

fn levee(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_levee")).args(args).env("NO_COLOR", "1").output().expect("run levee")
}

fn statement(name: &str) -> &'static str {
    SQL.split("-- name: ").find_map(|b| b.split_once('\n').filter(|(h, _)| h.trim() == name).map(|(_, body)| body.trim())).unwrap()
}

fn now() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() as u64
}

#[test]
fn list_show_cancel_and_retry_a_store() {
    let dir = std::env::temp_dir().join(format!("levee-cli-durable-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let store = dir.join("calls.db");
    let _ = std::fs::remove_file(&store);
    let policy = dir.join("p.yaml");
    std::fs::write(&policy, DOC).unwrap();
    let c = Connection::open(&store).unwrap();
    c.execute_batch(statement("schema")).unwrap();
    let mut e = Engine::load(DOC, 1).unwrap();
    // call 1: pending; call 2: dead after two timeouts
    let t = now();
    for _ in 0..2 {
        let s = e.durable_begin(0, "", "", 0, t).unwrap();
        c.query_row(statement("insert"), params!["job", b"x".to_vec(), None::<String>, s.next_at as i64, s.record, t as i64], |_| Ok(()))
            .unwrap();
    }
    let rec: Vec<u8> = c.query_row("SELECT record FROM levee_durable_calls WHERE id = 2", [], |r| r.get(0)).unwrap();
    let mut s = e.durable_step(&rec, "w", t, 0).unwrap();
    s = e.durable_outcome(&s.record, "w", t, 0, OutcomeKind::Timeout, 0, "", "slow", 0).unwrap();
    s = e.durable_step(&s.record, "w", t + 1_000_000_000, 0).unwrap();
    s = e.durable_outcome(&s.record, "w", t + 1_000_000_000, 0, OutcomeKind::ConnectionError, 0, "", "refused", 0).unwrap();
    assert_eq!(Record::decode(&s.record).unwrap().attempts, 2);
    c.execute(
        "UPDATE levee_durable_calls SET status = 'dead', next_at = 0, attempts = 2, record = ?1, error = 'retries-exhausted' WHERE id = 2",
        params![s.record],
    )
    .unwrap();

    let out = levee(&["durable", "list", store.to_str().unwrap()]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    assert!(text.contains("scheduled") && text.contains("dead") && text.contains("retries-exhausted"), "{text}");
    let dead = levee(&["durable", "list", "--dead", "--json", store.to_str().unwrap()]);
    let lines: Vec<String> = String::from_utf8_lossy(&dead.stdout).lines().map(str::to_string).collect();
    assert_eq!(lines.len(), 1, "{lines:?}");
    assert!(lines[0].contains("attempt 2: connection-error: refused"), "{}", lines[0]);
    let show = levee(&["durable", "show", store.to_str().unwrap(), "2"]);
    assert!(String::from_utf8_lossy(&show.stdout).contains("\"failures\": 2"));

    assert!(levee(&["durable", "cancel", store.to_str().unwrap(), "1"]).status.success());
    assert!(!levee(&["durable", "cancel", store.to_str().unwrap(), "1"]).status.success(), "a cancelled call cannot be cancelled again");
    let retry = levee(&["durable", "retry", store.to_str().unwrap(), "2", "--policy", policy.to_str().unwrap()]);
    assert!(retry.status.success(), "{}", String::from_utf8_lossy(&retry.stderr));
    let status: (String, i64) =
        c.query_row("SELECT status, attempts FROM levee_durable_calls WHERE id = 2", [], |r| Ok((r.get(0)?, r.get(1)?))).unwrap();
    assert_eq!(status, ("scheduled".to_string(), 0));
    let missing = levee(&["durable", "list", dir.join("nope.db").to_str().unwrap()]);
    assert!(!missing.status.success());
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_file_that_is_not_a_store_is_named_in_the_error() {
    let dir = std::env::temp_dir().join(format!("levee-cli-notadb-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let notadb = dir.join("notadb");
    std::fs::write(&notadb, "this is not an SQLite file, it is long enough to have a header of a hundred bytes or more..........\n")
        .unwrap();
    // An SQLite database without the durable-call table.
    let empty = dir.join("empty.db");
    Connection::open(&empty).unwrap().execute_batch("CREATE TABLE other (x INTEGER);").unwrap();
    for file in [&notadb, &empty] {
        for args in [vec!["list"], vec!["show"], vec!["cancel"]] {
            let mut a = vec!["durable"];
            a.extend(args.iter().copied());
            a.push(file.to_str().unwrap());
            if args[0] != "list" {
                a.push("1");
            }
            let o = levee(&a);
            let err = String::from_utf8_lossy(&o.stderr);
            assert!(!o.status.success(), "{a:?}");
            assert!(err.contains(file.to_str().unwrap()) && err.contains("not a store of durable calls"), "{a:?}: {err}");
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn prune_deletes_finished_calls_older_than_the_retention_and_nothing_else() {
    let dir = std::env::temp_dir().join(format!("levee-cli-prune-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let store = dir.join("calls.db");
    let _ = std::fs::remove_file(&store);
    let c = Connection::open(&store).unwrap();
    c.execute_batch(statement("schema")).unwrap();
    let mut e = Engine::load(DOC, 1).unwrap();
    let t = now();
    let hour = 3_600_000_000_000u64;
    // (status, last written): two hours ago, or a minute ago.
    let rows = [
        ("done", t - 2 * hour),
        ("dead", t - 2 * hour),
        ("cancelled", t - 2 * hour),
        ("cancelled", t - 60_000_000_000),
        ("scheduled", t - 2 * hour),
        ("running", t - 2 * hour),
        ("quarantined", t - 2 * hour),
        ("done", t - 60_000_000_000),
    ];
    for (status, at) in rows {
        let s = e.durable_begin(0, "", "", 0, t).unwrap();
        c.query_row(statement("insert"), params!["job", b"x".to_vec(), None::<String>, s.next_at as i64, s.record, t as i64], |_| Ok(()))
            .unwrap();
        c.execute("UPDATE levee_durable_calls SET status = ?1, updated_at = ?2 WHERE id = last_insert_rowid()", params![status, at as i64])
            .unwrap();
    }
    let ids = || -> Vec<i64> {
        let mut st = c.prepare("SELECT id FROM levee_durable_calls ORDER BY id").unwrap();
        st.query_map([], |r| r.get(0)).unwrap().map(Result::unwrap).collect()
    };
    let s = store.to_str().unwrap();

    // Only the statuses named.
    let out = levee(&["durable", "prune", s, "--older-than", "1h", "--status", "dead"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "1 dead call deleted");
    assert_eq!(ids(), [1, 3, 4, 5, 6, 7, 8]);
    // Every finished status, older than an hour: never a recent one, a pending one or a quarantined one.
    let out = levee(&["durable", "prune", s, "--older-than", "1h"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "1 done call deleted\n0 dead calls deleted\n1 cancelled call deleted");
    assert_eq!(ids(), [4, 5, 6, 7, 8]);
    // Refusals name the option, and delete nothing.
    for (args, want) in [
        (vec!["--older-than", "1h", "--status", "scheduled"], "--status: `scheduled` is not a finished status"),
        (vec!["--older-than", "1h", "--status", "done,quarantined"], "--status: `quarantined` is not a finished status"),
        (vec!["--older-than", "7d"], "--older-than: `7d` has an unknown unit `d`"),
    ] {
        let mut a = vec!["durable", "prune", s];
        a.extend(args);
        let o = levee(&a);
        assert!(!o.status.success(), "{a:?}");
        assert!(String::from_utf8_lossy(&o.stderr).contains(want), "{a:?}: {}", String::from_utf8_lossy(&o.stderr));
    }
    assert_eq!(ids(), [4, 5, 6, 7, 8]);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A store to fill, SQLite or PostgreSQL (a schema of its own in the database of
/// `LEVEE_TEST_POSTGRES`), and the STORE argument that names it.
enum Fill {
    Sqlite(Connection),
    Postgres(postgres::Client),
}

impl Fill {
    fn insert(&mut self, handler: &str, status: &str, record: &[u8]) {
        match self {
            Fill::Sqlite(c) => {
                c.query_row(statement("insert"), params![handler, b"x".to_vec(), None::<String>, 1i64, record, now() as i64], |_| Ok(()))
                    .unwrap();
                c.execute("UPDATE levee_durable_calls SET status = ?1 WHERE id = last_insert_rowid()", params![status]).unwrap();
            }
            Fill::Postgres(c) => {
                let row = c.query_one(pg_statement("insert"), &[&handler, &b"x".to_vec(), &None::<String>, &1i64, &record]).unwrap();
                let id: i64 = row.get(0);
                c.execute("UPDATE levee_durable_calls SET status = $1 WHERE id = $2", &[&status, &id]).unwrap();
            }
        }
    }
}

fn pg_statement(name: &str) -> &'static str {
    const PG: &str = include_str!("../../durable/postgres.sql");
    PG.split("-- name: ").find_map(|b| b.split_once('\n').filter(|(h, _)| h.trim() == name).map(|(_, body)| body.trim())).unwrap()
}

/// Twelve calls: handlers `a` (odd ids) and `b`, policies `p` (ids 1-6) and `q`, keys `k1`
/// (ids divisible by 3) and ``; statuses cycling through scheduled, done, dead and quarantined.
fn fill_and_check(fill: &mut Fill, store: &str) {
    let doc = "policies:\n  p: { attempts: 2 }\n  q: { attempts: 2 }\n";
    let mut e = Engine::load(doc, 1).unwrap();
    let statuses = ["scheduled", "done", "dead", "quarantined"];
    for id in 1..=12u32 {
        let key = if id % 3 == 0 { "k1" } else { "" };
        let s = e.durable_begin(u32::from(id > 6), key, "", 0, now()).unwrap();
        fill.insert(if id % 2 == 1 { "a" } else { "b" }, statuses[(id as usize - 1) % 4], &s.record);
    }
    let ids = |args: &[&str]| -> Vec<i64> {
        let mut a = vec!["durable", "list", store, "--json"];
        a.extend(args);
        let o = levee(&a);
        assert!(o.status.success(), "{a:?}: {}", String::from_utf8_lossy(&o.stderr));
        String::from_utf8_lossy(&o.stdout)
            .lines()
            .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["id"].as_i64().unwrap())
            .collect()
    };
    assert_eq!(ids(&[]), (1..=12).collect::<Vec<_>>());
    assert_eq!(ids(&["--status", "done"]), [2, 6, 10]);
    assert_eq!(ids(&["--status", "done,dead"]), [2, 3, 6, 7, 10, 11]);
    assert_eq!(ids(&["--dead"]), [3, 4, 7, 8, 11, 12]);
    assert_eq!(ids(&["--handler", "b", "--status", "quarantined"]), [4, 8, 12]);
    assert_eq!(ids(&["--policy", "q"]), [7, 8, 9, 10, 11, 12]);
    assert_eq!(ids(&["--policy", "q", "--key", "k1"]), [9, 12]);
    // Paging: a page of 4, then the next after the last id shown, with a filter that skips rows.
    assert_eq!(ids(&["--limit", "4"]), [1, 2, 3, 4]);
    assert_eq!(ids(&["--limit", "2", "--handler", "a", "--after", "3"]), [5, 7]);
    let text = levee(&["durable", "list", store, "--limit", "2", "--status", "dead"]);
    let text = String::from_utf8_lossy(&text.stdout).to_string();
    assert!(text.trim_end().ends_with("(more: add --after 7)"), "{text}");
    let counts = levee(&["durable", "counts", store, "--json"]);
    let counts: serde_json::Value = serde_json::from_slice(&counts.stdout).unwrap();
    assert_eq!(counts, serde_json::json!({"scheduled": 3, "running": 0, "done": 3, "dead": 3, "cancelled": 0, "quarantined": 3}));
    let bad = levee(&["durable", "list", store, "--status", "finished"]);
    assert!(String::from_utf8_lossy(&bad.stderr).contains("--status: `finished` is not a status"));
    // Cancel and retry through the core; prune by the store's clock.
    assert!(levee(&["durable", "cancel", store, "1"]).status.success());
    assert_eq!(ids(&["--status", "cancelled"]), [1]);
    let policy = std::env::temp_dir().join(format!("levee-cli-page-{}.yaml", std::process::id()));
    std::fs::write(&policy, doc).unwrap();
    let retry = levee(&["durable", "retry", store, "1", "--policy", policy.to_str().unwrap()]);
    assert!(retry.status.success(), "{}", String::from_utf8_lossy(&retry.stderr));
    let _ = std::fs::remove_file(&policy);
    assert_eq!(ids(&["--status", "scheduled"]), [1, 5, 9]);
    let pruned = levee(&["durable", "prune", store, "--older-than", "0s", "--status", "done"]);
    assert_eq!(String::from_utf8_lossy(&pruned.stdout).trim(), "3 done calls deleted");
    assert_eq!(ids(&["--status", "done"]), Vec::<i64>::new());
}

#[test]
fn list_filters_pages_and_counts_an_sqlite_store() {
    let dir = std::env::temp_dir().join(format!("levee-cli-page-sqlite-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let store = dir.join("calls.db");
    let _ = std::fs::remove_file(&store);
    let c = Connection::open(&store).unwrap();
    c.execute_batch(statement("schema")).unwrap();
    fill_and_check(&mut Fill::Sqlite(c), store.to_str().unwrap());
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn list_filters_pages_and_counts_a_postgres_store() {
    let Ok(dsn) = std::env::var("LEVEE_TEST_POSTGRES") else {
        assert!(std::env::var_os("LEVEE_REQUIRE_POSTGRES").is_none(), "LEVEE_REQUIRE_POSTGRES is set but LEVEE_TEST_POSTGRES is not");
        eprintln!("skipped: set LEVEE_TEST_POSTGRES to a conninfo to run `levee durable` on PostgreSQL");
        return;
    };
    let schema = format!("levee_cli_{}", std::process::id());
    let mut admin = postgres::Client::connect(&dsn, postgres::NoTls).unwrap();
    admin.batch_execute(&format!("DROP SCHEMA IF EXISTS {schema} CASCADE; CREATE SCHEMA {schema}")).unwrap();
    let store = format!("{dsn} options='-csearch_path={schema}'");
    let mut c = postgres::Client::connect(&store, postgres::NoTls).unwrap();
    c.batch_execute(pg_statement("schema")).unwrap();
    fill_and_check(&mut Fill::Postgres(c), &store);
    // A database without the table is named, with no password in the message.
    let empty = format!("{dsn} password=secret options='-csearch_path=levee_cli_none'");
    let o = levee(&["durable", "list", &empty]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains("not a store of durable calls") && !err.contains("secret"), "{err}");
    admin.batch_execute(&format!("DROP SCHEMA {schema} CASCADE")).unwrap();
}
