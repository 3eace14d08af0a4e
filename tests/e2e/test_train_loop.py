"""The train loop end to end with tiny settings: real Ray, FSDP on gloo, the reference engine.

Each test is a whole `miles train` (in-process, sharing one local Ray instance): disaggregated
placement; colocated placement (a tiny MoE with routing replay); the one-step-async and the
fully-async loops; an agent run; a diverging run that stops itself; the disaggregated run's saved
rollouts replayed (training as that run did); and that run crashed while saving, resumed from its
last complete checkpoint, matching the uninterrupted one. The disaggregated run is made once, for
all three.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import ray
import torch

from miles.config import load_config
from miles.ray.run import Run
from miles.ray.train_group import TrainRankError
from miles.train import train, train_sync
from miles.utils.checkpoint_layout import (
    MANIFEST_FILE,
    POINTER_FILE,
    checkpoint_problems,
    rollout_state_path,
)
from miles.utils.divergence import DivergenceError
from miles.utils.process_tree import ProcessKey, descendants, is_alive, key_of, kill_all
from miles.utils.run_lock import LOCK_FILE
from miles.utils.tracking import read_metrics
from tests.e2e.assets import random_lora_adapter, seeded_value_model, tiny_run_assets
from tests.e2e.pausing_rollout import PAUSE_AT, PAUSE_FILE
from tools.compare_runs import compare_records
from tools.workspace import REPO_ROOT

pytestmark = pytest.mark.timeout(900)


# Keys that count train-group restarts (--max-train-restarts): the rest of a restarted run's
# records are the uninterrupted run's.
RESTART_COUNTS = "^train/(restarts|replayed_rollouts|seconds_lost)$"


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("loop")
    yield tiny_run_assets(root)
    if ray.is_initialized():
        ray.shutdown()


def run(assets, out: Path, *flags: str) -> list[dict]:
    train(tiny_config(assets, out, *flags))
    return read_metrics(out / "metrics.jsonl")


def tiny_config(assets, out: Path, *flags: str):
    return load_config(tiny_flags(assets, out, *flags))


def tiny_flags(assets, out: Path, *flags: str) -> list[str]:
    checkpoint, data = assets
    return [
        "--hf-checkpoint", str(checkpoint), "--prompt-data", str(data),
        "--rollout-batch-size", "4", "--n-samples-per-prompt", "2",
        "--rollout-max-response-len", "3", "--rm-type", "exact_match",
        "--actor-num-gpus-per-node", "2", "--output-dir", str(out), "--console", "plain",
        "--lr", "1e-3", "--rollout-router", "builtin",
        *flags,
    ]  # fmt: skip


# Saving every rollout and one request at a time: the resume test replays this run from its
# checkpoints and must draw the same samples.
# Nine rollouts (a step takes a fraction of a second): the stop and restart tests compare their
# runs with it past rollout 7.
DISAGGREGATED = ["--num-rollout", "9", "--rollout-num-gpus", "1", "--rollout-concurrency", "1",
                 "--save-interval", "1"]  # fmt: skip


@pytest.fixture(scope="module")
def disaggregated(assets, tmp_path_factory) -> tuple[list[dict], str, Path]:
    """A disaggregated run that saves a checkpoint and its rollouts every rollout: its records,
    the rollouts' file pattern, and its output directory (checkpoints in `checkpoints/`)."""
    out = tmp_path_factory.mktemp("disaggregated")
    pattern = str(out / "rollouts" / "r{rollout_id}.pt")
    flags = [*DISAGGREGATED, "--save", str(out / "checkpoints"),
             "--save-debug-rollout-data", pattern]  # fmt: skip
    return run(assets, out / "run", *flags), pattern, out


def test_disaggregated_run_logs_every_rollout_with_its_time_split(disaggregated):
    records, _, out = disaggregated
    assert [r["rollout_id"] for r in records] == list(range(9))
    first = records[0]
    for key in ("rollout/reward_mean", "train/loss", "time/generate_s", "time/train_s",
                "time/update_weights_s", "time/step_s", "check/logprob_abs_diff",
                "startup/total_s", "startup/engines_s", "startup/trainers_s"):  # fmt: skip
        assert key in first, key
    assert first["check/logprob_abs_diff"] < 1e-3  # the step-0 check: engine runs our weights
    assert not any(k.startswith("startup/") for r in records[1:] for k in r)  # logged once
    assert (out / "run" / "config.json").is_file()
    # Fault tolerance is on by default for one engine that is not colocated.
    assert all(r["engine/restarts"] == 0 for r in records)


