"""MegatronArgs validation and the checks against a model's HF config: every rule raises with a
message naming the flag and the values involved."""

from __future__ import annotations

import dataclasses
import re

import pytest
import transformers
from hypothesis import given
from hypothesis import strategies as st

from miles.backends.megatron_utils.arguments import (
    SUPPORTED_MODEL_TYPES,
    MegatronArgs,
    padded_vocab_size,
    validate_against_hf,
)


def _qwen3(**overrides) -> transformers.Qwen3Config:
    settings = dict(
        vocab_size=259,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=8,
    )
    return transformers.Qwen3Config(**{**settings, **overrides})


def _raises(match: str, **kwargs) -> None:
    with pytest.raises(ValueError, match=match):
        MegatronArgs(**kwargs)


def test_defaults_are_valid_and_match_the_fsdp_backend_where_names_are_shared():
    args = MegatronArgs()
    assert args.tensor_model_parallel_size == args.pipeline_model_parallel_size == 1
    assert args.use_distributed_optimizer and args.params_dtype == "bfloat16"
    assert (args.lr, args.adam_beta2, args.clip_grad, args.seed) == (1e-6, 0.98, 1.0, 1234)
    assert args.model_parallel_size == 1


def test_every_field_is_documented_and_merges_with_the_core_settings():
    from miles.config.options import field_docs
    from miles.config.registry import CORE_GROUPS, Schema

    docs = field_docs(MegatronArgs)
    undocumented = [f.name for f in dataclasses.fields(MegatronArgs) if not docs.get(f.name)]
    assert not undocumented
    # A name shared with a core group (seed) must have the same type and default, or the
    # merged schema of `miles train --train-backend megatron` refuses to build.
    schema = Schema({**CORE_GROUPS, "backend": MegatronArgs})
    assert schema.options["tensor_model_parallel_size"].flag == "--tensor-model-parallel-size"


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"params_dtype": "float16"}, r"--params-dtype 'float16' is not a valid choice; use one"),
        ({"lr_decay_style": "step"}, r"--lr-decay-style 'step' is not a valid choice"),
        ({"tensor_model_parallel_size": 0}, r"--tensor-model-parallel-size must be >= 1, got 0"),
        ({"pipeline_model_parallel_size": 0}, r"--pipeline-model-parallel-size must be >= 1"),
        ({"context_parallel_size": 0}, r"--context-parallel-size must be >= 1, got 0"),
        ({"expert_model_parallel_size": 0}, r"--expert-model-parallel-size must be >= 1"),
        ({"make_vocab_size_divisible_by": 0}, r"--make-vocab-size-divisible-by must be >= 1"),
        ({"micro_batch_size": 0}, r"--micro-batch-size must be >= 1, got 0"),
        ({"lr": -1.0}, r"--lr must be >= 0.0, got -1.0"),
        ({"clip_grad": -0.5}, r"--clip-grad must be >= 0.0, got -0.5"),
        ({"update_weight_buffer_size": 0}, r"--update-weight-buffer-size must be >= 1"),
        ({"adam_beta1": 1.0}, r"--adam-beta1 must be in \[0, 1\), got 1.0"),
        ({"adam_eps": 0.0}, r"--adam-eps must be > 0, got 0.0"),
        (
            {"lr": 1e-6, "min_lr": 1e-5, "lr_decay_style": "cosine"},
            r"--min-lr \(1e-05\) must not exceed --lr \(1e-06\)",
        ),
    ],
)
def test_out_of_range_or_unknown_values_name_the_flag_and_value(kwargs, match):
    _raises(match, **kwargs)


def test_sequence_parallel_without_tensor_parallelism_is_an_error_not_a_no_op():
    _raises(r"--sequence-parallel .* --tensor-model-parallel-size is 1", sequence_parallel=True)
    assert MegatronArgs(sequence_parallel=True, tensor_model_parallel_size=2).sequence_parallel


def test_context_parallel_ranks_count_towards_one_model_replica():
    args = MegatronArgs(context_parallel_size=2, tensor_model_parallel_size=2)
    assert args.model_parallel_size == 4


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"min_lr": 1e-7}, r"--min-lr \(1e-07\) has no effect with --lr-decay-style constant"),
        ({"lr_decay_iters": 10}, r"--lr-decay-iters \(10\) has no effect with --lr-decay-style"),
        (
            {"lr_decay_style": "cosine", "lr_wsd_decay_iters": 5},
            r"--lr-wsd-decay-iters \(5\) only applies to --lr-decay-style wsd, not cosine",
        ),
        ({"lr_decay_style": "wsd"}, r"--lr-decay-style wsd needs --lr-wsd-decay-iters"),
        (
            {"lr_decay_style": "wsd", "lr_wsd_decay_iters": 0},
            r"--lr-wsd-decay-iters must be >= 1, got 0",
        ),
        (
            {"lr_decay_style": "linear", "lr_warmup_iters": 10, "lr_decay_iters": 10},
            r"--lr-decay-iters \(10\) must exceed --lr-warmup-iters \(10\)",
        ),
        ({"use_dynamic_batch_size": True}, r"--use-dynamic-batch-size needs --max-tokens-per-gpu"),
        (
            {"max_tokens_per_gpu": 4096},
            r"--max-tokens-per-gpu \(4096\) is only used with --use-dynamic-batch-size",
        ),
        (
            {"use_dynamic_batch_size": True, "max_tokens_per_gpu": 0},
            r"--max-tokens-per-gpu must be >= 1, got 0",
        ),
    ],
)
def test_schedule_and_batching_flags_without_effect_or_incomplete_are_errors(kwargs, match):
    _raises(match, **kwargs)


