"""The jinja2 sandbox chat templates render in, with the work of one render bounded.

A model's chat template is untrusted input. jinja2's immutable sandbox already keeps it away from
attributes and mutation; this adds bounds on what it can make, so a hostile template fails with a
ChatTemplateError instead of exhausting memory, aborting the tokenizer (Rust aborts on a failed
allocation) or spinning forever:

* loops: every item any ``for`` loop (or recursive ``loop(...)`` call) takes counts against
  MAX_LOOP_ITEMS per render, and ``range`` is at most MAX_TEMPLATE_RANGE long;
* building: every string or list the template builds (``*``, ``+``, ``%``, ``~``, ``str.format``,
  str methods, filters, ``{{ }}`` output) spends its size from MAX_BUILT_UNITS per render (a char is
  one unit, a list element ELEMENT_UNITS). Where the size is known before the work (a repetition, a
  padding width, a ``replace``, a ``join``) the work is refused before it is done;
* text of containers: ``str()`` of a list holding one big string many times is far larger than the
  list, so a value's text size is estimated (``text_size``) before it is converted.
"""

from __future__ import annotations

import contextvars
import functools
import json
import re
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from jinja2 import nodes
from jinja2.compiler import CodeGenerator, Frame
from jinja2.runtime import Context, LoopContext, markup_join, str_join
from jinja2.sandbox import ImmutableSandboxedEnvironment, SandboxedEnvironment, SandboxedFormatter
from jinja2.utils import Namespace, generate_lorem_ipsum

from colibri_stream.errors import ChatTemplateError

MAX_TEMPLATE_RANGE = 10_000
MAX_LOOP_ITEMS = 1_000_000  # nested loops multiply: two range(1000) loops are a million items
MAX_BUILT_UNITS = 64 * 2**20  # chars (a list element is ELEMENT_UNITS) built by one render
ELEMENT_UNITS = 8  # a list element is a pointer and an object: several chars' worth of memory
MAX_JSON_INDENT = 16  # tojson(indent=...): real templates use 2 or 4
MAX_LIPSUM = 100  # lipsum(n) paragraphs, and words per paragraph / 10

_budget: contextvars.ContextVar[_RenderBudget | None] = contextvars.ContextVar("_budget", default=None)


class _RenderBudget:
    def __init__(self) -> None:
        self.loop_items = 0
        self.units_left = MAX_BUILT_UNITS

    def check(self, units: int, what: str) -> None:
        if units > self.units_left:
            raise ChatTemplateError(
                f"chat template: {what} would build {units} characters, more than is left of the "
                f"{MAX_BUILT_UNITS} one render may build"
            )

    def spend(self, units: int, what: str) -> None:
        self.check(units, what)
        self.units_left -= units

    def loop_item(self) -> None:
        self.loop_items += 1
        if self.loop_items > MAX_LOOP_ITEMS:
            raise ChatTemplateError(f"chat template: its loops ran over {MAX_LOOP_ITEMS} items in one render")


_UNBOUNDED = _RenderBudget()  # outside a render (a template compiled, not rendered): never spent
_UNBOUNDED.units_left = 1 << 62


def budget() -> _RenderBudget:
    return _budget.get() or _UNBOUNDED


def start_render() -> contextvars.Token[_RenderBudget | None]:
    """A fresh budget for one render; pass the token to ``end_render``."""
    return _budget.set(_RenderBudget())


def end_render(token: contextvars.Token[_RenderBudget | None]) -> None:
    _budget.reset(token)


def text_size(value: Any, limit: int | None = None) -> int:
    """About ``len(str(value))``, counted without building it, stopping once over ``limit``: a list
    holding one 1 MB string a thousand times is small, its text a gigabyte."""
    limit = budget().units_left if limit is None else limit
    total, stack = 0, [value]
    while stack and total <= limit:
        item = stack.pop()
        if isinstance(item, str):
            total += len(item) + 2  # quotes, in a container's repr
        elif isinstance(item, list | tuple | set | frozenset | dict):
            total += 2 + 2 * len(item)
            if total <= limit:
                stack.extend(item.items() if isinstance(item, dict) else item)
        elif isinstance(item, Namespace):
            stack.append(item._Namespace__attrs)  # its repr shows its attributes
        elif isinstance(item, int) and not isinstance(item, bool):
            total += item.bit_length() // 3 + 2  # decimal digits, rounded up
        else:
            total += 64  # a number, None, an Undefined, a function's repr
    return total


