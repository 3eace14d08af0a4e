"""The README's main job: the CPU demo trains and the held-out reward rises by at least 0.3.
Then on-policy distillation on the demo's own models: the demo's starting point for RL (its SFT
warm-up) distilled from the model its GRPO stage trained gets closer to it, with no task reward
in the advantages, so what it learns comes from the teacher alone."""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest

from miles.utils.tracking import read_metrics

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "examples/cpu_demo"
KEY = "eval/heldout/reward_mean"


def eval_rewards(run_dir: Path) -> list[float]:
    return [r[KEY] for r in read_metrics(run_dir / "metrics.jsonl") if r.get(KEY) is not None]


def demo_env(out: Path) -> dict[str, str]:
    return {
        **os.environ,
        "MILES_DEMO_OUT": str(out),
        # The console scripts (miles) live beside this interpreter.
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
    }


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> tuple[Path, float, str]:
    """The whole demo, run once: its output directory, its wall time and its stdout."""
    out = tmp_path_factory.mktemp("cpu-demo") / "demo"
    start = time.monotonic()
    result = subprocess.run(
        ["bash", str(DEMO / "run.sh"), "--console", "plain"],
        env=demo_env(out), capture_output=True, text=True, timeout=1100,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return out, time.monotonic() - start, result.stdout


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_cpu_demo_learns_within_ten_minutes(demo):
    out, elapsed, stdout = demo
    grpo = eval_rewards(out / "grpo")
    sft = eval_rewards(out / "sft")
    print(stdout[-600:])
    print(f"held-out reward: {sft[0]:.3f} (start) -> {grpo[0]:.3f} (after SFT) -> {grpo[-1]:.3f}")
    assert grpo[-1] - grpo[0] >= 0.3, f"GRPO moved the held-out reward {grpo[0]} -> {grpo[-1]}"
    assert grpo[-1] - sft[0] >= 0.3
    assert elapsed < 600, f"the demo took {elapsed:.0f} s"
    plots = {p.name for p in (out / "grpo" / "plots").iterdir()}
    assert {"reward.png", "eval.png"} <= plots


def miles(*args: str | Path, env: dict[str, str]) -> None:
    result = subprocess.run(
        ["miles", *map(str, args)], env=env, cwd=REPO, capture_output=True, text=True, timeout=900
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_a_student_distilled_from_the_demos_trained_model_gets_closer_to_it(demo, tmp_path):
    out, _, _ = demo
    # The custom estimator is imported by name in every process of the run.
    env = {
        **demo_env(out),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }
    teacher = tmp_path / "teacher_hf"
    miles("export-hf", out / "grpo" / "checkpoints", teacher, env=env)  # GRPO's last weights
    student = tmp_path / "student"
    start = time.monotonic()
    miles(
        "train", "--config", DEMO / "grpo.yaml", "--console", "plain",
        "--hf-checkpoint", out / "sft_hf", "--save", student / "checkpoints",
        "--output-dir", student, "--num-rollout", "20", "--eval-interval", "10",
        # No task reward in the advantages: only the teacher's per-token KL teaches.
        "--advantage-estimator", "custom",
        "--custom-advantage-function-path", "tests.e2e.custom_algorithms:no_advantage",
        "--use-opd", "--opd-teacher-checkpoint", teacher, "--opd-kl-coef", "1.0",
        env=env,
    )  # fmt: skip
    elapsed = time.monotonic() - start
    records = list(read_metrics(student / "metrics.jsonl"))
    kl = [r["opd/teacher_kl"] for r in records if "opd/teacher_kl" in r]
    heldout = eval_rewards(student)
    teacher_heldout = eval_rewards(out / "grpo")[-1]
    first, last = statistics.fmean(kl[:3]), statistics.fmean(kl[-3:])
    print(
        f"teacher (the demo's GRPO model): held-out reward {teacher_heldout:.3f}; student (its "
        f"SFT warm-up): teacher KL per token {first:.3f} -> {last:.3f}, held-out reward "
        f"{heldout[0]:.3f} -> {heldout[-1]:.3f}; {elapsed:.0f} s"
    )
    assert len(kl) == 20, "every rollout reports the teacher KL"
    assert last < 0.5 * first, f"the teacher KL went {first:.3f} -> {last:.3f}"
    assert heldout[-1] - heldout[0] >= 0.2, f"the held-out reward went {heldout}"
    # Closer to the teacher than it started.
    assert abs(teacher_heldout - heldout[-1]) < abs(teacher_heldout - heldout[0])
