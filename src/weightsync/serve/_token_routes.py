"""vLLM's token routes: `/tokenize`, `/detokenize`, and tokens in, tokens out `/inference/v1/generate`.

Request and answer shapes are vLLM's, so SkyRL's generation path and prime-rl's prefill scoring
run unchanged. `/inference/v1/generate` takes token ids and vLLM's `sampling_params` object and
answers token ids (logprob tokens named `token_id:<id>`, as vLLM names them there), with no text.
It runs as a completion does (`/v1/completions` with a prompt of token ids): the same checks,
the same `n` choices, the same stream; each choice also carries its `weight_versions`. A vLLM
field that would change the answer and that this server cannot honour is refused by name (400),
never ignored.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import Discriminator, Field, StrictInt, StrictStr, Tag, ValidationError

from weightsync import CompletionOutput, InvalidRequestError, RequestOutput
from weightsync.serve._auth import require_api_key
from weightsync.serve._errors import RequestRefused
from weightsync.serve._http import unless_disconnected
from weightsync.serve._logprobs import written_logprob
from weightsync.serve._openai_routes import _Run, _stream, check_model
from weightsync.serve._protocol import ChatMessage, CompletionRequest, StreamOptions, _Body
from weightsync.serve._sse import ChunkFrame, EventStream
from weightsync.serve._view import EngineView

__all__ = ["router"]

router = APIRouter(tags=["tokens"], dependencies=[Depends(require_api_key)])
"""The token routes; each needs the API key when the server has one, as the `/v1` routes."""


class TokenizeCompletionRequest(_Body):
    """`/tokenize` of a text."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = Field(True, description="Add the tokenizer's BOS token.")
    return_token_strs: bool | None = Field(False, description="Also each token's text.")


class TokenizeChatRequest(_Body):
    """`/tokenize` of a conversation, through the model's chat template."""

    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = Field(
        False, description="The prompt ends inside the last message."
    )
    add_special_tokens: bool = Field(False, description="Add BOS on top of the template's.")
    return_token_strs: bool | None = False
    chat_template: str | None = Field(None, description="Refused when set (not supported).")
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description="More variables for the chat template."
    )
    tools: list[dict[str, Any]] | None = Field(None, description="Passed to the chat template.")


def _tokenize_kind(body: Any) -> str:
    return "chat" if isinstance(body, dict) and "messages" in body else "text"


TokenizeRequest = Annotated[
    Annotated[TokenizeCompletionRequest, Tag("text")] | Annotated[TokenizeChatRequest, Tag("chat")],
    Discriminator(_tokenize_kind),
]


class DetokenizeRequest(_Body):
    """`/detokenize`: token ids to text."""

    model: str | None = None
    tokens: list[Annotated[StrictInt, Field(ge=0)]]


class GenerateSamplingParams(_Body):
    """vLLM's `sampling_params` of `/inference/v1/generate` (see `SamplingParams`).

    `max_tokens` left out takes what the model has room for after the prompt, as vLLM's does.
    """

    n: int = Field(1, ge=1, le=64)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: StrictInt = Field(0, ge=-1)
    min_p: float = Field(0.0, ge=0, le=1)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    repetition_penalty: float = Field(1.0, gt=0)
    seed: StrictInt | None = None
    stop: StrictStr | list[StrictStr] | None = None
    stop_token_ids: list[StrictInt] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = Field(None, ge=1)
    min_tokens: int = Field(0, ge=0)
    logprobs: int | None = Field(None, ge=0, le=20)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # Taken, and changing nothing here: the answer has no text to detokenize or space.
    detokenize: bool = True
    spaces_between_special_tokens: bool = True
    # Honoured as on /v1/completions.
    prompt_logprobs: int | None = None
    logit_bias: dict[str, float] | None = None
    truncate_prompt_tokens: int | None = None
    # vLLM's, refused when set: each would change the answer, and this server cannot honour it.
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    structured_outputs: dict[str, Any] | None = None


_NOT_HONOURED = ("allowed_token_ids", "bad_words", "structured_outputs")


