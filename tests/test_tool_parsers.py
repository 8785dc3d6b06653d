"""Tool-call parsers qwen3_coder, mistral and pythonic, golden-tested on the formats'
published examples, streamed (one character at a time, as the server does) and not;
and ``--tool-parser-plugin``: a vLLM-style parser class loaded from a file and served."""

from __future__ import annotations

import json
import textwrap

import httpx
import pytest

from jaxserve.entrypoints.openai.tool_calls import ToolCallStream, ToolPlan
from jaxserve.entrypoints.openai.tool_parsers import get_tool_parser

try:                                    # tests/ as a package or as a plain directory
    from tests.fake_engine import FakeEngineCore
    from tests.test_server_fake_engine import ServerThread, sse_events
    from tests.test_tool_calling import reassemble
except ImportError:
    from fake_engine import FakeEngineCore
    from test_server_fake_engine import ServerThread, sse_events
    from test_tool_calling import reassemble

WEATHER_TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "state": {"type": "string"},
        "unit": {"type": "string"}, "days": {"type": "integer"}}}}}]

# Qwen3-Coder's chat template format (its model card's tool-calling example).
QWEN3_CODER = ("I'll check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\n"
               "Dallas\n</parameter>\n<parameter=state>\nTX\n</parameter>\n"
               "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>\n"
               "<tool_call>\n<function=get_weather>\n<parameter=city>\nSan Francisco\n"
               "</parameter>\n</function>\n</tool_call>")
# Mistral's function-calling docs: [TOOL_CALLS] and a JSON list; and the v11 tokenizer's form.
MISTRAL = ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Dallas", '
           '"state": "TX", "unit": "fahrenheit"}}, {"name": "get_weather", "arguments": '
           '{"city": "San Francisco", "state": "CA", "unit": "fahrenheit"}}]')
MISTRAL_V11 = '[TOOL_CALLS]get_weather[ARGS]{"city": "Dallas", "state": "TX"}'
# vLLM's pythonic parser docs (Llama 3.2 / Llama 4 style).
PYTHONIC = ("[get_weather(city='San Francisco', metric='celsius'), "
            "get_weather(city='Seattle', metric='celsius')]")
PYTHONIC_LLAMA4 = '<|python_start|>[get_weather(city="Dallas", days=3)]<|python_end|>'

GOLDEN = [
    ("qwen3_coder", QWEN3_CODER, "I'll check.\n",
     [("get_weather", {"city": "Dallas", "state": "TX", "days": 3}),
      ("get_weather", {"city": "San Francisco"})]),
    ("qwen3_coder", "No tools needed: the answer is 4.", "No tools needed: the answer is 4.", []),
    ("mistral", MISTRAL, "",
     [("get_weather", {"city": "Dallas", "state": "TX", "unit": "fahrenheit"}),
      ("get_weather", {"city": "San Francisco", "state": "CA", "unit": "fahrenheit"})]),
    ("mistral", MISTRAL_V11, "", [("get_weather", {"city": "Dallas", "state": "TX"})]),
    ("mistral", "Plain [text] answer.", "Plain [text] answer.", []),
    ("pythonic", PYTHONIC, "",
     [("get_weather", {"city": "San Francisco", "metric": "celsius"}),
      ("get_weather", {"city": "Seattle", "metric": "celsius"})]),
    ("pythonic", PYTHONIC_LLAMA4, "", [("get_weather", {"city": "Dallas", "days": 3})]),
    ("pythonic", "[1, 2] is a list, not a call.", "[1, 2] is a list, not a call.", []),
]


def _stream_char_by_char(plan: ToolPlan, text: str) -> tuple[str, list[dict]]:
    """Content and calls reassembled from deltas, the text growing one character a step."""
    stream, content, calls = ToolCallStream(plan), "", {}
    for end in range(1, len(text) + 1):
        piece, deltas = stream.deltas(text[:end], final=end == len(text))
        content += piece
        for delta in deltas:
            entry = calls.setdefault(delta["index"], {"name": None, "arguments": ""})
            if "id" in delta:
                assert entry["name"] is None, "a call's name is sent once"
                entry["name"] = delta["function"]["name"]
            entry["arguments"] += delta["function"].get("arguments", "")
    return content, [calls[i] for i in sorted(calls)]


@pytest.mark.parametrize("parser, text, content, calls", GOLDEN)
def test_golden_examples_parse_streamed_and_not(parser, text, content, calls):
    got_content, got_calls = get_tool_parser(parser, tools=WEATHER_TOOLS).split(text, True)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got_calls] == calls
    plan = ToolPlan("auto", WEATHER_TOOLS, parser_name=parser)
    streamed_content, streamed_calls = _stream_char_by_char(plan, text)
    assert streamed_content == content
    assert [(c["name"], c["arguments"]) for c in streamed_calls] == \
        [(c.name, c.arguments) for c in got_calls]


