"""OpenAI-compatible routes of one engine: `/v1/completions`, `/v1/chat/completions`.

A request with `n` choices per prompt runs as one engine request per choice. Streams are
server-sent events, one chunk per engine step that changed a choice, then `data: [DONE]`. Each
choice also carries its `token_ids`, the `weight_versions` that generated them (both as deltas in
a stream) and `prompt_token_ids`: what an RL trainer needs and OpenAI's shape lacks. They come
whether or not the request sets vLLM's `return_token_ids`; a chat answer also has vLLM's
top-level `prompt_token_ids`. A request whose `model` names a loaded LoRA adapter runs with it,
and the answer's `model` is the adapter's name, as vLLM's.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any, cast

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from weightsync import (
    CompletionOutput,
    InvalidRequestError,
    RequestOutput,
    SamplingParams,
    WeightSyncError,
)
from weightsync.serve._auth import require_api_key
from weightsync.serve._errors import RequestRefused, error_body, status_of
from weightsync.serve._fields import name_request
from weightsync.serve._http import unless_disconnected
from weightsync.serve._logprobs import LogprobsFormat
from weightsync.serve._protocol import ChatCompletionRequest, CompletionRequest, _SamplingFields
from weightsync.serve._sse import ChunkFrame, EventStream, sse
from weightsync.serve._view import EngineView

__all__ = ["check_model", "router"]

router = APIRouter(prefix="/v1", tags=["openai"], dependencies=[Depends(require_api_key)])
"""The `/v1` routes; each needs the API key when the server has one."""


def check_model(state: EngineView, model: str | None) -> str | None:
    """The LoRA adapter a request's `model` names; None for the served model (or none given).

    Raises:
        RequestRefused: A 404 for a name that is neither the model nor a loaded adapter, as
            vLLM (and OpenAI) answer an unknown model.
    """
    if model is None or model == state.config.model_name:
        return None
    adapters = [adapter.name for adapter in state.engine.list_lora_adapters()]
    if model in adapters:
        return model
    also = f" or one of its LoRA adapters {adapters}" if adapters else ""
    raise RequestRefused(
        404,
        f"model {model!r} is not served here; this server serves "
        f"{state.config.model_name!r}{also} (see GET /v1/models)",
        param="model",
        error_type="NotFound",
    )


class _Run:
    """The engine requests of one completion request: started together, streamed together."""

    def __init__(self, state: EngineView, body: _SamplingFields, prompts: list[str | list[int]],
                 max_tokens: int, logprobs: int | None, kind: str) -> None:  # fmt: skip
        self.lora_name = check_model(state, body.model)
        self.model_name = self.lora_name or state.config.model_name  # what the answer names
        _check_supported(body)
        self.state = state
        self.body = body
        self.id = body.request_id or f"{kind}-{uuid.uuid4().hex}"
        name_request(self.id)
        if self.id in state.live:
            raise RequestRefused(
                400,
                f"request_id {self.id!r} is already running; use a unique id",
                param="request_id",
            )
        self.created = int(time.time())
        self.prompt_ids: list[list[int]] = []
        for prompt in prompts:  # refuse a bad prompt before anything starts
            try:
                self.prompt_ids.append(
                    state.engine.tokenize(
                        prompt, truncate_prompt_tokens=body.truncate_prompt_tokens
                    )
                )
            except InvalidRequestError as exc:
                param = "messages" if kind == "chatcmpl" else "prompt"
                raise RequestRefused(400, str(exc), param=param) from None
        limit = state.engine.max_model_len
        if (longest := max(map(len, self.prompt_ids), default=0)) + max_tokens > limit:
            raise RequestRefused(  # as vLLM refuses it, rather than cutting the output short
                400,
                f"max_tokens {max_tokens} and a prompt of {longest} tokens exceed max_model_len "
                f"{limit}: ask for at most {limit - longest} tokens, or shorten the prompt",
                param="max_tokens",
            )
        if body.min_tokens > max_tokens:
            raise RequestRefused(
                400,
                f"min_tokens {body.min_tokens} exceeds the {max_tokens} tokens asked for: "
                "ask for at most max_tokens",
                param="min_tokens",
            )
        self.logprobs_format = LogprobsFormat(
            state.engine.engine.tokenizer,
            skip_special_tokens=body.skip_special_tokens,
            as_token_ids=bool(body.return_tokens_as_token_ids),
        )
        # Choice i*n + j is prompt i's choice j, as OpenAI numbers them.
        self.choices: list[tuple[str, list[int], SamplingParams]] = [
            (f"{self.id}-{i * body.n + j}", ids, body.sampling_params(max_tokens, logprobs, j))
            for i, ids in enumerate(self.prompt_ids)
            for j in range(body.n)
        ]

    def outputs(
        self, on_accepted: tuple[int, RequestOutput] | None = None
    ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Yields `(choice index, cumulative output)` as the engine produces them.

        `on_accepted`, if given, is yielded first, once every choice is in the engine.
        """
        # One choice is the common case: its stream is the engine's, without a task and a queue
        # per output, and without a generator in between that would only pass items on.
        if len(self.choices) == 1:
            return self._one_output(on_accepted)
        return self._many_outputs(on_accepted)

    async def _many_outputs(
        self, on_accepted: tuple[int, RequestOutput] | None
    ) -> AsyncIterator[tuple[int, RequestOutput]]:
        queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()
        engine = self.state.engine

        async def pump(index: int, request_id: str, ids: list[int], params: SamplingParams) -> None:
            try:
                stream = engine.generate(ids, params, request_id, cache_salt=self.body.cache_salt,
                                         lora_name=self.lora_name)  # fmt: skip
                async for output in stream:
                    queue.put_nowait((index, output))
                queue.put_nowait((index, None))
            except BaseException as exc:
                queue.put_nowait((index, exc))
                raise

        self.state.live[self.id] = [rid for rid, _, _ in self.choices]
        tasks = [asyncio.create_task(pump(i, *c)) for i, c in enumerate(self.choices)]
        try:
            # Tasks run their first steps in creation order when this one yields: each adds its
            # request to the engine before it waits, so the run is in the engine after this.
            await asyncio.sleep(0)
            for task in tasks:
                if task.done():  # refused at once (asleep, say): the run was not accepted
                    await task
            if on_accepted is not None:
                yield on_accepted
            running = len(tasks)
            while running:
                index, item = await queue.get()
                if item is None:
                    running -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield index, item
        finally:
            self.state.live.pop(self.id, None)
            for task in tasks:
                task.cancel()  # a client that left: leaving each stream aborts its request
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _one_output(
        self, on_accepted: tuple[int, RequestOutput] | None
    ) -> AsyncIterator[tuple[int, RequestOutput]]:
        request_id, ids, params = self.choices[0]
        self.state.live[self.id] = [request_id]
        # AsyncEngine.generate is an async generator: closing it aborts an unfinished request.
        stream = cast(
            AsyncGenerator[RequestOutput, None],
            self.state.engine.generate(
                ids, params, request_id, cache_salt=self.body.cache_salt, lora_name=self.lora_name
            ),
        )
        first = asyncio.ensure_future(anext(stream))
        try:
            await asyncio.sleep(0)  # the first step of `first` adds the request to the engine
            if first.done():  # refused at once (asleep, say): the run was not accepted
                await first
            if on_accepted is not None:
                yield on_accepted
            yield 0, await first
            async for output in stream:
                yield 0, output
        finally:
            self.state.live.pop(self.id, None)
            first.cancel()  # a client that left: closing the stream aborts its request
            await asyncio.gather(first, return_exceptions=True)
            await stream.aclose()

    async def finals(self) -> list[RequestOutput]:
        """Runs every choice to its end and returns the final outputs, by choice index."""
        finals: dict[int, RequestOutput] = {}
        async for index, output in self.outputs():
            finals[index] = output
        return [finals[i] for i in range(len(self.choices))]

    def usage(self, completion_tokens: int) -> dict[str, int]:
        """OpenAI's usage counts (each prompt counted once, whatever `n`)."""
        prompt_tokens = sum(len(ids) for ids in self.prompt_ids)
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        }


