"""Worker pools kept at their target size: the pool manager (the decision is ``pools.plan``, its
settings ``pools.settings``).

One pool per role (prefill, decode, colocated). Its target lives in Redis
(:class:`~pdserve.cluster.pools.store.PoolStore`); the autoscaler and operators only change
targets, the :class:`PoolManager` makes them true. The manager runs as an asyncio task in the
router actor's process and is the only code that creates worker actors.

Every ``interval_s`` the manager reconciles:

1. Observe: targets and members from Redis, worker records from the registry; a starting
   worker's ``ready()`` answer (or failure); every other member's ``ping()`` (answered on the
   worker's event loop, never behind an engine step). A member is **dead** when its actor is
   gone (``RayActorError``), ``max_missed_pings`` pings in a row time out, its engine loop
   died or is stuck in a step past its step bound (``loop_alive`` false), or it did not start
   within ``start_timeout_s``.
2. Decide: :func:`~pdserve.cluster.pools.plan.plan` turns (target, members) into actions,
   a pure function.
3. Act: ``start`` (a new actor under a fresh id ``<role>-<n>``, detached so it outlives this
   process, asking Ray for its CPUs, GPU and pool resource: ``pdserve.cluster.node_placement``),
   ``replace`` (kill the dead one, count a restart, start another), ``remove`` (a dead
   worker whose slot is not refilled), ``drain`` (mark it draining in the registry, under
   the cluster's key: the routers stop routing to it), ``finish`` (a draining worker that
   reported no request in a heartbeat taken ``drain_grace_s`` after the drain began, or
   ``drain_timeout_s`` passed: close and kill it).

A restarted manager (the router actor restarted by Ray) re-reads targets and members and
adopts every member whose named actor still lives, and every live worker actor of the cluster
Redis no longer lists; a member whose actor is gone is dead and replaced. An adopted worker's
start clock starts at adoption: however old it is, it has ``start_timeout_s`` from then to
answer ``ready()``. A failed start holds further starts of that role for a backoff that
doubles per consecutive failure, so a bad setting does not spin.

Redis is a cache of the manager's truth (``pdserve.cluster.control_plane``): targets, members,
restart counts and the next id number live in this process, and every reconcile that reaches
Redis puts back what it lacks or holds malformed (``PoolStore.republish``) and writes which
workers drain into their records, signed: the drain is this manager's decision and Redis only
mirrors it, so a ``draining`` flag written there by anyone else is overwritten (and read as
not draining until then, ``pdserve.cluster.registry``). A target nobody knows is never read
as zero: a role without one keeps its pool as it is (``pools.plan``), and a restarted manager
that finds workers but no target takes their number as the target. While Redis is
unreachable the manager keeps watching its members but changes nothing (a start needs a fresh
id and a registry); its writes that fail then are put back by the first repair after.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import ray
from ray.exceptions import ActorUnavailableError, RayActorError, RayError

from pdserve.cluster.actors import start_worker_actor
from pdserve.cluster.control_plane import REDIS_DOWN, ControlPlaneHealth
from pdserve.cluster.pools.plan import (
    DEAD,
    DRAIN,
    DRAINING,
    FINISH,
    READY,
    REMOVE,
    REPLACE,
    START,
    STARTING,
    Action,
    MemberView,
    plan,
)
from pdserve.cluster.pools.settings import PoolSettings
from pdserve.cluster.pools.store import MemberRecord, PoolState, PoolStore, worker_number
from pdserve.cluster.registry import Registry, WorkerRecord

logger = logging.getLogger(__name__)


class WorkerStartError(RayError):
    """A worker actor failed to start; the message ends with the worker's own error line."""


@dataclass
class Member:
    """One worker the manager owns, as it is watched in this process."""

    record: MemberRecord  # what Redis keeps of it
    actor: object | None  # its Ray actor handle (None: no live actor found)
    state: str = STARTING
    ready: asyncio.Task | None = None  # the pending ready() call while STARTING
    missed_pings: int = 0  # ping timeouts in a row
    drain_started: float | None = None  # time.time() the drain began
    error: str = ""  # why it died, or its engine loop's error
    died_at: float | None = None  # time.time() it was found dead
    was_draining: bool = False  # it died while draining
    start_clock: float = dataclasses.field(default_factory=time.time)  # time.time() its
    # start_timeout_s counts from: when this manager started it, or adopted it

    @property
    def worker_id(self) -> str:
        return self.record.worker_id

    @property
    def role(self) -> str:
        return self.record.role


