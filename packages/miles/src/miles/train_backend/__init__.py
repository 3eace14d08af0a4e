"""The contract a training backend implements on the core's side: its Ray actor class.

Example, a backend's actor class (the RL step and the life cycle are `TrainRayActor`'s)::

    from miles.train_backend import TrainRayActor, TrainRunSpec

    class MyTrainActor(TrainRayActor):
        backend_name = "mine"

        def build_engine(self, spec: TrainRunSpec, backend, *, device, with_ref):
            return MyEngine(backend, spec, device=device, with_ref=with_ref)

The backend's settings are a `miles.config.trainer_args.TrainerArgs` subclass, and its engine a
`miles.backends.training_utils.step.train_engine.TrainEngine`. Nothing here imports Ray or a
backend: the train loop (`miles.ray.train_group`) wraps these classes in Ray actors. The re-exports
resolve on first use: `train_actor` imports torch, which `run_spec`'s readers need not.
"""

import importlib
from typing import Any

_EXPORTS = {
    **{name: "miles.train_backend.train_actor" for name in ("ROLES", "Role", "TrainRayActor")},
    "TrainRunSpec": "miles.train_backend.run_spec",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
