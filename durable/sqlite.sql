-- Levee durable calls: the SQLite dialect. Every host executes these statements as written,
-- with its usual driver; a statement starts at its `-- name:` line and ends at the next one.
-- Parameters are positional (`?`), in the order the comment above each statement gives.
-- Times are wall-clock nanoseconds since the Unix epoch (this host's clock for an SQLite file).
-- The `record` column holds the core's versioned record bytes (docs/durable.md); the other
-- columns are copies the core's answer gives, kept for indexes and listings.

-- name: schema
CREATE TABLE IF NOT EXISTS levee_durable_calls (
    id              INTEGER PRIMARY KEY AUTOINCREMENT,
    handler         TEXT    NOT NULL,
    payload         BLOB    NOT NULL,
    idempotency_key TEXT    UNIQUE,
    status          TEXT    NOT NULL CHECK (status IN ('scheduled', 'running', 'done', 'dead', 'cancelled', 'quarantined')),
    next_at         INTEGER NOT NULL,
    attempts        INTEGER NOT NULL DEFAULT 0,
    lease_owner     TEXT,
    record          BLOB    NOT NULL,
    result          BLOB,
    error           TEXT,
    updated_at      INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS levee_durable_due ON levee_durable_calls (next_at) WHERE status IN ('scheduled', 'running');

-- name: insert
-- handler, payload, idempotency_key (NULL for none), next_at, record, updated_at
INSERT INTO levee_durable_calls (handler, payload, idempotency_key, status, next_at, record, updated_at)
VALUES (?, ?, ?, 'scheduled', ?, ?, ?)
ON CONFLICT (idempotency_key) DO NOTHING
RETURNING id;

-- name: find_by_key
-- idempotency_key
SELECT id FROM levee_durable_calls WHERE idempotency_key = ?;

-- name: claim
-- owner, claimed_until (now + the claim's hold), now, limit
-- Takes up to `limit` due calls (scheduled and due, or running with a lapsed lease) for this
-- process: it names itself the holder and moves them out of everyone's due window until it
-- has asked the core and written the core's answer. Run inside BEGIN IMMEDIATE.
UPDATE levee_durable_calls SET lease_owner = ?, next_at = ?
WHERE id IN (SELECT id FROM levee_durable_calls
             WHERE status IN ('scheduled', 'running') AND next_at <= ?
             ORDER BY next_at, id LIMIT ?)
RETURNING id, handler, payload, record, ?3 AS db_now, idempotency_key;

-- name: write
-- status, next_at, attempts, lease_owner, record, result, error, updated_at, id, owner
-- Fenced: only the process that holds the call may write it.
UPDATE levee_durable_calls
SET status = ?, next_at = ?, attempts = ?, lease_owner = ?, record = ?, result = ?, error = ?, updated_at = ?
WHERE id = ? AND lease_owner = ?;

-- name: quarantine
-- error, updated_at, id
UPDATE levee_durable_calls SET status = 'quarantined', lease_owner = NULL, error = ?, updated_at = ? WHERE id = ?;

-- name: get
-- id
SELECT id, handler, status, next_at, attempts, lease_owner, record, result, error, idempotency_key
FROM levee_durable_calls WHERE id = ?;

-- name: replace
-- status, next_at, attempts, record, error, updated_at, id, old_record
-- An operator's change (cancel, retry): compare-and-set on the record bytes; it clears the
-- holder, so a process still running an attempt of this call has its outcome refused.
UPDATE levee_durable_calls
SET status = ?, next_at = ?, attempts = ?, lease_owner = NULL, record = ?, error = ?, updated_at = ?
WHERE id = ? AND record = ?;

-- name: list
-- (no parameters)
SELECT id, handler, status, next_at, attempts, lease_owner, record, result, error, idempotency_key
FROM levee_durable_calls ORDER BY id;

-- name: list_dead
-- (no parameters)
SELECT id, handler, status, next_at, attempts, lease_owner, record, result, error, idempotency_key
FROM levee_durable_calls WHERE status IN ('dead', 'quarantined') ORDER BY id;

-- name: page
-- after_id, status (NULL: any), handler (NULL: any), limit
-- An operator's listing (`levee durable list`): one page of calls in id order after `after_id`.
SELECT id, handler, status, next_at, attempts, lease_owner, record, result, error, idempotency_key
FROM levee_durable_calls
WHERE id > ? AND status = COALESCE(?, status) AND handler = COALESCE(?, handler)
ORDER BY id LIMIT ?;

-- name: next_due
-- (no parameters)
SELECT MIN(next_at) FROM levee_durable_calls WHERE status IN ('scheduled', 'running');

-- name: counts
-- (no parameters)
SELECT status, COUNT(*) FROM levee_durable_calls GROUP BY status ORDER BY status;

-- name: prune
-- status, updated_before
-- An operator's clean-up (`levee durable prune`): the finished calls of one status (done, dead
-- or cancelled) last written before `updated_before` are deleted, with their payload and result.
-- Never a call still scheduled or running, nor a quarantined record (it waits for an operator).
DELETE FROM levee_durable_calls
WHERE status = ? AND status IN ('done', 'dead', 'cancelled') AND updated_at < ?;
