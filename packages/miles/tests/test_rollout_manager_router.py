"""RolloutManager in front of two engines through the real sglang-router."""

from __future__ import annotations

import json

import httpx
import ray

from miles.config import load_config
from miles.ray.cluster import init_ray
from miles.ray.placement import create_placement, plan_placement, remove_placement
from miles.ray.rollout_manager import RolloutManager


def test_rollout_through_sglang_router_spreads_over_both_engines(tiny_checkpoint, tmp_path):
    data = tmp_path / "train.jsonl"
    data.write_text(
        "".join(json.dumps({"input": f"{i}+1=", "label": str(i + 1)}) + "\n" for i in range(8))
    )
    config = load_config([
        "--hf-checkpoint", str(tiny_checkpoint), "--prompt-data", str(data),
        "--rollout-batch-size", "8", "--n-samples-per-prompt", "2",
        "--rollout-max-response-len", "4", "--rm-type", "exact_match",
        "--rollout-num-gpus", "2", "--rollout-router", "sglang-router",
        "--output-dir", str(tmp_path / "run"),
    ])  # fmt: skip
    init_ray(num_cpus=4)
    plan = plan_placement(
        actor_num_nodes=1, actor_num_gpus_per_node=1, rollout_num_gpus=2,
        rollout_num_gpus_per_engine=1, colocate=False, use_gpus=False,
    )  # fmt: skip
    placement = create_placement(plan, timeout_s=60)
    manager = ray.remote(RolloutManager).options(num_cpus=0).remote(config, placement, dp_size=1)
    try:
        urls, _ = ray.get([manager.start_engines.remote(), manager.load_data.remote()], timeout=180)
        result = ray.get(manager.generate.remote(0), timeout=120)
        assert result["metrics"]["rollout/samples"] == 16
        router_url = ray.get(manager.__ray_call__.remote(lambda self: self.pool.router_url))
        assert router_url is not None and router_url not in urls  # requests went to the router
        finished = [_server_info(url)["finished_requests"] for url in urls]
        assert all(count > 0 for count in finished), finished  # and it used both engines
    finally:
        ray.get(manager.dispose.remote(), timeout=120)
        remove_placement(placement)
        ray.shutdown()


def _server_info(url: str) -> dict:
    return httpx.get(f"{url}/get_server_info", timeout=30).json()["internal_states"][0]
