package levee

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"io"
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
// compiled-component cache"), and every entry whose SHA-256 does not match
// the digest the host wrote beside it when wazero wrote the entry.
const CacheDirEnv = "LEVEE_CACHE_DIR"

// digestSuffix names the file beside each wazero cache entry that holds the
// SHA-256 of the entry, in hex. wazero checks a CRC of the machine code only,
// not the table of function offsets in front of it, so a flipped bit there
// would send calls into the middle of other code; the digest covers the whole
// file. wazero reads entries by exact name and never lists the directory, so
// the files beside them are invisible to it.
const digestSuffix = ".levee-sha256"

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
	verifyCache(dir)
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

// versionDirs lists wazero's version directories in dir.
func versionDirs(dir string) []string {
	var out []string
	entries, _ := os.ReadDir(dir)
	for _, e := range entries {
		if e.IsDir() && strings.HasPrefix(e.Name(), "wazero-") {
			out = append(out, filepath.Join(dir, e.Name()))
		}
	}
	return out
}

// isEntryName tells wazero's entries from its temporary files and the digests
// beside the entries.
func isEntryName(n string) bool {
	return !strings.HasSuffix(n, digestSuffix) && !strings.HasSuffix(n, ".tmp")
}

// cacheEntries lists the entries of a version directory.
func cacheEntries(sub string) []string {
	var out []string
	files, _ := os.ReadDir(sub)
	for _, f := range files {
		if f.Type().IsRegular() && isEntryName(f.Name()) {
			out = append(out, filepath.Join(sub, f.Name()))
		}
	}
	return out
}

func fileDigest(path string) (string, error) {
	f, err := os.Open(path)
	if err != nil {
		return "", err
	}
	defer f.Close()
	h := sha256.New()
	if _, err := io.Copy(h, f); err != nil {
		return "", err
	}
	return hex.EncodeToString(h.Sum(nil)), nil
}

// verifyCache removes, when the process opens the cache (before wazero reads
// any entry), every entry without a digest beside it or whose content does not
// match its digest, and every digest without its entry: wazero then compiles
// the module again and writes the entry again, and sealCache digests it. An
// entry another process has written but not yet digested is removed too, and
// compiled again: never unsafe, at worst once more work.
func verifyCache(dir string) {
	for _, sub := range versionDirs(dir) {
		files, _ := os.ReadDir(sub) // one listing serves the entries and the digests
		present := make(map[string]bool, len(files))
		for _, f := range files {
			if f.Type().IsRegular() {
				present[f.Name()] = true
			}
		}
		for n := range present {
			p := filepath.Join(sub, n)
			if entry, isDigest := strings.CutSuffix(n, digestSuffix); isDigest {
				if !present[entry] {
					_ = os.Remove(p)
				}
				continue
			}
			if !isEntryName(n) {
				continue
			}
			want, err := os.ReadFile(p + digestSuffix)
			got, derr := fileDigest(p)
			if err != nil || derr != nil || string(want) != got {
				_ = os.Remove(p)
				_ = os.Remove(p + digestSuffix)
			}
		}
	}
}

// sealCache writes the digest of every entry that has none: after a compile,
// these are the entries wazero has written since the cache was opened (every
// older one without a digest was removed by verifyCache). The digest is
// written to a temporary file and renamed, so a reader never sees half of it.
// A digest that cannot be written leaves the entry to be removed and compiled
// again by the next process.
func sealCache(dir string) {
	for _, sub := range versionDirs(dir) {
		for _, entry := range cacheEntries(sub) {
			if _, err := os.Stat(entry + digestSuffix); err == nil {
				continue
			}
			d, err := fileDigest(entry)
			if err != nil {
				continue
			}
			tmp, err := os.CreateTemp(sub, filepath.Base(entry)+".*.tmp")
			if err != nil {
				continue
			}
			_, werr := tmp.WriteString(d)
			if cerr := tmp.Close(); werr != nil || cerr != nil || os.Rename(tmp.Name(), entry+digestSuffix) != nil {
				_ = os.Remove(tmp.Name())
			}
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

// compileModules makes e's runtime (the caller closes it on an error) and
// compiles the core module and the start adapter in it. The disk cache never
// fails a load: on a bad entry it is emptied and the modules compiled and
// written again; if that fails too, or the cache cannot be written (a full or
// read-only disk makes wazero's CompileModule fail), they are compiled with a
// cache in memory. After a compile on disk every entry written is digested
// (sealCache).
func (e *Engine) compileModules(ctx context.Context, wasm []byte) (core, adapter wazero.CompiledModule, err error) {
	compile := func(c wazero.CompilationCache) (wazero.CompiledModule, wazero.CompiledModule, error) {
		if e.rt != nil {
			_ = e.rt.Close(ctx) // the runtime of a failed attempt
		}
		e.rt = wazero.NewRuntimeWithConfig(ctx, wazero.NewRuntimeConfig().WithCompilationCache(c).WithMemoryLimitPages(e.o.memoryPages))
		core, err := e.rt.CompileModule(ctx, wasm)
		if err != nil {
			return nil, nil, fmt.Errorf("levee: compile core module: %w", err)
		}
		adapter, err := e.rt.CompileModule(ctx, startAdapterWasm())
		if err != nil {
			return nil, nil, fmt.Errorf("levee: compile the start adapter: %w", err)
		}
		return core, adapter, nil
	}
	cache, dir := compilationCache()
	core, adapter, err = compile(cache)
	if dir == "" {
		return core, adapter, err
	}
	if err == nil {
		sealCache(dir)
		return core, adapter, nil
	}
	if isCacheCorrupt(err) {
		dropCompilationCache(cache)
		if cache, dir = compilationCache(); dir != "" {
			if core, adapter, err = compile(cache); err == nil {
				sealCache(dir)
				return core, adapter, nil
			}
		}
	}
	return compile(memoryCache())
}
