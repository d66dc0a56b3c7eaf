"""`EngineProcess`: an inference engine in a process of its own, driven by the trainer over HTTP.

The trainer's process keeps its cores for training while a `weightsync serve` child on a free
loopback port generates, the way an inference server would. The trainer reaches it through the
same routes as any client: [`HTTPEngineClient`][weightsync.trainer.http_client.HTTPEngineClient]
for pause, resume and weight updates, and streamed `/v1/completions` for rollouts, which run in
the background between the trainer's calls. There is no second protocol: what works here works
against any `weightsync serve`.
"""

from __future__ import annotations

import json
import tempfile
import time
import uuid
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path
from typing import Any

from weightsync.engine.config import EngineConfig
from weightsync.engine.outputs import RequestOutput, WeightVersion
from weightsync.engine.pause import PauseMode
from weightsync.engine.sampling import SamplingParams
from weightsync.engine.tokenizer import Prompt
from weightsync.errors import EngineStateError, EngineTimeoutError, InvalidRequestError
from weightsync.trainer._rollouts import Rollouts
from weightsync.trainer._serve_process import ServeProcess
from weightsync.trainer.http_client import HTTPEngineClient
from weightsync.transfer.base import CLIENT_MARGIN_S, DEFAULT_TIMEOUT_S, TransferStats

__all__ = ["EngineProcess"]


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
    if not engine_config.prepack_linears:
        args.append("--no-prepack-linears")
    return args


