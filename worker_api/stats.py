"""What a worker reports of itself: its role (:data:`ROLES`), load and memory
(:class:`WorkerStats`), and what its recent forward passes achieved against its device's
measured peaks (:class:`Utilization`, ``engine.capacity.roofline`` measures them)."""

from __future__ import annotations

from dataclasses import dataclass, field

ROLES = ("prefill", "decode", "colocated")  # a worker's role, WorkerStats.role

IDLE = "idle"
COMPUTE = "compute"
BANDWIDTH = "bandwidth"


def binding(compute_utilization: float, bandwidth_utilization: float) -> str:
    """The resource closer to its peak; ``idle`` when neither is used."""
    if compute_utilization <= 0 and bandwidth_utilization <= 0:
        return IDLE
    return COMPUTE if compute_utilization >= bandwidth_utilization else BANDWIDTH


@dataclass(frozen=True)
class Utilization:
    """What a worker achieved over the recent steps, against its device's measured peaks."""

    flops_per_s: float = 0.0  # model FLOPs per forward second
    bytes_per_s: float = 0.0  # weight + KV bytes per forward second
    peak_flops_per_s: float = 0.0  # dense matmul rate measured on the device
    peak_bytes_per_s: float = 0.0  # copy bandwidth measured on the device
    busy_fraction: float = 0.0  # forward seconds / wall seconds

    @property
    def compute(self) -> float:
        return self.flops_per_s / self.peak_flops_per_s if self.peak_flops_per_s else 0.0

    @property
    def bandwidth(self) -> float:
        return self.bytes_per_s / self.peak_bytes_per_s if self.peak_bytes_per_s else 0.0

    @property
    def binding(self) -> str:
        return binding(self.compute, self.bandwidth)


@dataclass
class WorkerStats:
    """A worker's load and memory, for the registry, the router's pairing and metrics."""

    worker_id: str
    role: str  # one of ROLES
    total_blocks: int
    free_blocks: int  # allocatable now (free + evictable cached)
    used_blocks: int  # owned by requests or reservations
    cached_blocks: int  # evictable prefix-cache blocks
    num_running: int
    num_waiting: int  # queued prompts, or reservations waiting for KV
    queued_tokens: int  # prompt tokens not computed yet
    num_preemptions: int
    prefix_hit_tokens: int
    prefix_query_tokens: int
    ledger: dict = field(default_factory=dict)  # MemoryLedger.to_dict()
    transfer_address: str = ""  # decode workers: KV endpoint host:port
    draining: bool = False  # takes no new requests
    error: str | None = None  # set when the worker's engine loop died: it takes no work
    num_bounces: int = 0  # preemptions that handed a request back to the router (a counter)
    flops_per_s: float = 0.0  # model FLOPs per forward second over the recent steps (achieved)
    bytes_per_s: float = 0.0  # weight + KV bytes per forward second over the recent steps
    peak_flops_per_s: float = 0.0  # dense matmul rate measured on the worker's device
    peak_bytes_per_s: float = 0.0  # copy bandwidth measured on the worker's device
    busy_fraction: float = 0.0  # forward seconds / wall seconds over the recent steps
    spec_num_drafts: int = 0  # speculative decoding counters: sequence-steps that verified drafts
    spec_num_draft_tokens: int = 0  # drafts proposed and verified
    spec_num_accepted_tokens: int = 0  # drafts the target accepted
    kv_log_id: str = ""  # the engine's KV event log (KVEvents.log_id; "": prefix caching off)
    kv_events_number: int = 0  # the last batch of it drained (a reader behind it missed some)
    taken_at: float = 0.0  # wall clock: every call the worker received before it is counted
    # LoRA (all empty or zero when the worker serves no adapters): the digests
    # (AdapterRef.digest) of the adapters in a slot, ready for a step, or wanted by a request
    # queued there (loaded before it runs), and of those read in host memory (a slot load
    # away); the worker's slots; its counters since start
    lora_slots: int = 0
    lora_resident: tuple[str, ...] = ()
    lora_in_host: tuple[str, ...] = ()
    lora_disk_reads: int = 0  # adapters read from their files
    lora_slot_loads: int = 0  # adapters put into a slot
    lora_evictions: int = 0  # adapters taken out of a slot for another
    lora_disk_read_s: float = 0.0  # seconds spent reading adapter files (sum)
    lora_slot_load_s: float = 0.0  # seconds spent filling slots (sum)
    lora_requests: dict[str, int] = field(default_factory=dict)  # sequences run, by adapter name
    # KV tiers below the pool (docs/kv-tiers.md); zeros without them. Counters are totals
    # since the engine started; the router derives each tier's load time per token from
    # read_s / read_bytes and kv_bytes_per_block
    kv_bytes_per_block: int = 0  # one block's KV (every layer, this worker's ranks together)
    kv_host_blocks: int = 0  # blocks held in host memory
    kv_disk_blocks: int = 0  # blocks held on the worker's disk
    kv_host_bytes: int = 0
    kv_disk_bytes: int = 0
    kv_host_capacity_bytes: int = 0  # --kv-offload-cpu-gib
    kv_disk_capacity_bytes: int = 0  # --kv-offload-disk-gib
    kv_host_hit_tokens: int = 0  # prompt tokens loaded back from host memory
    kv_disk_hit_tokens: int = 0  # prompt tokens loaded back from disk
    kv_host_read_bytes: int = 0
    kv_disk_read_bytes: int = 0
    kv_host_read_s: float = 0.0  # seconds spent reading (and checking) blocks, per tier
    kv_disk_read_s: float = 0.0
    kv_host_written_bytes: int = 0  # blocks saved from the pool into host memory
    kv_disk_written_bytes: int = 0  # blocks written to disk
    kv_tier_evictions: int = 0  # blocks dropped from the lowest tier holding them
    kv_tier_read_failures: int = 0  # blocks that failed their check or read (recomputed)
    kv_tier_write_failures: int = 0  # writes that failed or were dropped (full disk, backlog)

    @property
    def utilization(self) -> Utilization:
        """What these figures achieved against the device's peaks (what binds now)."""
        return Utilization(self.flops_per_s, self.bytes_per_s, self.peak_flops_per_s,
                           self.peak_bytes_per_s, self.busy_fraction)
