"""The decode worker: holds reservations, receives KV, runs continuous batching.

Lifecycle of one request on a decode worker D:

1. ``reserve(request, router)``: validate it against D's pool, allocate blocks for its prompt
   (plus the outputs already streamed, for a migrated request) under a lease (``lease_s``) and
   a fresh ``TransferKey(transfer_id, epoch)``; the sequence waits in ``_reserved`` with status
   ``WAITING_FOR_KV``; the sink now accepts frames for the key; ``router`` owns the request
   (``streaming_worker.mailboxes``: its deltas go to that router's polls). While the prefill
   worker holds the request (queued or running), the router renews the lease (``renew``), so
   it lapses only when its owner is gone: invariant, a live router with a live prefill call
   never sees its reservation expire.
2. KV frames arrive on the transfer endpoint's receive threads and are scattered straight into
   the reserved blocks (``ReservedBlocksSink``); frames for unknown or stale keys are dropped.
3. COMMIT (token 0 from the prefill worker) hands the request to the loop thread: token 0 is
   appended, ``num_computed_tokens`` = every token before it, the blocks the COMMIT names
   stand-ins (a windowed prompt's blocks the prefill worker had freed) are freed, the rest
   hashed, and the sequence joins the running batch.
4. Every step decodes the running batch; token deltas (stamped with the request's attempt) go
   to the bounded outbox, which the routers drain in batches (``poll``), each getting its own
   requests' deltas, so a slow client never stalls the loop.
5. The request ends by stop/length (blocks freed by the scheduler), ``abort`` (idempotent in
   every state), or on its own with an ``abort`` delta carrying the error: transfer failure,
   lease expiry, its deadline passing (reserved or running), its router not polling for
   ``orphan_timeout_s`` (the clock is per router: another router's polls do not keep it
   alive), or the engine loop dying (every request fails, the worker refuses new work and
   reports the error in its stats). Every end makes a final delta, which ends the request's
   owner entry when a poll sorts it.

A tensor parallel decode worker (its engine a group of ranks) mirrors each reservation onto its
follower ranks, each receiving its own K/V heads on its own endpoint (``decode_worker.ranks``);
step 3 then waits until every rank has reported its heads in.

Instead of 1-3, ``submit(request, router)`` queues a prompt to prefill here, chunked into the
decode steps as on a colocated worker, its token 0 streamed from here (the router's conditional
disaggregation, ``router.pairing.prefill_location``).

D keeps a prefix cache like any engine (unless ``enable_prefix_caching`` is off): a request's
blocks are hashed once it runs (its KV is in; stand-ins are freed, never hashed), and stay
cached after it ends, those out of the window too. In step 1 the
leading blocks of a new reservation that the cache holds are shared, not allocated; the
reservation says how many (``num_cached_blocks``), the prefill worker sends only the blocks
after them, and the sink expects only those. At least one block is always sent (the prefix
match leaves the prompt's last token out).

All engine state is touched only on the loop thread (``EngineLoop``); public methods return
futures.
"""

from __future__ import annotations

import itertools
import logging
import random
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

from pdserve.decode_worker.ranks import TRANSFER_ADDRESS, report_name
from pdserve.engine.engine_loop import EngineLoop
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.parts import EngineParts
from pdserve.engine.sampling.grammar import Constraint, grammar_timing
from pdserve.engine.sequence import Sequence, SequenceStatus
from pdserve.engine.step.scheduling_policy import DecodePolicy
from pdserve.engine.worker_stats import engine_stats
from pdserve.kv_transfer import KVReceiver, ReservedBlocksSink, TransferError, TransferKey
from pdserve.streaming_worker.mailboxes import RouterMailboxes
from pdserve.streaming_worker.worker import ForkOwners, StreamingWorker
from pdserve.worker_api import (
    NoRoomNow,
    RequestDelta,
    Reservation,
    WorkerStats,
    WorkRequest,
    choice_request_id,
)

logger = logging.getLogger(__name__)


@dataclass
class _Reserved:
    """A reservation waiting for its KV."""

    seq: Sequence
    key: TransferKey
    lease_deadline: float  # time.time()


