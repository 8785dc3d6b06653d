"""The HTTP layer and AsyncLLMEngine against a fake, instant engine (no JAX, no model).

The fake has LLMEngine's surface (add_request / abort_request / step / ...) and a
byte-level tokenizer; it "generates" a fixed text cycle. These tests cover what
the HTTP side decides on its own: request parsing, errors, streaming framing,
disconnects, engine death, auth and shutdown. tests/test_server.py repeats the
important ones against the real engine.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import socket
import sys
import threading
import time

import httpx
import pytest

from jaxserve.config import ServeConfig
from jaxserve.engine.async_engine import AsyncLLMEngine
from jaxserve.engine.errors import EngineDeadError
from jaxserve.sampling_params import SamplingParams

pytestmark = pytest.mark.fast  # the pre-commit tier: `make test-fast`

try:                                    # tests/ as a package or as a plain directory
    from tests.fake_engine import CYCLE, FakeEngineCore
except ImportError:
    from fake_engine import CYCLE, FakeEngineCore


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerThread:
    """build_app + uvicorn in a thread, on a free port."""

    def __init__(self, engine: FakeEngineCore, api_key: str | None = None,
                 **server_options) -> None:
        import uvicorn

        from jaxserve.entrypoints.openai.api_server import build_app

        self.fake = engine
        self.engine = AsyncLLMEngine(engine)
        config = ServeConfig()
        config.engine.model_config.served_model_name = ["fake-model"]
        for name, value in server_options.items():      # ServerConfig fields
            setattr(config.server, name, value)
        self.app = build_app(self.engine, config, api_key=api_key)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port,
                                                    log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.engine.shutdown()


@pytest.fixture(scope="module")
def server():
    srv = ServerThread(FakeEngineCore())
    yield srv
    srv.stop()


def post(server, path: str, body, **kwargs) -> httpx.Response:
    if isinstance(body, (dict, list)):
        kwargs["json"] = body
    else:
        kwargs["content"] = body
    kwargs.setdefault("timeout", 30)
    return httpx.post(server.url + path, **kwargs)


def sse_events(response: httpx.Response) -> list:
    events = []
    for line in response.text.splitlines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def assert_openai_error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    return error


# -- happy paths ------------------------------------------------------------------------------------
def test_completion_returns_text_usage_and_finish_reason(server):
    r = post(server, "/v1/completions", {"model": "fake-model", "prompt": "ab", "max_tokens": 5})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion" and body["model"] == "fake-model"
    [choice] = body["choices"]
    start = (ord("a") + ord("b")) % len(CYCLE)
    assert choice["text"] == (CYCLE * 2)[start:start + 5]
    assert choice["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": 2, "completion_tokens": 5, "total_tokens": 7,
                             "prompt_tokens_details": {"cached_tokens": 0}}


def test_completion_prompt_list_and_n_give_prompt_major_choice_indices(server):
    r = post(server, "/v1/completions", {"prompt": ["a", "b"], "n": 2, "max_tokens": 3,
                                         "echo": True})
    choices = r.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    assert choices[0]["text"].startswith("a") and choices[2]["text"].startswith("b")
    assert r.json()["usage"]["completion_tokens"] == 12


def test_streamed_completion_deltas_join_to_the_full_text(server):
    body = {"prompt": [104, 105], "max_tokens": 8, "stream": True,
            "stream_options": {"include_usage": True}, "logprobs": 1}
    events = sse_events(post(server, "/v1/completions", body))
    assert events[-1] == "[DONE]"
    usage = events[-2]["usage"]
    assert events[-2]["choices"] == [] and usage["completion_tokens"] == 8
    chunks = [e["choices"][0] for e in events[:-2]]
    assert chunks[-1]["finish_reason"] == "length"
    text = "".join(c["text"] for c in chunks)
    full = post(server, "/v1/completions", {**body, "stream": False, "stream_options": None}
                ).json()["choices"][0]
    assert text == full["text"]
    tokens = [t for c in chunks if c["logprobs"] for t in c["logprobs"]["tokens"]]
    assert tokens == full["logprobs"]["tokens"]
    assert full["logprobs"]["text_offset"][:2] == [0, 1]


def test_chat_stream_starts_with_role_and_ends_with_finish_chunk(server):
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
            "max_tokens": 4, "stream": True, "n": 2}
    events = sse_events(post(server, "/v1/chat/completions", body))
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(e["object"] == "chat.completion.chunk" for e in chunks)
    assert [c["choices"][0]["delta"] for c in chunks[:2]] == [
        {"role": "assistant", "content": ""}] * 2
    finals = [c["choices"][0] for c in chunks if c["choices"][0]["finish_reason"]]
    assert sorted(f["index"] for f in finals) == [0, 1]
    assert all(f["delta"] == {} and f["finish_reason"] == "length" for f in finals)


def test_chat_stop_string_and_logprobs(server):
    body = {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "x"}],
            "max_tokens": 40, "stop": ["fox"], "logprobs": True, "top_logprobs": 1}
    r = post(server, "/v1/chat/completions", body)
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop" and "fox" not in choice["message"]["content"]
    content = choice["logprobs"]["content"]
    assert content[0]["top_logprobs"][0]["logprob"] == -0.5
    assert content[0]["bytes"] == list(content[0]["token"].encode())


def test_models_version_tokenize_detokenize(server):
    models = httpx.get(server.url + "/v1/models").json()["data"]
    assert models[0]["id"] == "fake-model" and models[0]["max_model_len"] == 128
    assert "version" in httpx.get(server.url + "/version").json()
    tok = post(server, "/tokenize", {"prompt": "hé"}).json()
    assert tok["tokens"] == list("hé".encode()) and tok["count"] == 3
    assert post(server, "/detokenize", {"tokens": tok["tokens"]}).json() == {"prompt": "hé"}
    chat_tok = post(server, "/tokenize", {"messages": [{"role": "user", "content": "a"}]})
    assert chat_tok.json()["count"] == len("<user>a<assistant>")


# -- errors -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("path, body, status, fragment", [
    ("/v1/completions", b"{not json", 400, "not valid JSON"),
    ("/v1/completions", b'{"prompt": "\xff\xfe"}', 400, "UTF-8"),
    ("/v1/completions", b"[1, 2]", 400, "JSON object"),
    ("/v1/completions", b'{"prompt": "a\\ud800b"}', 400, "surrogate"),
    ("/v1/completions", {"prompt": ["a"] * 600, "n": 2}, 400, "at most"),
    ("/v1/completions", {"prompt": "a", "max_tokens": "many"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "a", "n": 100000}, 400, "n"),
    ("/v1/completions", {"prompt": "a", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"prompt": "a", "logprobs": 21}, 400, "logprobs"),
    ("/v1/completions", {"prompt": []}, 400, "prompt"),
    ("/v1/completions", {}, 400, "prompt"),
    ("/v1/completions", {"prompt": [999999]}, 400, "out of range"),
    ("/v1/completions", {"prompt": "a", "max_tokens": 10 ** 12}, 400, "maximum context length"),
    ("/v1/completions", {"prompt": "x" * 500}, 400, "maximum context length"),
    ("/v1/completions", {"prompt": "a", "model": "gpt-4"}, 404, "does not exist"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "a"}]}, 400, "role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]}, 400, "image_url"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}],
                              "top_logprobs": 2}, 400, "logprobs"),
    ("/detokenize", {"tokens": [-1]}, 400, "out of range"),
])
def test_bad_requests_get_openai_shaped_errors_and_the_server_keeps_serving(
        server, path, body, status, fragment):
    error = assert_openai_error(post(server, path, body), status)
    assert fragment in error["message"] or fragment == error["param"], error
    ok = post(server, "/v1/completions", {"prompt": "a", "max_tokens": 2})
    assert ok.status_code == 200


def test_context_length_error_uses_vllm_wording(server):
    error = assert_openai_error(
        post(server, "/v1/completions", {"prompt": "abc", "max_tokens": 200}), 400)
    assert error["message"] == (
        "This model's maximum context length is 128 tokens. However, you requested 203 tokens "
        "(3 in the prompt, 200 in the completion). Please reduce the length of the prompt "
        "or completion.")
    error = assert_openai_error(post(server, "/v1/completions", {"prompt": "a" * 200}), 400)
    assert error["param"] == "prompt" and "input prompt" in error["message"]
    error = assert_openai_error(post(server, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "a" * 200}]}), 400)
    assert error["param"] == "messages"


def test_escaped_surrogate_pair_is_fine(server):
    r = post(server, "/v1/completions", b'{"prompt": "\\ud83d\\ude00", "max_tokens": 2}')
    assert r.status_code == 200, r.text


def test_unknown_fields_are_accepted(server):
    r = post(server, "/v1/completions", {"prompt": "a", "max_tokens": 2, "frobnicate": 1})
    assert r.status_code == 200


@pytest.mark.parametrize("path, body, field", [
    ("/v1/completions", {"use_beam_search": True}, "use_beam_search"),
    ("/v1/completions", {"bad_words": ["x"]}, "bad_words"),
    ("/v1/completions", {"priority": 3}, "priority"),
    ("/v1/chat/completions", {"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    ("/v1/chat/completions", {"prediction": {"type": "content", "content": "x"}},
     "prediction"),
    ("/v1/chat/completions", {"modalities": ["text", "audio"]}, "modalities"),
])
def test_recognised_but_unimplemented_fields_are_a_400_naming_them(server, path, body, field):
    base = ({"prompt": "a", "max_tokens": 2} if path == "/v1/completions" else
            {"messages": [{"role": "user", "content": "a"}], "max_tokens": 2})
    error = assert_openai_error(post(server, path, {**base, **body}), 400)
    assert field in error["message"], error
    # Their "off" values are what many clients send by default: those stay a 200.
    off = {"use_beam_search": False, "bad_words": [], "priority": 0, "audio": None,
           "prediction": None, "modalities": ["text"]}[field]
    assert post(server, path, {**base, field: off}).status_code == 200


@pytest.mark.parametrize("path, base", [
    ("/v1/completions", {"prompt": "ab"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "ab"}]}),
])
def test_continuous_usage_stats_put_usage_so_far_on_every_chunk(server, path, base):
    body = {**base, "max_tokens": 6, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    events = sse_events(post(server, path, body))[:-1]
    assert all(e["usage"] is not None for e in events), events
    counts = [e["usage"]["completion_tokens"] for e in events]
    assert counts == sorted(counts) and counts[-1] == 6
    if path == "/v1/chat/completions":
        assert counts[0] == 0       # the role chunk comes before any token
    assert len({e["usage"]["prompt_tokens"] for e in events}) == 1
    plain = sse_events(post(server, path, {**body, "stream_options": {"include_usage": True}}))
    assert all(e.get("usage") is None for e in plain[:-2])


def test_stream_options_need_stream_true(server):
    error = assert_openai_error(post(server, "/v1/completions", {
        "prompt": "a", "max_tokens": 2, "stream_options": {"include_usage": True}}), 400)
    assert "stream=True" in error["message"]


def test_unknown_route_is_an_openai_shaped_404_that_says_it_is_not_supported(server):
    error = assert_openai_error(httpx.get(server.url + "/v1/nothing"), 404)
    assert "not supported by this server" in error["message"]
    for path in ("/v1/embeddings", "/v1/audio/speech"):
        error = assert_openai_error(post(server, path, {"input": "a", "model": "fake-model"}),
                                    404)
        assert path in error["message"] and "not supported" in error["message"]
    assert_openai_error(httpx.delete(server.url + "/v1/completions"), 405)


def test_retrieve_model_by_id(server):
    r = httpx.get(server.url + "/v1/models/fake-model")
    assert r.status_code == 200 and r.json()["id"] == "fake-model"
    assert r.json()["object"] == "model"
    error = assert_openai_error(httpx.get(server.url + "/v1/models/other"), 404)
    assert error["code"] == "model_not_found"


def test_request_id_header_is_echoed_or_generated(server):
    r = post(server, "/v1/completions", {"prompt": "a", "max_tokens": 2},
             headers={"x-request-id": "trace-123"})
    assert r.headers["x-request-id"] == "trace-123"
    generated = [post(server, "/v1/completions", {"prompt": "a", "max_tokens": 2})
                 .headers["x-request-id"] for _ in range(2)]
    assert generated[0] and generated[0] != generated[1]
    assert httpx.get(server.url + "/v1/nothing").headers["x-request-id"]


def test_cors_preflight_and_simple_requests(server):
    r = httpx.options(server.url + "/v1/chat/completions", headers={
        "origin": "https://app.example", "access-control-request-method": "POST",
        "access-control-request-headers": "authorization,content-type"})
    assert r.status_code == 200
    assert r.headers["access-control-allow-origin"] in ("*", "https://app.example")
    assert "POST" in r.headers["access-control-allow-methods"]
    r = post(server, "/v1/completions", {"prompt": "a", "max_tokens": 2},
             headers={"origin": "https://app.example"})
    assert r.headers["access-control-allow-origin"] == "*"


def test_cors_flags_restrict_origins():
    from jaxserve.entrypoints.openai.api_server import build_app

    config = ServeConfig()
    config.server.allowed_origins = ['["https://good.example"]']    # vLLM's JSON form
    config.server.allow_credentials = True
    engine = AsyncLLMEngine(FakeEngineCore())
    try:
        from starlette.testclient import TestClient

        with TestClient(build_app(engine, config)) as client:
            good = client.options("/v1/models", headers={
                "origin": "https://good.example", "access-control-request-method": "GET"})
            assert good.headers["access-control-allow-origin"] == "https://good.example"
            assert good.headers["access-control-allow-credentials"] == "true"
            bad = client.options("/v1/models", headers={
                "origin": "https://evil.example", "access-control-request-method": "GET"})
            assert "access-control-allow-origin" not in bad.headers
    finally:
        engine.shutdown()


def test_request_log_line_per_request_with_enable_log_requests(caplog):
    from jaxserve.entrypoints.openai.api_server import build_app

    for disabled in (False, True):
        config = ServeConfig()
        config.server.enable_log_requests = not disabled
        engine = AsyncLLMEngine(FakeEngineCore())
        try:
            from starlette.testclient import TestClient

            with TestClient(build_app(engine, config)) as client, \
                    caplog.at_level(logging.INFO, logger="jaxserve.requests"):
                caplog.clear()
                r = client.post("/v1/completions", json={"prompt": "a", "max_tokens": 2})
                assert r.status_code == 200
                lines = [rec for rec in caplog.records if rec.name == "jaxserve.requests"]
                assert len(lines) == (0 if disabled else 1)
                if lines:
                    assert "Received request cmpl-" in lines[0].getMessage()
        finally:
            engine.shutdown()


# -- disconnects, metrics, engine death, auth, shutdown ------------------------------------------------
def metric_value(text: str, name: str, **labels) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} {labels} not in metrics")


def test_a_16_prompt_completion_gets_every_first_token_within_one_step():
    """A k-prompt completion queues all k engine requests before waiting once for their
    acceptance, so no prompt waits behind the others' engine steps."""
    srv = ServerThread(FakeEngineCore(step_delay=0.02))
    try:
        prompts = [f"prompt {i}" for i in range(16)]
        r = post(srv, "/v1/completions", {"prompt": prompts, "max_tokens": 4, "stream": True})
        assert r.status_code == 200, r.text
        texts = collections.defaultdict(str)
        for event in sse_events(r)[:-1]:
            for choice in event["choices"]:
                texts[choice["index"]] += choice["text"]
        assert sorted(texts) == list(range(16)) and all(len(t) == 4 for t in texts.values())
        steps = [step for request_id, step in srv.fake.first_token_step.items()
                 if request_id.startswith("cmpl-")]
        assert len(steps) == 16
        assert max(steps) - min(steps) <= 1, sorted(steps)
    finally:
        srv.stop()


