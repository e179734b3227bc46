package levee

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"testing"
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
