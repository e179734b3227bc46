package levee

// The bindings are written once against wit/levee.wit. This test reads the WIT
// itself (the subset levee.wit uses: enums, records, a resource with static
// and method functions) and checks that bindings.go describes exactly its
// types, case orders and functions, so the two cannot drift apart.

import (
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
	"unicode"
)

type witParser struct {
	toks []string
	i    int
}

func tokenizeWIT(src string) []string {
	var lines []string
	for _, l := range strings.Split(src, "\n") {
		if i := strings.Index(l, "//"); i >= 0 {
			l = l[:i]
		}
		lines = append(lines, l)
	}
	s := strings.Join(lines, "\n")
	var toks []string
	for i := 0; i < len(s); {
		c := rune(s[i])
		switch {
		case unicode.IsSpace(c):
			i++
		case strings.HasPrefix(s[i:], "->"):
			toks = append(toks, "->")
			i += 2
		case strings.ContainsRune("{}()<>,:;=.@/", c):
			toks = append(toks, string(c))
			i++
		default:
			j := i
			for j < len(s) && (unicode.IsLetter(rune(s[j])) || unicode.IsDigit(rune(s[j])) || s[j] == '-' || s[j] == '_' || s[j] == '%') {
				j++
			}
			if j == i {
				j = i + 1
			}
			toks = append(toks, strings.TrimPrefix(s[i:j], "%"))
			i = j
		}
	}
	return toks
}

func (p *witParser) peek() string {
	if p.i < len(p.toks) {
		return p.toks[p.i]
	}
	return ""
}
func (p *witParser) next() string { t := p.peek(); p.i++; return t }
func (p *witParser) expect(t *testing.T, s string) {
	t.Helper()
	if got := p.next(); got != s {
		t.Fatalf("WIT: expected %q, found %q at token %d", s, got, p.i-1)
	}
}

type witFunc struct {
	name     string
	resource string // the resource of a method, static function or constructor
	ctor     bool
	static   bool
	free     bool // a function of the interface, not of the resource
	params   []*witType
	results  []*witType
}

type witDefs struct {
	enums    map[string][]string
	records  map[string]*witType
	variants map[string]*witType
	funcs    []witFunc
}

func (p *witParser) typ(t *testing.T, d *witDefs) *witType {
	name := p.next()
	switch name {
	case "u8":
		return tU8
	case "u32":
		return tU32
	case "s32":
		return tS32
	case "u64":
		return tU64
	case "s64":
		return tS64
	case "f64":
		return tF64
	case "bool":
		return tBool
	case "string":
		return tString
	case "list":
		p.expect(t, "<")
		e := p.typ(t, d)
		p.expect(t, ">")
		return listOf(e)
	case "option":
		p.expect(t, "<")
		e := p.typ(t, d)
		p.expect(t, ">")
		return optionOf(e)
	case "result":
		var ok, er *witType
		if p.peek() == "<" {
			p.next()
			if p.peek() == "_" {
				p.next()
			} else {
				ok = p.typ(t, d)
			}
			if p.peek() == "," {
				p.next()
				er = p.typ(t, d)
			}
			p.expect(t, ">")
		}
		return resultOf(ok, er)
	case "engine":
		return tOwnEngine
	case "executor":
		return tOwnExecutor
	case "borrow":
		p.expect(t, "<")
		r := p.next()
		p.expect(t, ">")
		if r == "executor" {
			return tBorrowExecutor
		}
		return tBorrowEngine
	}
	if cases, ok := d.enums[name]; ok {
		return enumOf(name, cases...)
	}
	if r, ok := d.records[name]; ok {
		return r
	}
	if v, ok := d.variants[name]; ok {
		return v
	}
	t.Fatalf("WIT: unknown type %q", name)
	return nil
}

