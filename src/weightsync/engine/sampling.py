"""`SamplingParams` and the sampler that turns a batch of logits into next tokens."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from weightsync.errors import InvalidRequestError

__all__ = [
    "MAX_LOGPROBS",
    "MAX_STOP_STRINGS",
    "MAX_STOP_STRING_CHARS",
    "MAX_STOP_TOKEN_IDS",
    "SamplingParams",
    "TokenLogprobs",
    "sample",
    "token_logprobs",
]

MAX_LOGPROBS = 20
"""Most alternatives `SamplingParams.logprobs` may ask for at each step."""

# A request's stop checks run in the step every request shares, on each of its new tokens: their
# lists are bounded so that no request can slow the others down. No real client comes near
# (OpenAI takes 4 stop strings; vLLM's model runner takes 128 stop token ids).
MAX_STOP_STRINGS = 64
"""Most strings `SamplingParams.stop` may hold."""
MAX_STOP_STRING_CHARS = 512
"""Longest string of `SamplingParams.stop`, in characters."""
MAX_STOP_TOKEN_IDS = 128
"""Most ids `SamplingParams.stop_token_ids` may hold."""


@dataclass
class SamplingParams:
    r"""How one request samples its output.

    Attributes:
        max_tokens: Most output tokens to generate.
        temperature: Softmax temperature; 0 means greedy (argmax), deterministic and batch-invariant.
        top_p: Nucleus sampling: sample only from the smallest set of tokens whose probability
            adds up to at least `top_p` (1.0 keeps every token).
        seed: Seeds this request's sampler, so its output does not depend on the other requests
            in the batch; None draws a seed from the engine's.
        stop: Strings that end the output; the output text stops before the first one found.
            At most `MAX_STOP_STRINGS` strings of at most `MAX_STOP_STRING_CHARS` characters.
            While a request runs, the end of its text that could still begin a stop string is
            held back from its outputs (at most the longest stop string's length less one
            character), so that every output's text is a prefix of the final one.
        stop_token_ids: Token ids that end the output (kept in the output's token ids); at most
            `MAX_STOP_TOKEN_IDS`.
        ignore_eos: Keep generating past the end-of-sequence token (benchmarks want fixed lengths).
        logprobs: Return the log-probability of each sampled token, and of the `logprobs` most
            likely tokens at each step (0 for the sampled token alone); None returns none.
            Log-probabilities are those of the model's own distribution (softmax of the raw
            logits, before temperature and top-p), as an RL loss needs them.

    Raises:
        InvalidRequestError: A value is out of range; the message names the field.

    >>> SamplingParams(temperature=0, max_tokens=8, stop=["\\n"]).stop
    ['\\n']
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None

    def __post_init__(self) -> None:
        if (
            not isinstance(self.max_tokens, int)
            or isinstance(self.max_tokens, bool)
            or self.max_tokens < 1
        ):
            raise InvalidRequestError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if not isinstance(self.temperature, int | float) or not 0 <= self.temperature < float(
            "inf"
        ):
            raise InvalidRequestError(
                f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature!r}"
            )
        if not isinstance(self.top_p, int | float) or not 0 < self.top_p <= 1:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (
            not isinstance(self.seed, int)
            or isinstance(self.seed, bool)
            or not -(2**63) <= self.seed < 2**64  # what torch.Generator.manual_seed takes
        ):
            raise InvalidRequestError(
                f"seed must be an int in [-2**63, 2**64) or None, got {self.seed!r}"
            )
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        _check_length("stop", "strings", len(stop), MAX_STOP_STRINGS)
        if not all(isinstance(s, str) and s for s in stop):
            raise InvalidRequestError(
                f"stop must be a string or a list of non-empty strings, got {self.stop!r}"
            )
        longest = max(map(len, stop), default=0)
        if longest > MAX_STOP_STRING_CHARS:
            raise InvalidRequestError(
                f"stop holds a string of {longest} characters; each may have at most "
                f"{MAX_STOP_STRING_CHARS}: stop on a shorter suffix of it"
            )
        self.stop = stop
        stop_token_ids = list(self.stop_token_ids)
        _check_length("stop_token_ids", "ids", len(stop_token_ids), MAX_STOP_TOKEN_IDS)
        if not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in stop_token_ids
        ):
            raise InvalidRequestError(
                f"stop_token_ids must be a list of ints >= 0, got {self.stop_token_ids!r}"
            )
        self.stop_token_ids = stop_token_ids
        if self.logprobs is not None and (
            not isinstance(self.logprobs, int)
            or isinstance(self.logprobs, bool)
            or not 0 <= self.logprobs <= MAX_LOGPROBS
        ):
            raise InvalidRequestError(
                f"logprobs must be None or an int in [0, {MAX_LOGPROBS}], got {self.logprobs!r}"
            )

    @property
    def greedy(self) -> bool:
        """Whether sampling is greedy (temperature 0)."""
        return self.temperature == 0


