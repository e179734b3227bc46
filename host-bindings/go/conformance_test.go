package levee

import (
	"bytes"
	"context"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"reflect"
	"sort"
	"strconv"
	"strings"
	"testing"
)

// conformanceSkips lists vectors this host skips, with the reason. None today.
var conformanceSkips = map[string]string{}

func vectorsDir() string {
	if d := os.Getenv("LEVEE_VECTORS_DIR"); d != "" {
		return d
	}
	return filepath.Join("..", "..", "conformance", "vectors")
}

type vector struct {
	Name       string            `json:"name"`
	Document   string            `json:"document"`
	Seed       json.Number       `json:"seed"`
	LoadErrors []LoadError       `json:"load_errors"`
	Steps      []json.RawMessage `json:"steps"`
}

func decodeUseNumber(b []byte, v any) error {
	d := json.NewDecoder(bytes.NewReader(b))
	d.UseNumber()
	return d.Decode(v)
}

// norm makes decoded JSON comparable: numbers compare by value, exactly.
func norm(v any) any {
	switch x := v.(type) {
	case json.Number:
		s := string(x)
		if u, err := strconv.ParseUint(s, 10, 64); err == nil {
			return "i:" + strconv.FormatUint(u, 10)
		}
		if i, err := strconv.ParseInt(s, 10, 64); err == nil {
			return "i:" + strconv.FormatInt(i, 10)
		}
		f, err := strconv.ParseFloat(s, 64)
		if err != nil {
			return "bad:" + s
		}
		return normFloat(f)
	case float64:
		return normFloat(x)
	case map[string]any:
		out := map[string]any{}
		for k, e := range x {
			out[k] = norm(e)
		}
		return out
	case []any:
		out := make([]any, len(x))
		for i, e := range x {
			out[i] = norm(e)
		}
		return out
	}
	return v
}

func normFloat(f float64) string {
	if f == math.Trunc(f) && math.Abs(f) < 1<<63 {
		return "i:" + strconv.FormatInt(int64(f), 10)
	}
	return "f:" + strconv.FormatFloat(f, 'g', -1, 64)
}

func toJSONish(v any) any {
	b, _ := json.Marshal(v)
	var out any
	_ = decodeUseNumber(b, &out)
	return norm(out)
}

func eventJSON(ev Event) map[string]any {
	return map[string]any{"at": ev.At, "kind": ev.Kind.String(), "policy": ev.Policy, "key": ev.Key,
		"call": ev.Call, "attempt": ev.Attempt, "reason": ev.Reason.String(), "duration": ev.Duration,
		"state_from": ev.StateFrom.String(), "state_to": ev.StateTo.String(), "name": ev.Name, "value": ev.Value}
}

// step reads a step's arguments as the Rust runner does: a missing or mistyped
// field is 0, "" or false.
type step map[string]any

func (s step) u64(k string) uint64 {
	if n, ok := s[k].(json.Number); ok {
		if u, err := strconv.ParseUint(string(n), 10, 64); err == nil {
			return u
		}
	}
	return 0
}

func (s step) i32(k string) int32 {
	if n, ok := s[k].(json.Number); ok {
		if i, err := strconv.ParseInt(string(n), 10, 64); err == nil {
			return int32(i)
		}
	}
	return 0
}

func (s step) i64(k string) int64 {
	if n, ok := s[k].(json.Number); ok {
		if i, err := strconv.ParseInt(string(n), 10, 64); err == nil {
			return i
		}
	}
	return 0
}

func (s step) str(k string) string   { v, _ := s[k].(string); return v }
func (s step) boolean(k string) bool { v, _ := s[k].(bool); return v }

