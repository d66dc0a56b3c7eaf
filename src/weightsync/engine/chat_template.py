"""`ChatTemplate`: a model's Jinja chat template, rendered in a sandbox as `transformers` does.

A model directory's template (`chat_template.jinja`, or `tokenizer_config.json`'s
`chat_template`) is code from whoever published the model, and the messages it renders come from
clients. It runs in Jinja's immutable sandbox, with the settings and helpers templates on the
Hugging Face Hub are written for (`trim_blocks`, `lstrip_blocks`, loop controls, a `tojson` that
keeps non-ASCII text, `raise_exception`, `strftime_now`), so it renders exactly what
`transformers`' `apply_chat_template` renders. A model without a template gets the engine's
documented default (`ChatTemplate.default()`).

Each render is bounded (`weightsync.engine._template_sandbox`): it may take at most
`RENDER_TIMEOUT_S` seconds and produce at most `max_chars` characters, checked by the
template's own loops, calls, filters and operators as it runs; a template that passes a bound is
refused as the request's error, naming the bound and its limit.
"""

from __future__ import annotations

import datetime
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn

import jinja2

from weightsync.engine._template_sandbox import (
    RENDER_TIMEOUT_S,
    BoundedSandbox,
    TemplateBoundError,
)
from weightsync.errors import EngineConfigError, InvalidRequestError, WeightValidationError
from weightsync.transfer._safetensors import read_text

__all__ = ["ChatTemplate"]

_DEFAULT_MAX_CHARS = 2**20
"""`ChatTemplate.render`'s size bound when none is given, in characters (an engine gives its
own: `max_model_len x CHARS_PER_TOKEN`)."""

_DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message.role }}|>\n{{ message.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
"""The template of a model without one: `<|role|>`, a newline, the content and a newline per
message, then `<|assistant|>` and a newline where the reply begins. The markers are plain text;
the tokenizer adds its BOS token before them."""


_MAX_SOURCE_CHARS = 2**20
"""The longest template source compiled, in characters. Real chat templates are a few to tens of
kilobytes; compiling takes about 6 s per MB of expressions, so a larger one would hold the
server's start for minutes."""
_RESERVED = frozenset({"messages", "tools", "documents", "add_generation_prompt"})


def _present(path: Path) -> bool:
    """Whether a model directory has the file `path`; anything else under its name is refused.

    A directory, a FIFO, a device or a broken link where a tokenizer file belongs is a damaged
    checkpoint, not an absent file: taking it for absent would serve the model with another
    tokenizer, special tokens or template than its own.
    """
    if path.is_file():
        return True
    if not os.path.lexists(path):
        return False
    raise EngineConfigError(
        f"{path} is not a regular file (a directory, a FIFO, a device or a broken link); a "
        "model directory's files must be plain files"
    )


def _raise_exception(message: str) -> NoReturn:
    raise jinja2.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own `tojson` escapes HTML characters; templates expect plain JSON.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format_: str) -> str:
    return datetime.datetime.now().strftime(format_)


class ChatTemplate:
    """A chat template: messages in, the prompt text out.

    Args:
        source: The Jinja source.
        origin: Where it came from, for error messages (`"tokenizer_config.json's
            chat_template"`, say).
        variables: Names the template may read besides `messages` and `add_generation_prompt`:
            the tokenizer's special tokens (`bos_token`, `eos_token`, ...), as `transformers`
            passes them.
        add_special_tokens: Whether the rendered text is encoded with the tokenizer's special
            tokens. A model's own template writes them itself (`transformers` encodes its output
            without them); the default template leaves the BOS token to the tokenizer.

    Raises:
        EngineConfigError: The source is not a valid Jinja template, or is longer than
            `_MAX_SOURCE_CHARS` (2**20); the message names `origin` and the line.

    >>> template = ChatTemplate.default()
    >>> print(template.render([{"role": "user", "content": "hi"}]), end="")
    <|user|>
    hi
    <|assistant|>
    """

    def __init__(
        self,
        source: str,
        *,
        origin: str = "chat template",
        variables: Mapping[str, str] | None = None,
        add_special_tokens: bool = False,
    ) -> None:
        self.source = source
        self.origin = origin
        self.variables = dict(variables or {})
        self.add_special_tokens = add_special_tokens
        if len(source) > _MAX_SOURCE_CHARS:
            raise EngineConfigError(
                f"{origin} is {len(source)} characters, more than the {_MAX_SOURCE_CHARS} of any "
                "chat template: the file is damaged, or holds something else"
            )
        environment = BoundedSandbox(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        environment.add_filter("tojson", _tojson)
        environment.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now)
        try:
            self._environment = environment
            self._template = environment.from_string(source)
        except jinja2.TemplateSyntaxError as exc:
            raise EngineConfigError(
                f"{origin} is not a valid Jinja template: {exc.message} (line {exc.lineno})"
            ) from None
        # Expressions or blocks nested hundreds deep overflow Jinja's parser or Python's compiler.
        except (RecursionError, SyntaxError):
            raise EngineConfigError(
                f"{origin} is not a valid Jinja template: it nests too deeply"
            ) from None

    @classmethod
    def default(cls) -> ChatTemplate:
        """The documented template of a model without its own (see `_DEFAULT_CHAT_TEMPLATE`)."""
        return cls(
            _DEFAULT_CHAT_TEMPLATE, origin="the default chat template", add_special_tokens=True
        )

    @classmethod
    def from_directory(
        cls, directory: Path, tokenizer_config: Mapping[str, Any], variables: Mapping[str, str]
    ) -> ChatTemplate | None:
        """The template of a model directory, or None when it has none.

        `chat_template.jinja` comes first, then `tokenizer_config.json`'s `chat_template` (a
        text, or a list of named templates of which `default` is taken), as in `transformers`.

        Raises:
            EngineConfigError: A template that is not UTF-8 or not valid Jinja, or a
                `chat_template` entry of the wrong shape; the message names the file and key.
        """
        path = directory / "chat_template.jinja"
        if _present(path):
            try:
                text = read_text(path)
            except WeightValidationError as exc:  # not a regular file, or too large
                raise EngineConfigError(str(exc)) from None
            except UnicodeDecodeError as exc:
                raise EngineConfigError(
                    f"{path} is not UTF-8 text: {exc.reason} at byte {exc.start}; save the "
                    "template as UTF-8"
                ) from None
            return cls(text, origin=str(path), variables=variables)
        source = tokenizer_config.get("chat_template")
        origin = f"{directory / 'tokenizer_config.json'}: chat_template"
        if isinstance(source, list):
            named = {
                entry.get("name"): entry.get("template")
                for entry in source
                if isinstance(entry, dict) and isinstance(entry.get("name"), str)
            }
            source, origin = named.get("default"), f"{origin} 'default'"
        if source is None:
            return None
        if not isinstance(source, str):
            raise EngineConfigError(
                f"{origin} must be a Jinja text (or a list of named templates with a 'default'), "
                f"got {type(source).__name__}"
            )
        return cls(source, origin=origin, variables=variables)

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        documents: Sequence[Mapping[str, Any]] | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
        max_chars: int = _DEFAULT_MAX_CHARS,
        timeout_s: float = RENDER_TIMEOUT_S,
    ) -> str:
        """Renders `messages` (dicts with `role` and `content`) into the prompt text.

        Args:
            messages: The conversation.
            add_generation_prompt: End with the marker where the assistant's reply begins.
            tools: Tool definitions, as `transformers` passes them (the template decides how
                they show; the default template ignores them).
            documents: Documents for retrieval-augmented templates, likewise.
            template_kwargs: More variables for the template (vLLM's `chat_template_kwargs`,
                `enable_thinking`, say); they may not replace `messages`, `tools`, `documents`
                or `add_generation_prompt`.
            max_chars: The most characters the text (and any text or list the template builds
                on the way) may hold: 2**20 unless given; an engine gives `max_model_len x 32`.
            timeout_s: The most seconds the render may take.

        Raises:
            InvalidRequestError: The template refused the messages (its `raise_exception`, say:
                roles that do not alternate), failed on them, or passed `timeout_s` or
                `max_chars`; the message names the template (and the bound and its limit).
        """
        reserved = sorted(_RESERVED & set(template_kwargs or {}))
        if reserved:
            error = InvalidRequestError(
                f"chat_template_kwargs may not set {', '.join(reserved)}: pass them as fields of "
                "their own"
            )
            error.param = "chat_template_kwargs"
            raise error
        variables = {
            **self.variables,
            **(template_kwargs or {}),
            "messages": [dict(m) for m in messages],
            "add_generation_prompt": add_generation_prompt,
            "tools": None if tools is None else [dict(t) for t in tools],
            "documents": None if documents is None else [dict(d) for d in documents],
        }
        try:
            return self._environment.render(
                self._template, variables, timeout_s=timeout_s, max_chars=max_chars
            )
        except TemplateBoundError as exc:
            raise InvalidRequestError(
                f"{self.origin} passed its {exc.bound} bound on these messages: {exc.message}; "
                "send a shorter conversation, or serve the model with a template that does "
                "less work"
            ) from None
        except jinja2.TemplateError as exc:  # raise_exception, an undefined name, the sandbox
            raise InvalidRequestError(f"{self.origin} refused the messages: {exc}") from None
        except Exception as exc:  # a template's own bug (a wrong type, say) on these messages
            raise InvalidRequestError(
                f"{self.origin} failed on the messages: {type(exc).__name__}: {exc}"
            ) from None
