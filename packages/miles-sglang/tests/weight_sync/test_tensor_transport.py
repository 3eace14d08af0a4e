"""Colocated transport: only handles travel, across unrelated processes, and nothing leaks."""

from __future__ import annotations

import base64
import gc
import json
import os
import pickle
import subprocess
import sys

import pytest
import torch

from miles.backends.sglang_utils.weight_sync import (
    deserialize_flattened_bucket,
    deserialize_named_tensors,
    flatten_bucket,
    serialize_flattened_bucket,
    serialize_named_tensors,
    share_tensor,
    unflatten_bucket,
)

# Run in a separate interpreter started by subprocess, not forked: like an engine HTTP server,
# it shares nothing with the sender but the host. It drops the tensors before it answers.
RECEIVER = """
import gc, json, sys
from miles.backends.sglang_utils.weight_sync import (
    deserialize_flattened_bucket, deserialize_named_tensors, unflatten_bucket)
named_payload, flat_payload = sys.stdin.read().split()
out = {}
for kind, named in [("named", deserialize_named_tensors(named_payload)),
                    ("flat", unflatten_bucket(deserialize_flattened_bucket(flat_payload)))]:
    out[kind] = [[n, str(t.dtype), list(t.shape), t.double().flatten().tolist()] for n, t in named]
    del named
gc.collect()
print(json.dumps(out))
"""


def _segments() -> set[str]:
    """This process's torch shared-memory segments (torch names them /torch_<pid>_...)."""
    return {f for f in os.listdir("/dev/shm") if f.startswith(f"torch_{os.getpid()}_")}


def _sample() -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    return [
        ("model.embed_tokens.weight", torch.randn(6, 4, generator=gen).to(torch.bfloat16)),
        ("model.layers.0.mlp.up_proj.weight", torch.randn(4, 3, generator=gen).t()),  # strided
        ("model.position_ids", torch.arange(5)),
        ("model.mask", torch.tensor([True, False, True])),
        ("model.empty", torch.empty(0, 2)),
    ]


def _assert_same(got, expected) -> None:
    assert [n for n, _ in got] == [n for n, _ in expected]
    for (_, g), (_, e) in zip(got, expected, strict=True):
        assert g.dtype == e.dtype and g.shape == e.shape and torch.equal(g, e)


def test_named_tensors_round_trip_in_process():
    named = _sample()
    _assert_same(deserialize_named_tensors(serialize_named_tensors(named)), named)


def test_flattened_bucket_round_trips_in_process():
    named = _sample()
    got = unflatten_bucket(
        deserialize_flattened_bucket(serialize_flattened_bucket(flatten_bucket(named)))
    )
    _assert_same(got, named)


def test_payload_is_ascii_and_carries_handles_not_data():
    big = torch.randn(256, 256)  # 256 KiB of data
    payload = serialize_named_tensors([("w", big)])
    assert payload.isascii() and len(payload) < 2048


def test_sharing_copies_a_private_tensor_and_never_moves_the_callers_storage():
    param = torch.nn.Parameter(torch.randn(8))
    before = param.data_ptr()
    shared = share_tensor(param)
    assert shared.is_shared() and not param.is_shared()
    assert param.data_ptr() == before and shared.data_ptr() != before
    assert torch.equal(shared, param.detach()) and not shared.requires_grad
    assert share_tensor(shared).data_ptr() == shared.data_ptr()  # already shared: no copy


def test_unrelated_process_reads_the_tensors_and_no_segment_outlives_the_transfer():
    baseline = _segments()
    named = _sample()
    named_payload = serialize_named_tensors(named)
    flat_payload = serialize_flattened_bucket(flatten_bucket(named))
    assert _segments() - baseline, "the tensors should sit in /dev/shm while in flight"
    result = subprocess.run(
        [sys.executable, "-c", RECEIVER],
        input=f"{named_payload}\n{flat_payload}",
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 0, result.stderr
    received = json.loads(result.stdout)
    expected = [[n, str(t.dtype), list(t.shape), t.double().flatten().tolist()] for n, t in named]
    assert received["named"] == expected
    assert received["flat"] == expected
    del named_payload, flat_payload
    gc.collect()
    assert _segments() == baseline


def test_a_payload_is_single_use():
    payload = serialize_named_tensors([("w", torch.ones(3))])
    deserialize_named_tensors(payload)
    gc.collect()  # receiver and sender both dropped the tensor: the segment is gone
    with pytest.raises(ValueError, match="deserialize each payload once"):
        deserialize_named_tensors(payload)


class _Evil:
    def __reduce__(self):
        return (print, ("this must never run",))


@pytest.mark.parametrize(
    ("payload", "match"),
    [
        ("not base64 !!", "not valid base64"),
        (base64.b64encode(b"not a pickle").decode(), "not a weight-sync pickle"),
        (base64.b64encode(pickle.dumps(_Evil())).decode(), "builtins.print is not allowed"),
        (base64.b64encode(pickle.dumps([1, 2])).decode(), "not a list of \\(name, tensor\\) pairs"),
        (123, "must be a base64 string"),
    ],
)
def test_bad_named_payload_raises_value_error(payload, match, capsys):
    with pytest.raises(ValueError, match=match):
        deserialize_named_tensors(payload)
    assert "must never run" not in capsys.readouterr().out


def test_payloads_of_the_other_format_are_rejected_with_the_fix():
    named = [("w", torch.ones(2))]
    with pytest.raises(ValueError, match="load_format='flattened_bucket'"):
        deserialize_named_tensors(serialize_flattened_bucket(flatten_bucket(named)))
    with pytest.raises(ValueError, match="load_format=None"):
        deserialize_flattened_bucket(serialize_named_tensors(named))
    bad_meta = {"flat": {}, "metadata": [("w", "float32")]}
    with pytest.raises(ValueError, match="metadata must be"):
        deserialize_flattened_bucket(base64.b64encode(pickle.dumps(bad_meta)).decode())


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_tensors_travel_as_ipc_handles_to_an_unrelated_process():
    named = [(n, t.cuda()) for n, t in _sample()]
    named_payload = serialize_named_tensors(named)
    flat_payload = serialize_flattened_bucket(flatten_bucket(named))
    result = subprocess.run(
        [sys.executable, "-c", RECEIVER],
        input=f"{named_payload}\n{flat_payload}",
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    expected = [[n, str(t.dtype), list(t.shape), t.double().flatten().tolist()] for n, t in named]
    assert json.loads(result.stdout) == {"named": expected, "flat": expected}
