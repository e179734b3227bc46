module github.com/levee-dev/levee/host-bindings/go/grpc/bench

go 1.26.0

require (
	github.com/failsafe-go/failsafe-go v0.9.8
	github.com/levee-dev/levee/host-bindings/go v0.0.0
	github.com/levee-dev/levee/host-bindings/go/grpc v0.0.0
	google.golang.org/grpc v1.85.0
)

require (
	github.com/bits-and-blooms/bitset v1.24.4 // indirect
	github.com/tetratelabs/wazero v1.12.0 // indirect
	golang.org/x/net v0.60.0 // indirect
	golang.org/x/sys v0.48.0 // indirect
	golang.org/x/text v0.42.0 // indirect
	google.golang.org/genproto/googleapis/rpc v0.0.0-20260817212433-ac3dfec99bb1 // indirect
	google.golang.org/protobuf v1.36.12 // indirect
)

replace (
	github.com/levee-dev/levee/host-bindings/go => ../../
	github.com/levee-dev/levee/host-bindings/go/grpc => ../
)
