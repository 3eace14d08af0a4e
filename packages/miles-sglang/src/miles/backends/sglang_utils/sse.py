"""Server-sent events as SGLang streams them (`/generate` with `stream: true`): the JSON of each
`data:` line of an aiohttp answer, up to `data: [DONE]`, whatever the length of a line.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import aiohttp

from miles.backends.sglang_utils import fast_json


async def sse_data(response: aiohttp.ClientResponse) -> AsyncIterator[Any]:
    """The JSON of each `data:` line of a server-sent-event stream, until `data: [DONE]`."""
    async for line in _lines(response):
        if not line.startswith(b"data:"):
            continue  # blank separators, comments and other SSE fields
        data = line[len(b"data:") :].strip()
        if data == b"[DONE]":
            return
        yield fast_json.loads(data)


async def _lines(response: aiohttp.ClientResponse) -> AsyncIterator[bytes]:
    """The body's lines, however long: a chunk of a long answer with its log-probs can pass
    the line bound of aiohttp's own line reader (512 KiB)."""
    pending = b""
    async for data in response.content.iter_any():
        pending += data
        *lines, pending = pending.split(b"\n")
        for line in lines:
            yield line.rstrip(b"\r")
    if pending:
        yield pending
