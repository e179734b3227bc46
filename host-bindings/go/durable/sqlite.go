package durable

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"sync"
	"time"

	_ "modernc.org/sqlite" // the "sqlite" database/sql driver (pure Go)
)

// SQLiteStore is a store in one SQLite file (WAL mode), for one machine: several processes may
// share the file, and claims run in BEGIN IMMEDIATE transactions. Its clock is this host's.
type SQLiteStore struct {
	db   *sql.DB
	conn *sql.Conn
	mu   sync.Mutex // one statement at a time on the one connection
	sql  map[string]string
	file string // the database file, as SQLite names it (PRAGMA database_list)
}

// OpenSQLite opens (creating when missing) the store in the SQLite file at path.
func OpenSQLite(ctx context.Context, path string) (*SQLiteStore, error) {
	stmts, err := Statements("sqlite")
	if err != nil {
		return nil, err
	}
	db, err := sql.Open("sqlite", path)
	if err != nil {
		return nil, err
	}
	conn, err := db.Conn(ctx)
	if err != nil {
		_ = db.Close()
		return nil, err
	}
	s := &SQLiteStore{db: db, conn: conn, sql: stmts}
	for _, q := range []string{"PRAGMA busy_timeout=30000", "PRAGMA journal_mode=WAL", "PRAGMA synchronous=NORMAL", stmts["schema"]} {
		if _, err := conn.ExecContext(ctx, q); err != nil {
			_ = s.Close()
			return nil, fmt.Errorf("levee durable: opening %s: %w", path, err)
		}
	}
	if s.file, err = mainFile(ctx, conn); err != nil {
		_ = s.Close()
		return nil, fmt.Errorf("levee durable: opening %s: %w", path, err)
	}
	return s, nil
}

// Dialect is "sqlite".
func (s *SQLiteStore) Dialect() string { return "sqlite" }

// Close closes the file.
func (s *SQLiteStore) Close() error {
	return errors.Join(s.conn.Close(), s.db.Close())
}

func (s *SQLiteStore) now(context.Context) (uint64, error) { return uint64(time.Now().UnixNano()), nil }

func wallNow() int64 { return time.Now().UnixNano() }

// tx runs f between BEGIN IMMEDIATE and COMMIT (ROLLBACK on error) on the store's connection.
func (s *SQLiteStore) tx(ctx context.Context, f func() error) error {
	if _, err := s.conn.ExecContext(ctx, "BEGIN IMMEDIATE"); err != nil {
		return err
	}
	if err := f(); err != nil {
		_, rerr := s.conn.ExecContext(context.WithoutCancel(ctx), "ROLLBACK")
		return errors.Join(err, rerr)
	}
	_, err := s.conn.ExecContext(ctx, "COMMIT")
	return err
}

// sqlQuerier is what inserting needs of a connection: the store's *sql.Conn or the caller's *sql.Tx.
type sqlQuerier interface {
	QueryRowContext(ctx context.Context, query string, args ...any) *sql.Row
}

// sqliteSubmitter inserts through the store's connection (tx nil: in a BEGIN IMMEDIATE
// transaction of its own) or through the caller's transaction.
type sqliteSubmitter struct {
	s  *SQLiteStore
	tx *sql.Tx
}

func (s *SQLiteStore) submitter(ctx context.Context, tx any) (submitter, error) {
	if tx == nil {
		return sqliteSubmitter{s: s}, nil
	}
	t, ok := tx.(*sql.Tx)
	if !ok {
		return nil, errTx("sqlite", fmt.Sprintf("a %T cannot submit to an SQLite store, which takes a *sql.Tx (database/sql) on its file", tx))
	}
	if t == nil {
		return nil, errTx("sqlite", "a nil *sql.Tx")
	}
	file, err := mainFile(ctx, t)
	if err != nil {
		return nil, errTx("sqlite", fmt.Sprintf("reading the transaction's database file (is it an SQLite database?): %v", err))
	}
	if s.file == "" || file != s.file {
		return nil, errTx("sqlite", fmt.Sprintf("the transaction is on the file %q, the store on %q", file, s.file))
	}
	return sqliteSubmitter{s: s, tx: t}, nil
}

// mainFile is the file of the main database of q's connection ("" for one in memory).
func mainFile(ctx context.Context, q interface {
	QueryContext(ctx context.Context, query string, args ...any) (*sql.Rows, error)
}) (string, error) {
	rs, err := q.QueryContext(ctx, "PRAGMA database_list")
	if err != nil {
		return "", err
	}
	defer rs.Close()
	file := ""
	for rs.Next() {
		var seq int64
		var name, f string
		if err := rs.Scan(&seq, &name, &f); err != nil {
			return "", err
		}
		if name == "main" {
			file = f
		}
	}
	return file, rs.Err()
}

