// Engine load in a fresh process: the package's import (which compiles nothing), `loadSync` (compile
// and instantiate the core modules, parse the document) and the first call, with the process's RSS
// after them; cockatiel's import for comparison. Run it a few times: each run is one fresh process.
//
//   for i in 1 2 3 4 5; do node bench/coldstart.mjs; done

const t0 = performance.now(); // ms since the process started
const { loadSync } = await import('../dist/index.js');
const t1 = performance.now();
const levee = loadSync('policies:\n  p:\n    attempts: 3\n', { seed: 1n, meter: null });
const t2 = performance.now();
await levee.run(levee.policy('p'), async () => 1);
const t3 = performance.now();
const rss = process.memoryUsage().rss / 1048576;
await import('cockatiel');
const t4 = performance.now();
console.log(
  `js: node start ${t0.toFixed(0)} ms, import ${(t1 - t0).toFixed(1)} ms, load ${(t2 - t1).toFixed(1)} ms, ` +
    `first call ${(t3 - t2).toFixed(1)} ms, RSS ${rss.toFixed(1)} MB; cockatiel import ${(t4 - t3).toFixed(1)} ms`,
);
