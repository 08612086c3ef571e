"""Tool calling (OpenAI's ``tools`` / ``tool_choice``) for chat completions.

A request's ``tools`` are OpenAI's function definitions::

    [{"type": "function", "function": {"name", "description"?, "parameters"?: JSON schema}}]

How the model is asked, and how its answer is read, follows llama.cpp's server (common/chat.cpp),
in one of two formats chosen by the chat template:

- **hermes**: a template that writes ``<tool_call>`` itself (Qwen2.5, Qwen3, Hermes 2/3,
  SmolLM3 ...) gets the tools as its ``tools`` variable and describes them in its own words;
  the answer's ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks are its tool
  calls and the text outside them its content (what transformers' ``parse_response`` does with
  the Qwen family's response template). ``tool_choice`` "required" (or a named function)
  constrains the answer to such blocks holding a call of a given tool with arguments of its
  schema (through llguidance, ``pyinfer.grammar``); "auto" leaves the model free.
- **generic**: any other template (SmolLM2's, Llama's ...). As llama.cpp's generic format, the
  answer is constrained to one JSON object, ``{"tool_call": {"name", "arguments"}}`` (with
  ``parallel_tool_calls``: ``{"tool_calls": [...]}``) or, unless a call is required,
  ``{"response": "text"}``; a system message asks for that JSON (llama.cpp's sentence) and,
  where the template does not read ``tools``, lists the tools as JSON.

Earlier assistant tool calls and tool results are written back as JSON where the template does
not read them, whether or not the request has tools (``template_messages``, as llama.cpp's
template polyfills do). A tool's ``parameters`` keep their own ``$defs``/``$ref`` (moved under
the answer's schema); objects that list their properties take no others (``closed``, llama.cpp's
default); keywords llguidance does not implement are left unenforced (lenient), as llama.cpp's
converter leaves them. ``ToolStream`` gives a streamed answer's text for the user as it comes.

``tool_choice`` "none" (or no tools) is a plain chat: the tools are not shown to the model.
Call ids are made here (``call_`` and 24 hex digits), as llama.cpp makes them for models that
write none.
"""
from __future__ import annotations

import functools
import json
import re
import uuid
from dataclasses import dataclass

from pyinfer.errors import PyinferError
from pyinfer.reasoning import partial_suffix

#: llama.cpp's system text for its generic format (common_chat_params_init_generic)
GENERIC_INSTRUCTION = ("Respond in JSON format, either with `tool_call` (a request to call tools) "
                       "or with `response` reply to the user's request")
TOOL_CHOICES = ("none", "auto", "required")
#: OpenAI's rule for function names
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_HERMES_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
MAX_TOOLS = 128  # OpenAI's limit


class ToolError(PyinferError):
    """A malformed ``tools`` / ``tool_choice`` / ``parallel_tool_calls``; ``param`` names which."""

    def __init__(self, message: str, param: str = "tools"):
        super().__init__(message)
        self.param = param


def new_call_id() -> str:
    """An OpenAI-style call id: ``call_`` and 24 hex digits."""
    return f"call_{uuid.uuid4().hex[:24]}"


def tool_format(template: str | None) -> str:
    """"hermes" for a chat template that writes ``<tool_call>`` blocks itself, else "generic"."""
    return "hermes" if template and "<tool_call>" in template else "generic"


def _check_tools(tools) -> list[dict]:
    if not isinstance(tools, (list, tuple)):
        raise ToolError("tools must be a list of {\"type\": \"function\", \"function\": {...}} objects")
    if len(tools) > MAX_TOOLS:
        raise ToolError(f"tools has {len(tools)} entries, more than {MAX_TOOLS} (OpenAI's limit)")
    out, names = [], set()
    for i, t in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("function"), dict):
            raise ToolError(f"{where} must be {{\"type\": \"function\", \"function\": {{\"name\", "
                               "\"description\", \"parameters\"}}")
        f = t["function"]
        name = f.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise ToolError(f"{where}.function.name must be 1-64 letters, digits, '_' or '-'")
        if name in names:
            raise ToolError(f"{where}.function.name {name!r} is given twice")
        names.add(name)
        if f.get("description") is not None and not isinstance(f["description"], str):
            raise ToolError(f"{where}.function.description must be a string")
        params = f.get("parameters")
        if params is None:
            params = {"type": "object", "properties": {}}
        if not isinstance(params, dict):
            raise ToolError(f"{where}.function.parameters must be a JSON schema object")
        fn = {"name": name, "description": f["description"]} if f.get("description") is not None else {"name": name}
        out.append({"type": "function", "function": dict(fn, parameters=params)})
    return out


