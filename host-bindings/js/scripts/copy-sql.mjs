// Copy the shared durable SQL (the repository's durable/*.sql, the statements every host runs)
// into the package's `sql/` (gitignored), which `npm pack` ships: an installed package reads
// its statements from there (src/durable.ts, `statements`).
//
//   node scripts/copy-sql.mjs
import { copyFileSync, existsSync, mkdirSync, readdirSync } from 'node:fs';
import { dirname, join, resolve } from 'node:path';
import { fileURLToPath } from 'node:url';

const pkg = resolve(dirname(fileURLToPath(import.meta.url)), '..');
const from = resolve(pkg, '../../durable');
const to = join(pkg, 'sql');
if (!existsSync(from)) {
  console.error(`copy-sql: no ${from} (run this in a Levee checkout)`);
  process.exit(1);
}
mkdirSync(to, { recursive: true });
const files = readdirSync(from).filter((f) => f.endsWith('.sql'));
for (const f of files) copyFileSync(join(from, f), join(to, f));
console.log(`copy-sql: ${files.join(', ')} -> sql/`);
