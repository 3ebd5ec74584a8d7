"""Speculative decoding offline: greedy equals Hugging Face with each method on every family,
sampled outputs follow the target's distribution (chi-square), rolled-back slots never leak,
configs are validated, the counters add up."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdserve import LLM, SamplingParams
from pdserve.engine.config import EngineConfig
from pdserve.engine.kv_cache.block_manager import BlockManager
from pdserve.engine.sampling.rejection_sampler import (
    DRAFT_STREAM,
    DraftedRows,
    stream_uniform,
    verify,
)
from pdserve.engine.sampling.sampler import SamplingRow, inverse_cdf_draw
from pdserve.engine.sequence import Sequence, SequenceStatus
from pdserve.engine.speculation.speculator import NgramProposer, Speculator
from pdserve.engine.speculative_config import SpeculativeConfig
from pdserve.engine.step.scheduler import Scheduler, SchedulerConfig
from pdserve.worker_api.sampling_params import child_seed

transformers = pytest.importorskip("transformers")

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
         "prompt_lookup_min": 1}


def draft_config(hf_checkpoint, family: str, overrides: dict, k: int = 3) -> dict:
    """A truncated-layer draft: the same random draws for embeddings, lm_head and layer 0."""
    draft = hf_checkpoint(family, **{**overrides, "num_hidden_layers": 1})
    return {"method": "draft_model", "model": str(draft), "num_speculative_tokens": k}


def mixed_prompts(seed: int, vocab: int) -> list[list[int]]:
    """Random prompts plus repetitive ones (n-gram lookup finds matches in them)."""
    rng = random.Random(seed)
    rand = [[rng.randrange(3, vocab) for _ in range(n)] for n in (3, 17, 9)]
    return rand + [[5, 6, 7, 8, 9] * 5, [11, 12] * 7]


MAX_TOKENS = [12, 12, 2, 12, 1]  # 1 and 2 never speculate: spec and plain rows in one batch


def assert_no_leak(llm: LLM) -> None:
    bm = llm.engine.parts.block_manager
    bm.check_invariants()
    assert bm.num_used_blocks == 0
    assert llm.engine.num_requests == 0


def run(model_dir, prompts, spec, **kwargs):
    llm = LLM(str(model_dir), dtype="float32", block_size=4, num_kv_blocks=128,
              speculative_config=spec, **kwargs)
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in MAX_TOKENS]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert all(o.finish_reason == "length" for o in outs)
    assert_no_leak(llm)
    return llm, [o.token_ids for o in outs]


def test_greedy_matches_hf_every_family_each_method(hf_checkpoint, family_params, hf_model,
                                                    hf_greedy):
    """Prefill chunks (budget 16) share steps with speculating decodes and with requests too
    close to max_tokens to speculate."""
    for family, overrides in family_params:
        model_dir = hf_checkpoint(family, **overrides)
        vocab = transformers.AutoConfig.from_pretrained(model_dir).vocab_size
        prompts = mixed_prompts(1, vocab)
        reference = [t[:m] for t, m in zip(hf_greedy(hf_model(model_dir), prompts, 12),
                                           MAX_TOKENS, strict=True)]
        for spec in (NGRAM, draft_config(hf_checkpoint, family, overrides)):
            llm, ours = run(model_dir, prompts, spec, max_num_batched_tokens=16)
            assert ours == reference, f"{family} {overrides} {spec['method']}"
            stats = llm.spec_decode_stats()
            assert stats["num_drafts"] > 0 and 0 < stats["num_accepted_tokens"], stats
            assert stats["num_accepted_tokens"] <= stats["num_draft_tokens"]


def test_target_as_its_own_draft_accepts_everything(hf_checkpoint):
    model_dir = hf_checkpoint("llama")
    spec = {"method": "draft_model", "model": str(model_dir), "num_speculative_tokens": 4}
    llm, _ = run(model_dir, mixed_prompts(2, 500), spec)
    stats = llm.spec_decode_stats()
    assert stats["acceptance_rate"] == 1.0
    assert stats["mean_acceptance_length"] > 3.0


def test_preemption_with_speculation_tiny_pool(hf_checkpoint, hf_model, hf_greedy):
    model_dir = hf_checkpoint("llama")
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 200) for _ in range(n)] for n in (10, 12, 14, 9)]
    llm = LLM(str(model_dir), dtype="float32", block_size=4, num_kv_blocks=16,
              speculative_config=draft_config(hf_checkpoint, "llama", {}, k=4))
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    ours = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.spec_decode_stats()["num_drafts"] > 0
    assert ours == hf_greedy(hf_model(model_dir), prompts, 20)
    assert_no_leak(llm)


def test_penalties_logprobs_and_stop_strings_equal_plain_decoding(hf_checkpoint):
    """Penalties read the drafts as history, logprobs come from the target's rows, a stop
    string cuts the accepted tokens where plain decoding stops."""
    model_dir = hf_checkpoint("qwen3")
    prompts = mixed_prompts(3, 400)
    params = SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True, logprobs=2,
                            repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.2)
    plain_llm = LLM(str(model_dir), dtype="float32", block_size=4, num_kv_blocks=128)
    plain = plain_llm.generate(prompts, params, use_tqdm=False)
    stop = plain[3].text[len(plain[3].text) // 2:][:3]  # a piece from the middle of one text
    assert stop
    stopped = dataclasses.replace(params, stop=[stop])
    plain_stopped = plain_llm.generate(prompts, stopped, use_tqdm=False)
    for spec in (NGRAM, draft_config(hf_checkpoint, "qwen3", {})):
        llm = LLM(str(model_dir), dtype="float32", block_size=4, num_kv_blocks=128,
                  speculative_config=spec)
        ours = llm.generate(prompts, params, use_tqdm=False)
        for a, b in zip(ours, plain, strict=True):
            assert a.token_ids == b.token_ids and a.text == b.text
            assert [set(e) for e in a.logprobs] == [set(e) for e in b.logprobs]
            for ea, eb in zip(a.logprobs, b.logprobs, strict=True):
                assert all(ea[t] == pytest.approx(eb[t], abs=1e-4) for t in ea)
        ours_stopped = llm.generate(prompts, stopped, use_tqdm=False)
        assert [(o.token_ids, o.text, o.finish_reason) for o in ours_stopped] == \
            [(o.token_ids, o.text, o.finish_reason) for o in plain_stopped]
        assert any(o.finish_reason == "stop" for o in ours_stopped)
        stats = llm.spec_decode_stats()
        if spec["method"] == "draft_model":  # (penalties make n-gram matches rare)
            assert stats["num_drafts"] > 0 and stats["num_accepted_tokens"] > 0, stats
        assert_no_leak(llm)


# -- the distribution ---------------------------------------------------------------------------

def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """P(X >= statistic) for Pearson's chi-square against ``probs`` (cells with expected
    count < 5 pooled into one)."""
    expected = probs.double() * counts.sum()
    small = expected < 5
    obs = torch.cat([counts.double()[~small], counts.double()[small].sum().reshape(1)])
    exp = torch.cat([expected[~small], expected[small].sum().reshape(1)])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    stat = float(((obs - exp) ** 2 / exp).sum())
    dof = len(exp) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64),
                                         torch.tensor(stat / 2.0, dtype=torch.float64)))


def _one_step_rows(num: int, p_logits: torch.Tensor, q_logits: torch.Tensor):
    """``num`` seeded one-draft sequences: the draft drawn from q with its own stream."""
    params = SamplingParams(temperature=1.0)
    q = torch.softmax(q_logits, 0)
    seqs = []
    for seed in range(num):
        rows = [SamplingRow(params, seed, 0, [], []), SamplingRow(params, seed, 1, [], [])]
        u = torch.tensor([stream_uniform(seed, 0, DRAFT_STREAM)], dtype=torch.float64)
        draft = int(inverse_cdf_draw(q[None], u)[0])
        seqs.append(DraftedRows(rows, [draft], q[None].clone()))
    logits = p_logits[None].repeat(2 * num, 1)
    return logits, seqs


def test_rejection_sampling_unit_follows_p_and_a_wrong_rule_fails(monkeypatch):
    """Sensitivity: the same test rejects "always accept" (the draft's distribution)."""
    gen = torch.Generator().manual_seed(0)
    p_logits, q_logits = torch.randn(6, generator=gen) * 1.5, torch.randn(6, generator=gen) * 1.5
    p = torch.softmax(p_logits, 0)
    logits, seqs = _one_step_rows(6000, p_logits, q_logits)
    first = torch.tensor([v.token_ids[0] for v in verify(logits, seqs)])
    assert chi_square_p_value(torch.bincount(first, minlength=6), p) > 1e-3
    import pdserve.engine.sampling.rejection_sampler as rs

    real = rs.stream_uniform
    monkeypatch.setattr(rs, "stream_uniform", lambda seed, position, stream: 0.0
                        if stream == rs.ACCEPT_STREAM else real(seed, position, stream))
    wrong = torch.tensor([v.token_ids[0] for v in verify(logits, seqs)])
    assert chi_square_p_value(torch.bincount(wrong, minlength=6), p) < 1e-6


def _exact_joint(model, prompt: list[int], vocab: int, length: int) -> torch.Tensor:
    """P(t_0 .. t_{length-1} | prompt) at temperature 1, every sequence enumerated."""
    joint = torch.ones(1, dtype=torch.float64)
    prefixes = torch.zeros(1, 0, dtype=torch.int64)
    with torch.no_grad():
        for _ in range(length):
            ids = torch.cat([torch.tensor(prompt).expand(len(prefixes), -1), prefixes], 1)
            probs = torch.softmax(model(input_ids=ids).logits[:, -1].double(), -1)
            joint = (joint[:, None] * probs).reshape(-1)
            prefixes = torch.cat([prefixes.repeat_interleave(vocab, 0),
                                  torch.arange(vocab).repeat(len(prefixes))[:, None]], 1)
    return joint.reshape((vocab,) * length)


def test_sampled_speculative_outputs_follow_the_target(hf_checkpoint, hf_model):
    """Vocabulary 8, a draft of another family (disagrees often), K = 2, max_tokens 4: token 0
    is sampled after the prefill, tokens 1-3 by one or two speculative steps. The joint of
    (t0, t1), and the marginals of t2 and t3, match the exact target distribution."""
    small = dict(vocab_size=8, bos_token_id=0, eos_token_id=1)
    target = hf_checkpoint("llama", **small)
    draft = hf_checkpoint("qwen3", head_dim=16, **small)
    spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 2}
    llm = LLM(str(target), dtype="float32", block_size=4, num_kv_blocks=2048, seed=11,
              speculative_config=spec)
    prompt, num = [3, 5, 2, 7], 3000
    outs = llm.generate([prompt] * num, SamplingParams(max_tokens=4, temperature=1.0,
                                                       ignore_eos=True), use_tqdm=False)
    tokens = torch.tensor([o.token_ids for o in outs])  # (num, 4)
    stats = llm.spec_decode_stats()
    assert 0.2 < stats["acceptance_rate"] < 0.8, stats  # rejections are common
    joint = _exact_joint(hf_model(target), prompt, 8, 4)
    checks = [(tokens[:, 0] * 8 + tokens[:, 1], joint.sum((2, 3)).reshape(-1)),
              (tokens[:, 2], joint.sum((0, 1, 3))), (tokens[:, 3], joint.sum((0, 1, 2)))]
    for cells, probs in checks:
        counts = torch.bincount(cells, minlength=len(probs))
        assert chi_square_p_value(counts, probs) > 1e-3 / len(checks)
    assert_no_leak(llm)