def test_client_disconnect_mid_stream_aborts_the_request():
    srv = ServerThread(FakeEngineCore(step_delay=0.02))
    try:
        body = {"prompt": "a", "max_tokens": 100, "stream": True}
        with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=30) as r:
            lines = r.iter_lines()
            got = [next(lines) for _ in range(3)]
            assert any(line.startswith("data: ") for line in got)
        deadline = time.monotonic() + 10
        while not srv.fake.aborted:
            assert time.monotonic() < deadline, "the request was not aborted"
            time.sleep(0.02)
        deadline = time.monotonic() + 10
        while True:
            text = httpx.get(srv.url + "/metrics").text
            if metric_value(text, "jaxserve:request_success_total", finished_reason="abort"):
                break
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert metric_value(text, "jaxserve:kv_cache_usage_perc") == 0.0
        assert metric_value(text, "jaxserve:num_requests_running", model_name="fake-model") == 0
    finally:
        srv.stop()


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_streamed_text_with_unicode_line_breaks_keeps_each_event_on_one_line(server, path):
    """JSON leaves U+0085, U+2028 and U+2029 raw, but str.splitlines and httpx's (and
    requests') iter_lines end a line at each: raw, they cut a `data:` line in two (seen as a
    flaky drain test whose random tiny model sampled U+0085)."""
    script = "one\u2028two\x85three\u2029four"
    server.fake.script = script
    try:
        body = {"max_tokens": 40, "stream": True}
        body.update({"prompt": "a"} if path == "/v1/completions"
                    else {"messages": [{"role": "user", "content": "a"}]})
        with httpx.stream("POST", server.url + path, json=body, timeout=30) as r:
            assert r.status_code == 200
            lines = [line for line in r.iter_lines() if line]
    finally:
        server.fake.script = None
    assert all(line.startswith("data: ") for line in lines), lines
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(line[len("data: "):]) for line in lines[:-1]]
    text = "".join(choice.get("text") or (choice.get("delta") or {}).get("content") or ""
                   for event in events for choice in event["choices"])
    assert text == script


