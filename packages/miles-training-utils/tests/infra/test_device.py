"""Device detection and the decisions hanging off it; non-CPU kinds via patched detection."""

import types

import pytest
import torch

from miles.backends.training_utils.infra import device


@pytest.fixture(autouse=True)
def fresh_detection(monkeypatch):
    monkeypatch.delenv(device.DEVICE_ENV_VAR, raising=False)
    device.get_device_info.cache_clear()
    yield
    device.get_device_info.cache_clear()


def _pretend(monkeypatch, *, cuda=False, hip=None, npu=False, count=2):
    monkeypatch.setattr(device, "_npu_available", lambda: npu)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.version, "hip", hip)
    monkeypatch.setattr(device, "_accelerator_count", lambda kind: 1 if kind == "cpu" else count)


def test_this_machine_is_detected_as_cpu_with_gloo():
    info = device.get_device_info()
    assert info.kind == "cpu"
    assert info.dist_backend == "gloo"
    assert device.get_torch_device() == torch.device("cpu")


@pytest.mark.parametrize(
    ("flags", "kind", "backend", "torch_type"),
    [
        ({"cuda": True}, "cuda", "nccl", "cuda"),
        ({"cuda": True, "hip": "6.2.41133"}, "rocm", "nccl", "cuda"),
        ({"npu": True}, "npu", "hccl", "npu"),
        ({"npu": True, "cuda": True}, "npu", "hccl", "npu"),
        ({}, "cpu", "gloo", "cpu"),
    ],
)
def test_detection_decides_kind_backend_and_torch_device_type(
    monkeypatch, flags, kind, backend, torch_type
):
    _pretend(monkeypatch, **flags)
    info = device.get_device_info()
    assert (info.kind, info.dist_backend, info.torch_device_type) == (kind, backend, torch_type)
    assert device.dist_backend() == backend


def test_accelerator_rank_maps_to_its_local_device(monkeypatch):
    _pretend(monkeypatch, cuda=True, count=2)
    assert device.get_torch_device(1) == torch.device("cuda", 1)
    with pytest.raises(ValueError, match="local rank 2 has no cuda device: this process sees 2"):
        device.get_torch_device(2)


def test_env_var_forces_a_kind(monkeypatch):
    _pretend(monkeypatch, cuda=True)
    monkeypatch.setenv(device.DEVICE_ENV_VAR, "cpu")
    assert device.get_device_info().kind == "cpu"


def test_env_var_with_unknown_kind_names_the_value_and_choices(monkeypatch):
    monkeypatch.setenv(device.DEVICE_ENV_VAR, "tpu")
    with pytest.raises(
        ValueError,
        match=r"MILES_DEVICE='tpu' is not a device kind; use one of cpu, cuda, rocm, npu",
    ):
        device.get_device_info()


def test_npu_detection_imports_torch_npu_only_when_installed(monkeypatch):
    monkeypatch.setattr(device.importlib.util, "find_spec", lambda name: None)
    assert device._npu_available() is False
    fake_npu = types.SimpleNamespace(is_available=lambda: True)
    monkeypatch.setattr(device.importlib.util, "find_spec", lambda name: object())
    monkeypatch.setattr(device.importlib, "import_module", lambda name: None)
    monkeypatch.setattr(torch, "npu", fake_npu, raising=False)
    assert device._npu_available() is True


def test_cpu_memory_report_tracks_a_large_allocation():
    before = device.memory_report()
    block = torch.ones(64 * 1024 * 1024 // 4)  # 64 MiB, touched so it is resident
    after = device.memory_report()
    assert after.allocated - before.allocated > 48 * 1024 * 1024
    assert after.peak_allocated >= after.allocated
    assert after.device_used is None and after.device_total is None
    assert after.as_gib()["allocated"] == pytest.approx(after.allocated / 2**30)
    del block


def test_synchronize_and_empty_cache_are_safe_on_cpu():
    device.synchronize()
    device.empty_cache()
    device.reset_peak_memory()
    assert device.set_device(0) == torch.device("cpu")


def test_current_device_follows_the_detected_kind(monkeypatch):
    assert device.current_device() == torch.device("cpu")
    device.get_device_info.cache_clear()
    _pretend(monkeypatch, cuda=True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert device.current_device() == torch.device("cuda", 1)
