"""No request can hurt another: a request's own fault, a failed engine step (in-process
recovery, then exit non-zero after --max-engine-restarts), admission control
(--max-queued-requests, --max-queue-time) and a draining SIGTERM.

In-process tests drive `AsyncLLMEngine` over the tiny random Llama (tests/conftest.py) or the
fake engine behind the real HTTP app; the exit-status, overload and SIGTERM tests run a
`jaxserve serve` subprocess.
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.engine.async_engine import AsyncLLMEngine
from jaxserve.engine.errors import EngineDeadError, QueueTimeoutError, StepFailedError
from jaxserve.engine.fault_injection import InjectedStepFault, StepFaultInjector
from tests.fake_engine import FakeEngineCore
from tests.test_server import ServerProcess, metric, wait_for
from tests.test_server_fake_engine import ServerThread, assert_openai_error

LONG_PROMPT = list(range(3, 203))      # 200 tokens: fills a 64-token step for 4 steps
QUEUED_PROMPT = list(range(10, 210))   # behind it: one partial prefill at a time
SHORT_PROMPT = [5, 17, 42, 7, 99, 12]


@pytest.fixture(scope="module")
def llm(make_tiny_model):
    # Same settings as tests/test_engine.py's `llm`: the compiled steps are shared.
    return LLM(str(make_tiny_model("llama")), max_model_len=256, max_num_seqs=32,
               max_num_batched_tokens=64, kv_cache_memory_bytes=8 << 20)


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def reference_tokens(llm: LLM, prompt: list[int], max_tokens: int) -> list[int]:
    [out] = llm.generate([{"prompt_token_ids": prompt}], greedy(max_tokens), use_tqdm=False)
    return list(out.outputs[0].token_ids)


async def final_of(engine: AsyncLLMEngine, stream) -> object:
    outs = [out async for out in engine.stream_outputs(stream)]
    return outs[-1]


class OneShotFault:
    """A fault hook raising on its first call (a step with work dispatched), then never."""

    def __init__(self) -> None:
        self.fired_at: float | None = None

    def __call__(self) -> None:
        if self.fired_at is None:
            self.fired_at = time.monotonic()
            raise InjectedStepFault("injected once")


@pytest.mark.engine      # in-process recovery: the engine tier
def test_step_fault_fails_scheduled_requests_and_reruns_queued_ones(llm):
    """The long prompt is in the faulted step and fails; the one queued behind it (the step
    budget is full) is re-run after the in-process restart, with a fresh engine's tokens;
    a new request afterwards is served correctly too; counters survive the restart."""
    started = time.monotonic()
    ref_queued = reference_tokens(llm, QUEUED_PROMPT, 12)
    queued_alone = time.monotonic() - started     # the re-run's own work, on this box now
    ref_short = reference_tokens(llm, SHORT_PROMPT, 8)
    core = llm.llm_engine.engine_core
    tokens_before = core.snapshot().num_prompt_tokens
    fault = OneShotFault()
    core.fault_hook = fault
    engine = AsyncLLMEngine(core, start=False)

    async def scenario():
        failed_stream = engine.submit("long", None, greedy(8), prompt_token_ids=LONG_PROMPT)
        queued_stream = engine.submit("queued", None, greedy(12),
                                      prompt_token_ids=QUEUED_PROMPT)
        engine.start()                  # both are in its inbox before the first step
        await engine.wait_accepted([failed_stream, queued_stream])
        with pytest.raises(StepFailedError, match="injected once"):
            await final_of(engine, failed_stream)
        rerun = await final_of(engine, queued_stream)
        recovered_in = time.monotonic() - fault.fired_at
        assert list(rerun.outputs[0].token_ids) == ref_queued
        again = await engine.add_request("after", None, greedy(8),
                                         prompt_token_ids=SHORT_PROMPT)
        assert list((await final_of(engine, again)).outputs[0].token_ids) == ref_short
        return recovered_in

    try:
        recovered_in = asyncio.run(scenario())
        # From the fault to the re-run's last token: the restart plus the re-run's own
        # work. 5 s (the target), or on a box where that work alone takes over 5/3 s, three
        # times it; a restart that waited on any timeout would exceed both.
        assert recovered_in < max(5.0, 3 * queued_alone), (recovered_in, queued_alone)
        assert engine.is_healthy and engine.num_restarts == 1
        assert engine.num_unfinished_seqs == 0
        # The engine thread publishes its snapshot just after handing out the outputs.
        snap = wait_for(lambda: engine.snapshot.num_running == 0 and engine.snapshot,
                        what="the idle snapshot")
        assert snap.num_waiting == 0
        assert snap.num_prompt_tokens > tokens_before     # a counter, never reset
    finally:
        engine.shutdown()
        core.fault_hook = None


@pytest.mark.engine      # in-process recovery: the engine tier
def test_a_requests_own_output_fault_ends_it_alone(llm):
    """Output processing (here: the detokenizer) failing for one request ends that request
    with finish_reason "error"; its neighbour in the same steps is untouched."""
    ref = reference_tokens(llm, SHORT_PROMPT, 10)
    engine = llm.llm_engine
    engine.add_request("victim", None, greedy(10), prompt_token_ids=[9, 8, 7, 6])
    engine.add_request("bystander", None, greedy(10), prompt_token_ids=SHORT_PROMPT)

    def broken(token):
        raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "bad byte")

    engine.output_processor.requests["victim"].seqs[0].detok.decode_next = broken
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    assert finals["victim"].outputs[0].finish_reason == "error"
    assert list(finals["bystander"].outputs[0].token_ids) == ref
    assert finals["bystander"].outputs[0].finish_reason == "length"
    core = engine.engine_core
    assert core.scheduler.num_running == 0 and core.block_manager.usage == 0.0


@pytest.mark.engine      # in-process recovery: the engine tier
def test_queue_time_limit_ends_a_request_still_waiting(llm):
    core = llm.llm_engine.engine_core
    engine = AsyncLLMEngine(core, start=False)
    engine.max_queue_time = 0.0
    engine.max_unfinished_seqs = 10

    async def scenario():
        streams = []
        for request_id, prompt in (("first", LONG_PROMPT), ("second", SHORT_PROMPT)):
            engine.reserve(1)
            streams.append(engine.submit(request_id, None, greedy(4), prompt_token_ids=prompt,
                                         reserved_seqs=1))
        engine.start()
        # Both have waited > 0 s when the engine first looks; neither was scheduled yet.
        await engine.wait_accepted(streams)
        for stream in streams:
            with pytest.raises(QueueTimeoutError):
                await final_of(engine, stream)

    try:
        asyncio.run(scenario())
        assert engine.num_rejected["queue_timeout"] == 2
        assert engine.num_unfinished_seqs == 0
        wait_for(lambda: engine.snapshot.num_waiting + engine.snapshot.num_running == 0,
                 what="the aborted requests to leave the scheduler")
    finally:
        engine.shutdown()


def test_consecutive_step_faults_kill_the_engine_and_call_on_fatal():
    fake = FakeEngineCore()
    fake.fault_hook = StepFaultInjector(1)          # every step fails
    engine = AsyncLLMEngine(fake, start=False)
    engine.max_restarts = 2
    died = threading.Event()
    engine.on_fatal = lambda exc: died.set()
    engine.start()

    async def one(i: int):
        with pytest.raises(EngineDeadError if i == 2 else StepFailedError):
            async for _ in engine.generate(f"r{i}", "a", SamplingParams(max_tokens=3)):
                pass

    try:
        for i in range(3):
            asyncio.run(one(i))
        assert died.wait(5)
        assert engine.num_restarts == 2 and not engine.is_healthy
        assert "engine dead" in engine.health_problem
        assert engine.snapshot.num_running == 0
    finally:
        engine.shutdown()


# -- the HTTP side, over the fake engine ---------------------------------------------------------
def test_step_fault_over_http_stream_errors_nonstream_503_then_recovers():
    srv = ServerThread(FakeEngineCore(step_delay=0.02))
    try:
        body = {"messages": [{"role": "user", "content": "a"}], "max_tokens": 100,
                "stream": True}
        with httpx.stream("POST", srv.url + "/v1/chat/completions", json=body,
                          timeout=30) as r:
            lines = r.iter_lines()
            next(lines)
            srv.fake.fail_next_step = True
            rest = [line for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]"
        error = json.loads(rest[-2][len("data: "):])["error"]
        assert "injected engine failure" in error["message"]
        assert error["code"] == "engine_step_failed"

        # A non-streaming request in a failed step: 503 + Retry-After, OpenAI's shape.
        def fail_soon():
            time.sleep(0.1)
            srv.fake.fail_next_step = True
        threading.Thread(target=fail_soon).start()
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "a", "max_tokens": 100},
                       timeout=30)
        assert_openai_error(r, 503)
        assert r.headers["retry-after"] == "1"

        assert httpx.get(srv.url + "/health").status_code == 200
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "a", "max_tokens": 3},
                       timeout=30)
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
        text = httpx.get(srv.url + "/metrics").text
        assert metric(text, "jaxserve:engine_restarts_total") == 2
        assert metric(text, "jaxserve:num_requests_running") == 0
        assert srv.fake.num_recoveries == 2
    finally:
        srv.stop()


def test_health_reports_a_dead_engine_and_requests_get_503():
    srv = ServerThread(FakeEngineCore(), max_engine_restarts=0)
    try:
        srv.fake.fail_next_step = True
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "a", "max_tokens": 3},
                       timeout=30)
        assert_openai_error(r, 503)
        health = httpx.get(srv.url + "/health")
        assert health.status_code == 503 and "engine dead" in health.json()["error"]["message"]
        assert_openai_error(httpx.post(srv.url + "/v1/completions", json={"prompt": "a"}), 503)
    finally:
        srv.stop()


def test_a_request_larger_than_the_admission_limit_is_a_400():
    srv = ServerThread(FakeEngineCore(), max_queued_requests=4)     # 256 running + 4
    try:
        r = httpx.post(srv.url + "/v1/completions",
                       json={"prompt": ["a"] * 200, "n": 2, "max_tokens": 1}, timeout=30)
        assert_openai_error(r, 400)
        assert "at most 260" in r.json()["error"]["message"]
    finally:
        srv.stop()


# -- a live server (subprocess) ------------------------------------------------------------------
def test_consecutive_faults_exit_the_server_non_zero(make_tiny_model, tmp_path):
    srv = ServerProcess(make_tiny_model("llama"), tmp_path / "faults.log",
                        "--fault-injection-every-steps", "1", "--max-engine-restarts", "2")
    try:
        codes = []
        for _ in range(3):
            try:
                codes.append(httpx.post(srv.url + "/v1/completions", timeout=60,
                                        json={"prompt": "fox", "max_tokens": 4}).status_code)
            except httpx.TransportError:
                codes.append(None)
        assert codes[:2] == [503, 503], codes
        assert srv.proc.wait(60) == 1, srv.log_tail()
        log = srv.log_path.read_text()
        assert "engine restarted in-process" in log and "exiting with status 1" in log
    finally:
        srv.stop()


class _Burst:
    def __init__(self, size: int) -> None:
        self.left = size
        self.all_answered = asyncio.Event()

    def answered(self) -> None:
        self.left -= 1
        if self.left == 0:
            self.all_answered.set()


async def _admit_or_refuse(client: httpx.AsyncClient, body: dict, burst: _Burst
                           ) -> tuple[httpx.Response, float]:
    """One request of a burst, streamed: (its response, seconds to the answer). An admitted
    one holds its place (reads nothing) until every request of the burst has its answer,
    then hangs up (the server aborts it): the burst meets a full server however fast the box
    runs the engine against how fast the client sends."""
    start = time.monotonic()
    async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        seconds = time.monotonic() - start
        burst.answered()
        if r.status_code == 200:
            await burst.all_answered.wait()
        else:
            await r.aread()
    return r, seconds


# Polls /health every 20 ms from its own process (the test's event loop is busy with 200
# clients) until stdin closes; says "ready" after its first answer, then prints the status
# codes and latencies as JSON. The test starts the overload only once the poller is ready:
# the interpreter and httpx take ~0.5 s to start, and on a fast box the whole burst is
# answered in less (the poller then saw 2 polls of it: CI's flake of 2026-12-07).
_HEALTH_POLLER = """
import json, sys, threading, time, httpx
done = threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), done.set()), daemon=True).start()
codes, times = [], []
with httpx.Client(timeout=10) as client:
    while not done.is_set():
        start = time.monotonic()
        codes.append(client.get(sys.argv[1] + "/health").status_code)
        times.append(time.monotonic() - start)
        if len(codes) == 1:
            print("ready", flush=True)
        time.sleep(0.02)
