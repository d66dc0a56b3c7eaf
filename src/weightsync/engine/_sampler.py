"""The sampler: a batch's next-token logits in, one token per row out, and their logprobs.

Each row's logits go through its request's `SamplingParams` in vLLM's order: its `logit_bias`
added, the stop tokens masked while `min_tokens` are not reached, the penalties (repetition, frequency, presence), then
greedy argmax at temperature 0; otherwise the tempered softmax, `min_p`, `top_k` and `top_p`, and
one draw from the request's own generator. Rows that use none of these cost what they did before:
the masks and penalties touch only the rows that ask for them, the penalties in one batched step.
Log-probabilities are those of the raw logits, whatever the row's parameters.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple, Protocol

import torch

from weightsync.engine.outputs import Logprob
from weightsync.engine.sampling import SamplingParams

__all__ = ["SamplingRow", "TokenLogprobs", "position_logprobs", "sample", "token_logprobs"]


class SamplingRow(Protocol):
    """What the sampler reads of the request of one row (an engine `Sequence` is one)."""

    @property
    def sampling_params(self) -> SamplingParams:
        """How the request samples."""
        ...

    @property
    def generator(self) -> torch.Generator:
        """The request's own random generator (unused by greedy rows)."""
        ...

    @property
    def token_ids(self) -> list[int]:
        """Prompt then output token ids (the penalties count them)."""
        ...

    @property
    def num_prompt_tokens(self) -> int:
        """How many of `token_ids` are the prompt."""
        ...


def _uses_penalties(sp: SamplingParams) -> bool:
    return bool(sp.repetition_penalty != 1.0 or sp.frequency_penalty or sp.presence_penalty)


