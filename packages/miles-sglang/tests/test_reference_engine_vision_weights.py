"""Weight updates into a vision-language engine in the checkpoint's hub layout, the names SGLang's
loaders take (Qwen2.5-VL: `visual.*`, `model.layers.*`; Qwen3-VL: `model.visual.*`,
`model.language_model.*`), vision tower included, through every transport: afterwards the engine
scores an image prompt as a float64 forward of the sent model does (within 1e-5)."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForImageTextToText

from miles.backends.sglang_utils.client import SyncEngineClient
from miles.backends.sglang_utils.weight_sync import DistributedWeightSender, TensorWeightSender

from .vision_support import (
    data_url,
    float64_model,
    processor_inputs,
    reference_logprobs,
    shapes_image,
)

ATOL = 1e-5
SAMPLING = {"max_new_tokens": 5, "temperature": 1.0, "seed": 7, "ignore_eos": True}
# The tower's and the language model's first layers under the hub's names.
HUB_NAMES = {
    "qwen2_5_vl": ("visual.blocks.0.", "model.layers.0."),
    "qwen3_vl": ("model.visual.blocks.0.", "model.language_model.layers.0."),
}


@pytest.fixture(scope="module")
def perturbed(vlm, tmp_path_factory) -> Path:
    """The checkpoint with every weight moved (the vision tower's too), saved in its hub layout."""
    model = AutoModelForImageTextToText.from_pretrained(vlm.path)
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.05)
    path = tmp_path_factory.mktemp("perturbed")
    model.save_pretrained(path)
    return path


@pytest.fixture
def restore(vlm):
    """Puts the checkpoint's weights back: the other vision tests share the engine."""
    yield
    response = vlm.client.post("/update_weights_from_disk", json={"model_path": str(vlm.path)})
    assert response.json()["success"], response.text


def _assert_engine_serves(vlm, weights: Path) -> None:
    image = shapes_image("red")
    inputs = processor_inputs(vlm, "how many circles?", [image])
    body = {"input_ids": inputs["input_ids"][0].tolist(), "image_data": data_url(image),
            "return_logprob": True, "sampling_params": SAMPLING}  # fmt: skip
    answer = vlm.client.post("/generate", json=body).json()
    served = torch.tensor([e[0] for e in answer["meta_info"]["output_token_logprobs"]]).double()
    _, expected = reference_logprobs(float64_model(weights), inputs, answer["output_ids"])
    torch.testing.assert_close(served, expected, atol=ATOL, rtol=0)
    _, before = reference_logprobs(vlm.reference, inputs, answer["output_ids"])
    assert (expected - before).abs().max() > 1e-2, "the perturbation must show in the log-probs"


def _hub_tensors(path: Path, architecture: str) -> list[tuple[str, torch.Tensor]]:
    named = sorted(load_file(str(path / "model.safetensors")).items())
    names = [name for name, _ in named]
    for prefix in HUB_NAMES[architecture]:
        assert any(name.startswith(prefix) for name in names), (prefix, names[:4])
    return named


def test_hub_named_tensors_through_shared_memory(vlm, perturbed, restore):
    named = _hub_tensors(perturbed, vlm.engine.model_config.model_type)
    with SyncEngineClient(str(vlm.client.base_url)) as client:
        sender = TensorWeightSender([client], max_bytes=256 * 1024, dtype=torch.float32)
        assert sender.send(named, weight_version="5") > 1
    _assert_engine_serves(vlm, perturbed)


def test_hub_named_tensors_through_a_broadcast_group(vlm, perturbed, restore):
    named = _hub_tensors(perturbed, vlm.engine.model_config.model_type)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with SyncEngineClient(str(vlm.client.base_url)) as client:
        sender = DistributedWeightSender(
            [client], master_address="127.0.0.1", master_port=port, group_name="vlm-test",
            backend="gloo", max_bytes=256 * 1024, dtype=torch.float32,
        )  # fmt: skip
        try:
            sender.connect()
            sender.send(named, weight_version="6")
        finally:
            sender.close()
    _assert_engine_serves(vlm, perturbed)


def test_a_hub_checkpoint_from_disk(vlm, perturbed, restore):
    response = vlm.client.post("/update_weights_from_disk", json={"model_path": str(perturbed)})
    assert response.json()["success"], response.text
    _assert_engine_serves(vlm, perturbed)
