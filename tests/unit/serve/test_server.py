"""The HTTP server's own limits, on uvicorn in this process: headers come in time, or it closes."""

import asyncio
import socket
import threading
import time

import pytest
import uvicorn
from fastapi import FastAPI

from weightsync.serve._server import HEADER_TIMEOUT_S, bind, server_config

HEADERS_S = 0.5  # this test's header deadline
KEEP_ALIVE_S = 1
BOUND_S = 10.0  # a socket read waits this long at most: a connection never closed fails here


@pytest.fixture(scope="module")
def url():
    app = FastAPI()

    @app.get("/slow")
    async def slow() -> dict[str, bool]:
        await asyncio.sleep(2 * HEADERS_S)  # longer than the header deadline: it is disarmed
        return {"ok": True}

    sock = bind("127.0.0.1", 0)
    config = server_config(
        app, log_level="warning", header_timeout_s=HEADERS_S, keep_alive_timeout_s=KEEP_ALIVE_S
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + BOUND_S
    while not server.started:  # a server coming up: nothing to await but its flag
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.01)
    yield sock.getsockname()[:2]
    server.should_exit = True
    thread.join(BOUND_S)
    sock.close()


def until_closed(conn):
    """Everything the server sends until it closes the connection, and how long that took."""
    start, received = time.monotonic(), b""
    conn.settimeout(BOUND_S)
    while chunk := conn.recv(4096):  # b"" once the server closed it
        received += chunk
    return received, time.monotonic() - start


@pytest.mark.reliability("bad-input")
@pytest.mark.parametrize(
    "sent", [b"", b"GET /slow HTTP/1.1\r\nHost: x\r\n"], ids=["nothing", "half"]
)
def test_a_connection_that_never_finishes_its_headers_is_closed(url, sent, record_property):
    """A client opens a connection and never finishes its headers: the server closes it."""
    with socket.create_connection(url) as conn:
        conn.sendall(sent)
        received, waited = until_closed(conn)
    assert received == b"" and HEADERS_S * 0.8 <= waited < BOUND_S
    record_property("seconds_to_error", round(waited, 2))


def test_a_request_slower_than_the_header_deadline_is_answered_and_kept_alive(url):
    with socket.create_connection(url) as conn:
        for _ in range(2):  # the second request comes on the same, kept-alive connection
            conn.sendall(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n")
            conn.settimeout(BOUND_S)
            answer = conn.recv(4096)
            assert answer.startswith(b"HTTP/1.1 200 OK") and answer.endswith(b'{"ok":true}')
        received, waited = until_closed(conn)  # idle: closed by the keep-alive limit
    assert received == b"" and waited < BOUND_S


def test_the_served_limits_are_the_documented_ones():
    config = server_config(FastAPI())
    assert config.timeout_keep_alive == 5 and config.http.header_timeout_s == HEADER_TIMEOUT_S
