"""The wheel installs as part of the `miles` namespace, importable without any GPU library."""

import importlib
import sys


def test_imports_into_the_shared_namespace_without_initialising_a_gpu():
    module = importlib.import_module("miles.backends.fsdp_utils")
    miles = sys.modules["miles"]
    assert getattr(miles, "__file__", None) is None, "miles must stay a PEP 420 namespace package"
    assert module.__doc__ and "miles-fsdp" in module.__doc__
    torch = sys.modules.get("torch")
    assert torch is None or not torch.cuda.is_initialized()


def test_core_finds_the_fsdp_backend_through_its_entry_point():
    from miles.backends.fsdp_utils.actor import FSDPTrainRayActor
    from miles.utils.plugins import TRAIN_BACKENDS, load_plugin

    assert load_plugin(TRAIN_BACKENDS, "fsdp") is FSDPTrainRayActor
