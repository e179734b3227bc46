// Command coldstart times one engine load in a fresh process (compile or
// cache read of the core module, instantiation, document parse) and prints
// the process's peak RSS after it. Run it twice with an empty cache directory
// to see the cold and the warm load:
//
//	d=$(mktemp -d); go build -o /tmp/coldstart ./coldstart
//	LEVEE_CACHE_DIR=$d /tmp/coldstart; LEVEE_CACHE_DIR=$d /tmp/coldstart; LEVEE_CACHE_DIR=off /tmp/coldstart
package main

import (
	"context"
	"fmt"
	"os"
	"strings"
	"syscall"
	"time"

	levee "github.com/levee-dev/levee/host-bindings/go"
	"github.com/levee-dev/levee/host-bindings/go/bench"
)

func main() {
	t0 := time.Now()
	e, err := levee.Load(context.Background(), bench.Doc, levee.WithSeed(1))
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	load := time.Since(t0)
	p, err := e.Policy("api")
	if err == nil {
		err = levee.Do(context.Background(), p, bench.Work)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	var ru syscall.Rusage
	_ = syscall.Getrusage(syscall.RUSAGE_SELF, &ru)
	cache := os.Getenv(levee.CacheDirEnv)
	if cache == "" {
		cache = "default"
	}
	fmt.Printf("go: load %.1f ms, max RSS %.1f MB (%s=%s)\n", float64(load.Microseconds())/1e3, float64(ru.Maxrss)/1024, levee.CacheDirEnv, strings.TrimSpace(cache))
}