def _check_supported(body: _SamplingFields) -> None:
    """Refuses a field of vLLM's that asks for what this server cannot do, by name."""
    if (unsupported := body.unsupported_field()) is not None:
        name, why = unsupported
        raise RequestRefused(400, why, param=name)


def _extensions(out: CompletionOutput, start: int, prompt_ids: list[int] | None) -> dict[str, Any]:
    """The weightsync fields of a choice (from output token `start` on, for a stream's delta)."""
    fields: dict[str, Any] = {
        "token_ids": out.token_ids[start:],
        "weight_versions": out.weight_versions[start:],
    }
    if prompt_ids is not None:
        fields["prompt_token_ids"] = prompt_ids
    return fields


async def _stream(run: _Run, frame: ChunkFrame, choice: Any, include_usage: bool) -> EventStream:
    """The run's server-sent events, once every request of it is in the engine."""
    # An engine that refuses the run at once (asleep, shut down) raises here: the refusal is
    # the answer's own status, as for a request that is not streamed.
    outputs = run.outputs(on_accepted=(-1, RequestOutput(run.id, None, [])))
    await anext(outputs)
    return EventStream(_events(run, outputs, frame, choice, include_usage))


async def _events(
    run: _Run,
    outputs: AsyncIterator[tuple[int, RequestOutput]],
    frame: ChunkFrame,
    choice: Any,
    include_usage: bool,
) -> AsyncIterator[bytes]:
    """Server-sent events of a run: `choice(index, output, sent_tokens, sent_chars)` per change.

    The engine's stream of a choice hands over its newest output only: when this loop falls
    behind the engine, the tokens of several steps go out as one chunk, each with its id and
    weight version.
    """
    # A comment event (which SSE clients skip) says that every request of the run is in the
    # engine, so a trainer that queued them while paused knows when it may resume.
    yield b": accepted\n\n"
    sent_tokens = [0] * len(run.choices)
    sent_chars = [0] * len(run.choices)
    completion_tokens = 0
    try:
        async for index, output in outputs:
            out = output.outputs[0]
            if len(out.token_ids) == sent_tokens[index] and out.finish_reason is None:
                continue
            yield frame.event(choice(index, output, sent_tokens[index], sent_chars[index]))
            sent_tokens[index] = len(out.token_ids)
            sent_chars[index] = max(sent_chars[index], len(out.text))
            if out.finish_reason is not None:
                completion_tokens += len(out.token_ids)
    except WeightSyncError as exc:  # the status is sent already: the error travels as an event
        yield sse(error_body(status_of(exc), type(exc).__name__, str(exc)))
    if include_usage:
        yield sse(
            {"id": run.id, "object": "usage", "choices": [], "usage": run.usage(completion_tokens)}
        )
    yield sse("[DONE]")


