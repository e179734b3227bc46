package levee

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// resetCompilationCache forgets the process-wide cache, as a new process would.
func resetCompilationCache(t *testing.T) {
	t.Helper()
	cacheMu.Lock()
	cacheObj, cacheDir = nil, ""
	cacheMu.Unlock()
	t.Cleanup(func() {
		cacheMu.Lock()
		cacheObj, cacheDir = nil, ""
		cacheMu.Unlock()
	})
}

func cacheFiles(t *testing.T, dir string) map[string][]byte {
	t.Helper()
	out := map[string][]byte{}
	err := filepath.WalkDir(dir, func(p string, d os.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return err
		}
		b, err := os.ReadFile(p)
		out[p] = b
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	return out
}

func loadOnce(t *testing.T) {
	t.Helper()
	e, err := Load(context.Background(), "policies:\n  p:\n    attempts: 2\n", WithSeed(1))
	if err != nil {
		t.Fatal(err)
	}
	p, err := e.Policy("p")
	if err != nil {
		t.Fatal(err)
	}
	if err := Do(context.Background(), p, func(context.Context) error { return nil }); err != nil {
		t.Fatal(err)
	}
	_ = e.Close(context.Background())
}

// firstLoad points the cache at a new directory, loads once as a new process
// would, and answers the files the load wrote.
func firstLoad(t *testing.T) map[string][]byte {
	t.Helper()
	dir := t.TempDir()
	t.Setenv(CacheDirEnv, dir)
	resetCompilationCache(t)
	loadOnce(t)
	good := cacheFiles(t, dir)
	if len(good) == 0 {
		t.Fatal("the first load wrote no cache entry")
	}
	return good
}

// offsetTableBytes gives the second byte of each function offset in a wazero
// cache entry: after "WAZEVO", the version's length and the version, the
// number of functions (u32), then one u64 offset per function.
func offsetTableBytes(t *testing.T, b []byte) []int {
	t.Helper()
	if len(b) < 8 || string(b[:6]) != "WAZEVO" {
		t.Fatalf("not a wazero cache entry (%d bytes)", len(b))
	}
	at := 7 + int(b[6])
	n := int(binary.LittleEndian.Uint32(b[at:]))
	at += 4
	if n == 0 || at+8*n > len(b) {
		t.Fatalf("a wazero cache entry with %d functions in %d bytes", n, len(b))
	}
	out := make([]int, n)
	for i := range out {
		out[i] = at + 8*i + 1
	}
	return out
}

// A corrupt or truncated cache entry is never used: the host compiles again
// and writes the entry again.
func TestCompilationCacheSurvivesCorruptEntries(t *testing.T) {
	for _, corrupt := range []struct {
		name string
		f    func(*testing.T, []byte) []byte
	}{
		{"bit flip", func(_ *testing.T, b []byte) []byte { c := bytes.Clone(b); c[len(c)/2] ^= 0xff; return c }},
		{"truncated", func(_ *testing.T, b []byte) []byte { return b[:len(b)/3] }},
		{"garbage", func(*testing.T, []byte) []byte { return []byte("not a compiled module") }},
		// wazero's own checksum covers the machine code only: a flip in the table of
		// function offsets in front of it would send calls into the middle of other code
		{"offset table", func(t *testing.T, b []byte) []byte {
			c := bytes.Clone(b)
			for _, i := range offsetTableBytes(t, c) {
				c[i] ^= 0x01 // every function 256 bytes off
			}
			return c
		}},
	} {
		t.Run(corrupt.name, func(t *testing.T) {
			good := firstLoad(t)
			for p, b := range good {
				if strings.HasSuffix(p, digestSuffix) {
					continue
				}
				if err := os.WriteFile(p, corrupt.f(t, b), 0o600); err != nil {
					t.Fatal(err)
				}
			}
			resetCompilationCache(t)
			loadOnce(t) // must not fail, nor run the corrupt code
			again := cacheFiles(t, os.Getenv(CacheDirEnv))
			for p, b := range good {
				if !bytes.Equal(again[p], b) {
					t.Errorf("%s was not written again after the corruption", filepath.Base(p))
				}
			}
		})
	}
}

func TestCompilationCacheOff(t *testing.T) {
	t.Setenv(CacheDirEnv, "off")
	resetCompilationCache(t)
	loadOnce(t)
	if _, dir := compilationCache(); dir != "" {
		t.Fatalf("cache dir %q with %s=off", dir, CacheDirEnv)
	}
}

// Opening the cache removes the files not written for the prune age, in the
// cache directory and in wazero's version directories, and nothing else.
func TestOpeningTheCachePrunesOldFiles(t *testing.T) {
	resetCompilationCache(t)
	dir := t.TempDir()
	t.Setenv(CacheDirEnv, dir)
	age := cCachePruneAfterSecs * time.Second
	now := time.Now()
	old, young := now.Add(-age-time.Minute), now.Add(-age+time.Minute)
	files := map[string]time.Time{
		"stray":                      old,
		"wazero-v0.0.1-gone/entry":   old,
		"wazero-v0.0.1-gone/recent":  young,
		"other/entry":                old, // not wazero's: not looked into
		"wazero-v0.0.2-kept/current": young,
	}
	for name, at := range files {
		p := filepath.Join(dir, name)
		if err := os.MkdirAll(filepath.Dir(p), 0o700); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, []byte("x"), 0o600); err != nil {
			t.Fatal(err)
		}
		if err := os.Chtimes(p, at, at); err != nil {
			t.Fatal(err)
		}
		if strings.HasPrefix(name, "wazero-") { // a sound entry: its digest beside it
			d := sha256.Sum256([]byte("x"))
			if err := os.WriteFile(p+digestSuffix, []byte(hex.EncodeToString(d[:])), 0o600); err != nil {
				t.Fatal(err)
			}
			if err := os.Chtimes(p+digestSuffix, at, at); err != nil {
				t.Fatal(err)
			}
		}
	}
	if _, d := compilationCache(); d != dir {
		t.Fatalf("cache in %q, want %q", d, dir)
	}
	for name, at := range files {
		_, err := os.Stat(filepath.Join(dir, name))
		gone := os.IsNotExist(err)
		want := at.Equal(old) && name != "other/entry"
		if gone != want {
			t.Errorf("%s: removed %v, want %v (%v)", name, gone, want, err)
		}
	}
	if _, err := os.Stat(filepath.Join(dir, "wazero-v0.0.1-gone")); err != nil {
		t.Errorf("directories stay: %v", err)
	}
	loadOnce(t) // and the cache still serves a load
}

