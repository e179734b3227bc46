/**
 * Durable calls: retries that survive a process restart (`levee-resilience/durable`, Node).
 *
 * ```ts
 * const levee = await loadFile('policies.yaml');
 * const executor = new DurableExecutor(levee, new SQLiteStore('calls.db')); // or await PostgresStore.connect('postgres://...')
 * executor.register('send-invoice', async (payload, ctx) => { ... }, { policy: 'email', idempotent: false });
 * await executor.submit('send-invoice', Buffer.from('{"order": 17}'), { idempotencyKey: 'invoice-17' });
 * // or in your own transaction (pg client after BEGIN; better-sqlite3 handle on the store's file):
 * // the call exists if and only if your commit does, see SubmitOptions.tx
 * await executor.submit('send-invoice', body, { idempotencyKey: 'invoice-17', tx: client });
 * await executor.run({ signal }); // resumes what is due at start-up, then sleeps until the next call is due
 * ```
 *
 * The executor is a driver, like the in-process call drivers: it asks the core (the engine's
 * `durable*` functions) at every step and does what the answer says. The core decides when a call
 * is due, what a record found after a crash means, whether to retry and how long to wait; the
 * executor persists the record the core returns before each attempt and after each outcome,
 * through the shared statements of durable/sqlite.sql and durable/postgres.sql. Records and rows
 * are the same in every host: a call a Python or Go process wrote is resumed here, and back.
 *
 * Every write is fenced by the row's holder (`lease_owner`): a process that lost a call has its
 * writes refused. A record the core refuses (corrupt, another version, a policy no longer loaded)
 * is quarantined with the core's error, which names it. See docs/durable.md.
 *
 * The drivers are optional peer dependencies, loaded when a store is opened: `better-sqlite3`
 * for SQLiteStore, `pg` for PostgresStore.
 */

import { existsSync, readFileSync } from 'node:fs';
import { createRequire } from 'node:module';
import { hostname } from 'node:os';
import { randomBytes } from 'node:crypto';

import type { Outcome } from './errors.js';
import { LeveeClosedError, checkKey, outcomeOfError } from './errors.js';
import type { Levee } from './levee.js';
import { DURABLE_OPERATOR_TRIES } from './constants.js';
import { isComponentError } from './runtime.js';
import type { ComponentExports } from './runtime.js';
import type { Executor } from '../wasm/interfaces/levee-policy-engine-api.js';
import type {
  DurableStep,
  ExecCommand,
  ExecEvent,
  ExecRun,
  OutcomeKind,
  RowWrite,
} from '../wasm/interfaces/levee-policy-types.js';

const require = createRequire(import.meta.url);

/**
 * The shared statements of a dialect (`sqlite` or `postgres`), by name, as every host runs them:
 * from $LEVEE_DURABLE_SQL_DIR, else the package's `sql/`, else the repository's `durable/`.
 */
export function statements(dialect: 'sqlite' | 'postgres'): Record<string, string> {
  const dir = process.env.LEVEE_DURABLE_SQL_DIR;
  const packaged = new URL(`../sql/${dialect}.sql`, import.meta.url);
  const url = dir
    ? `${dir}/${dialect}.sql`
    : existsSync(packaged)
      ? packaged
      : new URL(`../../../durable/${dialect}.sql`, import.meta.url);
  const text = readFileSync(url, 'utf8');
  const out: Record<string, string> = {};
  for (const block of text.split(/^-- name: /m).slice(1)) {
    const nl = block.indexOf('\n');
    out[block.slice(0, nl).trim()] = block.slice(nl + 1).trim();
  }
  return out;
}

/** A call this process has just claimed. */
interface Claimed {
  id: number;
  handler: string;
  payload: Uint8Array;
  record: Uint8Array;
  dbNow: bigint;
  idempotencyKey: string | null;
}

/** A row of the shared `get`, `list` and `list_dead` statements. */
type Row = [
  number,
  string,
  string,
  bigint,
  number,
  string | null,
  Uint8Array,
  Uint8Array | null,
  string | null,
  string | null,
];

interface Write {
  status: string;
  nextAt: bigint;
  attempts: number;
  leaseOwner: string | null;
  record: Uint8Array;
  result: Uint8Array | null;
  error: string | null;
}

/** Where durable calls live: an SQLite file or a PostgreSQL database. */
export interface Store {
  readonly dialect: 'sqlite' | 'postgres';
  /** The store's wall clock, ns since the Unix epoch. */
  now(): Promise<bigint>;
  /**
   * Write a new call (or find the one holding `key`) and return its id. With `tx`, the write runs
   * on the caller's own connection inside their open transaction and is not committed here; a
   * store that cannot do that throws rather than ignore `tx` (see {@link SubmitOptions.tx}).
   */
  insert(
    handler: string,
    payload: Uint8Array,
    key: string | null,
    nextAt: bigint,
    record: Uint8Array,
    tx?: object,
  ): Promise<number>;
  claim(owner: string, hold: bigint, limit: number): Promise<Claimed[]>;
  /** A fenced write: false when this process no longer holds the call. */
  write(id: number, owner: string, w: Write): Promise<boolean>;
  quarantine(id: number, error: string): Promise<void>;
  replace(
    id: number,
    status: string,
    nextAt: bigint,
    attempts: number,
    record: Uint8Array,
    error: string | null,
    old: Uint8Array,
  ): Promise<boolean>;
  get(id: number): Promise<Row | undefined>;
  rows(deadOnly: boolean): Promise<Row[]>;
  /** ns until the next call is due (negative: one is due now), undefined when none is pending. */
  nextDueIn(): Promise<bigint | undefined>;
  counts(): Promise<Record<string, number>>;
  close(): Promise<void>;
}

