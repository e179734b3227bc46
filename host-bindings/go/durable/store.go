package durable

import (
	"context"
	"errors"
	"fmt"
)

// Store is where durable calls live: an SQLite file (OpenSQLite) or a PostgreSQL database
// (OpenPostgres). Both execute the shared statements of durable/*.sql as written; the rows
// are the same whichever host wrote them, so a call a Python or JS process submitted is run
// by a Go process and the other way round.
type Store interface {
	// Dialect is "sqlite" or "postgres".
	Dialect() string
	// Close releases the store's connections.
	Close() error

	now(ctx context.Context) (uint64, error)
	// submitter is where a submission reads the clock and inserts: the store's own connection
	// when tx is nil, else the caller's open transaction (a pgx.Tx for PostgreSQL, a *sql.Tx
	// for SQLite), checked to be of this store's dialect and database.
	submitter(ctx context.Context, tx any) (submitter, error)
	claim(ctx context.Context, owner string, hold uint64, limit int) ([]claimed, error)
	write(ctx context.Context, id int64, owner string, w writeArgs) (bool, error)
	quarantine(ctx context.Context, id int64, msg string) error
	replace(ctx context.Context, id int64, status string, nextAt uint64, attempts uint32, record []byte, msg *string, old []byte) (bool, error)
	get(ctx context.Context, id int64) (*row, error)
	rows(ctx context.Context, deadOnly bool) ([]row, error)
	// nextDueIn is how long until the next call is due, ns (negative: one is due now);
	// ok is false when no call is pending.
	nextDueIn(ctx context.Context) (ns int64, ok bool, err error)
	counts(ctx context.Context) (map[string]int64, error)
}

// submitter reads the store's clock and inserts a call, both through one connection or
// transaction (see Store.submitter).
type submitter interface {
	now(ctx context.Context) (uint64, error)
	insert(ctx context.Context, handler string, payload []byte, idempotencyKey *string, nextAt uint64, record []byte) (int64, error)
}

// claimed is a row of the shared `claim` statement (the same columns in both dialects).
type claimed struct {
	id             int64
	handler        string
	payload        []byte
	record         []byte
	dbNow          uint64
	idempotencyKey *string
}

// writeArgs are the columns of the shared `write` statement.
type writeArgs struct {
	status     string
	nextAt     uint64
	attempts   uint32
	leaseOwner *string
	record     []byte
	result     []byte
	err        *string
}

// row is a row of the shared `get`, `list` and `list_dead` statements.
type row struct {
	id             int64
	handler        string
	status         string
	nextAt         int64
	attempts       int64
	leaseOwner     *string
	record         []byte
	result         []byte
	err            *string
	idempotencyKey *string
}

type scanner interface{ Scan(dest ...any) error }

func scanRow(s scanner) (row, error) {
	var r row
	err := s.Scan(&r.id, &r.handler, &r.status, &r.nextAt, &r.attempts, &r.leaseOwner, &r.record, &r.result, &r.err,
		&r.idempotencyKey)
	return r, err
}

func scanClaimed(s scanner) (claimed, error) {
	var c claimed
	var now int64
	err := s.Scan(&c.id, &c.handler, &c.payload, &c.record, &now, &c.idempotencyKey)
	c.dbNow = uint64(max(now, 0))
	return c, err
}

// i64 converts a wall time or count for a BIGINT column (they are far below 2^63).
func i64(v uint64) int64 {
	if v > 1<<63-1 {
		return 1<<63 - 1
	}
	return int64(v)
}

var errNotAccepted = errors.New("levee durable: the store did not accept the call")

// errTx is the error of a transaction a store cannot submit through.
func errTx(dialect, reason string) error {
	return fmt.Errorf("levee durable: tx: %s (the store is %s)", reason, dialect)
}
