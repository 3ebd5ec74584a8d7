r"""What a worker's steps produce for the router: one :class:`RequestDelta` per request per
step, carried in :class:`StepDeltas` (what a step returns, a worker's outbox holds and a poll
ships), which alone chooses how deltas are encoded."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Iterator
from dataclasses import dataclass
from itertools import repeat
from typing import final

import numpy as np

CHOICE_SEPARATOR = "#"  # in a forked sequence's request id, before its index


def choice_request_id(request_id: str, index: int) -> str:
    """The request id a worker gives sequence ``index`` of a request forked into several
    (``SamplingParams.n``/``best_of``): the request's own for index 0, else with the index
    appended, so every sequence's deltas name it (:func:`split_choice` reads it back)."""
    return request_id if index == 0 else f"{request_id}{CHOICE_SEPARATOR}{index}"


def split_choice(request_id: str) -> tuple[str, int]:
    """(the request's id, the sequence's index) of a delta's ``request_id``."""
    base, sep, index = request_id.rpartition(CHOICE_SEPARATOR)
    if sep and index.isdigit() and index[0] != "0":
        return base, int(index)
    return request_id, 0


@dataclass(frozen=True)
class PrefixSource:
    """Where a worker found a prompt's leading tokens when it admitted it: read in place from
    its KV pool, or loaded back from its host memory or disk tier (and how long the loads
    took); it computed the rest."""

    pool_tokens: int = 0
    host_tokens: int = 0
    disk_tokens: int = 0
    load_s: float = 0.0

    @property
    def cached_tokens(self) -> int:
        return self.pool_tokens + self.host_tokens + self.disk_tokens


@dataclass
class RequestDelta:
    """What one step produced for one request (the unit streamed to clients)."""

    request_id: str
    new_token_ids: list[int]  # tokens generated this step
    text: str  # text delta (held back while it could still become a stop string)
    finish_reason: str | None = None  # "stop" | "length" | "abort" on the last delta
    logprobs: list[dict[int, float]] | None = None  # per new token, when requested
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0  # generated so far, this delta included
    error: str | None = None  # why an "abort" happened when the worker aborted on its own
    attempt: int = 1  # WorkRequest.attempt of the request this delta belongs to
    deadline_exceeded: bool = False  # the abort happened because the deadline passed
    preempted: bool = False  # a decode worker handed it back for lack of blocks: place again
    faulted: bool = False  # the request itself made its step fail (``error`` says how): it
    # ends here, failed, and is never moved to another worker as if this one had died
    queue_time_s: float | None = None  # on the first token a worker prefilled itself: arrival
    # at the worker -> first chunk scheduled (colocated traces; the prefill worker's are in
    # PrefillResult)
    prefill_time_s: float | None = None  # with queue_time_s: first chunk -> this token sampled
    prefix_source: PrefixSource | None = None  # with queue_time_s: where the worker found the
    # prompt's leading tokens (its pool, its KV tiers)
    # on the first output's delta, when SamplingParams.prompt_logprobs asks: one entry per
    # prompt token ({token_id: logprob}: the top ones and the prompt token's), the first None
    prompt_logprobs: list[dict[int, float] | None] | None = None


@final  # (so that ``type(part) is _NewTokens`` tells every part's type)
@dataclass(slots=True)
class _NewTokens:
    """One new token for each of several requests, none final, none with logprobs: the
    deltas of a pure decode step's rows that go on, kept as columns (StepDeltas' encoding)."""

    request_ids: list[str]
    token_ids: list[int]
    attempts: list[int]
    num_prompt_tokens: np.ndarray  # int64, one per request
    num_output_tokens: np.ndarray  # int64: generated so far, this token included
    texts: list[str] | None = None  # each token's text once filled (None: not yet)

    def __len__(self) -> int:
        return len(self.request_ids)

    def deltas(self) -> list[RequestDelta]:
        texts = self.texts if self.texts is not None else [""] * len(self)
        return [RequestDelta(request_id, [token_id], text, None, None, num_prompt, num_output,
                             attempt=attempt)
                for request_id, token_id, attempt, num_prompt, num_output, text
                in zip(self.request_ids, self.token_ids, self.attempts,
                       self.num_prompt_tokens.tolist(), self.num_output_tokens.tolist(),
                       texts, strict=True)]

    def select(self, index: list[int]) -> _NewTokens:
        """The requests at ``index`` (ascending)."""
        texts = None if self.texts is None else [self.texts[i] for i in index]
        return _NewTokens([self.request_ids[i] for i in index],
                          [self.token_ids[i] for i in index], [self.attempts[i] for i in index],
                          self.num_prompt_tokens[index], self.num_output_tokens[index], texts)


