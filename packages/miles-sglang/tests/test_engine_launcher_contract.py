"""Every rollout engine registered under `miles.rollout_engines` implements the engine-launcher
contract (`engine_launcher.EngineLauncher`) over one `EngineLaunchSpec`, and both built-in engines
start with the spec's LoRA flags."""

from importlib.metadata import entry_points

import pytest

from miles.backends.sglang_utils.engine_launcher import EngineLauncher, EngineLaunchSpec
from miles.backends.sglang_utils.engine_launchers import (
    ReferenceEngineLauncher,
    SGLangEngineLauncher,
)
from miles.backends.sglang_utils.reference_engine.cli import build_parser, engine_options
from miles.backends.sglang_utils.reference_engine.config import ReferenceEngineConfig
from miles.backends.sglang_utils.sglang_engine import build_launch_command

REGISTERED = sorted(entry_points(group="miles.rollout_engines"), key=lambda ep: ep.name)


def test_the_built_in_engines_are_registered():
    assert {ep.name for ep in REGISTERED} >= {"reference", "sglang"}


@pytest.mark.parametrize("entry_point", REGISTERED, ids=lambda ep: ep.name)
def test_a_registered_launcher_is_an_engine_launcher_with_its_url_before_start(entry_point):
    launcher = entry_point.load()(EngineLaunchSpec(model_path="unused", port=30111))
    assert isinstance(launcher, EngineLauncher)
    assert launcher.url == "http://127.0.0.1:30111" and launcher.pid is None
    launcher.shutdown()  # never started: stopping is a no-op, not an error


LORA_SPEC = {"enable_lora": True, "max_lora_rank": 8, "lora_target_modules": ["q_proj", "v_proj"]}
LORA_FLAGS = ["--enable-lora", "--max-lora-rank", "8", "--lora-target-modules", "q_proj", "v_proj"]


def test_a_lora_spec_starts_the_reference_engine_serving_lora_with_those_limits():
    launcher = ReferenceEngineLauncher(
        EngineLaunchSpec(model_path="/ckpt", port=30111, **LORA_SPEC)
    )
    command = launcher.command()
    assert " ".join(LORA_FLAGS) in " ".join(command)
    arguments = command[command.index("--model-path") :]  # after `python -m <cli module>`
    config = ReferenceEngineConfig(**engine_options(build_parser().parse_args(arguments)))
    assert config.lora.enabled and config.lora.max_rank == 8
    assert config.lora.target_modules == {"q_proj", "v_proj"}


def test_a_lora_spec_starts_sglang_with_its_lora_flags():
    launcher = SGLangEngineLauncher(EngineLaunchSpec(model_path="/ckpt", port=30111, **LORA_SPEC))
    command = build_launch_command(launcher.engine.config, python="py")
    assert " ".join(LORA_FLAGS) in " ".join(command)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"enable_lora": True, "max_lora_rank": 8}, "enable_lora needs lora_target_modules"),
        ({"enable_lora": True, "lora_target_modules": ["all"]}, "enable_lora needs max_lora_rank"),
        ({**LORA_SPEC, "max_lora_rank": 0}, "max_lora_rank must be >= 1, got 0"),
        ({"max_lora_rank": 8}, "max_lora_rank need enable_lora=True"),
    ],
)
def test_a_lora_spec_is_checked_where_it_is_built(fields, message):
    with pytest.raises(ValueError) as refusal:
        EngineLaunchSpec(model_path="/ckpt", **fields)
    assert message in str(refusal.value)
