"""The conformance check's HTTP side: bounded calls, streamed completions, and answer checks.

Every call opens a fresh connection (a server that drops a connection after an error, as vLLM
does after a 500, then cannot fail the next case) and carries a timeout. A case reports its
outcome by returning a detail (passed) or raising `CaseFailed` / `CaseSkipped`.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx

# vLLM's RL routes take the admin key; the OpenAI routes the API key.
_OPENAI_PREFIX = "/v1/"


class CaseFailed(Exception):
    """The server's answer breaks the contract; the message says how."""


class CaseSkipped(Exception):
    """The case cannot run against this server or with these options; the message says why."""


class ServerDown(Exception):
    """The server stopped answering (refused connections): no later case can run."""


@dataclass(frozen=True)
class Answer:
    """One HTTP answer, or the transport error that stood in for it.

    Attributes:
        method: The request's method.
        path: The request's path.
        status: The HTTP status; None when no answer came.
        body: The decoded JSON body (the raw text when it was not JSON).
        error: The transport error (a timeout, a dropped connection), if no answer came.
        seconds: How long the call took.
    """

    method: str
    path: str
    status: int | None
    body: Any
    error: str | None
    seconds: float

    def describe(self) -> str:
        """`POST /pause -> 200 {...}`, short enough for a table cell."""
        if self.status is None:
            return f"{self.method} {self.path} -> no answer ({self.error})"
        return f"{self.method} {self.path} -> {self.status} {_short(self.body)}"

    def error_message(self) -> str:
        """The error body's message (empty when the body has none)."""
        error = self.body.get("error") if isinstance(self.body, dict) else None
        if isinstance(error, dict):
            return str(error.get("message", ""))
        return str(error or (self.body.get("detail", "") if isinstance(self.body, dict) else ""))


def _short(body: Any, limit: int = 160) -> str:
    text = body if isinstance(body, str) else json.dumps(body, separators=(",", ":"))
    return text if len(text) <= limit else text[: limit - 3] + "..."


@dataclass
class StreamRecord:
    """What the client of one streamed completion saw (filled in as chunks arrive).

    Attributes:
        status: The HTTP status of the stream's answer.
        chunks: Data chunks that carried a choice.
        finish_reason: The last finish reason seen.
        completion_tokens: The usage chunk's count, if one came.
        completion_id: The id of the first chunk.
        done: Whether `data: [DONE]` arrived.
        error: A transport or decoding error that ended the stream.
        error_body: The body of a non-200 answer.
        running: Set once a second chunk came (the request is running) or the stream ended.
        ended: Set once the stream ended, whole or not.
    """

    status: int | None = None
    chunks: int = 0
    finish_reason: str | None = None
    completion_tokens: int | None = None
    completion_id: str | None = None
    done: bool = False
    error: str | None = None
    error_body: Any = None
    running: threading.Event = field(default_factory=threading.Event)
    ended: threading.Event = field(default_factory=threading.Event)

    def describe(self) -> str:
        """The record in one line."""
        if self.error_body is not None:
            return f"answered {self.status} {_short(self.error_body)}"
        return (
            f"{self.chunks} chunks, finish_reason={self.finish_reason!r}, "
            f"completion_tokens={self.completion_tokens}, [DONE]={'yes' if self.done else 'no'}"
            + (f", error={self.error}" if self.error else "")
        )


