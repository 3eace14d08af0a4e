"""RolloutManager end to end on real Ray: engines in their bundles, locked with the run's admin
key, a rollout, eval, state, dispose; and the launch settings of each engine."""

from __future__ import annotations

import json
import os
import signal
import time

import httpx
import pytest
import ray

from miles.config import load_config
from miles.ray.cluster import init_ray
from miles.ray.engine_fleet import engine_launch_spec
from miles.ray.placement import create_placement, plan_placement, remove_placement
from miles.ray.rollout_manager import RolloutManager
from miles.ray.run import RolloutManagerTimeoutError, Run
from miles.utils.checkpoint_layout import POINTER_FILE, rollout_state_path

GROUP = 2
PROMPTS = 4


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "train.jsonl"
    rows = [{"input": f"{a}+{a}=", "label": str(2 * a)} for a in range(10)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def manager(tiny_checkpoint, prompt_file, tmp_path_factory):
    """A RolloutManager actor with two reference engines in a real placement group."""
    out = tmp_path_factory.mktemp("run")
    config = load_config([
        "--hf-checkpoint", str(tiny_checkpoint), "--prompt-data", str(prompt_file),
        "--rollout-batch-size", str(PROMPTS), "--n-samples-per-prompt", str(GROUP),
        "--rollout-max-response-len", "4", "--rm-type", "exact_match",
        "--actor-num-gpus-per-node", "2", "--rollout-num-gpus", "2",
        "--rollout-router", "builtin", "--save", str(out / "ckpt"),
        "--eval-prompt-data", "heldout", str(prompt_file), "--n-samples-per-eval-prompt", "2",
        "--output-dir", str(out),
    ])  # fmt: skip
    init_ray(num_cpus=4)
    plan = plan_placement(
        actor_num_nodes=1, actor_num_gpus_per_node=2, rollout_num_gpus=2,
        rollout_num_gpus_per_engine=1, colocate=False, use_gpus=False,
    )  # fmt: skip
    placement = create_placement(plan, timeout_s=60)
    actor = ray.remote(RolloutManager).options(num_cpus=0).remote(config, placement, dp_size=2)
    urls, _ = ray.get([actor.start_engines.remote(), actor.load_data.remote()], timeout=180)
    yield actor, urls, config, placement
    ray.get(actor.dispose.remote(), timeout=120)
    remove_placement(placement)
    ray.shutdown()


def test_each_engine_gets_its_own_server(manager):
    actor, urls, *_ = manager
    assert len(urls) == 2 and len(set(urls)) == 2
    assert ray.get(actor.get_engine_urls.remote()) == urls


def test_the_engines_of_a_run_refuse_admin_calls_without_its_key(manager):
    actor, urls, *_ = manager
    key = ray.get(actor.engine_admin_key.remote())
    for url in urls:
        assert httpx.post(f"{url}/flush_cache", timeout=30).status_code == 401
        wrong = {"Authorization": "Bearer guessed"}
        assert httpx.post(f"{url}/abort_request", json={}, headers=wrong).status_code == 401
        admin = {"Authorization": f"Bearer {key}"}
        assert httpx.post(f"{url}/flush_cache", headers=admin, timeout=30).status_code == 200
        assert key not in httpx.get(f"{url}/get_server_info", timeout=30).text
    assert len(key) >= 32  # secrets.token_urlsafe(32): not guessable


def test_rollout_gives_group_normalized_shards_per_dp_rank(manager):
    actor, *_ = manager
    result = ray.get(actor.generate.remote(0), timeout=120)
    shards = ray.get(result["data"])
    assert len(shards) == 2
    rows = sum(len(s["tokens"]) for s in shards)
    assert rows == PROMPTS * GROUP
    assert all(len(s["tokens"]) == PROMPTS * GROUP // 2 for s in shards)
    merged = {}
    for shard in shards:
        for index, reward in zip(shard["sample_indices"], shard["rewards"], strict=True):
            merged[index] = reward
        for tokens, length, log_probs in zip(
            shard["tokens"], shard["response_lengths"], shard["rollout_log_probs"], strict=True
        ):
            assert 1 <= length <= 4 and len(log_probs) == length and len(tokens) > length
    # grpo: rewards are normalized within each group of consecutive sample indices.
    for group in range(PROMPTS):
        values = [merged[group * GROUP + i] for i in range(GROUP)]
        assert abs(sum(values)) < 1e-6
    metrics = result["metrics"]
    assert metrics["rollout/samples"] == PROMPTS * GROUP
    assert "rollout/reward_mean" in metrics and metrics["reward/failures"] == 0


def test_eval_reports_mean_reward_and_pass_at_k(manager):
    actor, *_ = manager
    metrics = ray.get(actor.eval.remote(0), timeout=120)
    assert {"eval/heldout/reward_mean", "eval/heldout/pass@1", "eval/heldout/pass@2"} <= set(
        metrics
    )
    assert metrics["eval/heldout/samples"] == 10 * 2


def test_offload_and_onload_engines(manager):
    actor, *_ = manager
    ray.get(actor.offload.remote(), timeout=60)
    ray.get(actor.onload.remote(), timeout=60)
    assert ray.get(actor.generate.remote(1), timeout=120)["metrics"]["rollout/samples"] == 8


def test_data_source_state_is_saved_and_restored(manager):
    actor, _, config, _ = manager
    path = ray.get(actor.save.remote(5))
    assert path == rollout_state_path(config.checkpoint.save, 5)
    assert ray.get(actor.load.remote()) is None  # no pointer yet: the checkpoint is incomplete
    (path.parent.parent / POINTER_FILE).write_text("5\n")
    assert ray.get(actor.load.remote()) == 5


def test_dispose_stops_every_engine(manager):  # last: it ends the shared manager's engines
    actor, *_ = manager
    pids = ray.get(actor.engine_pids.remote())
    assert len(pids) == 2 and all(_alive(pid) for pid in pids)
    ray.get(actor.dispose.remote(), timeout=120)
    assert not any(_alive(pid) for pid in pids)


def test_a_hung_manager_is_named_by_the_driver_within_its_bound(
    manager, tiny_checkpoint, prompt_file, tmp_path
):
    # A manager of its own (stopping the shared one would hang the tests after this one).
    hung_config = load_config([
        "--hf-checkpoint", str(tiny_checkpoint), "--prompt-data", str(prompt_file),
        "--rollout-batch-size", "2", "--rm-type", "exact_match", "--output-dir", str(tmp_path),
        "--rollout-manager-timeout-s", "1.5",
    ])  # fmt: skip
    actor = ray.remote(RolloutManager).options(num_cpus=0).remote(hung_config, None, dp_size=1)
    run = Run(hung_config)
    run.rollout_manager, run._manager_place = actor, actor.where.remote()
    pid = int(ray.get(run._manager_place, timeout=60).split()[1])
    os.kill(pid, signal.SIGSTOP)
    try:
        start = time.monotonic()
        with pytest.raises(
            RolloutManagerTimeoutError,
            match=rf"^the rollout manager \(pid {pid} on node .*\) did not answer a liveness "
            r"check within --rollout-manager-timeout-s 1.5 s: it is hung",
        ):
            run._await_manager(actor.generate.remote(0))  # waits as on a rollout
        assert time.monotonic() - start < 6.0  # 1 s poll + 1.5 s bound + naming it, loaded CI
        with pytest.raises(RolloutManagerTimeoutError, match=r"did not answer save within .* \+ "):
            run._from_manager(actor.save.remote(0), "save", engine_wait_s=0.5)
    finally:
        os.kill(pid, signal.SIGCONT)
        ray.kill(actor)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.parametrize(
    ("engine", "flags", "expected_extra"),
    [
        ("sglang", ["--colocate"], {"enable-memory-saver": True}),
        ("sglang", ["--colocate", "--sglang-context-length", "64"],
         {"context-length": "64", "enable-memory-saver": True}),
        ("sglang", ["--rollout-num-gpus", "1"], {}),
        ("reference", ["--colocate"], {}),
    ],
)  # fmt: skip
def test_colocated_sglang_engines_start_with_the_memory_saver(
    engine, flags, expected_extra, tmp_path
):
    # Without it SGLang "releases" its memory by keeping it, and the colocated trainer runs out.
    config = load_config([
        "--hf-checkpoint", "c", "--prompt-data", "d.jsonl", "--rollout-batch-size", "2",
        "--actor-num-gpus-per-node", "2", "--seed", "5", *flags,
    ])  # fmt: skip
    spec = engine_launch_spec(config, engine, 1, tmp_path)
    assert spec["extra_args"] == expected_extra
    assert spec["random_seed"] == 6 and spec["log_path"] == str(tmp_path / "engine_1.log")


def test_engines_record_routed_experts_when_the_requests_ask_for_them(tmp_path):
    # Without --enable-return-routed-experts an engine refuses such a request (400).
    def spec(*flags: str) -> bool:
        config = load_config([
            "--hf-checkpoint", "c", "--prompt-data", "d.jsonl", "--rollout-batch-size", "2",
            *flags,
        ])  # fmt: skip
        return engine_launch_spec(config, "reference", 0, tmp_path)["return_routed_experts"]

    assert spec("--return-routed-experts")
    assert not spec()


def test_engines_serve_the_trained_adapter_only_with_lora_adapter_sync(tiny_checkpoint, tmp_path):
    from miles.ray.engine_fleet import check_adapter_serving, served_adapter

    def config(*flags: str):
        return load_config([
            "--hf-checkpoint", str(tiny_checkpoint), "--prompt-data", "d.jsonl",
            "--rollout-batch-size", "2", *flags,
        ])  # fmt: skip

    adapter = config("--lora-rank", "8", "--lora-sync", "adapter", "--target-modules", "q_proj")
    spec = engine_launch_spec(adapter, "reference", 0, tmp_path)
    assert (spec["enable_lora"], spec["max_lora_rank"], spec["lora_target_modules"]) == (
        True, 8, ["q_proj"],
    )  # fmt: skip
    assert served_adapter(adapter) == "miles-policy"
    all_linear = engine_launch_spec(
        config("--lora-rank", "4", "--lora-sync", "adapter"), "sglang", 0, tmp_path
    )
    assert all_linear["lora_target_modules"] == ["all"]  # SGLang's name for every projection
    for merged in (config("--lora-rank", "8"), config()):
        assert "enable_lora" not in engine_launch_spec(merged, "reference", 0, tmp_path)
        assert served_adapter(merged) is None
    fully_async = config(
        "--lora-rank", "8", "--lora-sync", "adapter", "--fully-async", "--rollout-num-gpus",
        "1", "--off-policy-correction", "tis",
    )  # fmt: skip
    check_adapter_serving(fully_async, "reference")
    with pytest.raises(ValueError, match=r"use --lora-sync merged with --fully-async"):
        check_adapter_serving(fully_async, "sglang")
