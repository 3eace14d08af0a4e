"""Weight updates through every transport make the engine compute with the sender's weights;
bad updates are refused without changing anything; memory release really frees memory."""

from __future__ import annotations

import socket
import threading
from pathlib import Path

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from miles.backends.sglang_utils.client import SyncEngineClient
from miles.backends.sglang_utils.weight_sync import (
    DistributedWeightSender,
    TensorWeightSender,
    distributed_load_format,
    serialize_named_tensors,
)

PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]


def _engine_logprobs(url: str, max_new_tokens: int = 12) -> tuple[list[int], torch.Tensor, str]:
    result = httpx.post(
        f"{url}/generate",
        timeout=60,
        json={
            "input_ids": PROMPT,
            "return_logprob": True,
            "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens},
        },
    ).json()
    logprobs = torch.tensor(
        [entry[0] for entry in result["meta_info"]["output_token_logprobs"]], dtype=torch.float64
    )
    return result["output_ids"], logprobs, result["meta_info"]["weight_version"]


def _sender_logprobs(model, output_ids: list[int]) -> torch.Tensor:
    ids = torch.tensor([PROMPT + output_ids])
    with torch.no_grad():
        logits = model(ids).logits[0, len(PROMPT) - 1 : -1].double()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(output_ids)[:, None]).squeeze(-1)


def _assert_engine_matches(url: str, model) -> str:
    output_ids, engine, version = _engine_logprobs(url)
    torch.testing.assert_close(engine, _sender_logprobs(model, output_ids), atol=1e-5, rtol=0)
    return version


@pytest.fixture(scope="module")
def sender_model(other_checkpoint):
    return AutoModelForCausalLM.from_pretrained(other_checkpoint).eval()


@pytest.fixture(scope="module")
def private_engine(start_engine, tiny_checkpoint):
    """One engine for the update tests; each test starts from the original weights."""
    with start_engine(tiny_checkpoint) as url:
        yield url


@pytest.fixture
def fresh_engine(private_engine, tiny_checkpoint):
    response = httpx.post(
        f"{private_engine}/update_weights_from_disk",
        json={"model_path": str(tiny_checkpoint)},
        timeout=60,
    )
    assert response.json()["success"], response.text
    _assert_engine_matches(
        private_engine, AutoModelForCausalLM.from_pretrained(tiny_checkpoint).eval()
    )
    return private_engine


def test_update_from_tensor_through_shared_memory_in_buckets(fresh_engine, sender_model):
    with SyncEngineClient(fresh_engine) as client:
        sender = TensorWeightSender([client], max_bytes=64 * 1024, dtype=torch.float32)
        buckets = sender.send(sender_model.named_parameters(), weight_version="7")
        assert buckets > 1, "the byte budget should have split the model into several buckets"
        assert _assert_engine_matches(fresh_engine, sender_model) == "7"


def test_update_from_disk_loads_the_checkpoint_and_bumps_the_version(
    fresh_engine, other_checkpoint, sender_model
):
    url = fresh_engine
    before = httpx.get(f"{url}/get_model_info").json()["weight_version"]
    response = httpx.post(
        f"{url}/update_weights_from_disk", json={"model_path": str(other_checkpoint)}, timeout=60
    )
    assert response.json()["success"], response.text
    version = _assert_engine_matches(url, sender_model)
    assert int(version) == int(before) + 1


@pytest.mark.parametrize("load_format", [None, "flattened_bucket"])
def test_update_from_distributed_broadcast_group_on_gloo(fresh_engine, sender_model, load_format):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with SyncEngineClient(fresh_engine) as client:
        sender = DistributedWeightSender(
            [client],
            master_address="127.0.0.1",
            master_port=port,
            group_name=f"miles-test-{load_format}",
            backend="gloo",
            max_bytes=128 * 1024,
            dtype=torch.float32,
            load_format=load_format,
        )
        try:
            sender.connect()
            sender.send(sender_model.named_parameters(), weight_version="3")
            assert _assert_engine_matches(fresh_engine, sender_model) == "3"
        finally:
            sender.close()


