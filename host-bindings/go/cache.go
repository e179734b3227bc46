package levee

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"github.com/tetratelabs/wazero"
)

// CacheDirEnv names the environment variable that moves the on-disk cache of
// compiled core modules ("off" disables it: modules are then compiled once per
// process, in memory). The default is <os.UserCacheDir()>/levee/wazero
// ($XDG_CACHE_HOME or ~/.cache on Linux). wazero writes each compiled module
// under a directory named after its own version, in a file named after the
// module's SHA-256, so a new core or a new wazero never reads an old entry.
// Opening the cache removes the files in it, and in wazero's version
// directories, last written more than 30 days ago (docs/hosts.md, "The
// compiled-component cache").
const CacheDirEnv = "LEVEE_CACHE_DIR"

var (
	cacheMu  sync.Mutex
	cacheObj wazero.CompilationCache
	cacheDir string // "" when the cache is in memory only
)

// compilationCache is the compilation cache shared by every engine of the
// process: on disk where a cache directory can be made, in memory otherwise.
func compilationCache() (wazero.CompilationCache, string) {
	cacheMu.Lock()
	defer cacheMu.Unlock()
	if cacheObj == nil {
		cacheObj, cacheDir = newCompilationCache()
	}
	return cacheObj, cacheDir
}

func newCompilationCache() (wazero.CompilationCache, string) {
	dir := os.Getenv(CacheDirEnv)
	if dir == "off" {
		return wazero.NewCompilationCache(), ""
	}
	if dir == "" {
		base, err := os.UserCacheDir()
		if err != nil {
			return wazero.NewCompilationCache(), ""
		}
		dir = filepath.Join(base, "levee", "wazero")
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return wazero.NewCompilationCache(), ""
	}
	pruneCache(dir, time.Now())
	c, err := wazero.NewCompilationCacheWithDir(dir)
	if err != nil {
		return wazero.NewCompilationCache(), ""
	}
	return c, dir
}

// pruneCache removes the files of dir, and of wazero's version directories
// in it, last written more than cCachePruneAfterSecs before now: the entries of
// cores and wazeros no longer used, which are never read again (wazero's
// writes are its own, so this runs when the process opens the cache, not on a
// miss as in the other hosts). Directories stay; so does whatever cannot be
// listed or removed.
func pruneCache(dir string, now time.Time) {
	cutoff := now.Add(-cCachePruneAfterSecs * time.Second)
	removeOld := func(d string, e os.DirEntry) {
		if !e.Type().IsRegular() {
			return
		}
		if info, err := e.Info(); err == nil && info.ModTime().Before(cutoff) {
			_ = os.Remove(filepath.Join(d, e.Name()))
		}
	}
	entries, _ := os.ReadDir(dir)
	for _, e := range entries {
		if !e.IsDir() {
			removeOld(dir, e)
			continue
		}
		if !strings.HasPrefix(e.Name(), "wazero-") {
			continue
		}
		sub := filepath.Join(dir, e.Name())
		files, _ := os.ReadDir(sub)
		for _, f := range files {
			removeOld(sub, f)
		}
	}
}

// isCacheCorrupt tells a failure to read a cache entry (truncated, bit-flipped,
// another wazero's) from a failure to compile.
func isCacheCorrupt(err error) bool {
	return err != nil && strings.Contains(err.Error(), "compilationcache:")
}

// dropCompilationCache empties the cache directory after a corrupt entry, so
// the next compile writes it again.
func dropCompilationCache(bad wazero.CompilationCache) {
	cacheMu.Lock()
	defer cacheMu.Unlock()
	if cacheObj != bad {
		return // another engine has replaced it already
	}
	// bad is not closed: engines loaded before may still run on its compiled code
	if cacheDir != "" {
		entries, _ := os.ReadDir(cacheDir)
		for _, e := range entries {
			if strings.HasPrefix(e.Name(), "wazero-") {
				_ = os.RemoveAll(filepath.Join(cacheDir, e.Name()))
			}
		}
	}
	cacheObj = nil
}

// memoryCache is the fallback when the disk cache cannot serve a load.
var memoryCache = sync.OnceValue(wazero.NewCompilationCache)

// compileCore makes e's runtime (the caller closes it on an error) and compiles the core module in it. The disk
// cache never fails a load: on a bad entry it is emptied and the module
// compiled and written again; if that fails too, or the cache cannot be
// written (a full or read-only disk makes wazero's CompileModule fail), the
// module is compiled with a cache in memory.
func (e *Engine) compileCore(ctx context.Context, wasm []byte) (wazero.CompiledModule, error) {
	compile := func(c wazero.CompilationCache) (wazero.CompiledModule, error) {
		if e.rt != nil {
			_ = e.rt.Close(ctx) // the runtime of a failed attempt
		}
		e.rt = wazero.NewRuntimeWithConfig(ctx, wazero.NewRuntimeConfig().WithCompilationCache(c).WithMemoryLimitPages(e.o.memoryPages))
		return e.rt.CompileModule(ctx, wasm)
	}
	cache, dir := compilationCache()
	cm, err := compile(cache)
	if err == nil || dir == "" {
		return cm, err
	}
	if isCacheCorrupt(err) {
		dropCompilationCache(cache)
		if cache, dir = compilationCache(); dir != "" {
			if cm, err = compile(cache); err == nil {
				return cm, nil
			}
		}
	}
	return compile(memoryCache())
}