def _counts(token_lists: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """(len(token_lists), vocab) float counts of each token id in each list."""
    longest = max(map(len, token_lists), default=0)
    # Padded with the id `vocab`: its counts land in one extra column, dropped below.
    padded = torch.tensor([ids + [vocab] * (longest - len(ids)) for ids in token_lists],
                          dtype=torch.long).reshape(len(token_lists), longest)  # fmt: skip
    counts = torch.zeros(len(token_lists), vocab + 1, device=device)
    counts.scatter_add_(1, padded.to(device), torch.ones(padded.shape, device=device))
    return counts[:, :vocab]


def _penalised(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """`logits` with each row's penalties applied, as vLLM applies them (a copy if any).

    Repetition: the logit of a token seen in the prompt or the output is divided by the penalty
    when positive, multiplied when negative. Frequency and presence: a token's logit loses
    `frequency_penalty` per time it is in the output, and `presence_penalty` once if it is.
    """
    index = [i for i, row in enumerate(rows) if _uses_penalties(row.sampling_params)]
    if not index:
        return logits
    vocab, device = logits.shape[-1], logits.device
    picked = [rows[i] for i in index]
    outputs = _counts([r.token_ids[r.num_prompt_tokens :] for r in picked], vocab, device)
    prompts = _counts([r.token_ids[: r.num_prompt_tokens] for r in picked], vocab, device)

    def column(values: list[float]) -> torch.Tensor:  # (penalised rows, 1)
        return torch.tensor(values, device=device)[:, None]

    params = [r.sampling_params for r in picked]
    repetition = column([sp.repetition_penalty for sp in params])
    frequency = column([sp.frequency_penalty for sp in params])
    presence = column([sp.presence_penalty for sp in params])
    chosen = logits[index]  # (penalised rows, vocab), a copy
    seen = (outputs > 0) | (prompts > 0)
    repeated = torch.where(chosen > 0, chosen / repetition, chosen * repetition)
    chosen = torch.where(seen, repeated, chosen)
    chosen = chosen - frequency * outputs - presence * (outputs > 0).float()
    logits = logits.clone()
    logits[index] = chosen
    return logits


def _biased(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """`logits` with each row's `logit_bias` added (a copy if any row has one)."""
    biased = [i for i, row in enumerate(rows) if row.sampling_params.logit_bias]
    if not biased:
        return logits
    logits = logits.clone()
    for i in biased:
        bias = rows[i].sampling_params.logit_bias or {}
        ids = torch.tensor(list(bias), dtype=torch.long, device=logits.device)
        logits[i, ids] += torch.tensor(list(bias.values()), device=logits.device)
    return logits


def _masked_stops(
    logits: torch.Tensor, rows: Sequence[SamplingRow], eos_token_ids: frozenset[int]
) -> torch.Tensor:
    """`logits` with EOS and the stop token ids at -inf in rows short of their `min_tokens`."""
    vocab = logits.shape[-1]
    copied = False
    for i, row in enumerate(rows):
        sp = row.sampling_params
        if len(row.token_ids) - row.num_prompt_tokens >= sp.min_tokens:
            continue
        stops = set(sp.stop_token_ids) | (set() if sp.ignore_eos else set(eos_token_ids))
        ids = sorted(t for t in stops if t < vocab)
        if ids:
            if not copied:
                logits, copied = logits.clone(), True
            logits[i, ids] = float("-inf")
    return logits


def _filtered(probs: torch.Tensor, sp: SamplingParams) -> torch.Tensor:
    """`probs` (vocab,) with `min_p`, `top_k` and `top_p` applied; unnormalized."""
    if sp.min_p > 0:
        probs = probs.masked_fill(probs < sp.min_p * probs.max(), 0.0)
    if 0 < sp.top_k < probs.numel():
        # The k-th largest probability is the bar: tokens tied with it stay.
        probs = probs.masked_fill(probs < probs.topk(sp.top_k).values[-1], 0.0)
    if sp.top_p < 1.0:
        probs = _top_p_filter(probs / probs.sum(), sp.top_p)
    return probs


def _top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Zeroes the tail of `probs` (vocab,) outside the top-p nucleus; the result is unnormalized."""
    sorted_probs, order = probs.sort(descending=True)
    # A token stays if the mass strictly before it is below top_p, so the top token always stays.
    mass_before = sorted_probs.cumsum(0) - sorted_probs
    sorted_probs[mass_before >= top_p] = 0.0
    return torch.zeros_like(probs).scatter_(0, order, sorted_probs)


def sample(
    logits: torch.Tensor,
    rows: Sequence[SamplingRow],
    eos_token_ids: frozenset[int] = frozenset(),
) -> list[int]:
    """Picks one next token per row of `logits`.

    Greedy rows take the argmax of their (masked, penalised) logits; the others sample from the
    tempered, filtered softmax with their own generator, so each request's draw is independent
    of the batch it ran in.

    Args:
        logits: (num_rows, vocab) next-token logits; left unchanged.
        rows: The request of each row.
        eos_token_ids: The tokenizer's end-of-sequence ids (masked before `min_tokens`).

    Returns:
        The chosen token id of each row.
    """
    logits = _masked_stops(_penalised(_biased(logits.float(), rows), rows), rows, eos_token_ids)
    chosen = logits.argmax(dim=-1).tolist()  # (num_rows,)
    for i, row in enumerate(rows):
        sp = row.sampling_params
        if sp.greedy:
            continue
        # Shifted so the largest logit is 0: dividing by any temperature > 0 then cannot
        # overflow (a tiny temperature sends the rest to -inf: greedy, not NaN).
        shifted = logits[i] - logits[i].max()
        probs = _filtered(torch.softmax(shifted / sp.temperature, dim=-1), sp)  # (vocab,)
        chosen[i] = int(torch.multinomial(probs, 1, generator=row.generator).item())
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

    They are those of the raw logits' softmax: before penalties, masks, temperature and filters.

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


def position_logprobs(
    logits: torch.Tensor, next_tokens: Sequence[int], num_top: int
) -> list[dict[int, Logprob]]:
    """Scores known next tokens (a prompt's): each one's log-probability and rank, and the top.

    Args:
        logits: (positions, vocab) logits at consecutive positions.
        next_tokens: The token that follows each position.
        num_top: How many of the most likely tokens to add at each position.

    Returns:
        One dict per position: the next token first, then the `num_top` most likely tokens
        (vLLM's prompt log-probabilities), each with its log-probability of the raw logits and
        its rank (1 is the most likely).
    """
    logp = torch.log_softmax(logits.float(), dim=-1)  # (positions, vocab)
    index = torch.tensor(list(next_tokens), dtype=torch.long, device=logp.device)[:, None]
    chosen = logp.gather(1, index)  # (positions, 1)
    ranks = ((logp > chosen).sum(dim=-1) + 1).tolist()
    top_values, top_ids = logp.topk(num_top, dim=-1) if num_top else (logp[:, :0], index[:, :0])
    scored: list[dict[int, Logprob]] = []
    for row, token in enumerate(next_tokens):
        entry = {int(token): Logprob(float(chosen[row, 0]), int(ranks[row]))}
        for rank, (t, lp) in enumerate(
            zip(top_ids[row].tolist(), top_values[row].tolist(), strict=True)
        ):
            entry.setdefault(int(t), Logprob(float(lp), rank + 1))
        scored.append(entry)
    return scored
