"""``logit_bias`` in the engine (engine/sampling/sampler.py): a bias of +100 forces its token
greedily, -100 bans the greedy choice, rows without a bias in the same batch get the tokens
they get alone (on the persistent decode rows and in chunks), and the reported logprobs are
the model's, before the bias (vLLM's default)."""

from __future__ import annotations

import math
import re

import pytest
import torch

from pdserve.engine.llm import LLM
from pdserve.engine.sampling.sampler import Sampler, SamplingRow, takes_argmax
from pdserve.worker_api import NeverFits
from pdserve.worker_api.sampling_params import MAX_LOGIT_BIAS, SamplingParams

PROMPTS = [[5, 6, 7], [9, 10, 11, 12], [40, 41], [77, 3, 9, 100, 4]]


@pytest.fixture(scope="module")
def llm(tiny_dir):
    with LLM(str(tiny_dir), num_kv_blocks=64, block_size=4) as engine:
        yield engine


def greedy(max_tokens: int = 12, **kwargs) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kwargs)


@pytest.mark.parametrize("bias,message", [
    ({0: 1.0}, None), ({2**31 - 1: -100}, None), ({-1: 1.0}, "logit_bias keys must be token ids"),
    ({2**63: 1.0}, "logit_bias keys must be token ids"),
    ({1: 1e30}, re.escape("logit_bias of token 1 must be a number in [-100, 100]")),
    ({1: float("nan")}, "logit_bias of token 1 must be a number"),
    ({1: float("inf")}, "logit_bias of token 1 must be a number"),
    ({1: True}, "logit_bias of token 1 must be a number"), ({"1": 1.0}, "logit_bias keys"),
    ({i: 1.0 for i in range(MAX_LOGIT_BIAS + 1)}, f"at most {MAX_LOGIT_BIAS} entries"),
    ([1, 2], "logit_bias must be a map")])
def test_logit_bias_is_checked_when_built(bias, message):
    if message is None:
        assert SamplingParams(logit_bias=bias).logit_bias == {k: float(v) for k, v in bias.items()}
        return
    with pytest.raises(ValueError, match=message):
        SamplingParams(logit_bias=bias)


def test_an_empty_map_is_no_bias_and_keeps_the_argmax_path():
    assert SamplingParams(logit_bias={}).logit_bias is None
    assert takes_argmax(greedy(logit_bias={}))
    assert not takes_argmax(greedy(logit_bias={3: 0.5}))


def test_plus_100_forces_a_token_and_minus_100_bans_the_greedy_choice(llm):
    free = llm.generate(PROMPTS[0], greedy(), use_tqdm=False)[0].token_ids
    forced = llm.generate(PROMPTS[0], greedy(logit_bias={123: 100.0}), use_tqdm=False)[0]
    assert forced.token_ids == [123] * 12
    banned = llm.generate(PROMPTS[0], greedy(max_tokens=1, logit_bias={free[0]: -100.0}),
                          use_tqdm=False)[0].token_ids
    assert banned != free[:1]


def test_sampled_rows_follow_the_bias_too(llm):
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=3, ignore_eos=True,
                            logit_bias={200: 100.0})
    assert llm.generate(PROMPTS[1], params, use_tqdm=False)[0].token_ids == [200] * 8


def test_unbiased_rows_in_a_mixed_batch_get_the_tokens_they_get_alone(llm):
    """Greedy and seeded rows with no bias, batched with biased ones (on the decode rows after
    the first step), equal their runs alone."""
    free = [greedy(), SamplingParams(max_tokens=12, temperature=0.8, seed=7, ignore_eos=True)]
    alone = [llm.generate(PROMPTS[i], p, use_tqdm=False)[0].token_ids
             for i, p in zip((1, 3), free, strict=True)]
    mixed = llm.generate(PROMPTS, [greedy(logit_bias={50: 100.0}), free[0],
                                   greedy(logit_bias={60: 100.0, 61: 50.0}), free[1]],
                         use_tqdm=False)
    assert [mixed[1].token_ids, mixed[3].token_ids] == alone
    assert mixed[0].token_ids == [50] * 12 and mixed[2].token_ids == [60] * 12


def test_reported_logprobs_are_the_models_before_the_bias(llm, tiny_dir):
    from transformers import AutoModelForCausalLM

    out = llm.generate(PROMPTS[2], greedy(max_tokens=1, logprobs=2, logit_bias={300: 100.0}),
                       use_tqdm=False)[0]
    assert out.token_ids == [300]
    model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([PROMPTS[2]])).logits[0, -1].float()
    expected = torch.log_softmax(logits, dim=0)
    entry = out.logprobs[0]
    assert math.isclose(entry[300], float(expected[300]), abs_tol=1e-4)
    top = torch.topk(expected, 2).indices.tolist()
    assert set(entry) == {300, *top}


def test_an_id_outside_the_vocabulary_is_refused_naming_the_field(llm):
    vocab = llm.engine.parts.model_config.vocab_size
    with pytest.raises(NeverFits, match=rf"logit_bias keys must be token ids in \[0, {vocab}\), "
                                        rf"got {vocab}"):
        llm.engine.add_request("outside", PROMPTS[0], greedy(logit_bias={vocab: 1.0}))
    assert not llm.engine.has_unfinished_requests()


def test_the_sampler_leaves_rows_without_a_bias_and_the_callers_logits_untouched():
    logits = torch.randn(3, 50)
    rows = [SamplingRow(greedy(logit_bias={7: 100.0}), 0, 0, [], []),
            SamplingRow(greedy(), 0, 0, [], []),
            SamplingRow(SamplingParams(temperature=1.0, logit_bias={1: -100.0, 9: 100.0}),
                        5, 0, [], [])]
    given = logits.clone()
    out = Sampler()(given, rows)
    assert out.token_ids == [7, int(logits[1].argmax()), 9]
    assert torch.equal(given, logits)  # the biases went in place and came out exactly


def test_a_speculating_engine_serves_the_bias(tiny_dir):
    with LLM(str(tiny_dir), num_kv_blocks=64, speculative_config={
            "method": "ngram", "num_speculative_tokens": 2}) as speculating:
        out = speculating.generate(PROMPTS[3], greedy(logit_bias={77: 100.0}), use_tqdm=False)
    assert out[0].token_ids == [77] * 12
