"""The Megatron GPTModel built from a tiny HF checkpoint computes what the HF model computes.

Two real gloo ranks run Megatron with tensor parallelism 2 (through the CPU shim of cpu_shim.py)
and are compared with the HF model in float32 on one process: the logits of a batch, and the
gradient norm of one step on the mean token NLL, which is what the FSDP backend computes (its own
equivalence to the plain HF model is tested in miles-fsdp). The `cuda` tests repeat the
comparison on two GPUs over NCCL, without the shim.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
import transformers
from transformers import AutoModelForCausalLM

from miles.backends.megatron_utils.arguments import MegatronArgs
from miles.backends.megatron_utils.model_provider import (
    build_gpt_model,
    load_hf_weights,
    require_gpu,
    transformer_config_from_hf,
)
from miles.backends.training_utils.infra.device import get_device_info
from tests.support.distributed import free_port

from .cpu_shim import install_megatron_cpu_shim, megatron_on_cpu, run_distributed
from .gpu_world import join_nccl_world

TP = 2
BATCH, SEQ = 2, 12
VOCAB = 259
# A non-default divisor, so the vocabulary padding (259 -> 272 rows) is exercised.
MEGATRON_ARGS = {
    "tensor_model_parallel_size": TP,
    "params_dtype": "float32",
    "make_vocab_size_divisible_by": 8,
    "seed": 0,
}
_SIZES = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "head_dim": 16,
    "max_position_embeddings": 16384,
    "rms_norm_eps": 1e-6,
}


def _configs() -> dict[str, transformers.PretrainedConfig]:
    """One tiny config per architecture feature the provider maps."""
    return {
        # Grouped-query attention (2 heads per group), per-head q/k norms, tied embeddings.
        "qwen3": transformers.Qwen3Config(
            **_SIZES, num_key_value_heads=2, tie_word_embeddings=True, rope_theta=1e6
        ),
        # q/k/v biases, untied output layer.
        "qwen2": transformers.Qwen2Config(
            **_SIZES, num_key_value_heads=2, tie_word_embeddings=False, rope_theta=1e6
        ),
        # Multi-head attention (one head per group) and Llama 3 RoPE scaling.
        "llama": transformers.LlamaConfig(
            **_SIZES,
            num_key_value_heads=4,
            tie_word_embeddings=False,
            rope_theta=5e5,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
        ),
    }


ARCHITECTURES = ("qwen3", "qwen2", "llama")


def _hf_model(config: transformers.PretrainedConfig) -> torch.nn.Module:
    """Seeded HF model; norms and biases randomised too (HF initialises them to ones and zeros,
    which would hide a swapped norm or a misplaced bias)."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.ndim == 1:
                base = 1.0 if "norm" in name else 0.0
                param.copy_(base + 0.2 * torch.randn_like(param))
    return model


