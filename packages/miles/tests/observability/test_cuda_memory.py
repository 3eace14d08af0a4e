"""CUDA memory history on a GPU: recorded, dumped as a snapshot that PyTorch's memory viewer
reads (segments and the allocation trace with stacks), and ended."""

from __future__ import annotations

import pickle

import pytest
import torch

from miles.utils.observability import cuda_memory


def test_without_a_gpu_nothing_is_recorded(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert cuda_memory.start_history(oom_path=str(tmp_path / "oom.pickle")) is False
    assert cuda_memory.dump_snapshot(path=str(tmp_path / "s.pickle")) is None


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_snapshot_holds_the_allocations_made_while_recording(tmp_path):
    assert cuda_memory.start_history(oom_path=str(tmp_path / "oom.pickle"))
    block = torch.empty(64 * 1024 * 1024, dtype=torch.uint8, device="cuda")
    del block
    path = cuda_memory.dump_snapshot(path=str(tmp_path / "snapshot.pickle"))
    snapshot = pickle.loads((tmp_path / "snapshot.pickle").read_bytes())
    assert path == str(tmp_path / "snapshot.pickle")
    assert snapshot["segments"]
    events = [e for trace in snapshot["device_traces"] for e in trace]
    sizes = {e["size"] for e in events if e["action"] == "alloc"}
    assert 64 * 1024 * 1024 in sizes and all("frames" in e for e in events)
