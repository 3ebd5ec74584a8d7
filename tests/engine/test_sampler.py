"""Sampler: distributions after filters, penalties, greedy, keyed reproducibility, logprobs."""

from __future__ import annotations

import collections
import math
import random

import numpy as np
import pytest
import torch

import pdserve.engine.sampling.filters as filters_module
from pdserve.engine.sampling.filters import filter_weights, softmax_weights, top_values
from pdserve.engine.sampling.sampler import Sampler, SamplingRow, inverse_cdf_draw
from pdserve.engine.sampling.seeded_uniforms import (
    draw_uniform,
    draw_uniforms,
    keyed_uniforms,
    seed_key,
)
from pdserve.worker_api.sampling_params import SamplingParams

LOGITS = torch.tensor([2.0, 0.5, -1.0, 3.1, 1.7, 0.0, -3.0, 2.6, 1.1, -0.4, 0.9, -2.2])


def reference_probs(logits: torch.Tensor, temperature=1.0, top_k=0, top_p=1.0,
                    min_p=0.0) -> torch.Tensor:
    """HF warpers written out with a full sort, in float64: temperature, top-k, top-p, min-p."""
    scores = logits.double() / temperature
    order = torch.argsort(scores, descending=True)
    keep = torch.ones_like(scores, dtype=torch.bool)
    if 0 < top_k < len(scores):
        keep &= scores >= scores[order[top_k - 1]]
    probs = torch.softmax(scores.masked_fill(~keep, -math.inf), 0)
    if top_p < 1.0:
        above = 0.0
        for token in order.tolist():
            if above >= top_p:
                keep[token] = False
            above += probs[token].item()
    probs = torch.softmax(scores.masked_fill(~keep, -math.inf), 0)
    if min_p > 0:
        keep &= probs >= min_p * probs.max()
    return torch.softmax(scores.masked_fill(~keep, -math.inf), 0)


def chi2_limit(df: int, z: float = 3.72) -> float:
    """Wilson-Hilferty upper quantile of chi-square (z = 3.72: p ~ 1e-4)."""
    a = 2.0 / (9 * df)
    return df * (1 - a + z * math.sqrt(a)) ** 3


def draw_many(logits: torch.Tensor, params: SamplingParams, n: int = 4000, position: int = 3,
              seeds=None) -> list[int]:
    seeds = range(10_000, 10_000 + n) if seeds is None else seeds
    rows = [SamplingRow(params, seed, position, [], []) for seed in seeds]
    return Sampler()(logits.expand(len(rows), -1).contiguous(), rows).token_ids


def assert_matches(tokens: list[int], expected: torch.Tensor) -> None:
    counts = collections.Counter(tokens)
    n = len(tokens)
    kept = [t for t in range(len(expected)) if expected[t] > 0]
    assert set(counts) <= set(kept), f"filtered tokens drawn: {set(counts) - set(kept)}"
    stat = sum((counts[t] - n * expected[t].item()) ** 2 / (n * expected[t].item()) for t in kept)
    if len(kept) > 1:
        assert stat < chi2_limit(len(kept) - 1), (stat, counts, expected)


CONFIGS = [
    dict(),
    dict(temperature=0.6),
    dict(temperature=1.7),
    dict(top_k=4),
    dict(top_p=0.8),
    dict(top_p=0.3),
    dict(min_p=0.15),
    dict(top_k=6, top_p=0.9, min_p=0.1, temperature=0.8),
    dict(top_k=1, temperature=3.0),
]


@pytest.mark.parametrize("config", CONFIGS, ids=[str(c) for c in CONFIGS])
def test_empirical_distribution_matches_filters(config):
    expected = reference_probs(LOGITS, **config)
    assert_matches(draw_many(LOGITS, SamplingParams(**config)), expected)


def test_one_seed_over_positions_matches_distribution():
    params = SamplingParams(top_p=0.9, temperature=0.9)
    rows = [SamplingRow(params, 42, position, [], []) for position in range(4000)]
    tokens = Sampler()(LOGITS.expand(4000, -1).contiguous(), rows).token_ids
    assert_matches(tokens, reference_probs(LOGITS, temperature=0.9, top_p=0.9))


