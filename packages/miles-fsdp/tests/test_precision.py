"""PrecisionPolicy: dtypes per device, the FSDP2 policy, and the per-parameter engine dtypes."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.fsdp import MixedPrecisionPolicy

from miles.backends.fsdp_utils.arguments import FSDPArgs
from miles.backends.fsdp_utils.param_names import hf_parameter_name
from miles.backends.fsdp_utils.precision import PrecisionPolicy


@pytest.mark.parametrize(
    ("kind", "param_dtype"),
    [
        ("cpu", torch.float32),
        ("cuda", torch.bfloat16),
        ("rocm", torch.bfloat16),
        ("npu", torch.bfloat16),
    ],
)
def test_auto_computes_in_bfloat16_on_accelerators_and_float32_on_cpu(kind, param_dtype):
    policy = PrecisionPolicy.from_args(FSDPArgs(), kind)
    assert policy.param_dtype == param_dtype
    assert policy.reduce_dtype == torch.float32
    assert policy.master_dtype == torch.float32
    assert policy.engine_dtype == param_dtype


def test_explicit_dtypes_win_over_the_device_default():
    args = FSDPArgs(param_dtype="bfloat16", reduce_dtype="bfloat16")
    policy = PrecisionPolicy.from_args(args, "cpu")
    assert (policy.param_dtype, policy.reduce_dtype) == (torch.bfloat16, torch.bfloat16)
    policy = PrecisionPolicy.from_args(FSDPArgs(param_dtype="float32"), "cuda")
    assert policy.param_dtype == torch.float32


def test_mixed_precision_is_the_fsdp2_policy_with_the_same_dtypes():
    policy = PrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    mp = policy.mixed_precision()
    assert isinstance(mp, MixedPrecisionPolicy)
    assert (mp.param_dtype, mp.reduce_dtype) == (torch.bfloat16, torch.float32)


def test_record_names_every_parameter_once_in_hf_terms_with_the_engine_dtype():
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(4, 4)

    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(8, 4)
            self.layers = torch.nn.ModuleList([checkpoint_wrapper(Block())])
            self.head = torch.nn.Linear(4, 8, bias=False)
            self.head.weight = self.embed.weight  # tied

    policy = PrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    assert policy.record(Tiny()) == {
        "embed.weight": torch.bfloat16,
        "layers.0.proj.weight": torch.bfloat16,
        "layers.0.proj.bias": torch.bfloat16,
    }


def test_hf_parameter_name_drops_wrapper_path_components():
    assert (
        hf_parameter_name("_orig_mod.model.layers.0._checkpoint_wrapped_module.mlp.up_proj.weight")
        == "model.layers.0.mlp.up_proj.weight"
    )


@pytest.mark.parametrize("bad", [torch.int8, "bfloat16"])
def test_non_floating_dtypes_are_rejected(bad):
    with pytest.raises(ValueError, match=r"must be a floating torch\.dtype"):
        PrecisionPolicy(param_dtype=bad, reduce_dtype=torch.float32)


def test_unknown_device_kind_is_rejected():
    with pytest.raises(ValueError, match="device kind 'tpu' is not one of cpu, cuda, rocm, npu"):
        PrecisionPolicy.from_args(FSDPArgs(), "tpu")
