"""Rollouts in the background: streamed completions on an event loop thread of their own.

Each request streams from `/v1/completions`; the server's `: accepted` comment says the request
is in its engine, and the last chunk completes its output. The caller gets two futures per
request (accepted, final output) and keeps training meanwhile.
"""

from __future__ import annotations

import asyncio
import json
import threading
from concurrent.futures import Future
from typing import Any

import httpx

from weightsync.engine.outputs import RequestOutput
from weightsync.engine.sampling import SamplingParams
from weightsync.engine.tokenizer import Prompt
from weightsync.errors import EngineStateError, EngineTimeoutError
from weightsync.trainer._completions import accumulate, completion_body, to_output
from weightsync.trainer.http_client import _error_from_answer

_PATH = "/v1/completions"


def _refused(accepted: Future[None], error: Exception) -> Exception:
    """Fails the `accepted` future too, if still open; returns `error` to raise."""
    if not accepted.done():
        accepted.set_exception(error)
    return error


class Rollouts:
    """Streams completions from one server on a background event loop.

    Args:
        base_url: The server.
        headers: Headers of every request (the API key).
        timeout_s: Limit, in seconds, for the connection and for each chunk to arrive.
    """

    def __init__(self, base_url: str, *, headers: dict[str, str], timeout_s: float) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="weightsync-rollouts", daemon=True
        )
        self._thread.start()
        # A pause may freeze a stream for as long as the trainer trains: no read limit.
        timeout = httpx.Timeout(timeout_s, read=None)
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        self._client = httpx.AsyncClient(
            base_url=base_url, headers=headers, timeout=timeout, limits=limits
        )
        self._streams: set[Future[RequestOutput]] = set()

    def submit(
        self, request_id: str, prompt: Prompt, params: SamplingParams
    ) -> tuple[Future[None], Future[RequestOutput]]:
        """Starts one request; returns (accepted by the engine, final output) futures."""
        if self._loop.is_closed():
            raise EngineStateError("the engine was closed: create a new one to generate")
        accepted: Future[None] = Future()
        final = asyncio.run_coroutine_threadsafe(
            self._stream(request_id, prompt, params, accepted), self._loop
        )
        self._streams.add(final)
        final.add_done_callback(self._streams.discard)
        return accepted, final

    async def _stream(
        self, request_id: str, prompt: Prompt, params: SamplingParams, accepted: Future[None]
    ) -> RequestOutput:
        body = completion_body([prompt], params, request_id, stream=True)
        total: dict[str, Any] | None = None
        try:
            async with self._client.stream("POST", _PATH, json=body) as response:
                if response.status_code >= 400:
                    text = (await response.aread()).decode(errors="replace")
                    raise _error_from_answer(f"POST {_PATH}", response.status_code, text)
                async for line in response.aiter_lines():
                    if line.startswith(": accepted"):
                        accepted.set_result(None)
                    elif line.startswith("data: {"):
                        chunk = json.loads(line[len("data: ") :])
                        if "error" in chunk:
                            raise _error_from_answer(f"POST {_PATH}", chunk["error"]["code"],
                                                     json.dumps(chunk))  # fmt: skip
                        if chunk.get("choices"):
                            total = accumulate(total, chunk["choices"][0])
        except httpx.TimeoutException as exc:
            raise _refused(accepted, EngineTimeoutError(f"request {request_id}: {exc!r}")) from exc
        except httpx.HTTPError as exc:
            gone = EngineStateError(f"request {request_id}: the server went away ({exc!r})")
            raise _refused(accepted, gone) from exc
        except Exception as exc:
            raise _refused(accepted, exc) from None
        if total is None or total.get("finish_reason") is None:
            ended = EngineStateError(f"request {request_id}: the stream ended without an output")
            raise _refused(accepted, ended)
        output = to_output(request_id, total, [prompt])
        output.request_id = request_id
        return output

    def close(self) -> None:
        """Ends every stream and stops the loop thread."""
        if self._loop.is_closed():
            return
        for stream in list(self._streams):
            stream.cancel()  # leaving a stream closes its connection; the server aborts it
        asyncio.run_coroutine_threadsafe(self._client.aclose(), self._loop).result(30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(30)
        self._loop.close()
