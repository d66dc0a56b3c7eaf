"""The sandbox a chat template renders in: Jinja's immutable sandbox, bounded in time and size.

A template is code from whoever published the checkpoint. Jinja's sandbox keeps it away from
Python's internals, but not from work: two nested `range(100000)` loops run 10^10 times, and
`{{ content * 20000000 }}` builds a prompt of tens of megabytes that the tokenizer then chokes
on. Here every render carries a `_RenderBudget` (a deadline and a size in characters) that the
template's own operations check as they go:

- every loop iteration, call, filter and intercepted operator (`*`, `+`, `%`, `**`) checks the
  deadline;
- operations that multiply sizes (`*` on a text or a list, `+`, `%` and `format`, `replace`,
  `join`, `indent`, an integer argument such as a width) are sized *before* they run, from their
  operands; every result and every chunk of output is sized after.

A bound passed raises `TemplateBoundError`, which names the bound and its limit. The checks are
cooperative: nothing is interrupted from outside, so one step between two checks is itself
bounded by the size checks (no operation is given operands whose result would pass the bound).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import jinja2
import jinja2.nodes
import jinja2.sandbox
import jinja2.visitor
from jinja2.runtime import Context

from weightsync.transfer.base import _is_int

__all__: list[str] = []

RENDER_TIMEOUT_S = 5.0
"""How long one render may take, in seconds, before it is refused."""

CHARS_PER_TOKEN = 32
"""Rendered characters allowed per token of `max_model_len`: no tokenizer packs more than this
into a token of an ordinary prompt, so a longer text could not be served anyway."""

_BUDGET_KEY = "__weightsync_render_budget"  # a name a template cannot write (it is no identifier)
_ITER_FILTER = "__weightsync_bounded_iter"
_TEXT_FILTER = "__weightsync_bounded_text"
# A render holds the GIL while it runs, so the server's other threads (the step loop, the event
# loop) share one core with it. Templates of real models render in well under a millisecond; a
# render still running after `_FREE_S` then works in slices of `_SLICE_S` with a sleep of
# `_PAUSE_S` after each, a tenth of the GIL at most: everyone else runs at nearly full speed.
_FREE_S = 0.05
_SLICE_S = 0.001
_PAUSE_S = 0.009
_MAX_INT_BITS = 4096  # a template has no use for integers past this; their arithmetic is slow


class TemplateBoundError(Exception):
    """A render passed its deadline or its size bound.

    Attributes:
        bound: Which bound: `"time"` or `"size"`.
        message: What passed it and the limit.
    """

    def __init__(self, bound: str, message: str) -> None:
        super().__init__(message)
        self.bound = bound
        self.message = message


class _RenderBudget:
    """One render's deadline (monotonic seconds) and size bound (characters, list items)."""

    def __init__(self, timeout_s: float, max_chars: int) -> None:
        self.timeout_s = timeout_s
        self.max_chars = max_chars
        self.deadline = time.monotonic() + timeout_s
        self._next_pause = time.monotonic() + _FREE_S

    def tick(self) -> None:
        """Raises once the deadline passed; pauses a render that runs long (see `_FREE_S`)."""
        now = time.monotonic()
        if now > self.deadline:
            raise TemplateBoundError(
                "time", f"rendering took longer than its limit of {self.timeout_s:g} s"
            )
        if now >= self._next_pause:
            time.sleep(_PAUSE_S)
            self._next_pause = time.monotonic() + _SLICE_S

    def allow(self, size: int, what: str) -> None:
        """Raises when `what` would hold `size` characters (or items), more than the bound."""
        if size > self.max_chars:
            raise TemplateBoundError(
                "size", f"{what} reaches {size}, past the size limit of {self.max_chars} characters"
            )

    def sized(self, value: Any, what: str = "a value") -> Any:
        """Returns `value` after checking its size (texts, lists, dicts) and the deadline."""
        self.tick()
        if isinstance(value, str | bytes | list | tuple | dict | set):
            self.allow(len(value), what)
        elif _is_int(value):
            _allow_bits(value.bit_length())
        return value

    def iterate(self, iterable: Iterable[Any]) -> Iterator[Any]:
        """`iterable`, with the deadline checked before each item."""
        for item in iterable:
            self.tick()
            yield item

    def check_arguments(self, args: Iterable[Any], kwargs: Mapping[str, Any]) -> None:
        """Refuses an integer argument past the size bound (a width, a count, a repeat)."""
        for value in (*args, *kwargs.values()):
            if _is_int(value):
                self.allow(abs(value), "an integer argument (a width, a count)")


def _allow_bits(bits: int) -> None:
    if bits > _MAX_INT_BITS:
        raise TemplateBoundError(
            "size", f"an integer of about {bits} bits would pass the limit of {_MAX_INT_BITS} bits"
        )


