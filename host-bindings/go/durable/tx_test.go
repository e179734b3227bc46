package durable

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	levee "github.com/levee-dev/levee/host-bindings/go"
)

// SubmitTx against real stores: an SQLite file per test, and PostgreSQL when
// LEVEE_TEST_POSTGRES names a database (durable/tests/run.sh sets it for the server it starts on
// 127.0.0.1, as for the Rust executor's tests); each test then works in a schema of its own.

// txStore is a store with the caller's side of it: the caller's own connection to the same
// database, on which it opens transactions and keeps a table of its own (orders).
type txStore struct {
	name  string
	x     *Executor
	begin func() (callerTx, error)
	// orders counts the caller's rows, read outside any transaction.
	orders func(t *testing.T) int64
}

type callerTx struct {
	tx       any
	exec     func(q string) error
	commit   func() error
	rollback func() error
}

var schemaN atomic.Int32

func txStores(t *testing.T) ([]txStore, context.Context) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	t.Cleanup(cancel)
	e, err := levee.Load(ctx, testDoc)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = e.Close(context.Background()) })
	opts := []Option{WithOwner("test"), WithPollInterval(20 * time.Millisecond), WithClaimHold(time.Second)}
	var out []txStore

	// SQLite: the caller opens the same file with database/sql, waiting on a locked file.
	path := filepath.Join(t.TempDir(), "calls.db")
	s, err := OpenSQLite(ctx, path)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = s.Close() })
	db, err := sql.Open("sqlite", path+"?_pragma=busy_timeout(30000)&_txlock=immediate")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = db.Close() })
	if _, err := db.ExecContext(ctx, "CREATE TABLE orders (id BIGINT PRIMARY KEY, total BIGINT NOT NULL)"); err != nil {
		t.Fatal(err)
	}
	out = append(out, txStore{
		name: "sqlite",
		x:    New(e, s, opts...),
		begin: func() (callerTx, error) {
			tx, err := db.BeginTx(ctx, nil)
			if err != nil {
				return callerTx{}, err
			}
			return callerTx{
				tx:       tx,
				exec:     func(q string) error { _, err := tx.ExecContext(ctx, q); return err },
				commit:   tx.Commit,
				rollback: tx.Rollback,
			}, nil
		},
		orders: func(t *testing.T) int64 {
			var n int64
			if err := db.QueryRowContext(ctx, "SELECT count(*) FROM orders").Scan(&n); err != nil {
				t.Fatal(err)
			}
			return n
		},
	})

	dsn := os.Getenv("LEVEE_TEST_POSTGRES")
	if dsn == "" {
		t.Log("LEVEE_TEST_POSTGRES is not set: SQLite only")
		return out, ctx
	}
	schema := fmt.Sprintf("levee_go_%d_%d", os.Getpid(), schemaN.Add(1))
	admin, err := pgx.Connect(ctx, dsn)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := admin.Exec(ctx, fmt.Sprintf("DROP SCHEMA IF EXISTS %s CASCADE", schema)); err != nil {
		t.Fatal(err)
	}
	if _, err := admin.Exec(ctx, fmt.Sprintf("CREATE SCHEMA %s", schema)); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_, _ = admin.Exec(context.Background(), fmt.Sprintf("DROP SCHEMA IF EXISTS %s CASCADE", schema))
		_ = admin.Close(context.Background())
	})
	in := dsn + " search_path=" + schema
	ps, err := OpenPostgres(ctx, in)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = ps.Close() })
	pool, err := pgxpool.New(ctx, in) // the caller's own pool
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	if _, err := pool.Exec(ctx, "CREATE TABLE orders (id BIGINT PRIMARY KEY, total BIGINT NOT NULL)"); err != nil {
		t.Fatal(err)
	}
	out = append(out, txStore{
		name: "postgres",
		x:    New(e, ps, opts...),
		begin: func() (callerTx, error) {
			tx, err := pool.Begin(ctx)
			if err != nil {
				return callerTx{}, err
			}
			return callerTx{
				tx:       tx,
				exec:     func(q string) error { _, err := tx.Exec(ctx, q); return err },
				commit:   func() error { return tx.Commit(ctx) },
				rollback: func() error { return tx.Rollback(ctx) },
			}, nil
		},
		orders: func(t *testing.T) int64 {
			var n int64
			if err := pool.QueryRow(ctx, "SELECT count(*) FROM orders").Scan(&n); err != nil {
				t.Fatal(err)
			}
			return n
		},
	})
	return out, ctx
}

