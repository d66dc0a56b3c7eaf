"""The engine process's side of `EngineProcess`: an `LLMEngine` step loop that answers commands.

The loop checks the pipe between two engine steps, so a command acts at a step boundary while
requests are in flight. A command whose answer must wait for generation is answered when the
engine gets there, and the engine keeps stepping meanwhile.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import torch

from weightsync.config import WeightTransferConfig
from weightsync.engine.config import EngineConfig
from weightsync.engine.llm_engine import LLMEngine
from weightsync.engine.model import LlamaForCausalLM
from weightsync.engine.model_config import LlamaConfig
from weightsync.engine.outputs import RequestOutput
from weightsync.engine.sampling import SamplingParams
from weightsync.engine.scheduler import PauseMode, PauseState
from weightsync.errors import EngineConfigError, EngineStateError, InvalidRequestError
from weightsync.transfer.checksums import weight_checksums

# How often an idle worker rechecks a command whose answer is due (seconds).
_DEFERRED_POLL_S = 0.01


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
            "start_weight_update": engine.start_weight_update,
            "update_weights": self.update_weights,
            "finish_weight_update": lambda weight_version: engine.finish_weight_update(
                weight_version
            ),
            "abort_weight_update": lambda: {"aborted": engine.abort_weight_update()},
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


def engine_main(
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
