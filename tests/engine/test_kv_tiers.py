"""KV tiers below the pool: a prefix served from host memory or disk gives the same tokens as
computing it (greedy; fp32, int8 KV, a sliding window, tensor parallel), every way a stored
block can go bad is a miss that recomputes, a float pool's blocks stored as int8 are the int8
rule's rounding of them, a disk that fills, vanishes or is not ours keeps
serving, aborts leak no block, and a restarted engine never trusts files it did not write."""

from __future__ import annotations

import os
import random
import resource
import signal
import threading
import time

import numpy as np
import pytest
import torch

from pdserve.engine.config import EngineConfig
from pdserve.engine.kv_cache import int8_scales
from pdserve.engine.kv_cache.offload import PoolTiers
from pdserve.engine.kv_cache.prefix_hash import chained_block_hashes
from pdserve.engine.kv_cache.tiers import FOLDER_PREFIX, HEADER, KVTiers
from pdserve.engine.llm import LLM
from pdserve.testing.waits import wait_for
from pdserve.worker_api import KV_TIER_DISK, KV_TIER_HOST, PrefixSource, SamplingParams

GREEDY = SamplingParams(max_tokens=4, temperature=0)
BLOCK = 16
POOL = 8  # blocks: the four prompts below hold 12 full blocks, so a second round misses
HIT = 48  # prompt tokens a second round serves from a tier (3 full blocks of 49 tokens)


@pytest.fixture(autouse=True)
def loads_always_win(monkeypatch):
    """These tests check what loads give, not when they are worth it: the load rule weighs
    this machine's measured compute and read rates, which other work on it moves
    (tests/engine/test_kv_load_rule.py sets them), so here every block below the pool loads."""
    monkeypatch.setattr(PoolTiers, "worth_loading", lambda self, tiers: len(tiers))


def prompts(seed: int = 0, count: int = 4, length: int = 49) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, 200) for _ in range(length)] for _ in range(count)]


def two_rounds(llm: LLM, batch: list[list[int]]) -> list[tuple[list[int], int]]:
    """Each prompt alone, twice over: (tokens, cached prompt tokens) per request."""
    return [(out.token_ids, out.num_cached_tokens) for _ in range(2) for p in batch
            for out in llm.generate([p], GREEDY, use_tqdm=False)]


def one_round(llm: LLM, batch: list[list[int]]) -> list[list[int]]:
    return [out.token_ids for p in batch for out in llm.generate([p], GREEDY, use_tqdm=False)]


@pytest.fixture(scope="module")
def computed(tiny_dir) -> list[tuple[list[int], int]]:
    """The two rounds without tiers: every prompt computed (the pool holds too few)."""
    with LLM(str(tiny_dir), num_kv_blocks=POOL, block_size=BLOCK) as llm:
        return two_rounds(llm, prompts())


def disk_llm(tiny_dir, tmp_path) -> LLM:
    """The tiny model over a small pool, a host tier of 3 blocks and a disk tier."""
    return LLM(str(tiny_dir), num_kv_blocks=POOL, block_size=BLOCK, kv_offload_cpu_gib=0.0001,
               kv_offload_disk_gib=0.01, kv_offload_dir=str(tmp_path / "kv"))


def tiers_of(llm: LLM) -> KVTiers:
    return llm.engine.parts.block_manager.offload.tiers


def check_idle(llm: LLM) -> None:
    bm = llm.engine.parts.block_manager
    bm.check_invariants()
    assert bm.num_used_blocks == 0


def test_host_tier_round_trip_equals_computing(tiny_dir, computed):
    with LLM(str(tiny_dir), num_kv_blocks=POOL, block_size=BLOCK,
             kv_offload_cpu_gib=0.01) as llm:
        got = two_rounds(llm, prompts())
        bm = llm.engine.parts.block_manager
        assert [t for t, _ in got] == [t for t, _ in computed]
        assert [c for _, c in got[4:]] == [HIT] * 4
        assert bm.num_tier_hit_tokens == {KV_TIER_HOST: 4 * HIT, KV_TIER_DISK: 0}
        assert tiers_of(llm).counters.read_failures == 0
        check_idle(llm)