def test_qwen3_coder_converts_parameters_by_declared_type_and_streams_them_early():
    parser = get_tool_parser("qwen3_coder", tools=WEATHER_TOOLS)
    partial = QWEN3_CODER[:QWEN3_CODER.index("<parameter=days>")]
    _, [call] = parser.split(partial, final=False)
    assert call.arguments == '{"city": "Dallas", "state": "TX"', "arguments grow per parameter"
    # Undeclared tools: JSON-looking values are read as JSON, the rest stay strings.
    text = "<tool_call>\n<function=f>\n<parameter=n>\n7\n</parameter>\n<parameter=s>\nhi\n" \
           "</parameter>\n</function>\n</tool_call>"
    [call] = get_tool_parser("qwen3_coder").split(text, True)[1]
    assert json.loads(call.arguments) == {"n": 7, "s": "hi"}


def test_partial_marker_is_held_back_while_streaming():
    for parser, text in (("mistral", "Sure [TOOL_CA"), ("qwen3_coder", "Sure <tool_ca")):
        content, calls = get_tool_parser(parser).split(text, final=False)
        assert content == "Sure " and calls == []


PLUGIN = textwrap.dedent('''
    import json
    from jaxserve.entrypoints.openai.tool_parsers import (
        DeltaFunctionCall, DeltaMessage, DeltaToolCall, ExtractedToolCallInformation,
        FunctionCall, ToolCall, ToolParser, ToolParserManager)

    @ToolParserManager.register_module("call_colon")
    class CallColonParser(ToolParser):
        """Written against vLLM's interface: 'CALL name: {json}' lines."""

        def extract_tool_calls(self, model_output, request):
            content, *lines = model_output.split("CALL ")
            calls = []
            for line in lines:
                name, _, args = line.strip().partition(": ")
                calls.append(ToolCall(function=FunctionCall(name=name, arguments=args)))
            return ExtractedToolCallInformation(bool(calls), calls, content or None)

        def extract_tool_calls_streaming(self, previous_text, current_text, delta_text,
                                         previous_token_ids, current_token_ids,
                                         delta_token_ids, request):
            if "CALL " not in current_text:
                return DeltaMessage(content=delta_text)
            line = current_text.split("CALL ", 1)[1]
            if ": " not in line or "\\n" in line or not line.endswith("}"):
                return None
            name, _, args = line.partition(": ")
            try:
                json.loads(args)
            except ValueError:
                return None
            if getattr(self, "sent", False):
                return None
            self.sent = True
            return DeltaMessage(tool_calls=[DeltaToolCall(
                index=0, id="x", type="function",
                function=DeltaFunctionCall(name=name, arguments=args))])
''')


@pytest.fixture(scope="module")
def plugin_server(tmp_path_factory):
    path = tmp_path_factory.mktemp("plugin") / "my_parser.py"
    path.write_text(PLUGIN)
    srv = ServerThread(FakeEngineCore(max_model_len=4096), enable_auto_tool_choice=True,
                       tool_parser_plugin=str(path), tool_call_parser="call_colon")
    yield srv
    srv.stop()


def test_a_plugin_parser_loads_from_a_path_and_parses_streamed_and_not(plugin_server):
    plugin_server.fake.script = 'Checking. CALL get_weather: {"city": "Dallas"}'
    body = {"messages": [{"role": "user", "content": "weather?"}], "tools": WEATHER_TOOLS,
            "max_tokens": 400}
    r = httpx.post(plugin_server.url + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 200, r.text
    [choice] = r.json()["choices"]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "Checking. "
    [call] = choice["message"]["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Dallas"}'}
    streamed = reassemble(sse_events(httpx.post(plugin_server.url + "/v1/chat/completions",
                                                json={**body, "stream": True}, timeout=30)))
    assert streamed["content"] == "Checking. "
    assert [(c["name"], c["arguments"]) for c in streamed["tool_calls"]] == \
        [("get_weather", '{"city": "Dallas"}')]


def test_a_bad_plugin_path_or_unknown_parser_fails_at_startup(tmp_path):
    with pytest.raises(ValueError, match="is not a file"):
        ServerThread(FakeEngineCore(), tool_parser_plugin=str(tmp_path / "missing.py"),
                     tool_call_parser="hermes")
    with pytest.raises(ValueError, match="unknown tool call parser 'nope'"):
        ServerThread(FakeEngineCore(), enable_auto_tool_choice=True, tool_call_parser="nope")
