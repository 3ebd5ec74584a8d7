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

from pdserve.engine.detokenizer import Detokenizer
from pdserve.engine.protocol import RequestDelta, StepDeltas, TokenDeltas, expand_deltas
from pdserve.engine.sequence import Sequence


def _key(request_id: str, attempt: int) -> tuple[str, int]:
    return request_id, attempt


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
                self._deferred[_key(seq.request_id, seq.attempt)] = detok

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
            self._deferred.pop(_key(request_id, attempt), None)

    @property
    def defers(self) -> bool:
        """Requests without stop strings get their text in :meth:`render`, not in the step."""
        return self._defer or self._tokenizer is None

    def render(self, deltas: StepDeltas) -> list[RequestDelta]:
        """Expand compact deltas and fill in the text of deferred requests' deltas, in order
        (any thread). Each delta must be rendered once, and a request's in the order made."""
        return expand_deltas(self.render_compact(deltas))

    def render_compact(self, deltas: StepDeltas) -> StepDeltas:
        """:meth:`render` with compact deltas kept compact, their ``texts`` filled in (all ""
        without a tokenizer: nothing is deferred then)."""
        with self._lock:
            for item in deltas:
                if isinstance(item, TokenDeltas):
                    item.texts = self._texts(item)
                else:
                    self._render(item)
        return deltas

    def _texts(self, compact: TokenDeltas) -> list[str]:
        """Each token's text (none of them is final); "" for a request aborted since."""
        deferred = self._deferred
        return [detok.append(token_id).text if detok is not None else ""
                for detok, token_id in zip(
                    map(deferred.get, map(_key, compact.request_ids, compact.attempts)),
                    compact.token_ids, strict=True)]

    def _render(self, delta: RequestDelta) -> None:
        key = _key(delta.request_id, delta.attempt)
        detok = self._deferred.get(key)
        if detok is None:
            return
        for token_id in delta.new_token_ids:
            delta.text += detok.append(token_id).text
        if delta.finish_reason is not None:
            delta.text += detok.flush()
            del self._deferred[key]

    @property
    def num_deferred(self) -> int:
        with self._lock:
            return len(self._deferred)
