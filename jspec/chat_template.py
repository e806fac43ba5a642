"""Chat templates: rendered as transformers renders them (the same sandboxed Jinja environment,
filters, globals but `lipsum`, and variables), so the prompt text is identical, and within a bound,
since a template comes with a model's files and may be crafted.

A render takes at most `TEMPLATE_STEPS` steps (loop iterations and calls: macros, methods,
recursive loops) and `TEMPLATE_SECONDS` seconds; each string or list it builds (`*`, `+`, `~`,
`%`, calls, filters; `join`, `replace`, `indent`, `format` checked before they run) and the text
it renders hold at most `TEMPLATE_CHARS` items plus twice the messages' JSON length; a number
passed to a call or a filter (a width, a count) is at most `TEMPLATE_CHARS`; `*` and `**` make
integers of 4096 bits at most. Past that, or failing otherwise: one line.
"""

from __future__ import annotations

import contextvars
import dataclasses
import datetime
import functools
import json
import re
import time
from typing import Sequence

import jinja2
import jinja2.ext
from jinja2 import nodes
from jinja2.nodes import EvalContext
from jinja2.runtime import Context, LoopContext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.visitor import NodeTransformer

from jspec.errors import JspecError, first_line

TEMPLATE_STEPS = 1_000_000
TEMPLATE_SECONDS = 5.0
TEMPLATE_CHARS = 2**24


def render(template: str, messages: Sequence[dict], add_generation_prompt: bool, variables: dict) -> str:
    """The text `template` renders for `messages` (None values already dropped), with
    `variables` (the special tokens: bos_token, eos_token, ...) defined; a JspecError in one line
    when the template refuses them, fails or goes past the bound."""
    budget = _Budget(TEMPLATE_STEPS, time.monotonic() + TEMPLATE_SECONDS,
                     TEMPLATE_CHARS + 2 * len(json.dumps(messages, default=str)))
    token = _BUDGET.set(budget)
    try:
        pieces, length = [], 0
        for piece in _compile(template).generate(
                messages=messages, tools=None, documents=None, add_generation_prompt=add_generation_prompt,
                **variables):
            length += len(piece)
            budget.check(length, "the rendered text")
            pieces.append(piece)
        return "".join(pieces)
    except _OverBound as e:
        raise JspecError(f"the chat template went past jspec's bound: {e}") from None
    except jinja2.TemplateError as e:
        raise JspecError(f"the chat template refused the messages: {first_line(e)}") from None
    except Exception as e:  # noqa: BLE001 - a template can make Python raise anything (1 + "a", RecursionError)
        raise JspecError(f"the chat template failed on the messages: "
                         f"{type(e).__name__}: {first_line(e)}") from None
    finally:
        _BUDGET.reset(token)


# -- the Jinja environment transformers renders them in ------------------------------------------