def test_a_wrong_distribution_is_detected():
    # guards the statistical check itself: a different temperature must fail it
    tokens = draw_many(LOGITS, SamplingParams(temperature=1.3))
    with pytest.raises(AssertionError):
        assert_matches(tokens, reference_probs(LOGITS, temperature=1.0))


@pytest.mark.parametrize("path", ["topk", "radix"])
@pytest.mark.parametrize("seed", range(4))
def test_filter_masks_equal_reference_on_random_rows(seed, path, monkeypatch):
    # top-p has two exact implementations: force each one on the same rows
    monkeypatch.setattr(filters_module, "_rank_limit",
                        lambda weights: 10**9 if path == "topk" else -1)
    gen = torch.Generator().manual_seed(seed)
    rows, vocab = 24, 3000
    scale = torch.rand(rows, 1, generator=gen) * 6  # flat (scale ~ 0) to peaky rows
    logits = torch.randn(rows, vocab, generator=gen) * scale
    top_k = torch.randint(0, 40, (rows,), generator=gen) * (torch.rand(rows, generator=gen) < .5)
    top_p = torch.where(torch.rand(rows, generator=gen) < .7,
                        torch.rand(rows, generator=gen) * 0.98 + 0.01, torch.ones(rows))
    min_p = torch.where(torch.rand(rows, generator=gen) < .3,
                        torch.rand(rows, generator=gen) * 0.3, torch.zeros(rows))
    kept = filter_weights(softmax_weights(logits.clone()), top_k, top_p, min_p) > 0
    for r in range(rows):
        expected = reference_probs(logits[r], top_k=int(top_k[r]), top_p=float(top_p[r]),
                                   min_p=float(min_p[r])) > 0
        assert torch.equal(kept[r], expected), (r, int(kept[r].sum()), int(expected.sum()))