class GenerateRequest(_Body):
    """The body of `/inference/v1/generate`: token ids in, token ids out."""

    request_id: str | None = Field(
        None, min_length=1, description="The id `/abort_requests` takes (random by default)."
    )
    token_ids: list[StrictInt] = Field(min_length=1)
    sampling_params: GenerateSamplingParams
    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    cache_salt: str | None = Field(
        None, description="The prefix cache is shared only between requests with the same salt."
    )
    priority: int = Field(
        0, description="Only 0, as on `/v1/completions`: the scheduler serves in arrival order."
    )
    kv_transfer_params: dict[str, Any] | None = Field(None, description="Refused when set.")

    def refuse_what_is_not_honoured(self) -> None:
        """Raises `RequestRefused` naming the first set field that would change the answer."""
        fields = [(f"sampling_params.{name}", getattr(self.sampling_params, name))
                  for name in _NOT_HONOURED]  # fmt: skip
        fields.append(("kv_transfer_params", self.kv_transfer_params))
        for name, value in fields:
            if value is not None:
                raise RequestRefused(
                    400,
                    f"field {name!r} is not supported by this server; leave it out (it would "
                    "change the answer, so it is refused rather than ignored)",
                    param=name,
                )

    def as_completion(self, max_model_len: int) -> CompletionRequest:
        """The same request as a `/v1/completions` body with a prompt of token ids."""
        sampling = self.sampling_params
        max_tokens = sampling.max_tokens or max(1, max_model_len - len(self.token_ids))
        not_passed = {"max_tokens", "logprobs", "detokenize", "spaces_between_special_tokens"}
        fields = sampling.model_dump(exclude=not_passed | set(_NOT_HONOURED))
        try:
            return CompletionRequest(
                prompt=self.token_ids, max_tokens=max_tokens, logprobs=sampling.logprobs,
                model=self.model, request_id=self.request_id, stream=self.stream,
                stream_options=self.stream_options, cache_salt=self.cache_salt,
                priority=self.priority, **fields,
            )  # fmt: skip
        except ValidationError as exc:
            # The completion's bounds are the one rule; a 400 names the field in this body.
            raise RequestValidationError(
                [{**error, "loc": ("body", *self._where(error["loc"]))} for error in exc.errors()]
            ) from None

    @staticmethod
    def _where(location: tuple[Any, ...]) -> tuple[Any, ...]:
        """A `CompletionRequest` field's location as this body holds it."""
        if not location:
            return location
        if location[0] == "prompt":
            return ("token_ids", *location[1:])
        if location[0] in GenerateSamplingParams.model_fields:
            return ("sampling_params", *location)
        return location


def _refuse_chat_fields(body: TokenizeChatRequest) -> None:
    if body.chat_template is not None:
        raise RequestRefused(
            400,
            "field 'chat_template' is not supported by /tokenize here; leave it out (the model's "
            "own chat template renders the messages)",
            param="chat_template",
        )


@router.post("/tokenize", operation_id="tokenize")
async def _tokenize(body: TokenizeRequest, request: Request) -> dict[str, Any]:
    """A text's (or a conversation's) token ids, as vLLM's: `count`, `max_model_len`, `tokens`.

    `return_token_strs` adds each token's text, as the tokenizer decodes it alone.
    """
    state: EngineView = request.app.state.serve
    check_model(state, body.model)  # an adapter's name is fine: it shares the tokenizer
    llm = state.engine.engine
    tokenizer = llm.tokenizer
    try:
        if isinstance(body, TokenizeChatRequest):
            _refuse_chat_fields(body)
            messages = [m.template_fields() for m in body.messages]
            # Off the event loop and bounded, as on the chat route: a template is the publisher's code.
            tokens = await state.engine.apply_chat_template(
                messages,
                add_generation_prompt=body.add_generation_prompt,
                continue_final_message=body.continue_final_message,
                tools=body.tools,
                template_kwargs=body.chat_template_kwargs,
            )
            bos = tokenizer.bos_token_id
            if body.add_special_tokens and bos is not None:
                tokens = [bos, *tokens]
        else:
            tokens = tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
    except InvalidRequestError as exc:
        raise RequestRefused(400, str(exc), param="messages") from None
    except UnicodeEncodeError as exc:  # a lone surrogate ("\ud800" in JSON)
        raise RequestRefused(
            400, f"prompt is not valid Unicode text: {exc.reason}; send UTF-8 text", param="prompt"
        ) from None
    strs = (
        [tokenizer.decode([t], skip_special_tokens=False) for t in tokens]
        if body.return_token_strs
        else None
    )
    return {"count": len(tokens), "max_model_len": llm.max_model_len, "tokens": tokens,
            "token_strs": strs}  # fmt: skip


