"""int8 KV cache quality and capacity: ``python -m pdserve.bench.kv_int8 [--model DIR]``.

For each scale scheme of ``kv_int8_scales`` (see :mod:`pdserve.engine.kv_cache.int8_scales`),
with and without the first/last layers kept in the model dtype, against the model-dtype cache in
the same run, on the held-out real text of :mod:`pdserve.bench.kv_eval_text` under teacher forcing
(every position predicts the true next token from a cache holding the true prefix, so one
flipped token does not compound as in free-running greedy decoding):

* ``KL``: mean next-token KL(p_fp || p_int8) in nats;
* ``NLL`` and ``dNLL``: mean negative log-likelihood of the true next token (its exp is the
  perplexity) and its relative change against the model-dtype cache;
* ``top-1``: how often the argmax next token is the same;
* ``B/token`` and ``x fp16``: KV bytes per token of the layout for a 16-bit model (int8
  layers, fp edge layers in 16 bits, token scales) and the capacity against an fp16 cache of
  the same model (fp16 bytes / these bytes): how many more tokens the same pool holds.

A ``bfloat16 weights + KV`` row (the whole model in bf16, against the same reference) shows
the size of an error everyone already accepts.

The cache is read by the same attention path the engine serves with (torch on CPU, Triton on
CUDA): the prompt's K/V are written (quantised) into the paged pool and every query attends to
the dequantised cache, exactly as a decode step would. Never asserts.
"""

from __future__ import annotations

import argparse
import math

import torch

from pdserve.bench.kv_eval_text import EVAL_TEXTS
from pdserve.bench.stats import format_table
from pdserve.engine.capacity import memory
from pdserve.engine.config import KV_INT8_SCALES
from pdserve.engine.int8_calibration import teacher_forced_logits
from pdserve.engine.llm import LLM
from pdserve.models import tiny_model_dir

BLOCK_SIZE = 16


def eval_token_ids(llm: LLM, max_len: int) -> list[list[int]]:
    """The evaluation texts as token ids (each cut to ``max_len``)."""
    tokenizer = llm.engine.parts.tokenizer
    if tokenizer is None:
        raise SystemExit("the checkpoint has no tokenizer: the benchmark evaluates on text")
    vocab = llm.engine.parts.model_config.vocab_size
    return [[t for t in tokenizer.encode(text) if t < vocab][:max_len] for text in EVAL_TEXTS]


def teacher_forced_logprobs(llm: LLM, ids: list[int]) -> torch.Tensor:
    """(len(ids), vocab) fp32 log-probabilities at every position, one prefill through the
    engine's paged cache (written and read as the engine does)."""
    runner = llm.engine.parts.runner
    logits = teacher_forced_logits(runner.model, runner.kv_caches, BLOCK_SIZE, runner.device,
                                   runner.backend, [ids])[0]
    return torch.log_softmax(logits, dim=-1)


def stats(reference: list[torch.Tensor], logprobs: list[torch.Tensor],
           texts: list[list[int]]) -> tuple[float, float, float]:
    """(mean KL, mean NLL of the true next token, top-1 agreement) over all positions."""
    kl = nll = agree = count = 0.0
    for ref, out, ids in zip(reference, logprobs, texts, strict=True):
        ref, out = ref[:-1], out[:-1]  # the last position has no true next token
        target = torch.tensor(ids[1:])
        kl += float((ref.exp() * (ref - out)).sum())
        nll -= float(out.gather(1, target[:, None]).sum())
        agree += float((ref.argmax(-1) == out.argmax(-1)).sum())
        count += len(ids) - 1
    return kl / count, nll / count, agree / count


def _row(name: str, edges: str, kl: float, nll: float, ref_nll: float, top1: float,
         per_token: int, fp16: int) -> list[str]:
    return [name, edges, f"{kl:.2e}", f"{nll:.4f}", f"{math.exp(nll):.2f}",
            f"{100.0 * (nll - ref_nll) / ref_nll:+.3f}", f"{100.0 * top1:.2f}", str(per_token),
            f"{fp16 / per_token:.2f}"]


def bytes_per_token_16bit(llm: LLM) -> int:
    """KV bytes per token of this cache's layout for a 16-bit model (the fp edge layers in
    16 bits), whatever dtype the benchmark runs in."""
    config, mc = llm.engine.parts.config, llm.engine.parts.model_config
    layers = memory.kv_layer_dtypes(mc.num_hidden_layers, torch.float16, config)
    return memory.kv_bytes_per_block(mc, config, layers) // config.block_size


def compare(model_dir: str, max_len: int, schemes: list[str],
            with_bf16: bool = True) -> tuple[list[list[str]], int]:
    """Table rows: the model-dtype cache first, then every scheme x edge-layer setting."""
    common = dict(num_kv_blocks=-(-max_len // BLOCK_SIZE) + 1, block_size=BLOCK_SIZE,
                  max_model_len=None, enable_prefix_caching=False)
    base = LLM(model_dir, **common)
    texts = eval_token_ids(base, max_len)
    texts = [t for t in texts if len(t) > 1]
    reference = [teacher_forced_logprobs(base, ids) for ids in texts]
    ref_nll = stats(reference, reference, texts)[1]
    fp16 = base.engine.parts.model_config.kv_bytes_per_token(torch.float16)
    rows = [_row(f"{base.memory_ledger.kv_dtype} (reference)", "-", 0.0, ref_nll, ref_nll, 1.0,
                 fp16, fp16)]
    if with_bf16 and base.engine.parts.runner.model.dtype != torch.bfloat16:
        bf16 = LLM(model_dir, dtype="bfloat16", **common)
        kl, nll, top1 = stats(reference, [teacher_forced_logprobs(bf16, ids).float()
                                           for ids in texts], texts)
        rows.append(_row("bfloat16 weights + KV", "-", kl, nll, ref_nll, top1, fp16, fp16))
    for scheme in schemes:
        for keep_edges in (True, False):
            llm = LLM(model_dir, kv_cache_dtype="int8", kv_int8_scales=scheme,
                      kv_int8_keep_edge_layers=keep_edges, **common)
            kl, nll, top1 = stats(reference, [teacher_forced_logprobs(llm, ids)
                                               for ids in texts], texts)
            per_token = bytes_per_token_16bit(llm)
            rows.append(_row(f"int8 {scheme}", "yes" if keep_edges else "no", kl, nll, ref_nll,
                             top1, per_token, fp16))
    return rows, sum(map(len, texts))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None,
                        help="checkpoint folder or .gguf file (default: the built-in tiny "
                             "model, RANDOM weights)")
    parser.add_argument("--max-len", type=int, default=512, help="tokens per text at most")
    parser.add_argument("--schemes", default=",".join(KV_INT8_SCALES),
                        help="comma-separated kv_int8_scales to measure")
    parser.add_argument("--no-bf16", action="store_true", help="skip the bfloat16 row")
    args = parser.parse_args(argv)
    model_dir = args.model or str(tiny_model_dir())
    rows, num_tokens = compare(model_dir, args.max_len, args.schemes.split(","),
                               with_bf16=not args.no_bf16)
    print(f"model {model_dir}: {len(EVAL_TEXTS)} held-out texts, {num_tokens} tokens, "
          "teacher-forced")
    print(format_table(["KV cache", "fp edges", "KL", "NLL", "PPL", "dNLL %", "top-1 %",
                        "B/token", "x fp16"], rows))


if __name__ == "__main__":
    main()
