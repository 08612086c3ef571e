"""Tool calling (OpenAI's ``tools`` / ``tool_choice``; pyinfer/tools.py).

References nobody here wrote: ``jsonschema`` checks the generic format's answers and every call's
arguments against the tool's own schema; transformers' ``parse_response`` with its Qwen-family
response template reads the Hermes format's answers, and its ``apply_chat_template(tools=...)``
renders a template's ``tools`` variable; the ``openai`` client parses the server's answers. The
tiny random model (tests/_tiny_gguf.py) writes calls only because the grammar makes it; the
SmolLM2 tests are marked slow.
"""
from __future__ import annotations

import json

import pytest

pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

from pyinfer.errors import PyinferError  # noqa: E402
from pyinfer.tools import ToolError, ToolUse  # noqa: E402

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather of a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 24},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {
        "zone": {"type": "string", "maxLength": 16}}, "required": ["zone"]}}}
TOOLS = [WEATHER, TIME]
#: a Hermes-style template of our own (writes <tool_call> itself, reads ``tools``), as Qwen's do
HERMES_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nTools:\n{%- for t in tools %}\n{{ t.function | tojson }}"
    "{%- endfor %}\nCall one as <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call><|im_end|>\n"
    "{%- endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{%- if m.content %}{{ m.content }}{%- endif %}"
    "{%- for c in m.tool_calls or [] %}<tool_call>\n{{ {'name': c.function.name, "
    "'arguments': c.function.arguments} | tojson }}\n</tool_call>{%- endfor %}<|im_end|>\n{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}")


def _schema_of(name: str) -> dict:
    return next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == name)


def _check_calls(calls: list, names=("get_weather", "get_time")) -> None:
    """Each call in OpenAI's shape, of a given tool, with arguments of that tool's schema."""
    assert calls
    for c in calls:
        assert c["type"] == "function" and c["id"].startswith("call_")
        assert c["function"]["name"] in names
        jsonschema.validate(json.loads(c["function"]["arguments"]), _schema_of(c["function"]["name"]))


# ---- requests checked --------------------------------------------------------------------------
@pytest.mark.parametrize("tools, choice, parallel, param", [
    ("get_weather", None, None, "tools"), ([{"type": "retrieval"}], None, None, "tools"),
    ([{"type": "function", "function": {"name": "a b"}}], None, None, "tools"),
    ([WEATHER, WEATHER], None, None, "tools"),
    ([{"type": "function", "function": {"name": "f", "parameters": "{}"}}], None, None, "tools"),
    (TOOLS, "always", None, "tool_choice"), (TOOLS, {"type": "function"}, None, "tool_choice"),
    (TOOLS, {"type": "function", "function": {"name": "nope"}}, None, "tool_choice"),
    (None, "required", None, "tool_choice"), (TOOLS, None, "yes", "parallel_tool_calls"),
])
def test_malformed_tool_requests_name_their_field(tools, choice, parallel, param):
    with pytest.raises(ToolError) as e:
        ToolUse.of(tools, choice, parallel)
    assert e.value.param == param and "\n" not in str(e.value)


def test_none_and_no_tools_are_a_plain_chat():
    assert ToolUse.of(None) is None and ToolUse.of([]) is None
    assert ToolUse.of(TOOLS, "none") is None


def test_a_tool_named_like_a_choice_is_still_that_tool():
    auto = {"type": "function", "function": {"name": "auto"}}
    tu = ToolUse.of([auto, WEATHER], {"type": "function", "function": {"name": "auto"}})
    assert tu.required and [t["function"]["name"] for t in tu.callable_tools] == ["auto"]


# ---- the generic format's schema, checked by jsonschema -----------------------------------------
def test_generic_schema_takes_calls_of_the_tools_and_a_response_unless_required():
    call = {"tool_call": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    auto = ToolUse.of(TOOLS, "auto").schema()
    jsonschema.validate(call, auto)
    jsonschema.validate({"response": "Hello"}, auto)
    for bad in ({"tool_call": {"name": "get_weather", "arguments": {}}},  # required argument
                {"tool_call": {"name": "get_weather", "arguments": {"city": "x", "mood": "y"}}},
                {"tool_call": {"name": "send_mail", "arguments": {}}}, dict(call, response="x"),
                {"tool_calls": [call["tool_call"]]}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, auto)
    required = ToolUse.of(TOOLS, "required").schema()
    jsonschema.validate(call, required)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"response": "Hello"}, required)
    named = ToolUse.of(TOOLS, {"type": "function", "function": {"name": "get_time"}}).schema()
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(call, named)
    parallel = ToolUse.of(TOOLS, "required", True).schema()
    jsonschema.validate({"tool_calls": [call["tool_call"], {"name": "get_time",
                                                            "arguments": {"zone": "UTC"}}]}, parallel)


