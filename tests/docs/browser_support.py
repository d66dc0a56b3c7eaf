"""A headless Chromium driven over the DevTools protocol, and a static server for the built site.

Only the Python standard library and `websocket-client` are needed: no browser download, no
driver. Every request the page makes is intercepted: the site's own requests go through, and
anything else is refused and recorded, so a test can assert that the site needs nothing from
outside (its mermaid included: the site serves its own copy).
"""

from __future__ import annotations

import contextlib
import functools
import http.server
import json
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--remote-debugging-port=0",
    "--remote-allow-origins=*",
]


def find_chromium() -> str | None:
    """The Chromium executable: `$CHROMIUM`, else Debian's `chromium` on PATH."""
    for candidate in (os.environ.get("CHROMIUM"), "chromium", "chromium-browser"):
        if candidate and (found := shutil.which(candidate)):
            return found
    return None


@contextlib.contextmanager
def serve_directory(directory: Path) -> Iterator[str]:
    """Serves `directory` over HTTP on a free loopback port; yields the base URL."""

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:
            pass

    handler = functools.partial(Quiet, directory=str(directory))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()


class Page:
    """One browser tab: navigate, evaluate JavaScript, type; collects errors and refused requests."""

    def __init__(self, ws_url: str, origin: str, tolerated: tuple[str, ...] = ()) -> None:
        import websocket  # websocket-client

        # Outside requests the page does without: refused too, but neither recorded nor an error.
        self._tolerated = tolerated

        self._ws = websocket.create_connection(ws_url, timeout=30, suppress_origin=True)
        self._origin = origin
        self._next_id = 0
        self._events: list[dict[str, Any]] = []
        self.errors: list[str] = []
        self.refused: list[str] = []
        for method in ("Page.enable", "Runtime.enable", "Log.enable"):
            self.call(method)
        self.call("Fetch.enable", patterns=[{"urlPattern": "*"}])

    def close(self) -> None:
        """Closes the connection to the tab."""
        self._ws.close()

    def _send(self, method: str, params: dict[str, Any]) -> int:
        self._next_id += 1
        self._ws.send(json.dumps({"id": self._next_id, "method": method, "params": params}))
        return self._next_id

    def _handle(self, event: dict[str, Any]) -> None:
        method, params = event.get("method"), event.get("params", {})
        if method == "Fetch.requestPaused":
            url = params["request"]["url"]
            if url.startswith(self._origin) or url.startswith("data:"):
                self._send("Fetch.continueRequest", {"requestId": params["requestId"]})
            else:
                if not url.startswith(self._tolerated):
                    self.refused.append(url)
                self._send(
                    "Fetch.failRequest",
                    {"requestId": params["requestId"], "errorReason": "BlockedByClient"},
                )
        elif method == "Runtime.exceptionThrown":
            details = params["exceptionDetails"]
            text = details.get("exception", {}).get("description") or details.get("text")
            self.errors.append(f"exception: {text}")
        elif method == "Runtime.consoleAPICalled" and params["type"] in ("error", "assert"):
            args = " ".join(str(a.get("value", a.get("description", ""))) for a in params["args"])
            self.errors.append(f"console.{params['type']}: {args}")
        elif method == "Log.entryAdded" and params["entry"]["level"] == "error":
            entry = params["entry"]
            if not entry.get("url", "").startswith(self._tolerated):
                self.errors.append(f"log: {entry.get('text')} {entry.get('url', '')}".strip())
        self._events.append(event)

    def _receive(self) -> dict[str, Any]:
        message: dict[str, Any] = json.loads(self._ws.recv())
        if "method" in message:
            self._handle(message)
        return message

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        """Sends a command and returns its result, handling events meanwhile."""
        wanted = self._send(method, params)
        while True:
            message = self._receive()
            if message.get("id") == wanted:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                result: dict[str, Any] = message.get("result", {})
                return result

    def goto(self, url: str, timeout_s: float = 30.0) -> None:
        """Navigates and waits for the load event; clears the collected errors first."""
        self.errors.clear()
        self._events.clear()
        self.call("Page.navigate", url=url)
        deadline = time.monotonic() + timeout_s
        while not any(e.get("method") == "Page.loadEventFired" for e in self._events):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{url} did not load within {timeout_s:g} s")
            self._receive()

    def evaluate(self, expression: str) -> Any:
        """The value of a JavaScript expression (awaited if it is a promise)."""
        result = self.call(
            "Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True
        )
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def wait_for(self, expression: str, timeout_s: float = 20.0) -> Any:
        """Polls a JavaScript expression until it is truthy; returns its value.

        Raises:
            AssertionError: The page reported an error meanwhile (no point in waiting on).
            TimeoutError: Still false after `timeout_s`.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            value = self.evaluate(expression)
            if value:
                return value
            if self.errors:
                raise AssertionError(
                    f"errors while waiting for {expression}:\n" + "\n".join(self.errors)
                )
            if time.monotonic() > deadline:
                raise TimeoutError(f"still false after {timeout_s:g} s: {expression}")
            self.evaluate("new Promise(resolve => setTimeout(resolve, 100))")

    def rendered_diagrams(self) -> list[dict[str, Any]]:
        """Each `<div class="mermaid">` of the page: whether its shadow root holds an SVG, and
        whether that SVG is mermaid's error picture.

        Material draws a diagram into a closed shadow root, which the page's own scripts cannot
        read; the DevTools DOM can (`pierce`).
        """
        document = self.call("DOM.getDocument", depth=-1, pierce=True)["root"]
        found: list[dict[str, Any]] = []

        def attributes(node: dict[str, Any]) -> dict[str, str]:
            flat = node.get("attributes", [])
            return dict(zip(flat[::2], flat[1::2], strict=True))

        def svgs(node: dict[str, Any]) -> list[dict[str, Any]]:
            below = [*node.get("children", []), *node.get("shadowRoots", [])]
            here = [node] if node.get("nodeName") == "svg" else []
            return here + [svg for child in below for svg in svgs(child)]

        def walk(node: dict[str, Any]) -> None:
            classes = attributes(node).get("class", "").split()
            if node.get("nodeName") == "DIV" and "mermaid" in classes:
                drawn = [svg for root in node.get("shadowRoots", []) for svg in svgs(root)]
                roles = [attributes(svg).get("aria-roledescription", "") for svg in drawn]
                found.append({"svg": bool(drawn), "error": "error" in roles, "roles": roles})
            for child in [*node.get("children", []), *node.get("shadowRoots", [])]:
                walk(child)
            if "contentDocument" in node:
                walk(node["contentDocument"])

        walk(document)
        return found

    def type_text(self, text: str) -> None:
        """Types into the focused element, as a user would."""
        self.call("Input.insertText", text=text)


def _stop(process: subprocess.Popen[bytes]) -> None:
    """Stops Chromium and its helpers (the process group it leads), politely first."""
    for sig, wait_s in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 10.0)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, sig)
        try:
            process.wait(wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


@contextlib.contextmanager
def open_browser(chromium: str, origin: str, tolerated: tuple[str, ...] = ()) -> Iterator[Page]:
    """Starts a headless Chromium with a fresh profile; yields its first tab.

    Requests outside `origin` are refused; those starting with one of `tolerated` are not
    reported (as refused requests or console errors).
    """
    with tempfile.TemporaryDirectory(
        prefix="weightsync-chromium-", ignore_cleanup_errors=True
    ) as profile:
        # A session of its own: Chromium's helper processes are stopped with it.
        process = subprocess.Popen(
            [chromium, *FLAGS, f"--user-data-dir={profile}", "about:blank"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        page = None
        try:
            port_file = Path(profile) / "DevToolsActivePort"
            deadline = time.monotonic() + 30
            while not (port_file.is_file() and port_file.read_text().strip()):
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"chromium did not start (exit code {process.poll()})")
                time.sleep(0.05)
            port = port_file.read_text().split()[0]
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10) as reply:
                targets = json.load(reply)
            tab = next(t for t in targets if t["type"] == "page")
            page = Page(tab["webSocketDebuggerUrl"], origin, tolerated)
            yield page
        finally:
            if page is not None:
                page.close()
            _stop(process)
