"""One rollout engine's Ray actor: it sits in the engine's placement bundle and owns the server process.

The server (SGLang or the reference engine) is a child of this actor, so it runs on the bundle's node
with the bundle's devices, and killing the actor's placement never orphans it: `shutdown` stops the
process tree, and so does the actor's exit.
"""

from __future__ import annotations

import atexit
import logging
from typing import Any

import ray
from miles.backends.sglang_utils.engine_launcher import EngineLauncher, EngineLaunchSpec
from miles.utils.plugins import ROLLOUT_ENGINES, load_plugin

logger = logging.getLogger(__name__)


class RolloutEngineActor:
    """Start one engine through the `miles.rollout_engines` entry point, report its URL."""

    def __init__(self) -> None:
        self._launcher: EngineLauncher | None = None
        atexit.register(self.shutdown)

    def start(self, engine: str, spec: dict[str, Any], *, bind_node_ip: bool = True) -> str:
        """Launch engine `engine` (e.g. "reference") with `spec` (EngineLaunchSpec fields)."""
        if self._launcher is not None:
            raise RuntimeError(f"this actor already runs an engine at {self._launcher.url}")
        spec = dict(spec)
        if bind_node_ip:
            # Other nodes' trainers and the router reach the engine at this node's address.
            spec.setdefault("host", ray.util.get_node_ip_address())
        launcher_class = load_plugin(ROLLOUT_ENGINES, engine)
        launcher = launcher_class(EngineLaunchSpec(**spec))
        url = launcher.start()
        self._launcher = launcher
        logger.info("%s engine ready at %s (pid %s)", engine, url, launcher.pid)
        return url

    def pid(self) -> int | None:
        return self._launcher.pid if self._launcher is not None else None

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def shutdown(self, grace_s: float | None = None) -> None:
        """Stop the engine's process tree (SIGKILL after `grace_s`, default the launcher's);
        `start` may be called again afterwards."""
        if self._launcher is not None:
            launcher, self._launcher = self._launcher, None
            launcher.shutdown(**({} if grace_s is None else {"grace_s": grace_s}))
