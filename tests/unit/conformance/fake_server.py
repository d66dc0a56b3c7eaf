"""A fake server for the conformance check's tests: the contract, answered soundly, in process.

It is reached through an `httpx.MockTransport` (no socket, no process). Generation is a toy:
token i of a greedy completion is a function of the prompt and i; sampling at temperature > 0
draws from a seeded generator unless top_k=1 or min_p=1 narrow it to the greedy token. Streams
are generators that step one token at a time and honour pauses, aborts, an open update and
sleep, so the in-flight cases see what a real engine would show.

Flags switch on the unsound answers vLLM 0.32 gave where it was measured, so that a test can
show that exactly the cases they break fail.
"""

from __future__ import annotations

import hashlib
import json
import random
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs

import httpx

VOCAB = 1000
MAX_MODEL_LEN = 2048
_TOKEN_S = 0.002  # the toy's time per token: streams must be running when a case pauses
_INIT_KEYS = frozenset({"master_address", "master_port", "rank_offset", "world_size", "packed",
              "packed_buffer_size_bytes", "packed_num_buffers", "nccl_unique_id_b64"})  # fmt: skip
_UPDATE_KEYS = {"names", "dtype_names", "shapes"}
_FIELDS = {"model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature",
           "top_p", "top_k", "min_p", "seed", "n", "stream", "stream_options", "logprobs",
           "top_logprobs", "stop", "stop_token_ids", "ignore_eos", "min_tokens",
           "repetition_penalty", "presence_penalty", "frequency_penalty", "skip_special_tokens",
           "include_stop_str_in_output", "return_token_ids", "user", "request_id"}  # fmt: skip
_VLLM_PREFIX = "dp0:pp0:pcp0:tp0:"
# Refusals vLLM makes in its HTTP layer (typed, even where its engine's refusals are 500s).
_REQUEST = "Validation"


class _Refused(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "") -> None:
        super().__init__(message)
        self.status, self.param = status, param
        self.kind = kind or {400: "InvalidRequestError", 401: "Unauthorized", 404: "NotFound",
                             409: "EngineStateError", 500: "InternalServerError"}[status]  # fmt: skip


@dataclass
class _Request:
    id: str
    prompt: list[int]
    max_tokens: int
    aborted: bool = False
    done: int = 0


