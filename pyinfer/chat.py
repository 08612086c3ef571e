"""Render a chat (a list of messages) to a prompt with the model's Jinja2 chat template.

The template comes from the GGUF file (``tokenizer.chat_template``) and is untrusted input: it runs in
Jinja2's ``ImmutableSandboxedEnvironment``, which blocks attribute access such as
``().__class__.__mro__`` (llama-cpp-python rendered templates unsandboxed: CVE-2024-34359).
The environment matches the one Hugging Face transformers uses (``trim_blocks``, ``lstrip_blocks``,
``raise_exception``, ``strftime_now``, ``tojson``), so a template renders the same here as in
``apply_chat_template``.

The sandbox stops code execution, not work: a template can still loop for hours or build a string
of gigabytes. ``_BoundedEnvironment`` bounds that: ``range`` of at most MAX_RANGE items, no
``lipsum``, ``**`` / ``*`` / ``+`` / ``%`` and every call refused when their result would be huge,
and rendering itself runs under a step and time budget (a line tracer on the template's own frames)
with its output capped (RenderLimits). Each limit raises PyinferError; a real chat template stays
orders of magnitude below all of them.
"""
from __future__ import annotations

import json
import re
import sys
import time
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace

from .errors import PyinferError

#: Used when the GGUF file has no chat template (ChatML, as SmolLM2 and Qwen write it).
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class _TemplateError(Exception):
    """Raised by a template's own ``raise_exception(...)`` call."""


def _raise_exception(message):
    raise _TemplateError(message)


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # transformers overrides Jinja's tojson: no HTML escaping, unicode kept.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


#: Most items ``range()`` gives a template (Jinja's own sandbox allows 100,000).
MAX_RANGE = 10_000
#: Largest string or list one template expression may build, and largest integer argument of a
#: call (``"x".center(n)``, ``lipsum(n=...)``, ``indent(n)``): in characters or items.
MAX_VALUE = 1 << 22
#: Largest integer a template may compute with ``**``, in bits.
MAX_INT_BITS = 4096
#: A format string (``%`` or ``str.format``) with a number this long asks for a huge width.
_HUGE_WIDTH = re.compile(r"\d{7,}|\*")


@dataclass(frozen=True)
class RenderLimits:
    """Budget of one rendering: template lines executed, seconds of the rendering thread's own
    CPU time (wall-clock time counted other threads' work too: under a busy server a template
    well inside the budget alone was refused as hostile), with ``wall_seconds`` as a backstop,
    and output characters (``output_base`` plus ``output_per_input`` times the characters of the
    messages)."""

    steps: int = 1_000_000
    seconds: float = 2.0
    wall_seconds: float = 20.0
    output_base: int = 1 << 20
    output_per_input: int = 4


class _TemplateLimit(Exception):
    """A template went over a RenderLimits / _BoundedEnvironment bound."""


def _size(v) -> int:
    return len(v) if isinstance(v, (str, list, tuple, dict)) else 0


def _check_value(v):
    if _size(v) > MAX_VALUE:
        raise _TemplateLimit(f"a value of more than {MAX_VALUE} characters or items")
    return v


#: Filters, string methods and globals whose integer arguments are sizes of what they build
#: (``"x".center(n)``, ``indent(n)``, ``lipsum(n=...)``): those are bounded by MAX_VALUE; any
#: other integer argument is a value (an order id of 12,345,678 through ``tojson`` or ``string``
#: in a tool call was refused as hostile).
_SIZE_ARGS = frozenset({"center", "ljust", "rjust", "zfill", "expandtabs", "indent", "wordwrap",
                        "batch", "slice", "truncate", "lipsum", "join", "replace"})


def _check_args(args, kwargs, sizes: bool = True) -> None:
    for a in (*args, *kwargs.values()):
        if sizes and isinstance(a, int) and not isinstance(a, bool) and abs(a) > MAX_VALUE:
            raise _TemplateLimit(f"an argument larger than {MAX_VALUE} ({a})")
        _check_value(a)


