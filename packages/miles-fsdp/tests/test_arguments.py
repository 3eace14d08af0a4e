"""FSDPArgs: read from YAML then the command line by the run's config loader, typed, and loud
rejection of what FSDP can't do."""

from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path

import pytest

from miles.backends.fsdp_utils.arguments import FSDPArgs, validate_hybrid_shard_args
from miles.backends.training_utils.infra.device import get_device_info
from miles.config import load_config

# The settings every run needs; the FSDP backend is the default one.
REQUIRED = ["--hf-checkpoint", "ckpt", "--prompt-data", "train.jsonl", "--rollout-batch-size", "4"]


def load_fsdp_settings(*flags: str) -> FSDPArgs:
    """The backend group of a run configured by `flags` (after the required settings)."""
    backend = load_config([*REQUIRED, *flags]).backend
    assert isinstance(backend, FSDPArgs), f"the default backend's settings are {type(backend)}"
    return backend


@pytest.fixture
def config(tmp_path, monkeypatch) -> Path:
    monkeypatch.chdir(tmp_path)  # so error messages show the short name "config.yaml"
    return Path("config.yaml")


def test_defaults_are_the_documented_ones():
    args = load_fsdp_settings()
    assert args == FSDPArgs()
    assert (args.lr, args.adam_beta2, args.lr_decay_style, args.param_dtype) == (
        1e-6,
        0.98,
        "constant",
        "auto",
    )
    assert args.update_weight_buffer_size == 512 * 2**20


def test_every_field_has_a_docstring_under_it():
    # Shared fields are declared in core's TrainerArgs, the base class.
    lines = [line for cls in FSDPArgs.__mro__[:-1] for line in inspect.getsource(cls).splitlines()]
    for field in dataclasses.fields(FSDPArgs):
        (i,) = [i for i, line in enumerate(lines) if line.startswith(f"    {field.name}: ")]
        assert lines[i + 1].strip().startswith('"""'), f"{field.name} has no docstring"


def test_yaml_keys_with_dashes_or_underscores_are_read_and_typed(config):
    config.write_text(
        "lr: 1e-5\n"  # PyYAML reads this as a string; it must still become a float
        "lr-decay-style: cosine\n"
        "lr_decay_iters: 100\n"
        "min-lr: 0\n"
        "gradient_checkpointing: true\n"
        "use-dynamic-batch-size: yes\n"
        "max_tokens_per_gpu: 4096\n"
    )
    args = load_fsdp_settings("--config", str(config))
    assert args.lr == 1e-5 and isinstance(args.lr, float)
    assert args.lr_decay_style == "cosine"
    assert args.lr_decay_iters == 100
    assert args.min_lr == 0.0 and isinstance(args.min_lr, float)
    assert args.gradient_checkpointing is True
    assert args.use_dynamic_batch_size is True and args.max_tokens_per_gpu == 4096


def test_command_line_flags_override_the_yaml_file(config):
    config.write_text("lr: 1.0e-5\ngradient_checkpointing: true\nseed: 7\n")
    args = load_fsdp_settings(
        "--config", str(config),
        "--lr", "3e-6", "--no-gradient-checkpointing", "--seed=9", "--fsdp-cpu-offload",
    )  # fmt: skip
    assert args.lr == 3e-6
    assert args.gradient_checkpointing is False
    assert args.seed == 9
    assert args.fsdp_cpu_offload is True


def test_optional_integers_accept_none_from_the_command_line():
    args = load_fsdp_settings(
        "--lr-decay-style", "linear", "--lr-decay-iters", "10", "--lr-decay-iters", "none"
    )
    assert args.lr_decay_iters is None


def test_an_unknown_yaml_key_suggests_the_closest_setting(config):
    config.write_text("lr_decay_stlye: cosine\n")
    with pytest.raises(ValueError) as excinfo:
        load_fsdp_settings("--config", str(config))
    assert str(excinfo.value) == (
        "unknown setting 'lr_decay_stlye' in --config config.yaml; did you mean 'lr_decay_style'?"
    )


def test_an_unknown_flag_suggests_the_closest_flag():
    with pytest.raises(
        ValueError,
        match=r"unknown setting '--lr-decay-stlye' in the command line; did you mean "
        r"'--lr-decay-style'\?",
    ):
        load_fsdp_settings("--lr-decay-stlye", "cosine")
    # The loader lists each switch once, by its positive flag (`--no-...` is its other half).
    with pytest.raises(ValueError, match=r"did you mean '--gradient-checkpointing'\?"):
        load_fsdp_settings("--no-gradient-checkpoint")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--lr", "fast"], r"--lr: expected a number, got 'fast'"),
        (["--seed", "1.5"], r"--seed: expected an integer, got '1.5'"),
        (
            ["--share-prompt-forward=maybe"],
            r"could not parse the command line '.*--share-prompt-forward=maybe'",
        ),
        (["--lr"], r"could not parse the command line '.*--lr'"),
        (["lr", "1"], r"unexpected argument 'lr'"),
        (
            ["--lr-decay-style", "step"],
            r"--lr-decay-style: 'step' is not a valid choice; choose from constant, linear",
        ),
    ],
)
def test_malformed_flags_name_the_flag_and_the_value(argv, message):
    with pytest.raises(ValueError, match=message):
        load_fsdp_settings(*argv)


