"""The prefill worker: runs prompts and ships their KV to the decode worker that reserved it.

Lifecycle of one request on a prefill worker P:

1. ``prefill(request, reservation)`` queues the prompt (``WAITING``) with its target: the
   decode worker's transfer address and the reservation's ``TransferKey``.
2. Steps batch queued prompts with chunked prefill under the token budget; the prefix cache
   serves shared prompt prefixes first (``PrefillOnlyPolicy``: nothing decodes here).
3. In the step that computes a prompt's last chunk, as soon as layer ``l`` has written its
   K/V the request's blocks of that layer are packed (a copy) and queued on the sender's own
   thread, so layer ``l`` ships while ``l + 1`` computes (``overlap=True``; otherwise all
   layers are sent after the forward).
4. Token 0 is sampled; the sequence is handed off (``SENDING_KV``) and its blocks are released
   to the prefix cache at once (the payloads are copies); COMMIT(token 0) follows the layers
   on the same channel, naming how many leading blocks it shipped were stand-ins for blocks
   the window had freed here (``_blocks_to_send``). If token 0 already ends the request,
   ABORT is sent instead.
5. When the last frame has left, the ``PrefillResult`` future resolves with token 0 and the
   timings (queue, prefill, transfer, and when each group of layers was queued and left:
   ``kv_sends``, the trace's ``kv send`` spans). A failed send fails that future with
   TransferError; a request that made the step fail (the engine aborts it alone) fails it
   with ``RequestFaultError`` and its reservation gets ABORT.
``abort(request_id)`` is idempotent: a queued or running prompt is dropped and its blocks freed.
A queued or running prompt whose deadline passes is dropped the same way (its future fails with
``RequestAborted``); if the engine loop dies, every pending future fails with the error and the
worker refuses new work (its stats carry the error).

A migrated request arrives with ``output_token_ids``: P computes prompt + those tokens and
samples the next output position, which is the new token 0 of that attempt.

Tensor parallel groups on either side (this worker's engine on several ranks, or a reservation
naming several decode rank endpoints): each rank ships only the K/V heads each decode rank
holds (``prefill_worker.ranks``; rank 0 hands its followers the step's shipments with the
batch), the COMMIT goes to the decode worker's rank 0 marked sharded, and every other channel
a rank used closes its share of the key.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from pdserve.engine.config import EngineConfig
from pdserve.engine.engine_loop import EngineDeadError, EngineLoop
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.parts import EngineParts
from pdserve.engine.sampling.grammar import Constraint, grammar_timing
from pdserve.engine.step.hooks import StepHooks
from pdserve.engine.step.scheduler_output import ScheduledSequence
from pdserve.engine.step.scheduling_policy import PrefillOnlyPolicy
from pdserve.engine.worker_stats import engine_stats
from pdserve.kv_transfer import KVConnector, KVSender, TransferError, TransferKey
from pdserve.models.tensor_parallel import TensorShard
from pdserve.prefill_worker.ranks import Routes, Shipment, StepShipments
from pdserve.worker_api import (
    MAX_KV_SENDS,
    DuplicateRequestId,
    KVSend,
    PrefillResult,
    RequestDelta,
    RequestFaultError,
    Reservation,
    WorkerStats,
    WorkRequest,
)

logger = logging.getLogger(__name__)


class RequestAborted(RuntimeError):
    """The request was aborted before its prefill finished."""


@dataclass
class _LayerSend:
    """One frame of layers of a request's KV, as this rank shipped it on its routes."""

    first_layer: int
    end_layer: int
    queued_at: float  # packing began
    num_bytes: int
    left_at: list[float] = field(default_factory=list)  # each route's copy left (sender thread)


@dataclass
class _Target:
    """Where one request's KV goes, and what its transfer has cost so far."""

    reservation: Reservation
    result: Future  # Future[PrefillResult]
    routes: Routes  # where this rank's heads of the KV go
    arrival: float = field(default_factory=time.monotonic)
    frames: list[Future] = field(default_factory=list)
    bytes_sent: int = 0
    num_stand_ins: int = 0  # leading shipped blocks that hold no KV (freed here), for COMMIT
    sends: list[_LayerSend] = field(default_factory=list)  # its frames of layers, in order

    @property
    def sender(self) -> KVSender:
        """The channel to the decode worker's rank 0: the COMMIT's."""
        return self.routes.sends[0][0]

    @property
    def key(self) -> TransferKey:
        return TransferKey(self.reservation.transfer_id, self.reservation.epoch)