def _mean_token_nll(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy averaged over every predicted token of the batch."""
    return F.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]), input_ids[:, 1:].reshape(-1)
    )


def _hf_reference(config, input_ids) -> dict:
    model = _hf_model(config)
    logits = model(input_ids=input_ids).logits  # (B, T, V)
    _mean_token_nll(logits, input_ids).backward()
    grad_norm = math.sqrt(sum(p.grad.double().square().sum().item() for p in model.parameters()))
    return {
        "state": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "logits": logits.detach(),
        "grad_norm": grad_norm,
        "inv_freq": model.model.rotary_emb.inv_freq.clone(),
    }


@pytest.fixture(scope="module")
def batch() -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def references(batch) -> dict[str, dict]:
    return {arch: _hf_reference(config, batch) for arch, config in _configs().items()}


def _payload(references, batch) -> list[tuple]:
    return [(arch, config, references[arch]["state"], batch) for arch, config in _configs().items()]


# -- the Megatron side, on every rank ------------------------------------------------------------


def _megatron_worker(rank: int, payload: list[tuple], nccl_init_method: str | None) -> dict:
    """Build, load, forward and backward every architecture with tp=2; logits and grad norm of
    each."""
    from miles.backends.megatron_utils.parallel import (
        destroy_megatron_parallel,
        initialize_megatron_parallel,
    )

    if nccl_init_method is None:
        install_megatron_cpu_shim()
        device = torch.device("cpu")
    else:
        device = join_nccl_world(rank, nccl_init_method)
    state = initialize_megatron_parallel(MegatronArgs(**MEGATRON_ARGS))
    results = {"tp": (state.tp.rank, state.tp.size), "dp": (state.dp.rank, state.dp.size)}
    args = MegatronArgs(**MEGATRON_ARGS)
    for arch, hf_config, hf_state, input_ids in payload:
        model = build_gpt_model(hf_config, args).to(device)
        load_hf_weights(model, hf_state, hf_config, args)
        results[arch] = _forward_backward(model, input_ids.to(device), hf_config.vocab_size)
    destroy_megatron_parallel()
    return results


def _forward_backward(model, input_ids: torch.Tensor, vocab_size: int) -> dict:
    from megatron.core import parallel_state as mpu
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    batch, seq = input_ids.shape
    position_ids = torch.arange(seq, device=input_ids.device).expand(batch, seq)
    # Causal attention needs no mask: the local spec builds the causal one itself.
    vocab_parallel = model(input_ids, position_ids, attention_mask=None)  # (B, T, V_pad / tp)
    # All-gather the vocabulary slices (backward: each rank keeps its slice's gradient) and drop
    # the padding rows, whose zero logits would otherwise enter the softmax.
    logits = gather_from_tensor_model_parallel_region(vocab_parallel)[..., :vocab_size]
    _mean_token_nll(logits, input_ids).backward()
    return {
        "logits": logits.detach().cpu(),
        "grad_norm": _tp_grad_norm(model, mpu.get_tensor_model_parallel_group()),
        "inv_freq": model.rotary_pos_emb.inv_freq.detach().cpu(),
    }


def _tp_grad_norm(model: torch.nn.Module, tp_group) -> float:
    """Global gradient norm of a tensor-parallel model: split parameters' squares are summed over
    the tp ranks, replicated ones counted once. The q/k norms are replicated but each rank
    applies them to its own heads only, so their gradients are first summed over tp, as
    Megatron's finalize_model_grads does in training."""
    split = torch.zeros((), dtype=torch.float64, device=next(model.parameters()).device)
    replicated = torch.zeros_like(split)
    for name, param in model.named_parameters():
        grad = param.grad.double()
        if "q_layernorm" in name or "k_layernorm" in name:
            dist.all_reduce(grad, group=tp_group)
        squares = grad.square().sum()
        if getattr(param, "tensor_model_parallel", False):
            split += squares
        else:
            replicated += squares
    dist.all_reduce(split, group=tp_group)
    return math.sqrt((split + replicated).item())


@pytest.fixture(scope="module")
def megatron_results(references, batch) -> list[dict]:
    return run_distributed(_megatron_worker, TP, _payload(references, batch), None, timeout_s=240)


# -- comparisons -----------------------------------------------------------------------------


def _assert_logits_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    scale = expected.abs().max().item()
    torch.testing.assert_close(actual, expected, rtol=0, atol=1e-5 * max(scale, 1.0))


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_megatron_tp2_logits_match_the_hf_model(arch, megatron_results, references):
    expected = references[arch]["logits"]
    for rank_results in megatron_results:
        _assert_logits_close(rank_results[arch]["logits"], expected)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_megatron_tp2_grad_norm_of_one_step_matches_the_hf_model(
    arch, megatron_results, references
):
    expected = references[arch]["grad_norm"]
    for rank_results in megatron_results:
        # Both sides are float32 on the same device kind: they agree far inside the 3 % that
        # the bf16 FSDP comparison allows, so a layout error cannot hide in the margin.
        assert rank_results[arch]["grad_norm"] == pytest.approx(expected, rel=1e-6)


def test_rope_frequencies_match_hf_including_llama3_scaling(megatron_results, references):
    for arch in ARCHITECTURES:
        torch.testing.assert_close(
            megatron_results[0][arch]["inv_freq"], references[arch]["inv_freq"], rtol=1e-6, atol=0
        )


def test_parallel_state_has_tp_2_and_no_data_parallelism(megatron_results):
    assert [r["tp"] for r in megatron_results] == [(0, 2), (1, 2)]
    assert [r["dp"] for r in megatron_results] == [(0, 1), (0, 1)]


# -- configuration -----------------------------------------------------------------------------


def test_transformer_config_maps_biases_and_qk_norms_per_architecture():
    args = MegatronArgs(**MEGATRON_ARGS)
    mapped = {arch: transformer_config_from_hf(config, args) for arch, config in _configs().items()}
    assert {a: (c.add_qkv_bias, c.qk_layernorm) for a, c in mapped.items()} == {
        "qwen3": (False, True),
        "qwen2": (True, False),
        "llama": (False, False),
    }
    qwen3 = mapped["qwen3"]
    assert (qwen3.num_query_groups, qwen3.kv_channels, qwen3.ffn_hidden_size) == (2, 16, 128)
    assert (qwen3.normalization, qwen3.layernorm_epsilon, qwen3.gated_linear_unit) == (
        "RMSNorm",
        1e-6,
        True,
    )
    assert qwen3.activation_func is F.silu and not qwen3.add_bias_linear
    assert (qwen3.tensor_model_parallel_size, qwen3.params_dtype, qwen3.bf16) == (
        2,
        torch.float32,
        False,
    )
    bf16 = transformer_config_from_hf(_configs()["qwen3"], MegatronArgs(params_dtype="bfloat16"))
    assert (bf16.params_dtype, bf16.bf16) == (torch.bfloat16, True)


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (transformers.GPT2Config(), "model_type 'gpt2'"),
        (transformers.Qwen3Config(hidden_act="gelu"), "hidden_act='gelu'"),
        (
            transformers.LlamaConfig(rope_scaling={"rope_type": "yarn", "factor": 4.0}),
            "RoPE scaling",
        ),
        (
            transformers.LlamaConfig(
                rope_scaling={
                    "rope_type": "llama3",
                    "factor": 8.0,
                    "low_freq_factor": 2.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 8192,
                },
                max_position_embeddings=16384,
            ),
            "RoPE scaling",
        ),
    ],
    ids=["gpt2", "gelu", "yarn-rope", "llama3-rope-other-factors"],
)
def test_a_model_megatron_cannot_reproduce_is_refused(config, message):
    with pytest.raises(ValueError, match=message):
        transformer_config_from_hf(config, MegatronArgs())


