"""A real headless Chromium (Debian's package) driven over the DevTools protocol.

Just what the report test needs: open a URL, evaluate JS in the page, take a screenshot.
Chromium runs in its own process group with a throwaway profile, its name resolution
mapped to nowhere (so a page that tried to load anything from the network would show it
missing instead of fetching it) and its background services off; the whole group is
killed on every way out.
"""

from __future__ import annotations

import base64
import contextlib
import itertools
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path
from types import TracebackType
from typing import Any

from websockets.sync.client import connect

START_TIMEOUT_S = 60.0
CALL_TIMEOUT_S = 60.0


def chromium_path() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


class Browser:
    def __init__(self, executable: str) -> None:
        self._profile = tempfile.TemporaryDirectory(prefix="agent-gym-chromium-")
        self._process = subprocess.Popen(
            [executable, "--headless", "--disable-gpu", "--no-first-run",
             "--no-default-browser-check", "--disable-background-networking",
             "--disable-component-update", "--disable-sync", "--disable-extensions",
             "--disable-dev-shm-usage", "--host-resolver-rules=MAP * ~NOTFOUND",
             *(["--no-sandbox"] if os.geteuid() == 0 else []),  # root: no setuid sandbox
             "--remote-debugging-address=127.0.0.1", "--remote-debugging-port=0",
             f"--user-data-dir={self._profile.name}", "--window-size=1280,1600",
             "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        )
        self._ids = itertools.count(1)
        self._stack = contextlib.ExitStack()
        try:
            self._socket = self._stack.enter_context(
                connect(self._page_socket(), max_size=None, open_timeout=START_TIMEOUT_S))
            self.call("Page.enable")
            self.call("Runtime.enable")
        except BaseException:
            self.close()
            raise

    def _page_socket(self) -> str:
        """The page's DevTools WebSocket, once Chromium has written its port."""
        port_file = Path(self._profile.name) / "DevToolsActivePort"
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise RuntimeError(f"chromium exited with status {self._process.returncode}")
            lines = port_file.read_text().split() if port_file.exists() else []
            if lines:
                with urllib.request.urlopen(f"http://127.0.0.1:{lines[0]}/json/list",
                                            timeout=10) as reply:
                    pages = [t for t in json.load(reply) if t.get("type") == "page"]
                if pages:
                    return pages[0]["webSocketDebuggerUrl"]
            time.sleep(0.1)
        raise TimeoutError("chromium did not open its DevTools port")

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        """Send one DevTools command and return its result (events on the way are dropped)."""
        ident = next(self._ids)
        self._socket.send(json.dumps({"id": ident, "method": method, "params": params}))
        deadline = time.monotonic() + CALL_TIMEOUT_S
        while True:
            message = json.loads(self._socket.recv(timeout=max(0.1, deadline - time.monotonic())))
            if message.get("id") == ident:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message.get("result", {})

    def open(self, url: str) -> None:
        """Navigate and wait until the page's scripts have run (document complete)."""
        self.call("Page.navigate", url=url)
        deadline = time.monotonic() + CALL_TIMEOUT_S
        while self.evaluate("document.readyState") != "complete" or self.evaluate(
            "location.href"
        ) != url:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{url} did not finish loading")
            time.sleep(0.05)

    def evaluate(self, expression: str) -> Any:
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True,
                           awaitPromise=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression!r} raised: {result['exceptionDetails']}")
        return result["result"].get("value")

    def screenshot(self, path: Path) -> None:
        data = self.call("Page.captureScreenshot", format="png")["data"]
        path.write_bytes(base64.b64decode(data))

    def close(self) -> None:
        try:
            self._stack.close()
        finally:
            self._kill()

    def _kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):  # the whole group: zygote, renderers
            os.killpg(self._process.pid, signal.SIGKILL)
        self._process.wait(timeout=30)
        self._profile.cleanup()

    def __enter__(self) -> Browser:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        self.close()
