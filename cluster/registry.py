"""Shared cluster state in Redis: one hash per worker, refreshed by heartbeats, expiring by TTL.

Keys: ``pdserve:<cluster>:worker:<worker_id>`` -> hash of :class:`WorkerRecord` fields, with a
TTL of ``ttl_s``; a worker that stops heartbeating disappears from :meth:`Registry.workers`.
``draining`` belongs to whoever marks it (:meth:`Registry.set_draining`: an operator, the
autoscaler, the worker itself): heartbeats create it as 0 but never overwrite it.

Records cannot be half-written: a heartbeat writes its fields and the TTL in one Lua script
(replacing a key of another type, resetting a ``draining`` that is not 0 or 1), and
``set_draining`` writes only into a record that exists, so an expired record is never
recreated without a TTL. Readers skip a record that does not parse (counted through
``on_malformed``, family ``"worker"``) and give one without a TTL the record TTL, so garbage
leaves by itself while a live worker's next heartbeat rewrites its own record.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import redis

from pdserve.engine.protocol import WorkerStats

logger = logging.getLogger(__name__)


@dataclass
class WorkerRecord:
    """What the router needs to know about one worker."""

    worker_id: str  # unique name, also the Ray actor name
    role: str  # "prefill" | "decode" | "colocated"
    transfer_address: str = ""  # host:port of the KV transfer endpoint (decode side), or ""
    total_blocks: int = 0  # KV pool size
    free_blocks: int = 0  # allocatable now (free + evictable cached)
    num_running: int = 0  # requests in the running batch
    num_waiting: int = 0  # requests queued (prefill queue or waiting for KV)
    queued_tokens: int = 0  # prompt tokens not yet computed
    draining: bool = False  # takes no new requests
    heartbeat_time: float = 0.0  # wall clock of the last heartbeat
    used_blocks: int = 0  # owned by requests or reservations
    cached_blocks: int = 0  # evictable prefix-cache blocks
    num_preemptions: int = 0  # preemptions since start (a counter)
    prefix_hit_tokens: int = 0  # prompt tokens served by the prefix cache (a counter)
    prefix_query_tokens: int = 0  # prompt tokens looked up in the prefix cache (a counter)
    ledger_json: str = "{}"  # MemoryLedger.to_dict() as JSON
    pid: int = 0  # the worker's process id (on its node)
    error: str = ""  # why the worker's engine loop died ("" while it runs): it takes no work
    num_bounces: int = 0  # preemptions that handed a request back to the router (a counter)
    flops_per_s: float = 0.0  # achieved model FLOPs per forward second (recent steps)
    bytes_per_s: float = 0.0  # achieved weight + KV bytes per forward second (recent steps)
    peak_flops_per_s: float = 0.0  # dense matmul rate measured on the worker's device
    peak_bytes_per_s: float = 0.0  # copy bandwidth measured on the worker's device
    busy_fraction: float = 0.0  # forward seconds / wall seconds (recent steps)
    spec_num_drafts: int = 0  # speculative decoding: sequence-steps that verified drafts
    spec_num_draft_tokens: int = 0  # drafts proposed and verified (a counter)
    spec_num_accepted_tokens: int = 0  # drafts the target accepted (a counter)
    kv_log_id: str = ""  # the worker's KV event log (a new one: its cache started afresh)
    kv_events_number: int = 0  # its last batch published
    taken_at: float = 0.0  # wall clock: every call the worker received before it is counted

    @classmethod
    def from_stats(cls, stats: WorkerStats, pid: int = 0) -> WorkerRecord:
        return cls(stats.worker_id, stats.role, stats.transfer_address, stats.total_blocks,
                   stats.free_blocks, stats.num_running, stats.num_waiting,
                   stats.queued_tokens, stats.draining, 0.0, stats.used_blocks,
                   stats.cached_blocks, stats.num_preemptions, stats.prefix_hit_tokens,
                   stats.prefix_query_tokens, json.dumps(stats.ledger, sort_keys=True), pid,
                   stats.error or "", stats.num_bounces, stats.flops_per_s, stats.bytes_per_s,
                   stats.peak_flops_per_s, stats.peak_bytes_per_s, stats.busy_fraction,
                   stats.spec_num_drafts, stats.spec_num_draft_tokens,
                   stats.spec_num_accepted_tokens, stats.kv_log_id, stats.kv_events_number,
                   stats.taken_at)

    def to_stats(self) -> WorkerStats:
        return WorkerStats(self.worker_id, self.role, self.total_blocks, self.free_blocks,
                           self.used_blocks, self.cached_blocks, self.num_running,
                           self.num_waiting, self.queued_tokens, self.num_preemptions,
                           self.prefix_hit_tokens, self.prefix_query_tokens,
                           json.loads(self.ledger_json or "{}"), self.transfer_address,
                           self.draining, self.error or None, self.num_bounces,
                           flops_per_s=self.flops_per_s, bytes_per_s=self.bytes_per_s,
                           peak_flops_per_s=self.peak_flops_per_s,
                           peak_bytes_per_s=self.peak_bytes_per_s,
                           busy_fraction=self.busy_fraction,
                           spec_num_drafts=self.spec_num_drafts,
                           spec_num_draft_tokens=self.spec_num_draft_tokens,
                           spec_num_accepted_tokens=self.spec_num_accepted_tokens,
                           kv_log_id=self.kv_log_id, kv_events_number=self.kv_events_number,
                           taken_at=self.taken_at)

    def to_hash(self) -> dict[str, str]:
        return {f.name: str(int(v) if isinstance(v, bool) else v)
                for f in dataclasses.fields(self) for v in [getattr(self, f.name)]}

    @classmethod
    def from_hash(cls, raw: dict[bytes, bytes]) -> WorkerRecord:
        """The record a hash holds; ValueError for one that does not parse (a field of the
        wrong kind, no worker_id or role, a ledger that is not a JSON object)."""
        try:
            values = {k.decode(): v.decode() for k, v in raw.items()}
            kwargs = {}
            for f in dataclasses.fields(cls):
                if f.name not in values:
                    continue
                text = values[f.name]
                kind = {"int": int, "float": float, "bool": _flag}.get(f.type, str)
                kwargs[f.name] = kind(text)
            record = cls(**kwargs)
            ledger = json.loads(record.ledger_json or "{}")
        except (TypeError, ValueError, UnicodeDecodeError) as exc:
            raise ValueError(f"malformed worker record: {exc}") from None
        if not record.worker_id or not record.role or not isinstance(ledger, dict):
            raise ValueError("malformed worker record: no worker_id or role, or a ledger that "
                             "is not a JSON object")
        return record


def _flag(text: str) -> bool:
    if text not in ("0", "1"):
        raise ValueError(f"a flag must be 0 or 1, got {text!r}")
    return text == "1"


# KEYS[1]: a worker's record; ARGV[1]: TTL in ms; ARGV[2]: draining for a record without a
# valid one; ARGV[3..]: field, value, ... (all but draining). One step: fields and TTL together.
_HEARTBEAT = """
local kind = redis.call('TYPE', KEYS[1])['ok']
if kind ~= 'hash' and kind ~= 'none' then redis.call('DEL', KEYS[1]) end
redis.call('HSET', KEYS[1], unpack(ARGV, 3))
local draining = redis.call('HGET', KEYS[1], 'draining')
if draining ~= '0' and draining ~= '1' then redis.call('HSET', KEYS[1], 'draining', ARGV[2]) end
redis.call('PEXPIRE', KEYS[1], ARGV[1])
return 1
"""

# KEYS[1]: a worker's record; ARGV[1]: "0" | "1". Writes nothing into a record that is gone.
_SET_DRAINING = """
if redis.call('TYPE', KEYS[1])['ok'] ~= 'hash' then return 0 end
redis.call('HSET', KEYS[1], 'draining', ARGV[1])
return 1
"""

# KEYS[1]: any key; ARGV[1]: TTL in ms, given only when the key has none.
_EXPIRE_IF_PERSISTENT = """
if redis.call('PTTL', KEYS[1]) == -1 then redis.call('PEXPIRE', KEYS[1], ARGV[1]) end
return 1
"""


def redis_client(redis_url: str) -> redis.Redis:
    """A client that fails fast when Redis is away (the callers keep serving without it)."""
    return redis.Redis.from_url(redis_url, socket_timeout=5, socket_connect_timeout=2)


class Registry:
    """Worker records in Redis with heartbeat TTL; see the module docstring.
    ``on_malformed(family, count)`` hears of every record a read skipped."""

    def __init__(self, redis_url: str, cluster: str = "default", ttl_s: float = 10.0,
                 on_malformed: Callable[[str, int], None] | None = None):
        self.client = redis_client(redis_url)
        self.cluster = cluster
        self.prefix = f"pdserve:{cluster}:worker:"
        self.ttl_ms = int(ttl_s * 1000)
        self.on_malformed = on_malformed
        self._warned: set[bytes] = set()  # malformed keys already logged
        self._heartbeat = self.client.register_script(_HEARTBEAT)
        self._set_draining = self.client.register_script(_SET_DRAINING)
        self._expire_if_persistent = self.client.register_script(_EXPIRE_IF_PERSISTENT)

    def heartbeat(self, record: WorkerRecord) -> None:
        """Write ``record`` (all but ``draining``, which is only created) with the TTL."""
        record.heartbeat_time = time.time()
        fields = record.to_hash()
        draining = fields.pop("draining")
        flat = [item for pair in fields.items() for item in pair]
        self._heartbeat(keys=[self.prefix + record.worker_id],
                        args=[self.ttl_ms, draining, *flat])

    def workers(self, role: str | None = None) -> list[WorkerRecord]:
        """Every record that parses (of ``role``); malformed ones are skipped and counted."""
        keys = sorted(self.client.scan_iter(match=self.prefix + "*", count=100))
        if not keys:
            return []
        with self.client.pipeline(transaction=False) as pipe:
            for key in keys:
                pipe.hgetall(key)
            replies = pipe.execute(raise_on_error=False)
        records, malformed = [], []
        for key, reply in zip(keys, replies, strict=True):
            if isinstance(reply, dict) and not reply:
                continue  # expired between the scan and the read
            try:
                if isinstance(reply, Exception):  # a key of another type
                    raise ValueError(str(reply))
                record = WorkerRecord.from_hash(reply)
                if self.prefix + record.worker_id != key.decode():
                    raise ValueError(f"record of {record.worker_id!r} under another key")
            except ValueError as exc:
                malformed.append(key)
                self._warn_once(key, exc)
                continue
            records.append(record)
        if malformed:
            self._expire_garbage(malformed)
        return [r for r in records if role is None or r.role == role]

    def _warn_once(self, key: bytes, exc: ValueError) -> None:
        if key not in self._warned:
            if len(self._warned) > 1000:
                self._warned.clear()
            self._warned.add(key)
            logger.warning("skipping the malformed worker record %s (it expires unless its "
                           "worker rewrites it): %s", key.decode(errors="replace"), exc)

    def _expire_garbage(self, keys: list[bytes]) -> None:
        for key in keys:
            self._expire_if_persistent(keys=[key], args=[self.ttl_ms])
        if self.on_malformed is not None:
            self.on_malformed("worker", len(keys))

    def set_draining(self, worker_id: str, draining: bool = True) -> bool:
        """Mark the record draining (or not); False, writing nothing, when it is gone."""
        return bool(self._set_draining(keys=[self.prefix + worker_id],
                                       args=[str(int(draining))]))

    def remove(self, worker_id: str) -> None:
        self.client.delete(self.prefix + worker_id)

    def close(self) -> None:
        self.client.close()