const wallNs = (): bigint => BigInt(Date.now()) * 1_000_000n;
const big = (v: unknown): bigint => (typeof v === 'bigint' ? v : BigInt(v as string | number));
const bytes = (v: unknown): Uint8Array => (v instanceof Uint8Array ? v : new Uint8Array(0));
const str = (v: unknown): string | null => (v === null || v === undefined ? null : String(v));

function toRow(r: unknown[]): Row {
  return [
    Number(r[0]),
    String(r[1]),
    String(r[2]),
    big(r[3]),
    Number(r[4]),
    str(r[5]),
    bytes(r[6]),
    r[7] === null || r[7] === undefined ? null : bytes(r[7]),
    str(r[8]),
    str(r[9]),
  ];
}

function toClaimed(r: unknown[]): Claimed {
  return {
    id: Number(r[0]),
    handler: String(r[1]),
    payload: bytes(r[2]),
    record: bytes(r[3]),
    dbNow: big(r[4]),
    idempotencyKey: str(r[5]),
  };
}

// The part of better-sqlite3's API this module uses (an optional peer dependency).
interface SqliteStatement {
  safeIntegers(on: boolean): SqliteStatement;
  raw(on: boolean): SqliteStatement;
  readonly reader: boolean;
  all(...params: unknown[]): unknown[][];
  run(...params: unknown[]): { changes: number };
}
interface SqliteDatabase {
  pragma(s: string): unknown;
  exec(s: string): void;
  prepare(s: string): SqliteStatement;
  transaction<T>(f: () => T): { immediate(): T };
  close(): void;
  readonly inTransaction: boolean;
}

/** A short description of what was passed as `tx`, for its error. */
function describe(v: unknown): string {
  if (v === null) return 'null';
  if (typeof v !== 'object') return typeof v;
  const name = (v as { constructor?: { name?: unknown } }).constructor?.name;
  return typeof name === 'string' && name !== '' && name !== 'Object' ? `a ${name}` : 'an object';
}

/** The main database file of a better-sqlite3 handle ('' for an in-memory or temporary one). */
function mainFile(db: SqliteDatabase): string {
  const list = db.pragma('database_list') as { name?: unknown; file?: unknown }[];
  const file = list.find((d) => d.name === 'main')?.file;
  return typeof file === 'string' ? file : '';
}

/**
 * The shared statements `names` (all but the schema when undefined) prepared on `db`, as the store
 * runs them: integers as BigInt, rows as arrays, numbered placeholders bound in their order.
 */
function prepareShared(
  db: SqliteDatabase,
  sql: Record<string, string>,
  names?: string[],
): Map<string, SqliteStatement> {
  const out = new Map<string, SqliteStatement>();
  for (const name of names ?? Object.keys(sql)) {
    const text = sql[name];
    if (name === 'schema' || text === undefined) continue;
    const { text: plain, order } = anonymous(text);
    const st = db.prepare(plain).safeIntegers(true);
    const prepared = st.reader ? st.raw(true) : st;
    // better-sqlite3 binds `?NNN` only by name: the statement is bound through `order`
    out.set(name, {
      reader: prepared.reader,
      safeIntegers: () => prepared,
      raw: () => prepared,
      all: (...p: unknown[]) => prepared.all(...order.map((i) => p[i])),
      run: (...p: unknown[]) => prepared.run(...order.map((i) => p[i])),
    });
  }
  return out;
}

/**
 * A statement's placeholders rewritten, and only them: every `?NNN` (SQLite's numbered form, which
 * the shared claim uses to return its `now` parameter) becomes `?`, and `order` says which
 * parameter each `?` takes, so the statement runs with its parameters as the comments list them.
 */
function anonymous(text: string): { text: string; order: number[] } {
  const order: number[] = [];
  let next = 0;
  const out = text.replace(/\?(\d*)/g, (_, n: string) => {
    const i = n === '' ? next++ : Number(n) - 1;
    if (n !== '') next = Math.max(next, i + 1);
    order.push(i);
    return '?';
  });
  return { text: out, order };
}

/** A store in one SQLite file (WAL mode), for one machine; its clock is this host's. */
export class SQLiteStore implements Store {
  readonly dialect = 'sqlite' as const;
  readonly #db: SqliteDatabase;
  readonly #sql: Record<string, string>;
  readonly #stmts: Map<string, SqliteStatement>;
  readonly #file: string;
  /** The insert statements prepared on callers' handles (`tx`), once per handle. */
  readonly #txStmts = new WeakMap<object, Map<string, SqliteStatement>>();

  constructor(path: string) {
    const Database = require('better-sqlite3') as new (path: string, opts: { timeout: number }) => SqliteDatabase;
    this.#db = new Database(path, { timeout: 30_000 });
    this.#db.pragma('journal_mode = WAL');
    this.#db.pragma('synchronous = NORMAL');
    this.#sql = statements('sqlite');
    this.#db.exec(this.#sql.schema ?? '');
    this.#stmts = prepareShared(this.#db, this.#sql);
    this.#file = mainFile(this.#db);
  }

