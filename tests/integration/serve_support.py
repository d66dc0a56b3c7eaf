"""Starts `weightsync serve` as a real subprocess on a free loopback port, for integration tests."""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

SRC = Path(__file__).resolve().parents[2] / "src"
START_TIMEOUT_S = 60.0
_LISTENING = re.compile(r"listening on (http://\S+)")


class Server:
    """A `weightsync serve` process: its base URL and everything it printed so far."""

    def __init__(
        self, *args: str, env: dict[str, str] | None = None, log_level: str = "warning"
    ) -> None:
        environ = {**os.environ, **(env or {})}
        environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SRC), environ.get("PYTHONPATH")]))
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "weightsync.serve.cli",
                "serve",
                *args,
                "--log-level",
                log_level,
            ],
            stderr=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            text=True,
            env=environ,
        )
        self.lines: list[str] = []
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.base_url = self._wait_listening()
        self._wait_healthy()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        with self.proc.stderr:  # closed at EOF: a stopped server leaves no pipe open here
            for line in self.proc.stderr:
                self.lines.append(line)
                self._lines.put(line)
        self._lines.put(None)

    def _wait_listening(self) -> str:
        deadline = time.monotonic() + START_TIMEOUT_S
        while (left := deadline - time.monotonic()) > 0:
            try:
                line = self._lines.get(timeout=left)
            except queue.Empty:
                break
            if line is None:
                raise RuntimeError(f"weightsync serve exited at start:\n{self.output}")
            if match := _LISTENING.search(line):
                return match.group(1)
        self.kill()
        raise RuntimeError(f"weightsync serve did not listen within {START_TIMEOUT_S} s")

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.base_url}/health", timeout=5).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if self.proc.poll() is not None:
                raise RuntimeError(f"weightsync serve exited:\n{self.output}")
            time.sleep(0.05)  # polling a port that is coming up: there is nothing to await
        raise RuntimeError(f"/health did not answer within {START_TIMEOUT_S} s")

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 60.0) -> int:
        """Signals the server and waits for it to exit; returns its exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.proc.wait(timeout_s)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)


def serve_gloo(model_dir: Path) -> Iterator[Server]:
    """`weightsync serve` of `model_dir`, its weight transfer over gloo (CPU), until closed."""
    server = Server(str(model_dir), "--port", "0", "--num-kv-blocks", "64",
                    "--weight-transfer-config.backend", "gloo")  # fmt: skip
    yield server
    server.kill()


def run_cli(*args: str, timeout_s: float = 60.0) -> subprocess.CompletedProcess[str]:
    """Runs `weightsync` with `args` to its end (for commands that must exit at once)."""
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    return subprocess.run(
        [sys.executable, "-m", "weightsync.serve.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env=env,
    )