def test_disk_tier_round_trip_equals_computing(tiny_dir, computed, tmp_path):
    with disk_llm(tiny_dir, tmp_path) as llm:
        tiers = tiers_of(llm)
        first = one_round(llm, prompts())
        tiers.flush()  # (the evicted blocks are on disk now)
        second = one_round(llm, prompts())
        assert first + second == [t for t, _ in computed]
        bm = llm.engine.parts.block_manager  # (read from disk by the engine, or by the
        # reader thread ahead of it: then served from host memory)
        assert bm.num_tier_hit_tokens[KV_TIER_HOST] + bm.num_tier_hit_tokens[KV_TIER_DISK] > 0
        assert tiers.counters.disk_read_bytes > 0
        assert (tmp_path / "kv").stat().st_mode & 0o777 == 0o700
        assert tiers.folder.stat().st_mode & 0o777 == 0o700
        folder = tiers.folder
    assert not folder.exists()  # (closing the engine deletes its folder)


def test_a_queued_request_has_its_disk_blocks_prefetched_to_host(tiny_dir, computed, tmp_path):
    """A request's blocks on disk are read up into host memory while it is queued; its
    admission loads them from there, with the computed tokens."""
    with disk_llm(tiny_dir, tmp_path) as llm:
        tiers = tiers_of(llm)
        batch = prompts()
        first = one_round(llm, batch)
        tiers.flush()
        bm = llm.engine.parts.block_manager
        seq = llm.engine.add_request("queued", batch[0], GREEDY)
        hashes = chained_block_hashes(batch[0], BLOCK, bm._salt)[:3]
        assert any(tiers.tier_of(h) == KV_TIER_DISK for h in hashes) or \
            tiers.counters.prefetched_blocks  # (on disk when queued, unless already read up)
        deadline = time.monotonic() + 30
        while any(tiers.tier_of(h) != KV_TIER_HOST for h in hashes):
            assert time.monotonic() < deadline, [tiers.tier_of(h) for h in hashes]
            time.sleep(0.01)
        assert tiers.counters.prefetched_blocks > 0
        while llm.engine.has_unfinished_requests():
            llm.engine.step()
        assert seq.prefix_source == PrefixSource(0, HIT, 0, seq.prefix_source.load_s)
        assert seq.token_ids[len(batch[0]):] == computed[0][0]
        assert first == [t for t, _ in computed[:4]]
        check_idle(llm)


def test_a_request_waits_for_its_prefetch_while_others_step(tiny_dir, computed, tmp_path,
                                                           monkeypatch):
    """While a queued request's blocks are still coming up from disk, the running requests
    step without it; once they are up, it loads them from host memory. With nothing else to
    run, a request is admitted at once and reads from disk itself."""
    with disk_llm(tiny_dir, tmp_path) as llm:
        tiers = tiers_of(llm)
        batch = prompts()
        one_round(llm, batch)
        tiers.flush()
        gate = threading.Event()
        read_file = tiers._read_file

        def held_reader(block_hash):  # the reader thread's reads wait for the gate
            if threading.current_thread().name == "kv-tier-reader":
                assert gate.wait(30)
            return read_file(block_hash)

        monkeypatch.setattr(tiers, "_read_file", held_reader)
        engine = llm.engine
        busy = engine.add_request("busy", prompts(seed=1, count=1, length=20)[0],
                                  SamplingParams(max_tokens=8, temperature=0))
        engine.step()
        queued = engine.add_request("queued", batch[0], GREEDY)
        for _ in range(3):
            engine.step()
        assert queued.block_table == [] and queued.num_computed_tokens == 0
        assert busy.num_tokens == 20 + 4  # (one token per step: the prompt's, then 3 more)
        gate.set()
        # the blocks are up before busy's last steps (a fast decode step could end them first,
        # and a request alone reads from disk itself)
        bm = engine.parts.block_manager
        wait_for(lambda: not bm.coming_up(bm.find_prefix(queued)), what="the prefetch")
        while engine.has_unfinished_requests():
            engine.step()
        assert queued.prefix_source.cached_tokens == HIT
        assert queued.prefix_source.disk_tokens == 0, (queued.prefix_source, tiers.counters)
        assert queued.token_ids[len(batch[0]):] == computed[0][0]
        # alone: admitted in its first step, its blocks read from disk there
        one_round(llm, batch[1:])
        tiers.flush()
        gate.clear()
        alone = engine.add_request("alone", batch[0], GREEDY)
        engine.step()
        assert alone.num_computed_tokens > 0 and alone.prefix_source.disk_tokens > 0
        gate.set()
        while engine.has_unfinished_requests():
            engine.step()
        assert alone.token_ids[len(batch[0]):] == computed[0][0]
        check_idle(llm)


