"""Shared fixtures: tiny RANDOM Hugging Face checkpoints built with transformers.

* ``tiny_dir``: the built-in tiny model, generated into the session tmp dir (never ~/.cache).
* ``hf_checkpoint(name_or_family, *, rope_style="new", max_shard_size=None, **overrides)``:
  a session-cached factory returning a folder written by transformers' ``save_pretrained``
  (config.json, model.safetensors or shards + index, generation_config.json) plus the tiny
  model's tokenizer.json / tokenizer_config.json. ``name_or_family`` is a key of
  :data:`FAMILY_PARAMS` or a bare family ("llama", "mistral", "qwen2", "qwen3"). Weights are
  drawn from a fixed seed (every parameter, biases and norm weights included, is random, so
  loading mistakes show). ``rope_style="old"`` rewrites config.json to the pre-transformers-5
  ``rope_theta`` + ``rope_scaling`` keys; same arguments give the same weights.
* ``family_params``: list of (family, overrides), one per :data:`FAMILY_PARAMS` entry;
  ``hf_checkpoint(family, **overrides)`` builds it. A bare family gets small defaults
  (mistral: sliding_window 8), so ``hf_checkpoint("mistral")`` has a window tests exceed.
* ``family_case``: parametrized over every :data:`FAMILY_PARAMS` entry; yields a
  :class:`FamilyCase` (name, family, overrides, path). Use it to run a test on all families.
* ``hf_model(path)``: transformers' model for a checkpoint folder (fp32, eager attention),
  cached per folder.

transformers is imported lazily, so sessions that never use these fixtures do not pay for it.
The tiny tokenizer's vocab (480) is below every model vocab here, so it never emits an id the
model lacks.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before any Triton kernel module is imported

# pdserve first: a bare `python -m pytest` from the repository root puts the root on sys.path,
# where our folders would shadow third-party packages; importing pdserve takes it off again
# (`make test` runs pytest with -P, which never puts it there).
import pdserve  # noqa: E402, F401, I001

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from pdserve.testing.lora_adapters import cached_greedy

# One intra-op thread in the test process. The suite's models are tiny (hidden sizes of 48 to
# 96), so a second thread only adds OpenMP's fork and join to every op; and the test process
# shares this machine's cores with its own Ray workers, subprocesses and tensor parallel
# followers (which take this count), where OpenMP's waiting threads spin on cores another
# process needs. Tests of the kernels' threaded paths set their own count. Processes the
# tests start (Ray workers, `pdserve serve`) keep their own settings.
torch.set_num_threads(1)

HF_SEED = 0


def pytest_collection_modifyitems(items):
    """Under pytest-xdist's ``--dist loadgroup`` (``make test``), the e2e tests that start their
    own clusters run one after another in one worker (``own_cluster``)."""
    for item in items:
        if item.get_closest_marker("own_cluster") is not None:
            item.add_marker(pytest.mark.xdist_group("own_cluster"))


# Small, fast shapes; every family keeps vocab >= 480 (the tiny tokenizer's vocab).
_BASE = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
             rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)

FAMILY_PARAMS: dict[str, tuple[str, dict]] = {
    # Llama, GQA (4 query heads share 2 KV heads).
    "llama-gqa": ("llama", {}),
    # Llama, MHA with an odd head count and a vocab that is not a multiple of 8.
    "llama-mha-odd": ("llama", dict(hidden_size=48, num_attention_heads=3,
                                    num_key_value_heads=3, vocab_size=509)),
    # Llama 3.1 style RoPE scaling; a short original context so the scaling bites early.
    "llama3-rope": ("llama", dict(hidden_size=96, num_attention_heads=6, num_key_value_heads=3,
                                  rope_parameters=dict(rope_type="llama3", rope_theta=500000.0,
                                                       factor=8.0, low_freq_factor=1.0,
                                                       high_freq_factor=4.0,
                                                       original_max_position_embeddings=32))),
    # Qwen2: q/k/v bias, tied embeddings.
    "qwen2-bias-tied": ("qwen2", dict(tie_word_embeddings=True,
                                      rope_parameters=dict(rope_type="default",
                                                           rope_theta=1000000.0))),
    # Qwen3: per-head q/k RMSNorm, explicit head_dim (32) != hidden / heads (16).
    "qwen3-qknorm": ("qwen3", dict(head_dim=32)),
    # Mistral: sliding window 8, so every test's longer sequences exceed it.
    "mistral-window": ("mistral", dict(sliding_window=8)),
    # Qwen2 with use_sliding_window: layer 0 full attention, layer 1 a window of 6 (per-layer
    # windows; ModelConfig.sliding_window is None since no window covers every layer).
    "qwen2-layer-window": ("qwen2", dict(use_sliding_window=True, sliding_window=6,
                                         max_window_layers=1)),
}

# What a bare family name gets (under any explicit overrides): a window tests can exceed.
_FAMILY_DEFAULTS: dict[str, dict] = {"llama": {}, "mistral": dict(sliding_window=8),
                                     "qwen2": {}, "qwen3": {}}

_HF_CLASSES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
               "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
_CONFIG_CLASSES = {"llama": "LlamaConfig", "mistral": "MistralConfig",
                   "qwen2": "Qwen2Config", "qwen3": "Qwen3Config"}


@dataclass(frozen=True)
class FamilyCase:
    """One parametrized checkpoint for :func:`family_case`."""

    name: str  # key of FAMILY_PARAMS
    family: str  # model_type
    overrides: dict  # config overrides on top of the shared small shapes
    path: Path  # the checkpoint folder


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Every parameter random: matrices ~ N(0, 1/fan_in), norms ~ 1 + N(0, .1), biases
    ~ N(0, .1)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            noise = torch.randn(param.shape, generator=gen)
            if param.dim() == 2:
                param.copy_(noise / param.shape[1] ** 0.5)
            elif "norm" in name:
                param.copy_(1.0 + 0.1 * noise)
            else:
                param.copy_(0.1 * noise)


def _to_old_rope_style(config_path: Path) -> None:
    cfg = json.loads(config_path.read_text())
    params = dict(cfg.pop("rope_parameters", None) or {})
    cfg["rope_theta"] = params.pop("rope_theta", 10000.0)
    rope_type = params.pop("rope_type", "default")
    cfg["rope_scaling"] = None if rope_type == "default" else {"rope_type": rope_type, **params}
    config_path.write_text(json.dumps(cfg, indent=2))


def _build_checkpoint(out: Path, family: str, overrides: dict, rope_style: str,
                      max_shard_size: str | None, tiny: Path) -> None:
    import transformers

    kwargs = {**_BASE, **overrides}
    config = getattr(transformers, _CONFIG_CLASSES[family])(**kwargs)
    torch.manual_seed(HF_SEED)
    model = getattr(transformers, _HF_CLASSES[family])(config).float()
    _randomize(model, HF_SEED)
    save_kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(out, **save_kwargs)
    eos = [2, 0] if family.startswith("qwen") else 2  # both generation_config eos forms
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": 1, "eos_token_id": eos}, indent=2))
    if rope_style == "old":
        _to_old_rope_style(out / "config.json")
    elif rope_style != "new":
        raise ValueError(f"rope_style must be 'new' or 'old', got {rope_style!r}")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny / name, out / name)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    from pdserve.models.tiny import tiny_model_dir

    return tiny_model_dir(tmp_path_factory.mktemp("tiny-cache"))


@pytest.fixture(scope="session")
def family_params() -> list[tuple[str, dict]]:
    """Every FAMILY_PARAMS entry as (family, overrides): ``hf_checkpoint(family, **overrides)``."""
    return [(family, dict(overrides)) for family, overrides in FAMILY_PARAMS.values()]


@pytest.fixture(scope="session")
def hf_checkpoint(tmp_path_factory, tiny_dir):
    built: dict[str, Path] = {}

    def make(name_or_family: str, *, rope_style: str = "new", max_shard_size: str | None = None,
             **overrides) -> Path:
        if name_or_family in FAMILY_PARAMS:
            family, base = FAMILY_PARAMS[name_or_family]
            overrides = {**base, **overrides}
        elif name_or_family in _HF_CLASSES:
            family = name_or_family
        else:
            raise ValueError(f"unknown family {name_or_family!r}; use one of "
                             f"{sorted(FAMILY_PARAMS)} or {sorted(_HF_CLASSES)}")
        overrides = {**_FAMILY_DEFAULTS[family], **overrides}
        key = json.dumps([family, rope_style, max_shard_size, overrides], sort_keys=True)
        if key not in built:
            out = tmp_path_factory.mktemp(f"hf-{family}")
            _build_checkpoint(out, family, overrides, rope_style, max_shard_size, tiny_dir)
            built[key] = out
        return built[key]

    return make


@pytest.fixture(scope="session", params=sorted(FAMILY_PARAMS))
def family_case(request, hf_checkpoint) -> FamilyCase:
    family, overrides = FAMILY_PARAMS[request.param]
    return FamilyCase(request.param, family, overrides, hf_checkpoint(request.param))


@pytest.fixture(scope="session")
def hf_model():
    loaded: dict[Path, torch.nn.Module] = {}

    def load(path: Path) -> torch.nn.Module:
        if path not in loaded:
            from transformers import AutoModelForCausalLM

            loaded[path] = AutoModelForCausalLM.from_pretrained(
                path, dtype=torch.float32, attn_implementation="eager").eval()
        return loaded[path]

    return load


@pytest.fixture(scope="session")
def hf_greedy():
    """``hf_greedy(model_or_dir, prompts, max_tokens)``: the reference greedy tokens of every
    prompt from Hugging Face transformers with its own KV cache and no eos handling
    (``generate``'s min_new_tokens would mask eos logits and change the argmax). A folder is
    loaded in fp32 with transformers' default attention."""

    def run(model_or_dir, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        model = model_or_dir
        if not isinstance(model, torch.nn.Module):
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_pretrained(model_or_dir, dtype=torch.float32)
            model.eval()
        return cached_greedy(model, prompts, max_tokens)

    return run
