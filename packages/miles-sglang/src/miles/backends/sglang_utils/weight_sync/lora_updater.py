"""Adapter-mode weight sync: a LoRA run sends the engines its adapter, not the base weights.

(architecture.md: "Contracts / Weight sync")

Every rank drains `adapter_tensors()` (PEFT-named full tensors; it may gather shards). Rank 0,
which alone talks to the engines (all of them, colocated or not: this is disk and HTTP), writes them
as a PEFT adapter directory `sync_dir/<adapter_name>-v<version>/` (written aside, then renamed into
place, so no engine ever reads half of one) while the engines still generate. Then it pauses every
engine in place; on each it unloads the adapter of that name, loads the new directory under it and
labels the engine's weight version; and it resumes them all. Once every engine serves the new
version, the directories of earlier ones are removed. On a failure the engines are resumed and every
rank raises, as with the other updaters; an engine whose load failed serves no adapter of that name
until the next push.

The engines read the directory themselves: `sync_dir` must be on their host or on a filesystem
shared with rank 0. SGLang's unload waits for the requests running with the adapter to finish,
which requests paused in place never do: push a new adapter to SGLang between rollouts (the
reference engine lets such requests finish with the adapter they started with).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Callable, Collection, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from miles.backends.sglang_utils.engine_transport import EngineTimeouts
from miles.backends.sglang_utils.weight_sync.senders import WeightSyncError
from miles.backends.sglang_utils.weight_sync.updaters import WeightUpdater

logger = logging.getLogger(__name__)

ADAPTER_CONFIG_FILE = "adapter_config.json"
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"


def make_lora_adapter_updater(
    adapter_tensors: Callable[[], Iterator[tuple[str, torch.Tensor]]],
    adapter_config: dict[str, Any],
    *,
    engine_urls: Sequence[str],
    rank: int,
    world_size: int,
    sync_dir: str,
    adapter_name: str,
    only: Collection[str] | None = None,
    api_key: str | None = None,
    http_timeouts: EngineTimeouts | None = None,
) -> UpdateLoraAdapter:
    """The adapter-mode updater of train rank `rank` of `world_size`: rank 0 gets clients for
    every engine (`only`: just these, restarted ones), the others none. `adapter_tensors()`
    yields `(name, full tensor)` as `peft.get_peft_model_state_dict` names them;
    `adapter_config` is the adapter's PEFT config as a dict (`LoraConfig.to_dict()`), written as
    its adapter_config.json. `api_key`: the engines' admin key; `http_timeouts`: the bounds of
    the engine calls."""
    from miles.backends.sglang_utils.sync_client import SyncEngineClient

    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not a rank of a world of {world_size}")
    urls = list(engine_urls) if rank == 0 else []
    if only is not None:
        urls = [url for url in urls if url in only]
    timeouts = {"timeouts": http_timeouts} if http_timeouts is not None else {}
    clients = [SyncEngineClient(url, api_key=api_key, **timeouts) for url in urls]
    return UpdateLoraAdapter(
        adapter_tensors, clients, adapter_config=adapter_config, sync_dir=sync_dir,
        adapter_name=adapter_name, require_clients=only is None,
    )  # fmt: skip


class UpdateLoraAdapter(WeightUpdater):
    """Adapter mode: write the adapter's directory, swap it in on every engine."""

    def __init__(
        self,
        adapter_tensors: Callable[[], Iterator[tuple[str, torch.Tensor]]],
        clients: Sequence[Any],
        *,
        adapter_config: dict[str, Any],
        sync_dir: str,
        adapter_name: str,
        require_clients: bool = True,
    ) -> None:
        super().__init__(adapter_tensors, clients, buffer_size=None, dtype=None,
                         require_clients=require_clients)  # fmt: skip
        _check_adapter_config(adapter_config)
        if not adapter_name or os.sep in adapter_name or adapter_name.startswith("."):
            raise ValueError(
                f"adapter name {adapter_name!r} names the adapter on the engines and its "
                "directories: use a non-empty name without path separators or a leading dot"
            )
        self.adapter_config = adapter_config
        self.sync_dir = Path(sync_dir)
        self.adapter_name = adapter_name
        self.last_sync_bytes = 0
        """Bytes of the directory the last update wrote (rank 0; 0 on the others)."""
        self._written: list[Path] = []
        """Directories this updater wrote that the engines may still serve, oldest first."""
        self._staged: Path | None = None

    def update(self, weight_version: str) -> int:
        """Push the adapter to every engine as `weight_version`; all ranks must call this.
        Returns the bytes written (0 on ranks other than 0)."""
        super().update(weight_version)
        return self.last_sync_bytes

    def _send_paused(self, tensors: Iterator, weight_version: str) -> BaseException | None:
        """Write the directory while the engines generate, then swap it in with them paused;
        return the failure instead of raising."""
        try:
            self._staged = self._write(tensors, weight_version)
        except Exception as err:  # reported to every rank in _agree_on_failure
            logger.exception("writing LoRA adapter version %s failed", weight_version)
            return err
        error = super()._send_paused(tensors, weight_version)
        if error is None:
            self._remove_older_than(self._staged)
        return error

    def _send(self, tensors: Iterator, weight_version: str) -> None:
        assert self._staged is not None, "the directory is written before the engines pause"
        path = str(self._staged)
        for index, client in enumerate(self.clients):
            # A refusal means no adapter of this name was loaded (a fresh engine): nothing to do.
            client.unload_lora_adapter(self.adapter_name)
            loaded = _required(index, "load_lora_adapter", client.load_lora_adapter(
                lora_name=self.adapter_name, lora_path=path, pinned=False
            ))  # fmt: skip
            served = (loaded.get("loaded_adapters") or {}).get(self.adapter_name, path)
            if served != path:
                raise WeightSyncError(
                    f"engine {index} serves {self.adapter_name} from {served} after loading {path}"
                )
            _required(index, "update_weight_version", client.update_weight_version(weight_version))
        logger.info(
            "LoRA adapter %s version %s (%.1f MiB) loaded on %d engines", self.adapter_name,
            weight_version, self.last_sync_bytes / 2**20, len(self.clients),
        )  # fmt: skip

    def _write(self, tensors: Iterator, weight_version: str) -> Path:
        """Drain `tensors` into `sync_dir/<name>-v<version>/`, atomically; its path."""
        named: dict[str, torch.Tensor] = {}
        for name, tensor in tensors:
            if name in named:
                raise ValueError(f"adapter tensor {name!r} was handed over twice")
            named[name] = tensor.detach().to("cpu").contiguous()
        if not named:
            raise ValueError("the adapter updater got no tensors; the trainer handed over none")
        if os.sep in weight_version:
            raise ValueError(f"weight version {weight_version!r} cannot name a directory")
        self.sync_dir.mkdir(parents=True, exist_ok=True)
        final = self.sync_dir / f"{self.adapter_name}-v{weight_version}"
        staging = self.sync_dir / f".{final.name}.tmp-{os.getpid()}"
        shutil.rmtree(staging, ignore_errors=True)  # left by a crash
        staging.mkdir()
        config = json.dumps(self.adapter_config, indent=2, sort_keys=True, default=_json_value)
        (staging / ADAPTER_CONFIG_FILE).write_text(config)
        save_file(named, str(staging / ADAPTER_WEIGHTS_FILE), metadata={"format": "pt"})
        if final.exists():  # the same version pushed again after a failure
            shutil.rmtree(final)
        staging.rename(final)
        self.last_sync_bytes = sum(file.stat().st_size for file in final.iterdir())
        if final not in self._written:
            self._written.append(final)
        return final

    def _remove_older_than(self, newest: Path) -> None:
        """Every engine serves `newest`: the directories written before it go."""
        for directory in [d for d in self._written if d != newest]:
            shutil.rmtree(directory, ignore_errors=True)
        self._written = [newest]


