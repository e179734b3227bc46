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

import { execFileSync } from 'node:child_process';
import { existsSync, mkdirSync, readFileSync, readdirSync, rmSync, writeFileSync } from 'node:fs';
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
// String lowering: jco's glue encodes every string with `TextEncoder.encode`, which costs 1-2 us
// per call on Node 20 (a fresh buffer each time); policy keys and names are short ASCII strings
// passed on the hot path (`start`'s key). Short ASCII strings are written straight into the
// guest's memory; anything else still goes through TextEncoder. The exact text replaced is checked,
// so a jco upgrade that changes it fails here instead of silently losing the fast path.
const ORIGINAL_ENCODE = `    let buf = utf8Encoder.encode(s);
    let ptr = realloc(0, 0, 1, buf.length);`;
const FAST_ENCODE = `    if (s.length <= 256) {
      let ascii = true;
      for (let i = 0; i < s.length; i++) {
        if (s.charCodeAt(i) > 0x7f) {
          ascii = false;
          break;
        }
      }
      if (ascii) {
        const len = s.length;
        const at = realloc(0, 0, 1, len);
        const bytes = new Uint8Array(memory.buffer, at, len);
        for (let i = 0; i < len; i++) bytes[i] = s.charCodeAt(i);
        utf8EncodedLen = len;
        return at;
      }
    }
${ORIGINAL_ENCODE}`;
const gluePath = join(out, 'levee_policy.js');
if (process.env.LEVEE_JCO_PLAIN !== '1') {
  const glue = readFileSync(gluePath, 'utf8');
  const count = glue.split(ORIGINAL_ENCODE).length - 1;
  if (count !== 1) {
    console.error(
      `transpile: jco's utf8Encode changed (found ${count} copies of the expected text); update scripts/transpile.mjs`,
    );
    process.exit(1);
  }
  writeFileSync(gluePath, glue.replace(ORIGINAL_ENCODE, FAST_ENCODE));
}
console.log(`transpile: ${component} -> ${out}: ${readdirSync(out).sort().join(' ')}`);