class _Generation(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; rendering
    keeps its body (transformers' AssistantTracker does the same when not tracking)."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # Jinja's own tojson escapes HTML characters (<, >, &, '), which would change the prompt.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


@functools.cache
def _compile(template: str) -> jinja2.Template:
    # Templates come with model files: the sandbox keeps them from reaching Python internals, the
    # bound (module docstring) from running without end.
    env = _BoundedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols])
    env.filters = {name: _bounded_filter(name, f) for name, f in {**env.filters, "tojson": _tojson}.items()}
    # pass_context: so never run at compile time (folding constants), when there is no budget to count against.
    env.filters["jspec_counted"] = jinja2.pass_context(lambda context, iterable: _counting(iterable, _current()))
    env.filters["jspec_sized"] = jinja2.pass_context(lambda context, value: _current().sized(value))
    env.globals |= {"raise_exception": _raise_exception, "strftime_now": _strftime_now}
    del env.globals["lipsum"]  # placeholder text, in a Python loop no step of the bound would count
    try:
        tree = _Counting().visit(env.parse(template))
        tree.set_environment(env)
        return env.from_string(tree)
    except (jinja2.TemplateSyntaxError, RecursionError) as e:  # RecursionError: nested past the parser's depth
        raise JspecError(f"the model's chat template is not valid Jinja: {first_line(e)}") from None


# -- the bound on a template's work (TEMPLATE_STEPS, TEMPLATE_SECONDS, TEMPLATE_CHARS) --------------

# A %-style or {}-style conversion asking for a width or precision of eight digits or more.
_WIDE_FORMAT = re.compile(r"%[-+ #0]*\d{8,}|%[-+ #0]*\d*\.\d{8,}|\{[^{}]*:[^{}]*\d{8,}")


class _OverBound(Exception):
    """A chat template went past its bound; the message says which part."""


@dataclasses.dataclass
class _Budget:
    steps: int  # left in this render
    deadline: float  # time.monotonic() at which the render is stopped
    chars: int  # the most items a string or list it builds may hold

    def step(self) -> None:
        self.steps -= 1
        if self.steps < 0:
            raise _OverBound(f"it took more than {TEMPLATE_STEPS:,} steps (loop iterations and calls)")
        if time.monotonic() > self.deadline:
            raise _OverBound(f"it ran for more than {TEMPLATE_SECONDS:g} seconds")

    def check(self, length: int, what: str) -> None:
        if length > self.chars:
            raise _OverBound(f"{what} would hold more than {self.chars:,} characters or items")

    def sized(self, value):
        if isinstance(value, str | list | tuple | dict):
            self.check(len(value), "a string or list it built")
        return value


_BUDGET: contextvars.ContextVar[_Budget] = contextvars.ContextVar("the chat template's budget")


def _current() -> _Budget:  # outside a render (Jinja folding constants as it compiles): a fresh one
    return _BUDGET.get(None) or _Budget(TEMPLATE_STEPS, float("inf"), TEMPLATE_CHARS)


def _counting(iterable, budget: _Budget):
    for item in iterable:
        budget.step()
        yield item


class _Counting(NodeTransformer):
    """Sends every for loop's items through `_counting` and every `~`'s result through `_Budget.sized`."""

    def visit_For(self, node: nodes.For) -> nodes.For:
        node = self.generic_visit(node)
        node.iter = nodes.Filter(node.iter, "jspec_counted", [], [], None, None, lineno=node.lineno)
        return node

    def visit_Concat(self, node: nodes.Concat) -> nodes.Filter:
        return nodes.Filter(self.generic_visit(node), "jspec_sized", [], [], None, None, lineno=node.lineno)


def _check_numbers(values) -> None:
    for v in values:
        if type(v) is int and abs(v) > TEMPLATE_CHARS:
            raise _OverBound(f"it passed a number above {TEMPLATE_CHARS:,} to a call or filter")


def _grown(name: str, text, args: tuple, kwargs: dict) -> int:
    """How long `text.name(*args, **kwargs)` (or the filter `name` on `text`) would be, for those
    that can build a string far longer than their arguments; 0 for the others."""
    if not isinstance(text, str) or name not in ("format", "format_map", "replace", "indent", "expandtabs"):
        return 0
    if name.startswith("format"):
        return TEMPLATE_CHARS * 2**10 if _WIDE_FORMAT.search(text) else 0
    if name == "replace":
        old, new = (*args, "", "")[:2]
        if not (isinstance(old, str) and isinstance(new, str)):
            return 0
        return len(text) + (text.count(old) if old else len(text) + 1) * len(new)
    width = kwargs.get("width", kwargs.get("tabsize", args[0] if args else 0))  # indent's may be a string
    width = len(width) if isinstance(width, str) else width if type(width) is int else 0
    return len(text) + (text.count("\n") + 1 if name == "indent" else text.count("\t")) * width


def _joined(separator, items) -> list:
    """`items` as a list, refused if joining them with `separator` would pass the bound."""
    items = list(items)
    separator = separator if isinstance(separator, str) else ""
    total = sum(len(x) for x in items if isinstance(x, str)) + len(separator) * max(len(items) - 1, 0)
    _current().check(total, "a string it would join")
    return items


def _bounded_filter(name: str, f):
    """`f` refusing numbers past the bound, and strings it would grow past it, before it runs."""
    @functools.wraps(f)  # (keeps Jinja's mark of what the filter is passed first)
    def bounded(*args, **kwargs):
        skip = 1 if args and isinstance(args[0], Context | EvalContext | jinja2.Environment) else 0
        value, rest = (args[skip] if len(args) > skip else None), args[skip + 1:]
        _check_numbers((*rest, *kwargs.values()))
        if name == "join" and len(args) > skip:
            args = (*args[:skip], _joined(rest[0] if rest else kwargs.get("d", ""), value), *rest)
        else:
            _current().check(_grown(name, value, rest, kwargs), "a string it would build")
        return _current().sized(f(*args, **kwargs))

    return bounded


class _BoundedEnvironment(ImmutableSandboxedEnvironment):
    """transformers' sandbox, every call, recursive loop and growing operator kept within the
    render's `_Budget`."""

    intercepted_binops = frozenset({"*", "+", "**", "%"})  # (intercepted ones are also never folded)

    def call(self, context, obj, /, *args, **kwargs):
        budget = _current()
        budget.step()
        _check_numbers((*args, *kwargs.values()))
        method = getattr(obj, "__wrapped__", obj)  # the sandbox hands out str.format wrapped
        owner, name = getattr(method, "__self__", None), getattr(method, "__name__", "")
        if isinstance(obj, LoopContext) and args:  # `loop(children)` in a recursive loop
            args = (_counting(args[0], budget), *args[1:])
        elif isinstance(owner, str) and name == "join" and args:
            args = (_joined(owner, args[0]), *args[1:])
        else:
            budget.check(_grown(name, owner, args, kwargs), "a string it would build")
        return budget.sized(super().call(context, obj, *args, **kwargs))

    def call_binop(self, context, operator, left, right):
        budget, sequence = _current(), str | list | tuple
        if type(left) is int and type(right) is int:
            bits = {"*": left.bit_length() + right.bit_length(), "**": right * (abs(left) > 1) * left.bit_length()}
            if bits.get(operator, 0) > 4096:
                raise _OverBound("it computed a number of more than 4096 bits")
        if operator == "*":
            for items, times in ((left, right), (right, left)):
                if isinstance(items, sequence) and type(times) is int:
                    budget.check(len(items) * times, "a string or list it would repeat")
        elif operator == "+" and isinstance(left, sequence) and isinstance(right, sequence):
            budget.check(len(left) + len(right), "a string or list it would add up")
        elif operator == "%" and isinstance(left, str):
            _check_numbers(right if isinstance(right, tuple) else (right,))
            budget.check(_grown("format", left, (), {}), "a string it would format")
        return budget.sized(super().call_binop(context, operator, left, right))
