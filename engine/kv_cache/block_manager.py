"""Paged KV block allocator: ref counts, a prefix cache of chained block hashes, LRU eviction.

Every block is in exactly one of three states:

- **free**: ref count 0, no hash; on the free list.
- **cached**: ref count 0 but holding a prefix-cache hash; evictable, kept in LRU order
  (least recently released first). Allocation takes free blocks first, then evicts the LRU
  cached block and drops its hash.
- **used**: ref count > 0; the ref count equals the number of block tables that hold it (a
  block is shared through a prefix-cache hit, or by :meth:`BlockManager.fork`: the sequences
  of one request, ``n`` > 1, hold one copy of their prompt's full blocks).

Invariants (``check_invariants`` raises ``RuntimeError`` on a violation):

- ``num_free_blocks + num_cached_blocks + num_used_blocks == num_blocks`` at all times.
- A block table only grows (append-only) until ``free`` clears it; with a sliding window an
  entry becomes ``None`` once its block is out of every future query's window. The one
  exception is ``trim``: speculative decoding gives back the tail blocks it allocated for
  drafts the target rejected (never hashed: they lie past ``num_computed_tokens``).
- ``free`` releases a table in reverse order, tails first, so the LRU end of the cache holds
  chain tails and the heads of shared prefixes survive longest.
- A hash maps to one block; a block carries at most one hash. A block's hash is the salted
  sha256 of its parent's hash and its token ids (``pdserve.engine.kv_cache.prefix_hash``),
  chained from the first block, so a hit on block ``i`` implies the whole prefix
  ``[0, (i + 1) * block_size)`` matches. The salt is one per cluster (the launcher passes it
  in ``EngineConfig.prefix_cache_salt``); without one each block manager draws its own.
- ``match_prefix`` never serves every token of a sequence from the cache: at least one token
  is left to compute so the step can sample from its logits.

KV tiers (``offload``, docs/kv-tiers.md): a hashed block evicted from the pool is noted and
saved below it (``flush_saves``) before anything writes into it; a prefix lookup continues past
the pool into the tiers, and ``match_prefix`` loads those blocks into fresh pool blocks (checked)
and hashes them there, cutting the hit at the first block whose load failed.

Which blocks hold real KV (the one rule every hash obeys): entry ``i`` of a block table holds
the KV of exactly tokens ``[i * block_size, (i + 1) * block_size)`` when it is not ``None``,
those tokens are all before ``num_computed_tokens``, and it is not a stand-in. Only such a
block ever gets a hash. Blocks past ``num_computed_tokens`` (reserved for a transfer still on
its way, slots of drafts) are never hashed. A stand-in is a block a decode worker received
without KV: a prefill worker that ships a windowed prompt may have freed its leading blocks
(out of its window) during its chunked prefill; it sends block 0's contents for each, so the
shipment still maps one to one onto the reservation's blocks, and its COMMIT says how many
leading blocks of the shipment they are. :meth:`BlockManager.adopt_received` releases exactly
those (their entries become ``None``), hashes every other full block, and only then frees what
is out of its own window, so real blocks that left the window stay in the prefix cache
(hashed, ref 0), as a block the scheduler hashes and then frees does.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections import OrderedDict, deque
from dataclasses import dataclass
from operator import attrgetter

from pdserve.engine.kv_cache.prefix_hash import SALT_BYTES, adapter_root_hash, chain_hash
from pdserve.engine.sequence import Sequence
from pdserve.worker_api import KV_TIER_DISK, KV_TIER_HOST, PrefixSource

logger = logging.getLogger(__name__)

_BLOCK_TABLE = attrgetter("block_table")



@dataclass(frozen=True)
class PrefixHit:
    """What the prefix cache holds of one sequence's prompt now (``BlockManager.find_prefix``):
    one lookup of its hash chain, handed to every question admission asks of it in the same
    step (nothing changes the cache between them)."""

    blocks: tuple[int | None, ...]  # per leading full block: its pool block, None = to load
    hashes: tuple[bytes, ...]  # the chain hash of each of those blocks
    block_size: int

    @property
    def num_tokens(self) -> int:
        """Tokens served from the cache if every load passes its check."""
        return len(self.blocks) * self.block_size

    def hashes_to_load(self) -> list[bytes]:
        """The hashes of the blocks a tier below the pool holds."""
        return [h for b, h in zip(self.blocks, self.hashes, strict=True) if b is None]


def _root(seq: Sequence) -> bytes:
    """The parent hash of seq's first block: its LoRA adapter's (the base model's: zeros)."""
    return adapter_root_hash(None if seq.adapter is None else seq.adapter.digest)

class BlockManager:
    """Hands out KV cache blocks to sequences and keeps finished prefixes for reuse."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 sliding_window: int | None = None, hash_salt: bytes | None = None):
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks must be a positive integer, got {num_blocks!r}")
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
        if sliding_window is not None and (isinstance(sliding_window, bool)
                                           or not isinstance(sliding_window, int)
                                           or sliding_window < 1):
            raise ValueError(f"sliding_window must be a positive integer or None, "
                             f"got {sliding_window!r}")
        if hash_salt is not None and not isinstance(hash_salt, bytes):
            raise ValueError(f"hash_salt must be bytes or None, got {type(hash_salt).__name__}")
        self._num_blocks = num_blocks
        self._block_size = block_size
        self._salt = secrets.token_bytes(SALT_BYTES) if hash_salt is None else hash_salt
        self.enable_prefix_caching = enable_prefix_caching
        self.sliding_window = sliding_window
        self._ref_counts = [0] * num_blocks  # per block: tables holding it
        self._block_hashes: list[bytes | None] = [None] * num_blocks  # per block: prefix hash
        self._free: deque[int] = deque(range(num_blocks))  # ref 0, unhashed
        self._cached: OrderedDict[int, None] = OrderedDict()  # ref 0, hashed; LRU first
        self._hash_to_block: dict[bytes, int] = {}  # prefix hash -> block holding it
        # request_id -> (full blocks already hashed, hash of the last of them)
        self._chains: dict[str, tuple[int, bytes]] = {}
        self.num_prefix_queries = 0  # match_prefix calls
        self.num_prefix_query_tokens = 0  # tokens looked up by match_prefix
        self.num_prefix_hit_tokens = 0  # tokens served from the prefix cache
        # a KVEventLog (engine/kv_cache/events.py) told of every hash the cache gains and loses,
        # when the worker publishes its cache to the routers (None: nobody listens)
        self.events = None
        # the KV tiers below the pool (engine/kv_cache/offload.py PoolTiers; None: none): the
        # blocks evicted from the pool are saved there, prefix hits continue there
        self.offload = None
        self._to_save: list[tuple[int, bytes]] = []  # evicted, not saved yet: (block, hash)
        self.num_tier_hit_tokens = {KV_TIER_HOST: 0, KV_TIER_DISK: 0}  # prompt tokens loaded
        # from the tiers below the pool

    # ---- counts -------------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    @property
    def block_size(self) -> int:
        return self._block_size

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    @property
    def num_used_blocks(self) -> int:
        return self._num_blocks - len(self._free) - len(self._cached)

    @property
    def num_allocatable_blocks(self) -> int:
        return len(self._free) + len(self._cached)

    @property
    def usage_ratio(self) -> float:
        return self.num_used_blocks / self._num_blocks

    @property
    def prefix_hit_rate(self) -> float:
        return self.num_prefix_hit_tokens / max(1, self.num_prefix_query_tokens)

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def held_hashes(self) -> frozenset[bytes]:
        """Every hash the prefix cache can match now (cached or in use)."""
        return frozenset(self._hash_to_block)

    def block_hash(self, block_id: int) -> bytes | None:
        """The prefix-cache hash block_id holds, or None."""
        return self._block_hashes[block_id]

    # ---- prefix cache -------------------------------------------------------------------

    def find_prefix(self, seq: Sequence) -> PrefixHit:
        """The leading blocks of seq's full-block hash chain that the cache holds (pure): per
        block its pool block, or None for one a tier below the pool holds and
        ``offload.worth_loading`` says to load; and the hash of each."""
        bs = self._block_size
        hits: list[int | None] = []
        hashes: list[bytes] = []
        if not self.enable_prefix_caching or seq.prompt_logprobs is not None:
            return PrefixHit((), (), bs)  # (a prompt whose logprobs are wanted: computes all)
        parent, offload = _root(seq), self.offload
        below: list[int] = []  # the tiers of the hits below the pool
        for i in range((seq.num_tokens - 1) // bs):  # leave at least one token to compute
            h = chain_hash(parent, seq.token_ids[i * bs:(i + 1) * bs], self._salt)
            block_id = self._hash_to_block.get(h)
            if block_id is None:
                tier = None if offload is None else offload.tier_of(h)
                if tier is None:
                    break
                below.append(tier)
            hits.append(block_id)
            hashes.append(h)
            parent = h
        if below:  # up to the first block below the pool not worth loading
            worth = offload.worth_loading(below)
            if worth < len(below):
                cut = [i for i, b in enumerate(hits) if b is None][worth]
                del hits[cut:], hashes[cut:]
        return PrefixHit(tuple(hits), tuple(hashes), bs)

    def _num_dead_blocks(self, num_computed_tokens: int) -> int:
        """Leading blocks out of the window of every query at position >= num_computed_tokens.

        A query at position p sees keys k > p - window, so keys k <= num_computed - window are
        dead; block i (last token (i + 1) * block_size - 1) is dead when all its keys are.
        """
        if self.sliding_window is None:
            return 0
        return max(0, (num_computed_tokens - self.sliding_window + 1) // self._block_size)

    def prefetch(self, seq: Sequence) -> None:
        """Have the tiers bring the blocks of seq's prefix that are on disk up to host memory
        in the background (a request that just arrived: by its admission they load from
        memory). Changes nothing here."""
        offload = self.offload
        if offload is None or not offload.prefetches or seq.prompt_logprobs is not None:
            return  # (no disk tier: nothing to bring up, no chain to hash on arrival)
        bs, parent = self._block_size, _root(seq)
        below: list[bytes] = []  # the prefix's blocks held below the pool, in order
        on_disk = False
        for i in range((seq.num_tokens - 1) // bs):
            h = chain_hash(parent, seq.token_ids[i * bs:(i + 1) * bs], self._salt)
            if h not in self._hash_to_block:
                tier = offload.tier_of(h)
                if tier is None:
                    break
                below.append(h)
                on_disk |= tier == KV_TIER_DISK
            parent = h
        if on_disk:
            offload.prefetch(below)

    def coming_up(self, hit: PrefixHit) -> bool:
        """Whether blocks of a prefix (``find_prefix``) that ``match_prefix`` would load are
        still on their way from disk to host memory (``prefetch``): admitted now, it would read
        them from disk itself, in the step."""
        offload = self.offload
        return (offload is not None and offload.prefetches
                and offload.coming_up(hit.hashes_to_load()))

    def admission_room(self, seq: Sequence, hit: PrefixHit | None = None) -> int:
        """Tokens past the prefix hit (``find_prefix``, looked up when not given) that a fresh
        seq could get blocks for now; changes nothing.

        Counts the cached (ref 0) hit blocks that ``match_prefix`` would revive, and the
        blocks it would load from a tier, as taken.
        """
        hits = (self.find_prefix(seq) if hit is None else hit).blocks
        num_dead = 0 if None in hits else min(
            len(hits), self._num_dead_blocks(len(hits) * self._block_size))
        taken = sum(1 for b in hits[num_dead:] if b is None or self._ref_counts[b] == 0)
        return (self.num_allocatable_blocks - taken) * self._block_size

    def match_prefix(self, seq: Sequence, hit: PrefixHit | None = None) -> int:
        """Admit seq onto its cached prefix (``find_prefix`` of this step, looked up when not
        given): share the hit blocks, skip their tokens.

        Requires an empty block table and ``num_computed_tokens == 0``. Sets ``block_table``,
        ``num_computed_tokens`` and ``num_cached_tokens``; returns the number of hit tokens.
        With a sliding window, hit blocks already out of the window enter the table as ``None``.
        """
        if seq.block_table or seq.num_computed_tokens:
            raise RuntimeError(f"match_prefix needs a fresh sequence; {seq.request_id} has "
                               f"{len(seq.block_table)} blocks, "
                               f"{seq.num_computed_tokens} computed tokens")
        hit = self.find_prefix(seq) if hit is None else hit
        hits, hashes = list(hit.blocks), list(hit.hashes)
        loaded = {KV_TIER_HOST: 0, KV_TIER_DISK: 0}
        load_s = 0.0
        if None in hits:
            start = time.perf_counter()
            table = self._load_hits(seq, hits, hashes, loaded)
            load_s = time.perf_counter() - start
            num_dead = min(len(table), self._num_dead_blocks(len(table) * self._block_size))
            seq.block_table = table
            self._release_entries(seq, 0, num_dead)  # (loaded first: a load may fail)
        else:
            num_dead = min(len(hits), self._num_dead_blocks(len(hits) * self._block_size))
            table = [None] * num_dead
            for block_id in hits[num_dead:]:
                self._revive(block_id)
                table.append(block_id)
            seq.block_table = table
        num_hits = len(seq.block_table)
        num_hit_tokens = num_hits * self._block_size
        seq.num_computed_tokens = num_hit_tokens
        seq.num_cached_tokens = num_hit_tokens
        seq.prefix_source = PrefixSource(
            num_hit_tokens - loaded[KV_TIER_HOST] - loaded[KV_TIER_DISK], loaded[KV_TIER_HOST],
            loaded[KV_TIER_DISK], load_s)
        if self.enable_prefix_caching:
            self._chains[seq.request_id] = (num_hits, hashes[num_hits - 1] if num_hits
                                            else _root(seq))
        self.num_prefix_queries += 1
        self.num_prefix_query_tokens += seq.num_tokens
        self.num_prefix_hit_tokens += num_hit_tokens
        return num_hit_tokens

    def _revive(self, block_id: int) -> None:
        """One more table holds ``block_id`` (a cached one leaves the evictable list)."""
        if self._ref_counts[block_id] == 0:
            del self._cached[block_id]
        self._ref_counts[block_id] += 1

    def _load_hits(self, seq: Sequence, hits: list[int | None], hashes: list[bytes],
                   loaded: dict[int, int]) -> list[int | None]:
        """The table of ``hits`` with each None (a block below the pool) loaded into a fresh
        pool block and hashed there; cut before the first block whose load failed (its
        check, or a read), the blocks past the cut released. Pool hits are held first, so
        taking blocks for the loads never evicts them. Adds the tokens loaded to ``loaded``, by
        tier."""
        revived = sum(1 for b in hits if b is not None and self._ref_counts[b] == 0)
        room = self.num_allocatable_blocks - revived  # (a reservation checks room after)
        loads = [i for i, b in enumerate(hits) if b is None]
        if len(loads) > room:
            del hits[loads[room]:], hashes[loads[room]:]
            del loads[room:]
        for block_id in hits:  # every pool hit held before a block is taken for a load
            if block_id is not None:
                self._revive(block_id)
        table = [self._take_block() if b is None else b for b in hits]
        # (what taking those blocks evicted is saved before the loads overwrite it)
        num_loaded, tiers = self.offload.load([table[i] for i in loads],
                                              [hashes[i] for i in loads], self.flush_saves)
        cut = len(table) if num_loaded == len(loads) else loads[num_loaded]
        for i, tier in zip(loads[:num_loaded], tiers, strict=True):
            self._register(table[i], hashes[i])
            self.num_tier_hit_tokens[tier] += self._block_size
            loaded[tier] += self._block_size
        seq.block_table = table
        self._release_entries(seq, cut, len(table))
        return table[:cut]

    def flush_saves(self) -> None:
        """Save the blocks evicted from the pool since the last call into the tiers below
        it. Called before anything may write into a block taken since: the next forward, a
        decode reservation's KV, a load from a tier."""
        if self._to_save:
            to_save, self._to_save = self._to_save, []
            self.offload.save([b for b, _ in to_save], [h for _, h in to_save])

    def fork(self, parent: Sequence, child: Sequence) -> int:
        """Give fresh ``child`` (same prompt) ``parent``'s leading full prompt blocks, shared
        (each ref count + 1, entries out of the window stay None): every full block whose
        tokens the parent has computed, less the one holding the last prompt token (the
        child computes it to sample its own first token), as :meth:`match_prefix` leaves one.
        The partial last block is never shared: the child fills its own. With a sliding
        window, when the child's first queries would need a block the parent has already
        freed (out of the parent's window, not of the child's), nothing is shared: the child
        computes the whole prompt. Sets the child's ``block_table``, ``num_computed_tokens``
        and ``num_cached_tokens``; returns the shared tokens."""
        if child.block_table or child.num_computed_tokens:
            raise RuntimeError(f"fork needs a fresh child; {child.request_id} has "
                               f"{len(child.block_table)} blocks")
        num_tokens = min(parent.num_computed_tokens, child.num_prompt_tokens)
        num_shared = min(max(0, num_tokens - 1) // self._block_size, len(parent.block_table))
        first_needed = self._num_dead_blocks(num_shared * self._block_size)
        if None in parent.block_table[first_needed:num_shared]:
            num_shared = 0
        table = parent.block_table[:num_shared]
        for block_id in table:
            if block_id is not None:
                self._ref_counts[block_id] += 1
        child.block_table = list(table)
        child.num_computed_tokens = child.num_cached_tokens = num_shared * self._block_size
        return child.num_computed_tokens

    def cache_computed_blocks(self, seq: Sequence) -> None:
        """Register a chained hash for every newly full block whose tokens are all computed
        (:meth:`_register`: a hash already held by another block keeps that block)."""
        if not self.enable_prefix_caching:
            return
        bs = self._block_size
        num_hashed, parent = self._chains.get(seq.request_id, (0, _root(seq)))
        num_full = min(seq.num_computed_tokens // bs, len(seq.block_table))
        for i in range(num_hashed, num_full):
            h = chain_hash(parent, seq.token_ids[i * bs:(i + 1) * bs], self._salt)
            self._register(seq.block_table[i], h)
            parent = h
        if num_full > num_hashed:
            self._chains[seq.request_id] = (num_full, parent)

    def adopt_received(self, seq: Sequence, num_stand_ins: int = 0) -> None:
        """``seq``'s KV for every token before ``num_computed_tokens`` was written into its
        blocks by another worker (a KV hand-off), except in the ``num_stand_ins`` blocks right
        after its prefix hit (``num_cached_tokens``, which :meth:`match_prefix` set when the
        blocks were reserved): the sender's stand-ins (see the module docstring). Release
        those, hash every full block that remains, then free what is out of the window.
        ValueError, with nothing changed, when a stand-in would be inside the window (a query
        would read it)."""
        first = seq.num_cached_tokens // self._block_size
        num_dead = min(self._num_dead_blocks(seq.num_computed_tokens), len(seq.block_table))
        most = max(0, num_dead - first)  # received blocks out of the window
        if isinstance(num_stand_ins, bool) or not isinstance(num_stand_ins, int) \
                or not 0 <= num_stand_ins <= most:
            raise ValueError(f"{seq.request_id}: num_stand_ins must be an int in [0, {most}] "
                             f"(received blocks out of the window), got {num_stand_ins!r}")
        self._release_entries(seq, first, first + num_stand_ins)
        self.cache_computed_blocks(seq)
        self._release_entries(seq, 0, num_dead)  # (hit blocks before the stand-ins too)

    def cache_filled_blocks(self, seqs: list[Sequence]) -> None:
        """:meth:`cache_computed_blocks` of each of ``seqs``, decodes whose step just filled
        a block: one loop hashes the block each filled (a sequence with more to hash, or a
        block not in its table, takes the general method)."""
        if not self.enable_prefix_caching:
            return
        bs, salt, chains, register = self._block_size, self._salt, self._chains, self._register
        for seq in seqs:
            num_full, request_id = seq.num_computed_tokens // bs, seq.request_id
            num_hashed, parent = chains.get(request_id, (0, _root(seq)))
            if num_hashed != num_full - 1 or num_full > len(seq.block_table):
                self.cache_computed_blocks(seq)
                continue
            h = chain_hash(parent, seq.token_ids[num_hashed * bs:num_full * bs], salt)
            register(seq.block_table[num_hashed], h)
            chains[request_id] = (num_full, h)

    def _register(self, block_id: int | None, h: bytes) -> None:
        """``block_id`` holds the block of hash ``h``, unless it was freed (None), is hashed
        already, or another block holds ``h`` (that one is kept)."""
        if block_id is not None and self._block_hashes[block_id] is None \
                and h not in self._hash_to_block:
            self._block_hashes[block_id] = h
            self._hash_to_block[h] = block_id
            if self.events is not None:
                self.events.stored(h)

    def withhold_last_block(self) -> int:
        """Take the highest block id out of the pool for good (before any allocation) and
        return it: a scratch block nothing is ever stored in (CUDA graphs' padding rows)."""
        block_id = self._num_blocks - 1
        if len(self._free) != self._num_blocks or block_id < 1:
            raise RuntimeError("withhold_last_block needs an untouched pool of >= 2 blocks")
        self._free.remove(block_id)
        self._num_blocks -= 1
        return block_id

    # ---- allocation ---------------------------------------------------------------------

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        """Blocks to append so the table covers num_computed_tokens + num_new_tokens tokens."""
        total = seq.num_computed_tokens + num_new_tokens
        return max(0, -(-total // self._block_size) - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.blocks_needed(seq, num_new_tokens) <= self.num_allocatable_blocks

    def num_allocatable_tokens(self, seq: Sequence) -> int:
        """Most new tokens seq could get blocks for right now (its table's slack included)."""
        capacity = (len(seq.block_table) + self.num_allocatable_blocks) * self._block_size
        return max(0, capacity - seq.num_computed_tokens)

    def allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        """Append blocks so seq's table covers its next num_new_tokens tokens."""
        needed = self.blocks_needed(seq, num_new_tokens)
        if needed > self.num_allocatable_blocks:
            raise RuntimeError(f"allocate: {seq.request_id} needs {needed} blocks, "
                               f"{self.num_allocatable_blocks} allocatable")
        for _ in range(needed):
            seq.block_table.append(self._take_block())

    def append_block_each(self, seqs: list[Sequence]) -> list[int] | None:
        """One more block at the end of each of ``seqs`` (decodes entering a new block), all
        or none: the blocks in order, or None, with nothing taken, when fewer are
        allocatable."""
        if len(seqs) > self.num_allocatable_blocks:
            return None
        blocks = [self._take_block() for _ in seqs]
        list(map(list.append, map(_BLOCK_TABLE, seqs), blocks))
        return blocks

    def _take_block(self) -> int:
        if self._free:
            block_id = self._free.popleft()
        else:
            block_id, _ = self._cached.popitem(last=False)  # evict least recently used
            evicted = self._block_hashes[block_id]
            del self._hash_to_block[evicted]
            self._block_hashes[block_id] = None
            if self.events is not None:
                self.events.removed(evicted)
            if self.offload is not None:
                self._to_save.append((block_id, evicted))
        self._ref_counts[block_id] = 1
        return block_id

    def _release(self, block_id: int) -> None:
        self._ref_counts[block_id] -= 1
        if self._ref_counts[block_id] < 0:
            raise RuntimeError(f"block {block_id} released more often than taken")
        if self._ref_counts[block_id] == 0:
            if self._block_hashes[block_id] is not None:
                self._cached[block_id] = None  # most recently used end
            else:
                self._free.append(block_id)

    def free(self, seq: Sequence) -> None:
        """Release seq's blocks, tails first, and clear its table. Safe on an empty table."""
        for block_id in reversed(seq.block_table):
            if block_id is not None:
                self._release(block_id)
        seq.block_table = []
        self._chains.pop(seq.request_id, None)

    def trim(self, seq: Sequence, num_tokens: int) -> int:
        """Release seq's tail blocks past the ones ``num_tokens`` tokens need (slots of rejected
        speculative drafts); returns how many were released."""
        keep = -(-num_tokens // self._block_size)
        num_freed = 0
        while len(seq.block_table) > keep:
            block_id = seq.block_table.pop()
            if block_id is not None:
                self._release(block_id)
                num_freed += 1
        return num_freed

    def _release_entries(self, seq: Sequence, start: int, end: int) -> None:
        """Release the blocks of table entries ``[start, end)``, tails first; they become
        None (entries already None are skipped)."""
        table = seq.block_table
        for i in range(end - 1, start - 1, -1):
            if table[i] is not None:
                self._release(table[i])
                table[i] = None

    def free_out_of_window(self, seq: Sequence) -> int:
        """Free blocks no future query of seq can see; their entries become None."""
        num_dead = min(self._num_dead_blocks(seq.num_computed_tokens), len(seq.block_table))
        num_freed = 0
        for i in range(num_dead - 1, -1, -1):  # tails first; stop at the already-freed prefix
            block_id = seq.block_table[i]
            if block_id is None:
                break
            self._release(block_id)
            seq.block_table[i] = None
            num_freed += 1
        return num_freed

    # ---- checks -------------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Raise RuntimeError if the free/cached/used partition or the hash index is broken."""
        free, cached = set(self._free), set(self._cached)
        problems = []
        if len(free) != len(self._free):
            problems.append("duplicate block on the free list")
        if free & cached:
            problems.append(f"blocks both free and cached: {sorted(free & cached)}")
        used = {b for b in range(self._num_blocks) if self._ref_counts[b] > 0}
        listed_used = used & (free | cached)
        if listed_used:
            problems.append(f"blocks with refs on free/cached lists: {sorted(listed_used)}")
        if len(free) + len(cached) + len(used) != self._num_blocks:
            problems.append(f"free {len(free)} + cached {len(cached)} + used {len(used)} "
                            f"!= {self._num_blocks} blocks")
        if any(self._block_hashes[b] is not None for b in free):
            problems.append("a free block holds a hash")
        if any(self._block_hashes[b] is None for b in cached):
            problems.append("a cached block holds no hash")
        for h, b in self._hash_to_block.items():
            if self._block_hashes[b] != h:
                problems.append(f"hash index points to block {b} holding another hash")
        num_hashed = sum(h is not None for h in self._block_hashes)
        if num_hashed != len(self._hash_to_block):
            problems.append(f"{num_hashed} hashed blocks but {len(self._hash_to_block)} indexed")
        if problems:
            raise RuntimeError("BlockManager invariants violated: " + "; ".join(problems))
