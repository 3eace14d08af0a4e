"""Adapter-mode weight sync (`weight_sync.lora_updater`) end to end: two train ranks (a real gloo
group) push a PEFT adapter to a running engine, version after version; the engine then computes
what PEFT computes with those weights, labels its answers with the version, and only the newest
version's directory is left."""

from __future__ import annotations

import os

import httpx
import pytest
import torch
import torch.distributed as dist

from miles.backends.sglang_utils.weight_sync import (
    UpdateLoraAdapter,
    WeightSyncError,
    make_lora_adapter_updater,
)

from .lora_support import (
    LORA_ADMIN_KEY,
    adapter_tensors,
    engine_token_logprobs,
    make_peft_model,
    model_token_logprobs,
)
from .weight_sync.multiprocess import free_port, run_processes

PROMPT = [72, 101, 108, 108, 111, 44, 32, 119]
ADAPTER = "policy"


def _push_each_version(
    rank: int, url: str, port: int, sync_dir: str, config: dict, versions: list
) -> list[dict]:
    """Rank `rank` of 2 pushes every (version, tensors); rank 0 reports what the engine then
    serves and what `sync_dir` holds, each rank what its update returned or raised."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)  # fmt: skip
    current: dict[str, torch.Tensor] = {}

    def tensors():
        for name, tensor in current.items():
            dist.all_reduce(torch.zeros(1))  # a collective per tensor, as a gather of shards is
            yield name, tensor

    updater = make_lora_adapter_updater(
        tensors, config, engine_urls=[url], rank=rank, world_size=2, sync_dir=sync_dir,
        adapter_name=ADAPTER, api_key=LORA_ADMIN_KEY,
    )  # fmt: skip
    reports = []
    try:
        for version, named in versions:
            current = named
            try:
                report = {"bytes": updater.update(version)}
            except (WeightSyncError, RuntimeError) as err:
                report = {"error": f"{type(err).__name__}: {err}"}
            if rank == 0:
                report |= _engine_state(url, sync_dir)
            reports.append(report)
    finally:
        updater.shutdown()
        dist.destroy_process_group()
    return reports


def _engine_state(url: str, sync_dir: str) -> dict:
    """What the engine answers now: its weight version, and its log-probs with the adapter while
    one of that name is loaded."""
    with httpx.Client(base_url=url, timeout=60) as engine:
        base = engine.post("/generate", json={"input_ids": PROMPT,
                                              "sampling_params": {"max_new_tokens": 1}})  # fmt: skip
        state = {"dirs": sorted(os.listdir(sync_dir)),
                 "weight_version": base.json()["meta_info"]["weight_version"]}  # fmt: skip
        loaded = engine.post("/generate", json={"input_ids": PROMPT, "lora_path": ADAPTER,
                                                "sampling_params": {"max_new_tokens": 1}})  # fmt: skip
        if loaded.status_code == 200:
            state["logprobs"] = engine_token_logprobs(engine, PROMPT, lora_path=ADAPTER).tolist()
    return state


def test_two_ranks_push_adapter_versions_that_the_engine_then_serves_as_peft_does(
    lora_engine, tiny_checkpoint, tmp_path
):
    engine, client = lora_engine
    first = make_peft_model(tiny_checkpoint, rank=4, alpha=8, seed=11)
    second = make_peft_model(tiny_checkpoint, rank=4, alpha=8, seed=12)
    # Rank-16 matrices under the config's r = 4: a version the engine refuses.
    mismatched = make_peft_model(tiny_checkpoint, rank=16, alpha=8, seed=13)
    config = first.peft_config["default"].to_dict()
    versions = [("1", dict(adapter_tensors(first))), ("2", dict(adapter_tensors(second))),
                ("3", dict(adapter_tensors(mismatched)))]  # fmt: skip
    url = str(client.base_url).rstrip("/")
    sync_dir = str(tmp_path / "adapters")
    reports = run_processes(
        _push_each_version, 2, url, free_port(), sync_dir, config, versions, timeout_s=180
    )
    v1, v2, v3 = reports[0]
    for model, pushed, version in ((first, v1, "1"), (second, v2, "2")):
        served = torch.tensor(pushed["logprobs"])
        torch.testing.assert_close(served, model_token_logprobs(model, PROMPT), rtol=0, atol=1e-4)
        assert pushed["weight_version"] == version
        assert pushed["dirs"] == [f"{ADAPTER}-v{version}"]  # the older version's directory went
        assert pushed["bytes"] > 0
    assert [r["bytes"] for r in reports[1][:2]] == [0, 0]  # rank 1 wrote nothing
    # A version the engine refuses fails the update on both ranks, after generation resumed.
    assert "expected (r, in_features) and (out_features, r) with the config's r = 4" in v3["error"]
    assert "failed on another rank" in reports[1][2]["error"]
    assert not engine.scheduler.paused
    assert v3["dirs"] == [f"{ADAPTER}-v2", f"{ADAPTER}-v3"]  # kept until a version loads


def test_an_updater_refuses_a_config_that_is_not_a_lora_adapters(tmp_path):
    config = {"peft_type": "PREFIX_TUNING", "r": 4}
    with pytest.raises(ValueError, match="adapter mode syncs LORA adapters"):
        UpdateLoraAdapter(iter, [], adapter_config=config, sync_dir=str(tmp_path),
                          adapter_name=ADAPTER, require_clients=False)  # fmt: skip
    with pytest.raises(ValueError, match="without path separators"):
        UpdateLoraAdapter(iter, [], adapter_config={"peft_type": "LORA", "r": 4, "lora_alpha": 8,
                          "target_modules": ["q_proj"]}, sync_dir=str(tmp_path),
                          adapter_name="a/b", require_clients=False)  # fmt: skip


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device and sglang")
def test_sglang_serves_a_pushed_adapter_as_peft_does(tiny_checkpoint, tmp_path):
    """Adapter mode against a real SGLang server, launched as `SGLangEngineLauncher` launches one
    for a LoRA run (--enable-lora --max-lora-rank --lora-target-modules): after each push, its
    log-probs with the adapter are PEFT's (within float32 GPU kernels' error), and it labels its
    answers with the version."""
    from miles.backends.sglang_utils.engine_launcher import EngineLaunchSpec
    from miles.backends.sglang_utils.engine_launchers import SGLangEngineLauncher

    spec = EngineLaunchSpec(
        model_path=str(tiny_checkpoint), dtype="float32", mem_fraction_static=0.2, random_seed=0,
        enable_lora=True, max_lora_rank=8, lora_target_modules=["q_proj", "v_proj", "down_proj"],
        extra_args={"disable-cuda-graph": True},
    )  # fmt: skip
    launcher = SGLangEngineLauncher(spec)
    url = launcher.start()
    try:
        first = make_peft_model(tiny_checkpoint, rank=4, alpha=8, seed=11)
        second = make_peft_model(tiny_checkpoint, rank=4, alpha=8, seed=12)
        current = {}
        updater = make_lora_adapter_updater(
            lambda: iter(current.items()), first.peft_config["default"].to_dict(),
            engine_urls=[url], rank=0, world_size=1, sync_dir=str(tmp_path / "adapters"),
            adapter_name=ADAPTER,
        )  # fmt: skip
        with httpx.Client(base_url=url, timeout=120) as engine:
            for version, model in (("1", first), ("2", second)):
                current = dict(adapter_tensors(model))
                assert updater.update(version) > 0
                served = engine_token_logprobs(engine, PROMPT, lora_path=ADAPTER)
                expected = model_token_logprobs(model, PROMPT)
                torch.testing.assert_close(served, expected, rtol=0, atol=2e-2)
                with model.disable_adapter():  # the adapter's effect is far above that error
                    assert (expected - model_token_logprobs(model, PROMPT)).abs().max() > 0.1
                base = engine.post("/generate", json={"input_ids": PROMPT,
                                                      "sampling_params": {"max_new_tokens": 1}})  # fmt: skip
                assert base.json()["meta_info"]["weight_version"] == version
            assert sorted(os.listdir(tmp_path / "adapters")) == [f"{ADAPTER}-v2"]
        updater.shutdown()
    finally:
        launcher.shutdown()
