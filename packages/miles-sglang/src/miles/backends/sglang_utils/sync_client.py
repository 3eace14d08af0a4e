"""`SyncEngineClient`: EngineClient's calls, blocking, for trainers and Ray actors that run no event
loop. One private loop in a daemon thread runs every call, so all threads share one connection pool.
"""

from __future__ import annotations

import asyncio
import functools
import threading
from collections.abc import Callable, Coroutine, Iterator
from typing import Any, TypeVar

from miles.backends.sglang_utils.engine_client import EngineClient

T = TypeVar("T")


def _sync(name: str) -> Callable[..., Any]:
    """A blocking method that runs EngineClient.`name` on the private loop of a SyncEngineClient."""
    async_method = getattr(EngineClient, name)

    @functools.wraps(async_method)
    def method(self: SyncEngineClient, *args: Any, **kwargs: Any) -> Any:
        return self._run(getattr(self._client, name)(*args, **kwargs))

    return method


class SyncEngineClient:
    """The EngineClient calls, blocking, for trainers and Ray actors; safe to share across threads.

    It owns an event loop in a daemon thread: every call is scheduled there, so connections are
    pooled across threads. Takes EngineClient's arguments; `close()` when done.
    """

    def __init__(self, url: str, **client_kwargs: Any):
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name=f"engine-client {url}", daemon=True
        )
        self._thread.start()
        self._client = EngineClient(url, **client_kwargs)
        self.url = self._client.url
        self._closed = False

    def __repr__(self) -> str:
        return f"SyncEngineClient({self.url!r})"

    def __enter__(self) -> SyncEngineClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        if self._closed:
            coroutine.close()
            raise RuntimeError(f"{self!r} is closed; create a new client")
        assert threading.current_thread() is not self._thread, "would wait on its own loop"
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()

    def close(self) -> None:
        """Close the connections and stop the loop thread; later calls raise."""
        if self._closed:
            return
        self._run(self._client.aclose())
        self._closed = True
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    def generate_stream(self, payload: dict[str, Any]) -> Iterator[dict[str, Any]]:
        """EngineClient.generate_stream, one blocking step per chunk."""
        chunks = self._client.generate_stream(payload)
        try:
            while True:
                try:
                    yield self._run(chunks.__anext__())
                except StopAsyncIteration:
                    return
        finally:
            if not self._closed:
                self._run(chunks.aclose())

    generate = _sync("generate")
    health = _sync("health")
    health_generate = _sync("health_generate")
    wait_until_healthy = _sync("wait_until_healthy")
    get_server_info = _sync("get_server_info")
    get_model_info = _sync("get_model_info")
    flush_cache = _sync("flush_cache")
    pause_generation = _sync("pause_generation")
    continue_generation = _sync("continue_generation")
    abort_request = _sync("abort_request")
    update_weights_from_tensor = _sync("update_weights_from_tensor")
    init_weights_update_group = _sync("init_weights_update_group")
    update_weights_from_distributed = _sync("update_weights_from_distributed")
    destroy_weights_update_group = _sync("destroy_weights_update_group")
    update_weights_from_disk = _sync("update_weights_from_disk")
    release_memory_occupation = _sync("release_memory_occupation")
    resume_memory_occupation = _sync("resume_memory_occupation")
    load_lora_adapter = _sync("load_lora_adapter")
    unload_lora_adapter = _sync("unload_lora_adapter")
    update_weight_version = _sync("update_weight_version")