def test_generic_parse():
    tu = ToolUse.of(TOOLS, "auto", True)
    content, calls = tu.parse('{"tool_calls": [{"name": "get_time", "arguments": {"zone": "UTC"}}, '
                              '{"name": "get_weather", "arguments": {"city": "Oslo"}}]}')
    assert content is None and [c["function"]["name"] for c in calls] == ["get_time", "get_weather"]
    assert json.loads(calls[1]["function"]["arguments"]) == {"city": "Oslo"}
    assert len({c["id"] for c in calls}) == 2
    assert tu.parse('{"response": "It is sunny."}') == ("It is sunny.", [])
    assert tu.parse('{"tool_calls": [{"name": "get_ti') == ('{"tool_calls": [{"name": "get_ti', [])


# ---- the Hermes format against transformers' response parser ------------------------------------
@pytest.mark.parametrize("text", [
    'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
    '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>\n<tool_call>\n'
    '{"name": "get_weather", "arguments": {"city": "Rome", "unit": "celsius"}}\n</tool_call>',
    'No tool is needed: it is 4.', '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>',
])
def test_hermes_parse_matches_transformers(text):
    from transformers import PreTrainedTokenizerFast
    from tokenizers import Tokenizer, models

    fallbacks = pytest.importorskip("transformers.cli.serving.utils")._RESPONSE_TEMPLATE_FALLBACKS
    schema = next(v for k, v in fallbacks.items() if "qwen2" in k)
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.BPE()))
    ref = tok.parse_response(text, schema, prefix="<|im_start|>assistant\n")
    content, calls = ToolUse.of(TOOLS, "auto", template=HERMES_TEMPLATE).parse(text)
    assert content == ref.get("content")
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in ref.get("tool_calls", [])]


