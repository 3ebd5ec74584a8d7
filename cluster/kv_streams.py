"""Workers' KV events in Redis: one stream per worker, read by every router.

Key ``pdserve:<cluster>:kv:<worker_id>``, a Redis stream whose entries are the worker's
:class:`~pdserve.worker_api.KVEvents` batches (fields ``log``, ``n``, ``s``, ``r``, ``k``,
``t``: the log id, the batch number, the stored and removed 32-byte hashes, concatenated, the
tier of each stored hash, one byte each (``KV_TIER_*``; only when some stored hash is held
below the pool: an entry without ``k``, as workers without KV tiers write, holds pool blocks
only), and the worker's tag on all of them and its id under the cluster's key,
``pdserve.cluster.record_auth``). The worker actor adds an entry every ``KV_EVENTS_S``
(0.1 s) that its cache changed, trims the stream to ``maxlen`` entries and gives it the
registry's TTL, so a dead worker's stream leaves with its record.

Each router reads every stream from where it stopped. Whatever it misses (a trimmed stream, a
Redis restart, a batch whose write failed, a router that started late) shows as a gap in the
batch numbers, and the router's index resyncs that worker from a snapshot it asks the worker
for (``kv_snapshot``).

Redis is not trusted. A read never takes an entry over ``MAX_ENTRY_BYTES`` out of Redis (a
Lua script sizes each entry and returns only its id), nor more than ``MAX_READ_BYTES`` of one
stream at a time. An entry that is too large, does not parse, holds more than
``MAX_BATCH_HASHES`` hashes, a number out of bounds or a tier that is not one is skipped
(``on_malformed``, family ``"kv_event"``); one whose tag does not verify (a forged batch, or
one copied from another worker's stream) is skipped too (``on_untrusted``, kind
``"kv_event"``). Either is logged once per worker. A skipped entry never reaches the index, so
its batch numbers follow only the worker's own batches: a skipped real batch shows as a gap,
a forged one as nothing at all.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import redis

from pdserve.cluster.record_auth import RecordAuth, UntrustedError
from pdserve.engine.kv_cache.prefix_hash import ROOT_HASH
from pdserve.worker_api import KV_TIER_NAMES, KVEvents

logger = logging.getLogger(__name__)

HASH_BYTES = len(ROOT_HASH)
MAX_BATCH_HASHES = 1 << 16  # KVEventLog's max_pending: a batch holds no more hashes
MAX_ENTRY_BYTES = MAX_BATCH_HASHES * (HASH_BYTES + 1) + 1024  # its hashes, their tiers, log
# id, number and tag
MAX_READ_BYTES = 2 * MAX_ENTRY_BYTES  # of one stream's entries taken by one read (at least
# one entry: the rest comes with the next read)
_MAX_LOG_ID_CHARS = 64
_MAX_NUMBER_DIGITS = 18  # a batch number stays below 10**18
_TAG = "kv-event"
_SIGNED = (b"log", b"n", b"s", b"r", b"k")  # the fields the tag covers, in this order

# KEYS: streams; ARGV[1]: entries per stream at most; ARGV[2]: an entry's bytes at most;
# ARGV[3]: a stream's bytes per read at most; ARGV[3 + i]: the id last read of KEYS[i].
# Returns {key, {{id, {field, value, ...}}, ...}} per stream with entries after that id, an
# entry over the size as {id, {'oversized', its size}}; a key that is not a stream is left out.
_READ = """
local count, max_entry, budget = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local out = {}
for i, key in ipairs(KEYS) do
  local last = ARGV[3 + i]
  if redis.call('TYPE', key)['ok'] == 'stream' then
    local kept, used = {}, 0
    for _, entry in ipairs(redis.call('XRANGE', key, last, '+', 'COUNT', count + 1)) do
      if #kept == count then break end
      if entry[1] ~= last then
        local size = 0
        for _, part in ipairs(entry[2]) do size = size + #part end
        if size > max_entry then
          kept[#kept + 1] = {entry[1], {'oversized', tostring(size)}}
        elseif used + size > budget then
          break
        else
          used = used + size
          kept[#kept + 1] = entry
        end
      end
    end
    if #kept > 0 then out[#out + 1] = {key, kept} end
  end
end
return out
"""


def _split(blob: bytes) -> tuple[bytes, ...]:
    if len(blob) % HASH_BYTES:
        raise ValueError(f"{len(blob)} bytes is not a whole number of hashes")
    return tuple(blob[i:i + HASH_BYTES] for i in range(0, len(blob), HASH_BYTES))


def decode_entry(fields: dict[bytes, bytes]) -> KVEvents:
    """A stream entry as a batch (its tag not checked); ValueError when it is not one or
    breaks a bound (size, hashes, log id, number)."""
    if b"oversized" in fields:
        raise ValueError(f"an entry of {fields[b'oversized'].decode(errors='replace')} bytes "
                         f"(at most {MAX_ENTRY_BYTES})")
    try:
        log_id, number_text = fields[b"log"].decode(), fields[b"n"].decode()
        stored, removed = _split(fields[b"s"]), _split(fields[b"r"])
    except (KeyError, UnicodeDecodeError) as exc:
        raise ValueError(f"not a KV event batch: {exc!r}") from None
    if not 0 < len(log_id) <= _MAX_LOG_ID_CHARS or not log_id.isprintable():
        raise ValueError(f"log id {log_id[:_MAX_LOG_ID_CHARS]!r} is empty, too long or not "
                         f"printable")
    if not number_text.isdigit() or len(number_text) > _MAX_NUMBER_DIGITS \
            or int(number_text) < 1:
        raise ValueError(f"batch number {number_text[:40]!r} is not a whole number in "
                         f"[1, 10**{_MAX_NUMBER_DIGITS})")
    if len(stored) + len(removed) > MAX_BATCH_HASHES:
        raise ValueError(f"{len(stored) + len(removed)} hashes in one batch (at most "
                         f"{MAX_BATCH_HASHES})")
    return KVEvents(log_id, int(number_text), stored, removed,
                    _tiers(fields.get(b"k"), len(stored)))


def _tiers(blob: bytes | None, num_stored: int) -> tuple[int, ...]:
    """The ``k`` field as ``KVEvents.stored_tiers`` (none: all in the pool); ValueError when
    it does not give one known tier per stored hash."""
    if blob is None:
        return ()
    if len(blob) != num_stored:
        raise ValueError(f"{len(blob)} tiers for {num_stored} stored hashes")
    if any(tier >= len(KV_TIER_NAMES) for tier in blob):
        raise ValueError(f"a tier out of 0..{len(KV_TIER_NAMES) - 1}: {max(blob)}")
    return tuple(blob)


def _signed_parts(worker_id: str, fields: dict[bytes, bytes]) -> tuple[str | bytes, ...]:
    """What an entry's tag covers: the worker's id and the entry's fields in ``_SIGNED``
    order (``k`` only when the entry has one: an entry without it is tagged as before tiers,
    and removing or adding it breaks the tag)."""
    return (worker_id, *(fields[name] for name in _SIGNED if name in fields))


class KVStreams:
    """Publish a worker's batches signed; read every worker's from where this reader stopped,
    skipping what is too large, malformed or not signed with the cluster's key (``auth``)."""

    def __init__(self, client: redis.Redis, cluster: str, ttl_ms: int, maxlen: int = 1000, *,
                 auth: RecordAuth, on_malformed: Callable[[str, int], None] | None = None,
                 on_untrusted: Callable[[str, int], None] | None = None):
        self.client = client
        self.prefix = f"pdserve:{cluster}:kv:"
        self.ttl_ms = ttl_ms
        self.maxlen = maxlen
        self.auth = auth
        self.on_malformed = on_malformed
        self.on_untrusted = on_untrusted
        self._read_to: dict[str, bytes] = {}  # worker_id -> the last entry id read
        self._warned: set[str] = set()  # workers whose skipped entries were logged
        self._read = client.register_script(_READ)


    def publish(self, worker_id: str, events: KVEvents) -> None:
        """Add the batch to the worker's stream; a key of another type there (garbage) is
        replaced by the stream."""
        try:
            self._add(worker_id, events)
        except redis.ResponseError as exc:
            logger.warning("KV event stream of %s: %s; replacing the key", worker_id, exc)
            self.client.delete(self.prefix + worker_id)
            self._add(worker_id, events)

    def _add(self, worker_id: str, events: KVEvents) -> None:
        key = self.prefix + worker_id
        fields = {b"log": events.log_id.encode(), b"n": str(events.number).encode(),
                  b"s": b"".join(events.stored), b"r": b"".join(events.removed)}
        if events.stored_tiers:
            fields[b"k"] = bytes(events.stored_tiers)
        fields[b"t"] = self.auth.tag(_TAG, *_signed_parts(worker_id, fields)).encode()
        with self.client.pipeline(transaction=False) as pipe:
            pipe.xadd(key, fields, maxlen=self.maxlen, approximate=False)
            pipe.pexpire(key, self.ttl_ms)
            pipe.execute()

    def read(self, worker_ids: list[str], count: int = 1000) -> list[tuple[str, KVEvents]]:
        """The batches added to these workers' streams since the last read, in order per
        worker (a new worker's from the start of its stream). Streams of another type, and
        entries skipped (see the module docstring), give none."""
        for gone in set(self._read_to) - set(worker_ids):
            del self._read_to[gone]
        if not worker_ids:
            return []
        keys = [self.prefix + w for w in worker_ids]
        last = [self._read_to.get(w, b"0-0") for w in worker_ids]
        replies = self._read(keys=keys, args=[count, MAX_ENTRY_BYTES, MAX_READ_BYTES, *last])
        batches, skipped = [], {"malformed": 0, "untrusted": 0}
        for key, entries in replies:
            worker_id = key.decode()[len(self.prefix):]
            for entry_id, flat in entries:
                self._read_to[worker_id] = entry_id
                fields = dict(zip(flat[::2], flat[1::2], strict=True))
                try:
                    batches.append((worker_id, self._verified(worker_id, fields)))
                except ValueError as exc:
                    kind = "untrusted" if isinstance(exc, UntrustedError) else "malformed"
                    skipped[kind] += 1
                    self._warn_once(worker_id, kind, exc)
        for kind, hook in (("malformed", self.on_malformed), ("untrusted", self.on_untrusted)):
            if skipped[kind] and hook is not None:
                hook("kv_event", skipped[kind])
        return batches

    def _verified(self, worker_id: str, fields: dict[bytes, bytes]) -> KVEvents:
        """The entry's batch; ValueError when it is malformed, UntrustedError when its tag
        does not verify for this worker."""
        events = decode_entry(fields)
        if not self.auth.verifies(fields.get(b"t", b""), _TAG,
                                  *_signed_parts(worker_id, fields)):
            raise UntrustedError("its tag does not verify under this cluster's key for "
                                 "this worker")
        return events

    def _warn_once(self, worker_id: str, kind: str, exc: ValueError) -> None:
        if worker_id in self._warned:
            logger.debug("skipping a KV event entry of %s (%s): %s", worker_id, kind, exc)
            return
        if len(self._warned) > 1000:
            self._warned.clear()
        self._warned.add(worker_id)
        logger.warning("skipping a KV event entry of %s (%s; further ones of this worker are "
                       "counted, not logged): %s", worker_id, kind, exc)
