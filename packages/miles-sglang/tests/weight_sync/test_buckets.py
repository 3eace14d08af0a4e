"""Bucketing bounds bytes and memory; flattening round-trips exactly."""

from __future__ import annotations

import weakref

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from miles.backends.sglang_utils.weight_sync import (
    FlattenedBucket,
    TensorMeta,
    dtype_from_name,
    dtype_name,
    flatten_bucket,
    iter_buckets,
    iter_buckets_with_last,
    unflatten_bucket,
)

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.bool]


def _nbytes(bucket) -> int:
    return sum(t.numel() * t.element_size() for _, t in bucket)


def _named(sizes: list[int], dtype=torch.float32) -> list[tuple[str, torch.Tensor]]:
    return [(f"w{i}", torch.arange(n, dtype=dtype)) for i, n in enumerate(sizes)]


@pytest.mark.parametrize("max_bytes", [0, -5])
def test_max_bytes_below_one_is_rejected_at_the_call_naming_the_flag(max_bytes):
    with pytest.raises(ValueError, match="--update-weight-buffer-size"):
        iter_buckets([], max_bytes=max_bytes)
    with pytest.raises(ValueError, match="--update-weight-buffer-size"):
        iter_buckets_with_last([], max_bytes=max_bytes)


def test_cast_to_a_non_floating_dtype_is_rejected():
    with pytest.raises(ValueError, match="floating-point"):
        iter_buckets([], max_bytes=10, dtype=torch.int8)


@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.integers(0, 40), max_size=12), max_bytes=st.integers(1, 100))
def test_buckets_keep_order_and_stay_within_max_bytes_unless_one_tensor_is_larger(sizes, max_bytes):
    named = _named(sizes)  # float32: 4 bytes per element
    buckets = list(iter_buckets(named, max_bytes=max_bytes))
    assert [n for b in buckets for n, _ in b] == [n for n, _ in named]
    for i, bucket in enumerate(buckets):
        assert _nbytes(bucket) <= max_bytes or len(bucket) == 1
        if i + 1 < len(buckets):  # greedy: the next tensor really did not fit
            assert _nbytes(bucket) + _nbytes(buckets[i + 1][:1]) > max_bytes


def test_tensor_larger_than_max_bytes_travels_alone():
    named = _named([1, 100, 1])
    buckets = list(iter_buckets(named, max_bytes=16))
    assert [[n for n, _ in b] for b in buckets] == [["w0"], ["w1"], ["w2"]]


def test_only_floating_tensors_are_cast_and_sized_after_the_cast():
    named = [
        ("w", torch.ones(4, dtype=torch.float32)),
        ("ids", torch.arange(4)),
        ("mask", torch.ones(4, dtype=torch.bool)),
    ]
    (bucket,) = iter_buckets(named, max_bytes=8 + 32 + 4, dtype=torch.bfloat16)
    assert [t.dtype for _, t in bucket] == [torch.bfloat16, torch.int64, torch.bool]
    assert _nbytes(bucket) == 8 + 32 + 4


def test_only_the_last_bucket_is_marked_last():
    flags = [last for _, last in iter_buckets_with_last(_named([4, 4, 4]), max_bytes=16)]
    assert flags == [False, False, True]
    assert list(iter_buckets_with_last([], max_bytes=16)) == []


def test_buckets_are_built_lazily_and_one_at_a_time():
    """The input is pulled one tensor ahead at most, and a dropped bucket is freed before the next fills."""
    pulled: list[int] = []
    alive_at_pull: list[int] = []
    previous: list[weakref.ref] = []

    def source():
        for i in range(12):
            alive_at_pull.append(sum(r() is not None for r in previous))
            pulled.append(i)
            yield f"w{i}", torch.zeros(4)  # 16 bytes: 3 per 48-byte bucket

    seen = 0
    for bucket in iter_buckets(source(), max_bytes=48):
        seen += len(bucket)
        assert len(pulled) <= seen + 1
        previous[:] = [weakref.ref(t) for _, t in bucket]
        del bucket
    # Pulls after a bucket was handed over (and dropped) never found it still alive.
    assert alive_at_pull[4:] == [0] * len(alive_at_pull[4:])


def test_dtype_names_round_trip_and_unknown_names_are_rejected():
    for dtype in DTYPES:
        assert dtype_from_name(dtype_name(dtype)) is dtype
    assert dtype_name(torch.bfloat16) == "bfloat16"
    with pytest.raises(ValueError, match="not a torch dtype"):
        dtype_from_name("Tensor")


@st.composite
def _named_tensors(draw):
    out = []
    for i in range(draw(st.integers(0, 6))):
        dtype = draw(st.sampled_from(DTYPES))
        shape = tuple(draw(st.lists(st.integers(0, 4), max_size=3)))
        base = (torch.randn(shape) * 100).to(dtype)
        if draw(st.booleans()) and len(shape) >= 2:
            base = base.transpose(0, 1)  # non-contiguous input
        out.append((f"layer.{i}.weight", base))
    return out


@settings(max_examples=60, deadline=None)
@given(named=_named_tensors())
def test_flatten_then_unflatten_is_exact_and_keeps_order(named):
    bucket = flatten_bucket(named)
    assert all(f.dim() == 1 and f.is_contiguous() for f in bucket.flat.values())
    restored = unflatten_bucket(bucket)
    assert [n for n, _ in restored] == [n for n, _ in named]
    for (_, original), (_, got) in zip(named, restored, strict=True):
        assert got.dtype == original.dtype and got.shape == original.shape
        assert torch.equal(got, original)


def test_unflatten_returns_views_into_the_flat_tensors():
    bucket = flatten_bucket(
        [("a", torch.ones(2, 3)), ("b", torch.zeros(4)), ("i", torch.arange(3))]
    )
    assert set(bucket.flat) == {"float32", "int64"}
    assert bucket.metadata[1] == TensorMeta("b", "float32", (4,), 6, 4)
    (_, a), (_, b), _ = unflatten_bucket(bucket)
    b.fill_(7)
    assert torch.equal(bucket.flat["float32"][6:], torch.full((4,), 7.0))
    assert a.data_ptr() == bucket.flat["float32"].data_ptr()


@pytest.mark.parametrize(
    ("meta", "match"),
    [
        (TensorMeta("x", "int64", (2,), 0, 2), "only holds"),
        (TensorMeta("x", "float32", (2, 3), 0, 5), "does not fit"),
        (TensorMeta("x", "float32", (4,), 2, 4), "does not fit"),
    ],
)
def test_unflatten_rejects_metadata_that_does_not_fit(meta, match):
    with pytest.raises(ValueError, match=match):
        unflatten_bucket(FlattenedBucket(flat={"float32": torch.zeros(5)}, metadata=[meta]))
