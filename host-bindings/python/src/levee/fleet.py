"""Fleet-wide state through Redis: breaker evidence, retry budget and rate limit shared by
every process that runs a policy with a `fleet` section (docs/fleet.md).

```python
import levee
from levee.fleet import Fleet

engine = levee.load("policies.yaml")
with Fleet(engine, "redis://127.0.0.1:6379/0", node="web-1") as fleet:
    fleet.call("checkout", charge, "o-1", key="payments")
```

A Redis Cluster is the client you already have: `Fleet(engine, client=RedisCluster(...))`.
Every key the fleet writes carries the hash tag `{policy/key}` and every script touches one
key, so redis-py routes each script to the key's shard and follows MOVED and ASK itself; the
scripts are loaded on every primary, and a shard that lost its script cache (a restarted or
promoted node) answers NOSCRIPT once and is loaded again by redis-py's `Script`.

The core decides and this module carries bytes: it reads the key's shared state and the
store's clock, asks the engine to merge its evidence in, writes the result back with a
compare-and-set in Lua (no lock; a conflict merges again into what the store holds), and
hands the accepted bytes to the engine, which applies the quorum rule, probe coordination
and the shared budget. The fleet rate limit is GCRA in Lua on Redis's `TIME`, with the
parameters of the engine's fleet plan.

Publication is asynchronous (a background thread, every `publish-every`) unless the policy
says `publish: strict`. Every Redis operation is bounded by the policy's `timeout`; past it,
or on any Redis error, every call goes on with local-only decisions at once (the engine's
own breaker, budget and rate limit), a `FleetEvent("degraded")` is emitted, and the store is
tried again every `retry-every`; when it answers, `FleetEvent("restored")` and the state
converges with the next publication. Nothing on the data path fails because of Redis.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from typing import Any, TypeVar

import redis
from redis.backoff import NoBackoff
from redis.cluster import RedisCluster
from redis.retry import Retry

from ._constants import FLEET_MAX_CAS, FLEET_MAX_KEYS
from ._runtime import check_key
from .engine import Engine, Policy
from .errors import RateLimited
from .types import LoadError, Reason

__all__ = ["Fleet", "FleetEvent", "FleetPlan"]

T = TypeVar("T")
logger = logging.getLogger("levee.fleet")
_monotonic_ns = time.monotonic_ns


def _script(name: str) -> str:
    return resources.files("levee").joinpath("_fleet", name).read_text(encoding="utf-8")


@dataclass(frozen=True)
class FleetEvent:
    """Something the fleet option did: `kind` is `degraded` (the store is slow or down: local
    decisions only), `restored` (the store answers again) or `bad-state` (the store holds
    bytes the core refused for `policy`/`key`; local decisions go on)."""

    kind: str
    detail: str
    policy: str = ""
    key: str = ""


@dataclass(frozen=True)
class FleetPlan:
    """A policy's fleet plan as the core gives it (`engine.fleet-plan`); durations in ns."""

    policy: str
    index: int
    key_prefix: str
    strict: bool
    publish_every: int
    timeout: int
    retry_every: int
    ttl: int
    rate_interval: int
    rate_burst: int
    rate_max_wait: int
    lease: int
    shares_state: bool  # a breaker or a shared budget: published, not only rate-limited

    @staticmethod
    def parse(index: int, text: str) -> FleetPlan:
        p = json.loads(text)
        rate = p.get("rate-limit") or {}
        return FleetPlan(
            policy=str(p["policy"]),
            index=index,
            key_prefix=str(p["key-prefix"]),
            strict=p["publish"] == "strict",
            publish_every=int(p["publish-every"]),
            timeout=int(p["timeout"]),
            retry_every=int(p["retry-every"]),
            ttl=int(p["ttl"]),
            rate_interval=int(rate.get("interval", 0)),
            rate_burst=int(rate.get("burst", 0)),
            rate_max_wait=int(rate.get("max-wait", 0)),
            lease=int(rate.get("lease", 1)),
            shares_state=bool(p["breaker"]) or bool(p["budget"]),
        )