@dataclass
class FakeServer:
    """The contract's sound answers, with switches for vLLM 0.32's measured unsound ones.

    Attributes:
        api_key: The key the /v1 routes require (None: open).
        admin_api_key: The key the RL routes require (None: open).
        errors_500: Refusals of state and payload errors answer 500, as vLLM's do.
        ignore_unknown_fields: Unknown request fields are ignored, as vLLM does.
        abort_by_id_is_noop: `/abort_requests` with ids aborts nothing yet counts the ids.
        crash_on: A path whose call kills the server (every later call is refused).
        hang_on: A path whose call never answers (until the client's timeout).
        sleep_queues_requests: A completion while asleep waits for the wake up.
        empty_digests: Half of the checksums are of zero bytes (vLLM on CPU).
        wait_flag_means_abort: `wait_for_inflight_requests=true` is ignored (an abort pause).
        raw_line_separators: Streamed text holds U+2028 unescaped, as vLLM's may.
        known_init_keys: The init_info keys taken (default vLLM's); others are refused by name,
            listing the known ones, as weightsync's refusal does.
    """

    api_key: str | None = None
    admin_api_key: str | None = None
    errors_500: bool = False
    ignore_unknown_fields: bool = False
    abort_by_id_is_noop: bool = False
    crash_on: str | None = None
    hang_on: str | None = None
    sleep_queues_requests: bool = False
    empty_digests: bool = False
    wait_flag_means_abort: bool = False
    raw_line_separators: bool = False
    known_init_keys: frozenset[str] = _INIT_KEYS
    untimed_requests: list[str] = field(default_factory=list)
    _cond: threading.Condition = field(default_factory=threading.Condition)
    _running: dict[str, _Request] = field(default_factory=dict)
    _paused: bool = False
    _asleep_tags: set[str] = field(default_factory=set)
    _update_open: bool = False
    _initialized: bool = False
    _dead: bool = False
    _version: str | None = "default"
    _weights: dict[str, bytes] = field(
        default_factory=lambda: {f"layer.{i}.weight": bytes([i + 1]) * 8 for i in range(4)}
    )
    _next_id: int = 0

    def transport(self) -> httpx.MockTransport:
        """The transport a client reaches this server by."""
        return httpx.MockTransport(self._handle)

    # --- plumbing -----------------------------------------------------------------------------

    def _handle(self, request: httpx.Request) -> httpx.Response:
        timeout = request.extensions.get("timeout", {}).get("read")
        if timeout is None:
            self.untimed_requests.append(f"{request.method} {request.url.path}")
        if self._dead:
            raise httpx.ConnectError("connection refused", request=request)
        path = request.url.path
        if path == self.hang_on:
            time.sleep(timeout or 0)
            raise httpx.ReadTimeout("timed out", request=request)
        if path == self.crash_on:
            self._dead = True
            raise httpx.ConnectError("connection refused", request=request)
        try:
            self._authorize(request)
            return self._route(request, float(timeout or 30.0))
        except _Refused as exc:
            if self.errors_500 and exc.status in (400, 409) and exc.kind != "Validation":
                exc.status, exc.kind = 500, "InternalServerError"
            body = {"error": {"message": str(exc), "type": exc.kind, "param": exc.param,
                              "code": exc.status}}  # fmt: skip
            return httpx.Response(exc.status, json=body)

    def _authorize(self, request: httpx.Request) -> None:
        path = request.url.path
        key = self.api_key if path.startswith("/v1/") else self.admin_api_key
        if key and path != "/health" and request.headers.get("authorization") != f"Bearer {key}":
            raise _Refused(401, "a valid key is required", "authorization")

    def _route(self, request: httpx.Request, timeout: float) -> httpx.Response:
        path, method = request.url.path, request.method
        query = {k: v for k, v in parse_qs(request.url.query.decode()).items()}
        body = json.loads(request.content) if request.content else None
        handler = _ROUTES.get((method, path))
        if handler is None:
            raise _Refused(404, "Not Found")
        answer = handler(self, query, body, timeout)
        if isinstance(answer, httpx.Response):
            return answer
        return httpx.Response(200, json=answer)

    def _wait(self, blocked: Any, timeout: float) -> None:
        """Waits (holding the condition) while `blocked()`; a read timeout past `timeout`."""
        deadline = time.monotonic() + timeout
        while blocked():
            if time.monotonic() > deadline:
                raise httpx.ReadTimeout("timed out")
            self._cond.wait(0.01)

    # --- generation ---------------------------------------------------------------------------

    @staticmethod
    def greedy(prompt: list[int], i: int) -> int:
        """The toy model's greedy token number `i` after `prompt` (distinct for i < 100)."""
        return 3 + (sum(prompt) * 31 + i * 7) % (VOCAB - 3)

    def _held(self) -> bool:
        return self._paused or self._update_open or bool(self._asleep_tags)

    def _tokens(
        self, prompt: list[int], body: dict[str, Any], choice: int
    ) -> tuple[list[int], str]:
        max_tokens = body.get("max_tokens") or body.get("max_completion_tokens") or 16
        temperature = body.get("temperature", 1.0)
        narrow = body.get("top_k") == 1 or body.get("min_p") == 1.0
        rng = random.Random(None if body.get("seed") is None else body["seed"] + choice)
        tokens: list[int] = []
        for i in range(max_tokens):
            token = self.greedy(prompt, i) if temperature == 0 or narrow else rng.randrange(VOCAB)
            tokens.append(token)
            if token in (body.get("stop_token_ids") or []):
                return tokens, "stop"
        return tokens, "length"

    def _check_fields(self, body: Any, route: str) -> dict[str, Any]:
        if not isinstance(body, dict):
            raise _Refused(400, "the body must be a JSON object", kind=_REQUEST)
        unknown = sorted(set(body) - _FIELDS)
        if unknown and not self.ignore_unknown_fields:
            raise _Refused(400, f"unknown field {unknown[0]!r}", unknown[0], kind=_REQUEST)
        if body.get("model") != "fake-model":
            raise _Refused(
                404, f"model {body.get('model')!r} does not exist", "model", kind=_REQUEST
            )
        if body.get("temperature", 1.0) < 0:
            raise _Refused(400, "temperature must be >= 0", "temperature", kind=_REQUEST)
        max_tokens = body.get("max_tokens", 16)
        if max_tokens is not None and not 1 <= max_tokens <= MAX_MODEL_LEN:
            raise _Refused(
                400, f"max_tokens must be in [1, {MAX_MODEL_LEN}]", "max_tokens", kind=_REQUEST
            )
        if route == "chat":
            body["prompt"] = [1, *(len(m["content"]) % VOCAB for m in body["messages"])]
        if any(not 0 <= t < VOCAB for t in body["prompt"]):
            raise _Refused(400, "prompt token id out of vocabulary", "prompt", kind=_REQUEST)
        return body

    def completions(self, query: Any, body: Any, timeout: float, route: str = "text") -> Any:
        body = self._check_fields(body, route)
        with self._cond:
            if self._asleep_tags and not self.sleep_queues_requests:
                raise _Refused(409, "asleep: wake_up first")
            if self._update_open and self.crash_on == "generation during update":
                self._dead = True
                raise httpx.ConnectError("connection refused")
            self._next_id += 1
            completion_id = f"cmpl-{self._next_id}"
        if body.get("stream"):
            request = _Request(completion_id, body["prompt"], body.get("max_tokens", 16))
            with self._cond:
                self._running[request.id] = request
            return httpx.Response(200, content=self._stream(request, body),
                                  headers={"content-type": "text/event-stream"})  # fmt: skip
        with self._cond:
            self._wait(self._held, timeout)
        choices, total = [], 0
        for n in range(body.get("n", 1)):
            tokens, reason = self._tokens(body["prompt"], body, n)
            total += len(tokens)
            choice: dict[str, Any] = {"index": n, "finish_reason": reason}
            text = "".join(chr(65 + t % 26) for t in tokens)
            choice.update({"message": {"role": "assistant", "content": text}} if route == "chat"
                          else {"text": text})  # fmt: skip
            if body.get("return_token_ids"):
                choice["token_ids"] = tokens
                if route == "text":
                    choice["prompt_token_ids"] = body["prompt"]
            if body.get("logprobs") and route == "text":
                choice["logprobs"] = {"token_logprobs": [-1.0] * len(tokens),
                                      "top_logprobs": [{"A": -1.0, "B": -2.0}] * len(tokens)}  # fmt: skip
            choices.append(choice)
        answer = {"id": completion_id, "object": "chat.completion" if route == "chat"
                  else "text_completion", "choices": choices,
                  "usage": {"prompt_tokens": len(body["prompt"]), "completion_tokens": total,
                            "total_tokens": total + len(body["prompt"])}}  # fmt: skip
        if route == "chat" and body.get("return_token_ids"):
            answer["prompt_token_ids"] = body["prompt"]
        return answer

    def chat(self, query: Any, body: Any, timeout: float) -> Any:
        return self.completions(query, body, timeout, route="chat")

    def _stream(self, request: _Request, body: dict[str, Any]) -> Iterator[bytes]:
        def event(choice: dict[str, Any], **extra: Any) -> bytes:
            chunk = {"id": request.id, "object": "text_completion",
                     "choices": [{"index": 0, **choice}] if choice else [], **extra}  # fmt: skip
            data = json.dumps(chunk, ensure_ascii=not self.raw_line_separators)
            return f"data: {data}\n\n".encode()

        reason = "length"
        try:
            while request.done < request.max_tokens:
                with self._cond:
                    self._wait(lambda: self._held() and not request.aborted, 30.0)
                    if request.aborted:
                        reason = "abort"
                        break
                    token = self.greedy(request.prompt, request.done)
                    request.done += 1
                extra = {"token_ids": [token]} if body.get("return_token_ids") else {}
                yield event({"text": "x\u2028", "finish_reason": None, **extra})
                time.sleep(_TOKEN_S)
            yield event({"text": "", "finish_reason": reason})
            yield event({}, usage={"completion_tokens": request.done})
            yield b"data: [DONE]\n\n"
        finally:
            with self._cond:
                self._running.pop(request.id, None)
                self._cond.notify_all()

    # --- control routes -------------------------------------------------------------------------

    def pause(self, query: Any, body: Any, timeout: float) -> Any:
        mode = query.get("mode", ["abort"])[0]
        if mode not in ("abort", "wait", "keep"):
            raise _Refused(400, f"mode must be abort, wait or keep, got {mode!r}", "mode", _REQUEST)
        if query.get("clear_cache", ["true"])[0] not in ("true", "false"):
            raise _Refused(400, "clear_cache must be a boolean", "clear_cache", _REQUEST)
        if query.get("wait_for_inflight_requests", ["false"])[0] == "true":
            mode = "abort" if self.wait_flag_means_abort else "wait"
        with self._cond:
            if mode == "abort":
                for request in self._running.values():
                    request.aborted = True
            elif mode == "wait":
                self._wait(lambda: bool(self._running), timeout)
            self._paused = True
            self._cond.notify_all()
        return {"status": "paused"}

    def resume(self, query: Any, body: Any, timeout: float) -> Any:
        with self._cond:
            self._paused = False
            self._cond.notify_all()
        return {"status": "resumed"}

    def abort_requests(self, query: Any, body: Any, timeout: float) -> Any:
        ids = (body or {}).get("request_ids")
        if ids is not None and not isinstance(ids, list):
            raise _Refused(400, "request_ids must be a list", "request_ids", _REQUEST)
        with self._cond:
            if self.abort_by_id_is_noop and ids:
                return {"status": "aborted", "aborted": len(ids)}
            targets = [r for r in self._running.values() if not ids or r.id in ids]
            for request in targets:
                request.aborted = True
            self._cond.notify_all()
        return {"status": "aborted", "aborted": len(targets)}

    def get_world_size(self, query: Any, body: Any, timeout: float) -> Any:
        if query.get("include_dp", ["true"])[0] not in ("true", "false"):
            raise _Refused(400, "include_dp must be a boolean", "include_dp", _REQUEST)
        return {"world_size": 1}

    def init(self, query: Any, body: Any, timeout: float) -> Any:
        info = (body or {}).get("init_info")
        if not isinstance(info, dict):
            raise _Refused(400, "field 'init_info' must be an object", "init_info", _REQUEST)
        if unknown := sorted(set(info) - self.known_init_keys):
            raise _Refused(400, f"unknown init_info keys {unknown}; expected keys: "
                           f"{sorted(self.known_init_keys)}", "init_info")  # fmt: skip
        if info.get("world_size", 0) <= info.get("rank_offset", 1):
            raise _Refused(400, "world_size leaves no rank for this worker", "world_size")
        raise AssertionError("the check never sends an init that would rendezvous")

    def start(self, query: Any, body: Any, timeout: float) -> Any:
        with self._cond:
            if self._asleep_tags:
                raise _Refused(409, "asleep: wake_up first")
            if self._update_open:
                raise _Refused(409, "a weight update is already open")
            self._update_open = True
        return {"message": "Weight update started"}

    def update(self, query: Any, body: Any, timeout: float) -> Any:
        info = (body or {}).get("update_info")
        if isinstance(info, list):
            info = info[0] if info else None
        if not isinstance(info, dict):
            raise _Refused(400, "field 'update_info' must be an object", "update_info", _REQUEST)
        if not self._update_open:
            raise _Refused(409, "no weight update is open: start_weight_update first")
        if set(info) != _UPDATE_KEYS or len({len(info[k]) for k in _UPDATE_KEYS}) != 1:
            raise _Refused(400, "update_info needs names, dtype_names, shapes of one length")
        if not self._initialized:
            raise _Refused(409, "no transfer engine: init_weight_transfer_engine first")
        raise AssertionError("the check never sends an update a trainer would have to feed")

    def finish(self, query: Any, body: Any, timeout: float) -> Any:
        version = (body or {}).get("weight_version")
        if version is not None and not isinstance(version, str):
            raise _Refused(400, "weight_version must be a string", "weight_version", _REQUEST)
        with self._cond:
            if not self._update_open:
                raise _Refused(409, "no weight update is open")
            self._update_open = False
            if version is not None:
                self._version = version
            self._cond.notify_all()
        return {"message": "Weight update finished"}

    def update_weight_version(self, query: Any, body: Any, timeout: float) -> Any:
        version = (body or {}).get("new_version")
        if not isinstance(version, str):
            raise _Refused(400, "new_version must be a string", "new_version", _REQUEST)
        self._version = version
        return {"success": True, "new_version": version}

    def shutdown(self, query: Any, body: Any, timeout: float) -> Any:
        if self._update_open:
            raise _Refused(409, "a weight update is open")
        return {"message": "Weight transfer shut down"}

    def draft(self, query: Any, body: Any, timeout: float) -> Any:
        raise _Refused(400, "no draft model is configured")

    def weight_checker(self, query: Any, body: Any, timeout: float) -> Any:
        action, baseline = (body or {}).get("action"), (body or {}).get("baseline")
        if action not in ("checksum", "compare", "reset"):
            raise _Refused(400, "action must be checksum, compare or reset", "action", _REQUEST)
        if action == "reset":
            self._weights = {name: bytes(len(data)) for name, data in self._weights.items()}
            return {"status": "reset"}
        sums = {name: hashlib.sha256(b"" if self.empty_digests and i % 2 else data).hexdigest()
                for i, (name, data) in enumerate(self._weights.items())}  # fmt: skip
        if action == "checksum":
            return {"checksums": sums}
        if not isinstance(baseline, dict):
            raise _Refused(400, "compare needs a 'baseline' object", "baseline", _REQUEST)
        baseline = {key.removeprefix(_VLLM_PREFIX): digest for key, digest in baseline.items()}
        mismatches = sorted(
            k for k in sums.keys() | baseline.keys() if sums.get(k) != baseline.get(k)
        )
        return {"match": not mismatches, "mismatches": mismatches}

    def sleep(self, query: Any, body: Any, timeout: float) -> Any:
        level = int(query.get("level", ["1"])[0])
        if not 0 <= level <= 2:
            raise _Refused(400, "level must be 0, 1 or 2", "level", _REQUEST)
        with self._cond:
            self._asleep_tags = {"weights", "kv_cache", "scheduling"}
        return {"status": "sleeping", "level": level}

    def wake_up(self, query: Any, body: Any, timeout: float) -> Any:
        tags = query.get("tags")
        with self._cond:
            self._asleep_tags -= set(tags) if tags else set(self._asleep_tags)
            self._cond.notify_all()
            return {"status": "sleeping" if self._asleep_tags else "awake", "tags": tags}


