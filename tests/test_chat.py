"""pyinfer.chat against transformers' apply_chat_template on the same template string."""
from __future__ import annotations

import sys
import time

import gguf
import pytest

from pyinfer import constants as C
from pyinfer.chat import CHATML_TEMPLATE, render_chat
from pyinfer.errors import PyinferError
from tests._paths import smollm2_gguf_path

# SmolLM2-135M-Instruct's template, as its GGUF file embeds it (tokenizer.chat_template).
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# A Llama-2 style template: bos/eos tokens, raise_exception, whitespace control.
LLAMA2_TEMPLATE = (
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
    "{% set system_message = messages[0]['content'] %}{% else %}{% set loop_messages = messages %}"
    "{% set system_message = false %}{% endif %}"
    "{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if loop.index0 == 0 and system_message != false %}"
    "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}"
    "{% else %}{% set content = message['content'] %}{% endif %}"
    "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' '  + content.strip() + ' ' + eos_token }}{% endif %}"
    "{% endfor %}"
)
# Block tags on their own lines: trim_blocks / lstrip_blocks decide the output.
INDENTED_TEMPLATE = """{% for message in messages %}
    {% if message['role'] == 'user' %}
User: {{ message['content'] }}
    {% else %}
Bot: {{ message['content'] }}
    {% endif %}
{% endfor %}
{% if add_generation_prompt %}Bot:{% endif %}"""

CHATS = [
    [{"role": "user", "content": "What is the capital of Germany?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 🙂 é"}],
    [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
        {"role": "user", "content": "c\n  d"},
    ],
]


@pytest.fixture(scope="module")
def hf_tokenizer():
    """Any transformers tokenizer: apply_chat_template only needs the template and bos/eos strings."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models

    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>")))
    tok.bos_token, tok.eos_token = "<s>", "</s>"
    return tok


@pytest.mark.parametrize("template", [SMOLLM2_TEMPLATE, LLAMA2_TEMPLATE, INDENTED_TEMPLATE, CHATML_TEMPLATE])
@pytest.mark.parametrize("chat", range(len(CHATS)))
@pytest.mark.parametrize("gen", [True, False])
def test_matches_transformers(hf_tokenizer, template, chat, gen):
    messages = CHATS[chat]
    hf_tokenizer.chat_template = template
    expected = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
    assert render_chat(template, messages, add_generation_prompt=gen, bos_token="<s>", eos_token="</s>") == expected


# tools / documents tests, message keys, and the {% generation %} tag of training templates
TOOLS_TEMPLATE = (
    "{% if tools is not none %}[TOOLS {{ tools | length }}]{% endif %}"
    "{% if documents is defined %}[DOCS {{ documents is none }}]{% endif %}"
    "{% for m in messages %}{{ m.role }}: {{ m.content }} {{ m | list | sort }}"
    "{% if m.role == 'assistant' %}{% generation %}<{{ m.content }}>{% endgeneration %}{% endif %}\n"
    "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
)


@pytest.mark.parametrize("tools", [None, [{"type": "function", "function": {"name": "f"}}]])
def test_none_values_tools_and_the_generation_tag_match_transformers(hf_tokenizer, tools):
    """transformers leaves a message's None-valued keys out ("content": None rendered "None"
    here), always defines tools and documents (None: "tools is not none" was true here), and
    renders {% generation %} blocks (the template did not compile here)."""
    messages = [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": None, "tool_calls": None},
                {"role": "user", "content": "again"}]
    hf_tokenizer.chat_template = TOOLS_TEMPLATE
    expected = hf_tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                                add_generation_prompt=True)
    extra = {} if tools is None else {"tools": tools}
    assert render_chat(TOOLS_TEMPLATE, messages, **extra) == expected
    assert messages[1]["content"] is None  # the caller's messages are not changed


THINK_TEMPLATE = (
    "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% if enable_thinking is defined and "
    "enable_thinking is false %} <think></think>{% endif %}{% endif %}{{ extra | default('') }}"
    "{{ limits | default('') }}{{ template | default('') }}"
)


@pytest.mark.parametrize("kw", [{}, {"enable_thinking": False}, {"enable_thinking": True},
                                {"extra": ["x", 1]}, {"limits": 1, "template": "x"}])
def test_template_kwargs_match_transformers(hf_tokenizer, kw):
    """Extra template variables (Qwen3's enable_thinking; llama.cpp's chat_template_kwargs)
    render as transformers' apply_chat_template renders its extra keyword arguments (names of
    render_chat's own arguments too: they crashed the renderer)."""
    from pyinfer.chat import template_kwargs

    messages = [{"role": "user", "content": "hi"}]
    hf_tokenizer.chat_template = THINK_TEMPLATE
    expected = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                                **kw)
    assert render_chat(THINK_TEMPLATE, messages, variables=template_kwargs(kw)) == expected