def _check_choice(choice, names: set[str]) -> tuple[str, str | None]:
    """(kind, function name or None) of a ``tool_choice``."""
    if choice is None:
        return "auto", None
    if isinstance(choice, str):
        if choice not in TOOL_CHOICES:
            raise ToolError(f"tool_choice must be one of {', '.join(TOOL_CHOICES)} or "
                               "{\"type\": \"function\", \"function\": {\"name\": ...}}, got "
                               f"{choice!r}", "tool_choice")
        return choice, None
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) and isinstance(
        choice.get("function"), dict) and choice.get("type") == "function" else None
    if not isinstance(name, str):
        raise ToolError("tool_choice must be \"none\", \"auto\", \"required\" or "
                           "{\"type\": \"function\", \"function\": {\"name\": ...}}", "tool_choice")
    if name not in names:
        raise ToolError(f"tool_choice names {name!r}, which is not one of the tools", "tool_choice")
    return "function", name


@dataclass(frozen=True)
class ToolUse:
    """What one request asks of tool calling (``ToolUse.of``); None stands for a plain chat.

    tools: the checked definitions (each ``parameters`` filled in); choice: "auto",
    "required" or "function" (``function`` names the one tool that must be called); parallel:
    more than one call may be made in an answer; format: "hermes" or "generic" (module
    docstring).
    """

    tools: tuple
    choice: str
    parallel: bool
    format: str
    function: str | None = None

    @classmethod
    def of(cls, tools, tool_choice=None, parallel_tool_calls=None,
           template: str | None = None) -> "ToolUse | None":
        """The request's tool use, or None when it has no tools or ``tool_choice`` is "none".
        ``parallel_tool_calls`` None: False (llama.cpp's server default). Raises PyinferError
        (one line) for malformed tools, an unknown choice or a name that is not a tool's."""
        if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
            raise ToolError("parallel_tool_calls must be true or false", "parallel_tool_calls")
        if tools is None:
            if tool_choice not in (None, "none", "auto"):
                raise ToolError("tool_choice needs tools", "tool_choice")
            return None
        checked = _check_tools(tools)
        choice, function = _check_choice(tool_choice, {t["function"]["name"] for t in checked})
        if choice == "none" or not checked:
            if choice not in ("none", "auto"):
                raise ToolError("tool_choice needs tools", "tool_choice")
            return None
        return cls(tuple(checked), choice, bool(parallel_tool_calls), tool_format(template), function)

    @property
    def required(self) -> bool:
        """A call must be made ("required" or a named function)."""
        return self.choice != "auto"

    @property
    def callable_tools(self) -> list[dict]:
        """The tools the answer may call (only the named one when ``tool_choice`` names one)."""
        return [t for t in self.tools if self.function is None or t["function"]["name"] == self.function]

    def _calls_schema(self) -> dict:
        """The schema of one call of a callable tool; each tool's ``parameters`` sits in the
        root's ``$defs`` (its own ``$ref`` pointers rewritten to its new place: llama.cpp
        resolves them too), closed (``closed``); llguidance is lenient about keywords it does
        not implement (``uniqueItems`` ...), as llama.cpp's converter is."""
        calls, defs = [], {}
        for t in self.callable_tools:
            f = t["function"]
            key = f"tool-{f['name']}"
            defs[key] = _moved_refs(closed(f["parameters"]), f"/$defs/{key}")
            calls.append({"type": "object", "properties": {
                "name": {"type": "string", "const": f["name"]}, "arguments": {"$ref": f"#/$defs/{key}"}},
                "required": ["name", "arguments"], "additionalProperties": False})
        one = calls[0] if len(calls) == 1 else {"anyOf": calls}
        return {**one, "$defs": defs, "x-guidance": {"lenient": True}}

    def schema(self) -> dict:
        """The generic format's JSON schema of an answer (llama.cpp's, without the model-written
        call ids, and with no properties beside those named: a small model given the room
        wrote a "response" after its call)."""
        one = self._calls_schema()
        root = {k: one.pop(k) for k in ("$defs", "x-guidance")}
        key, value = (("tool_calls", {"type": "array", "items": one, "minItems": 1}) if self.parallel
                      else ("tool_call", one))
        call = _only(key, value)
        return {**(call if self.required else {"anyOf": [call, _only("response", {"type": "string"})]}),
                **root}

    def grammar(self, thinking_open: bool = False):
        """The ``pyinfer.grammar.Grammar`` the answer is held to, or None (hermes, "auto").
        ``thinking_open``: the prompt opened a ``<think>`` block, which a required call's
        grammar closes first (llama.cpp's ``thinking_forced_open``)."""
        from pyinfer.grammar import Grammar, with_layout

        if self.format == "generic":
            return Grammar.json_schema(self.schema())
        if not self.required:
            return None
        # hermes: one (or, parallel, several) <tool_call> blocks of a call's JSON, nothing else
        call = json.dumps(with_layout(self._calls_schema()))
        block = 'block: "<tool_call>\\n" call "\\n</tool_call>"\n'
        start = "start: " + ('"</think>" /[ \\t\\n]*/ ' if thinking_open else "") + (
            'block ("\\n" block)*\n' if self.parallel else "block\n")
        return Grammar("lark", start + block + f"call: %json {call}\n")

    # ---- the prompt ----------------------------------------------------------------------------
    def definitions(self) -> list[dict]:
        """The template's ``tools`` variable: the checked definitions, as transformers'
        ``apply_chat_template(tools=...)`` passes JSON-schema tools."""
        return [{"type": "function", "function": dict(t["function"])} for t in self.tools]

    def messages(self, messages: list, template: str | None) -> list:
        """``messages`` (``template_messages``'s already) as the template is given them with
        tools: for the generic format, a system message asking for the JSON answer (and
        listing the tools where the template does not read ``tools``); the hermes format's
        templates take them as they are."""
        if self.format == "hermes":
            return list(messages)
        template = template or ""
        text = GENERIC_INSTRUCTION
        if "tools" not in template:
            listing = "\n".join(json.dumps(t["function"], ensure_ascii=False) for t in self.tools)
            text = ("You can call these tools (each a JSON object with its name, description and "
                    f"the JSON schema of its arguments):\n{listing}\n\n{text}")
        out = list(messages)
        if out and isinstance(out[0], dict) and out[0].get("role") == "system" and isinstance(
                out[0].get("content"), str):
            return [dict(out[0], content=f"{out[0]['content']}\n\n{text}")] + out[1:]
        return [{"role": "system", "content": text}] + out

    # ---- the answer ----------------------------------------------------------------------------
    def parse(self, text: str, closed_thinking: bool = False) -> tuple[str | None, list[dict]]:
        """(content, tool_calls) of an answer's text: tool_calls in OpenAI's shape
        ``[{"id", "type": "function", "function": {"name", "arguments": JSON text}}]`` (empty
        when the answer calls none) and the content outside them (None when the answer is only
        calls). Text that does not parse (an answer cut by max_tokens) is all content.
        ``closed_thinking``: the grammar began the answer with ``</think>`` (``grammar``'s
        thinking_open; the text read as written, no reasoning split): not content."""
        if closed_thinking and text.startswith("</think>"):
            text = text[len("</think>"):].lstrip()
        if self.format == "generic":
            try:
                value = json.loads(text)
            except ValueError:  # cut short: the text for the user so far, or the text as it is
                partial = _response_so_far(text)
                return (text if partial is None else partial), []
            if isinstance(value, dict) and isinstance(value.get("response"), str):
                return value["response"], []
            calls = (value.get("tool_calls") if "tool_calls" in value else [value.get("tool_call")]
                     ) if isinstance(value, dict) else None
            made = [_call(c) for c in calls or []]
            if not made or None in made:
                return text, []
            return None, made
        made, pieces, at = [], [], 0
        for mt in _HERMES_BLOCK.finditer(text):
            try:
                c = _call(json.loads(mt.group(1)))
            except ValueError:
                c = None
            if c is None:
                continue  # (a block that is not a call stays in the content)
            made.append(c)
            pieces.append(text[at:mt.start()])
            at = mt.end()
        pieces.append(text[at:])
        if not made:
            return text, []
        # the whitespace around the calls goes (transformers' parser closes the content at
        # \s*<tool_call>); text between or after calls is kept, a line each
        parts = [pieces[0].rstrip()] + [p.strip() for p in pieces[1:]]
        return "\n".join(p for p in parts if p) or None, made


