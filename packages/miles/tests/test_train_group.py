"""RayTrainGroup on a real local Ray: every rank trains on its data-parallel replica's shard, so
ranks that split one model replica see the same samples."""

from __future__ import annotations

import pytest
import ray

from miles.ray import TrainRayActor
from miles.ray.cluster import init_ray
from miles.ray.placement import create_placement, plan_placement, remove_placement
from miles.ray.train_group import RayTrainGroup


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


@pytest.fixture(scope="module")
def group():
    started = not ray.is_initialized()
    init_ray(num_cpus=4, log_to_driver=False)
    plan = plan_placement(
        actor_num_nodes=1, actor_num_gpus_per_node=4, rollout_num_gpus=None,
        rollout_num_gpus_per_engine=1, colocate=True, use_gpus=False, cpus_per_bundle=0.5,
    )  # fmt: skip
    placement = create_placement(plan, timeout_s=60)
    train_group = RayTrainGroup(
        _PairedReplicaActor, placement, world_size=4, colocate=False, has_gpus=False,
        cpus_per_bundle=0.5,
    )  # fmt: skip
    try:
        assert train_group.init(None, None, None) == 0
        yield train_group
    finally:
        train_group.shutdown()
        remove_placement(placement)
        if started:
            ray.shutdown()


def test_ranks_of_one_replica_train_on_the_same_shard(group):
    assert group.dp_size == 2
    shards = [ray.put("shard-0"), ray.put("shard-1")]
    results = ray.get(group.async_train(0, shards))
    assert [r["shard"] for r in results] == ["shard-0", "shard-0", "shard-1", "shard-1"]
    assert group.logprob_gap(shards) == 1.0  # rank 0's, from shard 0


def test_one_shard_per_rank_is_refused_when_ranks_share_replicas(group):
    with pytest.raises(ValueError, match="got 4 data shards for 2 data-parallel replicas"):
        group.async_train(0, [ray.put(i) for i in range(4)])
