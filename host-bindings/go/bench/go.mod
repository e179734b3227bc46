module github.com/levee-dev/levee/host-bindings/go/bench

go 1.25.0

require (
	github.com/cenkalti/backoff/v5 v5.0.3
	github.com/failsafe-go/failsafe-go v0.9.8
	github.com/levee-dev/levee/host-bindings/go v0.0.0
	github.com/sony/gobreaker/v2 v2.4.0
)

require (
	github.com/bits-and-blooms/bitset v1.24.4 // indirect
	github.com/tetratelabs/wazero v1.12.0 // indirect
	golang.org/x/sys v0.44.0 // indirect
)

replace github.com/levee-dev/levee/host-bindings/go => ../
