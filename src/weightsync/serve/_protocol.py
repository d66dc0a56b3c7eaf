"""The OpenAI request bodies the server accepts, with vLLM's extensions.

Fields the server does not know are ignored and reported as vLLM ignores them, or refused by a
strict server (see `_fields`). Beyond OpenAI's fields, vLLM's are taken with vLLM's meaning:
the sampling fields (`top_k`, `min_p`, `repetition_penalty`, `min_tokens`, `ignore_eos`,
`stop_token_ids`, `skip_special_tokens`, `include_stop_str_in_output`, `logit_bias`,
`prompt_logprobs`, `truncate_prompt_tokens`; see `SamplingParams`), `cache_salt`,
`return_tokens_as_token_ids`, and the chat template's fields. A vLLM field that would change the
answer and that this server cannot honour is declared too, and refused by name unless it asks
for nothing (`unsupported_field`). `request_id` is vLLM's and weightsync's. Responses always
carry `token_ids`, `weight_versions` and `prompt_token_ids`, which OpenAI clients ignore:
`return_token_ids` is taken and changes nothing.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field, StrictBool, StrictInt, StrictStr

from weightsync import SamplingParams
from weightsync.errors import InvalidRequestError
from weightsync.serve._fields import RequestBody

__all__ = [
    "ChatCompletionRequest",
    "ChatMessage",
    "CompletionRequest",
    "StreamOptions",
    "TextPart",
]

_Prompt = StrictStr | list[StrictInt]


_Body = RequestBody

_NOT_SUPPORTED = "is not supported by this server"


def _asks_for_something(value: Any, default: Any) -> bool:
    """Whether a field's value asks for more than its default (null and empty ask for nothing)."""
    return value is not None and value != default and value not in ([], {})


class StreamOptions(_Body):
    """`stream_options`: `include_usage` adds a last chunk carrying the usage counts."""

    include_usage: bool = False