def test_hermes_template_gets_the_tools_as_transformers_passes_them(tmp_path):
    """The template's ``tools`` variable and a tool-using history render as transformers'
    apply_chat_template renders them."""
    from transformers import PreTrainedTokenizerFast
    from tokenizers import Tokenizer, models

    from pyinfer import LLM
    from tests._tiny_gguf import write_tiny_gguf

    llm = LLM(write_tiny_gguf(str(tmp_path / "t.gguf")), n_threads=1, device="cpu")
    llm.chat_template = HERMES_TEMPLATE
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    msgs = [{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": "22 C"}]
    tu = ToolUse.of(TOOLS, "auto", template=HERMES_TEMPLATE)
    ours = llm.detokenize(llm.chat_tokens(msgs, None, tu))
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.BPE()))
    tok.chat_template = HERMES_TEMPLATE
    ref = tok.apply_chat_template(msgs, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert ours == ref and '"name": "get_time"' in ours


# ---- the tiny random model: only the grammar makes it call ------------------------------------
@pytest.fixture(scope="module")
def tiny_llm(tmp_path_factory):
    from pyinfer import LLM
    from tests._tiny_gguf import write_tiny_gguf

    path = write_tiny_gguf(str(tmp_path_factory.mktemp("tiny") / "tiny.gguf"))
    return LLM(path, n_ctx=2048, n_threads=1, seed=0, device="cpu")  # (byte tokens: long prompts)


@pytest.mark.parametrize("template", [None, HERMES_TEMPLATE])
def test_required_calls_are_calls_of_the_tools(tiny_llm, template):
    tiny_llm.chat_template = template
    msgs = [{"role": "user", "content": "the weather"}]
    checked = 0
    for seed in range(6):
        for choice, names in (("required", ("get_weather", "get_time")),
                              ({"type": "function", "function": {"name": "get_time"}}, ("get_time",))):
            out = tiny_llm.create_chat_completion(msgs, tools=TOOLS, tool_choice=choice,
                                                  temperature=1.0, seed=seed, max_tokens=200)
            choice0 = out["choices"][0]
            if choice0["finish_reason"] == "length":
                continue  # (a random model may run out of tokens inside a string)
            assert choice0["finish_reason"] == "tool_calls"
            _check_calls(choice0["message"]["tool_calls"], names)
            assert choice0["message"]["content"] is None
            checked += 1
    assert checked >= 6  # (most answers complete: the test is not vacuous)


def test_streamed_calls_equal_the_answer(tiny_llm):
    tiny_llm.chat_template = None
    kw = dict(tools=TOOLS, tool_choice="required", temperature=1.0, seed=3, max_tokens=200)
    msgs = [{"role": "user", "content": "the time"}]
    whole = tiny_llm.create_chat_completion(msgs, **kw)["choices"][0]
    assert whole["message"].get("tool_calls")  # (something to compare)
    chunks = list(tiny_llm.create_chat_completion(msgs, stream=True, **kw))
    streamed = [d for c in chunks for d in c["choices"][0]["delta"].get("tool_calls") or []]
    assert chunks[-1]["choices"][0]["finish_reason"] == whole["finish_reason"]
    assert [(d["index"], d["function"]) for d in streamed] == [
        (i, c["function"]) for i, c in enumerate(whole["message"].get("tool_calls", []))]


def _stream_pieces(tu, text, sizes):
    """ToolStream's deltas for ``text`` fed in pieces of the given sizes, and its finish."""
    from pyinfer.tools import ToolStream

    ts, out, at, k = ToolStream(tu), [], 0, 0
    while at < len(text):
        n = sizes[k % len(sizes)]
        out.append(ts.feed(text[at:at + n]))
        at, k = at + n, k + 1
    return out, ts.finish()


@pytest.mark.parametrize("sizes", [[1], [2, 5], [7, 1, 3], [1000]])
def test_streamed_content_adds_up_to_the_parsed_answer(sizes):
    """Fed in any pieces, the content deltas and the finish add up to ``parse`` of the whole
    text (json decodes the generic format's string, escapes and surrogate pairs included), and
    text for the user streams before the answer ends."""
    generic = ToolUse.of(TOOLS, "auto")
    hermes = ToolUse.of(TOOLS, "auto", template=HERMES_TEMPLATE)
    said = 'It is 22 \u00b0C "in" Paris\n\\ today \U0001F600 \ud800 end'
    cases = [(generic, json.dumps({"response": said})),
             (generic, json.dumps({"response": said}, ensure_ascii=False)),
             (generic, '{"tool_call": {"name": "get_time", "arguments": {"zone": "UTC"}}}'),
             (generic, '{"response": "cut sho'),
             (hermes, 'Let me look.  \n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'),
             (hermes, 'No call: a < b and <tool_ is not a tag.\n'),
             (hermes, '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\nDone.'),
             (hermes, 'Odd <tool_call>not json</tool_call> text')]
    for tu, text in cases:
        deltas, (rest, calls) = _stream_pieces(tu, text, sizes)
        content, want_calls = tu.parse(text)
        assert "".join(deltas) + rest == (content or ""), text
        assert [c["function"] for c in calls] == [c["function"] for c in want_calls]
        if content and not text.startswith("<tool_call>") and sizes != [1000]:
            assert "".join(deltas), text  # (text before any call streamed before the end)


@pytest.mark.parametrize("seed", range(4))
def test_streamed_answers_with_tools_equal_the_whole_answer(tiny_llm, seed):
    tiny_llm.chat_template = None
    kw = dict(tools=TOOLS, tool_choice="auto", temperature=1.0, seed=seed, max_tokens=120,
              logprobs=True)
    msgs = [{"role": "user", "content": "hello"}]
    whole = tiny_llm.create_chat_completion(msgs, **kw)["choices"][0]
    chunks = [c["choices"][0] for c in tiny_llm.create_chat_completion(msgs, stream=True, **kw)]
    text = "".join(c["delta"].get("content") or "" for c in chunks)
    assert text == (whole["message"]["content"] or "")
    assert chunks[-1]["finish_reason"] == whole["finish_reason"]
    streamed_lp = [e for c in chunks for e in (c["logprobs"] or {}).get("content", [])]
    assert streamed_lp == whole["logprobs"]["content"]


def test_tools_with_a_grammar_or_a_continued_message_are_refused(tiny_llm):
    msgs = [{"role": "user", "content": "x"}]
    with pytest.raises(PyinferError, match="tools cannot be combined"):
        tiny_llm.create_chat_completion(msgs, tools=TOOLS, response_format={"type": "json_object"})
    with pytest.raises(PyinferError, match="continued"):
        tiny_llm.create_chat_completion(msgs + [{"role": "assistant", "content": "I"}], tools=TOOLS)


@pytest.mark.parametrize("extra, param", [
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": TOOLS, "parallel_tool_calls": 1}, "parallel_tool_calls"),
    ({"tools": [dict(WEATHER, type="code")]}, "tools"),
    ({"tools": TOOLS, "response_format": {"type": "json_object"}}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"),
])
def test_server_refuses_malformed_tool_requests(tiny_llm, extra, param):
    pytest.importorskip("starlette")
    from starlette.testclient import TestClient

    from pyinfer.server import create_app

    app = TestClient(create_app(tiny_llm), raise_server_exceptions=False)
    r = app.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], **extra})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_server_answers_a_required_call(tiny_llm):
    pytest.importorskip("starlette")
    from starlette.testclient import TestClient

    from pyinfer.server import create_app

    tiny_llm.chat_template = None
    app = TestClient(create_app(tiny_llm), raise_server_exceptions=False)
    r = app.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "x"}], "tools": TOOLS, "seed": 1, "max_tokens": 200,
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}}})
    choice = r.json()["choices"][0]
    assert r.status_code == 200 and choice["finish_reason"] == "tool_calls", r.text
    _check_calls(choice["message"]["tool_calls"], ("get_weather",))


