package bench

import (
	"context"
	"testing"

	levee "github.com/levee-dev/levee/host-bindings/go"
)

func leveePolicy(b *testing.B, opts ...levee.Option) *levee.Policy {
	e, err := levee.Load(context.Background(), Doc, append([]levee.Option{levee.WithSeed(1)}, opts...)...)
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { _ = e.Close(context.Background()) })
	p, err := e.Policy("api")
	if err != nil {
		b.Fatal(err)
	}
	return p
}

func BenchmarkBare(b *testing.B) {
	ctx := context.Background()
	for i := 0; i < b.N; i++ {
		_ = Work(ctx)
	}
}

func BenchmarkLevee(b *testing.B) {
	p := leveePolicy(b)
	ctx := context.Background()
	b.ReportAllocs()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		if err := levee.Do(ctx, p, Work); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkLeveeUnbounded turns the guest-call bound off (WithGuestCallLimit(0)).
func BenchmarkLeveeUnbounded(b *testing.B) {
	p := leveePolicy(b, levee.WithGuestCallLimit(0))
	ctx := context.Background()
	b.ReportAllocs()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		if err := levee.Do(ctx, p, Work); err != nil {
			b.Fatal(err)
		}
	}
}

func BenchmarkLeveeKeyed(b *testing.B) {
	p := leveePolicy(b)
	ctx := context.Background()
	key := levee.WithKey("api.example.com")
	b.ReportAllocs()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		if err := levee.Do(ctx, p, Work, key); err != nil {
			b.Fatal(err)
		}
	}
}

func BenchmarkLeveeParallel(b *testing.B) {
	p := leveePolicy(b)
	ctx := context.Background()
	b.ReportAllocs()
	b.ResetTimer()
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			if err := levee.Do(ctx, p, Work); err != nil {
				b.Error(err)
				return
			}
		}
	})
}

func BenchmarkFailsafeGo(b *testing.B) {
	ex := FailsafeExecutor()
	ctx := context.Background()
	fn := func() error { return Work(ctx) }
	b.ReportAllocs()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		if err := ex.Run(fn); err != nil {
			b.Fatal(err)
		}
	}
}

func BenchmarkFailsafeGoParallel(b *testing.B) {
	ex := FailsafeExecutor()
	ctx := context.Background()
	fn := func() error { return Work(ctx) }
	b.ReportAllocs()
	b.ResetTimer()
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			if err := ex.Run(fn); err != nil {
				b.Error(err)
				return
			}
		}
	})
}

func BenchmarkGobreakerBackoff(b *testing.B) {
	cb := GobreakerCB()
	ctx := context.Background()
	b.ReportAllocs()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		if err := GobreakerCall(ctx, cb); err != nil {
			b.Fatal(err)
		}
	}
}

func BenchmarkGobreakerBackoffParallel(b *testing.B) {
	cb := GobreakerCB()
	ctx := context.Background()
	b.ReportAllocs()
	b.ResetTimer()
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			if err := GobreakerCall(ctx, cb); err != nil {
				b.Error(err)
				return
			}
		}
	})
}
