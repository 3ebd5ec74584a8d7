"""The router's hold on the cluster's shared state: Redis is a cache of the truth, not the truth.

The truth is what lives: the worker actors (which answer pings) and the pool manager's memory
(targets, members, ids). Redis holds a copy that any process can read, and a lost or bad copy
is rebuilt from the live side:

* :class:`ControlPlaneHealth`: whether this process reaches Redis. A failed call makes it
  *degraded* (``pdserve_control_plane_degraded`` 1, a line in ``pdserve status``); further
  calls wait a backoff that doubles per failure up to ``max_backoff_s``; the first call that
  succeeds ends it. Malformed records, untrusted ones (a tag that does not verify) and
  re-published ones are counted here (``pdserve_malformed_records_total{family}``,
  ``pdserve_untrusted_records_total{kind}``, ``pdserve_control_plane_repairs_total{family}``).
* :class:`ResilientDirectory`: the router's worker directory. While Redis answers, it lists
  the registry's records as ``RedisDirectory`` does, plus every worker it listed before whose
  record is gone but which still answers a ping (its stats as last seen: a draining worker
  stays draining); while Redis does not answer, it lists the workers it knew that answer a
  ping. So neither a worker that cannot reach Redis nor a Redis restarted empty takes a live
  worker out of routing; a worker that dies still leaves, at its first failed ping or call.
  It also keeps what the router itself publishes (its ports) re-published (``keep``).

Workers re-register by themselves on their next heartbeat; the pool manager
(``pdserve.cluster.pools.manager``) re-publishes targets, members, counters and drain marks.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import redis

from pdserve.cluster.actors import RayHandle, RedisDirectory
from pdserve.cluster.registry import Registry
from pdserve.router.metrics import RouterMetrics
from pdserve.worker_api import WorkerStats

logger = logging.getLogger(__name__)

# What "Redis is away" looks like (a refused or dropped connection, a timeout, a server still
# loading its data); anything else Redis says is an answer.
REDIS_DOWN = (redis.ConnectionError, redis.TimeoutError)


class ControlPlaneHealth:
    """Whether this process reaches Redis (see the module docstring). ``clock`` is
    ``time.monotonic`` unless a test gives another."""

    def __init__(self, metrics: RouterMetrics | None = None, min_backoff_s: float = 0.25,
                 max_backoff_s: float = 4.0, clock: Callable[[], float] = time.monotonic):
        self.metrics = metrics
        self.min_backoff_s, self.max_backoff_s = min_backoff_s, max_backoff_s
        self.clock = clock
        self.degraded = False
        self.error = ""  # the latest failure while degraded
        self.malformed = 0  # records skipped because they did not parse (a counter)
        self.untrusted = 0  # values skipped because their tag did not verify (a counter)
        self.repairs = 0  # values re-published after Redis lost or spoiled them (a counter)
        self._since: float | None = None  # clock() when it became degraded
        self._failures = 0  # failed calls in a row
        self._next_try = 0.0

    @property
    def degraded_for_s(self) -> float:
        return 0.0 if self._since is None else self.clock() - self._since

    def can_try(self) -> bool:
        """False while the backoff after a failure runs: use what is known instead."""
        return not self.degraded or self.clock() >= self._next_try

    def ok(self) -> None:
        """A call reached Redis."""
        if self.degraded:
            logger.warning("Redis reachable again after %.1f s: the control plane is back",
                           self.degraded_for_s)
        self.degraded, self.error, self._since, self._failures = False, "", None, 0
        if self.metrics is not None:
            self.metrics.control_plane_degraded.set(0)

    def failed(self, exc: BaseException) -> None:
        """A call could not reach Redis: degraded, and the next try waits a backoff."""
        self._failures += 1
        backoff = min(self.max_backoff_s, self.min_backoff_s * 2 ** (self._failures - 1))
        self._next_try = self.clock() + backoff
        self.error = str(exc) or type(exc).__name__
        if not self.degraded:
            self.degraded, self._since = True, self.clock()
            logger.warning("Redis unreachable (%s): serving on with the workers known now; "
                           "retrying with backoff up to %.1f s (check the Redis server and "
                           "--redis-url)", self.error, self.max_backoff_s)
        if self.metrics is not None:
            self.metrics.control_plane_degraded.set(1)

    def count_malformed(self, family: str, count: int = 1) -> None:
        self.malformed += count
        if self.metrics is not None:
            self.metrics.malformed_records.labels(family).inc(count)

    def count_untrusted(self, kind: str, count: int = 1) -> None:
        self.untrusted += count
        if self.metrics is not None:
            self.metrics.untrusted_records.labels(kind).inc(count)

    def count_repairs(self, families: list[str]) -> None:
        """Count re-published values (one family name per value) and say so once."""
        if not families:
            return
        self.repairs += len(families)
        for family in set(families):
            if self.metrics is not None:
                self.metrics.control_plane_repairs.labels(family).inc(families.count(family))
        logger.warning("re-published to Redis what it lost or held malformed: %s",
                       ", ".join(f"{f} x{families.count(f)}" for f in sorted(set(families))))


class ResilientDirectory(RedisDirectory):
    """The router's ``WorkerDirectory``; see the module docstring. ``ping_timeout_s`` bounds
    the ping of a worker Redis does not list."""

    def __init__(self, registry: Registry, namespace: str, router: str,
                 health: ControlPlaneHealth, ping_timeout_s: float = 2.0,
                 keep_interval_s: float = 1.0):
        super().__init__(registry, namespace, router)
        self.health = health
        self.ping_timeout_s = ping_timeout_s
        self.keep_interval_s = keep_interval_s
        self._known: dict[str, tuple[RayHandle, WorkerStats]] = {}  # last snapshot, by worker id
        self._unlisted: set[str] = set()  # workers kept without a record (logged once)
        self._keepers: list[Callable[[], bool]] = []
        self._kept_at = 0.0

    def keep(self, publish: Callable[[], bool]) -> None:
        """Run ``publish`` (blocking; True when it wrote) every ``keep_interval_s`` while
        Redis answers: it puts back what this process owns in Redis."""
        self._keepers.append(publish)

    async def snapshot(self) -> list[tuple[RayHandle, WorkerStats]]:
        listed = None
        if self.health.can_try():
            try:
                listed = await super().snapshot()
                await self._keep_published()
                self.health.ok()
            except REDIS_DOWN as exc:
                self.health.failed(exc)
        fresh = {handle.worker_id for handle, _ in listed or []}
        unlisted = [(handle, stats) for worker_id, (handle, stats) in self._known.items()
                    if worker_id not in fresh and handle.dead_at is None]
        alive = await asyncio.gather(*(self._answers(handle) for handle, _ in unlisted))
        kept = [entry for entry, ok in zip(unlisted, alive, strict=True) if ok]
        self._note_unlisted({handle.worker_id for handle, _ in kept})
        live = [*(listed or []), *kept]
        self._known = {handle.worker_id: (handle, stats) for handle, stats in live}
        return live

    async def _answers(self, handle: RayHandle) -> bool:
        """Whether the worker answers a ping with its engine loop running."""
        try:
            answer = await asyncio.wait_for(handle.actor.ping.remote(), self.ping_timeout_s)
        except Exception as exc:  # noqa: BLE001 - any failure: it is not known to live
            logger.info("worker %s has no registry record and no ping answer (%s): it leaves "
                        "routing", handle.worker_id, exc)
            return False
        return bool(answer.get("loop_alive", True))

    def _note_unlisted(self, kept: set[str]) -> None:
        for worker_id in kept - self._unlisted:
            logger.warning("worker %s has no registry record but answers pings: routing to it "
                           "with its last known stats until its record is back", worker_id)
        for worker_id in self._unlisted - kept:
            logger.info("worker %s listed in the registry again (or gone)", worker_id)
        self._unlisted = kept

    async def _keep_published(self) -> None:
        now = time.monotonic()
        if not self._keepers or now - self._kept_at < self.keep_interval_s:
            return
        self._kept_at = now
        for publish in self._keepers:
            if await asyncio.to_thread(publish):
                self.health.count_repairs(["router"])
