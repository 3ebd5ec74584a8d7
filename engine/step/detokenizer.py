"""Incremental detokenization with stop strings: token ids in, safe text deltas out.

Contract of ``Detokenizer(tokenizer, prompt_token_ids, stop=None, skip_special_tokens=True)``:

- ``append(token_id) -> DetokenizedDelta(text, stopped, stop_reason)`` for each generated token,
  in order. ``text`` is new text, safe to show:
  * never a broken character: while the decoded tail ends in U+FFFD (a multi-byte UTF-8
    character split across tokens) the new tokens are held back, up to ``MAX_HELD_TOKENS``
    tokens; past that the U+FFFD is real (invalid bytes from the model) and is emitted. Tokens
    that add no text (skipped special tokens) are held the same way, so that the next token is
    decoded with its left context (SentencePiece spacing);
  * never any part of a stop string: text that could still become the start of a stop string is
    held back until it is disambiguated;
  * when a stop string completes (possibly spanning several tokens), ``text`` ends right before
    it, ``stopped`` is True and ``stop_reason`` is that stop string. If several could match, the
    one whose end comes first in the text wins (ties: the one starting first); this is the same
    whatever the token boundaries are. After a stop, ``append`` raises ``RuntimeError``.
- ``flush() -> str`` when generation ends for another reason (eos, stop token id, length,
  abort): returns everything still held back (a trailing U+FFFD included), itself cut before a
  stop string if the released text completes one. Safe to call after a stop (returns "") and
  more than once.
- ``output_text``: everything emitted so far (deltas plus flushes), joined.

Concatenated deltas (+ flush) equal ``tokenizer.decode(output_ids)`` whenever the tokenizer's
decode is a concatenation of the tokens' bytes (byte-level BPE); with SentencePiece-style
tokenizers they also carry the prompt's context (a leading space is kept, as in vLLM). Cost per
token: two decodes of a window of a few tokens (vLLM's prefix/read offsets: text is read as
``decode(ids[prefix:]) - decode(ids[prefix:read])``), not of the whole output.

The tokenizer is any object with ``decode(ids, skip_special_tokens=...) -> str``
(``pdserve.models.Tokenizer``, a ``tokenizers.Tokenizer``, a Hugging Face tokenizer). The
first two decode through ``tokenizers``' ``DecodeStream`` (see :class:`IncrementalDetokenizer`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Protocol

import tokenizers
from tokenizers.decoders import DecodeStream

logger = logging.getLogger(__name__)

REPLACEMENT_CHAR = "\ufffd"
PROMPT_CONTEXT_TOKENS = 5  # prompt tokens decoded in front of the output for spacing context
MAX_HELD_TOKENS = 6  # a split UTF-8 character spans at most 4 bytes; beyond this U+FFFD is real


class Decoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = ...) -> str: ...


@dataclass
class DetokenizedDelta:
    """What one appended token adds to the visible output."""

    text: str  # new text to emit (possibly empty)
    stopped: bool = False  # a stop string completed: generation must end, finish_reason "stop"
    stop_reason: str | None = None  # the stop string that matched


class IncrementalDetokenizer:
    """Token ids -> text deltas that never end inside a multi-byte character.

    With a Hugging Face ``tokenizers`` tokenizer (ours wraps one) the per-token decodes run in
    its ``DecodeStream`` (the same window rule, one call into Rust per token instead of two
    decodes from Python: about half the time, docs/cpu-speed.md); the
    bookkeeping here mirrors its window, so the hold limit, ``flush`` and a window whose
    prefix changed take the Python path on the same state, and a fresh stream continues from
    there."""

    def __init__(self, tokenizer: Decoder, prompt_token_ids: list[int],
                 skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        # only the prompt's tail is needed, as decoding context
        self._ids = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        self._prefix = 0  # window start: context tokens decoded but not emitted again
        self._read = len(self._ids)  # tokens before this have been emitted
        self._prefix_text: str | None = None  # decode of ids[prefix:read] (None: not yet)
        self._rust = _rust_tokenizer(tokenizer)
        self._restart_stream()

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    @property
    def num_held_tokens(self) -> int:
        """Tokens appended whose text has not been emitted yet (an unfinished character)."""
        return len(self._ids) - self._read

    def append(self, token_id: int) -> str:
        """Add one token; returns the new text (empty while a character is incomplete)."""
        self._ids.append(token_id)
        if self._stream is not None:
            try:
                text = self._stream.step(self._rust, token_id)
            except Exception:  # noqa: BLE001 - the window's prefix changed: the Python path
                self._stream = None
            else:
                if text is not None:  # emitted: the window moves as in _advance
                    self._prefix, self._read, self._prefix_text = self._read, len(self._ids), None
                    return text
                if self.num_held_tokens < MAX_HELD_TOKENS:
                    return ""
        text = self._decode(self._ids[self._prefix:])
        complete = len(text) > len(self._window_prefix()) and not text.endswith(REPLACEMENT_CHAR)
        if not complete and self.num_held_tokens < MAX_HELD_TOKENS:
            return ""  # an unfinished character, or no text yet (e.g. a skipped special token)
        return self._advance(text)

    def flush(self) -> str:
        """Release the held tokens' text, even if it ends in an incomplete character."""
        if not self.num_held_tokens:
            return ""
        return self._advance(self._decode(self._ids[self._prefix:]))

    def _window_prefix(self) -> str:
        if self._prefix_text is None:
            self._prefix_text = self._decode(self._ids[self._prefix:self._read])
        return self._prefix_text

    def _advance(self, text: str) -> str:
        prefix_text = self._window_prefix()
        if not text.startswith(prefix_text):
            logger.debug("decode of the window changed its prefix: %r -> %r", prefix_text, text)
        delta = text[len(prefix_text):]
        self._prefix, self._read, self._prefix_text = self._read, len(self._ids), None
        self._restart_stream()
        return delta

    def _restart_stream(self) -> None:
        """A stream whose window is ours (everything in it read), unless the window's text
        ends in a broken character (a stream would emit that U+FFFD again)."""
        self._stream = None
        if self._rust is not None and not self._window_prefix().endswith(REPLACEMENT_CHAR):
            self._stream = DecodeStream(ids=self._ids[self._prefix:],
                                        skip_special_tokens=self.skip_special_tokens)


