"""`Sequence`: one request's tokens, KV-cache bookkeeping and per-token weight versions."""

from __future__ import annotations

import enum
import logging

import torch

from weightsync.engine._sampler import TokenLogprobs
from weightsync.engine.lora import LoRAAdapter
from weightsync.engine.outputs import (
    CompletionOutput,
    FinishReason,
    Logprob,
    RequestOutput,
    WeightVersion,
)
from weightsync.engine.sampling import SamplingParams
from weightsync.engine.tokenizer import IncrementalDecoder

logger = logging.getLogger(__name__)

__all__ = ["Sequence", "SequenceStatus"]


class SequenceStatus(enum.Enum):
    """Where a sequence is: queued (or preempted), holding KV blocks, or done."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """A request in flight: prompt + output tokens and what the KV cache holds for them.

    Only the scheduler and the engine mutate a sequence; callers see `RequestOutput`s.

    Args:
        request_id: Unique id of the request.
        prompt_token_ids: The prompt, at least one token.
        sampling_params: How to sample the output.
        generator: This request's random generator (seeded).
        decoder: Turns output token ids into text as they arrive.
        prompt: The prompt text, if the prompt was given as text.
        cache_salt: Seeds its prefix-cache hashes: only requests with the same salt (or none)
            share cached blocks.
        lora: The LoRA adapter (one version of it) it runs with, from admission to its end;
            None: the base model.

    Attributes:
        token_ids: Prompt then output token ids.
        num_computed_tokens: Leading tokens whose KV is in the cache. The last sampled token is
            never computed yet: it is the next step's input.
        block_table: KV block ids holding this sequence's tokens, in order.
        block_hashes: Prefix-cache hashes of the leading full blocks of `block_table`.
        cache_epoch: The prefix-cache epoch (weights) its KV was computed under; blocks of a
            sequence from an older epoch are never offered for reuse.
        num_kv_resets: How many times its KV state was reset: a copy of its KV taken before
            the latest reset (a decode lane's) no longer matches the cache.
        num_cached_tokens: Prompt tokens that hit the prefix cache when it was admitted.
        was_started: Whether it has been admitted once (a preempted sequence has).
        times_passed: How many later sequences of running LoRA adapters were chosen to start
            while `max_loras` held it back (see `Scheduler._next_waiting`).
        output_weight_versions: The weight version that generated each output token.
        output_logprobs: Log-probabilities of each output token, when the request asked for them.
        prompt_logprobs: For each prompt position, the prompt token's log-probability and the
            most likely tokens there (None at position 0), when the request asked for them.
        output_text: The text decoded so far (outputs hold back its end while a stop string
            may begin there; see `visible_text`).
        stop_token_ids: The request's stop token ids, as a set: a lookup per token, whatever
            their number.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        *,
        generator: torch.Generator,
        decoder: IncrementalDecoder,
        prompt: str | None = None,
        cache_salt: str | None = None,
        lora: LoRAAdapter | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.cache_salt = cache_salt
        self.lora = lora
        self.times_passed = 0
        self.sampling_params = sampling_params
        self.generator = generator
        self.decoder = decoder
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.output_text = ""
        self.stop_token_ids = frozenset(sampling_params.stop_token_ids)
        # While running, this many trailing characters might begin a stop string that would cut
        # them off. A stop string kept in the text cuts nothing that could be shown before it
        # completes: no text is held back then.
        self._stop_hold = (
            0
            if sampling_params.include_stop_str_in_output
            else max(map(len, sampling_params.stop or []), default=1) - 1
        )
        self.output_weight_versions: list[WeightVersion] = []
        self.output_logprobs: list[TokenLogprobs] | None = (
            None if sampling_params.logprobs is None else []
        )
        self.prompt_logprobs: list[dict[int, Logprob] | None] | None = (
            None if sampling_params.prompt_logprobs is None else [None] * len(prompt_token_ids)
        )
        self.num_computed_tokens = 0
        self.block_table: list[int] = []
        self.block_hashes: list[bytes] = []
        self.cache_epoch = 0
        self.num_kv_resets = 0
        self.num_cached_tokens = 0
        self.status = SequenceStatus.WAITING
        self.was_started = False
        self.finish_reason: FinishReason | None = None
        self.stop_reason: str | int | None = None

    def __repr__(self) -> str:
        return (
            f"Sequence({self.request_id!r}, {self.status.value}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens})"
        )

    @property
    def num_tokens(self) -> int:
        """Prompt plus output tokens."""
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        """Output tokens generated so far."""
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        """The output token ids."""
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens whose KV still has to be computed before the next token can be sampled."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        """Whether the sequence has ended."""
        return self.status is SequenceStatus.FINISHED

    @property
    def visible_text(self) -> str:
        """The output text an output may show now: every later output's text extends it.

        While the request runs, the last characters that could still be the start of a stop
        string are held back: were the stop string to complete, they would not be part of the
        answer, and a stream cannot take back what it sent.
        """
        if self.is_finished or not self._stop_hold:
            return self.output_text
        return self.output_text[: max(0, len(self.output_text) - self._stop_hold)]

    def append_token(
        self, token_id: int, weight_version: WeightVersion, logprobs: TokenLogprobs | None = None
    ) -> None:
        """Appends a sampled token produced by `weight_version` (its text: `add_text`)."""
        self.token_ids.append(token_id)
        self.output_weight_versions.append(weight_version)
        if self.output_logprobs is not None and logprobs is not None:
            self.output_logprobs.append(logprobs)

    def add_text(self, token_id: int) -> str:
        """Decodes the newest token into the output text; returns the text it adds.

        A token that ends the request as a stop token is not decoded unless the request keeps
        its stop strings (`include_stop_str_in_output`), as vLLM leaves it out.
        """
        delta = self.decoder.add(token_id)
        self.output_text += delta
        return delta

    def reset_kv(self) -> None:
        """Forgets the KV-cache state (after its blocks were freed): all tokens get recomputed."""
        self.num_computed_tokens = 0
        self.block_table = []
        self.block_hashes = []
        self.num_kv_resets += 1

    def fail(self, exc: Exception) -> None:
        """Ends the sequence with `finish_reason="error"` and logs why (its computation failed)."""
        logger.error(
            "request %s failed and ends with finish_reason='error': %s: %s",
            self.request_id, type(exc).__name__, exc,
        )  # fmt: skip
        self.finish("error")

    def finish(
        self, reason: FinishReason, stop_reason: str | int | None = None, *, flush_text: bool = True
    ) -> None:
        """Marks the sequence finished (its blocks must be freed by the caller).

        `flush_text` completes the text with any held-back partial character; a stop string
        ends the text itself and passes False.
        """
        if flush_text:
            self.output_text += self.decoder.flush()
        self.status = SequenceStatus.FINISHED
        self.finish_reason = reason
        self.stop_reason = stop_reason

    def to_output(self) -> RequestOutput:
        """Returns the cumulative output so far."""
        completion = CompletionOutput(
            index=0,
            text=self.visible_text,
            token_ids=self.output_token_ids,
            weight_versions=list(self.output_weight_versions),
            logprobs=None
            if self.output_logprobs is None
            else [lp.logprob for lp in self.output_logprobs],
            top_logprobs=None
            if self.output_logprobs is None
            else [dict(lp.top) for lp in self.output_logprobs],
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
        )
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.token_ids[: self.num_prompt_tokens],
            outputs=[completion],
            finished=self.is_finished,
            num_cached_tokens=self.num_cached_tokens,
            prompt_logprobs=None if self.prompt_logprobs is None else list(self.prompt_logprobs),
        )
