"""A `weightsync serve` child process, both ends: starting and stopping it, and its parent watch.

The one place that spawns `weightsync serve` children: a trainer's
[`EngineProcess`][weightsync.trainer.engine_process.EngineProcess] and each replica of a
data-parallel front start theirs through `ServeProcess`. A child binds a free loopback port and
announces it; it is told its parent's pid (`--parent-pid`) and runs `watch_parent`, so that it
never outlives a parent killed outright (SIGKILL leaves the parent no time to stop it).
"""

from __future__ import annotations

import logging
import os
import queue
import re
import signal
import subprocess
import sys
import threading
from collections import deque
from collections.abc import Callable, Mapping, Sequence

from weightsync.errors import EngineConfigError, EngineStateError

logger = logging.getLogger(__name__)

_LISTENING = re.compile(r"listening on (http://\S+)")
_LOG_LINES_KEPT = 200  # the tail is what explains an exit
# How often a child checks that its parent is alive, in seconds; and how long it then gives its
# own graceful shutdown (abort requests, stop the engine) before it exits regardless.
_PARENT_POLL_S = 0.2
_ORPHAN_GRACE_S = 10.0


class ServeProcess:
    """A `weightsync serve` child on a free loopback port, watching this process.

    Args:
        argv: Its `weightsync serve` arguments (the model and options; host, port and
            `--parent-pid` are set here).
        env: Its environment (default: this process's).
        relay_prefix: Relay each log line to this process's stderr with this prefix (default:
            keep them only, for `log`).
        on_exit: Called with its exit status, from a reader thread, when it exits after it
            started listening and before `stop` was called.
    """

    def __init__(
        self,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        relay_prefix: str | None = None,
        on_exit: Callable[[int], None] | None = None,
    ) -> None:
        command = [sys.executable, "-m", "weightsync.serve.cli", "serve", *argv,
                   "--host", "127.0.0.1", "--port", "0", "--parent-pid", str(os.getpid())]  # fmt: skip
        self._relay_prefix = relay_prefix
        self._on_exit = on_exit
        self._stopping = False
        self._lines: deque[str] = deque(maxlen=_LOG_LINES_KEPT)
        self._listening: queue.Queue[str | None] = queue.Queue()
        self.exit_status: int | None = None
        self.base_url = ""
        self._process = subprocess.Popen(
            command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE, text=True, env=dict(env) if env is not None else None,
        )  # fmt: skip
        threading.Thread(target=self._read_log, name="weightsync-serve-log", daemon=True).start()

    def _read_log(self) -> None:
        """Keeps (and relays) the child's log lines; notes its address and its exit."""
        assert self._process.stderr is not None
        announced = False
        for line in self._process.stderr:
            if not announced and (match := _LISTENING.search(line)):
                announced = True  # not relayed: whoever started it announces what it serves
                self._listening.put(match.group(1))
                continue
            self._lines.append(line)
            if self._relay_prefix is not None:
                sys.stderr.write(f"{self._relay_prefix}{line}")
        self.exit_status = self._process.wait()
        self._listening.put(None)
        if announced and not self._stopping and self._on_exit is not None:
            self._on_exit(self.exit_status)

    def wait_listening(self, timeout_s: float) -> str:
        """Blocks until the child announces its address; returns it (`http://127.0.0.1:PORT`).

        Raises:
            EngineConfigError: It exited first: it refused its configuration (its log says why).
            EngineStateError: It did not announce an address within `timeout_s`.
        """
        try:
            url = self._listening.get(timeout=max(0.0, timeout_s))
        except queue.Empty:
            raise EngineStateError(
                f"weightsync serve did not start within {timeout_s:g} s: {self.log.strip()}"
            ) from None
        if url is None:
            self._process.wait()
            reason = self.log.strip() or f"exit status {self._process.returncode}"
            raise EngineConfigError(f"weightsync serve did not start: {reason}")
        self.base_url = url
        return url

    @property
    def pid(self) -> int:
        """The child's process id."""
        return self._process.pid

    @property
    def alive(self) -> bool:
        """Whether the child runs (one that exited never comes back)."""
        return self.exit_status is None and self._process.poll() is None

    @property
    def log(self) -> str:
        """The last lines the child printed."""
        return "".join(self._lines)

    def log_lines(self) -> list[str]:
        """The last lines the child printed, as a list."""
        return list(self._lines)

    def terminate(self) -> None:
        """Sends SIGTERM (the server's shutdown) and returns; `stop` then waits. Safe twice."""
        self._stopping = True
        if self._process.poll() is None:
            self._process.terminate()

    def stop(self, timeout_s: float) -> None:
        """SIGTERM, then SIGKILL after `timeout_s`. Safe to call twice."""
        self.terminate()
        if self._process.poll() is None:
            try:
                self._process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait(timeout_s)


def watch_parent(parent_pid: int) -> None:
    """Stops this process when `parent_pid` is no longer its parent (the parent died).

    Run by a `weightsync serve` child given `--parent-pid`. A daemon thread polls the parent id;
    on a change it sends this process SIGTERM (the server's graceful shutdown), and exits
    outright if that has not ended it within a grace period.
    """

    def watch() -> None:
        while os.getppid() == parent_pid:
            if stop.wait(_PARENT_POLL_S):
                return
        logger.error("the process that started this server (pid %d) is gone: shutting down",
                     parent_pid)  # fmt: skip
        os.kill(os.getpid(), signal.SIGTERM)
        if not stop.wait(_ORPHAN_GRACE_S):
            os._exit(1)

    stop = threading.Event()  # never set: the thread ends with the process
    if os.getppid() != parent_pid:  # the parent died before this process got here
        os._exit(1)
    threading.Thread(target=watch, name="weightsync-parent-watch", daemon=True).start()