def test_seeded_request_is_independent_of_batch(hf_checkpoint):
    model_dir = hf_checkpoint("llama")
    llm = LLM(str(model_dir), dtype="float32", block_size=4, num_kv_blocks=256,
              speculative_config=draft_config(hf_checkpoint, "llama", {}))
    params = SamplingParams(max_tokens=10, temperature=0.9, top_k=50, ignore_eos=True, seed=42)
    alone = llm.generate([[5, 6, 7]], params, use_tqdm=False)[0].token_ids
    others = [SamplingParams(max_tokens=m, temperature=1.0, ignore_eos=True) for m in (3, 9, 6)]
    batch = llm.generate([[9, 9], [5, 6, 7], [1, 2, 3, 4], [8]], [others[0], params, *others[1:]],
                         use_tqdm=False)
    assert batch[1].token_ids == alone
    assert_no_leak(llm)


# -- rollback -----------------------------------------------------------------------------------

class _Scripted(Speculator):
    """A speculator whose lookahead and accepted counts a test draws."""

    def __init__(self, block_manager, max_model_len, k, draw):
        super().__init__(SpeculativeConfig.from_dict(NGRAM | {"num_speculative_tokens": k}),
                         None, block_manager, max_model_len)
        self.draw = draw

    def num_lookahead(self, seq):
        limit = min(self.config.num_speculative_tokens,
                    seq.sampling_params.max_tokens - seq.num_output_tokens - 1,
                    self.max_model_len - seq.num_tokens - 1)
        return self.draw(st.integers(0, max(0, limit)))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), block_size=st.sampled_from([1, 2, 4]), num_blocks=st.integers(6, 40),
       k=st.integers(1, 5), caching=st.booleans())
