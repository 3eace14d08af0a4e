"""Test-only shim: lets megatron-core's tensor-parallel GPTModel (local layer spec) run forward and
backward on CPU processes joined by gloo, so the Megatron backend's numerics are tested without a GPU.

The backend itself is GPU-only (`require_gpu`); nothing outside tests imports this module. Four
things in megatron-core assume CUDA even when every tensor is on the CPU, found by running a
tensor-parallel-2 forward and backward until nothing broke; each is patched here and nothing else:

1. `torch.cuda.current_device()`: megatron passes it as `device=` for every buffer it allocates
   (parameters, rotary frequencies, all-gather outputs, the attention scores buffer). Making it
   return the CPU device keeps those allocations where the model lives. (Returning 0 would not do:
   `device=0` means cuda:0.)
2. The CUDA RNG tracker: attention dropout runs inside `get_cuda_rng_tracker().fork()`, which
   swaps CUDA generator states, and `model_parallel_cuda_manual_seed` seeds them. Megatron's own
   inference tracker (fork() is a no-op context, add() records nothing) is installed instead, so
   both calls go through; dropout is 0 in these models, so no random stream is lost.
3. `get_default_causal_mask`: with `attention_mask=None` and a causal layer spec, megatron's
   torch softmax builds the causal mask with `device="cuda"`; the patch builds the same mask on
   the CPU. Passing `attention_mask=None` on CPU thus tests the exact call the GPU path makes.
4. With context parallelism, the rotary embedding picks this rank's rows of its table with an
   index built as `torch.tensor(..., pin_memory=True).cuda()`; pinned memory needs the CUDA
   driver. There the index is built unpinned, and `.cuda()` keeps a tensor where it is.

Each patch is applied only where CUDA is absent, so the same tests run unpatched on a GPU machine.
Use: call `install_megatron_cpu_shim()` first in a worker run by this module's `run_distributed`
(which preloads megatron-core in the fork server), or `with megatron_on_cpu():` in-process.

`install_megatron_training_cpu_shim()` goes further, for tests of the whole train actor (optimizer
step, distributed checkpoint): megatron-core's optimizer, gradient clipping, schedules and
checkpoint writer allocate small buffers with `device="cuda"`, move tensors with `.cuda()`, call
`torch.cuda.synchronize()` and (megatron-core >= 0.19) wait on `torch.cuda.current_stream()`,
and the distributed optimizer accepts parameters only when `Tensor.type()` names a CUDA type. In a
worker process (never undone; the process exits) those allocations land on the CPU, `.cuda()`
keeps the tensor where it is, synchronize and stream waits are no-ops (CPU work runs in program
order), and a CPU tensor reports the CUDA name of its type. Numerics are untouched.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from functools import partial

import torch

from tests.support.distributed import DEFAULT_PRELOAD
from tests.support.distributed import run_distributed as _run_distributed

# What the gloo workers' fork server imports once: megatron-core and transformers take many seconds
# to import on a busy CI machine, and every worker of every test would otherwise pay it again.
MEGATRON_PRELOAD = (
    *DEFAULT_PRELOAD,
    "transformers",
    "megatron.core",
    "megatron.core.models.gpt",
    "megatron.core.models.gpt.gpt_layer_specs",
    "megatron.core.tensor_parallel",
)

run_distributed = partial(_run_distributed, preload=MEGATRON_PRELOAD)


def _cpu_current_device() -> torch.device:
    return torch.device("cpu")


def _cpu_default_causal_mask(sq: int) -> torch.Tensor:
    # Same as megatron.core.transformer.utils.get_default_causal_mask, without device="cuda":
    # True above the diagonal = a query may not attend to a later key.
    return torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)


def _stay_on_cpu(self: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    return self


def install_megatron_cpu_shim() -> Callable[[], None]:
    """Apply the four patches of the module docstring for the rest of this process (a
    run_distributed worker, which exits when its function returns); a no-op where CUDA is
    available. Returns the function that undoes them."""
    if torch.cuda.is_available():
        return lambda: None
    import megatron.core.fusions.fused_softmax as fused_softmax
    import megatron.core.models.common.embeddings.rope_utils as rope_utils
    import megatron.core.tensor_parallel.random as tp_random

    saved_current_device = torch.cuda.current_device
    saved_causal_mask = fused_softmax.get_default_causal_mask
    saved_tracker = (
        tp_random._CUDA_RNG_STATE_TRACKER,
        tp_random._CUDA_RNG_STATE_TRACKER_INITIALIZED,
    )
    saved_cuda = torch.Tensor.cuda
    torch.cuda.current_device = _cpu_current_device
    fused_softmax.get_default_causal_mask = _cpu_default_causal_mask
    tp_random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    rope_utils.torch = TorchWithoutCuda()
    torch.Tensor.cuda = _stay_on_cpu

    def undo() -> None:
        torch.cuda.current_device = saved_current_device
        fused_softmax.get_default_causal_mask = saved_causal_mask
        rope_utils.torch = torch
        torch.Tensor.cuda = saved_cuda
        tp_random._CUDA_RNG_STATE_TRACKER, tp_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = (
            saved_tracker
        )

    return undo


class TorchWithoutCuda:
    """`torch` as megatron's modules see it: factory calls asking for "cuda" get the CPU."""

    def __getattr__(self, name: str):
        return getattr(torch, name)

    @staticmethod
    def _on_cpu(kwargs: dict) -> dict:
        device = kwargs.get("device")
        if device == "cuda" or (isinstance(device, torch.device) and device.type == "cuda"):
            kwargs["device"] = "cpu"
        kwargs.pop("pin_memory", None)  # pinning host memory needs the CUDA driver
        return kwargs

    def tensor(self, *args, **kwargs):
        return torch.tensor(*args, **self._on_cpu(kwargs))

    def zeros(self, *args, **kwargs):
        return torch.zeros(*args, **self._on_cpu(kwargs))

    def ones(self, *args, **kwargs):
        return torch.ones(*args, **self._on_cpu(kwargs))

    def empty(self, *args, **kwargs):
        return torch.empty(*args, **self._on_cpu(kwargs))