#: how the generic format's answer begins when it is text for the user (pyinfer.grammar's JSON
#: layout: one space after ':')
_RESPONSE_OPEN = '{"response": "'


class ToolStream:
    """The content of a tool-using answer while it streams: ``feed(piece)`` returns the text now
    known to be content (for a delta), ``finish()`` the rest of the content and the calls, so
    that the deltas add up to ``ToolUse.parse`` of the whole answer. Hermes: the text before a
    ``<tool_call>`` (held back where it could begin one, and whitespace that may precede one);
    generic: the string of ``{"response": "..."}`` decoded as it comes (a call's JSON streams
    nothing)."""

    def __init__(self, use: ToolUse, closed_thinking: bool = False):
        self.use = use
        self.closed_thinking = closed_thinking  # (as ToolUse.parse's)
        self.text = ""  # the answer so far
        self.sent = ""  # content given out

    def _known(self) -> str:
        t = self.text
        if self.closed_thinking:
            if len(t) < len("</think>") + 1 and "</think>".startswith(t.rstrip()):
                return ""  # (could still be the forced tag)
            if t.startswith("</think>"):
                t = t[len("</think>"):].lstrip()
        if self.use.format == "hermes":
            at = t.find(_HERMES_OPEN)
            if at < 0:
                at = len(t) - partial_suffix(t, _HERMES_OPEN)
            return t[:at].rstrip()
        return _response_so_far(t) or ""

    def feed(self, piece: str) -> str:
        """The content ``piece`` makes known (possibly ""), for a delta."""
        self.text += piece
        known = self._known()
        if len(known) <= len(self.sent) or not known.startswith(self.sent):
            return ""
        delta, self.sent = known[len(self.sent):], known
        return delta

    def finish(self) -> tuple[str, list[dict]]:
        """(the content not yet given out, the calls) of the whole answer."""
        content, calls = self.use.parse(self.text, self.closed_thinking)
        content = content or ""
        return (content[len(self.sent):] if content.startswith(self.sent) else ""), calls


