"""RayTrainGroup on a real local Ray: every rank trains on its data-parallel replica's shard, so
ranks that split one model replica see the same samples; each rank runs the torch threads it is
given; a failing or dead rank is named with its process, and the failure report unwraps Ray's
errors."""

from __future__ import annotations

import contextlib
import os
import time

import pytest
import ray

from miles.ray.cluster import init_ray
from miles.ray.placement import create_placement, plan_placement, remove_placement
from miles.ray.train_group import RayTrainGroup, TrainRankError
from miles.train_backend import TrainRayActor
from miles.utils.failures import describe, write_failure_log


class _PairedReplicaActor(TrainRayActor):
    """A backend whose ranks come in pairs that split one replica (like tensor parallel 2).

    It overrides the calls this test routes (init, train, logprob_gap) and builds no engine."""

    def build_engine(self, spec, backend, *, device, with_ref):
        raise NotImplementedError("not part of this test")

    def init(self, spec, loss, backend, *, role="actor", with_ref=False):
        return 0

    def data_parallel_rank(self) -> int:
        return self.rank // 2

    def train(self, rollout_id, data_ref):
        return {"rank": self.rank, "shard": data_ref}

    def logprob_gap(self, data_ref):
        return float(data_ref == "shard-0")

    def torch_threads(self) -> int:
        import torch

        return torch.get_num_threads()


@contextlib.contextmanager
def train_group_of(world_size: int, cpu_threads: list[int] | None = None):
    """A RayTrainGroup of `_FailingActor` ranks in a real placement group, on a local Ray."""
    started = not ray.is_initialized()
    init_ray(num_cpus=4, log_to_driver=False)
    plan = plan_placement(
        actor_num_nodes=1, actor_num_gpus_per_node=world_size, rollout_num_gpus=None,
        rollout_num_gpus_per_engine=1, colocate=True, use_gpus=False, cpus_per_bundle=0.5,
    )  # fmt: skip
    placement = create_placement(plan, timeout_s=60)
    train_group = RayTrainGroup(
        _FailingActor, placement, world_size=world_size, colocate=False, has_gpus=False,
        cpus_per_bundle=0.5, cpu_threads=cpu_threads,
    )  # fmt: skip
    try:
        assert train_group.init(None, None, None) == 0
        yield train_group
    finally:
        train_group.shutdown()
        remove_placement(placement)
        if started:
            ray.shutdown()


@pytest.fixture(scope="module")
def group():
    with train_group_of(4) as train_group:
        yield train_group


def test_ranks_of_one_replica_train_on_the_same_shard(group):
    assert group.dp_size == 2
    shards = [ray.put("shard-0"), ray.put("shard-1")]
    results = ray.get(group.async_train(0, shards))
    assert [r["shard"] for r in results] == ["shard-0", "shard-0", "shard-1", "shard-1"]
    assert group.logprob_gap(shards) == 1.0  # rank 0's, from shard 0


def test_one_shard_per_rank_is_refused_when_ranks_share_replicas(group):
    with pytest.raises(ValueError, match="got 4 data shards for 2 data-parallel replicas"):
        group.async_train(0, [ray.put(i) for i in range(4)])


class _FailingActor(_PairedReplicaActor):
    def fail_on(self, rank: int) -> int:
        if self.rank == rank:
            raise ValueError(f"rank {rank} was told to fail")
        return self.rank

    def hang_on(self, rank: int, seconds: float) -> int:
        if self.rank == rank:
            time.sleep(seconds)  # stuck in its own computation: no collective for peers to fail
        return self.rank

    def die_on(self, rank: int) -> int:
        if self.rank == rank:
            os._exit(3)  # the process ends, as after SIGKILL or an out-of-memory kill
        return self.rank


def test_a_failing_rank_is_named_with_its_process_and_its_own_error(group):
    with pytest.raises(TrainRankError) as caught:
        group.call("fail_on", 2)
    message = str(caught.value)
    assert message.startswith("train rank 2 of 4 (pid ")
    assert (
        "on node " in message
        and "failed in fail_on: ValueError: rank 2 was told to fail" in message
    )
    assert "Traceback" not in message
    assert describe(caught.value).splitlines()[0] == f"TrainRankError: {message.splitlines()[0]}"


def test_each_rank_runs_the_torch_threads_it_was_given(group):
    # Ray alone gives a rank of half a CPU one thread (OMP_NUM_THREADS=1).
    with train_group_of(2, cpu_threads=[3, 2]) as train_group:
        threads = ray.get([a.call.remote("torch_threads") for a in train_group.actors])
    assert threads == [3, 2]


def test_a_rank_whose_process_dies_is_named_as_dead(tmp_path):
    with train_group_of(2) as train_group:
        pid = train_group.places[1].split()[1]
        with pytest.raises(
            TrainRankError, match=rf"^train rank 1 of 2 \(pid {pid} on node .*\) died in die_on"
        ):
            train_group.call("die_on", 1)
    log = write_failure_log(tmp_path, RuntimeError("first"))
    write_failure_log(tmp_path, RuntimeError("second"))
    entries = [line for line in log.read_text().splitlines() if line.startswith("=== ")]
    assert [e.split(": ", 1)[1] for e in entries] == ["RuntimeError: first", "RuntimeError: second"]


def test_a_rank_hung_outside_any_collective_is_named_within_the_call_bound():
    with train_group_of(2) as train_group:
        train_group.call_timeout_s = 1.5  # after start-up, which takes longer on a loaded machine
        pid = train_group.places[1].split()[1]
        start = time.monotonic()
        with pytest.raises(
            TrainRankError,
            match=rf"^no answer to hang_on within 1.5 s \(--train-call-timeout-s\) from train "
            rf"rank 1 \(pid {pid} on node ",
        ):
            train_group.call("hang_on", 1, 300.0)
        assert time.monotonic() - start < 5.0
        start = time.monotonic()
    # The hung rank is killed, not waited for (closing waits up to 60 s for a rank's answer).
    assert time.monotonic() - start < 30.0


def test_describe_unwraps_a_ray_task_error_to_the_exception_raised_remotely(group):
    @ray.remote(num_cpus=0)
    def fails() -> None:
        raise KeyError("missing-key")

    with pytest.raises(ray.exceptions.RayTaskError) as caught:
        ray.get(fails.remote())
    assert describe(caught.value) == "KeyError: 'missing-key'"