def test_the_engine_says_it_reads_flat_buckets_and_refuses_one_of_two_dtypes(engine_url):
    with SyncEngineClient(engine_url) as client:
        assert distributed_load_format([client]) == "flattened_bucket"

    class SilentEngine:  # what an SGLang server's info says of load formats: nothing
        def get_server_info(self):
            return {"version": "0.5.0"}

    with SyncEngineClient(engine_url) as client:
        assert distributed_load_format([client, SilentEngine()]) is None
    # A flat bucket of two dtypes cannot be laid out; refused before any broadcast is awaited.
    body = {"names": ["a", "b"], "dtypes": ["float32", "bfloat16"], "shapes": [[1], [1]],
            "group_name": "none", "load_format": "flattened_bucket"}  # fmt: skip
    response = httpx.post(f"{engine_url}/update_weights_from_distributed", json=body, timeout=60)
    assert response.status_code == 400, response.text
    assert "one dtype" in response.json()["message"]


def test_bad_updates_are_refused_and_change_nothing(engine_url, tiny_checkpoint):
    base = AutoModelForCausalLM.from_pretrained(tiny_checkpoint).eval()
    for named, message in (
        ([("model.layers.0.mlp.gate_proj.wieght", torch.zeros(1))], "unknown"),
        ([("model.norm.weight", torch.zeros(3))], "shape"),
    ):
        response = httpx.post(
            f"{engine_url}/update_weights_from_tensor",
            timeout=60,
            json={"serialized_named_tensors": [serialize_named_tensors(named)]},
        )
        assert response.status_code == 400 and response.json()["success"] is False
        assert message in response.json()["message"]
    response = httpx.post(
        f"{engine_url}/update_weights_from_disk", json={"model_path": "/nonexistent"}, timeout=60
    )
    assert response.status_code == 400 and "no *.safetensors files" in response.json()["message"]
    _assert_engine_matches(engine_url, base)


def test_update_during_generation_keeps_in_flight_sequences_intact(fresh_engine, other_checkpoint):
    url = fresh_engine
    results = []
    body = {
        "input_ids": PROMPT,
        "sampling_params": {"temperature": 0, "max_new_tokens": 300, "ignore_eos": True},
    }
    thread = threading.Thread(
        target=lambda: results.append(httpx.post(f"{url}/generate", json=body, timeout=120).json())
    )
    thread.start()
    httpx.post(f"{url}/pause_generation", json={"mode": "in_place"}, timeout=30)
    response = httpx.post(
        f"{url}/update_weights_from_disk",
        json={"model_path": str(other_checkpoint)},
        timeout=60,
    )
    httpx.post(f"{url}/continue_generation", timeout=30)
    thread.join(120)
    assert response.json()["success"]
    assert len(results[0]["output_ids"]) == 300
    assert results[0]["meta_info"]["finish_reason"]["type"] == "length"


def _rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def test_release_and_resume_weights_frees_and_restores_memory(start_engine, tmp_path):
    from miles.backends.sglang_utils.tiny_checkpoint import build_tiny_checkpoint

    big = build_tiny_checkpoint(
        tmp_path / "big",
        hidden_size=512,
        intermediate_size=2048,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
    )
    with start_engine(big) as url:
        pid = httpx.get(f"{url}/get_server_info").json()["pid"]
        output_before, logprobs_before, _ = _engine_logprobs(url)
        resident = _rss_bytes(pid)
        assert httpx.post(
            f"{url}/release_memory_occupation", json={"tags": ["weights"]}, timeout=60
        ).json()["success"]
        released = _rss_bytes(pid)
        assert resident - released > 30 * 2**20, f"RSS went {resident} -> {released}"
        assert httpx.get(f"{url}/health_generate", timeout=30).status_code == 503
        assert httpx.post(f"{url}/generate", json={"input_ids": [1]}, timeout=30).status_code == 400
        assert httpx.post(
            f"{url}/resume_memory_occupation", json={"tags": ["weights"]}, timeout=60
        ).json()["success"]
        output_after, logprobs_after, _ = _engine_logprobs(url)
        assert output_after == output_before
        torch.testing.assert_close(logprobs_after, logprobs_before)