def test_a_client_gone_halfway_through_its_body_is_a_499_not_an_error(caplog):
    """A client that hangs up while still sending its body (seen under load, as a keep-alive
    race) ends that request quietly: a 499, no 'unhandled error' traceback in the log."""
    from jaxserve.entrypoints.openai.api_server import build_app

    engine = AsyncLLMEngine(FakeEngineCore())
    try:
        app = build_app(engine, ServeConfig())
        arriving = iter([{"type": "http.request", "body": b'{"prompt": "a", ', "more_body": True},
                         {"type": "http.disconnect"}])
        sent = []

        async def receive() -> dict:
            return next(arriving)

        async def send(message: dict) -> None:
            sent.append(message)

        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
                 "method": "POST", "scheme": "http", "path": "/v1/completions",
                 "raw_path": b"/v1/completions", "root_path": "", "query_string": b"",
                 "headers": [(b"content-type", b"application/json"),
                             (b"content-length", b"64")],
                 "client": ("127.0.0.1", 50000), "server": ("127.0.0.1", 8000)}
        with caplog.at_level(logging.WARNING):
            asyncio.run(app(scope, receive, send))
        assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 499, sent
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    finally:
        engine.shutdown()


def test_non_streamed_request_is_aborted_when_the_client_goes_away():
    srv = ServerThread(FakeEngineCore(step_delay=0.02))
    try:
        with pytest.raises(httpx.ReadTimeout):
            post(srv, "/v1/completions", {"prompt": "a", "max_tokens": 100}, timeout=0.3)
        deadline = time.monotonic() + 10
        while not srv.fake.aborted:
            assert time.monotonic() < deadline, "the request was not aborted"
            time.sleep(0.02)
    finally:
        srv.stop()


