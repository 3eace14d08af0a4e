"""FSDP tests run their gloo workers through training-utils' helper, with a fork server that also
preloads FSDP, DCP and transformers: device meshes import torch._dynamo lazily, which takes many
seconds per process on a busy machine, and this pays for it once."""

from functools import partial

from tests.support.distributed import DEFAULT_PRELOAD
from tests.support.distributed import run_distributed as _run_distributed

FSDP_PRELOAD = (
    *DEFAULT_PRELOAD,
    "torch._dynamo",
    "torch.distributed.device_mesh",
    "torch.distributed.fsdp",
    "torch.distributed.checkpoint",
    "transformers",
    "transformers.models.qwen3.modeling_qwen3",
    "safetensors.torch",
)

run_distributed = partial(_run_distributed, preload=FSDP_PRELOAD)