def test_random_accept_patterns_never_leak(data, block_size, num_blocks, k, caching):
    """Scheduler + block manager + the speculator's rollback under random lookahead and
    accept counts (and preemption when the pool is small): invariants after every step,
    every table covers exactly its computed tokens' blocks or one more token, nothing left."""
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching=caching)
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=24,
                                      max_model_len=40), bm)
    spec = _Scripted(bm, 40, k, data.draw)
    sched.lookahead = spec.num_lookahead
    base = data.draw(st.lists(st.integers(0, 9), min_size=1, max_size=6))
    for i in range(data.draw(st.integers(1, 5))):
        prompt = base + data.draw(st.lists(st.integers(0, 9), min_size=0, max_size=5))
        params = SamplingParams(max_tokens=data.draw(st.integers(1, 12)), ignore_eos=True)
        seq = Sequence(f"r{i}", prompt, params)
        try:
            sched.add(seq)
        except ValueError:  # cannot fit this pool
            continue
    for _ in range(200):
        if not sched.has_unfinished:
            break
        out = sched.schedule()
        sched.update(out)
        for item in out.chunks:
            seq = item.seq
            if not item.samples or seq.is_finished:
                continue
            accepted = data.draw(st.integers(0, item.num_lookahead))
            for _ in range(accepted + 1):
                seq.append_token(data.draw(st.integers(0, 9)))
                if seq.num_output_tokens >= seq.sampling_params.max_tokens:
                    sched.finish(seq, SequenceStatus.FINISHED_LENGTH)
                    break
            else:
                if item.num_lookahead:
                    spec.roll_back(seq)
                    # rejected slots freed: at most the blocks of its tokens are held
                    assert len(seq.block_table) <= -(-seq.num_tokens // block_size)
        bm.check_invariants()
        held = sum(1 for s in sched.running for b in s.block_table if b is not None)
        assert held >= bm.num_used_blocks  # shared prefix blocks count once in the pool
        for s in sched.running:
            assert len(s.block_table) * block_size >= s.num_computed_tokens
    assert not sched.has_unfinished
    assert bm.num_used_blocks == 0


# -- config, proposers, counters ----------------------------------------------------------------

@pytest.mark.parametrize("bad, match", [
    ({"method": "medusa", "num_speculative_tokens": 2}, "method"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 17}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2,
      "prompt_lookup_min": 3}, "prompt_lookup_min"),
    ({"method": "ngram", "num_speculative_tokens": 2, "draft_tp": 1}, "draft_tp"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "model"),
    ({"method": "ngram"}, "num_speculative_tokens"),
])
def test_bad_configs_are_value_errors_naming_the_field(bad, match):
    with pytest.raises(ValueError, match=match):
        SpeculativeConfig.from_dict(bad)
    with pytest.raises(ValueError, match="speculative_config"):
        EngineConfig(model="x", speculative_config=bad)


