"""What a reader reads to follow one weight update: the package's files and lines on its path.

    python benchmarks/reader_path.py

Runs four updates in this process, each exactly as the docs show it, and records every function
of `weightsync` that runs between the update's first call and its last (every thread):

- `readme`: the README's "transfer API in one screen" (a packed gloo update, a thread as worker);
- `http`: the same update over HTTP, the trainer calling the four routes itself
  (docs/http-weight-sync.md's second block) against a `weightsync serve` app on a loopback port
  in this process;
- `http_client`: the same update through the trainer's sender and HTTP client (the first block of
  docs/http-weight-sync.md, up to its generation), as `examples/rlhf/rlhf_http_nccl.py` runs it;
- `ipc`: a shared-memory update (docs/transfer/ipc.md's first block).

Per scenario: `files` (the package files holding a function that ran), `lines_whole` (those files'
lines), `lines_on_path` (the lines of the functions that ran, each counted once, from its `def`
to its last line) and `returns` (read each function once, in the order it first ran, one thread
after the other: how many times the reader turns back to a file already left; lower reads
better). Module-level code and
import time are not counted: everything is imported before the first update starts. The last line
of output is one JSON object.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import re
import socket
import sys
import threading
import time
from pathlib import Path
from types import CodeType, FrameType
from typing import Any

import weightsync

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = Path(weightsync.__file__).resolve().parent


class _Recorder:
    """Collects the package's code objects that run while `on` is set, in every thread."""

    def __init__(self) -> None:
        self.on = False
        self.codes: set[CodeType] = set()
        self.first_runs: list[tuple[int, str]] = []  # (thread, file) of each function's first run

    def __call__(self, frame: FrameType, event: str, _arg: object) -> None:
        if not self.on or event != "call":
            return
        code = frame.f_code
        if not code.co_filename.startswith(str(PACKAGE)) or code.co_name == "<module>":
            return
        if code not in self.codes:
            self.codes.add(code)
            self.first_runs.append((threading.get_ident(), code.co_filename))

    def install(self) -> None:
        sys.setprofile(self)
        threading.setprofile(self)

    def figures(self) -> dict[str, Any]:
        spans: dict[str, set[int]] = {}
        for code in self.codes:
            lines = [line for _, _, line in code.co_lines() if line is not None]
            first = code.co_firstlineno
            spans.setdefault(code.co_filename, set()).update(
                range(first, max(lines, default=first) + 1)
            )
        files = sorted(spans)
        returns = 0
        for thread in {thread for thread, _ in self.first_runs}:
            left: set[str] = set()
            order = [file for ident, file in self.first_runs if ident == thread]
            for previous, current in itertools.pairwise(order):
                if current != previous:
                    left.add(previous)
                    returns += current in left
        return {
            "files": len(files),
            "lines_whole": sum(len(Path(f).read_text().splitlines()) for f in files),
            "lines_on_path": sum(len(lines) for lines in spans.values()),
            "returns": returns,
            "file_list": [str(Path(f).relative_to(PACKAGE.parent)) for f in files],
        }


def _block(path: Path, marker: str) -> str:
    """The first ```python block of a page that holds `marker`."""
    blocks: list[str] = re.findall(r"```python\n(.*?)```", path.read_text(), re.S)
    return next(block for block in blocks if marker in block)


def _run(recorder: _Recorder, source: str, namespace: dict[str, Any]) -> dict[str, Any]:
    recorder.codes.clear()
    recorder.first_runs.clear()
    code = compile(source, "<docs block>", "exec")
    recorder.on = True
    try:
        with contextlib.redirect_stdout(sys.stderr):  # the blocks print; the JSON stays last
            exec(code, namespace)
    finally:
        recorder.on = False
    return recorder.figures()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _serve(port: int) -> tuple[Any, threading.Thread]:
    import uvicorn

    from weightsync import AsyncEngine, WeightTransferConfig
    from weightsync.serve.app import create_app

    engine = AsyncEngine("tiny", weight_transfer_config=WeightTransferConfig(backend="gloo"))
    config = uvicorn.Config(create_app(engine), host="127.0.0.1", port=port, log_level="warning")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if time.monotonic() > deadline:
            raise TimeoutError("the in-process server did not start in 60 s")
        time.sleep(0.05)
    return server, thread


def measure() -> dict[str, dict[str, Any]]:
    """Runs the four updates and returns each one's figures, by scenario name."""
    import httpx  # noqa: F401  (imported before any update, like everything the blocks use)

    recorder = _Recorder()
    recorder.install()
    try:
        results = {
            "readme": _run(recorder, _block(ROOT / "README.md", "trainer_send_weights("), {}),
            "ipc": _run(
                recorder, _block(ROOT / "docs/transfer/ipc.md", "ipc_trainer_send_weights("), {}
            ),
        }
        port = _free_port()
        server, thread = _serve(port)
        source = _block(ROOT / "docs/http-weight-sync.md", "/start_weight_update").replace(
            "http://127.0.0.1:8000", f"http://127.0.0.1:{port}"
        )
        client = _block(ROOT / "docs/http-weight-sync.md", "sync_weights(").split("\nout = ")[0]
        try:
            results["http"] = _run(recorder, source, {})
            results["http_client"] = _run(
                recorder, client.replace("http://127.0.0.1:8000", f"http://127.0.0.1:{port}"), {}
            )
        finally:
            server.should_exit = True  # the app's shutdown closes the engine and its transfer
            thread.join(60)
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.parse_args()
    print(json.dumps({"package": weightsync.__version__, "scenarios": measure()}))


if __name__ == "__main__":
    main()
