"""`FSDPTrainRayActor`: the FSDP2 backend's train actor (architecture.md: "Contracts / Training
backend"). The RL step and the actor's life cycle are core's; this class only builds the engine.
PPO's critic is a second `FSDPEngine` on the same ranks, with a value head. Not supported: context
parallelism (FSDPArgs refuses it, naming its flag).
"""

from __future__ import annotations

import torch

from miles.backends.fsdp_utils import checkpoint
from miles.backends.fsdp_utils.arguments import FSDPArgs
from miles.backends.fsdp_utils.engine import FSDPEngine, check_device_support
from miles.train_backend import TrainRayActor, TrainRunSpec


class FSDPTrainRayActor(TrainRayActor):
    """One rank of the FSDP2 policy trainer; every rank gets the same calls in the same order."""

    backend_name = "fsdp"

    export_checkpoint = staticmethod(checkpoint.export_checkpoint_to_hf)
    """`miles export-hf`: a saved checkpoint as a Hugging Face directory, offline."""

    def check_supported(self, backend: FSDPArgs) -> None:
        check_device_support(backend)

    def build_engine(
        self, spec: TrainRunSpec, backend: FSDPArgs, *, device: torch.device, with_ref: bool
    ) -> FSDPEngine:
        if not isinstance(backend, FSDPArgs):
            raise TypeError(f"the FSDP backend takes FSDPArgs, got {type(backend).__name__}")
        return FSDPEngine(
            backend, spec, device=device, world_size=self.world_size, with_ref=with_ref
        )

    def build_critic_engine(
        self, spec: TrainRunSpec, backend: FSDPArgs, *, device: torch.device
    ) -> FSDPEngine:
        return FSDPEngine(
            backend, spec, device=device, world_size=self.world_size, with_ref=False,
            value_model=True,
        )  # fmt: skip
