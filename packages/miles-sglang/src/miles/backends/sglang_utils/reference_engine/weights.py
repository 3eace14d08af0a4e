"""Engine-side weight updates and memory release, each run on the engine loop between steps.

Three transports, as SGLang: tensors handed over through shared memory (colocated), a broadcast
group with trainer rank 0 (disaggregated), and a checkpoint directory on disk. Every update bumps
the weight version. Releasing `weights` moves them off the device (to a file when the device is
the CPU itself, so host memory is really returned) and resuming brings them back.
"""

from __future__ import annotations

import gc
import logging
import tempfile
import threading
from collections import deque
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from miles.backends.sglang_utils.reference_engine.errors import InvalidRequestError
from miles.backends.sglang_utils.reference_engine.scheduler import Scheduler
from miles.backends.sglang_utils.reference_engine.weight_layout import transpose_linear_weights
from miles.backends.sglang_utils.weight_sync import (
    FLATTENED_BUCKET,
    ReceiveBuffer,
    WeightUpdateError,
    create_weight_update_group,
    deserialize_flattened_bucket,
    deserialize_named_tensors,
    flattened_dtype,
    load_named_tensors,
    receive_flattened,
    receive_tensors,
    unflatten_bucket,
)
from miles.backends.training_utils.infra.device import empty_cache

logger = logging.getLogger(__name__)
MEMORY_TAGS = ("weights", "kv_cache")


