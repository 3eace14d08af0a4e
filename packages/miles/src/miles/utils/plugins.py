"""Backends and rollout engines, found through entry points rather than imported by name.

Core never imports a training backend (architecture.md: "Packages and the direction of
dependencies"): each backend wheel registers itself under entry-point groups, and choosing one
whose wheel is missing is a one-line error naming the wheel. A backend registers its settings
class apart from its actor, so reading the configuration never imports the actor's module.
"""

from __future__ import annotations

import difflib
from importlib.metadata import EntryPoint, entry_points
from typing import Any

TRAIN_BACKENDS = "miles.train_backends"
"""--train-backend name -> the backend's `TrainRayActor` subclass."""
TRAIN_BACKEND_ARGS = "miles.train_backend_args"
"""--train-backend name -> the backend's settings dataclass (a `TrainerArgs` subclass)."""
ROLLOUT_ENGINES = "miles.rollout_engines"

# What a user installs to get each known plugin, and the flag that chooses it.
KNOWN_PLUGINS: dict[str, dict[str, str]] = {
    TRAIN_BACKENDS: {"fsdp": "miles-fsdp", "megatron": "miles-megatron"},
    TRAIN_BACKEND_ARGS: {"fsdp": "miles-fsdp", "megatron": "miles-megatron"},
    ROLLOUT_ENGINES: {"sglang": "miles-sglang", "reference": "miles-sglang"},
}
_FLAG = {
    TRAIN_BACKENDS: "--train-backend",
    TRAIN_BACKEND_ARGS: "--train-backend",
    ROLLOUT_ENGINES: "--rollout-engine",
}


class PluginNotInstalledError(ImportError):
    """A known backend or engine was chosen but its wheel is not installed."""


def installed_plugins(group: str) -> dict[str, EntryPoint]:
    """Entry points registered under `group` by the installed wheels, by name."""
    return {ep.name: ep for ep in entry_points(group=group)}


def load_plugin(group: str, name: str) -> Any:
    """Load the object that the installed wheel registered as `name` in `group`."""
    return _entry_point(group, name).load()


def plugin_path(group: str, name: str) -> str:
    """The "module:attribute" path that the installed wheel registered as `name` in `group`,
    without importing it (for a process that only hands the path on to another)."""
    return _entry_point(group, name).value


def _entry_point(group: str, name: str) -> EntryPoint:
    if group not in KNOWN_PLUGINS:
        raise ValueError(f"unknown plugin group {group!r}; expected one of {sorted(KNOWN_PLUGINS)}")
    installed = installed_plugins(group)
    if name in installed:
        return installed[name]
    flag = _FLAG[group]
    wheel = KNOWN_PLUGINS[group].get(name)
    if wheel is not None:
        raise PluginNotInstalledError(
            f"{flag} {name} needs the {wheel} wheel, which is not installed: run `uv pip install {wheel}`"
        )
    choices = sorted(set(KNOWN_PLUGINS[group]) | set(installed))
    close = difflib.get_close_matches(name, choices, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise ValueError(
        f"{flag} {name!r} is not a known choice{hint}; choose from {', '.join(choices)}"
    )
