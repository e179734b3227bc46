// The filter's own work per request in V8, the engine Envoy runs it in, outside Envoy: the
// `gate_cost` example built for wasm32-wasip1 and run by Node's WASI with Liftoff off (Envoy
// compiles with TurboFan only). Its proxy-wasm imports are never called (the example uses an
// in-memory store), so they are stubs that throw.
//
//   cargo build --release --target wasm32-wasip1 -p levee-proxy-wasm --example gate_cost
//   node --no-liftoff proxy-wasm/bench/v8.mjs [N] [WORKERS] [EVICT_MIB]
//
// The same arguments as `cargo run --release -p levee-proxy-wasm --example gate_cost`, which
// gives the native figure to compare with.
import { readFileSync } from 'node:fs';
import { dirname, join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { WASI } from 'node:wasi';

const root = join(dirname(fileURLToPath(import.meta.url)), '..', '..');
const file = process.env.GATE_COST_WASM ?? join(root, 'target', 'wasm32-wasip1', 'release', 'examples', 'gate_cost.wasm');
const wasi = new WASI({ version: 'preview1', args: ['gate_cost', ...process.argv.slice(2)], env: {}, preopens: {}, returnOnExit: true });
const module = await WebAssembly.compile(readFileSync(file));
const imports = wasi.getImportObject();
imports.env = {};
for (const i of WebAssembly.Module.imports(module)) {
  if (i.module === 'env' && i.kind === 'function') {
    imports.env[i.name] = () => {
      throw new Error(`gate_cost called the proxy-wasm host function ${i.name}`);
    };
  }
}
const instance = await WebAssembly.instantiate(module, imports);
// The crate is also a proxy-wasm reactor (it exports `_initialize`); run the example's `main`.
const code = wasi.start({ exports: { memory: instance.exports.memory, _start: instance.exports._start } });
process.exitCode = code;
