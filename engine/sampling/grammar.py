"""Constrained decoding (docs/structured-output.md): a request's ``StructuredOutputs`` compiled
into a grammar, one matcher per sequence that follows the tokens it gets, and the token
bitmask that limits a row's logits to what its grammar allows next.

The grammar engine is xgrammar. A compiled grammar depends only on the constraint and the
tokenizer, so one engine keeps the grammars it compiled, keyed by constraint
(``StructuredOutputs.key``), and equal constraints share one. A matcher belongs to its
sequence (``Sequence.constraint``): the output stage advances it with every token appended,
and a worker that takes a request over (a decode worker after the hand-off, a migration, a
bounce) builds a fresh one and replays the outputs the request already has. So no matcher
state crosses a process.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import OrderedDict
from typing import TYPE_CHECKING

import torch

from pdserve.worker_api.sampling_params import StructuredOutputs

if TYPE_CHECKING:
    import xgrammar

    from pdserve.models import Tokenizer

logger = logging.getLogger(__name__)

CACHED_GRAMMARS = 256  # compiled grammars one engine keeps (least recently used go first)


class GrammarError(ValueError):
    """A constraint that does not compile; the message names its field, ``reason`` is the
    grammar engine's own first line."""

    def __init__(self, kind: str, reason: str) -> None:
        super().__init__(f"structured_outputs.{kind} does not compile: {reason}")
        self.kind, self.reason = kind, reason


