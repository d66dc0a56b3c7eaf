"""Log-probabilities in OpenAI's two shapes (completions' and chat's), over the byte tokenizer.

A token is named by its text when it is one ASCII character, as `bytes:` and a hex escape when it
is one byte of a multi-byte character (no text on its own), and by name when it is special.
"""

from __future__ import annotations

from typing import Any

from weightsync import ByteTokenizer, CompletionOutput

_SPECIAL_NAMES = {v: k for k, v in ByteTokenizer.special_tokens.items()}


def token_text(token_id: int) -> str:
    """The name OpenAI-style logprobs give a token."""
    if 0 <= token_id < 128:
        return chr(token_id)
    if token_id < 256:
        return f"bytes:\\x{token_id:02x}"
    return _SPECIAL_NAMES.get(token_id, f"<|token_{token_id}|>")


def _token_bytes(token_id: int) -> list[int] | None:
    return [token_id] if 0 <= token_id < 256 else None


def _offsets(out: CompletionOutput) -> list[int]:
    """Each output token's character offset in `out.text`."""
    decoder = ByteTokenizer().incremental_decoder()
    offsets, position = [], 0
    for token_id in out.token_ids:
        offsets.append(min(position, len(out.text)))
        position += len(decoder.add(token_id))
    return offsets


def completion_logprobs(out: CompletionOutput, start: int) -> dict[str, Any] | None:
    """`/v1/completions` logprobs of output tokens `start..` (text offsets within the choice)."""
    if out.logprobs is None:
        return None
    tops = out.top_logprobs or [{} for _ in out.logprobs]
    return {
        "tokens": [token_text(t) for t in out.token_ids[start:]],
        "token_logprobs": out.logprobs[start:],
        "top_logprobs": [{token_text(t): lp for t, lp in top.items()} for top in tops[start:]],
        "text_offset": _offsets(out)[start:],
    }


def chat_logprobs(out: CompletionOutput, start: int) -> dict[str, Any] | None:
    """`/v1/chat/completions` logprobs of output tokens `start..` (`{"content": [...]}`)."""
    if out.logprobs is None:
        return None
    tops = out.top_logprobs or [{} for _ in out.logprobs]
    content = [
        {
            "token": token_text(token_id),
            "logprob": logprob,
            "bytes": _token_bytes(token_id),
            "top_logprobs": [
                {"token": token_text(t), "logprob": lp, "bytes": _token_bytes(t)}
                for t, lp in top.items()
            ],
        }
        for token_id, logprob, top in zip(
            out.token_ids[start:], out.logprobs[start:], tops[start:], strict=True
        )
    ]
    return {"content": content}
