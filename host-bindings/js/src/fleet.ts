/**
 * Fleet-wide state through Redis (docs/fleet.md): breaker evidence, retry budget and rate limit
 * shared by every process that runs a policy with a `fleet` section, whatever its language.
 *
 * ```ts
 * import { load } from 'levee-resilience';
 * import { Fleet } from 'levee-resilience/fleet';
 *
 * const levee = await load(document);
 * await using fleet = await Fleet.connect(levee, 'redis://127.0.0.1:6379/0', { node: 'web-1' });
 * await fleet.run('payments', (ctx) => charge(order, ctx.signal), { key: 'acquirer-a' });
 * ```
 *
 * The core decides and this module carries bytes: it reads a key's shared state and the store's
 * clock, asks the engine to merge its evidence in (`fleet-merge`), writes the result back with a
 * compare-and-set in Lua (no lock; a conflict merges again into what the store holds) and hands
 * the accepted bytes to the engine (`fleet-apply`), which applies the quorum rule, probe
 * coordination and the shared budget. The fleet rate limit is GCRA in Lua on Redis's `TIME`, with
 * the parameters of the engine's fleet plan. The scripts are the repository's `fleet/lua/`, byte
 * for byte, as in every host.
 *
 * Publication is asynchronous (in the background, every `publish-every`) unless the policy says
 * `publish: strict`. Every Redis operation is bounded by the policy's `timeout`; past it, or on any
 * Redis error, every call goes on with local-only decisions at once (the engine's own breaker,
 * budget and rate limit), a `degraded` event is emitted, and the store is tried again every
 * `retry-every`; when it answers, `restored`, and the state converges with the next publication.
 * Nothing on the data path fails because of Redis.
 *
 * The client is ioredis, an optional peer dependency: `npm install ioredis` to use this module.
 */

import { readFileSync } from 'node:fs';
import { once } from 'node:events';
import { hostname } from 'node:os';
import { setTimeout as delay } from 'node:timers/promises';
import type { Cluster, Redis, RedisOptions } from 'ioredis';

import type { AttemptContext, Levee, PolicyEntry, RunOptions } from './levee.js';
import { FLEET_MAX_CAS, FLEET_MAX_KEYS } from './constants.js';
import { LeveeError, checkKey, keyError } from './errors.js';
import { reportHookError } from './events.js';
import { isComponentError } from './runtime.js';

/** Publications of one round that run at once (each is two round trips). */
const PUBLISH_CONCURRENCY = 8;
/** How long the first connection and the scripts' loading may take (outside the per-operation timeout). */
const CONNECT_MS = 1000;
const GCRA = 'leveeFleetGcra';
const STATE = 'leveeFleetState';
const EMPTY = Buffer.alloc(0);

/** What the fleet option did. */
export interface FleetEvent {
  /**
   * `degraded`: the store is slow or down, decisions are local only; `restored`: it answers again;
   * `bad-state`: the store holds bytes the core refused for `policy`/`key` (local decisions go on).
   */
  kind: 'degraded' | 'restored' | 'bad-state';
  detail: string;
  /** The policy and key (for `bad-state`; "" otherwise). */
  policy: string;
  key: string;
}

export type FleetEventKind = FleetEvent['kind'];
export type FleetListener = (event: FleetEvent) => void;

/** A policy's fleet plan as the core gives it (`fleet-plan`); durations in ns. */
export interface FleetPlan {
  readonly policy: string;
  readonly index: number;
  /** `<prefix>:{<policy>/`: a key's entries are this, the key, `}:s` (state) and `}:r` (rate). */
  readonly keyPrefix: string;
  readonly strict: boolean;
  readonly publishEvery: number;
  readonly timeout: number;
  readonly retryEvery: number;
  readonly ttl: number;
  /** The fleet rate limit's emission interval (0: the policy has none). */
  readonly rateInterval: number;
  readonly rateBurst: number;
  readonly rateMaxWait: number;
  readonly lease: number;
  /** A breaker or a shared budget: published, not only rate-limited. */
  readonly sharesState: boolean;
}

