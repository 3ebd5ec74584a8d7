"""One decoder for the Llama family: Llama 2/3, Mistral, Qwen2 and Qwen3.

The families differ only in switches carried by :class:`ModelConfig` (q/k/v and o biases,
per-head q/k RMSNorm, tied embeddings, per-layer sliding windows, RoPE scaling), so one module
tree serves all of them. Tokens arrive packed and flat, ``(num_tokens,)`` with no batch
dimension and no padding; :class:`AttentionMetadata` says which sequence each run belongs to.

Parameter layout (the loader maps Hugging Face names onto it):

* ``qkv_proj``: q_proj, k_proj and v_proj stacked along the output dim, one GEMM per layer
* ``gate_up_proj``: gate_proj then up_proj stacked, fed to ``silu_and_mul``

Every norm, rotary and activation goes through :mod:`pdserve.kernels` with
``backend=meta.backend``; attention goes through :class:`pdserve.models.attention.Attention`.

Submodules are called through ``.forward``: these modules never carry hooks, and skipping
``nn.Module.__call__`` saves per-call overhead, which bounds a small-batch CPU forward
(docs/cpu-speed.md).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.kernels import KVCacheLayer, cpu_decode_layers

# The dispatch module, not the package: once the Triton submodule pdserve.kernels.rotary is
# imported, it replaces the package attribute ``rotary`` (the dispatch function).
from pdserve.kernels import dispatch as kernels
from pdserve.kernels import linear as klinear
from pdserve.kernels.lora import LoraBatch
from pdserve.kernels.torch_ops import as_dtype
from pdserve.models.attention import Attention, AttentionMetadata
from pdserve.models.config import ModelConfig
from pdserve.models.rope import cos_sin_cache_for

logger = logging.getLogger(__name__)


def _param(*shape: int) -> nn.Parameter:
    # Uninitialised on purpose: weights always come from a checkpoint (or a test's fill).
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


class RMSNorm(nn.Module):
    """Weight holder; the math lives in ``kernels.rms_norm``."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = _param(size)
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None,
                backend: str = "auto"):
        return kernels.rms_norm(x, self.weight, self.eps, residual, backend=backend)


class Linear(nn.Module):
    """``y = x W^T (+ b)`` with an optional bias, weights loaded, never initialised. Once
    :meth:`pack` has run (CPU, float32 or bf16: ``kernels.linear.can_pack``) the weight lives
    only in its packed form.

    ``parts``: the widths of the projections fused into the output (q, k, v; gate, up), in
    order. With LoRA on (:meth:`init_lora`) each row also adds its adapter's update from the
    layer's slot pool (:mod:`pdserve.kernels.lora`): ``lora_a`` (slots, parts x rank, in) holds
    each part's A stacked, ``lora_b`` (slots, out, parts x rank) each part's B on its own rows
    and columns (block-diagonal), zero where an adapter leaves a part alone."""

    def __init__(self, in_features: int, out_features: int, bias: bool,
                 parts: tuple[int, ...] | None = None):
        super().__init__()
        self.in_features = in_features
        self.parts = parts or (out_features,)
        self.weight = _param(out_features, in_features)
        self.bias = _param(out_features) if bias else None
        self.register_buffer("packed", None)  # the weight in the CPU GEMM's layout, once packed
        self.register_buffer("lora_a", None)
        self.register_buffer("lora_b", None)

    def pack(self) -> None:
        """Keep the weight packed for the CPU's GEMM (:mod:`pdserve.kernels.linear`) and drop
        the plain copy; a no-op where packing does not apply."""
        if self.packed is None and klinear.can_pack(self.weight):
            self.packed = klinear.pack_weight(self.weight)
            self.weight = _param(0)

    def init_lora(self, slots: int, rank: int, in_features: int | None = None) -> None:
        """Zeroed slot pools for ``slots`` adapters of rank up to ``rank``; ``in_features``:
        the A width when it differs from the layer's (a row-parallel rank's slice)."""
        width = self.in_features if in_features is None else in_features
        dtype, device = self.lora_dtype_device()
        ranks = len(self.parts) * rank
        self.lora_a = torch.zeros(slots, ranks, width, dtype=dtype, device=device)
        self.lora_b = torch.zeros(slots, sum(self.parts), ranks, dtype=dtype, device=device)

    def lora_dtype_device(self) -> tuple[torch.dtype, torch.device]:
        source = self.bias if self.bias is not None else self.weight
        dtype = self.packed.dtype if self.packed is not None else source.dtype
        return dtype, source.device

    def set_lora(self, slot: int,
                 pairs: list[tuple[torch.Tensor, torch.Tensor] | None]) -> None:
        """Fill ``slot`` with one (A (r, in), B (part, r)) per part (None: that part is not
        adapted)."""
        a, b = self.lora_a[slot], self.lora_b[slot]
        a.zero_()
        b.zero_()
        rank = a.shape[0] // len(self.parts)
        first = 0
        for part, (width, pair) in enumerate(zip(self.parts, pairs, strict=True)):
            if pair is not None:
                r = pair[0].shape[0]
                a[part * rank:part * rank + r].copy_(pair[0])
                b[first:first + width, part * rank:part * rank + r].copy_(pair[1])
            first += width

    def forward(self, x: torch.Tensor, lora: LoraBatch | None = None,
                backend: str = "auto") -> torch.Tensor:
        y = klinear.linear(x, self.weight, self.bias, self.packed)
        if lora is not None and self.lora_a is not None:
            kernels.lora_delta(y, x, self.lora_a, self.lora_b, lora, backend=backend)
        return y


