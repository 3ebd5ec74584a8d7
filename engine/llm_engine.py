"""The engine: ``add_request`` / ``step`` / ``abort`` over the parts of ``engine/parts.py``
(model runner, KV pool, block manager, tokenizer), a scheduler, a sampler and a text stage.

:meth:`LLMEngine.step` is the one step every worker runs (offline, colocated, prefill, decode);
a role differs only in its :class:`~pdserve.engine.step.scheduling_policy.SchedulingPolicy` (what is
scheduled) and its :class:`~pdserve.engine.step.hooks.StepHooks` (what happens around the
forward: a prefill worker ships KV layers while the forward runs and hands finished prompts
off). Step:

1. ``scheduler.schedule()`` gives the step's one :class:`SchedulerOutput`: the decodes (each
   computes its last token and samples the next) and the chunks (prompt chunks, and
   speculating decodes with draft slots, whose drafts the speculator then proposes);
2. ``runner.prepare(output)`` makes the flat batch: the decodes are the runner's persistent
   :class:`~pdserve.engine.step.decode_rows.DecodeRows`, moved on by the step's diff, the
   chunks follow, built for the step; ``hooks.before_forward`` sees the chunks that sample
   this step (and may return a per-layer callback), ``runner.run()`` runs the batch and
   returns logits of every decode, then of the chunks that reach their last token, then
   ``hooks.after_forward``;
3. ``scheduler.update()`` advances ``num_computed_tokens`` and caches full blocks;
4. :meth:`draw` takes one token per decode, from the rows' arrays, and per sampling chunk (a
   speculating decode's drafts are verified instead, :meth:`Speculator.verify`, which gives
   its accepted tokens); the one output stage
   (:class:`~pdserve.engine.step.output_stage.OutputStage`) appends them, applies the stop
   rules (finished sequences free their blocks through ``scheduler.finish``) and builds the
   deltas; the speculator then frees the slots of rejected drafts; ``hooks.after_sample``
   decides which of the chunks' deltas the step returns. Text is made in the step only for
   requests with stop strings; the others' when their deltas are read (:meth:`render`).

Decodes are on the rows under a policy that puts them there
(``SchedulingPolicy.decodes_on_rows``) and without speculation (the scheduler's own rule);
the prefill worker's policy has no decodes, so its hooks see every sequence that samples.

Workers never reach into the parts: what they need of the engine is a method here
(``hand_off``, ``reserve_blocks``, ``release_blocks``, ``start_running``, ``render``,
``kv_caches``, ``drain_kv_events``, ``kv_snapshot``). docs/engine-step.md has the whole picture.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import random
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from pdserve.engine.config import EngineConfig
from pdserve.engine.parts import EngineParts
from pdserve.engine.sampling.grammar import Constraint, GrammarCompiler
from pdserve.engine.sampling.sampler import (
    Sampler,
    SamplingBatch,
    check_samplable,
    greedy_token_array,
    greedy_tokens,
    sampling_row,
)
from pdserve.engine.sequence import Sequence
from pdserve.engine.speculation.speculator import Speculator
from pdserve.engine.step.decode_rows import DecodeRows
from pdserve.engine.step.hooks import StepHooks, StepStats
from pdserve.engine.step.output_stage import OutputStage
from pdserve.engine.step.prompt_logprobs import score_prompts
from pdserve.engine.step.scheduler import Scheduler
from pdserve.engine.step.scheduler_output import SchedulerConfig
from pdserve.engine.step.scheduling_policy import SchedulingPolicy
from pdserve.engine.step.text_stage import TextStage
from pdserve.engine.tensor_parallel.group import TensorParallelRunner
from pdserve.worker_api import (
    DuplicateRequestId,
    KVEvents,
    KVSnapshot,
    NeverFits,
    NoRoomNow,
    RequestDelta,
    StepDeltas,
    WorkRequest,
    choice_request_id,
)
from pdserve.worker_api.adapters import AdapterRef
from pdserve.worker_api.sampling_params import MAX_N, SamplingParams, child_seed

logger = logging.getLogger(__name__)

GRAMMAR_THREADS = 2  # constraints one engine compiles at once, off its loop


class LLMEngine:
    """The engine every role runs: continuous batching with chunked prefill over one KV pool
    (a worker's role is its scheduling policy and step hooks, the module docstring)."""

    def __init__(self, parts: EngineParts, policy: SchedulingPolicy | None = None,
                 hooks: StepHooks | None = None, defer_text: bool = True):
        """``defer_text``: the text of requests without stop strings is made by
        :meth:`render` when their deltas are read, not in the step (``TextStage``)."""
        self.parts = parts
        self.hooks = hooks or StepHooks()
        cfg = parts.config
        self.scheduler = Scheduler(
            SchedulerConfig(max_num_seqs=cfg.max_num_seqs,
                            max_num_batched_tokens=cfg.max_num_batched_tokens,
                            max_model_len=parts.max_model_len,
                            enable_chunked_prefill=cfg.enable_chunked_prefill,
                            admission_hold_s=cfg.admission_hold_s,
                            prefill_batch_tokens=cfg.prefill_batch_tokens),
            parts.block_manager, policy or SchedulingPolicy(cfg.scheduling_policy))
        self.scheduler.adapters = parts.adapters
        self.sampler = Sampler()
        self._seed_source = random.Random(cfg.seed)
        self.text = TextStage(parts.tokenizer, defer=defer_text)
        self.output = OutputStage(self.scheduler, self.text, parts.eos_token_ids,
                                  parts.max_model_len)
        self.last_step = StepStats()
        # speculative decoding (engine/speculation/speculator.py): decode and colocated roles only
        self.speculator = Speculator.build(parts) if self.scheduler.policy.speculates else None
        if self.speculator is not None:
            self.scheduler.lookahead = self.speculator.num_lookahead
        elif parts.adapters is None:  # (LoRA rows and drafts run the unfused forward)
            self.scheduler.max_decode_rows = self._fused_decode_rows()
        # an int8 KV cache whose scales or dequantized values overflow shows as non-finite
        # logits: each step checks them, and fails the rows that have them (loudly)
        self._int8_kv = cfg.kv_int8_scales if cfg.kv_cache_dtype == "int8" else None
        self._grammars: GrammarCompiler | None = None  # made by the first constrained request
        self._grammars_lock = threading.Lock()
        # requests of n (best_of) > 1 whose prompt is still computing here: each forks into
        # its other sequences when it samples its first token (:meth:`_fork`)
        self._to_fork: dict[str, Sequence] = {}
        # constraints compiled for workers' loops, off them (threads start with the first)
        self._grammar_pool = ThreadPoolExecutor(GRAMMAR_THREADS,
                                                thread_name_prefix="pdserve-grammar")

    @classmethod
    def from_config(cls, config: EngineConfig) -> LLMEngine:
        return cls(EngineParts.build(config))

    # -- requests ---------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt: str | list[int],
                    params: SamplingParams | None = None, seed: int | None = None,
                    adapter: AdapterRef | None = None) -> Sequence:
        """Validate and queue a prompt; ``seed`` overrides the request's random stream key;
        ``adapter``: the LoRA adapter it runs under (None: the base model)."""
        return self.add_sequence(self.new_sequence(request_id, prompt,
                                                   params or SamplingParams(), seed,
                                                   adapter=adapter))

    def new_sequence(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                     seed: int | None = None, constraint: Constraint | None = None,
                     adapter: AdapterRef | None = None) -> Sequence:
        """A validated, untracked Sequence. NeverFits (a ValueError) naming what this engine can
        never take: a prompt its model or tokenizer cannot read, a context longer than its
        limit, more blocks than its pool, parameters no step can pack. A constrained request's
        matcher is ``constraint`` when given (:meth:`then_prepared`), else made here."""
        for index in range(params.num_sequences):
            if choice_request_id(request_id, index) in self.output.sequences:
                raise DuplicateRequestId(f"request_id {choice_request_id(request_id, index)!r} "
                                         f"is already running")
        if params.num_sequences > params.n and params.logprobs is None:
            # best_of ranks the sequences by their tokens' log-probabilities
            params = dataclasses.replace(params, logprobs=0)
        try:
            token_ids = self.parts.encode_prompt(prompt)
            limit = self.parts.max_model_len
            if len(token_ids) + params.max_tokens > limit:
                raise ValueError(f"prompt ({len(token_ids)} tokens) + max_tokens "
                                 f"({params.max_tokens}) exceeds the context length {limit}")
            if seed is None:
                seed = params.seed if params.seed is not None else \
                    self._seed_source.getrandbits(63)
            seq = Sequence(request_id, token_ids, params, seed=seed,
                           adapter=self._check_adapter(adapter))
            if params.prompt_logprobs is not None:
                seq.prompt_logprobs = [None]  # (the first token has none)
            self.scheduler.check_fits(seq)
            check_samplable(seq)
            self._check_logit_bias(params)
            if params.structured_outputs is not None:
                seq.constraint = constraint or self._constraint(params)
        except NeverFits:
            raise
        except ValueError as exc:
            raise NeverFits(str(exc)) from None
        return seq

    def sequence_for(self, request: WorkRequest,
                     constraint: Constraint | None = None) -> Sequence:
        """An untracked Sequence for a router's request: prompt + the outputs already streamed
        (a migrated request resumes at output position ``len(request.output_token_ids)``);
        ``constraint`` as for :meth:`new_sequence`."""
        seq = self.new_sequence(request.request_id, request.prompt_token_ids, request.params,
                                request.seed, constraint, request.adapter)
        resumed = list(request.output_token_ids)
        if resumed and request.params.num_sequences > 1:
            raise NeverFits("n: a request forked into several sequences (n or best_of > 1) "
                            "cannot resume from its outputs on another worker")
        if len(resumed) >= request.params.max_tokens:
            raise ValueError(f"output_token_ids ({len(resumed)}) must be fewer than "
                             f"max_tokens ({request.params.max_tokens})")
        if resumed:
            self.parts.encode_prompt(resumed)  # the same id checks as a prompt
        if seq.constraint is not None:  # the grammar goes on from the outputs so far
            for i, token_id in enumerate(resumed):
                if not seq.constraint.accept(token_id):
                    raise NeverFits(f"output_token_ids[{i}] ({token_id}) does not follow "
                                    f"the request's structured_outputs")
        seq.token_ids.extend(resumed)
        seq.num_resumed_tokens = len(resumed)
        if resumed:  # the first output, which carried the prompt logprobs, was streamed
            seq.prompt_logprobs = None
        seq.deadline, seq.attempt = request.deadline, request.attempt
        return seq

    def add_work(self, request: WorkRequest, constraint: Constraint | None = None) -> Sequence:
        """Queue a router's request (see :meth:`sequence_for`)."""
        return self.add_sequence(self.sequence_for(request, constraint))

    def add_sequence(self, seq: Sequence) -> Sequence:
        """Queue a checked, untracked sequence (:meth:`sequence_for`); DuplicateRequestId if
        its request id is already here."""
        if seq.request_id in self.output.sequences:
            raise DuplicateRequestId(f"request_id {seq.request_id!r} is already running")
        self.scheduler.add(seq)
        self.track(seq)
        self.parts.block_manager.prefetch(seq)
        if seq.sampling_params.num_sequences > 1 and self.scheduler.policy.accepts_running:
            self._to_fork[seq.request_id] = seq  # (a prefill worker hands one sequence off)
        return seq

    def _check_logit_bias(self, params: SamplingParams) -> None:
        """ValueError naming ``logit_bias`` and the key when a biased id is outside the
        vocabulary (the logits' width)."""
        vocab = self.parts.model_config.vocab_size
        outside = [t for t in params.logit_bias or () if t >= vocab]
        if outside:
            raise ValueError(f"logit_bias keys must be token ids in [0, {vocab}), "
                             f"got {outside[0]}")

    def _check_adapter(self, adapter: AdapterRef | None) -> AdapterRef | None:
        """``adapter`` once this engine has read it (ValueError naming it when it cannot)."""
        if adapter is None:
            return None
        if self.parts.adapters is None:
            raise ValueError(f"LoRA adapter {adapter.name!r}: this engine serves no adapters "
                             f"(start it with enable_lora)")
        self.parts.adapters.read(adapter)
        return adapter

    def _fused_decode_rows(self) -> int | None:
        """The decodes a step takes at most (``Scheduler.max_decode_rows``): as many as the
        model computes in one fused call, where it has one."""
        runner = self.parts.runner
        rows = getattr(runner.model, "fused_decode_rows", None)
        return None if rows is None else rows(runner.kv_caches, runner.backend)

    def _fork(self, parent: Sequence) -> list[Sequence]:
        """Start the other sequences of ``parent``'s request (``n``/``best_of`` > 1), whose
        prompt's KV is computed: each shares its full prompt blocks (``BlockManager.fork``),
        computes the rest of the prompt in its own block and samples its first token with
        its own random stream (:func:`child_seed`), and its own grammar matcher."""
        params = parent.sampling_params
        children = []
        for index in range(1, params.num_sequences):
            child = Sequence(choice_request_id(parent.request_id, index),
                             parent.prompt_token_ids, params,
                             seed=child_seed(parent.seed, index), index=index,
                             arrival_time=parent.arrival_time, deadline=parent.deadline,
                             attempt=parent.attempt, adapter=parent.adapter)
            if params.structured_outputs is not None:
                child.constraint = self._constraint(params)
            self.parts.block_manager.fork(parent, child)
            self.scheduler.add_running(child)
            self.track(child)
            children.append(child)
        self.hooks.forked(parent, children)
        return children

    def then_prepared(self, request: WorkRequest,
                      then: Callable[[Constraint | None], Future]) -> Future:
        """``then(constraint)``'s future once what a request needs from files and compilers
        is ready, made on the engine's own threads: ``constraint`` the matcher for its
        structured outputs (None when free), and its LoRA adapter read into host memory. A
        worker's loop never compiles a grammar or reads an adapter's files, and its steps go
        on meanwhile. A constraint or adapter that cannot be served fails the returned future
        with NeverFits, and ``then`` is not called."""
        params, adapter = request.params, request.adapter
        adapters = self.parts.adapters
        if params.structured_outputs is None and (
                adapter is None or adapters is None or adapters.holds(adapter)):
            return then(None)
        result: Future = Future()

        def compiled(made: Future) -> None:
            if made.cancelled():
                result.set_exception(RuntimeError("the engine closed before the request's "
                                                  "grammar compiled"))
                return
            exc = made.exception()
            if exc is not None:
                result.set_exception(exc if isinstance(exc, NeverFits) or
                                     not isinstance(exc, ValueError) else NeverFits(str(exc)))
                return
            try:
                after = then(made.result())
            except Exception as then_exc:  # noqa: BLE001 - the caller's future must resolve
                result.set_exception(then_exc)
                return
            after.add_done_callback(functools.partial(_copy_outcome, result))

        self._grammar_pool.submit(self._prepare, params, adapter).add_done_callback(compiled)
        return result

    def _prepare(self, params: SamplingParams, adapter: AdapterRef | None) -> Constraint | None:
        self._check_adapter(adapter)
        return None if params.structured_outputs is None else self._constraint(params)

    def _constraint(self, params: SamplingParams) -> Constraint:
        """A new matcher for ``params``' structured outputs (ValueError naming the field when
        they cannot be served here); the grammar engine starts with the first request."""
        if self.parts.tokenizer is None:
            raise ValueError("structured_outputs: this model has no tokenizer to build a "
                             "grammar over")
        with self._grammars_lock:  # (workers check requests on their callers' threads)
            if self._grammars is None:
                self._grammars = GrammarCompiler(self.parts.tokenizer,
                                                 self.parts.model_config.vocab_size)
        return self._grammars.constraint(params.structured_outputs)

    def _constrain(self, logits: torch.Tensor, seqs: list[Sequence]) -> None:
        """Limit each constrained sequence's row of ``logits`` (row ``i`` is ``seqs[i]``'s) to
        what its grammar allows next; unconstrained rows are untouched."""
        rows = [(i, seq.constraint) for i, seq in enumerate(seqs) if seq.constraint is not None]
        if rows:
            self._grammars.apply(logits, rows)

    def _constrain_drafts(self, sampling: list, logits: torch.Tensor) -> None:
        """Limit each constrained speculating item's k + 1 rows of ``logits`` to what its
        grammar allows at each position (after the drafts before it), so verification accepts
        a draft only where the grammar does and the target's own token obeys it too. Plain
        items' rows are constrained by ``draw``."""
        items, row = [], 0
        for item in sampling:
            if item.draft_token_ids and item.seq.constraint is not None:
                items.append((row, item.seq.constraint, list(item.draft_token_ids)))
            row += 1 + len(item.draft_token_ids)
        if items:
            self._grammars.apply_drafted(logits, items)

    def track(self, seq: Sequence) -> None:
        """Start detokenizing and stop-checking ``seq``'s output (resumed outputs replayed, so
        text and stop-string hold-back continue where the previous worker left them)."""
        self.output.track(seq)

    def render(self, deltas: StepDeltas) -> StepDeltas:
        """``deltas`` with the deferred text filled in (any thread; once per delta, in the
        order the steps made them). Every reader of a step's deltas calls it."""
        return self.text.render(deltas)

    def expire(self, now: float) -> list[RequestDelta]:
        """Abort every tracked request whose deadline (``time.time()``) has passed."""
        late = [s.request_id for s in self.output.sequences.values()
                if s.deadline is not None and s.deadline < now]
        deltas = [delta for request_id in late for delta in self.abort_request(request_id)]
        for delta in deltas:
            delta.error, delta.deadline_exceeded = "the request's deadline passed", True
        return deltas

    def abort_all(self, error: str) -> list[RequestDelta]:
        """Abort every tracked request; each final delta carries ``error``."""
        deltas = [delta for request_id in list(self.output.sequences)
                  for delta in self.abort_request(request_id)]
        for delta in deltas:
            delta.error = error
        return deltas

    def untrack(self, request_id: str) -> Sequence | None:
        """Stop following a request (it left this engine: handed off or aborted elsewhere);
        its text state goes too."""
        return self.output.untrack(request_id)

    def hand_off(self, seq: Sequence) -> None:
        """A prefill worker's prompt is done and its KV packed (copies): it leaves this engine,
        its blocks go back to the pool (full ones stay in the prefix cache)."""
        self.scheduler.hand_off(seq)
        self.parts.block_manager.free(seq)
        self.untrack(seq.request_id)

    def reserve_blocks(self, seq: Sequence) -> int:
        """Blocks for every token of untracked ``seq`` (a decode reservation): the leading
        blocks its prefix cache holds are shared, the rest allocated. Returns how many leading
        blocks were cached (their KV need not be sent); NoRoomNow, with nothing held, when the
        pool has no room for the rest now."""
        bm = self.parts.block_manager
        adapters = self.parts.adapters
        if seq.adapter is not None and adapters is not None and not adapters.can_take(seq.adapter):
            raise NoRoomNow(f"all {adapters.max_loras} LoRA slots are in use by other "
                            f"adapters (max_loras); request {seq.request_id} needs "
                            f"{seq.adapter.name!r}")
        bm.match_prefix(seq)
        if not bm.can_allocate(seq, seq.num_tokens - seq.num_computed_tokens):
            needed = bm.blocks_needed(seq, seq.num_tokens - seq.num_computed_tokens)
            bm.free(seq)
            raise NoRoomNow(f"{bm.num_allocatable_blocks} free KV blocks, request "
                            f"{seq.request_id} needs {needed}")
        num_cached = seq.num_computed_tokens // bm.block_size
        bm.allocate(seq, seq.num_tokens - seq.num_computed_tokens)
        if bm.offload is not None:  # before the KV that comes writes into evicted blocks
            bm.flush_saves()
        self.scheduler.pin_adapter(seq)
        return num_cached

    def release_blocks(self, seq: Sequence) -> None:
        """Free the blocks (and the LoRA slot) of an untracked ``seq`` (a reservation that ends
        before it runs)."""
        self.parts.block_manager.free(seq)
        self.scheduler.unpin_adapter(seq)

    def start_running(self, seq: Sequence, first_token_id: int,
                      num_stand_ins: int = 0) -> RequestDelta:
        """Join ``seq``, whose KV fills its reserved blocks, with its token 0 sampled elsewhere:
        the token runs through the same stop rules and detokenizer here, so later deltas
        continue exactly where the prefill worker left off. ``num_stand_ins``: the leading
        received blocks that hold no KV (``BlockManager.adopt_received``). Returns token 0's
        delta."""
        seq.num_computed_tokens = seq.num_tokens
        seq.prompt_logprobs = None  # (the prefill worker sent them with token 0)
        self.parts.block_manager.adopt_received(seq, num_stand_ins)  # its prompt's KV is in
        self.track(seq)
        try:
            if seq.sampling_params.num_sequences > 1:  # one KV hand-off, forked here
                self._fork(seq)
            delta = self.output.append_token(seq, first_token_id, None, time.monotonic())
            self.render(StepDeltas([delta]))
            if not seq.is_finished:
                self.scheduler.add_running(seq)
        except Exception:
            self.abort(seq.request_id)  # (untracked, out of the scheduler, forks too)
            raise
        return delta

    def drain_kv_events(self) -> KVEvents | None:
        """The prefix cache's changes since the last call, as the next numbered batch (None:
        no change, or prefix caching off); any thread. What the routers' index is fed."""
        events = self.parts.block_manager.events
        return None if events is None else events.drain()

    def kv_snapshot(self) -> KVSnapshot | None:
        """Every block hash the prefix cache holds (pool and tiers), as of the last batch
        drained (any thread; None with prefix caching off)."""
        events = self.parts.block_manager.events
        return None if events is None else events.snapshot()

    def close(self) -> None:
        """Stop what the engine runs beside this process (its tensor parallel ranks, its
        grammar threads)."""
        self._grammar_pool.shutdown(wait=False, cancel_futures=True)
        self.parts.close()

    def broken(self) -> str | None:
        """Why this engine cannot step any more though its process runs (one of its tensor
        parallel ranks has exited); None while it can. Safe from any thread."""
        ranks = self.ranks
        return None if ranks is None else ranks.followers.exited()

    @property
    def ranks(self) -> TensorParallelRunner | None:
        """The tensor parallel group's rank 0 (its followers' roles reached through it:
        ``call_ranks``, ``step_extras``, ``published``, ``reports``); None on one rank."""
        runner = self.parts.runner
        return runner if isinstance(runner, TensorParallelRunner) else None

    @property
    def kv_caches(self) -> list:
        """The KV pool, one entry per layer (what a prefill worker packs and ships)."""
        return self.parts.runner.kv_caches

    @property
    def device(self) -> torch.device:
        return self.parts.runner.device

    def abort(self, request_id: str) -> RequestDelta | None:
        """Idempotent: frees the request's blocks, those of every sequence it forked into
        too (:meth:`abort_request`); returns sequence 0's final delta if it was live."""
        deltas = self.abort_request(request_id)
        return deltas[0] if deltas and deltas[0].request_id == request_id else None

    def abort_request(self, request_id: str) -> list[RequestDelta]:
        """Idempotent: abort every sequence of the request (``n``/``best_of`` > 1: each it
        forked into); the final deltas of those that were live, sequence 0's first."""
        self._to_fork.pop(request_id, None)
        deltas = [self.output.abort(choice_request_id(request_id, index))
                  for index in range(MAX_N)]
        return [delta for delta in deltas if delta is not None]

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished

    @property
    def num_requests(self) -> int:
        return len(self.output.sequences)

    # -- stepping ---------------------------------------------------------------------------

    def step(self) -> StepDeltas:
        """One step; its deltas go through :meth:`render` before anyone reads them."""
        start = time.perf_counter()
        output = self.scheduler.schedule()
        deltas = StepDeltas(self.output.handed_back(output.bounced))
        for seq in output.bounced:  # (forks when it comes back, prefilled anew)
            self._to_fork.pop(seq.request_id, None)
        if output.is_empty:
            self.last_step = StepStats()
            return deltas
        sampling = [item for item in output.chunks if item.samples]
        if self.speculator is not None:  # drafts ride in the batch after each decode's token
            self.speculator.propose(output.chunks)
        runner = self.parts.runner
        batch = runner.prepare(output)
        after_layer = self.hooks.before_forward(sampling)
        offload = self.parts.block_manager.offload
        if offload is not None:  # before this forward writes into blocks evicted for it
            self.parts.block_manager.flush_saves()
        forward_start = time.perf_counter()
        logits = runner.run(batch, after_layer)
        forward_s = time.perf_counter() - forward_start
        if offload is not None and output.chunks:
            offload.note_compute(output.num_batched_tokens, forward_s)
        self.hooks.after_forward()
        if batch.num_scored:  # the last rows: prompt positions, before update moves the chunks
            score_prompts(output.chunks, logits[len(logits) - batch.num_scored:])
            logits = logits[:len(logits) - batch.num_scored]
        self.scheduler.update(output)
        num_decodes = len(output.decodes)  # the logits' first rows, one per decode
        if num_decodes:
            deltas.extend(self._rows_step(runner.rows, logits[:num_decodes]))
        if sampling:
            logits = logits[num_decodes:]
            seqs = [item.seq for item in sampling]
            if self.speculator is not None and self.speculator.drafted(sampling):
                self._constrain_drafts(sampling, logits)
                token_ids, logprobs, faults = self.speculator.verify(sampling, logits,
                                                                     self.draw)
            else:
                token_ids, logprobs, faults = self.draw(logits, seqs)
                token_ids = [[t] for t in token_ids]
                logprobs = [None if e is None else [e] for e in logprobs]
            if self._to_fork:  # before any of them can finish and free its blocks
                for i, seq in enumerate(seqs):  # (one that failed ends its request unforked)
                    if self._to_fork.get(seq.request_id) is seq and i not in faults:
                        del self._to_fork[seq.request_id]
                        self._fork(seq)
            made = self.output.emit(seqs, token_ids, logprobs, faults)
            if self.speculator is not None:  # rejected drafts' slots go back to the pool
                self.speculator.roll_back_each(sampling)
            deltas.extend(self.hooks.after_sample(sampling, made))
        self.last_step = StepStats(output.num_batched_tokens, output.num_seqs, forward_s,
                                   time.perf_counter() - start)
        return deltas

    def _rows_step(self, rows: DecodeRows, logits: torch.Tensor) -> StepDeltas:
        """The decodes' tokens, one per row, drawn with the rows' own arrays, appended by
        ``rows.advance``, then their deltas; the rows learn which ended."""
        version = self.scheduler.running_version
        if rows.all_greedy:
            faults = self._non_finite_rows(logits)
            if rows.any_per_token:  # (a constrained row is one: few steps pay for the check)
                self._constrain(logits, rows.seqs)
            tokens, logprobs = greedy_token_array(logits), None
            token_ids = tokens.tolist()
        else:  # the parameters are the rows' arrays; token histories only for penalties
            def batch() -> SamplingBatch:
                penalized = list(map(sampling_row, rows.seqs)) if rows.any_penalized else None
                return rows.sampling_batch(penalized)
            token_ids, logprobs, faults = self.draw(logits, rows.seqs, batch)
            tokens = np.asarray(token_ids, np.int64)
        rows.advance(token_ids, tokens)
        deltas, ended = self.output.emit_rows(rows, token_ids, logprobs, faults)
        if ended:
            rows.ended(ended, version, self.scheduler.running_version)
        return deltas

    # -- drawing tokens: a request that makes its step fail fails alone ------------------------

    def draw(self, logits: torch.Tensor, seqs: list[Sequence],
             batch: Callable[[], SamplingBatch] | None = None) -> tuple[list, list, dict]:
        """(token_ids, logprobs, faults): one token per row of ``logits``, row ``i`` drawn for
        ``seqs[i]`` (from ``batch()``, its sampling inputs, when given; else built from the
        sequences). ``faults`` maps the rows that failed to their error: a row whose logits
        are not finite (int8 KV), or that fails to sample alone when the batch failed (its
        token is the row's argmax, a placeholder never emitted). A constrained sequence's
        row is limited to what its grammar allows first."""
        faults = self._non_finite_rows(logits)  # (before the grammars' -inf go in)
        self._constrain(logits, seqs)
        if batch is None and Sampler.is_plain_greedy([seq.sampling_params for seq in seqs]):
            return greedy_tokens(logits), [None] * len(seqs), faults
        try:
            sampled = (self.sampler.sample(logits, batch()) if batch is not None
                       else self.sampler(logits, list(map(sampling_row, seqs))))
            return sampled.token_ids, sampled.logprobs, faults
        except Exception:  # noqa: BLE001 - find the rows at fault instead of dying
            logger.exception("sampling %d rows failed; sampling each row alone", len(seqs))
        token_ids, logprobs = [], []
        for i, seq in enumerate(seqs):
            try:
                sampled = self.sampler(logits[i:i + 1], [sampling_row(seq)])
                token_ids.append(sampled.token_ids[0])
                logprobs.append(sampled.logprobs[0])
            except Exception as exc:  # noqa: BLE001 - this row's request fails alone
                faults[i] = exc
                token_ids.append(int(logits[i].argmax()))
                logprobs.append(None)
        return token_ids, logprobs, faults

    def _non_finite_rows(self, logits: torch.Tensor) -> dict[int, Exception]:
        """With an int8 KV cache, the rows whose logits hold NaN or inf (each fails alone)."""
        if self._int8_kv is None:
            return {}
        bad = (~torch.isfinite(logits).all(dim=1)).nonzero().flatten().tolist()
        return {i: FloatingPointError(
            f"non-finite logits with the int8 KV cache (kv_int8_scales={self._int8_kv!r}): "
            "its scales or dequantized values overflowed; serve this model with "
            "kv_cache_dtype='auto'") for i in bad}


def _copy_outcome(target: Future, source: Future) -> None:
    """Resolve ``target`` as ``source`` resolved."""
    if source.cancelled():
        target.cancel()
        return
    exc = source.exception()
    if exc is not None:
        target.set_exception(exc)
    else:
        target.set_result(source.result())
