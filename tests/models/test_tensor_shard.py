"""The Megatron splits of :class:`TensorShard`: every rank's slices put back together are the
checkpoint's tensors, row-parallel biases are counted once, K/V heads are replicated when the
group outnumbers them, and a model that cannot be split is refused naming the setting."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pdserve.models.config import ModelConfig, hf_tensor_shapes
from pdserve.models.tensor_parallel import TensorShard

CONFIG = ModelConfig(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=48,
                     num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                     head_dim=8, rms_norm_eps=1e-6, rope_theta=10000.0, rope_scaling=None,
                     max_position_embeddings=64, tie_word_embeddings=False,
                     attention_bias=True, o_proj_bias=True, mlp_bias=True)


def _tensors(config: ModelConfig) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {name: torch.randn(shape, generator=gen)
            for name, shape in hf_tensor_shapes(config).items()}


@pytest.mark.parametrize("size", [1, 2])
def test_slices_put_back_together_are_the_checkpoint(size):
    tensors = _tensors(CONFIG)
    shards = [TensorShard(rank, size) for rank in range(size)]
    for name, full in tensors.items():
        parts = [shard.slice(CONFIG, name, full) for shard in shards]
        projection = name.split(".")[-2]
        if projection in ("o_proj", "down_proj") and name.endswith("bias"):
            assert torch.equal(sum(parts), full)  # rank 0 holds it, the others zeros
        elif projection in ("o_proj", "down_proj"):
            assert torch.equal(torch.cat(parts, dim=1), full)
        elif projection in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"):
            assert torch.equal(torch.cat(parts, dim=0), full)
        else:
            assert all(part is full for part in parts)  # replicated


def test_local_shapes_match_the_slices():
    shard = TensorShard(1, 2)
    local = shard.local_config(CONFIG)
    assert (local.num_attention_heads, local.num_key_value_heads,
            local.intermediate_size) == (2, 1, 24)
    local_shapes = hf_tensor_shapes(local)
    for name, full in _tensors(CONFIG).items():
        assert tuple(shard.slice(CONFIG, name, full).shape) == local_shapes[name], name


def test_more_ranks_than_kv_heads_replicate_each_head():
    """Four ranks over two K/V heads: ranks 0-1 hold head 0, ranks 2-3 head 1, and each
    rank's query heads are the ones that read its K/V head."""
    config = CONFIG
    k = _tensors(config)["model.layers.0.self_attn.k_proj.weight"]  # (2 heads x 8, hidden)
    d, group = config.head_dim, config.num_attention_heads // config.num_key_value_heads
    for rank in range(4):
        shard = TensorShard(rank, 4)
        assert shard.num_kv_heads(config) == 1
        head = shard.first_kv_head(config)
        assert head == rank // 2
        assert torch.equal(shard.slice(config, "model.layers.0.self_attn.k_proj.weight", k),
                           k[head * d:(head + 1) * d])
        query_head = rank  # one query head per rank
        assert query_head // group == head


@pytest.mark.parametrize(("size", "field"), [
    (3, "num_attention_heads"),  # 4 heads
    (8, "num_attention_heads"),
])
def test_a_split_that_does_not_divide_names_the_field(size, field):
    with pytest.raises(ValueError, match=f"tensor_parallel_size \\({size}\\).*{field}"):
        TensorShard(0, size).check(CONFIG)


def test_kv_heads_neither_divisible_nor_dividing_are_refused():
    config = dataclasses.replace(CONFIG, num_attention_heads=12, num_key_value_heads=3,
                                 intermediate_size=48)
    with pytest.raises(ValueError, match="num_key_value_heads \\(3\\)"):
        TensorShard(0, 4).check(config)
    with pytest.raises(ValueError, match="intermediate_size"):
        TensorShard(0, 5).check(dataclasses.replace(CONFIG, num_attention_heads=5,
                                                    num_key_value_heads=5))


@pytest.mark.parametrize("rank", [-1, 2, 2**63])
def test_a_rank_outside_the_group_is_refused(rank):
    with pytest.raises(ValueError, match="outside a group of 2"):
        TensorShard(rank, 2)


@pytest.mark.parametrize("kv_heads", [1, 2, 4, 8])
def test_head_routes_give_every_receiver_each_of_its_heads_once(kv_heads):
    from pdserve.models.tensor_parallel import head_routes

    config = dataclasses.replace(CONFIG, num_attention_heads=8, num_key_value_heads=kv_heads)
    for senders in (1, 2, 4, 8):
        for receivers in (1, 2, 4, 8):
            got: dict[int, list[int]] = {r: [] for r in range(receivers)}
            for rank in range(senders):
                shard = TensorShard(rank, senders)
                held = range(shard.first_kv_head(config),
                             shard.first_kv_head(config) + shard.num_kv_heads(config))
                for receiver, (first, end) in head_routes(config, shard, receivers):
                    assert set(range(first, end)) <= set(held)  # only what it holds
                    got[receiver] += range(first, end)
            for receiver in range(receivers):
                shard = TensorShard(receiver, receivers)
                want = list(range(shard.first_kv_head(config),
                                  shard.first_kv_head(config) + shard.num_kv_heads(config)))
                assert sorted(got[receiver]) == want, (senders, receivers, receiver)
