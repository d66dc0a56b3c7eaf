"""Running the app on uvicorn: a socket bound up front, and a shutdown that ends open streams."""

from __future__ import annotations

import asyncio
import logging
import socket
import sys
from types import FrameType

import uvicorn
from fastapi import FastAPI

from weightsync.serve._control import ControlSurface

logger = logging.getLogger("weightsync.serve")

# How long a shutdown waits for open responses (a transfer in flight) before closing them.
_GRACEFUL_SHUTDOWN_S = 30

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


class _Server(uvicorn.Server):
    """uvicorn's server, whose first SIGINT/SIGTERM also aborts the requests in flight.

    uvicorn waits for open responses before it stops; an open stream (one frozen by a `keep`
    pause, say) would hold it up. Aborting them ends each stream with `finish_reason="abort"`
    and `[DONE]`, then the server stops and the app shuts the engine down.
    """

    def __init__(self, config: uvicorn.Config, state: ControlSurface) -> None:
        super().__init__(config)
        self._state = state
        self._loop: asyncio.AbstractEventLoop | None = None

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if not self.should_exit and self._loop is not None:
            logger.info("shutting down: aborting %d running requests", len(self._state.live))
            self._loop.call_soon_threadsafe(
                lambda: self._loop.create_task(self._state.abort_all())  # type: ignore[union-attr]
            )
        super().handle_exit(sig, frame)


def serve_forever(app: FastAPI, sock: socket.socket, *, log_level: str = "info") -> int:
    """Serves `app` on `sock` until SIGINT or SIGTERM; returns the exit status."""
    config = uvicorn.Config(
        app,
        log_level=log_level,
        access_log=False,
        timeout_graceful_shutdown=_GRACEFUL_SHUTDOWN_S,
        lifespan="on",
    )
    server = _Server(config, app.state.serve)
    sys.setswitchinterval(_GIL_SWITCH_INTERVAL_S)  # this process only serves: see above
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    # Tests and scripts wait for this line; with --port 0 it is where the port is announced.
    print(f"weightsync serve: listening on http://{shown}:{port}", file=sys.stderr, flush=True)
    server.run(sockets=[sock])
    sock.close()
    return 0 if server.started else 1