def _check_format(fmt, style: str = "%") -> None:
    """Refuse a format with a huge or computed width: ``style`` "%" for ``%`` and the
    ``format`` filter ("%0*d", "%9999999d"), "{}" for ``str.format`` ("{:>9999999}"; there
    "*" is a fill character: "{:*^30}" and Markdown's "**50%**" are fine)."""
    if not isinstance(fmt, str) or not _HUGE_WIDTH.search(fmt.replace("%%", "")):
        return
    spec = (r"%[-+ #0]*(\*|\d+)?(?:\.(\*|\d+))?" if style == "%"
            else r"\{[^{}]*:[^{}]*?(\d+)[^{}]*\}")
    for m in re.finditer(spec, fmt):
        for width in m.groups():  # width, precision, or a {:...} spec's first number
            if width == "*" or (width and int(width) > MAX_VALUE):
                raise _TemplateLimit("a format with a huge or computed width")


def _safe_range(*args):
    r = range(*args)
    if len(r) > MAX_RANGE:
        raise _TemplateLimit(f"range() of more than {MAX_RANGE} items")
    return r


class _BoundedNamespace(Namespace):
    """``namespace()`` whose attributes cannot grow past MAX_VALUE (a loop doubling ``ns.s``)."""

    def __setitem__(self, name, value):
        super().__setitem__(name, _check_value(value))


def _bounded_filter(f, sizes: bool = True):
    def wrapper(*args, **kwargs):
        _check_args(args, kwargs, sizes)
        if f is _FORMAT_FILTER and args:  # "%9999999d"|format(1)
            _check_format(args[0])
        return _check_value(f(*args, **kwargs))

    for attr in ("jinja_pass_arg",):  # keep @pass_context / @pass_environment markers
        if hasattr(f, attr):
            setattr(wrapper, attr, getattr(f, attr))
    return wrapper


_FORMAT_FILTER = jinja2.filters.FILTERS["format"]


