package durable

import (
	"context"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// PostgresStore is a store in PostgreSQL, shared by processes on several machines. The
// database's clock is the one clock (every statement reads it itself); claims skip the rows
// other workers hold (FOR UPDATE SKIP LOCKED), so workers never wait on one another.
type PostgresStore struct {
	pool *pgxpool.Pool
	sql  map[string]string
}

// OpenPostgres connects to the database conninfo names (a libpq keyword/value string or a
// postgres:// URL) and creates the table when missing.
func OpenPostgres(ctx context.Context, conninfo string) (*PostgresStore, error) {
	stmts, err := Statements("postgres")
	if err != nil {
		return nil, err
	}
	cfg, err := pgxpool.ParseConfig(conninfo)
	if err != nil {
		return nil, err
	}
	if cfg.MaxConns > 8 {
		cfg.MaxConns = 8
	}
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, err
	}
	s := &PostgresStore{pool: pool, sql: stmts}
	if err := s.schema(ctx); err != nil {
		pool.Close()
		return nil, fmt.Errorf("levee durable: creating the table: %w", err)
	}
	return s, nil
}

// schema creates the table, one process at a time (the key every host's store uses).
func (s *PostgresStore) schema(ctx context.Context) error {
	conn, err := s.pool.Acquire(ctx)
	if err != nil {
		return err
	}
	defer conn.Release()
	if _, err := conn.Exec(ctx, "SELECT pg_advisory_lock(7467001)"); err != nil {
		return err
	}
	// No arguments: the simple protocol, which runs the two statements of `schema`.
	_, err = conn.Exec(ctx, s.sql["schema"], pgx.QueryExecModeSimpleProtocol)
	_, uerr := conn.Exec(context.WithoutCancel(ctx), "SELECT pg_advisory_unlock(7467001)")
	return errors.Join(err, uerr)
}

// Dialect is "postgres".
func (s *PostgresStore) Dialect() string { return "postgres" }

// Close closes the connections.
func (s *PostgresStore) Close() error {
	s.pool.Close()
	return nil
}

func (s *PostgresStore) now(ctx context.Context) (uint64, error) { return pgSubmitter{s: s}.now(ctx) }