def death_reason(exc: BaseException, limit: int | None = 200) -> str:
    """One line saying why a worker call failed: the last line of the error (a worker's own
    exception when its constructor raised), cut to its first sentence when over ``limit``."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    line = lines[-1] if lines else type(exc).__name__
    if limit is not None and len(line) > limit:
        first = line.find(". ")
        line = line[:first + 1] if 0 < first < limit else line[:limit] + "..."
    return line


class PoolManager:
    """See the module docstring. Create, ``start`` and ``stop`` it inside one event loop."""

    def __init__(self, store: PoolStore, registry: Registry, settings: PoolSettings,
                 namespace: str, on_restart: Callable[[str], None] | None = None,
                 on_reconcile: Callable[[PoolManager], None] | None = None,
                 health: ControlPlaneHealth | None = None):
        self.store = store
        self.registry = registry
        self.settings = settings
        self.namespace = namespace  # the cluster's Ray namespace (worker actor names)
        self._on_restart = on_restart  # called with the role of every replaced worker
        self._on_reconcile = on_reconcile  # called with the manager after every reconcile
        self.health = health or ControlPlaneHealth()  # whether Redis answers
        self.targets: dict[str, int] = {}  # role -> target: the truth (Redis holds a copy)
        self.restart_counts: dict[str, int] = {}  # role -> dead workers replaced so far
        self.next_ids: dict[str, int] = {}  # role -> the smallest id number never issued
        self.members: dict[str, Member] = {}
        self.dead: list[Member] = []  # removed dead workers, kept for dead_keep_s
        self.records: dict[str, WorkerRecord] = {}  # registry view of the latest reconcile
        self.last_error: dict[str, str] = {}  # role -> why its latest failed start failed
        self._failures: dict[str, int] = {}  # role -> failed starts in a row
        self._hold_until: dict[str, float] = {}  # role -> time.monotonic() starts resume
        self._lock = asyncio.Lock()
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None

    # -- lifecycle ----------------------------------------------------------------------------
    async def start(self) -> None:
        await self._adopt()
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        """Stop watching (the workers keep running; the launcher removes them)."""
        tasks = [t for t in [self._task, *(m.ready for m in self.members.values())] if t]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._task = None

    def wake(self) -> None:
        """Reconcile now instead of at the next period."""
        self._wake.set()

    async def _adopt(self) -> None:
        """Take over what a previous manager left: Redis's members and every live worker
        actor of the cluster (named ``<role>-<n>`` in its namespace), targets, counters."""
        records = {r.worker_id: r for r in await asyncio.to_thread(self.store.members)}
        named = await asyncio.to_thread(self._named_workers)
        for worker_id in sorted(set(named) - set(records)):
            logger.warning("adopting %s: a live worker Redis did not list", worker_id)
            records[worker_id] = MemberRecord(worker_id, named[worker_id],
                                              created_time=time.time())
        for record in sorted(records.values(), key=lambda r: r.created_time):
            actor = await asyncio.to_thread(self._lookup, record.worker_id)
            member = Member(record, actor)  # its start clock starts now
            self.members[record.worker_id] = member
            if actor is None:
                self._mark_dead(member, "no live actor (found by a restarted pool manager)")
            else:
                member.ready = asyncio.ensure_future(self._ready(actor))
                logger.info("adopting %s", record.worker_id)
        for worker_id in [*records, *named]:
            role, number = worker_number(worker_id) or (None, -1)
            if role is not None:
                self.next_ids[role] = max(self.next_ids.get(role, 0), number + 1)
        self.targets = await asyncio.to_thread(self.store.targets)
        self.restart_counts = await asyncio.to_thread(self.store.restarts)
        self._infer_missing_targets()

    def _infer_missing_targets(self) -> None:
        """A role with live members but no target keeps its size (never a target of 0)."""
        for role in sorted({m.role for m in self.members.values()} - set(self.targets)):
            size = sum(1 for m in self.members.values()
                       if m.role == role and m.state != DEAD and not m.record.draining)
            if size:
                logger.warning("no %s target in Redis: keeping the pool's %d live workers as "
                               "its target", role, size)
                self.targets[role] = size

    def _named_workers(self) -> dict[str, str]:
        """worker_id -> role of every live worker actor in the cluster's namespace."""
        found = {}
        for entry in ray.util.list_named_actors(all_namespaces=True):
            parsed = worker_number(entry["name"]) if entry["namespace"] == self.namespace \
                else None
            if parsed is not None:
                found[entry["name"]] = parsed[0]
        return found

    def _lookup(self, worker_id: str):
        try:
            return ray.get_actor(worker_id, namespace=self.namespace)
        except ValueError:
            return None

    async def _run(self) -> None:
        while True:
            try:
                await self.reconcile()
            except Exception:  # noqa: BLE001 - Redis or Ray may recover; keep watching
                logger.exception("pool reconcile failed")
            try:
                await asyncio.wait_for(self._wake.wait(), self.settings.interval_s)
            except TimeoutError:
                pass
            self._wake.clear()

    # -- one reconcile --------------------------------------------------------------------
    async def reconcile(self) -> None:
        reached = await self._read_shared()
        await self._observe()
        async with self._lock:
            if reached:  # while Redis is away, watch but change nothing
                try:
                    await self._republish()
                    await self._act()
                except REDIS_DOWN as exc:
                    self.health.failed(exc)
        cutoff = time.time() - self.settings.dead_keep_s
        self.dead = [m for m in self.dead if (m.died_at or 0.0) > cutoff]
        if self._on_reconcile is not None:
            self._on_reconcile(self)

    async def _read_shared(self) -> bool:
        """Registry records (and any target this process does not know) from Redis; False,
        keeping the last ones, while Redis is unreachable (or its backoff runs)."""
        if not self.health.can_try():
            return False
        try:
            stored = await asyncio.to_thread(self.store.targets)
            records = await asyncio.to_thread(self.registry.workers)
        except REDIS_DOWN as exc:
            self.health.failed(exc)
            return False
        self.health.ok()
        for role, size in stored.items():
            self.targets.setdefault(role, size)  # this process's own value wins
        self.records = {r.worker_id: r for r in records}
        return True

    async def _republish(self) -> None:
        """Put back in Redis what it lost or holds malformed: targets, counters, members,
        pids, and every live member's drain mark (:meth:`_remark_drains`)."""
        restarts = {role: n for role, n in self.restart_counts.items() if n}  # none: 0
        state = PoolState(dict(self.targets), restarts, dict(self.next_ids),
                          [m.record for m in self.members.values()])
        fixed = await asyncio.to_thread(self.store.republish, state)
        fixed += await self._remark_drains()
        self.health.count_repairs(fixed)

    async def _remark_drains(self) -> list[str]:
        """Write this manager's truth into every live member's record whose drain mark says
        otherwise or has no tag that verifies (the registry reads such a mark as not
        draining): a forged or stale ``draining=1`` is cleared, a drain's mark put back.
        Returns "drain" per mark written."""
        fixed = []
        for member in self.members.values():
            record = self.records.get(member.worker_id)
            draining = member.state == DRAINING or member.record.draining
            if member.state == DEAD or record is None or \
                    (record.draining == draining and record.draining_tag):
                continue
            if await asyncio.to_thread(self.registry.set_draining, member.worker_id, draining):
                record.draining = draining
                fixed.append("drain")
        return fixed

    async def _act(self) -> None:
        """Plan each pool and perform the actions (under the lock)."""
        now = time.monotonic()
        startable = {t.role for t in self.settings.templates}
        roles = (set(self.targets) | {m.role for m in self.members.values()}) & startable
        for role in sorted(roles):
            views = [self._view(m) for m in self.members.values() if m.role == role]
            can_start = now >= self._hold_until.get(role, 0.0)
            for action in plan(role, self.targets.get(role), views, can_start):
                await self._apply(action)

    async def _write(self, fn: Callable, *args) -> bool:
        """A write to Redis that may fail while Redis is away (the next repair puts it
        back); False when it did."""
        try:
            await asyncio.to_thread(fn, *args)
        except REDIS_DOWN as exc:
            self.health.failed(exc)
            return False
        return True

    async def _observe(self) -> None:
        members = list(self.members.values())
        await asyncio.gather(*(self._observe_one(m) for m in members))

    async def _observe_one(self, member: Member) -> None:
        if member.state == STARTING:
            await self._check_start(member)
        elif member.state in (READY, DRAINING):
            await self._check_ping(member)

    async def _check_start(self, member: Member) -> None:
        task = member.ready
        if task is None or not task.done():
            age = time.time() - member.start_clock
            if age > self.settings.start_timeout_s:
                self._start_failed(member, f"did not start within "
                                           f"{self.settings.start_timeout_s:.0f} s")
            return
        try:
            answer = task.result()
        except Exception as exc:  # noqa: BLE001 - any failure to start is the worker's death
            self._start_failed(member, death_reason(exc, limit=None))  # the worker's own words
            return
        member.ready = None
        member.state = DRAINING if member.record.draining else READY
        if member.record.draining and member.drain_started is None:
            member.drain_started = time.time()
        self._failures.pop(member.role, None)
        self.last_error.pop(member.role, None)
        await self._learn_where(member, answer)
        logger.info("worker %s ready (pid %s)", member.worker_id, member.record.pid)

    async def _learn_where(self, member: Member, answer: dict) -> None:
        pid, node = int(answer.get("pid", 0)), str(answer.get("node_ip", ""))
        if (pid, node) != (member.record.pid, member.record.node_ip):
            member.record.pid, member.record.node_ip = pid, node
            await self._write(self.store.save_member, member.record)
            await self._write(self.store.add_pid, node, pid)

    async def _check_ping(self, member: Member) -> None:
        try:
            answer = await asyncio.wait_for(member.actor.ping.remote(),
                                            self.settings.ping_timeout_s)
        except (TimeoutError, ActorUnavailableError) as exc:
            member.missed_pings += 1
            if member.missed_pings >= self.settings.max_missed_pings:
                self._mark_dead(member, f"{member.missed_pings} pings unanswered ({exc!r})")
            return
        except RayActorError as exc:
            self._mark_dead(member, f"actor died: {death_reason(exc)}")
            return
        except Exception as exc:  # noqa: BLE001 - a ping that raises is this worker's fault;
            # raised on, it would stop the reconcile of every other worker
            self._mark_dead(member, f"ping failed: {death_reason(exc)}")
            return
        member.missed_pings = 0
        if not answer.get("loop_alive", True):
            self._mark_dead(member, f"engine loop failed: {answer.get('error')}")
            return
        await self._learn_where(member, answer)

    def _start_failed(self, member: Member, why: str) -> None:
        role = member.role
        failures = self._failures[role] = self._failures.get(role, 0) + 1
        hold = min(self.settings.max_backoff_s, self.settings.backoff_s * 2 ** (failures - 1))
        self._hold_until[role] = time.monotonic() + hold
        self.last_error[role] = f"{member.worker_id}: {why}"
        logger.warning("worker %s failed to start (%s); %s starts held %.0f s",
                       member.worker_id, why, role, hold)
        self._mark_dead(member, why)

    def _mark_dead(self, member: Member, why: str) -> None:
        if member.state != DEAD:
            logger.warning("worker %s is dead: %s", member.worker_id, why)
        member.was_draining = member.was_draining or member.state == DRAINING \
            or member.record.draining
        member.state, member.error, member.died_at = DEAD, why, time.time()

    def _view(self, member: Member) -> MemberView:
        record = self.records.get(member.worker_id)
        load = record.num_running + record.num_waiting if record is not None else 0
        return MemberView(member.worker_id, member.state, load, self._drained(member),
                          member.was_draining, member.record.restarts)

    def _drained(self, member: Member) -> bool:
        if member.state != DRAINING or member.drain_started is None:
            return False
        if time.time() - member.drain_started > self.settings.drain_timeout_s:
            return True
        record = self.records.get(member.worker_id)
        return (record is not None and record.num_running == 0 and record.num_waiting == 0
                and record.heartbeat_time >= member.drain_started + self.settings.drain_grace_s)

    # -- actions ----------------------------------------------------------------------------
    async def _apply(self, action: Action) -> None:
        member = self.members.get(action.worker_id) if action.worker_id else None
        if action.kind == START:
            await self._start(action.role, action.restarts)
        elif action.kind == REPLACE:
            await self._remove(member)
            role = action.role
            self.restart_counts[role] = await asyncio.to_thread(
                self.store.count_restart, role, self.restart_counts.get(role, 0))
            if self._on_restart is not None:
                self._on_restart(action.role)
            new_id = await self._start(action.role, action.restarts)
            logger.warning("replaced dead worker %s (%s) with %s", member.worker_id,
                           member.error, new_id)
        elif action.kind == REMOVE:
            await self._remove(member)
        elif action.kind == DRAIN:
            await self._begin_drain(member)
        elif action.kind == FINISH:
            await self._finish(member)

    async def _start(self, role: str, restarts: int) -> str:
        worker_id = await asyncio.to_thread(self.store.next_worker_id, role,
                                            self.next_ids.get(role, 0))
        self.next_ids[role] = worker_number(worker_id)[1] + 1
        spec = dataclasses.replace(self.settings.template(role), worker_id=worker_id)
        record = MemberRecord(worker_id, role, restarts, created_time=time.time())
        await self._write(self.store.save_member, record)  # before the actor: adoptable
        cluster = await asyncio.to_thread(ray.cluster_resources)  # nodes may have joined
        actor = start_worker_actor(spec, self.settings.detached, cluster)
        member = Member(record, actor)
        member.ready = asyncio.ensure_future(self._ready(actor))
        self.members[worker_id] = member
        logger.info("starting worker %s", worker_id)
        return worker_id

    @staticmethod
    async def _ready(actor) -> dict:
        return await actor.ready.remote()

    async def _remove(self, member: Member) -> None:
        """Forget a dead member: kill what is left of it, drop its records."""
        if member.ready is not None:
            member.ready.cancel()
        await self._kill(member)
        self.members.pop(member.worker_id, None)
        self.dead.append(member)
        await self._write(self.registry.remove, member.worker_id)
        await self._write(self.store.remove_member, member.worker_id)

    async def _kill(self, member: Member) -> None:
        if member.actor is None:
            return
        try:
            await asyncio.to_thread(ray.kill, member.actor, no_restart=True)
        except Exception as exc:  # noqa: BLE001 - already gone
            logger.debug("kill %s: %s", member.worker_id, exc)

    async def _begin_drain(self, member: Member) -> None:
        starting = member.state == STARTING
        member.state, member.drain_started = DRAINING, time.time()
        if starting:  # no request can be on it yet: stop it now
            await self._finish(member)
            return
        member.record.draining = True
        await self._write(self.store.save_member, member.record)
        await self._write(self.registry.set_draining, member.worker_id, True)
        logger.info("draining worker %s", member.worker_id)

    async def _finish(self, member: Member) -> None:
        """A drained member: close it (it leaves the registry), kill the actor, forget it."""
        if member.ready is not None:
            member.ready.cancel()
        if member.actor is not None:
            try:
                await asyncio.wait_for(member.actor.close.remote(),
                                       self.settings.close_timeout_s)
            except Exception as exc:  # noqa: BLE001 - it is killed anyway
                logger.warning("closing %s failed: %s", member.worker_id, exc)
        await self._kill(member)
        self.members.pop(member.worker_id, None)
        await self._write(self.registry.remove, member.worker_id)
        await self._write(self.store.remove_member, member.worker_id)
        logger.info("worker %s drained and stopped", member.worker_id)

    def counts(self) -> dict[tuple[str, str], int]:
        """(role, state) -> members in that state (the dead ones removed lately included)."""
        out: dict[tuple[str, str], int] = {}
        for member in [*self.members.values(), *self.dead]:
            key = (member.role, member.state)
            out[key] = out.get(key, 0) + 1
        return out

    # -- operator actions (the Admin service) ---------------------------------------------
    async def drain(self, worker_id: str) -> Member:
        """Drain one worker and lower its pool's target by one (idempotent)."""
        async with self._lock:
            member = self.members.get(worker_id)
            if member is None:
                raise KeyError(worker_id)
            if member.state in (DRAINING, DEAD):
                return member
            role = member.role
            self.targets[role] = max(0, self.targets.get(role, self._pool_size(role)) - 1)
            await self._write(self.store.set_target, role, self.targets[role])
            await self._begin_drain(member)
        self.wake()
        return member

    async def set_target(self, role: str, size: int) -> None:
        """Set ``role``'s target (Admin's SetPoolTarget and the autoscaler); ValueError for a
        role this cluster cannot start or a size outside [0, max_workers_per_pool]."""
        self.settings.template(role)
        self.settings.check_pool_size(size)
        async with self._lock:
            self.targets[role] = size
            await self._write(self.store.set_target, role, size)
        self.wake()

    def _pool_size(self, role: str) -> int:
        """Starting and ready members of ``role`` (what counts against a target)."""
        return sum(1 for m in self.members.values()
                   if m.role == role and m.state in (STARTING, READY))