// function parses `name: [static] func(params) [-> result];` after its name.
func (p *witParser) function(t *testing.T, d *witDefs, name string) witFunc {
	f := witFunc{name: name}
	if name == "constructor" {
		f.ctor = true
	} else {
		p.expect(t, ":")
		if p.peek() == "static" {
			p.next()
			f.static = true
		}
		p.expect(t, "func")
	}
	p.expect(t, "(")
	for p.peek() != ")" {
		p.next()
		p.expect(t, ":")
		f.params = append(f.params, p.typ(t, d))
		if p.peek() == "," {
			p.next()
		}
	}
	p.next()
	if p.peek() == "->" {
		p.next()
		f.results = []*witType{p.typ(t, d)}
	}
	p.expect(t, ";")
	return f
}

func (p *witParser) block(t *testing.T, d *witDefs) {
	p.expect(t, "{")
	for p.peek() != "}" {
		switch p.next() {
		case "enum":
			name := p.next()
			p.expect(t, "{")
			var cases []string
			for p.peek() != "}" {
				cases = append(cases, p.next())
				if p.peek() == "," {
					p.next()
				}
			}
			p.next()
			d.enums[name] = cases
		case "record":
			name := p.next()
			p.expect(t, "{")
			var kv []any
			for p.peek() != "}" {
				f := p.next()
				p.expect(t, ":")
				kv = append(kv, f, p.typ(t, d))
				if p.peek() == "," {
					p.next()
				}
			}
			p.next()
			d.records[name] = recordOf(name, kv...)
		case "variant":
			name := p.next()
			p.expect(t, "{")
			var cases []string
			var payloads []*witType
			for p.peek() != "}" {
				cases = append(cases, p.next())
				var pt *witType
				if p.peek() == "(" {
					p.next()
					pt = p.typ(t, d)
					p.expect(t, ")")
				}
				payloads = append(payloads, pt)
				if p.peek() == "," {
					p.next()
				}
			}
			p.next()
			d.variants[name] = variantOf(name, cases, payloads)
		case "use":
			for p.next() != ";" {
			}
		case "resource":
			res := p.next()
			p.expect(t, "{")
			for p.peek() != "}" {
				f := p.function(t, d, p.next())
				f.resource = res
				if f.ctor {
					f.results = []*witType{ownOf(res)}
				}
				d.funcs = append(d.funcs, f)
			}
			p.next()
		default:
			if p.peek() != ":" {
				t.Fatalf("WIT: unexpected %q at token %d", p.toks[p.i-1], p.i-1)
			}
			f := p.function(t, d, p.toks[p.i-1])
			f.free = true
			d.funcs = append(d.funcs, f)
		}
	}
	p.next()
}

func parseWIT(t *testing.T, src string) *witDefs {
	d := &witDefs{enums: map[string][]string{}, records: map[string]*witType{}, variants: map[string]*witType{}}
	p := &witParser{toks: tokenizeWIT(src)}
	for p.peek() != "" {
		switch p.next() {
		case "package":
			for p.next() != ";" {
			}
		case "interface":
			p.next()
			p.block(t, d)
		case "world":
			p.next()
			for p.next() != "}" {
			}
		default:
			t.Fatalf("WIT: unexpected top-level %q", p.toks[p.i-1])
		}
	}
	return d
}