class SelfAttention(nn.Module):
    """Fused qkv projection, optional q/k norm, RoPE, paged attention, output projection."""

    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size, self.kv_size = config.q_size, config.kv_size
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size,
                               config.attention_bias,
                               parts=(self.q_size, self.kv_size, self.kv_size))
        self.o_proj = Linear(self.q_size, config.hidden_size, config.o_proj_bias)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim,
                              scale=self.head_dim ** -0.5,
                              sliding_window=config.layer_sliding_windows[layer_idx])

    def _head_norm(self, norm: RMSNorm, x: torch.Tensor, backend: str) -> torch.Tensor:
        num_tokens, num_heads, head_dim = x.shape
        flat = x.reshape(num_tokens * num_heads, head_dim)  # (T * heads, head_dim)
        return norm.forward(flat, backend=backend).view(num_tokens, num_heads, head_dim)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, cache: KVCacheLayer,
                meta: AttentionMetadata, rope: tuple, rows: tuple | None = None) -> torch.Tensor:
        """``rope``: (cos_sin_cache, its rope_table for ``positions``), shared by the layers.
        ``rows``: only those rows' outputs (:meth:`Attention.forward`); every K/V is written."""
        num_tokens, heads, kv_heads = hidden.shape[0], self.num_heads, self.num_kv_heads
        qkv = self.qkv_proj.forward(hidden, meta.lora, meta.backend)  # (T, q_size + 2 kv)
        qk_size = self.q_size + self.kv_size
        v = qkv[:, qk_size:].reshape(num_tokens, kv_heads, self.head_dim)  # (T, kv_heads, hd)
        if self.q_norm is None:  # q and k side by side in qkv: rotated as one tensor
            qk = qkv[:, :qk_size].reshape(num_tokens, heads + kv_heads, self.head_dim)
            q, k = kernels.rotary_packed(qk, heads, positions, rope[0], backend=meta.backend,
                                         table=rope[1])
        else:
            q = qkv[:, :self.q_size].reshape(num_tokens, heads, self.head_dim)
            k = qkv[:, self.q_size:qk_size].reshape(num_tokens, kv_heads, self.head_dim)
            q = self._head_norm(self.q_norm, q, meta.backend)
            k = self._head_norm(self.k_norm, k, meta.backend)
            q, k = kernels.rotary(q, k, positions, rope[0], backend=meta.backend, table=rope[1])
        out = self.attn.forward(q, k, v, cache, meta, rows)  # (T or rows, heads, head_dim)
        if not len(out):
            return hidden[:0]
        lora = (meta if rows is None else rows[1]).lora
        return self.o_proj.forward(out.reshape(len(out), self.q_size), lora,
                                   meta.backend)  # (T or rows, hidden)


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)) with gate and up fused into one GEMM."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size,
                                   config.mlp_bias,
                                   parts=(config.intermediate_size, config.intermediate_size))
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, config.mlp_bias)

    def forward(self, x: torch.Tensor, backend: str, lora: LoraBatch | None = None
                ) -> torch.Tensor:
        gate_up = self.gate_up_proj.forward(x, lora, backend)  # (T, 2 * intermediate)
        return self.down_proj.forward(kernels.silu_and_mul(gate_up, backend=backend), lora,
                                      backend)


