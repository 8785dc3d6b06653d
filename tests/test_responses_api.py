"""POST /v1/responses with the stock openai client and the OpenAI Agents SDK.

On the fake engine (scripted replies, no JAX): text, the stream's event sequence, a tool
round trip through previous_response_id, store: false, GET /v1/responses/{id}, and every
unsupported field or item → a 400 naming it. On the live tiny-Llama tools server:
text.format json_schema and tool_choice "required" are enforced, streamed or not, and the
Agents SDK's default model class (OpenAIResponsesModel) runs a tool loop.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import jsonschema
import openai
import pytest

try:                                    # tests/ as a package or as a plain directory
    from tests.fake_engine import FakeEngineCore
    from tests.test_server_fake_engine import ServerThread, assert_openai_error
    from tests.test_tool_calling import SCHEMAS
except ImportError:
    from fake_engine import FakeEngineCore
    from test_server_fake_engine import ServerThread, assert_openai_error
    from test_tool_calling import SCHEMAS

WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather",
           "parameters": SCHEMAS["get_weather"]}
HERMES_CALL = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
               '"celsius": true}}\n</tool_call>')


@pytest.fixture(scope="module")
def fake_server():
    srv = ServerThread(FakeEngineCore(max_model_len=4096), enable_auto_tool_choice=True,
                       tool_call_parser="hermes")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def fake_client(fake_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=fake_server.url + "/v1", api_key="x", max_retries=0)


def test_text_response_and_its_stream(fake_server, fake_client):
    fake_server.fake.script = "Hello there."
    response = fake_client.responses.create(model="fake-model", input="Hi",
                                            instructions="Be brief.")
    assert response.status == "completed" and response.output_text == "Hello there."
    assert response.id.startswith("resp_") and response.instructions == "Be brief."
    [message] = response.output
    assert message.type == "message" and message.role == "assistant"
    # The instructions became the system turn of the rendered prompt.
    prompt = fake_server.fake.tokenizer.decode(fake_server.fake.last_prompt_ids)
    assert prompt.startswith("<system>Be brief.<user>Hi")
    assert response.usage.input_tokens == len(prompt.encode())

    with fake_client.responses.stream(model="fake-model", input="Hi") as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[2:4] == ["response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.completed"]
    assert kinds.count("response.output_text.delta") >= 1
    assert final.output_text == "Hello there."


def test_max_output_tokens_gives_an_incomplete_response(fake_server, fake_client):
    fake_server.fake.script = "A long answer that will be cut."
    response = fake_client.responses.create(model="fake-model", input="Hi",
                                            max_output_tokens=5)
    assert response.status == "incomplete"
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.output_text == "A lon"


def test_tool_round_trip_through_previous_response_id(fake_server, fake_client):
    fake_server.fake.script = "Let me check." + HERMES_CALL
    first = fake_client.responses.create(model="fake-model", input="Weather in Paris?",
                                         tools=[WEATHER])
    message, call = first.output
    assert message.content[0].text == "Let me check."
    assert call.type == "function_call" and call.name == "get_weather"
    assert json.loads(call.arguments) == {"city": "Paris", "celsius": True}
    with fake_client.responses.stream(model="fake-model", input="Weather in Paris?",
                                      tools=[WEATHER]) as stream:
        events = list(stream)
        streamed = stream.get_final_response()
    assert [o.type for o in streamed.output] == ["message", "function_call"]
    assert streamed.output[1].arguments == call.arguments
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert "".join(deltas) == call.arguments

    fake_server.fake.script = "It is sunny in Paris."
    second = fake_client.responses.create(
        model="fake-model", previous_response_id=first.id, tools=[WEATHER],
        input=[{"type": "function_call_output", "call_id": call.call_id,
                "output": "sunny, 21 C"}])
    assert second.output_text == "It is sunny in Paris."
    assert second.previous_response_id == first.id
    prompt = fake_server.fake.tokenizer.decode(fake_server.fake.last_prompt_ids)
    # The stored history (question, the call) and the tool's output all reached the model.
    assert "Weather in Paris?" in prompt and "<tool>sunny, 21 C" in prompt
    assert httpx.get(f"{fake_server.url}/v1/responses/{second.id}").json()["id"] == second.id


def test_explicit_items_input_and_store_false(fake_server, fake_client):
    fake_server.fake.script = "Done."
    response = fake_client.responses.create(model="fake-model", store=False, input=[
        {"role": "developer", "content": "Use tools."},
        {"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather",
         "arguments": '{"city": "Tokyo", "celsius": false}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "rain"}])
    assert response.output_text == "Done."
    assert_openai_error(httpx.get(f"{fake_server.url}/v1/responses/{response.id}"), 404)
    error = assert_openai_error(httpx.post(fake_server.url + "/v1/responses", json={
        "input": "again", "previous_response_id": response.id}), 404)
    assert error["param"] == "previous_response_id"


def test_a_client_request_id_becomes_the_response_id(fake_server):
    fake_server.fake.script = "ok"
    r = httpx.post(fake_server.url + "/v1/responses", json={"input": "x"},
                   headers={"x-request-id": "trace-42"})
    assert r.json()["id"] == "resp_trace-42" and r.headers["x-request-id"] == "trace-42"
    r = httpx.post(fake_server.url + "/v1/chat/completions", headers={"x-request-id": "t-7"},
                   json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 2})
    assert r.json()["id"] == "chatcmpl-t-7"


@pytest.mark.parametrize("body, param, needle", [
    ({"background": True}, None, "`background` is not supported"),
    ({"include": ["reasoning.encrypted_content"]}, None, "include"),
    ({"reasoning": {"effort": "high"}}, None, "reasoning"),
    ({"tools": [{"type": "web_search"}]}, None, "'web_search' are not supported"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input[0]", "content parts of type 'input_image' are not supported"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0]", "'item_reference'"),
    ({"text": {"format": {"type": "grammar"}}}, "text.format", "'grammar'"),
    ({"truncation": "auto"}, None, "truncation"),
])
def test_unsupported_fields_are_400s_naming_them(fake_server, body, param, needle):
    error = assert_openai_error(httpx.post(fake_server.url + "/v1/responses",
                                           json={"input": "x", **body}), 400)
    assert needle in error["message"]
    if param is not None:
        assert error["param"] == param


# -- live: the tiny Llama tools server (tests/conftest.py) -----------------------------------------
@pytest.fixture(scope="module")
def live_client(tools_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=tools_server.url + "/v1", api_key="x", max_retries=0)


def test_json_schema_text_format_is_enforced_streamed_and_not(live_client):
    schema = {"type": "object", "properties": {"city": {"enum": ["Paris", "Tokyo"]},
                                               "days": {"type": "integer"}},
              "required": ["city", "days"], "additionalProperties": False}
    text = {"format": {"type": "json_schema", "name": "trip", "schema": schema,
                       "strict": True}}
    response = live_client.responses.create(model="tiny", input="Plan a trip.", text=text,
                                            max_output_tokens=40, temperature=0)
    jsonschema.validate(json.loads(response.output_text), schema)
    with live_client.responses.stream(model="tiny", input="Plan a trip.", text=text,
                                      max_output_tokens=40, temperature=0) as stream:
        final = stream.get_final_response()
    assert final.output_text == response.output_text


def test_required_tool_choice_round_trip(live_client):
    tools = [WEATHER]
    response = live_client.responses.create(model="tiny", input="Weather in Paris?",
                                            tools=tools, tool_choice="required",
                                            parallel_tool_calls=False,
                                            max_output_tokens=100, temperature=0)
    assert response.status == "completed"
    calls = [o for o in response.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather"
    for call in calls:
        jsonschema.validate(json.loads(call.arguments), SCHEMAS["get_weather"])
    follow_up = live_client.responses.create(
        model="tiny", previous_response_id=response.id, tools=tools, tool_choice="none",
        max_output_tokens=4, input=[{"type": "function_call_output", "call_id": c.call_id,
                                     "output": "sunny"} for c in calls])
    assert follow_up.status in ("completed", "incomplete")
    assert follow_up.usage.input_tokens > response.usage.input_tokens


@pytest.mark.parametrize("streamed", [False, True])
def test_agents_sdk_default_model_class_runs_a_tool_loop(fake_server, streamed):
    """The Agents SDK's default model (OpenAIResponsesModel) against our server: the
    scripted model calls the tool, the SDK runs it and sends its output back (the tool
    switches the script), the model answers."""
    pytest.importorskip("agents")
    from agents import (
        Agent,
        ModelSettings,
        OpenAIResponsesModel,
        Runner,
        function_tool,
        set_default_openai_client,
        set_tracing_disabled,
    )

    calls = []

    @function_tool
    def get_weather(city: str, celsius: bool) -> str:
        """Current weather in a city."""
        calls.append((city, celsius))
        fake_server.fake.script = "It is sunny in Paris."
        return "sunny, 21 C"

    async def run() -> object:
        client = openai.AsyncOpenAI(base_url=fake_server.url + "/v1", api_key="x",
                                    max_retries=0)
        set_tracing_disabled(True)
        set_default_openai_client(client, use_for_tracing=False)
        agent = Agent(name="weather", instructions="Answer briefly.",
                      model=OpenAIResponsesModel(model="fake-model", openai_client=client),
                      tools=[get_weather], model_settings=ModelSettings(max_tokens=200))
        if not streamed:
            return await Runner.run(agent, "Weather in Paris?", max_turns=4)
        result = Runner.run_streamed(agent, "Weather in Paris?", max_turns=4)
        async for _ in result.stream_events():
            pass
        return result

    fake_server.fake.script = HERMES_CALL
    result = asyncio.run(run())
    assert calls == [("Paris", True)]
    kinds = [item.type for item in result.new_items]
    assert kinds == ["tool_call_item", "tool_call_output_item", "message_output_item"]
    assert result.final_output == "It is sunny in Paris."
    prompt = fake_server.fake.tokenizer.decode(fake_server.fake.last_prompt_ids)
    assert "<tool>sunny, 21 C" in prompt and prompt.startswith("<system>Answer briefly.")
