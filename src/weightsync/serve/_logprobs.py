r"""Log-probabilities in OpenAI's two shapes (completions' and chat's), named by the tokenizer.

A token is named by its own text, as the engine's tokenizer decodes it alone (special tokens by
their name). A token that is no text on its own (one byte of a multi-byte character, an id the
tokenizer does not know) is named `bytes:\xNN` by the byte tokenizer, and `token_id:N` (vLLM's
form for ids) by any other. A request with vLLM's `return_tokens_as_token_ids` has every token
named `token_id:N`, so a client reads the ids back whatever their text.

Prompt log-probabilities (vLLM's `prompt_logprobs`) have vLLM's shape: `None` for the first
prompt token, then for each one `{"<id>": {"logprob", "rank", "decoded_token"}}`, the prompt's
token first.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from weightsync import ByteTokenizer, CompletionOutput
from weightsync.engine.outputs import Logprob
from weightsync.engine.tokenizer import Tokenizer

_REPLACEMENT = "\ufffd"  # what a token that ends mid-character decodes to
_LOWEST_LOGPROB = -9999.0  # what vLLM writes for -inf, which JSON cannot hold


def written_logprob(logprob: float) -> float:
    """A log-probability as JSON can hold it: a non-finite one becomes vLLM's lowest.

    vLLM writes -inf so; the NaN of a model whose training diverged goes the same way, since
    one NaN would make the whole answer unwritable (a 500 for every choice).
    """
    return logprob if math.isfinite(logprob) else _LOWEST_LOGPROB


class LogprobsFormat:
    """Writes one request's log-probabilities, naming its tokens with `tokenizer`.

    Args:
        tokenizer: The engine's tokenizer.
        skip_special_tokens: The request's: the text offsets follow its text.
        as_token_ids: vLLM's `return_tokens_as_token_ids`: name every token `token_id:N`.
    """

    def __init__(
        self, tokenizer: Tokenizer, *, skip_special_tokens: bool, as_token_ids: bool = False
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.as_token_ids = as_token_ids
        self._names: dict[int, str] = {}

    def token_name(self, token_id: int) -> str:
        """The name a token has in this request's logprobs."""
        return f"token_id:{token_id}" if self.as_token_ids else self.token_text(token_id)

    def token_text(self, token_id: int) -> str:
        """The name OpenAI-style logprobs give a token by its text."""
        if (name := self._names.get(token_id)) is None:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            if text and _REPLACEMENT not in text:
                name = text
            elif isinstance(self.tokenizer, ByteTokenizer) and 0 <= token_id < 256:
                name = f"bytes:\\x{token_id:02x}"
            else:
                name = f"token_id:{token_id}"
            self._names[token_id] = name
        return name

    def _token_bytes(self, token_id: int) -> list[int] | None:
        if isinstance(self.tokenizer, ByteTokenizer) and 0 <= token_id < 256:
            return [token_id]
        name = self.token_text(token_id)
        return None if name.startswith(("token_id:", "bytes:")) else list(name.encode("utf-8"))

    def _offsets(self, out: CompletionOutput, prompt_ids: Sequence[int]) -> list[int]:
        """Each output token's character offset in `out.text`."""
        decoder = self.tokenizer.incremental_decoder(
            prompt_ids, skip_special_tokens=self.skip_special_tokens
        )
        offsets, position = [], 0
        for token_id in out.token_ids:
            offsets.append(min(position, len(out.text)))
            position += len(decoder.add(token_id))
        return offsets

    def completion(
        self, out: CompletionOutput, start: int, prompt_ids: Sequence[int]
    ) -> dict[str, Any] | None:
        """`/v1/completions` logprobs of output tokens `start..` (text offsets in the choice)."""
        if out.logprobs is None:
            return None
        tops = out.top_logprobs or [{} for _ in out.logprobs]
        name = self.token_name
        return {
            "tokens": [name(t) for t in out.token_ids[start:]],
            "token_logprobs": [written_logprob(lp) for lp in out.logprobs[start:]],
            "top_logprobs": [
                {name(t): written_logprob(lp) for t, lp in top.items()} for top in tops[start:]
            ],
            "text_offset": self._offsets(out, prompt_ids)[start:],
        }

    def chat(self, out: CompletionOutput, start: int) -> dict[str, Any] | None:
        """`/v1/chat/completions` logprobs of output tokens `start..` (`{"content": [...]}`)."""
        if out.logprobs is None:
            return None
        tops = out.top_logprobs or [{} for _ in out.logprobs]
        name, raw = self.token_name, self._token_bytes
        content = [
            {
                "token": name(token_id),
                "logprob": written_logprob(logprob),
                "bytes": raw(token_id),
                "top_logprobs": [
                    {"token": name(t), "logprob": written_logprob(lp), "bytes": raw(t)}
                    for t, lp in top.items()
                ],
            }
            for token_id, logprob, top in zip(
                out.token_ids[start:], out.logprobs[start:], tops[start:], strict=True
            )
        ]
        return {"content": content}

    def prompt(
        self, scored: Sequence[dict[int, Logprob] | None] | None
    ) -> list[dict[str, dict[str, Any]] | None] | None:
        """VLLM's `prompt_logprobs` of a request's output (None when it did not ask)."""
        if scored is None:
            return None
        return [
            None
            if entry is None
            else {
                str(token_id): {
                    "logprob": written_logprob(lp.logprob),
                    "rank": lp.rank,
                    "decoded_token": self.token_text(token_id),
                }
                for token_id, lp in entry.items()
            }
            for entry in scored
        ]

    def echoed(
        self,
        prompt_ids: Sequence[int],
        scored: Sequence[dict[int, Logprob] | None] | None,
        echo_text: str,
        output: dict[str, Any],
    ) -> dict[str, Any]:
        """Completions' logprobs with the echoed prompt's tokens first, as vLLM writes them.

        The first prompt token has no log-probability (`null`, and `null` alternatives); the
        others have theirs from `scored` (the request's prompt log-probabilities). The output's
        text offsets move past `echo_text`. A stream's later chunks pass no `prompt_ids`: their
        offsets move alone.
        """
        entries = list(scored or [])[: len(prompt_ids)] if prompt_ids else []
        entries += [None] * (len(prompt_ids) - len(entries))
        name = self.token_name
        decoder = self.tokenizer.incremental_decoder(
            [], skip_special_tokens=self.skip_special_tokens
        )
        offsets, position = [], 0
        for token_id in prompt_ids:
            offsets.append(min(position, len(echo_text)))
            position += len(decoder.add(token_id))
        return {
            "tokens": [name(t) for t in prompt_ids] + output["tokens"],
            "token_logprobs": [
                None if entry is None else written_logprob(entry[t].logprob)
                for t, entry in zip(prompt_ids, entries, strict=True)
            ]
            + output["token_logprobs"],
            "top_logprobs": [
                None
                if entry is None
                else {name(t): written_logprob(lp.logprob) for t, lp in entry.items()}
                for entry in entries
            ]
            + output["top_logprobs"],
            "text_offset": offsets + [len(echo_text) + offset for offset in output["text_offset"]],
        }