# printf-style conversions (the % operator, the format filter): flags, then width and precision
_PRINTF = re.compile(r"%(?:\([^)]*\))?[#0\- +]*(\*|\d+)?(?:\.(\*|\d+))?")


def _printf_estimate(fmt: str, args: tuple[Any, ...]) -> int:
    """An upper bound on ``fmt % args``: the format, the text of the arguments, and every width or
    precision (``*`` takes one from the arguments)."""
    numbers = [a for a in args if isinstance(a, int) and not isinstance(a, bool)]
    extra = 0
    for match in _PRINTF.finditer(fmt):
        for field in match.groups():
            if field == "*":
                extra += max(numbers, default=0)
            elif field:
                extra += int(field)
    return len(fmt) + text_size(args) + extra


class _BoundedFormatter(SandboxedFormatter):
    """``str.format`` in the sandbox, with each field's width and precision (after nested fields are
    filled in: ``{:{}}``) and each converted value's text checked against the budget."""

    def convert_field(self, value: Any, conversion: str | None) -> Any:
        if conversion is not None:
            budget().check(text_size(value), "a format field")
        return super().convert_field(value, conversion)

    def format_field(self, value: Any, format_spec: str) -> Any:
        widths = [int(n) for n in re.findall(r"\d+", format_spec)]
        budget().check(max([text_size(value), *widths]), f"format spec {format_spec[:40]!r}")
        result = super().format_field(value, format_spec)
        budget().spend(len(result), "a format field")
        return result


class _BoundedRange:
    """``range`` for templates: at most MAX_TEMPLATE_RANGE long (its items count as loop items)."""

    def __init__(self, *args: int):
        self.inner = range(*args)
        if len(self.inner) > MAX_TEMPLATE_RANGE:
            raise ChatTemplateError(f"chat template: range of {len(self.inner)} items (at most {MAX_TEMPLATE_RANGE})")

    def __iter__(self) -> Iterator[int]:
        return _counted(self.inner)

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, index: Any) -> Any:
        return self.inner[index]


def _counted(items: Iterable[Any]) -> Iterator[Any]:
    for item in items:
        budget().loop_item()
        yield item


def _lipsum(n: int = 5, html: bool = True, min: int = 20, max: int = 100) -> str:  # noqa: A002 - jinja's names
    if not all(isinstance(v, int) and 0 <= v <= MAX_LIPSUM * 10 for v in (n * 10, min, max)):
        raise ChatTemplateError(f"chat template: lipsum({n}, min={min}, max={max}) is too long")
    return generate_lorem_ipsum(n, html, min, max)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    """Hugging Face's ``tojson`` (what chat templates are written for): plain JSON, non-ASCII kept and
    nothing HTML-escaped, and an ``ensure_ascii`` argument (jinja's own takes none and escapes <>&')."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class _GuardedCodeGenerator(CodeGenerator):
    """Compiles every ``for`` loop's iterable through ``environment.guard_iterable`` and every ``~``
    through ``environment.guard_concat``: neither goes through a sandbox hook otherwise."""

    def visit_For(self, node: nodes.For, frame: Frame) -> None:
        guarded = nodes.Call(nodes.EnvironmentAttribute("guard_iterable"), [node.iter], [], None, None)
        copy = nodes.For(node.target, guarded, node.body, node.else_, node.test, node.recursive, lineno=node.lineno)
        super().visit_For(copy, frame)

    def visit_Concat(self, node: nodes.Concat, frame: Frame) -> None:
        self.write("environment.guard_concat(context.eval_ctx, (")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


def _units(value: Any) -> int:
    """What a built value costs: its characters, or its elements."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, list | tuple | dict | set):
        return len(value) * ELEMENT_UNITS
    return 0


