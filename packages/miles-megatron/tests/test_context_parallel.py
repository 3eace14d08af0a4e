"""Context parallelism without Transformer Engine (`context_parallel`).

The layout: every rank gets an equal, causally balanced share of each sequence, the shares cover
it exactly once, and Megatron's rotary embedding slices its table the same way. The attention on
2 gloo processes (and over NCCL on 2 GPUs): each rank's output and the gradients of queries, keys and values equal a
float64 full-sequence causal attention with grouped-query heads. The model-level checks (log-probs
equal HF's, training steps, the FSDP backend's gradient norm) are in test_actor.py and
tests/e2e/test_megatron_matches_fsdp.py.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from miles.backends.megatron_utils.context_parallel import local_positions, split_sequence
from tests.support.distributed import free_port

from .cpu_shim import install_megatron_cpu_shim, run_distributed
from .gpu_world import join_nccl_world

SEQ, BATCH, HEADS, GROUPS, HEAD_DIM = 12, 2, 4, 2, 8


@settings(max_examples=60, deadline=None)
@given(cp_size=st.integers(1, 6), chunk=st.integers(1, 5), data=st.data())
def test_the_ranks_hold_every_position_once_with_equal_causal_work(cp_size, chunk, data):
    length = 2 * cp_size * chunk
    held = [local_positions(length, r, cp_size) for r in range(cp_size)]
    assert sorted(torch.cat(held).tolist()) == list(range(length))
    assert {len(h) for h in held} == {length // cp_size}
    # Causal attention work of a query at position p is p + 1 keys: the same on every rank.
    assert len({int((h + 1).sum()) for h in held}) == 1
    rank = data.draw(st.integers(0, cp_size - 1))
    tensor = torch.arange(3 * length).view(3, length)
    assert torch.equal(split_sequence(tensor, 1, rank, cp_size), tensor[:, held[rank]])


@pytest.mark.parametrize(
    ("length", "rank", "size", "message"),
    [
        (10, 0, 2, r"a sequence of 10 tokens cannot be split over 2 .* multiple of 2 x 2 = 4"),
        (8, 2, 2, r"context-parallel rank 2 is not in a group of 2"),
        (8, 0, 0, r"context-parallel rank 0 is not in a group of 0"),
    ],
)
def test_a_layout_that_cannot_split_the_sequence_is_refused(length, rank, size, message):
    with pytest.raises(ValueError, match=message):
        local_positions(length, rank, size)


def _reference(q, k, v) -> torch.Tensor:
    """Full causal grouped-query attention in float64: q [T, B, H, D], k/v [T, B, G, D]."""
    repeat = q.size(2) // k.size(2)
    k, v = k.repeat_interleave(repeat, dim=2), v.repeat_interleave(repeat, dim=2)
    scores = torch.einsum("qbhd,kbhd->bhqk", q, k) / HEAD_DIM**0.5
    causal = torch.ones(q.size(0), k.size(0), dtype=torch.bool).tril()
    probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
    return torch.einsum("bhqk,kbhd->qbhd", probs, v).reshape(q.size(0), q.size(1), -1)


def _attention_worker(rank: int, q, k, v, weight, nccl_init_method: str | None = None) -> dict:
    import torch.distributed as dist
    from megatron.core.models.common.embeddings.rope_utils import get_pos_emb_on_this_cp_rank
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.enums import AttnMaskType

    from miles.backends.megatron_utils.context_parallel import (
        ContextParallelAttention,
        gather_sequence,
    )

    if nccl_init_method is None:
        install_megatron_cpu_shim()
    else:
        device = join_nccl_world(rank, nccl_init_method)
        q, k, v, weight = (t.to(device) for t in (q, k, v, weight))
    size = dist.get_world_size()
    config = TransformerConfig(
        num_layers=1, hidden_size=HEADS * HEAD_DIM, num_attention_heads=HEADS,
        num_query_groups=GROUPS, kv_channels=HEAD_DIM, context_parallel_size=size,
        params_dtype=torch.float64, attention_dropout=0.0,
    )  # fmt: skip
    attention = ContextParallelAttention(
        config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self",
        pg_collection=SimpleNamespace(cp=dist.group.WORLD),
    )  # fmt: skip
    local = [split_sequence(t, 0, rank, size).clone().requires_grad_() for t in (q, k, v)]
    out = attention(*local, attention_mask=None)
    # A different weight per position makes every gradient depend on which rank owns what.
    (out * split_sequence(weight, 0, rank, size)).sum().backward()
    table = torch.arange(SEQ, dtype=torch.float64).view(SEQ, 1, 1, 1)
    rope_rows = get_pos_emb_on_this_cp_rank(table.to(q.device), 0, dist.group.WORLD)
    result = {
        "out": out.detach(),
        "grads": [t.grad for t in local],
        "gathered": gather_sequence(local[0].detach(), 0, dist.group.WORLD),
        "rope_rows": rope_rows.flatten(),
    }
    return {key: _to_cpu(value) for key, value in result.items()}


def _to_cpu(value):
    return [t.cpu() for t in value] if isinstance(value, list) else value.cpu()


def _attention_run(nccl_init_method: str | None = None) -> dict:
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(SEQ, BATCH, HEADS, HEAD_DIM, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(SEQ, BATCH, GROUPS, HEAD_DIM, generator=gen, dtype=torch.float64)
            for _ in range(2))  # fmt: skip
    weight = torch.randn(SEQ, BATCH, HEADS * HEAD_DIM, generator=gen, dtype=torch.float64)
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    expected = _reference(*full)
    (expected * weight).sum().backward()
    ranks = run_distributed(_attention_worker, 2, q, k, v, weight, nccl_init_method, timeout_s=180)
    return {"inputs": (q, k, v), "expected": expected.detach(), "full": full, "ranks": ranks}


@pytest.fixture(scope="module")
def attention_run() -> dict:
    return _attention_run()


def _check_outputs(attention_run: dict) -> None:
    for rank, result in enumerate(attention_run["ranks"]):
        expected = split_sequence(attention_run["expected"], 0, rank, 2)
        torch.testing.assert_close(result["out"], expected, rtol=1e-12, atol=1e-12)


def _check_gradients(attention_run: dict) -> None:
    for rank, result in enumerate(attention_run["ranks"]):
        for ours, full in zip(result["grads"], attention_run["full"], strict=True):
            torch.testing.assert_close(
                ours, split_sequence(full.grad, 0, rank, 2), rtol=1e-12, atol=1e-12
            )


def test_each_rank_attends_causally_over_the_whole_sequence(attention_run):
    _check_outputs(attention_run)


def test_query_key_and_value_gradients_equal_the_full_attentions(attention_run):
    _check_gradients(attention_run)


def test_gather_restores_global_order_and_the_rotary_table_is_sliced_like_the_tokens(
    attention_run,
):
    q = attention_run["inputs"][0]
    for rank, result in enumerate(attention_run["ranks"]):
        assert torch.equal(result["gathered"], q)
        assert result["rope_rows"].long().tolist() == local_positions(SEQ, rank, 2).tolist()


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_on_two_gpus_over_nccl_outputs_and_gradients_equal_the_full_attentions():
    run = _attention_run(f"tcp://127.0.0.1:{free_port()}")
    _check_outputs(run)
    _check_gradients(run)