class _SamplingFields(_Body):
    model: str | None = Field(None, description="Ignored beyond a check: the server has one model.")
    temperature: float = Field(1.0, ge=0, description="0 is greedy.")
    top_p: float = Field(1.0, gt=0, le=1)
    presence_penalty: float | None = Field(0.0, ge=-2, le=2)
    frequency_penalty: float | None = Field(0.0, ge=-2, le=2)
    seed: StrictInt | None = Field(None, description="Seeds each choice (choice i uses seed + i).")
    stop: StrictStr | list[StrictStr] | None = None
    # vLLM's extensions, with vLLM's meaning (see `SamplingParams`); null means the default.
    top_k: StrictInt | None = Field(None, ge=-1, description="vLLM: 0 or -1 keeps every token.")
    min_p: float | None = Field(None, ge=0, le=1, description="vLLM.")
    repetition_penalty: float | None = Field(None, gt=0, description="vLLM: 1 is none.")
    min_tokens: StrictInt = Field(0, ge=0, description="vLLM: at most the output's max tokens.")
    stop_token_ids: list[StrictInt] | None = Field(None, description="vLLM.")
    ignore_eos: bool = Field(False, description="vLLM.")
    skip_special_tokens: bool = Field(True, description="vLLM.")
    include_stop_str_in_output: bool = Field(False, description="vLLM.")
    return_token_ids: bool | None = Field(
        None, description="vLLM; token ids are always returned here."
    )
    logit_bias: dict[str, float] | None = Field(
        None, description="Token id (as a string) to a bias in [-100, 100] added to its logit."
    )
    prompt_logprobs: StrictInt | None = Field(
        None,
        ge=0,
        le=20,
        description="vLLM: per prompt position, its token's log-probability "
        "and this many alternatives (`None` first). Not with `stream`.",
    )
    truncate_prompt_tokens: StrictInt | None = Field(
        None, ge=-1, description="vLLM: keep the prompt's last N tokens (-1: as many as fit)."
    )
    truncation_side: Literal["left", "right"] | None = Field(
        None, description="vLLM: only `left` (the default) is taken."
    )
    cache_salt: str | None = Field(
        None, min_length=1, max_length=1024,
        description="vLLM: cached prefixes are shared only between requests of the same salt.",
    )  # fmt: skip
    return_tokens_as_token_ids: bool | None = Field(
        None, description="vLLM: logprob tokens are written `token_id:<id>`."
    )
    priority: StrictInt = Field(
        0, description="vLLM: only 0 is taken (the scheduler serves first come, first served)."
    )
    # vLLM's fields this server cannot honour: taken when they ask for nothing, else refused.
    structured_outputs: dict[str, Any] | None = Field(None, description="vLLM: not supported.")
    response_format: dict[str, Any] | None = Field(
        None, description='Only `{"type": "text"}`: JSON modes are not supported.'
    )
    use_beam_search: bool = Field(False, description="vLLM: not supported.")
    length_penalty: float = Field(1.0, description="vLLM: beam search only; no effect.")
    allowed_token_ids: list[StrictInt] | None = Field(None, description="vLLM: not supported.")
    bad_words: list[str] | None = Field(None, description="vLLM: not supported.")
    logprob_token_ids: list[StrictInt] | None = Field(None, description="vLLM: not supported.")
    spaces_between_special_tokens: bool = Field(True, description="vLLM: only true is taken.")
    watermarking: bool | None = Field(None, description="vLLM: not supported.")
    repetition_detection: dict[str, Any] | None = Field(None, description="vLLM: not supported.")
    thinking_token_budget: StrictInt | None = Field(None, description="vLLM: not supported.")
    best_of: StrictInt | None = Field(None, description="OpenAI: at most `n` (no reranking).")
    n: int = Field(1, ge=1, le=64, description="Choices per prompt.")
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    request_id: str | None = Field(
        None,
        min_length=1,
        description="weightsync extension: the id `/abort_requests` takes (random by default).",
    )

    # Declared fields refused unless they ask for nothing: name -> the value that asks nothing.
    refused_unless_default: ClassVar[dict[str, Any]] = {
        "structured_outputs": None, "use_beam_search": False, "allowed_token_ids": None,
        "bad_words": None, "logprob_token_ids": None, "spaces_between_special_tokens": True,
        "watermarking": False, "repetition_detection": None, "thinking_token_budget": -1,
        "priority": 0,
    }  # fmt: skip

    def unsupported_field(self) -> tuple[str, str] | None:
        """The first field that asks for what this server cannot do: `(name, why)`, or None."""
        for name, nothing in self.refused_unless_default.items():
            if _asks_for_something(getattr(self, name), nothing):
                return name, f"{name}={getattr(self, name)!r} {_NOT_SUPPORTED}"
        if self.response_format is not None and self.response_format.get("type") != "text":
            kind = self.response_format.get("type")
            return "response_format", (
                f"response_format of type {kind!r} {_NOT_SUPPORTED}: structured outputs (JSON "
                "schema, JSON object, grammar) are not implemented; only 'text' is taken"
            )
        if self.truncation_side == "right":
            return "truncation_side", f"truncation_side='right' {_NOT_SUPPORTED}; 'left' is"
        if self.best_of is not None and self.best_of > self.n:
            return "best_of", (
                f"best_of={self.best_of} above n={self.n} {_NOT_SUPPORTED}: it ranks no "
                "candidates; ask for n choices instead"
            )
        if self.stream and self.prompt_logprobs is not None:
            return "prompt_logprobs", (
                "prompt_logprobs are not available with stream=true, as in vLLM: ask without stream"
            )
        return None

    def engine_prompt_logprobs(self, logprobs: int | None) -> int | None:
        """The engine's `prompt_logprobs`: the request's."""
        return self.prompt_logprobs

    def token_bias(self) -> dict[int, float] | None:
        """`logit_bias` keyed by token id.

        Raises:
            InvalidRequestError: A key is not a token id (`param` names `logit_bias`).
        """
        if self.logit_bias is None:
            return None
        try:
            return {int(token): bias for token, bias in self.logit_bias.items()}
        except ValueError:
            error = InvalidRequestError(
                f'logit_bias keys must be token ids written as strings ("42"), got '
                f"{sorted(self.logit_bias)!r}"
            )
            error.param = "logit_bias"
            raise error from None

    def sampling_params(self, max_tokens: int, logprobs: int | None, choice: int) -> SamplingParams:
        """The engine's sampling parameters of choice number `choice` of a prompt.

        Raises:
            InvalidRequestError: A field is out of range (`param` names it); a `seed` whose
                last choice's seed (`seed + n - 1`) is past 2**64 names `seed` and `n`.
        """
        if self.seed is not None and self.seed < 2**64 <= self.seed + self.n - 1:
            error = InvalidRequestError(
                f"seed {self.seed} with n={self.n}: choice i samples with seed + i, so seed must "
                f"be below 2**64 - {self.n - 1}"
            )
            error.param = "seed"
            raise error
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=0 if self.top_k is None else self.top_k,
            min_p=self.min_p or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            seed=None if self.seed is None else self.seed + choice,
            stop=self.stop,
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            logprobs=logprobs,
            prompt_logprobs=self.engine_prompt_logprobs(logprobs),
            logit_bias=self.token_bias(),
            truncate_prompt_tokens=self.truncate_prompt_tokens,
        )


