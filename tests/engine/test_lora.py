"""LoRA adapters in the engine: greedy output under each adapter equals PEFT's (fp32) in one
batch that mixes adapters of different ranks and target sets with the base model; slots are
reused (an evicted adapter loaded again gives the same tokens); the prefix cache never shares a
block between adapters; bad adapters are refused naming them, before anything changes."""

from __future__ import annotations

import json
import random
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from pdserve import LLM, SamplingParams
from pdserve.models.lora import read_adapter
from pdserve.testing.lora_adapters import ALL_TARGETS, peft_greedy, write_peft_adapter

pytest.importorskip("peft")

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
ENGINE = dict(dtype="float32", block_size=4, num_kv_blocks=256, enable_lora=True)
# rank, target modules: every projection, attention alone, the MLP alone, two of attention
ADAPTERS = [(1, ALL_TARGETS), (4, ("q_proj", "k_proj", "v_proj", "o_proj")),
            (8, ("gate_proj", "up_proj", "down_proj")), (16, ("q_proj", "v_proj"))]


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 480) for _ in range(rng.randrange(3, 30))] for _ in range(n)]


@pytest.fixture(scope="session")
def lora_case(hf_checkpoint, tmp_path_factory):
    """``family -> (base dir, [adapter dirs])``: four PEFT adapters of ADAPTERS per family."""
    made = {}

    def make(family: str):
        if family not in made:
            base = hf_checkpoint(family)
            out = tmp_path_factory.mktemp(f"lora-{family}")
            made[family] = (base, [write_peft_adapter(base, out / f"a{i}", rank, targets,
                                                      seed=i)
                                   for i, (rank, targets) in enumerate(ADAPTERS)])
        return made[family]

    return make


@pytest.fixture(scope="session")
def references(lora_case):
    """PEFT's greedy tokens per (family, adapter index or None, prompts seed)."""
    cache = {}

    def get(family: str, index: int | None, prompts: list[list[int]]):
        key = (family, index, json.dumps(prompts))
        if key not in cache:
            base, adapters = lora_case(family)
            cache[key] = peft_greedy(base, None if index is None else adapters[index],
                                     prompts, GREEDY.max_tokens)
        return cache[key]

    return get


def _assert_no_leak(llm: LLM) -> None:
    bm = llm.engine.parts.block_manager
    assert bm.num_used_blocks == 0 and llm.engine.num_requests == 0
    assert llm.engine.parts.adapters._pins == [0] * llm.engine.parts.adapters.max_loras


@pytest.mark.parametrize("family", ["llama-gqa", "qwen2-bias-tied"])
def test_mixed_batch_equals_peft(family, lora_case, references):
    """Two prompts under each of four adapters and the base model, all in one engine's steps
    (chunked prefill, decodes of several adapters together)."""
    base, adapters = lora_case(family)
    prompts = _prompts(2, seed=1)
    llm = LLM(str(base), **ENGINE, max_num_batched_tokens=24)
    refs = [LLM.adapter(a) for a in adapters]
    choices = [None, *range(len(refs))]
    outs = llm.generate([p for _ in choices for p in prompts], GREEDY, use_tqdm=False,
                        adapters=[None if c is None else refs[c] for c in choices
                                  for _ in prompts])
    got = [o.token_ids for o in outs]
    for k, choice in enumerate(choices):
        assert got[2 * k:2 * k + 2] == references(family, choice, prompts), choice
    assert len({json.dumps(got[2 * k:2 * k + 2]) for k in range(len(choices))}) == len(choices)
    _assert_no_leak(llm)
    ledger = llm.memory_ledger  # the slots are counted (as weights) before the pool is sized
    assert 0 < ledger.lora_bytes == llm.engine.parts.adapters.slot_bytes < ledger.weight_bytes
    assert ("LoRA slots (in weights)" in dict(ledger.rows()))


def test_evicted_adapter_reloads_to_the_same_tokens(lora_case, references):
    """Two slots, four adapters: each round evicts; host memory holds one adapter, so some
    loads read files again."""
    base, adapters = lora_case("llama-gqa")
    prompts = _prompts(2, seed=2)
    llm = LLM(str(base), **{**ENGINE, "max_loras": 2, "max_cpu_loras": 2})
    refs = [LLM.adapter(a) for a in adapters]
    for order in ([0, 1, 2, 3], [3, 0, 2, 1]):
        for index in order:
            outs = llm.generate(prompts, GREEDY, use_tqdm=False, adapters=refs[index])
            assert [o.token_ids for o in outs] == references("llama-gqa", index, prompts)
    counters = llm.engine.parts.adapters.counters
    # loads 0 1 2 3 | 0 2 1 (3 stays), each after the first two evicting; host memory keeps
    # the last two read, never the one wanted next
    assert (counters.slot_loads, counters.evictions, counters.disk_reads) == (7, 5, 7)
    _assert_no_leak(llm)