def test_draft_with_another_vocabulary_is_a_value_error(hf_checkpoint):
    other = hf_checkpoint("llama-mha-odd")  # vocab 509
    with pytest.raises(ValueError, match=r"vocab_size \(509\).*vocab_size \(512\)"):
        LLM(str(hf_checkpoint("llama")), speculative_config={
            "method": "draft_model", "model": str(other), "num_speculative_tokens": 2})


def test_ngram_lookup_prefers_longest_most_recent_match():
    proposer = NgramProposer(SpeculativeConfig.from_dict(NGRAM))
    assert proposer.lookup([1, 2, 3, 9, 1, 2, 3, 7, 8, 2, 3], 3) == [7, 8, 2]  # n=2, latest
    assert proposer.lookup([4, 1, 2, 3, 5, 6, 0, 2, 3], 2) == [5, 6]  # n=3 none, n=2 "2 3"
    assert proposer.lookup([1, 2, 3], 3) == []
    assert proposer.lookup([7, 7], 4) == [7, 7, 7, 7]  # a loop continues past the end
    assert proposer.lookup([5, 1, 2, 1, 2], 3) == [1, 2, 1]  # "1 2" at 1: the span "1 2" again


def test_counters_reach_worker_stats_and_prometheus(hf_checkpoint):
    from prometheus_client import generate_latest

    from pdserve.engine.worker_stats import engine_stats
    from pdserve.router.metrics import RouterMetrics

    llm, _ = run(hf_checkpoint("llama"), mixed_prompts(4, 500), NGRAM)
    s = llm.spec_decode_stats()
    stats = engine_stats("w0", "colocated", llm.engine)
    assert (stats.spec_num_drafts, stats.spec_num_draft_tokens,
            stats.spec_num_accepted_tokens) == (s["num_drafts"], s["num_draft_tokens"],
                                                s["num_accepted_tokens"])
    assert s["mean_acceptance_length"] == pytest.approx(
        1 + s["num_accepted_tokens"] / s["num_drafts"])
    metrics = RouterMetrics()
    metrics.set_worker(stats)
    text = generate_latest(metrics.registry).decode()
    line = f'pdserve_spec_decode_num_accepted_tokens_total{{role="colocated",worker="w0"}} ' \
           f'{float(s["num_accepted_tokens"])}'
    assert line in text
    assert "pdserve_spec_decode_num_drafts_total" in text
    assert "pdserve_spec_decode_num_draft_tokens_total" in text
    metrics.remove_worker("colocated", "w0")
    assert 'worker="w0"' not in generate_latest(metrics.registry).decode()


