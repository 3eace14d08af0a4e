"""Placement groups on a real single-node Ray instance: probes land in their bundles, timeouts explain."""

from __future__ import annotations

import logging

import pytest
import ray

from miles.ray.cluster import bind_host, init_ray
from miles.ray.placement import create_placement, plan_placement, remove_placement

NUM_CPUS = 4


@pytest.fixture(scope="module")
def local_ray():
    started = not ray.is_initialized()
    init_ray(num_cpus=NUM_CPUS, log_to_driver=False)
    yield
    if started:
        ray.shutdown()


@ray.remote
class _Probe:
    """Reports the node Ray ran it on."""

    def node(self) -> str:
        return ray.get_runtime_context().get_node_id()


def _run_together(strategies, num_cpus: float) -> list[str]:
    """Start one probe per strategy, all alive at once; return their nodes."""
    probes = [_Probe.options(num_cpus=num_cpus, scheduling_strategy=s).remote() for s in strategies]
    try:
        return ray.get([p.node.remote() for p in probes], timeout=60)
    finally:
        for probe in probes:
            ray.kill(probe)


def test_init_ray_is_idempotent(local_ray):
    init_ray(num_cpus=1)
    assert ray.is_initialized()
    assert ray.cluster_resources()["CPU"] >= 1


def test_disaggregated_probes_run_in_their_own_bundles(local_ray):
    plan = plan_placement(
        actor_num_nodes=1,
        actor_num_gpus_per_node=2,
        rollout_num_gpus=1,
        rollout_num_gpus_per_engine=1,
        colocate=False,
        use_gpus=False,
    )
    placement = create_placement(plan, timeout_s=60)
    try:
        node = ray.get_runtime_context().get_node_id()
        assert placement.bundle_nodes == [node] * 3
        assert sorted(placement.bundle_indices) == [0, 1, 2]
        # Each probe takes a whole one-CPU bundle, so all three run only in distinct bundles.
        strategies = [placement.actor_scheduling(r) for r in range(2)]
        strategies.append(placement.engine_scheduling(0))
        assert _run_together(strategies, num_cpus=1) == [node] * 3
    finally:
        remove_placement(placement)


def test_colocated_trainer_and_engine_share_a_bundle(local_ray):
    plan = plan_placement(
        actor_num_nodes=1,
        actor_num_gpus_per_node=1,
        rollout_num_gpus=None,
        rollout_num_gpus_per_engine=1,
        colocate=True,
        use_gpus=False,
    )
    placement = create_placement(plan, timeout_s=60)
    try:
        # Half-CPU probes: trainer and engine both fit the one-CPU bundle at the same time.
        strategies = [placement.actor_scheduling(0), placement.engine_scheduling(0)]
        assert _run_together(strategies, num_cpus=0.5) == placement.bundle_nodes * 2
    finally:
        remove_placement(placement)


def test_removing_a_placement_frees_its_cpus(local_ray):
    plan = plan_placement(
        actor_num_nodes=1,
        actor_num_gpus_per_node=2,
        rollout_num_gpus=2,
        rollout_num_gpus_per_engine=2,
        colocate=True,
        use_gpus=False,
    )
    placement = create_placement(plan, timeout_s=60)
    remove_placement(placement)
    # A second group as large as the whole node only fits once the first one is gone.
    whole = plan_placement(
        actor_num_nodes=1,
        actor_num_gpus_per_node=int(ray.cluster_resources()["CPU"]),
        rollout_num_gpus=None,
        rollout_num_gpus_per_engine=1,
        colocate=True,
        use_gpus=False,
    )
    remove_placement(create_placement(whole, timeout_s=30))


def test_unsatisfiable_placement_times_out_naming_needs_and_fix(local_ray, caplog):
    too_many = int(ray.cluster_resources()["CPU"]) + 1
    plan = plan_placement(
        actor_num_nodes=1,
        actor_num_gpus_per_node=too_many,
        rollout_num_gpus=1,
        rollout_num_gpus_per_engine=1,
        colocate=False,
        use_gpus=False,
    )
    with caplog.at_level(logging.INFO, logger="miles.ray.placement"):
        with pytest.raises(TimeoutError) as error:
            create_placement(plan, timeout_s=2, log_every_s=0.5, name="miles-test-too-big")
    message = str(error.value)
    assert f"{too_many + 1} bundles (CPU {too_many + 1})" in message
    assert f"CPU {NUM_CPUS:g} in total" in message
    assert "--actor-num-gpus-per-node" in message and "--rollout-num-gpus" in message
    assert "add nodes" in message
    assert any("waited" in r.getMessage() for r in caplog.records), "no progress log while waiting"
    # The failed group was removed, so it holds nothing.
    states = {t["name"]: t["state"] for t in ray.util.placement_group_table().values()}
    assert states["miles-test-too-big"] == "REMOVED"


def test_a_placement_sent_to_another_actor_schedules_there(local_ray):
    # The rollout manager receives the placement as an argument and starts engines from inside.
    plan = plan_placement(
        actor_num_nodes=1,
        actor_num_gpus_per_node=1,
        rollout_num_gpus=1,
        rollout_num_gpus_per_engine=1,
        colocate=False,
        use_gpus=False,
    )
    placement = create_placement(plan, timeout_s=60)
    try:

        @ray.remote(num_cpus=0)
        def start_engine_probe(received) -> str:
            return _run_together([received.engine_scheduling(0)], num_cpus=1)[0]

        node = ray.get(start_engine_probe.remote(placement), timeout=60)
        assert node == placement.engine_node(0)
    finally:
        remove_placement(placement)


def test_a_run_on_one_node_binds_loopback_unless_an_engine_elsewhere_must_reach_it(local_ray):
    # One node: the engines and train ranks listen on loopback, not the machine's address.
    assert bind_host() == "127.0.0.1"
    assert bind_host(["http://127.0.0.1:30000", "http://localhost:30001"]) == "127.0.0.1"
    # All of 127.0.0.0/8 is this machine, as a train rank's rendezvous also takes it.
    assert bind_host(["http://127.0.0.2:30000", "http://[::1]:30001"]) == "127.0.0.1"
    # An external engine on another host joins trainer rank 0's weight-update group.
    assert bind_host(["http://127.0.0.1:30000", "http://10.0.0.7:30000"]) is None