@pytest.mark.parametrize("value,message", [
    ("x", "must be a JSON object"), ({"add_generation_prompt": False}, "set by the renderer"),
    ({"1a": 0}, "not a template variable name"), ({"raise_exception": 0}, "set by the renderer")])
def test_bad_template_kwargs(value, message):
    from pyinfer.chat import parse_template_kwargs, template_kwargs

    with pytest.raises(PyinferError, match=message):
        template_kwargs(value)
    for text in ("{enable_thinking: false}", '{"x": NaN}'):
        with pytest.raises(PyinferError, match="not valid JSON"):
            parse_template_kwargs(text)


def test_smollm2_template_literal():
    out = render_chat(SMOLLM2_TEMPLATE, CHATS[0])
    assert out == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nWhat is the capital of Germany?<|im_end|>\n<|im_start|>assistant\n"
    )


def test_fallback_chatml():
    assert render_chat(None, CHATS[0]) == render_chat("", CHATS[0]) == (
        "<|im_start|>user\nWhat is the capital of Germany?<|im_end|>\n<|im_start|>assistant\n"
    )


@pytest.mark.parametrize(
    "template",
    [
        "{{ ().__class__.__mro__[1].__subclasses__() }}",
        "{{ messages.__class__.__init__.__globals__ }}",
        "{% set x = messages.append({'role': 'x'}) %}",  # immutable sandbox: no mutation
        "{{ cycler.__init__.__globals__.os.popen('id').read() }}",
    ],
)
def test_malicious_template_is_refused(template):
    with pytest.raises(PyinferError, match="unsafe"):
        render_chat(template, CHATS[0])


@pytest.mark.parametrize(
    "template, message",
    [
        ("{% for m in messages %}", "chat template error"),
        ("{{ raise_exception('roles must alternate') }}", "roles must alternate"),
        ("{{ messages[0]['content'] + 1 }}", "chat template error"),
    ],
)
def test_template_errors_are_one_line(template, message):
    with pytest.raises(PyinferError, match=message) as e:
        render_chat(template, CHATS[0])
    assert "\n" not in str(e.value)


def test_strftime_now():
    out = render_chat("{{ strftime_now('%Y') }}", [])
    assert out.isdigit() and len(out) == 4


@pytest.mark.slow
@pytest.mark.skipif(smollm2_gguf_path() is None, reason="SmolLM2 GGUF not found (set PYINFER_SMOLLM2_GGUF)")
def test_smollm2_embedded_template(hf_tokenizer):
    reader = gguf.GGUFReader(smollm2_gguf_path())
    template = reader.fields[C.K_CHAT_TEMPLATE].contents()
    assert template == SMOLLM2_TEMPLATE
    hf_tokenizer.chat_template = template
    for messages in CHATS[:2]:
        expected = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert render_chat(template, messages) == expected


