"""Prefill and decode workers in one process: greedy output equals the colocated engine,
and every path returns every block."""

from __future__ import annotations

import random

import pytest

from pdserve import LLM, SamplingParams


def prompts_for(seed: int, lengths: list[int], vocab: int = 200) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, vocab) for _ in range(n)] for n in lengths]


@pytest.fixture(scope="module")
def greedy():
    return SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("prefill_kwargs", [{}, {"overlap": False, "layers_per_frame": 2}])
def test_disaggregated_greedy_equals_colocated(hf_checkpoint, make_pair, greedy, prefill_kwargs):
    model_dir = hf_checkpoint("llama")
    prompts = prompts_for(0, [5, 17, 30])
    expected = [o.token_ids for o in LLM(str(model_dir), dtype="float32", block_size=4,
                                         num_kv_blocks=128).generate(prompts, greedy,
                                                                     use_tqdm=False)]
    pair = make_pair(model_dir, prefill_kwargs=prefill_kwargs)
    for i, prompt in enumerate(prompts):
        tokens, reason = pair.generate(f"r{i}", prompt, greedy)
        assert reason == "length"
        assert tokens == expected[i]
    assert pair.used_blocks() == (0, 0)


def test_sliding_window_and_chunked_prefill(hf_checkpoint, make_pair, greedy):
    model_dir = hf_checkpoint("mistral")
    prompts = prompts_for(1, [23, 6])
    expected = [o.token_ids for o in LLM(str(model_dir), dtype="float32", block_size=4,
                                         num_kv_blocks=128).generate(prompts, greedy,
                                                                     use_tqdm=False)]
    pair = make_pair(model_dir, max_num_batched_tokens=8)
    assert [pair.generate(f"w{i}", p, greedy)[0] for i, p in enumerate(prompts)] == expected
    assert pair.used_blocks() == (0, 0)


def test_token_zero_finishes_request(hf_checkpoint, make_pair):
    pair = make_pair(hf_checkpoint("llama"))
    tokens, reason = pair.generate("one", [3, 4, 5], SamplingParams(max_tokens=1, temperature=0))
    assert len(tokens) == 1 and reason == "length"
    assert pair.used_blocks() == (0, 0)


@pytest.mark.parametrize("scales", ["static", "kivi", "hybrid"])
def test_int8_cache_disaggregated_equals_colocated(hf_checkpoint, make_pair, greedy, scales):
    """Every layer int8 (the 2-layer model has no middle layer to keep edges around); dynamic
    token scales travel in the frames with their blocks."""
    model_dir = hf_checkpoint("llama")
    prompts = prompts_for(2, [9, 21])
    int8 = dict(kv_cache_dtype="int8", kv_int8_keep_edge_layers=False, kv_int8_scales=scales)
    expected = [o.token_ids for o in LLM(str(model_dir), dtype="float32", block_size=4,
                                         num_kv_blocks=128, **int8).generate(
                                             prompts, greedy, use_tqdm=False)]
    pair = make_pair(model_dir, prefill_kwargs={"layers_per_frame": 3}, **int8)
    assert [pair.generate(f"q{i}", p, greedy)[0] for i, p in enumerate(prompts)] == expected
    assert pair.used_blocks() == (0, 0)


@pytest.mark.parametrize(("family", "kv"), [("llama", {}), ("mistral", {}),
                                          ("llama", {"kv_cache_dtype": "int8",
                                                     "kv_int8_keep_edge_layers": False,
                                                     "kv_int8_scales": "kivi"})])