_ROUTES: dict[tuple[str, str], Any] = {
    ("GET", "/health"): lambda s, q, b, t: httpx.Response(200),
    ("GET", "/version"): lambda s, q, b, t: {"version": "fake"},
    ("GET", "/v1/models"): lambda s, q, b, t: {"object": "list", "data": [{"id": "fake-model"}]},
    ("POST", "/v1/completions"): FakeServer.completions,
    ("POST", "/v1/chat/completions"): FakeServer.chat,
    ("POST", "/pause"): FakeServer.pause,
    ("POST", "/resume"): FakeServer.resume,
    ("GET", "/is_paused"): lambda s, q, b, t: {"is_paused": s._paused},
    ("POST", "/abort_requests"): FakeServer.abort_requests,
    ("GET", "/get_world_size"): FakeServer.get_world_size,
    ("GET", "/weight_info"): lambda s, q, b, t: {"weight_version": s._version},
    ("POST", "/reset_prefix_cache"): lambda s, q, b, t: {"success": True},
    ("POST", "/init_weight_transfer_engine"): FakeServer.init,
    ("POST", "/start_weight_update"): FakeServer.start,
    ("POST", "/update_weights"): FakeServer.update,
    ("POST", "/finish_weight_update"): FakeServer.finish,
    ("POST", "/update_weight_version"): FakeServer.update_weight_version,
    ("POST", "/shutdown_weight_transfer_engine"): FakeServer.shutdown,
    ("POST", "/start_draft_weight_update"): FakeServer.draft,
    ("POST", "/weight_checker"): FakeServer.weight_checker,
    ("POST", "/sleep"): FakeServer.sleep,
    ("POST", "/wake_up"): FakeServer.wake_up,
    ("GET", "/is_sleeping"): lambda s, q, b, t: {"is_sleeping": bool(s._asleep_tags)},
}
