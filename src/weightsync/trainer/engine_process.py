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
import logging
import threading
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from weightsync import errors
from weightsync.engine.config import EngineConfig
from weightsync.engine.outputs import CompletionOutput, RequestOutput, WeightVersion
from weightsync.engine.processing import Prompt
from weightsync.engine.sampling import SamplingParams
from weightsync.engine.scheduler import PauseMode, PauseState
from weightsync.errors import (
    InvalidRequestError,
    WeightTransferError,
)
from weightsync.trainer._engine_worker import engine_main
from weightsync.trainer._pipe import PipeProcess
from weightsync.transfer.base import TransferStats

__all__ = ["EngineProcess"]

logger = logging.getLogger(__name__)

# Errors a command may raise in the worker, re-raised under their own class in the trainer.
_REMOTE_ERRORS: dict[str, type[Exception]] = {
    name: getattr(errors, name) for name in errors.__all__
}


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
        super().__init__(engine_main, args, timeout_s)
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

    def start_weight_update(self) -> None:
        """Opens a weight-update transaction (see `LLMEngine.start_weight_update`)."""
        self._call("start_weight_update")

    def finish_weight_update(self, weight_version: WeightVersion | None = None) -> None:
        """Ends the transaction; the version moves (see `LLMEngine.finish_weight_update`)."""
        self._call("finish_weight_update", weight_version=weight_version)

    def abort_weight_update(self) -> bool:
        """Ends the transaction on purpose (see `LLMEngine.abort_weight_update`)."""
        aborted: bool = self._call("abort_weight_update")["aborted"]
        return aborted

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
