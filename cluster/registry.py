"""Shared cluster state in Redis: one hash per worker, refreshed by heartbeats, expiring by TTL.

Keys: ``pdserve:<cluster>:worker:<worker_id>`` -> hash of :class:`WorkerRecord` fields, with a
TTL of ``ttl_s``; a worker that stops heartbeating disappears from :meth:`Registry.workers`.
``draining`` belongs to the pool manager, which decides it and re-marks it at every reconcile
(:meth:`Registry.set_draining`); heartbeats create it as 0 but never overwrite it.

Records cannot be half-written: a heartbeat writes its fields and the TTL in one Lua script
(replacing a key of another type, resetting a ``draining`` that is not 0 or 1), and
``set_draining`` writes only into a record that exists, so an expired record is never
recreated without a TTL.

Redis is not trusted (``pdserve.cluster.record_auth``): the heartbeat signs every field but
the drain mark with the cluster's key (``tag``), and ``draining`` carries a tag of its own
(``draining_tag``). Readers skip, count and log once a record that is larger than
``MAX_RECORD_FIELDS`` or ``MAX_RECORD_BYTES`` (sized in Redis: it is never sent), does not
parse or breaks a bound (every number finite and >= 0, the ledger's ``block_size`` > 0,
LoRA adapter digests of 64 hex digits):
``on_malformed``, family ``"worker"``; or whose tag does not verify: ``on_untrusted``, kind
``"worker"``. A drain mark whose tag does not verify reads as
not draining (``on_untrusted``, kind ``"draining"``) until the pool manager writes its own.
Skipped records without a TTL get the record TTL, so garbage leaves by itself while a live
worker's next heartbeat rewrites its own record.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import redis

from pdserve.cluster.record_auth import RecordAuth, UntrustedError
from pdserve.worker_api import WorkerStats

logger = logging.getLogger(__name__)

MAX_RECORD_FIELDS = 128  # a record's fields, at most (a WorkerRecord has fewer than 70)
MAX_RECORD_BYTES = 64 * 1024  # a record's field names and values together, at most
MAX_ERROR_CHARS = 2000  # of the error a record carries (a longer one is cut)
MAX_LORA_DIGESTS = 256  # adapter digests a record keeps per list (the most recently used)
MAX_LORA_NAMES = 64  # adapters whose request counts a record keeps (the most requested)
_MAX_INT = 1 << 63  # a record's whole numbers stay below it
_RECORD_TAG = "worker-record"  # the purposes of the two tags
_DRAINING_TAG = "draining"


@dataclass
class WorkerRecord:
    """What the router needs to know about one worker: every :class:`WorkerStats` field
    (:func:`stats_stored` says how each is kept) and the registry's own (``REGISTRY_ONLY``)."""

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
    lora_slots: int = 0  # LoRA adapter slots in its model (0: it serves no adapters)
    lora_resident: str = ""  # digests of the adapters in a slot, space-separated
    lora_in_host: str = ""  # digests of the adapters read in host memory, space-separated
    lora_disk_reads: int = 0  # adapters read from their files (a counter)
    lora_slot_loads: int = 0  # adapters put into a slot (a counter)
    lora_evictions: int = 0  # adapters taken out of a slot for another (a counter)
    lora_disk_read_s: float = 0.0  # seconds spent reading adapter files (sum)
    lora_slot_load_s: float = 0.0  # seconds spent filling slots (sum)
    lora_requests_json: str = "{}"  # sequences run by adapter name, as a JSON object
    kv_bytes_per_block: int = 0  # KV tiers below the pool (docs/kv-tiers.md): one block's KV
    kv_host_blocks: int = 0  # blocks held in host memory
    kv_disk_blocks: int = 0  # blocks held on the worker's disk
    kv_host_bytes: int = 0
    kv_disk_bytes: int = 0
    kv_host_capacity_bytes: int = 0
    kv_disk_capacity_bytes: int = 0
    kv_host_hit_tokens: int = 0  # prompt tokens loaded back from host memory (a counter)
    kv_disk_hit_tokens: int = 0  # prompt tokens loaded back from disk (a counter)
    kv_host_read_bytes: int = 0  # (a counter, as are the rest)
    kv_disk_read_bytes: int = 0
    kv_host_read_s: float = 0.0
    kv_disk_read_s: float = 0.0
    kv_host_written_bytes: int = 0
    kv_disk_written_bytes: int = 0
    kv_tier_evictions: int = 0
    kv_tier_read_failures: int = 0
    kv_tier_write_failures: int = 0
    tag: str = ""  # the worker's tag on every field but the drain mark's (Registry.heartbeat)
    draining_tag: str = ""  # the pool manager's tag on ``draining`` (Registry.set_draining);
    # "" as read: no mark that verifies (it reads as not draining)

    @classmethod
    def from_stats(cls, stats: WorkerStats, pid: int = 0) -> WorkerRecord:
        """The record of ``stats``: every field under its name (:data:`STATS_STORED` says
        which are stored otherwise); the registry's own fields (:data:`REGISTRY_ONLY`) are
        ``pid`` and defaults."""
        values = {}
        for f in dataclasses.fields(stats):
            stored = stats_stored(f.name)
            values[stored.field] = stored.encode(getattr(stats, f.name))
        return cls(**values, pid=pid)

    def to_stats(self) -> WorkerStats:
        values = {}
        for f in dataclasses.fields(WorkerStats):
            stored = stats_stored(f.name)
            values[f.name] = stored.decode(getattr(self, stored.field))
        return WorkerStats(**values)

    def to_hash(self) -> dict[str, str]:
        return {f.name: str(int(v) if isinstance(v, bool) else v)
                for f in dataclasses.fields(self) for v in [getattr(self, f.name)]}

    @classmethod
    def from_hash(cls, raw: dict[bytes, bytes]) -> WorkerRecord:
        """The record a hash holds (its tags not checked); ValueError for one that does not
        parse (a field of the wrong kind, no worker_id or role, a ledger that is not a JSON
        object) or breaks a bound (:func:`_check_bounds`)."""
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
            _lora_digests(record.lora_resident)  # (each ValueError when it does not parse)
            _lora_digests(record.lora_in_host)
            _lora_requests(record.lora_requests_json)
        except (TypeError, ValueError, UnicodeDecodeError, RecursionError) as exc:
            # RecursionError: a ledger nested too deep for json.loads
            raise ValueError(f"malformed worker record: {exc}") from None
        if not record.worker_id or not record.role or not isinstance(ledger, dict):
            raise ValueError("malformed worker record: no worker_id or role, or a ledger that "
                             "is not a JSON object")
        _check_bounds(record, ledger)
        return record


