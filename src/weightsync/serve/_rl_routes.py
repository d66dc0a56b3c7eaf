"""vLLM's RL routes: pause and resume, the weight-update transaction, versions and checksums.

Paths, query parameters and success bodies are vLLM's, so a trainer written against vLLM's HTTP
control plane drives this server unchanged. Each route checks its parameters and calls its
engine client as vLLM's routes do: the `AsyncEngine` itself, or a data-parallel front's replicas
behind the same calls (`EngineClient`); what the server answers of itself comes from its
`ServerView`. Unlike vLLM's, every route takes the admin key when the server has one, and every
failure is JSON naming the field and the weightsync error type with the status of its class
(never a 500 for a known failure). Transfer calls block on a worker thread, never on the event
loop, so streams keep flowing. IPC handles arrive as JSON records: nothing is unpickled.

One concept: vLLM's RL control surface over HTTP, route by route. Its length is the routes'
docstrings (they are the schema's descriptions) and the checks of their bodies; cut in two, a
reader would look for a route in the wrong half.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import re
from collections.abc import Callable, Coroutine, Mapping
from typing import Annotated, Any, Literal, Protocol

from fastapi import APIRouter, Body, Depends, Query, Request, Response
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from pydantic import Field, StrictInt, StrictStr

from weightsync.engine.lora import MAX_LORA_NAME_LENGTH, LoRAAdapter
from weightsync.engine.outputs import WeightVersion
from weightsync.engine.pause import PauseMode
from weightsync.engine.weights import AdapterCommit, WeightUpdateStatus
from weightsync.serve._auth import require_admin_key
from weightsync.serve._errors import RequestRefused, error_body
from weightsync.serve._fields import RequestBody
from weightsync.serve._view import Body as Answer
from weightsync.serve._view import ServerView
from weightsync.transfer.base import TransferStats


class EngineClient(Protocol):
    """The calls the RL routes make, named and typed as `AsyncEngine`'s, which implements them.

    A data-parallel front implements them over its replicas; where it answers with its replicas'
    own answers (`update_weights`' stats, `weight_update`), those pass on as JSON.
    """

    async def arm_pause(
        self, after_tokens: int, *, mode: PauseMode = ..., clear_cache: bool = ...
    ) -> None: ...
    async def resume_generation(self) -> None: ...
    async def init_weight_transfer_engine(self, request: Mapping[str, Any]) -> None: ...
    async def shutdown_weight_transfer_engine(self) -> None: ...
    async def start_weight_update(
        self, *, lora_name: str | None = ..., lora_config: Mapping[str, Any] | None = ...
    ) -> None: ...
    async def update_weights(
        self, request: Mapping[str, Any]
    ) -> TransferStats | Mapping[str, Any]: ...
    @property
    def weight_update(self) -> WeightUpdateStatus | Mapping[str, Any] | None: ...
    async def finish_weight_update(self, weight_version: WeightVersion | None = ...) -> bool: ...
    @property
    def last_adapter_commit(self) -> AdapterCommit | None: ...
    async def abort_weight_update(self) -> bool: ...
    async def update_weight_version(self, new_version: WeightVersion) -> None: ...
    async def reset_weights(self) -> None: ...
    async def sleep(self, level: int = ..., *, mode: PauseMode = ...) -> None: ...
    async def wake_up(self, tags: list[str] | None = ...) -> None: ...
    async def reset_prefix_cache(self) -> bool: ...
    async def load_lora_adapter(
        self, lora_name: str, lora_path: str, *, load_inplace: bool = ...
    ) -> LoRAAdapter | None: ...
    async def unload_lora_adapter(self, lora_name: str) -> None: ...


class StopAnsweredRoute(APIRoute):
    """A control route that answers 503 at once when the server starts stopping.

    A control call may wait long on a trainer (an init waiting for its group, an update mid
    broadcast, a front's call to its replicas) and nothing can interrupt torch's wait. At a
    shutdown (the app's `state.stopping` set) the client gets its answer now, a 503 that says
    the server stops; the call's work is cancelled and keeps the engine's locks until it ends,
    if ever: the process exits without it. An answer begun before stays as it is.
    """

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handle = super().get_route_handler()

        async def answer(request: Request) -> Response:
            stopping: asyncio.Event = request.app.state.stopping
            work = asyncio.ensure_future(handle(request))
            stop = asyncio.ensure_future(stopping.wait())
            try:
                await asyncio.wait({work, stop}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                stop.cancel()
            if work.done():
                return work.result()
            work.cancel()  # not awaited: it may wait for torch until its timeout_s
            message = (f"{request.url.path} did not complete: the server is shutting down "
                       "(SIGINT or SIGTERM); start it again, then repeat the call")  # fmt: skip
            return JSONResponse(error_body(503, "EngineStateError", message), status_code=503)

        return answer


router = APIRouter(
    tags=["rl"], dependencies=[Depends(require_admin_key)], route_class=StopAnsweredRoute
)
"""The RL routes; each needs the admin key when the server has one."""

_PAUSE_MODES = ("abort", "wait", "keep")
# vLLM keys a checksum by its worker's place before the name: `dp0:pp0:pcp0:tp0:`.
_VLLM_KEY = re.compile(r"^dp\d+:pp\d+:pcp\d+:tp\d+:")
# A label travels with every generated token: bounded, so one call cannot bloat every stream
# (the engine checks the same bound; this puts it in the schema).
_Version = (
    Annotated[StrictStr, Field(max_length=256)]
    | Annotated[StrictInt, Field(ge=-(2**63) + 1, le=2**63 - 1)]
)


_Body = RequestBody  # unknown fields: see `_fields`


class AbortRequestsRequest(_Body):
    """`/abort_requests`: the completion ids to abort; empty or absent aborts every one.

    The body itself is required (`{}` at least), as vLLM's.
    """

    request_ids: list[str] | None = None


class InitWeightTransferRequest(_Body):
    """`/init_weight_transfer_engine`: the init info the trainer's `trainer_init` made."""

    init_info: dict[str, Any]


_LoRAName = Annotated[StrictStr, Field(min_length=1, max_length=MAX_LORA_NAME_LENGTH)]
"""An adapter's name, as the engine's adapters take it."""


class StartWeightUpdateRequest(_Body):
    """`/start_weight_update`: an optional body (older vLLM sent `is_checkpoint_format`).

    `lora_name` (a weightsync extension) addresses the update to a LoRA adapter: only its
    tensors travel, under PEFT's names, and nothing pauses. `lora_config` (PEFT's
    `adapter_config.json` fields: `r`, `lora_alpha`, `target_modules`, `use_rslora`) creates
    an adapter not loaded yet; without it the loaded adapter's shapes are the contract.
    """

    is_checkpoint_format: bool = True
    lora_name: _LoRAName | None = None
    lora_config: dict[str, Any] | None = None


class UpdateWeightsRequest(_Body):
    """`/update_weights`: one update message (names, dtype names, shapes; IPC handle records).

    A list is vLLM's data-parallel form, one update info per worker rank: each engine takes
    its own entry. Instead of `update_info`, prime-rl's `weight_dir` names a checkpoint
    directory to load as a whole update (null: nothing to load, nothing changes).
    """

    update_info: dict[str, Any] | list[dict[str, Any]] | None = None
    weight_dir: str | None = None


class FinishWeightUpdateRequest(_Body):
    """`/finish_weight_update`: the version the weights take (None counts updates)."""

    weight_version: _Version | None = None


class UpdateWeightVersionRequest(_Body):
    """`/update_weight_version`: relabels the current weights."""

    new_version: _Version


class WeightCheckerRequest(_Body):
    """`/weight_checker`: `checksum`, `compare` against a `baseline` of digests, or `reset`."""

    action: Literal["checksum", "compare", "reset"]
    baseline: dict[str, str] | None = Field(None, description="name -> SHA-256 hex (compare).")


def _engine(request: Request) -> EngineClient:
    engine: EngineClient = request.app.state.engine_client
    return engine


def _view(request: Request) -> ServerView:
    view: ServerView = request.app.state.serve
    return view


def _pause_mode(mode: str) -> PauseMode:
    if mode not in _PAUSE_MODES:
        raise RequestRefused(
            400,
            f"query parameter 'mode' must be one of {list(_PAUSE_MODES)}, got {mode!r}",
            param="mode",
        )
    return mode  # type: ignore[return-value]


@router.post("/pause", operation_id="pause")
async def _pause(
    request: Request,
    mode: str = "abort",
    clear_cache: bool = True,
    wait_for_inflight_requests: bool | None = None,
    timeout_s: float | None = None,
) -> Answer:
    """Pauses generation at a step boundary: `abort`, `wait` (drain first) or `keep` (freeze).

    `wait_for_inflight_requests=true` is the deprecated spelling of `mode=wait`; given with any
    other `mode` (`abort` included) it is a 400. A pause armed by `/arm_pause` lands where it was
    armed to, and this call waits for it. `timeout_s` (a weightsync extension) bounds each
    replica's answer on a data-parallel front.
    """
    pause_mode = _pause_mode(mode)
    if wait_for_inflight_requests:
        # `mode` defaults to abort, so only a mode given in the query can conflict.
        if "mode" in request.query_params and pause_mode != "wait":
            raise RequestRefused(
                400,
                f"query parameters 'mode={mode}' and 'wait_for_inflight_requests=true' conflict: "
                "give mode=wait alone (wait_for_inflight_requests is deprecated)",
                param="wait_for_inflight_requests",
            )
        pause_mode = "wait"
    if timeout_s is not None and not 0 < timeout_s < math.inf:  # NaN fails both
        raise RequestRefused(
            400,
            f"query parameter 'timeout_s' must be a number of seconds > 0, got {timeout_s!r}",
            param="timeout_s",
        )
    return await _view(request).pause(pause_mode, clear_cache, timeout_s)


@router.post("/arm_pause", operation_id="arm_pause")
async def _arm_pause(
    request: Request, after_tokens: int, mode: str = "keep", clear_cache: bool = True
) -> Answer:
    """Arms a pause for when every unfinished request has `after_tokens` output tokens.

    A weightsync extension: the pause lands exactly at that step boundary, however late the
    trainer is; `/pause` then waits for it. Queue the requests while paused, arm, then resume.
    """
    pause_mode = _pause_mode(mode)
    if after_tokens < 0:
        raise RequestRefused(
            400, f"after_tokens must be an int >= 0, got {after_tokens}", param="after_tokens"
        )
    await _engine(request).arm_pause(after_tokens, mode=pause_mode, clear_cache=clear_cache)
    return {"status": "armed"}


@router.post("/resume", operation_id="resume")
async def _resume(request: Request) -> Answer:
    """Resumes generation; kept requests continue."""
    await _engine(request).resume_generation()
    return {"status": "resumed"}


@router.get("/is_paused", operation_id="is_paused")
async def _is_paused(request: Request) -> Answer:
    """Whether generation is paused."""
    return await _view(request).is_paused()


@router.post("/abort_requests", operation_id="abort_requests")
async def _abort_requests(
    request: Request, body: Annotated[AbortRequestsRequest | None, Body()] = None
) -> Answer:
    """Aborts running completions by id (every one when `request_ids` is empty or absent).

    A request without a body is a 400, as vLLM's (whose body must be JSON): `{}` aborts every
    completion.
    """
    if body is None:
        raise RequestRefused(
            400,
            'the body is missing: send {"request_ids": [...]} to abort those completions, or '
            "{} to abort every one",
            param="body",
        )
    return await _view(request).abort_requests(body.request_ids)


@router.post("/unfinished_requests", operation_id="unfinished_requests")
async def _unfinished_requests(request: Request, body: AbortRequestsRequest) -> Answer:
    """The given completion ids that are still unfinished in the engine (a weightsync extension).

    A completion that finished may still be on its way to its client; one listed here is
    queued, running or frozen by a pause.
    """
    return await _view(request).unfinished_requests(body.request_ids or [])


@router.post("/init_weight_transfer_engine", operation_id="init_weight_transfer_engine")
async def _init_weight_transfer_engine(request: Request, body: InitWeightTransferRequest) -> Answer:
    """Joins the trainer's transfer; blocks (off the event loop) until it forms or times out."""
    await _engine(request).init_weight_transfer_engine({"init_info": body.init_info})
    return {"message": "Weight transfer initialized"}


@router.post("/start_weight_update", operation_id="start_weight_update")
async def _start_weight_update(
    request: Request, body: Annotated[StartWeightUpdateRequest | None, Body()] = None
) -> Answer:
    """Opens a weight-update transaction; no forward pass runs until it ends."""
    if body is not None and not body.is_checkpoint_format:
        raise RequestRefused(
            400,
            "field 'is_checkpoint_format': only checkpoint-format (Hugging Face) names are "
            "supported; send true or leave it out",
            param="is_checkpoint_format",
        )
    lora_name = body.lora_name if body is not None else None
    lora_config = body.lora_config if body is not None else None
    if lora_name is None and lora_config is not None:
        raise RequestRefused(
            400,
            "field 'lora_config' needs 'lora_name': name the LoRA adapter the config describes",
            param="lora_config",
        )
    if lora_name is None:  # vLLM's call, exactly
        await _engine(request).start_weight_update()
        return {"message": "Weight update started"}
    if lora_name == _view(request).config.model_name:  # as /v1/load_lora_adapter refuses it
        raise RequestRefused(
            400,
            f"field 'lora_name': the lora adapter '{lora_name}' conflicts with a served base "
            "model: name the adapter apart from the model",
            param="lora_name",
        )
    await _engine(request).start_weight_update(lora_name=lora_name, lora_config=lora_config)
    return {"message": "Weight update started", "lora_name": lora_name}


@router.post("/update_weights", operation_id="update_weights")
async def _update_weights(request: Request, body: UpdateWeightsRequest) -> Answer:
    """Receives one update message (off the event loop); may come several times per update.

    The body adds to vLLM's `stats` (what was received and how fast) and `weight_update` (the
    update in progress after this message, or null when none is: a bare update finished).
    `{"weight_dir": DIR}` (prime-rl's form) loads a checkpoint directory whatever the
    server's backend: checked against the model, then loaded; on a data-parallel front, on
    every replica or on none. `{"weight_dir": null}` changes nothing.
    """
    given = body.model_fields_set
    if "weight_dir" in given and body.update_info is not None:
        raise RequestRefused(
            400,
            "give either 'update_info' (vLLM's form) or 'weight_dir' (a checkpoint directory), "
            "not both",
            param="weight_dir",
        )
    if "weight_dir" in given:
        if body.weight_dir is None:  # prime-rl's NCCL mode: its bytes come another way
            return {"message": "weight_dir is null: nothing loaded, the weights are unchanged"}
        return await _update(request, {"weight_dir": body.weight_dir})
    if body.update_info is None:
        raise RequestRefused(
            400, "field 'update_info' is required (or 'weight_dir')", param="update_info"
        )
    return await _update(request, {"update_info": body.update_info})


async def _update(request: Request, message: dict[str, Any]) -> Answer:
    """`/update_weights`' answer: the message's stats, and the update as the call left it."""
    engine = _engine(request)
    stats = await engine.update_weights(message)
    status = engine.weight_update  # read at once: no other call ran since
    if isinstance(stats, TransferStats):
        stats = dataclasses.asdict(dataclasses.replace(stats, loaded_names=None))
    if isinstance(status, WeightUpdateStatus):
        status = dataclasses.asdict(status)
    shown = None if status is None else dict(status)
    return {"message": "Weights updated", "stats": dict(stats), "weight_update": shown}


@router.post("/finish_weight_update", operation_id="finish_weight_update")
async def _finish_weight_update(
    request: Request, body: Annotated[FinishWeightUpdateRequest | None, Body()] = None
) -> Answer:
    """Ends the transaction: the version moves if every announced weight landed.

    `applied` (added to vLLM's body) is false when an `/update_weights` of the update was
    refused and not sent again: the update then ends unapplied, as `/abort_weight_update` ends
    it, with the previous weights and version; so vLLM's calls alone get a server back to
    serving after a refusal.

    A LoRA adapter's update adds `lora_name`, the adapter's new `weight_version` and
    `dropped_versions`: the older versions of the adapter that requests still used and that
    the server let go to keep `--max-lora-versions` (their requests ended as an abort ends
    them), oldest first.
    """
    engine = _engine(request)
    before = engine.last_adapter_commit
    applied = await engine.finish_weight_update(body.weight_version if body else None)
    answer: Answer = {"message": "Weight update finished", "applied": applied}
    commit = engine.last_adapter_commit
    if applied and commit is not None and commit is not before:
        answer |= dataclasses.asdict(commit)
    return answer


@router.post("/abort_weight_update", operation_id="abort_weight_update")
async def _abort_weight_update(request: Request) -> Answer:
    """Ends the transaction on purpose (a weightsync extension); `aborted`: one was open."""
    aborted = await _engine(request).abort_weight_update()
    return {"message": "Weight update aborted", "aborted": aborted}


@router.post("/shutdown_weight_transfer_engine", operation_id="shutdown_weight_transfer_engine")
async def _shutdown_weight_transfer_engine(request: Request) -> Answer:
    """Leaves the trainer's transfer and frees what it held (vLLM's client calls it on close)."""
    await _engine(request).shutdown_weight_transfer_engine()
    return {"message": "Weight transfer shut down"}


@router.post("/update_weight_version", operation_id="update_weight_version")
async def _update_weight_version(request: Request, body: UpdateWeightVersionRequest) -> Answer:
    """Relabels the current weights; no byte changes."""
    await _engine(request).update_weight_version(body.new_version)
    return {"success": True, "new_version": body.new_version}


@router.get("/weight_info", operation_id="weight_info")
async def _weight_info(request: Request) -> Answer:
    """The current weight version."""
    return await _view(request).weight_info()


@router.post("/weight_checker", operation_id="weight_checker")
async def _weight_checker(request: Request, body: WeightCheckerRequest) -> Answer:
    """SHA-256 of every weight (`checksum`), a comparison with a `baseline` of them, or `reset`.

    `reset`, as vLLM's, writes zeros over every weight (while paused or idle): a later
    `compare` against the trainer's digests then shows every weight an update missed; the
    engine generates from zeros until an update lands. Baseline keys in vLLM's form
    (`dp0:pp0:pcp0:tp0:` before the name) are compared by name. Refused (409) while a weight
    update is in progress, or weights are torn or asleep: the digests would describe weights
    that are about to change or are half-written. On a data-parallel front,
    `replicas[i].mismatches` lists the names whose digest on replica i differs from the
    `baseline` (compare) or from replica 0's (checksum).
    """
    if body.action == "reset":
        await _engine(request).reset_weights()
        return {"status": "reset"}
    if body.action == "compare" and body.baseline is None:
        raise RequestRefused(
            400, "field 'baseline' is required with action 'compare'", param="baseline"
        )
    sums = await _view(request).weight_checksums()
    baseline = {_VLLM_KEY.sub("", key): digest for key, digest in (body.baseline or {}).items()}
    reference = baseline if body.action == "compare" else sums[0]
    differing = [
        sorted(n for n in s.keys() | reference.keys() if s.get(n) != reference.get(n)) for s in sums
    ]
    per_replica = (
        {"replicas": [{"replica": i, "mismatches": names} for i, names in enumerate(differing)]}
        if len(sums) > 1
        else {}
    )
    if body.action == "checksum":
        return {"checksums": sums[0], **per_replica}
    mismatches = sorted({name for names in differing for name in names})
    return {"match": not mismatches, "mismatches": mismatches, **per_replica}


@router.get("/engine_stats", operation_id="engine_stats")
async def _engine_stats(request: Request) -> Answer:
    """Counters of the engine (a weightsync extension): forward passes run, requests in flight.

    `last_pause` says where the last `/pause` fell in the engine's steps: `requested_at_step`
    (steps run when the server handled it), `landed_at_step` (steps run once it had landed) and
    its `mode`; null before the first pause. Network transit is not in these counts.
    `is_sleeping` says whether anything sleeps, `weight_update` is the update in progress (as
    `/update_weights` answers it) or null.
    """
    return await _view(request).engine_stats()


@router.get("/get_world_size", operation_id="get_world_size")
async def _get_world_size(request: Request, include_dp: bool = True) -> Answer:
    """Transfer workers behind this server (the trainer not counted): one per replica.

    With `include_dp=false`, the workers of one replica (always 1 here: no tensor or pipeline
    parallelism).
    """
    return {"world_size": _view(request).config.world_size if include_dp else 1}


@router.post("/sleep", operation_id="sleep")
async def _sleep(request: Request, level: int = 1, mode: str = "abort") -> Answer:
    """Pauses (`mode`, as `/pause` takes it) and frees memory, as vLLM's `/sleep`.

    Level 0 stops scheduling; 1 also frees the KV cache and puts the weights to sleep; 2 also
    frees the weights' memory (woken, they are torn until an update covering them lands).
    Asleep, the server refuses completions and weight updates (409) until `/wake_up`.
    """
    if isinstance(level, bool) or level not in (0, 1, 2):
        raise RequestRefused(
            400, f"query parameter 'level' must be 0, 1 or 2, got {level!r}", param="level"
        )
    await _engine(request).sleep(level, mode=_pause_mode(mode))
    return {"status": "sleeping", "level": level}


@router.post("/wake_up", operation_id="wake_up")
async def _wake_up(request: Request, tags: Annotated[list[str] | None, Query()] = None) -> Answer:
    """Wakes `tags` (some of `weights`, `kv_cache`, `scheduling`; all when none is given).

    `status` is `awake` once nothing sleeps, else `sleeping`. Waking `weights` alone lets an
    update land before the KV cache comes back; an unknown tag is a 400 (vLLM wakes everything).
    """
    await _engine(request).wake_up(tags)
    asleep = (await _view(request).is_sleeping())["is_sleeping"]
    return {"status": "sleeping" if asleep else "awake", "tags": tags}


@router.get("/is_sleeping", operation_id="is_sleeping")
async def _is_sleeping(request: Request) -> Answer:
    """Whether any part of the server sleeps."""
    return await _view(request).is_sleeping()


@router.post("/reset_prefix_cache", operation_id="reset_prefix_cache")
async def _reset_prefix_cache(request: Request) -> Answer:
    """Forgets every cached prompt prefix; requests running keep their KV."""
    return {"success": await _engine(request).reset_prefix_cache()}


@router.post("/start_draft_weight_update", operation_id="start_draft_weight_update")
async def _start_draft_weight_update(request: Request) -> Answer:
    """VLLM's update of a speculative decoder's draft model: refused, there is none here."""
    raise RequestRefused(
        400,
        "start_draft_weight_update: this server has no draft model (weightsync serve does no "
        "speculative decoding): update the model's own weights with /start_weight_update",
        error_type="InvalidRequestError",
    )
