"""What the engine asks of a tokenizer (`Tokenizer`), and the byte-level one the presets use.

Token ids 0..255 of [`ByteTokenizer`][weightsync.engine.tokenizer.ByteTokenizer] are bytes, then
a few special tokens: any text round-trips through UTF-8 with no vocabulary file and no download,
which is all a test or an example needs. A model directory brings its own tokenizer
([`HFTokenizer`][weightsync.engine.hf_tokenizer.HFTokenizer]); both satisfy `Tokenizer`.
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence
from typing import TYPE_CHECKING, ClassVar, Protocol

if TYPE_CHECKING:
    from weightsync.engine.chat_template import ChatTemplate

__all__ = ["ByteTokenizer", "IncrementalDecoder", "Prompt", "Tokenizer"]

Prompt = str | list[int]
"""A prompt: text (tokenized by the engine's tokenizer) or token ids."""


class IncrementalDecoder(Protocol):
    """Turns one sequence's output token ids into text as they arrive.

    The texts returned, joined, are the text of all the ids: a decoder holds back what a later
    token may still change (an incomplete character, a merge) rather than take it back.
    """

    def add(self, token_id: int) -> str:
        """Consumes one token id and returns the text it completes (possibly empty)."""
        ...

    def flush(self) -> str:
        """Ends the stream and returns what was held back (incomplete characters as U+FFFD)."""
        ...


class Tokenizer(Protocol):
    """The tokenizer an `LLMEngine` uses: text prompts to ids, output ids to text."""

    @property
    def vocab_size(self) -> int:
        """Number of token ids the tokenizer knows (the model's vocabulary may be larger)."""
        ...

    @property
    def bos_token_id(self) -> int | None:
        """The beginning-of-sequence token, if the tokenizer has one."""
        ...

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """The tokens that end a request (unless it sets `ignore_eos`)."""
        ...

    @property
    def chat_template(self) -> ChatTemplate | None:
        """The model's own chat template, if it has one."""
        ...

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Returns the token ids of `text`, with the tokenizer's special tokens (BOS) if asked.

        Raises:
            UnicodeEncodeError: `text` holds a lone surrogate (it has no UTF-8 form).
        """
        ...

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        """Returns the text of `token_ids`; ids the tokenizer does not know give no text."""
        ...

    def incremental_decoder(
        self, prompt_token_ids: Sequence[int] = (), *, skip_special_tokens: bool = True
    ) -> IncrementalDecoder:
        """Returns a fresh decoder for one sequence's output, which follows `prompt_token_ids`.

        With `skip_special_tokens` the special tokens give no text; without, their own.
        """
        ...


class _ByteDecoder:
    """`ByteTokenizer`'s incremental decoder: holds back an incomplete UTF-8 character.

    `names` maps the special tokens to write, by id, to their text (none when they are skipped).
    """

    def __init__(self, names: dict[int, str]) -> None:
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._names = names

    def add(self, token_id: int) -> str:
        if 0 <= token_id < 256:
            return str(self._utf8.decode(bytes((token_id,))))
        if token_id in self._names:  # it ends a character cut short, as `decode` does
            text = str(self._utf8.decode(b"", final=True)) + self._names[token_id]
            self._utf8.reset()
            return text
        return ""  # skipped special or out-of-vocabulary ids carry no text

    def flush(self) -> str:
        return str(self._utf8.decode(b"", final=True))


class ByteTokenizer:
    """Bytes as tokens (ids 0..255) plus `<|bos|>` (256), `<|eos|>` (257) and `<|pad|>` (258).

    Args:
        add_bos: Whether `encode` starts a prompt with the BOS token (its one special token).

    >>> tok = ByteTokenizer()
    >>> tok.encode("hi")
    [256, 104, 105]
    >>> tok.decode([256, 104, 105, 257])
    'hi'
    >>> decoder = tok.incremental_decoder()
    >>> [decoder.add(i) for i in "é".encode()]
    ['', 'é']
    """

    bos_token_id = 256
    eos_token_id = 257
    pad_token_id = 258
    eos_token_ids = frozenset({257})
    vocab_size = 259
    special_tokens: ClassVar[dict[str, int]] = {"<|bos|>": 256, "<|eos|>": 257, "<|pad|>": 258}
    chat_template = None  # the engine's documented default template applies

    def __init__(self, *, add_bos: bool = True) -> None:
        self.add_bos = add_bos

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Returns the token ids of `text`: its UTF-8 bytes, after the BOS token if enabled.

        Raises:
            UnicodeEncodeError: `text` holds a lone surrogate.
        """
        prefix = [self.bos_token_id] if add_special_tokens and self.add_bos else []
        return prefix + list(text.encode("utf-8"))

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
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

    def incremental_decoder(
        self, prompt_token_ids: Sequence[int] = (), *, skip_special_tokens: bool = True
    ) -> IncrementalDecoder:
        """Returns a fresh decoder for streaming one sequence's output (bytes need no context).

        Without `skip_special_tokens`, a special token's text is its name (`<|eos|>`), as in
        `decode`; ids past the special tokens (a model's vocabulary may be larger) have none.
        """
        names = {} if skip_special_tokens else {v: k for k, v in self.special_tokens.items()}
        return _ByteDecoder(names)
