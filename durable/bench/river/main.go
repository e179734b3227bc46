// River, the peer of durable/bench: the same job as Levee's durable benchmark (durable/tests/bench.py),
// run by River v0.51.2 on PostgreSQL (riverpgxv5) or SQLite (riversqlite).
//
//	river-bench run --store postgres:DSN --calls 10000 --workers 3
//	river-bench run --store sqlite:/tmp/river.db --calls 10000 --workers 1
//
// `run` migrates River's schema into an empty store, submits the calls (InsertMany, in batches
// of 1,000: River's way to insert many jobs), then starts the worker processes (this program
// with `work`, 32 workers each, as bench.py's executors run 32 calls at once) and waits until no
// job is left to run. One job in ten fails on its first attempt and is retried after 100 ms.
// It prints the submit rate and the calls per second from the workers' start to the last end.
package main

import (
	"context"
	"database/sql"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/riverqueue/river"
	"github.com/riverqueue/river/riverdriver"
	"github.com/riverqueue/river/riverdriver/riverpgxv5"
	"github.com/riverqueue/river/riverdriver/riversqlite"
	"github.com/riverqueue/river/rivermigrate"
	"github.com/riverqueue/river/rivertype"
	_ "modernc.org/sqlite"
)

// CallArgs is one call; N picks the calls that fail once.
type CallArgs struct {
	N int `json:"n"`
}

// Kind is River's job kind.
func (CallArgs) Kind() string { return "bench" }

// Call does no work; one call in ten fails on its first attempt.
type Call struct{ river.WorkerDefaults[CallArgs] }

// Work runs one attempt.
func (Call) Work(_ context.Context, job *river.Job[CallArgs]) error {
	if job.Args.N%10 == 0 && job.Attempt == 1 {
		return errors.New("fails once")
	}
	return nil
}

// retryAfter100ms is the benchmark's backoff: the retry is due 100 ms after the failure.
type retryAfter100ms struct{}

func (retryAfter100ms) NextRetry(*rivertype.JobRow) time.Time {
	return time.Now().Add(100 * time.Millisecond)
}

func must(err error) {
	if err != nil {
		fmt.Fprintln(os.Stderr, "river-bench:", err)
		os.Exit(1)
	}
}

// store opens STORE and answers the River client's pieces for it.
type store struct {
	pool *pgxpool.Pool
	db   *sql.DB
}

func open(ctx context.Context, spec string) store {
	kind, rest, _ := strings.Cut(spec, ":")
	switch kind {
	case "postgres":
		pool, err := pgxpool.New(ctx, rest)
		must(err)
		return store{pool: pool}
	case "sqlite":
		db, err := sql.Open("sqlite", "file:"+rest+"?_pragma=journal_mode(WAL)&_pragma=busy_timeout(30000)&_txlock=immediate")
		must(err)
		db.SetMaxOpenConns(1)
		return store{db: db}
	}
	must(fmt.Errorf("--store: use postgres:DSN or sqlite:PATH, not %q", spec))
	return store{}
}

func newClient[TTx any](d riverdriver.Driver[TTx], workers *river.Workers, concurrency int) *river.Client[TTx] {
	cfg := &river.Config{RetryPolicy: retryAfter100ms{}}
	if workers != nil {
		cfg.Workers = workers
		cfg.Queues = map[string]river.QueueConfig{river.QueueDefault: {MaxWorkers: concurrency}}
	}
	c, err := river.NewClient(d, cfg)
	must(err)
	return c
}

func migrate[TTx any](ctx context.Context, d riverdriver.Driver[TTx]) {
	m, err := rivermigrate.New(d, nil)
	must(err)
	_, err = m.Migrate(ctx, rivermigrate.DirectionUp, nil)
	must(err)
}

// submit inserts the calls with InsertMany in batches of 1,000: how long it took.
func submit[TTx any](ctx context.Context, d riverdriver.Driver[TTx], calls int) time.Duration {
	migrate(ctx, d)
	c := newClient(d, nil, 0)
	t0 := time.Now()
	for done := 0; done < calls; {
		batch := make([]river.InsertManyParams, 0, 1000)
		for i := done; i < calls && len(batch) < 1000; i++ {
			batch = append(batch, river.InsertManyParams{Args: CallArgs{N: i + 1}})
		}
		_, err := c.InsertMany(ctx, batch)
		must(err)
		done += len(batch)
	}
	return time.Since(t0)
}

// work runs calls until SIGTERM.
func work[TTx any](ctx context.Context, d riverdriver.Driver[TTx], concurrency int) {
	workers := river.NewWorkers()
	river.AddWorker(workers, &Call{})
	c := newClient(d, workers, concurrency)
	must(c.Start(ctx))
	sig := make(chan os.Signal, 1)
	signal.Notify(sig, syscall.SIGTERM, syscall.SIGINT)
	<-sig
	stop, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	_ = c.Stop(stop)
}

// left is how many jobs still have to run.
func (s store) left(ctx context.Context) int {
	const q = "SELECT COUNT(*) FROM river_job WHERE state NOT IN ('completed', 'discarded', 'cancelled')"
	var n int
	if s.pool != nil {
		must(s.pool.QueryRow(ctx, q).Scan(&n))
	} else {
		must(s.db.QueryRowContext(ctx, q).Scan(&n))
	}
	return n
}

func main() {
	if len(os.Args) < 2 {
		must(errors.New("usage: river-bench run|work --store STORE [--calls N] [--workers W] [--concurrency C]"))
	}
	fs := flag.NewFlagSet(os.Args[1], flag.ExitOnError)
	spec := fs.String("store", "", "postgres:DSN or sqlite:PATH")
	calls := fs.Int("calls", 10000, "calls to submit")
	procs := fs.Int("workers", 1, "worker processes")
	concurrency := fs.Int("concurrency", 32, "calls each worker runs at once")
	must(fs.Parse(os.Args[2:]))
	ctx := context.Background()
	s := open(ctx, *spec)
	switch os.Args[1] {
	case "work":
		if s.pool != nil {
			work(ctx, riverpgxv5.New(s.pool), *concurrency)
		} else {
			work(ctx, riversqlite.New(s.db), *concurrency)
		}
	case "run":
		var took time.Duration
		if s.pool != nil {
			took = submit(ctx, riverpgxv5.New(s.pool), *calls)
		} else {
			took = submit(ctx, riversqlite.New(s.db), *calls)
		}
		submitted := took
		self, err := os.Executable()
		must(err)
		start := time.Now()
		var ws []*exec.Cmd
		for range *procs {
			w := exec.Command(self, "work", "--store", *spec, "--concurrency", fmt.Sprint(*concurrency))
			w.Stdout, w.Stderr = os.Stdout, os.Stderr
			must(w.Start())
			ws = append(ws, w)
		}
		for s.left(ctx) > 0 && time.Since(start) < 10*time.Minute {
			time.Sleep(20 * time.Millisecond)
		}
		took = time.Since(start)
		for _, w := range ws {
			_ = w.Process.Signal(syscall.SIGTERM)
			_ = w.Wait()
		}
		fmt.Printf("river, %s, %d workers: %d calls in %.2fs: %.0f calls/s (submitted at %.0f calls/s)\n",
			strings.SplitN(*spec, ":", 2)[0], *procs, *calls, took.Seconds(), float64(*calls)/took.Seconds(),
			float64(*calls)/submitted.Seconds())
	default:
		must(fmt.Errorf("unknown command %q", os.Args[1]))
	}
}
