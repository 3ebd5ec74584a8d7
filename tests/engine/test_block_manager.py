"""BlockManager: unit cases, then a hypothesis state machine with a shadow KV cache.

The state machine writes, for every computed token, the prefix it depends on into a shadow
copy of the pool, and checks every key a query reads against it: a prefix-cache hit must
hold exactly the sequence's tokens, a sliding window must never free a key still visible.
"""

from __future__ import annotations

import hashlib
import os
import struct
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from pdserve.engine.kv_cache.block_manager import BlockManager
from pdserve.engine.kv_cache.prefix_hash import ROOT_HASH, chain_hash
from pdserve.engine.sequence import Sequence
from pdserve.worker_api.sampling_params import SamplingParams


def make_seq(request_id: str, token_ids: list[int]) -> Sequence:
    return Sequence(request_id, list(token_ids), SamplingParams(max_tokens=4))


def compute(bm: BlockManager, seq: Sequence, n: int) -> None:
    """Allocate and 'run' n tokens the way the scheduler and engine do."""
    bm.allocate(seq, n)
    seq.num_computed_tokens += n
    bm.cache_computed_blocks(seq)
    bm.free_out_of_window(seq)


def test_counts_and_validation():
    bm = BlockManager(8, 4)
    assert (bm.num_blocks, bm.block_size, bm.num_free_blocks) == (8, 4, 8)
    assert bm.num_cached_blocks == bm.num_used_blocks == 0
    with pytest.raises(ValueError, match="num_blocks"):
        BlockManager(0, 4)
    with pytest.raises(ValueError, match="block_size"):
        BlockManager(4, 0)
    with pytest.raises(ValueError, match="sliding_window"):
        BlockManager(4, 4, sliding_window=0)


def test_allocate_extends_table_and_raises_without_room():
    bm = BlockManager(3, 4)
    seq = make_seq("a", list(range(10)))
    assert bm.blocks_needed(seq, 10) == 3
    bm.allocate(seq, 5)
    assert len(seq.block_table) == 2
    assert bm.blocks_needed(seq, 3) == 0  # 8 tokens still fit in 2 blocks
    other = make_seq("b", list(range(9)))
    bm.allocate(other, 4)
    assert not bm.can_allocate(seq, 10)
    with pytest.raises(RuntimeError, match="allocatable"):
        bm.allocate(seq, 10)
    bm.free(seq)
    bm.free(other)
    bm.free(other)  # idempotent on an empty table
    assert seq.block_table == [] and bm.num_used_blocks == 0
    bm.check_invariants()


def test_prefix_hit_shares_blocks_and_keeps_one_token_to_compute():
    bm = BlockManager(16, 4)
    prompt = list(range(100, 112))  # 3 full blocks
    first = make_seq("a", prompt)
    assert bm.match_prefix(first) == 0
    compute(bm, first, 12)
    second = make_seq("b", prompt)  # identical: the last block must be recomputed
    assert bm.find_prefix(second).num_tokens == 8
    assert bm.match_prefix(second) == 8
    assert second.block_table == first.block_table[:2]
    assert second.num_computed_tokens == second.num_cached_tokens == 8
    assert [bm.ref_count(b) for b in first.block_table] == [2, 2, 1]
    compute(bm, second, 4)  # same content as first's block 2: hash stays with first's block
    assert bm.block_hash(second.block_table[2]) is None
    third = make_seq("c", prompt + [7])
    assert bm.match_prefix(third) == 12
    assert third.block_table == first.block_table
    assert (bm.num_prefix_queries, bm.num_prefix_hit_tokens) == (3, 20)
    for seq in (first, second, third):
        bm.free(seq)
    assert bm.num_used_blocks == 0 and bm.num_cached_blocks == 3
    bm.check_invariants()