def test_int8_kv_round_trip_equals_int8_computing(tiny_dir):
    """The second round, loaded from the host tier (int8 blocks and their token scales),
    equals the first, computed on the same int8 pool."""
    with LLM(str(tiny_dir), num_kv_blocks=POOL, block_size=BLOCK, kv_cache_dtype="int8",
             kv_int8_keep_edge_layers=False, kv_int8_scales="hybrid",
             kv_offload_cpu_gib=0.01) as llm:
        got = two_rounds(llm, prompts(1))
        assert llm.engine.parts.block_manager.num_tier_hit_tokens[KV_TIER_HOST] == 4 * HIT
        assert llm.engine.parts.runner.kv_caches[0].k_token_scale is not None
    assert [t for t, _ in got[4:]] == [t for t, _ in got[:4]]


def int8_rule(x: torch.Tensor, channel: torch.Tensor) -> torch.Tensor:
    """The hybrid int8 write rule of kernels/kv_layout.py, written out on its own: x (T,
    heads, dim) as an int8 pool holds it, read back in float32."""
    y = x / channel
    token = (y.abs().amax(-1, keepdim=True) / 127).clamp(2.0 ** -14, 65504.0).half().float()
    return (y / token).round().clamp(-127, 127) * channel * token


def test_int8_storage_keeps_what_an_int8_pool_would_hold(tiny_dir):
    """A float32 pool's blocks, saved as int8 (kv_offload_int8) and loaded back into other
    pool blocks, are the hybrid rule's rounding of what was saved, in under a third of the
    bytes."""
    with LLM(str(tiny_dir), num_kv_blocks=POOL, block_size=BLOCK, kv_offload_cpu_gib=0.01,
             kv_offload_int8=True) as llm:
        offload = llm.engine.parts.block_manager.offload
        caches = llm.engine.parts.runner.kv_caches
        torch.manual_seed(0)
        for cache in caches:
            cache.kv.normal_()
            cache.kv[:, 1] *= 1e3  # (a block of large values keeps its own token scales)
        saved = [cache.kv[:, [1, 2]].clone() for cache in caches]
        offload.save([1, 2], [b"\x01" * 32, b"\x02" * 32])
        assert offload.load([5, 6], [b"\x01" * 32, b"\x02" * 32], lambda: None) == (
            2, [KV_TIER_HOST, KV_TIER_HOST])
        staged = offload.int8.staging(1)
        for cache, before, int8 in zip(caches, saved, staged, strict=True):
            for half, channel in ((0, int8.k_scale), (1, int8.v_scale)):
                expected = int8_rule(before[half].flatten(0, 1), channel)
                loaded = cache.kv[half, [5, 6]].flatten(0, 1)
                torch.testing.assert_close(loaded, expected, rtol=1e-6, atol=0)
                assert not torch.equal(loaded, before[half].flatten(0, 1))  # (rounded)
        float_bytes = sum(c.bytes_per_block for c in caches)
        assert offload.tiers.block_nbytes == sum(c.bytes_per_block for c in staged)
        assert offload.tiers.block_nbytes < float_bytes / 3
        assert "hybrid" in llm.memory_ledger.kv_tier_int8
        assert "passed" in llm.memory_ledger.kv_tier_int8


