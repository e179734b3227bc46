-- Levee durable calls: the PostgreSQL dialect, for processes on several machines. Every host
-- executes these statements as written, with its usual driver; a statement starts at its
-- `-- name:` line and ends at the next one. Parameters are numbered (`$1`); drivers that
-- want another style (psycopg's `%s`) rewrite only the placeholders.
-- The database's clock is the one clock: every statement reads `now()` itself, as
-- nanoseconds since the Unix epoch, and claims return it (`db_now`) for the core.
-- The `record` column holds the core's versioned record bytes (docs/durable.md).

-- name: schema
CREATE TABLE IF NOT EXISTS levee_durable_calls (
    id              BIGSERIAL PRIMARY KEY,
    handler         TEXT    NOT NULL,
    payload         BYTEA   NOT NULL,
    idempotency_key TEXT    UNIQUE,
    status          TEXT    NOT NULL CHECK (status IN ('scheduled', 'running', 'done', 'dead', 'cancelled', 'quarantined')),
    next_at         BIGINT  NOT NULL,
    attempts        INTEGER NOT NULL DEFAULT 0,
    lease_owner     TEXT,
    record          BYTEA   NOT NULL,
    result          BYTEA,
    error           TEXT,
    updated_at      BIGINT  NOT NULL
);
CREATE INDEX IF NOT EXISTS levee_durable_due ON levee_durable_calls (next_at) WHERE status IN ('scheduled', 'running');

-- name: clock
-- (no parameters) the database's wall clock, ns since the Unix epoch
SELECT (EXTRACT(EPOCH FROM clock_timestamp()) * 1000000000)::BIGINT;

-- name: insert
-- $1 handler, $2 payload, $3 idempotency_key (NULL for none), $4 next_at, $5 record (both from
-- the core's `durable-begin` at `clock`)
INSERT INTO levee_durable_calls (handler, payload, idempotency_key, status, next_at, record, updated_at)
VALUES ($1, $2, $3, 'scheduled', $4, $5, (EXTRACT(EPOCH FROM clock_timestamp()) * 1000000000)::BIGINT)
ON CONFLICT (idempotency_key) DO NOTHING
RETURNING id;

-- name: find_by_key
-- $1 idempotency_key
SELECT id FROM levee_durable_calls WHERE idempotency_key = $1;

-- name: claim
-- $1 owner, $2 hold (ns the claim keeps the calls out of the due window), $3 limit
-- Rows locked by another claim are skipped, so workers never wait on one another.
WITH t AS (SELECT (EXTRACT(EPOCH FROM clock_timestamp()) * 1000000000)::BIGINT AS now),
due AS (
    SELECT c.id FROM levee_durable_calls c, t
    WHERE c.status IN ('scheduled', 'running') AND c.next_at <= t.now
    ORDER BY c.next_at, c.id LIMIT $3
    FOR UPDATE OF c SKIP LOCKED
)
UPDATE levee_durable_calls c SET lease_owner = $1, next_at = t.now + $2
FROM due, t WHERE c.id = due.id
RETURNING c.id, c.handler, c.payload, c.record, t.now AS db_now, c.idempotency_key;

-- name: write
-- $1 status, $2 next_at, $3 attempts, $4 lease_owner, $5 record, $6 result, $7 error, $8 id, $9 owner
-- Fenced: only the process that holds the call may write it.
UPDATE levee_durable_calls
SET status = $1, next_at = $2, attempts = $3, lease_owner = $4, record = $5, result = $6, error = $7,
    updated_at = (EXTRACT(EPOCH FROM clock_timestamp()) * 1000000000)::BIGINT
WHERE id = $8 AND lease_owner = $9;

-- name: quarantine
-- $1 error, $2 id
UPDATE levee_durable_calls SET status = 'quarantined', lease_owner = NULL, error = $1,
    updated_at = (EXTRACT(EPOCH FROM clock_timestamp()) * 1000000000)::BIGINT
WHERE id = $2;

-- name: get
-- $1 id
SELECT id, handler, status, next_at, attempts, lease_owner, record, result, error, idempotency_key
FROM levee_durable_calls WHERE id = $1;

-- name: replace
-- $1 status, $2 next_at, $3 attempts, $4 record, $5 error, $6 id, $7 old_record
UPDATE levee_durable_calls
SET status = $1, next_at = $2, attempts = $3, lease_owner = NULL, record = $4, error = $5,
    updated_at = (EXTRACT(EPOCH FROM clock_timestamp()) * 1000000000)::BIGINT
WHERE id = $6 AND record = $7;

-- name: list
-- (no parameters)
SELECT id, handler, status, next_at, attempts, lease_owner, record, result, error, idempotency_key
FROM levee_durable_calls ORDER BY id;

-- name: list_dead
-- (no parameters)
SELECT id, handler, status, next_at, attempts, lease_owner, record, result, error, idempotency_key
FROM levee_durable_calls WHERE status IN ('dead', 'quarantined') ORDER BY id;

-- name: page
-- $1 after_id, $2 status (NULL: any), $3 handler (NULL: any), $4 limit
-- An operator's listing (`levee durable list`): one page of calls in id order after `after_id`.
SELECT id, handler, status, next_at, attempts, lease_owner, record, result, error, idempotency_key
FROM levee_durable_calls
WHERE id > $1 AND status = COALESCE($2, status) AND handler = COALESCE($3, handler)
ORDER BY id LIMIT $4;

-- name: next_due
-- (no parameters) how long until the next call is due, ns (negative: one is due now)
SELECT MIN(next_at) - (EXTRACT(EPOCH FROM clock_timestamp()) * 1000000000)::BIGINT
FROM levee_durable_calls WHERE status IN ('scheduled', 'running');

-- name: counts
-- (no parameters)
SELECT status, COUNT(*) FROM levee_durable_calls GROUP BY status ORDER BY status;

-- name: prune
-- $1 status, $2 updated_before
-- An operator's clean-up (`levee durable prune`): the finished calls of one status (done, dead
-- or cancelled) last written before `updated_before` are deleted, with their payload and result.
-- Never a call still scheduled or running, nor a quarantined record (it waits for an operator).
DELETE FROM levee_durable_calls
WHERE status = $1 AND status IN ('done', 'dead', 'cancelled') AND updated_at < $2;