def test_more_adapters_at_once_than_slots_wait_their_turn(lora_case, references):
    """Four adapters' requests submitted together to one slot: they run one adapter at a time,
    every output right, nothing held after."""
    base, adapters = lora_case("llama-gqa")
    prompts = _prompts(1, seed=3)
    llm = LLM(str(base), **{**ENGINE, "max_loras": 1})
    refs = [LLM.adapter(a) for a in adapters]
    outs = llm.generate(prompts * 4, GREEDY, use_tqdm=False, adapters=refs)
    for index, out in enumerate(outs):
        assert out.token_ids == references("llama-gqa", index, prompts)[0]
    _assert_no_leak(llm)


def test_prefix_cache_keeps_adapters_apart(lora_case, references):
    base, adapters = lora_case("llama-gqa")
    prompt = _prompts(1, seed=4)[0] * 3  # several full blocks
    llm = LLM(str(base), **ENGINE)
    a, b = LLM.adapter(adapters[0]), LLM.adapter(adapters[1])
    first = llm.generate([prompt], GREEDY, use_tqdm=False, adapters=a)[0]
    assert first.num_cached_tokens == 0
    again = llm.generate([prompt], GREEDY, use_tqdm=False, adapters=a)[0]
    assert again.num_cached_tokens > 0 and again.token_ids == first.token_ids
    for other in (b, None):
        out = llm.generate([prompt], GREEDY, use_tqdm=False, adapters=other)[0]
        assert out.num_cached_tokens == 0
        assert out.token_ids == references("llama-gqa", None if other is None else 1,
                                           [prompt])[0]
    # the same name over other weights is another adapter: nothing of the first is served
    renamed = type(a)(a.name, str(adapters[2]), LLM.adapter(adapters[2]).digest)
    out = llm.generate([prompt], GREEDY, use_tqdm=False, adapters=renamed)[0]
    assert out.num_cached_tokens == 0
    _assert_no_leak(llm)


def test_n_forks_and_speculation_keep_the_adapter(lora_case, references):
    """n > 1 forks on the worker that samples (each fork under the adapter), and speculation
    (prompt lookup, a draft model without the adapter) verifies drafts under it: greedy output
    unchanged."""
    base, adapters = lora_case("llama-gqa")
    prompts = [p * 2 for p in _prompts(2, seed=5)]  # repeats give n-gram drafts
    ref = LLM.adapter(adapters[0])
    want = references("llama-gqa", 0, prompts)
    for speculation in ({"method": "ngram", "num_speculative_tokens": 3,
                         "prompt_lookup_max": 3},
                        {"method": "draft_model", "model": str(base),
                         "num_speculative_tokens": 2}):  # (the base model as the draft)
        spec = LLM(str(base), **ENGINE, speculative_config=speculation)
        assert [o.token_ids for o in spec.generate(prompts, GREEDY, use_tqdm=False,
                                                   adapters=ref)] == want, speculation
        assert spec.spec_decode_stats()["num_draft_tokens"] > 0
    plain = LLM(str(base), **ENGINE)
    forked = plain.generate(prompts, SamplingParams(max_tokens=10, temperature=0.0,
                                                    ignore_eos=True, n=2),
                            use_tqdm=False, adapters=ref)
    assert [o.token_ids for o in forked] == [want[0], want[0], want[1], want[1]]
    _assert_no_leak(plain)


def test_int8_kv_under_adapters_is_batch_invariant(lora_case):
    """With int8 KV, each adapter's tokens in a mixed batch equal its tokens run alone."""
    base, adapters = lora_case("llama-gqa")
    prompts = _prompts(2, seed=6)
    llm = LLM(str(base), **ENGINE, kv_cache_dtype="int8")
    refs = [LLM.adapter(a) for a in adapters[:2]]
    mixed = llm.generate(prompts * 3, GREEDY, use_tqdm=False,
                         adapters=[None, None, refs[0], refs[0], refs[1], refs[1]])
    for k, ref in enumerate([None, *refs]):
        alone = llm.generate(prompts, GREEDY, use_tqdm=False, adapters=ref)
        assert [o.token_ids for o in mixed[2 * k:2 * k + 2]] == [o.token_ids for o in alone]
    _assert_no_leak(llm)


# -- refusals --------------------------------------------------------------------------------


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def _edit_config(folder, **changes):
    path = folder / "adapter_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def _edit_weights(folder, edit):
    path = folder / "adapter_model.safetensors"
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path))


