"""The start-up check of external engines (--rollout-external-engine-addrs): a real reference
engine serving the checkpoint passes; one serving another model, and an address where nothing
answers, are refused naming the engine and the fix."""

from __future__ import annotations

import asyncio
import time

import pytest

from miles.backends.sglang_utils.server_process import free_port
from miles.ray.external_engines import (
    ExternalEngineError,
    check_external_engines,
    serves_checkpoint,
)


def test_a_local_model_path_must_be_the_checkpoints_directory(tmp_path):
    checkpoint, other = tmp_path / "tiny-qwen3", tmp_path / "other"
    checkpoint.mkdir()
    other.mkdir()
    (tmp_path / "link").symlink_to(checkpoint)
    assert serves_checkpoint(str(tmp_path / "link"), str(checkpoint))
    assert serves_checkpoint(f"{checkpoint}/", str(checkpoint))
    assert not serves_checkpoint(str(other), str(checkpoint))
    # Same name, but another directory of this host: another model.
    (other / "tiny-qwen3").mkdir()
    assert not serves_checkpoint(str(other / "tiny-qwen3"), str(checkpoint))


def test_a_path_this_host_lacks_or_a_hub_id_is_compared_by_name(tmp_path):
    checkpoint = tmp_path / "Qwen3-0.6B"
    checkpoint.mkdir()
    assert serves_checkpoint("/models/on/the/engine/host/Qwen3-0.6B", str(checkpoint))
    assert serves_checkpoint("Qwen/Qwen3-0.6B", str(checkpoint))
    assert serves_checkpoint("/models/Qwen3-0.6B", "Qwen/Qwen3-0.6B")
    assert not serves_checkpoint("Qwen/Qwen3-8B", str(checkpoint))


def test_an_engine_serving_the_checkpoint_passes(engine_url, tiny_checkpoint):
    asyncio.run(check_external_engines([engine_url], hf_checkpoint=str(tiny_checkpoint),
                                       admin_key=None, timeout_s=30))  # fmt: skip


def test_an_engine_serving_another_model_is_refused_naming_both(engine_url, tmp_path):
    other = tmp_path / "other-model"
    other.mkdir()
    with pytest.raises(ExternalEngineError) as caught:
        asyncio.run(check_external_engines([engine_url], hf_checkpoint=str(other),
                                           admin_key=None, timeout_s=30))  # fmt: skip
    message = str(caught.value)
    assert message.startswith(f"external engine {engine_url} serves '")
    assert f"not --hf-checkpoint {other}" in message
    assert f"start the engine with --model-path {other}" in message


def test_an_address_where_nothing_answers_is_refused_within_the_bound(tiny_checkpoint):
    url = f"http://127.0.0.1:{free_port()}"
    started = time.monotonic()
    with pytest.raises(ExternalEngineError) as caught:
        asyncio.run(check_external_engines([url], hf_checkpoint=str(tiny_checkpoint),
                                           admin_key=None, timeout_s=1.0))  # fmt: skip
    assert time.monotonic() - started < 10
    message = str(caught.value)
    assert message.startswith(f"external engine {url} (--rollout-external-engine-addrs) cannot "
                              "generate: ")  # fmt: skip
    assert message.endswith("start it first, or fix its address")