def _join_digests(digests: tuple[str, ...]) -> str:
    """Adapter digests as a record keeps them: the last ``MAX_LORA_DIGESTS`` (the engine lists
    them least recently used first), space-separated."""
    return " ".join(digests[-MAX_LORA_DIGESTS:])


def _lora_digests(text: str) -> tuple[str, ...]:
    """The digests a record keeps; ValueError unless each is 64 lowercase hex digits."""
    digests = tuple(text.split())
    for digest in digests:
        if len(digest) != 64 or digest.strip("0123456789abcdef"):
            raise ValueError(f"a LoRA adapter digest must be 64 lowercase hex digits, got "
                             f"{digest[:80]!r}")
    return digests


def _dump_requests(counts: dict[str, int]) -> str:
    """Request counts by adapter name as a record keeps them: the ``MAX_LORA_NAMES`` largest."""
    kept = sorted(counts.items(), key=lambda item: (-item[1], item[0]))[:MAX_LORA_NAMES]
    return json.dumps(dict(kept), sort_keys=True)


def _lora_requests(text: str) -> dict[str, int]:
    """The request counts a record keeps; ValueError unless a JSON object of whole numbers."""
    counts = json.loads(text or "{}")
    if not isinstance(counts, dict) or not all(
            isinstance(n, int) and not isinstance(n, bool) and 0 <= n < _MAX_INT
            for n in counts.values()):
        raise ValueError("lora_requests_json must be a JSON object of whole numbers >= 0")
    return counts