def test_every_checkpoint_of_a_run_is_committed_with_a_manifest_of_both_parts(disaggregated):
    _, _, out = disaggregated
    for rollout_id in (0, 1, 2):
        assert checkpoint_problems(out / "checkpoints", rollout_id) == []
    manifest = json.loads((out / "checkpoints" / "iter_0000002" / MANIFEST_FILE).read_text())
    assert "rollout/iter_0000002.json" in manifest["files"]  # the rollout side's state too
    assert any(name.startswith("iter_0000002/model/") for name in manifest["files"])


def test_a_colocated_moe_run_with_rollout_routing_replay_shares_the_devices(tmp_path):
    """Tiny Qwen3-MoE (4 experts, top-2), colocated (engines and trainers take turns: sleep and
    wake-up every rollout), with R3: the engines report each token's experts, the trainer replays
    them, and the step-0 check finds trainer and engine agree."""
    checkpoint, data = tiny_run_assets(tmp_path / "assets", architecture="qwen3_moe")
    records = run(
        (checkpoint, data), tmp_path / "run", "--num-rollout", "2", "--colocate",
        "--use-rollout-routing-replay", "--check-weight-sync-tolerance", "1e-4",
    )  # fmt: skip
    assert [r["rollout_id"] for r in records] == [0, 1]
    assert records[0]["check/logprob_abs_diff"] < 1e-4
    assert all("train/moe/router_entropy" in r for r in records)


def test_async_run_overlaps_generation_and_training(assets, tmp_path):
    records = run(
        assets, tmp_path, "--num-rollout", "3", "--rollout-num-gpus", "1",
        "--async-train", "--off-policy-correction", "tis",
    )  # fmt: skip
    assert [r["rollout_id"] for r in records] == [0, 1, 2]
    assert all("train/loss" in r for r in records)


# LoRA from a start adapter whose B is not zero, so the step-0 check sees an adapter that
# changes the model: the engines must run base + adapter exactly as the trainer does.
LORA = ["--lora-rank", "4", "--lora-alpha", "8", "--lr", "1e-2",
        "--check-weight-sync-tolerance", "1e-4"]  # fmt: skip


@pytest.mark.parametrize(
    "placement",
    [
        # The engine serves the base and loads each adapter version; KL against the base, which
        # is the trained model with its adapters off.
        ["--colocate", "--lora-sync", "adapter", "--use-kl-loss", "--kl-loss-coef", "0.1"],
        # The engine gets the adapted layers merged; the fully-async loop.
        ["--rollout-num-gpus", "1", "--lora-sync", "merged", "--fully-async",
         "--off-policy-correction", "tis", "--max-weight-staleness", "1"],
        # One-step async, and on-policy distillation from a teacher (the start checkpoint).
        ["--rollout-num-gpus", "1", "--async-train", "--off-policy-correction", "tis",
         "--use-opd", "--opd-teacher-checkpoint", "{checkpoint}", "--opd-kl-coef", "0.5"],
    ],
    ids=["colocated-adapter-sync-kl", "disaggregated-merged-sync-fully-async", "async-opd"],
)  # fmt: skip
def test_a_lora_run_trains_and_its_engines_run_the_trainers_adapted_model(
    assets, tmp_path, placement
):
    checkpoint, _ = assets
    adapter = random_lora_adapter(checkpoint, tmp_path / "adapter", rank=4)
    placement = [flag.format(checkpoint=checkpoint) for flag in placement]
    records = run(
        assets, tmp_path / "run", "--num-rollout", "2", *LORA, "--lora-adapter-path",
        str(adapter), *placement,
    )  # fmt: skip
    assert [r["rollout_id"] for r in records] == [0, 1]
    assert records[0]["check/logprob_abs_diff"] < 1e-4
    assert all(math.isfinite(r["train/loss"]) for r in records)