def test_cached_blocks_revive_and_evict_lru_tails_first():
    bm = BlockManager(4, 2)
    seq = make_seq("a", [1, 2, 3, 4, 5, 6, 7])
    bm.match_prefix(seq)
    compute(bm, seq, 7)
    table = list(seq.block_table)
    bm.free(seq)
    assert bm.num_cached_blocks == 3 and bm.num_free_blocks == 1
    # A newcomer with another prefix takes the free block, then evicts the chain's tail.
    other = make_seq("b", [9] * 5)
    bm.match_prefix(other)
    bm.allocate(other, 5)
    assert other.block_table == [3, table[2], table[1]]
    assert bm.num_allocatable_blocks == 1 and bm.block_hash(table[0]) is not None
    bm.free(other)
    # The head survived: a request sharing it revives it from the cache.
    again = make_seq("c", [1, 2, 8])
    assert bm.admission_room(again) == 3 * 2  # 4 allocatable, one revived
    assert bm.match_prefix(again) == 2 and again.block_table == [table[0]]
    assert bm.num_cached_blocks == 0 and bm.num_used_blocks == 1
    bm.free(again)
    bm.check_invariants()


def test_prefix_caching_off_never_hits():
    bm = BlockManager(8, 2, enable_prefix_caching=False)
    a = make_seq("a", [1, 2, 3, 4, 5])
    bm.match_prefix(a)
    compute(bm, a, 5)
    b = make_seq("b", [1, 2, 3, 4, 5])
    assert bm.match_prefix(b) == 0
    bm.free(a)
    assert bm.num_cached_blocks == 0 and bm.num_free_blocks == 8


def test_sliding_window_frees_only_blocks_no_future_query_sees():
    bm = BlockManager(16, 2, sliding_window=4)
    seq = make_seq("a", list(range(20)))
    bm.match_prefix(seq)
    compute(bm, seq, 6)  # next query at 6 sees keys 3..6: block 0 (keys 0, 1) is dead
    assert seq.block_table[0] is None and seq.block_table[1] is not None
    compute(bm, seq, 1)  # next query at 7 sees keys 4..7: block 1 (keys 2, 3) is dead
    assert seq.block_table[:2] == [None, None] and seq.block_table[2] is not None
    assert bm.free_out_of_window(seq) == 0
    compute(bm, seq, 13)
    assert sum(b is not None for b in seq.block_table) <= 3
    bm.free(seq)
    assert bm.num_used_blocks == 0
    bm.check_invariants()


def test_sliding_window_prefix_hit_skips_dead_blocks():
    bm = BlockManager(16, 2, sliding_window=3)
    a = make_seq("a", list(range(11)))
    bm.match_prefix(a)
    compute(bm, a, 4)  # blocks 0, 1 hashed while still live; block 0 then freed (dead)
    compute(bm, a, 6)
    b = make_seq("b", list(range(10)) + [99])
    assert a.block_table[:4] == [None] * 4
    # All 5 full blocks hit; at 10 computed tokens keys 0..7 are dead, so only block 4 lives.
    assert bm.match_prefix(b) == 10
    assert b.block_table == [None] * 4 + [a.block_table[4]]
    assert bm.ref_count(a.block_table[4]) == 2
    bm.free(a)
    bm.free(b)
    assert bm.num_used_blocks == 0
    bm.check_invariants()


def _received(bm: BlockManager, request_id: str, token_ids: list[int]) -> Sequence:
    """A decode reservation: its prefix hit shared, the rest allocated, its KV all in."""
    seq = make_seq(request_id, token_ids)
    bm.match_prefix(seq)
    bm.allocate(seq, seq.num_tokens - seq.num_computed_tokens)
    seq.num_computed_tokens = seq.num_tokens
    return seq