def test_metrics_move_with_requests(server):
    before = httpx.get(server.url + "/metrics").text
    post(server, "/v1/completions", {"prompt": "a", "max_tokens": 3})
    after = httpx.get(server.url + "/metrics").text
    for name in ("jaxserve:generation_tokens_total", "jaxserve:prompt_tokens_total",
                 "jaxserve:e2e_request_latency_seconds_count",
                 "jaxserve:time_to_first_token_seconds_count"):
        assert metric_value(after, name) > metric_value(before, name), name
    assert metric_value(after, "jaxserve:request_success_total", finished_reason="length") >= 1
    assert 'model_name="fake-model"' in after


def test_api_key_guards_everything_but_health_and_metrics():
    srv = ServerThread(FakeEngineCore(), api_key="sekret")
    try:
        assert_openai_error(httpx.get(srv.url + "/v1/models"), 401)
        assert_openai_error(post(srv, "/v1/completions", b"{bad json"), 401)
        wrong = {"Authorization": "Bearer nope"}
        assert_openai_error(httpx.get(srv.url + "/v1/models", headers=wrong), 401)
        good = {"Authorization": "Bearer sekret"}
        assert httpx.get(srv.url + "/v1/models", headers=good).status_code == 200
        assert httpx.get(srv.url + "/health").status_code == 200
        assert httpx.get(srv.url + "/metrics").status_code == 200
    finally:
        srv.stop()


