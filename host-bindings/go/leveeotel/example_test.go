package leveeotel_test

import (
	"context"
	"fmt"

	levee "github.com/levee-dev/levee/host-bindings/go"
	"github.com/levee-dev/levee/host-bindings/go/leveeotel"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"
)

// Levee's metrics on an OpenTelemetry MeterProvider (here one with a manual reader).
func ExampleNew() {
	ctx := context.Background()
	reader := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	eng, err := levee.Load(ctx, "policies:\n  api: { attempts: 2 }\n",
		levee.WithTelemetry(leveeotel.New(leveeotel.WithMeterProvider(mp))))
	if err != nil {
		panic(err)
	}
	defer eng.Close(ctx)
	p, _ := eng.Policy("api")
	_ = levee.Do(ctx, p, func(context.Context) error { return nil })

	var rm metricdata.ResourceMetrics
	_ = reader.Collect(ctx, &rm)
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			if m.Name == "levee.calls" {
				dp := m.Data.(metricdata.Sum[int64]).DataPoints[0]
				result, _ := dp.Attributes.Value("levee.result")
				fmt.Println(m.Name, result.AsString(), dp.Value)
			}
		}
	}
	// Output: levee.calls success 1
}
