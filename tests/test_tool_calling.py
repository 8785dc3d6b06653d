"""Tool calling on /v1/chat/completions.

Against a fake engine that replies with a scripted text (no JAX): the hermes parser for
tool_choice "auto" (calls, plain content, streaming hold-back of a partial
``<tool_call>``), and every bad tools request → a 400. Against a live server on a tiny
random Llama: tool_choice "required" and a named function are enforced with structured
outputs, so even a random model returns valid calls, streamed or not; a follow-up turn
with tool results renders through the chat template; the openai client and LangChain
drive it as they drive OpenAI.
"""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

try:                                    # tests/ as a package or as a plain directory
    from tests.fake_engine import FakeEngineCore
    from tests.test_server_fake_engine import ServerThread, assert_openai_error, sse_events
except ImportError:
    from fake_engine import FakeEngineCore
    from test_server_fake_engine import ServerThread, assert_openai_error, sse_events

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object",
                   "properties": {"city": {"enum": ["Paris", "Tokyo"]},
                                  "celsius": {"type": "boolean"}},
                   "required": ["city", "celsius"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
        "required": ["zone"], "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
USER = [{"role": "user", "content": "What is the weather in Paris?"}]
HERMES_REPLY = ('Let me check.<tool_call>\n{"name": "get_weather", "arguments": '
                '{"city": "Paris", "celsius": true}}\n</tool_call>')


def reassemble(events: list) -> dict:
    """The streamed chunks of choice 0 put back together as a non-streamed message."""
    content, calls, finish = "", {}, None
    for event in events:
        if event == "[DONE]" or not event["choices"]:
            continue
        [choice] = event["choices"]
        delta = choice["delta"]
        content += delta.get("content") or ""
        for call in delta.get("tool_calls", ()):
            entry = calls.setdefault(call["index"], {"id": None, "name": None, "arguments": ""})
            if "id" in call:
                assert entry["id"] is None, "a call's id is sent once"
                entry["id"], entry["name"] = call["id"], call["function"]["name"]
            entry["arguments"] += call["function"].get("arguments", "")
        finish = choice["finish_reason"] or finish
    return {"content": content or None, "finish_reason": finish,
            "tool_calls": [calls[i] for i in sorted(calls)]}


def flat_calls(message: dict) -> list[dict]:
    return [{"id": c["id"], "name": c["function"]["name"],
             "arguments": c["function"]["arguments"]} for c in message.get("tool_calls") or ()]


# -- tool_choice "auto" with the hermes parser, on a scripted fake engine ---------------------------
@pytest.fixture(scope="module")
def hermes_server():
    srv = ServerThread(FakeEngineCore(max_model_len=4096), enable_auto_tool_choice=True,
                       tool_call_parser="hermes")
    yield srv
    srv.stop()


def chat(server, body: dict) -> httpx.Response:
    return httpx.post(server.url + "/v1/chat/completions", json=body, timeout=30)


@pytest.mark.parametrize("script, content, calls", [
    (HERMES_REPLY, "Let me check.", [("get_weather", {"city": "Paris", "celsius": True})]),
    ('<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>\n'
     '<tool_call>{"name": "get_weather", "arguments": {"city": "Tokyo", "celsius": false}}',
     None, [("get_time", {"zone": "UTC"}), ("get_weather", {"city": "Tokyo", "celsius": False})]),
    ("It is sunny, no tool needed. a<b", "It is sunny, no tool needed. a<b", []),
])
def test_auto_hermes_calls_parse_and_stream_to_the_same_message(hermes_server, script, content,
                                                                 calls):
    hermes_server.fake.script = script
    body = {"messages": USER, "tools": TOOLS, "max_tokens": 400}
    r = chat(hermes_server, body)
    assert r.status_code == 200, r.text
    [choice] = r.json()["choices"]
    message = choice["message"]
    assert message["content"] == content
    assert [(c["name"], json.loads(c["arguments"])) for c in flat_calls(message)] == calls
    assert all(c["id"].startswith("chatcmpl-tool-") and c["type"] == "function"
               for c in message.get("tool_calls") or ())
    assert choice["finish_reason"] == ("tool_calls" if calls else "stop")

    events = sse_events(chat(hermes_server, {**body, "stream": True}))
    streamed = reassemble(events)
    assert streamed["content"] == content and streamed["finish_reason"] == choice["finish_reason"]
    assert [(c["name"], c["arguments"]) for c in streamed["tool_calls"]] == \
        [(c["name"], c["arguments"]) for c in flat_calls(message)]
    # One character per step: the start of "<tool_call>" was held back, never sent as content.
    sent = [e["choices"][0]["delta"].get("content") or "" for e in events
            if e != "[DONE]" and e["choices"]]
    if calls:
        assert not any("<" in piece for piece in sent), sent


def test_auto_without_tools_used_and_tool_choice_none_keep_content(hermes_server):
    hermes_server.fake.script = HERMES_REPLY
    r = chat(hermes_server, {"messages": USER, "tools": TOOLS, "tool_choice": "none",
                             "max_tokens": 400})
    [choice] = r.json()["choices"]
    assert choice["message"]["content"] == HERMES_REPLY and choice["finish_reason"] == "stop"
    assert "tool_calls" not in choice["message"]


def test_legacy_functions_are_answered_in_the_legacy_shape(hermes_server):
    """Old clients read message.function_call (and finish_reason "function_call")."""
    hermes_server.fake.script = HERMES_REPLY
    body = {"messages": USER, "functions": [WEATHER["function"]], "function_call": "auto",
            "max_tokens": 400}
    [choice] = chat(hermes_server, body).json()["choices"]
    assert choice["finish_reason"] == "function_call"
    assert "tool_calls" not in choice["message"]
    assert choice["message"]["function_call"] == {
        "name": "get_weather", "arguments": '{"city": "Paris", "celsius": true}'}
    events = sse_events(chat(hermes_server, {**body, "stream": True}))
    deltas = [e["choices"][0]["delta"] for e in events if e != "[DONE]" and e["choices"]]
    assert not any("tool_calls" in d for d in deltas)
    streamed = [d["function_call"] for d in deltas if "function_call" in d]
    assert streamed[0]["name"] == "get_weather"
    assert "".join(d.get("arguments", "") for d in streamed) == \
        choice["message"]["function_call"]["arguments"]
    assert [e["choices"][0]["finish_reason"] for e in events
            if e != "[DONE]" and e["choices"]][-1] == "function_call"


@pytest.mark.parametrize("body, param, needle", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice", "'nope' has not been passed"),
    ({"tool_choice": "required"}, "tool_choice", "`tools` must be set"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "tool_choice must be"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "tool_choice", "cannot be combined"),
    ({"response_format": {"type": "xml"}}, "response_format.type", "'xml'"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a+"}, "guided_*",
     "only use one kind"),
    ({"tools": [{"type": "retrieval"}]}, None, "tools"),
])
def test_bad_tool_and_format_requests_are_openai_400s(hermes_server, body, param, needle):
    hermes_server.fake.script = None
    error = assert_openai_error(chat(hermes_server, {"messages": USER, **body}), 400)
    assert needle in error["message"]
    if param is not None:
        assert error["param"] == param
    assert chat(hermes_server, {"messages": USER, "max_tokens": 3}).status_code == 200


