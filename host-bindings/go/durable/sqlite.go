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

func (s *SQLiteStore) insert(ctx context.Context, handler string, payload []byte, key *string, nextAt uint64, record []byte) (int64, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	var id int64
	found := false
	err := s.tx(ctx, func() error {
		err := s.conn.QueryRowContext(ctx, s.sql["insert"], handler, payload, key, i64(nextAt), record, wallNow()).Scan(&id)
		if errors.Is(err, sql.ErrNoRows) && key != nil {
			err = s.conn.QueryRowContext(ctx, s.sql["find_by_key"], *key).Scan(&id)
		}
		if err == nil {
			found = true
		} else if errors.Is(err, sql.ErrNoRows) {
			err = nil
		}
		return err
	})
	if err == nil && !found {
		err = errNotAccepted
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