/** The shared state of a key as the core reads it (`fleet-inspect`; times are store ms). */
export interface FleetState {
  /** The fleet's last successful probe: evidence recorded before it no longer counts. */
  cleared: number;
  /** The process holding the half-open probe ("" for none), and until when. */
  probe: string;
  'probe-until': number;
  /** The shared retry budget's level (null: none shared). */
  tokens: number | null;
  records: Array<{
    node: string;
    state: string;
    /** Opened by the quorum (such a record never counts toward it). */
    'fleet-opened': boolean;
    since: number;
    expires: number;
    calls: number;
    failures: number;
    trips: number;
    seen: number;
  }>;
}

export interface FleetOptions {
  /** This process's name in the shared state. Default `<host>-<pid>`. */
  node?: string | undefined;
  /**
   * An ioredis client of your own (a `Redis`, or a `Cluster`: every script touches one key whose
   * entries share a hash tag). Its own timeouts and reconnection apply, and an operation slower than
   * the policy's `timeout` still sends the fleet local-only. The fleet does not close it.
   */
  client?: Redis | Cluster | undefined;
  /** More ioredis options for the client the fleet makes from the URL (timeouts and retries are the fleet's). */
  redisOptions?: RedisOptions | undefined;
  /** Receives every fleet event (as `on('event', ...)`). */
  listener?: FleetListener | undefined;
  /** Publish in the background (default true); false: call `sync` yourself. */
  background?: boolean | undefined;
}

/** Options of `Fleet.run`: the Levee's, and the tokens the call takes from the fleet's rate limit. */
export interface FleetRunOptions<T> extends RunOptions<T> {
  /** Tokens of the fleet rate limit this call takes (default 1; a lease serves only cost 1). */
  cost?: number | undefined;
}

type Reply = Array<number | Buffer>;
interface Scripts {
  leveeFleetGcra(key: string, ...args: Array<string | number>): Promise<number[]>;
  leveeFleetStateBuffer(key: string, ...args: Array<string | number | Buffer>): Promise<Reply>;
}
type Client = (Redis | Cluster) & Scripts;

interface Plan extends FleetPlan {
  readonly entry: PolicyEntry;
  /** ms */
  readonly timeoutMs: number;
  /** The keys published in the background, least recently used first. */
  readonly keys: Map<string, true>;
  lastKey: string | undefined;
  /** This process's fleet rate-limit leases, by key. */
  readonly leases: Map<string, Lease>;
}

interface Lease {
  tokens: number;
  /** performance.now() ms */
  expires: number;
  blockedUntil: number;
  /** A lease request in flight: concurrent calls wait for it rather than ask for their own. */
  pending: Promise<void> | undefined;
}

/** A store answer that came too late: the fleet goes local-only. */
class FleetTimeout extends Error {
  override readonly name = 'FleetTimeout';
}

const scripts = new Map<string, string>();

/** A script of the package's `lua/` (beside both dist/fleet.js and src/fleet.ts), read once. */
function script(name: 'gcra.lua' | 'state.lua'): string {
  let text = scripts.get(name);
  if (text === undefined) scripts.set(name, (text = readFileSync(new URL(`../lua/${name}`, import.meta.url), 'utf8')));
  return text;
}

function u8(data: Uint8Array): Buffer {
  return Buffer.from(data.buffer, data.byteOffset, data.byteLength);
}

function bytesOf(reply: Reply): Buffer {
  const data = reply[3];
  return Buffer.isBuffer(data) ? data : EMPTY;
}

function int(reply: Reply, i: number): number {
  const v = reply[i];
  if (typeof v === 'number') return v;
  if (Buffer.isBuffer(v)) return Number(v.toString('latin1'));
  throw new TypeError(`levee fleet: the state script answered no integer at ${i}`);
}

