"""Pool state in Redis, so a restarted router (or controller) keeps it: targets, members, ids.

Keys, all under the cluster's prefix ``pdserve:<cluster>:`` (the registry's worker records sit
under ``pdserve:<cluster>:worker:`` beside them):

* ``pool:<role>:target`` -> int: the size the pool manager keeps the pool at;
* ``pool:<role>:seq`` -> int: the next worker id number; worker ids are ``<role>-<n>``, so
  every worker a cluster ever starts has a fresh id (``decode-0``, ``decode-1``, ...);
* ``pool:<role>:restarts`` -> int: dead workers replaced (a counter);
* ``members`` -> hash worker_id -> :class:`MemberRecord` JSON: the workers the pool manager
  started and has not removed, so a restarted manager adopts them by name;
* ``pids`` -> set of ``node_ip:pid`` of every worker started (stop checks they are gone);
* ``router`` -> hash with the router's bound ``port`` and ``metrics_port``: a router restarted
  by Ray binds the same ports (each further router ``router-<i>`` of ``--routers N`` has its
  own hash under its name).

Redis is a cache of the pool manager's truth, not the truth: the manager keeps every value in
memory and :meth:`PoolStore.republish` writes back whatever went missing or bad (Redis
restarted empty, FLUSHALL, garbage). Counters never go back: an id or restart count is issued
above the floor the manager knows (``next_worker_id(role, floor)``), so a counter lost with
Redis never re-issues the id of a live worker. Readers skip a value that does not parse, as if
it were missing, and count it through ``on_malformed(family, count)``.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable
from dataclasses import dataclass

import redis

from pdserve.cluster.registry import redis_client
from pdserve.worker_api import ROLES

# KEYS[1]: a counter; ARGV[1]: its floor. Sets it to max(value, floor) + 1 and returns
# {max(value, floor), 1 if the value was not a whole number >= 0 (it counts as 0) else 0}.
_BUMP_FLOORED = """
local raw = redis.pcall('GET', KEYS[1])
local value, malformed = 0, 0
if raw then
  local n = type(raw) == 'string' and tonumber(raw) or nil
  if n and n >= 0 and n == math.floor(n) then value = n else malformed = 1 end