def _bad_adapters(good, tmp_path):
    """(case, folder, words the error must hold) for every way an adapter can be wrong."""
    cases = []
    missing = _copy(good, tmp_path / "no-weights")
    (missing / "adapter_model.safetensors").unlink()
    cases.append(("no weights", missing, "adapter_model.safetensors"))
    no_config = _copy(good, tmp_path / "no-config")
    (no_config / "adapter_config.json").unlink()
    cases.append(("no config", no_config, "adapter_config.json"))
    cases.append(("no folder", tmp_path / "nowhere", "is not a folder"))
    dora = _copy(good, tmp_path / "dora")
    _edit_config(dora, use_dora=True)
    cases.append(("dora", dora, "DoRA"))
    saved = _copy(good, tmp_path / "modules-to-save")
    _edit_config(saved, modules_to_save=["lm_head"])
    cases.append(("modules_to_save", saved, "modules_to_save"))
    head = _copy(good, tmp_path / "embed")
    _edit_weights(head, lambda t: t.update({
        "base_model.model.model.embed_tokens.lora_A.weight": torch.zeros(2, 512)}))
    cases.append(("embedding", head, "embed_tokens"))
    shape = _copy(good, tmp_path / "shape")

    def widen(t):
        key = next(k for k in t if k.endswith("q_proj.lora_A.weight"))
        t[key] = torch.zeros(t[key].shape[0], t[key].shape[1] + 1)

    _edit_weights(shape, widen)
    cases.append(("shape", shape, "do not fit the base weight"))
    layer = _copy(good, tmp_path / "layer")

    def deeper(t):
        for key in [k for k in t if ".layers.0." in k]:
            t[key.replace(".layers.0.", ".layers.7.")] = t.pop(key)

    _edit_weights(layer, deeper)
    cases.append(("layer", layer, "has no model.layers.7"))
    half = _copy(good, tmp_path / "half")
    _edit_weights(half, lambda t: t.pop(next(k for k in t if k.endswith("lora_B.weight"))))
    cases.append(("lora_B missing", half, "lora_B missing"))
    nan = _copy(good, tmp_path / "nan")
    _edit_weights(nan, lambda t: t[next(iter(t))].fill_(float("nan")))
    cases.append(("non-finite", nan, "non-finite"))
    return cases


def test_bad_adapters_are_refused_naming_them(lora_case, tmp_path):
    base, adapters = lora_case("llama-gqa")
    llm = LLM(str(base), **{**ENGINE, "max_lora_rank": 8})
    config = llm.engine.parts.model_config
    ok = LLM.adapter(adapters[1])
    for case, folder, words in _bad_adapters(adapters[1], tmp_path):
        with pytest.raises(ValueError, match="LoRA adapter") as info:
            read_adapter("bad", folder, config, 16)
        assert words in str(info.value) and "'bad'" in str(info.value), case
        if folder.exists() and (folder / "adapter_config.json").exists() \
                and (folder / "adapter_model.safetensors").exists():
            ref = LLM.adapter(folder, name="bad")
            with pytest.raises(ValueError, match="'bad'"):
                llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False, adapters=ref)
    with pytest.raises(ValueError, match="rank 16, above max_lora_rank"):
        llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False, adapters=LLM.adapter(adapters[3]))
    # files changed after registration: refused, never served under the old digest
    changed = _copy(adapters[1], tmp_path / "changed")
    ref = LLM.adapter(changed)
    _edit_weights(changed, lambda t: t[next(iter(t))].mul_(2))
    with pytest.raises(ValueError, match="changed since"):
        llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False, adapters=ref)
    # nothing above changed the engine: the good adapter still serves, nothing leaked
    assert llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False, adapters=ok)[0].token_ids
    _assert_no_leak(llm)
    plain = LLM(str(base), dtype="float32", block_size=4, num_kv_blocks=64)
    with pytest.raises(ValueError, match="enable_lora"):
        plain.generate([[5, 6, 7]], GREEDY, use_tqdm=False, adapters=ok)
    assert plain.engine.num_requests == 0


def test_tensor_parallel_mixed_batch_equals_peft(lora_case, references):
    """TP=2 over gloo: each rank holds its part of every slot (B split like the base rows of
    q, k, v, gate and up; A like the input columns of o and down), filled when rank 0 fills
    its own; two slots for four adapters, so slots are refilled on both ranks mid-run."""
    base, adapters = lora_case("llama-gqa")
    prompts = _prompts(2, seed=7)
    refs = [LLM.adapter(a) for a in adapters]
    choices = [None, 0, 1, 2, 3]
    with LLM(str(base), **ENGINE, max_loras=2, tensor_parallel_size=2, device="cpu") as llm:
        outs = llm.generate([p for _ in choices for p in prompts], GREEDY, use_tqdm=False,
                            adapters=[None if c is None else refs[c] for c in choices
                                      for _ in prompts])
        got = [o.token_ids for o in outs]
        for k, choice in enumerate(choices):
            assert got[2 * k:2 * k + 2] == references("llama-gqa", choice, prompts), choice
        assert llm.engine.parts.adapters.counters.evictions > 0
        _assert_no_leak(llm)
