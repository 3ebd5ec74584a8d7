"""What a worker reports of its engine: load, memory, achieved rates, speculation counters."""

from __future__ import annotations

import time

from pdserve.engine.llm_engine import LLMEngine
from pdserve.worker_api import KV_TIER_DISK, KV_TIER_HOST, Utilization, WorkerStats


def engine_stats(worker_id: str, role: str, engine: LLMEngine, num_reserved: int = 0,
                 transfer_address: str = "") -> WorkerStats:
    """A worker's load and memory as the router and the registry see them, and what its
    recent forward passes achieved against the device's measured peaks. Taken on the
    engine's loop thread, which has run every call received before now (``taken_at``)."""
    bm, sched = engine.parts.block_manager, engine.scheduler
    meter = engine.parts.runner.meter
    util = meter.snapshot() if meter is not None else Utilization()
    queued = sum(s.num_uncomputed_tokens for s in [*sched.waiting, *sched.running]
                 if s.num_computed_tokens < s.num_prompt_tokens)
    return WorkerStats(
        worker_id, role, bm.num_blocks, bm.num_allocatable_blocks, bm.num_used_blocks,
        bm.num_cached_blocks, sched.num_running, sched.num_waiting + num_reserved, queued,
        sched.num_preemptions, bm.num_prefix_hit_tokens, bm.num_prefix_query_tokens,
        engine.parts.ledger.to_dict(), transfer_address, num_bounces=sched.num_bounces,
        flops_per_s=util.flops_per_s, bytes_per_s=util.bytes_per_s,
        peak_flops_per_s=util.peak_flops_per_s, peak_bytes_per_s=util.peak_bytes_per_s,
        busy_fraction=util.busy_fraction,
        kv_log_id="" if bm.events is None else bm.events.log_id,
        kv_events_number=0 if bm.events is None else bm.events.number,
        taken_at=time.time(), **spec_stats(engine), **lora_stats(engine),
        **tier_stats(engine))


def tier_stats(engine: LLMEngine) -> dict:
    """The KV tiers' contents and counters as WorkerStats fields (none without tiers). With
    tensor parallelism, rank 0's (each rank holds its heads of the same blocks)."""
    bm = engine.parts.block_manager
    offload = bm.offload
    if offload is None:
        return {}
    tiers = offload.tiers
    usage, c = tiers.usage(), tiers.counters
    return dict(kv_bytes_per_block=tiers.block_nbytes,
                kv_host_blocks=usage["host_blocks"], kv_disk_blocks=usage["disk_blocks"],
                kv_host_bytes=usage["host_bytes"], kv_disk_bytes=usage["disk_bytes"],
                kv_host_capacity_bytes=tiers.host_capacity,
                kv_disk_capacity_bytes=tiers.disk_capacity if tiers.folder else 0,
                kv_host_hit_tokens=bm.num_tier_hit_tokens[KV_TIER_HOST],
                kv_disk_hit_tokens=bm.num_tier_hit_tokens[KV_TIER_DISK],
                kv_host_read_bytes=c.host_read_bytes, kv_disk_read_bytes=c.disk_read_bytes,
                kv_host_read_s=c.host_read_s, kv_disk_read_s=c.disk_read_s,
                kv_host_written_bytes=c.host_written_bytes,
                kv_disk_written_bytes=c.disk_written_bytes, kv_tier_evictions=c.evictions,
                kv_tier_read_failures=c.read_failures, kv_tier_write_failures=c.write_failures)


def lora_stats(engine: LLMEngine) -> dict:
    """The LoRA slots' contents and counters as WorkerStats fields (none without LoRA)."""
    slots = engine.parts.adapters
    if slots is None:
        return {}
    c = slots.counters
    resident = slots.resident_digests()
    # an adapter a queued request wants is as good as resident for routing: it is loaded
    # before that request runs (a router's call counted by these stats must not look unloaded)
    queued = {seq.adapter.digest for seq in engine.scheduler.waiting if seq.adapter is not None}
    return dict(lora_slots=slots.max_loras,
                lora_resident=resident + tuple(sorted(queued - set(resident))),
                lora_in_host=slots.host_digests(), lora_disk_reads=c.disk_reads,
                lora_slot_loads=c.slot_loads, lora_evictions=c.evictions,
                lora_disk_read_s=c.disk_read_s, lora_slot_load_s=c.slot_load_s,
                lora_requests=dict(slots.requests))


def spec_stats(engine: LLMEngine) -> dict:
    """The speculative-decoding counters as WorkerStats fields (zeros without speculation)."""
    if engine.speculator is None:
        return {}
    s = engine.speculator.stats
    return dict(spec_num_drafts=s.num_drafts, spec_num_draft_tokens=s.num_draft_tokens,
                spec_num_accepted_tokens=s.num_accepted_tokens)
