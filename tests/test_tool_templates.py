"""Tools reach the model: the default model (SmolLM2) is served with jaxserve's bundled
tool-aware variant of its chat template, so tools, assistant tool calls and tool results
are in the prompt and "auto" works end to end; a template that renders no tools is
flagged (a warning once, an ``x-jaxserve-warning`` header per response)."""

from __future__ import annotations

import json

import httpx
import pytest

from jaxserve.chat_templates import SMOLLM2_TEMPLATE, bundled_names, tool_aware_replacement
from jaxserve.loader.tokenizer import apply_chat_template, read_chat_template

try:                                    # tests/ as a package or as a plain directory
    from tests.fake_engine import FakeEngineCore
    from tests.test_server_fake_engine import ServerThread
    from tests.test_tool_calling import TOOLS, USER, WEATHER
except ImportError:
    from fake_engine import FakeEngineCore
    from test_server_fake_engine import ServerThread
    from test_tool_calling import TOOLS, USER, WEATHER

CHATS = [
    USER,
    [{"role": "system", "content": "Be terse."}, *USER,
     {"role": "assistant", "content": "Sunny."}, {"role": "user", "content": "Thanks!"}],
]


@pytest.fixture(scope="module")
def smollm2_tokenizer(default_gguf_path):
    from jaxserve.loader.tokenizer import load_tokenizer

    return load_tokenizer(str(default_gguf_path))


def test_the_bundled_template_replaces_smollm2s_and_renders_plain_chats_identically(
        smollm2_tokenizer):
    assert smollm2_tokenizer.chat_template.strip() == SMOLLM2_TEMPLATE
    tool_aware = tool_aware_replacement(smollm2_tokenizer.chat_template)
    assert tool_aware == read_chat_template("smollm2_tools")      # a bundled name
    assert "smollm2_tools" in bundled_names()
    for chat in CHATS:
        assert apply_chat_template(smollm2_tokenizer, chat, tool_aware) == \
            apply_chat_template(smollm2_tokenizer, chat)
    with pytest.raises(FileNotFoundError, match="bundled template name"):
        read_chat_template("no_such_template")


@pytest.fixture(scope="module")
def smollm2_server(default_gguf_path, tmp_path_factory):
    try:
        from tests.test_server import ServerProcess
    except ImportError:
        from test_server import ServerProcess

    directory = tmp_path_factory.mktemp("smollm2_server")
    server = ServerProcess(default_gguf_path, directory / "server.log", "--max-model-len", "512",
                           "--kv-cache-memory-bytes", str(64 << 20),
                           "--enable-auto-tool-choice", "--tool-call-parser", "hermes")
    yield server
    assert server.stop() == 0, server.log_tail()


def _chat(server, body: dict) -> httpx.Response:
    r = httpx.post(server.url + "/v1/chat/completions", json={"model": "tiny", **body},
                   timeout=120)
    assert r.status_code == 200, r.text
    return r


def test_auto_on_the_default_model_sees_the_tools_and_completes_a_tool_loop(smollm2_server):
    without = _chat(smollm2_server, {"messages": USER, "max_tokens": 1})
    with_tools = _chat(smollm2_server, {"messages": USER, "tools": TOOLS, "max_tokens": 1})
    assert with_tools.json()["usage"]["prompt_tokens"] > \
        without.json()["usage"]["prompt_tokens"] + 60       # both tools' schemas are in it
    assert "x-jaxserve-warning" not in with_tools.headers
    # A forced call (named tool_choice), its result, then "auto": the loop completes.
    forced = _chat(smollm2_server, {"messages": USER, "tools": TOOLS, "max_tokens": 60,
                                    "tool_choice": {"type": "function",
                                                    "function": {"name": "get_weather"}}})
    message = forced.json()["choices"][0]["message"]
    [call] = message["tool_calls"]
    assert set(json.loads(call["function"]["arguments"])) == {"city", "celsius"}
    history = [*USER, message, {"role": "tool", "tool_call_id": call["id"],
                                "content": "sunny, 21 C"}]
    final = _chat(smollm2_server, {"messages": history, "tools": TOOLS, "max_tokens": 8})
    [choice] = final.json()["choices"]
    assert choice["finish_reason"] in ("stop", "length", "tool_calls")
    # The call and its result are in the prompt (SmolLM2's own template dropped the call).
    assert final.json()["usage"]["prompt_tokens"] > \
        with_tools.json()["usage"]["prompt_tokens"] + 20


def test_a_template_that_ignores_tools_is_flagged():
    server = ServerThread(FakeEngineCore(max_model_len=4096), enable_auto_tool_choice=True,
                          tool_call_parser="hermes")      # the fake template drops tools
    try:
        server.fake.script = "ok"
        body = {"messages": USER, "tools": [WEATHER], "max_tokens": 2}
        r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=30)
        assert "does not render the request's tools" in r.headers["x-jaxserve-warning"]
        r = httpx.post(server.url + "/v1/chat/completions", timeout=30,
                       json={"messages": USER, "max_tokens": 2})
        assert "x-jaxserve-warning" not in r.headers
    finally:
        server.stop()