// pgQuerier is what submitting needs of a connection: the store's pool or a transaction.
type pgQuerier interface {
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// pgSubmitter reads the database's clock and inserts through the store's pool (tx nil: the
// insert in a transaction of its own) or through the caller's transaction.
type pgSubmitter struct {
	s  *PostgresStore
	tx pgx.Tx
}

// tableOf names the table an unqualified levee_durable_calls resolves to on q's connection
// (its database and the table's oid, 0 when there is none), so that a transaction on another
// database or search_path is refused rather than given calls no executor of this store sees.
const tableOf = "SELECT current_database(), COALESCE(to_regclass('levee_durable_calls')::oid, 0)::BIGINT"

func (s *PostgresStore) submitter(ctx context.Context, tx any) (submitter, error) {
	if tx == nil {
		return pgSubmitter{s: s}, nil
	}
	t, ok := tx.(pgx.Tx)
	if !ok {
		return nil, errTx("postgres", fmt.Sprintf("a %T cannot submit to a PostgreSQL store, which takes a pgx.Tx (github.com/jackc/pgx/v5)", tx))
	}
	var db, txDB string
	var oid, txOID int64
	err := s.pool.QueryRow(ctx, tableOf).Scan(&db, &oid)
	if err != nil {
		return nil, err
	}
	if err := t.QueryRow(ctx, tableOf).Scan(&txDB, &txOID); err != nil {
		return nil, errTx("postgres", fmt.Sprintf("reading the transaction's database: %v", err))
	}
	if txDB != db || txOID != oid {
		where := fmt.Sprintf("the table levee_durable_calls of the database %q", txDB)
		if txOID == 0 {
			where = fmt.Sprintf("no table levee_durable_calls (database %q; another search_path?)", txDB)
		}
		return nil, errTx("postgres", fmt.Sprintf("the transaction sees %s, not the store's (database %q)", where, db))
	}
	return pgSubmitter{s: s, tx: t}, nil
}

// now is the database's clock, read through the caller's transaction when there is one.
func (u pgSubmitter) now(ctx context.Context) (uint64, error) {
	var q pgQuerier = u.s.pool
	if u.tx != nil {
		q = u.tx
	}
	var n int64
	err := q.QueryRow(ctx, u.s.sql["clock"]).Scan(&n)
	return uint64(max(n, 0)), err
}

func (u pgSubmitter) insert(ctx context.Context, handler string, payload []byte, key *string, nextAt uint64, record []byte) (int64, error) {
	if u.tx != nil {
		return u.s.insertOn(ctx, u.tx, handler, payload, key, nextAt, record)
	}
	var id int64
	err := pgx.BeginFunc(ctx, u.s.pool, func(tx pgx.Tx) error {
		var err error
		id, err = u.s.insertOn(ctx, tx, handler, payload, key, nextAt, record)
		return err
	})
	return id, err
}

// insertOn runs the shared `insert` (and `find_by_key` when the key is taken) on q.
func (s *PostgresStore) insertOn(ctx context.Context, q pgQuerier, handler string, payload []byte, key *string, nextAt uint64, record []byte) (int64, error) {
	var id int64
	err := q.QueryRow(ctx, s.sql["insert"], handler, payload, key, i64(nextAt), record).Scan(&id)
	if errors.Is(err, pgx.ErrNoRows) && key != nil {
		err = q.QueryRow(ctx, s.sql["find_by_key"], *key).Scan(&id)
	}
	if errors.Is(err, pgx.ErrNoRows) {
		return 0, errNotAccepted
	}
	return id, err
}

func (s *PostgresStore) claim(ctx context.Context, owner string, hold uint64, limit int) ([]claimed, error) {
	rs, err := s.pool.Query(ctx, s.sql["claim"], owner, i64(hold), int64(limit))
	if err != nil {
		return nil, err
	}
	defer rs.Close()
	var out []claimed
	for rs.Next() {
		c, err := scanClaimed(rs)
		if err != nil {
			return nil, err
		}
		out = append(out, c)
	}
	return out, rs.Err()
}

func (s *PostgresStore) exec(ctx context.Context, name string, args ...any) (int64, error) {
	tag, err := s.pool.Exec(ctx, s.sql[name], args...)
	return tag.RowsAffected(), err
}

func (s *PostgresStore) write(ctx context.Context, id int64, owner string, w writeArgs) (bool, error) {
	n, err := s.exec(ctx, "write", w.status, i64(w.nextAt), int32(min(w.attempts, 1<<31-1)), w.leaseOwner, w.record,
		w.result, w.err, id, owner)
	return n == 1, err
}

func (s *PostgresStore) quarantine(ctx context.Context, id int64, msg string) error {
	_, err := s.exec(ctx, "quarantine", msg, id)
	return err
}

func (s *PostgresStore) replace(ctx context.Context, id int64, status string, nextAt uint64, attempts uint32, record []byte,
	msg *string, old []byte) (bool, error) {
	n, err := s.exec(ctx, "replace", status, i64(nextAt), int32(min(attempts, 1<<31-1)), record, msg, id, old)
	return n == 1, err
}

func (s *PostgresStore) get(ctx context.Context, id int64) (*row, error) {
	r, err := scanRow(s.pool.QueryRow(ctx, s.sql["get"], id))
	if errors.Is(err, pgx.ErrNoRows) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	return &r, nil
}

func (s *PostgresStore) rows(ctx context.Context, deadOnly bool) ([]row, error) {
	name := "list"
	if deadOnly {
		name = "list_dead"
	}
	rs, err := s.pool.Query(ctx, s.sql[name])
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

func (s *PostgresStore) nextDueIn(ctx context.Context) (int64, bool, error) {
	var in *int64
	if err := s.pool.QueryRow(ctx, s.sql["next_due"]).Scan(&in); err != nil {
		return 0, false, err
	}
	if in == nil {
		return 0, false, nil
	}
	return *in, true, nil
}

func (s *PostgresStore) counts(ctx context.Context) (map[string]int64, error) {
	rs, err := s.pool.Query(ctx, s.sql["counts"])
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
