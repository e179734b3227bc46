package levee

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
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

// A corrupt or truncated cache entry is never used: the host compiles again
// and writes the entry again.
func TestCompilationCacheSurvivesCorruptEntries(t *testing.T) {
	for _, corrupt := range []struct {
		name string
		f    func([]byte) []byte
	}{
		{"bit flip", func(b []byte) []byte { c := bytes.Clone(b); c[len(c)/2] ^= 0xff; return c }},
		{"truncated", func(b []byte) []byte { return b[:len(b)/3] }},
		{"garbage", func([]byte) []byte { return []byte("not a compiled module") }},
	} {
		t.Run(corrupt.name, func(t *testing.T) {
			dir := t.TempDir()
			t.Setenv(CacheDirEnv, dir)
			resetCompilationCache(t)
			loadOnce(t)
			good := cacheFiles(t, dir)
			if len(good) == 0 {
				t.Fatal("the first load wrote no cache entry")
			}
			for p, b := range good {
				if err := os.WriteFile(p, corrupt.f(b), 0o600); err != nil {
					t.Fatal(err)
				}
			}
			resetCompilationCache(t)
			loadOnce(t) // must not fail, nor run the corrupt code
			again := cacheFiles(t, dir)
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