// now is this host's clock, as for every SQLite statement.
func (u sqliteSubmitter) now(ctx context.Context) (uint64, error) { return u.s.now(ctx) }

func (u sqliteSubmitter) insert(ctx context.Context, handler string, payload []byte, key *string, nextAt uint64, record []byte) (int64, error) {
	if u.tx != nil {
		return u.s.insertOn(ctx, u.tx, handler, payload, key, nextAt, record)
	}
	u.s.mu.Lock()
	defer u.s.mu.Unlock()
	var id int64
	err := u.s.tx(ctx, func() error {
		var err error
		id, err = u.s.insertOn(ctx, u.s.conn, handler, payload, key, nextAt, record)
		return err
	})
	return id, err
}

// insertOn runs the shared `insert` (and `find_by_key` when the key is taken) on q.
func (s *SQLiteStore) insertOn(ctx context.Context, q sqlQuerier, handler string, payload []byte, key *string, nextAt uint64, record []byte) (int64, error) {
	var id int64
	err := q.QueryRowContext(ctx, s.sql["insert"], handler, payload, key, i64(nextAt), record, wallNow()).Scan(&id)
	if errors.Is(err, sql.ErrNoRows) && key != nil {
		err = q.QueryRowContext(ctx, s.sql["find_by_key"], *key).Scan(&id)
	}
	if errors.Is(err, sql.ErrNoRows) {
		return 0, errNotAccepted
	}
	return id, err
}

func (s *SQLiteStore) claim(ctx context.Context, owner string, hold uint64, limit int) ([]claimed, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	now := wallNow()
	var out []claimed
	err := s.tx(ctx, func() error {
		out = out[:0]
		rs, err := s.conn.QueryContext(ctx, s.sql["claim"], owner, now+i64(hold), now, limit)
		if err != nil {
			return err
		}
		defer rs.Close()
		for rs.Next() {
			c, err := scanClaimed(rs)
			if err != nil {
				return err
			}
			out = append(out, c)
		}
		return rs.Err()
	})
	if err != nil {
		return nil, err
	}
	return out, nil
}

func (s *SQLiteStore) exec(ctx context.Context, name string, args ...any) (int64, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	r, err := s.conn.ExecContext(ctx, s.sql[name], args...)
	if err != nil {
		return 0, err
	}
	return r.RowsAffected()
}

func (s *SQLiteStore) write(ctx context.Context, id int64, owner string, w writeArgs) (bool, error) {
	n, err := s.exec(ctx, "write", w.status, i64(w.nextAt), int64(w.attempts), w.leaseOwner, w.record, w.result, w.err,
		wallNow(), id, owner)
	return n == 1, err
}

func (s *SQLiteStore) quarantine(ctx context.Context, id int64, msg string) error {
	_, err := s.exec(ctx, "quarantine", msg, wallNow(), id)
	return err
}

func (s *SQLiteStore) replace(ctx context.Context, id int64, status string, nextAt uint64, attempts uint32, record []byte,
	msg *string, old []byte) (bool, error) {
	n, err := s.exec(ctx, "replace", status, i64(nextAt), int64(attempts), record, msg, wallNow(), id, old)
	return n == 1, err
}

func (s *SQLiteStore) get(ctx context.Context, id int64) (*row, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	r, err := scanRow(s.conn.QueryRowContext(ctx, s.sql["get"], id))
	if errors.Is(err, sql.ErrNoRows) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	return &r, nil
}

func (s *SQLiteStore) rows(ctx context.Context, deadOnly bool) ([]row, error) {
	name := "list"
	if deadOnly {
		name = "list_dead"
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	rs, err := s.conn.QueryContext(ctx, s.sql[name])
	if err != nil {
		return nil, err
	}
	defer rs.Close()
	var out []row
	for rs.Next() {
		r, err := scanRow(rs)
		if err != nil {
			return nil, err
		}
		out = append(out, r)
	}
	return out, rs.Err()
}

func (s *SQLiteStore) nextDueIn(ctx context.Context) (int64, bool, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	var next sql.NullInt64
	if err := s.conn.QueryRowContext(ctx, s.sql["next_due"]).Scan(&next); err != nil {
		return 0, false, err
	}
	if !next.Valid {
		return 0, false, nil
	}
	return next.Int64 - wallNow(), true, nil
}

func (s *SQLiteStore) counts(ctx context.Context) (map[string]int64, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return countRows(s.conn.QueryContext(ctx, s.sql["counts"]))
}

func countRows(rs *sql.Rows, err error) (map[string]int64, error) {
	if err != nil {
		return nil, err
	}
	defer rs.Close()
	out := map[string]int64{}
	for rs.Next() {
		var st string
		var n int64
		if err := rs.Scan(&st, &n); err != nil {
			return nil, err
		}
		out[st] = n
	}
	return out, rs.Err()
}