def test_shutdown_aborts_in_flight_requests_and_refuses_new_ones():
    engine = AsyncLLMEngine(FakeEngineCore(step_delay=0.01))

    async def scenario():
        params = SamplingParams(max_tokens=10_000)
        gen = engine.generate("r1", "a", params)
        first = await gen.__anext__()
        assert not first.finished
        await asyncio.get_running_loop().run_in_executor(None, engine.shutdown)
        outs = [out async for out in gen]
        assert outs and outs[-1].finished and outs[-1].outputs[0].finish_reason == "abort"
        with pytest.raises(EngineDeadError):
            await engine.add_request("r2", "a", params)

    asyncio.run(scenario())
    assert not engine.engine_thread.alive


def test_an_llm_engine_is_served_through_its_core_with_the_same_text():
    """AsyncLLMEngine(llm.llm_engine), as the quickstart notebook once wrote it, serves the
    LLMEngine's core; its text equals the offline front end's for the same request."""
    from jaxserve.engine.llm_engine import LLMEngine

    params = SamplingParams(max_tokens=7, temperature=0.0)
    offline = LLMEngine(FakeEngineCore())
    offline.add_request("r", "abc", params)
    finals = []
    while offline.has_unfinished_requests():
        finals += [out for out in offline.step() if out.finished]
    core = FakeEngineCore()
    engine = AsyncLLMEngine(LLMEngine(core))
    assert engine.engine_core is core

    async def served():
        return [out async for out in engine.generate("r", "abc", params)][-1]

    try:
        final = asyncio.run(served())
    finally:
        engine.shutdown()
    assert final.outputs[0].text == finals[0].outputs[0].text and len(final.outputs[0].text) == 7


