"""Starting a `weightsync serve` child on a free loopback port, and stopping it."""

from __future__ import annotations

import json
import os
import queue
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from weightsync.engine.config import EngineConfig
from weightsync.errors import EngineConfigError, EngineStateError

_LISTENING = re.compile(r"listening on (http://\S+)")


def _serve_args(engine_config: EngineConfig) -> list[str]:
    """`weightsync serve` options of an `EngineConfig`."""
    args = [
        "--max-num-seqs", str(engine_config.max_num_seqs),
        "--max-num-batched-tokens", str(engine_config.max_num_batched_tokens),
        "--block-size", str(engine_config.block_size),
        "--num-kv-blocks", str(engine_config.num_kv_blocks),
        "--sampling-seed", str(engine_config.seed),
    ]  # fmt: skip
    if engine_config.max_model_len is not None:
        args += ["--max-model-len", str(engine_config.max_model_len)]
    if not engine_config.enable_prefix_caching:
        args.append("--no-prefix-caching")
    if engine_config.weight_update_staging:
        args.append("--weight-update-staging")
    if engine_config.refuse_non_finite_weights:
        args.append("--refuse-non-finite-weights")
    return args


class ServeProcess:
    """A `weightsync serve` child: started with the engine's settings, stopped by `stop`.

    Raises:
        EngineConfigError: The server refused its configuration (the message is its own).
        EngineStateError: It did not announce its port within `timeout_s`.
    """

    def __init__(
        self,
        model: str | dict[str, Any],
        *,
        seed: int,
        dtype: str,
        engine_config: EngineConfig,
        backend: str | None,
        worker_index: int,
        device: str,
        timeout_s: float,
    ) -> None:
        self.timeout_s = timeout_s
        self._tempdir: tempfile.TemporaryDirectory[str] | None = None
        args = ["serve", "--host", "127.0.0.1", "--port", "0", "--seed", str(seed),
                "--dtype", dtype, "--worker-index", str(worker_index), "--device", device,
                "--log-level", "warning", *_serve_args(engine_config),
                # One compute thread: the trainer and the other engines share the cores.
                "--num-threads", "1",
                # The server exits with this process, even one killed outright.
                "--parent-pid", str(os.getpid())]  # fmt: skip
        if isinstance(model, dict):  # the shapes only: zero weights until the first update
            self._tempdir = tempfile.TemporaryDirectory(prefix="weightsync-model-")
            (Path(self._tempdir.name) / "config.json").write_text(json.dumps(model))
            args[1:1] = [self._tempdir.name, "--load-format", "dummy"]
        else:
            args.insert(1, model)
        if backend is not None:
            args += ["--weight-transfer-config.backend", backend]
        env = dict(os.environ)
        self._process = subprocess.Popen(
            [sys.executable, "-m", "weightsync.serve.cli", *args],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        self._log: list[str] = []
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read_log, name="weightsync-serve-log", daemon=True).start()
        try:
            self.base_url = self._wait_listening()
        except BaseException:
            self.stop()
            raise

    def _read_log(self) -> None:
        assert self._process.stderr is not None
        for line in self._process.stderr:
            self._log.append(line)
            self._lines.put(line)
        self._lines.put(None)

    def _wait_listening(self) -> str:
        deadline = time.monotonic() + self.timeout_s
        while (left := deadline - time.monotonic()) > 0:
            try:
                line = self._lines.get(timeout=left)
            except queue.Empty:
                break
            if line is None:  # it exited: say why, in the class of its refusal
                self._process.wait(self.timeout_s)
                reason = self.log.strip() or f"exit status {self._process.returncode}"
                raise EngineConfigError(f"weightsync serve did not start: {reason}")
            if match := _LISTENING.search(line):
                return match.group(1)
        raise EngineStateError(f"weightsync serve did not start within {self.timeout_s} s")

    @property
    def pid(self) -> int:
        """The server's process id."""
        return self._process.pid

    @property
    def log(self) -> str:
        """What the server printed so far."""
        return "".join(self._log)

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after `timeout_s`; removes the model directory. Idempotent."""
        if self._process.poll() is None:
            self._process.terminate()
            try:
                self._process.wait(self.timeout_s)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait(self.timeout_s)
        if self._tempdir is not None:
            self._tempdir.cleanup()
            self._tempdir = None
