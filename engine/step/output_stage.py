"""The step's one output stage: sampled tokens in, deltas out.

Whatever a step computed (a prefill chunk's first token, a decode's next token, a speculating
decode's accepted drafts and the target's own token, the persistent rows' tokens of a pure
decode step), its tokens reach the requests here and only here: each token is appended, its
text made when a stop string needs it, the stop rules applied (finishing the request in the
scheduler when one holds) and the request's delta built. A request that makes its step fail
(its stop rules or text raise, its sampling fails, its logits are not finite) is aborted here
alone, with a final delta saying why.

The stage also owns which requests the engine makes output for (:meth:`track`,
:meth:`untrack`): a request is tracked from its admission until its final delta.
"""

from __future__ import annotations

import dataclasses
import logging
import time

from pdserve.engine.sequence import Sequence, SequenceStatus
from pdserve.engine.step.decode_rows import DecodeRows
from pdserve.engine.step.scheduler import Scheduler
from pdserve.engine.step.text_stage import TextStage
from pdserve.worker_api import DuplicateRequestId, RequestDelta, StepDeltas

logger = logging.getLogger(__name__)

Logprobs = dict[int, float]


def merge_deltas(parts: list[RequestDelta]) -> RequestDelta:
    """One delta for the tokens one request got this step (the last one's status)."""
    if len(parts) == 1:
        return parts[0]
    logprobs = None if any(d.logprobs is None for d in parts) else \
        [entry for d in parts for entry in d.logprobs]
    return dataclasses.replace(parts[-1], new_token_ids=[t for d in parts for t in d.new_token_ids],
                               text="".join(d.text for d in parts), logprobs=logprobs)