def test_auto_tool_choice_without_the_flags_is_a_400_naming_them():
    srv = ServerThread(FakeEngineCore())
    try:
        for body in ({"tools": TOOLS}, {"tools": TOOLS, "tool_choice": "auto"}):
            error = assert_openai_error(chat(srv, {"messages": USER, **body}), 400)
            assert "--enable-auto-tool-choice" in error["message"]
            assert "--tool-call-parser" in error["message"]
        assert chat(srv, {"messages": USER, "max_tokens": 3}).status_code == 200
    finally:
        srv.stop()


# -- enforced tool choices on a live server ---------------------------------------------------------
@pytest.fixture(scope="module")
def client(tools_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=tools_server.url + "/v1", api_key="EMPTY", max_retries=0,
                         timeout=120)


def live_chat(server, body: dict) -> httpx.Response:
    return httpx.post(server.url + "/v1/chat/completions",
                      json={"model": "tiny", "max_tokens": 80, **body}, timeout=120)


def _assert_valid_calls(calls: list[dict], allowed: set[str]) -> None:
    assert calls
    for call in calls:
        assert call["name"] in allowed and call["id"].startswith("chatcmpl-tool-")
        jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])


@pytest.mark.parametrize("tool_choice, parallel, allowed", [
    ("required", True, {"get_weather", "get_time"}),
    ("required", False, {"get_weather", "get_time"}),
    ({"type": "function", "function": {"name": "get_time"}}, True, {"get_time"}),
])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_required_and_named_tool_choice_always_give_valid_calls(tools_server, tool_choice,
                                                                parallel, allowed, temperature):
    body = {"messages": USER, "tools": TOOLS, "tool_choice": tool_choice, "n": 2, "seed": 1,
            "parallel_tool_calls": parallel, "temperature": temperature}
    r = live_chat(tools_server, body)
    assert r.status_code == 200, r.text
    for choice in r.json()["choices"]:
        # Parallel calls: a random model may keep adding calls until max_tokens; the
        # complete ones are still returned. One call (or a named one) always finishes.
        expected = ("tool_calls", "length") if tool_choice == "required" and parallel \
            else ("tool_calls",)
        assert choice["finish_reason"] in expected, choice
        assert choice["message"]["content"] is None
        calls = flat_calls(choice["message"])
        _assert_valid_calls(calls, allowed)
        if not parallel:
            assert len(calls) == 1
    # Streamed: the same calls (n=1, greedy so both runs pick the same tokens).
    body = {**body, "n": 1, "temperature": 0.0}
    [full] = live_chat(tools_server, body).json()["choices"]
    streamed = reassemble(sse_events(live_chat(tools_server, {**body, "stream": True})))
    assert streamed["finish_reason"] == full["finish_reason"] and streamed["content"] is None
    _assert_valid_calls(streamed["tool_calls"], allowed)
    assert [(c["name"], c["arguments"]) for c in streamed["tool_calls"]] == \
        [(c["name"], c["arguments"]) for c in flat_calls(full["message"])]


