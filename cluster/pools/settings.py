"""How the pool manager (``cluster.pools``) starts and watches workers: its settings,
validated on construction (ValueError naming the field)."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.cluster.actors import WorkerSpec
from pdserve.cluster.pools.plan import MAX_WORKERS_PER_POOL


@dataclass(frozen=True)
class PoolSettings:
    """How the pool manager starts and watches workers."""

    templates: tuple[WorkerSpec, ...]  # one per role it may start (worker_id is replaced)
    detached: bool = True  # worker actors outlive the router actor, so a restart adopts them
    interval_s: float = 0.5  # reconcile period
    ping_timeout_s: float = 5.0  # one ping, at most
    max_missed_pings: int = 3  # pings in a row timing out that make a worker dead
    start_timeout_s: float = 600.0  # actor creation + model load, at most
    drain_grace_s: float = 1.0  # a drained worker must be idle in a heartbeat this much later
    drain_timeout_s: float = 600.0  # a drain lasting longer finishes anyway
    close_timeout_s: float = 30.0  # a finished worker's close(), at most, before the kill
    backoff_s: float = 1.0  # starts held after a failed start, doubled per consecutive failure
    max_backoff_s: float = 60.0  # the longest hold
    dead_keep_s: float = 60.0  # a removed dead worker stays listed this long
    max_workers_per_pool: int = MAX_WORKERS_PER_POOL  # no target above this, whoever sets it

    def __post_init__(self) -> None:
        roles = [t.role for t in self.templates]
        if len(set(roles)) != len(roles):
            raise ValueError(f"templates must have one spec per role, got roles {roles}")
        for name in ("interval_s", "ping_timeout_s", "start_timeout_s", "backoff_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.max_missed_pings < 1:
            raise ValueError(f"max_missed_pings must be >= 1, got {self.max_missed_pings}")
        if self.max_workers_per_pool < 1:
            raise ValueError(f"max_workers_per_pool must be >= 1, got "
                             f"{self.max_workers_per_pool}")

    def check_pool_size(self, size: int) -> None:
        """ValueError naming ``size`` unless 0 <= size <= max_workers_per_pool."""
        if not 0 <= size <= self.max_workers_per_pool:
            raise ValueError(f"size must be in [0, {self.max_workers_per_pool}] (the server's "
                             f"--max-workers-per-pool), got {size}")

    def template(self, role: str) -> WorkerSpec:
        for spec in self.templates:
            if spec.role == role:
                return spec
        raise ValueError(f"role must be one of {[t.role for t in self.templates]}, "
                         f"got {role!r}")