class Stored(NamedTuple):
    """How a WorkerStats field is kept in the record."""

    field: str  # the record's field
    encode: Callable[[Any], Any]  # the stats value -> the record's
    decode: Callable[[Any], Any]  # the record's value -> the stats'


def _same(value: Any) -> Any:
    return value


# The WorkerStats fields the record keeps under another name or in another form; it keeps every
# other one under its own name, as it is.
STATS_STORED = {
    "ledger": Stored("ledger_json", lambda ledger: json.dumps(ledger, sort_keys=True),
                     lambda text: json.loads(text or "{}")),
    "error": Stored("error", lambda error: (error or "")[:MAX_ERROR_CHARS],
                    lambda text: text or None),
    "lora_resident": Stored("lora_resident", _join_digests, _lora_digests),
    "lora_in_host": Stored("lora_in_host", _join_digests, _lora_digests),
    "lora_requests": Stored("lora_requests_json", _dump_requests, _lora_requests),
}
# The record's fields no WorkerStats field fills: the registry's and the signatures'.
REGISTRY_ONLY = ("heartbeat_time", "pid", "tag", "draining_tag")


def stats_stored(name: str) -> Stored:
    """How the WorkerStats field ``name`` is kept in a :class:`WorkerRecord`."""
    return STATS_STORED.get(name) or Stored(name, _same, _same)


SIGNED_FIELDS = tuple(sorted(f.name for f in dataclasses.fields(WorkerRecord)
                             if f.name not in ("draining", "draining_tag", "tag")))


def _check_bounds(record: WorkerRecord, ledger: dict) -> None:
    """ValueError naming the first value out of its bounds: every whole number in [0, 2**63),
    every rate finite and >= 0, the ledger's ``block_size`` (16 when it names none) a whole
    number > 0 (the router divides by it)."""
    for f in dataclasses.fields(record):
        value = getattr(record, f.name)
        if (f.type == "int" and not 0 <= value < _MAX_INT) or \
                (f.type == "float" and not (math.isfinite(value) and value >= 0)):
            raise ValueError(f"malformed worker record: {f.name} = {value!r} is out of bounds")
    block_size = ledger.get("block_size", 16)
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"malformed worker record: ledger block_size = {block_size!r} (a "
                         f"whole number > 0)")


def _flag(text: str) -> bool:
    if text not in ("0", "1"):
        raise ValueError(f"a flag must be 0 or 1, got {text!r}")
    return text == "1"


# KEYS[1]: a worker's record; ARGV[1]: TTL in ms; ARGV[2], ARGV[3]: draining and its tag for a
# record without a valid flag; ARGV[4..]: field, value, ... (all but the drain mark). One step:
# fields and TTL together.
_HEARTBEAT = """
local kind = redis.call('TYPE', KEYS[1])['ok']
if kind ~= 'hash' and kind ~= 'none' then redis.call('DEL', KEYS[1]) end
redis.call('HSET', KEYS[1], unpack(ARGV, 4))
local draining = redis.call('HGET', KEYS[1], 'draining')
if draining ~= '0' and draining ~= '1' then
  redis.call('HSET', KEYS[1], 'draining', ARGV[2], 'draining_tag', ARGV[3])
end
redis.call('PEXPIRE', KEYS[1], ARGV[1])
return 1
"""

# KEYS[1]: a worker's record; ARGV[1]: "0" | "1"; ARGV[2]: its tag. Writes nothing into a
# record that is gone.
_SET_DRAINING = """
if redis.call('TYPE', KEYS[1])['ok'] ~= 'hash' then return 0 end
redis.call('HSET', KEYS[1], 'draining', ARGV[1], 'draining_tag', ARGV[2])
return 1
"""

