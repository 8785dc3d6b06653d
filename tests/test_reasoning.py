"""--reasoning-parser (deepseek_r1, qwen3): the thinking as chat's message.reasoning (and
reasoning_content), as separate stream deltas, as Responses reasoning items; tool calls and
structured outputs apply to the answer after it.

Scripted replies on the fake engine test the separation; a tiny random Llama whose
tokenizer has ``<think>``/``</think>`` tokens, forced through them with logit_bias, tests
that the grammar starts after ``</think>`` (and at once when the template's
``enable_thinking: false`` closes the thinking in the prompt).
"""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from jaxserve.reasoning import get_reasoning_parser

try:                                    # tests/ as a package or as a plain directory
    from tests.fake_engine import FakeEngineCore
    from tests.test_server_fake_engine import ServerThread, sse_events
    from tests.test_tool_calling import TOOLS, USER, reassemble
except ImportError:
    from fake_engine import FakeEngineCore
    from test_server_fake_engine import ServerThread, sse_events
    from test_tool_calling import TOOLS, USER, reassemble

THOUGHT = "<think>\nThe user wants the weather. <tool_call> is how I call.\n</think>\n\n"


@pytest.fixture(scope="module")
def qwen3_server():
    srv = ServerThread(FakeEngineCore(max_model_len=4096), enable_auto_tool_choice=True,
                       tool_call_parser="hermes", reasoning_parser="qwen3")
    yield srv
    srv.stop()


def chat(server, body: dict) -> httpx.Response:
    return httpx.post(server.url + "/v1/chat/completions", json=body, timeout=30)


def test_reasoning_is_separated_in_chat_and_in_stream_deltas(qwen3_server):
    qwen3_server.fake.script = THOUGHT + "It is sunny."
    body = {"messages": USER, "max_tokens": 400}
    [choice] = chat(qwen3_server, body).json()["choices"]
    message = choice["message"]
    reasoning = "\nThe user wants the weather. <tool_call> is how I call.\n"
    assert message["reasoning"] == message["reasoning_content"] == reasoning
    assert message["content"] == "\n\nIt is sunny."
    events = [e for e in sse_events(chat(qwen3_server, {**body, "stream": True}))
              if e != "[DONE]" and e["choices"]]
    deltas = [e["choices"][0]["delta"] for e in events]
    assert "".join(d.get("reasoning", "") for d in deltas) == reasoning
    assert "".join(d.get("reasoning_content", "") for d in deltas) == reasoning
    assert "".join(d.get("content") or "" for d in deltas) == "\n\nIt is sunny."
    assert not any("reasoning" in d and d.get("content") for d in deltas), "separate deltas"
    assert not any("think>" in (d.get("content") or "") + d.get("reasoning", "")
                   for d in deltas)


def test_tool_calls_are_parsed_from_the_answer_only(qwen3_server):
    """A <tool_call> inside the thinking is not a call; the one after it is."""
    qwen3_server.fake.script = THOUGHT + (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
        '"celsius": true}}\n</tool_call>')
    body = {"messages": USER, "tools": TOOLS, "max_tokens": 400}
    [choice] = chat(qwen3_server, body).json()["choices"]
    assert choice["finish_reason"] == "tool_calls"
    [call] = choice["message"]["tool_calls"]
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris", "celsius": True}
    assert "<tool_call> is how I call" in choice["message"]["reasoning"]
    streamed = reassemble(sse_events(chat(qwen3_server, {**body, "stream": True})))
    assert [c["arguments"] for c in streamed["tool_calls"]] == [call["function"]["arguments"]]


def test_a_reply_without_thinking_is_all_content_for_qwen3(qwen3_server):
    qwen3_server.fake.script = "Just an answer."
    [choice] = chat(qwen3_server, {"messages": USER, "max_tokens": 400}).json()["choices"]
    assert choice["message"]["content"] == "Just an answer."
    assert "reasoning" not in choice["message"]


def test_responses_api_returns_reasoning_items(qwen3_server):
    qwen3_server.fake.script = THOUGHT + "Sunny."
    client = openai.OpenAI(base_url=qwen3_server.url + "/v1", api_key="x", max_retries=0)
    response = client.responses.create(model="fake-model", input="Weather?")
    reasoning, message = response.output
    assert reasoning.type == "reasoning"
    assert reasoning.content[0].text.startswith("\nThe user wants the weather.")
    assert response.output_text == "\n\nSunny."
    assert response.usage.output_tokens_details.reasoning_tokens > 0
    with client.responses.stream(model="fake-model", input="Weather?") as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert "response.reasoning_text.delta" in kinds and "response.output_text.delta" in kinds
    assert kinds.index("response.reasoning_text.done") < kinds.index(
        "response.output_text.delta")
    assert final.output[0].content[0].text == reasoning.content[0].text
    assert final.output_text == response.output_text