def test_a_consistent_parallel_layout_passes_validation():
    args = MegatronArgs(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    validate_against_hf(args, _qwen3(), world_size=8)  # data parallel 2
    for model_type in SUPPORTED_MODEL_TYPES:
        config = transformers.AutoConfig.for_model(
            model_type, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64
        )
        validate_against_hf(MegatronArgs(tensor_model_parallel_size=2), config, world_size=2)


@pytest.mark.parametrize(
    ("args", "config", "world_size", "match"),
    [
        (
            {"tensor_model_parallel_size": 3},
            {},
            3,
            r"--tensor-model-parallel-size \(3\) must divide the model's num_attention_heads "
            r"\(8\); use one of \[1, 2\]",
        ),
        (
            {"tensor_model_parallel_size": 4},
            {},
            4,
            r"--tensor-model-parallel-size \(4\) must divide the model's num_key_value_heads "
            r"\(2\); use one of \[1, 2\]",
        ),
        (
            {"tensor_model_parallel_size": 2},
            {"intermediate_size": 99},
            2,
            r"--tensor-model-parallel-size \(2\) must divide the model's intermediate_size \(99\)",
        ),
        (
            {"pipeline_model_parallel_size": 3},
            {},
            3,
            r"--pipeline-model-parallel-size \(3\) must divide the model's num_hidden_layers "
            r"\(4\).*\[1, 2, 4\]",
        ),
        (
            {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2},
            {},
            6,
            r"the 6 training ranks must be a multiple of --tensor-model-parallel-size x "
            r"--pipeline-model-parallel-size x --context-parallel-size \(2 x 2 x 1 = 4\)",
        ),
        (
            {"expert_model_parallel_size": 2},
            {},
            2,
            r"--expert-model-parallel-size 2 has no effect: qwen3 is a dense model",
        ),
        ({}, {"use_sliding_window": True}, 1, r"use_sliding_window=True"),
        ({}, {"attention_bias": True}, 1, r"qwen3 config sets attention_bias=True"),
        ({}, {}, 0, r"the training world size must be >= 1, got 0"),
    ],
)
def test_settings_the_model_cannot_take_name_both_values(args, config, world_size, match):
    with pytest.raises(ValueError, match=match):
        validate_against_hf(MegatronArgs(**args), _qwen3(**config), world_size)


def test_unsupported_architectures_are_named_with_the_supported_list():
    config = transformers.MistralConfig(num_attention_heads=4, num_key_value_heads=2)
    with pytest.raises(ValueError, match=r"model_type 'mistral'; supported: qwen2, qwen3, llama"):
        validate_against_hf(MegatronArgs(), config, world_size=1)


@pytest.mark.parametrize(
    ("config", "family"),
    [
        (transformers.Qwen3MoeConfig(num_experts=8), "Mixture-of-Experts models (qwen3_moe, 8"),
        (transformers.Qwen3_5MoeConfig(), "Gated DeltaNet hybrids (qwen3_5_moe)"),
        (transformers.Qwen3_5Config(), "Gated DeltaNet hybrids (qwen3_5)"),
        (transformers.Qwen3_5TextConfig(), "Gated DeltaNet hybrids (qwen3_5_text)"),
        (transformers.Qwen3NextConfig(), "Gated DeltaNet hybrids (qwen3_next)"),
        (transformers.MixtralConfig(), "Mixture-of-Experts models (mixtral, 8"),
    ],
)
def test_moe_and_gdn_families_are_refused_in_one_line_naming_the_fsdp_backend(config, family):
    with pytest.raises(ValueError, match=re.escape(family)) as refused:
        validate_against_hf(MegatronArgs(), config, world_size=1)
    message = str(refused.value)
    assert "\n" not in message and message.endswith("use --train-backend fsdp"), message


def test_llama_mlp_bias_is_rejected_but_qwen2_qkv_bias_is_native():
    llama = transformers.LlamaConfig(num_attention_heads=4, num_key_value_heads=2, mlp_bias=True)
    with pytest.raises(ValueError, match=re.escape("llama config sets mlp_bias=True")):
        validate_against_hf(MegatronArgs(), llama, world_size=1)
    qwen2 = transformers.Qwen2Config(num_attention_heads=4, num_key_value_heads=2)
    validate_against_hf(MegatronArgs(), qwen2, world_size=1)


def test_padded_vocab_follows_megatrons_rule():
    assert padded_vocab_size(259, 128, 1) == 384
    assert padded_vocab_size(259, 128, 2) == 512
    assert padded_vocab_size(256, 128, 2) == 256
    assert padded_vocab_size(151936, 128, 8) == 152576
    with pytest.raises(ValueError, match="positive sizes"):
        padded_vocab_size(0, 128, 1)


@given(vocab=st.integers(1, 300_000), divisible_by=st.integers(1, 256), tp=st.integers(1, 16))
def test_padded_vocab_is_the_smallest_aligned_size_that_fits(vocab, divisible_by, tp):
    padded = padded_vocab_size(vocab, divisible_by, tp)
    multiple = divisible_by * tp
    assert padded % multiple == 0
    assert vocab <= padded < vocab + multiple


def test_lora_is_refused_naming_the_fsdp_backend():
    with pytest.raises(ValueError, match=r"^--lora-rank 8: .*use --train-backend fsdp$"):
        MegatronArgs(lora_rank=8)


def test_a_vision_language_model_is_refused_naming_the_fsdp_backend(tmp_path):
    from transformers import AutoConfig

    from miles.backends.sglang_utils.tiny_checkpoint import build_tiny_checkpoint

    config = AutoConfig.from_pretrained(build_tiny_checkpoint(tmp_path, architecture="qwen2_5_vl"))
    with pytest.raises(
        ValueError, match=r"vision-language models \(qwen2_5_vl\); use --train-backend fsdp"
    ):
        validate_against_hf(MegatronArgs(), config, world_size=1)
