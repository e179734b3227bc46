// Command loadgen is the Envoy benchmark's two other processes: a fast upstream
// (-serve) and an open-loop load generator at a fixed rate (-url).
//
//	loadgen -serve 127.0.0.1:0          prints the address, answers 200 "ok"
//	loadgen -url URL -rate 500 -for 10s prints p50 p99 (microseconds), the count
//	                                    measured, the errors and the count sent
//	                                    (warm-up included)
//
// The generator sends each request at its scheduled time on one of -conns
// keep-alive connections, and measures from that scheduled time (so a stall
// shows as latency: no coordinated omission).
package main

import (
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"sort"
	"sync"
	"time"
)

func serve(addr string) {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	fmt.Println(ln.Addr().String())
	body := []byte("ok")
	_ = http.Serve(ln, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("content-length", "2")
		_, _ = w.Write(body)
	}))
}

func main() {
	serveAddr := flag.String("serve", "", "serve 200s on this address instead")
	url := flag.String("url", "", "target URL")
	rate := flag.Float64("rate", 500, "requests per second")
	dur := flag.Duration("for", 10*time.Second, "how long")
	warm := flag.Duration("warmup", 2*time.Second, "warm-up, not measured")
	conns := flag.Int("conns", 8, "keep-alive connections")
	flag.Parse()
	if *serveAddr != "" {
		serve(*serveAddr)
		return
	}
	if *url == "" || *rate <= 0 {
		fmt.Fprintln(os.Stderr, "usage: loadgen -url URL [-rate N] [-for D] | -serve ADDR")
		os.Exit(2)
	}
	tr := &http.Transport{MaxIdleConnsPerHost: *conns, MaxConnsPerHost: *conns, DisableCompression: true}
	client := &http.Client{Transport: tr, Timeout: 5 * time.Second}
	interval := time.Duration(float64(time.Second) / *rate)
	total := int((*warm + *dur) / interval)
	warmN := int(*warm / interval)
	lat := make([]time.Duration, 0, total)
	var mu sync.Mutex
	var wg sync.WaitGroup
	errs := 0
	sem := make(chan struct{}, *conns)
	start := time.Now()
	for i := 0; i < total; i++ {
		at := start.Add(time.Duration(i) * interval)
		if d := time.Until(at); d > 0 {
			time.Sleep(d)
		}
		sem <- struct{}{}
		wg.Add(1)
		go func(i int, at time.Time) {
			defer wg.Done()
			defer func() { <-sem }()
			resp, err := client.Get(*url)
			ok := err == nil && resp.StatusCode == 200
			if err == nil {
				_, _ = io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
			}
			d := time.Since(at)
			mu.Lock()
			defer mu.Unlock()
			if !ok {
				errs++
				return
			}
			if i >= warmN {
				lat = append(lat, d)
			}
		}(i, at)
	}
	wg.Wait()
	if len(lat) == 0 {
		fmt.Fprintln(os.Stderr, "no successful requests")
		os.Exit(1)
	}
	sort.Slice(lat, func(a, b int) bool { return lat[a] < lat[b] })
	pct := func(p float64) float64 {
		i := int(p / 100 * float64(len(lat)))
		if i >= len(lat) {
			i = len(lat) - 1
		}
		return float64(lat[i].Nanoseconds()) / 1000
	}
	fmt.Printf("%.1f %.1f %d %d %d\n", pct(50), pct(99), len(lat), errs, total)
}