@pytest.mark.parametrize("path", ["topk", "radix"])
@pytest.mark.parametrize("seed", range(3))
def test_numpy_and_torch_filter_ops_give_the_same_weights(seed, path, monkeypatch):
    """On CPU the filters' compares, counts and masks run as numpy ops, elsewhere as torch
    ops: the weights must be the same bit for bit (ties, zeros, mixed filters)."""
    monkeypatch.setattr(filters_module, "_rank_limit",
                        lambda weights: 10**9 if path == "topk" else -1)
    gen = torch.Generator().manual_seed(seed)
    rows = 40
    for vocab in (5, 300, 2000):
        logits = (torch.randn(rows, vocab, generator=gen) * 4).round()  # many ties
        logits[:3, vocab // 2:] = -float("inf")  # zero weights
        top_k = torch.randint(0, 12, (rows,), generator=gen)
        top_k *= torch.rand(rows, generator=gen) < .5
        top_p = torch.where(torch.rand(rows, generator=gen) < .7,
                            torch.rand(rows, generator=gen), torch.ones(rows))
        min_p = torch.where(torch.rand(rows, generator=gen) < .3,
                            torch.rand(rows, generator=gen) * 0.3, torch.zeros(rows))
        weights = softmax_weights(logits.clone())
        with_numpy = filter_weights(weights.clone(), top_k, top_p, min_p)
        with monkeypatch.context() as torch_only:
            torch_only.setattr(filters_module, "_numpy_pair", lambda *tensors: False)
            with_torch = filter_weights(weights.clone(), top_k, top_p, min_p)
        assert torch.equal(with_numpy, with_torch), vocab
        assert 0 < int((with_numpy > 0).sum()) < int((weights > 0).sum())  # filters cut


def test_a_filter_passed_as_none_is_the_filter_off_for_every_row():
    gen = torch.Generator().manual_seed(7)
    weights = softmax_weights((torch.randn(12, 300, generator=gen) * 3).round())
    top_k, top_p = torch.randint(0, 20, (12,), generator=gen), torch.full((12,), 0.8)
    min_p, off_k, off_p, off_min = torch.full((12,), 0.05), torch.zeros(12, dtype=torch.int64), \
        torch.ones(12), torch.zeros(12)
    for args, none_args in [((off_k, top_p, off_min), (None, top_p, None)),
                            ((top_k, off_p, off_min), (top_k, None, None)),
                            ((off_k, off_p, min_p), (None, None, min_p)),
                            ((top_k, top_p, off_min), (top_k, top_p, None))]:
        expected = filter_weights(weights.clone(), *args)
        assert torch.equal(filter_weights(weights.clone(), *none_args), expected)
        assert int((expected > 0).sum()) < int((weights > 0).sum())  # the filter cut
    assert torch.equal(filter_weights(weights.clone(), None, None, None), weights)


def test_filters_of_no_rows_are_no_rows():
    weights = torch.zeros(0, 10)
    kept = filter_weights(weights, torch.zeros(0, dtype=torch.int64), torch.full((0,), 0.5),
                          torch.zeros(0))
    assert kept.shape == (0, 10)


def test_ties_at_a_threshold_are_all_kept():
    logits = torch.tensor([[5.0, 5.0, 5.0, 1.0, 5.0], [0.0] * 5, [2.0, 1.0, 1.0, 1.0, 0.0]])
    weights = softmax_weights(logits.clone())
    kept = filter_weights(weights, torch.tensor([2, 0, 0]), torch.tensor([1.0, 0.5, 0.5]),
                          torch.zeros(3)) > 0
    assert kept.tolist() == [[True, True, True, False, True], [True] * 5,
                             [True, True, True, True, False]]


def test_tiny_temperature_is_greedy_and_empty_batch_is_empty():
    logits = torch.tensor([[0.0, 1.0, 0.999999]])
    rows = [SamplingRow(SamplingParams(temperature=1e-6), seed, 0, [], []) for seed in range(1)]
    assert Sampler()(logits, rows).token_ids == [1]
    assert Sampler()(torch.zeros(0, 5), []).token_ids == []


def test_greedy_is_exactly_argmax_of_raw_logits():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(40, 1000, generator=gen)
    logits[3, [10, 500]] = 100.0  # a tie: the first index wins, as torch.argmax
    rows = [SamplingRow(SamplingParams(temperature=0.0, top_k=5, top_p=0.5, min_p=0.3),
                        i, i, [1, 2, 3], [4, 5]) for i in range(40)]
    before = logits.clone()
    out = Sampler()(logits, rows)
    assert out.token_ids == torch.argmax(logits, dim=1).tolist()
    assert out.token_ids[3] == 10
    assert torch.equal(logits, before)  # the caller's logits are not modified


def test_greedy_rows_mixed_with_sampled_rows():
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(10, 50, generator=gen)
    rows = [SamplingRow(SamplingParams(temperature=0.0 if i % 2 else 1.0, top_k=3), i, 0, [], [])
            for i in range(10)]
    out = Sampler()(logits, rows)
    top3 = torch.topk(logits, 3).indices
    for i, token in enumerate(out.token_ids):
        if i % 2:
            assert token == int(logits[i].argmax())
        else:
            assert token in top3[i].tolist()


def reference_penalties(logits, prompt, output, rep, freq, pres):
    out = logits.clone()
    for token in set(prompt) | set(output):
        value = out[token].item()
        out[token] = value * rep if value < 0 else value / rep
    for token, count in collections.Counter(output).items():
        out[token] -= freq * count + pres
    return out


def test_penalties_shift_logits_exactly():
    gen = torch.Generator().manual_seed(3)
    vocab = 20
    logits = torch.randn(4, vocab, generator=gen) * 3
    cases = [  # (prompt, output, repetition, frequency, presence)
        ([1, 2, 2, 7], [7, 7, 3, 0], 1.3, 0.5, 0.25),
        ([5], [], 0.8, 0.0, 0.0),
        ([], [9, 9, 9, 4], 1.0, -0.7, 1.5),
        ([0, 19], [19, 18], 2.0, 0.0, -2.0),
    ]
    expected = torch.stack([reference_penalties(logits[i], p, o, r, f, s)
                            for i, (p, o, r, f, s) in enumerate(cases)])
    rows = [SamplingRow(SamplingParams(temperature=0.0, repetition_penalty=r, frequency_penalty=f,
                                       presence_penalty=s, logprobs=vocab), 0, len(o), p, o)
            for p, o, r, f, s in cases]
    out = Sampler()(logits, rows)
    assert out.token_ids == expected.argmax(1).tolist()
    for i, entry in enumerate(out.logprobs):
        want = torch.log_softmax(expected[i], 0)
        got = torch.tensor([entry[t] for t in range(vocab)])
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_penalty_token_ids_out_of_range_raise():
    rows = [SamplingRow(SamplingParams(frequency_penalty=0.5), 0, 0, [], [3, 10])]
    with pytest.raises(ValueError, match="output_token_ids"):
        Sampler()(torch.zeros(1, 10), rows)


def test_bad_logits_shape_raises():
    rows = [SamplingRow(SamplingParams(), 0, 0, [], [])]
    with pytest.raises(ValueError, match="logits"):
        Sampler()(torch.zeros(2, 10), rows)
    with pytest.raises(ValueError, match="logits"):
        Sampler()(torch.zeros(10), rows)


def test_same_seed_and_position_same_token_whatever_the_batch():
    gen = torch.Generator().manual_seed(4)
    vocab = 5000
    row_logits = torch.randn(vocab, generator=gen) * 2
    params = SamplingParams(temperature=0.9, top_p=0.95, top_k=200, repetition_penalty=1.1)
    target = SamplingRow(params, 123456789, 17, [1, 2, 3], [4, 4, 5])
    sampler = Sampler()
    alone = sampler(row_logits[None], [target]).token_ids[0]
    rng = random.Random(5)
    for batch, index in ((50, 0), (50, 37), (50, 49), (7, 3)):
        logits = torch.randn(batch, vocab, generator=gen) * 3
        logits[index] = row_logits
        rows = []
        for _ in range(batch):
            other = SamplingParams(temperature=rng.choice([0.0, 0.5, 1.0, 1.5]),
                                   top_k=rng.choice([0, 10, 1000]), top_p=rng.choice([1.0, 0.7]),
                                   min_p=rng.choice([0.0, 0.1]), logprobs=rng.choice([None, 3]),
                                   frequency_penalty=rng.choice([0.0, 0.4]))
            rows.append(SamplingRow(other, rng.randrange(2**32), rng.randrange(100), [7], [8, 9]))
        rows[index] = target
        assert sampler(logits, rows).token_ids[index] == alone
    # and the key matters: other positions / seeds give other tokens
    tokens = {sampler(row_logits[None], [SamplingRow(params, 123456789, p, [1, 2, 3], [4, 4, 5])])
              .token_ids[0] for p in range(40)}
    assert len(tokens) > 5


def test_every_row_of_a_mixed_batch_equals_its_solo_draw():
    gen = torch.Generator().manual_seed(7)
    rng = random.Random(8)
    batch, vocab = 120, 2000
    logits = torch.randn(batch, vocab, generator=gen) * torch.rand(batch, 1, generator=gen) * 6
    rows = [SamplingRow(SamplingParams(temperature=rng.choice([0.0, 0.7, 1.0]),
                                       top_k=rng.choice([0, 0, 20]),
                                       top_p=rng.choice([1.0, 0.9, 0.5]),
                                       min_p=rng.choice([0.0, 0.0, 0.05]),
                                       presence_penalty=rng.choice([0.0, 0.5])),
                        rng.randrange(2**40), rng.randrange(50), [1, 2], [3, 3])
            for _ in range(batch)]
    sampler = Sampler()
    together = sampler(logits, rows).token_ids
    alone = [sampler(logits[i:i + 1].clone(), [row]).token_ids[0] for i, row in enumerate(rows)]
    assert together == alone


def test_draw_uniform_is_a_fixed_function():
    # pinned values: every worker must compute the same stream (prefill draws 0, decode the rest)
    values = [draw_uniform(0, 0), draw_uniform(1, 0), draw_uniform(0, 1), draw_uniform(-1, 7)]
    assert values == PINNED_UNIFORMS
    assert all(0.0 <= v < 1.0 for v in values)
    assert draw_uniform(2**63 - 1, 10**9) != draw_uniform(-(2**63), 10**9)


PINNED_UNIFORMS = [0.6524484863740322, 0.36818951565166946, 0.03401170130434639,
                   0.10134950925237729]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16])