def _check_adapter_config(config: dict[str, Any]) -> None:
    if not isinstance(config, dict):
        raise ValueError(
            f"adapter_config must be a dict (LoraConfig.to_dict()), got {type(config).__name__}"
        )
    peft_type = config.get("peft_type")
    if peft_type != "LORA":
        raise ValueError(
            f"adapter_config has peft_type {peft_type!r}; adapter mode syncs LORA adapters (pass "
            "the model's LoraConfig.to_dict())"
        )
    missing = [key for key in ("r", "lora_alpha", "target_modules") if config.get(key) is None]
    if missing:
        raise ValueError(f"adapter_config lacks {missing}; pass the model's LoraConfig.to_dict()")


def _json_value(value: Any) -> Any:
    """What json cannot write by itself in a PEFT config: sets (target_modules) as sorted lists,
    as PEFT's own save does."""
    if isinstance(value, set | frozenset):
        return sorted(value)
    raise TypeError(f"adapter_config holds a {type(value).__name__}, which JSON cannot hold")


def _required(index: int, action: str, answer: Any) -> dict:
    """`answer` of engine `index`, or WeightSyncError with the engine's reason."""
    if isinstance(answer, dict) and answer.get("success") is True:
        return answer
    reason = (
        answer.get("error_message") or answer.get("message") if isinstance(answer, dict) else answer
    )
    logger.warning("engine %d refused %s: %s", index, action, reason)
    raise WeightSyncError(f"engine {index} refused {action}: {reason}", {index: str(reason)})
