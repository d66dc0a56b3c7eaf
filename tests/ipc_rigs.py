"""Test rig: trainer and receiver processes for IPC transfers, driven over JSON pipes.

Spawn-safe entry points used by the multi-process tests and the benchmarks, built on
`process_rigs.CommandProcess`. The parent process plays the control channel (what HTTP or Ray is
in production): an `IPCTrainerProcess` hands it each update info dict, the parent gives the dict
to every `IPCReceiverProcess` and sends the trainer their acknowledgement. Only JSON crosses the
pipes.
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from typing import Any

import torch

from process_rigs import (
    CommandProcess,
    WorkerProcessError,
    allocate_tensors,
    fill_tensors,
    serve_commands,
)
from weightsync import weight_checksums
from weightsync.errors import WeightTransferError, WeightTransferTimeout, WeightValidationError
from weightsync.transfer.base import TransferStats, WeightTransferUpdateInfo
from weightsync.transfer.ipc import (
    IPCTrainerSendWeightsArgs,
    IPCWeightTransferEngine,
    ipc_trainer_init,
    ipc_trainer_send_weights,
)

__all__ = ["IPCReceiverProcess", "IPCTrainerProcess", "deliver_to_processes"]


def _use_device(device: str) -> None:
    if torch.device(device).type == "cuda":  # handles open on, and copies run on, this device
        torch.cuda.set_device(torch.device(device))


def _stats(stats: TransferStats) -> dict[str, Any]:
    return {**vars(stats), "gbps": stats.gbps}


def _receiver_main(
    conn: Connection, update_info: dict[str, Any], device: str, worker_index: int
) -> None:
    _use_device(device)
    specs = WeightTransferUpdateInfo(**update_info).specs()
    params = allocate_tensors(specs, flat=False, device=device)
    engine = IPCWeightTransferEngine(worker_index=worker_index, params=params)

    def load_weights(pairs: list[tuple[str, torch.Tensor]]) -> None:
        for name, tensor in pairs:
            params[name].copy_(tensor)

    def update(update_info: dict[str, Any]) -> dict[str, Any]:
        stats = engine.receive_weights(update_info, load_weights)
        return {"stats": _stats(stats), "update_in_progress": engine.update_in_progress}

    def fill(seed: int) -> None:
        fill_tensors(params, seed)

    serve_commands(
        conn,
        {
            "init": lambda init_info: engine.init_transfer_engine(init_info),
            "update": update,
            "fill": fill,
            "digests": lambda: {"digests": weight_checksums(params)},
            "state": lambda: {
                "initialized": engine.is_initialized,
                "update_in_progress": engine.update_in_progress,
            },
            "abort": engine.abort_update,
            "shutdown": engine.shutdown,
        },
    )
    engine.shutdown()


def _trainer_main(
    conn: Connection, update_info: dict[str, Any], device: str, timeout_s: float
) -> None:
    _use_device(device)
    specs = WeightTransferUpdateInfo(**update_info).specs()
    state: dict[str, Any] = {}

    def init(layout: str = "plain", **session_kwargs: Any) -> dict[str, Any]:
        if "session" in state:
            state["session"].close()
        if layout not in ("plain", "shared"):
            raise ValueError(f"layout must be 'plain' or 'shared', got {layout!r}")
        session = state["session"] = ipc_trainer_init(**session_kwargs)
        if layout == "shared":  # weightsync's own shared memory: exported in place
            state["tensors"] = session.shared_tensors(specs)
        else:
            state["tensors"] = allocate_tensors(specs, flat=False, device=device)
        return {"init_info": session.init_info, "janitor_pid": session.janitor_pid}

    def deliver(info: dict[str, Any]) -> None:
        conn.send_bytes(json.dumps({"ok": True, "deliver": info}).encode())
        if not conn.poll(timeout_s):
            raise WeightTransferTimeout(
                f"no acknowledgement from the parent within {timeout_s:g} s"
            )
        ack = json.loads(conn.recv_bytes())
        if ack.get("error") is not None:
            error_cls = (
                WeightValidationError
                if ack.get("error_type") == "WeightValidationError"
                else WeightTransferError
            )
            raise error_cls(ack["error"])

    def send(seed: int, fail_at_part: int | None = None) -> dict[str, Any]:
        tensors = state["tensors"]
        fill_tensors(tensors, seed)
        parts = iter(range(-1, 1 << 30))  # the announcement is delivery -1

        def deliver_or_fail(info: dict[str, Any]) -> None:
            if next(parts) == fail_at_part:  # a failure drill: this part's delivery fails
                raise WeightTransferError(f"failure drill at part {fail_at_part}")
            deliver(info)

        args = IPCTrainerSendWeightsArgs(state["session"], deliver_or_fail, update_info)
        stats = ipc_trainer_send_weights(tensors.items(), args)
        return {"stats": _stats(stats), "segments": state["session"].segment_names()}

    def close() -> None:
        state.pop("session").close()

    def fork_child() -> dict[str, Any]:
        # A plain fork, as a DataLoader worker is made: the child inherits every fd, the
        # janitor's pipe included, and outlives this process until someone kills it.
        pid = os.fork()
        if pid == 0:
            try:
                while True:
                    signal.pause()
            finally:
                os._exit(0)
        return {"child_pid": pid}

    serve_commands(
        conn,
        {
            "init": init,
            "send": send,
            "fork_child": fork_child,
            "digests": lambda: {"digests": weight_checksums(state["tensors"])},
            "segments": lambda: {"segments": state["session"].segment_names()},
            "close": close,
        },
    )
    if "session" in state:
        state["session"].close()


def _relay(
    receivers: Sequence[CommandProcess], update_info: dict[str, Any]
) -> tuple[str, str] | None:
    """Gives `update_info` to every receiver; returns `(error_type, message)` if any failed."""
    for receiver in receivers:
        receiver.start("update", update_info=update_info)
    failures = []
    for index, receiver in enumerate(receivers):
        try:
            reply = receiver.reply(check=False)
        except (TimeoutError, OSError, EOFError) as exc:
            failures.append(("WeightTransferTimeout", f"receiver {index}: {exc}"))
            continue
        if not reply["ok"]:
            failures.append(
                (
                    reply["error_type"],
                    f"receiver {index}: {reply['error_type']}: {reply['message']}",
                )
            )
    if not failures:
        return None
    kinds = {kind for kind, _ in failures}
    kind = "WeightValidationError" if kinds == {"WeightValidationError"} else "WeightTransferError"
    return kind, "; ".join(message for _, message in failures)


def deliver_to_processes(
    receivers: Sequence[CommandProcess],
) -> Callable[[dict[str, Any]], None]:
    """A `deliver` callable for a trainer in this process that feeds receiver processes.

    Raises (from the callable):
        WeightValidationError: Every failing receiver rejected the update.
        WeightTransferError: Some receiver failed otherwise (or did not answer).
    """

    def deliver(update_info: dict[str, Any]) -> None:
        failure = _relay(receivers, update_info)
        if failure is not None:
            kind, message = failure
            raise (
                WeightValidationError if kind == "WeightValidationError" else WeightTransferError
            )(message)

    return deliver


class IPCReceiverProcess(CommandProcess):
    """A process holding zeroed tensors for `update_info` and an `ipc` receiver engine.

    Commands: `init` (`init_info`), `update` (`update_info`), `fill` (`seed`), `digests`,
    `state`, `abort` (drop the update in progress), `shutdown`, `exit`.

    Args:
        update_info: Dict form of the tensors it holds (and expects).
        device: Where its tensors live, e.g. `"cpu"` or `"cuda:0"`.
        worker_index: Its index among the trainer's workers.
        timeout_s: Limit for each reply, in seconds.
    """

    def __init__(
        self,
        *,
        update_info: dict[str, Any],
        device: str = "cpu",
        worker_index: int = 0,
        timeout_s: float = 120.0,
    ) -> None:
        super().__init__(_receiver_main, (update_info, device, worker_index), timeout_s)


class IPCTrainerProcess(CommandProcess):
    """A process holding tensors for `update_info` that it fills from a seed and sends by IPC.

    Commands: `init` (`layout` = `"plain"` or `"shared"` (the session's shared memory), plus the
    keyword arguments of `ipc_trainer_init`),
    `send` (see `IPCTrainerProcess.send`), `digests`,
    `segments`, `fork_child` (a plain `os.fork` child that waits to be killed; its pid),
    `close`, `exit`.

    Args:
        update_info: Dict form of the tensors it holds.
        device: Where its tensors live, e.g. `"cpu"` or `"cuda:0"`.
        timeout_s: Limit for each reply and each acknowledgement, in seconds.
    """

    def __init__(
        self, *, update_info: dict[str, Any], device: str = "cpu", timeout_s: float = 120.0
    ) -> None:
        super().__init__(_trainer_main, (update_info, device, timeout_s), timeout_s)

    def next_message(self) -> dict[str, Any]:
        """Waits for the trainer's next message: a delivery (`"deliver"` key) or the final reply."""
        message: dict[str, Any] = self.reply(check=False)
        return message

    def acknowledge(self, failure: tuple[str, str] | None = None) -> None:
        """Answers the pending delivery: done, or failed with `(error_type, message)`."""
        if failure is None:
            self.start("ack")
        else:
            self.start("ack", error_type=failure[0], error=failure[1])

    def send(self, receivers: Sequence[CommandProcess], **fields: Any) -> dict[str, Any]:
        """Runs `send` (`seed`, optional `fail_at_part`), relaying each delivery to `receivers`.

        Returns:
            The trainer's reply, with its `stats` and the `segments` it holds afterwards.

        Raises:
            WorkerProcessError: The send failed; `error_type` names the trainer's exception.
        """
        self.start("send", **fields)
        while True:
            message = self.next_message()
            if "deliver" in message:
                self.acknowledge(_relay(receivers, message["deliver"]))
                continue
            if not message["ok"]:
                raise WorkerProcessError(message)
            return message