# One rank each, one request at a time: the two placements of the critic must draw the same
# samples. Two optimizer steps per rollout, the first rollout trains the critic alone.
PPO = ["--advantage-estimator", "ppo", "--num-critic-only-steps", "1", "--critic-lr", "1e-3",
       "--num-rollout", "2", "--global-batch-size", "4", "--actor-num-gpus-per-node", "1",
       "--rollout-num-gpus", "1", "--rollout-concurrency", "1", "--save-interval", "1"]  # fmt: skip


@pytest.fixture(scope="module")
def ppo_runs(assets, tmp_path_factory) -> dict[str, tuple[list[dict], Path]]:
    """The same PPO run with the critic on the policy's ranks and on a rank of its own, both
    starting the critic from one seeded value model: each one's records and directory (output
    in `run/`, checkpoints in `checkpoints/`; the second's memory record in `memory/`)."""
    root = tmp_path_factory.mktemp("ppo")
    critic = seeded_value_model(assets[0], root / "critic_start")
    # The critic's own rank is recorded and profiled beside the policy's.
    observed = ["--memory-snapshot-dir", str(root / "own" / "memory"), "--profile-target",
                "train", "--profile-step-start", "1", "--profile-step-end", "2"]  # fmt: skip
    runs = {}
    for placement, flags in (("shared", []), ("own", ["--critic-num-nodes", "1", *observed])):
        records = run(
            assets, root / placement / "run", *PPO, "--critic-hf-checkpoint", str(critic),
            "--save", str(root / placement / "checkpoints"), *flags,
        )  # fmt: skip
        runs[placement] = records, root / placement
    return runs


def test_a_ppo_run_trains_its_critic_after_critic_only_rollouts_and_saves_both(ppo_runs):
    """--advantage-estimator ppo: the critic shares the policy's ranks; the first rollout trains
    it alone, then both train; both are saved, the critic under <save>/critic."""
    records, directory = ppo_runs["shared"]
    save = directory / "checkpoints"
    assert [r["rollout_id"] for r in records] == [0, 1]
    assert "train/loss" not in records[0] and "train/loss" in records[1]
    for record in records:
        assert math.isfinite(record["critic/value_loss"]) and record["critic/step"] > 0
        assert "critic/explained_variance" in record and "critic/returns_mean" in record
    assert records[1]["critic/step"] == 4.0  # two steps a rollout
    assert (save / POINTER_FILE).read_text().strip() == "1"
    assert (save / "critic" / POINTER_FILE).read_text().strip() == "1"


def test_a_critic_on_a_rank_of_its_own_trains_exactly_as_one_on_the_policys(ppo_runs):
    """--critic-num-nodes 1: the critic's own rank scores the rollout, the policy's rank takes
    its values and computes the returns, the critic trains on them. Every non-timing value of
    the run is the one of the critic on the policy's rank; its checkpoint is saved, and its
    rank is in the memory record and the profiler's traces."""
    shared, _ = ppo_runs["shared"]
    own, directory = ppo_runs["own"]
    assert "startup/critic_trainers_s" in own[0] and "startup/critic_trainers_s" not in shared[0]
    # A critic on ranks of its own turns train-group restarts off: no restart counts logged.
    assert compare_records(shared, own, ignore=["^memory/", RESTART_COUNTS]) == []
    assert (directory / "checkpoints" / "critic" / POINTER_FILE).read_text().strip() == "1"
    memory = (directory / "memory" / "peak_rss.jsonl").read_text().splitlines()
    assert {"train_rank_0", "critic_rank_0"} <= {json.loads(line)["process"] for line in memory}
    assert own[1]["memory/critic_rank_0/peak_rss_mb"] > 10
    traces = sorted(p.name for p in (directory / "run" / "profiles" / "train").iterdir())
    assert traces == [
        "critic_rank_0.rollouts_1-1.pt.trace.json",
        "rank_0.rollouts_1-1.pt.trace.json",
    ]


FULLY_ASYNC = ["--rollout-num-gpus", "1", "--fully-async", "--off-policy-correction", "tis",
               "--max-weight-staleness", "1", "--save-interval", "1"]  # fmt: skip


