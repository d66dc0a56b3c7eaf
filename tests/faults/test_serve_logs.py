"""What a server's log says of an expected failure: one line, torch's C++ frames only at debug."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
from serve_support import Server

from weightsync import trainer_init

pytestmark = pytest.mark.reliability("fault")

WAIT_S = 30.0
GONE = "rank 1: the trainer"  # the line that says the trainer went
CPP_FRAMES = ("frame #", "c10::")
JOINED = "joined a gloo group"


def joined_then_closed(server: Server) -> int:
    """A trainer joins `server` to its gloo group and closes it; returns where the close's lines
    begin in the server's output, once the server said it noticed."""
    group = trainer_init(world_size=2, backend="gloo", timeout_s=WAIT_S)
    answers: list[httpx.Response] = []
    body = {"init_info": group.init_info}
    joining = threading.Thread(target=lambda: answers.append(
        httpx.post(f"{server.base_url}/init_weight_transfer_engine", json=body, timeout=WAIT_S)
    ))  # fmt: skip
    joining.start()
    try:
        group.connect()
        joining.join(WAIT_S)
        # The join's own line, which the answer may overtake on its way here, comes first.
        wait_for_line(server, JOINED, 0)
        mark = len(server.lines)
    finally:
        group.close()
    assert answers and answers[0].status_code == 200, answers
    wait_for_line(server, GONE, mark)  # the server's watch notices within about a second
    return mark


def wait_for_line(server: Server, text: str, start: int) -> None:
    """Waits until a line the server printed from line `start` on holds `text`."""
    deadline = time.monotonic() + WAIT_S
    while not any(text in line for line in server.lines[start:]):
        assert time.monotonic() < deadline, f"the server never said {text!r}:\n{server.output}"
        time.sleep(0.05)  # a line printed by another process: nothing to await


def test_a_trainer_that_closes_its_group_is_one_line_in_the_servers_log(record_property):
    """A trainer closes its gloo group: the server logs one line, and no C++ frame."""
    server = Server("debug", "--port", "0", "--weight-transfer-config.backend", "gloo",
                    log_level="info")  # fmt: skip
    try:
        mark = joined_then_closed(server)
        assert server.stop() in (0, -15)
    finally:
        server.kill()
    # Everything the server printed after the close, until its own shutdown began.
    said = []
    for line in server.lines[mark:]:
        if "shutting down" in line:
            break
        said += [line] if line.strip() else []
    assert len(said) == 1 and GONE in said[0], server.output
    assert not [line for line in server.lines if any(f in line for f in CPP_FRAMES)], server.output
    record_property("message", said[0][:160])


def test_at_debug_level_the_servers_log_has_torchs_detail():
    """The same at `--log-level debug`: torch's failure and its C++ frames are in the log."""
    server = Server("debug", "--port", "0", "--weight-transfer-config.backend", "gloo",
                    log_level="debug")  # fmt: skip
    try:
        joined_then_closed(server)
        assert server.stop() in (0, -15)
    finally:
        server.kill()
    assert "DistNetworkError" in server.output and "Traceback" in server.output
    assert any("frame #" in line for line in server.lines), server.output
