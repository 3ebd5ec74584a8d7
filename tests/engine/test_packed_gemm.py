"""CPU float32 engines, and bf16 ones where oneDNN has bf16 kernels for the CPU, pack their
linear layers for oneDNN (``cpu_packed_gemm``, on by default): the same greedy tokens as the
plain path (the Hugging Face comparisons of the other engine tests run packed), and the ledger
counts what the packed weights take."""

from __future__ import annotations

import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.kernels import linear as klinear

PARAMS = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
PROMPTS = [[5, 17, 33, 80, 120, 7, 9, 300], list(range(3, 60))]


@pytest.mark.parametrize("name", ["llama-gqa", "qwen2-bias-tied"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_packed_and_plain_decode_the_same_tokens(hf_checkpoint, name, dtype):
    """In bf16 too: F.linear's bf16 GEMM on the CPU is oneDNN's, over the unpacked weight."""
    element = torch.empty(0, dtype=getattr(torch, dtype))
    if not klinear.can_pack(element.new_empty(1, 1)):
        pytest.skip(f"{dtype} weights do not pack on this CPU")
    outs = {}
    for packed in (True, False):
        llm = LLM(str(hf_checkpoint(name)), dtype=dtype, block_size=4, num_kv_blocks=64,
                  cpu_packed_gemm=packed)
        layer = llm.engine.parts.runner.model.model.layers[0]
        assert (layer.mlp.gate_up_proj.packed is not None) == packed
        outs[packed] = ([o.token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)],
                        llm.memory_ledger.weight_bytes)
    assert outs[True][0] == outs[False][0]
    model = llm.engine.parts.model_config
    head = model.vocab_size * model.hidden_size * element.element_size()
    # a tied head gets a packed copy (lookups read the embedding); untied, it only moves
    assert outs[True][1] - outs[False][1] == (head if model.tie_word_embeddings else 0)