class Probe:
    """Bounded HTTP calls to the server under test.

    Args:
        url: The server's base URL.
        api_key: Sent as a bearer token on the OpenAI (`/v1/...`) routes.
        admin_api_key: Sent as a bearer token on every other route.
        timeout_s: The bound of every call, in seconds.
        transport: An httpx transport to use instead of the network (tests).
    """

    def __init__(
        self,
        url: str,
        *,
        api_key: str | None = None,
        admin_api_key: str | None = None,
        timeout_s: float = 30.0,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self.model = ""
        self._api_key = api_key
        self._admin_api_key = admin_api_key
        self._client = httpx.Client(
            base_url=self.url,
            timeout=timeout_s,
            transport=transport,
            # One connection per call: vLLM drops a connection after a 500, which would
            # otherwise fail whichever case reuses it next.
            limits=httpx.Limits(max_keepalive_connections=0),
        )

    def close(self) -> None:
        """Closes the client."""
        self._client.close()

    def headers(self, path: str, *, key: str | None = "default") -> dict[str, str]:
        """The auth header for `path` (`key=None` sends none; a string sends that key)."""
        if key == "default":
            key = self._api_key if path.startswith(_OPENAI_PREFIX) else self._admin_api_key
        return {"Authorization": f"Bearer {key}"} if key else {}

    def call(
        self,
        method: str,
        path: str,
        *,
        params: Any = None,
        json_body: Any = None,
        timeout_s: float | None = None,
        key: str | None = "default",
    ) -> Answer:
        """One request; a transport failure becomes an answer without a status.

        Raises:
            ServerDown: The connection was refused: the server is gone.
        """
        headers = self.headers(path, key=key)
        started = time.perf_counter()
        try:
            response = self._client.request(
                method, path, params=params, json=json_body, headers=headers,
                timeout=timeout_s or self.timeout_s,
            )  # fmt: skip
        except httpx.ConnectError as exc:
            raise ServerDown(f"{method} {path}: {exc}") from exc
        except httpx.HTTPError as exc:
            seconds = time.perf_counter() - started
            error = f"{type(exc).__name__} after {seconds:.1f} s"
            return Answer(method, path, None, None, error, seconds)
        seconds = time.perf_counter() - started
        try:
            body: Any = response.json()
        except ValueError:
            body = response.text
        return Answer(method, path, response.status_code, body, None, seconds)

    def completion(self, timeout_s: float | None = None, **fields: Any) -> Answer:
        """`POST /v1/completions` for this server's model (greedy, 8 tokens unless given)."""
        body = {"model": self.model, "max_tokens": 8, "temperature": 0, **fields}
        return self.call("POST", "/v1/completions", json_body=body, timeout_s=timeout_s)

    def chat(self, timeout_s: float | None = None, **fields: Any) -> Answer:
        """`POST /v1/chat/completions` for this server's model (greedy, 8 tokens unless given)."""
        body = {
            "model": self.model,
            "messages": [{"role": "user", "content": "Say something."}],
            "max_tokens": 8,
            "temperature": 0,
            **fields,
        }
        return self.call("POST", "/v1/chat/completions", json_body=body, timeout_s=timeout_s)

    @contextmanager
    def stream(self, prompt: list[int], max_tokens: int) -> Iterator[StreamRecord]:
        """Runs a greedy streamed completion on a thread; yields its record as it fills.

        The thread ends with the stream, or when a read waits longer than the timeout; leaving
        the block waits for it (bounded by that timeout).
        """
        record = StreamRecord()
        body = {
            "model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
        }  # fmt: skip
        thread = threading.Thread(target=self._read_stream, args=(body, record), daemon=True)
        thread.start()
        try:
            yield record
        finally:
            thread.join(self.timeout_s + 5)

    def _read_stream(self, body: dict[str, Any], record: StreamRecord) -> None:
        path = "/v1/completions"
        try:
            with self._client.stream(
                "POST", path, json=body, headers=self.headers(path), timeout=self.timeout_s
            ) as response:
                record.status = response.status_code
                if response.status_code != 200:
                    response.read()
                    try:
                        record.error_body = response.json()
                    except ValueError:
                        record.error_body = response.text
                    return
                # Split at newlines only: generated text may hold U+2028 and kin, at which
                # `iter_lines` would cut a JSON object in two.
                pending = b""
                for data in response.iter_bytes():
                    *lines, pending = (pending + data).split(b"\n")
                    for line in lines:
                        _take_line(line.decode(), record)
        except (httpx.HTTPError, ValueError) as exc:
            record.error = type(exc).__name__
        finally:
            record.running.set()
            record.ended.set()


def _take_line(line: str, record: StreamRecord) -> None:
    """Folds one server-sent-event line into the record."""
    if not line.startswith("data:"):
        return
    data = line[len("data:") :].strip()
    if data == "[DONE]":
        record.done = True
        return
    chunk = json.loads(data)
    if record.completion_id is None:
        record.completion_id = chunk.get("id")
    usage = chunk.get("usage")
    if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
        record.completion_tokens = usage["completion_tokens"]
    choices = chunk.get("choices") or []
    if choices:
        record.chunks += 1
        reason = choices[0].get("finish_reason")
        if reason:
            record.finish_reason = reason
        if record.chunks >= 2:  # a token streamed beyond the first: the request is running
            record.running.set()


class Background:
    """A call run on a thread (a request a case sends while it does something else).

    Args:
        call: The call; its answer, or the `ServerDown` it raised, is kept.
    """

    def __init__(self, call: Callable[[], Answer]) -> None:
        self._answers: list[Answer] = []
        self._down: list[ServerDown] = []
        self._thread = threading.Thread(target=self._run, args=(call,), daemon=True)
        self._thread.start()

    def _run(self, call: Callable[[], Answer]) -> None:
        try:
            self._answers.append(call())
        except ServerDown as exc:
            self._down.append(exc)

    def seen(self) -> str:
        """What the call got so far, in words (for a case's detail)."""
        if self._down:
            return "a refused connection"
        if self._answers:
            answer = self._answers[0]
            return f"{answer.status} {_short(answer.body)}" if answer.status else str(answer.error)
        return "no answer yet"

    def wait(self, timeout_s: float) -> Answer | None:
        """The answer if it came in `timeout_s`, else None; `ServerDown` if the server is gone."""
        self._thread.join(timeout_s)
        if self._down:
            raise self._down[0]
        return self._answers[0] if self._answers else None


def expect_ok(answer: Answer, **fields: Any) -> dict[str, Any]:
    """A 200 whose JSON body has `fields` with these values (`...` for any value).

    Returns:
        The body.

    Raises:
        CaseFailed: Another status, a body that is not an object, or a field that differs.
    """
    if answer.status != 200 or not isinstance(answer.body, dict):
        raise CaseFailed(f"expected 200, got {answer.describe()}")
    for name, value in fields.items():
        if name not in answer.body:
            raise CaseFailed(f"{answer.describe()}: no field {name!r}")
        if value is not ... and answer.body[name] != value:
            raise CaseFailed(f"{answer.describe()}: expected {name}={value!r}")
    return answer.body


def expect_refusal(answer: Answer, statuses: tuple[int, ...], *, mentions: str = "") -> str:
    """A typed refusal: one of `statuses`, body `{"error": {"message", "type", "param", "code"}}`.

    Args:
        answer: The answer to check.
        statuses: The acceptable statuses.
        mentions: A word the message (or `param`) must contain, case-insensitive.

    Returns:
        A detail naming the status and the message.

    Raises:
        CaseFailed: A success, a 500, no answer, another status, an untyped body, or a message
            that does not name `mentions`.
    """
    if answer.status is None:
        raise CaseFailed(f"expected {_statuses(statuses)}, got {answer.describe()}")
    if answer.status not in statuses:
        raise CaseFailed(f"expected {_statuses(statuses)}, got {answer.describe()}")
    error = answer.body.get("error") if isinstance(answer.body, dict) else None
    if not isinstance(error, dict) or not isinstance(error.get("message"), str):
        raise CaseFailed(f"untyped error body: {answer.describe()}")
    missing = [key for key in ("type", "param", "code") if key not in error]
    if missing or error.get("code") != answer.status:
        raise CaseFailed(f"error body lacks {missing or ['code == status']}: {answer.describe()}")
    text = f"{error['message']} {error.get('param') or ''}".lower()
    if mentions and mentions.lower() not in text:
        raise CaseFailed(f"the message does not name {mentions!r}: {answer.describe()}")
    return f"{answer.status} {error.get('type')}: {_short(error['message'], 100)}"


def _statuses(statuses: tuple[int, ...]) -> str:
    return "a typed " + " or ".join(str(s) for s in statuses)


def token_ids(answer: Answer) -> list[int]:
    """The first choice's `token_ids` (vLLM's `return_token_ids`), or `CaseFailed`."""
    choices = answer.body.get("choices") if isinstance(answer.body, dict) else None
    ids = choices[0].get("token_ids") if choices else None
    if answer.status != 200 or not isinstance(ids, list):
        raise CaseFailed(f"expected choices[0].token_ids, got {answer.describe()}")
    if not all(isinstance(i, int) for i in ids):
        raise CaseFailed(f"choices[0].token_ids holds a non-integer: {answer.describe()}")
    return ids


def wait_until(event: threading.Event, timeout_s: float, what: str) -> None:
    """Waits for `event`, or fails the case naming `what`."""
    if not event.wait(timeout_s):
        raise CaseFailed(f"{what} did not happen within {timeout_s:g} s")
