package levee

import (
	"os"
	"path/filepath"
	"strings"
	"sync"

	"github.com/tetratelabs/wazero"
)

// CacheDirEnv names the environment variable that moves the on-disk cache of
// compiled core modules ("off" disables it: modules are then compiled once per
// process, in memory). The default is <os.UserCacheDir()>/levee/wazero
// ($XDG_CACHE_HOME or ~/.cache on Linux). wazero writes each compiled module
// under a directory named after its own version, in a file named after the
// module's SHA-256, so a new core or a new wazero never reads an old entry.
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
	c, err := wazero.NewCompilationCacheWithDir(dir)
	if err != nil {
		return wazero.NewCompilationCache(), ""
	}
	return c, dir
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