class PrefillWorker(StepHooks):
    """See the module docstring for the lifecycle. It runs the engine's one step; its
    :class:`StepHooks` methods ship the KV of the prompts each step completes."""

    role = "prefill"

    @staticmethod
    def config_for(config: EngineConfig) -> EngineConfig:
        """A prefill worker never decodes: no decode CUDA graphs, no speculative draft (so
        its pool budget keeps no room for one)."""
        return dataclasses.replace(config, enforce_eager=True, speculative_config=None)

    def __init__(self, worker_id: str, parts: EngineParts, connector: KVConnector,
                 overlap: bool = True, layers_per_frame: int = 1):
        if layers_per_frame < 1:
            raise ValueError(f"layers_per_frame must be >= 1, got {layers_per_frame}")
        self.worker_id = worker_id
        self.engine = LLMEngine(parts, policy=PrefillOnlyPolicy(parts.config.scheduling_policy),
                                hooks=self, defer_text=False)  # token 0's text, now
        self.connector = connector
        self.overlap = overlap
        self.layers_per_frame = layers_per_frame
        self.frames = frame_ranges(parts.runner.kv_caches, layers_per_frame)
        self.ranks = self.engine.ranks  # the follower ranks (None on one rank)
        self.model_config = parts.model_config
        self.shard = TensorShard(0, parts.config.tensor_parallel_size)
        self._frame_ending = {end - 1: (start, end) for start, end in self.frames}
        self._targets: dict[str, _Target] = {}
        self._shipments: list[tuple[_Target, torch.Tensor]] = []  # this step's, in sampling order
        self._sampled_at = 0.0
        self.loop = EngineLoop(f"prefill-{worker_id}", self.engine.step,
                               self.engine.has_unfinished_requests, tick=self._tick,
                               stats=self._stats, on_death=self._fail_everything,
                               watch=self.engine.broken,
                               step_timeout_s=parts.config.step_timeout_s)
        self.loop.start()  # (after self.loop is set: the loop's first tick reads it)

    # -- public API (any thread) --------------------------------------------------------------
    def prefill(self, request: WorkRequest, reservation: Reservation) -> Future:
        """Future[PrefillResult]: resolves once token 0 is sampled and the KV has been sent.
        A constrained request's grammar compiles first, off the loop
        (``LLMEngine.then_prepared``), and its LoRA adapter is read."""
        result: Future = Future()
        admitted = self.engine.then_prepared(
            request, lambda constraint: self.loop.call(self._admit, request, reservation,
                                                              result, constraint))
        admitted.add_done_callback(
            lambda f: f.exception() is not None and not result.done()
            and result.set_exception(f.exception()))
        return result

    def abort(self, request_id: str) -> Future:
        return self.loop.call(self._abort, request_id)

    def stats(self) -> Future:
        return self.loop.call(self._stats)

    def snapshot(self) -> WorkerStats:
        """The latest published stats, without waiting for the engine loop."""
        return self.loop.snapshot()

    def close(self) -> None:
        self.loop.stop()
        self.connector.close()
        self._fail_everything("the prefill worker was closed")  # the loop has stopped

    # -- loop thread --------------------------------------------------------------------------
    def _admit(self, request: WorkRequest, reservation: Reservation, result: Future,
               constraint: Constraint | None) -> None:
        if request.request_id in self._targets:
            raise DuplicateRequestId(f"request_id {request.request_id!r} is already held here")
        routes = Routes(self.model_config, self.shard, self.connector,  # connect lazily
                        _addresses(reservation))
        self.engine.add_work(request, constraint)
        self._targets[request.request_id] = _Target(reservation, result, routes)

    def _abort(self, request_id: str, why: str = "aborted") -> None:
        target = self._targets.pop(request_id, None)
        self.engine.abort(request_id)
        if target is not None and not target.result.done():
            target.result.set_exception(RequestAborted(f"{request_id} {why}"))

    def _tick(self) -> None:
        for delta in self.engine.expire(time.time()):
            self._abort(delta.request_id, "dropped: its deadline passed")

    def _fail_everything(self, error: str) -> None:
        """The loop died or stopped: fail every pending future (engine state not touched)."""
        targets, self._targets = self._targets, {}
        for target in targets.values():
            if not target.result.done():
                target.result.set_exception(EngineDeadError(error))

    # -- StepHooks: the engine's one step calls these around its forward ----------------------
    def before_forward(self, sampling: list[ScheduledSequence]):
        """Open the shipments of the prompts that complete this step; with ``overlap``, each
        frame of layers ships as soon as the forward has written it."""
        self._shipments = [(self._targets[item.seq.request_id], self._blocks_to_send(item.seq))
                           for item in sampling]
        if self.ranks is not None and self._shipments:
            self.ranks.step_extras = StepShipments(tuple(self.frames), tuple(
                Shipment(t.key.transfer_id, t.key.epoch, _addresses(t.reservation),
                         tuple(ids.tolist())) for t, ids in self._shipments))
        if not (self.overlap and self._shipments):
            return None

        def after_layer(layer: int) -> None:
            if layer in self._frame_ending:
                self._send_layers(*self._frame_ending[layer])
        return after_layer

    def after_forward(self) -> None:
        if not self.overlap:
            for start, end in self.frames:
                self._send_layers(start, end)
        self._sampled_at = time.monotonic()

    def after_sample(self, sampling: list[ScheduledSequence],
                     deltas: list[RequestDelta]) -> list[RequestDelta]:
        for item, delta in zip(sampling, deltas, strict=True):
            self._finish_prefill(item, delta, self._sampled_at)
        self._shipments = []
        return []  # token 0 reaches the router in the PrefillResult, not as a delta

    def _blocks_to_send(self, seq) -> torch.Tensor:
        """The prompt's blocks after those the decode worker's prefix cache holds. A block
        already out of the window (None: freed here) is sent as a stand-in, block 0's
        contents, so the shipment maps one to one onto the reservation. The target counts
        the blocks up to the last stand-in for the COMMIT (None entries are a leading run: a
        window frees from the front, a prefix hit's dead blocks are its first), and the
        decode worker frees those unhashed (``BlockManager.adopt_received``)."""
        target = self._targets[seq.request_id]
        table = seq.block_table[target.reservation.num_cached_blocks:]
        target.num_stand_ins = max((i + 1 for i, b in enumerate(table) if b is None), default=0)
        ids = [0 if b is None else b for b in table]
        return torch.tensor(ids, dtype=torch.int64, device=self.engine.device)

    def _send_layers(self, start: int, end: int) -> None:
        caches = self.engine.kv_caches
        for target, block_ids in self._shipments:
            queued_at = time.monotonic()
            frames, nbytes = target.routes.ship(target.key, caches, block_ids, start, end)
            send = _LayerSend(start, end, queued_at, nbytes)
            for frame in frames:
                frame.add_done_callback(lambda _, s=send: s.left_at.append(time.monotonic()))
            target.sends.append(send)
            target.frames += frames
            target.bytes_sent += nbytes

    def _finish_prefill(self, item: ScheduledSequence, delta: RequestDelta,
                        sampled_at: float) -> None:
        seq = item.seq
        target = self._targets.pop(seq.request_id)
        target.frames += target.routes.end_shares(target.key, skip=1)  # other decode ranks
        if delta.faulted:  # the request made the step fail: the engine aborted it, alone
            target.frames.append(target.sender.send_abort(target.key))
            target.result.set_exception(RequestFaultError(f"{seq.request_id}: {delta.error}"))
            return
        if seq.is_finished and seq.sampling_params.num_sequences == 1:
            # token 0 ended the request: D's reservation is not needed
            target.frames.append(target.sender.send_abort(target.key))
        else:  # (n > 1: the decode worker forks the others from the prompt's KV even when
            # token 0 ended the first sequence; the engine frees a finished one itself)
            if not seq.is_finished:
                self.engine.hand_off(seq)  # payloads are copies: its blocks are free now
            target.frames.append(target.sender.send_commit(
                target.key, delta.new_token_ids[0], sharded=target.routes.sharded,
                num_stand_ins=target.num_stand_ins))
        timings = (seq.first_scheduled_time - target.arrival,
                   sampled_at - seq.first_scheduled_time)
        last = target.frames[-1]
        last.add_done_callback(lambda f: self._resolve(target, seq, delta, timings, sampled_at, f))

    def _resolve(self, target: _Target, seq, delta: RequestDelta, timings, sampled_at: float,
                 last: Future) -> None:
        """On the sender thread, once the last frame left (or failed)."""
        # Frames leave in order on one sender thread: every earlier frame is done too.
        failed = next((f.exception() for f in target.frames if f.exception()), None)
        if target.result.done():
            return
        if failed is not None:
            target.result.set_exception(TransferError(f"{seq.request_id}: {failed}"))
            return
        target.result.set_result(PrefillResult(
            seq.request_id, delta, queue_time_s=timings[0], prefill_time_s=timings[1],
            transfer_time_s=time.monotonic() - sampled_at, transfer_bytes=target.bytes_sent,
            num_cached_tokens=seq.num_cached_tokens, prefix_source=seq.prefix_source,
            kv_sends=kv_send_groups(target.sends, seq.first_scheduled_time),
            **grammar_timing(seq.constraint)))

    def _stats(self) -> WorkerStats:
        return engine_stats(self.worker_id, self.role, self.engine)


