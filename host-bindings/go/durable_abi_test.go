package levee

import (
	"errors"
	"testing"
)

// An executor lives in its component instance: after a trap replaced the instance, the next
// answer is ErrExecutorReset, and the machine that took its place has the same configuration
// and handlers.
func TestAnExecutorIsRebuiltAfterATrap(t *testing.T) {
	e := mustLoad(t, "policies:\n  p:\n    attempts: 2\n")
	x, err := e.NewExecutor(ExecutorConfig{Owner: "w1", Concurrency: 3})
	if err != nil {
		t.Fatal(err)
	}
	if err := x.Register("send"); err != nil {
		t.Fatal(err)
	}
	cmds, err := x.Feed(0, ExecEvent{Kind: ExecPoll})
	if err != nil || len(cmds) != 1 || cmds[0].Kind != ExecClaim || cmds[0].Limit != 3 {
		t.Fatalf("poll: %+v %v", cmds, err)
	}
	killGuest(e)
	if _, err := x.Feed(1, ExecEvent{Kind: ExecPoll}); err == nil || errors.Is(err, ErrExecutorReset) {
		t.Fatalf("a trap: %v", err)
	}
	if _, err := x.Feed(2, ExecEvent{Kind: ExecPoll}); !errors.Is(err, ErrExecutorReset) {
		t.Fatalf("after the trap: %v", err)
	}
	// a fresh machine: no claim in flight, the handler registered
	cmds, err = x.Feed(3, ExecEvent{Kind: ExecPoll})
	if err != nil || len(cmds) != 1 || cmds[0].Kind != ExecClaim || cmds[0].Limit != 3 {
		t.Fatalf("poll after the reset: %+v %v", cmds, err)
	}
	step, err := e.DurableBegin(0, "", "", 0, 1_800_000_000_000_000_000)
	if err != nil {
		t.Fatal(err)
	}
	rows := []ClaimedCall{{ID: 7, Handler: "send", Record: step.Record, DBNow: 1_800_000_000_000_000_000},
		{ID: 8, Handler: "other", Record: step.Record, DBNow: 1_800_000_000_000_000_000}}
	cmds, err = x.Feed(4, ExecEvent{Kind: ExecClaimed, Rows: rows})
	if err != nil || len(cmds) != 3 || cmds[0].Kind != ExecWrite || cmds[0].Row.ID != 7 || cmds[0].Row.Status != "running" ||
		cmds[1].Kind != ExecQuarantine || cmds[1].ID != 8 || cmds[2].Kind != ExecClaim || cmds[2].Limit != 2 {
		t.Fatalf("claimed: %+v %v", cmds, err)
	}
	if n, err := x.Running(); n != 1 || err != nil {
		t.Fatalf("running: %d %v", n, err)
	}
	if err := x.Close(); err != nil {
		t.Fatal(err)
	}
}
