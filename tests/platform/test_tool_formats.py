"""The tool-call formats of tessera.tool_calls for every template family, without a server: which
format a chat template teaches, how tools and a call history reach the template, that a forced
call's grammar accepts exactly the format's calls with valid arguments, and that streamed
deltas add up to what the finished reply parses to, however the text is cut."""
from __future__ import annotations

import dataclasses
import json

import pytest

from engine.loader import default_model_path, load_gguf
from engine.sampling_params import InvalidRequestError
from engine.structured_output import GrammarRejected, StructuredOutput
from engine.tokenizer import TextTokenizer
from tessera import tool_calls as tc
from tests.engine.test_tokenizer_families import LLAMA31_TEMPLATE, QWEN25_TEMPLATE

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city.",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string"},
                                                "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                                                "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}}}
MISTRAL_TEMPLATE = ("{%- for m in messages %}{%- if m.role == 'user' %}[INST] {{ m.content }}[/INST]"
                    "{%- elif m.tool_calls %}[TOOL_CALLS]{{ m.tool_calls | tojson }}</s>"
                    "{%- else %}{{ m.content }}</s>{%- endif %}{%- endfor %}")
HISTORY = [{"role": "user", "content": "Weather in Paris for 2 days?"},
           {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
               "name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}}]},
           {"role": "tool", "tool_call_id": "call_1", "content": '{"max_c": 21}'}]

#: A finished reply of each format with two calls, and what it parses to.
REPLIES = {
    "hermes": 'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa\\"ris}", "days": 2}}\n'
              '</tool_call>\n<tool_call>\n{"arguments": {"zone": "CET"}, "name": "get_time"}\n</tool_call>',
    "llama3_json": '{"name": "get_weather", "parameters": {"city": "Pa\\"ris}", "days": 2}}; '
                   '{"name": "get_time", "parameters": {"zone": "CET"}}',
    "mistral": '[{"name": "get_weather", "arguments": {"city": "Pa\\"ris}", "days": 2}}, '
               '{"name": "get_time", "arguments": {"zone": "CET"}}]',
}
CALLS = [("get_weather", {"city": 'Pa"ris}', "days": 2}), ("get_time", {"zone": "CET"})]


@pytest.fixture(scope="module")
def smollm2() -> TextTokenizer:
    _, _, meta = load_gguf(default_model_path())
    return TextTokenizer.from_gguf_metadata(meta)


def _plan(choice="auto", parallel=None):
    return tc.plan([WEATHER, TIME], choice, parallel)


def test_the_format_is_read_off_the_chat_template(smollm2):
    assert tc.tool_format(QWEN25_TEMPLATE) == tc.ToolFormat("hermes", native=True)
    assert tc.tool_format(LLAMA31_TEMPLATE) == tc.ToolFormat("llama3_json", native=True)
    assert tc.tool_format(MISTRAL_TEMPLATE, {"[TOOL_CALLS]": 5}.get) == tc.ToolFormat("mistral", True, 5)
    assert tc.tool_format(smollm2.chat_template) == tc.ToolFormat("hermes", native=False)  # the default


def test_a_native_template_renders_the_tools_and_the_history_itself(smollm2):
    qwen = dataclasses.replace(smollm2, chat_template=QWEN25_TEMPLATE)
    messages, tools = tc.render(HISTORY, _plan(), tc.tool_format(QWEN25_TEMPLATE))
    text = qwen.apply_chat_template(messages, tools=tools)
    assert '"name": "get_time"' in text and "<tools>" in text
    # The call's arguments reach the template as an object, written as JSON (not a quoted string).
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>' in text
    assert '<tool_response>\n{"max_c": 21}\n</tool_response>' in text

    llama = dataclasses.replace(smollm2, chat_template=LLAMA31_TEMPLATE)
    messages, tools = tc.render(HISTORY, _plan(), tc.tool_format(LLAMA31_TEMPLATE))
    text = llama.apply_chat_template(messages, tools=tools, variables={"date_string": "26 Nov 2026"})
    assert '{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}' in text
    assert "<|start_header_id|>ipython<|end_header_id|>\n\n{\"max_c\": 21}" in text


def test_the_default_format_writes_tools_calls_and_results_into_the_messages(smollm2):
    messages, tools = tc.render([{"role": "system", "content": "Be brief."}] + HISTORY, _plan(),
                                tc.tool_format(smollm2.chat_template))
    assert tools is None and [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
    assert messages[0]["content"].startswith("Be brief.\n\n") and '"name": "get_time"' in messages[0]["content"]
    assert messages[2]["content"] == tc.call_block("get_weather", {"city": "Paris", "days": 2})
    assert messages[3]["content"] == '<tool_response>\n{"max_c": 21}\n</tool_response>'
    # tool_choice "none": no tools shown, the history still rendered.
    messages, _ = tc.render(HISTORY, _plan("none"), tc.tool_format(None))
    assert messages[0]["role"] == "user" and "<tool_call>" in messages[1]["content"]
    text = smollm2.apply_chat_template(messages)
    assert "<tool_response>" in text


@pytest.mark.parametrize("choice", ["auto", "required"])
@pytest.mark.parametrize("fmt", sorted(REPLIES))
def test_replies_parse_and_stream_to_the_same_calls_however_they_are_cut(fmt, choice):
    f = tc.ToolFormat(fmt, native=True)
    reply = REPLIES[fmt]
    content, calls = tc.parse(reply, _plan(choice), f)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == CALLS
    assert content == ("Checking." if fmt == "hermes" else None)
    for size in range(1, 9):
        parser = tc.StreamParser(_plan(choice), f)
        deltas = []
        for i in range(0, len(reply), size):
            deltas += parser.feed(reply[i:i + size])
        deltas += parser.finish()
        streamed: dict[int, list] = {}
        for d in deltas:
            if d.id is not None:
                assert d.index not in streamed and d.name  # a call starts once, name first
                streamed[d.index] = [d.name, ""]
            elif d.index is not None:
                streamed[d.index][1] += d.arguments
        assert [(n, json.loads(a)) for n, a in streamed.values()] == CALLS, size
        assert "".join(d.content for d in deltas if d.content) == (content or "")


@pytest.mark.parametrize("text", [
    "No calls here, just <tool_call> talk.",
    "Unclosed <tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\"",
    '<tool_call>\n{"name": "launch_rockets", "arguments": {}}\n</tool_call>',  # not a declared tool
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": </tool_call>',  # broken JSON
    "A plain answer.",
])
def test_what_is_no_call_stays_text_in_both_paths(text):
    """With tool_choice auto a stream holds a call until its block closes (only a forced call,
    whose grammar guarantees it parses, streams its arguments as they are written)."""
    f = tc.ToolFormat("hermes", native=False)
    assert tc.parse(text, _plan(), f) == (text, [])
    parser = tc.StreamParser(_plan(), f)
    deltas = [d for ch in text for d in parser.feed(ch)] + parser.finish()
    assert all(d.index is None for d in deltas)
    assert "".join(d.content for d in deltas) == text


@pytest.mark.parametrize("fmt", ["hermes", "llama3_json", "mistral"])
def test_a_forced_calls_grammar_takes_valid_calls_only(smollm2, fmt):
    structured = StructuredOutput(smollm2, smollm2.vocab_size, [smollm2.eos_token_id])
    f = tc.ToolFormat(fmt, native=True)
    good = {"hermes": tc.call_block("get_weather", {"city": "Oslo", "days": 3}),
            "llama3_json": '{"name": "get_weather", "parameters": {"city": "Oslo", "days": 3}}',
            "mistral": '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo", "days": 3}}]'}[fmt]
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        grammar = structured.compile(tc.constraint(_plan(choice), f))
        structured.start("r", grammar)
        ids = smollm2.encode(good, add_special_tokens=False)
        assert not any(structured.accept("r", tok) for tok in ids[:-1])
        # The call is complete: the grammar ends with it (one call) or allows the reply's end
        # (more calls may follow).
        assert structured.accept("r", ids[-1]) or structured.accept("r", smollm2.eos_token_id), fmt
        structured.release("r")
    # Arguments outside the schema (days > 7) are refused token by token.
    bad = good.replace("3}", "9}")
    structured.start("r", structured.compile(tc.constraint(_plan("required"), f)))
    with pytest.raises(GrammarRejected):
        for tok in smollm2.encode(bad, add_special_tokens=False):
            structured.accept("r", tok)
    structured.release("r")
    assert tc.constraint(_plan("auto"), f) is None and tc.constraint(_plan("none"), f) is None


def test_a_schema_the_grammar_library_cannot_compile_is_a_400_naming_tools(smollm2):
    structured = StructuredOutput(smollm2, smollm2.vocab_size, [smollm2.eos_token_id])
    tool = {"type": "function", "function": {"name": "f", "parameters": {"$ref": "#/$defs/missing"}}}
    with pytest.raises(InvalidRequestError) as e:
        structured.compile(tc.constraint(tc.plan([tool], "required", None), tc.tool_format(None)))
    assert e.value.param == "tools"


@pytest.mark.parametrize("tools, choice, param", [
    ([{"type": "code_interpreter"}], None, "tools"),
    ([WEATHER, WEATHER], None, "tools"),
    ([{"type": "function", "function": {"name": "x" * 65}}], None, "tools"),
    ([{"type": "function", "function": {"name": "f", "parameters": [1]}}], None, "tools"),
    ([{"type": "function", "function": {"name": "f", "unknown": 1}}], None, "tools"),
    ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "tool_choice"),
    ([WEATHER], {"type": "function"}, "tool_choice"),
    (None, "required", "tool_choice"),
    ([WEATHER], "always", "tool_choice"),
])
def test_plan_refuses_bad_tools_naming_the_field(tools, choice, param):
    with pytest.raises(tc.ToolsError) as e:
        tc.plan(tools, choice, None)
    assert e.value.param == param


def test_plan_modes():
    assert _plan().mode == "auto" and _plan().parallel
    assert tc.plan(None, None, None).mode == "none" and not tc.plan(None, None, None).offered
    named = _plan({"type": "function", "function": {"name": "get_time"}})
    assert named.mode == "named" and named.named == "get_time" and not named.parallel
    assert not _plan("required", parallel=False).parallel


def test_a_forced_call_closes_the_objects_its_schema_leaves_open(smollm2):
    """A pydantic-made schema says nothing of other keys (JSON Schema then allows any): the
    forced call's grammar closes every object that lists its properties, except allOf's parts."""
    open_schema = {"type": "object", "properties": {"city": {"type": "string"}, "where": {"$ref": "#/$defs/Geo"}},
                   "required": ["city"], "$defs": {"Geo": {"type": "object", "properties": {"lat": {"type": "number"}}}},
                   "x-guidance": {"whitespace_flexible": True}}
    closed = tc._params_schema(tc.Tool("f", None, open_schema))
    assert closed["additionalProperties"] is False and closed["$defs"]["Geo"]["additionalProperties"] is False
    assert "x-guidance" not in closed and "additionalProperties" not in open_schema  # the tool's own is untouched
    kept = {"type": "object", "properties": {"a": {"type": "string"}}, "additionalProperties": {"type": "integer"}}
    assert tc._params_schema(tc.Tool("g", None, kept))["additionalProperties"] == {"type": "integer"}
    parts = {"allOf": [{"type": "object", "properties": {"a": {"type": "string"}}}]}
    assert "additionalProperties" not in tc._params_schema(tc.Tool("h", None, parts))["allOf"][0]

    structured = StructuredOutput(smollm2, smollm2.vocab_size, [smollm2.eos_token_id])
    tool = {"type": "function", "function": {"name": "f", "parameters": open_schema}}
    structured.start("r", structured.compile(tc.constraint(tc.plan([tool], "required", None), tc.tool_format(None))))
    with pytest.raises(GrammarRejected):
        for tok in smollm2.encode(tc.call_block("f", {"city": "Oslo", "invented": 1}), add_special_tokens=False):
            structured.accept("r", tok)
