"""`EngineClient`, the async client of SGLang's native HTTP API on one engine or router URL: one
method per endpoint, grouped by role (generation, health and info, scheduling control, weights and
memory, LoRA adapters). The HTTP below them - connection pool, deadlines, retries - is
`engine_transport`'s.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any, Literal

import aiohttp

from miles.backends.sglang_utils import fast_json
from miles.backends.sglang_utils.engine_error import EngineError, server_message
from miles.backends.sglang_utils.engine_transport import JSON_BODY, Answer, EngineTransport
from miles.backends.sglang_utils.sse import sse_data

if TYPE_CHECKING:  # only named in annotations: the client stays importable without loading torch
    import torch

logger = logging.getLogger(__name__)

PauseMode = Literal["abort", "retract", "in_place"]
PAUSE_MODES: tuple[str, ...] = ("abort", "retract", "in_place")


def _drop_none(fields: dict[str, Any]) -> dict[str, Any]:
    # Omitted fields take SGLang's defaults; older servers also reject fields they do not know.
    return {key: value for key, value in fields.items() if value is not None}


def _dtype_name(dtype: str | torch.dtype) -> str:
    # SGLang looks dtypes up with getattr(torch, name): it wants "bfloat16", not "torch.bfloat16".
    return str(dtype).removeprefix("torch.")


class EngineClient(EngineTransport):
    """Async client of one SGLang server (or a router in front of several), pooled and bounded.

    `max_concurrency` bounds the generation calls in flight; control calls (health, pause, abort,
    weight updates) bypass it, so a pause always reaches an engine saturated with generations.
    Use it from one event loop (its connection pool, opened at the first call, belongs to that
    loop); threads use SyncEngineClient. Its arguments, connection pool, deadlines and retries
    are those of `EngineTransport`, which it extends.
    """

    def __repr__(self) -> str:
        return f"EngineClient({self.url!r})"

    async def __aenter__(self) -> EngineClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def _get_json(self, endpoint: str) -> Any:
        return (await self._request("GET", endpoint, retry=True)).json()

    async def _post(self, endpoint: str, payload: dict[str, Any] | None = None) -> Any:
        """A control POST: JSON answer, or None for SGLang's empty and plain-text answers."""
        response = await self._request("POST", endpoint, payload=payload or {})
        try:
            return response.json()
        except ValueError:
            return None

    async def _post_update(self, endpoint: str, payload: dict[str, Any]) -> dict[str, Any]:
        """A weight or memory call: SGLang's `{"success", "message"}`, whatever the outcome.

        SGLang answers a failed update with HTTP 400 and `success: false`; that is returned, not
        raised, so callers read one shape. Other HTTP errors raise EngineError.
        """
        try:
            response = await self._request(
                "POST", endpoint, payload=payload, read_timeout_s=self.timeouts.weights_s
            )
        except EngineError as exc:
            body = _json_or_none(exc.body or "")
            refused = exc.status is not None and exc.status < 500
            if refused and isinstance(body, dict) and "success" in body:
                return body
            raise
        body = _json_or_none(response.text)
        if isinstance(body, dict) and "success" in body:
            return body
        # /release_memory_occupation and /resume_memory_occupation answer `null` on success.
        return {"success": True, "message": ""}

    # -- generation -------------------------------------------------------------------------

    async def generate(self, payload: dict[str, Any]) -> dict[str, Any] | list[dict[str, Any]]:
        """POST /generate with a raw SGLang body; a batched `input_ids`/`text` answers a list.
        The call's deadline: `EngineTimeouts.generate_deadline_s`."""
        deadline_s = self.timeouts.generate_deadline_s(payload)
        async with self._generation_slots:
            response = await self._request(
                "POST", "/generate", payload=payload, read_timeout_s=deadline_s,
                deadline_s=deadline_s + self.timeouts.connect_s,
            )  # fmt: skip
        return response.json()

    async def generate_stream(self, payload: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """POST /generate with `stream: true`; yields each SSE `data:` chunk until `[DONE]`.

        Close the iterator (`contextlib.aclosing`) when stopping early: it holds a generation slot.
        """
        body = {**payload, "stream": True}
        timeout = self._timeout(self.timeouts.generate_s)
        async with self._generation_slots:
            try:
                async with self._session().post(
                    self.url + "/generate",
                    data=fast_json.dumps(body),
                    headers=JSON_BODY,
                    timeout=timeout,
                ) as response:
                    if not response.ok:
                        answer = await Answer.read(response)
                        raise EngineError.from_response(self.url, "/generate", answer)
                    async for chunk in sse_data(response):
                        if isinstance(chunk, dict) and "error" in chunk:
                            # SGLang reports a failure mid-stream as `data: {"error": {"message"}}`.
                            error = chunk["error"]
                            message = error.get("message") if isinstance(error, dict) else error
                            raise EngineError(self.url, "/generate", 200, str(message))
                        yield chunk
            except aiohttp.ClientError as exc:
                raise self._transport_error("/generate", exc) from exc

    # -- health and info --------------------------------------------------------------------

    async def _probe(self, endpoint: str, timeout_s: float | None = None) -> tuple[bool, str]:
        """One GET without retries: a probe reports the state now; callers poll. `timeout_s`
        bounds the whole answer (default: the control calls' bound)."""
        # The whole answer within the bound: a server that trickles bytes never resets it.
        bound_s = timeout_s if timeout_s is not None else self.timeouts.control_s
        timeout = aiohttp.ClientTimeout(total=bound_s, sock_connect=self.timeouts.connect_s)
        try:
            response = await self._send("GET", endpoint, None, timeout)
        except (aiohttp.ClientError, TimeoutError) as exc:  # `total` runs out as a TimeoutError
            why = (
                f"no complete answer within {bound_s:g} s" if isinstance(exc, TimeoutError) else exc
            )
            return False, f"{type(exc).__name__}: {why}"
        if response.is_success:
            return True, f"HTTP {response.status_code}"
        return False, f"HTTP {response.status_code}: {server_message(response)}"

    async def health(self) -> bool:
        """GET /health: the HTTP server answers (the model may still be loading)."""
        return (await self._probe("/health"))[0]

    async def check_health(self, timeout_s: float) -> tuple[bool, str]:
        """GET /health within `timeout_s`: (answered 2xx, what it answered or why not)."""
        return await self._probe("/health", timeout_s)

    async def health_generate(self) -> bool:
        """GET /health_generate: the engine can generate a token."""
        return (await self._probe("/health_generate"))[0]

    async def wait_until_healthy(self, timeout_s: float = 600.0, poll_s: float = 1.0) -> None:
        """Poll /health_generate until it answers 200; raise EngineError after `timeout_s`."""
        start = time.monotonic()
        next_log = start
        while True:
            ok, answer = await self._probe("/health_generate")
            elapsed = time.monotonic() - start
            if ok:
                logger.info("engine %s is healthy after %.1f s", self.url, elapsed)
                return
            if elapsed >= timeout_s:
                raise EngineError(
                    self.url,
                    "/health_generate",
                    None,
                    f"not healthy after {elapsed:.0f} s (last answer: {answer})",
                    "raise the timeout for slow model loads, or read the engine's log",
                )
            if time.monotonic() >= next_log:
                logger.info(
                    "waiting for engine %s /health_generate: %.0f s of %.0f s (last answer: %s)",
                    self.url,
                    elapsed,
                    timeout_s,
                    answer,
                )
                next_log += 10.0
            await asyncio.sleep(poll_s)

    async def get_server_info(self) -> dict[str, Any]:
        """GET /get_server_info: server arguments and scheduler state."""
        return await self._get_json("/get_server_info")

    async def get_model_info(self) -> dict[str, Any]:
        """GET /get_model_info: model_path, tokenizer_path, is_generation, weight_version."""
        return await self._get_json("/get_model_info")

    # -- scheduling control -----------------------------------------------------------------

    async def flush_cache(self) -> None:
        """POST /flush_cache (SGLang answers 400 while requests are running)."""
        await self._post("/flush_cache")

    async def pause_generation(self, mode: PauseMode = "abort") -> Any:
        """POST /pause_generation: abort (return running requests), retract or in_place."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode {mode!r} is not one of {', '.join(PAUSE_MODES)}")
        return await self._post("/pause_generation", {"mode": mode})

    async def continue_generation(self) -> Any:
        """POST /continue_generation: resume after pause_generation."""
        return await self._post("/continue_generation")

    async def abort_request(self, rid: str = "", abort_all: bool = False) -> None:
        """POST /abort_request: abort one request by `rid`, or every request."""
        await self._post("/abort_request", {"rid": rid, "abort_all": abort_all})

    # -- weights and memory -----------------------------------------------------------------

    async def update_weights_from_tensor(
        self,
        serialized_named_tensors: list[str],
        load_format: str | None = None,
        flush_cache: bool = True,
        weight_version: str | None = None,
    ) -> dict[str, Any]:
        """POST /update_weights_from_tensor: one serialized bucket per tensor-parallel rank."""
        payload = {
            "serialized_named_tensors": serialized_named_tensors,
            "load_format": load_format,
            "flush_cache": flush_cache,
            "weight_version": weight_version,
        }
        return await self._post_update("/update_weights_from_tensor", _drop_none(payload))

    async def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str = "weight_update_group",
        backend: str = "nccl",
    ) -> dict[str, Any]:
        """POST /init_weights_update_group: join the trainer's broadcast group."""
        payload = {
            "master_address": master_address,
            "master_port": master_port,
            "rank_offset": rank_offset,
            "world_size": world_size,
            "group_name": group_name,
            "backend": backend,
        }
        return await self._post_update("/init_weights_update_group", payload)

    async def update_weights_from_distributed(
        self,
        names: list[str],
        dtypes: list[str | torch.dtype],
        shapes: list[list[int]],
        group_name: str = "weight_update_group",
        flush_cache: bool = True,
        weight_version: str | None = None,
        load_format: str | None = None,
    ) -> dict[str, Any]:
        """POST /update_weights_from_distributed: receive these tensors from the broadcast, one by
        one, or (`load_format="flattened_bucket"`) as one flat tensor."""
        payload = {
            "names": names,
            "dtypes": [_dtype_name(dtype) for dtype in dtypes],
            "shapes": [list(shape) for shape in shapes],
            "group_name": group_name,
            "flush_cache": flush_cache,
            "weight_version": weight_version,
            "load_format": load_format,
        }
        return await self._post_update("/update_weights_from_distributed", _drop_none(payload))

    async def destroy_weights_update_group(
        self, group_name: str = "weight_update_group"
    ) -> dict[str, Any]:
        """POST /destroy_weights_update_group."""
        return await self._post_update("/destroy_weights_update_group", {"group_name": group_name})

    async def update_weights_from_disk(
        self, model_path: str, load_format: str | None = None, weight_version: str | None = None
    ) -> dict[str, Any]:
        """POST /update_weights_from_disk: reload weights from a checkpoint directory."""
        payload = {
            "model_path": model_path,
            "load_format": load_format,
            "weight_version": weight_version,
        }
        return await self._post_update("/update_weights_from_disk", _drop_none(payload))

    async def release_memory_occupation(self, tags: list[str] | None = None) -> dict[str, Any]:
        """POST /release_memory_occupation: free `tags` (weights, kv_cache; None: all)."""
        return await self._post_update("/release_memory_occupation", _drop_none({"tags": tags}))

    async def resume_memory_occupation(self, tags: list[str] | None = None) -> dict[str, Any]:
        """POST /resume_memory_occupation: take back what release_memory_occupation freed."""
        return await self._post_update("/resume_memory_occupation", _drop_none({"tags": tags}))

    # -- LoRA adapters ------------------------------------------------------------------------

    async def load_lora_adapter(
        self, lora_name: str, lora_path: str, pinned: bool = False
    ) -> dict[str, Any]:
        """POST /load_lora_adapter: serve the PEFT adapter directory `lora_path` (read by the
        engine: on its host or a shared filesystem) as `lora_name`, which /generate's
        `lora_path` then names. SGLang's `{success, error_message, loaded_adapters}`; a refusal
        is returned, not raised."""
        payload = {"lora_name": lora_name, "lora_path": lora_path, "pinned": pinned}
        return await self._post_update("/load_lora_adapter", payload)

    async def unload_lora_adapter(self, lora_name: str) -> dict[str, Any]:
        """POST /unload_lora_adapter: stop serving adapter `lora_name` (requests running with it
        finish with it). Answers as load_lora_adapter."""
        return await self._post_update("/unload_lora_adapter", {"lora_name": lora_name})

    async def update_weight_version(
        self, new_version: str, abort_all_requests: bool = False
    ) -> dict[str, Any]:
        """POST /update_weight_version: label what the engine serves from now on (`meta_info`'s
        `weight_version`) without sending weights, e.g. after a new LoRA adapter."""
        payload = {"new_version": new_version, "abort_all_requests": abort_all_requests}
        return await self._post_update("/update_weight_version", payload)

    # -- profiling ----------------------------------------------------------------------------

    async def start_profile(
        self, output_dir: str, activities: list[str] | None = None
    ) -> dict[str, Any]:
        """POST /start_profile: the engine's own torch.profiler, until stop_profile; its trace
        goes to `output_dir` on the engine's host. Answers `{"success", "message"}`."""
        payload = _drop_none({"output_dir": output_dir, "activities": activities})
        return await self._post_update("/start_profile", payload)

    async def stop_profile(self) -> dict[str, Any]:
        """POST /stop_profile: end the profile and write its trace. Answers as start_profile."""
        return await self._post_update("/stop_profile", {})


def _json_or_none(text: str) -> Any:
    try:
        return json.loads(text) if text.strip() else None
    except ValueError:
        return None