def _budget_of(context: Context) -> _RenderBudget:
    # Read from the render's own variables (`parent`), which the template cannot reassign.
    budget = context.parent.get(_BUDGET_KEY)
    if not isinstance(budget, _RenderBudget):  # pragma: no cover - every render passes one
        raise TemplateBoundError("time", "the template rendered without its bounds")
    return budget


def _length(value: Any) -> int:
    return len(value) if isinstance(value, str | list | tuple) else len(str(value))


def _format_size(template: str, arguments: Iterable[Any], budget: _RenderBudget) -> int:
    """An upper bound on a `%` or `format` result: each field may hold the longest argument."""
    widest = max((_length(a) for a in arguments), default=0)
    for field in _numbers(template):  # a width or precision ("%99999999s", "{:>99999999}")
        budget.allow(field, "a format width")
    return len(template) + (template.count("%") + template.count("{")) * widest


def _numbers(text: str) -> Iterator[int]:
    digits = ""
    for char in text + " ":
        if char.isdigit():
            digits += char
        elif digits:
            yield int(digits[:18])  # the cap stops a huge run from becoming a huge int
            digits = ""


def _replace_size(text: str, old: str, new: str, count: int = -1) -> int:
    hits = text.count(old) if old else len(text) + 1
    if count is not None and count >= 0:
        hits = min(hits, count)
    return len(text) + hits * (len(new) - len(old))


def _joined(budget: _RenderBudget, separator: str, iterable: Iterable[Any]) -> list[Any]:
    """The items to join, sized before the text is built."""
    items, size = [], 0
    for item in budget.iterate(iterable):
        items.append(item)
        size += _length(item) + len(separator)
        budget.allow(size, "a joined text")
    return items


def _before_call(budget: _RenderBudget, obj: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
                 ) -> tuple[Any, ...]:  # fmt: skip
    """Sizes a call's result from its operands, before it runs; returns the arguments to use."""
    # The sandbox wraps `str.format` in a function of its own; the method is its `__wrapped__`.
    method = getattr(obj, "__wrapped__", obj)
    owner, name = getattr(method, "__self__", None), getattr(method, "__name__", "")
    if name != "safe_range":  # a range is lazy, and each loop over it is bounded in time
        budget.check_arguments(args, kwargs)
    if isinstance(owner, str):
        if name in ("format", "format_map"):
            budget.allow(_format_size(owner, (*args, *kwargs.values()), budget), "a formatted text")
        elif name == "replace" and len(args) >= 2 and all(isinstance(a, str) for a in args[:2]):
            budget.allow(_replace_size(owner, *args[:2], *args[2:3]), "a replaced text")
        elif name == "join" and len(args) == 1:
            return (_joined(budget, owner, args[0]),)
        elif name == "expandtabs":
            tabsize = args[0] if args else kwargs.get("tabsize", 8)
            budget.allow(len(owner) * max(1, int(tabsize)), "a text with its tabs expanded")
    return args


