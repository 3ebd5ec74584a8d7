"""Shared cluster state in Redis: one hash per worker, refreshed by heartbeats, expiring by TTL.

Keys: ``pdserve:<cluster>:worker:<worker_id>`` -> hash of :class:`WorkerRecord` fields, with a
TTL of ``ttl_s``; a worker that stops heartbeating disappears from :meth:`Registry.workers`.
``draining`` belongs to whoever marks it (:meth:`Registry.set_draining`: an operator, the
autoscaler, the worker itself): heartbeats create it as 0 but never overwrite it.
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass

import redis

from pdserve.engine.messages import WorkerStats


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
                   stats.spec_num_accepted_tokens)

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
                           spec_num_accepted_tokens=self.spec_num_accepted_tokens)

    def to_hash(self) -> dict[str, str]:
        return {f.name: str(int(v) if isinstance(v, bool) else v)
                for f in dataclasses.fields(self) for v in [getattr(self, f.name)]}

    @classmethod
    def from_hash(cls, raw: dict[bytes, bytes]) -> WorkerRecord:
        values = {k.decode(): v.decode() for k, v in raw.items()}
        kwargs = {}
        for f in dataclasses.fields(cls):
            if f.name not in values:
                continue
            text = values[f.name]
            kind = {"int": int, "float": float, "bool": lambda s: bool(int(s))}.get(f.type, str)
            kwargs[f.name] = kind(text)
        return cls(**kwargs)


class Registry:
    """Worker records in Redis with heartbeat TTL."""

    def __init__(self, redis_url: str, cluster: str = "default", ttl_s: float = 10.0):
        self.client = redis.Redis.from_url(redis_url, socket_timeout=5)
        self.prefix = f"pdserve:{cluster}:worker:"
        self.ttl_ms = int(ttl_s * 1000)

    def heartbeat(self, record: WorkerRecord) -> None:
        """Write ``record`` (all but ``draining``, which is only created) and renew the TTL."""
        record.heartbeat_time = time.time()
        key = self.prefix + record.worker_id
        fields = record.to_hash()
        draining = fields.pop("draining")
        with self.client.pipeline() as pipe:
            pipe.hset(key, mapping=fields)
            pipe.hsetnx(key, "draining", draining)
            pipe.pexpire(key, self.ttl_ms)
            pipe.execute()

    def workers(self, role: str | None = None) -> list[WorkerRecord]:
        keys = sorted(self.client.scan_iter(match=self.prefix + "*", count=100))
        if not keys:
            return []
        with self.client.pipeline() as pipe:
            for key in keys:
                pipe.hgetall(key)
            hashes = pipe.execute()
        records = [WorkerRecord.from_hash(h) for h in hashes if h]
        return [r for r in records if role is None or r.role == role]

    def set_draining(self, worker_id: str, draining: bool = True) -> None:
        self.client.hset(self.prefix + worker_id, "draining", str(int(draining)))

    def remove(self, worker_id: str) -> None:
        self.client.delete(self.prefix + worker_id)

    def close(self) -> None:
        self.client.close()