def test_draft_memory_is_in_the_ledger(hf_checkpoint):
    model_dir = hf_checkpoint("llama")
    spec = draft_config(hf_checkpoint, "llama", {})
    plain = LLM(str(model_dir), memory_budget_bytes=64 << 20).memory_ledger
    ledger = LLM(str(model_dir), memory_budget_bytes=64 << 20,
                 speculative_config=spec).memory_ledger
    assert ledger.draft_bytes > 0 and plain.draft_bytes == 0
    assert ledger.num_kv_blocks < plain.num_kv_blocks  # the draft's KV shares the budget


@pytest.mark.triton
def test_triton_backend_verifies_drafts(hf_checkpoint, hf_model, hf_greedy):
    """The Triton kernels (interpreter on CPU) take the k + 1 query tokens per sequence of a
    verification batch: greedy still equals HF."""
    import sys

    model_dir = hf_checkpoint("llama")
    prompts = [[5, 6, 7, 5, 6, 7, 5], [9, 10, 11]]
    spec = {"method": "draft_model", "model": str(model_dir), "num_speculative_tokens": 2}
    llm = LLM(str(model_dir), dtype="float32", block_size=4, num_kv_blocks=32,
              attention_backend="triton", speculative_config=spec)
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    ours = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert ours == hf_greedy(hf_model(model_dir), prompts, 5)
    assert llm.spec_decode_stats()["num_accepted_tokens"] > 0
    assert "pdserve.kernels.prefill_attention" in sys.modules
    assert_no_leak(llm)


def test_n_forks_speculate_as_the_request_alone(hf_checkpoint):
    """n = 3 under speculation (the draft's KV of the shared prompt blocks included): each
    sequence equals the same speculating engine run alone with its seed (sampled drafts are
    accepted by rejection sampling, so a draft model's tokens are not plain decoding's), and
    every block comes back."""
    model_dir = hf_checkpoint("llama")
    prompt = [5, 6, 7, 8, 9] * 3
    params = SamplingParams(max_tokens=12, temperature=0.8, seed=21, ignore_eos=True, n=3)
    for spec in (NGRAM, draft_config(hf_checkpoint, "llama", {})):
        llm = LLM(str(model_dir), dtype="float32", block_size=4, num_kv_blocks=128,
                  speculative_config=spec)
        alone = [llm.generate(prompt, dataclasses.replace(params, n=1, seed=child_seed(21, i)),
                              use_tqdm=False)[0].token_ids for i in range(3)]
        outs = llm.generate(prompt, params, use_tqdm=False)
        assert [o.token_ids for o in outs] == alone, spec["method"]
        assert_no_leak(llm)
