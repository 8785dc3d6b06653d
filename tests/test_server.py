"""A live `jaxserve serve` (subprocess, tiny random Llama) driven by the real `openai` client
and plain httpx: completions, chat, streaming, n, logprobs, stop, seeds, usage, errors,
32 concurrent streams equal to offline LLM.generate, metrics, disconnects, auth, README
examples, and a clean SIGTERM shutdown.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from jaxserve import LLM, SamplingParams

ROOT = Path(__file__).resolve().parent.parent
# Same engine settings as tests/test_engine.py's `llm`, so the compilation cache is shared.
ENGINE_ARGS = ["--max-model-len", "256", "--max-num-seqs", "32", "--max-num-batched-tokens",
               "64", "--kv-cache-memory-bytes", str(8 << 20)]
MODEL_NAME = "tiny"
STARTUP_TIMEOUT = 300.0

WORDS = ("the quick brown fox jumps over lazy dog language model predicts next token paged "
         "attention stores cache blocks continuous batching lets new requests join").split()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`python -m jaxserve.entrypoints.cli serve MODEL ...` on a free port, logs to a file."""

    def __init__(self, model_dir: Path, log_path: Path, *extra: str,
                 env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        cmd = [sys.executable, "-m", "jaxserve.entrypoints.cli", "serve", str(model_dir),
               "--host", "127.0.0.1", "--port", str(self.port), "--served-model-name",
               MODEL_NAME, "--uvicorn-log-level", "warning", *ENGINE_ARGS,
               *extra]
        self.log = open(log_path, "w")  # noqa: SIM115 - open for the process lifetime
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                     env={**os.environ, **(env or {})}, cwd=ROOT)
        self.wait_ready()

    def wait_ready(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"server exited with {self.proc.returncode}:\n"
                                     f"{self.log_tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.25)
        self.proc.kill()
        raise AssertionError(f"server not ready after {STARTUP_TIMEOUT} s:\n{self.log_tail()}")

    def wait_background_compiles(self, timeout: float = STARTUP_TIMEOUT) -> None:
        """Until the server's background compile thread is done, as its log says (the
        warm-up line announces its work; runner/step_compilation.py logs each end). A test
        that times the server's answers waits here first: the thread traces and lowers, and
        holds the GIL meanwhile (CI once saw every refusal of a burst wait 1.75 s against
        a 0.13 s yardstick, likely the store's refill)."""
        ends = []
        text = self.log_path.read_text(errors="replace")
        if "more in the background" in text:
            ends.append(("background compile of",))
        if "to be compiled again in the background" in text:
            ends.append(("step executables that JAX's compilation cache had served",
                         "cannot be stored", "storing the step executables failed"))
        deadline = time.monotonic() + timeout
        while any(not any(e in text for e in end) for end in ends):
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise AssertionError(f"background compiles not done:\n{self.log_tail()}")
            time.sleep(0.1)
            text = self.log_path.read_text(errors="replace")

    def log_tail(self, lines: int = 40) -> str:
        self.log.flush()
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return self.proc.returncode


@pytest.fixture(scope="module")
def model_dir(make_tiny_model) -> Path:
    return make_tiny_model("llama")


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    srv = ServerProcess(model_dir, tmp_path_factory.mktemp("server") / "server.log")
    yield srv
    code = srv.stop()
    assert code == 0, f"server exited with {code}:\n{srv.log_tail()}"


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="EMPTY", max_retries=0,
                         timeout=120)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


def prompt_of(i: int, length: int) -> str:
    return " ".join(WORDS[(i * 7 + k * 3) % len(WORDS)] for k in range(length))


def metric(text: str, name: str, **labels: str) -> float:
    for line in text.splitlines():
        if line.startswith(name) and line[len(name)] in "{ " and \
                all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name}{labels} not in /metrics")