_HERMES_OPEN = "<tool_call>"


def _response_so_far(text: str) -> str | None:
    """The user's text of a generic-format answer ``{"response": "..."}``, decoded as far as it
    has come (an escape cut short waits), or None for an answer that is not one."""
    if not text.startswith(_RESPONSE_OPEN):
        return None
    body, i = text[len(_RESPONSE_OPEN):], 0
    while i < len(body) and body[i] != '"':  # the string's end: its first unescaped quote
        if body[i] != "\\":
            i += 1
        elif i + 1 < len(body) and body[i + 1] != "u":
            i += 2
        elif i + 6 <= len(body) and not (0xD800 <= _hex(body[i + 2:i + 6]) <= 0xDBFF
                                         and i + 12 > len(body)):
            i += 6  # (a pair's first half waits for its second)
        else:
            break  # an escape cut short: wait for the rest
    try:
        return json.loads('"' + body[:i] + '"')
    except ValueError:
        return None


def _hex(text: str) -> int:
    try:
        return int(text, 16)
    except ValueError:
        return -1


#: schema keywords whose values are schemas (one, a list, or a map of them) that stand alone
_SUB_ONE = ("items", "additionalProperties", "additionalItems", "contains", "propertyNames",
            "unevaluatedProperties", "unevaluatedItems")
