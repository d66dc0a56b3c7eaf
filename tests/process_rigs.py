"""Test rig: trainer and receiver processes for broadcast transfers, driven over a JSON pipe.

Spawn-safe entry points used by the multi-process tests and the benchmarks: a `ReceiverProcess`
holds a set of tensors and receives updates into them; a `TrainerProcess` holds tensors filled
from a seed and sends them. Commands and replies are JSON objects (no pickle of
tensors or code crosses the pipe), and every wait for a reply has a timeout.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing as mp
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import torch

from weightsync import weight_checksums
from weightsync.transfer.base import TensorSpec, WeightTransferUpdateInfo
from weightsync.transfer.buckets import flat_tensors

__all__ = [
    "CommandProcess",
    "ReceiverProcess",
    "TrainerProcess",
    "WorkerProcessError",
    "allocate_tensors",
    "fill_tensors",
    "serve_commands",
]


class WorkerProcessError(RuntimeError):
    """A command failed inside a worker process; `error_type` names the original exception.

    Attributes:
        error_type: Class name of the exception raised in the worker.
        reply: The full reply, e.g. with `partially_applied`.
    """

    def __init__(self, reply: dict[str, Any]) -> None:
        super().__init__(f"{reply.get('error_type')}: {reply.get('message')}")
        self.error_type = str(reply.get("error_type"))
        self.reply = reply


def allocate_tensors(
    specs: list[TensorSpec], *, flat: bool, device: str = "cpu"
) -> dict[str, torch.Tensor]:
    """Zeroed tensors for `specs`: one flat buffer in the bucket layout, or one tensor each."""
    if flat:
        return flat_tensors(specs, device=device)[1]
    return {s.name: torch.zeros(s.shape, dtype=s.dtype, device=device) for s in specs}


def fill_tensors(tensors: dict[str, torch.Tensor], seed: int) -> None:
    """Fills `tensors` in place with values determined by `seed` (and each tensor's position)."""
    generator = torch.Generator().manual_seed(seed)
    for tensor in tensors.values():
        if tensor.numel() == 0:
            continue
        if tensor.dtype == torch.bool:
            values = torch.randint(0, 2, tensor.shape, generator=generator).bool()
        elif tensor.dtype.is_floating_point or tensor.dtype.is_complex:
            values = torch.randn(tensor.shape, generator=generator).to(tensor.dtype)
        else:
            info = torch.iinfo(tensor.dtype)
            values = torch.randint(
                max(info.min, -100), min(info.max, 100), tensor.shape, generator=generator
            ).to(tensor.dtype)
        tensor.copy_(values)


def _use_device(device: str) -> None:
    """Makes `device` this process's current CUDA device (NCCL needs it); CPU needs nothing."""
    if torch.device(device).type == "cuda":
        torch.cuda.set_device(torch.device(device))


def _peak_rss_bytes() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def _reset_peak_rss() -> dict[str, int]:
    """Restarts peak-RSS tracking (Linux) and returns the current RSS as the new baseline."""
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")
    return {"rss": _peak_rss_bytes()}


def serve_commands(conn: Connection, handlers: dict[str, Callable[..., Any]]) -> None:
    """Answers JSON commands on `conn` until `exit`; errors are replies, not crashes.

    Each command is a JSON object `{"op": name, **kwargs}`; `handlers[name](**kwargs)` runs and
    its dict result (or `{"ok": false, "error_type", "message", ...}`) is the reply.
    """
    torch.set_num_threads(1)  # several processes share the cores; oversubscription costs more
    while True:
        command = json.loads(conn.recv_bytes())
        op = command.pop("op")
        if op == "exit":
            conn.send_bytes(json.dumps({"ok": True}).encode())
            return
        try:
            result = handlers[op](**command)
            reply = {"ok": True, **(result or {})}
        except Exception as exc:
            reply = {
                "ok": False,
                "error_type": type(exc).__name__,
                "message": str(exc),
                "partially_applied": getattr(exc, "partially_applied", None),
                "traceback": traceback.format_exc(),
            }
        conn.send_bytes(json.dumps(reply).encode())


def _receiver_main(
    conn: Connection,
    backend: str,
    update_info: dict[str, Any],
    worker_index: int,
    flat: bool,
    in_place: bool,
    device: str,
) -> None:
    from weightsync.transfer.base import create_engine

    _use_device(device)
    specs = WeightTransferUpdateInfo(**update_info).specs()
    params = allocate_tensors(specs, flat=flat, device=device)
    engine = create_engine(
        backend,
        worker_index=worker_index,
        params=params if in_place else None,
        expected_specs={s.name: s for s in specs},
    )

    def load_weights(pairs: list[tuple[str, torch.Tensor]]) -> None:
        for name, tensor in pairs:
            params[name].copy_(tensor)

    def update(update_info: dict[str, Any], stall_after_loads: int | None = None) -> dict[str, Any]:
        loads = 0

        def load_or_stall(pairs: list[tuple[str, torch.Tensor]]) -> None:
            nonlocal loads
            if loads == stall_after_loads:  # a failure drill: hang mid-update, say so first
                conn.send_bytes(json.dumps({"ok": True, "stalled": True}).encode())
                torch.multiprocessing.Event().wait()
            loads += 1
            load_weights(pairs)

        stats = engine.receive_weights(update_info, load_or_stall)
        return {"stats": {**vars(stats), "gbps": stats.gbps}}

    def init(init_info: dict[str, Any]) -> None:
        engine.init_transfer_engine(init_info)

    serve_commands(
        conn,
        {
            "init": init,
            "update": update,
            "digests": lambda: {"digests": weight_checksums(params)},
            "reset_peak": _reset_peak_rss,
            "peak": lambda: {"peak_rss": _peak_rss_bytes()},
            "shutdown": engine.shutdown,
        },
    )
    engine.shutdown()


def _trainer_main(
    conn: Connection,
    update_info: dict[str, Any],
    flat: bool,
    init_default_group: bool,
    device: str,
) -> None:
    from weightsync.transfer.nccl import (
        NCCLTrainerSendWeightsArgs,
        TrainerGroup,
        trainer_init,
        trainer_send_weights,
    )

    _use_device(device)
    if init_default_group:  # like a DDP/FSDP trainer: the transfer must leave this group alone
        import torch.distributed as dist

        store = dist.TCPStore("127.0.0.1", 0, 1, True)  # type: ignore[attr-defined]
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    specs = WeightTransferUpdateInfo(**update_info).specs()
    tensors = allocate_tensors(specs, flat=flat, device=device)
    groups: list[TrainerGroup] = []

    def init(**kwargs: Any) -> dict[str, Any]:
        groups[:] = [trainer_init(**kwargs)]
        return {"init_info": groups[0].init_info}

    def send(seed: int, stall_at_tensor: int | None = None) -> dict[str, Any]:
        fill_tensors(tensors, seed)

        def stall(pair: tuple[str, torch.Tensor]) -> torch.Tensor:
            if pair[0] == specs[stall_at_tensor or 0].name:  # a failure drill: hang mid-update
                conn.send_bytes(json.dumps({"ok": True, "stalled": True}).encode())
                torch.multiprocessing.Event().wait()
            return pair[1]

        args = NCCLTrainerSendWeightsArgs(
            groups[0], update_info, stall if stall_at_tensor is not None else None
        )
        stats = trainer_send_weights(tensors.items(), args)
        result: dict[str, Any] = {"stats": {**vars(stats), "gbps": stats.gbps}}
        if init_default_group:
            import torch.distributed as dist

            result["default_group_size"] = dist.get_world_size()
        return result

    serve_commands(
        conn,
        {
            "init": init,
            "connect": lambda: groups[0].connect(),
            "close": lambda: groups.pop().close(),
            "send": send,
            "digests": lambda: {"digests": weight_checksums(tensors)},
        },
    )


class CommandProcess:
    """Parent-side handle of a spawned process that runs `serve_commands`.

    Args:
        target: Spawn-safe function `target(conn, *args)` that ends in `serve_commands`.
        args: Its further arguments (JSON-like values).
        timeout_s: Default limit for each reply, in seconds.
    """

    def __init__(
        self, target: Callable[..., None], args: tuple[Any, ...], timeout_s: float
    ) -> None:
        context = mp.get_context("spawn")
        self._conn, child = context.Pipe()
        self.process = context.Process(target=target, args=(child, *args), daemon=True)
        self.process.start()
        child.close()
        self.timeout_s = timeout_s

    @property
    def pid(self) -> int:
        """The process id."""
        assert self.process.pid is not None
        return self.process.pid

    def start(self, op: str, **fields: Any) -> None:
        """Sends a command without waiting for its reply."""
        self._conn.send_bytes(json.dumps({"op": op, **fields}).encode())

    def reply(self, timeout_s: float | None = None, *, check: bool = True) -> dict[str, Any]:
        """Waits for the next reply.

        Raises:
            TimeoutError: No reply within `timeout_s` (default: the handle's).
            WorkerProcessError: The command failed and `check` is set.
        """
        limit = self.timeout_s if timeout_s is None else timeout_s
        if not self._conn.poll(limit):
            raise TimeoutError(f"no reply from worker process {self.pid} within {limit:g} s")
        reply: dict[str, Any] = json.loads(self._conn.recv_bytes())
        if check and not reply["ok"]:
            raise WorkerProcessError(reply)
        return reply

    def call(self, op: str, **fields: Any) -> dict[str, Any]:
        """Sends a command and returns its (successful) reply."""
        self.start(op, **fields)
        return self.reply()

    def kill(self) -> None:
        """Kills the process at once (SIGKILL)."""
        self.process.kill()
        self.process.join(self.timeout_s)

    def close(self) -> None:
        """Asks the process to exit; kills it if it does not within the timeout."""
        if self.process.is_alive():
            with contextlib.suppress(OSError, TimeoutError, EOFError):
                self.call("exit")
            self.process.join(self.timeout_s)
        if self.process.is_alive():
            self.kill()
        self._conn.close()


class ReceiverProcess(CommandProcess):
    """A process holding zeroed tensors for `update_info` and a receiver engine of `backend`.

    Commands: `init` (`init_info`), `update` (`update_info`, optional `stall_after_loads` to hang
    after that many loaded buckets, for failure drills), `digests`, `reset_peak`, `peak`,
    `shutdown`, `exit`.

    Args:
        backend: Registered backend name, e.g. `"gloo"`.
        update_info: Dict form of the tensors it holds (and expects).
        worker_index: Its index among the group's workers.
        flat: Lay its tensors out in one flat buffer (bucket layout) instead of one tensor each.
        in_place: Offer its tensors to the engine so buckets can land in place.
        device: Where its tensors live (`"cuda:1"` for the `nccl` backend).
        timeout_s: Limit for each reply, in seconds.
    """

    def __init__(
        self,
        *,
        backend: str,
        update_info: dict[str, Any],
        worker_index: int = 0,
        flat: bool = False,
        in_place: bool = True,
        device: str = "cpu",
        timeout_s: float = 120.0,
    ) -> None:
        args = (backend, update_info, worker_index, flat, in_place, device)
        super().__init__(_receiver_main, args, timeout_s)


class TrainerProcess(CommandProcess):
    """A process holding tensors for `update_info` that it fills from a seed and sends.

    Commands: `init` (the keyword arguments of `trainer_init`), `connect`, `close` (the group, and
    its port), `send` (`seed`, optional `stall_at_tensor` to hang before that tensor, for failure
    drills), `digests`, `exit`.

    Args:
        update_info: Dict form of the tensors it holds.
        flat: Lay its tensors out in one flat buffer (sends without a pack copy).
        init_default_group: Call `torch.distributed.init_process_group` first, like a DDP trainer.
        device: Where its tensors live (`"cuda:0"` for the `nccl` backend).
        timeout_s: Limit for each reply, in seconds.
    """

    def __init__(
        self,
        *,
        update_info: dict[str, Any],
        flat: bool = False,
        init_default_group: bool = False,
        device: str = "cpu",
        timeout_s: float = 120.0,
    ) -> None:
        args = (update_info, flat, init_default_group, device)
        super().__init__(_trainer_main, args, timeout_s)