  #st(name: string, stmts: Map<string, SqliteStatement> = this.#stmts): SqliteStatement {
    const st = stmts.get(name);
    if (!st) throw new Error(`durable/sqlite.sql has no statement \`${name}\``);
    return st;
  }

  /** The caller's handle checked (better-sqlite3, this store's file, inside a transaction), its statements. */
  #txStatements(tx: object): Map<string, SqliteStatement> {
    const known = this.#txStmts.get(tx);
    const db = (typeof tx === 'object' && tx !== null ? tx : {}) as Partial<SqliteDatabase>;
    if (known === undefined && (typeof db.prepare !== 'function' || typeof db.pragma !== 'function'))
      throw new TypeError(
        `tx: an SQLiteStore takes the caller's better-sqlite3 Database on the store's file, inside a transaction; got ${describe(tx)}`,
      );
    const handle = tx as SqliteDatabase;
    if (handle.inTransaction !== true)
      throw new Error(
        "tx: the better-sqlite3 Database is not inside a transaction (run `db.exec('BEGIN')` first; submit without tx commits at once)",
      );
    if (known !== undefined) return known;
    const file = mainFile(handle);
    if (this.#file === '' || file !== this.#file)
      throw new Error(
        `tx: the better-sqlite3 Database is on \`${file || ':memory:'}\`, the store on \`${this.#file || ':memory:'}\`: the call must be written to the store's file`,
      );
    const stmts = prepareShared(handle, this.#sql, ['insert', 'find_by_key']);
    this.#txStmts.set(tx, stmts);
    return stmts;
  }

  async now(): Promise<bigint> {
    return wallNs();
  }

  async insert(
    handler: string,
    payload: Uint8Array,
    key: string | null,
    nextAt: bigint,
    record: Uint8Array,
    tx?: object,
  ): Promise<number> {
    const write = (stmts: Map<string, SqliteStatement>) => {
      const r = this.#st('insert', stmts).all(
        handler,
        Buffer.from(payload),
        key,
        nextAt,
        Buffer.from(record),
        wallNs(),
      );
      return r.length === 0 && key !== null ? this.#st('find_by_key', stmts).all(key) : r;
    };
    // the caller's transaction is theirs to commit; the store's own insert commits here
    const rows =
      tx === undefined ? this.#db.transaction(() => write(this.#stmts)).immediate() : write(this.#txStatements(tx));
    if (rows.length === 0) throw new Error('the store did not accept the call');
    return Number(rows[0]?.[0]);
  }

  async claim(owner: string, hold: bigint, limit: number): Promise<Claimed[]> {
    const now = wallNs();
    const rows = this.#db.transaction(() => this.#st('claim').all(owner, now + hold, now, limit)).immediate();
    return rows.map(toClaimed);
  }

  async write(id: number, owner: string, w: Write): Promise<boolean> {
    const buf = (b: Uint8Array | null) => (b === null ? null : Buffer.from(b));
    const r = this.#st('write').run(
      w.status,
      w.nextAt,
      w.attempts,
      w.leaseOwner,
      buf(w.record),
      buf(w.result),
      w.error,
      wallNs(),
      id,
      owner,
    );
    return r.changes === 1;
  }

  async quarantine(id: number, error: string): Promise<void> {
    this.#st('quarantine').run(error, wallNs(), id);
  }

  async replace(
    id: number,
    status: string,
    nextAt: bigint,
    attempts: number,
    record: Uint8Array,
    error: string | null,
    old: Uint8Array,
  ): Promise<boolean> {
    return (
      this.#st('replace').run(status, nextAt, attempts, Buffer.from(record), error, wallNs(), id, Buffer.from(old))
        .changes === 1
    );
  }

  async get(id: number): Promise<Row | undefined> {
    const r = this.#st('get').all(id)[0];
    return r ? toRow(r) : undefined;
  }

  async rows(deadOnly: boolean): Promise<Row[]> {
    return this.#st(deadOnly ? 'list_dead' : 'list')
      .all()
      .map(toRow);
  }

  async nextDueIn(): Promise<bigint | undefined> {
    const v = this.#st('next_due').all()[0]?.[0];
    return v === null || v === undefined ? undefined : big(v) - wallNs();
  }

  async counts(): Promise<Record<string, number>> {
    return Object.fromEntries(
      this.#st('counts')
        .all()
        .map((r) => [String(r[0]), Number(r[1])]),
    );
  }

  async close(): Promise<void> {
    this.#db.close();
  }
}

// The part of pg's API this module uses (an optional peer dependency).
interface PgResult {
  rows: unknown[][];
  rowCount: number | null;
}
interface PgClient {
  query(q: { text: string; values?: unknown[]; rowMode: 'array' }): Promise<PgResult>;
  query(text: string): Promise<unknown>;
  release(): void;
}
interface PgPool {
  query(q: { text: string; values?: unknown[]; rowMode: 'array' }): Promise<PgResult>;
  connect(): Promise<PgClient>;
  end(): Promise<void>;
}
/** What runs a statement: the store's pool, or a caller's client inside their transaction. */
type PgQueryable = Pick<PgPool, 'query'>;

/**
 * The caller's `pg` client checked: a Client or a pool's client (not a Pool, whose queries run on
 * any connection, outside the caller's transaction), inside a transaction where pg says so.
 */
function pgTx(tx: object): PgQueryable {
  const c = (typeof tx === 'object' && tx !== null ? tx : {}) as {
    query?: unknown;
    totalCount?: unknown;
    getTransactionStatus?: unknown;
  };
  if (typeof c.query !== 'function')
    throw new TypeError(
      `tx: a PostgresStore takes the caller's \`pg\` client (a Client, or a pool's client) inside a transaction; got ${describe(tx)}`,
    );
  if (typeof c.totalCount === 'number')
    throw new TypeError(
      "tx: a pg Pool runs each query on any of its connections, outside the caller's transaction: pass the client of `await pool.connect()` after `BEGIN`",
    );
  // pg's clients that have getTransactionStatus() tell their state ('I' idle, 'T' in one, 'E' failed)
  if (typeof c.getTransactionStatus === 'function') {
    const state: unknown = (c.getTransactionStatus as () => unknown).call(tx);
    if (state === 'I')
      throw new Error(
        "tx: the pg client is not inside a transaction (await `client.query('BEGIN')` first; submit without tx commits at once)",
      );
  }
  return tx as PgQueryable;
}

