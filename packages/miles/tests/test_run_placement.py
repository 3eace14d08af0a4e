"""Placement on a Ray cluster with GPUs, seen from a driver without any (a CPU-only head node):
the run reserves GPU bundles, and each engine is told the GPU ids of all its bundles (Ray shows an
actor only its own bundle's GPU, so a multi-GPU engine would otherwise see one)."""

from __future__ import annotations

import pytest
import ray
import torch

from miles.config import load_config
from miles.ray.placement import (
    create_placement,
    plan_for_cluster,
    plan_placement,
    remove_placement,
)
from miles.ray.run import Run

FLAGS = ["--hf-checkpoint", "c", "--prompt-data", "d.jsonl", "--rollout-batch-size", "2",
         "--actor-num-gpus-per-node", "2", "--rollout-num-gpus", "1"]  # fmt: skip


@pytest.fixture(scope="module")
def cluster_with_gpus():
    if ray.is_initialized():
        ray.shutdown()
    # Ray counts these GPUs as resources only; torch in this driver sees none.
    ray.init(address="local", num_cpus=4, num_gpus=3, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a driver without GPUs")
def test_a_driver_without_gpus_reserves_the_clusters_gpus(cluster_with_gpus):
    config = load_config(FLAGS)
    has_gpus = Run(config)._join_ray()  # joins the running instance
    placement = create_placement(plan_for_cluster(config.cluster, use_gpus=has_gpus))
    try:
        assert has_gpus
        assert [bundle.get("GPU") for bundle in placement.plan.bundles] == [1.0, 1.0, 1.0]
        assert sorted(placement.bundle_devices) == ["0", "1", "2"]
        assert placement.engine_devices(0) == [placement.bundle_devices[2]]
    finally:
        remove_placement(placement)


@pytest.mark.parametrize("colocate", [False, True])
def test_a_two_gpu_engine_is_given_both_of_its_bundles_gpus(cluster_with_gpus, colocate):
    plan = plan_placement(
        actor_num_nodes=1, actor_num_gpus_per_node=1 if not colocate else 2,
        rollout_num_gpus=2, rollout_num_gpus_per_engine=2, colocate=colocate, use_gpus=True,
    )  # fmt: skip
    placement = create_placement(plan, timeout_s=60)
    try:
        engine = placement.engine_devices(0)
        assert len(engine) == len(set(engine)) == 2
        trainers = [placement.bundle_devices[b] for b in plan.actor_bundles]
        # Colocated, the engine drives the trainers' GPUs; otherwise GPUs of its own.
        assert (sorted(engine) == sorted(trainers)) if colocate else not set(engine) & set(trainers)
    finally:
        remove_placement(placement)
