"""`SamplingParams`: how one request samples its output, checked when it is built.

The sampler that applies them to a batch is the engine's own business (`engine/_sampler.py`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from weightsync.errors import InvalidRequestError
from weightsync.transfer.base import _is_int

__all__ = ["SamplingParams"]

_MAX_LOGPROBS = 20  # most alternatives `logprobs` may ask for at each step

# A request's stop checks run in the step every request shares, on each of its new tokens: their
# lists are bounded so that no request can slow the others down. No real client comes near
# (OpenAI takes 4 stop strings; vLLM's model runner takes 128 stop token ids).
_MAX_STOP_STRINGS = 64
_MAX_STOP_STRING_CHARS = 512
_MAX_STOP_TOKEN_IDS = 128
_MAX_LOGIT_BIAS_ENTRIES = 1024  # each is a write into a row of logits at every step
_MAX_LOGIT_BIAS = 100.0  # OpenAI's and vLLM's range: [-100, 100]


@dataclass
class SamplingParams:
    r"""How one request samples its output; the fields and their meaning are vLLM's.

    At each step the model's logits go through, in this order: `logit_bias`, the stop tokens'
    mask (while `min_tokens` are not reached), the penalties, then argmax (temperature 0) or the tempered
    softmax filtered by `min_p`, `top_k` and `top_p`, from which the request's generator draws.

    Attributes:
        max_tokens: Most output tokens to generate.
        temperature: Softmax temperature; 0 means greedy (argmax), deterministic and batch-invariant.
        top_p: Nucleus sampling: sample only from the smallest set of tokens whose probability
            adds up to at least `top_p` (1.0 keeps every token).
        top_k: Sample only from the `top_k` most likely tokens (and those tied with the last of
            them); 0 or -1 keeps every token.
        min_p: Drop the tokens whose probability is below `min_p` times the most likely
            token's (0 keeps every token; 1 keeps the most likely alone, and its ties).
        repetition_penalty: Each token seen in the prompt or the output so far has its logit
            divided by this when positive, multiplied by it when negative (1 changes nothing;
            above 1 discourages repeats).
        presence_penalty: Subtracted once from the logit of each token the output holds
            (in [-2, 2]).
        frequency_penalty: Subtracted from the logit of each token once per time the output
            holds it (in [-2, 2]).
        seed: Seeds this request's sampler, so its output does not depend on the other requests
            in the batch; None draws a seed from the engine's.
        stop: Strings that end the output; the output text stops before the first one found
            (after it, with `include_stop_str_in_output`). At most 64 strings of at most 512
            characters. While a request runs, the end of its text that could still begin a stop
            string is held back from its outputs (at most the longest stop string's length less
            one character), so that every output's text is a prefix of the final one.
        stop_token_ids: Token ids that end the output (kept in the output's token ids; their
            text only with `include_stop_str_in_output`); at most 128.
        ignore_eos: Keep generating past the end-of-sequence token (benchmarks want fixed lengths).
        min_tokens: Output tokens generated before the request may end otherwise than by
            `max_tokens`: until then EOS and `stop_token_ids` cannot be sampled (their logits
            are masked) and stop strings are not looked for. At most `max_tokens`.
        skip_special_tokens: Leave the special tokens' text out of the output text (True), or
            write it (False). Their ids stay in the output's token ids either way.
        include_stop_str_in_output: Keep the matched stop string (or the text of the stop
            token, EOS included) at the end of the output text.
        logprobs: Return the log-probability of each sampled token, and of the `logprobs` most
            likely tokens at each step (0 for the sampled token alone, at most 20); None returns
            none. Log-probabilities are those of the model's own distribution (softmax of the
            raw logits, before penalties, masks, temperature and filters), as an RL loss needs
            them.
        prompt_logprobs: Return, for each prompt token after the first, its log-probability
            given the tokens before it, and the `prompt_logprobs` most likely tokens there (0 for
            the prompt token alone, at most 20); None returns none. A request that asks for them
            computes its whole prompt (it takes no prefix from the cache).
        logit_bias: Added to the logits of these token ids (each in [-100, 100]) at every step,
            before the penalties; at most 1024 ids. Log-probabilities stay those of the raw
            logits.
        truncate_prompt_tokens: Keep only the last `truncate_prompt_tokens` tokens of the prompt
            (at least 1); -1 keeps as many as `max_model_len` leaves room for (all but one);
            None keeps the prompt whole.

    Raises:
        InvalidRequestError: A value is out of range; the message names the field.

    >>> SamplingParams(temperature=0, max_tokens=8, stop=["\\n"]).stop
    ['\\n']
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] | None = None
    truncate_prompt_tokens: int | None = None

    def __post_init__(self) -> None:
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise _invalid("max_tokens", f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if not _is_number(self.temperature) or not 0 <= self.temperature < float("inf"):
            raise _invalid(
                "temperature",
                f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature!r}",
            )
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise _invalid("top_p", f"top_p must be in (0, 1], got {self.top_p!r}")
        self._check_sampling_extensions()
        if self.seed is not None and (
            not _is_int(self.seed)
            or not -(2**63) <= self.seed < 2**64  # what torch.Generator.manual_seed takes
        ):
            raise _invalid(
                "seed", f"seed must be an int in [-2**63, 2**64) or None, got {self.seed!r}"
            )
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        _check_length("stop", "strings", len(stop), _MAX_STOP_STRINGS)
        if not all(isinstance(s, str) and s for s in stop):
            raise _invalid(
                "stop", f"stop must be a string or a list of non-empty strings, got {self.stop!r}"
            )
        longest = max(map(len, stop), default=0)
        if longest > _MAX_STOP_STRING_CHARS:
            raise _invalid(
                "stop",
                f"stop holds a string of {longest} characters; each may have at most "
                f"{_MAX_STOP_STRING_CHARS}: stop on a shorter suffix of it",
            )
        self.stop = stop
        stop_token_ids = list(self.stop_token_ids)
        _check_length("stop_token_ids", "ids", len(stop_token_ids), _MAX_STOP_TOKEN_IDS)
        if not all(_is_int(t) and t >= 0 for t in stop_token_ids):
            raise _invalid(
                "stop_token_ids",
                f"stop_token_ids must be a list of ints >= 0, got {self.stop_token_ids!r}",
            )
        self.stop_token_ids = stop_token_ids
        for flag in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            if not isinstance(getattr(self, flag), bool):
                raise _invalid(flag, f"{flag} must be True or False, got {getattr(self, flag)!r}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or not 0 <= value <= _MAX_LOGPROBS):
                raise _invalid(
                    name, f"{name} must be None or an int in [0, {_MAX_LOGPROBS}], got {value!r}"
                )
        self._check_prompt_fields()

    def _check_prompt_fields(self) -> None:
        """Checks `logit_bias` (made a fresh dict) and `truncate_prompt_tokens`."""
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise _invalid(
                    "logit_bias",
                    f"logit_bias must be a dict of token id to bias, got {self.logit_bias!r}",
                )
            _check_length("logit_bias", "entries", len(self.logit_bias), _MAX_LOGIT_BIAS_ENTRIES)
            for token_id, bias in self.logit_bias.items():
                if not _is_int(token_id) or token_id < 0:
                    raise _invalid(
                        "logit_bias", f"logit_bias keys must be token ids >= 0, got {token_id!r}"
                    )
                if not _is_number(bias) or not -_MAX_LOGIT_BIAS <= bias <= _MAX_LOGIT_BIAS:
                    raise _invalid(
                        "logit_bias",
                        f"logit_bias of token {token_id} must be a number in "
                        f"[-{_MAX_LOGIT_BIAS:g}, {_MAX_LOGIT_BIAS:g}], got {bias!r}",
                    )
            self.logit_bias = {int(t): float(b) for t, b in self.logit_bias.items()}
        truncate = self.truncate_prompt_tokens
        if truncate is not None and (
            not _is_int(truncate) or not (truncate >= 1 or truncate == -1)
        ):
            raise _invalid(
                "truncate_prompt_tokens",
                f"truncate_prompt_tokens must be an int >= 1, -1 (as many as fit) or None, "
                f"got {truncate!r}",
            )

    def _check_sampling_extensions(self) -> None:
        """Checks vLLM's fields beyond OpenAI's: top_k, min_p, the penalties, min_tokens."""
        if not _is_int(self.top_k) or self.top_k < -1:
            raise _invalid(
                "top_k", f"top_k must be an int >= 1, or 0 or -1 (every token), got {self.top_k!r}"
            )
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            raise _invalid("min_p", f"min_p must be in [0, 1], got {self.min_p!r}")
        if not _is_number(self.repetition_penalty) or not (
            0 < self.repetition_penalty < float("inf")
        ):
            raise _invalid(
                "repetition_penalty",
                f"repetition_penalty must be a finite number > 0 (1 = none), "
                f"got {self.repetition_penalty!r}",
            )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -2 <= value <= 2:
                raise _invalid(name, f"{name} must be in [-2, 2], got {value!r}")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise _invalid(
                "min_tokens",
                f"min_tokens must be an int in [0, max_tokens={self.max_tokens}], "
                f"got {self.min_tokens!r}",
            )

    @property
    def greedy(self) -> bool:
        """Whether sampling is greedy (temperature 0)."""
        return self.temperature == 0


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _invalid(param: str, message: str) -> InvalidRequestError:
    """An `InvalidRequestError` naming the field at fault (a server's 400 carries it as `param`)."""
    error = InvalidRequestError(message)
    error.param = param
    return error


def _check_length(field: str, items: str, count: int, limit: int) -> None:
    """Refuses a list of more than `limit` items, naming the field, the limit and the count."""
    if count > limit:
        raise _invalid(
            field, f"{field} holds {count} {items}; at most {limit} are accepted: send fewer"
        )
