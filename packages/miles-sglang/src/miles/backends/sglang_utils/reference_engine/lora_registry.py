"""The LoRA adapters one engine serves, by name: what /load_lora_adapter adds (checked against the
model and the LoRA flags), /unload_lora_adapter removes, and /generate's `lora_path` names.

Loading reads the directory off the engine loop and never touches a running request: requests hold
the adapter they were submitted with, so an unload or a reload under the same name changes what
later requests get, not what running ones compute. (SGLang's unload waits for the adapter's
running requests instead; both leave those requests on the adapter they started with.)
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

import torch

from miles.backends.sglang_utils.reference_engine.errors import InvalidRequestError
from miles.backends.sglang_utils.reference_engine.lora_layers import LoraAdapter, LoraLayers
from miles.backends.sglang_utils.reference_engine.lora_settings import LoraSettings
from miles.backends.sglang_utils.reference_engine.peft_adapter import PeftLora, read_peft_lora

logger = logging.getLogger(__name__)


class LoraRegistry:
    """Loaded adapters by name; safe to call from the server's threads."""

    def __init__(
        self,
        layers: LoraLayers,
        *,
        max_rank: int,
        target_modules: frozenset[str],
        max_per_batch: int,
        dtype: torch.dtype,
    ) -> None:
        self.layers = layers
        self.max_rank = max_rank
        self.target_modules = target_modules
        self.max_per_batch = max_per_batch
        self.dtype = dtype
        self._loaded: dict[str, LoraAdapter] = {}
        self._lock = threading.Lock()

    @classmethod
    def start(cls, layers: LoraLayers, settings: LoraSettings, dtype: torch.dtype) -> LoraRegistry:
        """The registry of `settings`, with its --lora-paths adapters loaded; a rank or target set
        left out is the largest rank / every projection those adapters adapt (as SGLang infers
        them)."""
        read = {}
        for name, path in settings.start_adapters.items():
            try:
                read[name] = read_peft_lora(path)
            except InvalidRequestError as err:
                raise ValueError(f"--lora-paths {name}={path}: {err}") from None
        max_rank = settings.max_rank or max(lora.rank for lora in read.values())
        targets = settings.target_modules
        if targets is None:
            targets = frozenset().union(
                *(lora.adapted_names | set(lora.target_modules) for lora in read.values())
            )
        registry = cls(layers, max_rank=max_rank, target_modules=targets,
                       max_per_batch=settings.max_per_batch, dtype=dtype)  # fmt: skip
        for name, lora in read.items():
            try:
                registry._add(name, lora, pinned=False)
            except InvalidRequestError as err:
                raise ValueError(f"--lora-paths {name}={lora.path}: {err}") from None
        return registry

    def load(self, name: str, path: str, pinned: bool = False) -> LoraAdapter:
        """Read the PEFT adapter in directory `path` and serve it as `name`."""
        self._check_free(name)
        return self._add(name, read_peft_lora(path), pinned=pinned)

    def unload(self, name: str) -> None:
        with self._lock:
            if name not in self._loaded:
                raise InvalidRequestError(
                    f"no LoRA adapter named {name!r} is loaded (loaded: {sorted(self._loaded)})",
                    param="lora_name",
                )
            del self._loaded[name]
        logger.info("unloaded LoRA adapter %s", name)

    def resolve(self, names: Sequence[str | None]) -> list[LoraAdapter | None]:
        """The adapters /generate's `lora_path` names, one per sequence (None: the base model)."""
        loaded = dict(self._loaded)  # one consistent view for the whole request
        unknown = sorted({name for name in names if name is not None and name not in loaded})
        if unknown:
            raise InvalidRequestError(
                f"lora_path {', '.join(map(repr, unknown))} names no loaded LoRA adapter (loaded: "
                f"{sorted(loaded)}); load it with /load_lora_adapter first",
                param="lora_path",
            )
        return [None if name is None else loaded[name] for name in names]

    def loaded_paths(self) -> dict[str, str]:
        """{name: path} of every loaded adapter (SGLang's `loaded_adapters`)."""
        return {name: adapter.path for name, adapter in self._loaded.items()}

    def _check_free(self, name: str) -> None:
        loaded = self._loaded.get(name)
        if loaded is not None:
            raise InvalidRequestError(
                f"a LoRA adapter named {name!r} is already loaded (from {loaded.path}); unload it "
                "first (/unload_lora_adapter) or load this one under another name",
                param="lora_name",
            )

    def _add(self, name: str, lora: PeftLora, *, pinned: bool) -> LoraAdapter:
        adapter = self._on_device(name, lora, pinned)
        with self._lock:
            self._check_free(name)  # another load of this name may have finished meanwhile
            pinned_now = sum(a.pinned for a in self._loaded.values())
            if pinned and pinned_now >= self.max_per_batch - 1:
                raise InvalidRequestError(
                    f"cannot pin LoRA adapter {name!r}: {pinned_now} of --max-loras-per-batch "
                    f"{self.max_per_batch} are pinned already, and one slot stays free for the "
                    "others and the base model (as in SGLang); load it unpinned or raise "
                    "--max-loras-per-batch",
                    param="pinned",
                )
            self._loaded[name] = adapter
        logger.info("loaded LoRA adapter %s from %s (rank %d)", name, lora.path, lora.rank)
        return adapter

    def _on_device(self, name: str, lora: PeftLora, pinned: bool) -> LoraAdapter:
        """`lora` checked against the flags and the model, its matrices on the engine's device."""
        if lora.rank > self.max_rank:
            raise InvalidRequestError(
                f"LoRA adapter {name!r} has rank {lora.rank}, above --max-lora-rank "
                f"{self.max_rank}; restart the engine with a larger --max-lora-rank"
            )
        outside = sorted((set(lora.target_modules) | lora.adapted_names) - self.target_modules)
        if outside:
            raise InvalidRequestError(
                f"LoRA adapter {name!r} adapts {outside}, outside --lora-target-modules "
                f"{sorted(self.target_modules)}; restart the engine with them included"
            )
        present = {path.rsplit(".", 1)[-1] for path in self.layers.linears}
        absent = sorted(set(lora.target_modules) - present)
        missing = sorted(set(lora.layers) - set(self.layers.linears))
        if absent or missing:
            raise InvalidRequestError(
                f"LoRA adapter {name!r} targets modules the served model does not have: "
                f"{absent or missing[:4]}; was it trained on another architecture?"
            )
        layers = {}
        for path, (a, b) in lora.layers.items():
            linear = self.layers.linears[path]
            if a.shape[1] != linear.in_features or b.shape[0] != linear.out_features:
                raise InvalidRequestError(
                    f"LoRA adapter {name!r}: {path} has lora_A {tuple(a.shape)} and lora_B "
                    f"{tuple(b.shape)}, but the model's layer maps {linear.in_features} to "
                    f"{linear.out_features} features; was it trained on another model size?"
                )
            device = self.layers.device
            layers[path] = (a.to(device, self.dtype), b.to(device, self.dtype))
        return LoraAdapter(name=name, path=lora.path, rank=lora.rank, scaling=lora.scaling,
                           pinned=pinned, layers=layers)  # fmt: skip
