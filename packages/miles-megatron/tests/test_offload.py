"""StorageOffloader: sleep frees every byte behind the tensors, wake restores them, and every view
(Megatron's DDP buffers, optimizer shards) still aliases the same memory afterwards."""

from __future__ import annotations

import pytest
import torch
import transformers
from hypothesis import given, settings
from hypothesis import strategies as st

from miles.backends.megatron_utils.offload import StorageOffloader

from .cpu_shim import install_megatron_cpu_shim, run_distributed

CPU = torch.device("cpu")


@settings(max_examples=25, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 50), min_size=1, max_size=6),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.int64]),
)
def test_views_of_one_buffer_get_their_values_back_and_keep_sharing_it(sizes, dtype):
    flat = (torch.randn(sum(sizes)) * 100).to(dtype)
    views = list(flat.split(sizes))
    saved = flat.clone()
    offloader = StorageOffloader(CPU)
    offloader.offload(views)
    assert flat.untyped_storage().nbytes() == 0
    assert offloader.nbytes == saved.numel() * saved.element_size()
    offloader.reload()
    assert torch.equal(flat, saved)
    views[-1].fill_(7)  # a write through a view still lands in the flat buffer
    assert torch.equal(flat[-sizes[-1] :], torch.full((sizes[-1],), 7, dtype=dtype))


def test_discarded_tensors_come_back_zero_and_kept_ones_win_a_shared_storage():
    grads = torch.randn(10)
    params = torch.randn(6)
    saved = params.clone()
    offloader = StorageOffloader(CPU)
    # The same storage named in both lists is kept: losing weights is never the cheap mistake.
    offloader.offload([params], discard=[grads[:5], grads[5:], params[:2]])
    assert offloader.nbytes == (10 + 6) * 4
    offloader.reload()
    assert torch.equal(grads, torch.zeros(10)) and torch.equal(params, saved)


def test_only_tensors_on_the_device_are_touched_and_the_state_machine_is_enforced():
    offloader = StorageOffloader(torch.device("meta"))  # stands in for a GPU: not the CPU
    cpu_tensor = torch.ones(3)
    offloader.offload([cpu_tensor])  # e.g. Adam's CPU step counter next to GPU moments
    assert cpu_tensor.untyped_storage().nbytes() == 12 and offloader.nbytes == 0
    with pytest.raises(RuntimeError, match="offload\\(\\) twice"):
        offloader.offload([cpu_tensor])
    offloader.reload()
    with pytest.raises(RuntimeError, match="reload\\(\\) without offload"):
        offloader.reload()


def test_a_visit_brings_back_only_the_named_tensors_and_frees_them_again():
    weights, moments = torch.randn(5), torch.randn(9)
    saved = weights.clone()
    offloader = StorageOffloader(CPU)
    with pytest.raises(RuntimeError, match="needs offloaded state"):
        with offloader.visiting([weights]):
            pass
    view = weights[1:3]
    offloader.offload([weights, moments])
    with offloader.visiting([view]):  # any view names its whole storage
        assert torch.equal(weights, saved)
        assert moments.untyped_storage().nbytes() == 0
    assert weights.untyped_storage().nbytes() == 0
    offloader.reload()
    assert torch.equal(weights, saved)


def test_state_that_appears_after_the_first_offload_is_covered_by_the_next():
    weights = torch.randn(4)
    offloader = StorageOffloader(CPU)
    offloader.offload([weights])
    offloader.reload()
    moment = torch.randn(8)  # e.g. Adam's state, created at the first step
    offloader.offload([weights, moment])
    assert moment.untyped_storage().nbytes() == 0
    offloader.reload()
    assert moment.untyped_storage().nbytes() == 32


CONFIG = transformers.Qwen3Config(
    vocab_size=259, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
    tie_word_embeddings=False,
)  # fmt: skip


def _ddp_worker(rank: int) -> dict:
    """A Megatron DDP model with flat param and grad buffers through one backward, a sleep and a
    wake: the buffers are freed, then back with the weights intact and gradients zeroed."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from miles.backends.megatron_utils.arguments import MegatronArgs
    from miles.backends.megatron_utils.model_provider import (
        build_gpt_model,
        transformer_config_from_hf,
    )
    from miles.backends.megatron_utils.parallel import (
        destroy_megatron_parallel,
        initialize_megatron_parallel,
    )

    keep = install_megatron_cpu_shim()  # noqa: F841 (the patches live as long as this)
    args = MegatronArgs(params_dtype="float32", make_vocab_size_divisible_by=8, seed=0)
    initialize_megatron_parallel(args)
    config = transformer_config_from_hf(CONFIG, args)
    model = DistributedDataParallel(
        config=config,
        ddp_config=DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, use_distributed_optimizer=True
        ),
        module=build_gpt_model(CONFIG, args),
    )
    ids = torch.arange(12).view(1, 12)
    logits = model(input_ids=ids, position_ids=ids, attention_mask=None)
    logits.float().square().mean().backward()
    params = [p for p in model.module.parameters()]
    weights = [p.detach().clone() for p in params]
    buffer = model.buffers[0]
    had_grads = bool(buffer.grad_data.abs().sum() > 0)

    offloader = StorageOffloader(CPU)
    offloader.offload(params, discard=[p.main_grad for p in params])
    freed = (
        buffer.param_data.untyped_storage().nbytes(),
        buffer.grad_data.untyped_storage().nbytes(),
    )
    offloader.reload()
    # Views still alias the flat buffer: a write to it shows in the parameter.
    buffer.param_data.add_(1.0)
    aliased = all(torch.equal(p, w + 1.0) for p, w in zip(params, weights, strict=True))
    result = {
        "had_grads": had_grads,
        "freed": freed,
        "aliased_and_restored": aliased,
        "grads_zero": bool(buffer.grad_data.abs().sum() == 0),
        "one_region_each": len(offloader._regions) == 2,
    }
    destroy_megatron_parallel()
    return result


def test_a_megatron_ddp_model_sleeps_and_wakes_with_its_flat_buffers_intact():
    (result,) = run_distributed(_ddp_worker, 1, timeout_s=240)
    assert result["had_grads"]
    assert result["freed"] == (0, 0)
    assert result["aliased_and_restored"]
    assert result["grads_zero"]
    assert result["one_region_each"]