class OutputStage:
    """Stop rules and deltas of the requests one engine tracks."""

    def __init__(self, scheduler: Scheduler, text: TextStage, eos_token_ids,
                 max_model_len: int) -> None:
        self.scheduler = scheduler
        self.text = text
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.sequences: dict[str, Sequence] = {}  # request_id -> every tracked request

    # -- which requests ---------------------------------------------------------------------

    def track(self, seq: Sequence) -> None:
        """Start detokenizing and stop-checking ``seq``'s output (resumed outputs replayed, so
        text and stop-string hold-back continue where the previous worker left them)."""
        if seq.request_id in self.sequences:
            raise DuplicateRequestId(f"request_id {seq.request_id!r} is already running")
        self.sequences[seq.request_id] = seq
        self.text.track(seq)

    def untrack(self, request_id: str) -> Sequence | None:
        """Stop following a request (it left this engine: handed off or aborted elsewhere);
        its text state goes too."""
        seq = self.sequences.pop(request_id, None)
        if seq is not None:
            self.text.drop(request_id, seq.attempt)
        return seq

    def abort(self, request_id: str) -> RequestDelta | None:
        """Idempotent: frees the request's blocks; returns its final delta if it was live."""
        seq = self.untrack(request_id)
        self.scheduler.abort(request_id)
        if seq is None:
            return None
        return RequestDelta(request_id, [], "", "abort", None, seq.num_prompt_tokens,
                            seq.num_output_tokens, attempt=seq.attempt)

    def handed_back(self, bounced: list[Sequence]) -> list[RequestDelta]:
        """Final deltas of sequences the scheduler preempted by handing them back."""
        deltas = []
        for seq in bounced:
            self.sequences.pop(seq.request_id, None)  # its final delta closes its text
            self.text.finish(seq.request_id)
            deltas.append(RequestDelta(seq.request_id, [], "", "abort", None,
                                       seq.num_prompt_tokens, seq.num_output_tokens,
                                       error="preempted: no free KV blocks on this worker",
                                       attempt=seq.attempt, preempted=True))
        return deltas

    # -- tokens in, deltas out ----------------------------------------------------------------

    def emit(self, seqs: list[Sequence], token_ids: list[list[int]],
             logprobs: list[list[Logprobs] | None], faults: dict[int, Exception]
             ) -> list[RequestDelta]:
        """One delta per sequence of ``seqs``: ``token_ids[i]`` (one token, or a speculating
        decode's accepted tokens) appended to ``seqs[i]`` up to the first that finishes it;
        ``faults[i]``: ``seqs[i]`` failed in this step and ends with that error instead."""
        now = time.monotonic()
        deltas = []
        for i, seq in enumerate(seqs):
            if i in faults:
                deltas.append(self.fault(seq, faults[i]))
                continue
            entries = logprobs[i]
            try:
                parts = []
                for j, token_id in enumerate(token_ids[i]):
                    seq.token_ids.append(token_id)
                    parts.append(self.appended(seq, token_id,
                                               None if entries is None else entries[j], now))
                    if seq.is_finished:
                        break
                deltas.append(merge_deltas(parts))
            except Exception as exc:  # noqa: BLE001 - stop rules or text of this request alone
                deltas.append(self.fault(seq, exc))
        return deltas

    def emit_rows(self, rows: DecodeRows, token_ids: list[int],
                  logprobs: list[Logprobs | None] | None,
                  faults: dict[int, Exception]) -> tuple[StepDeltas, list[int]]:
        """The deltas of a pure decode step's rows, whose tokens ``rows.advance`` appended:
        one compact delta for the rows that go on, the per-token path (:meth:`appended`) for
        the rows a token may end, those with their own stop rules and those at fault (which
        end failed). Returns the deltas and the rows that ended."""
        if not self.text.defers:  # every token's text is made in the step
            per_token = list(range(len(rows)))
        else:
            per_token = rows.ending(self.eos_token_ids).tolist()
            if faults:
                per_token = sorted(set(per_token).union(faults))
        deltas = rows.new_token_deltas(token_ids, per_token)
        ended = []
        if per_token:
            now = time.monotonic()
            for i in per_token:
                seq = rows.seqs[i]
                if i in faults:
                    deltas.append(self.fault(seq, faults[i]))
                else:
                    try:
                        deltas.append(self.appended(seq, token_ids[i],
                                                    logprobs[i] if logprobs else None, now))
                    except Exception as exc:  # noqa: BLE001 - this request alone
                        deltas.append(self.fault(seq, exc))
                if seq.is_finished:
                    ended.append(i)
        rows.first_tokens_sent()
        return deltas, ended

    def append_token(self, seq: Sequence, token_id: int, logprobs: Logprobs | None,
                     now: float) -> RequestDelta:
        """Append ``token_id`` to ``seq`` and return its delta (:meth:`appended`)."""
        seq.token_ids.append(token_id)
        return self.appended(seq, token_id, logprobs, now)

    def appended(self, seq: Sequence, token_id: int, logprobs: Logprobs | None,
                 now: float) -> RequestDelta:
        """``token_id``, now the last of ``seq.token_ids``: its text, the stop rules (the
        request finishes when one holds) and its delta. Runs once per sequence per step
        outside the compact rows: keep it lean."""
        if seq.constraint is not None and not seq.constraint.accept(token_id):
            raise ValueError(f"token {token_id} breaks the request's structured_outputs")
        timings = None
        if seq.first_token_time is None:
            seq.first_token_time = now
            if seq.first_scheduled_time is not None:  # prefilled here: where TTFT went
                timings = (seq.first_scheduled_time - seq.arrival_time,
                           now - seq.first_scheduled_time)
        if logprobs is not None:
            seq.output_logprobs.append(logprobs)
        text, stopped = self.text.append(seq.request_id, token_id)
        num_output = len(seq.token_ids) - seq.num_prompt_tokens
        status = self.stop_status(seq, token_id, stopped, num_output)
        if status is not None:
            text += self.text.finish(seq.request_id)  # held back text ("" after a stop)
            self.scheduler.finish(seq, status)
            self.sequences.pop(seq.request_id, None)  # its final delta closes its text
        delta = RequestDelta(seq.request_id, [token_id], text,
                             status.finish_reason if status else None,
                             [logprobs] if logprobs is not None else None,
                             seq.num_prompt_tokens, num_output, attempt=seq.attempt)
        if timings is not None:
            delta.queue_time_s, delta.prefill_time_s = timings
            delta.prefix_source = seq.prefix_source
        if seq.prompt_logprobs is not None:  # the first output carries the prompt's
            delta.prompt_logprobs, seq.prompt_logprobs = seq.prompt_logprobs, None
        return delta

    def stop_status(self, seq: Sequence, token_id: int, stop_string_hit: bool,
                    num_output: int) -> SequenceStatus | None:
        params = seq.sampling_params
        if stop_string_hit or (params.stop_token_ids and token_id in params.stop_token_ids):
            return SequenceStatus.FINISHED_STOPPED
        if not params.ignore_eos and token_id in self.eos_token_ids:
            return SequenceStatus.FINISHED_STOPPED
        if seq.constraint is not None and seq.constraint.is_terminated:  # its grammar ended
            return SequenceStatus.FINISHED_STOPPED
        if num_output >= params.max_tokens or len(seq.token_ids) >= self.max_model_len:
            return SequenceStatus.FINISHED_LENGTH
        return None

    def fault(self, seq: Sequence, exc: Exception) -> RequestDelta:
        """Abort ``seq``, which made this step fail, with a final delta saying why."""
        logger.error("request %s failed in a step and is aborted alone", seq.request_id,
                     exc_info=exc)
        delta = self.abort(seq.request_id) or RequestDelta(
            seq.request_id, [], "", "abort", None, seq.num_prompt_tokens,
            seq.num_output_tokens, attempt=seq.attempt)
        delta.error = f"the request failed in the engine: {type(exc).__name__}: {exc}"
        delta.faulted = True
        return delta
