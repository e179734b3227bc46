// Node: core modules read from the package's `wasm/` folder, time from `process.hrtime`.

import { readFileSync } from 'node:fs';
import type { Platform } from './levee.js';

const modules = new Map<string, WebAssembly.Module>();
// Read once: `process` on the global object is an accessor, and going through it on every clock
// reading cost ~200 instructions, as much as the reading itself (two readings per call).
const hrtime = process.hrtime;

export const nodePlatform: Platform = {
  getCoreModule(path: string): WebAssembly.Module {
    let module = modules.get(path);
    if (module === undefined) {
      module = new WebAssembly.Module(readFileSync(new URL(`../wasm/${path}`, import.meta.url)));
      modules.set(path, module);
    }
    return module;
  },
  now: () => hrtime.bigint(),
  randomSeed: () => crypto.getRandomValues(new BigUint64Array(1))[0] ?? 0n,
  // Ref'd while it has a success to send: an unref'd immediate lets the loop block in its poll
  // phase until the next timer (a parked call waited out its queue timeout so); a ref'd one runs
  // in this turn of the loop, at the price of one more turn (a poll that does not wait).
  soon: (fn) => setImmediate(fn),
};