def test_sequence_parallel_is_refused_with_the_local_layer_spec():
    args = MegatronArgs(tensor_model_parallel_size=2, sequence_parallel=True)
    with pytest.raises(ValueError, match="--sequence-parallel needs Transformer Engine"):
        transformer_config_from_hf(_configs()["qwen3"], args)


def test_require_gpu_refuses_a_cpu_machine_in_one_line(monkeypatch):
    monkeypatch.setenv("MILES_DEVICE", "cpu")
    get_device_info.cache_clear()
    try:
        with pytest.raises(RuntimeError) as raised:
            require_gpu()
        assert str(raised.value) == (
            "the megatron backend needs NVIDIA or AMD GPUs (found: cpu); "
            "use --train-backend fsdp on this machine"
        )
        monkeypatch.setenv("MILES_DEVICE", "rocm")
        get_device_info.cache_clear()
        require_gpu()  # AMD GPUs are accepted like NVIDIA ones
    finally:
        get_device_info.cache_clear()


def test_require_gpu_refuses_this_cpu_only_machine(monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    monkeypatch.delenv("MILES_DEVICE", raising=False)  # detect, do not force
    get_device_info.cache_clear()
    try:
        with pytest.raises(RuntimeError, match=r"\(found: cpu\); use --train-backend fsdp"):
            require_gpu()
    finally:
        get_device_info.cache_clear()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the shim patches nothing where CUDA is")
def test_cpu_shim_patches_megatron_only_inside_its_block():
    import megatron.core.fusions.fused_softmax as fused_softmax
    import megatron.core.models.common.embeddings.rope_utils as rope_utils
    import megatron.core.tensor_parallel.random as tp_random

    def patched():
        return (torch.cuda.current_device, fused_softmax.get_default_causal_mask,
                rope_utils.torch, torch.Tensor.cuda)  # fmt: skip

    before = patched()
    with megatron_on_cpu():
        assert torch.cuda.current_device() == torch.device("cpu")
        assert fused_softmax.get_default_causal_mask(3).tolist() == [
            [False, True, True],
            [False, False, True],
            [False, False, False],
        ]
        with tp_random.get_cuda_rng_tracker().fork():  # no CUDA generator is touched
            pass
        index = rope_utils.torch.tensor([0, 3], device="cpu", pin_memory=True).cuda()
        assert index.device == torch.device("cpu")
    assert patched() == before


# -- the same comparisons on two GPUs ------------------------------------------------------------

needs_two_gpus = pytest.mark.skipif(
    torch.cuda.device_count() < TP, reason=f"needs {TP} CUDA devices"
)


@pytest.fixture(scope="module")
def megatron_gpu_results(references, batch) -> list[dict]:
    init_method = f"tcp://127.0.0.1:{free_port()}"
    return run_distributed(
        _megatron_worker, TP, _payload(references, batch), init_method, timeout_s=300
    )


@pytest.mark.cuda
@needs_two_gpus
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_megatron_tp2_on_gpus_matches_the_hf_model(arch, megatron_gpu_results, references):
    expected = references[arch]
    for rank_results in megatron_gpu_results:
        # GPU kernels sum in other orders than the CPU reference: a looser logit tolerance, and
        # the 3 % grad-norm margin of the FSDP comparison.
        scale = expected["logits"].abs().max().item()
        torch.testing.assert_close(
            rank_results[arch]["logits"], expected["logits"], rtol=0, atol=1e-4 * max(scale, 1.0)
        )
        assert rank_results[arch]["grad_norm"] == pytest.approx(expected["grad_norm"], rel=0.03)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_require_gpu_accepts_a_cuda_machine(monkeypatch):
    monkeypatch.delenv("MILES_DEVICE", raising=False)
    get_device_info.cache_clear()
    try:
        require_gpu()
    finally:
        get_device_info.cache_clear()