def _rust_tokenizer(tokenizer) -> tokenizers.Tokenizer | None:
    """The ``tokenizers.Tokenizer`` that decodes for ``tokenizer``, if there is one."""
    for candidate in (tokenizer, getattr(tokenizer, "backend", None)):
        if isinstance(candidate, tokenizers.Tokenizer):
            return candidate
    return None


class StopChecker:
    """Holds back text that could start a stop string; cuts the text before a completed one."""

    def __init__(self, stop: list[str] | None = None) -> None:
        self.stop = [s for s in (stop or []) if s]
        self._held = ""  # longest tail of the text that is a proper prefix of a stop string

    @property
    def held_text(self) -> str:
        return self._held

    def check(self, text: str) -> tuple[str, str | None]:
        """Feed new text; returns (text safe to emit, matched stop string or None)."""
        if not self.stop:
            return text, None
        buf = self._held + text
        match = self._first_match(buf)
        if match is not None:
            start, stop = match
            self._held = ""
            return buf[:start], stop
        self._held = self._stop_prefix_tail(buf)
        return buf[:len(buf) - len(self._held)], None

    def release(self) -> str:
        """The held-back text (generation ended without completing a stop string)."""
        held, self._held = self._held, ""
        return held

    def _first_match(self, buf: str) -> tuple[int, str] | None:
        """(start, stop) of the occurrence that ends first; ties go to the one starting first."""
        best: tuple[int, int, str] | None = None
        for stop in self.stop:
            start = buf.find(stop)
            if start < 0:
                continue
            key = (start + len(stop), start, stop)
            if best is None or key[:2] < best[:2]:
                best = key
        return None if best is None else (best[1], best[2])

    def _stop_prefix_tail(self, buf: str) -> str:
        longest = min(len(buf), max(len(s) for s in self.stop) - 1)
        for size in range(longest, 0, -1):
            tail = buf[-size:]
            if any(s.startswith(tail) for s in self.stop):
                return tail
        return ""


class Detokenizer:
    """Incremental detokenizer plus stop strings: the object the engine keeps per request."""

    def __init__(self, tokenizer: Decoder, prompt_token_ids: list[int],
                 stop: list[str] | None = None, skip_special_tokens: bool = True) -> None:
        self._text = IncrementalDetokenizer(tokenizer, prompt_token_ids, skip_special_tokens)
        self._stops = StopChecker(stop)
        self._chunks: list[str] = []
        self.stopped = False  # a stop string completed
        self.stop_reason: str | None = None  # the stop string that completed

    @property
    def output_text(self) -> str:
        return "".join(self._chunks)

    def append(self, token_id: int) -> DetokenizedDelta:
        if self.stopped:
            raise RuntimeError(f"append({token_id}) after the stop string {self.stop_reason!r}")
        return self._emit(self._text.append(token_id))

    def flush(self) -> str:
        if self.stopped:
            return ""
        delta = self._emit(self._text.flush())
        if delta.stopped:
            return delta.text
        tail = self._stops.release()
        self._chunks.append(tail)
        return delta.text + tail

    def _emit(self, text: str) -> DetokenizedDelta:
        if not text:
            return DetokenizedDelta("")
        safe, stop = self._stops.check(text)
        self._chunks.append(safe)
        if stop is not None:
            self.stopped, self.stop_reason = True, stop
        return DetokenizedDelta(safe, self.stopped, stop)
