"""Workers' KV events in Redis: one stream per worker, read by every router.

Key ``pdserve:<cluster>:kv:<worker_id>``, a Redis stream whose entries are the worker's
:class:`~pdserve.engine.protocol.KVEvents` batches (fields ``log``, ``n``, ``s``, ``r``: the log
id, the batch number, then the stored and removed 32-byte hashes, concatenated). The worker
actor adds an entry every ``KV_EVENTS_S`` (0.1 s) that its cache changed, trims the stream to
``maxlen`` entries and gives it the registry's TTL, so a dead worker's stream leaves with its
record.

Each router reads every stream from where it stopped. Whatever it misses (a trimmed stream, a
Redis restart, a batch whose write failed, a router that started late) shows as a gap in the
batch numbers, and the router's index resyncs that worker from a snapshot it asks the worker
for (``kv_snapshot``); an entry that does not parse is skipped, which shows as a gap too.
"""

from __future__ import annotations

import logging

import redis

from pdserve.engine.prefix_hash import ROOT_HASH
from pdserve.engine.protocol import KVEvents

logger = logging.getLogger(__name__)

HASH_BYTES = len(ROOT_HASH)


def _split(blob: bytes) -> tuple[bytes, ...]:
    if len(blob) % HASH_BYTES:
        raise ValueError(f"{len(blob)} bytes is not a whole number of hashes")
    return tuple(blob[i:i + HASH_BYTES] for i in range(0, len(blob), HASH_BYTES))


def decode_entry(fields: dict[bytes, bytes]) -> KVEvents:
    """A stream entry as a batch; ValueError when it is not one."""
    try:
        log_id, number = fields[b"log"].decode(), int(fields[b"n"])
        stored, removed = _split(fields[b"s"]), _split(fields[b"r"])
    except (KeyError, UnicodeDecodeError) as exc:
        raise ValueError(f"not a KV event batch: {exc!r}") from None
    if number < 1:
        raise ValueError(f"batch number {number} < 1")
    return KVEvents(log_id, number, stored, removed)


class KVStreams:
    """Publish a worker's batches; read every worker's from where this reader stopped."""

    def __init__(self, client: redis.Redis, cluster: str, ttl_ms: int, maxlen: int = 1000):
        self.client = client
        self.prefix = f"pdserve:{cluster}:kv:"
        self.ttl_ms = ttl_ms
        self.maxlen = maxlen
        self._read_to: dict[str, bytes] = {}  # worker_id -> the last entry id read

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
        with self.client.pipeline(transaction=False) as pipe:
            pipe.xadd(key, {"log": events.log_id, "n": events.number,
                            "s": b"".join(events.stored), "r": b"".join(events.removed)},
                      maxlen=self.maxlen, approximate=False)
            pipe.pexpire(key, self.ttl_ms)
            pipe.execute()

    def read(self, worker_ids: list[str], count: int = 1000) -> list[tuple[str, KVEvents]]:
        """The batches added to these workers' streams since the last read, in order per
        worker (a new worker's from the start of its stream). Entries that do not parse,
        and streams of another type, are skipped."""
        for gone in set(self._read_to) - set(worker_ids):
            del self._read_to[gone]
        if not worker_ids:
            return []
        streams = {self.prefix + w: self._read_to.get(w, b"0-0") for w in worker_ids}
        try:
            replies = self.client.xread(streams, count=count)
        except redis.ResponseError as exc:  # a key of another type: read them one by one
            logger.warning("KV event streams: %s; reading each stream alone", exc)
            replies = []
            for key, last in streams.items():
                try:
                    replies += self.client.xread({key: last}, count=count)
                except redis.ResponseError:
                    continue
        batches = []
        for key, entries in replies:
            worker_id = key.decode()[len(self.prefix):]
            for entry_id, fields in entries:
                self._read_to[worker_id] = entry_id
                try:
                    batches.append((worker_id, decode_entry(fields)))
                except ValueError as exc:
                    logger.warning("skipping a malformed KV event entry of %s: %s", worker_id,
                                   exc)
        return batches