class StepDeltas:
    """The deltas of one or more steps in the order they were made: what a step returns, a
    worker's outbox holds and a poll ships. Iterating gives one :class:`RequestDelta` per
    request per step; ``len`` counts them.

    This class alone chooses how deltas are encoded, in memory and on the wire (pickled by
    Ray): a pure decode step's deltas that only add one token (most of them) are kept as
    columns, one list per field, so a step makes no object per request and a poll pickles
    one object per step; every other delta is a RequestDelta. Readers never see the
    difference."""

    __slots__ = ("_parts", "_size")

    def __init__(self, deltas: Iterable[RequestDelta] = ()) -> None:
        self._parts: list[RequestDelta | _NewTokens] = list(deltas)
        self._size = len(self._parts)

    @classmethod
    def new_tokens(cls, request_ids: list[str], token_ids: list[int], attempts: list[int],
                   num_prompt_tokens: np.ndarray, num_output_tokens: np.ndarray) -> StepDeltas:
        """The deltas of requests that each got one token (``token_ids[i]`` for
        ``request_ids[i]``), none final, none with logprobs; the lists are kept as given."""
        out = cls()
        if request_ids:
            out._add(_NewTokens(request_ids, token_ids, attempts, num_prompt_tokens,
                                num_output_tokens))
        return out

    def _add(self, part: RequestDelta | _NewTokens) -> None:
        self._parts.append(part)
        self._size += len(part) if type(part) is _NewTokens else 1

    def append(self, delta: RequestDelta) -> None:
        self._parts.append(delta)
        self._size += 1

    def extend(self, deltas: StepDeltas | Iterable[RequestDelta]) -> None:
        if type(deltas) is StepDeltas:
            self._parts.extend(deltas._parts)
            self._size += deltas._size
        else:
            for delta in deltas:
                self.append(delta)

    def __len__(self) -> int:
        return self._size

    def __bool__(self) -> bool:
        return self._size > 0

    def __iter__(self) -> Iterator[RequestDelta]:
        deltas: list[RequestDelta] = []
        for part in self._parts:
            if type(part) is _NewTokens:
                deltas += part.deltas()
            else:
                deltas.append(part)
        return iter(deltas)

    def __repr__(self) -> str:
        return f"StepDeltas({list(self)!r})"

    def read(self, token: Callable[[str, int, str], None],
             delta: Callable[[RequestDelta], None]) -> None:
        """Iterating without making the objects, for a reader that keeps up with every step
        (the offline LLM): ``token(request_id, token_id, text)`` for each delta that only
        adds one token and is kept as columns, ``delta(d)`` for every other; in order."""
        for part in self._parts:
            if type(part) is _NewTokens:
                texts = part.texts if part.texts is not None else repeat("")
                list(map(token, part.request_ids, part.token_ids, texts))
            else:
                delta(part)

    def fill_text(self, piece: Callable[[str, int, int], str],
                  end: Callable[[str, int], str]) -> None:
        """Add to each delta's text ``piece(request_id, attempt, token_id)`` of each of its new
        tokens, then, on a final delta, ``end(request_id, attempt)``; in order, once."""
        for part in self._parts:
            if type(part) is _NewTokens:
                part.texts = list(map(piece, part.request_ids, part.attempts, part.token_ids))
                continue
            for token_id in part.new_token_ids:
                part.text += piece(part.request_id, part.attempt, token_id)
            if part.finish_reason is not None:
                part.text += end(part.request_id, part.attempt)

    def split(self, owner: Callable[[str, int, bool], Hashable | None]
              ) -> dict[Hashable, StepDeltas]:
        """The deltas by ``owner(request_id, attempt, is_final)``, each owner's in order (an
        owner of None: dropped). Called once per delta, in order."""
        out: dict[Hashable, StepDeltas] = {}
        for part in self._parts:
            if type(part) is not _NewTokens:
                key = owner(part.request_id, part.attempt, part.finish_reason is not None)
                if key is not None:
                    out.setdefault(key, StepDeltas()).append(part)
                continue
            keys = list(map(owner, part.request_ids, part.attempts, repeat(False)))
            if keys.count(keys[0]) == len(keys):  # one owner (the usual case): kept whole
                if keys[0] is not None:
                    out.setdefault(keys[0], StepDeltas())._add(part)
                continue
            rows: dict[Hashable, list[int]] = {}
            for row, key in enumerate(keys):
                rows.setdefault(key, []).append(row)
            for key, index in rows.items():
                if key is not None:
                    out.setdefault(key, StepDeltas())._add(part.select(index))
        return out


