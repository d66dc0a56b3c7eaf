"""The engine's edges: prompts in (`InputProcessor`), sampled tokens out (`OutputProcessor`)."""

from __future__ import annotations

from collections import abc
from typing import Any

import torch

from weightsync.engine._sampler import TokenLogprobs
from weightsync.engine._scheduler import ScheduledSequence
from weightsync.engine._sequence import Sequence
from weightsync.engine._template_sandbox import CHARS_PER_TOKEN
from weightsync.engine.chat_template import ChatTemplate
from weightsync.engine.lora import LoRAAdapter
from weightsync.engine.outputs import WeightVersion
from weightsync.engine.sampling import SamplingParams
from weightsync.engine.tokenizer import Prompt, Tokenizer
from weightsync.errors import InvalidRequestError
from weightsync.transfer.base import _is_int


class InputProcessor:
    """Turns a prompt and its sampling parameters into a validated `Sequence`.

    Args:
        tokenizer: Tokenizes text prompts; makes each sequence's text decoder.
        vocab_size: The model's vocabulary size (token-id prompts must fit in it).
        max_model_len: Longest sequence in tokens.
        seed: Seeds the sampling of requests that set no seed of their own.
        device: Where sampling runs: each sequence's generator lives there.

    Attributes:
        chat_template: The tokenizer's chat template, else the documented default
            (`ChatTemplate.default()`).
        max_chars: The longest text, in characters, that a prompt or a rendered chat template
            may be: `max_model_len x CHARS_PER_TOKEN`.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        vocab_size: int,
        max_model_len: int,
        seed: int,
        device: torch.device | str = "cpu",
    ) -> None:
        self.tokenizer = tokenizer
        self.chat_template = tokenizer.chat_template or ChatTemplate.default()
        self.device = torch.device(device)
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.max_chars = max_model_len * CHARS_PER_TOKEN
        self.seed = seed
        self._num_requests = 0

    def tokenize(
        self,
        prompt: Prompt,
        *,
        add_special_tokens: bool = True,
        truncate_prompt_tokens: int | None = None,
    ) -> tuple[str | None, list[int]]:
        """Checks a prompt and returns its text (None for token ids) and token ids.

        Has no side effect, so a server can refuse a bad prompt before it answers.
        `add_special_tokens=False` encodes a text without the tokenizer's BOS token (a chat
        template's output carries its own). `truncate_prompt_tokens` keeps the prompt's last
        tokens, as `SamplingParams.truncate_prompt_tokens` says, before the length is checked.

        A text is encoded only if it could be served: one longer than `max_chars` characters is
        refused before the tokenizer sees it.

        Raises:
            InvalidRequestError: An empty prompt, text that is not valid Unicode or longer than
                `max_chars`, unknown token ids, or a prompt that leaves no room for output within
                `max_model_len`.
        """
        if isinstance(prompt, str):
            text: str | None = prompt
            if len(prompt) > self.max_chars:
                raise InvalidRequestError(
                    f"prompt has {len(prompt)} characters, more than the limit of "
                    f"{self.max_chars} (max_model_len {self.max_model_len} x {CHARS_PER_TOKEN}) "
                    "that can be encoded: it could not fit in max_model_len tokens; shorten it"
                )
            try:
                token_ids = self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
            except UnicodeEncodeError as exc:  # a lone surrogate, say ("\ud800" in JSON)
                raise InvalidRequestError(
                    f"prompt is not valid Unicode text: {exc.reason} at character {exc.start} "
                    f"({prompt[exc.start : exc.end]!r}); send text that encodes as UTF-8"
                ) from None
        else:
            if not isinstance(prompt, list | tuple):
                raise InvalidRequestError(
                    f"a prompt is a string or a list of token ids, got {type(prompt).__name__}"
                )
            text, token_ids = None, list(prompt)
            if not all(_is_int(t) and 0 <= t < self.vocab_size for t in token_ids):
                raise InvalidRequestError(
                    f"prompt token ids must be ints in [0, {self.vocab_size}), got {prompt!r}"
                )
        if not token_ids or prompt == "":  # a BOS token alone is not a prompt
            raise InvalidRequestError("prompt is empty: give at least one token")
        if truncate_prompt_tokens is not None:
            keep = (
                self.max_model_len - 1 if truncate_prompt_tokens == -1 else truncate_prompt_tokens
            )
            token_ids = token_ids[-keep:]
        if len(token_ids) >= self.max_model_len:
            raise InvalidRequestError(
                f"prompt has {len(token_ids)} tokens but max_model_len is {self.max_model_len}: "
                "shorten the prompt to leave room for at least one output token"
            )
        return text, token_ids

    def apply_chat_template(
        self,
        messages: abc.Sequence[abc.Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: abc.Sequence[abc.Mapping[str, Any]] | None = None,
        documents: abc.Sequence[abc.Mapping[str, Any]] | None = None,
        template_kwargs: abc.Mapping[str, Any] | None = None,
    ) -> list[int]:
        """The prompt token ids of a conversation, through `chat_template`.

        Renders `messages` (dicts with `role` and `content`) and encodes the text as
        `transformers`' `apply_chat_template` does: a model's own template writes its special
        tokens itself; the default template's text gets the tokenizer's BOS token.
        `continue_final_message` ends the text right after the last message's content (the
        model continues that message, as `transformers` does it: no end-of-turn marker);
        it excludes `add_generation_prompt`. `tools`, `documents` and `template_kwargs` go to
        the template (see `ChatTemplate.render`). The render is
        bounded: `RENDER_TIMEOUT_S` seconds and `max_chars` characters.

        Raises:
            InvalidRequestError: The template refused or failed on the messages or passed a
                bound, or the prompt is empty, not valid Unicode, or leaves no room for output
                within `max_model_len`.

        >>> from weightsync.engine.tokenizer import ByteTokenizer
        >>> processor = InputProcessor(ByteTokenizer(), vocab_size=259, max_model_len=64, seed=0)
        >>> processor.apply_chat_template([{"role": "user", "content": "hi"}])[:4]
        [256, 60, 124, 117]
        """
        if continue_final_message and add_generation_prompt:
            error = InvalidRequestError(
                "continue_final_message and add_generation_prompt exclude each other: set "
                "add_generation_prompt to false to continue the last message"
            )
            error.param = "continue_final_message"
            raise error
        template = self.chat_template
        text = template.render(
            messages,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            documents=documents,
            template_kwargs=template_kwargs,
            max_chars=self.max_chars,
        )
        if continue_final_message:
            text = _cut_after_final_message(text, messages)
        return self.tokenize(text, add_special_tokens=template.add_special_tokens)[1]

    def process(
        self,
        request_id: str,
        prompt: Prompt,
        sampling_params: SamplingParams | None,
        *,
        cache_salt: str | None = None,
        lora: LoRAAdapter | None = None,
    ) -> Sequence:
        """Returns the new request's sequence (running with `lora`, if given).

        Raises:
            InvalidRequestError: An empty prompt, unknown token ids, a prompt that leaves no
                room for output within `max_model_len`, or `logit_bias` ids outside the
                vocabulary.
        """
        params = sampling_params or SamplingParams()
        text, token_ids = self.tokenize(
            prompt, truncate_prompt_tokens=params.truncate_prompt_tokens
        )
        if params.logit_bias and max(params.logit_bias) >= self.vocab_size:
            error = InvalidRequestError(
                f"logit_bias names token {max(params.logit_bias)}, outside the vocabulary "
                f"[0, {self.vocab_size})"
            )
            error.param = "logit_bias"
            raise error
        # Unseeded requests still get a generator of their own, so that a request's draws never
        # depend on which other requests share its batch.
        # A derived seed wraps into [0, 2**64), what torch.Generator takes, whatever the
        # engine's seed.
        seed = (
            params.seed
            if params.seed is not None
            else (self.seed * 1_000_003 + self._num_requests) % 2**64
        )
        self._num_requests += 1
        return Sequence(
            request_id,
            token_ids,
            params,
            generator=torch.Generator(self.device).manual_seed(seed),
            decoder=self.tokenizer.incremental_decoder(
                token_ids, skip_special_tokens=params.skip_special_tokens
            ),
            prompt=text,
            cache_salt=cache_salt,
            lora=lora,
        )

    @staticmethod
    def pair_prompts(
        prompts: Prompt | abc.Sequence[Prompt],
        sampling_params: SamplingParams | abc.Sequence[SamplingParams] | None,
    ) -> tuple[list[Prompt], list[SamplingParams]]:
        """Pairs each prompt with its sampling parameters, as `LLMEngine.generate` takes them.

        One prompt (a string or a list of token ids) or a list of prompts; one `SamplingParams` for
        all of them (None: the defaults) or a list with one per prompt.

        Raises:
            InvalidRequestError: The two lists differ in length.

        >>> batch, params = InputProcessor.pair_prompts("hi", None)
        >>> batch, len(params)
        (['hi'], 1)
        """
        batch: list[Prompt] = (
            [prompts]  # type: ignore[list-item]
            if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int))
            else list(prompts)  # type: ignore[arg-type]
        )
        params = (
            list(sampling_params)
            if isinstance(sampling_params, abc.Sequence)
            else [sampling_params or SamplingParams()] * len(batch)
        )
        if len(params) != len(batch):
            raise InvalidRequestError(f"got {len(batch)} prompts but {len(params)} sampling params")
        return batch, params


class OutputProcessor:
    """Applies a step's sampled tokens to their sequences and ends those that should stop.

    Args:
        tokenizer: Names the end-of-sequence tokens.
        max_model_len: Longest sequence in tokens.
    """

    def __init__(self, tokenizer: Tokenizer, *, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(tokenizer.eos_token_ids)
        self.max_model_len = max_model_len

    def process(
        self,
        batch: list[ScheduledSequence],
        tokens: list[int],
        weight_version: WeightVersion,
        logprobs: list[TokenLogprobs | None] | None = None,
    ) -> list[Sequence]:
        """Appends each sampled token, tagged with its version, and applies stop conditions.

        A token's version is `weight_version`, or for a row of a LoRA adapter the version of
        the adapter it runs with (`LoRAAdapter.weight_version`).

        Args:
            batch: The step's batch.
            tokens: One sampled token per sequence of `batch` that samples, in batch order.
            weight_version: Version of the weights that produced `tokens`.
            logprobs: Log-probabilities of each of `tokens` (None where not asked for).

        Returns:
            The sequences that received a token (some now finished), in batch order. A
            sequence whose token could not be applied ends with `finish_reason="error"`.
        """
        sampled = iter(tokens)
        sampled_logprobs = iter(logprobs if logprobs is not None else [None] * len(tokens))
        changed = []
        for item in batch:
            if not item.samples:
                continue  # a prefill chunk that does not reach the end yet
            token, token_logprobs = next(sampled), next(sampled_logprobs)
            try:
                lora = item.seq.lora
                version = weight_version if lora is None else lora.weight_version
                item.seq.append_token(token, version, token_logprobs)
                self._check_stop(item.seq, token)
            except Exception as exc:  # this request's text or stop check: it alone ends
                item.seq.fail(exc)
            changed.append(item.seq)
        return changed

    def _check_stop(self, seq: Sequence, token: int) -> None:
        # Each check costs this request alone, whatever its lists hold (they are bounded): a
        # set lookup per token, and stop strings searched in the newest text only. The first
        # `min_tokens` tokens end nothing (the sampler kept EOS and the stop tokens out of them).
        params = seq.sampling_params
        may_stop = seq.num_output_tokens > params.min_tokens
        is_eos = token in self.eos_token_ids and not params.ignore_eos
        stop_token = may_stop and (is_eos or token in seq.stop_token_ids)
        reason = None if is_eos else token  # vLLM's stop_reason: the stop token id, not EOS
        if stop_token and not params.include_stop_str_in_output:
            seq.finish("stop", reason)  # the stop token's text stays out
            return
        delta = seq.add_text(token)
        if stop_token:
            seq.finish("stop", reason)
        elif (
            may_stop
            and params.stop
            and delta
            and (found := _find_stop(seq.output_text, delta, params.stop))
        ):
            index, stop = found
            end = index + len(stop) if params.include_stop_str_in_output else index
            seq.output_text = seq.output_text[:end]
            seq.finish("stop", stop, flush_text=False)
        if not seq.is_finished and (
            seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= self.max_model_len
        ):
            seq.finish("length")


def _cut_after_final_message(text: str, messages: abc.Sequence[abc.Mapping[str, Any]]) -> str:
    """`text` up to the end of the last message's content (stripped, as `transformers` finds it).

    Raises:
        InvalidRequestError: The rendered text does not hold the last message's content.
    """
    final = str(messages[-1].get("content", "") if messages else "").strip()
    end = text.rfind(final) if final else -1
    if end < 0:
        error = InvalidRequestError(
            "continue_final_message: the chat template's text does not hold the last message's "
            "content, so there is no place to continue it; give the last message some text"
        )
        error.param = "continue_final_message"
        raise error
    return text[: end + len(final)]


def _find_stop(text: str, delta: str, stops: abc.Sequence[str]) -> tuple[int, str] | None:
    """The earliest stop string that `delta`, the end of `text`, completes: (index, string)."""
    found = []
    for stop in stops:
        # A stop string completed now ends within delta, so it starts at most len(stop) - 1
        # characters before it.
        start = max(0, len(text) - len(delta) - len(stop) + 1)
        if (index := text.find(stop, start)) >= 0:
            found.append((index, stop))
    return min(found) if found else None