# ---- SmolLM2 (slow) --------------------------------------------------------------------------------
@pytest.mark.slow
def test_smollm2_calls_the_weather_tool_and_reads_its_result(smollm2_llm):
    msgs = [{"role": "user", "content": "What is the weather in Paris?"}]
    out = smollm2_llm.create_chat_completion(msgs, tools=[WEATHER], tool_choice="required",
                                             temperature=0, max_tokens=64)["choices"][0]
    assert out["finish_reason"] == "tool_calls"
    _check_calls(out["message"]["tool_calls"], ("get_weather",))
    assert json.loads(out["message"]["tool_calls"][0]["function"]["arguments"])["city"] == "Paris"
    call = out["message"]["tool_calls"][0]
    history = msgs + [out["message"], {"role": "tool", "tool_call_id": call["id"],
                                       "name": "get_weather", "content": "22 C and sunny"}]
    text = smollm2_llm.detokenize(smollm2_llm.chat_tokens(history, None, ToolUse.of(
        [WEATHER], template=smollm2_llm.chat_template)))
    assert '{"tool_call": {"name": "get_weather", "arguments": {"city": "Paris"' in text
    assert ('{"tool_response": {"tool": "get_weather", "tool_call_id": "%s", '
            '"content": "22 C and sunny"}}' % call["id"]) in text
    again = smollm2_llm.create_chat_completion(history, tools=[WEATHER], temperature=0,
                                               max_tokens=64)["choices"][0]
    assert again["message"].get("tool_calls") or again["message"]["content"]  # (an answer)


from tests.test_server import client, server  # noqa: E402,F401,F811 - the server fixtures


@pytest.mark.slow
def test_openai_client_tool_calls(client):  # noqa: F811
    import openai

    msgs = [{"role": "user", "content": "What is the weather in Paris?"}]
    out = client.chat.completions.create(model="smollm2", messages=msgs, tools=[WEATHER],
                                         tool_choice="required", temperature=0, max_tokens=64)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    stream = client.chat.completions.create(model="smollm2", messages=msgs, tools=[WEATHER],
                                            tool_choice="required", temperature=0, max_tokens=64,
                                            stream=True)
    parts, finish = {}, None
    for ch in stream:
        for d in ch.choices[0].delta.tool_calls or []:
            parts.setdefault(d.index, []).append(d.function.arguments or "")
        finish = ch.choices[0].finish_reason or finish
    assert finish == "tool_calls" and "".join(parts[0]) == call.function.arguments
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="smollm2", messages=msgs, tools=[WEATHER],
                                       tool_choice={"type": "function", "function": {"name": "x"}})
    assert e.value.body["param"] == "tool_choice"


# ---- schemas as clients write them (a QA pass against OpenAI's and llama.cpp's behaviour) ---------
def _pydantic_tool():
    """A tool as ``openai.pydantic_function_tool`` writes it: nested models under $defs, $ref."""
    pydantic = pytest.importorskip("pydantic")

    class Point(pydantic.BaseModel):
        x: int
        y: int

    class Route(pydantic.BaseModel):
        start: Point
        end: Point

    return {"type": "function", "function": {"name": "plan_route",
                                             "parameters": Route.model_json_schema()}}