func runVector(t *testing.T, path string) {
	raw, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	var vec vector
	if err := decodeUseNumber(raw, &vec); err != nil {
		t.Fatalf("parse: %v", err)
	}
	seed, err := strconv.ParseUint(string(vec.Seed), 10, 64)
	if err != nil {
		t.Fatalf("seed %q: %v", vec.Seed, err)
	}
	ctx := context.Background()
	load := func() (*Engine, error) { return Load(ctx, vec.Document, WithSeed(seed), WithSnapshotInterval(0)) }
	e, err := load()
	if vec.LoadErrors != nil {
		lerrs, ok := err.(LoadErrors)
		if !ok {
			t.Fatalf("load: want errors %v, got %v", vec.LoadErrors, err)
		}
		if !reflect.DeepEqual([]LoadError(lerrs), vec.LoadErrors) {
			t.Fatalf("load errors:\n got %#v\nwant %#v", []LoadError(lerrs), vec.LoadErrors)
		}
		return
	}
	if err != nil {
		t.Fatalf("load: %v", err)
	}
	defer func() { _ = e.Close(ctx) }()
	policy := func(name string) uint32 {
		i, ok, err := e.PolicyIndex(name)
		if err != nil {
			t.Fatalf("policy-index: %v", err)
		}
		if !ok {
			return math.MaxUint32
		}
		return i
	}
	var record []byte // the record of the last durable step that succeeded
	var shared []byte // the bytes of the last fleet_merge that succeeded
	var x *Executor   // the trace's executor (an `executor` step makes it)
	for n, rawStep := range vec.Steps {
		var s step
		if err := decodeUseNumber(rawStep, &s); err != nil {
			t.Fatalf("step %d: %v", n, err)
		}
		op := s.str("op")
		expect, hasExpect := s["expect"]
		var got any
		var err error
		switch op {
		case "start":
			var v Verdict
			v, err = e.Start(s.u64("call"), policy(s.str("policy")), s.str("key"), uint32(s.u64("flags")), s.u64("now"), s.u64("settle_call"), s.u64("settle_at"), s.u64("settle_elapsed"))
			got = verdictJSON(v)
		case "acquire":
			var v Verdict
			v, err = e.Acquire(s.u64("call"), s.u64("now"))
			got = verdictJSON(v)
		case "report":
			k, ok := ParseOutcomeKind(s.str("kind"))
			if !ok {
				t.Fatalf("step %d: outcome kind %q", n, s.str("kind"))
			}
			var v Verdict
			v, err = e.Report(s.u64("call"), s.u64("now"), s.u64("elapsed"), k, s.i32("code"), s.str("text"), s.u64("wall_secs"), uint32(s.u64("flags")))
			got = verdictJSON(v)
		case "report_fallback":
			var v Verdict
			v, err = e.ReportFallback(s.u64("call"), s.u64("now"), s.boolean("ok"))
			got = verdictJSON(v)
		case "hedge_step":
			var a HedgeAnswer
			a, err = e.HedgeStep(s.u64("call"), s.u64("now"))
			got = hedgeJSON(a)
		case "report_attempt":
			k, ok := ParseOutcomeKind(s.str("kind"))
			if !ok {
				t.Fatalf("step %d: outcome kind %q", n, s.str("kind"))
			}
			var a HedgeAnswer
			a, err = e.ReportAttempt(s.u64("call"), uint32(s.u64("attempt")), s.u64("now"), s.u64("elapsed"), k, s.i32("code"),
				s.str("text"), s.u64("wall_secs"), uint32(s.u64("flags")))
			got = hedgeJSON(a)
		case "cancel":
			err = e.Cancel(s.u64("call"), s.u64("now"))
		case "take_wakes":
			var calls []uint64
			calls, err = e.TakeWakes()
			l := make([]any, len(calls))
			for i, c := range calls {
				l[i] = c
			}
			got = l
		case "drain_events":
			var evs []Event
			evs, err = e.DrainEvents()
			l := make([]any, len(evs))
			for i, ev := range evs {
				l[i] = eventJSON(ev)
			}
			got = l
		case "breaker_state":
			var st BreakerState
			var ok bool
			st, ok, err = e.BreakerState(policy(s.str("policy")), s.str("key"), s.u64("now"))
			if ok {
				got = st.String()
			}
		case "set_breaker_state":
			st, ok := ParseBreakerState(s.str("state"))
			if !ok {
				t.Fatalf("step %d: state %q", n, s.str("state"))
			}
			var msg string
			msg, ok, err = e.SetBreakerState(policy(s.str("policy")), s.str("key"), st, s.u64("now"))
			if ok {
				got = map[string]any{"ok": nil}
			} else {
				got = map[string]any{"err": msg}
			}
		case "call_info":
			var ci CallInfo
			var ok bool
			ci, ok, err = e.CallInfo(s.u64("call"))
			if ok {
				got = map[string]any{"policy": ci.Policy, "key": ci.Key, "attempts": ci.Attempts,
					"deadline": ci.Deadline, "last_reason": ci.LastReason.String(), "in_flight": ci.InFlight}
			}
		case "policy_info":
			var pi PolicyInfo
			var ok bool
			pi, ok, err = e.PolicyInfo(policy(s.str("policy")))
			if ok {
				fb := pi.Fallbacks
				if fb == nil {
					fb = []string{}
				}
				got = map[string]any{"name": pi.Name, "max_attempts": pi.MaxAttempts,
					"attempt_timeout": pi.AttemptTimeout, "deadline": pi.Deadline, "fallbacks": fb}
			}
		case "analyze":
			var a Analysis
			var ok bool
			a, ok, err = e.Analyze(policy(s.str("policy")), uint32(s.u64("layers")))
			if ok {
				got = map[string]any{"worst_attempts": a.WorstAttempts, "worst_latency": a.WorstLatency,
					"amplification": a.Amplification, "amplification_with_budget": a.AmplificationWithBudget}
			}
		case "export_import", "snapshot_import":
			var st []byte
			if op == "snapshot_import" {
				st, err = e.ExportSnapshot()
			} else {
				st, err = e.ExportState()
			}
			if err != nil {
				break
			}
			_ = e.Close(ctx)
			if e, err = load(); err != nil {
				t.Fatalf("step %d: reload fresh engine: %v", n, err)
			}
			if err = e.ImportState(st); err != nil {
				t.Fatalf("step %d: import-state: %v", n, err)
			}
		case "reload":
			err = e.Reload(s.str("document"))
			if lerrs, ok := err.(LoadErrors); ok {
				got, err = map[string]any{"err": []LoadError(lerrs)}, nil
			} else if err == nil {
				got = map[string]any{"ok": nil}
			}
		case "import_state":
			b, herr := hex.DecodeString(s.str("bytes_hex"))
			if herr != nil {
				t.Fatalf("step %d: bytes_hex: %v", n, herr)
			}
			err = e.ImportState(b)
			if le, ok := err.(*LoadError); ok {
				got, err = map[string]any{"err": *le}, nil
			} else if err == nil {
				got = map[string]any{"ok": nil}
			}
		case "durable_begin", "durable_step", "durable_renew", "durable_outcome", "durable_cancel", "durable_revive":
			rec := record
			if h, ok := s["record_hex"].(string); ok {
				rec, err = hex.DecodeString(h)
				if err != nil {
					t.Fatalf("step %d: record_hex: %v", n, err)
				}
			}
			var ds DurableStep
			switch op {
			case "durable_begin":
				ds, err = e.DurableBegin(policy(s.str("policy")), s.str("key"), s.str("idempotency_key"), uint32(s.u64("flags")), s.u64("wall_now"))
			case "durable_step":
				ds, err = e.DurableStep(rec, s.str("owner"), s.u64("wall_now"), s.u64("elapsed"))
			case "durable_renew":
				ds, err = e.DurableRenew(rec, s.str("owner"), s.u64("wall_now"), s.u64("elapsed"))
			case "durable_outcome":
				kind, kok := ParseOutcomeKind(s.str("kind"))
				if !kok {
					t.Fatalf("step %d: outcome kind %q", n, s.str("kind"))
				}
				ds, err = e.DurableOutcome(rec, s.str("owner"), s.u64("wall_now"), s.u64("elapsed"), kind, s.i32("code"),
					s.str("text"), s.str("message"), uint32(s.u64("flags")))
			case "durable_cancel":
				ds, err = e.DurableCancel(rec, s.u64("wall_now"))
			default:
				ds, err = e.DurableRevive(rec, s.u64("wall_now"))
			}
			if le, ok := err.(*LoadError); ok {
				got, err = map[string]any{"err": *le}, nil
			} else if err == nil {
				record = ds.Record
				got = map[string]any{"ok": map[string]any{"action": ds.Action.String(), "attempt": ds.Attempt,
					"wait": ds.Wait, "timeout": ds.Timeout, "next_at": ds.NextAt, "lease_until": ds.LeaseUntil,
					"reason": ds.Reason.String(), "policy_changed": ds.PolicyChanged, "record_hex": hex.EncodeToString(ds.Record)}}
			}
		case "durable_inspect":
			rec := record
			if h, ok := s["record_hex"].(string); ok {
				rec, err = hex.DecodeString(h)
				if err != nil {
					t.Fatalf("step %d: record_hex: %v", n, err)
				}
			}
			var js string
			js, err = e.DurableInspect(rec)
			if le, ok := err.(*LoadError); ok {
				got, err = map[string]any{"err": *le}, nil
			} else if err == nil {
				got = map[string]any{"ok": js}
			}
		case "fleet_plan":
			var plan string
			var ok bool
			plan, ok, err = e.FleetPlan(policy(s.str("policy")))
			if ok {
				got = plan
			}
		case "fleet_merge", "fleet_apply", "fleet_inspect":
			sh := shared
			if h, ok := s["shared_hex"].(string); ok {
				sh, err = hex.DecodeString(h)
				if err != nil {
					t.Fatalf("step %d: shared_hex: %v", n, err)
				}
			}
			switch op {
			case "fleet_inspect":
				var js string
				js, err = e.FleetInspect(sh)
				if err == nil {
					got = map[string]any{"ok": js}
				}
			case "fleet_apply":
				err = e.FleetApply(policy(s.str("policy")), s.str("key"), s.str("node"), s.u64("now"), s.u64("wall_ms"), sh)
				if err == nil {
					got = map[string]any{"ok": nil}
				}
			default:
				var merged []byte
				merged, err = e.FleetMerge(policy(s.str("policy")), s.str("key"), s.str("node"), s.u64("now"), s.u64("wall_ms"), sh)
				if err == nil {
					var js string
					if js, err = e.FleetInspect(merged); err == nil {
						var state any
						if err = json.Unmarshal([]byte(js), &state); err == nil {
							shared = merged
							got = map[string]any{"ok": map[string]any{"hex": hex.EncodeToString(merged), "state": state}}
						}
					}
				}
			}
			if le, ok := err.(*LoadError); ok {
				got, err = map[string]any{"err": *le}, nil
			}
		case "executor":
			c, _ := s["config"].(map[string]any)
			cs := step(c)
			if x != nil {
				_ = x.Close()
			}
			x, err = e.NewExecutor(ExecutorConfig{Owner: cs.str("owner"), Concurrency: uint32(cs.u64("concurrency")),
				Poll: cs.u64("poll"), ClaimHold: cs.u64("claim_hold"), UntilIdle: cs.boolean("until_idle")})
			if err == nil {
				names, _ := s["register"].([]any)
				for _, name := range names {
					if err = x.Register(name.(string)); err != nil {
						break
					}
				}
			}
		case "exec_poll", "exec_claim_failed", "exec_claimed", "exec_next_due", "exec_written", "exec_renew", "exec_finished":
			ev := ExecEvent{ID: s.i64("id")}
			switch op {
			case "exec_poll":
				ev.Kind = ExecPoll
			case "exec_claim_failed":
				ev.Kind, ev.Error = ExecClaimFailed, s.str("error")
			case "exec_claimed":
				ev.Kind = ExecClaimed
				rows, _ := s["rows"].([]any)
				for _, r := range rows {
					m, _ := r.(map[string]any)
					rs := step(m)
					rec := record
					if h, ok := m["record_hex"].(string); ok {
						if rec, err = hex.DecodeString(h); err != nil {
							t.Fatalf("step %d: record_hex: %v", n, err)
						}
					}
					ev.Rows = append(ev.Rows, ClaimedCall{ID: rs.i64("id"), Handler: rs.str("handler"), Record: rec,
						DBNow: rs.u64("db_now")})
				}
			case "exec_next_due":
				ev.Kind = ExecNextDueIn
				if _, ok := s["due_in"].(json.Number); ok {
					ev.Pending, ev.DueIn = true, s.u64("due_in")
				}
			case "exec_written":
				ev.Kind = ExecWritten
				switch r := s["result"].(type) {
				case string:
					if r == "lost" {
						ev.Result.Kind = WriteLost
					}
				case map[string]any:
					ev.Result = WriteResult{Kind: WriteFailed, Error: step(r).str("failed")}
				}
			case "exec_renew":
				ev.Kind = ExecRenew
			default:
				kind, kok := ParseOutcomeKind(s.str("kind"))
				if !kok {
					t.Fatalf("step %d: outcome kind %q", n, s.str("kind"))
				}
				ev.Kind, ev.Outcome, ev.Code, ev.Text, ev.Message, ev.Flags = ExecFinished, kind, s.i32("code"),
					s.str("text"), s.str("message"), uint32(s.u64("flags"))
			}
			var cmds []ExecCommand
			cmds, err = x.Feed(s.u64("now"), ev)
			out := make([]any, len(cmds))
			for i, c := range cmds {
				out[i] = execCommandJSON(c)
				if c.Kind == ExecWrite {
					record = c.Row.Record
				}
			}
			got = out
		case "exec_forget":
			err = x.Forget(s.i64("id"))
		case "exec_running":
			var r uint32
			r, err = x.Running()
			got = r
		case "exec_operator":
			rec := record
			if h, ok := s["record_hex"].(string); ok {
				if rec, err = hex.DecodeString(h); err != nil {
					t.Fatalf("step %d: record_hex: %v", n, err)
				}
			}
			var w RowWrite
			w, err = e.ExecOperator(s.i64("id"), rec, s.boolean("revive"), s.u64("wall_now"))
			if le, ok := err.(*LoadError); ok {
				got, err = map[string]any{"err": *le}, nil
			} else if err == nil {
				record = w.Record
				got = map[string]any{"ok": rowJSON(w)}
			}
		default:
			t.Fatalf("step %d: unknown op %q", n, op)
		}
		if err != nil {
			t.Fatalf("step %d (%s): %v", n, op, err)
		}
		if op == "cancel" || op == "export_import" || op == "snapshot_import" {
			continue
		}
		if !hasExpect {
			continue // a step without an expectation is replayed, not checked
		}
		if g := toJSONish(got); !matchesExpectation(norm(expect), g) {
			gb, _ := json.Marshal(got)
			wb, _ := json.Marshal(expect)
			t.Fatalf("step %d (%s):\n got %s\nwant %s", n, op, gb, wb)
		}
	}
}

