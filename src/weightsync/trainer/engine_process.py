"""`EngineProcess`: an inference engine in a process of its own, driven by the trainer.

The trainer's process keeps its cores for training while a spawned process runs an
[`LLMEngine`][weightsync.engine.llm_engine.LLMEngine] step loop, the way an inference server or an
actor would. Commands and replies are JSON objects on a pipe: no pickle crosses it.

The worker's loop checks the pipe between two engine steps, so a command acts at a step
boundary while requests are in flight. A command whose answer must wait for generation (collect
finished requests; pause once every request has produced `after_tokens` tokens; a `wait` pause)
is answered when the engine gets there, and the engine keeps stepping meanwhile. One command is
outstanding at a time; the client's calls are serialized by a lock, so threads may share it.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import uuid
from collections.abc import Callable, Mapping, Sequence
from multiprocessing.connection import Connection
from typing import Any

import torch

from weightsync.config import WeightTransferConfig
from weightsync.engine.config import EngineConfig
from weightsync.engine.llm_engine import LLMEngine
from weightsync.engine.model import LlamaForCausalLM
from weightsync.engine.model_config import LlamaConfig
from weightsync.engine.outputs import CompletionOutput, RequestOutput, WeightVersion
from weightsync.engine.processing import Prompt
from weightsync.engine.sampling import SamplingParams
from weightsync.engine.scheduler import PauseMode, PauseState
from weightsync.errors import (
    EngineBusyError,
    EngineConfigError,
    EngineStateError,
    InvalidRequestError,
    TornWeightsError,
    WeightTransferError,
    WeightTransferTimeout,
    WeightValidationError,
)
from weightsync.trainer._pipe import PipeProcess
from weightsync.transfer.base import TransferStats
from weightsync.transfer.checksums import weight_checksums

__all__ = ["EngineProcess"]

logger = logging.getLogger(__name__)

# How often an idle worker rechecks a command whose answer is due (seconds).
_DEFERRED_POLL_S = 0.01

# Errors a command may raise in the worker, re-raised under their own class in the trainer.
_REMOTE_ERRORS: dict[str, type[Exception]] = {
    cls.__name__: cls
    for cls in (
        EngineBusyError,
        EngineConfigError,
        EngineStateError,
        InvalidRequestError,
        TornWeightsError,
        WeightTransferError,
        WeightTransferTimeout,
        WeightValidationError,
    )
}


def _dtype(name: str) -> torch.dtype:
    dtypes = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}
    if name not in dtypes:
        raise EngineConfigError(f"dtype must be one of {sorted(dtypes)}, got {name!r}")
    return dtypes[name]


def _build_engine(
    model: str | dict[str, Any],
    *,
    seed: int,
    dtype: str,
    engine_config: dict[str, Any],
    backend: str | None,
    worker_index: int,
) -> LLMEngine:
    if isinstance(model, dict):  # a Hugging Face config.json: zero weights until the first update
        llama = LlamaForCausalLM(LlamaConfig.from_hf_dict(model), dtype=_dtype(dtype))
        with torch.no_grad():
            for parameter in llama.parameters():
                parameter.zero_()
        model_arg: LlamaForCausalLM | str = llama
    else:
        model_arg = model
    return LLMEngine(
        model_arg,
        engine_config=EngineConfig(**engine_config),
        weight_transfer_config=WeightTransferConfig(backend=backend) if backend else None,
        seed=seed,
        dtype=_dtype(dtype),
        worker_index=worker_index,
    )


@dataclasses.dataclass
class _Deferred:
    """A command answered later: when `ready()` holds, `answer()` makes its reply."""

    ready: Callable[[], bool]
    answer: Callable[[], dict[str, Any] | None]


class _EngineLoop:
    """The worker's side: steps the engine, and answers commands between two steps."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.live: dict[str, int] = {}  # unfinished request id -> output tokens so far
        self.finished: dict[str, RequestOutput] = {}  # finished, not yet collected
        # A pause waiting for every unfinished request to reach `after_tokens` output tokens;
        # checked before every step, so it lands exactly there.
        self.armed: dict[str, Any] | None = None

    def absorb(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            if output.finished:
                self.live.pop(output.request_id, None)
                self.finished[output.request_id] = output
            else:
                self.live[output.request_id] = len(output.outputs[0].token_ids)

    def step(self) -> None:
        self.absorb(self.engine.step())

    def fire_armed_pause(self) -> None:
        """Starts the armed pause once every unfinished request has its `after_tokens` tokens."""
        armed = self.armed
        if armed is None:
            return
        if not self.engine.is_paused() and any(
            count < armed["after_tokens"] for count in self.live.values()
        ):
            return
        self.armed = None
        if not self.engine.is_paused():  # pausing an already paused engine changes nothing
            self.engine.start_pause(mode=armed["mode"], clear_cache=armed["clear_cache"])

    # --- commands ------------------------------------------------------------------------------

    def add_requests(
        self, requests: list[dict[str, Any]], pause: dict[str, Any] | None = None
    ) -> None:
        for request in requests:
            params = SamplingParams(**request["sampling_params"])
            self.engine.add_request(request["request_id"], request["prompt"], params)
            self.live[request["request_id"]] = 0
        if pause is not None:  # armed in the same command: no step can run before it
            self.armed = pause

    def collect(self, request_ids: list[str]) -> _Deferred:
        unknown = [r for r in request_ids if r not in self.live and r not in self.finished]
        if unknown:
            raise InvalidRequestError(
                f"collect: unknown or already collected request ids {unknown[:5]}; collect each "
                "request once, after add_requests"
            )

        def ready() -> bool:
            if self.engine.is_paused() and not self.engine.has_work():
                waiting = [r for r in request_ids if r not in self.finished]
                if waiting:
                    raise EngineStateError(
                        f"collect would wait forever: the engine is paused with {len(waiting)} "
                        "of these requests unfinished; call resume_generation() first"
                    )
            return all(r in self.finished for r in request_ids)

        def answer() -> dict[str, Any]:
            outputs = [self.finished.pop(r) for r in request_ids]
            return {"outputs": [dataclasses.asdict(o) for o in outputs]}

        return _Deferred(ready, answer)

    def pause(self, mode: PauseMode, clear_cache: bool, after_tokens: int | None) -> _Deferred:
        engine = self.engine
        if self.armed is None:  # else: wait for the pause armed with the requests
            self.armed = {
                "mode": mode,
                "clear_cache": clear_cache,
                "after_tokens": after_tokens or 0,
            }
        self.fire_armed_pause()

        def ready() -> bool:
            # A `wait` pause drains its running requests first.
            return self.armed is None and engine.pause_state is not PauseState.DRAINING

        def answer() -> None:
            self.step()  # paused: computes nothing, delivers the outputs the pause ended

        return _Deferred(ready, answer)

    def update_weights(self, update_info: dict[str, Any]) -> dict[str, Any]:
        stats = self.engine.update_weights({"update_info": update_info})
        return {"stats": dataclasses.asdict(stats), "weight_version": self.engine.weight_version}

    def state(self) -> dict[str, Any]:
        engine = self.engine
        return {
            "weight_version": engine.weight_version,
            "pause_state": engine.pause_state.value,
            "num_steps": engine.num_steps,
            "num_unfinished": len(self.live),
        }

    # --- the loop ------------------------------------------------------------------------------

    def handlers(self) -> dict[str, Callable[..., Any]]:
        engine = self.engine
        return {
            "add_requests": self.add_requests,
            "collect": self.collect,
            "abort": lambda request_ids: engine.abort_request(request_ids),
            "pause_generation": self.pause,
            "resume_generation": engine.resume_generation,
            "init_weight_transfer_engine": lambda init_info: engine.init_weight_transfer_engine(
                {"init_info": init_info}
            ),
            "update_weights": self.update_weights,
            "state": self.state,
            "weight_digests": lambda: {"digests": weight_checksums(engine.model.named_weights())},
        }

    def serve(self, conn: Connection) -> None:
        handlers = self.handlers()
        deferred: _Deferred | None = None
        while True:
            self.fire_armed_pause()
            if deferred is not None:
                try:
                    if deferred.ready():
                        _send(conn, {"ok": True, **(deferred.answer() or {})})
                        deferred = None
                except Exception as exc:
                    _send(conn, _error_reply(exc))
                    deferred = None
            busy = self.engine.has_work()
            # Idle: block on the pipe instead of spinning (briefly, if an answer is due).
            idle_wait_s = _DEFERRED_POLL_S if deferred is not None else None
            if conn.poll(0 if busy else idle_wait_s):
                command = json.loads(conn.recv_bytes())
                op = command.pop("op")
                if op == "exit":
                    _send(conn, {"ok": True})
                    return
                try:
                    if deferred is not None:
                        raise EngineStateError(
                            f"command {op!r} arrived while another is outstanding; "
                            "EngineProcess answers one command at a time"
                        )
                    if op not in handlers:
                        raise InvalidRequestError(
                            f"unknown command {op!r}; known: {sorted(handlers)}"
                        )
                    result = handlers[op](**command)
                except Exception as exc:
                    _send(conn, _error_reply(exc))
                    continue
                if isinstance(result, _Deferred):
                    deferred = result
                else:
                    _send(conn, {"ok": True, **(result or {})})
            elif busy:
                self.step()


def _send(conn: Connection, reply: dict[str, Any]) -> None:
    conn.send_bytes(json.dumps(reply).encode())


def _error_reply(exc: Exception) -> dict[str, Any]:
    return {
        "ok": False,
        "error_type": type(exc).__name__,
        "message": str(exc),
        "partially_applied": getattr(exc, "partially_applied", None),
    }


def _engine_main(
    conn: Connection,
    model: str | dict[str, Any],
    seed: int,
    dtype: str,
    engine_config: dict[str, Any],
    backend: str | None,
    worker_index: int,
    device: str,
) -> None:
    torch.set_num_threads(1)  # the trainer and other engines share the cores
    if torch.device(device).type == "cuda":  # nccl receives on the current CUDA device
        torch.cuda.set_device(torch.device(device))
    try:
        engine = _build_engine(
            model,
            seed=seed,
            dtype=dtype,
            engine_config=engine_config,
            backend=backend,
            worker_index=worker_index,
        )
    except Exception as exc:  # answer every command with the reason, so the trainer sees it
        while True:
            command = json.loads(conn.recv_bytes())
            _send(conn, {"ok": True} if command["op"] == "exit" else _error_reply(exc))
            if command["op"] == "exit":
                return
    try:
        _EngineLoop(engine).serve(conn)
    finally:
        engine.shutdown()


def _to_output(data: dict[str, Any]) -> RequestOutput:
    completions = [CompletionOutput(**c) for c in data.pop("outputs")]
    return RequestOutput(**data, outputs=completions)


class EngineProcess(PipeProcess):
    """An `LLMEngine` in a spawned process, and the trainer's client for it.

    Its methods mirror `LLMEngine`'s and block until the worker answered; requests run in the
    worker between calls, so the trainer computes while the engine generates. It satisfies
    [`EngineClient`][weightsync.trainer.client.EngineClient].

    Args:
        model: A preset name (`"debug"`, `"tiny"`, `"small"`) with weights drawn from `seed`, or a
            Hugging Face `config.json` dict: that shape with zeroed weights, for a trainer to fill.
        seed: Seed of a preset's weights.
        dtype: Parameter dtype: `"float32"`, `"float64"` or `"bfloat16"`.
        engine_config: Scheduler and KV-cache limits.
        backend: Transfer backend of its updates (`"nccl"`, `"gloo"`, `"ipc"`); None takes the
            one named in the init info.
        worker_index: Its index among the engines a trainer updates (its broadcast rank is
            `1 + worker_index`).
        device: Where its transfer buffers live: `"cpu"`, or `"cuda:N"` for `nccl` (the
            process's CUDA device). The engine itself computes on the CPU.
        timeout_s: Limit, in seconds, for each answer that does not wait for generation.

    >>> engine = EngineProcess("debug", engine_config=EngineConfig(num_kv_blocks=64))
    >>> out = engine.generate(["hi"], SamplingParams(temperature=0, max_tokens=3))[0]
    >>> out.outputs[0].weight_versions
    [0, 0, 0]
    >>> engine.close()
    """

    def __init__(
        self,
        model: str | dict[str, Any] = "debug",
        *,
        seed: int = 0,
        dtype: str = "float32",
        engine_config: EngineConfig | None = None,
        backend: str | None = None,
        worker_index: int = 0,
        device: str = "cpu",
        timeout_s: float = 120.0,
    ) -> None:
        config = dataclasses.asdict(engine_config or EngineConfig())
        args = (model, seed, dtype, config, backend, worker_index, device)
        super().__init__(_engine_main, args, timeout_s)
        self.worker_index = worker_index
        self._lock = threading.Lock()

    def _call(self, op: str, wait_s: float | None = None, **fields: Any) -> dict[str, Any]:
        """Sends one command and returns its reply; worker errors keep their class."""
        with self._lock:
            self._start(op, **fields)
            return self._reply(wait_s)

    def _error_from(self, reply: dict[str, Any]) -> Exception:
        """Re-raises a worker's weightsync error under its own class."""
        error_cls = _REMOTE_ERRORS.get(str(reply.get("error_type")))
        message = str(reply.get("message"))
        if error_cls is None:  # an unexpected failure inside the engine process
            return super()._error_from(reply)
        if issubclass(error_cls, WeightTransferError):
            return error_cls(message, partially_applied=bool(reply.get("partially_applied")))
        return error_cls(message)

    # --- requests -----------------------------------------------------------------------------

    def add_requests(
        self,
        prompts: Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        request_ids: Sequence[str] | None = None,
        *,
        pause_after_tokens: int | None = None,
        pause_mode: PauseMode = "keep",
        clear_cache: bool = True,
    ) -> list[str]:
        """Queues requests in the engine and returns at once; they run while the trainer works.

        Args:
            prompts: Text or token-id prompts.
            sampling_params: One for all, or one per prompt.
            request_ids: Unique ids; random ones by default.
            pause_after_tokens: Also arm a pause (`pause_mode`, `clear_cache`) that lands at the
                first step boundary where every unfinished request has this many output tokens.
                Armed in the same command as the requests, so no step runs before it and it
                lands exactly there; `pause_generation(...)` then waits for it.
            pause_mode: Mode of that pause.
            clear_cache: Whether that pause drops the KV and prefix caches.

        Returns:
            The request ids, for `collect`.

        Raises:
            InvalidRequestError: A bad prompt, sampling parameters or duplicate id (requests
                before it were queued).
        """
        params = (
            list(sampling_params)
            if isinstance(sampling_params, Sequence)
            else [sampling_params or SamplingParams()] * len(prompts)
        )
        ids = list(request_ids) if request_ids is not None else [uuid.uuid4().hex for _ in prompts]
        if not len(prompts) == len(params) == len(ids):
            raise InvalidRequestError(
                f"add_requests got {len(prompts)} prompts, {len(params)} sampling params and "
                f"{len(ids)} request ids; give one each (or one sampling params for all)"
            )
        requests = [
            {"request_id": i, "prompt": p, "sampling_params": dataclasses.asdict(sp)}
            for i, p, sp in zip(ids, prompts, params, strict=True)
        ]
        if pause_after_tokens is not None and (
            not isinstance(pause_after_tokens, int) or pause_after_tokens < 0
        ):
            raise InvalidRequestError(
                f"pause_after_tokens must be an int >= 0 or None, got {pause_after_tokens!r}"
            )
        pause = (
            None
            if pause_after_tokens is None
            else {
                "mode": pause_mode,
                "clear_cache": clear_cache,
                "after_tokens": pause_after_tokens,
            }
        )
        self._call("add_requests", requests=requests, pause=pause)
        return ids

    def collect(
        self, request_ids: Sequence[str], timeout_s: float | None = None
    ) -> list[RequestOutput]:
        """Waits until the requests finished and returns their final outputs, in order.

        Args:
            request_ids: Ids from `add_requests`, each collected once.
            timeout_s: Limit in seconds; by default the handle's `timeout_s`.

        Raises:
            EngineStateError: The engine is paused with some of them unfinished (it would wait
                forever): resume it first.
            InvalidRequestError: An unknown or already collected id.
        """
        reply = self._call("collect", timeout_s, request_ids=list(request_ids))
        return [_to_output(o) for o in reply["outputs"]]

    def generate(
        self,
        prompts: Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Runs prompts to completion and returns their final outputs (`add_requests` + `collect`)."""
        return self.collect(self.add_requests(prompts, sampling_params))

    def abort(self, request_ids: Sequence[str]) -> None:
        """Aborts requests; `collect` then returns them with `finish_reason="abort"`."""
        self._call("abort", request_ids=list(request_ids))

    # --- pause / resume / weights -------------------------------------------------------------

    def pause_generation(
        self,
        *,
        mode: PauseMode = "abort",
        clear_cache: bool = True,
        after_tokens: int | None = None,
        timeout_s: float | None = None,
    ) -> None:
        """Pauses at a step boundary and returns once paused (see `LLMEngine.pause_generation`).

        Args:
            mode: `abort`, `wait` or `keep`.
            clear_cache: Drop the KV and prefix caches (kept requests recompute on resume).
            after_tokens: Pause at the first step boundary where every unfinished request has
                at least this many output tokens (or has finished), instead of now; the engine
                keeps generating until then. Requests may already be past that count when this
                call arrives: to land exactly at a token, arm the pause with the requests
                (`add_requests(..., pause_after_tokens=...)`); this call then waits for it.
            timeout_s: Limit in seconds; by default the handle's `timeout_s`.

        Raises:
            InvalidRequestError: Unknown `mode`.
        """
        if after_tokens is not None and (not isinstance(after_tokens, int) or after_tokens < 0):
            raise InvalidRequestError(
                f"after_tokens must be an int >= 0 or None, got {after_tokens!r}"
            )
        self._call(
            "pause_generation",
            timeout_s,
            mode=mode,
            clear_cache=clear_cache,
            after_tokens=after_tokens,
        )

    def resume_generation(self) -> None:
        """Resumes generation (harmless when running).

        Raises:
            TornWeightsError: A failed update left torn weights; land a complete update first.
        """
        self._call("resume_generation")

    def is_paused(self) -> bool:
        """Whether generation is paused."""
        return str(self._call("state")["pause_state"]) == PauseState.PAUSED.value

    @property
    def weight_version(self) -> WeightVersion:
        """Version of the engine's current weights."""
        version: WeightVersion = self._call("state")["weight_version"]
        return version

    def init_weight_transfer_engine(self, request: Mapping[str, Any]) -> None:
        """Joins a trainer's transfer: `{"init_info": {...}}`; blocks until the group forms."""
        self._call("init_weight_transfer_engine", init_info=dict(request["init_info"]))

    def update_weights(self, request: Mapping[str, Any]) -> TransferStats:
        """Receives one update: `{"update_info": {...}}` (see `LLMEngine.update_weights`).

        Returns:
            What the engine received and how fast.

        Raises:
            EngineBusyError: Requests are in flight and the engine is not paused.
            WeightValidationError: The update does not match the model; nothing changed.
            WeightTransferError: The transfer failed (see `partially_applied`).
        """
        reply = self._call("update_weights", update_info=dict(request["update_info"]))
        return TransferStats(**reply["stats"])

    def weight_digests(self) -> dict[str, str]:
        """SHA-256 of every weight's bytes, by Hugging Face name.

        Equal to [`weight_checksums`][weightsync.transfer.checksums.weight_checksums] of the
        trainer's weights exactly when the engine holds the same bits.
        """
        digests: dict[str, str] = self._call("weight_digests")["digests"]
        return digests