def _str_method_estimate(text: str, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int | None:
    """The size of ``text.method(*args)`` before it is built, for the str methods that can amplify."""
    first = args[0] if args else None
    if method in ("center", "ljust", "rjust", "zfill") and isinstance(first, int):
        return max(len(text), first)
    if method == "expandtabs":
        tabsize = first if isinstance(first, int) else kwargs.get("tabsize", 8)
        return len(text) + text.count("\t") * max(tabsize if isinstance(tabsize, int) else 8, 0)
    if method == "replace" and len(args) >= 2 and isinstance(args[0], str) and isinstance(args[1], str):
        old, new = args[0], args[1]
        count = text.count(old) if old else len(text) + 1
        if len(args) > 2 and isinstance(args[2], int) and args[2] >= 0:
            count = min(count, args[2])
        return len(text) + count * max(len(new) - len(old), 0)
    return None


class BoundedSandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox with the bounds of this module (see its docstring)."""

    code_generator_class = _GuardedCodeGenerator
    intercepted_binops = frozenset(["*", "**", "+", "%"])

    def __init__(self, **options: Any):
        super().__init__(finalize=self._finalize, **options)
        self.globals.update(range=_BoundedRange, lipsum=_lipsum)
        self.filters["tojson"] = _tojson
        self.filters.update({name: _guarded_filter(name, f) for name, f in self.filters.items()})

    @staticmethod
    def _finalize(value: Any) -> Any:
        """Every ``{{ }}`` value, before str(): its text is built output."""
        budget().spend(text_size(value), "an output value")
        return value

    def call_binop(self, context: Context, operator: str, left: Any, right: Any) -> Any:
        if operator == "**" and isinstance(right, int | float) and abs(right) > 1024:
            raise ChatTemplateError(f"chat template: exponent {right} is too large")
        estimate = _binop_estimate(operator, left, right)
        if estimate:
            budget().check(estimate, f"{type(left).__name__} {operator} {type(right).__name__}")
        result = SandboxedEnvironment.call_binop(self, context, operator, left, right)
        budget().spend(_units(result), f"{type(left).__name__} {operator} {type(right).__name__}")
        return result

    def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
        """``'...'.format`` and ``format_map`` through the bounded formatter (jinja's, otherwise)."""
        wrapper = super().wrap_str_format(value)
        if wrapper is None or not isinstance(value.__self__, str) or type(value.__self__) is not str:
            return wrapper
        fmt, formatter = value.__self__, _BoundedFormatter(self)
        is_map = value.__name__ == "format_map"

        def bounded(*args: Any, **kwargs: Any) -> str:
            if is_map:
                if kwargs or len(args) != 1:
                    raise TypeError("format_map() takes exactly one positional argument")
                mapping = args[0]  # two statements: mypy checks `args[0]` after `args = ()`
                args, kwargs = (), mapping
            return formatter.vformat(fmt, args, kwargs)

        return functools.update_wrapper(bounded, value)

    def call(__self, __context: Context, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805 - jinja's signature
        if isinstance(__obj, LoopContext) and args:  # a recursive loop's next level
            args = (__self.guard_iterable(args[0]), *args[1:])
        # reflection: which callable a template calls (a bound str method is budgeted before it runs)
        owner = getattr(__obj, "__self__", None)
        if isinstance(owner, str) and getattr(__obj, "__name__", "") == "join" and args:  # reflection: as above
            items = list(args[0])
            budget().check(sum(text_size(i) for i in items) + len(owner) * len(items), "str.join")
            args = (items, *args[1:])
        elif isinstance(owner, str):
            estimate = _str_method_estimate(owner, getattr(__obj, "__name__", ""), args, kwargs)  # reflection: as above
            if estimate is not None:
                budget().check(estimate, f"str.{__obj.__name__}")
        result = SandboxedEnvironment.call(__self, __context, __obj, *args, **kwargs)
        budget().spend(_units(result), f"{getattr(__obj, '__name__', 'a call')}()")  # reflection: its name, if any
        return result

    def guard_iterable(self, iterable: Any) -> Iterator[Any]:
        return _counted(iterable)

    def guard_concat(self, eval_ctx: nodes.EvalContext, items: tuple[Any, ...]) -> str:
        budget().spend(sum(text_size(i) for i in items), "a ~ concatenation")
        return markup_join(items) if eval_ctx.autoescape else str_join(items)


def _binop_estimate(operator: str, left: Any, right: Any) -> int:
    sized = (str, list, tuple)
    if operator == "*":
        for seq, times in ((left, right), (right, left)):
            if isinstance(seq, sized) and isinstance(times, int) and not isinstance(times, bool):
                return _units(seq) * max(times, 0)
    if operator == "+" and isinstance(left, sized) and isinstance(right, sized):
        return _units(left) + _units(right)
    if operator == "%" and isinstance(left, str):
        return _printf_estimate(left, right if isinstance(right, tuple) else (right,))
    return 0


# Filters that turn their value into text (str() of a container first), and the extra text their
# arguments can add; and filters that turn a string into one element per character.
_TEXT_FILTERS = frozenset(
    "capitalize center e escape forceescape format indent lower pprint replace safe string striptags "
    "title trim truncate upper urlencode urlize wordwrap xmlattr tojson join".split()
)
_SEQUENCE_FILTERS = frozenset("list batch slice map select reject unique sort groupby dictsort".split())


def _filter_estimate(name: str, value: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    """An upper bound (or close) on the characters filter ``name`` builds from ``value``."""
    if name == "join":
        sep = args[0] if args else kwargs.get("d", "")
        return sum(text_size(i) for i in value) + text_size(sep) * len(value)
    size = text_size(value)
    if name == "format":
        return _printf_estimate(value if isinstance(value, str) else "", args or (kwargs,))
    if name == "center":
        width = args[0] if args else kwargs.get("width", 80)
        return max(size, width if isinstance(width, int) else 0)
    if name == "indent":
        width = args[0] if args else kwargs.get("width", 4)
        pad = len(width) if isinstance(width, str) else width if isinstance(width, int) else 0
        lines = value.count("\n") + 1 if isinstance(value, str) else size
        return size + max(pad, 0) * lines
    if name == "wordwrap":
        wrap = kwargs.get("wrapstring", args[2] if len(args) > 2 else "\n")
        return size * (1 + len(wrap) if isinstance(wrap, str) else 2)
    if name == "replace" and isinstance(value, str):
        return _str_method_estimate(value, "replace", tuple(args), kwargs) or size
    if name == "tojson":
        indent = args[1] if len(args) > 1 else kwargs.get("indent")  # tojson(ensure_ascii, indent, ...)
        if indent is not None and (not isinstance(indent, int) or not 0 <= indent <= MAX_JSON_INDENT):
            raise ChatTemplateError(f"chat template: tojson indent {indent!r} (at most {MAX_JSON_INDENT})")
        return size * (1 + (indent or 0))
    if name in ("e", "escape", "forceescape", "urlencode", "urlize"):
        return size * 6  # '&' -> '&amp;', a byte -> '%XX', a URL -> an <a href> tag
    return size


def _guarded_filter(name: str, func: Any) -> Any:
    """``func`` with its output (and for text filters, its work) counted against the render's budget.
    The wrapper keeps jinja's pass_context/pass_environment marker (copied by functools.wraps)."""
    # reflection: jinja marks pass_context/pass_environment filters with this attribute
    value_at = 1 if getattr(func, "jinja_pass_arg", None) is not None else 0

    @functools.wraps(func)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        if len(args) > value_at:
            value = args[value_at]
            if name == "join" and not isinstance(value, str):
                value = list(value)
                args = (*args[:value_at], value, *args[value_at + 1 :])
            if name in _TEXT_FILTERS:
                budget().check(_filter_estimate(name, value, args[value_at + 1 :], kwargs), f"filter {name}")
            elif name in _SEQUENCE_FILTERS and isinstance(value, str):
                budget().check(len(value) * ELEMENT_UNITS, f"filter {name}")
        result = func(*args, **kwargs)
        budget().spend(_units(result), f"filter {name}")
        return result

    return guarded


__all__ = ["BoundedSandbox", "MAX_BUILT_UNITS", "MAX_LOOP_ITEMS", "MAX_TEMPLATE_RANGE", "end_render", "start_render"]
