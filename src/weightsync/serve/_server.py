"""Running the app on uvicorn: a socket bound up front, and a shutdown that ends open streams."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys
import threading
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

import uvicorn
from fastapi import FastAPI
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from weightsync.engine.async_engine import TRANSFER_THREAD_NAME
from weightsync.serve._view import ServerView

logger = logging.getLogger("weightsync.serve")

SHUTDOWN_GRACE_S = 2
"""How long, in seconds, a shutdown (SIGINT, SIGTERM) waits for open responses before it cancels
them. Streams were aborted at the signal and end at once; what may stay open is a control call
waiting on a trainer (an init waiting for its group, an update mid-broadcast), whose trainer's
side fails within its own `timeout_s` once the server is gone."""

ENGINE_SHUTDOWN_TIMEOUT_S = 2.0
"""How long, in seconds, a server's shutdown waits for its engine's: a transfer call that still
waits in torch holds the transfer engine until its `timeout_s`, and the server does not wait
for that (see `serve_forever`)."""

HEADER_TIMEOUT_S = 10.0
"""How long, in seconds, a connection may take to send a request's headers, counted from its
opening or from the end of its previous response; then it is closed. uvicorn bounds none of
this: a client that opens connections and never finishes its headers would hold them forever."""

KEEP_ALIVE_TIMEOUT_S = 5
"""How long, in seconds, an idle keep-alive connection stays open for its next request."""

# How long a thread may hold the GIL while another waits for it (Python's default: 5 ms). The
# event loop (a few microseconds of Python per streamed chunk) and the engine's step thread (Python
# between torch ops) take turns on it all the time; with 5 ms slices each waits out whole slices of
# the other, which delays both the chunks and the next step. Shorter slices let them interleave.
_GIL_SWITCH_INTERVAL_S = 0.0005


def bind(host: str, port: int) -> socket.socket:
    """Binds a listening socket, so a port in use is an `OSError` here, not a traceback later.

    Raises:
        OSError: The address is in use or cannot be bound.
    """
    family, kind, proto, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, kind, proto)
    # Reuse a port whose old connections linger in TIME_WAIT; a live listener still refuses.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
        sock.listen(2048)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


class _HeaderDeadlineProtocol(HttpToolsProtocol):
    """uvicorn's HTTP/1.1 protocol (httptools), with a deadline for every request's headers.

    The deadline runs from the connection's opening, and again from the end of each response
    while no request is queued behind it; the request's last header byte disarms it. The
    request's body and the response have no such deadline: a route bounds its own work.
    """

    header_timeout_s: float = HEADER_TIMEOUT_S

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_header_deadline()

    def on_headers_complete(self) -> None:
        self._disarm_header_deadline()
        super().on_headers_complete()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.timeout_keep_alive_task is not None:  # idle, waiting for the next request
            self._arm_header_deadline()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_deadline()
        super().connection_lost(exc)

    def _arm_header_deadline(self) -> None:
        self._disarm_header_deadline()
        self._header_deadline = self.loop.call_later(self.header_timeout_s, self._headers_late)

    def _disarm_header_deadline(self) -> None:
        if self._header_deadline is not None:
            self._header_deadline.cancel()
            self._header_deadline = None

    def _headers_late(self) -> None:
        self._header_deadline = None
        if not self.transport.is_closing():
            self.transport.close()


def server_config(
    app: FastAPI,
    *,
    log_level: str = "info",
    header_timeout_s: float = HEADER_TIMEOUT_S,
    keep_alive_timeout_s: int = KEEP_ALIVE_TIMEOUT_S,
) -> uvicorn.Config:
    """The settings `app` is served with: the timeouts above, a graceful shutdown, no access log."""
    protocol = type(
        "HeaderDeadlineProtocol", (_HeaderDeadlineProtocol,), {"header_timeout_s": header_timeout_s}
    )
    return uvicorn.Config(
        app,
        http=protocol,
        log_level=log_level,
        access_log=False,
        timeout_keep_alive=keep_alive_timeout_s,
        timeout_graceful_shutdown=SHUTDOWN_GRACE_S,
        lifespan="on",
    )


class _Server(uvicorn.Server):
    """uvicorn's server, whose first SIGINT/SIGTERM also aborts the requests in flight.

    uvicorn waits for open responses before it stops; an open stream (one frozen by a `keep`
    pause, say) would hold it up. Aborting them ends each stream with `finish_reason="abort"`
    and `[DONE]`, and a control call still waiting on a trainer is answered 503 (see
    `StopAnsweredRoute`); then the server stops and the app shuts the engine down. `on_signal`
    runs at the first signal too (a front signals its replicas, which then stop alongside it).
    """

    def __init__(
        self, config: uvicorn.Config, app: FastAPI, on_signal: Callable[[], None] | None
    ) -> None:
        super().__init__(config)
        self._state: ServerView = app.state.serve
        self._stopping: asyncio.Event = app.state.stopping
        self._on_signal = on_signal
        self._loop: asyncio.AbstractEventLoop | None = None

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if not self.should_exit and self._loop is not None:
            logger.info("shutting down: aborting %d running requests", len(self._state.live))
            if self._on_signal is not None:
                self._on_signal()
            self._loop.call_soon_threadsafe(self._stopping.set)  # control calls answer 503
            self._loop.call_soon_threadsafe(
                lambda: self._loop.create_task(self._state.abort_all())  # type: ignore[union-attr]
            )
        super().handle_exit(sig, frame)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        """SIGINT and SIGTERM stop the server while it serves; the previous handlers come back.

        uvicorn's own raises the signal again once the server stopped, to end the process with
        it: `serve_forever` ends the process itself, with status 0.
        """
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in _STOP_SIGNALS}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def serve_forever(
    app: FastAPI,
    sock: socket.socket,
    *,
    log_level: str = "info",
    on_signal: Callable[[], None] | None = None,
) -> int:
    """Serves `app` on `sock` until SIGINT or SIGTERM; returns the exit status.

    The process stops within seconds of the signal, whatever it was doing: open responses get
    `SHUTDOWN_GRACE_S`, the app's shutdown bounds its own steps, and a transfer call still
    waiting in torch (which nothing can interrupt) is left behind: the process then exits
    without waiting for it (`os._exit`, after the app's shutdown released what it could).

    Args:
        app: The app to serve.
        sock: A bound, listening socket (see `bind`).
        log_level: uvicorn's log level.
        on_signal: Run at the first signal, before the server starts stopping.
    """
    server = _Server(server_config(app, log_level=log_level), app, on_signal)
    sys.setswitchinterval(_GIL_SWITCH_INTERVAL_S)  # this process only serves: see above
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    # Tests and scripts wait for this line; with --port 0 it is where the port is announced.
    print(f"weightsync serve: listening on http://{shown}:{port}", file=sys.stderr, flush=True)
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
    status = 0 if server.started else 1
    waiting = [t for t in threading.enumerate() if t.name == TRANSFER_THREAD_NAME and t.is_alive()]
    if waiting:
        logger.warning("exiting while %d transfer call(s) still wait in torch (each would end "
                       "within its timeout_s); its trainer sees the server gone", len(waiting))  # fmt: skip
        logging.shutdown()  # flushes the log: os._exit skips the interpreter's clean-up
        sys.stderr.flush()
        os._exit(status)
    return status