def test_adopt_received_frees_exactly_the_stand_ins_and_caches_the_real_blocks():
    """Window 4, blocks of 2: a 20-token prompt whose first 2 blocks hit the cache, then 3
    stand-ins (blocks the sender had freed), then 5 real blocks. The stand-ins go back to the
    free list unhashed; every real block is hashed, and those out of the window (hit blocks
    and real ones alike) stay cached. A chain through the stand-ins' positions matches once
    someone computes them for real, and then reaches the real blocks after them."""
    bm = BlockManager(32, 2, sliding_window=4)
    tokens = list(range(100, 120))
    head = _received(bm, "head", tokens[:5])
    bm.adopt_received(head)  # caches blocks 0, 1
    bm.free(head)
    seq = _received(bm, "a", tokens)
    assert seq.num_cached_tokens == 4
    table = list(seq.block_table)
    bm.adopt_received(seq, 3)
    assert seq.block_table == [None] * 8 + table[8:]  # keys 0..15 are out of the window
    assert [bm.block_hash(b) is None for b in table[2:5]] == [True] * 3
    assert all(bm.block_hash(b) is not None for b in table[:2] + table[5:])
    assert (bm.num_used_blocks, bm.num_cached_blocks, bm.num_free_blocks) == (2, 5, 25)
    again = make_seq("again", tokens + [1])
    assert bm.match_prefix(again) == 4  # the chain stops at the first stand-in
    bm.free(again)
    local = _received(bm, "local", tokens[:11])  # computes blocks 2..4 here
    bm.cache_computed_blocks(local)
    bm.free(local)
    through = make_seq("through", tokens + [1])
    assert bm.match_prefix(through) == 20
    assert through.block_table[9] == table[9] and bm.ref_count(table[9]) == 2
    for s in (seq, through):
        bm.free(s)
    assert bm.num_used_blocks == 0
    bm.check_invariants()


def test_adopt_received_after_a_prefix_hit_without_a_window_hashes_every_full_block():
    bm = BlockManager(16, 2)
    head = _received(bm, "head", list(range(9)))
    bm.adopt_received(head)
    bm.free(head)
    seq = _received(bm, "a", list(range(12)))
    assert seq.num_cached_tokens == 8
    bm.adopt_received(seq)
    assert all(bm.block_hash(b) is not None for b in seq.block_table)
    bm.free(seq)
    bm.check_invariants()


@pytest.mark.parametrize(("window", "num_stand_ins"), [(4, 9), (4, -1), (4, True), (None, 1)])
def test_adopt_received_refuses_stand_ins_a_query_would_read(window, num_stand_ins):
    """Received blocks 0..9 of 20 tokens, window 4: keys 0..15 (blocks 0..7) are out of it, so
    at most 8 stand-ins; none without a window. The refusal names the field, changes nothing."""
    bm = BlockManager(16, 2, sliding_window=window)
    seq = _received(bm, "a", list(range(20)))
    table = list(seq.block_table)
    with pytest.raises(ValueError, match="num_stand_ins"):
        bm.adopt_received(seq, num_stand_ins)
    assert seq.block_table == table and bm.num_used_blocks == 10 and not bm.held_hashes()
    bm.free(seq)
    bm.check_invariants()


