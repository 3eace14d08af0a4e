"""The user's agent (--agent-function-path): loaded and checked when the settings are built, so a
missing or plain function stops the run before anything starts."""

from __future__ import annotations

import inspect
from typing import Any

from miles.backends.training_utils.infra.import_path import ImportPathError, load_function

AGENT_FLAG = "--agent-function-path"


def load_agent(path: str) -> Any:
    """The agent function `path` names; it must be `async def run(client, sample)`."""
    agent = load_function(path, AGENT_FLAG)
    if not inspect.iscoroutinefunction(agent):
        raise ImportPathError(
            f"{AGENT_FLAG} {path!r} names a plain function; an agent is "
            "`async def run(client, sample) -> str | None`"
        )
    return agent