# ---- templates that burn CPU or memory fail fast (issue 9) ----------------------------------------
@pytest.mark.parametrize("template, message", [
    ("{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}", "range() of more than"),
    ("{% for i in range(10000) %}{% for j in range(10000) %}x{% endfor %}{% endfor %}", "too many steps"),
    # no output and no calls inside the loops: only the step budget sees them
    ("{% set r = range(10000) %}{% for i in r %}{% for j in r %}{% endfor %}{% endfor %}", "too many steps"),
    ("{{ 2 ** (2 ** 40) }}", "a number of more than 4096 bits"),
    ("{{ lipsum(n=10**7) }}", "'lipsum' is undefined"),  # (no global: refused before any size)
    ("{{ lipsum() }}", "'lipsum' is undefined"),
    ("{{ 'x' * 10**10 }}", "a value of more than"),
    ("{{ 'x'|center(10**9) }}", "an argument larger than"),
    ("{{ 'ab'.ljust(10**9) }}", "an argument larger than"),
    ("{{ '%0999999999d' % 1 }}", "a format with a huge or computed width"),
    ("{{ '%0*d' % (10**9, 1) }}", "a format with a huge or computed width"),
    ("{{ '%.999999999f' % 1.0 }}", "a format with a huge or computed width"),
    ("{{ '{:>999999999}'.format(1) }}", "a format with a huge or computed width"),
    ("{{ '%0999999999d'|format(1) }}", "a format with a huge or computed width"),
    ("{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
     "a value of more than"),
    ("{% set big %}{% for i in range(10000) %}{% for j in range(10000) %}x{% endfor %}{% endfor %}"
     "{% endset %}{{ big|length }}", "too many steps"),
    # 2^60 calls of a few lines each: the clock or the step budget ends it, whichever comes first
    # (on a fast core the 1,000,000 steps run out before 2 s: seen on an AVX-512 EPYC box)
    ("{% macro f(n) %}{{ f(n - 1) ~ f(n - 1) if n else 'x' }}{% endmacro %}{{ f(60) }}",
     ("more than 2 s", "too many steps")),
    ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "recurses too deeply"),
])
def test_costly_template_fails_fast(template, message):
    t0 = time.monotonic()
    with pytest.raises(PyinferError) as e:
        render_chat(template, CHATS[0])
    messages = message if isinstance(message, tuple) else (message,)
    assert any(m in str(e.value) for m in messages), str(e.value)
    assert "\n" not in str(e.value)
    assert time.monotonic() - t0 < 4.0  # the 2 s clock, with room for a busy machine


def test_output_is_capped_by_the_input_size():
    from pyinfer.chat import RenderLimits

    limits = RenderLimits(output_base=1000, output_per_input=2)
    template = "{% for i in range(300) %}{{ messages[0]['content'] }}{% endfor %}"
    # 1000 + 2 x the 25 characters of the message (keys and values: "role" "user" "content" ...)
    with pytest.raises(PyinferError, match="an output of more than 1050 characters"):
        render_chat(template, [{"role": "user", "content": "0123456789"}], limits=limits)
    # the same template within its budget renders as Jinja would
    assert render_chat(template, [{"role": "user", "content": "ab"}], limits=limits) == "ab" * 300


def test_ordinary_formats_still_work():
    assert render_chat("{{ '%5.2f|%s|%%' % (1.5, 'a') }}{{ '{:>4}'.format('b') }}", []) == " 1.50|a|%   b"


def test_limits_leave_a_long_conversation_alone():
    chat = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"message {i} " * 50}
            for i in range(2000)]
    out = render_chat(SMOLLM2_TEMPLATE, chat)
    assert out.count("<|im_start|>") == 2002 and out.endswith("<|im_start|>assistant\n")


def test_bounded_rendering_restores_the_tracer():
    seen = []

    def tracer(frame, event, arg):
        seen.append(event)
        return None

    sys.settrace(tracer)
    try:
        render_chat(SMOLLM2_TEMPLATE, CHATS[0])
        with pytest.raises(PyinferError):
            render_chat("{{ 2 ** (2 ** 40) }}", CHATS[0])
        assert sys.gettrace() is tracer
    finally:
        sys.settrace(None)