class _CpuStream:
    """What megatron asks of the current CUDA stream; CPU work runs in program order anyway."""

    def wait_event(self, event) -> None:
        return None

    def wait_stream(self, stream) -> None:
        return None

    def synchronize(self) -> None:
        return None


# The megatron modules whose module-level `torch` allocates on "cuda" during a training step.
_MODULES_ALLOCATING_ON_CUDA = (
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.optimizer.grad_scaler",
    "megatron.core.optimizer.distrib_optimizer",
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.utils",
)


def install_megatron_training_cpu_shim() -> None:
    """`install_megatron_cpu_shim()` plus the training-path patches of the module docstring, for
    the rest of this worker process; a no-op where CUDA is available."""
    if torch.cuda.is_available():
        return
    import importlib

    install_megatron_cpu_shim()
    proxy = TorchWithoutCuda()
    for name in _MODULES_ALLOCATING_ON_CUDA:
        importlib.import_module(name).torch = proxy
    tensor_type = torch.Tensor.type

    def cuda_type_name(self, *args, **kwargs):
        if args or kwargs or self.device.type != "cpu":
            return tensor_type(self, *args, **kwargs)
        return tensor_type(self).replace("torch.", "torch.cuda.", 1)

    torch.Tensor.type = cuda_type_name
    torch.cuda.synchronize = lambda *args, **kwargs: None
    torch.cuda.empty_cache = lambda *args, **kwargs: None
    torch.cuda.current_stream = lambda *args, **kwargs: _CpuStream()


@contextlib.contextmanager
def megatron_on_cpu() -> Iterator[None]:
    """The shim for the duration of the block, undone on exit."""
    undo = install_megatron_cpu_shim()
    try:
        yield
    finally:
        undo()
