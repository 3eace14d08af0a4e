"""Ray-facing pieces of miles core: the train-actor contract every training backend implements.

Example, a backend's actor class (the RL step and the life cycle are `TrainRayActor`'s)::

    from miles.ray import TrainRayActor, TrainRunSpec

    class MyTrainActor(TrainRayActor):
        backend_name = "mine"

        def build_engine(self, spec: TrainRunSpec, backend, *, device, with_ref):
            return MyEngine(backend, spec, device=device, with_ref=with_ref)

Nothing here imports Ray or a backend: the train loop wraps these classes in Ray actors. The
re-exports resolve on first use, so the configuration can read `miles.config.placement_plan`
without importing the train-actor machinery.
"""

import importlib
from typing import Any

from miles.backends.training_utils.infra.vendor_libs import disable_unusable_amdsmi

# Every module of this package imports Ray, whose GPU probe inside `import ray` imports amdsmi: an
# amdsmi that cannot load must be set aside first, or no miles process starts.
disable_unusable_amdsmi()

_EXPORTS = {
    **{name: "miles.ray.train_actor" for name in ("ROLES", "Role", "TrainRayActor")},
    "TrainRunSpec": "miles.ray.run_spec",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