print(json.dumps({"codes": codes, "times": times}))
"""


class HealthPoller:
    def __init__(self, url: str) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", _HEALTH_POLLER, url],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout.readline() == "ready\n", "the /health poller did not start"

    def stop(self) -> tuple[list[int], list[float]]:
        out, _ = self.proc.communicate("", timeout=30)
        result = json.loads(out.strip().splitlines()[-1])
        return result["codes"], result["times"]


async def _stream_finish(client: httpx.AsyncClient, body: dict, started: asyncio.Event,
                         admitted: asyncio.Event | None = None) -> tuple[str | None, bool]:
    """A streamed completion: (its last finish_reason, whether it ended with [DONE]).

    `admitted` is set once the server answered 200 (the request is in the engine),
    `started` once the first token streamed."""
    finish, done = None, False
    async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        if admitted is not None:
            admitted.set()
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            started.set()
            if line == "data: [DONE]":
                done = True
                continue
            for choice in json.loads(line[6:]).get("choices", []):
                finish = choice.get("finish_reason") or finish
    return finish, done


def test_overload_gets_503_at_once_then_sigterm_drains(make_tiny_model, tmp_path):
    srv = ServerProcess(make_tiny_model("llama"), tmp_path / "overload.log",
                        "--max-num-seqs", "2", "--max-queued-requests", "30",
                        "--max-model-len", "512", "--shutdown-timeout", "3",
                        "--no-compile-in-background")
    try:
        # 200 concurrent completions: at most 2 + 30 sequences are admitted at once.
        async def overload():
            # No keep-alive: a connection idle for uvicorn's 5 s keep-alive timeout while a
            # loaded client gets round to it can close under a request (a ReadError, seen
            # in CI); every request gets its own connection, the yardstick's too.
            limits = httpx.Limits(max_connections=250, max_keepalive_connections=0)
            async with httpx.AsyncClient(base_url=srv.url, timeout=120, limits=limits) as c:
                async def models() -> float:
                    start = time.monotonic()
                    assert (await c.get("/v1/models")).status_code == 200
                    return time.monotonic() - start
                # The yardstick: the same burst of 200 connections to a trivial route, in
                # the same run, just before.
                baseline = await asyncio.gather(*[models() for _ in range(200)])
                burst = _Burst(200)
                results = await asyncio.gather(*[
                    _admit_or_refuse(c, {"prompt": f"fox {i}", "max_tokens": 240,
                                         "ignore_eos": True}, burst)
                    for i in range(200)])
            return results, max(baseline)

        srv.wait_background_compiles()
        poller = HealthPoller(srv.url)
        results, baseline = asyncio.run(overload())
        health_codes, health_times = poller.stop()
        rejected = [(r, t) for r, t in results if r.status_code == 503]
        done = [r for r, _ in results if r.status_code == 200]
        assert len(rejected) + len(done) == 200
        # Requests arrive over seconds (a slow client) and admitted ones may finish
        # meanwhile (240 steps each), but most of the 200 meet a full server.
        assert len(done) >= 32 and len(rejected) >= 100, (len(done), len(rejected))
        for r, _ in rejected:
            assert_openai_error(r, 503)
            assert r.json()["error"]["code"] == "queue_full"
            assert r.headers["retry-after"] == "1"
        # "At once": a refusal costs about what a trivial route costs under the same burst of
        # 200 connections, measured in this run (a box twice as slow or as loaded slows both).
        # The overload also runs the engine beside the refusals, which the yardstick does not:
        # 3x + 1 s covers that (seen: 3.6 s against a 1.35 s yardstick on a loaded box), while
        # a refusal that waited on the engine would wait for whole 240-token requests.
        # Every refusal but the slowest 5 %: one client connection in a burst of 200 can
        # meet a scheduling hiccup of the box (seen once in five quiet runs: 2.3 s for one
        # refusal while the other 180 took 0.13-0.15 s); a path that waited on the engine
        # would hold up nearly all of them.
        waits = sorted(seconds for _, seconds in rejected)
        assert waits[int(0.95 * len(waits)) - 1] < 3.0 * baseline + 1.0, (baseline, waits[::10])
        assert len(health_times) >= 3 and set(health_codes) == {200}, health_codes
        # /health is never held up by the overload beyond what any trivial route costs
        # under it (the same yardstick and margin).
        assert max(health_times) < 3.0 * baseline + 1.0, (baseline, max(health_times))
        text = httpx.get(srv.url + "/metrics").text
        assert metric(text, "jaxserve:num_requests_rejected_total",
                      reason="queue_full") == len(rejected)
        # The admitted ones hung up: they are aborted and give back their places.
        def idle() -> bool:
            text = httpx.get(srv.url + "/metrics").text
            return metric(text, "jaxserve:num_requests_running") == 0 == \
                metric(text, "jaxserve:num_requests_waiting")
        wait_for(idle, 30, "the hung-up requests to be aborted")

        # SIGTERM with a medium and long requests in flight: the medium one finishes
        # normally within --shutdown-timeout (3 s), the long ones past it end with "abort",
        # new ones get 503. Two rows a step make the long ones last (24 x 480 tokens: 5,760
        # steps, ~6 s here), so the drain outlasts the client's look at it even when the
        # client is starved (seen under a CPU hog: with 8 rows and 240 tokens the engine
        # finished everything and exited before the client's refused request). The medium
        # one is running before the long ones are sent, so none of them queues ahead of it.
        async def drain():
            async with httpx.AsyncClient(base_url=srv.url, timeout=120) as c:
                started = [asyncio.Event() for _ in range(25)]
                admitted = [asyncio.Event() for _ in range(24)]
                medium = asyncio.ensure_future(_stream_finish(
                    c, {"prompt": "dog", "max_tokens": 200, "ignore_eos": True}, started[0]))
                await asyncio.wait_for(started[0].wait(), 60)
                long = [asyncio.ensure_future(_stream_finish(
                    c, {"prompt": f"cat {i}", "max_tokens": 480, "ignore_eos": True},
                    started[1 + i], admitted[i])) for i in range(24)]
                # SIGTERM once all of them are in the engine (a slow client may still be
                # sending some: those would meet the drain's 503, seen in CI) and one of
                # them streams (the other row is then busy).
                await asyncio.wait_for(asyncio.gather(*[e.wait() for e in admitted]), 60)
                await asyncio.wait([asyncio.ensure_future(e.wait()) for e in started[1:]],
                                   timeout=60, return_when=asyncio.FIRST_COMPLETED)
                assert any(e.is_set() for e in started[1:])
                srv.proc.send_signal(signal.SIGTERM)
                deadline = time.monotonic() + 30     # a bound on a hang, not a speed target
                while (await c.get("/health")).status_code == 200:
                    assert time.monotonic() < deadline
                    await asyncio.sleep(0.02)
                refused = await c.post("/v1/completions", json={"prompt": "x"})
                return await medium, await asyncio.gather(*long), refused

        medium, long, refused = asyncio.run(drain())
        assert_openai_error(refused, 503)
        assert refused.json()["error"]["code"] == "shutting_down"
        assert medium == ("length", True), medium
        assert all(done for _, done in long)
        # A long one either finished within the timeout or, still queued or running at it,
        # ended with "abort" (here about half: the engine does ~3,000 of the 5,760 steps in
        # 3 s); none is left open (the process exits 0 below).
        assert all(finish in ("length", "abort") for finish, _ in long), long
        assert srv.proc.wait(30) == 0, srv.log_tail()
    finally:
        srv.stop()


def test_flags_reach_the_config():
    from jaxserve.config import ServeConfig
    from jaxserve.entrypoints.cli import build_parser, config_from_args

    args = build_parser().parse_args(
        ["serve", "--max-queued-requests", "5", "--max-queue-time", "2.5",
         "--shutdown-timeout", "7", "--max-engine-restarts", "1"])
    server = config_from_args(ServeConfig(), args).server
    assert (server.max_queued_requests, server.max_queue_time, server.shutdown_timeout,
            server.max_engine_restarts) == (5, 2.5, 7.0, 1)
    assert ServeConfig().server.max_queued_requests == 1024
    server.max_engine_restarts = -1
    with pytest.raises(ValueError, match="max_engine_restarts"):
        server.check()
