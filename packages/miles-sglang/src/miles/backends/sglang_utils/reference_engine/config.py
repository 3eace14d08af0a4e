"""Settings of one reference engine, with SGLang's server flag names where they exist."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from miles.backends.sglang_utils.reference_engine.lora_settings import LoraSettings

DTYPES = {
    "auto": None,
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


@dataclass(kw_only=True)
class ReferenceEngineConfig:
    """One engine: which model, where it listens, how much it batches."""

    model_path: str
    """--model-path: a Hugging Face checkpoint directory (config, weights, tokenizer)."""
    host: str = "127.0.0.1"
    """--host: loopback by default; bind wider only behind --api-key."""
    port: int = 30000
    """--port."""
    random_seed: int = 0
    """--random-seed: seeds unseeded requests' samplers."""
    dtype: str = "auto"
    """--dtype: auto (the checkpoint's), float32, bfloat16 or float16."""
    context_length: int | None = None
    """--context-length: prompt + output limit (default: the model's max_position_embeddings)."""
    max_running_requests: int = 128
    """--max-running-requests: sequences decoded together; more wait in the queue."""
    admission_quiet_ms: float = 2.0
    """--admission-quiet-ms: an idle engine starts its first prefill once no request has arrived
    for this long (at most 50 ms in all), so that a burst (a rollout's requests, sent at
    once) is prefilled and decoded as one batch; 0 starts on the first request."""
    api_key: str | None = None
    """--api-key: require `Authorization: Bearer <key>` on every request but the health probes."""
    admin_api_key: str | None = None
    """--admin-api-key: the key of the admin routes (weights, memory, pause, abort); without it
    they take --api-key."""
    max_queued_requests: int = 4096
    """--max-queued-requests: sequences waiting for a slot; past it /generate answers 503 with
    Retry-After. Also the most sequences (prompts x n) one request may ask for."""
    max_request_bytes: int = 64 << 20
    """--max-request-bytes: the largest /generate body accepted (413 past it)."""
    enable_return_routed_experts: bool = False
    """--enable-return-routed-experts: record a MoE model's routing, so that requests may ask for
    `return_routed_experts` (SGLang's flag of the same name)."""
    disable_fast_decode: bool = False
    """--disable-fast-decode: decode through the Hugging Face forward even where the engine's own
    decode step covers the model (`fast_decode`), e.g. to compare the two."""
    served_model_name: str | None = None
    """--served-model-name: the model id of the OpenAI-compatible routes (default: --model-path)."""
    device: str | None = None
    """--device: torch device (default: the detected accelerator, else cpu)."""
    enable_lora: bool = False
    """--enable-lora: serve LoRA adapters (SGLang's flag); --lora-paths turns it on too."""
    max_lora_rank: int | None = None
    """--max-lora-rank: the largest adapter rank /load_lora_adapter accepts (default: the
    largest of --lora-paths)."""
    lora_target_modules: list[str] | None = None
    """--lora-target-modules: the projections adapters may adapt (q_proj k_proj v_proj o_proj
    gate_proj up_proj down_proj, or all; default: those of --lora-paths)."""
    max_loras_per_batch: int = 8
    """--max-loras-per-batch: distinct adapters in the running batch (the base model counts as
    one, as in SGLang); requests of another adapter wait for a slot."""
    lora_paths: list[str] | None = None
    """--lora-paths: adapters loaded at start, NAME=PATH (or PATH, named by its path)."""

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype {self.dtype!r} is not one of {', '.join(DTYPES)}")
        if not 0 < self.port < 65536:
            raise ValueError(f"--port {self.port} is not a TCP port (1-65535)")
        if self.max_running_requests < 1:
            raise ValueError(
                f"--max-running-requests must be >= 1, got {self.max_running_requests}"
            )
        for flag, value in (("--max-queued-requests", self.max_queued_requests),
                            ("--max-request-bytes", self.max_request_bytes)):  # fmt: skip
            if value < 1:
                raise ValueError(f"{flag} must be >= 1, got {value}")
        if self.admission_quiet_ms < 0:
            raise ValueError(
                f"--admission-quiet-ms must be >= 0 (0 admits at once), got {self.admission_quiet_ms}"
            )
        if self.api_key is not None and self.api_key == self.admin_api_key:
            raise ValueError("--admin-api-key must differ from --api-key, or it guards nothing")
        if self.context_length is not None and self.context_length < 2:
            raise ValueError(f"--context-length must be >= 2, got {self.context_length}")
        if self.lora_paths and not self.enable_lora:
            self.enable_lora = True  # as SGLang: adapters to load at start ask for LoRA serving
        self.lora  # noqa: B018 - checks the LoRA flags now, at start-up

    @cached_property
    def lora(self) -> LoraSettings:
        """The LoRA flags, checked and expanded (`all`, NAME=PATH)."""
        return LoraSettings.from_flags(
            enable_lora=self.enable_lora,
            max_lora_rank=self.max_lora_rank,
            lora_target_modules=self.lora_target_modules,
            max_loras_per_batch=self.max_loras_per_batch,
            lora_paths=self.lora_paths,
        )

    @property
    def torch_dtype(self) -> torch.dtype | str:
        return DTYPES[self.dtype] or "auto"
