"""MoE experts in the checkpoint layout: what a trainer sends for a fused transformers model is
exactly what the Hugging Face checkpoint holds (the names and tensors SGLang's MoE loaders read),
and an engine holding fused experts loads that layout, whole or not at all."""

from __future__ import annotations

import re

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from miles.backends.sglang_utils.tiny_checkpoint import build_tiny_checkpoint
from miles.backends.sglang_utils.weight_sync import WeightUpdateError, load_named_tensors
from miles.backends.sglang_utils.weight_sync.expert_layout import split_fused_experts


@pytest.fixture(scope="module")
def moe_checkpoint(tmp_path_factory):
    return build_tiny_checkpoint(tmp_path_factory.mktemp("moe"), architecture="qwen3_moe")


def test_split_experts_are_the_checkpoints_tensors_under_its_names(moe_checkpoint):
    model = AutoModelForCausalLM.from_pretrained(moe_checkpoint, dtype=torch.float32)
    fused = dict(model.named_parameters())
    assert fused["model.layers.0.mlp.experts.gate_up_proj"].shape == (4, 64, 64)  # (E, 2I, H)
    sent = dict(split_fused_experts(model.named_parameters()))
    on_disk = load_file(str(moe_checkpoint / "model.safetensors"))
    assert sent.keys() == on_disk.keys()  # lm_head is tied: neither holds it
    assert "model.layers.1.mlp.experts.3.up_proj.weight" in sent
    for name, tensor in on_disk.items():
        assert torch.equal(sent[name], tensor), name


def test_an_engine_with_fused_experts_loads_the_checkpoint_layout(moe_checkpoint, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(moe_checkpoint, dtype=torch.float32)
    other = AutoModelForCausalLM.from_pretrained(
        build_tiny_checkpoint(tmp_path / "other", seed=1, architecture="qwen3_moe"),
        dtype=torch.float32,
    )
    sent = list(split_fused_experts(model.named_parameters()))
    assert load_named_tensors(other, sent, complete=True) == len(sent)
    for name, parameter in other.named_parameters():
        assert torch.equal(parameter, dict(model.named_parameters())[name]), name


def test_a_checkpoint_missing_one_experts_part_is_refused_and_nothing_loads(moe_checkpoint):
    model = AutoModelForCausalLM.from_pretrained(moe_checkpoint, dtype=torch.float32)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    sent = [
        (name, torch.zeros_like(t))
        for name, t in split_fused_experts(model.named_parameters())
        if name != "model.layers.1.mlp.experts.2.down_proj.weight"
    ]
    missing = re.escape("'model.layers.1.mlp.experts.down_proj' is missing")
    with pytest.raises(WeightUpdateError, match=missing):
        load_named_tensors(model, sent, complete=True)
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())