def test_int8_storage_serves_prefixes_from_the_tiers(tiny_dir, computed, tmp_path):
    """With int8 storage the second round loads its prefixes from host and disk; on the tiny
    model its greedy tokens are those of computing them."""
    with LLM(str(tiny_dir), num_kv_blocks=POOL, block_size=BLOCK, kv_offload_cpu_gib=0.00005,
             kv_offload_disk_gib=0.01, kv_offload_dir=str(tmp_path / "kv"),
             kv_offload_int8=True) as llm:
        tiers = tiers_of(llm)
        first = one_round(llm, prompts())
        tiers.flush()
        second = one_round(llm, prompts())
        bm = llm.engine.parts.block_manager
        assert sum(bm.num_tier_hit_tokens.values()) == 4 * HIT
        assert tiers.usage()["disk_blocks"] > 0 and tiers.counters.read_failures == 0
        check_idle(llm)
    assert first + second == [t for t, _ in computed]


@pytest.mark.parametrize("settings, field", [
    (dict(), "kv_offload_cpu_gib"),
    (dict(kv_offload_cpu_gib=1, kv_cache_dtype="int8"), "kv_cache_dtype"),
    (dict(kv_offload_cpu_gib=1, tensor_parallel_size=2), "tensor_parallel_size")])
def test_int8_storage_refuses_what_it_cannot_serve(tiny_dir, settings, field):
    with pytest.raises(ValueError, match=field):
        EngineConfig(model=str(tiny_dir), kv_offload_int8=True, **settings)


def test_int8_storage_that_fails_its_check_stores_floats(tiny_dir, monkeypatch, caplog):
    monkeypatch.setattr(int8_scales, "MAX_CHECK_KL", -1.0)  # no scheme can pass
    with LLM(str(tiny_dir), num_kv_blocks=POOL, block_size=BLOCK, kv_offload_cpu_gib=0.01,
             kv_offload_int8=True) as llm:
        offload = llm.engine.parts.block_manager.offload
        assert offload.int8 is None and llm.memory_ledger.kv_tier_int8 == ""
        caches = llm.engine.parts.runner.kv_caches
        assert offload.tiers.block_nbytes == sum(c.bytes_per_block for c in caches)
    assert "the tiers store blocks in the model dtype" in caplog.text


def test_sliding_window_round_trip_equals_computing(hf_checkpoint):
    path = str(hf_checkpoint("mistral-window"))
    batch = prompts(2, length=33)
    with LLM(path, num_kv_blocks=16, block_size=4) as llm:
        expected = two_rounds(llm, batch)
    with LLM(path, num_kv_blocks=16, block_size=4, kv_offload_cpu_gib=0.01) as llm:
        got = two_rounds(llm, batch)
        assert llm.engine.parts.block_manager.num_tier_hit_tokens[KV_TIER_HOST] > 0
        check_idle(llm)
    assert [t for t, _ in got] == [t for t, _ in expected]


def test_tensor_parallel_round_trip_and_a_follower_miss(tiny_dir, computed):
    with LLM(str(tiny_dir), num_kv_blocks=POOL, block_size=BLOCK, tensor_parallel_size=2,
             kv_offload_cpu_gib=0.01) as llm:
        got = two_rounds(llm, prompts())
        assert [t for t, _ in got] == [t for t, _ in computed]
        bm = llm.engine.parts.block_manager
        assert bm.num_tier_hit_tokens[KV_TIER_HOST] == 4 * HIT
        # rank 0 holds a block its follower lost: the load is a miss on every rank
        ranks = llm.engine.ranks
        assert ranks.call_ranks_counting("load_tier_blocks", [0], [b"\x07" * 32]) == 1
        check_idle(llm)


def corrupt_host(tiers: KVTiers) -> int:
    """Flip one byte in every block the host tier holds; how many."""
    with tiers._lock:
        for payload, _ in tiers._host.values():
            payload[len(payload) // 2] ^= 0x40
        return len(tiers._host)


def disk_files(tiers: KVTiers) -> list:
    return sorted(p for p in tiers.folder.iterdir() if p.suffix != ".part")


def _truncate(path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2])


