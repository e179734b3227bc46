package durable

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	levee "github.com/levee-dev/levee/host-bindings/go"
)

const testDoc = `
policies:
  quick:
    attempts: 3
    attempt-timeout: 5s
    backoff: { kind: constant, base: 50ms, cap: 50ms, jitter: none }
    durable: { lease: 2s, max-crashes: 2 }
  other:
    attempts: 2
    backoff: { kind: constant, base: 50ms, cap: 50ms, jitter: none }
`

func setup(t *testing.T) (*Executor, *SQLiteStore, context.Context) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	t.Cleanup(cancel)
	e, err := levee.Load(ctx, testDoc)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = e.Close(context.Background()) })
	s, err := OpenSQLite(ctx, filepath.Join(t.TempDir(), "calls.db"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = s.Close() })
	return New(e, s, WithOwner("test"), WithPollInterval(20*time.Millisecond), WithClaimHold(time.Second)), s, ctx
}

func status(t *testing.T, ctx context.Context, x *Executor, id int64) CallStatus {
	t.Helper()
	st, ok, err := x.Status(ctx, id)
	if err != nil || !ok {
		t.Fatalf("status of call %d: %v %v", id, ok, err)
	}
	return st
}

// The embedded statements are the repository's shared files, byte for byte.
func TestStatementsAreTheSharedFiles(t *testing.T) {
	for _, d := range []string{"sqlite", "postgres"} {
		shared, err := os.ReadFile(filepath.Join("..", "..", "..", "durable", d+".sql"))
		if err != nil {
			t.Fatalf("the shared file: %v", err)
		}
		embedded, _ := sqlFiles.ReadFile("sql/" + d + ".sql")
		if !bytes.Equal(shared, embedded) {
			t.Errorf("sql/%s.sql differs from durable/%s.sql: copy it (cp durable/%s.sql host-bindings/go/durable/sql/)", d, d, d)
		}
		st, _ := Statements(d)
		for _, name := range []string{"schema", "insert", "find_by_key", "claim", "write", "quarantine", "get", "replace",
			"list", "list_dead", "next_due", "counts"} {
			if st[name] == "" {
				t.Errorf("%s: no statement %q", d, name)
			}
		}
	}
	if _, err := Statements("oracle"); err == nil {
		t.Error("an unknown dialect has statements")
	}
}

func TestRetryAfterAFailureThenDone(t *testing.T) {
	x, _, ctx := setup(t)
	var runs atomic.Int32
	var attempts []uint32
	err := x.Register("send", func(ctx context.Context, payload []byte, c Call) ([]byte, error) {
		attempts = append(attempts, c.Attempt)
		if runs.Add(1) == 1 {
			return nil, fmt.Errorf("reset: %w", syscall.ECONNRESET)
		}
		if c.IdempotencyKey != "k-1" || string(payload) != "hello" {
			return nil, fmt.Errorf("got key %q payload %q", c.IdempotencyKey, payload)
		}
		return []byte("sent"), nil
	}, WithPolicy("quick"))
	if err != nil {
		t.Fatal(err)
	}
	id, err := x.Submit(ctx, "send", []byte("hello"), "k-1")
	if err != nil {
		t.Fatal(err)
	}
	again, err := x.Submit(ctx, "send", []byte("hello"), "k-1")
	if err != nil || again != id {
		t.Fatalf("a second submission with the key: id %d (first %d), %v", again, id, err)
	}
	if st := status(t, ctx, x, id); st.Status != "scheduled" || st.Record["policy"] != "quick" {
		t.Fatalf("submitted: %+v", st)
	}
	t0 := time.Now()
	if err := x.RunUntilIdle(ctx); err != nil {
		t.Fatal(err)
	}
	st := status(t, ctx, x, id)
	if st.Status != "done" || st.Attempts != 2 || string(st.Result) != "sent" || st.LeaseOwner != "" {
		t.Fatalf("after the run: %+v", st)
	}
	if fmt.Sprint(attempts) != "[1 2]" || time.Since(t0) < 50*time.Millisecond {
		t.Fatalf("attempts %v in %v (backoff 50ms)", attempts, time.Since(t0))
	}
	if st.Record["failures"] != float64(1) {
		t.Fatalf("the record: %v", st.Record)
	}
	counts, err := x.Counts(ctx)
	if err != nil || counts["done"] != 1 {
		t.Fatalf("counts %v %v", counts, err)
	}
}