def _addresses(reservation: Reservation) -> tuple[str, ...]:
    """The decode worker's rank endpoints (its one endpoint when it is not split)."""
    return reservation.rank_addresses or (reservation.transfer_address,)


def kv_send_groups(sends: list[_LayerSend], origin: float,
                   max_groups: int = MAX_KV_SENDS) -> tuple[KVSend, ...]:
    """A request's frames of layers as at most ``max_groups`` sends of consecutive layers, in
    seconds after ``origin`` (its first chunk scheduled)."""
    per_group = -(-len(sends) // max_groups) if sends else 1
    groups = [sends[i:i + per_group] for i in range(0, len(sends), per_group)]
    return tuple(KVSend(
        group[0].first_layer, group[-1].end_layer, group[0].queued_at - origin,
        max((t for s in group for t in s.left_at), default=group[-1].queued_at) - origin,
        sum(s.num_bytes for s in group)) for group in groups)


def frame_ranges(caches, layers_per_frame: int) -> list[tuple[int, int]]:
    """Split the layers into frames of at most ``layers_per_frame`` layers of one dtype
    (int8 pools may keep their first and last layers in the model dtype)."""
    ranges, start = [], 0
    for layer in range(1, len(caches) + 1):
        if (layer == len(caches) or layer - start == layers_per_frame
                or caches[layer].kv.dtype != caches[start].kv.dtype):
            ranges.append((start, layer))
            start = layer
    return ranges