def test_the_decode_prefix_cache_receives_only_the_blocks_it_lacks(hf_checkpoint, make_pair,
                                                                   greedy, family, kv):
    """A request sharing 6 blocks of prefix with one the decode worker has run: its
    reservation names them cached, the prefill worker sends only the blocks after them, and
    greedy output still equals the colocated engine (with a sliding window, whose received
    blocks out of the window stay cached on the decode worker, and int8 KV)."""
    model_dir = hf_checkpoint(family)
    shared = prompts_for(2, [24])[0]
    prompts = [shared + tail for tail in prompts_for(3, [5, 9])]  # 8 and 9 blocks of 4
    expected = [o.token_ids for o in LLM(str(model_dir), dtype="float32", block_size=4,
                                         num_kv_blocks=128, **kv).generate(prompts, greedy,
                                                                           use_tqdm=False)]
    pair = make_pair(model_dir, **kv)
    outputs, sent = [], []
    for i, prompt in enumerate(prompts):
        outputs.append(pair.generate(f"c{i}", prompt, greedy)[0])
        reservation, result = pair.last
        sent.append((reservation.num_blocks, reservation.num_cached_blocks,
                     result.transfer_bytes))
    assert outputs == expected
    (blocks0, cached0, bytes0), (blocks1, cached1, bytes1) = sent
    assert (blocks0, cached0, blocks1, cached1) == (8, 0, 9, 6)
    if not kv:  # fp32: the bytes are the blocks'
        assert bytes1 * blocks0 == bytes0 * (blocks1 - cached1)
    assert bytes1 < bytes0
    assert pair.used_blocks() == (0, 0)


@pytest.mark.parametrize("prefill_kwargs, frames", [({}, 2), ({"overlap": False}, 2),
                                                     ({"layers_per_frame": 2}, 1)])
def test_the_result_says_when_each_group_of_layers_left(hf_checkpoint, make_pair, greedy,
                                                        prefill_kwargs, frames):
    """``kv_sends`` covers every layer once, in order, in frames that were queued before
    they left and left before the result came back; their bytes are the transfer's."""
    pair = make_pair(hf_checkpoint("llama"), prefill_kwargs=prefill_kwargs)
    pair.generate("s0", prompts_for(4, [21])[0], greedy)
    _, result = pair.last
    sends = result.kv_sends
    assert len(sends) == frames  # (the test model has 2 layers)
    assert [(s.first_layer, s.end_layer) for s in sends] == (
        [(0, 1), (1, 2)] if frames == 2 else [(0, 2)])
    assert sum(s.num_bytes for s in sends) == result.transfer_bytes > 0
    done = result.prefill_time_s + result.transfer_time_s
    for send in sends:
        assert 0 <= send.queued_s <= send.sent_s <= done
    assert pair.used_blocks() == (0, 0)


def test_kv_sends_are_grouped_into_at_most_eight_spans():
    from pdserve.prefill_worker.worker import _LayerSend, kv_send_groups

    sends = [_LayerSend(i, i + 1, 10.0 + i, 100, [10.5 + i, 10.6 + i]) for i in range(30)]
    groups = kv_send_groups(sends, 10.0)
    assert [(g.first_layer, g.end_layer) for g in groups] == [
        (i, min(i + 4, 30)) for i in range(0, 30, 4)]
    assert groups[0].queued_s == 0.0 and groups[0].sent_s == pytest.approx(3.6)
    assert sum(g.num_bytes for g in groups) == 3000
    unsent = kv_send_groups([_LayerSend(0, 1, 12.0, 8)], 10.0)  # (no frame reported back)
    assert unsent[0].sent_s == unsent[0].queued_s == 2.0
    assert kv_send_groups([], 10.0) == ()


def test_frame_ranges_split_by_size_and_dtype():
    import torch

    from pdserve.kernels import KVCacheLayer
    from pdserve.prefill_worker.worker import frame_ranges

    def layer(dtype):
        kv = torch.zeros(2, 1, 1, 1, 1, dtype=dtype)
        scale = torch.ones(1, 1) if dtype == torch.int8 else None
        return KVCacheLayer(kv, scale, scale)

    caches = [layer(torch.float32)] + [layer(torch.int8)] * 4 + [layer(torch.float32)]
    assert frame_ranges(caches, 3) == [(0, 1), (1, 4), (4, 5), (5, 6)]
    assert frame_ranges(caches[1:5], 1) == [(0, 1), (1, 2), (2, 3), (3, 4)]


