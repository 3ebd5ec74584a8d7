"""Continuous batching with chunked prefill and preemption by recompute.

Lifecycle of one step (the engine drives it):

1. ``schedule()``: running sequences claim the token budget in the policy's order (decodes
   take one token, partial prefills a chunk of what is left). A sequence that cannot get
   blocks preempts the newest unscheduled running sequence (tail first, possibly itself):
   its blocks are freed, ``num_computed_tokens`` drops to 0 and it goes to the FRONT of
   waiting. If no running sequence went short, waiting sequences are admitted FCFS: prefix
   cache first (``match_prefix``), then a chunk of what remains, while ``max_num_seqs`` and
   the budget allow; admission stops at a request whose prefix is still coming up from the
   disk tier while others have work (``BlockManager.coming_up``). Returns one
   :class:`SchedulerOutput`: the decodes (under a policy that puts them on the runner's rows,
   ``decodes_on_rows``, and without speculation), then the chunks. When nothing but positions
   changed since the last step (every running sequence decodes, nothing to admit), the
   schedule is the last one's decodes, moved on by a diff: those that joined, those entering a
   new block and the block each got (``_schedule_steady``), without a pass over the running
   set.
2. The model runner computes each decode's last token and each chunk's
   ``seq.token_ids[start : start + num_new_tokens]`` in one forward; the engine samples one
   token for every decode and for the chunks whose ``samples`` is True.
3. ``update(output)``: advance ``num_computed_tokens``, register full blocks in the prefix
   cache, free blocks that left the sliding window. Call it before ``finish``.
4. The engine appends sampled tokens, decides stop, and calls ``finish(seq, status)`` (or
   ``hand_off`` on a prefill worker, whose blocks then belong to the KV sender).

Queues: ``waiting`` (deque, FCFS, status WAITING, no blocks) and ``running`` (list in
admission order, status RUNNING, blocks cover ``num_computed_tokens``).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable

from pdserve.engine.adapters import AdapterSlots
from pdserve.engine.kv_cache.block_manager import BlockManager
from pdserve.engine.sequence import Sequence, SequenceStatus
from pdserve.engine.step.scheduler_output import ScheduledSequence, SchedulerConfig, SchedulerOutput
from pdserve.engine.step.scheduling_policy import (
    DecodePolicy,
    PrefillOnlyPolicy,
    SchedulingPolicy,
)

logger = logging.getLogger(__name__)

__all__ = ["DecodePolicy", "PrefillOnlyPolicy", "ScheduledSequence", "Scheduler",
           "SchedulerConfig", "SchedulerOutput", "SchedulingPolicy"]


def _remove(items: list[Sequence] | deque[Sequence], seq: Sequence) -> bool:
    """Remove seq by identity (dataclass equality compares every field)."""
    for i, item in enumerate(items):
        if item is seq:
            del items[i]
            return True
    return False


class Scheduler:
    """Owns the waiting and running queues of one engine and decides each step's batch."""

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager,
                 policy: SchedulingPolicy | None = None):
        self.config = config
        self.block_manager = block_manager
        self.policy = policy if policy is not None else SchedulingPolicy()
        self.waiting: deque[Sequence] = deque()  # FCFS; preempted ones go to the front
        self.running: list[Sequence] = []  # admission order; the tail is preempted first
        self.running_version = 0  # counts changes to ``running`` (the runner's rows mirror one)
        self._seqs: dict[str, Sequence] = {}  # request_id -> every waiting or running seq
        self.num_preemptions = 0  # preemptions since start, every kind
        self.num_bounces = 0  # of which handed back to the router (decode role)
        # speculative decoding (set by the engine): draft slots a decode may get this step
        self.lookahead: Callable[[Sequence], int] | None = None
        self._decodes: list[Sequence] = []  # the latest steady step's sequences
        self._decodes_version = -1  # the running_version they are
        # sequences that need a block at the next steady step (None: not known, every
        # sequence is checked), and those that joined running since the latest schedule()
        self._due: list[Sequence] | None = None
        self._joined: list[Sequence] = []
        # LoRA (set by the engine when it serves adapters): a running sequence pins its
        # adapter's slot; a waiting one for an adapter without a slot waits for one
        self.adapters: AdapterSlots | None = None
        # (set by the engine where a decode step of up to this many rows runs as one fused
        # call, far faster a token than a step of more): decodes a step at most, the running
        # sequences taking turns, those that waited the most steps first (_decode_turns)
        self.max_decode_rows: int | None = None
        self._turns_waited: dict[int, int] = {}  # id(seq) -> steps it has waited for a turn

    # ---- counts -------------------------------------------------------------------------

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def has_unfinished(self) -> bool:
        return bool(self._seqs)

    def get(self, request_id: str) -> Sequence | None:
        return self._seqs.get(request_id)

    # ---- entry points -------------------------------------------------------------------

    def check_fits(self, seq: Sequence) -> None:
        """Raise ValueError if seq alone could never be served by this scheduler's pool."""
        bm, cfg = self.block_manager, self.config
        prompt_len = seq.num_prompt_tokens
        if prompt_len < 1:
            raise ValueError("prompt length must be at least 1 token")
        if prompt_len > cfg.max_model_len - 1:
            raise ValueError(f"prompt length ({prompt_len}) exceeds max_model_len - 1 "
                             f"({cfg.max_model_len - 1}); one position is kept for output")
        max_tokens = seq.sampling_params.max_tokens
        total = min(prompt_len + max_tokens, cfg.max_model_len)
        blocks = -(-total // bm.block_size)
        if bm.sliding_window is not None and cfg.enable_chunked_prefill:
            blocks = min(blocks, -(-bm.sliding_window // bm.block_size) + 2)
        if blocks > bm.num_blocks:
            raise ValueError(f"prompt length + max_tokens ({prompt_len} + {max_tokens}) needs "
                             f"{blocks} KV blocks of {bm.block_size} tokens, more than the "
                             f"{bm.num_blocks} blocks in the pool")

    def _track(self, seq: Sequence) -> None:
        if seq.request_id in self._seqs:
            raise ValueError(f"request_id {seq.request_id!r} is already scheduled")
        self._seqs[seq.request_id] = seq

    def add(self, seq: Sequence) -> None:
        """Queue a new prompt. ValueError if it can never fit."""
        if seq.block_table or seq.num_computed_tokens:
            raise ValueError(f"{seq.request_id}: a new sequence must hold no blocks and no "
                             f"computed tokens")
        self.check_fits(seq)
        self._track(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def add_running(self, seq: Sequence) -> None:
        """Join a sequence whose KV is already in its blocks (decode worker after commit)."""
        if not self.policy.accepts_running:
            raise ValueError(f"a {self.policy.name} scheduler takes no running sequences")
        if self.block_manager.blocks_needed(seq, 0):
            raise ValueError(f"{seq.request_id}: block_table ({len(seq.block_table)} blocks) "
                             f"does not cover num_computed_tokens ({seq.num_computed_tokens})")
        self.check_fits(seq)
        self._track(seq)
        seq.status = SequenceStatus.RUNNING
        self._join_running(seq)

    def _join_running(self, seq: Sequence) -> None:
        """Every change to ``running`` goes through here or :meth:`_leave_running`: the
        version they count is what the runner's rows mirror; a steady step checks the
        sequences that joined since the last one."""
        self.pin_adapter(seq)
        self.running.append(seq)
        self.running_version += 1
        self._joined.append(seq)

    def _leave_running(self, seq: Sequence) -> bool:
        if not _remove(self.running, seq):
            return False
        self.unpin_adapter(seq)
        self.running_version += 1
        return True

    def pin_adapter(self, seq: Sequence) -> None:
        """Hold seq's LoRA slot (loading the adapter into one), unless it holds it already
        or runs the base model; RuntimeError when every slot is pinned by other adapters."""
        if seq.adapter is not None and seq.lora_slot < 0:
            if self.adapters is None:
                raise ValueError(f"{seq.request_id}: LoRA adapter {seq.adapter.name!r} asked "
                                 f"of an engine without LoRA (enable_lora)")
            seq.lora_slot = self.adapters.acquire(seq.adapter)

    def unpin_adapter(self, seq: Sequence) -> None:
        if seq.lora_slot >= 0 and self.adapters is not None:
            self.adapters.release(seq.lora_slot)
            seq.lora_slot = -1

    def _drop(self, seq: Sequence) -> bool:
        """Forget seq (queues only, blocks untouched); False if it was not tracked."""
        if self._seqs.get(seq.request_id) is not seq:
            return False
        del self._seqs[seq.request_id]
        if not self._leave_running(seq):
            _remove(self.waiting, seq)
        return True

    def finish(self, seq: Sequence, status: SequenceStatus) -> None:
        """End seq: drop it from the queues, free its blocks, set a finished status once."""
        if not SequenceStatus(status).is_finished:
            raise ValueError(f"status must be a finished status, got {status!r}")
        self._drop(seq)
        self.block_manager.free(seq)
        if not seq.is_finished:
            seq.status = status

    def abort(self, request_id: str) -> Sequence | None:
        """Abort a waiting or running request; None if unknown or already finished."""
        seq = self._seqs.get(request_id)
        if seq is None:
            return None
        self.finish(seq, SequenceStatus.FINISHED_ABORTED)
        logger.debug("aborted %s", request_id)
        return seq

    def hand_off(self, seq: Sequence, status: SequenceStatus = SequenceStatus.SENDING_KV) -> None:
        """Drop seq from the queues but keep its blocks: the caller now owns and frees them."""
        if not self._drop(seq):
            raise ValueError(f"{seq.request_id} is not scheduled here")
        seq.status = status

    # ---- one step -----------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = self._schedule_steady()
        self._joined = []
        if out is not None:
            return out
        self._due = None  # (known again after the next steady step)
        out = SchedulerOutput()
        budget, short, deferred = self._schedule_running(out, self.config.max_num_batched_tokens)
        # never admit while the running set is short of blocks
        if not short and not self._holds_admission():
            budget = self._schedule_waiting(out, budget)
        for seq in deferred:  # prefills that let better waiting requests go first
            if budget <= 0 or out.num_seqs >= self.config.max_num_seqs:
                break
            if seq.status == SequenceStatus.RUNNING:
                budget -= self._schedule_one(seq, budget, out)[0]
        now = time.monotonic()
        for seq in out.sequences():
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = now
        return out

    @property
    def _decodes_on_rows(self) -> bool:
        """Whether decodes go to ``SchedulerOutput.decodes`` (the runner's rows): when the
        policy puts them there and nothing speculates (a speculating decode is a chunk)."""
        return self.policy.decodes_on_rows and self.lookahead is None

    def _holds_admission(self) -> bool:
        """Whether the waiting prompts wait this step (``SchedulerConfig.admission_hold_s``).

        While sequences decode, each step that also computes a prompt takes that prompt's
        time out of every decode's next token. Held up to the hold from the oldest one's
        arrival, prompts that arrive close together prefill in one step and the decodes run
        without prefills between them: lower time per output token, later first tokens.
        They go at once when nothing decodes (an idle engine adds no wait), when they are at
        least as many as the decodes (holding them would leave the batch smaller than what
        waits) or when they fill a step's budget (waiting longer would batch no more)."""
        hold = self.config.admission_hold_s
        if hold <= 0.0 or not self.waiting:
            return False
        decoding = sum(len(s.token_ids) - s.num_computed_tokens == 1 for s in self.running)
        if len(self.waiting) >= decoding:
            return False
        if time.monotonic() - min(s.arrival_time for s in self.waiting) >= hold:
            return False
        waiting_tokens = sum(s.num_uncomputed_tokens for s in self.waiting)
        return waiting_tokens < self.config.max_num_batched_tokens

    def _admits_waiting(self) -> bool:
        """Whether this step admits waiting prompts: some wait, a seat is free, none is held."""
        return (bool(self.waiting) and len(self.running) < self.config.max_num_seqs
                and not self._holds_admission())

    def _schedule_steady(self) -> SchedulerOutput | None:
        """The decodes of every running sequence, made from the last steady step's by a diff,
        when that is what the general schedule would give: nothing waits (or every seat is
        taken), decodes are on the rows, every running sequence has one token left to
        compute, all fit the step's limits, and the sequences entering a new block get one.
        None when the step needs the general schedule."""
        cfg = self.config
        if not self._decodes_on_rows or not self.running or self._admits_waiting():
            return None  # (with every seat taken, the general schedule would admit no one)
        running = SequenceStatus.RUNNING  # (joined or due, then finished: no longer)
        due, joined = self._due, [s for s in self._joined if s.status == running]
        if due is None or self._decodes_version != self.running_version:
            seqs = (self.policy.order_running(self.running) if self.policy.by_priority
                    else list(self.running))  # (all decodes: FCFS order is admission order)
            if len(seqs) > min(cfg.max_num_seqs, cfg.max_num_batched_tokens,
                               self.max_decode_rows or len(seqs)):
                return None
            if due is None:  # not known since a general step: every sequence is checked
                joined = seqs
            if any(len(s.token_ids) - s.num_computed_tokens != 1 for s in joined):
                return None
            self._decodes, self._decodes_version = seqs, self.running_version
        seqs, bs = self._decodes, self.block_manager.block_size
        if due is None or joined:  # (in the step's order, as the general schedule would)
            due = [s for s in seqs if s.num_computed_tokens == len(s.block_table) * bs]
        else:  # those the last step's update noted, less any that finished since
            due = [s for s in due if s.status == running]
        blocks = self.block_manager.append_block_each(due) if due else []
        if blocks is None:
            return None  # the general schedule preempts
        self._due = None  # (update() finds the next step's)
        now = time.monotonic()
        for seq in joined:
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = now
        return SchedulerOutput(decodes=seqs, decodes_version=self.running_version,
                               joined=list(joined), grown=due, new_blocks=blocks,
                               num_batched_tokens=len(seqs))

    def _schedule_running(self, out: SchedulerOutput,
                          budget: int) -> tuple[int, bool, list[Sequence]]:
        """Give running sequences their tokens; returns (budget left, went short of blocks,
        the prefills deferred behind better waiting requests)."""
        short, deferred = False, []
        decodes, chunks, max_num_seqs = out.decodes, out.chunks, self.config.max_num_seqs
        fast, block_size = self.policy.decodes_take_one_token, self.block_manager.block_size
        fast = fast and self.lookahead is None  # speculating decodes take draft slots too
        on_rows = self._decodes_on_rows
        running, num_fast = SequenceStatus.RUNNING, 0  # (locals: this loop runs per sequence)
        ordered = self.policy.order_running(self.running)
        waits = self._decode_turns(ordered)
        for seq in ordered:
            if budget <= 0 or len(decodes) + len(chunks) >= max_num_seqs:
                break
            if seq.status != running:  # preempted earlier in this loop
                continue
            if waits and id(seq) in waits:  # a decode whose turn this step is not
                continue
            computed = seq.num_computed_tokens
            if (fast and len(seq.token_ids) - computed == 1
                    and computed < len(seq.block_table) * block_size):
                # a decode whose last block has room (most sequences, most steps)
                if on_rows:
                    decodes.append(seq)
                else:
                    chunks.append(ScheduledSequence(seq, 1))
                num_fast += 1
                budget -= 1
                continue
            if self.policy.defers(seq, self.waiting):
                deferred.append(seq)
                continue
            used, went_short = self._schedule_one(seq, budget, out)
            budget -= used
            short = short or went_short
        out.num_batched_tokens += num_fast
        return budget, short, deferred

    def _decode_turns(self, ordered: list[Sequence]) -> dict[int, int]:
        """The decodes that wait this step (id -> steps waited, this one counted). None wait
        unless the step is one of decodes alone (no prompt chunk runs, none is admitted: a
        step with a prompt runs the unfused forward anyway, in which decodes cost little more
        a token) and more than ``max_decode_rows`` of them; then all but the
        ``max_decode_rows`` that waited the most steps (in the policy's order among equals),
        so none waits more than ceil(decodes / max_decode_rows) - 1 steps in a row."""
        cap, lookahead = self.max_decode_rows, self.lookahead
        decoding = ([] if cap is None or lookahead is not None else
                    [s for s in ordered if len(s.token_ids) - s.num_computed_tokens == 1])
        if len(decoding) <= (cap or 0) or len(decoding) < len(ordered) or self._admits_waiting():
            self._turns_waited = {}
            return self._turns_waited
        last = self._turns_waited
        decoding.sort(key=lambda s: -last.get(id(s), 0))  # (stable: the policy's order)
        self._turns_waited = {id(s): last.get(id(s), 0) + 1 for s in decoding[cap:]}
        return self._turns_waited

    def _schedule_one(self, seq: Sequence, budget: int, out: SchedulerOutput) -> tuple[int, bool]:
        """Schedule running ``seq``'s next tokens; returns (tokens scheduled, went short)."""
        n = self.policy.num_new_tokens(seq, seq.num_computed_tokens, budget,
                                       self.config.enable_chunked_prefill)
        if n <= 0:
            return 0, False
        if self.lookahead is not None and n == 1 and seq.num_uncomputed_tokens == 1:
            return self._schedule_speculative(seq, budget, out)
        if seq.num_computed_tokens + n <= len(seq.block_table) * self.block_manager.block_size:
            self._add(out, seq, n)  # the table already covers the tokens
            return n, False
        short = False
        if not self.block_manager.can_allocate(seq, n):
            short = True
            n = self._make_room(seq, n, out)
            if n == 0:
                return 0, short
        self.block_manager.allocate(seq, n)
        self._add(out, seq, n)
        return n, short

    def _add(self, out: SchedulerOutput, seq: Sequence, n: int) -> None:
        """Running ``seq``'s ``n`` tokens into ``out``: a decode on the rows when it computes
        its last token alone and decodes are on the rows, else a chunk."""
        if n == 1 and self._decodes_on_rows and seq.num_uncomputed_tokens == 1:
            out.add_decode(seq)
        else:
            out.add(seq, n)

    def _schedule_speculative(self, seq: Sequence, budget: int,
                              out: SchedulerOutput) -> tuple[int, bool]:
        """A decode that may speculate: its one token as any decode (preempting if it must),
        then up to ``lookahead(seq)`` draft slots from the budget and free blocks only."""
        bm = self.block_manager
        short = not bm.can_allocate(seq, 1)
        if short and self._make_room(seq, 1, out) == 0:
            return 0, short
        k = max(0, min(self.lookahead(seq), budget - 1, bm.num_allocatable_tokens(seq) - 1))
        bm.allocate(seq, 1 + k)
        out.add(seq, 1, k)
        return 1 + k, short

    def _make_room(self, seq: Sequence, n: int, out: SchedulerOutput) -> int:
        """Preempt newest unscheduled sequences until seq's n tokens fit.

        When seq itself is the newest, shrink its chunk to what fits, or preempt it when not
        even one token fits. Returns the tokens seq computes now (0 = seq was preempted).
        """
        bm = self.block_manager
        while not bm.can_allocate(seq, n):
            scheduled = set(map(id, out.sequences()))
            candidates = [s for s in self.running if id(s) not in scheduled]
            victim = self.policy.pick_victim(candidates)
            if not any(victim is s for s in candidates):
                raise RuntimeError(f"policy {self.policy.name} picked a victim outside the "
                                   f"unscheduled running sequences")
            if victim is seq:
                fit = min(n, bm.num_allocatable_tokens(seq))
                if fit >= 1 and self.config.enable_chunked_prefill:
                    return fit
                self._preempt(seq, out)
                return 0
            self._preempt(victim, out)
        return n

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self._leave_running(seq)
        self.block_manager.free(seq)
        seq.num_preemptions += 1
        self.num_preemptions += 1
        if self.policy.preempt_kind == "bounce":  # ended here; the router places it again
            self._drop(seq)
            seq.status = SequenceStatus.FINISHED_ABORTED
            self.num_bounces += 1
            out.bounced.append(seq)
            logger.debug("bounced %s back to the router", seq.request_id)
            return
        seq.num_computed_tokens = 0
        seq.num_cached_tokens = 0
        seq.num_draft_computed_tokens = 0  # speculative decoding: the draft's KV went too
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        out.preempted.append(seq)
        logger.debug("preempted %s (recompute %d tokens)", seq.request_id, seq.num_tokens)

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> int:
        """Admit waiting sequences in the policy's order while seats, budget, blocks and
        ``prefill_batch_tokens`` allow; returns the budget left."""
        cfg, bm = self.config, self.block_manager
        prompt_tokens = sum(item.num_new_tokens for item in out.chunks if not item.is_decode)
        while (budget > 0 and len(self.running) < cfg.max_num_seqs
               and out.num_seqs < cfg.max_num_seqs):
            seq = self.policy.next_waiting(self.waiting)
            if seq is None:
                break
            if seq.adapter is not None and self.adapters is not None \
                    and not self.adapters.can_take(seq.adapter):
                break  # (its adapter waits for a slot other adapters' sequences free)
            hit = bm.find_prefix(seq)  # (one lookup of its chain for every question below)
            if (self.running or out.num_seqs) and bm.coming_up(hit):
                break  # (its prefix is on its way up from disk: the others step meanwhile)
            n = self.policy.num_new_tokens(seq, hit.num_tokens, budget,
                                           cfg.enable_chunked_prefill)
            if n <= 0:
                break
            if prompt_tokens and cfg.prefill_batch_tokens is not None \
                    and prompt_tokens + n > cfg.prefill_batch_tokens:
                break  # (it waits for a step of its own rather than make these wait for it)
            room = bm.admission_room(seq, hit)
            if room < n:
                # Alone, a chunk shrinks to what fits so a sliding-window request progresses.
                if self.running or not cfg.enable_chunked_prefill or room < 1:
                    break
                n = room
            _remove(self.waiting, seq)
            bm.match_prefix(seq, hit)
            bm.allocate(seq, n)
            seq.status = SequenceStatus.RUNNING
            self._join_running(seq)
            out.add(seq, n)
            budget -= n
            prompt_tokens += n
        return budget

    def update(self, output: SchedulerOutput) -> None:
        """After the model ran: advance progress, cache full blocks, free out-of-window blocks."""
        if output.decodes:
            self._update_decodes(output)
        if output.chunks:
            self._update_chunks(output.chunks)

    def _update_chunks(self, chunks: list[ScheduledSequence]) -> None:
        bm = self.block_manager
        bs = bm.block_size
        # only a block filled by this step gets hashed; only a window frees blocks
        caching, windowed = bm.enable_prefix_caching, bm.sliding_window is not None
        finished = SequenceStatus.FINISHED_STOPPED  # (a local: this loop runs per sequence)
        for item in chunks:
            seq = item.seq
            if seq.status >= finished:  # finished or aborted between schedule and update
                continue
            computed = seq.num_computed_tokens = item.start + item.num_new_tokens
            if computed > len(seq.token_ids):
                raise RuntimeError(f"{seq.request_id}: computed {computed} of "
                                   f"{seq.num_tokens} tokens")
            if caching and computed // bs > item.start // bs:
                bm.cache_computed_blocks(seq)
            if windowed:
                bm.free_out_of_window(seq)

    def _update_decodes(self, output: SchedulerOutput) -> None:
        """The decodes computed one more token each; after a steady step, note those whose
        next position starts a block they do not have (the next steady step gives them one)."""
        bm = self.block_manager
        bs = bm.block_size
        filled = []
        for seq in output.decodes:  # (runs per sequence per step: keep it lean)
            computed = seq.num_computed_tokens = seq.num_computed_tokens + 1
            if not computed % bs:
                filled.append(seq)
        if filled and bm.enable_prefix_caching:
            bm.cache_filled_blocks(filled)
        steady = output.decodes_version >= 0
        if steady:
            self._due = [s for s in filled if s.num_computed_tokens == len(s.block_table) * bs]
        window = bm.sliding_window
        if window is None:
            return
        if not steady:  # (a general step frees every decode's, as it does every chunk's)
            for seq in output.decodes:
                bm.free_out_of_window(seq)
            return
        joined = set(map(id, output.joined))  # (a decode worker's bring whole prompts)
        for seq in output.decodes:  # those whose step pushed a block out, and those that joined
            oldest = seq.num_computed_tokens - (window - 1)  # next query's first key
            if (oldest > 0 and not oldest % bs) or id(seq) in joined:
                bm.free_out_of_window(seq)
