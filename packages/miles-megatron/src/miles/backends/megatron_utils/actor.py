"""`MegatronTrainRayActor`: the Megatron-core backend's train actor (architecture.md: "Contracts /
Training backend"). The RL step and the actor's life cycle are core's; this class only builds the
engines: the policy's and, for --advantage-estimator ppo, the critic's, a value model on the same
ranks and groups. GPU-only: `init` refuses a machine without NVIDIA or AMD GPUs.
"""

from __future__ import annotations

import torch

from miles.backends.megatron_utils.arguments import MegatronArgs
from miles.backends.megatron_utils.engine import MegatronEngine
from miles.backends.megatron_utils.model_provider import require_gpu
from miles.train_backend import TrainRayActor, TrainRunSpec


class MegatronTrainRayActor(TrainRayActor):
    """One rank of the Megatron policy trainer; every rank gets the same calls in the same order."""

    backend_name = "megatron"

    def check_supported(self, backend: MegatronArgs) -> None:
        require_gpu()

    def build_engine(
        self, spec: TrainRunSpec, backend: MegatronArgs, *, device: torch.device, with_ref: bool
    ) -> MegatronEngine:
        _check_args(backend)
        return MegatronEngine(
            backend, spec, device=device, world_size=self.world_size, with_ref=with_ref
        )

    def build_critic_engine(
        self, spec: TrainRunSpec, backend: MegatronArgs, *, device: torch.device
    ) -> MegatronEngine:
        _check_args(backend)
        return MegatronEngine(
            backend, spec, device=device, world_size=self.world_size, with_ref=False,
            value_model=True,
        )  # fmt: skip


def _check_args(backend: object) -> None:
    if not isinstance(backend, MegatronArgs):
        raise TypeError(f"the megatron backend takes MegatronArgs, got {type(backend).__name__}")