/** What the core's LoadError (a jco ComponentError's payload) says, if `err` is one. */
function loadError(err: unknown): string | undefined {
  if (!isComponentError(err)) return undefined;
  const p = err.payload as { path?: unknown; message?: unknown } | null;
  const path = typeof p?.path === 'string' && p.path !== '' ? `${p.path}: ` : '';
  return `${path}${String(p?.message ?? err.message)}`;
}

function describe(err: unknown): string {
  return err instanceof Error ? `${err.name}: ${err.message}` : String(err);
}

/**
 * The fleet option of one Levee: see the module documentation. Make it with `Fleet.connect`; one
 * instance serves any number of concurrent calls.
 */
export class Fleet {
  readonly levee: Levee;
  /** This process's name in the shared state. */
  readonly node: string;
  /** The client (the fleet's own, or the one passed in `client`). */
  readonly redis: Redis | Cluster;
  /** Compare-and-set conflicts merged again (for tests and metrics). */
  conflicts = 0;
  /** Accepted publications. */
  publications = 0;

  readonly #client: Client;
  readonly #owned: boolean;
  readonly #plans: Map<string, Plan>;
  readonly #listeners = new Map<FleetEventKind | 'event', Set<FleetListener>>();
  readonly #stop = new AbortController();
  readonly #clientTimeoutMs: number;
  #up = true;
  #loop: Promise<void> | undefined;

  /**
   * The fleet option for `levee` against the Redis server at `url` (ignored with `options.client`).
   * Resolves once connected and the scripts loaded, or, when Redis does not answer within a second,
   * local-only (a `degraded` event; the store is tried again every `retry-every`): it never rejects
   * because of Redis. It rejects when ioredis is not installed.
   */
  static async connect(levee: Levee, url = 'redis://127.0.0.1:6379/0', options: FleetOptions = {}): Promise<Fleet> {
    const plans = fleetPlans(levee);
    const all = [...plans.values()];
    // The client waits as long as the slowest policy allows; each operation is then held to its
    // own policy's timeout (`#op`).
    const timeoutMs = all.length === 0 ? 5 : Math.max(...all.map((p) => p.timeoutMs));
    const retryMs = Math.min(...all.map((p) => p.retryEvery / 1e6), 1000);
    let client = options.client;
    if (client === undefined) {
      let Ctor: typeof Redis;
      try {
        const mod = (await import('ioredis')) as unknown as { Redis?: typeof Redis; default?: typeof Redis };
        const found = mod.Redis ?? mod.default;
        if (found === undefined) throw new TypeError('ioredis exports no Redis class');
        Ctor = found;
      } catch (err) {
        throw new Error('levee-resilience/fleet needs ioredis, an optional peer dependency: npm install ioredis', {
          cause: err,
        });
      }
      client = new Ctor(url, {
        ...options.redisOptions,
        lazyConnect: true,
        // Past the policy's timeout a command fails, and the fleet goes local-only.
        commandTimeout: timeoutMs,
        connectTimeout: Math.max(timeoutMs, CONNECT_MS),
        // While disconnected every command fails at once (never queued), and none is sent twice.
        enableOfflineQueue: false,
        autoResendUnfulfilledCommands: false,
        maxRetriesPerRequest: 0,
        // Reconnect in the background, at the pace local-only hosts try the store again.
        retryStrategy: () => Math.max(10, retryMs),
      });
    }
    const fleet = new Fleet(levee, client, options, plans, timeoutMs, options.client === undefined);
    await fleet.#start(options.client === undefined, options.background ?? true);
    return fleet;
  }

