"""The OpenAI request bodies the server accepts.

Unknown fields are refused (400 naming the field) rather than silently ignored, so a misspelt
`max_token` is caught. Beyond OpenAI's fields, the sampling fields of vLLM's requests are taken
with vLLM's meaning (`top_k`, `min_p`, `repetition_penalty`, `min_tokens`, `ignore_eos`,
`stop_token_ids`, `skip_special_tokens`, `include_stop_str_in_output`, `return_token_ids`; see
`SamplingParams`), and `request_id` is weightsync's own. Responses always carry `token_ids`,
`weight_versions` and `prompt_token_ids`, which OpenAI clients ignore: `return_token_ids` is taken
and changes nothing.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr

from weightsync import SamplingParams
from weightsync.errors import InvalidRequestError

__all__ = [
    "ChatCompletionRequest",
    "ChatMessage",
    "CompletionRequest",
    "StreamOptions",
    "TextPart",
]

_Prompt = StrictStr | list[StrictInt]


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


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
    n: int = Field(1, ge=1, le=64, description="Choices per prompt.")
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    request_id: str | None = Field(
        None,
        min_length=1,
        description="weightsync extension: the id `/abort_requests` takes (random by default).",
    )

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
        )


class CompletionRequest(_SamplingFields):
    """The body of `POST /v1/completions`.

    `prompt` is a text, a list of token ids, or a list of either (one completion each).
    `logprobs` asks for the sampled tokens' log-probabilities and that many alternatives.
    """

    prompt: _Prompt | list[_Prompt]
    max_tokens: int = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=20)

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
    """One chat message."""

    role: Literal["system", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    def text(self) -> str:
        """The content as one text."""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)

    def template_fields(self) -> dict[str, str]:
        """The message as a chat template reads it: role, content as one text, name if given."""
        fields = {"role": self.role, "content": self.text()}
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

    def max_output_tokens(self) -> int:
        """`max_completion_tokens`, else `max_tokens`, else 16."""
        return self.max_completion_tokens or self.max_tokens or 16

    def num_logprobs(self) -> int | None:
        """The engine's `logprobs` for this request."""
        return (self.top_logprobs or 0) if self.logprobs or self.top_logprobs else None
