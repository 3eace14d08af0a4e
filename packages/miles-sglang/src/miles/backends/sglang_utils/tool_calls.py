"""Tool calls in a model's output, in the format Qwen's chat templates teach: one JSON object per
call between `<tool_call>` and `</tool_call>`,

    <tool_call>
    {"name": "add", "arguments": {"a": 1, "b": 2}}
    </tool_call>

`parse_tool_calls` turns such text into OpenAI's `message.tool_calls`. An output whose calls do not
all parse (broken JSON, no name, a tool that was not offered) is no call at all: the client gets the
text as the model wrote it, so a policy learns from its own malformed calls instead of the server
failing on them.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
_CALL = re.compile(re.escape(TOOL_CALL_START) + r"(.*?)" + re.escape(TOOL_CALL_END), re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str
    """The arguments as a JSON object in a string, as OpenAI sends them."""
    id: str

    def as_openai(self, index: int | None = None) -> dict[str, Any]:
        call: dict[str, Any] = {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        if index is not None:  # a streamed delta names its position
            call["index"] = index
        return call


@dataclass(frozen=True)
class ParsedOutput:
    content: str | None
    """The text before the first call without its trailing whitespace; None when that is empty."""
    tool_calls: list[ToolCall]


def parse_tool_calls(text: str, tool_names: set[str]) -> ParsedOutput:
    """`text` split into content and calls of the offered `tool_names`; no calls when any
    `<tool_call>` block is malformed, or when text other than whitespace follows the calls."""
    matches = list(_CALL.finditer(text))
    if not matches:
        return ParsedOutput(text, [])
    calls = []
    for match in matches:
        call = _one_call(match.group(1), tool_names)
        if call is None:
            return ParsedOutput(text, [])
        calls.append(call)
    between = _CALL.sub("", text[matches[0].start() :])
    if between.strip():  # prose after or between the calls: not a well-formed answer
        return ParsedOutput(text, [])
    # Trailing whitespace before the first call is not content (a stream holds it back too).
    content = text[: matches[0].start()].rstrip()
    return ParsedOutput(content or None, calls)


def _one_call(body: str, tool_names: set[str]) -> ToolCall | None:
    try:
        value = json.loads(body)
    except (ValueError, RecursionError):  # RecursionError: brackets nested thousands deep
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    if value["name"] not in tool_names:
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):  # already encoded: it must still be a JSON object
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError):
            return None
    if not isinstance(arguments, dict):
        return None
    try:  # a lone UTF-16 surrogate (JSON's "\ud800") is no text a tool or a tokenizer takes
        json.dumps([value["name"], arguments], ensure_ascii=False).encode()
    except (UnicodeEncodeError, ValueError, RecursionError):
        return None
    # ASCII-escaped: arguments the model wrote may hold a lone surrogate ("\\ud800").
    encoded = json.dumps(arguments)
    return ToolCall(name=value["name"], arguments=encoded, id=f"call_{uuid.uuid4().hex[:24]}")


def held_back(text: str) -> int:
    """How many trailing characters of streamed `text` could begin a `<tool_call>` tag: they wait
    until the next token says whether a call starts."""
    for length in range(min(len(TOOL_CALL_START) - 1, len(text)), 0, -1):
        if TOOL_CALL_START.startswith(text[-length:]):
            return length
    return 0