class GrammarCompiler:
    """Compiles constraints for one tokenizer and vocabulary (the model's logits width).

    :meth:`constraint` may run on any thread (a worker checks a request on the caller's thread
    before its loop adds it); :meth:`apply` runs on the engine loop's."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        # lazy: xgrammar imports transformers (slow; docs/structured-output.md); only an
        # engine that gets a constrained request pays for it
        import xgrammar as xgr
        from transformers import PreTrainedTokenizerFast

        start = time.perf_counter()
        info = xgr.TokenizerInfo.from_huggingface(
            PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend),
            vocab_size=vocab_size, stop_token_ids=list(tokenizer.eos_token_ids) or None)
        self._xgr = xgr
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self._grammars: OrderedDict[tuple, xgrammar.CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()  # guards _grammars (compiling runs outside it)
        self._bitmask = xgr.allocate_token_bitmask(1, vocab_size)
        self.vocab_size = vocab_size
        logger.info("grammar engine ready for %d tokens in %.0f ms", vocab_size,
                    (time.perf_counter() - start) * 1e3)

    def constraint(self, outputs: StructuredOutputs) -> Constraint:
        """A new matcher at the start of ``outputs``' grammar. GrammarError (a ValueError
        naming the field) when it does not compile."""
        start = time.perf_counter()
        grammar, cached = self._compiled(outputs)
        return Constraint(self._xgr.GrammarMatcher(grammar), time.perf_counter() - start, cached)

    def compile(self, outputs: StructuredOutputs) -> xgrammar.CompiledGrammar:
        """``outputs``' grammar, from the cache or compiled now (GrammarError)."""
        return self._compiled(outputs)[0]

    def _compiled(self, outputs: StructuredOutputs) -> tuple[xgrammar.CompiledGrammar, bool]:
        """(the grammar, whether the cache held it)."""
        key = outputs.key
        with self._lock:
            grammar = self._grammars.get(key)
            if grammar is not None:
                self._grammars.move_to_end(key)
                return grammar, True
        kind, compiler = outputs.kind, self._compiler
        try:
            if kind == "json":
                grammar = compiler.compile_json_schema(outputs.json, any_whitespace=False,
                                                       separators=(",", ":"))
            elif kind == "json_object":
                grammar = compiler.compile_builtin_json_grammar()
            elif kind == "regex":
                grammar = compiler.compile_regex(outputs.regex)
            elif kind == "choice":
                grammar = compiler.compile_grammar(choice_grammar(outputs.choice))
            elif kind == "structural_tag":
                grammar = self._structural_tag(json.loads(outputs.structural_tag))
            else:
                grammar = compiler.compile_grammar(outputs.grammar)
        except Exception as exc:  # noqa: BLE001 - xgrammar raises several kinds
            reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise GrammarError(kind, reason) from None
        with self._lock:
            self._grammars[key] = grammar
            if len(self._grammars) > CACHED_GRAMMARS:
                self._grammars.popitem(last=False)
        return grammar, False

    def _structural_tag(self, tag: dict) -> xgrammar.CompiledGrammar:
        """xgrammar's structural tag, or vLLM's older form (``structures`` + ``triggers``)."""
        if "structures" not in tag:
            return self._compiler.compile_structural_tag(tag)
        structures, triggers = tag.get("structures"), tag.get("triggers")
        if not isinstance(structures, list) or not isinstance(triggers, list):
            raise ValueError("structures and triggers must be lists")
        items = [self._xgr.StructuralTagItem(
            begin=s["begin"], end=s["end"],
            schema=s["schema"] if isinstance(s["schema"], str) else json.dumps(s["schema"]))
            for s in structures]
        return self._compiler.compile_structural_tag(items, triggers)

    def apply(self, logits: torch.Tensor, rows: list[tuple[int, Constraint]]) -> None:
        """Set to -inf, in place, every logit ``rows``' grammars forbid next: ``(i, c)`` limits
        row ``i`` of ``logits`` to what ``c`` allows. The other rows are left alone."""
        n = logits.shape[0]
        self._ensure_rows(n)
        bitmask = self._bitmask[:n]
        for i, constraint in rows:
            constraint.matcher.fill_next_token_bitmask(bitmask, i)
        self._xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=self.vocab_size,
                                              indices=[i for i, _ in rows])


    def apply_drafted(self, logits: torch.Tensor,
                      items: list[tuple[int, Constraint, list[int]]]) -> None:
        """Speculation's form of :meth:`apply`: for ``(i, c, drafts)``, row ``i + j`` of
        ``logits`` is the position after ``drafts[:j]`` and is limited to what ``c`` allows
        there. The rows after a draft the grammar refuses are left alone: the target gives
        that draft probability 0, so verification rejects it (and draws from the residual,
        which keeps sampling exact), and rows past a rejection are never read. Each matcher
        ends where it began."""
        rows = []
        self._ensure_rows(logits.shape[0])
        for i, constraint, drafts in items:
            accepted = 0
            for j in range(len(drafts) + 1):
                constraint.matcher.fill_next_token_bitmask(self._bitmask, i + j)
                rows.append(i + j)
                if j == len(drafts) or not constraint.accept(drafts[j]):
                    break
                accepted += 1
                if constraint.is_terminated:  # (the output ends at that draft)
                    break
            if accepted:
                constraint.matcher.rollback(accepted)
        self._xgr.apply_token_bitmask_inplace(logits, self._bitmask[:logits.shape[0]],
                                              vocab_size=self.vocab_size, indices=rows)

    def _ensure_rows(self, n: int) -> None:
        if self._bitmask.shape[0] < n:
            self._bitmask = self._xgr.allocate_token_bitmask(n, self.vocab_size)


class Constraint:
    """One sequence's place in its grammar (the ``OutputConstraint`` a ``Sequence`` holds)."""

    __slots__ = ("matcher", "compile_s", "cache_hit")

    def __init__(self, matcher: xgrammar.GrammarMatcher, compile_s: float = 0.0,
                 cache_hit: bool = False) -> None:
        self.matcher = matcher
        self.compile_s = compile_s  # seconds its grammar took to get (compile or cache)
        self.cache_hit = cache_hit  # the engine's cache held its grammar

    def accept(self, token_id: int) -> bool:
        """Advance past ``token_id``; False (and no move) when the grammar forbids it."""
        return bool(self.matcher.accept_token(token_id))

    @property
    def is_terminated(self) -> bool:
        """The grammar has ended (its stop token accepted): nothing may follow."""
        return bool(self.matcher.is_terminated())


def grammar_timing(constraint: Constraint | None) -> dict:
    """A worker message's ``grammar_compile_s`` and ``grammar_cache_hit`` for a sequence's
    constraint (empty for free output)."""
    if constraint is None:
        return {}
    return {"grammar_compile_s": constraint.compile_s, "grammar_cache_hit": constraint.cache_hit}


def choice_grammar(choices: tuple[str, ...]) -> str:
    """An EBNF grammar whose sentences are exactly ``choices``."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)
