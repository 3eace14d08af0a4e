"""The wheel installs as part of the `miles` namespace, importable without any GPU library."""

import importlib
import sys


def test_imports_into_the_shared_namespace_without_initialising_a_gpu():
    module = importlib.import_module("miles.backends.sglang_utils")
    miles = sys.modules["miles"]
    assert getattr(miles, "__file__", None) is None, "miles must stay a PEP 420 namespace package"
    assert module.__doc__ and "miles-sglang" in module.__doc__
    torch = sys.modules.get("torch")
    assert torch is None or not torch.cuda.is_initialized()
