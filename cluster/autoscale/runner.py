"""The autoscaler at work in the router actor: observe, :func:`decide`, set targets.

It runs as an asyncio task on the router actor's event loop, beside the pool manager it
drives (``pdserve.cluster.pools.manager``) and the router whose metrics it reads. Every tick
(``scale_interval_s`` or one second, whichever is shorter):

1. Observe (:meth:`AutoscaleRunner.snapshot`): each pool's target (the manager's), its members by
   state (the pool manager), each ready worker's load from its latest registry heartbeat
   (queued prompt tokens, running and waiting requests, KV usage, busy fraction), and from
   the router's sliding windows (``pdserve.router.metrics``) the prefill pool's TTFT part and
   the ITL P90, token rates, the arrival rate and mean lengths over ``window_s``.
2. Decide: :func:`~pdserve.cluster.autoscale.decision.decide`, a pure function of that snapshot, the
   controller state kept here, the config and ``time.monotonic()``.
3. Act: each step is logged in one line (``autoscale decode 1 -> 2 (up): itl 0.08 > 0.05,
   held 3.0 s``; INFO, shown whatever the actor's log level), counted in
   ``pdserve_autoscaler_decisions_total{role,direction,reason}`` and handed to the pool
   manager as the pool's new target; the manager starts a worker or drains one.

A restarted router actor starts with a fresh controller state: the targets, kept in Redis
for the next incarnation, stay.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from pdserve.cluster.autoscale.config import SCALED_ROLES, AutoscaleConfig
from pdserve.cluster.autoscale.decision import (
    ControllerState,
    Decision,
    MetricsSnapshot,
    PoolSnapshot,
    WorkerSignal,
    decide,
)
from pdserve.cluster.pools.manager import PoolManager
from pdserve.cluster.pools.plan import DRAINING, READY, STARTING
from pdserve.router.metrics import RouterMetrics

logger = logging.getLogger(__name__)
logger.setLevel(logging.INFO)  # every decision is one INFO line, even under --log-level WARNING


class AutoscaleRunner:
    """See the module docstring. Create, ``start`` and ``stop`` it inside one event loop."""

    def __init__(self, config: AutoscaleConfig, manager: PoolManager, metrics: RouterMetrics,
                 clock: Callable[[], float] = time.monotonic):
        self.config = config
        self.manager = manager
        self.metrics = metrics
        self.clock = clock
        self.state = ControllerState()
        self.last: Decision | None = None  # the latest tick's decision
        self._started = clock()
        self._task: asyncio.Task | None = None

    @property
    def tick_s(self) -> float:
        return min(1.0, self.config.scale_interval_s)

    async def start(self) -> None:
        logger.info("autoscaler on: prefill %d..%d, decode %d..%d, at most %d workers",
                    *self.config.bounds("prefill"), *self.config.bounds("decode"),
                    self.config.budget)
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.tick_s)
            try:
                await self.tick()
            except Exception:  # noqa: BLE001 - Redis may recover; keep the last targets
                logger.exception("autoscaler tick failed")

    async def tick(self) -> Decision:
        """One observe-decide-act round; returns the decision."""
        targets = dict(self.manager.targets)  # the manager's own (Redis holds a copy)
        now = self.clock()
        decision = decide(self.snapshot(targets, now), self.state, self.config, now)
        self.state, self.last = decision.state, decision
        for step in decision.steps:
            logger.info("%s", step.line())
            self.metrics.autoscaler_decisions.labels(step.role, step.direction,
                                                     step.reason).inc()
            await self.manager.set_target(step.role, step.to_size)
        return decision

    # -- observe ----------------------------------------------------------------------------
    def snapshot(self, targets: dict[str, int], now: float) -> MetricsSnapshot:
        """What :func:`decide` sees now (``targets``: role -> target, the manager's)."""
        window = self.config.window_s
        elapsed = max(1e-3, min(window, now - self._started))  # rates over what was seen
        m = self.metrics
        prefilled = m.prompt_window.count(window, now)
        streamed = m.itl_window.count(window, now)
        pools = {}
        for role in SCALED_ROLES:
            if role not in targets:
                continue
            latency = m.prefill_ttft_window if role == "prefill" else m.itl_window
            tokens = m.prompt_window.total(window, now) if role == "prefill" else streamed
            pools[role] = self._pool(role, targets[role], latency.quantile(0.9, window, now),
                                     int(latency.count(window, now)) if role == "prefill"
                                     else int(streamed), tokens / elapsed)
        return MetricsSnapshot(
            pools, arrival_rate=prefilled / elapsed,
            mean_prompt_tokens=m.prompt_window.total(window, now) / prefilled if prefilled else 0.0,
            mean_output_tokens=(streamed + prefilled) / prefilled if prefilled else 0.0)

    def _pool(self, role: str, target: int, p90: float | None, samples: int,
              tokens_per_s: float) -> PoolSnapshot:
        members = [m for m in self.manager.members.values() if m.role == role]
        max_num_seqs = self.manager.settings.template(role).config.max_num_seqs
        workers = []
        for member in members:
            record = self.manager.records.get(member.worker_id)
            if member.state != READY or record is None or record.draining:
                continue
            workers.append(WorkerSignal(
                member.worker_id, queued_tokens=record.queued_tokens,
                num_running=record.num_running, num_waiting=record.num_waiting,
                kv_usage=record.used_blocks / max(1, record.total_blocks),
                max_num_seqs=max_num_seqs, busy_fraction=record.busy_fraction))
        starting = sum(1 for m in members if m.state == STARTING
                       or (m.state == READY and m.worker_id not in self.manager.records))
        draining = sum(1 for m in members if m.state == DRAINING)
        return PoolSnapshot(role, target, tuple(workers), starting, draining, p90, samples,
                            tokens_per_s)