_SUB_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
#: keywords whose branches combine with their parent (closing a branch changes what it accepts)
_COMBINING = ("allOf", "not", "if", "then", "else")


def closed(schema, depth: int = 0):
    """``schema`` with ``"additionalProperties": false`` wherever an object schema lists
    ``properties`` and says nothing of other properties (no ``patternProperties``, no
    combination with ``allOf`` / ``anyOf`` / ``oneOf`` / ``if``): llama.cpp's grammars take
    that default (grammars/README.md), llguidance takes JSON Schema's (any other property
    allowed), and a small model given the room writes made-up arguments after the real ones.
    Walks the schema keywords only (a property named "enum" is a property); the branches of
    ``anyOf`` / ``oneOf`` are closed only where their parent lists no properties of its own,
    those of ``allOf``, ``not`` and ``if`` never. Raises ToolError past 64 levels."""
    if depth > 64:
        raise ToolError("a tool's parameters schema is nested too deeply")
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for k in _SUB_ONE:
        if isinstance(schema.get(k), dict):
            out[k] = closed(schema[k], depth + 1)
    if isinstance(schema.get("items"), list):
        out["items"] = [closed(v, depth + 1) for v in schema["items"]]
    if isinstance(schema.get("prefixItems"), list):
        out["prefixItems"] = [closed(v, depth + 1) for v in schema["prefixItems"]]
    for k in _SUB_MAPS:
        if isinstance(schema.get(k), dict):
            out[k] = {n: closed(v, depth + 1) for n, v in schema[k].items()}
    own = isinstance(schema.get("properties"), dict)
    for k in ("anyOf", "oneOf"):
        if not own and isinstance(schema.get(k), list):
            out[k] = [closed(v, depth + 1) for v in schema[k]]
    if own and not any(k in schema for k in ("additionalProperties", "patternProperties",
                                             "unevaluatedProperties", "anyOf", "oneOf",
                                             *_COMBINING)):
        out["additionalProperties"] = False
    return out


def _moved_refs(schema, to: str, depth: int = 0):
    """``schema`` with each local ``$ref`` ("#/..." or "#") pointing under ``to`` (the JSON
    pointer where the schema now sits in a larger one)."""
    if depth > 128:
        raise ToolError("a tool's parameters schema is nested too deeply")
    if isinstance(schema, list):
        return [_moved_refs(v, to, depth + 1) for v in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _moved_refs(v, to, depth + 1) for k, v in schema.items()}
    ref = schema.get("$ref")
    if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
        out["$ref"] = "#" + to + ref[1:]
    return out


