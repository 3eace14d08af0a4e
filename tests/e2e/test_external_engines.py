"""A run on engines it did not launch (--rollout-external-engine-addrs): the test starts two
reference engines itself, as a user starts his servers, with an admin key of their own.

The run trains on them and pushes its weights into them (the step-0 check passes, and afterwards
both serve the trained weights at the run's last weight version), and leaves them running. Killed
mid-run, one of them is reported lost (a log line and `engine/lost_for_good`), is not restarted,
and the run ends on the other.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import httpx
import pytest
import ray

from miles.backends.sglang_utils.server_process import ADMIN_KEY_ENV, ServerProcess, free_port
from miles.config import load_config
from miles.train import train
from miles.utils.tracking import read_metrics
from tests.e2e.assets import tiny_run_assets

pytestmark = pytest.mark.timeout(900)

ADMIN_KEY = "the-users-own-admin-key"
# A prompt whose log-probs tell the weights apart (scored, not generated: deterministic).
PROBE = {"input_ids": [109, 97, 120, 40, 49, 44, 50, 41, 61, 50], "return_logprob": True,
         "logprob_start_len": 0, "sampling_params": {"max_new_tokens": 0}}  # fmt: skip


def start_engines(checkpoint: Path, count: int, log_dir: Path) -> list[ServerProcess]:
    """`count` reference engines on loopback, started together and ready, as a user runs them."""
    engines = []
    for i in range(count):
        port = free_port()
        command = [sys.executable, "-m", "miles.backends.sglang_utils.reference_engine.cli",
                   "--model-path", str(checkpoint), "--host", "127.0.0.1", "--port", str(port),
                   "--random-seed", str(i), "--log-level", "warning"]  # fmt: skip
        engines.append(ServerProcess(command, name=f"external-engine-{port}",
                                     log_path=log_dir / f"engine-{port}.log",
                                     env={ADMIN_KEY_ENV: ADMIN_KEY}))  # fmt: skip
    for engine in engines:
        engine.wait_until_ready(f"{url(engine)}/health", timeout_s=180)
    return engines


def url(engine: ServerProcess) -> str:
    return f"http://127.0.0.1:{engine.command[engine.command.index('--port') + 1]}"


def probe_logprobs(engine: ServerProcess) -> list[float]:
    answer = httpx.post(f"{url(engine)}/generate", json=PROBE, timeout=60).json()
    return [entry[0] for entry in answer["meta_info"]["input_token_logprobs"][1:]]


def weight_version(engine: ServerProcess) -> str:
    return httpx.get(f"{url(engine)}/get_model_info", timeout=10).json()["weight_version"]


@pytest.fixture
def external_run(tmp_path, monkeypatch) -> Iterator[tuple[tuple[Path, Path], list, Path]]:
    """(assets, two engines started here, the run's output dir); the engines stopped after."""
    assets = tiny_run_assets(tmp_path / "assets")
    # The driver reads the external engines' admin key where the engines read theirs.
    monkeypatch.setenv(ADMIN_KEY_ENV, ADMIN_KEY)
    with ExitStack() as stack:
        engines = start_engines(assets[0], 2, tmp_path)
        for engine in engines:
            stack.callback(engine.shutdown)
        yield assets, engines, tmp_path / "run"
    if ray.is_initialized():
        ray.shutdown()


def external_flags(assets, out: Path, engines: list[ServerProcess], *flags: str) -> list[str]:
    checkpoint, data = assets
    return [
        "--hf-checkpoint", str(checkpoint), "--prompt-data", str(data),
        "--rollout-batch-size", "4", "--n-samples-per-prompt", "2",
        "--rollout-max-response-len", "3", "--rm-type", "exact_match",
        "--actor-num-gpus-per-node", "1", "--output-dir", str(out), "--console", "plain",
        # The entropy bonus has a gradient whatever the rewards: the weights surely move.
        "--lr", "1e-2", "--entropy-coef", "0.1", "--rollout-router", "builtin",
        "--rollout-external-engine-addrs", *(url(engine).removeprefix("http://")
                                             for engine in engines),
        *flags,
    ]  # fmt: skip


def test_a_run_trains_on_external_engines_syncs_their_weights_and_leaves_them_running(
    external_run,
):
    assets, engines, out = external_run
    before = [probe_logprobs(engine) for engine in engines]
    assert before[0] == pytest.approx(before[1], abs=1e-5)  # the same checkpoint

    train(load_config(external_flags(assets, out, engines, "--num-rollout", "2")))

    records = read_metrics(out / "metrics.jsonl")
    assert [r["rollout_id"] for r in records] == [0, 1]
    assert records[0]["check/logprob_abs_diff"] < 1e-3  # the engines run the trainer's weights
    assert all("train/loss" in r for r in records)
    assert records[-1]["engine/serving"] == 2 and records[-1]["engine/lost_for_good"] == 0
    # Still running and answering, each at the run's last version: the first push, then one
    # after every rollout.
    for engine in engines:
        assert engine.poll() is None
        assert weight_version(engine) == str(1 + len(records))
    after = [probe_logprobs(engine) for engine in engines]
    assert after[0] == pytest.approx(after[1], abs=1e-5)  # both got the same weights
    assert max(abs(a - b) for a, b in zip(after[0], before[0], strict=True)) > 1e-3  # trained


class KillAfterFirstRollout(threading.Thread):
    """SIGKILLs one engine as soon as the first rollout is logged (the run is then mid-way)."""

    def __init__(self, engine: ServerProcess, metrics: Path):
        super().__init__(daemon=True)
        self.engine, self.metrics = engine, metrics
        self.killed_after: int | None = None  # rollouts logged when it was killed
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            logged = read_metrics(self.metrics) if self.metrics.is_file() else []
            if logged:
                os.kill(self.engine.pid, signal.SIGKILL)
                self.killed_after = len(logged)
                return
            time.sleep(0.1)


def test_a_killed_external_engine_is_reported_lost_and_the_run_goes_on_with_the_other(
    external_run, caplog
):
    assets, (survivor, victim), out = external_run
    flags = external_flags(
        assets, out, [survivor, victim], "--num-rollout", "3",
        "--rollout-health-check-interval-s", "1", "--rollout-health-check-timeout-s", "5",
    )  # fmt: skip
    killer = KillAfterFirstRollout(victim, out / "metrics.jsonl")
    killer.start()
    try:
        with caplog.at_level(logging.WARNING, logger="miles.ray.run"):
            train(load_config(flags))
    finally:
        killer.stop.set()
        killer.join(timeout=10)

    records = read_metrics(out / "metrics.jsonl")
    assert killer.killed_after is not None and killer.killed_after < 3
    assert [r["rollout_id"] for r in records] == [0, 1, 2]
    assert all("train/loss" in r for r in records)
    assert records[-1]["engine/lost_for_good"] == 1 and records[-1]["engine/serving"] == 1
    assert records[-1]["engine/restarts"] == 0  # not the run's to restart
    assert f"external engines ['{url(victim)}'] are lost" in caplog.text
    assert victim.poll() is not None  # dead, and nobody started it again
    assert survivor.poll() is None  # left running, with every weight update of the run
    assert weight_version(survivor) == str(1 + len(records))