def _garble_header(path) -> None:
    data = bytearray(path.read_bytes())
    data[:8] = b"NOTATIER"
    path.write_bytes(bytes(data))


def _other_layout(path) -> None:
    data = bytearray(path.read_bytes())
    data[8:40] = bytes(32)  # another pool's fingerprint
    path.write_bytes(bytes(data))


def _flip_payload(path) -> None:
    data = bytearray(path.read_bytes())
    data[HEADER.size + 7] ^= 0x01
    path.write_bytes(bytes(data))


def _swap_names(paths) -> None:  # a file holding another block's KV under this hash
    a, b = paths[0], paths[1]
    tmp = a.with_suffix(".swap")
    a.rename(tmp)
    b.rename(a)
    tmp.rename(b)


DISK_FAULTS = {
    "truncated": lambda paths: [_truncate(p) for p in paths],
    "garbled header": lambda paths: [_garble_header(p) for p in paths],
    "another layout": lambda paths: [_other_layout(p) for p in paths],
    "flipped payload byte": lambda paths: [_flip_payload(p) for p in paths],
    "missing": lambda paths: [p.unlink() for p in paths],
    "swapped": lambda paths: [_swap_names(paths[i:i + 2]) for i in range(0, len(paths) - 1, 2)],
}


def test_corrupt_host_blocks_are_recomputed(tiny_dir, computed):
    with LLM(str(tiny_dir), num_kv_blocks=POOL, block_size=BLOCK,
             kv_offload_cpu_gib=0.01) as llm:
        batch = prompts()
        first = one_round(llm, batch)
        assert corrupt_host(tiers_of(llm)) > 0
        second = one_round(llm, batch)
        assert first + second == [t for t, _ in computed]
        assert tiers_of(llm).counters.read_failures > 0
        check_idle(llm)


@pytest.mark.parametrize("fault", sorted(DISK_FAULTS))
def test_bad_disk_blocks_are_recomputed(tiny_dir, computed, tmp_path, fault, caplog):
    with disk_llm(tiny_dir, tmp_path) as llm:
        tiers = tiers_of(llm)
        batch = prompts()
        first = one_round(llm, batch)
        tiers.flush()
        paths = disk_files(tiers)
        assert len(paths) >= 2
        DISK_FAULTS[fault](paths)
        second = one_round(llm, batch)
        assert first + second == [t for t, _ in computed]
        assert tiers.counters.read_failures > 0
        assert "recomputed" in caplog.text
        check_idle(llm)


def test_a_disk_that_fills_or_vanishes_keeps_serving(tiny_dir, computed, tmp_path):
    """A write past the file size limit fails (EFBIG, as a full disk's ENOSPC): dropped and
    counted; then the folder is deleted under the engine: reads and writes fail, it serves."""
    with disk_llm(tiny_dir, tmp_path) as llm:
        tiers = tiers_of(llm)
        batch = prompts()
        limits = resource.getrlimit(resource.RLIMIT_FSIZE)
        old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        # (a block's file is one byte over: the test's own small files still fit)
        resource.setrlimit(resource.RLIMIT_FSIZE, (HEADER.size + tiers.block_nbytes - 1,
                                                   limits[1]))
        try:
            first = one_round(llm, batch)
            tiers.flush()
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, limits)
            signal.signal(signal.SIGXFSZ, old_handler)
        assert tiers.counters.write_failures > 0 and not disk_files(tiers)
        one_round(llm, batch)  # now written
        tiers.flush()
        assert disk_files(tiers)
        for path in tiers.folder.iterdir():
            path.unlink()
        tiers.folder.rmdir()
        second = one_round(llm, batch)
        tiers.flush()
        assert first + second == [t for t, _ in computed]
        assert tiers.counters.read_failures > 0
        check_idle(llm)