func mustBegin(t *testing.T, st txStore) callerTx {
	t.Helper()
	c, err := st.begin()
	if err != nil {
		t.Fatal(err)
	}
	return c
}

func registerCounting(t *testing.T, x *Executor, runs *atomic.Int32) {
	t.Helper()
	err := x.Register("invoice", func(_ context.Context, payload []byte, _ Call) ([]byte, error) {
		runs.Add(1)
		return append([]byte("sent "), payload...), nil
	}, WithPolicy("quick"))
	if err != nil {
		t.Fatal(err)
	}
}

// The caller's row and the call are written together or not at all: a rollback leaves neither,
// and the handler never runs.
func TestSubmitTxRolledBackLeavesNeitherTheRowNorTheCall(t *testing.T) {
	stores, ctx := txStores(t)
	for _, st := range stores {
		t.Run(st.name, func(t *testing.T) {
			var runs atomic.Int32
			registerCounting(t, st.x, &runs)
			c := mustBegin(t, st)
			if err := c.exec("INSERT INTO orders (id, total) VALUES (17, 100)"); err != nil {
				t.Fatal(err)
			}
			id, err := st.x.SubmitTx(ctx, c.tx, "invoice", []byte("17"), "invoice-17")
			if err != nil || id <= 0 {
				t.Fatalf("SubmitTx: %d %v", id, err)
			}
			if err := c.rollback(); err != nil {
				t.Fatal(err)
			}
			if n := st.orders(t); n != 0 {
				t.Errorf("%d rows of orders after the rollback", n)
			}
			calls, err := st.x.Calls(ctx)
			if err != nil || len(calls) != 0 {
				t.Fatalf("calls after the rollback: %+v %v", calls, err)
			}
			if _, ok, err := st.x.Status(ctx, id); ok || err != nil {
				t.Fatalf("the rolled-back call %d has a status: %v %v", id, ok, err)
			}
			if err := st.x.RunUntilIdle(ctx); err != nil {
				t.Fatal(err)
			}
			if runs.Load() != 0 {
				t.Fatalf("the handler of a rolled-back call ran %d times", runs.Load())
			}
			// The key is free again: a later submission takes it.
			again, err := st.x.Submit(ctx, "invoice", []byte("17"), "invoice-17")
			if err != nil {
				t.Fatal(err)
			}
			if s := status(t, ctx, st.x, again); s.Status != "scheduled" || s.IdempotencyKey != "invoice-17" {
				t.Fatalf("the key after the rollback: %+v", s)
			}
		})
	}
}

// After the commit, a running executor sees the call at its next poll and runs it to the end.
func TestSubmitTxCommittedRunsOnTheNextPoll(t *testing.T) {
	stores, ctx := txStores(t)
	for _, st := range stores {
		t.Run(st.name, func(t *testing.T) {
			var runs atomic.Int32
			registerCounting(t, st.x, &runs)
			runCtx, stop := context.WithCancel(ctx)
			done := make(chan error, 1)
			go func() { done <- st.x.Run(runCtx) }()
			defer func() {
				stop()
				if err := <-done; err != nil && !errors.Is(err, context.Canceled) {
					t.Errorf("Run: %v", err)
				}
			}()

			c := mustBegin(t, st)
			if err := c.exec("INSERT INTO orders (id, total) VALUES (18, 250)"); err != nil {
				t.Fatal(err)
			}
			id, err := st.x.SubmitKeyedTx(ctx, c.tx, "invoice", []byte("18"), "invoice-18", "mail.example")
			if err != nil {
				t.Fatal(err)
			}
			time.Sleep(100 * time.Millisecond) // five polls: the uncommitted call is not run
			if runs.Load() != 0 {
				t.Fatalf("a call ran before its transaction committed (%d runs)", runs.Load())
			}
			if err := c.commit(); err != nil {
				t.Fatal(err)
			}
			deadline := time.Now().Add(10 * time.Second)
			var s CallStatus
			for time.Now().Before(deadline) {
				s = status(t, ctx, st.x, id)
				if s.Status == "done" {
					break
				}
				time.Sleep(10 * time.Millisecond)
			}
			if s.Status != "done" || s.Attempts != 1 || string(s.Result) != "sent 18" || s.IdempotencyKey != "invoice-18" ||
				s.Record["policy"] != "quick" || s.Record["key"] != "mail.example" {
				t.Fatalf("after the commit: %+v", s)
			}
			if runs.Load() != 1 || st.orders(t) != 1 {
				t.Fatalf("%d runs, %d orders", runs.Load(), st.orders(t))
			}
		})
	}
}