@router.post("/completions", response_model=None, operation_id="create_completion")
async def _create_completion(body: CompletionRequest, request: Request) -> Response | EventStream:
    """Completes each prompt (`n` choices each); streams server-sent events with `stream`."""
    state: EngineView = request.app.state.serve
    run = _Run(state, body, body.prompts(), body.max_tokens, body.logprobs, "cmpl")
    base = {"id": run.id, "object": "text_completion", "created": run.created,
            "model": run.model_name}  # fmt: skip
    prompt_of = [ids for ids in run.prompt_ids for _ in range(body.n)]
    # vLLM's echo: a text prompt as it was sent, unless truncated; token ids as they decode.
    tokenizer = state.engine.engine.tokenizer
    echo_text = [
        prompt
        if isinstance(prompt, str) and body.truncate_prompt_tokens is None
        else tokenizer.decode(ids, skip_special_tokens=body.skip_special_tokens)
        for prompt, ids in zip(body.prompts(), run.prompt_ids, strict=True)
    ] if body.echo else []  # fmt: skip

    def choice(index: int, output: RequestOutput, start: int, chars: int) -> dict[str, Any]:
        out, prompt_ids = output.outputs[0], prompt_of[index]
        text = out.text[chars:]
        logprobs = (
            run.logprobs_format.completion(out, start, prompt_ids)
            if body.logprobs is not None
            else None
        )
        if body.echo:  # the choice's first chunk (or whole answer) leads with the prompt
            echoed = echo_text[index // body.n]
            text = echoed + text if start == 0 else text
            if logprobs is not None:
                logprobs = run.logprobs_format.echoed(
                    prompt_ids if start == 0 else [], output.prompt_logprobs, echoed, logprobs
                )
        return {
            "index": index,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": out.finish_reason,
            "stop_reason": out.stop_reason,
            **_extensions(out, start, prompt_ids if start == 0 else None),
        }

    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return await _stream(run, ChunkFrame(base), choice, include_usage)
    finals = await unless_disconnected(request, run.finals())
    if finals is None:
        return Response(status_code=499)  # nobody reads it: the client left
    outs = [f.outputs[0] for f in finals]
    choices = [choice(i, final, 0, 0) for i, final in enumerate(finals)]
    if body.prompt_logprobs is not None:  # vLLM puts them on each choice of a completion
        for entry, final in zip(choices, finals, strict=True):
            entry["prompt_logprobs"] = run.logprobs_format.prompt(final.prompt_logprobs)
    return JSONResponse({
        **base,
        "choices": choices,
        "usage": run.usage(sum(len(o.token_ids) for o in outs)),
    })  # fmt: skip


@router.post("/chat/completions", response_model=None, operation_id="create_chat_completion")
async def _create_chat_completion(
    body: ChatCompletionRequest, request: Request
) -> Response | EventStream:
    """Replies to a conversation (`n` choices); streams server-sent events with `stream`."""
    state: EngineView = request.app.state.serve
    _check_supported(body)
    messages = [m.template_fields() for m in body.messages]
    try:  # the model's own template, or the documented default
        prompt = await state.engine.apply_chat_template(messages, **body.template_options())
    except InvalidRequestError as exc:
        raise RequestRefused(400, str(exc), param=exc.param or "messages") from None
    run = _Run(state, body, [prompt], body.max_output_tokens(), body.num_logprobs(), "chatcmpl")
    model = run.model_name
    asked = body.num_logprobs() is not None

    def choice(index: int, output: RequestOutput, start: int, chars: int) -> dict[str, Any]:
        out = output.outputs[0]
        delta: dict[str, Any] = {"content": out.text[chars:]}
        if start == 0:
            delta["role"] = "assistant"
        return {
            "index": index,
            "delta": delta,
            "logprobs": run.logprobs_format.chat(out, start) if asked else None,
            "finish_reason": out.finish_reason,
            **_extensions(out, start, run.prompt_ids[0] if start == 0 else None),
        }

    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        frame = ChunkFrame({"id": run.id, "object": "chat.completion.chunk",
                            "created": run.created, "model": model})  # fmt: skip
        return await _stream(run, frame, choice, include_usage)
    finals = await unless_disconnected(request, run.finals())
    if finals is None:
        return Response(status_code=499)  # nobody reads it: the client left
    outs = [f.outputs[0] for f in finals]
    choices = [
        {
            "index": i,
            "message": {"role": "assistant", "content": out.text},
            "logprobs": run.logprobs_format.chat(out, 0) if asked else None,
            "finish_reason": out.finish_reason,
            **_extensions(out, 0, run.prompt_ids[0]),
        }
        for i, out in enumerate(outs)
    ]
    return JSONResponse({
        "id": run.id, "object": "chat.completion", "created": run.created, "model": model,
        "choices": choices, "usage": run.usage(sum(len(o.token_ids) for o in outs)),
        "prompt_token_ids": run.prompt_ids[0],
        # vLLM's: on the answer, not per choice (every choice has the one prompt)
        "prompt_logprobs": run.logprobs_format.prompt(finals[0].prompt_logprobs),
    })  # fmt: skip