def test_a_fully_async_run_killed_mid_run_resumes_with_its_buffer(assets, tmp_path):
    """A fully-async `miles train` (weights pushed every second rollout) SIGKILLed, the driver
    alone, while it generates past rollout 2's checkpoint: every process it started (Ray's, the
    engine's) is gone within seconds, and so is its Ray session directory. The same command
    again resumes from the last complete checkpoint. That checkpoint holds the buffer, and the groups that were
    ready when it was saved are the next rollout's first."""
    ckpt, pattern = tmp_path / "ckpt", str(tmp_path / "rollouts" / "r{rollout_id}.pt")
    flags = [*FULLY_ASYNC, "--save", str(ckpt), "--save-debug-rollout-data", pattern,
             "--update-weights-interval", "2"]  # fmt: skip
    out = tmp_path / "run"
    killed_at = kill_when_saved(tiny_flags(assets, out, *flags, "--num-rollout", "8"), ckpt, 2)
    first = read_metrics(out / "metrics.jsonl")
    assert [r["rollout_id"] for r in first][: killed_at + 1] == list(range(killed_at + 1))
    for record in first:
        assert record["async/staleness_max"] <= 1 and "train/loss" in record
        assert record["async/staleness_0_ratio"] + record["async/staleness_1_ratio"] == 1.0
        for key in ("async/trainer_wait_s", "async/engine_idle_s", "async/buffer_groups",
                    "async/dropped_groups"):  # fmt: skip
            assert key in record, key
    # Weights go out after every second rollout.
    assert ["async/update_pause_s" in r for r in first[:3]] == [False, True, False]
    state = json.loads(rollout_state_path(str(ckpt), killed_at).read_text())["fully_async"]
    assert state["ready"] or state["pending"], "the checkpoint holds no buffered group"

    # The same command, one rollout further than the kill's checkpoint.
    resumed = run(assets, out, *flags, "--num-rollout", str(killed_at + 2))
    assert [r["rollout_id"] for r in resumed] == list(range(killed_at + 2))  # each logged once
    trained = torch.load(pattern.format(rollout_id=killed_at + 1), weights_only=False)["shards"]
    trained_tokens = {tuple(t) for shard in trained for t in shard["tokens"]}
    # The resumed run's first push makes the next version: groups of the saved version are
    # within the bound of 1 and are the first taken (--rollout-batch-size 4).
    usable = [ready for ready in state["ready"] if ready["version"] >= state["version"]]
    assert usable, "no ready group in the checkpoint is within the bound"
    for ready in usable[:4]:
        for sample in ready["group"]:
            assert tuple(sample["tokens"]) in trained_tokens