def test_chain_hash_is_the_same_in_every_process():
    code = ("from pdserve.engine.kv_cache.prefix_hash import ROOT_HASH, chain_hash;"
            "print(chain_hash(chain_hash(ROOT_HASH, [1, 2, 3], b's'), [4, 5, 6], b's').hex())")
    outs = set()
    for seed in ("1", "2"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        outs.add(subprocess.run([sys.executable, "-P", "-c", code], env=env, capture_output=True,
                                text=True, check=True).stdout)
    assert len(outs) == 1


def test_chain_hash_is_sha256_of_salt_parent_and_little_endian_int64_ids():
    ids = [0, 1, 2**40 + 7, 2**63 - 1]
    words = b"".join(i.to_bytes(8, "little") for i in ids)
    parent = bytes(range(32))
    assert chain_hash(parent, ids, b"salt") == hashlib.sha256(b"salt" + parent + words).digest()
    with pytest.raises(struct.error):
        chain_hash(ROOT_HASH, [2**63], b"salt")


def test_append_block_each_gives_every_sequence_one_block_or_none():
    bm = BlockManager(num_blocks=4, block_size=2)
    seqs = [make_seq(f"r{i}", [1, 2]) for i in range(3)]
    for seq in seqs:
        bm.allocate(seq, 2)
    assert bm.append_block_each(seqs[:2]) is None  # one block left: nothing taken
    assert [len(seq.block_table) for seq in seqs] == [1, 1, 1]
    blocks = bm.append_block_each(seqs[2:])
    assert blocks == [seqs[2].block_table[-1]] and bm.num_free_blocks == 0
    for seq in seqs:
        bm.free(seq)
    bm.check_invariants()


def test_cache_filled_blocks_equals_caching_each_sequence():
    """The rows' one loop over the decodes that filled a block leaves the same hashes as the
    general method per sequence: one block behind (the loop), two behind (the general
    method), a duplicate of a block another sequence holds (it stays unhashed)."""

    def run(batched: bool) -> tuple:
        bm = BlockManager(num_blocks=32, block_size=2, hash_salt=b"s" * 16)
        prompts = {"one": [1, 2, 3], "same": [1, 2, 3], "two": [5, 6, 7, 8, 9], "full": [4, 4]}
        seqs = [make_seq(name, ids) for name, ids in prompts.items()]
        for seq in seqs:
            bm.allocate(seq, 1)  # first token computed: nothing full yet
            seq.num_computed_tokens = 1
        for seq in seqs[:3]:  # each fills a block (``two`` a second one too)
            bm.allocate(seq, seq.num_tokens - 1)
            seq.num_computed_tokens = 2 * (seq.num_tokens // 2)
        seqs[3].num_computed_tokens = 2  # its one block filled by its second token
        if batched:
            bm.cache_filled_blocks(seqs)
        else:
            for seq in seqs:
                bm.cache_computed_blocks(seq)
        return ([bm.block_hash(b) for b in range(32)],
                {s.request_id: bm._chains.get(s.request_id) for s in seqs})

    batched, each = run(True), run(False)
    assert batched == each
    hashes = [h for h in batched[0] if h is not None]
    assert len(hashes) == len(set(hashes)) == 4  # one's, two's two, full's; not same's copy


def _cached_hashes(bm: BlockManager, token_ids: list[int]) -> list[bytes]:
    seq = Sequence(f"r{bm.num_prefix_queries}", list(token_ids), SamplingParams())
    bm.match_prefix(seq)
    bm.allocate(seq, seq.num_tokens - seq.num_computed_tokens)
    seq.num_computed_tokens = seq.num_tokens
    bm.cache_computed_blocks(seq)
    hashes = [h for b in seq.block_table if (h := bm.block_hash(b)) is not None]
    bm.free(seq)
    return hashes


def test_salted_hashes_still_hit_and_differ_between_clusters():
    prompt = list(range(40, 53))  # 3 full blocks of 4, and one token
    one, same, other = (BlockManager(16, 4, hash_salt=s) for s in (b"a", b"a", b"b"))
    first = _cached_hashes(one, prompt)
    assert len(first) == 3 and all(len(h) == 32 for h in first)
    assert _cached_hashes(same, prompt) == first  # same salt, same hashes
    assert set(_cached_hashes(other, prompt)).isdisjoint(first)  # another cluster's salt
    again = Sequence("again", prompt + [7], SamplingParams())
    assert one.match_prefix(again) == 12  # the prefix cache still hits with salted hashes
    one.free(again)
    one.check_invariants()
    with pytest.raises(ValueError, match="hash_salt"):
        BlockManager(4, 4, hash_salt="text")


PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16] * 2,
           [1, 2, 3, 4, 9, 9, 9, 9, 5, 5, 5, 5, 6, 6, 6, 6] * 2,
           [7] * 32]