// The idempotency key holds inside a transaction, and across it: every later submission with
// the key returns the first call's id and adds nothing.
func TestSubmitTxIdempotencyKeyReturnsTheFirstID(t *testing.T) {
	stores, ctx := txStores(t)
	for _, st := range stores {
		t.Run(st.name, func(t *testing.T) {
			var runs atomic.Int32
			registerCounting(t, st.x, &runs)
			c := mustBegin(t, st)
			first, err := st.x.SubmitTx(ctx, c.tx, "invoice", []byte("19"), "invoice-19")
			if err != nil {
				t.Fatal(err)
			}
			second, err := st.x.SubmitTx(ctx, c.tx, "invoice", []byte("other"), "invoice-19")
			if err != nil || second != first {
				t.Fatalf("a second submission in the transaction: id %d (first %d), %v", second, first, err)
			}
			if err := c.commit(); err != nil {
				t.Fatal(err)
			}
			c = mustBegin(t, st)
			third, err := st.x.SubmitTx(ctx, c.tx, "invoice", nil, "invoice-19")
			if err != nil || third != first {
				t.Fatalf("in a later transaction: id %d (first %d), %v", third, first, err)
			}
			if err := c.commit(); err != nil {
				t.Fatal(err)
			}
			if own, err := st.x.Submit(ctx, "invoice", nil, "invoice-19"); err != nil || own != first {
				t.Fatalf("Submit: id %d (first %d), %v", own, first, err)
			}
			calls, err := st.x.Calls(ctx)
			if err != nil || len(calls) != 1 {
				t.Fatalf("calls: %+v %v", calls, err)
			}
			if err := st.x.RunUntilIdle(ctx); err != nil {
				t.Fatal(err)
			}
			if s := status(t, ctx, st.x, first); s.Status != "done" || string(s.Result) != "sent 19" || runs.Load() != 1 {
				t.Fatalf("after the run: %+v, %d runs", s, runs.Load())
			}
		})
	}
}

// Two transactions submitting with one key at once: the second waits for the first (SQLite:
// for the file's write lock; PostgreSQL: on the key's unique index) and, once the first
// commits, returns its id.
func TestSubmitTxConcurrentTransactionsShareTheKey(t *testing.T) {
	stores, ctx := txStores(t)
	for _, st := range stores {
		t.Run(st.name, func(t *testing.T) {
			var runs atomic.Int32
			registerCounting(t, st.x, &runs)
			a := mustBegin(t, st)
			first, err := st.x.SubmitTx(ctx, a.tx, "invoice", []byte("21"), "invoice-21")
			if err != nil {
				t.Fatal(err)
			}
			type result struct {
				id  int64
				err error
			}
			got := make(chan result, 1)
			go func() {
				b, err := st.begin()
				if err != nil {
					got <- result{0, err}
					return
				}
				id, err := st.x.SubmitTx(ctx, b.tx, "invoice", []byte("21"), "invoice-21")
				if err != nil {
					_ = b.rollback()
					got <- result{0, err}
					return
				}
				got <- result{id, b.commit()}
			}()
			select {
			case r := <-got:
				t.Fatalf("the second transaction did not wait for the first: %+v", r)
			case <-time.After(100 * time.Millisecond):
			}
			if err := a.commit(); err != nil {
				t.Fatal(err)
			}
			r := <-got
			if r.err != nil || r.id != first {
				t.Fatalf("the second transaction: id %d (first %d), %v", r.id, first, r.err)
			}
			if calls, err := st.x.Calls(ctx); err != nil || len(calls) != 1 {
				t.Fatalf("calls: %+v %v", calls, err)
			}
		})
	}
}