def wait_for(predicate, timeout: float = 30.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


# -- the openai client ------------------------------------------------------------------------------
@pytest.mark.engine
def test_models_lists_the_served_name_and_max_model_len(client, http):
    [model] = client.models.list().data
    assert model.id == MODEL_NAME
    assert http.get("/v1/models").json()["data"][0]["max_model_len"] == 256
    assert http.get("/version").json()["version"]


@pytest.mark.engine
def test_completion_and_its_stream_agree(client):
    kwargs = {"model": MODEL_NAME, "prompt": prompt_of(0, 6), "max_tokens": 12, "temperature": 0}
    full = client.completions.create(**kwargs)
    choice = full.choices[0]
    assert choice.finish_reason in ("stop", "length")
    assert full.usage.prompt_tokens > 0 and full.usage.completion_tokens > 0
    assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens
    chunks = list(client.completions.create(stream=True, **kwargs))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    assert chunks[-1].choices[0].finish_reason == choice.finish_reason


@pytest.mark.engine
def test_chat_and_its_stream_agree_and_the_stream_starts_with_the_role(client):
    kwargs = {"model": MODEL_NAME, "messages": [{"role": "system", "content": "be brief"},
                                              {"role": "user", "content": prompt_of(1, 5)}],
                  "max_tokens": 10, "temperature": 0}
    full = client.chat.completions.create(**kwargs)
    assert full.choices[0].message.role == "assistant"
    chunks = list(client.chat.completions.create(
        stream=True, stream_options={"include_usage": True}, **kwargs))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == \
        full.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == \
        full.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


@pytest.mark.engine
def test_n_2_returns_two_choices(client):
    out = client.completions.create(model=MODEL_NAME, prompt=prompt_of(2, 4), max_tokens=6,
                                    n=2, temperature=1.0, seed=7,
                                    extra_body={"ignore_eos": True})
    assert sorted(c.index for c in out.choices) == [0, 1]
    assert out.usage.completion_tokens == 12
    chat = client.chat.completions.create(model=MODEL_NAME, n=2, max_tokens=4,
                                          messages=[{"role": "user", "content": "hi"}])
    assert sorted(c.index for c in chat.choices) == [0, 1]


@pytest.mark.engine
def test_logprobs_in_both_formats(client):
    out = client.completions.create(model=MODEL_NAME, prompt=prompt_of(3, 5), max_tokens=5,
                                    temperature=0, logprobs=2, extra_body={"ignore_eos": True})
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert all(v <= 0 for v in lp.token_logprobs)
    assert all(len(top) >= 2 for top in lp.top_logprobs)
    assert lp.text_offset == sorted(lp.text_offset)
    chat = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
        temperature=0, logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    content = chat.choices[0].logprobs.content
    assert len(content) == 4
    assert all(len(item.top_logprobs) == 3 for item in content)
    assert content[0].top_logprobs[0].logprob >= content[0].top_logprobs[1].logprob
    # greedy: the sampled token is the most likely one
    assert content[0].logprob == pytest.approx(content[0].top_logprobs[0].logprob, abs=1e-5)


@pytest.mark.engine
def test_stop_string_truncates_the_output(client):
    kwargs = {"model": MODEL_NAME, "prompt": prompt_of(4, 6), "max_tokens": 24, "temperature": 0,
                  "extra_body": {"ignore_eos": True}}
    text = client.completions.create(**kwargs).choices[0].text
    assert len(text) > 8, text
    stop = text[5:8]
    assert stop.strip(), "pick a stop string with something in it"
    out = client.completions.create(stop=[stop], **kwargs).choices[0]
    assert out.finish_reason == "stop"
    assert out.text == text[:text.index(stop)]
    streamed = client.completions.create(stop=[stop], stream=True, **kwargs)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == out.text


@pytest.mark.engine
def test_seed_makes_sampling_reproducible(client):
    kwargs = {"model": MODEL_NAME, "prompt": prompt_of(5, 5), "max_tokens": 16, "temperature": 1.0,
                  "extra_body": {"ignore_eos": True}}
    a = client.completions.create(seed=1234, **kwargs).choices[0].text
    b = client.completions.create(seed=1234, **kwargs).choices[0].text
    others = {client.completions.create(seed=s, **kwargs).choices[0].text for s in (1, 2, 3)}
    assert a == b
    assert len(others | {a}) > 1, "different seeds should sample differently"


@pytest.mark.engine
def test_usage_reports_cached_prompt_tokens_on_a_repeated_prompt(client):
    prompt = prompt_of(6, 40)
    client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=2, temperature=0)
    again = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=2,
                                      temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens >= 16


@pytest.mark.engine
def test_prompt_as_token_ids_and_echo(client, http):
    ids = http.post("/tokenize", json={"prompt": prompt_of(7, 4)}).json()["tokens"]
    out = client.completions.create(model=MODEL_NAME, prompt=[ids, ids], max_tokens=3,
                                    temperature=0, echo=True)
    text = http.post("/detokenize", json={"tokens": ids}).json()["prompt"]
    assert [c.index for c in out.choices] == [0, 1]
    assert all(c.text.startswith(text) for c in out.choices)
    assert out.choices[0].text == out.choices[1].text