class DecoderLayer(nn.Module):
    """Pre-norm block; the residual add is fused into the next RMSNorm."""

    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = SelfAttention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)
        # tensor parallel: sums, in place, the ranks' partial outputs of o_proj and down_proj
        self.all_reduce: Callable[[torch.Tensor], None] | None = None

    def forward(self, positions, hidden, residual, cache, meta, rope, rows=None):
        """``rows`` (see :meth:`SelfAttention.forward`): the outputs of those rows alone."""
        backend = meta.backend
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm.forward(hidden, backend=backend)
        else:
            hidden, residual = self.input_layernorm.forward(hidden, residual, backend=backend)
        hidden = self.self_attn.forward(positions, hidden, cache, meta, rope, rows)
        lora = meta.lora
        if rows is not None:
            lora = rows[1].lora
            residual = residual.index_select(0, rows[0])
            if not len(hidden):
                return hidden, residual
        if self.all_reduce is not None:
            self.all_reduce(hidden)
        hidden, residual = self.post_attention_layernorm.forward(hidden, residual, backend=backend)
        hidden = self.mlp.forward(hidden, backend, lora)
        if self.all_reduce is not None:
            self.all_reduce(hidden)
        return hidden, residual


class DecoderModel(nn.Module):
    """Embedding, decoder layers and the final norm (Hugging Face's ``model.`` prefix)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Module()
        self.embed_tokens.weight = _param(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i)
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """The decoder for every supported family; see the module docstring."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.model = DecoderModel(config)
        self.lm_head = nn.Module()
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        else:
            self.lm_head.weight = _param(config.vocab_size, config.hidden_size)
        self.register_buffer("lm_head_packed", None)  # pack_linears: the head's GEMM layout
        # float32 [cos | sin] table, kept outside the parameters so .to(dtype) never rounds it
        self._cos_sin_cache = cos_sin_cache_for(config)
        # whether a decode step runs as one C call (cpu_decode_layers): None until the first
        # decode step asks cpu_decode_layers.takes_model; set False to keep the unfused forward
        self.fuses_decode: bool | None = None
        self._decode_layers: cpu_decode_layers.DecodeLayers | None = None

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    @property
    def num_layers(self) -> int:
        return self.config.num_hidden_layers

    def cos_sin_cache(self, device: torch.device) -> torch.Tensor:
        """The RoPE table on ``device`` (moved once, then reused)."""
        if self._cos_sin_cache.device != device:
            self._cos_sin_cache = self._cos_sin_cache.to(device)
        return self._cos_sin_cache

    def set_rope_freq_factors(self, freq_factors: torch.Tensor) -> None:
        """Divide the RoPE frequencies by ``freq_factors`` (head_dim / 2,): how GGUF files
        carry Llama 3.1 scaling."""
        self._cos_sin_cache = cos_sin_cache_for(self.config, freq_factors=freq_factors)

    def tie_weights(self) -> None:
        """Make lm_head share the embedding matrix (tied or lm_head-less checkpoints)."""
        self.lm_head.weight = self.model.embed_tokens.weight

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[KVCacheLayer], meta: AttentionMetadata,
                after_layer: Callable[[int], None] | None = None,
                rows: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids, positions: (T,) -> final-normed hidden states (T, hidden).

        ``after_layer(i)`` runs once layer ``i``'s K/V are in the cache (the prefill worker
        ships that layer while the next one computes). ``rows`` (R,) int64, ascending: the only
        rows the caller reads (those it samples); returns (R, hidden). The last layer then
        writes every row's K/V but computes its attention, MLP and norms for those rows
        alone: no later layer reads the other rows, so that work would be thrown away (1/L
        of a prompt's)."""
        if input_ids.dim() != 1 or positions.shape != input_ids.shape:
            raise ValueError(f"input_ids and positions must both be (num_tokens,), got "
                             f"{tuple(input_ids.shape)} and {tuple(positions.shape)}")
        if len(kv_caches) != self.num_layers:
            raise ValueError(f"kv_caches has {len(kv_caches)} layers, the model {self.num_layers}")
        cos_sin = self.cos_sin_cache(input_ids.device)
        rope = (cos_sin, kernels.rope_table(positions, cos_sin, backend=meta.backend))
        fused = self._fused_decode(len(input_ids), kv_caches, meta, rows, after_layer)
        if fused is not None:
            return fused.forward(input_ids, rope[1], meta.slot_mapping, meta.block_tables,
                                 meta.context_lens)
        hidden = F.embedding(input_ids, self.model.embed_tokens.weight)  # (T, hidden)
        residual = None
        last = None if rows is None or len(rows) == len(input_ids) else (rows, meta.of_rows(rows))
        for i, (layer, cache) in enumerate(zip(self.model.layers, kv_caches, strict=True)):
            hidden, residual = layer.forward(positions, hidden, residual, cache, meta, rope,
                                             last if i == self.num_layers - 1 else None)
            if after_layer is not None:
                after_layer(i)
        hidden, _ = self.model.norm.forward(hidden, residual, backend=meta.backend)  # >= 1 layer
        return hidden

    def fused_decode_rows(self, kv_caches: list[KVCacheLayer], backend: str) -> int | None:
        """The most sequences a pure decode step of this model over ``kv_caches`` computes
        in one fused call (:meth:`_fused_decode`, without LoRA rows); None where it runs
        none. A step of more runs the unfused forward, far slower a token."""
        if not self._fuses(backend) or not cpu_decode_layers.DecodeLayers.takes(kv_caches,
                                                                                self.dtype):
            return None
        return cpu_decode_layers.MAX_ROWS[self.dtype]

    def _fuses(self, backend: str) -> bool:
        """Whether the fused decode serves this model on ``backend`` (asked of
        :func:`cpu_decode_layers.takes_model` once)."""
        if kernels.resolve_backend(backend, self.device) != "native":
            return False
        if self.fuses_decode is None:
            self.fuses_decode = cpu_decode_layers.takes_model(self)
        return self.fuses_decode

    def _fused_decode(self, num_tokens: int, kv_caches: list[KVCacheLayer],
                      meta: AttentionMetadata, rows, after_layer
                      ) -> cpu_decode_layers.DecodeLayers | None:
        """The one-call decode (:mod:`pdserve.kernels.cpu_decode_layers`) where it serves this
        step: a CPU model it takes, the native backend, one new token for each of at most
        ``MAX_ROWS[dtype]`` sequences, every row wanted, no LoRA rows, no per-layer hook."""
        if (after_layer is not None or meta.lora is not None or not meta.is_decode_only
                or not 0 < num_tokens <= cpu_decode_layers.MAX_ROWS.get(self.dtype, 0)
                or (rows is not None and len(rows) != num_tokens)
                or not self._fuses(meta.backend)):
            return None
        held = self._decode_layers
        if held is None or not held.serves(kv_caches):
            if not cpu_decode_layers.DecodeLayers.takes(kv_caches, self.dtype):
                return None
            held = self._decode_layers = cpu_decode_layers.DecodeLayers(self, kv_caches)
        return held

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(T, hidden) -> (T, vocab) float32."""
        logits = klinear.linear(hidden, self.lm_head.weight, None, self.lm_head_packed)
        return as_dtype(logits, torch.float32)

    def join_tensor_group(self, all_reduce: Callable[[torch.Tensor], None]) -> None:
        """Run as one rank of a tensor parallel group (a model built from a
        :class:`~pdserve.models.tensor_parallel.TensorShard`'s local config): every block's
        output is summed across the ranks with ``all_reduce`` (in place)."""
        for layer in self.model.layers:
            layer.all_reduce = all_reduce
        self.fuses_decode = self._decode_layers = None

    def pack_linears(self) -> None:
        """Pack every linear layer and the head for the CPU's GEMM (a no-op elsewhere). A head
        that shares the embedding matrix gets a packed copy (lookups read the embedding)."""
        self.fuses_decode = self._decode_layers = None
        for module in self.modules():
            if isinstance(module, Linear):
                module.pack()
        head = self.lm_head.weight
        if self.lm_head_packed is not None or not klinear.can_pack(head):
            return
        self.lm_head_packed = klinear.pack_weight(head)
        if head is not self.model.embed_tokens.weight:
            self.lm_head.weight = _param(0)


# model_type -> decoder class; all four families share one implementation.
MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "llama": LlamaForCausalLM,
    "mistral": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
    "qwen3": LlamaForCausalLM,
}


def build_model(config: ModelConfig, dtype: torch.dtype = torch.float32,
                device: torch.device | str = "cpu") -> nn.Module:
    """An uninitialised model for ``config`` (fill it with :func:`load_model` or by hand)."""
    try:
        cls = MODEL_REGISTRY[config.model_type]
    except KeyError:
        raise ValueError(f"unsupported architecture {config.model_type!r}; supported: "
                         f"{', '.join(MODEL_REGISTRY)}") from None
    with torch.device("meta"):  # no allocation, no init: shapes only
        model = cls(config)
    model = model.to(dtype=dtype).to_empty(device=device)
    if config.tie_word_embeddings:
        model.tie_weights()  # to_empty gives each module its own tensor
    return model.eval()
