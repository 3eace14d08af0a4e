"""Clients of SGLang's native HTTP API on one engine or router URL (architecture.md: "Contracts /
Rollout engine"); import them from here. `EngineClient` (async) lives in `engine_client`,
`SyncEngineClient` (blocking, for trainers and Ray actors) in `sync_client`, the HTTP exchange with
its deadlines and retries (`EngineTimeouts`) in `engine_transport`, `EngineError` in `engine_error`.
"""

from miles.backends.sglang_utils.engine_client import PAUSE_MODES, EngineClient, PauseMode
from miles.backends.sglang_utils.engine_error import EngineError, HttpAnswer, server_message
from miles.backends.sglang_utils.engine_transport import EngineTimeouts
from miles.backends.sglang_utils.sync_client import SyncEngineClient

__all__ = [
    "PAUSE_MODES",
    "EngineClient",
    "EngineError",
    "EngineTimeouts",
    "HttpAnswer",
    "PauseMode",
    "SyncEngineClient",
    "server_message",
]
