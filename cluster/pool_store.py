"""Pool state in Redis, so a restarted router (or controller) keeps it: targets, members, ids.

Keys, all under the cluster's prefix ``pdserve:<cluster>:`` (the registry's worker records sit
under ``pdserve:<cluster>:worker:`` beside them):

* ``pool:<role>:target`` -> int: the size the pool manager keeps the pool at;
* ``pool:<role>:seq`` -> int: INCR counter; worker ids are ``<role>-<n>`` with n = seq - 1, so
  every worker a cluster ever starts has a fresh id (``decode-0``, ``decode-1``, ...);
* ``pool:<role>:restarts`` -> int: dead workers replaced (a counter);
* ``members`` -> hash worker_id -> :class:`MemberRecord` JSON: the workers the pool manager
  started and has not removed, so a restarted manager adopts them by name;
* ``pids`` -> set of ``node_ip:pid`` of every worker started (stop checks they are gone);
* ``router`` -> hash with the router's bound ``port`` and ``metrics_port``: a router restarted
  by Ray binds the same ports (each further router ``router-<i>`` of ``--routers N`` has its
  own hash under its name).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

import redis

from pdserve.cluster.actors import ROLES

# INCRBY that never goes below zero; returns the new value.
_ADD_FLOORED = """
local v = redis.call('INCRBY', KEYS[1], ARGV[1])
if v < 0 then redis.call('SET', KEYS[1], 0); v = 0 end
return v
"""


def _check_role(role: str) -> None:
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, got {role!r}")


@dataclass
class MemberRecord:
    """One worker the pool manager owns, as stored in Redis."""

    worker_id: str  # the Ray actor name and the registry key
    role: str  # "prefill" | "decode" | "colocated"
    restarts: int = 0  # how many dead workers this one's pool slot replaced before it
    draining: bool = False  # drain requested: finish its streams, then remove it
    created_time: float = 0.0  # time.time() when the manager started it
    pid: int = 0  # OS process id once known (0 before its first answer)
    node_ip: str = ""  # the node it runs on once known

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> MemberRecord:
        values = json.loads(text)
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in values.items() if k in names})


class PoolStore:
    """The pool manager's persistent state; see the module docstring."""

    def __init__(self, redis_url: str, cluster: str):
        self.client = redis.Redis.from_url(redis_url, socket_timeout=5)
        self.prefix = f"pdserve:{cluster}:"
        self._add_floored = self.client.register_script(_ADD_FLOORED)

    def _pool_key(self, role: str, what: str) -> str:
        _check_role(role)
        return f"{self.prefix}pool:{role}:{what}"

    # -- targets ------------------------------------------------------------------------------
    def set_target(self, role: str, size: int) -> None:
        if not isinstance(size, int) or size < 0:
            raise ValueError(f"size must be an integer >= 0, got {size!r}")
        self.client.set(self._pool_key(role, "target"), size)

    def add_target(self, role: str, delta: int) -> int:
        """Change a target by ``delta`` (never below 0); returns the new target."""
        return int(self._add_floored(keys=[self._pool_key(role, "target")], args=[delta]))

    def targets(self) -> dict[str, int]:
        """role -> target, for the roles that have one."""
        values = self.client.mget([self._pool_key(r, "target") for r in ROLES])
        return {role: int(v) for role, v in zip(ROLES, values, strict=True) if v is not None}

    # -- ids and counters ---------------------------------------------------------------------
    def next_worker_id(self, role: str) -> str:
        return f"{role}-{int(self.client.incr(self._pool_key(role, 'seq'))) - 1}"

    def count_restart(self, role: str) -> int:
        return int(self.client.incr(self._pool_key(role, "restarts")))

    def restarts(self) -> dict[str, int]:
        values = self.client.mget([self._pool_key(r, "restarts") for r in ROLES])
        return {role: int(v or 0) for role, v in zip(ROLES, values, strict=True)}

    # -- members ------------------------------------------------------------------------------
    def save_member(self, member: MemberRecord) -> None:
        self.client.hset(self.prefix + "members", member.worker_id, member.to_json())

    def remove_member(self, worker_id: str) -> None:
        self.client.hdel(self.prefix + "members", worker_id)

    def members(self) -> list[MemberRecord]:
        raw = self.client.hgetall(self.prefix + "members")
        return sorted((MemberRecord.from_json(v) for v in raw.values()),
                      key=lambda m: m.created_time)

    def add_pid(self, node_ip: str, pid: int) -> None:
        self.client.sadd(self.prefix + "pids", f"{node_ip}:{pid}")

    def pids(self) -> set[tuple[str, int]]:
        """(node_ip, pid) of every worker process started in this cluster."""
        out = set()
        for raw in self.client.smembers(self.prefix + "pids"):
            node, _, pid = raw.decode().rpartition(":")
            out.add((node, int(pid)))
        return out

    # -- the router ---------------------------------------------------------------------------
    def save_router(self, port: int, metrics_port: int | None, name: str = "router") -> None:
        mapping = {"port": port, "metrics_port": "" if metrics_port is None else metrics_port}
        self.client.hset(self.prefix + name, mapping=mapping)

    def router_ports(self, name: str = "router") -> tuple[int | None, int | None]:
        """(port, metrics_port) a previous router ``name`` bound, None where unknown."""
        raw = {k.decode(): v.decode() for k, v in
               self.client.hgetall(self.prefix + name).items()}
        port, metrics = raw.get("port"), raw.get("metrics_port")
        return (int(port) if port else None, int(metrics) if metrics else None)

    # -- teardown -----------------------------------------------------------------------------
    def clear(self) -> None:
        """Delete every key of this cluster (worker records included)."""
        keys = list(self.client.scan_iter(match=self.prefix + "*", count=500))
        if keys:
            self.client.delete(*keys)

    def close(self) -> None:
        self.client.close()
