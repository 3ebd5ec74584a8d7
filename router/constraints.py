"""The router's check of a request's structured output: its grammar compiled once, bounded in
time, before any worker sees the request (docs/structured-output.md).

``StructuredOutputs`` already bounds a constraint's size when it is built (text length, JSON
nesting, enum values, regex groups). What only compiling can tell, whether a schema, regex or
grammar is valid and whether it compiles in reasonable time, is told here:

1. A constraint compiled before (or refused before) is answered from an LRU of keys at once
   (a refusal for time for ``TOO_COMPLEX_KEPT_S`` only: it may have been the machine's load).
2. Otherwise it is compiled in a child process that holds a grammar compiler for the served
   tokenizer (``engine.sampling.grammar.GrammarCompiler``, started with the first constrained
   request: the grammar engine's import and its tokenizer table take a few seconds once).
   The router's event loop only awaits a thread that waits on the child's answer.
3. A compile that takes longer than ``timeout_s`` is refused as too complex, and the child is
   killed (the grammar engine offers no way to stop a compile), so a pathological constraint
   holds neither the router nor a CPU past its deadline; the next request starts a new child.

One child compiles one constraint at a time; requests with new constraints queue for it, each
bounded by the deadline once its turn comes. Unconstrained requests never wait for it. The
compiled grammar is not kept or sent: each worker compiles its own (grammar.py's cache).
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from pdserve.worker_api.sampling_params import StructuredOutputs

Tokenizer = Any  # the served model's pdserve.models.Tokenizer (the router does not import models)

logger = logging.getLogger(__name__)

CHECKED_CONSTRAINTS = 4096  # constraints whose answer the router keeps (LRU)
CHILD_START_TIMEOUT_S = 120.0  # the child's grammar engine set-up, at most
TOO_COMPLEX = "is too complex"  # how a refusal for time starts
TOO_COMPLEX_KEPT_S = 300.0  # how long a refusal for time is answered from the cache


class ConstraintRefused(ValueError):
    """A constraint no worker could serve; the message says why, not which field (the
    preparation stage names the field as the client's door spells it)."""

    def __init__(self, why: str, check: ConstraintCheck) -> None:
        super().__init__(why)
        self.check = check  # how it was checked

    @property
    def is_too_complex(self) -> bool:
        return str(self).startswith(TOO_COMPLEX)


@dataclass(frozen=True)
class ConstraintCheck:
    """How a request's constraint was checked (its trace)."""

    compile_s: float  # seconds the child compiled it (0: answered from the cache)
    cached: bool  # answered from the router's cache of checked constraints


class ConstraintChecker:
    """Compiles constraints for one tokenizer in a child process, with a deadline (see the
    module docstring). ``check`` runs on the event loop; everything blocking runs on one
    thread of its own."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, timeout_s: float = 2.0) -> None:
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.tokenizer, self.vocab_size, self.timeout_s = tokenizer, vocab_size, timeout_s
        # key -> (why refused or None, time.monotonic() until which the answer holds)
        self._answers: OrderedDict[tuple, tuple[str | None, float]] = OrderedDict()
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="pdserve-grammar-check")
        self._child: _Child | None = None  # (the check thread's, and close's)
        self._lock = threading.Lock()  # guards _answers (loop and check thread)

    async def check(self, outputs: StructuredOutputs) -> ConstraintCheck:
        """ConstraintRefused when ``outputs`` does not compile or takes longer than the
        deadline to; otherwise how it was checked."""
        key = outputs.key
        with self._lock:
            why, until = self._answers.get(key, (None, 0.0))
            cached = key in self._answers and until >= time.monotonic()
            if cached:
                self._answers.move_to_end(key)
        if cached:
            check = ConstraintCheck(0.0, True)
        else:
            loop = asyncio.get_running_loop()
            try:
                why, seconds = await loop.run_in_executor(self._thread, self._compile, outputs)
            except RuntimeError as exc:  # no compiler: the workers' own compile checks it
                logger.error("structured output not checked in the router: %s", exc)
                return ConstraintCheck(0.0, False)
            check = ConstraintCheck(seconds, False)
            # a refusal for time may have been the machine's load: tried again after a while
            kept_s = TOO_COMPLEX_KEPT_S if why is not None and why.startswith(TOO_COMPLEX) \
                else float("inf")
            with self._lock:
                self._answers[key] = (why, time.monotonic() + kept_s)
                if len(self._answers) > CHECKED_CONSTRAINTS:
                    self._answers.popitem(last=False)
        if why is not None:
            raise ConstraintRefused(why, check)
        return check

    def close(self) -> None:
        """Drop the queued checks and kill the child (a compile in progress is answered as
        having ended the compiler)."""
        self._thread.shutdown(wait=False, cancel_futures=True)
        self._stop_child()

    # -- the check thread ---------------------------------------------------------------------
    def _compile(self, outputs: StructuredOutputs) -> tuple[str | None, float]:
        """(why refused or None, seconds compiling) (the check thread)."""
        if self._child is None:
            self._child = _Child(self.tokenizer, self.vocab_size)
        start = time.perf_counter()
        answer = self._child.compile(outputs, self.timeout_s)
        seconds = time.perf_counter() - start
        if answer is _TIMED_OUT:
            logger.warning("a %s constraint did not compile in %.1f s: refused, compiler "
                           "restarted", outputs.kind, self.timeout_s)
            self._stop_child()
            return f"{TOO_COMPLEX}: it did not compile within {self.timeout_s:g} s", seconds
        if answer is _CHILD_GONE:
            self._stop_child()
            return f"{TOO_COMPLEX}: compiling it ended the compiler", seconds
        return answer, seconds

    def _stop_child(self) -> None:
        child, self._child = self._child, None
        if child is not None:
            child.kill()


_TIMED_OUT = "timed out"  # (compared by identity: never a real answer)
_CHILD_GONE = "child gone"


class _Child:
    """One compiler process and the pipe to it."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        context = multiprocessing.get_context("spawn")  # (never fork a threaded router)
        self._conn, child_conn = context.Pipe()
        self._process = context.Process(target=serve_compiles,
                                        args=(child_conn, tokenizer, vocab_size),
                                        name="pdserve-grammar-check", daemon=True)
        self._process.start()
        child_conn.close()
        if not self._conn.poll(CHILD_START_TIMEOUT_S):
            self.kill()
            raise RuntimeError(f"the grammar check process did not start in "
                               f"{CHILD_START_TIMEOUT_S:g} s")
        try:
            self._conn.recv()  # (its ready message)
        except EOFError:
            self.kill()
            raise RuntimeError(f"the grammar check process exited while starting (exit code "
                               f"{self._process.exitcode})") from None

    def compile(self, outputs: StructuredOutputs, timeout_s: float) -> str | None:
        """Why the child refused ``outputs`` (None: it compiled), _TIMED_OUT or _CHILD_GONE."""
        try:
            self._conn.send(outputs)
            if not self._conn.poll(timeout_s):
                return _TIMED_OUT
            return self._conn.recv()
        except (EOFError, OSError):
            return _CHILD_GONE

    def kill(self) -> None:
        self._process.kill()
        self._process.join(5.0)
        self._conn.close()


def serve_compiles(conn: Connection, tokenizer: Tokenizer, vocab_size: int) -> None:
    """The child process: compile each constraint received; answer None or why it failed."""
    # lazy: the grammar engine (xgrammar, transformers) loads in this child only, never in
    # the router's process
    from pdserve.engine.sampling.grammar import GrammarCompiler, GrammarError

    compiler = GrammarCompiler(tokenizer, vocab_size)
    conn.send("ready")
    while True:
        try:
            outputs = conn.recv()
        except EOFError:
            return
        try:
            compiler.compile(outputs)
            conn.send(None)
        except GrammarError as exc:
            conn.send(f"does not compile: {exc.reason}")
