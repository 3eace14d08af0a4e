"""Tensor-parallel layouts of Megatron parameters: which dim each one splits, that sharding then
gathering is the identity, that linear_qkv shards hold whole query groups and linear_fc1 shards
hold matching gate and up columns, and that gathering over real gloo ranks rebuilds the tensors."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from miles.backends.megatron_utils.convert import hf_to_megatron, split_qkv
from miles.backends.megatron_utils.tp_sharding import (
    gather_tp_param,
    tp_gather,
    tp_partition_dim,
    tp_shard,
)

from .cpu_shim import install_megatron_cpu_shim, run_distributed
from .test_convert import hf_state, tiny_hf_model

LAYER = "decoder.layers.3."


@pytest.mark.parametrize(
    ("name", "dim"),
    [
        ("embedding.word_embeddings.weight", 0),
        ("output_layer.weight", 0),
        (LAYER + "self_attention.linear_qkv.weight", 0),
        (LAYER + "self_attention.linear_qkv.bias", 0),
        (LAYER + "mlp.linear_fc1.weight", 0),
        (LAYER + "self_attention.linear_proj.weight", 1),
        (LAYER + "mlp.linear_fc2.weight", 1),
        (LAYER + "mlp.linear_fc2.bias", None),
        (LAYER + "input_layernorm.weight", None),
        (LAYER + "pre_mlp_layernorm.weight", None),
        (LAYER + "self_attention.q_layernorm.weight", None),
        (LAYER + "self_attention.k_layernorm.weight", None),
        ("decoder.final_layernorm.weight", None),
        ("output_layer.score.weight", None),  # the value model's one-output head
        ("output_layer.score.bias", None),
        (LAYER + "self_attention.linear_qkv.layer_norm_weight", None),  # TE-fused norm
        ("module.module." + LAYER + "mlp.linear_fc2.weight", 1),  # DDP / Float16Module prefixes
    ],
)
def test_each_parameter_splits_along_megatrons_dim(name, dim):
    assert tp_partition_dim(name) == dim


def test_unknown_parameters_are_refused_rather_than_guessed():
    with pytest.raises(ValueError, match=r"no tensor-parallel layout known for .*router\.weight"):
        tp_partition_dim(LAYER + "mlp.router.weight")


def _attention_config(groups: int, per_group: int, head_dim: int) -> SimpleNamespace:
    return SimpleNamespace(
        num_attention_heads=groups * per_group,
        num_key_value_heads=groups,
        head_dim=head_dim,
        hidden_size=8,
    )


@st.composite
def _layer_case(draw):
    tp = draw(st.sampled_from([2, 4]))
    groups = tp * draw(st.integers(1, 2))
    per_group = draw(st.integers(1, 3))
    head_dim = draw(st.integers(1, 3))
    hidden = draw(st.integers(1, 5))
    ffn = tp * draw(st.integers(1, 3))
    vocab = tp * draw(st.integers(1, 4))
    config = _attention_config(groups, per_group, head_dim)
    qkv_rows = groups * (per_group + 2) * head_dim
    shapes = {
        "embedding.word_embeddings.weight": (vocab, hidden),
        "output_layer.weight": (vocab, hidden),
        LAYER + "self_attention.linear_qkv.weight": (qkv_rows, hidden),
        LAYER + "self_attention.linear_qkv.bias": (qkv_rows,),
        LAYER + "self_attention.linear_proj.weight": (hidden, groups * per_group * head_dim),
        LAYER + "mlp.linear_fc1.weight": (2 * ffn, hidden),
        LAYER + "mlp.linear_fc2.weight": (hidden, ffn),
        LAYER + "input_layernorm.weight": (hidden,),
        LAYER + "self_attention.q_layernorm.weight": (head_dim,),
    }
    return tp, config, shapes


@settings(max_examples=40, deadline=None)
@given(case=_layer_case(), seed=st.integers(0, 2**16))
def test_sharding_then_gathering_is_the_identity_for_tp_2_and_4(case, seed):
    tp, config, shapes = case
    gen = torch.Generator().manual_seed(seed)
    for name, shape in shapes.items():
        full = torch.randn(shape, generator=gen)
        shards = [tp_shard(name, full, r, tp, config) for r in range(tp)]
        dim = tp_partition_dim(name)
        if dim is None:
            assert all(s is full for s in shards)
        else:
            assert all(s.shape[dim] * tp == full.shape[dim] for s in shards), name
        assert torch.equal(tp_gather(name, shards, config), full), name


def test_qkv_shards_hold_whole_query_groups():
    model = tiny_hf_model("qwen2")  # 4 heads in 2 groups of 2, head_dim 8, q/k/v biases
    state, config = hf_state(model), model.config
    fused = hf_to_megatron(state, config)
    hf = "model.layers.0.self_attn."
    for kind in ("weight", "bias"):
        full = fused[f"decoder.layers.0.self_attention.linear_qkv.{kind}"]
        for rank in range(2):  # tp 2: one group = 2 q heads + 1 k head + 1 v head per rank
            q, k, v = split_qkv(tp_shard(f"x.linear_qkv.{kind}", full, rank, 2, config), config)
            assert torch.equal(q, state[f"{hf}q_proj.{kind}"][rank * 16 : (rank + 1) * 16])
            assert torch.equal(k, state[f"{hf}k_proj.{kind}"][rank * 8 : (rank + 1) * 8])
            assert torch.equal(v, state[f"{hf}v_proj.{kind}"][rank * 8 : (rank + 1) * 8])


def test_fc1_shards_hold_matching_gate_and_up_columns():
    gate, up = torch.arange(8.0)[:, None], 100 + torch.arange(8.0)[:, None]
    full = torch.cat([gate, up])
    shard = tp_shard(LAYER + "mlp.linear_fc1.weight", full, 1, 4, None)
    assert shard[:, 0].tolist() == [2.0, 3.0, 102.0, 103.0]


def test_layouts_that_do_not_split_evenly_are_errors():
    config = _attention_config(groups=2, per_group=2, head_dim=2)
    with pytest.raises(ValueError, match=r"2 query groups .* cannot be split over 4"):
        tp_shard(LAYER + "self_attention.linear_qkv.weight", torch.zeros(16, 3), 0, 4, config)
    with pytest.raises(ValueError, match=r"dim 1 of size 6 cannot be split over 4"):
        tp_shard(LAYER + "mlp.linear_fc2.weight", torch.zeros(3, 6), 0, 4, config)
    with pytest.raises(ValueError, match=r"tp_rank must be in \[0, 2\), got 2"):
        tp_shard("output_layer.weight", torch.zeros(4, 3), 2, 2, config)


def _gather_every_parameter(rank: int, full_state: dict, config) -> dict[str, bool]:
    world = dist.group.WORLD
    rebuilt = {}
    for name, full in full_state.items():
        for dtype in (torch.float32, torch.bfloat16):
            local = tp_shard(name, full.to(dtype), rank, 2, config)
            gathered = gather_tp_param(name, local, config, group=world)
            rebuilt[f"{name}:{dtype}"] = torch.equal(gathered, full.to(dtype))
        if tp_partition_dim(name) is None:
            rebuilt[f"{name}:no copy"] = gather_tp_param(name, full, config, group=world) is full
    # Without a group and without megatron's parallel state there is no tp group to guess.
    name = "output_layer.weight"
    try:
        gather_tp_param(name, full_state[name], config)
    except ValueError as error:
        rebuilt["no group is an error"] = "pass the group explicitly" in str(error)
    # With megatron's parallel state, group=None means its tensor-parallel group.
    from megatron.core import parallel_state

    undo_shim = install_megatron_cpu_shim()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    local = tp_shard(name, full_state[name], rank, 2, config)
    rebuilt["megatron tp group"] = torch.equal(
        gather_tp_param(name, local, config), full_state[name]
    )
    parallel_state.destroy_model_parallel()
    undo_shim()
    return rebuilt


def test_gather_over_two_gloo_ranks_rebuilds_every_full_parameter():
    model = tiny_hf_model("qwen2")
    full_state = hf_to_megatron(hf_state(model), model.config, tp_size=2)
    results = run_distributed(_gather_every_parameter, 2, full_state, model.config)
    for rank_result in results:
        assert rank_result and all(rank_result.values()), rank_result
    assert "megatron tp group" in results[0] and "no group is an error" in results[0]