class EngineProcess:
    """A `weightsync serve` child process, and the trainer's client for it.

    Its methods mirror `LLMEngine`'s and block until the server answered; requests run in the
    server between calls, so the trainer computes while the engine generates. It satisfies
    [`EngineClient`][weightsync.trainer.senders.EngineClient]. Close it (or use `with`) to stop
    the server; should this process die without closing it (killed, say), the server notices
    within a second and stops itself.

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
        device: Where the engine computes and its updates land (`weightsync serve --device`):
            `"cpu"`, or `"cuda:N"`, which also serves `nccl` as the process's CUDA device.
        timeout_s: Limit, in seconds, for the server to start and for each answer that does not
            wait for generation. The default (150 s) exceeds the transfer's default (120 s), which
            a weight-update call waits for: keep it above the `timeout_s` of the transfer.

    Raises:
        EngineConfigError: The server refused the configuration; the message says why.
        EngineStateError: The server did not start within `timeout_s`.

    >>> engine = EngineProcess("debug", engine_config=EngineConfig(num_kv_blocks=64))  # doctest: +SKIP
    >>> engine.generate(["hi"], SamplingParams(max_tokens=3))[0].outputs[0].weight_versions  # doctest: +SKIP
    [0, 0, 0]
    >>> engine.close()  # doctest: +SKIP
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
        timeout_s: float = DEFAULT_TIMEOUT_S + CLIENT_MARGIN_S,
    ) -> None:
        self.worker_index = worker_index
        self.timeout_s = timeout_s
        self._model_dir: tempfile.TemporaryDirectory[str] | None = None
        if isinstance(model, dict):  # the shapes only: zero weights until the first update
            self._model_dir = tempfile.TemporaryDirectory(prefix="weightsync-model-")
            (Path(self._model_dir.name) / "config.json").write_text(json.dumps(model))
            model_args = [self._model_dir.name, "--load-format", "dummy"]
        else:
            model_args = [model]
        argv = [*model_args, "--seed", str(seed), "--dtype", dtype,
                "--worker-index", str(worker_index), "--device", device, "--log-level", "warning",
                *_serve_args(engine_config or EngineConfig()),
                # One compute thread: the trainer and the other engines share the cores.
                "--num-threads", "1"]  # fmt: skip
        if backend is not None:
            argv += ["--weight-transfer-config.backend", backend]
        self._server = ServeProcess(argv)
        try:
            self.base_url = self._server.wait_listening(timeout_s)
        except BaseException:
            self._stop_server()
            raise
        self.client = HTTPEngineClient(
            self.base_url, timeout_s=timeout_s, worker_index=worker_index
        )
        self._rollouts = Rollouts(self.base_url, headers={}, timeout_s=timeout_s)
        self._results: dict[str, Future[RequestOutput]] = {}

    @property
    def pid(self) -> int:
        """The server's process id. The server exits when this process does, even killed."""
        return self._server.pid

    @property
    def log(self) -> str:
        """What the server printed so far (warnings and errors)."""
        return self._server.log

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
        """Starts requests in the engine and returns once it holds them; they run meanwhile.

        Args:
            prompts: Text or token-id prompts.
            sampling_params: One for all, or one per prompt.
            request_ids: Unique ids; random ones by default.
            pause_after_tokens: Also arm a pause (`pause_mode`, `clear_cache`) that lands at the
                first step boundary where every unfinished request has this many output tokens.
                The requests are queued while the engine is paused, the pause armed, then the
                engine resumed, so no step runs before it and it lands exactly there;
                `pause_generation(...)` then waits for it.
            pause_mode: Mode of that pause.
            clear_cache: Whether that pause drops the KV and prefix caches.

        Returns:
            The request ids, for `collect`.

        Raises:
            InvalidRequestError: Mismatched lengths, a bad argument, or a request the engine
                refused.
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
        if pause_after_tokens is not None and (
            not isinstance(pause_after_tokens, int) or pause_after_tokens < 0
        ):
            raise InvalidRequestError(
                f"pause_after_tokens must be an int >= 0 or None, got {pause_after_tokens!r}"
            )
        hold = pause_after_tokens is not None and not self.client.is_paused()
        if hold:  # queue them all before any step runs (kept requests keep their KV)
            self.client.pause_generation(mode="keep", clear_cache=False)
        try:
            accepted = []
            for request_id, prompt, sp in zip(ids, prompts, params, strict=True):
                started, result = self._rollouts.submit(request_id, prompt, sp)
                self._results[request_id] = result
                accepted.append(started)
            for started in accepted:
                started.result(self.timeout_s)
            if pause_after_tokens is not None:
                self.client.arm_pause(pause_after_tokens, mode=pause_mode, clear_cache=clear_cache)
        finally:
            if hold:
                self.client.resume_generation()
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
            InvalidRequestError: An unknown, repeated or already collected id.
            EngineTimeoutError: They did not finish within the limit.
        """
        if len(set(request_ids)) != len(request_ids):
            raise InvalidRequestError(f"collect: request ids repeat in {list(request_ids)[:10]}")
        unknown = [r for r in request_ids if r not in self._results]
        if unknown:
            raise InvalidRequestError(
                f"collect: unknown or already collected request ids {unknown[:5]}; collect each "
                "request once, after add_requests"
            )
        waiting = [r for r in request_ids if not self._results[r].done()]
        # Finished ones may still be on their way; the engine says which ones are not.
        if (
            waiting
            and self.client.is_paused()
            and (waiting := self.client.unfinished_requests(waiting))
        ):
            raise EngineStateError(
                f"collect would wait forever: the engine is paused with {len(waiting)} of these "
                "requests unfinished; call resume_generation() first"
            )
        limit = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + limit
        outputs = []
        for request_id in request_ids:
            try:
                outputs.append(
                    self._results[request_id].result(max(0.0, deadline - time.monotonic()))
                )
            except FutureTimeout:
                raise EngineTimeoutError(
                    f"collect: request {request_id} did not finish within {limit} s"
                ) from None
        for request_id in request_ids:
            del self._results[request_id]
        return outputs

    def generate(
        self,
        prompts: Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Runs prompts to completion and returns their final outputs (`add_requests` + `collect`)."""
        return self.collect(self.add_requests(prompts, sampling_params))

    def abort(self, request_ids: Sequence[str]) -> None:
        """Aborts requests; `collect` then returns them with `finish_reason="abort"`."""
        self.client.abort_requests(list(request_ids))

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
                at least this many output tokens (or has finished), instead of now. Requests may
                already be past that count when this call arrives: to land exactly at a token,
                arm the pause with the requests (`add_requests(..., pause_after_tokens=...)`);
                this call then waits for it.
            timeout_s: Limit in seconds; by default the handle's `timeout_s`.

        Raises:
            InvalidRequestError: Unknown `mode` or a bad `after_tokens`.
        """
        if after_tokens is not None:
            if not isinstance(after_tokens, int) or after_tokens < 0:
                raise InvalidRequestError(
                    f"after_tokens must be an int >= 0 or None, got {after_tokens!r}"
                )
            self.client.arm_pause(after_tokens, mode=mode, clear_cache=clear_cache)
        self.client.pause_generation(mode=mode, clear_cache=clear_cache, timeout_s=timeout_s)

    def resume_generation(self) -> None:
        """Resumes generation (harmless when running).

        Raises:
            TornWeightsError: A failed update left torn weights; land a complete update first.
        """
        self.client.resume_generation()

    def is_paused(self) -> bool:
        """Whether generation is paused."""
        return self.client.is_paused()

    @property
    def weight_version(self) -> WeightVersion:
        """Version of the engine's current weights."""
        return self.client.weight_version

    def get_world_size(self) -> int:
        """Transfer workers behind the server (`/get_world_size`): 1."""
        return self.client.get_world_size()

    def init_weight_transfer_engine(self, request: Mapping[str, Any]) -> None:
        """Joins a trainer's transfer: `{"init_info": {...}}`; blocks until the group forms."""
        self.client.init_weight_transfer_engine(request)

    def start_weight_update(
        self, *, lora_name: str | None = None, lora_config: Mapping[str, Any] | None = None
    ) -> None:
        """Opens a weight-update transaction (see `LLMEngine.start_weight_update`)."""
        self.client.start_weight_update(lora_name=lora_name, lora_config=lora_config)

    def update_weights(self, request: Mapping[str, Any]) -> TransferStats:
        """Receives one update: `{"update_info": {...}}` (see `LLMEngine.update_weights`).

        Raises:
            EngineBusyError: Requests are in flight and the engine is not paused.
            WeightValidationError: The update does not match the model; nothing changed.
            WeightTransferError: The transfer failed (see `partially_applied`).
        """
        return self.client.update_weights(request)

    def finish_weight_update(self, weight_version: WeightVersion | None = None) -> None:
        """Ends the transaction; the version moves (see `LLMEngine.finish_weight_update`)."""
        self.client.finish_weight_update(weight_version)

    def abort_weight_update(self) -> bool:
        """Ends the transaction on purpose (see `LLMEngine.abort_weight_update`)."""
        return self.client.abort_weight_update()

    def shutdown_weight_transfer_engine(self) -> None:
        """Leaves the trainer's transfer (see `LLMEngine.shutdown_weight_transfer_engine`)."""
        self.client.shutdown_weight_transfer_engine()

    def weight_digests(self) -> dict[str, str]:
        """SHA-256 of every weight's bytes, by Hugging Face name (`/weight_checker`)."""
        return self.client.weight_checksums()

    # --- lifecycle ----------------------------------------------------------------------------

    def close(self) -> None:
        """Stops the server (SIGTERM, then SIGKILL after `timeout_s`). Safe to call twice."""
        self._rollouts.close()
        self.client.close()
        self._stop_server()

    def _stop_server(self) -> None:
        self._server.stop(self.timeout_s)
        if self._model_dir is not None:
            self._model_dir.cleanup()
            self._model_dir = None

    def __enter__(self) -> EngineProcess:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"EngineProcess({self.base_url}, worker_index={self.worker_index})"