def test_a_follow_up_turn_with_tool_results_renders_through_the_template(tools_server,
                                                                         make_tiny_model):
    from transformers import AutoTokenizer

    from tests.conftest import TOOLS_CHATML_TEMPLATE

    messages = USER + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call-1", "type": "function", "function": {
                "name": "get_weather", "arguments": '{"city": "Paris", "celsius": true}'}}]},
        {"role": "tool", "tool_call_id": "call-1", "content": "18 degrees, sunny"}]
    r = live_chat(tools_server, {"messages": messages, "tools": TOOLS, "tool_choice": "none",
                                 "max_tokens": 2})
    assert r.status_code == 200, r.text
    tokenizer = AutoTokenizer.from_pretrained(make_tiny_model("llama"))
    for_template = [dict(m) for m in messages]
    for_template[1] = {**messages[1], "content": "", "tool_calls": [
        {**messages[1]["tool_calls"][0], "function": {
            "name": "get_weather", "arguments": {"city": "Paris", "celsius": True}}}]}
    text = tokenizer.apply_chat_template(for_template, chat_template=TOOLS_CHATML_TEMPLATE,
                                         tokenize=False, add_generation_prompt=True)
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"' in text
    assert "<tool_response>18 degrees, sunny</tool_response>" in text
    expected = len(tokenizer.encode(text, add_special_tokens=False))
    assert r.json()["usage"]["prompt_tokens"] == expected
    # With tools shown (tool_choice auto), the template lists them: a longer prompt.
    with_tools = live_chat(tools_server, {"messages": USER, "tools": TOOLS, "max_tokens": 2,
                                          "tool_choice": "required"}).json()
    without = live_chat(tools_server, {"messages": USER, "max_tokens": 2}).json()
    assert with_tools["usage"]["prompt_tokens"] > without["usage"]["prompt_tokens"] + 10


def test_openai_client_tool_calls_round_trip(client):
    completion = client.chat.completions.create(
        model="tiny", messages=USER, tools=TOOLS, max_tokens=80,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    [call] = completion.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS["get_weather"])


def test_langchain_bind_tools_and_structured_output(tools_server):
    langchain_openai = pytest.importorskip("langchain_openai")
    from typing import Literal

    from pydantic import BaseModel

    class Weather(BaseModel):
        city: Literal["Paris", "Tokyo"]
        celsius: bool

    llm = langchain_openai.ChatOpenAI(model="tiny", base_url=tools_server.url + "/v1",
                                      api_key="EMPTY", max_tokens=80, temperature=0,
                                      max_retries=0)
    bound = llm.bind_tools([WEATHER], tool_choice="get_weather")
    message = bound.invoke("Weather in Paris?")
    [call] = message.tool_calls
    assert call["name"] == "get_weather"
    jsonschema.validate(call["args"], SCHEMAS["get_weather"])
    for method in ("json_schema", "function_calling"):
        result = llm.with_structured_output(Weather, method=method).invoke("Weather?")
        assert isinstance(result, Weather), method


