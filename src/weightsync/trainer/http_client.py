"""`HTTPEngineClient`: drives a `weightsync serve` (or vLLM) server from the trainer, over HTTP.

It speaks the server's routes: vLLM's RL routes for pause, resume and the weight-update
transaction, and `/v1/completions` for rollouts. It satisfies
[`EngineClient`][weightsync.trainer.senders.EngineClient], so the weight senders and
[`sync_weights`][weightsync.trainer.senders.sync_weights] drive a server exactly as they drive an
engine in the trainer's process. An error answer is raised again under the weightsync class its
body names. Every call has a timeout; HTTP pairs each answer with its request, so a call that
timed out never hands its late answer to the next one.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import httpx

from weightsync._keys import bearer, check_api_key
from weightsync.engine.outputs import RequestOutput, WeightVersion
from weightsync.engine.sampling import SamplingParams
from weightsync.engine.tokenizer import Prompt
from weightsync.engine.weights import AdapterCommit
from weightsync.errors import (
    EngineStateError,
    EngineTimeoutError,
    InvalidRequestError,
    WeightSyncError,
    WeightTransferError,
    WeightTransferTimeout,
)
from weightsync.trainer._completions import accumulate, completion_body, to_output
from weightsync.transfer.base import CLIENT_MARGIN_S, DEFAULT_TIMEOUT_S, TransferStats, _is_int

__all__ = ["HTTPEngineClient"]


def _error_classes() -> dict[str, type[WeightSyncError]]:
    """Every weightsync error class by name, so an error body's type maps back to its class."""
    found: dict[str, type[WeightSyncError]] = {}
    pending: list[type[WeightSyncError]] = [WeightSyncError]
    while pending:
        cls = pending.pop()
        found.setdefault(cls.__name__, cls)
        pending.extend(cls.__subclasses__())
    return found


_ERRORS = _error_classes()


def _error_from_answer(call: str, status: int, text: str) -> WeightSyncError:
    """The weightsync error an error answer names by its type, else one fitting its status."""
    try:
        error = json.loads(text)["error"]
        error_type, message = str(error["type"]), str(error["message"])
    except (ValueError, KeyError, TypeError):
        error, error_type, message = {}, "", text[:500]
    message = f"{call} -> {status}: {message}"
    cls = _ERRORS.get(error_type)
    if cls is not None and issubclass(cls, WeightTransferError):
        built: WeightSyncError = cls(
            message, partially_applied=bool(error.get("partially_applied"))
        )
    elif cls is not None:
        built = cls(message)
    elif status == 504:
        built = WeightTransferTimeout(message)
    elif 400 <= status < 500 and status != 409:
        built = InvalidRequestError(message)
    else:
        built = EngineStateError(message)
    if isinstance(error.get("param"), str):
        built.param = error["param"]  # a front passes its replica's answer on whole
    return built


