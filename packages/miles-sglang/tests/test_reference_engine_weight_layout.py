"""On the CPU the reference engine stores linear weights column-major (`weight_layout`): the
model computes the same numbers, weight updates land in the new layout, a tied output head keeps
the embedding's rows, and weights resumed from their offload file get the layout back."""

from __future__ import annotations

import copy

import torch
from torch import nn
from transformers import AutoModelForCausalLM

from miles.backends.sglang_utils.reference_engine.model_runner import ModelRunner
from miles.backends.sglang_utils.reference_engine.scheduler import Scheduler
from miles.backends.sglang_utils.reference_engine.weight_layout import transpose_linear_weights
from miles.backends.sglang_utils.reference_engine.weights import WeightManager
from miles.backends.sglang_utils.weight_sync import load_named_tensors

CPU = torch.device("cpu")


def _column_major(weight: torch.Tensor) -> bool:
    return weight.stride() == (1, weight.shape[0])


def _linear_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {
        name: module.weight
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and name != "lm_head"
    }


def test_every_unshared_linear_weight_is_column_major_and_the_model_computes_the_same(
    tiny_checkpoint,
):
    reference = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float64).eval()
    model = copy.deepcopy(reference)
    linears = _linear_weights(model)
    assert transpose_linear_weights(model, CPU) == len(linears) > 0
    assert all(_column_major(w) for w in linears.values())
    # The tiny checkpoint ties its output head to the embedding, which reads rows.
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.lm_head.weight.is_contiguous()
    for name, weight in reference.named_parameters():
        assert torch.equal(model.get_parameter(name), weight), name
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, reference(ids).logits, rtol=1e-12, atol=1e-12)
    assert transpose_linear_weights(model, CPU) == 0  # already laid out
    assert transpose_linear_weights(copy.deepcopy(reference), torch.device("meta")) == 0


def test_updates_land_in_the_layout_and_a_resume_lays_the_weights_out_again(tiny_checkpoint):
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32)
    runner = ModelRunner(model, CPU)
    scheduler = Scheduler(
        runner, eos_token_ids=set(), context_length=64, max_running_requests=4, seed=0
    )
    try:
        manager = WeightManager(scheduler, runner.model, CPU)
        name = "model.layers.0.mlp.gate_proj.weight"
        target = runner.model.get_parameter(name)
        assert _column_major(target)
        sent = torch.randn(target.shape)
        load_named_tensors(runner.model, [(name, sent)])
        assert torch.equal(target, sent) and _column_major(target)

        before = {n: w.detach().clone() for n, w in _linear_weights(runner.model).items()}
        manager.release(["weights"])
        manager.resume(["weights"])
        after = _linear_weights(runner.model)
        assert all(_column_major(w) for w in after.values())
        for n, weight in after.items():
            assert torch.equal(weight, before[n]), n
    finally:
        scheduler.shutdown()