@dataclass
class _Lease:
    tokens: int = 0
    expires: int = 0
    blocked_until: int = 0


class Fleet:
    """The fleet option for an engine: see the module documentation.

    `url` names the Redis server. `client` is a client you already have instead, a
    `redis.Redis` or a `redis.cluster.RedisCluster`: its own timeouts and retries then apply
    (give it socket timeouts near the policies' fleet `timeout` and no retries: a call slower
    than the policy's `timeout` still sends the fleet local-only, but only once it returns),
    and it stays yours: `close()` does not close it. `node` names this process in the shared
    state (default `<host>-<pid>`).

    A cluster is one store: when any shard fails to answer, the whole fleet goes local-only
    (`FleetEvent("degraded")`), and it is restored when every primary serves again.
    """

    def __init__(
        self,
        engine: Engine,
        url: str = "redis://127.0.0.1:6379/0",
        *,
        node: str | None = None,
        client: redis.Redis | RedisCluster | None = None,
        listener: Callable[[FleetEvent], None] | None = None,
        background: bool = True,
    ) -> None:
        self.engine = engine
        self.node = node or f"{socket.gethostname()}-{os.getpid()}"
        self.plans: dict[str, FleetPlan] = {}
        for name in engine.policies:
            idx = engine._index(name)
            text = engine._locked_op(lambda c, i=idx: c.fleet_plan(i))  # type: ignore[misc]
            if text is not None:
                self.plans[name] = FleetPlan.parse(idx, text)
        # The client waits as long as the slowest policy allows; each operation is then held
        # to its own policy's timeout (`_timed`).
        timeout = max((p.timeout for p in self.plans.values()), default=5_000_000) / 1e9
        self._timeout_ns = int(timeout * 1e9)
        self._owned = client is None
        self.redis: redis.Redis | RedisCluster = client or redis.Redis.from_url(
            url, socket_timeout=timeout, socket_connect_timeout=timeout, retry=Retry(NoBackoff(), 0)
        )
        self._gcra = self.redis.register_script(_script("gcra.lua"))
        self._state = self.redis.register_script(_script("state.lua"))
        self._listeners: list[Callable[[FleetEvent], None]] = [listener] if listener else []
        self._lock = threading.Lock()
        self._keys: OrderedDict[tuple[str, str], None] = OrderedDict()
        self._leases: dict[str, _Lease] = {}
        self._handles: OrderedDict[tuple[str, str], Policy] = OrderedDict()
        self._up = True
        self._stop = threading.Event()
        self.conflicts = 0  # compare-and-set conflicts merged again (for tests and metrics)
        self.publications = 0
        self._thread: threading.Thread | None = None
        try:  # connect and load the scripts once (on every primary of a cluster), untimed
            self._ping()
            self.redis.script_load(self._gcra.script)
            self.redis.script_load(self._state.script)
        except redis.RedisError as e:
            self._degrade(e)
        if background and self.plans:
            self._thread = threading.Thread(target=self._loop, name="levee-fleet", daemon=True)
            self._thread.start()

    # -------------------------------------------------------------- public API

    @property
    def up(self) -> bool:
        """False while the fleet runs local-only (the store was slow or down)."""
        return self._up

    def add_listener(self, listener: Callable[[FleetEvent], None]) -> None:
        self._listeners.append(listener)

    def call(self, name: str, fn: Callable[..., T], /, *args: Any, key: str = "", cost: int = 1, **kwargs: Any) -> T:
        """Run `fn(*args, **kwargs)` under the named policy and key, with the fleet's state."""
        check_key(key)
        plan = self.plans.get(name)
        if plan is not None:
            self._touch(name, key)
            if plan.rate_interval:
                self._take(plan, key, cost)
        try:
            return self._handle(name, key).call(fn, *args, **kwargs)
        finally:
            if plan is not None and plan.strict and plan.shares_state and self._up:
                self.sync(name, key)

    def sync(self, name: str, key: str = "") -> bool:
        """Publish this process's evidence for one policy and key and apply the fleet's
        state now; False when the store did not answer (the fleet is then local-only)."""
        check_key(key)
        plan = self.plans.get(name)
        if plan is None or not self._up:
            return False
        try:
            self._sync(plan, key)
            return True
        except redis.RedisError as e:
            self._degrade(e)
            return False
        except Exception:  # the engine faulted (it recovers by itself): never fail the call for it
            logger.exception("levee fleet publication failed")
            return False

    def inspect(self, name: str, key: str = "") -> dict[str, Any] | None:
        """The key's shared state as the core reads it (None when there is none)."""
        check_key(key)
        plan = self.plans[name]
        raw = self._state(keys=[plan.key_prefix + key + "}:s"], args=["", b"", 0])
        data = bytes(raw[3]) if len(raw) > 3 else b""
        if not data:
            return None
        out = self.engine._locked_op(lambda c: c.fleet_inspect(data))
        if isinstance(out, LoadError):
            raise ValueError(str(out))
        parsed: dict[str, Any] = json.loads(out)
        return parsed

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self._owned:
            self.redis.close()

    def __enter__(self) -> Fleet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -------------------------------------------------------------- internals

    def _emit(self, ev: FleetEvent) -> None:
        level = logging.WARNING if ev.kind != "restored" else logging.INFO
        logger.log(level, "levee fleet %s: %s", ev.kind, ev.detail)
        for listener in list(self._listeners):
            try:
                listener(ev)
            except Exception:
                logger.exception("a levee fleet listener raised")

    def _degrade(self, err: BaseException) -> None:
        with self._lock:
            was, self._up = self._up, False
            self._leases.clear()
        if was:
            self._emit(FleetEvent("degraded", f"{type(err).__name__}: {err}; local decisions only"))

    def _touch(self, name: str, key: str) -> None:
        k = (name, key)
        with self._lock:
            if k in self._keys:
                self._keys.move_to_end(k)
                return
            self._keys[k] = None
            if len(self._keys) > FLEET_MAX_KEYS:
                self._keys.popitem(last=False)

    def _handle(self, name: str, key: str) -> Policy:
        k = (name, key)
        with self._lock:
            h = self._handles.get(k)
            if h is None:
                h = self.engine.policy(name, key=key)
                self._handles[k] = h
                if len(self._handles) > FLEET_MAX_KEYS:
                    self._handles.popitem(last=False)
            return h

    def _ping(self) -> None:
        """Ask the store whether it serves: PING one server; of a cluster, every primary, each
        of which must report `cluster_state:ok` (a restarted master answers PING but refuses
        keys until it has rejoined), so that the fleet is restored only when every shard serves."""
        if not isinstance(self.redis, RedisCluster):
            self.redis.ping()
            return
        answer: Any = self.redis.cluster_info(target_nodes=RedisCluster.PRIMARIES)
        infos: dict[str, Any] = answer if isinstance(answer, dict) and "cluster_state" not in answer else {"": answer}
        for name, info in infos.items():  # one primary gives its own answer, not one per node
            state = info.get("cluster_state") if isinstance(info, dict) else None
            if state != "ok":
                raise redis.ConnectionError(f"cluster node {name}: cluster_state {state}")

    def _timed(self, fn: Callable[[], Any], limit_ns: int = 0) -> Any:
        start = _monotonic_ns()
        out = fn()
        if _monotonic_ns() - start > (limit_ns or self._timeout_ns):
            raise redis.TimeoutError("the store answered after the policy's fleet timeout")
        return out

    def _take(self, plan: FleetPlan, key: str, cost: int) -> None:
        """The fleet rate limit; raises RateLimited, sleeps for a wait, returns when admitted."""
        if not self._up:
            return
        rk = plan.key_prefix + key + "}:r"
        lease = plan.lease if cost == 1 else 1
        now = _monotonic_ns()
        with self._lock:
            b = self._leases.get(rk)
            if b is not None:
                if b.tokens > 0 and now < b.expires:
                    b.tokens -= 1
                    return
                if now < b.blocked_until:  # the store's last answer: no token before then
                    raise self._limited(plan, b.blocked_until - now)
        want = lease if lease > 1 else cost
        args = [plan.rate_interval, plan.rate_burst, want, plan.rate_max_wait, 1 if lease > 1 else 0]
        try:
            kind, granted, ns = (int(x) for x in self._timed(lambda: self._gcra(keys=[rk], args=args), plan.timeout))
        except redis.RedisError as e:
            self._degrade(e)
            return
        if kind == 0:
            if lease > 1 and granted > 1:
                with self._lock:
                    b = self._leases.setdefault(rk, _Lease())
                    b.tokens = (b.tokens if now < b.expires else 0) + granted - 1
                    b.expires = now + plan.rate_interval * plan.rate_burst
            return
        if kind == 1:
            time.sleep(max(0, min(ns, plan.rate_max_wait)) / 1e9)
            return
        with self._lock:
            self._leases.setdefault(rk, _Lease()).blocked_until = now + max(ns, 0)
        raise self._limited(plan, ns)

    @staticmethod
    def _limited(plan: FleetPlan, ns: int) -> RateLimited:
        return RateLimited(Reason.RATE_LIMITED, policy=plan.policy, attempts=0, retry_after=max(ns, 0) / 1e9)

    def _script_state(self, plan: FleetPlan, sk: str, version: int | str, data: bytes, ttl_ms: int) -> Any:
        return self._timed(lambda: self._state(keys=[sk], args=[version, data, ttl_ms]), plan.timeout)

    def _merge(self, idx: int, key: str, now: int, wall: int, data: bytes) -> bytes | LoadError:
        return self.engine._locked_op(lambda c: c.fleet_merge(idx, key, self.node, now, wall, data))

    def _apply(self, idx: int, key: str, now: int, wall: int, data: bytes) -> LoadError | None:
        return self.engine._locked_op(lambda c: c.fleet_apply(idx, key, self.node, now, wall, data))

    def _sync(self, plan: FleetPlan, key: str) -> None:
        """One publication: read, merge, compare-and-set (merging again on a conflict), apply."""
        sk = plan.key_prefix + key + "}:s"
        ttl_ms = max(1, plan.ttl // 1_000_000)
        raw = self._script_state(plan, sk, "", b"", ttl_ms)
        version, wall = int(raw[1]), int(raw[2])
        data = bytes(raw[3]) if len(raw) > 3 else b""
        for _ in range(FLEET_MAX_CAS):
            now = _monotonic_ns()
            merged = self._merge(plan.index, key, now, wall, data)
            if isinstance(merged, LoadError):
                self._emit(FleetEvent("bad-state", str(merged), plan.policy, key))
                return
            out = self._script_state(plan, sk, version, merged, ttl_ms)
            if int(out[0]) == 1:
                self.publications += 1
                err = self._apply(plan.index, key, now, wall, merged)
                if err is not None:
                    self._emit(FleetEvent("bad-state", str(err), plan.policy, key))
                return
            self.conflicts += 1
            version, wall = int(out[1]), int(out[2])
            data = bytes(out[3]) if len(out) > 3 else b""

    def _loop(self) -> None:
        every = min(p.publish_every for p in self.plans.values()) / 1e9
        retry = min(p.retry_every for p in self.plans.values()) / 1e9
        while not self._stop.is_set():
            if self._up:
                with self._lock:
                    keys = list(self._keys)
                for name, key in keys:
                    plan = self.plans.get(name)
                    if plan is None or plan.strict or not plan.shares_state or not self._up:
                        continue
                    try:
                        self._sync(plan, key)
                    except redis.RedisError as e:
                        self._degrade(e)
                    except Exception:  # a bug here must not stop publication for good
                        logger.exception("levee fleet publication failed")
                self._stop.wait(every)
            else:
                self._stop.wait(retry)
                try:
                    self._timed(self._ping)
                except redis.RedisError:
                    continue
                self._up = True
                self._emit(FleetEvent("restored", "the store answers again; publishing"))