class HTTPEngineClient:
    """A trainer's client of one `weightsync serve` server.

    Args:
        base_url: The server, e.g. `"http://127.0.0.1:8000"`.
        api_key: Key of the `/v1` routes (`--api-key`), if the server has one.
        admin_api_key: Key of the RL routes (`--admin-api-key`), if the server has one. Keys
            may be any text without control characters or surrounding spaces; they are sent
            as UTF-8.
        timeout_s: Limit, in seconds, of every call (a transfer call waits for the transfer,
            which the server bounds by its own timeout, so keep this above that). The default,
            150 s, is the transfer's default (120 s) plus `CLIENT_MARGIN_S`.
        worker_index: The server's `--worker-index`, which a broadcast sender checks against
            the server's position among its engines; None skips the check.

    >>> client = HTTPEngineClient("http://127.0.0.1:8000", timeout_s=30)
    >>> client.base_url
    'http://127.0.0.1:8000'
    >>> client.close()
    """

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None = None,
        admin_api_key: str | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S + CLIENT_MARGIN_S,
        worker_index: int | None = None,
    ) -> None:
        check_api_key(api_key, name="api_key")
        check_api_key(admin_api_key, name="admin_api_key")
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self.worker_index = worker_index
        self._api_key = api_key
        self._admin_api_key = admin_api_key
        # One connection pool shared by every thread that calls this client.
        self._http = httpx.Client(base_url=self.base_url, timeout=timeout_s)
        self.last_adapter_commit: AdapterCommit | None = None  # see finish_weight_update

    # --- plumbing -----------------------------------------------------------------------------

    def _headers(self, admin: bool) -> dict[bytes, bytes]:
        key = self._admin_api_key if admin else (self._api_key or self._admin_api_key)
        return {b"Authorization": bearer(key)} if key else {}

    def _transport_error(self, method: str, path: str, exc: httpx.HTTPError) -> WeightSyncError:
        if isinstance(exc, httpx.TimeoutException):
            return EngineTimeoutError(
                f"{method} {path}: {self.base_url} did not answer within {self.timeout_s} s "
                "(timeout_s); the server may still complete the call: check its state (/is_paused, /weight_info) "
                "before retrying, or raise timeout_s"
            )
        return EngineStateError(
            f"{method} {path}: cannot reach {self.base_url} ({exc!r}): is `weightsync serve` "
            "running there?"
        )

    def _call(
        self,
        method: str,
        path: str,
        *,
        admin: bool = True,
        params: Mapping[str, Any] | None = None,
        body: Mapping[str, Any] | None = None,
        timeout_s: float | None = None,
    ) -> dict[str, Any]:
        if self._http.is_closed:
            raise EngineStateError(f"{method} {path}: this client was closed; create a new one")
        try:
            response = self._http.request(
                method,
                path,
                params=params,
                json=body,
                headers=self._headers(admin),
                timeout=timeout_s if timeout_s is not None else self.timeout_s,
            )
        except httpx.HTTPError as exc:
            raise self._transport_error(method, path, exc) from exc
        if response.status_code >= 400:
            raise _error_from_answer(f"{method} {path}", response.status_code, response.text)
        answer: dict[str, Any] = response.json()
        return answer

    # --- pause / resume -----------------------------------------------------------------------

    def pause_generation(
        self, *, mode: str = "abort", clear_cache: bool = True, timeout_s: float | None = None
    ) -> None:
        """`POST /pause`: pauses at a step boundary (`abort`, `wait` or `keep`)."""
        params = {"mode": mode, "clear_cache": str(clear_cache).lower()}
        self._call("POST", "/pause", params=params, timeout_s=timeout_s)

    def arm_pause(self, after_tokens: int, *, mode: str = "keep", clear_cache: bool = True) -> None:
        """`POST /arm_pause` (weightsync): pause where every request has `after_tokens` tokens.

        The next `pause_generation` waits for it. See `LLMEngine.arm_pause`.
        """
        params = {
            "after_tokens": after_tokens,
            "mode": mode,
            "clear_cache": str(clear_cache).lower(),
        }
        self._call("POST", "/arm_pause", params=params)

    def resume_generation(self) -> None:
        """`POST /resume`."""
        self._call("POST", "/resume")

    def is_paused(self) -> bool:
        """`GET /is_paused`."""
        return bool(self._call("GET", "/is_paused")["is_paused"])

    def abort_requests(self, request_ids: Sequence[str] | None = None) -> int:
        """`POST /abort_requests`: aborts completions by id (all when None); returns how many."""
        body = {"request_ids": list(request_ids)} if request_ids else {}
        return int(self._call("POST", "/abort_requests", body=body)["aborted"])

    def unfinished_requests(self, request_ids: Sequence[str]) -> list[str]:
        """`POST /unfinished_requests` (weightsync): those of `request_ids` still unfinished."""
        body = {"request_ids": list(request_ids)}
        return list(self._call("POST", "/unfinished_requests", body=body)["unfinished"])

    # --- weights ------------------------------------------------------------------------------

    def init_weight_transfer_engine(self, request: Mapping[str, Any]) -> None:
        """`POST /init_weight_transfer_engine` with `{"init_info": {...}}`; blocks until joined."""
        self._call(
            "POST", "/init_weight_transfer_engine", body={"init_info": dict(request["init_info"])}
        )

    def start_weight_update(
        self, *, lora_name: str | None = None, lora_config: Mapping[str, Any] | None = None
    ) -> None:
        """`POST /start_weight_update`: opens the weight-update transaction.

        With `lora_name` (and, for an adapter not loaded yet, PEFT's `lora_config`), the
        transaction is that LoRA adapter's (see `LLMEngine.start_weight_update`).
        """
        if lora_name is None and lora_config is None:
            self._call("POST", "/start_weight_update")  # vLLM's call, exactly
            return
        body = {"lora_name": lora_name, "lora_config": dict(lora_config) if lora_config else None}
        self._call("POST", "/start_weight_update", body=body)

    def update_weights(self, request: Mapping[str, Any]) -> TransferStats:
        """`POST /update_weights` with `{"update_info": {...}}`; returns the server's stats."""
        answer = self._call(
            "POST", "/update_weights", body={"update_info": dict(request["update_info"])}
        )
        return TransferStats(**answer.get("stats", {}))

    def finish_weight_update(self, weight_version: WeightVersion | None = None) -> None:
        """`POST /finish_weight_update`: ends the transaction; the version moves.

        After an adapter's update, `last_adapter_commit` holds what the server answered.
        """
        answer = self._call(
            "POST", "/finish_weight_update", body={"weight_version": weight_version}
        )
        if "lora_name" in answer:
            self.last_adapter_commit = _adapter_commit(answer)

    def abort_weight_update(self) -> bool:
        """`POST /abort_weight_update`: ends the transaction on purpose; whether one was open."""
        return bool(self._call("POST", "/abort_weight_update")["aborted"])

    def shutdown_weight_transfer_engine(self) -> None:
        """`POST /shutdown_weight_transfer_engine`: the server leaves the trainer's transfer."""
        self._call("POST", "/shutdown_weight_transfer_engine")

    @property
    def weight_version(self) -> WeightVersion:
        """`GET /weight_info`: the version of the server's weights."""
        version: WeightVersion = self._call("GET", "/weight_info")["weight_version"]
        return version

    def update_weight_version(self, new_version: WeightVersion) -> None:
        """`POST /update_weight_version`: relabels the current weights."""
        self._call("POST", "/update_weight_version", body={"new_version": new_version})

    def weight_checksums(self) -> dict[str, str]:
        """`POST /weight_checker` (`checksum`): SHA-256 of every weight, by name."""
        checksums: dict[str, str] = self._call(
            "POST", "/weight_checker", body={"action": "checksum"}
        )["checksums"]
        return checksums

    def compare_weights(self, baseline: Mapping[str, str]) -> list[str]:
        """`POST /weight_checker` (`compare`): the names whose digest differs from `baseline`."""
        answer = self._call(
            "POST", "/weight_checker", body={"action": "compare", "baseline": dict(baseline)}
        )
        return list(answer["mismatches"])

    def get_world_size(self, include_dp: bool = True) -> int:
        """`GET /get_world_size`: transfer workers behind the server."""
        params = {"include_dp": str(include_dp).lower()}
        return int(self._call("GET", "/get_world_size", params=params)["world_size"])

    def health(self) -> bool:
        """Whether `GET /health` answers 200 now."""
        try:
            return self._http.get("/health", timeout=self.timeout_s).status_code == 200
        except httpx.HTTPError:
            return False

    # --- rollouts -----------------------------------------------------------------------------

    def generate(
        self,
        prompts: Sequence[Prompt],
        sampling_params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
    ) -> list[RequestOutput]:
        """`POST /v1/completions`: runs prompts to completion; one output per prompt, in order.

        Each output carries its token ids, the weight version of every token, and the sampled
        tokens' log-probabilities when `sampling_params.logprobs` is set.
        """
        params = sampling_params or SamplingParams()
        body = completion_body(prompts, params, request_id, stream=False)
        answer = self._call("POST", "/v1/completions", admin=False, body=body)
        return [to_output(answer["id"], choice, prompts) for choice in answer["choices"]]

    def stream(
        self,
        prompt: Prompt,
        sampling_params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
    ) -> Iterator[RequestOutput]:
        """`POST /v1/completions` with `stream`: yields the cumulative output after each chunk.

        The last one has `finished` set. Raises like the other calls; a chunk that does not
        arrive within `timeout_s` raises `EngineTimeoutError`.
        """
        params = sampling_params or SamplingParams()
        body = completion_body([prompt], params, request_id, stream=True)
        path = "/v1/completions"
        try:
            with self._http.stream(
                "POST", path, json=body, headers=self._headers(False)
            ) as response:
                if response.status_code >= 400:
                    response.read()
                    raise _error_from_answer(f"POST {path}", response.status_code, response.text)
                total: dict[str, Any] | None = None
                for line in response.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[len("data: ") :])
                    if "error" in chunk:
                        raise _ERRORS.get(chunk["error"]["type"], EngineStateError)(
                            chunk["error"]["message"]
                        )
                    if not chunk.get("choices"):
                        continue  # the usage chunk
                    total = accumulate(total, chunk["choices"][0])
                    yield to_output(chunk["id"], total, [prompt])
        except httpx.HTTPError as exc:
            raise self._transport_error("POST", path, exc) from exc

    # --- lifecycle ----------------------------------------------------------------------------

    def close(self) -> None:
        """Closes the connection pool."""
        self._http.close()

    def __enter__(self) -> HTTPEngineClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _adapter_commit(answer: Mapping[str, Any]) -> AdapterCommit:
    """The adapter commit a `/finish_weight_update` answer reports, its types checked."""
    name, version = answer.get("lora_name"), answer.get("weight_version")
    dropped = answer.get("dropped_versions")

    def is_version(value: object) -> bool:
        return isinstance(value, str) or _is_int(value)

    if (
        not isinstance(name, str)
        or not is_version(version)
        or not isinstance(dropped, list)
        or not all(is_version(v) for v in dropped)
    ):
        raise WeightSyncError(
            "/finish_weight_update answered an adapter's update with lora_name "
            f"{name!r:.80}, weight_version {version!r:.80} and dropped_versions "
            f"{dropped!r:.200}; expected a string, a version (string or int) and a list of "
            "versions: is the server a weightsync server of this version?"
        )
    return AdapterCommit(name, version, list(dropped))  # type: ignore[arg-type]
