"""A run that survives its engines: two reference engines, one SIGKILLed as a weight push begins
and the other frozen (SIGSTOP) mid-run; fault tolerance (on by default) restarts each, pushes it
the current weights and puts it back, and the run ends with every rollout logged and both
restarts counted. The push that met the dead engine is the engine's failure, not the trainers':
with train-group restarts on (--save, --save-interval), the train group is not restarted for it;
a train rank SIGKILLed while the weights go to the restarted engine is, once, and the restore
goes again."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import ray

from miles.config import load_config
from miles.ray.run import Run
from miles.ray.train_group import RayTrainGroup
from miles.train import train
from miles.utils.tracking import read_metrics
from tests.e2e.assets import tiny_run_assets

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

ENGINE_MODULE = "miles.backends.sglang_utils.reference_engine.cli"


def engine_pids(checkpoint: Path) -> dict[int, int]:
    """port -> pid of the reference engines serving `checkpoint` (this test's own directory)."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            args = Path(f"/proc/{entry}/cmdline").read_bytes().decode().split("\0")
        except OSError:
            continue
        if ENGINE_MODULE in args and str(checkpoint) in args:
            found[int(args[args.index("--port") + 1])] = int(entry)
    return found


def records(path: Path) -> list[dict]:
    return read_metrics(path) if path.is_file() else []


class EngineSaboteur(threading.Thread):
    """Kills one engine as the run begins its second weight push (`kill_at_push`, the run's
    own step, wrapped), then freezes the other once the first one's restart shows in the
    records."""

    def __init__(self, checkpoint: Path, metrics: Path):
        super().__init__(daemon=True)
        self.checkpoint, self.metrics = checkpoint, metrics
        self.done: list[str] = []
        self.frozen_pid: int | None = None
        self.killed_port: int | None = None
        self.pushes = 0
        self.rank_killed = False
        self.stop = threading.Event()

    def kill_at_push(self, push: Callable[[Run], int]) -> Callable[[Run], int]:
        def push_to_a_dying_engine(run: Run) -> int:
            self.pushes += 1
            if self.pushes == 2:  # after the first rollout: the engine dies under the push
                pids = engine_pids(self.checkpoint)
                self.killed_port = min(pids)
                os.kill(pids[self.killed_port], signal.SIGKILL)
                self.done.append(f"killed {self.killed_port}")
            return push(run)

        return push_to_a_dying_engine

    def kill_a_rank_at_restore(self, restore: Callable[..., int]) -> Callable[..., int]:
        def restore_with_a_dying_rank(group: RayTrainGroup, urls: list[str]) -> int:
            if not self.rank_killed:  # the first restore: the engine killed under the push
                self.rank_killed = True
                where = ray.get(group.actors[0].where.remote())  # "pid P on node A"
                os.kill(int(where.split()[1]), signal.SIGKILL)
                self.done.append("killed train rank 0")
            return restore(group, urls)

        return restore_with_a_dying_rank

    def _wait_for(self, condition) -> bool:
        while not self.stop.is_set():
            if condition(records(self.metrics)):
                return True
            time.sleep(0.1)
        return False

    def run(self) -> None:
        if not self._wait_for(lambda logged: logged and logged[-1].get("engine/restarts") == 1):
            return
        other = next(
            pid for port, pid in engine_pids(self.checkpoint).items() if port != self.killed_port
        )
        self.frozen_pid = other
        os.kill(other, signal.SIGSTOP)
        self.done.append("froze the other")


def test_a_run_survives_a_killed_and_a_hung_engine(tmp_path, monkeypatch):
    checkpoint, data = tiny_run_assets(tmp_path)
    out = tmp_path / "run"
    config = load_config([
        "--hf-checkpoint", str(checkpoint), "--prompt-data", str(data),
        "--rollout-batch-size", "4", "--n-samples-per-prompt", "2",
        "--rollout-max-response-len", "16", "--rm-type", "exact_match",
        "--actor-num-gpus-per-node", "1", "--rollout-num-gpus", "2",
        "--rollout-router", "builtin", "--num-rollout", "4",
        "--rollout-health-check-interval-s", "1", "--rollout-health-check-timeout-s", "5",
        "--output-dir", str(out), "--console", "plain", "--lr", "1e-3",
        "--save", str(tmp_path / "ckpt"), "--save-interval", "2",
    ])  # fmt: skip
    saboteur = EngineSaboteur(checkpoint, out / "metrics.jsonl")
    monkeypatch.setattr(Run, "_push_weights", saboteur.kill_at_push(Run._push_weights))
    monkeypatch.setattr(
        RayTrainGroup, "restore_engines",
        saboteur.kill_a_rank_at_restore(RayTrainGroup.restore_engines),
    )  # fmt: skip
    saboteur.start()
    try:
        train(config)
    finally:
        saboteur.stop.set()
        saboteur.join(timeout=10)
        if saboteur.frozen_pid is not None and engine_pids(checkpoint):
            os.kill(saboteur.frozen_pid, signal.SIGKILL)  # ours; the run should have ended it
        if ray.is_initialized():
            ray.shutdown()
    logged = read_metrics(out / "metrics.jsonl")
    assert [r["rollout_id"] for r in logged] == [0, 1, 2, 3]
    assert len(saboteur.done) == 3, saboteur.done
    assert logged[-1]["engine/restarts"] == 2
    assert logged[-1]["engine/seconds_lost"] > 0
    # The dead engine's push did not cost the trainers a restart; the rank killed in the restore
    # that followed did, once.
    assert logged[-1]["train/restarts"] == 1
    assert not engine_pids(checkpoint)  # the run stopped every engine it (re)started
