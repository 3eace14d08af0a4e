"""The reference engine behind one server: the model and tokenizer (and a vision-language model's
processor), the scheduler that decodes, the weight manager, the LoRA adapters (with
--enable-lora), and what every route asks of them (parsing, validation, the queue bound, texts,
server info). No HTTP here: the routes modules take a `ReferenceEngine`, and `server.py` builds
the app around one.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from typing import Any

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    AutoTokenizer,
)

from miles.backends.sglang_utils.reference_engine.config import ReferenceEngineConfig
from miles.backends.sglang_utils.reference_engine.errors import InvalidRequestError, QueueFullError
from miles.backends.sglang_utils.reference_engine.images import load_image
from miles.backends.sglang_utils.reference_engine.lora_layers import LoraAdapter
from miles.backends.sglang_utils.reference_engine.lora_registry import LoraRegistry
from miles.backends.sglang_utils.reference_engine.model_runner import ModelRunner
from miles.backends.sglang_utils.reference_engine.requests import (
    GenerateLimits,
    ParsedGenerate,
    SequenceSpec,
    parse_generate,
)
from miles.backends.sglang_utils.reference_engine.sampling import SamplingParams
from miles.backends.sglang_utils.reference_engine.scheduler import Request as EngineRequest
from miles.backends.sglang_utils.reference_engine.scheduler import Scheduler
from miles.backends.sglang_utils.reference_engine.vision_inputs import PromptImages, VisionProcessor
from miles.backends.sglang_utils.reference_engine.weights import WeightManager
from miles.backends.sglang_utils.token_spelling import TokenSpelling
from miles.backends.sglang_utils.vlm_checkpoint import checkpoint_renamer, is_vision_language
from miles.backends.sglang_utils.weight_sync import DISTRIBUTED_LOAD_FORMATS, FLATTENED_BUCKET
from miles.backends.training_utils.infra.device import get_torch_device

VERSION = "miles-reference-engine/1"

# A token is at least one character of text: a longer prompt cannot fit, so it is refused before
# the tokenizer spends seconds on it.
_MAX_CHARS_PER_TOKEN = 64


class ReferenceEngine:
    """The model, tokenizer, loop and weight manager behind one server."""

    def __init__(self, config: ReferenceEngineConfig) -> None:
        self.config = config
        torch.manual_seed(config.random_seed)
        self.device = torch.device(config.device) if config.device else get_torch_device(0)
        self.tokenizer = AutoTokenizer.from_pretrained(config.model_path)
        # A config with a vision tower (Qwen2.5-VL, Qwen3-VL) is served with its image inputs.
        checkpoint_config = AutoConfig.from_pretrained(config.model_path)
        vision = is_vision_language(checkpoint_config)
        if vision and config.lora.enabled:
            # Its adapters would also name the vision tower's projections, which no test covers.
            raise ValueError(
                f"--enable-lora: the reference engine serves LoRA adapters on text models, and "
                f"{config.model_path} is a vision-language model ({checkpoint_config.model_type});"
                " sync merged weights (--lora-sync merged) or serve adapters with SGLang"
            )
        auto_model = AutoModelForImageTextToText if vision else AutoModelForCausalLM
        model = auto_model.from_pretrained(config.model_path, dtype=config.torch_dtype)
        self.model_config = model.config
        self.text_config = model.config.get_text_config()
        """The language model's settings (a vision-language model nests them)."""
        self.vision = VisionProcessor(config.model_path, model.config) if vision else None
        """A vision-language model's processor; None for a text model, which refuses images."""
        self.context_length = config.context_length or int(
            getattr(self.text_config, "max_position_embeddings", 4096)
        )
        self.scheduler = Scheduler(
            ModelRunner(
                model,
                self.device,
                record_routed_experts=config.enable_return_routed_experts,
                fast_decode=not config.disable_fast_decode,
                lora=config.lora.enabled,
            ),
            eos_token_ids=self._eos_ids(model),
            context_length=self.context_length,
            max_running_requests=config.max_running_requests,
            seed=config.random_seed,
            admission_quiet_s=config.admission_quiet_ms / 1000,
            max_loras_per_batch=config.lora.max_per_batch if config.lora.enabled else None,
        )
        # A vision-language model's updates come in its hub layout (SGLang's loaders' names).
        rename = checkpoint_renamer(model) if vision else None
        self.weights = WeightManager(
            self.scheduler, self.scheduler.runner.model, self.device, rename=rename
        )
        runner = self.scheduler.runner
        self.loras: LoraRegistry | None = None
        """The served LoRA adapters; None without --enable-lora."""
        if runner.lora is not None:
            try:
                self.loras = LoraRegistry.start(runner.lora, config.lora, model.dtype)
            except BaseException:
                self.scheduler.shutdown()
                raise
        self.limits = GenerateLimits(
            max_text_chars=self.context_length * _MAX_CHARS_PER_TOKEN,
            max_sequences=config.max_queued_requests,
        )
        # One thread tokenizes, off the event loop: a long prompt does not stall /health, and a
        # fast tokenizer is never entered from two threads at once.
        self._tokenizer_thread = ThreadPoolExecutor(1, thread_name_prefix="tokenize")
        self.spelling = TokenSpelling(self.tokenizer)

    @property
    def model_name(self) -> str:
        return self.config.served_model_name or self.config.model_path

    async def off_loop(self, fn: Callable[..., Any], *args: Any) -> Any:
        """`fn(*args)` in the tokenizer's thread: text work never stalls the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer_thread, fn, *args)

    def token_text(self, token_id: int) -> str:
        return self.spelling.text(token_id)

    def token_texts(self, ids: list[int]) -> list[str]:
        """Each token decoded alone, as SGLang's return_text_in_logprobs does it."""
        # transformers 5 decodes an empty batch to [""].
        return self.tokenizer.batch_decode([[token] for token in ids]) if ids else []

    async def parse(self, body: Any) -> ParsedGenerate:
        """A /generate body, validated; text and images are read off the event loop."""
        reader = self.read_prompt if self.vision is not None else None
        if not (
            isinstance(body, dict) and (body.get("text") is not None or body.get("image_data"))
        ):
            return parse_generate(body, self.tokenize, self.limits, reader)  # ids: nothing slow
        return await self.off_loop(parse_generate, body, self.tokenize, self.limits, reader)

    def read_prompt(
        self, prompt: str | list[int], image_data: list[str], param: str
    ) -> tuple[list[int], PromptImages | None]:
        """A vision-language model's prompt (text with one placeholder per image, or expanded
        ids) and its images (`image_data` strings, named `param` in errors) -> its token ids and
        images. Runs in the tokenizer's thread (`off_loop`)."""
        assert self.vision is not None, "only a vision-language model reads images"
        images = [load_image(value, f"{param}[{j}]") for j, value in enumerate(image_data)]
        return self.vision.read(prompt, images, param)

    def check_queue(self, sequences: int) -> None:
        """Refuse `sequences` more when the wait queue would grow past --max-queued-requests."""
        waiting = self.scheduler.num_waiting
        if waiting + sequences > self.config.max_queued_requests:
            raise QueueFullError(
                f"{waiting} requests wait already; {sequences} more would pass "
                f"--max-queued-requests {self.config.max_queued_requests}: retry shortly"
            )

    def _eos_ids(self, model) -> set[int]:
        ids = model.generation_config.eos_token_id if model.generation_config else None
        ids = ids if ids is not None else self.tokenizer.eos_token_id
        return set(ids if isinstance(ids, list) else [ids]) - {None}

    def tokenize(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise InvalidRequestError(
                f"text must be a string or a list of strings, got {type(text).__name__}"
            )
        return self.tokenizer.encode(text, add_special_tokens=False)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def adapters_for(self, specs: list[SequenceSpec]) -> list[LoraAdapter | None]:
        """The LoRA adapter of each sequence (`lora_path`, a loaded adapter's name; None: the
        base model)."""
        names = [spec.lora_path for spec in specs]
        if self.loras is None:
            asked = next((name for name in names if name is not None), None)
            if asked is not None:
                raise InvalidRequestError(
                    f"LoRA adapter {asked!r} was requested (lora_path), but LoRA is not enabled: "
                    "start the engine with --enable-lora and load adapters with --lora-paths or "
                    "/load_lora_adapter",
                    param="lora_path",
                )
            return [None] * len(specs)
        return self.loras.resolve(names)

    def validate(self, spec: SequenceSpec) -> None:
        vocab = self.text_config.vocab_size
        if max(spec.input_ids) >= vocab:
            raise InvalidRequestError(
                f"input_ids contain token id {max(spec.input_ids)} >= vocab size {vocab}"
            )
        if spec.token_ids_logprob and max(spec.token_ids_logprob) >= vocab:
            raise InvalidRequestError(
                f"token_ids_logprob contains token id {max(spec.token_ids_logprob)} >= vocab "
                f"size {vocab}",
                param="token_ids_logprob",
            )
        if len(spec.input_ids) >= self.context_length:
            raise InvalidRequestError(
                f"prompt of {len(spec.input_ids)} tokens does not fit the context length "
                f"{self.context_length} (--context-length); shorten it"
            )
        if "weights" in self.weights.released or "kv_cache" in self.weights.released:
            raise InvalidRequestError(
                "memory is released; call /resume_memory_occupation before generating"
            )

    def stop_checker(self, params: SamplingParams) -> Callable[[EngineRequest], str | None] | None:
        if not params.stop:
            return None

        def check(request: EngineRequest) -> str | None:
            text = self.decode(request.output_ids)
            return next((s for s in params.stop if s in text), None)

        return check

    def final_text(self, request: EngineRequest) -> str:
        text = self.decode(request.output_ids)
        matched = (request.finish_reason or {}).get("matched")
        if isinstance(matched, str) and not self._params_of(request).no_stop_trim:
            text = text[: text.find(matched)] if matched in text else text
        return text

    @staticmethod
    def _params_of(request: EngineRequest) -> SamplingParams:
        return request.params

    def server_info(self) -> dict[str, Any]:
        info = asdict(self.config)
        for key in ("api_key", "admin_api_key"):  # said to be set, never echoed
            info[key] = "(set)" if info[key] else None
        info.update(
            version=VERSION,
            pid=os.getpid(),
            weight_version=self.scheduler.weight_version,
            context_length=self.context_length,
            max_total_num_tokens=self.context_length * self.config.max_running_requests,
            **{DISTRIBUTED_LOAD_FORMATS: [FLATTENED_BUCKET]},
            internal_states=[
                {
                    "num_running": self.scheduler.num_running,
                    "num_waiting": self.scheduler.num_waiting,
                    "paused": self.scheduler.paused,
                    "finished_requests": self.scheduler.finished_requests,
                    "decode_steps": self.scheduler.steps,
                    "prefilled_tokens": self.scheduler.runner.prefilled_tokens,
                    "step_seconds": dict(self.scheduler.step_seconds),
                }
            ],
        )
        return info