@router.post("/detokenize", operation_id="detokenize")
async def _detokenize(body: DetokenizeRequest, request: Request) -> dict[str, Any]:
    """The text of token ids (`{"prompt": ...}`), special tokens written out, as vLLM's."""
    state: EngineView = request.app.state.serve
    check_model(state, body.model)
    tokenizer = state.engine.engine.tokenizer
    vocab_size = tokenizer.vocab_size
    for position, token in enumerate(body.tokens):
        if token >= vocab_size:
            raise RequestRefused(
                400,
                f"tokens[{position}] is {token}, not a token id of this model (0 to "
                f"{vocab_size - 1})",
                param=f"tokens[{position}]",
            )
    return {"prompt": tokenizer.decode(body.tokens, skip_special_tokens=False)}


def _token_logprobs(out: CompletionOutput, start: int, asked: int) -> dict[str, Any] | None:
    """The logprobs of output tokens `start..` in vLLM's shape: tokens named `token_id:<id>`.

    Each position lists the sampled token first, then the most likely others, `max(asked, 1)`
    in all, as vLLM's.
    """
    if out.logprobs is None:
        return None
    tops = out.top_logprobs or [{} for _ in out.logprobs]
    content = []
    for token_id, logprob, top in zip(
        out.token_ids[start:], out.logprobs[start:], tops[start:], strict=True
    ):
        ranked = [(token_id, logprob)] + [(t, lp) for t, lp in top.items() if t != token_id]
        content.append({
            "token": f"token_id:{token_id}", "logprob": written_logprob(logprob), "bytes": None,
            "top_logprobs": [{"token": f"token_id:{t}", "logprob": written_logprob(lp),
                              "bytes": None} for t, lp in ranked[: max(asked, 1)]],
        })  # fmt: skip
    return {"content": content}


@router.post("/inference/v1/generate", response_model=None, operation_id="generate_tokens")
async def _generate(body: GenerateRequest, request: Request) -> Response | EventStream:
    """Token ids in, token ids out: vLLM's `GenerateResponse` (server-sent events with `stream`).

    A choice has `index`, `token_ids`, `finish_reason`, `logprobs` (with
    `sampling_params.logprobs`) and weightsync's `weight_versions`; the answer has `request_id`
    (the id `/abort_requests` takes), `usage`, and vLLM's `prompt_logprobs` (with
    `sampling_params.prompt_logprobs`, else null).
    """
    state: EngineView = request.app.state.serve
    body.refuse_what_is_not_honoured()
    completion = body.as_completion(state.engine.max_model_len)
    run = _Run(state, completion, completion.prompts(), completion.max_tokens,
               completion.logprobs, "generate-tokens")  # fmt: skip
    asked = completion.logprobs

    def choice(index: int, output: RequestOutput, start: int, chars: int) -> dict[str, Any]:
        del chars  # no text here
        out = output.outputs[0]
        return {
            "index": index,
            "logprobs": _token_logprobs(out, start, asked) if asked is not None else None,
            "finish_reason": out.finish_reason,
            "token_ids": out.token_ids[start:],
            "routed_experts": None,
            "weight_versions": out.weight_versions[start:],
        }

    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return await _stream(run, ChunkFrame({"request_id": run.id}), choice, include_usage)
    finals = await unless_disconnected(request, run.finals())
    if finals is None:
        return Response(status_code=499)  # nobody reads it: the client left
    outs = [f.outputs[0] for f in finals]
    return JSONResponse({
        "request_id": run.id, "model": run.model_name, "created": run.created,
        "choices": [{**choice(i, final, 0, 0), "finish_reason": out.finish_reason or "stop"}
                    for i, (final, out) in enumerate(zip(finals, outs, strict=True))],
        "usage": run.usage(sum(len(o.token_ids) for o in outs)),
        "prompt_logprobs": run.logprobs_format.prompt(finals[0].prompt_logprobs),
        "kv_transfer_params": None,
    })  # fmt: skip
