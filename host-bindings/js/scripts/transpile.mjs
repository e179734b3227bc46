// Transpile the policy component with the pinned jco into `wasm/` (gitignored).
//
//   node scripts/transpile.mjs [component.wasm] [out-dir] [jco-cli.js]
//
// Defaults: $LEVEE_WASM_DIR/levee_policy.wasm (LEVEE_WASM_DIR defaults to <repo>/target/levee),
// ./wasm, and the jco of this package. Flags, on purpose:
// - `--instantiation sync`: the host compiles the core modules itself (from files on Node, from
//   static imports in Worker runtimes, where compiling Wasm at run time is forbidden) and can
//   re-instantiate cheaply after a trap;
// - `--no-wasi-shim`: the component has zero imports;
// - `--base64-cutoff 0`: never inline a core module as base64 (Workers cannot compile it);
// - no `--valid-lifting-optimization`: values coming out of the guest are checked, never trusted.
// The glue is used as jco writes it (no patching): the hot path's `start` call lowers its own
// arguments by the canonical ABI (see `#lowerKey` in src/levee.ts).

import { execFileSync } from 'node:child_process';
import { existsSync, mkdirSync, readdirSync, rmSync } from 'node:fs';
import { dirname, join, resolve } from 'node:path';
import { fileURLToPath } from 'node:url';

const here = dirname(fileURLToPath(import.meta.url));
const pkg = resolve(here, '..');
const repo = resolve(pkg, '../..');
const wasmDir = process.env.LEVEE_WASM_DIR ? resolve(process.env.LEVEE_WASM_DIR) : join(repo, 'target/levee');
const component = resolve(process.argv[2] || join(wasmDir, 'levee_policy.wasm'));
const out = resolve(process.argv[3] || join(pkg, 'wasm'));
const jco = resolve(process.argv[4] || join(pkg, 'node_modules/@bytecodealliance/jco/src/jco.js'));

if (!existsSync(component)) {
  console.error(
    `transpile: no component at ${component} (build it: cargo run -q --release -p levee-build -- target/levee)`,
  );
  process.exit(1);
}
rmSync(out, { recursive: true, force: true });
mkdirSync(out, { recursive: true });
execFileSync(
  process.execPath,
  [
    jco,
    'transpile',
    component,
    '--name',
    'levee_policy',
    '--instantiation',
    'sync',
    '--no-wasi-shim',
    '--base64-cutoff',
    '0',
    '--quiet',
    '-o',
    out,
  ],
  { stdio: 'inherit' },
);
console.log(`transpile: ${component} -> ${out}: ${readdirSync(out).sort().join(' ')}`);