  private constructor(
    levee: Levee,
    client: Redis | Cluster,
    options: FleetOptions,
    plans: Map<string, Plan>,
    timeoutMs: number,
    owned: boolean,
  ) {
    this.levee = levee;
    this.node = options.node ?? `${hostname()}-${process.pid}`;
    this.redis = client;
    this.#owned = owned;
    this.#plans = plans;
    this.#clientTimeoutMs = timeoutMs;
    if (options.listener !== undefined) this.on('event', options.listener);
    // Errors come back on the operations that failed; the client's own error events are noise here
    // (and unhandled, ioredis would print each). A client passed in keeps the listeners it has.
    if (owned) client.on('error', () => {});
    client.defineCommand(GCRA, { numberOfKeys: 1, lua: script('gcra.lua') });
    client.defineCommand(STATE, { numberOfKeys: 1, lua: script('state.lua') });
    this.#client = client as Client;
  }

  async #start(connect: boolean, background: boolean): Promise<void> {
    // Connect and load the scripts once (on every master of a cluster), outside the per-operation
    // timeout. (ioredis also sends a script with EVAL on a connection that has not run it, and
    // again after NOSCRIPT: a restarted or promoted node gets it back by itself.)
    try {
      const ready = (async () => {
        const c = this.redis;
        if (connect) await (c as Redis).connect();
        if (c.isCluster && c.status !== 'ready') await once(c, 'ready');
        const servers = c.isCluster ? (c as Cluster).nodes('master') : [c as Redis];
        await Promise.all(
          servers.map(async (server) => {
            await server.script('LOAD', script('gcra.lua'));
            await server.script('LOAD', script('state.lua'));
          }),
        );
      })();
      ready.catch(() => {});
      await withTimeout(ready, CONNECT_MS);
    } catch (err) {
      this.#degrade(err);
    }
    if (background && this.#plans.size > 0) this.#loop = this.#publishLoop();
  }

  // ---------------------------------------------------------------- public API

  /** False while the fleet runs local-only (the store was slow or down). */
  get up(): boolean {
    return this.#up;
  }

  /** The fleet plans, by policy name (the policies with a `fleet` section). */
  get plans(): ReadonlyMap<string, FleetPlan> {
    return this.#plans;
  }

  /** Listen to one kind of fleet event, or to all (`'event'`). A listener that throws is reported and ignored. */
  on(kind: FleetEventKind | 'event', listener: FleetListener): this {
    let set = this.#listeners.get(kind);
    if (set === undefined) this.#listeners.set(kind, (set = new Set()));
    set.add(listener);
    return this;
  }

  off(kind: FleetEventKind | 'event', listener: FleetListener): this {
    this.#listeners.get(kind)?.delete(listener);
    return this;
  }

