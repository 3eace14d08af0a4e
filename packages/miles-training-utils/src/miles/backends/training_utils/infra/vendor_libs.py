"""Vendor libraries behind the device layer's whole-device memory reports, checked before anything
else imports them. No torch here: the driver and the configuration import this.

AMD's `amdsmi` Python bindings load the ROCm library `libamd_smi.so` when imported. The package on
PyPI carries no library: on a host without ROCm (or with another ROCm release) its import raises
`KeyError: 'libamd_smi.so'`, not an ImportError. Ray's AMD GPU probe, which runs inside
`import ray`, expects an ImportError there, so such an `amdsmi` breaks `import ray`, and with it
every miles process. AMD ships the bindings with each ROCm release (`/opt/rocm/share/amd_smi`),
version-matched; that is where the ROCm image gets them (docker/Dockerfile.rocm).
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import sys

logger = logging.getLogger(__name__)

ROCM_AMDSMI_SOURCE = "/opt/rocm/share/amd_smi"
"""The bindings of the installed ROCm release: `pip install /opt/rocm/share/amd_smi`."""


def disable_unusable_amdsmi() -> str | None:
    """If `amdsmi` is installed but cannot load, make every later `import amdsmi` in this process
    an ImportError (what Ray and torch handle as "no AMD SMI") and log why. Returns the reason,
    or None when `amdsmi` is absent or works. Call it before the first `import ray`."""
    if "amdsmi" in sys.modules or importlib.util.find_spec("amdsmi") is None:
        return None  # absent, imported already, or marked unusable by an earlier call
    try:
        importlib.import_module("amdsmi")
    except ImportError:
        return None
    except Exception as err:  # KeyError / OSError: the ROCm library it wraps is missing
        for name in [m for m in sys.modules if m == "amdsmi" or m.startswith("amdsmi.")]:
            del sys.modules[name]
        sys.modules["amdsmi"] = None  # type: ignore[assignment]  # import now raises ImportError
        reason = f"{type(err).__name__}: {err}"
        logger.warning(
            "amdsmi is installed but cannot load (%s): whole-GPU memory reports are off on AMD. "
            "Install the bindings of this host's ROCm release (pip install %s), or uninstall "
            "amdsmi on a host without ROCm",
            reason, ROCM_AMDSMI_SOURCE,
        )  # fmt: skip
        return reason
    return None


def amdsmi_usable() -> bool:
    """Whether `import amdsmi` works here (after `disable_unusable_amdsmi`)."""
    disable_unusable_amdsmi()  # imports a usable one, marks an unusable one None
    return sys.modules.get("amdsmi") is not None