def test_a_folder_of_another_user_turns_the_disk_tier_off(tiny_dir, computed, tmp_path,
                                                          caplog):
    root = tmp_path / "kv"
    root.mkdir()
    os.chown(root, os.getuid() + 4242, -1)
    try:
        with LLM(str(tiny_dir), num_kv_blocks=POOL, block_size=BLOCK,
                 kv_offload_cpu_gib=0.0001, kv_offload_disk_gib=0.01,
                 kv_offload_dir=str(root)) as llm:
            assert tiers_of(llm).folder is None and "KV disk tier off" in caplog.text
            assert [t for t, _ in two_rounds(llm, prompts())] == [t for t, _ in computed]
            assert not any(root.iterdir())
    finally:
        os.chown(root, os.getuid(), -1)


def test_a_restarted_engine_trusts_no_earlier_file(tmp_path):
    """Folders of engines no longer alive are deleted at start; a live one's are kept."""
    root = tmp_path / "kv"
    dead = root / f"{FOLDER_PREFIX}999999999-dead"
    live = root / f"{FOLDER_PREFIX}{os.getppid()}-live"
    for folder in (dead, live):
        folder.mkdir(parents=True)
        (folder / ("ab" * 32)).write_bytes(b"x" * 64)
    tiers = KVTiers(bytes(32), 64, 0, 1 << 20, str(root))
    try:
        assert not dead.exists() and live.exists()
        assert tiers.tier_of(bytes.fromhex("ab" * 32)) is None
    finally:
        tiers.close()


def test_tiers_keep_lru_within_budgets_and_bound_the_backlog(tmp_path):
    block = 1000
    tiers = KVTiers(b"f" * 32, block, host_bytes=3 * block, disk_bytes=4 * (HEADER.size + block),
                    disk_dir=str(tmp_path))
    hashes = [bytes([i]) * 32 for i in range(10)]
    try:
        for i, h in enumerate(hashes):
            tiers.save(h, np.full(block, i, dtype=np.uint8))
        tiers.flush()
        # host: the last three; disk: the four before them; the first three dropped
        assert [tiers.tier_of(h) for h in hashes] == [None] * 3 + [KV_TIER_DISK] * 4 \
            + [KV_TIER_HOST] * 3
        assert tiers.read(hashes[5])[0] == 5 and tiers.read(hashes[9])[0] == 9
        assert tiers.counters.evictions == 3
        assert tiers.usage() == dict(host_blocks=3, host_bytes=3 * block, disk_blocks=4,
                                     disk_bytes=4 * (HEADER.size + block))
    finally:
        tiers.close()
    # a writer that cannot keep up: blocks past the backlog bound are dropped, never waited for
    slow = KVTiers(b"f" * 32, block, host_bytes=0, disk_bytes=1 << 20,
                   disk_dir=str(tmp_path / "slow"), max_backlog_bytes=2 * block)
    gate = threading.Event()
    write = slow._write
    slow._write = lambda *args: (gate.wait(10), write(*args))
    try:
        for h in hashes:
            slow.save(h, np.zeros(block, dtype=np.uint8))
        assert slow.counters.write_failures >= len(hashes) - 3
    finally:
        gate.set()
        slow.flush()
        slow.close()


def test_aborts_with_writes_in_flight_leak_no_block(tiny_dir, tmp_path):
    with disk_llm(tiny_dir, tmp_path) as llm:
        engine = llm.engine
        gate = threading.Event()
        tiers = tiers_of(llm)
        write = tiers._write
        tiers._write = lambda *args: (gate.wait(10), write(*args))
        try:
            for round_ in range(3):
                for i, p in enumerate(prompts()):
                    engine.add_request(f"r{round_}-{i}", p, GREEDY)
                for _ in range(3):
                    engine.step()
                for i in range(4):
                    engine.abort_request(f"r{round_}-{i}")
                check_idle(llm)
        finally:
            gate.set()
        tiers.flush()
        check_idle(llm)


# ---- the block manager over a real pool and real tiers, without a model ---------------------

def _content(token_ids: list[int], upto: int) -> float:
    """What a block ending at token ``upto`` holds here: a function of every token before it
    (as real KV is, through attention)."""
    return float(hash(tuple(token_ids[:upto])) % 100_003)


