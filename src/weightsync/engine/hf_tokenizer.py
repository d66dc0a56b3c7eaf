"""`HFTokenizer`: a model directory's own tokenizer, through the `tokenizers` library.

`tokenizer.json` holds the whole pipeline (normalizer, pre-tokenizer, model, post-processor,
decoder) and the special and added tokens; `tokenizer_config.json` names the BOS and EOS tokens
and may hold the chat template; `generation_config.json` lists the ids that end a generation
(Llama 3 and Qwen2.5 list several). Prompts are encoded as `transformers` encodes them: the
post-processor decides whether a BOS token comes first.

Output text is decoded incrementally, so that a stream's pieces join into exactly the text of the
whole output: a token's text can depend on its neighbours (a SentencePiece word's leading space,
a character split over several byte tokens), so each new token is decoded together with the
tokens before it, and text is released only once it can no longer change.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import tokenizers

from weightsync.engine.chat_template import ChatTemplate, _present
from weightsync.engine.tokenizer import ByteTokenizer, IncrementalDecoder, Tokenizer
from weightsync.errors import EngineConfigError, WeightValidationError
from weightsync.transfer._safetensors import read_text
from weightsync.transfer.base import _is_int

__all__ = ["HFTokenizer", "load_tokenizer"]

logger = logging.getLogger(__name__)

# The special tokens `transformers` names (and passes to chat templates by these names).
_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                       "cls_token", "mask_token")  # fmt: skip
# Prompt tokens an output's first token is decoded after: enough for its leading space or a
# character it completes, few enough to cost nothing.
_CONTEXT_TOKENS = 6
_REPLACEMENT = "\ufffd"  # what an incomplete UTF-8 sequence decodes to
# SentencePiece's byte-fallback tokens (`<0xE2>`): a run of them decodes as one, and one invalid
# byte turns every byte of its run into U+FFFD, so a run's text is final only once it ends.
_BYTE_TOKEN = re.compile(r"<0x[0-9A-F]{2}>")


class _WindowDecoder:
    """Decodes a window of recent tokens; releases the text a new token adds once it is final.

    The window starts at the first token whose text was released in the previous step
    (`_prefix`), so that whatever depends on the token before (a word's leading space) decodes
    the same way in both calls; `_read` is where the unreleased tokens begin. Text ending in
    U+FFFD may be an incomplete character that the next token completes, and the text of a run
    of byte tokens may change until the run ends: both wait. Tokens that decoding skips
    (special and unknown ones) do not end a run: they wait too.
    """

    def __init__(
        self,
        tokenizer: tokenizers.Tokenizer,
        context: Sequence[int],
        pending: frozenset[int],
        *,
        skip_special_tokens: bool,
    ) -> None:
        self._tokenizer = tokenizer
        self._pending = pending
        self._skip_special_tokens = skip_special_tokens
        self._ids = list(context)[-_CONTEXT_TOKENS:]
        if self._decode(self._ids).endswith(_REPLACEMENT):
            self._ids = []  # a prompt that ends mid-character is no context to decode after
        self._prefix = 0
        self._read = len(self._ids)

    def _decode(self, ids: list[int]) -> str:
        return str(self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens))

    def _released(self, *, final: bool) -> str:
        before = self._decode(self._ids[self._prefix : self._read])
        text = self._decode(self._ids[self._prefix :])
        if final or (len(text) > len(before) and not text.endswith(_REPLACEMENT)):
            self._prefix, self._read = self._read, len(self._ids)
            return text[len(before) :]
        return ""

    def add(self, token_id: int) -> str:
        self._ids.append(token_id)
        if token_id in self._pending or self._tokenizer.id_to_token(token_id) is None:
            return ""
        return self._released(final=False)

    def flush(self) -> str:
        return self._released(final=True)


class HFTokenizer:
    """A Hugging Face model directory's tokenizer (`tokenizer.json`), with its special tokens.

    Build one with `from_directory`. It satisfies
    [`Tokenizer`][weightsync.engine.tokenizer.Tokenizer].

    Args:
        tokenizer: The `tokenizers` pipeline.
        eos_token_ids: The ids that end a request.
        bos_token_id: The BOS token, if any.
        chat_template: The model's chat template, if any.
    """

    def __init__(
        self,
        tokenizer: tokenizers.Tokenizer,
        *,
        eos_token_ids: frozenset[int],
        bos_token_id: int | None = None,
        chat_template: ChatTemplate | None = None,
    ) -> None:
        self._tokenizer = tokenizer
        # A tokenizer.json may carry truncation or padding settings: a prompt is never cut or
        # padded here.
        self._tokenizer.no_truncation()
        self._tokenizer.no_padding()
        self.eos_token_ids = eos_token_ids
        self.bos_token_id = bos_token_id
        self.chat_template = chat_template
        # Tokens whose text is not final when they arrive: byte tokens, and special tokens
        # when decoding skips them (they then do not end a run of byte tokens).
        vocab = tokenizer.get_vocab(with_added_tokens=False)
        self._byte_tokens = frozenset(
            token_id for token, token_id in vocab.items() if _BYTE_TOKEN.fullmatch(token)
        )
        self._special_tokens = frozenset(
            i for i, token in tokenizer.get_added_tokens_decoder().items() if token.special
        )

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer knows, added tokens included."""
        return int(self._tokenizer.get_vocab_size(with_added_tokens=True))

    @classmethod
    def from_directory(cls, path: str | Path) -> HFTokenizer:
        """Reads a model directory's tokenizer files; never downloads anything.

        The files are `tokenizer.json`, `tokenizer_config.json` (special tokens, chat template),
        `chat_template.jinja` and `generation_config.json`. The EOS ids are
        `tokenizer_config.json`'s `eos_token` and every id of `generation_config.json`'s
        `eos_token_id` (a number or a list; `config.json`'s when the directory has no generation
        config).

        Raises:
            EngineConfigError: A file that does not parse, a special token that is not in the
                vocabulary, an id of the wrong type, or a chat template that is not valid Jinja;
                the message names the file and the key.
        """
        directory = Path(path)
        tokenizer_path = directory / "tokenizer.json"
        try:
            tokenizer = tokenizers.Tokenizer.from_str(read_text(tokenizer_path))
        except WeightValidationError as exc:  # not a regular file, or too large
            raise EngineConfigError(str(exc)) from None
        except Exception as exc:  # the library raises a bare Exception for any parse error
            raise EngineConfigError(
                f"{tokenizer_path} does not parse as a tokenizers pipeline: {exc}"
            ) from None
        config = _read_json(directory / "tokenizer_config.json")
        tokens = _special_tokens(config, directory / "tokenizer_config.json")
        ids = {key: _token_id(tokenizer, token, directory, key) for key, token in tokens.items()}
        eos = {ids["eos_token"]} if "eos_token" in ids else set()
        generation = directory / "generation_config.json"
        if _present(generation):
            eos |= _ids_of(_read_json(generation), generation, "eos_token_id")
        else:  # transformers' generate then takes the model config's
            eos |= _ids_of(_read_json(directory / "config.json"), directory / "config.json",
                           "eos_token_id")  # fmt: skip
        if not eos:
            logger.warning("%s names no EOS token: requests end at max_tokens only", directory)
        return cls(
            tokenizer,
            eos_token_ids=frozenset(eos),
            bos_token_id=ids.get("bos_token"),
            chat_template=ChatTemplate.from_directory(directory, config, tokens),
        )

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Returns the token ids of `text`; the post-processor's special tokens if asked.

        Raises:
            UnicodeEncodeError: `text` holds a lone surrogate.
        """
        try:
            return list(self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)
        except TypeError:  # the library's answer to text that is not valid Unicode
            text.encode("utf-8")  # raises the UnicodeEncodeError that says where
            raise

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        """Returns the text of `token_ids`; ids the tokenizer does not know give no text."""
        return str(self._tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens))

    def incremental_decoder(
        self, prompt_token_ids: Sequence[int] = (), *, skip_special_tokens: bool = True
    ) -> IncrementalDecoder:
        """Returns a decoder of one output; the prompt's last tokens give its first token context.

        With `skip_special_tokens` the special tokens give no text, as in `decode`.

        >>> import tokenizers
        >>> from tokenizers import decoders, models, pre_tokenizers
        >>> tok = tokenizers.Tokenizer(models.BPE({"h": 0, "i": 1, "hi": 2, "\u0120": 3}, [("h", "i")]))
        >>> tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(), decoders.ByteLevel()
        >>> decoder = HFTokenizer(tok, eos_token_ids=frozenset()).incremental_decoder()
        >>> [decoder.add(i) for i in (2, 3, 0, 1)], decoder.flush()
        (['hi', ' ', 'h', 'i'], '')
        """
        pending = self._byte_tokens | (self._special_tokens if skip_special_tokens else frozenset())
        return _WindowDecoder(self._tokenizer, prompt_token_ids, pending,
                              skip_special_tokens=skip_special_tokens)  # fmt: skip


def load_tokenizer(path: str | Path, *, vocab_size: int) -> Tokenizer:
    """The tokenizer of a model directory: its `tokenizer.json`, else the byte tokenizer.

    Args:
        path: The model directory.
        vocab_size: The model's vocabulary size; every id the tokenizer makes must fit in it.

    Raises:
        EngineConfigError: The tokenizer does not load (see `HFTokenizer.from_directory`), or it
            knows more ids than the model has.
    """
    directory = Path(path)
    if not _present(directory / "tokenizer.json"):
        logger.warning(
            "%s has no tokenizer.json: text goes through the byte tokenizer (ids 0-258)", directory
        )
        return ByteTokenizer()
    tokenizer = HFTokenizer.from_directory(directory)
    if tokenizer.vocab_size > vocab_size:
        raise EngineConfigError(
            f"{directory / 'tokenizer.json'} knows {tokenizer.vocab_size} token ids but "
            f"config.json's vocab_size is {vocab_size}: the tokenizer does not belong to this model"
        )
    # Ids need not be dense: a tokenizer.json may give a token an id far past how many it knows,
    # which the model's embedding would be indexed with.
    ids = tokenizer._tokenizer.get_vocab(with_added_tokens=True)
    token, largest = max(ids.items(), key=lambda item: item[1], default=("", -1))
    if largest >= vocab_size:
        raise EngineConfigError(
            f"{directory / 'tokenizer.json'} gives {token[:40]!r} the id {largest}, but "
            f"config.json's vocab_size is {vocab_size}: the tokenizer does not belong to this "
            "model, or its file is damaged"
        )
    return tokenizer


def _read_json(path: Path) -> dict[str, Any]:
    """A JSON object file's content; an absent file is empty."""
    if not _present(path):
        return {}
    try:
        data = json.loads(read_text(path))
    except WeightValidationError as exc:  # not a regular file, or too large
        raise EngineConfigError(str(exc)) from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise EngineConfigError(f"{path} is not valid JSON: {exc}") from None
    except RecursionError:  # arrays or objects nested thousands deep
        raise EngineConfigError(f"{path} is not valid JSON: it nests too deeply") from None
    if not isinstance(data, dict):
        raise EngineConfigError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data


def _special_tokens(config: dict[str, Any], path: Path) -> dict[str, str]:
    """The named special tokens of `tokenizer_config.json`: `{"eos_token": "</s>", ...}`."""
    tokens = {}
    for key in _SPECIAL_TOKEN_KEYS:
        value = config.get(key)
        if isinstance(value, dict):  # an AddedToken's fields
            value = value.get("content")
        if value is None:
            continue
        if not isinstance(value, str):
            raise EngineConfigError(f"{path}: {key} must be a token text, got {value!r}")
        tokens[key] = value
    return tokens


def _token_id(tokenizer: tokenizers.Tokenizer, token: str, directory: Path, key: str) -> int:
    token_id = tokenizer.token_to_id(token)
    if token_id is None:
        raise EngineConfigError(
            f"{directory / 'tokenizer_config.json'}: {key} {token!r} is not in "
            f"{directory / 'tokenizer.json'}'s vocabulary"
        )
    return int(token_id)


def _ids_of(data: dict[str, Any], path: Path, key: str) -> set[int]:
    """The token ids under `key`: a number, a list of numbers, or absent."""
    value = data.get(key)
    values = value if isinstance(value, list) else [] if value is None else [value]
    if not all(_is_int(v) and v >= 0 for v in values):
        raise EngineConfigError(
            f"{path}: {key} must be a token id or a list of them, got {value!r}"
        )
    return set(values)