@pytest.mark.parametrize("where", ["remote", "local"])
def test_a_windowed_prompt_longer_than_window_and_chunk_leaves_no_stand_in_in_the_cache(
        hf_checkpoint, make_pair, hf_greedy, where):
    """The reported case: a sliding window of 12, blocks of 4, chunks of 8. A 64-token prompt
    A runs through a prefill worker, which frees the blocks that leave the window during its
    chunked prefill and ships stand-ins for them. Then a prompt C sharing A's first 12 tokens
    runs, its prompt computed on the prefill worker (``remote``: the decode worker's
    reservation matches its prefix cache) or on the decode worker itself (``local``: a submit,
    as conditional disaggregation does). C's greedy tokens equal transformers'. The decode
    worker used to hash the stand-ins at commit, and C's first three blocks matched them."""
    model_dir = hf_checkpoint("mistral", sliding_window=12)
    prompt_a, tail = prompts_for(7, [64, 4])
    prompt_c = prompt_a[:12] + tail
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    pair = make_pair(model_dir, max_num_batched_tokens=8)
    pair.generate("a", prompt_a, params)
    if where == "remote":
        tokens, _ = pair.generate("c", prompt_c, params)
    else:
        tokens = _submitted(pair.decode, "c", prompt_c, params)
    assert tokens == hf_greedy(model_dir, [prompt_c], 6)[0]
    assert pair.used_blocks() == (0, 0)


def test_a_windowed_prompt_keeps_its_real_blocks_for_the_decode_prefix_cache(
        hf_checkpoint, make_pair, hf_greedy):
    """Window 12, blocks of 4, chunks of 8, every prompt sharing A's tokens. H (A's first 16
    tokens) ships no stand-in: the decode worker caches its 4 blocks, the first already out
    of its window. A (64 tokens) hits them (4 cached) and its prefill worker, which freed A's
    blocks 4..10 during its chunked prefill, ships 7 stand-ins for them: the decode worker
    frees exactly those, unhashed, and keeps A's real blocks 11.. cached. L (A's first 44
    tokens, computed on the decode worker itself) hits H's 4 blocks only, and hashes blocks
    4..10 for real. Then C (A's first 56 tokens) hits 14 blocks: H's, L's and A's real
    11..13. Every request's greedy tokens equal transformers'. A decode worker that hashed
    the stand-ins served them to L (wrong tokens); one that freed every received block out
    of its window before hashing left H and A without a chain (0 and 11 cached)."""
    model_dir = hf_checkpoint("mistral", sliding_window=12)
    prompt_a, tail_l, tail_c = prompts_for(8, [64, 4, 4])
    prompts = {"h": prompt_a[:16], "a": prompt_a, "l": prompt_a[:44] + tail_l,
               "c": prompt_a[:56] + tail_c}
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    pair = make_pair(model_dir, max_num_batched_tokens=8)
    tokens, cached = {}, {}
    for name, prompt in prompts.items():
        if name == "l":
            tokens[name] = _submitted(pair.decode, name, prompt, params)
            continue
        tokens[name] = pair.generate(name, prompt, params)[0]
        cached[name] = pair.last[0].num_cached_blocks
    assert cached == {"h": 0, "a": 4, "c": 14}
    assert list(tokens.values()) == hf_greedy(model_dir, list(prompts.values()), 6)
    assert pair.used_blocks() == (0, 0)


def _submitted(worker, request_id: str, prompt: list[int], params, timeout: float = 60.0):
    """Submit a prompt to a streaming worker and collect its tokens until the final delta."""
    import time

    from pdserve.worker_api import WorkRequest

    worker.submit(WorkRequest(request_id, list(prompt), params, seed=1,
                              arrival_time=time.time())).result(timeout)
    tokens, reason, deadline = [], None, time.monotonic() + timeout
    while reason is None and time.monotonic() < deadline:
        for delta in worker.poll(0.2):
            tokens += delta.new_token_ids
            reason = delta.finish_reason
    return tokens