class DecodeWorker(StreamingWorker):
    """See the module docstring for the lifecycle."""

    role = "decode"

    def __init__(self, worker_id: str, parts: EngineParts,
                 make_endpoint: Callable[[ReservedBlocksSink], KVReceiver],
                 lease_s: float = 60.0, orphan_timeout_s: float = 30.0):
        self.worker_id = worker_id
        self.mailboxes = RouterMailboxes()
        self.engine = LLMEngine(parts, policy=DecodePolicy(parts.config.scheduling_policy),
                                hooks=ForkOwners(self.mailboxes))
        self.lease_s = lease_s
        self.orphan_timeout_s = orphan_timeout_s
        self.sink = ReservedBlocksSink(self.engine.kv_caches, on_complete=self._on_kv_complete,
                                       on_failure=self._on_kv_failed)
        self.endpoint = make_endpoint(self.sink)
        self.ranks = self.engine.ranks  # the follower ranks (None on one rank)
        self.rank_addresses: tuple[str, ...] = () if self.ranks is None else (
            self.endpoint.address, *self.ranks.published(TRANSFER_ADDRESS))
        # rank 0's heads in: (token 0, stand-ins) of its COMMIT
        self._waiting_ranks: dict[TransferKey, tuple[int, int]] = {}
        self.epoch = random.getrandbits(62)  # this incarnation: older frames never match
        self._transfer_ids = itertools.count(1)
        self._reserved: dict[str, _Reserved] = {}
        # requests whose grammar compiles before they reserve -> aborted meanwhile
        self._compiling: dict[str, bool] = {}
        self._compiling_lock = threading.Lock()  # (reserve's callers and the loop)
        self._by_key: dict[TransferKey, str] = {}
        self.loop = EngineLoop(f"decode-{worker_id}", self.engine.step,
                               self.engine.has_unfinished_requests, tick=self._tick,
                               stats=self._stats, on_death=self._fail_everything,
                               watch=self.engine.broken,
                               step_timeout_s=parts.config.step_timeout_s)
        self.loop.start()  # (after self.loop is set: the loop's first tick reads it)

    # -- public API (any thread) --------------------------------------------------------------
    def reserve(self, request: WorkRequest, router: str = "") -> Future:
        """Future[Reservation]; fails with NeverFits or NoRoomNow when it declines, and with
        DuplicateRequestId when the id is held here already (reserved, submitted or running).
        ``router`` (its actor name) owns the request once reserved. A constrained request's
        grammar compiles (and its LoRA adapter is read) first, off the loop
        (``LLMEngine.then_prepared``); an abort
        that arrives meanwhile stops it before it holds any block."""
        request_id = request.request_id
        if request.params.structured_outputs is not None:
            with self._compiling_lock:
                self._compiling[request_id] = False
        reserved = self.engine.then_prepared(
            request, lambda constraint: self.loop.call(self._reserve, request, router,
                                                              constraint))
        if request.params.structured_outputs is not None:
            reserved.add_done_callback(lambda _: self._compiled(request_id))
        return reserved

    def renew(self, request_id: str) -> Future:
        """Future[float | None]: the reservation's new lease deadline (None: not reserved)."""
        return self.loop.call(self._renew, request_id)

    def abort(self, request_id: str) -> Future:
        return self.loop.call(self._abort, request_id)

    def close(self) -> None:
        self.endpoint.close()
        self.sink.close()
        self.loop.stop()

    # -- loop thread ------------------------------------------------------------------------
    def _compiled(self, request_id: str) -> bool:
        """Forget a request whose grammar was compiling; True when it was aborted meanwhile."""
        with self._compiling_lock:
            return self._compiling.pop(request_id, False)

    def _reserve(self, request: WorkRequest, router: str,
                 constraint: Constraint | None) -> Reservation:
        if constraint is not None and self._compiled(request.request_id):
            raise RuntimeError(f"{request.request_id} was aborted while its grammar compiled")
        seq = self.engine.sequence_for(request, constraint)
        self.mailboxes.claim(seq.request_id, seq.attempt, router)  # DuplicateRequestId first
        try:
            return self._reserve_claimed(seq)
        except BaseException:
            self.mailboxes.release(seq.request_id)
            raise

    def _reserve_claimed(self, seq: Sequence) -> Reservation:
        try:
            num_cached = self.engine.reserve_blocks(seq)
        except NoRoomNow as exc:
            raise NoRoomNow(f"decode worker {self.worker_id}: {exc}") from None
        seq.status = SequenceStatus.WAITING_FOR_KV
        key = TransferKey(next(self._transfer_ids), self.epoch)
        to_receive = list(seq.block_table[num_cached:])  # the cached prefix is here already
        self.sink.expect(key, to_receive)
        if self.ranks is not None:
            self.ranks.call_ranks("expect", key.transfer_id, key.epoch, to_receive)
        deadline = time.time() + self.lease_s
        self._reserved[seq.request_id] = _Reserved(seq, key, deadline)
        self._by_key[key] = seq.request_id
        return Reservation(seq.request_id, self.worker_id, self.endpoint.address,
                           key.transfer_id, key.epoch, len(seq.block_table), deadline,
                           self.rank_addresses, num_cached_blocks=num_cached,
                           prefix_source=seq.prefix_source,
                           **grammar_timing(seq.constraint))

    def _release(self, request_id: str) -> _Reserved | None:
        entry = self._reserved.pop(request_id, None)
        if entry is not None:
            self._by_key.pop(entry.key, None)
            self.sink.forget(entry.key)
            self._waiting_ranks.pop(entry.key, None)
            if self.ranks is not None:
                self.ranks.call_ranks("forget", entry.key.transfer_id, entry.key.epoch)
                self.ranks.clear_reports(report_name(entry.key))
            self.engine.release_blocks(entry.seq)
            entry.seq.status = SequenceStatus.FINISHED_ABORTED
        return entry

    def _abort(self, request_id: str) -> None:
        """The router's abort: its final delta (no error) only ends the owner entry."""
        with self._compiling_lock:
            if request_id in self._compiling:  # (its reserve stops once the grammar is ready)
                self._compiling[request_id] = True
        entry = self._release(request_id)
        self.loop.outbox.put_many(self.engine.abort_request(request_id) if entry is None
                                  else [_final(entry.seq, None)])

    def _renew(self, request_id: str) -> float | None:
        entry = self._reserved.get(request_id)
        if entry is None:
            return None
        entry.lease_deadline = time.time() + self.lease_s
        return entry.lease_deadline

    def _fail(self, request_id: str, error: str, deadline_exceeded: bool = False) -> None:
        """End a reservation on D's own initiative; the router learns why from the delta."""
        entry = self._release(request_id)
        if entry is not None:
            logger.warning("request %s failed on %s: %s", request_id, self.worker_id, error)
            delta = _final(entry.seq, error)
            delta.deadline_exceeded = deadline_exceeded
            self.loop.outbox.put_many([delta])

    def _fail_request(self, request_id: str, error: str) -> None:
        """A reservation or a running request ends with ``error`` (its router is gone)."""
        if request_id in self._reserved:
            self._fail(request_id, error)
            return
        deltas = self.engine.abort_request(request_id)
        for delta in deltas:
            delta.error = error
        self.loop.outbox.put_many(deltas)

    def _fail_everything(self, error: str) -> None:
        """Every reservation and running request ends with ``error`` (the loop died)."""
        for request_id in list(self._reserved):
            self._fail(request_id, error)
        self.loop.outbox.put_many(self.engine.abort_all(error))

    def _commit(self, key: TransferKey, first_token_id: int, num_stand_ins: int) -> None:
        if key not in self._by_key:  # aborted or expired meanwhile
            return
        if self.ranks is not None and not self._ranks_in(key, first_token_id, num_stand_ins):
            return  # (a follower's heads still on the way: _tick looks again)
        request_id = self._by_key[key]  # until it runs, a failure releases it as reserved
        try:
            # token 0 was streamed by the prefill worker: its delta is not sent again
            self.engine.start_running(self._reserved[request_id].seq, first_token_id,
                                      num_stand_ins)
        except Exception as exc:  # noqa: BLE001 - the request learns why; nothing leaks
            logger.exception("commit of %s failed", request_id)
            seq = self._reserved[request_id].seq
            for index in range(1, seq.sampling_params.num_sequences):  # forks it made, if any
                self.mailboxes.release(choice_request_id(request_id, index))  # (no deltas)
            self._fail(request_id, f"commit failed: {exc!r}")
            return
        self._by_key.pop(key, None)
        self._reserved.pop(request_id)

    def _ranks_in(self, key: TransferKey, first_token_id: int, num_stand_ins: int) -> bool:
        """Whether every follower rank has its heads of ``key`` (rank 0's are in); a rank that
        failed fails the request. Not yet: the key waits in ``_waiting_ranks``."""
        reports = self.ranks.reports(report_name(key))
        failed = next((r for r in reports if r), None)
        if failed is None and None in reports:
            self._waiting_ranks[key] = (first_token_id, num_stand_ins)
            return False
        self._waiting_ranks.pop(key, None)
        if failed is not None:  # (its release clears the reports)
            self._fail(self._by_key[key], f"KV transfer failed on a tensor parallel rank: "
                                          f"{failed}")
            return False
        self.ranks.clear_reports(report_name(key))
        return True

    def _tick(self) -> None:
        for key, (first_token_id, num_stand_ins) in list(self._waiting_ranks.items()):
            self._commit(key, first_token_id, num_stand_ins)
        now = time.time()
        for request_id, entry in list(self._reserved.items()):
            if entry.seq.deadline is not None and entry.seq.deadline < now:
                self._fail(request_id, "the request's deadline passed", deadline_exceeded=True)
            elif entry.lease_deadline < now:
                self._fail(request_id, "reservation lease expired before the KV arrived")
        self.loop.outbox.put_many(self.engine.expire(now))
        self._free_orphans()

    def _stats(self) -> WorkerStats:
        return engine_stats(self.worker_id, self.role, self.engine, len(self._reserved),
                            self.endpoint.address)

    # -- receive threads ----------------------------------------------------------------------
    def _on_kv_complete(self, key: TransferKey, first_token_id: int,
                        num_stand_ins: int) -> None:
        self.loop.call(self._commit, key, first_token_id, num_stand_ins)

    def _on_kv_failed(self, key: TransferKey, error: TransferError) -> None:
        request_id = self._by_key.get(key)
        if request_id is not None:
            self.loop.call(self._fail, request_id, f"KV transfer failed: {error}")


def _final(seq: Sequence, error: str | None) -> RequestDelta:
    """The final ``abort`` delta of a reservation that ends before it runs."""
    return RequestDelta(seq.request_id, [], "", "abort", num_prompt_tokens=seq.num_prompt_tokens,
                        num_output_tokens=seq.num_output_tokens, error=error,
                        attempt=seq.attempt)