/**
 * A store in PostgreSQL, shared by processes on several machines. The database's clock is the one
 * clock; claims skip the rows other workers hold (`FOR UPDATE SKIP LOCKED`).
 */
export class PostgresStore implements Store {
  readonly dialect = 'postgres' as const;
  readonly #pool: PgPool;
  readonly #sql: Record<string, string>;

  private constructor(pool: PgPool, sql: Record<string, string>) {
    this.#pool = pool;
    this.#sql = sql;
  }

  /** Connect (a `postgres://` URL or `{ host, port, ... }`) and create the table when missing. */
  static async connect(config: string | Record<string, unknown>): Promise<PostgresStore> {
    const pg = require('pg') as { Pool: new (c: Record<string, unknown>) => PgPool };
    const pool = new pg.Pool(typeof config === 'string' ? { connectionString: config, max: 8 } : { max: 8, ...config });
    const sql = statements('postgres');
    const client = await pool.connect();
    try {
      await client.query('SELECT pg_advisory_lock(7467001)'); // one schema creation at a time
      await client.query(sql.schema ?? '');
      await client.query('SELECT pg_advisory_unlock(7467001)');
    } finally {
      client.release();
    }
    return new PostgresStore(pool, sql);
  }

  async #q(name: string, values: unknown[] = [], on: PgQueryable = this.#pool): Promise<PgResult> {
    const text = this.#sql[name];
    if (text === undefined) throw new Error(`durable/postgres.sql has no statement \`${name}\``);
    const vals = values.map((v) =>
      typeof v === 'bigint' ? v.toString() : v instanceof Uint8Array ? Buffer.from(v) : v,
    );
    return on.query({ text, values: vals, rowMode: 'array' });
  }

  async now(): Promise<bigint> {
    return big((await this.#q('clock')).rows[0]?.[0]);
  }

  async insert(
    handler: string,
    payload: Uint8Array,
    key: string | null,
    nextAt: bigint,
    record: Uint8Array,
    tx?: object,
  ): Promise<number> {
    // the caller's transaction is theirs to commit; the pool's insert commits at once
    const on = tx === undefined ? this.#pool : pgTx(tx);
    let rows = (await this.#q('insert', [handler, payload, key, nextAt, record], on)).rows;
    if (rows.length === 0 && key !== null) rows = (await this.#q('find_by_key', [key], on)).rows;
    if (rows.length === 0) throw new Error('the store did not accept the call');
    return Number(rows[0]?.[0]);
  }

  async claim(owner: string, hold: bigint, limit: number): Promise<Claimed[]> {
    return (await this.#q('claim', [owner, hold, limit])).rows.map(toClaimed);
  }

  async write(id: number, owner: string, w: Write): Promise<boolean> {
    const r = await this.#q('write', [
      w.status,
      w.nextAt,
      w.attempts,
      w.leaseOwner,
      w.record,
      w.result,
      w.error,
      id,
      owner,
    ]);
    return r.rowCount === 1;
  }

  async quarantine(id: number, error: string): Promise<void> {
    await this.#q('quarantine', [error, id]);
  }

  async replace(
    id: number,
    status: string,
    nextAt: bigint,
    attempts: number,
    record: Uint8Array,
    error: string | null,
    old: Uint8Array,
  ): Promise<boolean> {
    return (await this.#q('replace', [status, nextAt, attempts, record, error, id, old])).rowCount === 1;
  }

  async get(id: number): Promise<Row | undefined> {
    const r = (await this.#q('get', [id])).rows[0];
    return r ? toRow(r) : undefined;
  }

  async rows(deadOnly: boolean): Promise<Row[]> {
    return (await this.#q(deadOnly ? 'list_dead' : 'list')).rows.map(toRow);
  }

  async nextDueIn(): Promise<bigint | undefined> {
    const v = (await this.#q('next_due')).rows[0]?.[0];
    return v === null || v === undefined ? undefined : big(v);
  }

  async counts(): Promise<Record<string, number>> {
    return Object.fromEntries((await this.#q('counts')).rows.map((r) => [String(r[0]), Number(r[1])]));
  }

  async close(): Promise<void> {
    await this.#pool.end();
  }
}

/** What a handler knows of the attempt it runs. */
export interface DurableContext {
  callId: number;
  /** The attempt, counting the first. */
  attempt: number;
  /** The call's idempotency key: make a second run of an attempt whose outcome was lost harmless with it. */
  idempotencyKey: string | null;
  /** The attempt's timeout in ms (the core's, bounded by the deadline), undefined for none. */
  timeoutMs: number | undefined;
  /** Aborted at the timeout, when the call is lost, and when the executor stops. */
  signal: AbortSignal;
}

/** A handler returns the call's result (bytes, a string, or nothing) or throws. */
export type DurableHandler = (
  payload: Uint8Array,
  ctx: DurableContext,
) => Promise<Uint8Array | string | void> | Uint8Array | string | void;

/** What the store holds for a call; `record` is the core's description, null when it cannot read it. */
export interface CallStatus {
  id: number;
  handler: string;
  status: string;
  nextAt: bigint;
  attempts: number;
  leaseOwner: string | null;
  idempotencyKey: string | null;
  error: string | null;
  result: Uint8Array | null;
  record: Record<string, unknown> | null;
}

/** Options of {@link DurableExecutor.submit}. */
export interface SubmitOptions {
  /** One call per key: a second submission with it returns the first call's id and adds nothing. */
  idempotencyKey?: string | undefined;
  /** The key (say, a downstream host) the call's breaker, budget and limits are kept under. */
  key?: string | undefined;
  /**
   * The caller's own connection, inside a transaction the caller began and will commit or roll
   * back (the outbox pattern): the call is written in that transaction, so it exists if and only
   * if the caller's transaction commits, together with the caller's own rows.
   *
   * - {@link PostgresStore}: a `pg` `Client`, or the client of `await pool.connect()`, after
   *   `await client.query('BEGIN')`, on the store's database (and schema). Not a `Pool`.
   * - {@link SQLiteStore}: a `better-sqlite3` `Database` opened on the store's file, after
   *   `db.exec('BEGIN IMMEDIATE')`. In one process, keep that transaction free of other I/O
   *   awaits: the executor's own connection waits (synchronously, as better-sqlite3 does) for the
   *   file's write lock while it is held.
   *
   * Nothing is committed here. The executor is not woken (the call is not visible before the
   * commit): after the caller commits, the call runs at the latest at the executor's next poll
   * (`pollIntervalMs`, default 1 s), in any process running an executor on the store. A rolled-back
   * transaction leaves no call. Anything else as `tx` (another driver's connection, a `Pool`, a
   * connection not inside a transaction, an SQLite handle on another file) is an error naming `tx`,
   * thrown before anything is written. An error of the database itself leaves the caller's
   * transaction for the caller to roll back, as any failed statement of theirs would.
   */
  tx?: object | undefined;
}

export interface DurableExecutorOptions {
  /** Names this process in leases; unique per process (default: host, pid and a random suffix). */
  owner?: string | undefined;
  /** Calls run at once (default: the core's, 16; docs/durable.md, "The executor"). */
  concurrency?: number | undefined;
  /** The longest sleep before looking at the store again, ms (default: the core's, 1 s). */
  pollIntervalMs?: number | undefined;
  /** How long a claim keeps calls out of other processes' due window until the core's answer is written, ms (default: the core's, 5 s). */
  claimHoldMs?: number | undefined;
  /** Called after an attempt's outcome is known and before it is persisted. */
  onAttemptDone?: ((callId: number, attempt: number, outcome: Outcome) => void) | undefined;
}

interface Registered {
  fn: DurableHandler;
  policy: string;
  idempotent: boolean;
}

/** A LoadError of the core (a record it refuses), as jco throws it. */
function loadErrorOf(err: unknown): string | undefined {
  const p = (err as { payload?: { path?: unknown; message?: unknown } } | null)?.payload;
  if (!p || typeof p.message !== 'string') return undefined;
  return typeof p.path === 'string' && p.path !== '' ? `${p.path}: ${p.message}` : p.message;
}

function outcomeArgs(o: Outcome): [OutcomeKind, number, string, number] {
  switch (o.kind) {
    case 'http-status':
      return [o.kind, o.status, o.retryAfter ?? '', o.overloaded === true ? 1 : 0];
    case 'grpc-status':
      return [o.kind, o.code, o.pushback ?? '', 0];
    case 'error-class':
      return [o.kind, 0, o.name, 0];
    default:
      return [o.kind, 0, '', 0];
  }
}

/** The monotonic clock the machine is fed with, ns. */
const mono = (): bigint => process.hrtime.bigint();
/** A duration of the machine (ns) as a timer's ms (at most the longest a Node timer takes). */
const ms = (ns: bigint): number => (ns > 0n ? Math.min(Number(ns) / 1e6, 2 ** 31 - 1) : 0);
/** A duration the user configured (ms) as the machine's ns; 0, the core's default, when not configured. */
function configuredNs(v: number | undefined): bigint {
  return v === undefined || !Number.isFinite(v) ? 0n : BigInt(Math.max(1, Math.round(v * 1e6)));
}
const errorText = (err: unknown): string => (err instanceof Error ? err.message : String(err));
const POLL: ExecEvent = { tag: 'poll' };

/** The abort reason of a handler whose call this process no longer holds (lost, lease run out, instance replaced). */
class Lost extends Error {}

/** What a run of the executor works with: the DurableExecutor's store, handlers and options. */
interface Host {
  readonly levee: Levee;
  readonly store: Store;
  readonly owner: string;
  readonly handlers: ReadonlyMap<string, Registered>;
  readonly onAttemptDone: DurableExecutorOptions['onAttemptDone'];
  /** As configured; 0 takes the core's default. */
  readonly concurrency: number;
  readonly poll: bigint;
  readonly hold: bigint;
}

/** A handler running an attempt. */
interface Running {
  readonly ac: AbortController;
  readonly renew: ReturnType<typeof setInterval>;
  timer: ReturnType<typeof setTimeout> | undefined;
  timedOut: boolean;
}

/**
 * One `run` of the executor: the core's machine (the component's `executor` resource) decides,
 * this carries out its commands with the store's statements, the handlers and timers, and feeds
 * it what came of them (docs/durable.md, "The executor"). The machine lives in the component
 * instance it was made by: when the Levee's instance is replaced (after a trap), a new machine
 * is made and the calls the old one held are abandoned, to be resumed once their leases lapse.
 */
class Drive {
  readonly #h: Host;
  readonly #untilIdle: boolean;
  #machine: { exec: Executor; component: ComponentExports } | undefined;
  /** Changes with the machine: what an earlier machine's I/O comes to is not fed to a new one. */
  #epoch = 0;
  /** The rows claimed and held here, for the handler dispatch (payload, idempotency key). */
  readonly #claimed = new Map<bigint, Claimed>();
  readonly #running = new Map<bigint, Running>();
  /** A success's result, until its write. */
  readonly #results = new Map<bigint, Uint8Array | null>();
  /** Statements and handlers in flight: settled before `run` returns. */
  readonly #inflight = new Set<Promise<void>>();
  #sleep: ReturnType<typeof setTimeout> | undefined;
  #woken = false;
  #over = false;
  /** Feeds that failed in a row (the component trapped): the second ends the run with its error. */
  #failures = 0;
  readonly #done: Promise<void>;
  #settle!: (err?: unknown) => void;

  constructor(host: Host, untilIdle: boolean) {
    this.#h = host;
    this.#untilIdle = untilIdle;
    this.#done = new Promise<void>((resolve, reject) => {
      this.#settle = (err?: unknown) => (err === undefined ? resolve() : reject(err));
    });
  }

  start(): Promise<void> {
    this.#feed(this.#epoch, POLL);
    return this.#done;
  }

  /** Stop: running handlers are cancelled (nothing of them is recorded), statements in flight settle. */
  stop(err?: unknown): void {
    if (this.#over) return;
    this.#over = true;
    if (this.#sleep !== undefined) clearTimeout(this.#sleep);
    this.#sleep = undefined;
    for (const r of this.#running.values()) this.#cancel(r, undefined);
    this.#running.clear();
    void (async () => {
      while (this.#inflight.size > 0) await Promise.allSettled([...this.#inflight]);
      this.#release();
      this.#settle(err);
    })();
  }

  /** The machine released in its instance (unless that instance was replaced: it went with it). */
  #release(): void {
    const m = this.#machine;
    this.#machine = undefined;
    if (m === undefined) return;
    try {
      this.#h.levee.durableCrossing('durable-executor', (_, component) => {
        const dispose = (m.exec as { [Symbol.dispose]?: () => void })[Symbol.dispose];
        if (component === m.component && typeof dispose === 'function') dispose.call(m.exec);
      });
    } catch {
      // closed, or the instance replaced: nothing of it is left to release
    }
  }

  /** A submission or an attempt's end: look at the store now rather than at the end of the sleep. */
  wake(): void {
    if (this.#over) return;
    if (this.#sleep === undefined) {
      this.#woken = true; // the next sleep is cut short
      return;
    }
    clearTimeout(this.#sleep);
    this.#sleepFor(0);
  }

  /** A handler registered while this runs. */
  register(name: string): void {
    const m = this.#machine;
    if (m === undefined || this.#over) return;
    try {
      this.#h.levee.durableCrossing('durable-executor', (_, component) => {
        if (component === m.component) m.exec.register(name);
      });
    } catch {
      // the instance was replaced: the next feed makes a machine with every handler registered
    }
  }

  #sleepFor(wait: number): void {
    const epoch = this.#epoch;
    this.#sleep = setTimeout(() => {
      this.#sleep = undefined;
      this.#feed(epoch, POLL);
    }, wait);
  }

  #make(component: ComponentExports): { exec: Executor; component: ComponentExports } {
    const exec = new component.engineApi.Executor({
      owner: this.#h.owner,
      concurrency: this.#h.concurrency,
      poll: this.#h.poll,
      claimHold: this.#h.hold,
      untilIdle: this.#untilIdle,
    });
    for (const name of this.#h.handlers.keys()) exec.register(name);
    return { exec, component };
  }

  /** The machine was lost with its instance: abandon what it held, and start again with a new one. */
  #replaced(): void {
    this.#epoch++;
    this.#machine = undefined;
    for (const r of this.#running.values()) this.#cancel(r, new Lost());
    this.#running.clear();
    this.#claimed.clear();
    this.#results.clear();
    if (this.#sleep !== undefined) clearTimeout(this.#sleep);
    this.#sleep = undefined;
    this.#woken = false;
  }

  /** Feed `event` to the machine (unless it is an earlier machine's) and carry out its commands. */
  #feed(epoch: number, event: ExecEvent): void {
    if (this.#over || epoch !== this.#epoch) return;
    let commands: ExecCommand[] | undefined;
    try {
      commands = this.#h.levee.durableCrossing('durable-executor', (engine, component) => {
        // another crossing trapped and replaced the instance: the machine went with it
        if (this.#machine !== undefined && this.#machine.component !== component) return undefined;
        this.#machine ??= this.#make(component);
        return this.#machine.exec.feed(engine, mono(), event);
      });
    } catch (err) {
      // The component trapped here (its instance is replaced), or the Levee was closed.
      if (err instanceof LeveeClosedError || ++this.#failures > 1) return this.stop(err);
      console.error(
        "levee durable: the executor's machine failed; the calls it held are resumed once their leases lapse:",
        err,
      );
    }
    if (commands === undefined) {
      this.#replaced();
      this.#sleepFor(0); // a new machine looks at the store
      return;
    }
    this.#failures = 0;
    for (const c of commands) this.#carry(c);
  }

  #io(f: () => Promise<void>): void {
    const p: Promise<void> = f()
      .catch((err: unknown) => this.stop(err))
      .finally(() => this.#inflight.delete(p));
    this.#inflight.add(p);
  }

  /** The machine no longer holds call `id`: its slot is free. */
  #released(id: bigint): void {
    this.#claimed.delete(id);
    this.#results.delete(id);
    this.wake();
  }

  #carry(c: ExecCommand): void {
    const { store, owner } = this.#h;
    const epoch = this.#epoch;
    switch (c.tag) {
      case 'claim': {
        const { limit, hold } = c.val;
        this.#io(async () => {
          let event: ExecEvent;
          try {
            const rows = await store.claim(owner, hold, limit);
            if (this.#over || epoch !== this.#epoch) return; // resumed once the claim lapses
            for (const r of rows) this.#claimed.set(BigInt(r.id), r);
            const val = rows.map((r) => ({ id: BigInt(r.id), handler: r.handler, bytes: r.record, dbNow: r.dbNow }));
            event = { tag: 'claimed', val };
          } catch (err) {
            event = { tag: 'claim-failed', val: errorText(err) };
          }
          this.#feed(epoch, event);
        });
        return;
      }
      case 'write':
        this.#write(epoch, c.val);
        return;
      case 'run':
        this.#run(epoch, c.val);
        return;
      case 'abandon': {
        const r = this.#running.get(c.val);
        this.#running.delete(c.val);
        if (r !== undefined) this.#cancel(r, new Lost());
        this.#released(c.val);
        return;
      }
      case 'quarantine': {
        const { id, error } = c.val;
        this.#io(async () => {
          try {
            await store.quarantine(Number(id), error);
          } catch (err) {
            console.error(`levee durable: call ${id}: setting it aside (${error}):`, err);
          }
        });
        this.#released(id);
        return;
      }
      case 'next-due':
        this.#io(async () => {
          let event: ExecEvent;
          try {
            const d = await store.nextDueIn();
            event = { tag: 'next-due', val: d === undefined ? undefined : d < 0n ? 0n : d };
          } catch (err) {
            // the store failed as a claim does: said, and looked at again after the poll interval
            event = { tag: 'claim-failed', val: errorText(err) };
          }
          this.#feed(epoch, event);
        });
        return;
      case 'sleep': {
        const wait = this.#woken ? 0 : ms(c.val - mono());
        this.#woken = false;
        if (this.#sleep !== undefined) clearTimeout(this.#sleep);
        this.#sleepFor(wait);
        return;
      }
      case 'idle':
        this.stop();
        return;
      case 'log': {
        const { level, id, text } = c.val;
        const line = id === 0n ? text : `${text} (call ${id})`;
        if (level === 'warn') console.warn(line);
        else console.error(line);
        return;
      }
    }
  }

  #write(epoch: number, row: RowWrite): void {
    const { store, owner } = this.#h;
    const id = row.id;
    const w: Write = {
      status: row.status,
      nextAt: row.nextAt,
      attempts: row.attempts,
      leaseOwner: row.lease ? owner : null,
      record: row.bytes,
      result: row.keepResult ? (this.#results.get(id) ?? null) : null,
      error: row.error ?? null,
    };
    this.#io(async () => {
      let result: ExecEvent & { tag: 'written' };
      try {
        const applied = await store.write(Number(id), owner, w);
        result = { tag: 'written', val: { id, result: { tag: applied ? 'applied' : 'lost' } } };
      } catch (err) {
        result = { tag: 'written', val: { id, result: { tag: 'failed', val: errorText(err) } } };
      }
      if (this.#over || epoch !== this.#epoch) return;
      this.#feed(epoch, result);
      // No handler runs (nor was started) for the call: the machine is done with it.
      if (!this.#over && epoch === this.#epoch && !this.#running.has(id)) this.#released(id);
    });
  }

  #cancel(r: Running, reason: unknown): void {
    clearInterval(r.renew);
    if (r.timer !== undefined) clearTimeout(r.timer);
    r.ac.abort(reason);
  }

  #run(epoch: number, run: ExecRun): void {
    const id = run.id;
    const claimed = this.#claimed.get(id);
    const reg = claimed === undefined ? undefined : this.#h.handlers.get(claimed.handler);
    if (claimed === undefined || reg === undefined) {
      // Not claimed here (the machine and this host disagree): leave it to its lease.
      try {
        this.#h.levee.durableCrossing('durable-executor', () => this.#machine?.exec.forget(id));
      } catch {
        // the instance was replaced: its machine, and the call with it, are gone
      }
      this.#released(id);
      return;
    }
    const ac = new AbortController();
    const r: Running = {
      ac,
      renew: setInterval(() => this.#feed(epoch, { tag: 'renew', val: id }), ms(run.renewEvery)),
      timer: undefined,
      timedOut: false,
    };
    const timeoutMs = run.timeout > 0n ? ms(run.timeout) : undefined;
    if (timeoutMs !== undefined)
      r.timer = setTimeout(() => {
        r.timedOut = true;
        ac.abort(new DOMException('The operation was aborted due to timeout', 'TimeoutError'));
      }, timeoutMs);
    this.#running.set(id, r);
    const ctx: DurableContext = {
      callId: Number(id),
      attempt: run.attempt,
      idempotencyKey: claimed.idempotencyKey,
      timeoutMs,
      signal: ac.signal,
    };
    const aborted = new Promise<never>((_, reject) =>
      ac.signal.addEventListener('abort', () => reject(ac.signal.reason), { once: true }),
    );
    aborted.catch(() => undefined);
    this.#io(async () => {
      let result: Uint8Array | null = null;
      let failure: unknown;
      let failed = false;
      try {
        const out = await Promise.race([Promise.resolve().then(() => reg.fn(claimed.payload, ctx)), aborted]);
        result = out === undefined ? null : typeof out === 'string' ? Buffer.from(out) : out;
      } catch (err) {
        failed = true;
        failure = err;
      }
      clearInterval(r.renew);
      if (r.timer !== undefined) clearTimeout(r.timer);
      // abandoned, stopped, or the machine replaced: nothing of this attempt is recorded
      if (this.#over || epoch !== this.#epoch || this.#running.get(id) !== r) return;
      this.#running.delete(id);
      let outcome: Outcome = { kind: 'success' };
      let message = '';
      if (r.timedOut) outcome = { kind: 'timeout' };
      else if (failed) {
        outcome = outcomeOfError(failure);
        message = errorText(failure);
      } else this.#results.set(id, result);
      try {
        this.#h.onAttemptDone?.(Number(id), run.attempt, outcome);
      } catch (err) {
        console.error('levee durable: onAttemptDone threw (ignored):', err);
      }
      const [kind, code, text, flags] = outcomeArgs(outcome);
      this.#feed(epoch, { tag: 'finished', val: { id, kind, code, text, message, flags } });
    });
  }
}