func TestGivenUpCallsAreListedWithTheirLastError(t *testing.T) {
	x, _, ctx := setup(t)
	_ = x.Register("refuse", func(context.Context, []byte, Call) ([]byte, error) {
		return nil, levee.ClassError("Refused", errors.New("no such order"))
	}, WithPolicy("quick"))
	_ = x.Register("bare", func(context.Context, []byte, Call) ([]byte, error) {
		return nil, fmt.Errorf("reset: %w", syscall.ECONNRESET)
	}, WithPolicy("quick"), NotIdempotent())
	a, _ := x.Submit(ctx, "refuse", nil, "")
	b, _ := x.Submit(ctx, "bare", nil, "")
	if err := x.RunUntilIdle(ctx); err != nil {
		t.Fatal(err)
	}
	dead, err := x.Dead(ctx)
	if err != nil || len(dead) != 2 {
		t.Fatalf("dead: %+v %v", dead, err)
	}
	if dead[0].ID != a || dead[0].Status != "dead" ||
		!strings.HasPrefix(dead[0].Error, "non-retryable: attempt 1 failed with `Refused`: ") {
		t.Errorf("the refused call: %+v", dead[0])
	}
	if dead[1].ID != b || !strings.HasPrefix(dead[1].Error, "non-idempotent: attempt 1 failed with `connection-error`") {
		t.Errorf("the non-idempotent call: %+v", dead[1])
	}
	if dead[1].Attempts != 1 {
		t.Errorf("a non-idempotent call without a key ran again: %+v", dead[1])
	}
}

func TestBadRecordsAreQuarantinedNamingThem(t *testing.T) {
	x, s, ctx := setup(t)
	_ = x.Register("ok", func(context.Context, []byte, Call) ([]byte, error) { return nil, nil }, WithPolicy("quick"))
	good, _ := x.Submit(ctx, "ok", nil, "")
	corrupt, _ := x.Submit(ctx, "ok", nil, "c")
	orphan, _ := x.Submit(ctx, "ok", nil, "o")
	if _, err := s.conn.ExecContext(ctx, "UPDATE levee_durable_calls SET record = X'4c56445201ff' WHERE id = ?", corrupt); err != nil {
		t.Fatal(err)
	}
	if _, err := s.conn.ExecContext(ctx, "UPDATE levee_durable_calls SET handler = 'gone' WHERE id = ?", orphan); err != nil {
		t.Fatal(err)
	}
	if err := x.RunUntilIdle(ctx); err != nil {
		t.Fatal(err)
	}
	if st := status(t, ctx, x, good); st.Status != "done" {
		t.Errorf("the good call: %+v", st)
	}
	st := status(t, ctx, x, corrupt)
	if st.Status != "quarantined" || !strings.HasPrefix(st.Error, "record") || st.Record != nil {
		t.Errorf("the corrupt record: %+v", st)
	}
	st = status(t, ctx, x, orphan)
	if st.Status != "quarantined" || st.Error != "handler: no durable handler named `gone` is registered" {
		t.Errorf("the record of no handler: %+v", st)
	}
	dead, _ := x.Dead(ctx)
	if len(dead) != 2 {
		t.Errorf("dead() lists the quarantined records: %+v", dead)
	}
}

func TestAPolicyGoneAfterAReloadIsQuarantined(t *testing.T) {
	x, _, ctx := setup(t)
	_ = x.Register("o", func(context.Context, []byte, Call) ([]byte, error) { return nil, nil }, WithPolicy("other"))
	id, _ := x.Submit(ctx, "o", nil, "")
	if err := x.engine.Reload("policies:\n  quick:\n    attempts: 3\n"); err != nil {
		t.Fatal(err)
	}
	if err := x.RunUntilIdle(ctx); err != nil {
		t.Fatal(err)
	}
	st := status(t, ctx, x, id)
	if st.Status != "quarantined" || !strings.HasPrefix(st.Error, "record.policy: ") || !strings.Contains(st.Error, "other") {
		t.Errorf("after the reload: %+v", st)
	}
}