@pytest.mark.parametrize("template", [None, HERMES_TEMPLATE])
def test_defs_and_refs_in_parameters_are_followed(tiny_llm, template):
    """A tool's own "#/$defs/..." pointers broke once the schema was nested in the answer's
    (400 "Pointer '/$defs/Point' does not exist"); llama.cpp resolves them."""
    tool = _pydantic_tool()
    assert "$defs" in tool["function"]["parameters"]
    tiny_llm.chat_template = template
    for seed in range(3):
        out = tiny_llm.create_chat_completion([{"role": "user", "content": "x"}], tools=[tool],
                                              tool_choice="required", temperature=1.0, seed=seed,
                                              max_tokens=300)["choices"][0]
        if out["finish_reason"] == "length":
            continue
        args = json.loads(out["message"]["tool_calls"][0]["function"]["arguments"])
        jsonschema.validate(args, tool["function"]["parameters"])
        return
    pytest.fail("no call completed in 300 tokens")


@pytest.mark.parametrize("schema, value", [
    ({"type": "object", "allOf": [{"properties": {"a": {"type": "integer"}}},
                                  {"properties": {"b": {"type": "integer"}}}]}, {"a": 1, "b": 2}),
    ({"type": "object", "properties": {"kind": {"type": "string"}},
      "anyOf": [{"properties": {"a": {"type": "integer"}}}, {"properties": {"b": {"type": "integer"}}}]},
     {"kind": "x", "a": 1}),
    ({"type": "object", "properties": {"enum": {"type": "object", "properties": {"x": {"type": "integer"}}}}},
     {"enum": {"x": 1}}),
])
def test_closing_objects_keeps_what_the_schema_accepts(schema, value):
    """closed() made allOf / anyOf-with-properties schemas refuse their own valid values (each
    branch closed alone), and walked a property named "enum" as a keyword."""
    from pyinfer.tools import closed

    jsonschema.validate(value, schema)
    jsonschema.validate(value, closed(schema))
    if "enum" in schema.get("properties", {}):
        with pytest.raises(jsonschema.ValidationError):  # (its inner object is closed)
            jsonschema.validate({"enum": {"x": 1, "y": 2}}, closed(schema))


def test_keywords_llguidance_does_not_implement_do_not_fail_the_request(tiny_llm):
    """uniqueItems, not, contains ... are left unenforced (llama.cpp's converter ignores what it
    does not implement); the whole request was refused, even under "auto"."""
    from pyinfer.grammar import ByteVocab

    tool = {"type": "function", "function": {"name": "tag", "parameters": {
        "type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string"},
                                                  "uniqueItems": True}}, "required": ["tags"]}}}
    for choice in ("auto", "required"):
        for template in (None, HERMES_TEMPLATE):
            g = ToolUse.of([tool], choice, template=template).grammar()
            if g is not None:
                g.check(ByteVocab())


def test_history_tool_parts_reach_a_template_without_tool_support(tiny_llm):
    """Calls and results of earlier turns are written as JSON for a template that reads neither,
    with or without tools in the request (with "none" the calls vanished and the result was a
    bare "tool" turn); a result names its tool (found from the call's id) and keeps the id; text
    beside a call is kept."""
    tiny_llm.chat_template = None  # (chatml: no tool support)
    calls = [{"id": "call_a", "type": "function",
              "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
             {"id": "call_b", "type": "function",
              "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]
    msgs = [{"role": "user", "content": "Weather in Paris and Rome?"},
            {"role": "assistant", "content": "Let me look.", "tool_calls": calls},
            {"role": "tool", "tool_call_id": "call_a", "content": "22 C"},
            {"role": "tool", "tool_call_id": "call_b", "content": "25 C"}]
    for tools in (None, ToolUse.of(TOOLS, "auto")):
        text = tiny_llm.detokenize(tiny_llm.chat_tokens(msgs, None, tools))
        said = json.loads(text.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0])
        assert said == {"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"},
                                        "id": "call_a"},
                                       {"name": "get_weather", "arguments": {"city": "Rome"},
                                        "id": "call_b"}], "content": "Let me look."}
        assert ('{"tool_response": {"tool": "get_weather", "tool_call_id": "call_b", '
                '"content": "25 C"}}') in text