  /**
   * `levee.run` with the fleet's state: the fleet rate limit first (a `LeveeError` with reason
   * `rate-limited` and `retryAfterMs` when it rejects; a wait the policy's `max-wait` allows is
   * slept, cut short by `signal`), then the policy; in strict mode the call's evidence is published
   * before it settles. A policy without a `fleet` section runs as `levee.run` would.
   */
  run<T>(policy: string, fn: (ctx: AttemptContext) => T | PromiseLike<T>, options?: FleetRunOptions<T>): Promise<T> {
    const plan = this.#plans.get(policy);
    if (plan === undefined) return this.levee.run(policy, fn, options);
    const key = options?.key ?? '';
    const tooLong = keyError(key);
    if (tooLong !== undefined) return Promise.reject(tooLong);
    if (plan.strict) return this.#strict(plan, key, fn, options);
    if (plan.sharesState) this.#touch(plan, key);
    if (plan.rateInterval === 0 || !this.#up) return this.levee.run(plan.entry, fn, options);
    const cost = options?.cost ?? 1;
    if (!Number.isSafeInteger(cost) || cost < 1) {
      return Promise.reject(new RangeError(`levee fleet: cost must be a positive integer, not ${String(cost)}`));
    }
    // The common case: a token of this process's lease, no round trip.
    if (cost === 1 && plan.lease > 1) {
      const b = plan.leases.get(key);
      if (b !== undefined && b.tokens > 0 && performance.now() < b.expires) {
        b.tokens--;
        return this.levee.run(plan.entry, fn, options);
      }
    }
    return this.#take(plan, key, cost, options?.signal).then(() => this.levee.run(plan.entry, fn, options));
  }

  /**
   * Publish this process's evidence for a policy and key and apply the fleet's state now. Resolves
   * false when the store did not answer (the fleet is then local-only) or the policy has no fleet
   * section; rejects only a key longer than the bound (a RangeError, as every entry that takes a key).
   */
  async sync(policy: string, key = ''): Promise<boolean> {
    checkKey(key);
    const plan = this.#plans.get(policy);
    if (plan === undefined || !this.#up) return false;
    return this.#syncSafe(plan, key);
  }

  /**
   * A key's shared state as the core reads it (`undefined` when there is none). Rejects on a Redis
   * error, and with an Error naming what is wrong when the core refuses the bytes.
   */
  async inspect(policy: string, key = ''): Promise<FleetState | undefined> {
    checkKey(key);
    const plan = this.#plans.get(policy);
    if (plan === undefined) throw new TypeError(`levee fleet: policy "${policy}" has no fleet section`);
    const raw = await this.#client.leveeFleetStateBuffer(plan.keyPrefix + key + '}:s', '', '', 0);
    const data = bytesOf(raw);
    if (data.length === 0) return undefined;
    let text: string;
    try {
      text = this.levee.fleetCrossing('fleet-inspect', false, (e) => e.fleetInspect(data));
    } catch (err) {
      const refused = loadError(err);
      throw refused === undefined ? err : new Error(`levee fleet: the store's bytes: ${refused}`, { cause: err });
    }
    return JSON.parse(text) as FleetState;
  }

  /** Stop publication and, for a client the fleet made, close it. */
  async close(): Promise<void> {
    if (this.#stop.signal.aborted) return;
    this.#stop.abort();
    await this.#loop;
    if (!this.#owned) return;
    try {
      await withTimeout(this.redis.quit(), this.#clientTimeoutMs);
    } catch {
      this.redis.disconnect();
    }
  }

  async [Symbol.asyncDispose](): Promise<void> {
    await this.close();
  }

  // ---------------------------------------------------------------- internals

  #emit(event: FleetEvent): void {
    for (const kind of [event.kind, 'event'] as const) {
      for (const listener of this.#listeners.get(kind) ?? []) {
        try {
          listener(event);
        } catch (err) {
          reportHookError(err, `fleet listener of "${kind}"`);
        }
      }
    }
  }

  #degrade(err: unknown): void {
    for (const plan of this.#plans.values()) plan.leases.clear();
    if (!this.#up) return;
    this.#up = false;
    this.#emit({ kind: 'degraded', detail: `${describe(err)}; local decisions only`, policy: '', key: '' });
  }

  /** Keep the key for background publication, most recently used last. */
  #touch(plan: Plan, key: string): void {
    if (plan.lastKey === key) return;
    plan.lastKey = key;
    const keys = plan.keys;
    if (keys.delete(key)) {
      keys.set(key, true);
      return;
    }
    keys.set(key, true);
    if (keys.size > FLEET_MAX_KEYS) {
      const oldest = keys.keys().next();
      if (oldest.done !== true) keys.delete(oldest.value);
    }
  }

  /** One store operation under the policy's timeout: past it (or on any error) it rejects. */
  async #op<R>(plan: Plan, run: () => Promise<R>): Promise<R> {
    const start = performance.now();
    const p = run();
    const out = plan.timeoutMs < this.#clientTimeoutMs ? await withTimeout(p, plan.timeoutMs) : await p;
    if (performance.now() - start > plan.timeoutMs) {
      throw new FleetTimeout(`the store answered after the policy's fleet timeout (${plan.timeoutMs} ms)`);
    }
    return out;
  }

  /** Strict mode: a token from the store per call, and the call's evidence published before it settles. */
  async #strict<T>(
    plan: Plan,
    key: string,
    fn: (ctx: AttemptContext) => T | PromiseLike<T>,
    options: FleetRunOptions<T> | undefined,
  ): Promise<T> {
    const cost = options?.cost ?? 1;
    if (!Number.isSafeInteger(cost) || cost < 1) {
      throw new RangeError(`levee fleet: cost must be a positive integer, not ${String(cost)}`);
    }
    if (plan.rateInterval > 0 && this.#up) await this.#take(plan, key, cost, options?.signal);
    if (!plan.sharesState) return this.levee.run(plan.entry, fn, options);
    try {
      return await this.levee.run(plan.entry, fn, options);
    } finally {
      if (this.#up) await this.#syncSafe(plan, key);
    }
  }

  /**
   * The fleet rate limit: resolves when admitted (after a wait, when the core's semantics give
   * one), rejects with `rate-limited` when refused. The store being down admits: the policy's own
   * rate limit still holds. With leases, one request per key is in flight: its tokens go into the
   * lease before anyone goes on, and every call, the one that asked included, takes its token
   * from there (none is admitted without one).
   */
  async #take(plan: Plan, key: string, cost: number, signal: AbortSignal | undefined): Promise<void> {
    if (signal?.aborted) throw signal.reason;
    const rk = plan.keyPrefix + key + '}:r';
    const leased = cost === 1 && plan.lease > 1;
    for (let round = 0; ; round++) {
      if (!this.#up) return;
      const now = performance.now();
      const b = plan.leases.get(key);
      if (b !== undefined) {
        if (cost === 1 && b.tokens > 0 && now < b.expires) {
          b.tokens--;
          return;
        }
        if (now < b.blockedUntil) throw limited(plan, (b.blockedUntil - now) * 1e6);
        if (leased && b.pending !== undefined && round < 4) {
          await (signal === undefined ? b.pending : withSignal(b.pending, signal));
          continue;
        }
      }
      const want = leased ? plan.lease : cost;
      const args = [plan.rateInterval, plan.rateBurst, want, plan.rateMaxWait, leased ? 1 : 0];
      const ask = this.#op(plan, () => this.#client.leveeFleetGcra(rk, ...args));
      if (leased) {
        const e = b ?? this.#lease(plan, key);
        const pending: Promise<void> = ask
          .then(
            ([kind, granted]) => {
              if (kind === 0 && granted !== undefined && granted > 0 && this.#up) {
                e.tokens = (now < e.expires ? e.tokens : 0) + granted;
                e.expires = now + (plan.rateInterval * plan.rateBurst) / 1e6;
              }
            },
            () => {},
          )
          .finally(() => {
            if (e.pending === pending) e.pending = undefined;
          });
        e.pending = pending;
      }
      let reply: number[];
      try {
        reply = signal === undefined ? await ask : await withSignal(ask, signal);
      } catch (err) {
        if (signal?.aborted && err === signal.reason) throw err;
        this.#degrade(err);
        return;
      }
      const [kind, , ns] = reply;
      if (kind === 0) {
        if (!leased) return;
        continue; // the tokens are in the lease: take one as everyone does
      }
      if (kind === 1) {
        const ms = Math.max(0, Math.min(ns ?? 0, plan.rateMaxWait)) / 1e6;
        await this.levee.clock.sleep(ms, signal);
        return;
      }
      const hint = Math.max(ns ?? 0, 0);
      if (this.#up) (b ?? this.#lease(plan, key)).blockedUntil = now + hint / 1e6;
      throw limited(plan, hint);
    }
  }

  /** A new lease entry for a key (the least recently made is dropped past FLEET_MAX_KEYS). */
  #lease(plan: Plan, key: string): Lease {
    const e: Lease = { tokens: 0, expires: 0, blockedUntil: 0, pending: undefined };
    plan.leases.set(key, e);
    if (plan.leases.size > FLEET_MAX_KEYS) {
      const oldest = plan.leases.keys().next();
      if (oldest.done !== true) plan.leases.delete(oldest.value);
    }
    return e;
  }

  /** One publication; false when the store did not answer. Never rejects. */
  async #syncSafe(plan: Plan, key: string): Promise<boolean> {
    try {
      await this.#sync(plan, key);
      return true;
    } catch (err) {
      this.#degrade(err);
      return false;
    }
  }

  /** One publication: read, merge, compare-and-set (merging again on a conflict), apply. */
  async #sync(plan: Plan, key: string): Promise<void> {
    const sk = plan.keyPrefix + key + '}:s';
    const ttlMs = Math.max(1, Math.floor(plan.ttl / 1e6));
    let reply = await this.#op(plan, () => this.#client.leveeFleetStateBuffer(sk, '', '', ttlMs));
    for (let round = 0; round < FLEET_MAX_CAS; round++) {
      const version = int(reply, 1);
      const wall = BigInt(int(reply, 2));
      const data = bytesOf(reply);
      let merged: Uint8Array;
      let now: bigint;
      try {
        [merged, now] = this.levee.fleetCrossing('fleet-merge', false, (e, t) => [
          e.fleetMerge(plan.index, key, this.node, t, wall, data),
          t,
        ]);
      } catch (err) {
        const refused = loadError(err);
        // A refusal names what is wrong with the store's bytes; a trap recovered by itself: publish next time.
        if (refused !== undefined) this.#emit({ kind: 'bad-state', detail: refused, policy: plan.policy, key });
        return;
      }
      const out = await this.#op(plan, () => this.#client.leveeFleetStateBuffer(sk, version, u8(merged), ttlMs));
      if (int(out, 0) === 1) {
        this.publications++;
        try {
          this.levee.fleetCrossing('fleet-apply', true, (e) =>
            e.fleetApply(plan.index, key, this.node, now, wall, merged),
          );
        } catch (err) {
          this.#emit({ kind: 'bad-state', detail: loadError(err) ?? describe(err), policy: plan.policy, key });
        }
        return;
      }
      this.conflicts++;
      reply = out;
    }
  }

  /**
   * Whether the store serves: PING one server; of a cluster, every master, each of which must
   * report `cluster_state:ok` (a restarted master answers PING but refuses keys until it has
   * rejoined), so that the fleet is restored only when every shard serves, as in every host. The
   * client must also reach as many masters as the cluster has (`cluster_size`): ioredis drops a
   * node it lost from its list, and the others say `ok` until the cluster marks it failed.
   */
  async #ping(): Promise<void> {
    const c = this.redis;
    if (!c.isCluster) {
      await c.ping();
      return;
    }
    const masters = (c as Cluster).nodes('master');
    const sizes = await Promise.all(
      masters.map(async (m) => {
        const info = String(await m.cluster('INFO'));
        if (!info.includes('cluster_state:ok')) {
          throw new Error(`cluster node ${m.options.host ?? ''}:${m.options.port ?? ''}: not cluster_state:ok`);
        }
        return Number(/cluster_size:(\d+)/.exec(info)?.[1] ?? 0);
      }),
    );
    const size = Math.max(1, ...sizes);
    if (masters.length < size) {
      // Ask the cluster for its nodes again (ioredis does by itself only on a redirection or every
      // `slotsRefreshInterval`): a master that came back is then in the list of the next ping.
      (c as Cluster).refreshSlotsCache();
      throw new Error(`the client reaches ${masters.length} of the cluster's ${size} masters`);
    }
  }

  async #publishLoop(): Promise<void> {
    const plans = [...this.#plans.values()];
    const every = Math.min(...plans.map((p) => p.publishEvery)) / 1e6;
    const retry = Math.min(...plans.map((p) => p.retryEvery)) / 1e6;
    const published = plans.filter((p) => p.sharesState && !p.strict);
    const signal = this.#stop.signal;
    while (!signal.aborted) {
      if (this.#up) {
        const work: Array<[Plan, string]> = [];
        for (const plan of published) for (const key of plan.keys.keys()) work.push([plan, key]);
        for (let i = 0; i < work.length && this.#up && !signal.aborted; i += PUBLISH_CONCURRENCY) {
          await Promise.all(work.slice(i, i + PUBLISH_CONCURRENCY).map(([p, k]) => this.#syncSafe(p, k)));
        }
        if (!(await pause(every, signal))) return;
      } else {
        if (!(await pause(retry, signal))) return;
        try {
          await withTimeout(this.#ping(), this.#clientTimeoutMs);
        } catch {
          continue;
        }
        this.#up = true;
        this.#emit({ kind: 'restored', detail: 'the store answers again; publishing', policy: '', key: '' });
      }
    }
  }
}

function fleetPlans(levee: Levee): Map<string, Plan> {
  const plans = new Map<string, Plan>();
  for (const entry of levee.policies) {
    const text = levee.fleetCrossing('fleet-plan', false, (e) => e.fleetPlan(entry.index));
    if (text === undefined) continue;
    const p = JSON.parse(text) as {
      policy: string;
      'key-prefix': string;
      publish: string;
      'publish-every': number;
      timeout: number;
      'retry-every': number;
      ttl: number;
      breaker: boolean;
      budget: boolean;
      'rate-limit'?: { interval: number; burst: number; 'max-wait': number; lease: number } | null;
    };
    const rate = p['rate-limit'] ?? undefined;
    plans.set(entry.name, {
      policy: p.policy,
      index: entry.index,
      entry,
      keyPrefix: p['key-prefix'],
      strict: p.publish === 'strict',
      publishEvery: p['publish-every'],
      timeout: p.timeout,
      timeoutMs: Math.max(1, Math.ceil(p.timeout / 1e6)),
      retryEvery: p['retry-every'],
      ttl: p.ttl,
      rateInterval: rate?.interval ?? 0,
      rateBurst: rate?.burst ?? 0,
      rateMaxWait: rate?.['max-wait'] ?? 0,
      lease: rate?.lease ?? 1,
      sharesState: p.breaker || p.budget,
      keys: new Map(),
      lastKey: undefined,
      leases: new Map(),
    });
  }
  return plans;
}

function limited(plan: FleetPlan, ns: number): LeveeError {
  return new LeveeError('rate-limited', {
    policy: plan.policy,
    attempts: 0,
    retryAfterMs: Math.max(ns, 0) / 1e6,
    detail: 'the fleet rate limit',
  });
}

/** `p`, or a FleetTimeout after `ms`. */
function withTimeout<R>(p: Promise<R>, ms: number): Promise<R> {
  let timer: ReturnType<typeof setTimeout> | undefined;
  const late = new Promise<never>((_, reject) => {
    timer = setTimeout(() => reject(new FleetTimeout(`the store did not answer within ${ms} ms`)), ms);
    timer.unref?.();
  });
  return Promise.race([p, late]).finally(() => clearTimeout(timer));
}

/** `p`, or the signal's reason as soon as it aborts. */
function withSignal<R>(p: Promise<R>, signal: AbortSignal): Promise<R> {
  if (signal.aborted) return Promise.reject(signal.reason);
  return new Promise<R>((resolve, reject) => {
    const onAbort = (): void => reject(signal.reason);
    signal.addEventListener('abort', onAbort, { once: true });
    p.then(
      (v) => {
        signal.removeEventListener('abort', onAbort);
        resolve(v);
      },
      (e) => {
        signal.removeEventListener('abort', onAbort);
        reject(e);
      },
    );
  });
}

/** Wait `ms` unless `signal` aborts first (then false). Never keeps the process alive. */
async function pause(ms: number, signal: AbortSignal): Promise<boolean> {
  try {
    await delay(ms, undefined, { signal, ref: false });
    return true;
  } catch {
    return false;
  }
}