def test_readme_structured_output_and_tool_examples_run(tools_server):
    import re
    import subprocess
    import sys
    from pathlib import Path

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    blocks = dict(re.findall(r"```(\w+) test-tools-server\n(.*?)```", readme, re.DOTALL))
    assert set(blocks) == {"sh", "python"}, "README examples not found"
    sh = blocks["sh"].replace("http://localhost:8000", tools_server.url)
    result = subprocess.run(["bash", "-euo", "pipefail", "-c", sh.replace("curl -s", "curl -sf")],
                            capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    [choice] = json.loads(result.stdout)["choices"]
    answer = json.loads(choice["message"]["content"])
    assert answer["color"] in ("red", "blue") and isinstance(answer["sure"], bool)
    code = blocks["python"].replace("http://localhost:8000", tools_server.url)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    assert lines and all(re.match(r"chatcmpl-tool-\w+ get_weather \{'city': '(Paris|Tokyo)'\}$",
                                  line) for line in lines), result.stdout


@pytest.mark.parametrize("text, final, content, calls", [
    ('{"name": "get_time", "parameters": {"zone": "UTC"}}', True, "",
     [("get_time", '{"zone": "UTC"}')]),
    ('<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"x": 1}}',
     True, "", [("a", "{}"), ("b", '{"x": 1}')]),
    ('{"name": "get_time", "parameters": {"zone": ', False, "", []),     # held back
    ('{"not": "a call"}', True, '{"not": "a call"}', []),
    ("Plain answer.", False, "Plain answer.", []),
])
def test_llama3_json_parser_splits_calls_from_content(text, final, content, calls):
    from jaxserve.entrypoints.openai.tool_parsers import get_tool_parser

    got_content, got_calls = get_tool_parser("llama3_json").split(text, final)
    assert got_content == content
    assert [(c.name, c.arguments) for c in got_calls] == calls


def test_hermes_parser_holds_back_only_a_possible_tag_start():
    from jaxserve.entrypoints.openai.tool_parsers import get_tool_parser

    parser = get_tool_parser("hermes")
    assert parser.split("Sure <tool_c", final=False) == ("Sure ", [])
    assert parser.split("a < b", final=False) == ("a < b", [])
    assert parser.split("Sure <tool_c", final=True) == ("Sure <tool_c", [])
    assert parser.split('x<tool_call>{"name": "f", "arguments": {}} bad', final=True) \
        == ('x<tool_call>{"name": "f", "arguments": {}} bad', [])


# -- "required" streams incrementally; a cut-off call stays a call --------------------------------
REQUIRED_REPLY = ('[{"name":"get_weather","parameters":{"city":"Paris","celsius":true}},'
                  '{"name":"get_time","parameters":{"zone":"UTC"}}]')


def test_required_streams_argument_deltas_as_generated(hermes_server):
    hermes_server.fake.script = REQUIRED_REPLY
    body = {"messages": USER, "tools": TOOLS, "tool_choice": "required", "max_tokens": 400,
            "stream": True}
    events = sse_events(chat(hermes_server, body))
    streamed = reassemble(events)
    assert streamed["finish_reason"] == "tool_calls" and streamed["content"] is None
    assert [(c["name"], c["arguments"]) for c in streamed["tool_calls"]] == [
        ("get_weather", '{"city":"Paris","celsius":true}'), ("get_time", '{"zone":"UTC"}')]
    # As the server sees the text grow token by token, the arguments go out as they grow.
    from jaxserve.entrypoints.openai.tool_calls import ToolCallStream, ToolPlan

    stream, fragments = ToolCallStream(ToolPlan("required", TOOLS)), []
    for end in range(1, len(REQUIRED_REPLY) + 1):
        _, deltas = stream.deltas(REQUIRED_REPLY[:end], final=end == len(REQUIRED_REPLY))
        fragments += [d["function"].get("arguments", "") for d in deltas]
    assert len(fragments) > 20, "arguments arrive in pieces, not one delta per call"
    assert fragments[0] == "" and "".join(fragments) == \
        '{"city":"Paris","celsius":true}{"zone":"UTC"}'


def test_a_required_call_cut_by_max_tokens_is_a_partial_call_not_content(hermes_server):
    hermes_server.fake.script = REQUIRED_REPLY
    body = {"messages": USER, "tools": TOOLS, "tool_choice": "required", "max_tokens": 45}
    [choice] = chat(hermes_server, body).json()["choices"]
    assert choice["finish_reason"] == "length"
    assert not choice["message"]["content"]
    [call] = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert call["function"]["arguments"] == REQUIRED_REPLY[REQUIRED_REPLY.index("{\"city"):45]
    streamed = reassemble(sse_events(chat(hermes_server, {**body, "stream": True})))
    assert streamed["finish_reason"] == "length" and streamed["content"] is None
    assert [(c["name"], c["arguments"]) for c in streamed["tool_calls"]] == \
        [("get_weather", REQUIRED_REPLY[REQUIRED_REPLY.index("{\"city"):45])]


def test_disable_any_whitespace_combines_with_response_format(hermes_server):
    hermes_server.fake.script = "{}"
    r = chat(hermes_server, {"messages": USER, "max_tokens": 5,
                             "response_format": {"type": "json_object"},
                             "structured_outputs": {"disable_any_whitespace": True}})
    assert r.status_code == 200, r.text
    error = assert_openai_error(chat(hermes_server, {
        "messages": USER, "structured_outputs": {"disable_any_whitespace": True}}), 400)
    assert error["param"] == "structured_outputs"


def test_unsupported_content_error_is_readable(hermes_server):
    error = assert_openai_error(chat(hermes_server, {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "https://x/cat.png"}}]}]}), 400)
    assert "content parts of type 'image_url' are not supported" in error["message"]
    assert error["param"] == "messages.0.content.0"
