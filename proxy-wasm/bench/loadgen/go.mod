module levee.invalid/proxy-wasm/bench/loadgen

go 1.21
