"""Staging buffers: every tensor arrives cast, whole and in order; buckets respect the bound and
alternate between two buffers allocated once."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from miles.backends.sglang_utils.weight_sync import ReceiveBuffer, unflatten_bucket
from miles.backends.sglang_utils.weight_sync.staging import StagingBuffers, pack_buckets

_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.bool]


def _tensor(seed: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=generator).bool()
    if dtype == torch.int64:
        return torch.randint(-1000, 1000, shape, generator=generator)
    return torch.randn(shape, generator=generator).to(dtype)


@st.composite
def _named_tensors(draw):
    count = draw(st.integers(1, 12))
    out = []
    for i in range(count):
        dtype = draw(st.sampled_from(_DTYPES))
        shape = tuple(draw(st.lists(st.integers(0, 9), min_size=0, max_size=3)))
        out.append((f"t{i}", _tensor(i, dtype, shape)))
    return out


@settings(max_examples=150, deadline=None)
@given(
    named=_named_tensors(),
    max_bytes=st.integers(2, 2048),
    cast=st.sampled_from([None, torch.bfloat16, torch.float32]),
)
def test_every_tensor_arrives_cast_whole_and_in_order(named, max_bytes, cast):
    staging = StagingBuffers(max_bytes, shared=False)
    received, buffers = [], []
    for bucket, is_last in pack_buckets(iter(named), staging, dtype=cast):
        tensors = unflatten_bucket(bucket)
        sizes = [t.numel() * t.element_size() for _, t in tensors]
        # Within the bound, padding of a second dtype's region included; a larger tensor alone.
        assert len(tensors) == 1 or sum(sizes) + 64 * (len(bucket.flat) - 1) <= max_bytes // 2
        buffers.append({flat.untyped_storage().data_ptr() for flat in bucket.flat.values()})
        received += [(name, t.clone(), is_last) for name, t in tensors]  # before the reuse
    assert [name for name, _, _ in received] == [name for name, _ in named]
    assert [last for _, _, last in received][-1] is True
    for (_, sent), (_, got, _) in zip(named, received, strict=True):
        expected = sent.to(cast) if cast is not None and sent.is_floating_point() else sent
        assert got.dtype == expected.dtype and torch.equal(got, expected)
    # A bucket is packed while the one before is in flight: never into the same buffer.
    for before, after in itertools.pairwise(buffers):
        assert not before & after


def test_buffers_are_allocated_once_and_reused_across_syncs():
    staging = StagingBuffers(1 << 12, shared=True)
    named = [(f"w{i}", torch.randn(100)) for i in range(20)]  # 8000 bytes: 4 buckets of 2 KiB
    first = [b.flat["float32"].data_ptr() for b, _ in pack_buckets(named, staging, dtype=None)]
    allocated = staging.allocated_bytes
    second = [b.flat["float32"].data_ptr() for b, _ in pack_buckets(named, staging, dtype=None)]
    assert first == second and len(set(first)) == 2
    assert staging.allocated_bytes == allocated == 2 * 2048
    # A tensor larger than a bucket grows its buffer and travels alone.
    big = [("small", torch.randn(10)), ("big", torch.randn(3000)), ("after", torch.randn(10))]
    packed = [[m.name for m in b.metadata] for b, _ in pack_buckets(big, staging, dtype=None)]
    assert packed == [["small"], ["big"], ["after"]]
    # Between syncs the buffers hold at most the bound: the grown one goes, the other stays.
    staging.trim()
    assert staging.allocated_bytes == 2048
    staging.release()
    assert staging.allocated_bytes == 0


def test_a_second_dtype_gets_an_aligned_region_of_its_own():
    staging = StagingBuffers(1 << 12, shared=False)
    named = [("step", torch.tensor([3, 4])), ("w", torch.randn(5)), ("b", torch.randn(3))]
    ((bucket, last),) = list(pack_buckets(named, staging, dtype=torch.bfloat16))
    assert last and list(bucket.flat) == ["int64", "bfloat16"]
    region = bucket.flat["bfloat16"]
    assert region.data_ptr() % 64 == 0 and region.numel() == 8
    assert [m.name for m in bucket.metadata] == ["step", "w", "b"]


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="--update-weight-buffer-size"):
        StagingBuffers(0, shared=False)
    with pytest.raises(ValueError, match="floating-point dtype"):
        list(
            pack_buckets([("w", torch.ones(1))], StagingBuffers(8, shared=False), dtype=torch.int8)
        )


def test_an_engines_receive_buffer_is_reused_and_grows_only_for_a_larger_bucket():
    buffer = ReceiveBuffer()
    first = buffer.take(1000, torch.float32, "cpu")
    again = buffer.take(500, torch.bfloat16, "cpu")
    assert again.data_ptr() == first.data_ptr() and again.numel() == 500
    larger = buffer.take(2000, torch.float32, "cpu")
    assert larger.numel() == 2000 and larger.dtype == torch.float32