// What Submit refuses SubmitTx refuses the same way, and a transaction of the wrong kind or on
// another database is an error naming it, with nothing written.
func TestSubmitTxRefusesWhatItCannotUse(t *testing.T) {
	stores, ctx := txStores(t)
	for _, st := range stores {
		t.Run(st.name, func(t *testing.T) {
			var runs atomic.Int32
			registerCounting(t, st.x, &runs)
			c := mustBegin(t, st)
			defer func() { _ = c.rollback() }()
			check := func(what string, err error, want ...string) {
				t.Helper()
				if err == nil {
					t.Fatalf("%s: no error", what)
				}
				for _, w := range want {
					if !strings.Contains(err.Error(), w) {
						t.Errorf("%s: %q does not say %q", what, err, w)
					}
				}
			}
			_, err := st.x.SubmitTx(ctx, nil, "invoice", nil, "")
			check("a nil tx", err, "levee durable: tx: nil", "(the store is "+st.name+")")
			_, err = st.x.SubmitTx(ctx, (*sql.Tx)(nil), "invoice", nil, "")
			check("a nil *sql.Tx", err, "levee durable: tx: nil")
			_, err = st.x.SubmitTx(ctx, "BEGIN", "invoice", nil, "")
			check("a string", err, "levee durable: tx: a string cannot submit to")
			_, err = st.x.SubmitTx(ctx, c.tx, "nope", nil, "")
			check("no handler", err, "no durable handler named `nope`")
			long := strings.Repeat("k", levee.MaxKeyBytes+1)
			if _, err := st.x.SubmitKeyedTx(ctx, c.tx, "invoice", nil, "", long); !errors.Is(err, levee.ErrKeyTooLong) {
				t.Errorf("a key too long: %v", err)
			}

			// A transaction of the other dialect.
			switch st.name {
			case "sqlite":
				var p pgx.Tx = fakePgxTx{}
				_, err = st.x.SubmitTx(ctx, p, "invoice", nil, "")
				check("a pgx.Tx", err, "levee durable: tx: a durable.fakePgxTx cannot submit to an SQLite store, which takes a *sql.Tx")
				// A *sql.Tx on another SQLite file.
				_, err = st.x.SubmitTx(ctx, otherSQLiteTx(t, ctx), "invoice", nil, "")
				check("another file", err, "levee durable: tx: the transaction is on the file", "other.db", "calls.db")
			case "postgres":
				_, err = st.x.SubmitTx(ctx, otherSQLiteTx(t, ctx), "invoice", nil, "")
				check("a *sql.Tx", err, "levee durable: tx: a *sql.Tx cannot submit to a PostgreSQL store, which takes a pgx.Tx")
				// A pgx.Tx on a connection whose search_path has no table of calls.
				conn, err := pgx.Connect(ctx, os.Getenv("LEVEE_TEST_POSTGRES")+" search_path=nowhere")
				if err != nil {
					t.Fatal(err)
				}
				defer conn.Close(context.Background())
				ptx, err := conn.Begin(ctx)
				if err != nil {
					t.Fatal(err)
				}
				defer func() { _ = ptx.Rollback(context.Background()) }()
				_, err = st.x.SubmitTx(ctx, ptx, "invoice", nil, "")
				check("another search_path", err, "levee durable: tx: the transaction sees no table levee_durable_calls")
			}
			// The caller's transaction is still usable, and nothing was written.
			if err := c.exec("INSERT INTO orders (id, total) VALUES (20, 1)"); err != nil {
				t.Fatalf("the caller's transaction after the refusals: %v", err)
			}
			if calls, err := st.x.Calls(ctx); err != nil || len(calls) != 0 {
				t.Fatalf("calls: %+v %v", calls, err)
			}
		})
	}
}

// fakePgxTx is a pgx.Tx that is not one, for the dialect check (never called).
type fakePgxTx struct{ pgx.Tx }

// otherSQLiteTx is an open transaction on a fresh SQLite file that is not the store's, rolled
// back and closed when the test ends.
func otherSQLiteTx(t *testing.T, ctx context.Context) *sql.Tx {
	t.Helper()
	db, err := sql.Open("sqlite", filepath.Join(t.TempDir(), "other.db"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = db.Close() })
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = tx.Rollback() })
	return tx
}