# KEYS[1]: a worker's record; ARGV[1]: the most fields it may have; ARGV[2]: the most bytes
# its names and values may add up to. Its fields and values, flat ({} when it is gone), or an
# error for a key no reader should take: a record too large never leaves Redis (its values are
# sized in place, never copied).
_READ_RECORD = """
local kind = redis.call('TYPE', KEYS[1])['ok']
if kind == 'none' then return {} end
if kind ~= 'hash' then return redis.error_reply('a key of type ' .. kind .. ', not a hash') end
local fields = redis.call('HLEN', KEYS[1])
if fields > tonumber(ARGV[1]) then
  return redis.error_reply('a record of ' .. fields .. ' fields (at most ' .. ARGV[1] .. ')')
end
local size = 0
for _, name in ipairs(redis.call('HKEYS', KEYS[1])) do
  size = size + #name + redis.call('HSTRLEN', KEYS[1], name)
end
if size > tonumber(ARGV[2]) then
  return redis.error_reply('a record of ' .. size .. ' bytes (at most ' .. ARGV[2] .. ')')
end
return redis.call('HGETALL', KEYS[1])
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
    """Worker records in Redis with heartbeat TTL; see the module docstring. ``auth``: the
    cluster's key (``RecordAuth(spec.record_key)``); ``on_malformed(family, count)`` and
    ``on_untrusted(kind, count)`` hear of every record (or drain mark) a read skipped."""

    def __init__(self, redis_url: str, cluster: str = "default", ttl_s: float = 10.0,
                 on_malformed: Callable[[str, int], None] | None = None,
                 on_untrusted: Callable[[str, int], None] | None = None, *,
                 auth: RecordAuth):
        self.client = redis_client(redis_url)
        self.cluster = cluster
        self.prefix = f"pdserve:{cluster}:worker:"
        self.ttl_ms = int(ttl_s * 1000)
        self.auth = auth
        self.on_malformed = on_malformed
        self.on_untrusted = on_untrusted
        self._warned: set[tuple[bytes, str]] = set()  # (key, what) already logged
        self._heartbeat = self.client.register_script(_HEARTBEAT)
        self._set_draining = self.client.register_script(_SET_DRAINING)
        self._read_record = self.client.register_script(_READ_RECORD)
        self._expire_if_persistent = self.client.register_script(_EXPIRE_IF_PERSISTENT)

    def heartbeat(self, record: WorkerRecord) -> None:
        """Write ``record`` signed (all but ``draining``, which is only created) with the TTL."""
        record.heartbeat_time = time.time()
        fields = record.to_hash()
        draining = fields.pop("draining")
        del fields["draining_tag"]
        fields["tag"] = self.auth.tag(_RECORD_TAG, *self._signed_parts(fields))
        flat = [item for pair in fields.items() for item in pair]
        self._heartbeat(keys=[self.prefix + record.worker_id],
                        args=[self.ttl_ms, draining, self._drain_tag(record.worker_id, draining),
                              *flat])

    def _drain_tag(self, worker_id: str, draining: str) -> str:
        return self.auth.tag(_DRAINING_TAG, worker_id, draining)

    def workers(self, role: str | None = None) -> list[WorkerRecord]:
        """Every record that is bounded, parses and verifies (of ``role``); the others are
        skipped and counted (see the module docstring)."""
        keys = sorted(self.client.scan_iter(match=self.prefix + "*", count=100))
        if not keys:
            return []
        with self.client.pipeline(transaction=False) as pipe:
            for key in keys:
                self._read_record(keys=[key], args=[MAX_RECORD_FIELDS, MAX_RECORD_BYTES],
                                  client=pipe)
            replies = pipe.execute(raise_on_error=False)
        records, skipped = [], {"malformed": [], "untrusted": []}
        for key, reply in zip(keys, replies, strict=True):
            if isinstance(reply, list) and not reply:
                continue  # expired between the scan and the read
            try:
                record = self._verified(key, reply)
            except ValueError as exc:
                kind = "untrusted" if isinstance(exc, UntrustedError) else "malformed"
                skipped[kind].append(key)
                self._warn_once(key, kind, f"skipping the {kind} worker record %s (it expires "
                                           "unless its worker rewrites it): %s", exc)
                continue
            self._check_drain_mark(key, record)
            records.append(record)
        if skipped["malformed"] or skipped["untrusted"]:
            self._expire_garbage(skipped["malformed"] + skipped["untrusted"])
            self._count(self.on_malformed, "worker", len(skipped["malformed"]))
            self._count(self.on_untrusted, "worker", len(skipped["untrusted"]))
        return [r for r in records if role is None or r.role == role]

    def _verified(self, key: bytes, reply: list | Exception) -> WorkerRecord:
        """The record a read returned; ValueError when it is malformed, UntrustedError when
        its tag does not verify."""
        if isinstance(reply, Exception):  # a key of another type, or too large
            raise ValueError(str(reply))
        raw = dict(zip(reply[::2], reply[1::2], strict=True))
        record = WorkerRecord.from_hash(raw)
        if self.prefix + record.worker_id != key.decode():
            raise ValueError(f"record of {record.worker_id!r} under another key")
        values = {k.decode(): v.decode() for k, v in raw.items()}  # from_hash decoded them
        if not self.auth.verifies(record.tag, _RECORD_TAG, *self._signed_parts(values)):
            raise UntrustedError("its tag does not verify under this cluster's key")
        return record

    @staticmethod
    def _signed_parts(values: dict[str, str]) -> list[str]:
        """The signed fields' names and values (as stored), in order; UntrustedError when one
        is missing."""
        missing = [name for name in SIGNED_FIELDS if name not in values]
        if missing:
            raise UntrustedError(f"it lacks the signed field {missing[0]!r}")
        return [p for name in SIGNED_FIELDS for p in (name, values[name])]

    def _check_drain_mark(self, key: bytes, record: WorkerRecord) -> None:
        """Keep ``draining`` only when its tag verifies; otherwise the record reads as not
        draining with no mark (``draining_tag`` ""), and the pool manager writes its own."""
        if self.auth.verifies(record.draining_tag, _DRAINING_TAG, record.worker_id,
                              str(int(record.draining))):
            return
        self._warn_once(key, "draining", "ignoring the drain mark of %s (draining=%d): its "
                        "tag does not verify under this cluster's key", int(record.draining))
        self._count(self.on_untrusted, "draining", 1)
        record.draining, record.draining_tag = False, ""

    def _warn_once(self, key: bytes, what: str, message: str, *args) -> None:
        """Log ``message`` % (the key, *args) at the first ``what`` of this key."""
        if (key, what) not in self._warned:
            if len(self._warned) > 1000:
                self._warned.clear()
            self._warned.add((key, what))
            logger.warning(message, key.decode(errors="replace"), *args)

    def _expire_garbage(self, keys: list[bytes]) -> None:
        for key in keys:
            self._expire_if_persistent(keys=[key], args=[self.ttl_ms])

    @staticmethod
    def _count(hook: Callable[[str, int], None] | None, kind: str, count: int) -> None:
        if hook is not None and count:
            hook(kind, count)

    def set_draining(self, worker_id: str, draining: bool = True) -> bool:
        """Mark the record draining (or not) under the cluster's key; False, writing nothing,
        when it is gone. The pool manager's call: it holds which workers drain."""
        flag = str(int(draining))
        return bool(self._set_draining(keys=[self.prefix + worker_id],
                                       args=[flag, self._drain_tag(worker_id, flag)]))

    def remove(self, worker_id: str) -> None:
        self.client.delete(self.prefix + worker_id)

    def close(self) -> None:
        self.client.close()
