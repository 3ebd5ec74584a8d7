"""LoRA adapters for tests and benchmarks, made by PEFT (the reference pdserve is checked
against) for a Hugging Face checkpoint folder, and PEFT's own greedy tokens under one.

PEFT starts B at zero (an adapter that changes nothing); these adapters draw A and B from a
seeded generator instead, large enough that each adapter's greedy tokens differ from the base
model's and from each other's. PEFT and transformers are imported where used (test-only
dependencies)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_peft_adapter(base_dir: str | Path, out_dir: str | Path, rank: int,
                       target_modules=ALL_TARGETS, seed: int = 0, alpha: float | None = None,
                       use_rslora: bool = False, layers: list[int] | None = None,
                       rank_pattern: dict | None = None, scale: float = 1.0) -> Path:
    """A PEFT LoRA adapter of the model in ``base_dir`` saved to ``out_dir``
    (adapter_config.json + adapter_model.safetensors), with seeded random A and B."""
    from peft import LoraConfig, get_peft_model  # lazy: a test-only dependency
    from transformers import AutoModelForCausalLM  # lazy: a test-only dependency

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=alpha if alpha is not None else 2 * rank,
                        target_modules=list(target_modules), lora_dropout=0.0,
                        use_rslora=use_rslora, layers_to_transform=layers,
                        rank_pattern=rank_pattern or {})
    model = get_peft_model(base, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                fan_in = param.shape[1]
                param.copy_(torch.randn(param.shape, generator=generator)
                            * scale / fan_in ** 0.5)
    out = Path(out_dir)
    model.save_pretrained(out)
    return out


def peft_greedy(base_dir: str | Path, adapter_dir: str | Path | None,
                prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """PEFT's greedy tokens for each prompt alone, fp32, the adapter at ``adapter_dir`` applied
    (None: the base model), with transformers' own KV cache."""
    from peft import PeftModel  # lazy: a test-only dependency
    from transformers import AutoModelForCausalLM  # lazy: a test-only dependency

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32,
                                                 attn_implementation="eager")
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(model, adapter_dir)
    return cached_greedy(model.eval(), prompts, max_tokens)


def cached_greedy(model: torch.nn.Module, prompts: list[list[int]],
                  max_tokens: int) -> list[list[int]]:
    """A transformers model's greedy tokens for each prompt alone, one token at a time over
    its own KV cache, with no eos handling (``generate``'s min_new_tokens would mask the eos
    logits and change the argmax)."""
    outs = []
    with torch.no_grad():
        for prompt in prompts:
            ids, past, generated = torch.tensor([prompt]), None, []
            for _ in range(max_tokens):
                out = model(input_ids=ids, past_key_values=past, use_cache=True)
                past = out.past_key_values
                generated.append(int(out.logits[0, -1].argmax()))
                ids = torch.tensor([[generated[-1]]])
            outs.append(generated)
    return outs


def adapter_rank(adapter_dir: str | Path) -> int:
    return int(json.loads((Path(adapter_dir) / "adapter_config.json").read_text())["r"])