# -- errors ------------------------------------------------------------------------------------------
BAD_REQUESTS = [
    ("/v1/completions", b"{oops", 400),
    ("/v1/completions", b'{"prompt": "caf\xe9", "model": "tiny"}', 400),
    ("/v1/completions", {"prompt": "a", "max_tokens": "lots"}, 400),
    ("/v1/completions", {"prompt": "a", "n": 10 ** 6}, 400),
    ("/v1/completions", {"prompt": "a", "max_tokens": 10 ** 9}, 400),
    ("/v1/completions", {"prompt": "fox " * 400}, 400),
    ("/v1/completions", {"prompt": [10 ** 7]}, 400),
    ("/v1/completions", {"prompt": "a", "temperature": "hot"}, 400),
    ("/v1/completions", {"prompt": "a", "logprobs": 1000}, 400),
    ("/v1/completions", {"prompt": "a", "stop": [""]}, 400),
    ("/v1/completions", {"prompt": "a", "model": "gpt-4"}, 404),
    ("/v1/chat/completions", {"messages": "hello"}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "user"}], "max_completion_tokens": -1},
     400),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]}, 400),
]


@pytest.mark.engine
@pytest.mark.parametrize("path, body, status", BAD_REQUESTS)
def test_invalid_request_gets_an_openai_error_and_the_server_keeps_serving(
        http, path, body, status):
    kwargs = {"json": body} if isinstance(body, dict) else {
        "content": body, "headers": {"Content-Type": "application/json"}}
    r = http.post(path, **kwargs)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert http.get("/health").status_code == 200
    ok = http.post("/v1/completions", json={"prompt": "fox", "max_tokens": 2})
    assert ok.status_code == 200


@pytest.mark.engine
def test_context_length_error_has_vllm_wording(http):
    ids = http.post("/tokenize", json={"prompt": "fox jumps"}).json()["tokens"]
    r = http.post("/v1/completions", json={"prompt": ids, "max_tokens": 300})
    assert r.status_code == 400
    n = len(ids)
    assert r.json()["error"]["message"] == (
        f"This model's maximum context length is 256 tokens. However, you requested "
        f"{n + 300} tokens ({n} in the prompt, 300 in the completion). Please reduce the "
        "length of the prompt or completion.")


@pytest.mark.engine
def test_openai_client_raises_bad_request_and_not_found(client):
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL_NAME, prompt="a", max_tokens=100000)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="a")


# -- concurrency, metrics, disconnects ---------------------------------------------------------------
@pytest.mark.engine
def test_32_concurrent_streams_complete_and_match_offline_generate(server, model_dir, http):
    prompts = [prompt_of(i, 3 + (i * 5) % 23) for i in range(32)]
    max_tokens = 32

    async def one(client: openai.AsyncOpenAI, prompt: str, started: asyncio.Event) -> str:
        stream = await client.completions.create(
            model=MODEL_NAME, prompt=prompt, max_tokens=max_tokens, temperature=0,
            stream=True, extra_body={"ignore_eos": True})
        text = ""
        async for chunk in stream:
            started.set()
            if chunk.choices:
                text += chunk.choices[0].text
        return text

    async def run_all() -> tuple[list[str], str]:
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="EMPTY",
                                    max_retries=0, timeout=300)
        async with httpx.AsyncClient(base_url=server.url) as scraper:
            started = asyncio.Event()
            # A long request keeps the engine busy past the batch: on a tiny model the 32
            # streams can end before the server gets to answer a scrape.
            long_running = asyncio.create_task(client.completions.create(
                model=MODEL_NAME, prompt="fox", max_tokens=200, temperature=0,
                extra_body={"ignore_eos": True}))
            tasks = [asyncio.create_task(one(client, p, started)) for p in prompts]
            await started.wait()
            during = (await scraper.get("/metrics")).text     # while the batch runs
            texts = await asyncio.gather(*tasks)
            await long_running
        await client.close()
        return texts, during

    before = http.get("/metrics").text
    texts, during = asyncio.run(run_all())
    after = http.get("/metrics").text

    assert metric(during, "jaxserve:num_requests_running") > 0
    assert metric(during, "jaxserve:kv_cache_usage_perc") > 0
    for name in ("jaxserve:generation_tokens_total", "jaxserve:prompt_tokens_total",
                 "jaxserve:time_to_first_token_seconds_count",
                 "jaxserve:inter_token_latency_seconds_count",
                 "jaxserve:e2e_request_latency_seconds_count",
                 "jaxserve:request_queue_time_seconds_count"):
        assert metric(after, name) > metric(before, name), name
    assert metric(after, "jaxserve:request_success_total", finished_reason="length") - \
        metric(before, "jaxserve:request_success_total", finished_reason="length") == 33

    llm = LLM(str(model_dir), max_model_len=256, max_num_seqs=32, max_num_batched_tokens=64,
              kv_cache_memory_bytes=8 << 20)
    offline = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens,
                                                   ignore_eos=True), use_tqdm=False)
    assert texts == [o.outputs[0].text for o in offline]