func TestCancelThenRetry(t *testing.T) {
	x, _, ctx := setup(t)
	var runs atomic.Int32
	_ = x.Register("ok", func(context.Context, []byte, Call) ([]byte, error) { runs.Add(1); return []byte("y"), nil },
		WithPolicy("quick"))
	id, _ := x.Submit(ctx, "ok", nil, "")
	if ok, err := x.Cancel(ctx, id); !ok || err != nil {
		t.Fatalf("cancel: %v %v", ok, err)
	}
	st := status(t, ctx, x, id)
	if st.Status != "cancelled" || st.Error != "cancelled by an operator" {
		t.Fatalf("cancelled: %+v", st)
	}
	if err := x.RunUntilIdle(ctx); err != nil || runs.Load() != 0 {
		t.Fatalf("a cancelled call ran: %d %v", runs.Load(), err)
	}
	if ok, _ := x.Cancel(ctx, id); ok {
		t.Fatal("a finished call was cancelled again")
	}
	if ok, err := x.Retry(ctx, id); !ok || err != nil {
		t.Fatalf("retry: %v %v", ok, err)
	}
	if err := x.RunUntilIdle(ctx); err != nil {
		t.Fatal(err)
	}
	if st := status(t, ctx, x, id); st.Status != "done" || runs.Load() != 1 {
		t.Fatalf("after the retry: %+v, %d runs", st, runs.Load())
	}
	if _, ok, _ := x.Status(ctx, 999); ok {
		t.Fatal("an unknown call has a status")
	}
}

// An attempt cut off by a crash (a running record whose lease lapsed, written by another
// owner) is retried when the call has a key, and counts as a crash.
func TestACrashedAttemptIsResumed(t *testing.T) {
	x, s, ctx := setup(t)
	_ = x.Register("ok", func(_ context.Context, _ []byte, c Call) ([]byte, error) {
		if c.Attempt == 1 {
			select {} // never: the first attempt is cut off below
		}
		return nil, nil
	}, WithPolicy("quick"))
	id, _ := x.Submit(ctx, "ok", nil, "key")
	// Another process took the call up, wrote it running, and died.
	cs, err := s.claim(ctx, "dead-process", uint64(time.Second), 1)
	if err != nil || len(cs) != 1 {
		t.Fatalf("claim: %v %v", cs, err)
	}
	step, err := x.engine.DurableStep(cs[0].record, "dead-process", cs[0].dbNow-uint64(3*time.Second), 0)
	if err != nil || step.Action != levee.DurableRun {
		t.Fatalf("step: %+v %v", step, err)
	}
	owner := "dead-process"
	ok, err := s.write(ctx, id, owner, writeArgs{status: "running", nextAt: step.NextAt, attempts: step.Attempt,
		leaseOwner: &owner, record: step.Record})
	if !ok || err != nil {
		t.Fatalf("write: %v %v", ok, err)
	}
	if err := x.RunUntilIdle(ctx); err != nil {
		t.Fatal(err)
	}
	st := status(t, ctx, x, id)
	if st.Status != "done" || st.Attempts != 2 || st.Record["crashes"] != float64(1) {
		t.Fatalf("after the resume: %+v", st)
	}
}

func TestRegisterNeedsAPolicyAndSubmitAHandler(t *testing.T) {
	x, _, ctx := setup(t)
	if err := x.Register("nope", func(context.Context, []byte, Call) ([]byte, error) { return nil, nil }); !errors.Is(err, levee.ErrUnknownPolicy) {
		t.Fatalf("register under an unknown policy: %v", err)
	}
	if _, err := x.Submit(ctx, "nope", nil, ""); err == nil || !strings.Contains(err.Error(), "no durable handler named `nope`") {
		t.Fatalf("submit to no handler: %v", err)
	}
}

// A key longer than levee.MaxKeyBytes is refused before anything is stored, as Do refuses it.
func TestAKeyTooLongIsRefused(t *testing.T) {
	x, _, ctx := setup(t)
	if err := x.Register("send", func(context.Context, []byte, Call) ([]byte, error) { return nil, nil }, WithPolicy("quick")); err != nil {
		t.Fatal(err)
	}
	long := strings.Repeat("k", levee.MaxKeyBytes+1)
	if _, err := x.SubmitKeyed(ctx, "send", nil, "k-1", long); !errors.Is(err, levee.ErrKeyTooLong) ||
		!strings.Contains(err.Error(), fmt.Sprintf("key: %d bytes", levee.MaxKeyBytes+1)) {
		t.Fatalf("submit with a key of %d bytes: %v", len(long), err)
	}
	if _, err := x.SubmitKeyed(ctx, "send", nil, "k-2", long[:levee.MaxKeyBytes]); err != nil {
		t.Fatalf("submit with a key of %d bytes: %v", levee.MaxKeyBytes, err)
	}
}