// matchesExpectation is the Rust runner's rule: objects compare the fields the
// expectation names, arrays element by element, anything else exactly.
func matchesExpectation(want, got any) bool {
	switch w := want.(type) {
	case map[string]any:
		g, ok := got.(map[string]any)
		if !ok {
			return false
		}
		for k, wv := range w {
			gv, ok := g[k]
			if !ok || !matchesExpectation(wv, gv) {
				return false
			}
		}
		return true
	case []any:
		g, ok := got.([]any)
		if !ok || len(g) != len(w) {
			return false
		}
		for i := range w {
			if !matchesExpectation(w[i], g[i]) {
				return false
			}
		}
		return true
	}
	return reflect.DeepEqual(want, got)
}

// verdictJSON is the runners' JSON form of a verdict (with "reason" for the kinds that carry one).
func verdictJSON(v Verdict) map[string]any {
	m := map[string]any{"verdict": uint64(v), "kind": v.Kind().String(), "detail": v.Detail(),
		"payload": v.Payload(), "events_pending": v.EventsPending()}
	switch v.Kind() {
	case VerdictWait, VerdictRetry, VerdictFallback, VerdictFail:
		m["reason"] = v.Reason().String()
	}
	return m
}

// rowJSON is the runners' JSON form of a row-write (conformance/README.md, "Executor steps").
func rowJSON(w RowWrite) map[string]any {
	var e any
	if w.Error != nil {
		e = *w.Error
	}
	return map[string]any{"id": w.ID, "status": w.Status, "next_at": w.NextAt, "attempts": w.Attempts,
		"record_hex": hex.EncodeToString(w.Record), "lease": w.Lease, "keep_result": w.KeepResult, "error": e}
}

