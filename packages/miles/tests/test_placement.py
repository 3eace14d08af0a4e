"""Placement layout as a pure function of the config, and the bundle-to-node mapping (no Ray)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from miles.ray.placement import PlacementPlan, _logical_to_physical, plan_placement


def _plan(**overrides) -> PlacementPlan:
    kwargs = dict(
        actor_num_nodes=1,
        actor_num_gpus_per_node=4,
        rollout_num_gpus=4,
        rollout_num_gpus_per_engine=1,
        colocate=False,
        use_gpus=True,
    )
    return plan_placement(**{**kwargs, **overrides})


def test_colocated_trainers_and_engines_share_the_same_bundles():
    plan = _plan(actor_num_nodes=2, actor_num_gpus_per_node=2, colocate=True)
    assert len(plan.bundles) == 4
    assert plan.actor_bundles == [0, 1, 2, 3]
    assert plan.engine_bundles == [[0], [1], [2], [3]]
    assert plan.colocate


def test_colocated_rollout_num_gpus_defaults_to_the_train_devices():
    plan = _plan(rollout_num_gpus=None, rollout_num_gpus_per_engine=2, colocate=True)
    assert plan.engine_bundles == [[0, 1], [2, 3]]


def test_disaggregated_engines_get_bundles_after_the_trainers():
    plan = _plan(actor_num_gpus_per_node=2, rollout_num_gpus=3)
    assert len(plan.bundles) == 5
    assert plan.actor_bundles == [0, 1]
    assert plan.engine_bundles == [[2], [3], [4]]
    assert not plan.colocate


def test_multi_gpu_engines_take_consecutive_bundles():
    plan = _plan(actor_num_gpus_per_node=2, rollout_num_gpus=6, rollout_num_gpus_per_engine=3)
    assert plan.engine_bundles == [[2, 3, 4], [5, 6, 7]]
    assert plan.num_engines == 2


def test_gpu_bundles_reserve_a_gpu_and_cpus():
    plan = _plan(cpus_per_bundle=2)
    assert plan.bundles == [{"GPU": 1.0, "CPU": 2.0}] * 8
    assert plan.total_resources() == {"CPU": 16.0, "GPU": 8.0}


def test_gpu_bundles_may_reserve_no_cpu():
    assert _plan(cpus_per_bundle=0).bundles[0] == {"GPU": 1.0}


def test_without_gpus_each_worker_device_is_a_cpu_bundle():
    plan = _plan(use_gpus=False, cpus_per_bundle=0.5)
    assert plan.bundles == [{"CPU": 0.5}] * 8
    assert plan.total_resources() == {"CPU": 4.0}


@pytest.mark.parametrize(
    ("overrides", "words"),
    [
        ({"actor_num_nodes": 0}, ["--actor-num-nodes", "(0)"]),
        ({"actor_num_gpus_per_node": -1}, ["--actor-num-gpus-per-node", "(-1)"]),
        ({"actor_num_gpus_per_node": 1.5}, ["--actor-num-gpus-per-node", "1.5"]),
        ({"rollout_num_gpus_per_engine": 0}, ["--rollout-num-gpus-per-engine", "(0)"]),
        ({"rollout_num_gpus": 0}, ["--rollout-num-gpus", "(0)"]),
        ({"rollout_num_gpus": None}, ["--rollout-num-gpus", "--colocate", "required"]),
        (
            {"rollout_num_gpus": 2, "colocate": True},
            ["--rollout-num-gpus (2)", "--colocate", "(1 * 4 = 4)", "--rollout-num-gpus 4"],
        ),
        (
            {"rollout_num_gpus": 6, "rollout_num_gpus_per_engine": 4},
            ["--rollout-num-gpus (6)", "--rollout-num-gpus-per-engine (4)", "multiple of 4"],
        ),
        (
            {"colocate": True, "rollout_num_gpus_per_engine": 3},
            ["--rollout-num-gpus (4)", "--rollout-num-gpus-per-engine (3)"],
        ),
        ({"use_gpus": False, "cpus_per_bundle": 0}, ["--cpus-per-bundle (0)", "> 0"]),
        ({"cpus_per_bundle": -1}, ["--cpus-per-bundle (-1)"]),
        ({"cpus_per_bundle": float("nan")}, ["--cpus-per-bundle (nan)"]),
    ],
)
def test_invalid_combination_raises_naming_the_flags_and_values(overrides, words):
    with pytest.raises(ValueError) as error:
        _plan(**overrides)
    for word in words:
        assert word in str(error.value)


@given(
    actor_num_nodes=st.integers(1, 4),
    actor_num_gpus_per_node=st.integers(1, 8),
    engines=st.integers(1, 8),
    per_engine=st.integers(1, 4),
    colocate=st.booleans(),
    use_gpus=st.booleans(),
)
def test_every_bundle_is_used_with_matching_counts(
    actor_num_nodes, actor_num_gpus_per_node, engines, per_engine, colocate, use_gpus
):
    num_actor = actor_num_nodes * actor_num_gpus_per_node
    if colocate:
        if num_actor % per_engine:
            return
        rollout_num_gpus = num_actor
    else:
        rollout_num_gpus = engines * per_engine
    plan = plan_placement(
        actor_num_nodes=actor_num_nodes,
        actor_num_gpus_per_node=actor_num_gpus_per_node,
        rollout_num_gpus=rollout_num_gpus,
        rollout_num_gpus_per_engine=per_engine,
        colocate=colocate,
        use_gpus=use_gpus,
    )
    engine_flat = [b for bundles in plan.engine_bundles for b in bundles]
    assert len(plan.actor_bundles) == num_actor
    assert len(engine_flat) == rollout_num_gpus
    assert all(len(bundles) == per_engine for bundles in plan.engine_bundles)
    # Each role uses each bundle at most once ...
    assert len(set(plan.actor_bundles)) == num_actor
    assert len(set(engine_flat)) == rollout_num_gpus
    # ... and together they use every bundle, sharing them exactly when colocated.
    assert set(plan.actor_bundles) | set(engine_flat) == set(range(len(plan.bundles)))
    shared = set(plan.actor_bundles) & set(engine_flat)
    assert shared == (set(range(len(plan.bundles))) if colocate else set())
    assert all(("GPU" in bundle) == use_gpus for bundle in plan.bundles)


def test_disaggregated_trainers_fill_the_fullest_node_first():
    # Ray put 2 bundles on node "a" and 3 on "b"; 3 train ranks fit on "b" alone.
    plan = _plan(actor_num_gpus_per_node=3, rollout_num_gpus=2)
    nodes = ["a", "b", "a", "b", "b"]
    physical = _logical_to_physical(plan, nodes)
    assert sorted(physical) == list(range(5))
    assert [nodes[physical[b]] for b in plan.actor_bundles] == ["b", "b", "b"]
    assert [nodes[physical[b[0]]] for b in plan.engine_bundles] == ["a", "a"]


def test_disaggregated_ties_between_nodes_break_by_node_id():
    plan = _plan(actor_num_gpus_per_node=2, rollout_num_gpus=2)
    nodes = ["n2", "n1", "n2", "n1"]
    physical = _logical_to_physical(plan, nodes)
    assert physical == [1, 3, 0, 2]


def test_disaggregated_trainers_spanning_nodes_leave_engines_on_the_remainder():
    # 5 train ranks over nodes of 4 + 3 bundles: 4 on "x", 1 on "y", engines on "y".
    plan = _plan(actor_num_gpus_per_node=5, rollout_num_gpus=2)
    nodes = ["y", "x", "x", "y", "x", "y", "x"]
    physical = _logical_to_physical(plan, nodes)
    actor_nodes = [nodes[physical[b]] for b in plan.actor_bundles]
    assert actor_nodes == ["x", "x", "x", "x", "y"]
    assert [nodes[physical[b[0]]] for b in plan.engine_bundles] == ["y", "y"]


def test_colocated_order_is_sorted_by_node():
    plan = _plan(colocate=True)
    nodes = ["b", "a", "b", "a"]
    assert _logical_to_physical(plan, nodes) == [1, 3, 0, 2]


@given(nodes=st.lists(st.sampled_from("abcd"), min_size=2, max_size=12), data=st.data())
def test_trainers_use_the_fewest_nodes_possible(nodes, data):
    num_actor = data.draw(st.integers(1, len(nodes) - 1))
    plan = _plan(actor_num_gpus_per_node=num_actor, rollout_num_gpus=len(nodes) - num_actor)
    physical = _logical_to_physical(plan, nodes)
    assert sorted(physical) == list(range(len(nodes)))
    used = len({nodes[physical[b]] for b in plan.actor_bundles})
    sizes = sorted((nodes.count(n) for n in set(nodes)), reverse=True)
    fewest = next(k for k in range(1, len(sizes) + 1) if sum(sizes[:k]) >= num_actor)
    assert used == fewest