func TestBindingsMatchTheWIT(t *testing.T) {
	path := os.Getenv("LEVEE_WIT")
	if path == "" {
		path = filepath.Join("..", "..", "wit", "levee.wit")
	}
	src, err := os.ReadFile(path)
	if err != nil {
		t.Fatalf("read the WIT: %v", err)
	}
	d := parseWIT(t, string(src))
	for name, ours := range map[string][]string{"reason": reasonNames, "outcome-kind": outcomeKindNames,
		"breaker-state": breakerStateNames, "event-kind": eventKindNames,
		"durable-action": durableActionNames, "durable-reason": durableReasonNames, "log-level": logLevelNames[:]} {
		if !reflect.DeepEqual(d.enums[name], ours) {
			t.Errorf("enum %s: WIT %v, bindings %v", name, d.enums[name], ours)
		}
	}
	for name, ours := range map[string]*witType{"event": tEvent, "load-error": tLoadError, "policy-info": tPolicyInfo,
		"call-info": tCallInfo, "analysis": tAnalysis, "durable-step": tDurableStep, "hedge-start": tHedgeStart,
		"hedge-end": tHedgeEnd, "hedge-answer": tHedgeAnswer, "executor-config": tExecutorConfig,
		"claimed-call": tClaimedCall, "row-write": tRowWrite, "exec-claim": tExecClaim, "exec-run": tExecRun,
		"exec-quarantine": tExecQuarantine, "exec-log": tExecLog, "exec-written": tExecWritten,
		"exec-finished": tExecFinished} {
		w := d.records[name]
		if w == nil || !reflect.DeepEqual(w.names, ours.names) || !reflect.DeepEqual(w.offsets, ours.offsets) ||
			w.size != ours.size || w.align != ours.align || !reflect.DeepEqual(w.flat, ours.flat) {
			t.Errorf("record %s differs from the WIT", name)
		}
	}
	for name, ours := range map[string]*witType{"hedge-command": tHedgeCommand, "write-result": tWriteResult,
		"exec-event": tExecEvent, "exec-command": tExecCommand} {
		w := d.variants[name]
		if w == nil || !reflect.DeepEqual(w.names, ours.names) || w.payload != ours.payload || w.discSz != ours.discSz ||
			w.size != ours.size || w.align != ours.align || !reflect.DeepEqual(w.flat, ours.flat) {
			t.Errorf("variant %s differs from the WIT", name)
			continue
		}
		for i := range w.fields {
			if (w.fields[i] == nil) != (ours.fields[i] == nil) ||
				(w.fields[i] != nil && (w.fields[i].size != ours.fields[i].size || !reflect.DeepEqual(w.fields[i].flat, ours.fields[i].flat))) {
				t.Errorf("variant %s: case %s differs from the WIT", name, w.names[i])
			}
		}
	}
	if len(d.funcs) != nFuncs {
		t.Fatalf("the WIT has %d engine functions, the bindings %d", len(d.funcs), nFuncs)
	}
	for i, f := range d.funcs {
		self := tBorrowEngine
		if f.resource == "executor" {
			self = tBorrowExecutor
		}
		export := ifaceEngineAPI + "#[method]" + f.resource + "." + f.name
		params := append([]*witType{self}, f.params...)
		if f.static {
			export = ifaceEngineAPI + "#[static]" + f.resource + "." + f.name
			params = f.params
		}
		if f.ctor {
			export = ifaceEngineAPI + "#[constructor]" + f.resource
			params = f.params
		}
		if f.free {
			export = ifaceEngineAPI + "#" + f.name
			params = f.params
		}
		w := newFuncSig(export, params, f.results)
		s := sigs[i]
		if s.export != w.export || !reflect.DeepEqual(s.flatParams, w.flatParams) ||
			!reflect.DeepEqual(s.flatResults, w.flatResults) || s.retptr != w.retptr || len(s.results) != len(w.results) {
			t.Errorf("function %d: bindings %s %v -> %v, WIT %s %v -> %v", i, s.export, s.flatParams, s.flatResults,
				w.export, w.flatParams, w.flatResults)
			continue
		}
		for j := range w.results {
			if s.results[j].size != w.results[j].size || s.results[j].align != w.results[j].align ||
				!reflect.DeepEqual(s.results[j].flat, w.results[j].flat) {
				t.Errorf("%s: result layout differs from the WIT", s.export)
			}
		}
		for j := range w.params {
			if !reflect.DeepEqual(s.params[j].flat, w.params[j].flat) {
				t.Errorf("%s: param %d differs from the WIT", s.export, j)
			}
		}
	}
}