/** Runs durable calls from a store: at most one process at a time per call, under a lease. */
export class DurableExecutor {
  readonly owner: string;
  readonly #levee: Levee;
  readonly #store: Store;
  readonly #host: Host;
  readonly #handlers = new Map<string, Registered>();
  /** The runs going on (`run`): woken by a submission. */
  readonly #drives = new Set<Drive>();

  constructor(levee: Levee, store: Store, options: DurableExecutorOptions = {}) {
    this.#levee = levee;
    this.#store = store;
    this.owner = options.owner ?? `${hostname()}:${process.pid}:${randomBytes(4).toString('hex')}`;
    const c = options.concurrency;
    this.#host = {
      levee,
      store,
      owner: this.owner,
      handlers: this.#handlers,
      onAttemptDone: options.onAttemptDone,
      concurrency: c === undefined || !Number.isFinite(c) ? 0 : Math.min(2 ** 32 - 1, Math.max(1, Math.trunc(c))),
      poll: configuredNs(options.pollIntervalMs),
      hold: configuredNs(options.claimHoldMs),
    };
  }

  /** Register `fn` under `name`, run under `policy` (default: the name). `idempotent: false`: a call without a key is not retried after a failure or a crash. */
  register(
    name: string,
    fn: DurableHandler,
    options: { policy?: string | undefined; idempotent?: boolean | undefined } = {},
  ): void {
    const policy = options.policy ?? name;
    this.#levee.policy(policy); // throws UnknownPolicyError now, not at run time
    this.#handlers.set(name, { fn, policy, idempotent: options.idempotent ?? true });
    for (const d of this.#drives) d.register(name);
  }

  /**
   * Persist a new call and return its id; a second submission with the same idempotency key returns
   * the first call's id. With `tx` (see {@link SubmitOptions.tx}), the call is written inside the
   * caller's open transaction and runs once the caller commits.
   */
  async submit(handler: string, payload: Uint8Array | string, options: SubmitOptions = {}): Promise<number> {
    const reg = this.#handlers.get(handler);
    if (!reg) throw new Error(`no durable handler named \`${handler}\` is registered`);
    checkKey(options.key ?? '');
    const engine = this.#levee.engine;
    const index = engine.policyIndex(reg.policy);
    if (index === undefined)
      throw new Error(`handler \`${handler}\`: \`${reg.policy}\` is not a policy of the loaded document`);
    const key = options.idempotencyKey ?? '';
    let step: DurableStep;
    try {
      step = engine.durableBegin(index, options.key ?? '', key, reg.idempotent ? 0 : 1, await this.#store.now());
    } catch (err) {
      const le = loadErrorOf(err);
      throw le === undefined ? err : new Error(le);
    }
    const body = typeof payload === 'string' ? Buffer.from(payload) : payload;
    const id = await this.#store.insert(handler, body, key === '' ? null : key, step.nextAt, step.bytes, options.tx);
    // a call in the caller's transaction is not visible before their commit: the next poll finds it
    if (options.tx === undefined) this.#wake();
    return id;
  }

  #wake(): void {
    for (const d of this.#drives) d.wake();
  }

  async status(id: number): Promise<CallStatus | undefined> {
    const r = await this.#store.get(id);
    return r ? this.#status(r) : undefined;
  }

  async calls(): Promise<CallStatus[]> {
    return (await this.#store.rows(false)).map((r) => this.#status(r));
  }

  /** Calls given up, and quarantined records, with their last error. */
  async dead(): Promise<CallStatus[]> {
    return (await this.#store.rows(true)).map((r) => this.#status(r));
  }

  async counts(): Promise<Record<string, number>> {
    return this.#store.counts();
  }

  #status(r: Row): CallStatus {
    let record: Record<string, unknown> | null = null;
    try {
      record = JSON.parse(this.#levee.engine.durableInspect(r[6])) as Record<string, unknown>;
    } catch {
      record = null;
    }
    return {
      id: r[0],
      handler: r[1],
      status: r[2],
      nextAt: r[3],
      attempts: r[4],
      leaseOwner: r[5],
      record,
      result: r[7],
      error: r[8],
      idempotencyKey: r[9],
    };
  }

  /** Cancel a call that has not finished (an attempt running now has its outcome refused). False when unknown or finished. */
  async cancel(id: number): Promise<boolean> {
    return this.#operator(id, false);
  }

  /** Give a dead or cancelled call a fresh set of attempts, due now. */
  async retry(id: number): Promise<boolean> {
    const ok = await this.#operator(id, true);
    this.#wake();
    return ok;
  }

  /** The core's write for an operator's cancel or retry, compare-and-set against the record read. */
  async #operator(id: number, revive: boolean): Promise<boolean> {
    for (let i = 0; i < DURABLE_OPERATOR_TRIES; i++) {
      const r = await this.#store.get(id);
      if (!r) return false;
      const wallNow = await this.#store.now();
      let w: RowWrite;
      try {
        w = this.#levee.durableCrossing('durable-operator', (engine, component) =>
          component.engineApi.Executor.operator(engine, BigInt(id), r[6], revive, wallNow),
        );
      } catch (err) {
        if (isComponentError(err)) return false; // finished already, or a record the core cannot use
        throw err;
      }
      if (await this.#store.replace(id, w.status, w.nextAt, w.attempts, w.bytes, w.error ?? null, r[6])) return true;
    }
    return false;
  }

  /** Claim and run due calls until `signal` aborts (or, with `untilIdle`, until no call is pending). */
  async run(options: { signal?: AbortSignal | undefined; untilIdle?: boolean | undefined } = {}): Promise<void> {
    const { signal, untilIdle = false } = options;
    if (signal?.aborted) return;
    const drive = new Drive(this.#host, untilIdle);
    const onAbort = () => drive.stop();
    signal?.addEventListener('abort', onAbort, { once: true });
    this.#drives.add(drive);
    try {
      await drive.start();
    } finally {
      this.#drives.delete(drive);
      signal?.removeEventListener('abort', onAbort);
    }
  }
}