@pytest.mark.engine
def test_client_disconnect_mid_stream_aborts_and_frees_blocks(server, http):
    before = metric(http.get("/metrics").text, "jaxserve:request_success_total",
                    finished_reason="abort")
    body = {"prompt": prompt_of(8, 8), "max_tokens": 200, "stream": True,
            "extra": "ignored", "ignore_eos": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        events = (line for line in r.iter_lines() if line.startswith("data: "))
        next(events), next(events)      # two tokens arrived: the request is running
    def aborts() -> float:
        return metric(http.get("/metrics").text, "jaxserve:request_success_total",
                      finished_reason="abort")

    wait_for(lambda: aborts() > before, what="the abort")
    wait_for(lambda: metric(http.get("/metrics").text, "jaxserve:kv_cache_usage_perc") == 0,
             what="the KV blocks to return")
    assert metric(http.get("/metrics").text, "jaxserve:num_requests_running") == 0
    assert http.post("/v1/completions", json={"prompt": "fox", "max_tokens": 2}).status_code \
        == 200


# -- README examples ------------------------------------------------------------------------------
def readme_blocks() -> list[tuple[str, str]]:
    """(language, code) of the fenced blocks of README.md tagged `test-server`."""
    return re.findall(r"```(\w+) test-server\n(.*?)```", (ROOT / "README.md").read_text(),
                      re.DOTALL)


def test_readme_curl_and_openai_examples_run(server):
    blocks = readme_blocks()
    assert {lang for lang, _ in blocks} >= {"sh", "python"}, "README examples not found"
    for lang, code in blocks:
        code = code.replace("http://localhost:8000", server.url)
        if lang == "python":
            cmd = [sys.executable, "-c", code]
        else:
            cmd = ["bash", "-euo", "pipefail", "-c", code.replace("curl -s", "curl -sf")]
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
        assert result.returncode == 0, f"{lang} example failed:\n{code}\n{result.stderr}"
        if lang == "sh":        # curl prints the JSON bodies back to back
            decoder, text, count = json.JSONDecoder(), result.stdout.strip(), 0
            while text:
                body, end = decoder.raw_decode(text)
                assert body["choices"], body
                text, count = text[end:].lstrip(), count + 1
            assert count == code.count("curl ")
        else:
            assert result.stdout.strip(), "the python example printed nothing"


# -- auth and shutdown (a second server) ------------------------------------------------------------
def test_api_key_is_enforced_and_sigterm_exits_cleanly_mid_stream(model_dir, tmp_path):
    srv = ServerProcess(model_dir, tmp_path / "keyed.log", env={"JAXSERVE_API_KEY": "s3cret"})
    try:
        body = {"prompt": "fox", "max_tokens": 2}
        assert httpx.post(srv.url + "/v1/completions", json=body).status_code == 401
        wrong = {"Authorization": "Bearer nope"}
        r = httpx.post(srv.url + "/v1/completions", json=body, headers=wrong)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(srv.url + "/health").status_code == 200
        assert httpx.get(srv.url + "/metrics").status_code == 200
        keyed = openai.OpenAI(base_url=srv.url + "/v1", api_key="s3cret", max_retries=0)
        assert keyed.completions.create(model=MODEL_NAME, prompt="fox", max_tokens=2).choices
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=srv.url + "/v1", api_key="bad",
                          max_retries=0).models.list()

        # SIGTERM while a stream is in flight: the stream ends properly, the process exits 0.
        stream = keyed.completions.create(model=MODEL_NAME, prompt="fox", max_tokens=200,
                                          stream=True, extra_body={"ignore_eos": True})
        chunks = iter(stream)
        next(chunks)
        srv.proc.send_signal(signal.SIGTERM)
        rest = list(chunks)
        assert rest and rest[-1].choices[0].finish_reason in ("length", "abort")
        assert srv.proc.wait(60) == 0, srv.log_tail()
        log = srv.log_path.read_text()
        assert f"serving {MODEL_NAME} on http://127.0.0.1:{srv.port}" in log
    finally:
        srv.stop()
