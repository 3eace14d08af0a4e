"""On-policy distillation and reference-model settings in the run configuration: what is accepted,
what is refused before start-up (with the flag, the value and the fix), and the placement of the
teacher engines in bundles of their own."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from miles.config import load_config
from miles.ray.placement import plan_for_config, plan_placement
from miles.train_backend.run_spec import TrainRunSpec

BASE = ["--prompt-data", "train.jsonl", "--rollout-batch-size", "4"]


def checkpoint(path: Path, vocab_size: int = 259) -> str:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({"vocab_size": vocab_size}))
    return str(path)


@pytest.fixture
def student(tmp_path) -> str:
    return checkpoint(tmp_path / "student")


@pytest.fixture
def teacher(tmp_path) -> str:
    return checkpoint(tmp_path / "teacher")


def load(student: str, *flags: str):
    return load_config(["--hf-checkpoint", student, *BASE, *flags])


def test_opd_with_a_teacher_reaches_the_train_step_and_the_placement(student, teacher):
    config = load(student, "--use-opd", "--opd-teacher-checkpoint", teacher,
                  "--opd-kl-coef", "0.5", "--opd-teacher-num-engines", "2")  # fmt: skip
    assert config.distillation.opd_kl_coef == 0.5 and config.distillation.kl_in_advantages
    spec = TrainRunSpec.from_config(config, num_rollout=1)
    assert spec.distillation is config.distillation
    plan = plan_for_config(config, use_gpus=False)
    # Train rank 0, engine bundle 1, then one bundle per teacher.
    assert plan.engine_bundles == [[1]] and plan.teacher_bundles == [[2], [3]]
    assert len(plan.bundles) == 4
    # Without --use-opd nothing of it reaches the step.
    assert TrainRunSpec.from_config(load(student), num_rollout=1).distillation is None


def test_teachers_take_bundles_of_their_own_also_when_colocated():
    plan = plan_placement(
        actor_num_nodes=1, actor_num_gpus_per_node=2, rollout_num_gpus=None,
        rollout_num_gpus_per_engine=1, colocate=True, use_gpus=True,
        teacher_engines=1, teacher_gpus_per_engine=2,
    )  # fmt: skip
    assert plan.actor_bundles == [0, 1] and plan.engine_bundles == [[0], [1]]
    assert plan.teacher_bundles == [[2, 3]] and plan.total_resources() == {"CPU": 4.0, "GPU": 4.0}


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            ["--loss-type", "sft_loss"],
            "--use-opd distills on the student's own samples, but "
            "--loss-type sft_loss trains on given data",
        ),
        (["--debug-rollout-only"], "--debug-train-only and --debug-rollout-only run only one"),
        (["--opd-type", "megatron"], r"--opd-type megatron .* is not supported; supported: sglang"),
    ],
)
def test_combinations_that_cannot_distill_are_refused(student, teacher, flags, message):
    with pytest.raises(ValueError, match=message):
        load(student, "--use-opd", "--opd-teacher-checkpoint", teacher, *flags)


def test_a_teacher_of_another_vocabulary_is_refused(student, tmp_path):
    other = checkpoint(tmp_path / "other", vocab_size=32000)
    with pytest.raises(ValueError, match=r"vocabulary of 32000 tokens, the student .* 259"):
        load(student, "--use-opd", "--opd-teacher-checkpoint", other)


def test_a_missing_teacher_is_refused_before_start_up(student, tmp_path):
    with pytest.raises(ValueError, match=r"--opd-teacher-checkpoint .*missing.* does not exist"):
        load(student, "--use-opd", "--opd-teacher-checkpoint", str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="needs the teacher"):
        load(student, "--use-opd")


def test_opd_settings_without_use_opd_are_refused(student, teacher):
    with pytest.raises(
        ValueError, match=r"--opd-teacher-checkpoint .* is only read with --use-opd"
    ):
        load(student, "--opd-teacher-checkpoint", teacher)


def test_the_reference_model_settings_need_a_kl_that_reads_it(student, tmp_path):
    reference = checkpoint(tmp_path / "reference")
    kl = ["--use-kl-loss", "--kl-loss-coef", "0.1"]
    config = load(student, *kl, "--ref-load", reference, "--ref-update-interval", "3")
    spec = TrainRunSpec.from_config(config, num_rollout=6)
    assert spec.ref_load == reference and spec.ref_update_interval == 3
    with pytest.raises(ValueError, match=r"--ref-load .* only --kl-coef or --use-kl-loss reads"):
        load(student, "--ref-load", reference)
    with pytest.raises(ValueError, match=r"--ref-update-interval \(2\) sets up the reference"):
        load(student, "--ref-update-interval", "2")
    with pytest.raises(ValueError, match="--ref-update-interval must be >= 1"):
        load(student, *kl, "--ref-update-interval", "0")
    with pytest.raises(ValueError, match=r"--ref-load .*nowhere.* does not exist"):
        load(student, *kl, "--ref-load", str(tmp_path / "nowhere"))