class _BoundedEnvironment(ImmutableSandboxedEnvironment):
    """The immutable sandbox with every way of making a huge value bounded (module docstring)."""

    intercepted_binops = frozenset(["**", "*", "+", "%"])

    def call_binop(self, context, op, left, right):
        if op == "**":
            if isinstance(left, int) and isinstance(right, int) and right > 0 and abs(left) > 1 \
                    and right * abs(left).bit_length() > MAX_INT_BITS:
                raise _TemplateLimit(f"a number of more than {MAX_INT_BITS} bits")
            return _check_value(left ** right)
        if op == "*":
            for seq, n in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(n, int) and max(len(seq), 1) * n > MAX_VALUE:
                    raise _TemplateLimit(f"a value of more than {MAX_VALUE} characters or items")
            return left * right
        if op == "%":
            if isinstance(left, str):
                _check_format(left)
            return _check_value(left % right)
        if op == "+":
            if _size(left) + _size(right) > MAX_VALUE:
                raise _TemplateLimit(f"a value of more than {MAX_VALUE} characters or items")
            return left + right
        return super().call_binop(context, op, left, right)

    def getattr(self, obj, attribute):
        if isinstance(obj, str) and attribute in ("format", "format_map"):  # "{:>9999999}".format(1)
            _check_format(obj, "{}")
        return super().getattr(obj, attribute)

    def getitem(self, obj, argument):
        if isinstance(obj, str) and argument in ("format", "format_map"):
            _check_format(obj, "{}")
        return super().getitem(obj, argument)

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 - Jinja's own signature
        _check_args(args, kwargs, getattr(__obj, "__name__", None) in _SIZE_ARGS)
        return _check_value(super().call(__context, __obj, *args, **kwargs))


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` renders its body: the tag transformers' chat
    templates use to mark the assistant's tokens for training masks (its AssistantTracker);
    without it such a template did not compile and the model could not chat."""

    tags = {"generation"}

    def parse(self, parser):
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


@lru_cache(maxsize=8)
def _compile(template: str) -> jinja2.Template:
    env = _BoundedEnvironment(trim_blocks=True, lstrip_blocks=True,
                              extensions=["jinja2.ext.loopcontrols", _GenerationTag])
    env.filters = {name: _bounded_filter(f, name in _SIZE_ARGS) for name, f in env.filters.items()}
    env.filters["tojson"] = _bounded_filter(_tojson, False)
    env.globals.pop("lipsum", None)  # lorem ipsum generator: no template needs it, lipsum(n=10**7) costs
    env.globals["range"] = _safe_range
    env.globals["namespace"] = _BoundedNamespace
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(template)


class _Budget:
    """A line tracer for the template's compiled code (filename "<template>"): counts executed
    lines and checks the clock, so loops with no calls in them are bounded too."""

    def __init__(self, limits: RenderLimits):
        self.steps = limits.steps
        self.limits = limits
        self.cpu_deadline = time.thread_time() + limits.seconds
        self.wall_deadline = time.monotonic() + limits.wall_seconds

    def check_time(self) -> None:
        """_TemplateLimit past the CPU budget (or the wall-clock backstop)."""
        if time.thread_time() > self.cpu_deadline:
            raise _TemplateLimit(f"more than {self.limits.seconds:g} s")
        if time.monotonic() > self.wall_deadline:
            raise _TemplateLimit(f"more than {self.limits.wall_seconds:g} s of waiting")

    def global_trace(self, frame, event, arg):
        if frame.f_code.co_filename == "<template>":
            return self.local_trace
        return None

    def local_trace(self, frame, event, arg):
        if event == "line":
            self.steps -= 1
            if self.steps < 0:
                raise _TemplateLimit("too many steps")
            if self.steps & 1023 == 0:
                self.check_time()
        return self.local_trace


#: Deepest nesting of lists and dicts a chat's messages and template variables may have (a
#: tool's JSON schema is a few levels; a request nested 500 deep overflowed Python's stack).
MAX_MESSAGE_DEPTH = 64


def _text_size(x) -> int:
    """Characters of the strings in a (nested) message structure, walked without recursion.
    Raises PyinferError past MAX_MESSAGE_DEPTH levels."""
    size, todo = 0, [(x, 0)]
    while todo:
        v, depth = todo.pop()
        if isinstance(v, str):
            size += len(v)
        elif isinstance(v, (dict, list, tuple)):
            if depth >= MAX_MESSAGE_DEPTH:
                raise PyinferError(f"the messages or template variables are nested more than "
                                   f"{MAX_MESSAGE_DEPTH} levels deep")
            items = [w for kv in v.items() for w in kv] if isinstance(v, dict) else v
            todo.extend((w, depth + 1) for w in items)
        else:
            size += 8
    return size


def _render_bounded(tmpl: jinja2.Template, limits: RenderLimits, max_out: int,
                    variables: dict) -> str:
    budget = _Budget(limits)
    old = sys.gettrace()
    sys.settrace(budget.global_trace)
    try:
        parts, n = [], 0
        for piece in tmpl.generate(variables):  # (a dict: any name is a template variable)
            n += len(piece)
            if n > max_out:
                raise _TemplateLimit(f"an output of more than {max_out} characters")
            budget.check_time()
            parts.append(piece)
        return "".join(parts)
    finally:
        sys.settrace(old)


#: Names the renderer defines itself (the template's inputs and the sandbox's functions): a
#: ``chat_template_kwargs`` key may not be one of them.
RENDER_NAMES = frozenset({"messages", "add_generation_prompt", "bos_token", "eos_token", "tools",
                          "documents", "raise_exception", "strftime_now", "range", "namespace",
                          "self"})  # (Jinja's own name for the template)


def template_kwargs(value, name: str = "chat_template_kwargs") -> dict:
    """The extra variables of a chat template (llama.cpp's and vLLM's ``chat_template_kwargs``,
    e.g. Qwen3's ``{"enable_thinking": false}``) checked: None gives {}; otherwise a dict whose
    keys are identifiers other than ``RENDER_NAMES``. Returns a copy. Raises PyinferError (one
    line, naming ``name``) for anything else."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise PyinferError(f"{name} must be a JSON object, e.g. '{{\"enable_thinking\": false}}'")
    for k in value:
        if not isinstance(k, str) or not k.isidentifier():
            raise PyinferError(f"{name}: {k!r} is not a template variable name")
        if k in RENDER_NAMES:
            raise PyinferError(f"{name}: {k!r} is set by the renderer itself")
    return dict(value)


def _not_json(constant: str):
    raise ValueError(f"{constant} is not JSON")


def parse_template_kwargs(text: str, name: str = "--chat-template-kwargs") -> dict:
    """``template_kwargs`` of a JSON object given as text (a command-line flag). Raises
    PyinferError (one line) for text that is not JSON (NaN and Infinity included) or not such an
    object."""
    try:
        value = json.loads(text, parse_constant=_not_json)
    except ValueError as e:
        raise PyinferError(f"{name} is not valid JSON ({e})") from None
    return template_kwargs(value, name)


_PROBE = "pyinfer-typed-content-probe"


@lru_cache(maxsize=8)
def wants_typed_content(template: str | None) -> bool:
    """True for a template that shows a message's text only when its content is a list of
    OpenAI's parts (SmolVLM's loops over ``message['content']``: a string's characters gave
    nothing): a user message rendered once as a string and once as one text part, as llama.cpp's
    minja tells such templates (its ``requires_typed_content`` capability). Contents are
    joined into strings for every other template, as llama.cpp joins them. False where the
    probe does not render."""
    if not template:
        return False
    try:
        as_text = render_chat(template, [{"role": "user", "content": _PROBE}])
        as_part = render_chat(template, [{"role": "user",
                                          "content": [{"type": "text", "text": _PROBE}]}])
    except PyinferError:
        return False
    return _PROBE not in as_text and _PROBE in as_part


#: The names templates read an assistant's reasoning by: llama.cpp's server sets both
#: reasoning_content and thinking (gpt-oss's template reads "thinking"), transformers aliases all
#: three (its _alias_reasoning_fields).
_REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")


def _with_reasoning_aliases(m: dict) -> dict:
    """``m`` with its reasoning text under each name of _REASONING_KEYS it lacks (the first
    present is the text); unchanged when it has none."""
    text = next((m[k] for k in _REASONING_KEYS if k in m), None)
    if text is None:
        return m
    return {**{k: text for k in _REASONING_KEYS}, **m}


def render_chat(
    template: str | None,
    messages: list[dict],
    add_generation_prompt: bool = True,
    bos_token: str = "",
    eos_token: str = "",
    limits: RenderLimits = RenderLimits(),
    variables: dict | None = None,
    **extra,
) -> str:
    """Prompt text for ``messages`` (``[{"role": "user", "content": "hi"}, ...]``).

    template: Jinja2 source; None or "" uses ``CHATML_TEMPLATE``.
    add_generation_prompt: end with the header of an assistant turn.
    bos_token / eos_token: the strings templates may insert (``{{ bos_token }}``).
    extra, variables: more template variables (e.g. ``tools``), passed through; ``variables``
    (a dict, ``template_kwargs``'s) may also hold names this function's arguments have
    (``limits``, ``template``).
    limits: the step, time and output budget (RenderLimits).
    Raises PyinferError (one line) on a syntax error, a sandbox violation, ``raise_exception``, or a
    template that goes over a limit (too slow, too much output, a huge number or string).
    """
    if not template:
        template = CHATML_TEMPLATE
    # as transformers' apply_chat_template: keys set to None are left out of a message (a
    # "content": None renders as nothing, not "None"), and tools / documents are always defined
    messages = [_with_reasoning_aliases({k: v for k, v in m.items() if v is not None})
                if isinstance(m, dict) else m for m in messages]
    extra = {**extra, **(variables or {})}
    max_out = limits.output_base + limits.output_per_input * _text_size([messages, extra])
    try:
        tmpl = _compile(template)
        return _render_bounded(tmpl, limits, max_out, {
            "tools": None, "documents": None, **extra,
            "messages": messages, "add_generation_prompt": add_generation_prompt,
            "bos_token": bos_token, "eos_token": eos_token})
    except _TemplateLimit as e:
        raise PyinferError(f"chat template refused: it needs {e} (a hostile or broken template)") from None
    except RecursionError:
        raise PyinferError("chat template refused: it recurses too deeply") from None
    except MemoryError:
        raise PyinferError("chat template refused: it ran out of memory") from None
    except _TemplateError as e:
        raise PyinferError(f"chat template: {_one_line(e)}") from None
    except jinja2.exceptions.SecurityError as e:
        raise PyinferError(f"chat template tried an unsafe operation: {_one_line(e)}") from None
    except jinja2.TemplateError as e:
        raise PyinferError(f"chat template error: {_one_line(e)}") from None
    except Exception as e:  # noqa: BLE001 - a template can raise anything (TypeError, KeyError ...)
        raise PyinferError(f"chat template error: {type(e).__name__}: {_one_line(e)}") from None


def _one_line(e: BaseException) -> str:
    s = str(e).strip()
    return s.splitlines()[0] if s else type(e).__name__