def test_string_arguments_are_objects_for_a_template_that_writes_json():
    """OpenAI clients send a call's arguments as JSON text; a template that writes them with
    tojson (Qwen2.5's, ours here) rendered them double-encoded; llama.cpp gives it the object."""
    from pyinfer.tools import template_messages

    call = {"id": "c", "type": "function", "function": {"name": "get_weather",
                                                        "arguments": '{"city": "Paris"}'}}
    out = template_messages([{"role": "assistant", "content": None, "tool_calls": [call]}],
                            HERMES_TEMPLATE)
    assert out[0]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    string_template = "{% for m in messages %}{% for c in m.tool_calls %}{{ c.function.arguments }}{% endfor %}{% endfor %}"
    out = template_messages([{"role": "assistant", "content": None, "tool_calls": [call]}],
                            string_template)
    assert out[0]["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris"}'


@pytest.mark.parametrize("function", ["get_weather", None, [1], {"arguments": "{}"}])
def test_a_malformed_call_in_the_history_is_a_one_line_error(tiny_llm, function):
    from pyinfer.errors import PyinferError

    msgs = [{"role": "user", "content": "x"},
            {"role": "assistant", "content": None,
             "tool_calls": [{"id": "c", "type": "function", "function": function}]}]
    with pytest.raises(PyinferError, match=r"messages\[1\]\.tool_calls\[0\]"):
        tiny_llm.chat_tokens(msgs)


def test_a_required_call_closes_a_thinking_block_the_prompt_opened(tiny_llm):
    """A template whose generation prompt opens <think>: the required call's grammar starts with
    </think> (llama.cpp's thinking_forced_open), so the call is content, not reasoning."""
    tiny_llm.chat_template = HERMES_TEMPLATE.replace("assistant\n{%- endif %}",
                                                     "assistant\n<think>\n{%- endif %}")
    assert tiny_llm.render_chat([{"role": "user", "content": "x"}]).endswith("<think>")
    out = tiny_llm.create_chat_completion([{"role": "user", "content": "x"}], tools=TOOLS,
                                          tool_choice="required", temperature=1.0, seed=2,
                                          max_tokens=200, reasoning_format="deepseek")["choices"][0]
    assert out["finish_reason"] == "tool_calls", out
    _check_calls(out["message"]["tool_calls"])


def test_server_tool_schema_errors_name_tools(tiny_llm):
    pytest.importorskip("starlette")
    from starlette.testclient import TestClient

    from pyinfer.server import create_app

    tiny_llm.chat_template = None
    app = TestClient(create_app(tiny_llm), raise_server_exceptions=False)
    bad = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"p": {"$ref": "#/$defs/missing"}}}}}
    r = app.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                               "tools": [bad]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools", r.text
    r = app.post("/v1/chat/completions", json={"messages": [
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": None, "tool_calls": [{"type": "function", "function": "f"}]}],
        "tools": TOOLS})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text


def test_review_cases(tiny_llm):
    """From the review of the change: a required call that closes a prompt's thinking block had
    content "</think>" where no reasoning split takes it (the docstring says None); a tool_call_id
    that is not a string raised TypeError; render_chat showed another prompt than chat_tokens
    sends for a tool history."""
    from pyinfer.errors import PyinferError

    tiny_llm.chat_template = HERMES_TEMPLATE.replace("assistant\n{%- endif %}",
                                                     "assistant\n<think>\n{%- endif %}")
    for seed in range(4):
        out = tiny_llm.create_chat_completion([{"role": "user", "content": "x"}], tools=TOOLS,
                                              tool_choice="required", temperature=1.0, seed=seed,
                                              max_tokens=200)["choices"][0]
        if out["finish_reason"] == "tool_calls":
            break
    assert out["finish_reason"] == "tool_calls" and out["message"]["content"] is None, out
    tiny_llm.chat_template = None
    call = {"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}
    history = [{"role": "user", "content": "x"},
               {"role": "assistant", "content": None, "tool_calls": [call]},
               {"role": "tool", "tool_call_id": ["c1"], "content": "noon"}]
    with pytest.raises(PyinferError, match=r"tool_call_id must be a string"):
        tiny_llm.chat_tokens(history)
    history[2]["tool_call_id"] = "c1"
    assert tiny_llm.detokenize(tiny_llm.chat_tokens(history)) == tiny_llm.render_chat(history)
