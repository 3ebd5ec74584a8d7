"""Where output text is made: inside the step only when it decides something.

A request with stop strings needs its text inside the step (a stop string ends it, and the
scheduler must know at once). Every other request's text decides nothing, so the step only
appends token ids and :meth:`TextStage.render` makes the text later, on the thread that reads
the deltas: the actor thread that serves ``poll`` on a decode or colocated worker (it runs
while the loop thread is in the next forward: on CUDA the step waits on the device there, and
torch releases the GIL inside its ops), or the offline ``LLM`` between steps. Incremental
detokenization costs about as much per token as a decode step's whole engine overhead per
sequence (docs/cpu-speed.md), so keeping it out of the step matters.

Rules that keep the two threads apart:

- inline detokenizers (stop strings) are touched only by the loop thread;
- deferred ones live under a lock, keyed by (request id, attempt), so a request that comes back
  to this worker in a later attempt never shares state with deltas of the earlier one still
  being read;
- a deferred detokenizer is dropped when its final delta is rendered, or at once when the
  request is aborted here (its returned abort delta may never be read; the router ignores
  the text of an attempt it aborted);
- a request that joins with tokens streamed elsewhere (a migrated request's outputs, a decode
  worker's token 0) replays them first, so text continues where the previous worker left it.
"""

from __future__ import annotations

import threading

from pdserve.engine.sequence import Sequence
from pdserve.engine.step.detokenizer import Detokenizer
from pdserve.worker_api import StepDeltas


class TextStage:
    """Detokenizers of the requests an engine tracks (none without a tokenizer)."""

    def __init__(self, tokenizer, defer: bool = True) -> None:
        self._tokenizer = tokenizer
        self._defer = defer  # False: every request is detokenized in the step
        self._inline: dict[str, Detokenizer] = {}  # loop thread only
        self._deferred: dict[tuple[str, int], Detokenizer] = {}  # under _lock
        self._lock = threading.Lock()

    def track(self, seq: Sequence) -> None:
        """Start following ``seq``'s text; its outputs so far are replayed (no text out)."""
        if self._tokenizer is None:
            return
        stop = seq.sampling_params.stop
        detok = Detokenizer(self._tokenizer, seq.prompt_token_ids, stop=stop)
        for token_id in seq.output_token_ids:
            detok.append(token_id)
        if stop or not self._defer:
            self._inline[seq.request_id] = detok
        else:
            with self._lock:
                self._deferred[seq.request_id, seq.attempt] = detok

    def append(self, request_id: str, token_id: int) -> tuple[str, bool]:
        """In the step: (text, a stop string completed) of an inline request; ("", False)
        for the others (their text comes from :meth:`render`)."""
        detok = self._inline.get(request_id)
        if detok is None:
            return "", False
        piece = detok.append(token_id)
        return piece.text, piece.stopped

    def finish(self, request_id: str) -> str:
        """In the step, when a request ends: an inline request's held-back text (dropped
        here); deferred ones flush in :meth:`render` with their final delta."""
        detok = self._inline.pop(request_id, None)
        return detok.flush() if detok is not None else ""

    def drop(self, request_id: str, attempt: int) -> None:
        """The request left this engine without a final delta to render."""
        self._inline.pop(request_id, None)
        with self._lock:
            self._deferred.pop((request_id, attempt), None)

    @property
    def defers(self) -> bool:
        """Requests without stop strings get their text in :meth:`render`, not in the step."""
        return self._defer or self._tokenizer is None

    def render(self, deltas: StepDeltas) -> StepDeltas:
        """Fill in the text of deferred requests' deltas, in order (any thread), and return
        ``deltas``. Each delta must be rendered once, and a request's in the order made."""
        with self._lock:
            deltas.fill_text(self._piece, self._end)
        return deltas

    def _piece(self, request_id: str, attempt: int, token_id: int) -> str:
        """A deferred request's text of its next token ("" if not deferred: inline, or
        aborted since)."""
        detok = self._deferred.get((request_id, attempt))
        return "" if detok is None else detok.append(token_id).text

    def _end(self, request_id: str, attempt: int) -> str:
        """A deferred request's held-back text, after its final delta's tokens (its
        detokenizer goes)."""
        detok = self._deferred.pop((request_id, attempt), None)
        return "" if detok is None else detok.flush()

    @property
    def num_deferred(self) -> int:
        with self._lock:
            return len(self._deferred)