class WeightManager:
    """Owns every change to the engine's weights and its memory occupation."""

    def __init__(
        self,
        scheduler: Scheduler,
        model: torch.nn.Module,
        device: torch.device,
        *,
        rename: Callable[[str], str] | None = None,
    ) -> None:
        """`rename`: a checkpoint's parameter name -> the model's, for a model whose names
        transformers changed on load (`vlm_checkpoint.checkpoint_renamer`); updates may use either."""
        self.scheduler = scheduler
        self.model = model
        self.device = device
        self.rename = rename
        self.groups: dict[str, object] = {}
        self._received = ReceiveBuffer()  # flattened buckets, one at a time
        # The shared-memory storages of the last two tensor updates (a trainer's two staging
        # buffers); a released or replaced buffer's memory returns once it leaves this window.
        self._mapped: deque[dict[int, torch.UntypedStorage]] = deque(maxlen=2)
        self.released: set[str] = set()
        self._offload_file: Path | None = None
        self._group_lock = threading.Lock()

    def _bump(self, weight_version: str | None) -> str:
        current = self.scheduler.weight_version
        self.scheduler.weight_version = (
            weight_version
            if weight_version is not None
            else str(int(current) + 1 if current.isdigit() else 1)
        )
        return self.scheduler.weight_version

    def _require_weights(self) -> None:
        if "weights" in self.released:
            raise InvalidRequestError("weights are released; call /resume_memory_occupation first")

    def _load(self, named_tensors, weight_version: str | None, *, complete: bool = False) -> str:
        """Load all of `named_tensors` or none (the version stays too); `complete`: they must
        cover every parameter (a whole checkpoint)."""
        self._require_weights()
        try:
            count = load_named_tensors(
                self.model, named_tensors, complete=complete, rename=self.rename
            )
        except WeightUpdateError as err:
            raise InvalidRequestError(str(err)) from None
        version = self._bump(weight_version)
        logger.info("loaded %d tensors, weight version %s", count, version)
        return f"loaded {count} tensors; weight version {version}"

    def from_tensor(
        self, serialized: list[str], load_format: str | None, weight_version: str | None
    ) -> str:
        if not serialized:
            raise InvalidRequestError("serialized_named_tensors is empty")
        if load_format not in (None, "flattened_bucket"):
            raise InvalidRequestError(
                f"load_format {load_format!r} is not supported; use null or 'flattened_bucket'"
            )
        # One entry per tensor-parallel rank in SGLang; the reference engine has one rank.
        try:
            if load_format == "flattened_bucket":
                named = unflatten_bucket(deserialize_flattened_bucket(serialized[0]))
            else:
                named = deserialize_named_tensors(serialized[0])
        except ValueError as err:
            raise InvalidRequestError(f"cannot read serialized_named_tensors: {err}") from None
        if all(tensor.device.type == "cpu" for _, tensor in named):
            # A trainer sends every bucket from one of its two staging buffers: kept mapped, the
            # next payload naming one finds it in torch's cache of shared storages instead of
            # mapping it again and faulting in every page (a third of the load, measured).
            self._mapped.append({id(s): s for s in (t.untyped_storage() for _, t in named)})
        return self._load(named, weight_version)

    def from_disk(self, model_path: str, weight_version: str | None) -> str:
        """A whole checkpoint directory: every file readable and every parameter in it, or the
        engine keeps its weights and version."""
        files = sorted(Path(model_path).glob("*.safetensors"))
        if not files:
            raise InvalidRequestError(f"no *.safetensors files in model_path {model_path!r}")
        named = []
        for file in files:
            try:
                named += load_file(str(file)).items()
            except Exception as err:  # safetensors raises its own error type for a bad header
                raise InvalidRequestError(
                    f"cannot read {file}: {type(err).__name__}: {err}; the weights are unchanged"
                ) from None
        return self._load(named, weight_version, complete=True)

    def init_group(
        self,
        *,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str,
        backend: str,
    ) -> str:
        """Join the trainer's broadcast group as rank `rank_offset` (blocks until it forms)."""
        with self._group_lock:
            if group_name in self.groups:
                raise InvalidRequestError(
                    f"weight update group {group_name!r} already exists; destroy it first"
                )
        group = create_weight_update_group(
            master_address=master_address,
            master_port=master_port,
            rank=rank_offset,
            world_size=world_size,
            group_name=group_name,
            backend=backend,
        )
        with self._group_lock:
            self.groups[group_name] = group
        return f"joined {group_name} as rank {rank_offset} of {world_size}"

    def from_distributed(
        self,
        *,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        group_name: str,
        weight_version: str | None,
        load_format: str | None = None,
    ) -> str:
        if not (len(names) == len(dtypes) == len(shapes)):
            raise InvalidRequestError(
                f"names ({len(names)}), dtypes ({len(dtypes)}) and shapes ({len(shapes)}) must have equal lengths"
            )
        if load_format == FLATTENED_BUCKET:
            try:  # refused before the broadcast, which the trainer then stops waiting on
                flattened_dtype(dtypes)
            except ValueError as err:
                raise InvalidRequestError(str(err)) from None
        group = self.groups.get(group_name)
        if group is None:
            raise InvalidRequestError(
                f"no weight update group {group_name!r}; call /init_weights_update_group first"
            )
        if load_format == FLATTENED_BUCKET:
            named = receive_flattened(
                group, names, dtypes, shapes, self.device, buffer=self._received
            )
        else:
            named = receive_tensors(group, names, dtypes, shapes, self.device)
        return self._load(named, weight_version)

    def destroy_group(self, group_name: str) -> str:
        group = self.groups.pop(group_name, None)
        if group is None:
            raise InvalidRequestError(f"no weight update group {group_name!r}")
        group.destroy()
        return f"destroyed {group_name}"

    def release(self, tags: list[str]) -> str:
        self._received.release()
        self._mapped.clear()
        for tag in tags:
            if tag == "weights" and "weights" not in self.released:
                self._offload_weights()
            self.released.add(tag)
        gc.collect()
        empty_cache()
        return f"released {', '.join(tags)}"

    def resume(self, tags: list[str]) -> str:
        for tag in tags:
            if tag == "weights" and "weights" in self.released:
                self._restore_weights()
            self.released.discard(tag)
        return f"resumed {', '.join(tags)}"

    def _named_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """Every parameter and buffer (non-persistent ones too, such as rotary tables), each
        storage once: tied weights appear under their first name only."""
        seen, named = set(), []
        for name, tensor in [*self.model.named_parameters(), *self.model.named_buffers()]:
            if id(tensor) not in seen:
                seen.add(id(tensor))
                named.append((name, tensor))
        return named

    def _offload_weights(self) -> None:
        handle = tempfile.NamedTemporaryFile(
            prefix="miles-engine-weights-", suffix=".safetensors", delete=False
        )
        handle.close()
        named = self._named_tensors()
        save_file({name: t.detach().to("cpu").contiguous() for name, t in named}, handle.name)
        self._offload_file = Path(handle.name)
        for _, tensor in named:
            tensor.data = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
        logger.info("released weights to %s", self._offload_file)

    def _restore_weights(self) -> None:
        assert self._offload_file is not None, "weights were released without an offload file"
        saved = load_file(str(self._offload_file))
        for name, tensor in self._named_tensors():
            tensor.data = saved[name].to(self.device)
        transpose_linear_weights(self.model, self.device)  # the file holds them row-major
        self._offload_file.unlink(missing_ok=True)
        self._offload_file = None


def check_tags(tags: list[str] | None) -> list[str]:
    tags = list(MEMORY_TAGS) if tags is None else tags
    unknown = [t for t in tags if t not in MEMORY_TAGS]
    if unknown:
        raise InvalidRequestError(f"unknown memory tags {unknown}; use {list(MEMORY_TAGS)}")
    return tags