def _check_length(field: str, items: str, count: int, limit: int) -> None:
    """Refuses a list of more than `limit` items, naming the field, the limit and the count."""
    if count > limit:
        raise InvalidRequestError(
            f"{field} holds {count} {items}; at most {limit} are accepted: send fewer"
        )


def _top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Zeroes the tail of `probs` (vocab,) outside the top-p nucleus; the result is unnormalized."""
    sorted_probs, order = probs.sort(descending=True)
    # A token stays if the mass strictly before it is below top_p, so the top token always stays.
    mass_before = sorted_probs.cumsum(0) - sorted_probs
    sorted_probs[mass_before >= top_p] = 0.0
    return torch.zeros_like(probs).scatter_(0, order, sorted_probs)


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator],
) -> list[int]:
    """Picks one next token per row of `logits`.

    Greedy rows take the argmax; the others sample from the tempered, top-p filtered softmax with
    their own generator, so each request's draw is independent of the batch it ran in.

    Args:
        logits: (num_rows, vocab) next-token logits.
        params: One `SamplingParams` per row.
        generators: One `torch.Generator` per row (unused by greedy rows).

    Returns:
        The chosen token id of each row.
    """
    logits = logits.float()  # (num_rows, vocab)
    chosen = logits.argmax(dim=-1).tolist()
    for row, (sp, generator) in enumerate(zip(params, generators, strict=True)):
        if sp.greedy:
            continue
        # Shifted so the largest logit is 0: dividing by any temperature > 0 then cannot
        # overflow (a tiny temperature sends the rest to -inf: greedy, not NaN).
        shifted = logits[row] - logits[row].max()
        probs = torch.softmax(shifted / sp.temperature, dim=-1)  # (vocab,)
        if sp.top_p < 1.0:
            probs = _top_p_filter(probs, sp.top_p)
        chosen[row] = int(torch.multinomial(probs, 1, generator=generator).item())
    return [int(t) for t in chosen]


class TokenLogprobs(NamedTuple):
    """Log-probabilities at one sampling step.

    Attributes:
        logprob: Log-probability of the sampled token.
        top: The most likely tokens and their log-probabilities, most likely first (as many as
            the request's `logprobs`).
    """

    logprob: float
    top: list[tuple[int, float]]


def token_logprobs(
    logits: torch.Tensor, params: Sequence[SamplingParams], tokens: Sequence[int]
) -> list[TokenLogprobs | None]:
    """Log-probabilities of the sampled `tokens`, for the rows whose request asked for them.

    Args:
        logits: (num_rows, vocab) next-token logits, as given to `sample`.
        params: One `SamplingParams` per row.
        tokens: The token sampled in each row.

    Returns:
        One entry per row: None where `logprobs` is None.
    """
    rows = [row for row, sp in enumerate(params) if sp.logprobs is not None]
    result: list[TokenLogprobs | None] = [None] * len(params)
    if not rows:
        return result
    logp = torch.log_softmax(logits[rows].float(), dim=-1)  # (asking rows, vocab)
    index = torch.tensor([[tokens[r]] for r in rows], device=logp.device)  # (asking rows, 1)
    chosen = logp.gather(1, index).squeeze(1).tolist()
    k = max(params[r].logprobs or 0 for r in rows)
    top_values, top_ids = logp.topk(k, dim=-1) if k else (logp[:, :0], logp[:, :0].long())
    for i, row in enumerate(rows):
        n = params[row].logprobs or 0
        top = list(zip(top_ids[i, :n].tolist(), top_values[i, :n].tolist(), strict=True))
        result[row] = TokenLogprobs(float(chosen[i]), top)
    return result