@pytest.mark.parametrize("window", [None, 10])
def test_random_traffic_loads_exactly_what_was_computed(tmp_path, window):
    """Sequences over shared prefixes through a 12-block pool with host and disk tiers: every
    block a sequence is admitted on (read in place or loaded from a tier) holds the content
    computed for its tokens, through evictions, saves, loads and frees; the invariants hold;
    and a router's index fed the worker's KV events holds each hash at the best tier that
    really holds it."""
    import torch

    from pdserve.engine.kv_cache.block_manager import BlockManager
    from pdserve.engine.kv_cache.events import KVEventLog
    from pdserve.engine.kv_cache.offload import PoolTiers, block_nbytes
    from pdserve.engine.sequence import Sequence
    from pdserve.kernels import KVCacheLayer
    from pdserve.router.kv_index import KVIndex

    bs, num_blocks = 4, 12
    caches = [KVCacheLayer(torch.zeros(2, num_blocks, bs, 1, 2)) for _ in range(2)]
    events = KVEventLog()
    tiers = KVTiers(b"t" * 32, block_nbytes(caches), host_bytes=6 * block_nbytes(caches),
                    disk_bytes=40 * (HEADER.size + block_nbytes(caches)),
                    disk_dir=str(tmp_path), events=events)
    bm = BlockManager(num_blocks, bs, sliding_window=window, hash_salt=b"s" * 16)
    bm.events = events
    bm.offload = PoolTiers(caches, tiers, bs)
    index = KVIndex()
    rng = random.Random(window or 0)
    prefixes = [[rng.randrange(1, 30) for _ in range(12)] for _ in range(5)]
    live: list[Sequence] = []
    loaded = 0
    for step in range(300):
        if live and (rng.random() < 0.5 or bm.num_allocatable_blocks < 5):
            bm.free(live.pop(rng.randrange(len(live))))
            continue
        tokens = rng.choice(prefixes) + [rng.randrange(1, 30) for _ in range(rng.randrange(1, 6))]
        seq = Sequence(f"s{step}", tokens, SamplingParams(max_tokens=1))
        expected_hit = bm.find_prefix(seq).num_tokens
        room = bm.admission_room(seq)
        hit = bm.match_prefix(seq)
        assert hit <= expected_hit  # (less only when a load failed: none does here)
        assert hit == expected_hit
        loaded += seq.prefix_source.host_tokens + seq.prefix_source.disk_tokens
        for i, block_id in enumerate(seq.block_table):
            if block_id is not None:
                assert caches[0].kv[0, block_id, 0, 0, 0].item() == _content(tokens, (i + 1) * bs)
        remaining = seq.num_tokens - seq.num_computed_tokens
        if remaining > room or not bm.can_allocate(seq, remaining):
            bm.free(seq)
            continue
        bm.allocate(seq, remaining)
        bm.flush_saves()  # (the step's forward comes next: it writes the new blocks)
        for i in range(seq.num_computed_tokens // bs, len(seq.block_table)):
            for cache in caches:
                cache.kv[:, seq.block_table[i]] = _content(tokens, (i + 1) * bs)
        seq.num_computed_tokens = seq.num_tokens
        bm.cache_computed_blocks(seq)
        bm.free_out_of_window(seq)
        live.append(seq)
        bm.check_invariants()
        if step % 7 == 0 and (batch := events.drain()) is not None:
            assert index.apply("w", batch)
    for seq in live:
        bm.free(seq)
    bm.check_invariants()
    assert bm.num_used_blocks == 0 and loaded > 0
    tiers.flush()
    if (batch := events.drain()) is not None:
        assert index.apply("w", batch)
    truth = {h: KV_TIER_DISK for h in tiers._disk}
    truth.update({h: KV_TIER_HOST for h in tiers._host})
    truth.update({h: 0 for h in bm._hash_to_block})
    assert index.held_tiers("w") == truth
    assert {KV_TIER_HOST, KV_TIER_DISK} <= set(truth.values())
    tiers.close()