@pytest.mark.parametrize("template,kw", [
    # an integer argument that is a value, not a size: GLM-4.6's tool arguments through tojson,
    # Seed-OSS's through string (an order id of 12,345,678 refused the whole template)
    ("{{ n | tojson }} {{ n | string }} {{ '%d' | format(n) }} {{ (n | int) + 1 }}",
     {"n": 12345678}),
    ("{% macro f(a) %}<{{ a }}>{% endmacro %}{{ f(n) }}{{ namespace(t=n).t }}", {"n": 12345678}),
    # str.format on text with Markdown's "%**": "*" is no computed width there
    ("{{ '**50%** done for {name}'.format(name='x') }} {{ '{:*^9}'.format('a') }}", {}),
])
def test_values_that_are_no_sizes_render_as_jinja_renders_them(template, kw):
    """The bounds on sizes (widths, counts) let values through: the text is jinja2's own
    sandbox's (the reference), where pyinfer refused these templates as hostile."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    from pyinfer.chat import render_chat

    msgs = [{"role": "user", "content": "x"}]
    want = ImmutableSandboxedEnvironment().from_string(template).render(messages=msgs, **kw)
    assert render_chat(template, msgs, **kw) == want


def test_reasoning_content_reaches_a_template_that_reads_thinking():
    """An assistant's reasoning_content is also its "thinking" and "reasoning" (llama.cpp's
    server sets thinking for gpt-oss's template; transformers aliases the three): a template
    reading message.thinking dropped an earlier turn's reasoning. The reference rendering is
    jinja2's own over the message with the alias written in by hand."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    from pyinfer.chat import render_chat

    template = ("{% for m in messages %}[{{ m.role }}]{% if m.thinking %}<think>{{ m.thinking }}"
                "</think>{% endif %}{{ m.content }}{% endfor %}")
    msgs = [{"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": "Sunny.", "reasoning_content": "Look it up."}]
    hand = [msgs[0], dict(msgs[1], thinking="Look it up.")]
    want = ImmutableSandboxedEnvironment().from_string(template).render(messages=hand)
    assert "<think>Look it up.</think>" in want
    assert render_chat(template, msgs, add_generation_prompt=False) == want
    assert "thinking" not in msgs[1]  # (the caller's message untouched)


def test_a_template_that_reads_only_parts_gets_parts(tmp_path):
    """A template that loops over message['content'] as parts (SmolVLM's kind) rendered a
    string content as nothing, and the joined parts too: the user's text was lost. Such a
    template gets each content as one text part (llama.cpp's minja: requires_typed_content);
    the reference is jinja2's own rendering of the same messages given as parts."""
    from gguf import GGUFValueType as VT
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    from pyinfer import LLM
    from pyinfer import constants as C
    from pyinfer.chat import CHATML_TEMPLATE, wants_typed_content
    from tests._tiny_gguf import write_tiny_gguf

    template = ("{% for m in messages %}{{ m['role'] }}: {% for p in m['content'] %}"
                "{% if p['type'] == 'text' %}{{ p['text'] }}{% endif %}{% endfor %}\n{% endfor %}"
                "{% if add_generation_prompt %}assistant:{% endif %}")
    assert wants_typed_content(template) and not wants_typed_content(CHATML_TEMPLATE)
    path = write_tiny_gguf(str(tmp_path / "t.gguf"),
                           overrides={C.K_CHAT_TEMPLATE: (template, VT.STRING, None)})
    llm = LLM(path, n_threads=1, device="cpu")
    parts = [{"role": "user", "content": [{"type": "text", "text": "the cat"}]}]
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)  # (transformers')
    want = env.from_string(template).render(messages=parts, add_generation_prompt=True)
    assert "the cat" in want
    for msgs in (parts, [{"role": "user", "content": "the cat"}]):
        assert llm.detokenize(llm.chat_tokens(msgs)).lstrip() == want


def test_the_time_bound_counts_the_rendering_threads_own_time():
    """Under a busy server (threads sharing the GIL) a template well inside the time bound alone
    was refused as hostile: the bound counted wall-clock time. It counts the rendering thread's
    CPU time now (a wall-clock backstop stays)."""
    import threading
    import time

    from pyinfer.chat import RenderLimits, render_chat

    tmpl = ("{% for j in range(n) %}{% for i in range(5000) %}{{ i % 7 }}{% endfor %}"
            "{% endfor %}")
    render_chat(tmpl, [{"role": "user", "content": "x"}], variables={"n": 4})  # (compiled once)
    t0 = time.thread_time()
    render_chat(tmpl, [{"role": "user", "content": "x"}], variables={"n": 4})
    alone = time.thread_time() - t0
    limits = RenderLimits(seconds=max(3 * alone, 0.05), steps=10_000_000)
    n = 4
    stop = threading.Event()

    def burn():
        while not stop.is_set():
            sum(range(2000))

    burners = [threading.Thread(target=burn) for _ in range(8)]  # (the render gets ~1/9 of the GIL)
    for b in burners:
        b.start()
    try:
        out = render_chat(tmpl, [{"role": "user", "content": "x"}], limits=limits, variables={"n": n})
    finally:
        stop.set()
        for b in burners:
            b.join()
    assert len(out) == n * 5000  # (rendered: about 9x its CPU budget's wall-clock time went by)
