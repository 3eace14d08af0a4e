"""The run reserves bundles of the cluster it joins, not of the driver's machine: a driver without
GPUs (a CPU-only head node) that joins a cluster with GPUs reserves GPU bundles."""

from __future__ import annotations

import pytest
import ray
import torch

from miles.config import load_config
from miles.ray.placement import remove_placement
from miles.ray.run import Run

FLAGS = ["--hf-checkpoint", "c", "--prompt-data", "d.jsonl", "--rollout-batch-size", "2",
         "--actor-num-gpus-per-node", "2", "--rollout-num-gpus", "1"]  # fmt: skip


@pytest.fixture
def cluster_with_gpus():
    if ray.is_initialized():
        ray.shutdown()
    # Ray counts these GPUs as resources only; torch in this driver sees none.
    ray.init(address="local", num_cpus=4, num_gpus=3, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a driver without GPUs")
def test_a_driver_without_gpus_reserves_the_clusters_gpus(cluster_with_gpus):
    run = Run(load_config(FLAGS))
    placement, has_gpus = run._reserve_placement()
    try:
        assert has_gpus
        assert [bundle.get("GPU") for bundle in placement.plan.bundles] == [1.0, 1.0, 1.0]
    finally:
        remove_placement(placement)