@pytest.mark.parametrize("name, prompt, text, expected", [
    ("deepseek_r1", "", "Thinking without a tag</think>Answer", ("Thinking without a tag",
                                                                "Answer")),
    ("deepseek_r1", "", "<think>cut off by max_tokens", ("cut off by max_tokens", "")),
    ("qwen3", "<|im_start|>assistant\n<think>\n", "thought</think>ok", ("thought", "ok")),
    ("qwen3", "<|im_start|>assistant\n<think>\n\n</think>\n\n", "plain</think>",
     (None, "plain</think>")),
    ("qwen3", "", "no tags", (None, "no tags")),
])
def test_parsers_follow_the_prompt_and_only_grow_while_streaming(name, prompt, text, expected):
    assert get_reasoning_parser(name, prompt).split(text, final=True) == expected
    parser, previous = get_reasoning_parser(name, prompt), ("", "")
    for end in range(len(text) + 1):
        reasoning, content = parser.split(text[:end], final=False)
        assert (reasoning or "").startswith(previous[0]) and content.startswith(previous[1])
        previous = (reasoning or "", content)


# -- a real tiny model with think tokens: structured outputs start after </think> -----------------
THINK_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
    "{% else %}<think>\n{% endif %}{% endif %}")
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
          "additionalProperties": False}


@pytest.fixture(scope="module")
def think_server(tmp_path_factory):
    import torch
    import transformers
    from transformers import AutoTokenizer

    try:
        from tests.conftest import _build_tiny_tokenizer
        from tests.test_server import ServerProcess
    except ImportError:
        from conftest import _build_tiny_tokenizer
        from test_server import ServerProcess

    root = tmp_path_factory.mktemp("think_model")
    _build_tiny_tokenizer(root)
    tokenizer = AutoTokenizer.from_pretrained(root)
    tokenizer.add_tokens(["<think>", "</think>"])     # added, not special: decoded as text
    tokenizer.chat_template = THINK_TEMPLATE
    tokenizer.save_pretrained(root)
    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, vocab_size=len(tokenizer),
        bos_token_id=1, eos_token_id=2, pad_token_id=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32) \
        .save_pretrained(root)
    server = ServerProcess(root, root / "server.log", "--reasoning-parser", "deepseek_r1",
                           "--structured-outputs-disable-any-whitespace")
    server.think_ids = tokenizer.convert_tokens_to_ids(["<think>", "</think>"])
    server.a_id = tokenizer.encode("a", add_special_tokens=False)[0]
    yield server
    assert server.stop() == 0, server.log_tail()


def test_the_grammar_starts_after_the_thinking(think_server):
    """</think> forced first: then the answer obeys the schema (the bias cannot push
    </think> into it); 'a' forced: the thinking is 'a's, unconstrained, and no answer."""
    _, end_id = think_server.think_ids
    body = {"model": "tiny", "messages": USER, "max_tokens": 24,
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": "r", "schema": SCHEMA}}}
    r = httpx.post(think_server.url + "/v1/chat/completions", timeout=120,
                   json={**body, "logit_bias": {str(end_id): 100}})
    assert r.status_code == 200, r.text
    message = r.json()["choices"][0]["message"]
    assert message["reasoning"] == ""
    jsonschema.validate(json.loads(message["content"]), SCHEMA)

    r = httpx.post(think_server.url + "/v1/chat/completions", timeout=120,
                   json={**body, "max_tokens": 6,
                         "logit_bias": {str(think_server.a_id): 100}})
    [choice] = r.json()["choices"]
    assert choice["finish_reason"] == "length"
    assert choice["message"]["reasoning"] == "aaaaaa" and choice["message"]["content"] == ""


def test_enable_thinking_false_constrains_from_the_first_token(think_server):
    _, end_id = think_server.think_ids
    r = httpx.post(think_server.url + "/v1/chat/completions", timeout=120, json={
        "model": "tiny", "messages": USER, "max_tokens": 24,
        "chat_template_kwargs": {"enable_thinking": False},
        "logit_bias": {str(end_id): 100},
        "response_format": {"type": "json_schema",
                            "json_schema": {"name": "r", "schema": SCHEMA}}})
    message = r.json()["choices"][0]["message"]
    assert "reasoning" not in message
    jsonschema.validate(json.loads(message["content"]), SCHEMA)