def kill_when_saved(flags: list[str], ckpt: Path, rollout_id: int) -> int:
    """Run `miles train` in a process group of its own; SIGKILL the driver alone once the
    checkpoint of `rollout_id` is complete (its pointer written), and check that every process
    it started ends within seconds, its Ray session directory removed. Returns the pointer at
    the kill."""
    log = ckpt.parent / "killed.log"
    with log.open("w") as sink:
        process = subprocess.Popen(
            [sys.executable, "-m", "miles.cli.main", "train", *flags],
            env=_own_ray_env(), stdout=sink, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    started: set[ProcessKey] = set()
    try:
        deadline = time.monotonic() + 600
        while not (pointer := _pointer(ckpt)) or int(pointer) < rollout_id:
            assert process.poll() is None, f"it ended before the kill:\n{log.read_text()[-4000:]}"
            assert time.monotonic() < deadline, log.read_text()[-4000:]
            time.sleep(0.1)
        started = _started_by(process.pid)
        process.kill()
        process.wait(timeout=60)
        assert _still_running(started, within_s=10) == []
        assert not Path(_session_dir(log)).exists()
        return int(_pointer(ckpt))
    finally:
        _end(process, started)


def _own_ray_env(**extra: str) -> dict[str, str]:
    """The environment of a `miles train` that starts its own Ray instance and can import this
    repository's test helpers."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    return {**env, "PYTHONPATH": str(REPO_ROOT), **extra}


def _started_by(pid: int) -> set[ProcessKey]:
    """Every process below `pid` (Ray's, the workers, the engine servers), by pid and start
    time: a test looks at the processes its run started, never at others' by their name."""
    return descendants([key_of(pid)]) - {key_of(pid)}


def _still_running(processes: set[ProcessKey], *, within_s: float) -> list[str]:
    """The command lines of `processes` still running after `within_s`."""
    deadline = time.monotonic() + within_s
    while (left := [key for key in processes if is_alive(key)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    return [Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace") for pid, _ in left]


def _session_dir(log: Path) -> str:
    """The Ray session directory the driver logged (`miles.ray.local_ray`)."""
    match = re.search(r"local Ray session (\S+)", log.read_text())
    assert match, log.read_text()[-4000:]
    return match.group(1)


def _end(process: subprocess.Popen, started: set[ProcessKey]) -> None:
    """Leave nothing of a failed test running: the driver, then what it started (ours only)."""
    if process.poll() is None:
        process.kill()
        process.wait(timeout=60)
    kill_all(started)


def test_a_second_run_on_a_directory_in_use_is_refused_and_the_first_runs_on(assets, tmp_path):
    """Two runs on one --output-dir / --save: the second is refused in one line naming the first
    (before it writes anything), and the first's records and checkpoints are its own."""
    out, ckpt = tmp_path / "run", tmp_path / "ckpt"
    flags = tiny_flags(assets, out, "--num-rollout", "3", "--rollout-num-gpus", "1",
                       "--actor-num-gpus-per-node", "1", "--save", str(ckpt))  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # its own Ray instance
    miles = str(Path(sys.executable).parent / "miles")  # the console script a user runs
    first = subprocess.Popen([miles, "train", *flags], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while not (out / LOCK_FILE).exists():
            assert first.poll() is None and time.monotonic() < deadline, first.stdout.read()
            time.sleep(0.05)
        second = subprocess.run([miles, "train", *flags],
                                env=env, capture_output=True, text=True, timeout=120)  # fmt: skip
        assert second.returncode == 2, second.stderr
        line = f"--output-dir {out} is in use by another run (pid {first.pid} on "
        assert line in second.stderr and len(second.stderr.strip().splitlines()) == 1
        assert first.wait(timeout=600) == 0
    finally:
        if first.poll() is None:
            first.kill()
            first.wait(timeout=60)
    records = read_metrics(out / "metrics.jsonl")
    assert [r["rollout_id"] for r in records] == [0, 1, 2]
    assert (ckpt / POINTER_FILE).read_text().strip() == "2"
    assert not (out / LOCK_FILE).exists() and not (ckpt / LOCK_FILE).exists()  # released
    assert not (out / "failure.log").exists()  # the refused run wrote nothing there


def _pointer(ckpt: Path) -> str:
    try:
        return (ckpt / POINTER_FILE).read_text().strip()
    except FileNotFoundError:
        return ""


def test_an_agent_run_trains_on_its_sessions_and_evaluates_through_them(assets, tmp_path):
    """--agent-function-path in a real run: the session server lives in the rollout manager's
    actor, every sample is a two-turn session, held-out prompts go through the same agent."""
    _, data = assets
    records = run(
        assets, tmp_path, "--num-rollout", "1", "--rollout-num-gpus", "1",
        "--apply-chat-template", "--rollout-max-response-len", "96",
        "--rollout-function-path", "miles.rollout.agent_rollout:AgentRollout",
        "--agent-function-path", "tests.e2e.agents:two_turns",
        "--eval-prompt-data", "heldout", str(data), "--eval-interval", "1",
    )  # fmt: skip
    rollout = next(r for r in records if "rollout/turns_mean" in r)
    assert rollout["rollout/turns_mean"] == 2.0
    assert rollout["rollout/session_end/completed"] == 8.0
    assert rollout["rollout/failed_ratio"] == 0.0
    evaluation = next(r for r in records if "eval/heldout/reward_mean" in r)
    assert evaluation["eval/heldout/samples"] == 16.0
    assert evaluation["eval/heldout/turns_mean"] == 2.0  # the agent's sessions, not one /generate


def test_a_diverging_run_stops_after_the_skipped_steps_with_every_rollout_logged(
    assets, tmp_path, disaggregated
):
    # lr 1e30: the first step is finite and throws the weights to ~1e30, every later forward
    # overflows, and its step is skipped. Four steps per rollout: 1 applied, then 3 skipped. The
    # entropy bonus gives a gradient even when every reward is the same (no advantage). The
    # disaggregated run's rollouts are replayed: no engine to start.
    _, pattern, _ = disaggregated
    with pytest.raises(DivergenceError, match="3 optimizer steps in a row") as error:
        run(assets, tmp_path, "--num-rollout", "2", "--rollout-num-gpus", "1", "--lr", "1e30",
            "--entropy-coef", "0.01", "--global-batch-size", "2",
            "--max-consecutive-nonfinite-steps", "3",
            "--debug-train-only", "--load-debug-rollout-data", pattern)  # fmt: skip
    assert "rollout 0 step 2, rollout 0 step 3, rollout 0 step 4" in str(error.value)
    (record,) = read_metrics(tmp_path / "metrics.jsonl")  # the stopped rollout is on record
    assert record["rollout_id"] == 0 and record["train/skipped_steps"] == 3


def test_a_run_resumed_after_a_crash_matches_the_uninterrupted_one(
    assets, tmp_path, disaggregated, caplog
):
    full, _, out = disaggregated
    # The same run, crashed while saving rollout 8: its metrics were logged and its checkpoint
    # files written, but the pointer (written last) still names rollout 7. And rollout 7's
    # checkpoint has since lost three bits of a weight shard: the run must see it and resume
    # from rollout 6's instead, as if it had never stopped.
    shutil.copytree(out / "run", tmp_path / "crashed")
    shutil.copytree(out / "checkpoints", tmp_path / "crashed_ckpt")
    (tmp_path / "crashed_ckpt" / POINTER_FILE).write_text("7")
    shard = max((tmp_path / "crashed_ckpt" / "iter_0000007" / "model").glob("*.distcp"),
                key=lambda p: p.stat().st_size)  # fmt: skip
    data = bytearray(shard.read_bytes())
    for offset in (0, 9, 123):
        data[len(data) // 2 + offset] ^= 0x10
    shard.write_bytes(bytes(data))
    with caplog.at_level("WARNING", logger="miles.utils.run_dirs"):
        resumed = run(
            assets, tmp_path / "crashed", *DISAGGREGATED, "--save", str(tmp_path / "crashed_ckpt")
        )
    assert f"{shard} does not match its SHA-256" in caplog.text
    assert "resuming from the newest good checkpoint" in caplog.text
    assert [r["rollout_id"] for r in resumed] == list(range(9))  # rollouts 7, 8 logged once each
    # Every non-timing value of the resumed rollouts, to the bit (tools/compare_runs.py); the
    # resumed process's first rollout adds its start-up and step-0 check records.
    assert compare_records(full[7:], resumed[7:], ignore=["^check/"]) == []
    assert (tmp_path / "crashed_ckpt" / POINTER_FILE).read_text().strip() == "8"


# The uninterrupted run's settings (DISAGGREGATED), a checkpoint every 5 rollouts.
STOPPED = [*DISAGGREGATED[:-2], "--save-interval", "5"]


@pytest.mark.slow
def test_a_sigterm_to_the_process_group_saves_the_rollout_in_progress_and_the_rerun_matches(
    assets, tmp_path, disaggregated
):
    """SIGTERM to a `miles train`'s process group (Ray's processes included) during rollout 7,
    with --save-interval 5: rollout 7 finishes and is saved, every process the run started
    ends, its Ray session directory is removed, and it exits 143 with one line. The same
    command resumes at rollout 8, and every value equals the uninterrupted run's."""
    full, _, _ = disaggregated
    out, ckpt, pause, log = (
        tmp_path / "run",
        tmp_path / "ckpt",
        tmp_path / "paused",
        tmp_path / "log",
    )
    flags = tiny_flags(assets, out, *STOPPED, "--save", str(ckpt))
    # The rollout waits before rollout 7 until the signal is in: the stop lands there on a
    # machine of any speed (pausing_rollout.py; its samples are the built-in rollout's).
    pausing = ["--rollout-function-path", "tests.e2e.pausing_rollout:PausingRollout"]
    env = _own_ray_env(**{PAUSE_AT: "7", PAUSE_FILE: str(pause)})
    miles = str(Path(sys.executable).parent / "miles")  # the console script a user runs
    with log.open("w") as sink:
        process = subprocess.Popen([miles, "train", *flags, *pausing], env=env, stdout=sink,
                                   stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    started: set[ProcessKey] = set()
    try:
        deadline = time.monotonic() + 600
        while not pause.exists():
            assert process.poll() is None and time.monotonic() < deadline, log.read_text()[-4000:]
            time.sleep(0.05)
        started = _started_by(process.pid)
        os.killpg(process.pid, signal.SIGTERM)
        while "SIGTERM: stopping after the step of rollout 7" not in log.read_text():
            assert process.poll() is None and time.monotonic() < deadline, log.read_text()[-4000:]
            time.sleep(0.05)
        pause.unlink()
        assert process.wait(timeout=120) == 143, log.read_text()[-4000:]
        assert _still_running(started, within_s=5) == []
    finally:
        _end(process, started)
    text = log.read_text()
    last = text.strip().splitlines()[-1]
    assert last == "miles train: stopped by SIGTERM at rollout 7; checkpoint iter_0000007 written"
    assert "Traceback" not in text
    assert not Path(_session_dir(log)).exists()
    assert (ckpt / POINTER_FILE).read_text().strip() == "7"
    assert [r["rollout_id"] for r in read_metrics(out / "metrics.jsonl")] == list(range(8))

    resumed = run(assets, out, *STOPPED, "--save", str(ckpt))  # the same command, again
    assert [r["rollout_id"] for r in resumed] == list(range(9))
    # The resumed process's first rollout adds its start-up and step-0 check records.
    assert compare_records(full, resumed, ignore=["^check/"]) == []


@pytest.mark.slow
def test_ctrl_c_during_start_up_stops_at_once_in_one_line_and_leaves_nothing(assets, tmp_path):
    """SIGINT to the process group (a terminal's Ctrl-C) once Ray has started: nothing is
    trained, so the run stops at once; it exits 130 with one line and no traceback, and every
    process it started is gone."""
    out, log = tmp_path / "run", tmp_path / "log"
    flags = tiny_flags(assets, out, "--num-rollout", "2", "--rollout-num-gpus", "1",
                       "--actor-num-gpus-per-node", "1")  # fmt: skip
    with log.open("w") as sink:
        process = subprocess.Popen(
            [sys.executable, "-m", "miles.cli.main", "train", *flags], env=_own_ray_env(),
            stdout=sink, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    started: set[ProcessKey] = set()
    try:
        deadline = time.monotonic() + 300
        while "local Ray session" not in log.read_text():
            assert process.poll() is None and time.monotonic() < deadline, log.read_text()[-4000:]
            time.sleep(0.05)
        started = _started_by(process.pid)
        os.killpg(process.pid, signal.SIGINT)
        assert process.wait(timeout=120) == 130, log.read_text()[-4000:]
        assert _still_running(started, within_s=5) == []
    finally:
        _end(process, started)
    text = log.read_text()
    assert text.strip().splitlines()[-1] == (
        "miles train: stopped by SIGINT during start-up; no checkpoint written (no --save)"
    )
    assert "Traceback" not in text and "KeyboardInterrupt" not in text
    assert not Path(_session_dir(log)).exists()


# The uninterrupted run's settings (DISAGGREGATED), a checkpoint every 3 rollouts.
RESTARTED = [*DISAGGREGATED[:-2], "--save-interval", "3"]


@pytest.mark.slow
def test_a_train_rank_killed_mid_run_is_restarted_and_the_run_matches_the_uninterrupted_one(
    assets, tmp_path, disaggregated
):
    """Train rank 1 SIGKILLed once rollout 4 is logged, with --save-interval 3: the train group
    starts again from rollout 2's checkpoint and replays rollouts 3, 4 (and any it trained
    since) from their kept train data. The run finishes, its engine never restarted, and every
    value equals the uninterrupted run's; the kept train data is gone with the last checkpoint."""
    full, _, _ = disaggregated
    out, ckpt = tmp_path / "run", tmp_path / "ckpt"
    config = tiny_config(assets, out, *RESTARTED, "--save", str(ckpt))
    with Run(config) as started:
        ranks = [
            ray.get(a.__ray_call__.remote(lambda _: os.getpid())) for a in started.trainers.actors
        ]
        engines = ray.get(started.rollout_manager.engine_pids.remote())
        killed: list[int] = []
        killer = threading.Thread(
            target=_kill_once_logged, args=(out / "metrics.jsonl", 5, ranks[1], killed),
            daemon=True,
        )  # fmt: skip
        killer.start()
        train_sync(started)
        killer.join(timeout=10)
        assert ray.get(started.rollout_manager.engine_pids.remote()) == engines
    assert killed, "the run ended before rank 1 was killed"
    records = read_metrics(out / "metrics.jsonl")
    assert [r["rollout_id"] for r in records] == list(range(9))
    assert records[-1]["train/restarts"] == 1 and records[-1]["train/seconds_lost"] > 0
    assert records[-1]["train/replayed_rollouts"] >= 2  # 3 and 4 at least
    assert compare_records(full, records, ignore=["^check/", RESTART_COUNTS]) == []
    assert list((ckpt / "train_data").glob("*")) == []


def _kill_once_logged(metrics: Path, records: int, pid: int, killed: list[int]) -> None:
    """SIGKILL `pid` as soon as `metrics` holds `records` lines (within seconds of the last)."""
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if metrics.is_file() and metrics.read_text().count("\n") >= records:
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
            return
        time.sleep(0.01)


def test_debug_replay_trains_on_saved_rollouts_as_the_run_that_saved_them(
    assets, tmp_path, disaggregated
):
    records, pattern, _ = disaggregated
    replayed = run(
        assets, tmp_path / "replay", "--num-rollout", "2", "--rollout-num-gpus", "1",
        "--debug-train-only", "--load-debug-rollout-data", pattern,
    )  # fmt: skip
    # Same start weights, same data: the same optimizer steps; no engines, so no step-0 check.
    assert [r["rollout_id"] for r in replayed] == [0, 1]
    for ours, theirs in zip(replayed, records[:2], strict=True):
        assert ours["train/loss"] == pytest.approx(theirs["train/loss"], rel=1e-5, abs=1e-7)
        assert ours["train/grad_norm"] == pytest.approx(theirs["train/grad_norm"], rel=1e-5)
        assert "check/logprob_abs_diff" not in ours and "time/update_weights_s" not in ours


def test_a_hung_and_then_a_dead_train_rank_stop_the_step_naming_the_rank(
    assets, tmp_path, disaggregated
):
    # Rank 1 frozen (SIGSTOP): rank 0 waits in a collective until --distributed-timeout-s, and
    # the error names rank 1 as the one that never answered. Rank 1 killed: the next step stops
    # naming it as dead. The saved rollouts are replayed: no engine to start.
    _, pattern, _ = disaggregated
    timeout_s = 8
    config = tiny_config(
        assets, tmp_path, "--num-rollout", "1", "--rollout-num-gpus", "1",
        "--debug-train-only", "--load-debug-rollout-data", pattern,
        "--distributed-timeout-s", str(timeout_s),
    )  # fmt: skip
    with Run(config) as started:
        rollout = started.generate(0)
        pids = [
            ray.get(a.__ray_call__.remote(lambda _: os.getpid())) for a in started.trainers.actors
        ]
        os.kill(pids[1], signal.SIGSTOP)
        began = time.monotonic()
        with pytest.raises(TrainRankError) as hung:
            started.train(rollout)
        hung_s = time.monotonic() - began
        os.kill(pids[1], signal.SIGKILL)
        with pytest.raises(TrainRankError) as dead:
            started.train(rollout)
    assert str(hung.value).startswith("train rank 0 of 2 (pid ")
    assert f"no answer from rank 1 (pid {pids[1]} on node " in str(hung.value)
    assert timeout_s <= hung_s < timeout_s + 20
    assert str(dead.value).startswith(f"train rank 1 of 2 (pid {pids[1]} on node ")
    assert ") died in train (rollout 0): " in str(dead.value)
