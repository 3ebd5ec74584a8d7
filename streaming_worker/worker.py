"""What the decode and colocated workers share: an engine stepping on its own loop thread,
which takes prompts to prefill itself (``submit``), whose deltas the routers poll (each its
own requests', ``streaming_worker.mailboxes``) and whose stats they read, and the per-router
orphan clock that frees the requests of a router gone silent."""

from __future__ import annotations

import functools
import logging
from concurrent.futures import Future

from pdserve.engine.engine_loop import EngineLoop
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.sequence import Sequence
from pdserve.engine.step.hooks import StepHooks
from pdserve.streaming_worker.mailboxes import MailboxSizes, RouterMailboxes
from pdserve.worker_api import RequestDelta, StepDeltas, WorkerStats, WorkRequest

logger = logging.getLogger(__name__)


class ForkOwners(StepHooks):
    """A streaming worker's step hooks: the sequences a request of ``n`` > 1 forks into
    belong to the router that owns the request (``RouterMailboxes.claim_forks``)."""

    def __init__(self, mailboxes: RouterMailboxes) -> None:
        self.mailboxes = mailboxes

    def forked(self, parent: Sequence, children: list[Sequence]) -> None:
        self.mailboxes.claim_forks(parent.request_id, [child.request_id for child in children])


class StreamingWorker:
    """A worker whose ``engine`` steps on ``loop``; subclasses define ``_stats`` and
    ``_fail_request`` (loop thread) and call :meth:`_free_orphans` from their tick."""

    worker_id: str
    engine: LLMEngine
    loop: EngineLoop
    mailboxes: RouterMailboxes
    orphan_timeout_s: float  # a router silent this long is gone: its requests are freed

    def submit(self, request: WorkRequest, router: str = "") -> Future:
        """Queue the request to be prefilled and decoded here: Future[None], done once the
        request is checked and queued for the engine loop, which adds it before its next step.
        The check runs on the caller's thread, so a router placing requests never waits for
        the step in progress. The future holds NeverFits (a ValueError) when the request can
        never be served here, DuplicateRequestId when its id is held here already, or the
        loop's error when it is dead or stopped. ``router`` (its
        actor name) owns the request once queued."""
        done: Future = Future()
        try:
            seq = self.engine.sequence_for(request)  # reads only what the engine never changes
            # claimed before the loop can see it, so its first delta goes to its router; an
            # id held here already is refused (DuplicateRequestId) before anything is queued
            self.mailboxes.claim(request.request_id, request.attempt, router)
        except ValueError as exc:
            done.set_exception(exc)
            return done
        queued = self.loop.call(self._submit, seq)
        if queued.done():  # refused at once: the loop is dead or stopping
            self.mailboxes.release(request.request_id)
            return queued
        queued.add_done_callback(functools.partial(self._submit_ended, request))
        done.set_result(None)
        return done

    def _submit_ended(self, request: WorkRequest, queued: Future) -> None:
        """A submit the caller was told is queued, but the loop never added: it died or
        stopped first (or adding it failed). Its router gets a final delta saying so, as the
        requests already running got theirs from the loop's death (loop thread)."""
        exc = queued.exception()
        if exc is None:
            return
        logger.warning("%s: request %s was queued but never added: %s", self.worker_id,
                       request.request_id, exc)
        self.loop.outbox.put_many([RequestDelta(
            request.request_id, [], "", "abort", None, len(request.prompt_token_ids),
            len(request.output_token_ids), attempt=request.attempt,
            error=f"the engine loop ended before the request was added: {exc}")])

    def _submit(self, seq: Sequence) -> None:
        """Add a checked and claimed request (loop thread)."""
        self.engine.add_sequence(seq)

    def poll(self, timeout: float | None = None, router: str = "") -> StepDeltas:
        """``router``'s deltas: those another router's poll left for it, else what the worker
        produced since the last poll (blocks up to ``timeout`` when none), their text made
        here. One poll at a time (the handle's thread)."""
        self.mailboxes.polled(router)
        mine = self.mailboxes.take(router)
        if mine:
            return mine
        rendered = self.engine.render(self.loop.outbox.drain(timeout))
        mine = self.mailboxes.take(router)
        mine.extend(self.mailboxes.sort(rendered, router))
        return mine

    def mailbox_sizes(self) -> MailboxSizes:
        return self.mailboxes.sizes()

    def stats(self) -> Future:
        """Future[WorkerStats], taken on the loop thread."""
        return self.loop.call(self._stats)

    def snapshot(self) -> WorkerStats:
        """The latest published stats, without waiting for the engine loop."""
        return self.loop.snapshot()

    def _stats(self) -> WorkerStats:
        raise NotImplementedError

    def _fail_request(self, request_id: str, error: str) -> None:
        """End one request on the worker's own initiative; its final delta says why."""
        raise NotImplementedError

    def _free_orphans(self) -> None:
        """Fail every request of a router that has not polled for ``orphan_timeout_s``."""
        for silent in self.mailboxes.silent(self.orphan_timeout_s):
            why = (f"router {silent.router or '(unnamed)'} has not polled this worker for "
                   f"{silent.silent_s:.0f} s (orphan_timeout_s {self.orphan_timeout_s:g})")
            logger.warning("%s: freeing %d request(s): %s", self.worker_id,
                           len(silent.request_ids), why)
            self.mailboxes.forget(silent.router)
            for request_id in silent.request_ids:
                self._fail_request(request_id, why)