def test_engine_rejection_is_a_value_error_and_changes_nothing():
    fake = FakeEngineCore()
    engine = AsyncLLMEngine(fake)

    async def scenario():
        with pytest.raises(ValueError):
            await engine.add_request("r1", "x" * 500, SamplingParams())
        outs = [out async for out in engine.generate("r2", "a", SamplingParams(max_tokens=3))]
        assert outs[-1].outputs[0].text and outs[-1].finished

    try:
        asyncio.run(scenario())
        assert fake.requests == {}
    finally:
        engine.shutdown()


def test_bench_serving_runs_against_the_server(server, tmp_path):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).parent.parent / "benchmarks" / "bench_serving.py"
    spec = importlib.util.spec_from_file_location("bench_serving", path)
    bench = importlib.util.module_from_spec(spec)
    sys.modules["bench_serving"] = bench     # dataclasses look their module up
    spec.loader.exec_module(bench)
    summary = bench.main(["--base-url", server.url, "--num-prompts", "6", "--random-input-len",
                          "8", "--random-output-len", "5", "--token-id-low", "1",
                          "--token-id-high", "250", "--max-concurrency", "3", "--request-rate",
                          "100", "--save-result", "--result-dir", str(tmp_path)])
    assert summary["completed"] == 6 and summary["total_output_tokens"] == 30
    assert summary["mean_ttft_ms"] > 0 and summary["median_itl_ms"] >= 0
    assert list(tmp_path.glob("*.json"))
    chat = bench.main(["--base-url", server.url, "--endpoint", "/v1/chat/completions",
                       "--num-prompts", "2", "--random-input-len", "4", "--random-output-len",
                       "3"])
    assert chat["completed"] == 2