def test_a_yaml_bool_is_not_accepted_as_a_number(config):
    config.write_text("micro_batch_size: true\n")
    with pytest.raises(
        ValueError, match=r"'micro_batch_size' in --config config.yaml: expected an integer"
    ):
        load_fsdp_settings("--config", str(config))


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (
            {"context_parallel_size": 2},
            r"--context-parallel-size 2: .*not supported yet by the FSDP",
        ),
        ({"lora_rank": -1}, r"--lora-rank must be >= 0 \(0 trains every weight\), got -1"),
        ({"lora_rank": 8, "lora_alpha": 0.0}, r"--lora-alpha must be > 0 .*got 0.0"),
        ({"lora_rank": 8, "lora_dropout": 1.0}, r"--lora-dropout must be in \[0, 1\), got 1.0"),
        ({"lora_rank": 8, "lora_dropout": -0.1}, r"--lora-dropout must be in \[0, 1\), got -0.1"),
        ({"lora_rank": 8, "target_modules": " , "}, r"--target-modules ' , ' names no module"),
        (
            {"lora_rank": 8, "target_modules": "q_proj,v_proj", "exclude_modules": "v_proj"},
            r"--exclude-modules \['v_proj'\] are also in --target-modules",
        ),
        ({"lora_sync": "lazy"}, r"--lora-sync 'lazy' is not a valid choice; use one of merged"),
        ({"lora_alpha": 32.0}, r"--lora-alpha 32.0 has no effect without LoRA"),
        ({"lora_sync": "adapter"}, r"--lora-sync 'adapter' has no effect without LoRA"),
        ({"use_dynamic_batch_size": True}, r"--use-dynamic-batch-size needs --max-tokens-per-gpu"),
        ({"max_tokens_per_gpu": 4096}, r"--max-tokens-per-gpu \(4096\) is only used with"),
        ({"min_lr": 1e-7}, r"--min-lr \(1e-07\) has no effect with --lr-decay-style constant"),
        ({"lr_decay_iters": 10}, r"--lr-decay-iters \(10\) has no effect with --lr-decay-style"),
        (
            {"lr_decay_style": "cosine", "lr_wsd_decay_iters": 5},
            r"only applies to --lr-decay-style wsd",
        ),
        ({"lr_decay_style": "wsd"}, r"--lr-decay-style wsd needs --lr-wsd-decay-iters"),
        (
            {"lr_decay_style": "linear", "lr_warmup_iters": 10, "lr_decay_iters": 10},
            r"--lr-decay-iters \(10\) must exceed --lr-warmup-iters \(10\)",
        ),
        (
            {"min_lr": 1e-3, "lr": 1e-4, "lr_decay_style": "linear"},
            r"--min-lr \(0.001\) must not exceed",
        ),
        ({"adam_beta2": 1.0}, r"--adam-beta2 must be in \[0, 1\), got 1.0"),
        ({"micro_batch_size": 0}, r"--micro-batch-size must be >= 1, got 0"),
        ({"dp_replicate_size": 0}, r"--dp-replicate-size must be >= 1, got 0"),
        ({"param_dtype": "float16"}, r"--param-dtype 'float16' is not a valid choice"),
    ],
)
def test_settings_the_backend_cannot_honour_raise_naming_the_flag(settings, message):
    with pytest.raises(ValueError, match=message):
        FSDPArgs(**settings)


def test_flash_attention_on_cpu_is_rejected(monkeypatch):
    monkeypatch.setenv("MILES_DEVICE", "cpu")
    get_device_info.cache_clear()
    try:
        with pytest.raises(ValueError, match=r"flash_attention_2 needs a CUDA GPU.*runs on cpu"):
            FSDPArgs(attn_implementation="flash_attention_2")
    finally:
        get_device_info.cache_clear()


def test_hybrid_shard_replicas_must_divide_the_world():
    validate_hybrid_shard_args(8, 2)
    validate_hybrid_shard_args(8, 1)
    with pytest.raises(
        ValueError, match=r"--dp-replicate-size \(3\) .* \(8\).*use one of \[1, 2, 4, 8\]"
    ):
        validate_hybrid_shard_args(8, 3)
    with pytest.raises(ValueError, match=r"--dp-replicate-size \(0\)"):
        validate_hybrid_shard_args(8, 0)