def template_messages(messages: list, template: str | None) -> list:
    """``messages`` with their tool parts as ``template`` can read them, with or without tools
    in the request (a last turn after tool results often has none): where it does not read
    ``tool_calls``, an assistant's calls become JSON text, ``{"tool_call": {"name",
    "arguments", "id"}}`` (or ``{"tool_calls": [...]}``, with its ``content`` where it wrote
    text too); where it knows neither calls nor a "tool" role, a result becomes a user message
    ``{"tool_response": {"tool", "tool_call_id", "content"}}`` (the tool's name found from
    the call's id; llama.cpp's template polyfills write these shapes); where it reads calls
    whose arguments it writes as JSON (``arguments | tojson``: Qwen2.5's), arguments sent as
    JSON text (as OpenAI clients send them) are given as the object they stand for, as
    llama.cpp does. Raises ToolError (param "messages") for a call that is not
    ``{"function": {"name", "arguments"}}``."""
    template = template or ""
    reads_calls = "tool_calls" in template
    knows_tool_role = "tool" in template.replace("tools", "").replace("tool_call", "")
    objects = reads_calls and _wants_object_arguments(template)
    names: dict[str, str] = {}
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            out.append(m)
            continue
        calls = m.get("tool_calls")
        if calls:
            calls = _checked_calls(calls, i)
            for c in calls:
                if isinstance(c.get("id"), str):
                    names[c["id"]] = c["function"]["name"]
            if not reads_calls:
                plain = [dict({"name": c["function"]["name"],
                               "arguments": _arguments_value(c["function"].get("arguments"))},
                              **({"id": c["id"]} if isinstance(c.get("id"), str) else {}))
                         for c in calls]
                text = m.get("content") if isinstance(m.get("content"), str) else ""
                body = ({"tool_call": plain[0]} if len(plain) == 1 and not text
                        else dict({"tool_calls": plain}, **({"content": text} if text else {})))
                m = {k: v for k, v in m.items() if k != "tool_calls"}
                m["content"] = json.dumps(body, ensure_ascii=False)
            elif objects:
                m = dict(m, tool_calls=[dict(c, function=dict(
                    c["function"], arguments=_arguments_value(c["function"].get("arguments"))))
                    for c in calls])
        elif m.get("role") == "tool" and not (knows_tool_role or reads_calls):
            call_id = m.get("tool_call_id")
            if call_id is not None and not isinstance(call_id, str):
                raise ToolError(f"messages[{i}].tool_call_id must be a string", "messages")
            result = {"tool": m.get("name") or names.get(call_id), "tool_call_id": call_id,
                      "content": m.get("content")}
            m = {"role": "user", "content": json.dumps(
                {"tool_response": {k: v for k, v in result.items() if v is not None}},
                ensure_ascii=False)}
        out.append(m)
    return out


def _checked_calls(calls, i: int) -> list[dict]:
    where = f"messages[{i}].tool_calls"
    if not isinstance(calls, list):
        raise ToolError(f"{where} must be a list", "messages")
    for j, c in enumerate(calls):
        f = c.get("function") if isinstance(c, dict) else None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str) or not isinstance(
                f.get("arguments", ""), (str, dict)):
            raise ToolError(f"{where}[{j}] must be {{\"type\": \"function\", \"function\": "
                            "{\"name\": str, \"arguments\": JSON text}}", "messages")
    return calls


@functools.lru_cache(maxsize=16)
def _wants_object_arguments(template: str) -> bool:
    """Does ``template`` write a call's arguments as JSON (``| tojson``) when given an object?
    Found by rendering a probe call, as llama.cpp's minja probes a template's capabilities."""
    from pyinfer.chat import render_chat

    probe = [{"role": "user", "content": "x"},
             {"role": "assistant", "content": None, "tool_calls": [
                 {"id": "call_probe", "type": "function",
                  "function": {"name": "probe_tool", "arguments": {"probe_key": "probe_value"}}}]}]
    try:
        return '"probe_key"' in render_chat(template, probe, add_generation_prompt=False)
    except PyinferError:
        return False


def _only(key: str, schema: dict) -> dict:
    """The schema of an object with exactly one property, ``key``."""
    return {"type": "object", "properties": {key: schema}, "required": [key],
            "additionalProperties": False}


def _arguments_value(args):
    """A call's ``arguments`` as the JSON value it stands for (OpenAI sends JSON text)."""
    if isinstance(args, str):
        try:
            return json.loads(args)
        except ValueError:
            return args
    return args


def _call(c) -> dict | None:
    """An OpenAI tool call from a parsed ``{"name", "arguments"}`` (Hermes' and the generic
    format's shape), or None for anything else."""
    if not isinstance(c, dict) or not isinstance(c.get("name"), str):
        return None
    args = c.get("arguments", c.get("parameters", {}))
    return {"id": new_call_id(), "type": "function",
            "function": {"name": c["name"],
                         "arguments": args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)}}