class CompletionRequest(_SamplingFields):
    """The body of `POST /v1/completions`.

    `prompt` is a text, a list of token ids, or a list of either (one completion each).
    `logprobs` asks for the sampled tokens' log-probabilities and that many alternatives.
    """

    prompt: _Prompt | list[_Prompt]
    max_tokens: int = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = Field(
        False, description="The prompt leads the text (and, with logprobs, the logprobs)."
    )
    suffix: str | None = Field(None, description="Not supported.")
    prompt_embeds: Any = Field(None, description="vLLM: not supported.")
    add_special_tokens: bool = Field(True, description="vLLM: only true is taken.")

    refused_unless_default: ClassVar[dict[str, Any]] = {
        **_SamplingFields.refused_unless_default,
        "suffix": None, "prompt_embeds": None, "add_special_tokens": True,
    }  # fmt: skip

    def engine_prompt_logprobs(self, logprobs: int | None) -> int | None:
        """The request's `prompt_logprobs`, else with `echo` its `logprobs` (vLLM's rule)."""
        if self.prompt_logprobs is None and self.echo:
            return logprobs
        return self.prompt_logprobs

    def prompts(self) -> list[str | list[int]]:
        """The prompts, one per completion."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if all(isinstance(p, int) for p in prompt):  # one prompt of token ids (maybe empty)
            return [[p for p in prompt if isinstance(p, int)]]
        return [p if isinstance(p, str) else list(p) for p in prompt if not isinstance(p, int)]


class TextPart(_Body):
    """One text part of a message's content."""

    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    """One chat message; fields beyond these (`tool_calls`, say) go to the chat template."""

    passes_unknown_fields: ClassVar[bool] = True

    # `tool` and `developer` too: a conversation with tools answers the calls in `tool` turns.
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = Field(
        description="None only where OpenAI allows it: an assistant turn of tool calls."
    )
    name: str | None = None

    def text(self) -> str:
        """The content as one text (empty for none)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)

    def template_fields(self) -> dict[str, Any]:
        """The message as a chat template reads it: its fields, content as one text."""
        fields: dict[str, Any] = {**(self.model_extra or {}), "role": self.role,
                                  "content": self.text()}  # fmt: skip
        if self.name is not None:
            fields["name"] = self.name
        return fields


class ChatCompletionRequest(_SamplingFields):
    """The body of `POST /v1/chat/completions`.

    `messages` are rendered by the model's chat template (`LLMEngine.apply_chat_template`).
    `logprobs=true` asks for the sampled tokens' log-probabilities, `top_logprobs` for that many
    alternatives.
    """

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = Field(
        None, description="Tool definitions, passed to the chat template (no tool-call parsing)."
    )
    tool_choice: Literal["none", "auto"] | dict[str, Any] | str | None = Field(
        None, description="`none` or `auto`: a choice that demands a call is not supported."
    )
    parallel_tool_calls: bool | None = Field(None, description="No tool-call parsing: no effect.")
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description="vLLM: more variables for the chat template."
    )
    add_generation_prompt: StrictBool = Field(
        True, description="vLLM: end the prompt where the assistant's reply begins."
    )
    continue_final_message: StrictBool = Field(
        False, description="vLLM: the model continues the last message (needs "
        "add_generation_prompt false).",
    )  # fmt: skip
    documents: list[dict[str, Any]] | None = Field(
        None, description="vLLM: documents for the chat template."
    )
    reasoning_effort: str | None = Field(
        None, description="Passed to the chat template as `reasoning_effort`."
    )
    include_reasoning: bool = Field(True, description="No reasoning parser: no effect.")
    echo: bool = Field(False, description="vLLM: only false is taken.")
    add_special_tokens: bool = Field(False, description="vLLM: only false is taken.")
    chat_template: str | None = Field(None, description="vLLM: not supported (the model's own).")

    refused_unless_default: ClassVar[dict[str, Any]] = {
        **_SamplingFields.refused_unless_default,
        "echo": False, "add_special_tokens": False, "chat_template": None,
    }  # fmt: skip

    def unsupported_field(self) -> tuple[str, str] | None:
        """As for every body, and a `tool_choice` that demands a call."""
        if self.tool_choice not in (None, "none", "auto"):
            return "tool_choice", (
                f"tool_choice={self.tool_choice!r} {_NOT_SUPPORTED}: it demands a tool call, "
                "and this server parses none; send 'none' or 'auto'"
            )
        return super().unsupported_field()

    def template_options(self) -> dict[str, Any]:
        """What the chat template is given besides the messages (`apply_chat_template`)."""
        kwargs = dict(self.chat_template_kwargs or {})
        if self.reasoning_effort is not None:
            kwargs.setdefault("reasoning_effort", self.reasoning_effort)
        return {
            "add_generation_prompt": self.add_generation_prompt,
            "continue_final_message": self.continue_final_message,
            "tools": self.tools,
            "documents": self.documents,
            "template_kwargs": kwargs,
        }

    def max_output_tokens(self) -> int:
        """`max_completion_tokens`, else `max_tokens`, else 16."""
        return self.max_completion_tokens or self.max_tokens or 16

    def num_logprobs(self) -> int | None:
        """The engine's `logprobs` for this request."""
        return (self.top_logprobs or 0) if self.logprobs or self.top_logprobs else None
