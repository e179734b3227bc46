// A PostgreSQL for the durable tests, the way durable/tests/run.sh starts it: the database
// LEVEE_TEST_POSTGRES names (run.sh's private cluster), else a private cluster of the installed
// PostgreSQL started here on 127.0.0.1 (initdb in a temporary directory, run as the `postgres`
// user when this is root, fsync off), stopped at the end. Each test takes a schema of its own.

import { execFileSync } from 'node:child_process';
import { chmodSync, chownSync, existsSync, mkdtempSync, readdirSync, rmSync } from 'node:fs';
import { tmpdir, userInfo } from 'node:os';
import { join } from 'node:path';

import { freePort } from './helpers.mjs';

function pgBin() {
  const root = '/usr/lib/postgresql';
  if (!existsSync(root)) return undefined;
  const versions = readdirSync(root)
    .filter((v) => existsSync(join(root, v, 'bin', 'pg_ctl')))
    .sort((a, b) => Number(a) - Number(b));
  return versions.length === 0 ? undefined : join(root, versions[versions.length - 1], 'bin');
}

/** A libpq keyword DSN (run.sh's `host=... port=...`) or a URL, as a pg config object. */
function parseDsn(dsn) {
  if (dsn.includes('://')) return { connectionString: dsn };
  const names = { dbname: 'database' };
  const out = {};
  for (const pair of dsn.trim().split(/\s+/)) {
    const eq = pair.indexOf('=');
    if (eq > 0) out[names[pair.slice(0, eq)] ?? pair.slice(0, eq)] = pair.slice(eq + 1);
  }
  if (out.port !== undefined) out.port = Number(out.port);
  return out;
}

/** `{ config, stop }` (a pg config object), or `{ skip }` saying why there is no PostgreSQL. */
export async function startPostgres() {
  const dsn = process.env.LEVEE_TEST_POSTGRES;
  if (dsn) return { config: parseDsn(dsn), stop: async () => undefined };
  const bin = pgBin();
  if (!bin) {
    const why = 'no PostgreSQL under /usr/lib/postgresql and LEVEE_TEST_POSTGRES is not set';
    // durable/tests/run.sh installs it and requires it: the tests never pass by being skipped there.
    if (process.env.LEVEE_REQUIRE_POSTGRES) throw new Error(why);
    return { skip: why };
  }
  const work = mkdtempSync(join(tmpdir(), 'levee-js-pg-'));
  chmodSync(work, 0o755);
  const data = join(work, 'pg');
  const root = userInfo().uid === 0;
  const run = (cmd, args) => {
    if (!root) return execFileSync(join(bin, cmd), args, { stdio: 'pipe' });
    const line = [join(bin, cmd), ...args].map((a) => `'${a}'`).join(' ');
    return execFileSync('su', ['postgres', '-s', '/bin/bash', '-c', line], { stdio: 'pipe' });
  };
  execFileSync('mkdir', ['-p', data]);
  if (root) {
    const uid = Number(execFileSync('id', ['-u', 'postgres']).toString().trim());
    const gid = Number(execFileSync('id', ['-g', 'postgres']).toString().trim());
    chownSync(data, uid, gid);
  }
  const port = await freePort();
  run('initdb', ['-D', data, '-A', 'trust', '-U', 'postgres', '--no-sync']);
  run('pg_ctl', [
    '-D',
    data,
    '-w',
    '-l',
    join(data, 'log'),
    '-o',
    `-c listen_addresses=127.0.0.1 -p ${port} -k ${data} -c fsync=off -c max_connections=50`,
    'start',
  ]);
  return {
    config: { host: '127.0.0.1', port, user: 'postgres', database: 'postgres' },
    stop: async () => {
      try {
        run('pg_ctl', ['-D', data, '-m', 'immediate', 'stop']);
      } finally {
        rmSync(work, { recursive: true, force: true });
      }
    },
  };
}
