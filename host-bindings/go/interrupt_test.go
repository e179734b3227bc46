package levee

import (
	"context"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/tetratelabs/wazero"
	"github.com/tetratelabs/wazero/api"
)

// A module written by hand: a memory, a defined global (so the new globals are 1 and 2),
// "spin" loops forever, "count" counts to 100000 in a loop nested in a block and
// also runs a loop with a result and a few instructions with immediates.
func handModule() []byte {
	section := func(id byte, body ...byte) []byte {
		return append([]byte{id, byte(len(body))}, body...)
	}
	m := []byte("\x00asm\x01\x00\x00\x00")
	m = append(m, section(1, 1, 0x60, 0, 1, 0x7f)...) // type () -> i32
	m = append(m, section(3, 2, 0, 0)...)
	m = append(m, section(5, 1, 0, 1)...) // memory of 1 page
	//                        // two functions
	m = append(m, section(6, 1, 0x7f, 0x01, 0x41, 0x05, 0x0b)...) // global (mut i32) = 5
	m = append(m, section(7, 2, 4, 's', 'p', 'i', 'n', 0, 0, 5, 'c', 'o', 'u', 'n', 't', 0, 1)...)
	spin := []byte{0, 0x03, 0x40, 0x0c, 0x00, 0x0b, 0x41, 0x00, 0x0b}
	count := []byte{1, 1, 0x7f, // one i32 local
		0x02, 0x40, 0x03, 0x40, // block loop
		0x20, 0x00, 0x41, 0x01, 0x6a, 0x22, 0x00, // local.get 0, i32.const 1, i32.add, local.tee 0
		0x41, 0xa0, 0x8d, 0x06, 0x48, 0x0d, 0x00, // i32.const 100000, i32.lt_s, br_if 0
		0x0b, 0x0b, // end end
		0x03, 0x7f, 0x41, 0x07, 0x0b, 0x1a, // loop (result i32) i32.const 7 end drop
		0x42, 0x80, 0x80, 0x80, 0x80, 0x80, 0x01, 0x1a, // i64.const 2^35, drop
		0x44, 0, 0, 0, 0, 0, 0, 0xf0, 0x3f, 0x1a, // f64.const 1, drop
		0x23, 0x00, 0x1a, // global.get 0, drop
		0x20, 0x00, 0x0b}
	code := []byte{2, byte(len(spin))}
	code = append(code, spin...)
	code = append(code, byte(len(count)))
	code = append(code, count...)
	return append(m, section(10, code...)...)
}

func instantiateHand(t *testing.T, ctx context.Context, r wazero.Runtime, wasm []byte) (api.Module, api.MutableGlobal) {
	t.Helper()
	mod, err := r.InstantiateWithConfig(ctx, wasm, wazero.NewModuleConfig().WithName(""))
	if err != nil {
		t.Fatal(err)
	}
	g, ok := mod.ExportedGlobal(interruptExport).(api.MutableGlobal)
	if !ok {
		t.Fatalf("no mutable global %q", interruptExport)
	}
	return mod, g
}

func TestInterruptInstrumentation(t *testing.T) {
	ctx := context.Background()
	wasm, err := instrumentInterrupt(handModule())
	if err != nil {
		t.Fatal(err)
	}
	r := wazero.NewRuntime(ctx)
	defer r.Close(ctx)
	mod, g := instantiateHand(t, ctx, r, wasm)
	// the module still computes what it did, its own global untouched
	if res, err := mod.ExportedFunction("count").Call(ctx); err != nil || res[0] != 100000 {
		t.Fatalf("count: %v %v", res, err)
	}
	// with the interrupt set, the next loop head traps
	g.Set(1)
	if _, err := mod.ExportedFunction("count").Call(ctx); err == nil || !strings.Contains(err.Error(), "unreachable") {
		t.Fatalf("count with the interrupt set: %v", err)
	}

	// The watchdog interrupts a call that never ends by itself.
	mod2, g2 := instantiateHand(t, ctx, r, wasm)
	w := newWatch(time.Now(), 20*time.Millisecond)
	w.intr.Store(&g2)
	w.start.Store(max(int64(time.Since(w.epoch)), 1))
	done := make(chan error, 1)
	go func() { _, err := mod2.ExportedFunction("spin").Call(ctx); done <- err }()
	// A collection while the guest spins must not wait for it forever (native code
	// cannot be preempted; the instrumented loop exits to Go now and then).
	runtime.GC()
	select {
	case err := <-done:
		if err == nil || !w.fired.Load() || w.start.Load() != -1 {
			t.Fatalf("spin returned %v (fired %v)", err, w.fired.Load())
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the watchdog did not interrupt an endless loop")
	}
	w.close()

	for v, want := range map[int32]string{10000: "\x90\xce\x00", 63: "\x3f", 64: "\xc0\x00", -1: "\x7f"} {
		if got := string(appendS32(nil, v)); got != want {
			t.Fatalf("appendS32(%d) = %x, want %x", v, got, want)
		}
	}
	for _, bad := range [][]byte{nil, []byte("\x00asm\x02\x00\x00\x00"), handModule()[:40]} {
		if _, err := instrumentInterrupt(bad); err == nil {
			t.Fatalf("instrumented a broken module %x", bad)
		}
	}
}

func TestWatchdogStopsOnClose(t *testing.T) {
	// Count the watchdogs themselves: the process's goroutine count moves with other tests'
	// goroutines (servers, timers) and made this test flaky under load.
	watchdogs := func() int {
		buf := make([]byte, 1<<20)
		return strings.Count(string(buf[:runtime.Stack(buf, true)]), ".(*watch).run(")
	}
	settle := func(want func(int) bool) int {
		n := watchdogs()
		for i := 0; i < 200 && !want(n); i++ {
			time.Sleep(10 * time.Millisecond)
			n = watchdogs()
		}
		return n
	}
	before := watchdogs()
	var es []*Engine
	for i := 0; i < 3; i++ {
		e, err := Load(context.Background(), doDoc)
		if err != nil {
			t.Fatal(err)
		}
		es = append(es, e)
	}
	if n := settle(func(n int) bool { return n >= before+3 }); n < before+3 {
		t.Fatalf("%d watchdogs with 3 engines, %d before", n, before)
	}
	p := mustPolicy(t, es[0], "fast")
	if err := Do(context.Background(), p, func(context.Context) error { return nil }); err != nil {
		t.Fatal(err)
	}
	for _, e := range es {
		if err := e.Close(context.Background()); err != nil {
			t.Fatal(err)
		}
	}
	if n := settle(func(n int) bool { return n <= before }); n > before {
		t.Fatalf("%d watchdogs after Close, %d before", n, before)
	}
	// an unbounded engine has no watchdog
	e, err := Load(context.Background(), doDoc, WithGuestCallLimit(0))
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close(context.Background())
	if e.watch != nil {
		t.Fatal("a watchdog without a bound")
	}
}