def test_top_values_are_torch_topk_values(dtype):
    """On CPU the ranking takes numpy's sort or partition; the values must be topk's, ties,
    zeros and strided rows included, on both sides of the vocabulary and k cut-offs."""
    gen = torch.Generator().manual_seed(1)
    for vocab in (1, 7, 1024, 1025, 5000):
        x = ((torch.rand(9, vocab, generator=gen) * 20).floor() / 20).to(dtype)  # many ties
        x[0] = 0.0
        for k in sorted({1, 16, 63, 64, 256, vocab // 2, vocab} & set(range(1, vocab + 1))):
            for rows in (x, x[::2], x.t().contiguous().t()):
                expected = torch.topk(rows, k).values
                got = top_values(rows, k)
                assert got.dtype == dtype and torch.equal(got, expected), (vocab, k)


def test_draw_uniforms_equal_draw_uniform_bit_for_bit():
    """The batch's uniforms come from array ops (also from seed keys kept across steps); they
    must be the scalar hash exactly."""
    rng = random.Random(3)
    seeds = [0, 1, -1, 2**63 - 1, -(2**63), 2**64 - 1, 2**70 + 5]
    seeds += [rng.randrange(-(2**63), 2**64) for _ in range(500)]
    positions = [rng.randrange(0, 2**40) for _ in seeds]
    vector = draw_uniforms(seeds, positions).tolist()
    assert vector == [draw_uniform(s, p) for s, p in zip(seeds, positions, strict=True)]
    assert all(0.0 <= u < 1.0 for u in vector)
    keys = np.array([seed_key(s) for s in seeds], np.uint64)
    assert keyed_uniforms(keys, np.array(positions, np.int64)).tolist() == vector


def test_inverse_cdf_never_draws_zero_weight_tokens():
    vocab = 300  # not a multiple of the 128-token block
    weights = torch.zeros(3, vocab)
    weights[0, [0, 299]] = torch.tensor([1.0, 3.0])
    weights[1, 130] = 1.0  # one token, in the second block
    weights[2, 127:129] = 1.0  # straddles a block boundary
    for u in (0.0, 1e-12, 0.2499, 0.2501, 0.4999, 0.5001, 0.999999, 1.0 - 2**-53):
        drawn = inverse_cdf_draw(weights, torch.full((3,), u, dtype=torch.float64)).tolist()
        assert drawn[0] == (0 if u < 0.25 else 299)
        assert drawn[1] == 130
        assert drawn[2] == (127 if u < 0.5 else 128)


def test_logprobs_are_log_softmax_of_processed_logits():
    gen = torch.Generator().manual_seed(6)
    logits = torch.randn(4, 100, generator=gen) * 2
    rows = [SamplingRow(SamplingParams(temperature=0.5, logprobs=5, top_k=3), 1, 0, [], []),
            SamplingRow(SamplingParams(temperature=0.0, logprobs=0), 2, 0, [], []),
            SamplingRow(SamplingParams(temperature=1.0), 3, 0, [], []),
            SamplingRow(SamplingParams(temperature=2.0, logprobs=20, min_p=0.5), 4, 0, [], [])]
    out = Sampler()(logits, rows)
    assert out.logprobs[2] is None
    for i, n, temperature in ((0, 5, 0.5), (1, 0, 1.0), (3, 20, 2.0)):
        reference = torch.log_softmax(logits[i] / temperature, 0)  # before top-k / min-p
        entry = out.logprobs[i]
        top = torch.topk(reference, n).indices.tolist()
        assert set(entry) == set(top) | {out.token_ids[i]}
        for token, value in entry.items():
            assert value == pytest.approx(reference[token].item(), abs=1e-5)
    assert list(out.logprobs[1]) == [int(logits[1].argmax())]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_greedy_tokens_are_argmax_with_ties_and_nan_at_the_first_index(dtype):
    from pdserve.engine.sampling.sampler import greedy_tokens

    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(33, 517, generator=gen).to(dtype)
    logits[1, [5, 9, 400]] = logits[1].max() + 1  # a three-way tie
    logits[2, [7, 8]] = float("nan")
    with torch.inference_mode():  # how the runner's logits come
        frozen = logits.clone()
    for x in (logits, frozen):
        got = greedy_tokens(x)
        assert got == x.argmax(dim=1).tolist() and got[1] == 5 and got[2] == 7
