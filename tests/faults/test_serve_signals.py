"""SIGINT and SIGTERM stop `weightsync serve` within seconds, whatever it is doing.

Each case brings a server (one engine, or a data-parallel front over two replicas) to a state,
signals it, and checks: the process exits within `EXIT_BOUND_S`, with status 0; a stream open at
the signal got its final event; a control call waiting at the signal was answered 503; the port
can be bound again; and (`no_leftovers`) no process, thread, port, fd or shared-memory segment
of the case is left, the front's replicas included.
"""

from __future__ import annotations

import contextlib
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from leftovers import established_to
from serve_support import Server

from weightsync import (
    LlamaForCausalLM,
    NCCLTrainerSendWeightsArgs,
    WeightSyncError,
    WeightTransferUpdateInfo,
    trainer_init,
    trainer_send_weights,
)

pytestmark = pytest.mark.reliability("fault")

EXIT_BOUND_S = 10.0
"""How soon after the signal the server must have exited (measured: about 2 to 5 s)."""
WAIT_S = 60.0  # what the case itself waits for, at most: start-up, a call, a thread
STALL_AT_TENSOR = 10  # of the debug model's 21: several buckets are on the wire by then
BUCKET_BYTES = 32 << 10


class Case:
    """A server brought to a state; what the state opened (streams, calls, a trainer)."""

    def __init__(self, replicas: int) -> None:
        args = ["--weight-transfer-config.backend", "gloo"]
        if replicas > 1:
            args += ["--data-parallel-size", str(replicas)]
        self.replicas = replicas
        self.server = Server("debug", "--port", "0", *args)
        self.url = self.server.base_url
        self.http = httpx.Client(base_url=self.url, timeout=WAIT_S)
        self.threads: list[threading.Thread] = []
        self.stream_lines: list[str] = []
        self.group: Any = None
        self.waiting: list[httpx.Response] = []  # the answer of a control call open at the signal
        self.calls_waiting = 0  # how many control calls the state left waiting
        self.release = threading.Event()  # lets a stalled trainer go on, once the server is gone

    def in_thread(self, call: Callable[[], Any]) -> None:
        def run() -> None:
            # The server may go away under it: what each case asserts comes after.
            with contextlib.suppress(httpx.HTTPError, WeightSyncError):
                call()

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        self.threads.append(thread)

    def open_frozen_stream(self) -> None:
        """A stream the server accepted and holds open: it is queued behind a `keep` pause."""
        assert self.http.post("/pause", params={"mode": "keep"}).status_code == 200
        accepted = threading.Event()
        body = {"prompt": "hi", "max_tokens": 400, "ignore_eos": True, "stream": True}

        def stream() -> None:
            with httpx.stream("POST", f"{self.url}/v1/completions", json=body, timeout=WAIT_S) as r:
                for line in r.iter_lines():
                    if line:
                        self.stream_lines.append(line)
                    if line == ": accepted":
                        accepted.set()

        self.in_thread(stream)
        assert accepted.wait(WAIT_S)

    def trainer(self, timeout_s: float) -> Any:
        self.group = trainer_init(world_size=1 + self.replicas, backend="gloo",
                                  timeout_s=timeout_s, bucket_size_bytes=BUCKET_BYTES)  # fmt: skip
        return self.group

    def close(self) -> None:
        self.release.set()
        for thread in self.threads:
            thread.join(WAIT_S)
        self.http.close()
        if self.group is not None:
            self.group.close()
        self.server.kill()


def paused(case: Case) -> None:
    """Paused (`keep`), a stream frozen by it."""
    case.open_frozen_stream()


def asleep(case: Case) -> None:
    """Asleep (level 1), after a stream that the sleep aborted."""
    case.open_frozen_stream()
    assert case.http.post("/sleep", params={"level": 1}).status_code == 200


def init_waiting(case: Case) -> None:
    """An init waiting for a trainer that never joins its group; a stream frozen meanwhile."""
    case.open_frozen_stream()
    group = case.trainer(timeout_s=WAIT_S)
    body = {"init_info": group.init_info}
    case.in_thread(
        lambda: case.waiting.append(case.http.post("/init_weight_transfer_engine", json=body))
    )
    case.calls_waiting = 1
    deadline = time.monotonic() + WAIT_S  # every engine connects to the trainer's store
    while established_to(case.server.proc.pid, group.init_info["master_port"]) < case.replicas:
        assert time.monotonic() < deadline, "the server never reached the trainer's store"
        time.sleep(0.02)  # another process's connection: nothing here to await


def mid_broadcast(case: Case) -> None:
    """An update open, its buckets half on the wire (the trainer stalls); a stream frozen."""
    case.open_frozen_stream()
    group = case.trainer(timeout_s=WAIT_S)
    body = {"init_info": group.init_info}
    case.in_thread(lambda: case.http.post("/init_weight_transfer_engine", json=body))
    group.connect()
    assert case.http.post("/start_weight_update").status_code == 200
    pairs = list(LlamaForCausalLM.from_preset("debug", seed=3).named_weights())
    update_info = WeightTransferUpdateInfo.from_named_tensors(pairs, weight_version="stalled")
    update = {"update_info": update_info.to_dict()}
    case.in_thread(lambda: case.waiting.append(case.http.post("/update_weights", json=update)))
    case.calls_waiting = 1
    stalled, taken = threading.Event(), 0

    def take(pair: tuple[str, Any]) -> Any:
        nonlocal taken
        if taken == STALL_AT_TENSOR:
            stalled.set()
            case.release.wait(WAIT_S)
        taken += 1
        return pair[1]

    args = NCCLTrainerSendWeightsArgs(group, update_info, take)
    case.in_thread(lambda: trainer_send_weights(pairs, args))
    assert stalled.wait(WAIT_S)


STATES = {"paused": paused, "asleep": asleep, "init_waiting": init_waiting,
          "mid_broadcast": mid_broadcast}  # fmt: skip
CASES = [
    *[(1, state, sig) for state in STATES for sig in ("SIGTERM", "SIGINT")],
    # A front: its replicas must stop with it (fewer cases: each starts three processes).
    (2, "init_waiting", "SIGTERM"), (2, "init_waiting", "SIGINT"), (2, "mid_broadcast", "SIGTERM"),
]  # fmt: skip


@pytest.mark.parametrize(("replicas", "state", "sig"), CASES)
def test_a_signal_stops_the_server_within_seconds(
    no_leftovers, replicas, state, sig, record_property
):
    """A signal in each state: exit 0 within seconds, streams ended, port and memory freed."""
    case = Case(replicas)
    try:
        STATES[state](case)
        port = int(case.url.rsplit(":", 1)[1])
        start = time.monotonic()
        case.server.proc.send_signal(getattr(signal, sig))
        try:
            status = case.server.proc.wait(EXIT_BOUND_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"still running {EXIT_BOUND_S} s after {sig}:\n{case.server.output}")
        seconds = time.monotonic() - start
    finally:
        case.close()
    assert status == 0, case.server.output
    assert case.stream_lines[-1:] == ["data: [DONE]"], case.stream_lines[-3:]
    assert len(case.waiting) == case.calls_waiting  # answered at the signal, not cut off
    for answer in case.waiting:
        assert answer.status_code == 503 and "shutting down" in answer.text, answer.text
    with socket.socket() as probe:  # as a restarted server binds it
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind(("127.0.0.1", port))
    record_property("message", f"exited {seconds:.2f} s after {sig}, status {status}")