// execCommandJSON is the runners' JSON form of an exec-command.
func execCommandJSON(c ExecCommand) any {
	switch c.Kind {
	case ExecClaim:
		return map[string]any{"claim": map[string]any{"limit": c.Limit, "hold": c.Hold}}
	case ExecWrite:
		return map[string]any{"write": rowJSON(c.Row)}
	case ExecRun:
		return map[string]any{"run": map[string]any{"id": c.ID, "attempt": c.Attempt, "timeout": c.Timeout,
			"renew_every": c.RenewEvery}}
	case ExecAbandon:
		return map[string]any{"abandon": c.ID}
	case ExecQuarantine:
		return map[string]any{"quarantine": map[string]any{"id": c.ID, "error": c.Error}}
	case ExecNextDue:
		return "next_due"
	case ExecSleep:
		return map[string]any{"sleep": c.Until}
	case ExecIdle:
		return "idle"
	default:
		return map[string]any{"log": map[string]any{"level": c.Level.String(), "id": c.ID, "text": c.Text}}
	}
}

// hedgeJSON is the runners' JSON form of a hedge-answer (conformance/runner, hedge_json).
func hedgeJSON(a HedgeAnswer) map[string]any {
	cmds := make([]any, len(a.Commands))
	for i, c := range a.Commands {
		switch c.Kind {
		case HedgeStart:
			cmds[i] = map[string]any{"start": map[string]any{"attempt": c.Attempt, "timeout": c.Timeout}}
		case HedgeCancel:
			cmds[i] = map[string]any{"cancel": c.Attempt}
		case HedgeWait:
			cmds[i] = map[string]any{"wait": c.Delay}
		case HedgeEnd:
			cmds[i] = map[string]any{"end": map[string]any{"attempt": c.Attempt, "verdict": verdictJSON(c.Verdict)}}
		}
	}
	return map[string]any{"commands": cmds, "events_pending": a.EventsPending}
}

func TestConformance(t *testing.T) {
	files, _ := filepath.Glob(filepath.Join(vectorsDir(), "*.json"))
	sort.Strings(files)
	if len(files) == 0 {
		t.Fatalf("no conformance vectors in %s", vectorsDir())
	}
	ran := 0
	for _, f := range files {
		name := strings.TrimSuffix(filepath.Base(f), ".json")
		if name == "schema" {
			continue
		}
		t.Run(name, func(t *testing.T) {
			if why, ok := conformanceSkips[name]; ok {
				t.Skip(why)
			}
			runVector(t, f)
		})
		ran++
	}
	t.Logf("%d vectors", ran)
	_ = fmt.Sprint
}