def _before_filter(
    budget: _RenderBudget, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[Any, ...]:
    """Sizes a filter's result from its operands, before it runs; returns the arguments to use."""
    budget.check_arguments(args, kwargs)
    if not args:
        return args
    value, rest = args[0], args[1:]
    if name == "join":
        separator = rest[0] if rest else kwargs.get("d", "")
        return (_joined(budget, str(separator), value), *rest)
    if name == "replace" and isinstance(value, str) and len(rest) >= 2:
        budget.allow(
            _replace_size(value, str(rest[0]), str(rest[1]), *rest[2:3]), "a replaced text"
        )
    elif name == "indent" and isinstance(value, str):
        width = rest[0] if rest else kwargs.get("width", 4)
        per_line = len(width) if isinstance(width, str) else int(width)
        budget.allow(len(value) + (value.count("\n") + 1) * per_line, "an indented text")
    elif name == "format" and isinstance(value, str):
        budget.allow(_format_size(value, (*rest, *kwargs.values()), budget), "a formatted text")
    elif name == "wordwrap" and isinstance(value, str):
        wrapstring = rest[3] if len(rest) > 3 else kwargs.get("wrapstring") or "\n"
        budget.allow(len(value) * (1 + len(str(wrapstring))), "a wrapped text")
    return args


def _bounded_filter(name: str, function: Callable[..., Any]) -> Callable[..., Any]:
    """`function` (a Jinja filter) with the render's bounds checked around it."""
    pass_arg = getattr(function, "jinja_pass_arg", None)
    passes = pass_arg.name if pass_arg is not None else None

    @jinja2.pass_context
    def bounded(context: Context, *args: Any, **kwargs: Any) -> Any:
        budget = _budget_of(context)
        budget.tick()
        args = _before_filter(budget, name, args, kwargs)
        first = {"context": (context,), "eval_context": (context.eval_ctx,),
                 "environment": (context.environment,)}.get(passes or "", ())  # fmt: skip
        return budget.sized(function(*first, *args, **kwargs), f"the result of |{name}")

    bounded.__name__ = bounded.__qualname__ = name
    return bounded


@jinja2.pass_context
def _bounded_iter(context: Context, iterable: Any) -> Iterator[Any]:
    return _budget_of(context).iterate(iterable)


@jinja2.pass_context
def _bounded_text(context: Context, text: Any) -> Any:
    return _budget_of(context).sized(text, "a concatenated text")


class _BoundingTransformer(jinja2.visitor.NodeTransformer):
    """Routes every loop's iterable and every `~` concatenation through the budget."""

    def visit_For(self, node: jinja2.nodes.For) -> jinja2.nodes.Node:  # noqa: N802 - Jinja's name
        self.generic_visit(node)
        node.iter = jinja2.nodes.Filter(
            node.iter, _ITER_FILTER, [], [], None, None, lineno=node.lineno
        )
        return node

    def visit_Concat(self, node: jinja2.nodes.Concat) -> jinja2.nodes.Node:  # noqa: N802
        self.generic_visit(node)
        return jinja2.nodes.Filter(node, _TEXT_FILTER, [], [], None, None, lineno=node.lineno)


class BoundedSandbox(jinja2.sandbox.ImmutableSandboxedEnvironment):
    """Jinja's immutable sandbox, with each render bounded by the budget `render` gives it.

    Filters added after construction are bounded too when added through `add_filter`.
    """

    # Operators whose result can outgrow their operands: sized before they run. (Intercepted
    # operators are also never folded at load time, where no budget exists.)
    intercepted_binops = frozenset({"*", "**", "+", "%", "//"})

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        for name, function in list(self.filters.items()):
            self.filters[name] = _bounded_filter(name, function)
        self.filters[_ITER_FILTER] = _bounded_iter
        self.filters[_TEXT_FILTER] = _bounded_text

    def add_filter(self, name: str, function: Callable[..., Any]) -> None:
        """Adds (or replaces) filter `name`, bounded as the built-in ones are."""
        self.filters[name] = _bounded_filter(name, function)

    def _parse(self, source: str, name: str | None, filename: str | None) -> jinja2.nodes.Template:
        tree = super()._parse(source, name, filename)
        bounded = _BoundingTransformer().visit(tree)
        assert isinstance(bounded, jinja2.nodes.Template)
        return bounded

    def call_binop(self, context: Context, operator: str, left: Any, right: Any) -> Any:
        budget = _budget_of(context)
        budget.tick()
        sized = (str, list, tuple)
        if operator == "*":
            for seq, times in ((left, right), (right, left)):
                if isinstance(seq, sized) and isinstance(times, int):
                    budget.allow(len(seq) * max(times, 0), f"{type(seq).__name__} * {times}")
            if isinstance(left, int) and isinstance(right, int):
                _allow_bits(left.bit_length() + right.bit_length())
        elif operator == "+" and isinstance(left, sized) and isinstance(right, sized):
            budget.allow(len(left) + len(right), "a sum of texts or lists")
        elif operator == "%" and isinstance(left, str):
            arguments = right if isinstance(right, tuple) else (right,)
            budget.allow(_format_size(left, arguments, budget), "a formatted text")
        elif operator == "**" and isinstance(left, int) and isinstance(right, int) and right > 0:
            _allow_bits(max(left.bit_length(), 1) * min(right, 1 << 32))
        return budget.sized(super().call_binop(context, operator, left, right))

    def call(
        __self,  # noqa: N805 - Jinja's own signature: a keyword named `self` may be passed on
        __context: Context,
        __obj: Any,
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        budget = _budget_of(__context)
        budget.tick()
        args = _before_call(budget, __obj, args, kwargs)
        result = super().call(__context, __obj, *args, **kwargs)
        return budget.sized(result, f"the result of {getattr(__obj, '__name__', 'a call')}()")

    def render(
        self,
        template: jinja2.Template,
        variables: Mapping[str, Any],
        *,
        timeout_s: float,
        max_chars: int,
    ) -> str:
        """Renders `template` with `variables`, within `timeout_s` and `max_chars` characters.

        Raises:
            TemplateBoundError: The render passed its deadline or its size bound.
            jinja2.TemplateError: The template's own errors (the sandbox's included).
        """
        budget = _RenderBudget(timeout_s, max_chars)
        chunks, size = [], 0
        for chunk in template.generate({**variables, _BUDGET_KEY: budget}):
            size += len(chunk)
            budget.allow(size, "the rendered prompt")
            budget.tick()
            chunks.append(chunk)
        return "".join(chunks)
