"""The run configuration: precedence, suggestions, derived values and every cross-group rule."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from miles.config import Schema, build_parser, load_config
from miles.config.docs import BEGIN, END, render_reference, splice

BASE = ["--hf-checkpoint", "ckpt", "--prompt-data", "train.jsonl", "--rollout-batch-size", "4"]


def load(*flags: str, base: list[str] = BASE):
    return load_config([*base, *flags])


def write_yaml(tmp_path: Path, content: dict) -> str:
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(content))
    return str(path)


def test_defaults_derive_one_step_per_rollout():
    config = load("--n-samples-per-prompt", "8")
    assert config.training.global_batch_size == 32
    assert config.training.num_steps_per_rollout == 1
    assert config.rollout.n_samples_per_prompt == 8


def test_global_batch_size_derives_steps_and_steps_derive_global_batch_size():
    assert load("--n-samples-per-prompt", "4", "--global-batch-size", "8").training.num_steps_per_rollout == 2  # fmt: skip
    assert load("--n-samples-per-prompt", "4", "--num-steps-per-rollout", "4").training.global_batch_size == 4  # fmt: skip


@settings(max_examples=40, deadline=None)
@given(
    rbs=st.integers(1, 16),
    n=st.integers(1, 8),
    steps=st.integers(1, 8),
)
def test_batch_identity_holds_or_the_error_names_the_flags(rbs, n, steps):
    flags = ["--rollout-batch-size", str(rbs), "--n-samples-per-prompt", str(n)]
    flags += ["--num-steps-per-rollout", str(steps), "--actor-num-gpus-per-node", "1"]
    base = ["--hf-checkpoint", "c", "--prompt-data", "d.jsonl"]
    if (rbs * n) % steps:
        with pytest.raises(ValueError, match="--num-steps-per-rollout"):
            load(*flags, base=base)
        return
    training = load(*flags, base=base).training
    assert training.global_batch_size * training.num_steps_per_rollout == rbs * n


def test_inconsistent_batch_pair_is_an_error():
    with pytest.raises(ValueError, match="give only one of the two"):
        load("--n-samples-per-prompt", "4", "--global-batch-size", "8", "--num-steps-per-rollout", "3")  # fmt: skip


def test_yaml_then_flags_precedence(tmp_path):
    path = write_yaml(
        tmp_path,
        {"rollout": {"rollout_temperature": 0.7, "n-samples-per-prompt": 2}, "eps_clip": 0.3},
    )
    config = load("--config", path, "--rollout-temperature", "0.9")
    assert config.rollout.rollout_temperature == 0.9  # flag beats file
    assert config.rollout.n_samples_per_prompt == 2  # file beats default
    assert config.algorithm.eps_clip == 0.3
    assert config.rollout.rollout_top_p == 1.0  # default


def test_yaml_can_hold_every_required_setting(tmp_path):
    path = write_yaml(
        tmp_path,
        {"hf_checkpoint": "c", "prompt_data": "d.jsonl", "rollout_batch_size": 2},
    )
    assert load_config(["--config", path]).rollout.rollout_batch_size == 2


def test_unknown_flag_suggests_the_closest():
    with pytest.raises(ValueError, match="did you mean '--rollout-batch-size'"):
        load("--rollout-batchsize", "3")


def test_unknown_yaml_key_suggests_the_closest(tmp_path):
    path = write_yaml(tmp_path, {"rollout": {"n_sample_per_prompt": 4}})
    with pytest.raises(ValueError, match="did you mean 'n_samples_per_prompt'"):
        load("--config", path)


def test_bad_value_names_the_flag_and_the_expected_type():
    with pytest.raises(ValueError, match="--rollout-batch-size: expected an integer, got 'four'"):
        load_config(["--hf-checkpoint", "c", "--prompt-data", "d", "--rollout-batch-size", "four"])


def test_bad_choice_lists_the_choices():
    with pytest.raises(ValueError, match="choose from auto, sglang, reference"):
        load("--rollout-engine", "vllm")


def test_missing_required_settings_are_listed():
    with pytest.raises(ValueError, match="missing required") as error:
        load_config(["--rollout-batch-size", "2"])
    assert "--hf-checkpoint" in str(error.value) and "--prompt-data" in str(error.value)


def test_bool_and_list_flags():
    config = load("--colocate", "--no-rollout-shuffle", "--rollout-stop", "</s>", "\n\n")
    assert config.cluster.colocate is True
    assert config.data.rollout_shuffle is False
    assert config.rollout.rollout_stop == ["</s>", "\n\n"]


def test_backend_settings_come_from_the_backend_wheel():
    config = load("--lr", "3e-5", "--gradient-checkpointing")
    assert type(config.backend).__name__ == "FSDPArgs"
    assert config.backend.lr == 3e-5


def test_the_train_ranks_get_a_typed_run_spec():
    from miles.train_backend.run_spec import TrainRunSpec

    config = load("--num-steps-per-rollout", "2")
    spec = TrainRunSpec.from_config(config, num_rollout=3)
    assert spec.hf_checkpoint == "ckpt" and spec.global_batch_size == 2
    assert spec.total_optimizer_steps == 6
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.colocate = True  # type: ignore[misc]


def _run_fresh_python(*lines: str) -> None:
    """Run `lines` in a new interpreter (this one has imported everything); they must succeed."""
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-c", "\n".join(lines)], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr[-2000:]


def test_reading_the_config_and_train_help_import_neither_ray_nor_a_backends_actor():
    _run_fresh_python(
        "import contextlib, io, sys",
        "from miles.config import load_config",
        "load_config(['--hf-checkpoint', 'c', '--prompt-data', 'd.jsonl',",
        "             '--rollout-batch-size', '2'])",
        "from miles.cli.main import main",
        "with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):",
        "    main(['train', '--help'])",
        "heavy = ('miles.train_backend.train_actor', 'miles.backends.fsdp_utils.actor',",
        "         'miles.backends.fsdp_utils.engine', 'torch', 'transformers', 'datasets', 'sympy')",
        "bad = [m for m in sys.modules if m == 'ray' or m.startswith('ray.') or m in heavy]",
        "assert not bad, bad",
    )  # fmt: skip


@pytest.mark.parametrize(
    "module",
    [
        "miles.train",  # the driver: it only orchestrates
        "miles.ray.rollout_manager",  # its actor launches the engines before loading anything
        "miles.ray.engine_actor",  # it only starts the engine's server process
        "miles.backends.training_utils.algorithms.registry",  # the registry the config validates against
    ],
)
def test_processes_that_start_a_run_import_no_torch_before_they_need_it(module):
    # Every process of a run pays its own imports (torch alone takes seconds): the ones on the
    # path to the first rollout import it only where their work needs it.
    _run_fresh_python(
        "import importlib, sys",
        f"importlib.import_module({module!r})",
        "heavy = ('torch', 'transformers', 'datasets', 'sympy', 'math_verify')",
        "bad = [m for m in heavy if m in sys.modules]",
        "assert not bad, bad",
    )  # fmt: skip


def test_missing_backend_wheel_names_the_wheel(monkeypatch):
    from miles.utils import plugins

    monkeypatch.setattr(plugins, "installed_plugins", lambda group: {})
    with pytest.raises(ImportError, match="uv pip install miles-fsdp"):
        load()


def test_load_defaults_to_save_and_paths_become_absolute():
    # Ray workers run in other directories: every path is resolved where miles was launched.
    config = load("--save", "out")
    assert config.checkpoint.load == config.checkpoint.save == os.path.abspath("out")
    assert load("--save", "out", "--load", "other").checkpoint.load == os.path.abspath("other")
    assert config.data.prompt_data == os.path.abspath("train.jsonl")
    assert config.checkpoint.hf_checkpoint == "ckpt"  # not a local path: a hub id stays as is


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--num-rollout", "3", "--num-epoch", "2"], "give one of them"),
        (
            [
                "--debug-rollout-only",
                "--debug-train-only",
                "--load-debug-rollout-data",
                "x{rollout_id}",
            ],
            "exclude each other",
        ),
        (["--debug-train-only"], "--load-debug-rollout-data"),
        (["--save-debug-rollout-data", "out.pt"], "{rollout_id}"),
        (["--save-interval", "2"], "set --save DIR"),
        (["--eval-interval", "2"], "--eval-prompt-data NAME PATH"),
        (["--eval-prompt-data", "a"], "name/path pairs"),
        (["--async-train"], "--off-policy-correction"),
        (["--async-train", "--colocate", "--off-policy-correction", "tis"], "drop one of the two"),
        (["--fully-async"], "--fully-async trains on samples from older weights"),
        (["--fully-async", "--colocate", "--off-policy-correction", "tis"], "--colocate"),
        (["--fully-async", "--async-train", "--off-policy-correction", "tis"], "pick one"),
        (["--update-weights-interval", "2"], "--off-policy-correction"),
        (["--update-weights-interval", "0"], "--update-weights-interval must be >= 1"),
        (["--max-weight-staleness", "2"], r"--max-weight-staleness \(2\) is only read with"),
        (["--max-weight-staleness", "-1"], "--max-weight-staleness must be >= 0"),
        (["--partial-rollout"], "--partial-rollout resumes groups left over"),
        (
            [
                "--fully-async",
                "--off-policy-correction",
                "tis",
                "--mask-offpolicy-in-partial-rollout",
            ],
            "add both flags",
        ),
        (
            ["--fully-async", "--off-policy-correction", "tis", "--fully-async-buffer-groups", "2"],
            r"--fully-async-buffer-groups \(2\) must hold a train step's --rollout-batch-size \(4\)",
        ),
        (
            [
                "--fully-async",
                "--off-policy-correction",
                "tis",
                "--rollout-function-path",
                "tests.e2e.agents:two_turns",
            ],
            "makes whole rollouts only",
        ),
        (
            [
                "--fully-async",
                "--off-policy-correction",
                "tis",
                "--partial-rollout",
                "--custom-generate-function-path",
                # Any function but generate_sample itself (the built-in way) is custom generation.
                "tests.e2e.agents:two_turns",
            ],
            "only the built-in single-turn generation",
        ),
        (
            [
                "--use-rollout-routing-replay",
                "--apply-chat-template",
                "--tool-paths",
                "examples.tool_use.tools:calc",
                "--rollout-function-path",
                "miles.rollout.tool_rollout:ToolRollout",
            ],
            "keeps each sample's engine routing from the built-in single-turn generation",
        ),
        (["--label-key", "none"], "--label-key is none"),
        (["--actor-num-gpus-per-node", "3"], "divisible by the data-parallel size"),
        (
            ["--colocate", "--actor-num-gpus-per-node", "2", "--rollout-num-gpus", "1"],
            "--rollout-num-gpus",
        ),
        (
            ["--rollout-num-gpus", "3", "--rollout-num-gpus-per-engine", "2"],
            "--rollout-num-gpus-per-engine",
        ),
        (["--actor-num-nodes", "0"], "--actor-num-nodes must be >= 1"),
        (["--use-kl-loss", "--kl-loss-coef", "0"], "kl"),
        (["--custom-rm-path", "m:f"], "--custom-rm-path"),
        (["--rm-type", "remote"], "--rm-url"),
        (["--rm-type", "maths"], "math"),
        (
            ["--distributed-timeout-s", "600", "--train-call-timeout-s", "600"],
            r"--train-call-timeout-s \(600.0\) must exceed --distributed-timeout-s \(600.0\)",
        ),
        (["--rollout-manager-timeout-s", "0"], "--rollout-manager-timeout-s must be a positive"),
        (["--max-turns", "0"], r"--max-turns \(0\) must be at least 1"),
        (["--tool-timeout-s", "0"], r"--tool-timeout-s \(0.0\) must be positive"),
        (["--tool-paths", "no_colon"], "--tool-paths"),
        (
            ["--tool-paths", "json:dumps"],
            "json:dumps: parameter 'obj' needs one of the annotations",
        ),
        (
            ["--apply-chat-template-kwargs", "[1]"],
            "--apply-chat-template-kwargs: expected a JSON object",
        ),
        (["--apply-chat-template-kwargs", "{not json"], "expected a JSON object"),
        (["--apply-chat-template-kwargs", '{"a": 1}'], "pass --apply-chat-template too"),
        (["--chat-template-path", "t.jinja"], "pass --apply-chat-template too"),
        (
            ["--apply-chat-template", "--apply-chat-template-kwargs", '{"tokenize": false}'],
            r"names \['tokenize'\]: those are apply_chat_template's own arguments",
        ),
        (
            ["--apply-chat-template", "--chat-template-path", "no/such.jinja"],
            "--chat-template-path 'no/such.jinja' is not a file",
        ),
    ],
)
def test_invalid_combinations_name_the_flags(flags, message):
    with pytest.raises((ValueError, ImportError), match=message):
        load(*flags)


@pytest.mark.parametrize("timeout", ["0", "-5"])
def test_engine_startup_timeout_must_be_positive(timeout):
    message = f"--engine-startup-timeout-s must be positive, got {timeout}"
    with pytest.raises(ValueError, match=message):
        load("--engine-startup-timeout-s", timeout)


def test_help_has_a_section_per_group_and_explains_gpus_on_cpu(capsys):
    parser = build_parser(Schema.for_backend("fsdp"))
    text = parser.format_help()
    for group in ("cluster", "rollout", "data", "algorithm", "training", "checkpoint", "logging", "engine", "backend"):  # fmt: skip
        assert f"{group} settings" in text
    assert "worker devices" in text
    assert "--rollout-batch-size" in text and "(required)" in text


def test_help_flag_exits_cleanly():
    with pytest.raises(SystemExit) as exit_:
        load_config(["--help"])
    assert exit_.value.code == 0


@pytest.mark.parametrize("page", ["packages/miles/README.md", "docs/configuration.md"])
def test_config_reference_is_generated_from_the_schema(page):
    path = Path(__file__).resolve().parents[3] / page
    text = path.read_text()
    assert BEGIN in text and END in text
    assert text == splice(text, render_reference(Schema.for_backend("fsdp"))), (
        f"{page}'s config reference is stale: run `uv run python -m miles.config.docs --write "
        "packages/miles/README.md docs/configuration.md`"
    )


def test_async_is_a_short_spelling_of_async_train():
    config = load("--async", "--off-policy-correction", "tis", "--rollout-num-gpus", "1")
    assert config.training.async_train is True


def test_every_sglang_server_flag_passes_through_as_sglang_flag():
    config = load(
        "--sglang-context-length", "8192", "--sglang-enable-metrics",
        "--sglang-server-args", "chunked-prefill-size=4096",
    )  # fmt: skip
    assert config.engine.sglang_extra_args == {
        "chunked-prefill-size": "4096",
        "context-length": "8192",
        "enable-metrics": True,
    }


def test_fully_async_buffer_defaults_to_what_the_staleness_bound_lets_train():
    flags = ["--fully-async", "--off-policy-correction", "tis"]
    assert load(*flags).training.fully_async_buffer_groups == 4  # --rollout-batch-size 4 x 1
    config = load(*flags, "--max-weight-staleness", "2")
    assert config.training.fully_async_buffer_groups == 8
