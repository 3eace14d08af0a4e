"""Every rollout engine registered under `miles.rollout_engines` implements the engine-launcher
contract (`engine_launcher.EngineLauncher`) over one `EngineLaunchSpec`, both built-in engines
start with the spec's LoRA flags, and the reference engine's server with its CPU threads."""

import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest

from miles.backends.sglang_utils.engine_launcher import EngineLauncher, EngineLaunchSpec
from miles.backends.sglang_utils.engine_launchers import (
    ReferenceEngineLauncher,
    SGLangEngineLauncher,
)
from miles.backends.sglang_utils.reference_engine.cli import build_parser, engine_options
from miles.backends.sglang_utils.reference_engine.config import ReferenceEngineConfig
from miles.backends.sglang_utils.server_process import ServerProcess
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


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="reads /proc/<pid>/environ")
def test_a_reference_engine_with_cpu_threads_runs_its_server_with_that_many(monkeypatch):
    # A stand-in server (a sleeping Python) started the launcher's way: a real engine would only
    # add its model's load to what this checks, the environment the launcher gives the process.
    monkeypatch.setattr(ServerProcess, "wait_until_ready", lambda *args, **kwargs: None)
    launcher = ReferenceEngineLauncher(EngineLaunchSpec(model_path="/ckpt", cpu_threads=2))
    monkeypatch.setattr(
        launcher, "command", lambda: [sys.executable, "-c", "import time; time.sleep(60)"]
    )
    launcher.start()
    try:
        environ = Path(f"/proc/{launcher.pid}/environ").read_bytes().split(b"\0")
    finally:
        launcher.shutdown()
    assert b"OMP_NUM_THREADS=2" in environ and b"MKL_NUM_THREADS=2" in environ


def test_cpu_threads_below_one_are_refused_where_the_spec_is_built():
    with pytest.raises(ValueError, match="cpu_threads must be >= 1 \\(None: inherit\\), got 0"):
        EngineLaunchSpec(model_path="/ckpt", cpu_threads=0)
    assert EngineLaunchSpec(model_path="/ckpt").thread_env() == {}