end
local floor = tonumber(ARGV[1])
if value < floor then value = floor end
redis.call('SET', KEYS[1], string.format('%d', value + 1))
return {value, malformed}
"""

_WORKER_ID = re.compile(r"^(?P<role>[a-z]+)-(?P<number>\d+)$")


def _check_role(role: str) -> None:
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, got {role!r}")


def worker_number(worker_id: str) -> tuple[str, int] | None:
    """(role, n) of an id the pool manager issues (``decode-3`` -> ("decode", 3)), else None."""
    match = _WORKER_ID.match(worker_id)
    if match is None or match["role"] not in ROLES:
        return None
    return match["role"], int(match["number"])


def _whole(raw: bytes | None) -> int | None:
    """A stored whole number >= 0, or None (missing or malformed)."""
    if raw is None:
        return None
    try:
        value = int(raw.decode())
    except (UnicodeDecodeError, ValueError):
        return None
    return value if value >= 0 else None


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
        """The record; ValueError for text that is not one (bad JSON, kinds, role)."""
        try:
            values = json.loads(text)
            names = {f.name for f in dataclasses.fields(cls)}
            record = cls(**{k: v for k, v in values.items() if k in names})
        except (TypeError, ValueError, AttributeError, UnicodeDecodeError,
                RecursionError) as exc:  # (RecursionError: JSON nested past the parser's depth)
            raise ValueError(f"malformed member record: {type(exc).__name__}") from None
        kinds = [(record.worker_id, str), (record.role, str), (record.restarts, int),
                 (record.pid, int), (record.node_ip, str), (record.draining, bool),
                 (record.created_time, (int, float))]
        if not all(isinstance(v, k) for v, k in kinds) or record.role not in ROLES \
                or not record.worker_id:
            raise ValueError(f"malformed member record: {values!r}"[:200])
        return record


@dataclass
class PoolState:
    """What the pool manager knows, for :meth:`PoolStore.republish` to put back in Redis."""

    targets: dict[str, int]  # role -> target (Redis must hold exactly this)
    restarts: dict[str, int]  # role -> workers replaced (Redis keeps the larger)
    next_ids: dict[str, int]  # role -> the smallest id number never issued (likewise)
    members: list[MemberRecord]  # the workers it owns (Redis must hold exactly these)


class PoolStore:
    """The pool manager's state in Redis; see the module docstring."""

    def __init__(self, redis_url: str, cluster: str,
                 on_malformed: Callable[[str, int], None] | None = None):
        self.client = redis_client(redis_url)
        self.prefix = f"pdserve:{cluster}:"
        self.on_malformed = on_malformed
        self._bump_floored = self.client.register_script(_BUMP_FLOORED)

    def _pool_key(self, role: str, what: str) -> str:
        _check_role(role)
        return f"{self.prefix}pool:{role}:{what}"

    def _malformed(self, family: str, count: int = 1) -> None:
        if count and self.on_malformed is not None:
            self.on_malformed(family, count)

    # -- targets ------------------------------------------------------------------------------
    def set_target(self, role: str, size: int) -> None:
        if not isinstance(size, int) or size < 0:
            raise ValueError(f"size must be an integer >= 0, got {size!r}")
        self.client.set(self._pool_key(role, "target"), size)

    def targets(self) -> dict[str, int]:
        """role -> target, for the roles that have one (a malformed one counts as none)."""
        return self._per_role("target")

    def _per_role(self, what: str) -> dict[str, int]:
        values = self.client.mget([self._pool_key(r, what) for r in ROLES])
        out = {role: _whole(v) for role, v in zip(ROLES, values, strict=True) if v is not None}
        self._malformed(what, sum(v is None for v in out.values()))
        return {role: v for role, v in out.items() if v is not None}

    # -- ids and counters ---------------------------------------------------------------------
    def next_worker_id(self, role: str, floor: int = 0) -> str:
        """A fresh id ``<role>-<n>`` with n >= ``floor`` (the manager's floor outlives a
        counter Redis lost, so no live worker's id is issued again)."""
        return f"{role}-{self._bump(role, 'seq', floor)}"

    def count_restart(self, role: str, floor: int = 0) -> int:
        """Count one replaced worker; returns the new count (at least ``floor`` + 1)."""
        return self._bump(role, "restarts", floor) + 1

    def _bump(self, role: str, what: str, floor: int) -> int:
        value, malformed = self._bump_floored(keys=[self._pool_key(role, what)], args=[floor])
        self._malformed(what, int(malformed))
        return int(value)

    def restarts(self) -> dict[str, int]:
        return {role: 0 for role in ROLES} | self._per_role("restarts")

    # -- members ------------------------------------------------------------------------------
    def save_member(self, member: MemberRecord) -> None:
        self.client.hset(self.prefix + "members", member.worker_id, member.to_json())

    def remove_member(self, worker_id: str) -> None:
        self.client.hdel(self.prefix + "members", worker_id)

    def members(self) -> list[MemberRecord]:
        """The stored members in start order; malformed entries are skipped."""
        parsed, bad = self._members()
        self._malformed("members", len(bad))
        return sorted(parsed.values(), key=lambda m: m.created_time)

    def _members(self) -> tuple[dict[str, MemberRecord], list[bytes]]:
        """(worker_id -> record, fields that do not parse); a key of another type is
        deleted (nothing in it can be read) and counted."""
        key = self.prefix + "members"
        try:
            raw = self.client.hgetall(key)
        except redis.ResponseError:  # WRONGTYPE: garbage in place of the hash
            self.client.delete(key)
            self._malformed("members")
            return {}, []
        parsed, bad = {}, []
        for field, value in raw.items():
            try:
                record = MemberRecord.from_json(value)
            except ValueError:
                bad.append(field)
                continue
            if record.worker_id.encode() != field:
                bad.append(field)
                continue
            parsed[record.worker_id] = record
        return parsed, bad

    def add_pid(self, node_ip: str, pid: int) -> None:
        self.client.sadd(self.prefix + "pids", f"{node_ip}:{pid}")

    def pids(self) -> set[tuple[str, int]]:
        """(node_ip, pid) of every worker process started in this cluster."""
        parsed, bad = self._pids()
        self._malformed("pids", len(bad))
        return parsed

    def _pids(self) -> tuple[set[tuple[str, int]], list[bytes]]:
        key = self.prefix + "pids"
        try:
            raw = self.client.smembers(key)
        except redis.ResponseError:  # WRONGTYPE
            self.client.delete(key)
            self._malformed("pids")
            return set(), []
        out, bad = set(), []
        for entry in raw:
            node, _, pid = entry.decode(errors="replace").rpartition(":")
            number = _whole(pid.encode())
            if not node or not number:
                bad.append(entry)
                continue
            out.add((node, number))
        return out, bad

    # -- putting back what Redis lost ---------------------------------------------------------
    def republish(self, state: PoolState) -> list[str]:
        """Write back every value of ``state`` that Redis lacks or holds wrong, drop member
        and pid entries that do not parse; returns the families rewritten (one entry per
        value), empty when Redis already held it all."""
        return self._republish_counters(state) + self._republish_members(state.members)

    def _republish_counters(self, state: PoolState) -> list[str]:
        wanted = {}  # key -> (family, value, exact: else Redis may hold more)
        for what, values, exact in (("target", state.targets, True),
                                    ("restarts", state.restarts, False),
                                    ("seq", state.next_ids, False)):
            for role, value in values.items():
                wanted[self._pool_key(role, what)] = (what, value, exact)
        if not wanted:
            return []
        keys = list(wanted)
        writes, fixed = {}, []
        for key, raw in zip(keys, self.client.mget(keys), strict=True):
            what, value, exact = wanted[key]
            have = _whole(raw)
            if have is None or (have != value if exact else have < value):
                writes[key] = value
                fixed.append(what)
        if writes:
            self.client.mset(writes)
        return fixed

    def _republish_members(self, members: list[MemberRecord]) -> list[str]:
        stored, bad = self._members()
        wanted = {m.worker_id: m for m in members}
        writes = {wid: m.to_json() for wid, m in wanted.items() if stored.get(wid) != m}
        stale = [wid for wid in stored if wid not in wanted]
        pids, bad_pids = self._pids()
        new_pids = {f"{m.node_ip}:{m.pid}" for m in members
                    if m.pid and (m.node_ip, m.pid) not in pids}
        key = self.prefix + "members"
        with self.client.pipeline() as pipe:  # MULTI/EXEC
            if bad or stale:
                pipe.hdel(key, *bad, *stale)
            if writes:
                pipe.hset(key, mapping=writes)
            if bad_pids:
                pipe.srem(self.prefix + "pids", *bad_pids)
            if new_pids:
                pipe.sadd(self.prefix + "pids", *new_pids)
            pipe.execute()
        self._malformed("members", len(bad))
        self._malformed("pids", len(bad_pids))
        return ["members"] * (len(writes) + len(bad) + len(stale)) \
            + ["pids"] * (len(new_pids) + len(bad_pids))

    # -- the router ---------------------------------------------------------------------------
    def save_router(self, port: int, metrics_port: int | None, name: str = "router") -> None:
        mapping = {"port": port, "metrics_port": "" if metrics_port is None else metrics_port}
        self.client.hset(self.prefix + name, mapping=mapping)

    def router_ports(self, name: str = "router") -> tuple[int | None, int | None]:
        """(port, metrics_port) a previous router ``name`` bound, None where unknown (or
        stored malformed)."""
        try:
            raw = self.client.hgetall(self.prefix + name)
        except redis.ResponseError:  # WRONGTYPE
            self._malformed("router")
            return None, None
        port, metrics = (raw.get(f, b"") for f in (b"port", b"metrics_port"))
        out = (_whole(port) if port else None, _whole(metrics) if metrics else None)
        self._malformed("router", sum(bool(raw_value) and value is None
                                      for raw_value, value in zip((port, metrics), out,
                                                                  strict=True)))
        return out

    def ensure_router(self, port: int, metrics_port: int | None, name: str = "router") -> bool:
        """Save the router's ports unless Redis holds them already; True when it wrote."""
        if self.router_ports(name) == (port, metrics_port):
            return False
        mapping = {"port": port, "metrics_port": "" if metrics_port is None else metrics_port}
        with self.client.pipeline() as pipe:  # MULTI/EXEC; garbage of another type goes first
            pipe.delete(self.prefix + name)
            pipe.hset(self.prefix + name, mapping=mapping)
            pipe.execute()
        return True

    # -- teardown -----------------------------------------------------------------------------
    def clear(self) -> None:
        """Delete every key of this cluster (worker records included)."""
        keys = list(self.client.scan_iter(match=self.prefix + "*", count=500))
        if keys:
            self.client.delete(*keys)

    def close(self) -> None:
        self.client.close()
