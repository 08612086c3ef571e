"""Render a chat (a list of messages) to a prompt with the model's Jinja2 chat template.

The template comes from the GGUF file (``tokenizer.chat_template``) and is untrusted input: it runs in
Jinja2's ``ImmutableSandboxedEnvironment``, which blocks attribute access such as
``().__class__.__mro__`` (llama-cpp-python rendered templates unsandboxed: CVE-2024-34359).
The environment matches the one Hugging Face transformers uses (``trim_blocks``, ``lstrip_blocks``,
``raise_exception``, ``strftime_now``, ``tojson``), so a template renders the same here as in
``apply_chat_template``.
"""
from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

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


@lru_cache(maxsize=8)
def _compile(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(template)


def render_chat(
    template: str | None,
    messages: list[dict],
    add_generation_prompt: bool = True,
    bos_token: str = "",
    eos_token: str = "",
    **extra,
) -> str:
    """Prompt text for ``messages`` (``[{"role": "user", "content": "hi"}, ...]``).

    template: Jinja2 source; None or "" uses ``CHATML_TEMPLATE``.
    add_generation_prompt: end with the header of an assistant turn.
    bos_token / eos_token: the strings templates may insert (``{{ bos_token }}``).
    extra: more template variables (e.g. ``tools``), passed through.
    Raises PyinferError (one line) on a syntax error, a sandbox violation or ``raise_exception``.
    """
    if not template:
        template = CHATML_TEMPLATE
    try:
        tmpl = _compile(template)
        return tmpl.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=bos_token,
            eos_token=eos_token,
            **extra,
        )
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
