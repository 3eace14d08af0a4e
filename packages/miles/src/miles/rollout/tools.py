"""Tools a policy may call during a rollout: Python functions named by import path (--tool-paths).

A tool is a plain function, sync or async, whose parameters are annotated with JSON's types
(`int`, `float`, `str`, `bool`, `list`, `dict`): its name, its docstring's first paragraph and its
signature become the OpenAI function spec the chat template shows the model. A call never fails
the rollout: a tool that raises, takes arguments it does not accept, or does not answer within
--tool-timeout-s gives the model an error message instead, and the call is counted.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import json
import typing
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from miles.backends.training_utils.infra.import_path import load_function

TOOL_PATHS_FLAG = "--tool-paths"
# Sync tools run here, not in the event loop's default executor: a tool that hangs past its
# timeout keeps its thread, and must not starve the reward functions that share that executor.
_TOOL_THREADS = ThreadPoolExecutor(max_workers=16, thread_name_prefix="tool")
_JSON_TYPES = {int: "integer", float: "number", str: "string", bool: "boolean",
               list: "array", dict: "object"}  # fmt: skip


@dataclass(frozen=True)
class Tool:
    name: str
    function: Callable[..., Any]
    spec: dict[str, Any]
    """OpenAI's tool spec: {"type": "function", "function": {name, description, parameters}}."""


@dataclass(frozen=True)
class ToolResult:
    text: str
    """What the model reads back: the tool's answer, or what went wrong."""
    failure: str | None = None
    """None, or why the call failed: "unknown tool", "bad arguments", "raised", "timeout"."""


def load_tools(paths: list[str]) -> dict[str, Tool]:
    """The tools of --tool-paths ("pkg.mod:fn" each), by name; an unusable one is an error
    naming it, raised before the run starts."""
    tools: dict[str, Tool] = {}
    for path in paths:
        function = load_function(path, TOOL_PATHS_FLAG)
        name = function.__name__
        if name in tools:
            raise ValueError(f"{TOOL_PATHS_FLAG}: two tools are named {name!r}; rename one")
        tools[name] = Tool(name, function, _spec(name, function, path))
    return tools


def _spec(name: str, function: Callable[..., Any], path: str) -> dict[str, Any]:
    hints = typing.get_type_hints(function)
    properties, required = {}, []
    for parameter in inspect.signature(function).parameters.values():
        kind = _JSON_TYPES.get(
            typing.get_origin(hints.get(parameter.name)) or hints.get(parameter.name)
        )
        if kind is None or parameter.kind not in (
            parameter.POSITIONAL_OR_KEYWORD,
            parameter.KEYWORD_ONLY,
        ):
            raise ValueError(
                f"{TOOL_PATHS_FLAG} {path}: parameter {parameter.name!r} needs one of the "
                "annotations int, float, str, bool, list or dict (a model passes JSON), and must "
                "be nameable (no *args or **kwargs)"
            )
        properties[parameter.name] = {"type": kind}
        if parameter.default is parameter.empty:
            required.append(parameter.name)
    description = (inspect.getdoc(function) or "").split("\n\n")[0].replace("\n", " ")
    parameters = {"type": "object", "properties": properties, "required": required}
    return {"type": "function",
            "function": {"name": name, "description": description, "parameters": parameters}}  # fmt: skip


async def call_tool(
    tools: dict[str, Tool], name: str, arguments: str, timeout_s: float
) -> ToolResult:
    """Run one call the model made (`arguments`: a JSON object); never raises for the tool's sake.

    A sync tool runs in a worker thread: one that hangs past the timeout keeps its thread (Python
    cannot stop it), but the rollout goes on without it."""
    tool = tools.get(name)
    if tool is None:
        return ToolResult(
            f"error: there is no tool {name!r}; tools: {sorted(tools)}", "unknown tool"
        )
    try:
        values = json.loads(arguments)
        if not isinstance(values, dict):
            raise TypeError(f"arguments must be a JSON object, got {arguments!r}")
        inspect.signature(tool.function).bind(**values)
    except (TypeError, ValueError) as err:
        return ToolResult(f"error: bad arguments for {name}: {err}", "bad arguments")
    try:
        if inspect.iscoroutinefunction(tool.function):
            answer = await asyncio.wait_for(tool.function(**values), timeout_s)
        else:
            loop = asyncio.get_running_loop()
            call = functools.partial(tool.function, **values)
            answer = await asyncio.wait_for(loop.run_in_executor(_TOOL_THREADS, call), timeout_s)
        text = answer if isinstance(answer, str) else json.dumps(answer, default=str)
    except TimeoutError:
        return ToolResult(f"error: {name} did not answer within {timeout_s:g} s", "timeout")
    except Exception as err:  # the tool's own failure is the model's to read, not the run's
        return ToolResult(f"error: {name} raised {type(err).__name__}: {err}", "raised")
    return ToolResult(text)
