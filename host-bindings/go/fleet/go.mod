module github.com/levee-dev/levee/host-bindings/go/fleet

go 1.25.0

require (
	github.com/levee-dev/levee/host-bindings/go v0.0.0
	github.com/redis/go-redis/v9 v9.17.3
)

require (
	github.com/cespare/xxhash/v2 v2.3.0 // indirect
	github.com/dgryski/go-rendezvous v0.0.0-20200823014737-9f7001d12a5f // indirect
	github.com/tetratelabs/wazero v1.12.0 // indirect
	golang.org/x/sys v0.44.0 // indirect
)

replace github.com/levee-dev/levee/host-bindings/go => ../
