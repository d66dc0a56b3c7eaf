"""A byte-level tokenizer: token ids 0..255 are bytes, then a few special tokens.

Any text round-trips through UTF-8 with no vocabulary file and no download, which is all a test or
an example needs. Models loaded from a directory may have a larger vocabulary: ids the tokenizer
does not know decode to nothing.
"""

from __future__ import annotations

import codecs
from typing import ClassVar

__all__ = ["ByteTokenizer", "IncrementalDecoder"]


class IncrementalDecoder:
    """Turns a stream of token ids into text, holding back an incomplete UTF-8 character.

    >>> tok = ByteTokenizer()
    >>> decoder = tok.incremental_decoder()
    >>> [decoder.add(i) for i in "é".encode()]
    ['', 'é']
    """

    def __init__(self, tokenizer: ByteTokenizer) -> None:
        self._tokenizer = tokenizer
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def add(self, token_id: int) -> str:
        """Consumes one token id and returns the text it completes (possibly empty)."""
        if 0 <= token_id < 256:
            return str(self._utf8.decode(bytes((token_id,))))
        return ""  # special or out-of-vocabulary ids carry no text

    def flush(self) -> str:
        """Ends the stream: an incomplete trailing character becomes U+FFFD."""
        return str(self._utf8.decode(b"", final=True))


class ByteTokenizer:
    """Bytes as tokens (ids 0..255) plus `<|bos|>` (256), `<|eos|>` (257) and `<|pad|>` (258).

    Args:
        add_bos: Whether `encode` starts every prompt with the BOS token by default.

    >>> tok = ByteTokenizer()
    >>> tok.encode("hi")
    [256, 104, 105]
    >>> tok.decode([256, 104, 105, 257])
    'hi'
    """

    bos_token_id = 256
    eos_token_id = 257
    pad_token_id = 258
    vocab_size = 259
    special_tokens: ClassVar[dict[str, int]] = {"<|bos|>": 256, "<|eos|>": 257, "<|pad|>": 258}

    def __init__(self, *, add_bos: bool = True) -> None:
        self.add_bos = add_bos

    def encode(self, text: str, *, add_bos: bool | None = None) -> list[int]:
        """Returns the token ids of `text` (its UTF-8 bytes), after a BOS token if enabled."""
        prefix = [self.bos_token_id] if (self.add_bos if add_bos is None else add_bos) else []
        return prefix + list(text.encode("utf-8"))

    def decode(self, token_ids: list[int], *, skip_special_tokens: bool = True) -> str:
        """Returns the text of `token_ids`; invalid UTF-8 becomes U+FFFD.

        Special tokens are dropped, or rendered by name when `skip_special_tokens` is False.
        """
        names = {v: k for k, v in self.special_tokens.items()}
        out: list[str] = []
        run = bytearray()
        for token_id in token_ids:
            if 0 <= token_id < 256:
                run.append(token_id)
                continue
            out.append(run.decode("utf-8", errors="replace"))
            run.clear()
            if not skip_special_tokens and token_id in names:
                out.append(names[token_id])
        out.append(run.decode("utf-8", errors="replace"))
        return "".join(out)

    def incremental_decoder(self) -> IncrementalDecoder:
        """Returns a fresh decoder for streaming one sequence's output."""
        return IncrementalDecoder(self)
