"""Open a page in a real headless Chromium (Debian's `chromium`, which `.ci/run` installs) and read
back what it rendered and every error it reported, over the DevTools protocol on loopback.

`load_page(url, expression)` returns the value of `expression` evaluated in the loaded page and the
console errors, uncaught exceptions and failed loads the browser logged.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from typing import Any

_BROWSERS = ("chromium", "chromium-browser", "google-chrome")
_START_TIMEOUT_S = 60.0


def chromium_path() -> str | None:
    return next((path for name in _BROWSERS if (path := shutil.which(name))), None)


@dataclass
class LoadedPage:
    value: Any
    errors: list[str] = field(default_factory=list)


def load_page(url: str, expression: str, *, timeout_s: float = 60.0) -> LoadedPage:
    """Load `url` in a fresh headless Chromium; `expression`'s JSON value and the page's errors."""
    from websockets.sync.client import connect

    browser = chromium_path()
    assert browser is not None, "no Chromium on $PATH (apt-get install chromium)"
    with tempfile.TemporaryDirectory() as profile:
        process = subprocess.Popen(
            [browser, "--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run",
             "--remote-debugging-address=127.0.0.1", "--remote-debugging-port=0",
             f"--user-data-dir={profile}", "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        try:
            port = _devtools_port(process)
            page = _page_socket(port)
            with connect(page, max_size=None, open_timeout=timeout_s) as socket:
                return _DevTools(socket, timeout_s).load(url, expression)
        finally:
            process.kill()
            process.wait(timeout=30)


def _devtools_port(process: subprocess.Popen) -> int:
    deadline = time.monotonic() + _START_TIMEOUT_S
    assert process.stderr is not None
    seen = []
    while time.monotonic() < deadline:
        line = process.stderr.readline()
        if not line and process.poll() is not None:
            break
        seen.append(line)
        found = re.search(r"DevTools listening on ws://127\.0\.0\.1:(\d+)/", line)
        if found:
            return int(found.group(1))
    raise RuntimeError(f"Chromium did not open its DevTools port:\n{''.join(seen)[-2000:]}")


def _page_socket(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=30) as answer:
        targets = json.load(answer)
    return next(t["webSocketDebuggerUrl"] for t in targets if t["type"] == "page")


class _DevTools:
    def __init__(self, socket: Any, timeout_s: float) -> None:
        self.socket, self.timeout_s = socket, timeout_s
        self.errors: list[str] = []
        self._next_id = 0
        self._loaded = False

    def load(self, url: str, expression: str) -> LoadedPage:
        for domain in ("Page", "Runtime", "Log"):
            self.call(f"{domain}.enable")
        self.call("Page.navigate", url=url)
        deadline = time.monotonic() + self.timeout_s
        while not self._loaded:
            assert time.monotonic() < deadline, f"{url} did not finish loading"
            self._read()
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"evaluating in the page failed: {result['exceptionDetails']}")
        return LoadedPage(value=result["result"].get("value"), errors=self.errors)

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        self._next_id += 1
        self.socket.send(json.dumps({"id": self._next_id, "method": method, "params": params}))
        while True:
            message = self._read()
            if message.get("id") == self._next_id:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message["result"]

    def _read(self) -> dict[str, Any]:
        message = json.loads(self.socket.recv(timeout=self.timeout_s))
        method, params = message.get("method"), message.get("params", {})
        if method == "Page.loadEventFired":
            self._loaded = True
        elif method == "Runtime.exceptionThrown":
            self.errors.append(f"exception: {params['exceptionDetails'].get('text')}")
        elif method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
            self.errors.append(f"console.{params['type']}: {params.get('args')}")
        elif method == "Log.entryAdded" and params["entry"].get("level") == "error":
            entry = params["entry"]
            self.errors.append(f"{entry.get('source')}: {entry.get('text')} {entry.get('url', '')}")
        return message