// An entry is read only with the digest written beside it when it was
// written: one without a digest (a cache from before the digests, or a write
// cut short) or with a digest that does not match is removed when the cache
// is opened, compiled again, written again and digested again; a digest
// without its entry goes too.
func TestCompilationCacheEntriesNeedTheirDigest(t *testing.T) {
	for _, c := range []struct {
		name   string
		break_ func(entry string) error
	}{
		{"digest missing", func(entry string) error { return os.Remove(entry + digestSuffix) }},
		{"digest wrong", func(entry string) error {
			return os.WriteFile(entry+digestSuffix, []byte(strings.Repeat("0", 64)), 0o600)
		}},
		{"digest garbage", func(entry string) error { return os.WriteFile(entry+digestSuffix, []byte("?"), 0o600) }},
	} {
		t.Run(c.name, func(t *testing.T) {
			good := firstLoad(t)
			var entries []string
			for p := range good {
				if !strings.HasSuffix(p, digestSuffix) {
					if _, ok := good[p+digestSuffix]; !ok {
						t.Fatalf("%s was written without its digest", filepath.Base(p))
					}
					entries = append(entries, p)
				}
			}
			if len(entries) == 0 {
				t.Fatal("the first load wrote no cache entry")
			}
			orphan := filepath.Join(filepath.Dir(entries[0]), "gone"+digestSuffix)
			if err := os.WriteFile(orphan, []byte("x"), 0o600); err != nil {
				t.Fatal(err)
			}
			stamp := time.Now().Add(-time.Hour)
			for _, p := range entries {
				if err := c.break_(p); err != nil {
					t.Fatal(err)
				}
				if err := os.Chtimes(p, stamp, stamp); err != nil { // to see it written again
					t.Fatal(err)
				}
			}
			resetCompilationCache(t)
			loadOnce(t)
			again := cacheFiles(t, os.Getenv(CacheDirEnv))
			for p, b := range good {
				if !bytes.Equal(again[p], b) {
					t.Errorf("%s differs after the load", filepath.Base(p))
				}
			}
			for _, p := range entries {
				if info, err := os.Stat(p); err != nil || !info.ModTime().After(stamp) {
					t.Errorf("%s was not compiled and written again (%v)", filepath.Base(p), err)
				}
			}
			if _, err := os.Stat(orphan); !os.IsNotExist(err) {
				t.Errorf("a digest without its entry stays (%v)", err)
			}
		})
	}
}