class BlockManagerMachine(RuleBasedStateMachine):
    """Random admit/allocate/compute/append/free/window-free over shared prefixes."""

    @initialize(num_blocks=st.integers(3, 24), block_size=st.sampled_from([1, 2, 4]),
                window=st.none() | st.integers(1, 12), prefix_caching=st.booleans())
    def setup(self, num_blocks, block_size, window, prefix_caching):
        self.bm = BlockManager(num_blocks, block_size, prefix_caching, window)
        self.live: dict[str, Sequence] = {}
        self.freed: list[Sequence] = []
        self.shadow: dict[tuple[int, int], tuple[int, ...]] = {}  # (block, slot) -> prefix
        self.next_id = 0

    def _pick(self, index: int) -> Sequence:
        return self.live[sorted(self.live)[index % len(self.live)]]

    @rule(prompt=st.integers(0, len(PROMPTS) - 1), keep=st.integers(1, 32),
          tail=st.lists(st.integers(0, 3), max_size=6))
    def admit(self, prompt, keep, tail):
        seq = make_seq(f"r{self.next_id}", PROMPTS[prompt][:keep] + tail)
        self.next_id += 1
        expected, room = self.bm.find_prefix(seq).num_tokens, self.bm.admission_room(seq)
        hit = self.bm.match_prefix(seq)
        assert hit == expected < seq.num_tokens and hit % self.bm.block_size == 0
        assert self.bm.num_allocatable_tokens(seq) == room
        for i, block in enumerate(seq.block_table):  # a hit holds exactly this prefix
            if block is None:
                continue
            for slot in range(self.bm.block_size):
                pos = i * self.bm.block_size + slot
                assert self.shadow[(block, slot)] == tuple(seq.token_ids[:pos + 1])
        self.live[seq.request_id] = seq

    @precondition(lambda self: self.live)
    @rule(index=st.integers(0, 99), want=st.integers(1, 12))
    def allocate_and_compute(self, index, want):
        seq = self._pick(index)
        n = min(want, seq.num_uncomputed_tokens)
        if n == 0:
            return
        if not self.bm.can_allocate(seq, n):
            with pytest.raises(RuntimeError):
                self.bm.allocate(seq, n)
            return
        self.bm.allocate(seq, n)
        self._run(seq, n)
        self.bm.cache_computed_blocks(seq)

    def _run(self, seq: Sequence, n: int) -> None:
        """Check every key the n queries read, then write their K/V into the shadow pool."""
        bs, window, start = self.bm.block_size, self.bm.sliding_window, seq.num_computed_tokens
        for pos in range(start, start + n):
            block = seq.block_table[pos // bs]
            assert block is not None and self.bm.ref_count(block) == 1  # never write shared
            self.shadow[(block, pos % bs)] = tuple(seq.token_ids[:pos + 1])
            low = 0 if window is None else max(0, pos - window + 1)
            for key in range(low, pos + 1):
                kblock = seq.block_table[key // bs]
                assert kblock is not None, f"key {key} of query {pos} was freed"
                assert self.shadow[(kblock, key % bs)] == tuple(seq.token_ids[:key + 1])
        seq.num_computed_tokens += n

    @precondition(lambda self: self.live)
    @rule(index=st.integers(0, 99), token=st.integers(0, 3))
    def append_token(self, index, token):
        seq = self._pick(index)
        if seq.num_uncomputed_tokens == 0:
            seq.append_token(token)

    @precondition(lambda self: self.live)
    @rule(index=st.integers(0, 99))
    def window_free(self, index):
        seq = self._pick(index)
        before = self.bm.num_used_blocks
        freed = self.bm.free_out_of_window(seq)
        if self.bm.sliding_window is None:
            assert freed == 0
        assert self.bm.num_used_blocks <= before

    @precondition(lambda self: self.live)
    @rule(index=st.integers(0, 99))
    def free(self, index):
        seq = self._pick(index)
        self.bm.free(seq)
        assert seq.block_table == []
        self.bm.free(seq)  # idempotent
        del self.live[seq.request_id]
        self.freed.append(seq)

    @invariant()
    def blocks_are_consistent(self):
        if not hasattr(self, "bm"):
            return
        bm = self.bm
        bm.check_invariants()
        assert bm.num_free_blocks + bm.num_cached_blocks + bm.num_used_blocks == bm.num_blocks
        holders: dict[int, int] = {}
        for seq in self.live.values():
            live = [b for b in seq.block_table if b is not None]
            assert len(live) == len(set(live)), "a block twice in one table"
            first_live = next((i for i, b in enumerate(seq.block_table) if b is not None),
                              len(seq.block_table))
            assert all(b is not None for b in seq.block_table[first_live:]), "None after live"
            assert len(seq.block_table) * bm.block_size >= seq.num_computed_tokens
            for b in live:
                holders[b] = holders.get(b, 0) + 1
        for b in range(bm.num_blocks):
            assert bm.ref_count(b) == holders.get(b, 0)
            if holders.get(b, 0) > 1:
                assert bm.block_hash(b) is not None, "shared block outside the prefix cache"
        assert all(seq.block_table == [] for seq in self.freed)

    def teardown(self):
        if not hasattr(self, "bm"):
            return
        for seq in self.live.values():
            self.bm.free(seq)
        assert self.bm.num_used_blocks == 0
        self.bm.check_invariants()


BlockManagerMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
test_block_manager_state_machine = BlockManagerMachine.TestCase
