"""Liveness (/livez), readiness (/readyz) and /health through each state a replica passes:
loading (with phase and progress), ready, busy at twice its capacity, saturated, draining,
stuck, and back. The app is the one `jaxserve serve` runs (`ServingApp`: listening from the
start, the engine loaded on a thread) over the fake engine (tests/fake_engine.py), so each
state can be held exactly as long as the test needs it; the real engine's loading path is
covered by tests/test_deploy_monitoring.py.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
import uvicorn

try:                                    # tests/ as a package or as a plain directory
    from tests.fake_engine import FakeEngineCore
except ImportError:
    from fake_engine import FakeEngineCore

from jaxserve import load_progress
from jaxserve.config import ServeConfig
from jaxserve.engine.async_engine import AsyncLLMEngine
from jaxserve.entrypoints.openai.serving_app import ServingApp

DEADLINE_S = 10.0


class ShellServer:
    """`ServingApp` under uvicorn on a free port; `load(make_engine)` on a thread, as
    run_server does once the socket listens."""

    def __init__(self, *, max_num_seqs: int = 256, **server_options: object) -> None:
        config = ServeConfig()
        config.engine.model_config.served_model_name = ["fake-model"]
        config.engine.scheduler_config.max_num_seqs = max_num_seqs
        for name, value in server_options.items():          # ServerConfig fields
            setattr(config.server, name, value)
        self.shell = ServingApp(config)
        self.server = uvicorn.Server(uvicorn.Config(self.shell, host="127.0.0.1", port=0,
                                                    log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        wait_for(lambda: self.server.started, "the server did not start")
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"

    def load(self, make_engine: Callable[[], AsyncLLMEngine]) -> threading.Thread:
        loader = threading.Thread(target=self.shell.load, args=(make_engine,), daemon=True)
        loader.start()
        return loader

    def get(self, path: str) -> httpx.Response:
        return httpx.get(self.url + path, timeout=10)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        if self.shell.engine is not None:
            self.shell.engine.shutdown()


def wait_for(condition: Callable[[], object], message: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not condition():
        assert time.monotonic() < deadline, message
        time.sleep(0.01)


def loaded_server(fake: FakeEngineCore, **options: object) -> ShellServer:
    srv = ShellServer(**options)
    srv.load(lambda: AsyncLLMEngine(fake))
    wait_for(srv.shell.loaded.is_set, "the fake engine did not load")
    return srv


async def stream_tokens(url: str, max_tokens: int, first_token: asyncio.Event | None = None
                        ) -> int:
    """Stream one completion; the number of characters it received (one per fake token)."""
    body = {"prompt": "go", "max_tokens": max_tokens, "stream": True}
    chars = 0
    async with httpx.AsyncClient(timeout=60) as client, \
            client.stream("POST", url + "/v1/completions", json=body) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                chars += len(json.loads(line[len("data: "):])["choices"][0]["text"])
                if first_token is not None:
                    first_token.set()
    return chars


# -- loading ----------------------------------------------------------------------------------------
@pytest.mark.fast
def test_listens_while_loading_reports_phase_and_progress_then_becomes_ready():
    release = threading.Event()

    def make_engine() -> AsyncLLMEngine:
        load_progress.report("load")
        load_progress.report("compile", 0.43)
        assert release.wait(DEADLINE_S)
        return AsyncLLMEngine(FakeEngineCore())

    srv = ShellServer()
    try:
        srv.load(make_engine)
        wait_for(lambda: srv.get("/readyz").json().get("progress") == 0.43,
                 "/readyz never reported the compile progress")
        ready = srv.get("/readyz")
        assert ready.status_code == 503
        assert ready.json() == {"status": "loading", "phase": "compile", "progress": 0.43}
        live = srv.get("/livez")
        assert live.status_code == 200 and live.json()["status"] == "alive"
        assert srv.get("/health").status_code == 503
        api = httpx.post(srv.url + "/v1/completions", json={"prompt": "a"}, timeout=10)
        assert api.status_code == 503 and api.headers["retry-after"].isdigit()
        error = api.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["type"] == "service_unavailable" and "compile, 43%" in error["message"]
        assert srv.get("/metrics").status_code == 200

        release.set()
        wait_for(lambda: srv.get("/readyz").status_code == 200, "never became ready")
        assert srv.get("/readyz").json() == {"status": "ready"}
        assert srv.get("/health").status_code == 200
        done = httpx.post(srv.url + "/v1/completions", json={"prompt": "a", "max_tokens": 3},
                          timeout=10)
        assert done.status_code == 200 and done.json()["usage"]["completion_tokens"] == 3
        assert b"jaxserve:num_requests_running" in srv.get("/metrics").content
    finally:
        release.set()
        srv.stop()


@pytest.mark.fast
def test_a_failed_load_is_neither_alive_nor_ready():
    failed = threading.Event()

    def make_engine() -> AsyncLLMEngine:
        raise FileNotFoundError("model 'nope' not found")

    srv = ShellServer()
    srv.shell.on_load_failed = lambda exc: failed.set()
    try:
        srv.load(make_engine)
        assert failed.wait(DEADLINE_S)
        live, ready = srv.get("/livez"), srv.get("/readyz")
        assert live.status_code == 503 and "not found" in live.json()["reason"]
        assert ready.status_code == 503 and ready.json()["status"] == "failed"
    finally:
        srv.stop()


# -- loaded -----------------------------------------------------------------------------------------
@pytest.mark.fast
def test_busy_at_twice_capacity_stays_alive_and_ready_while_the_queue_has_room():
    """8 streams on a batch of 4: every iteration is short, so the loop is alive even though
    it has been busy for longer than the liveness threshold in total."""
    srv = loaded_server(FakeEngineCore(step_delay=0.01), max_num_seqs=4,
                        liveness_stall_timeout=0.3, max_queued_requests=64)
    try:
        async def run() -> None:
            streams = [asyncio.create_task(stream_tokens(srv.url, 80)) for _ in range(8)]
            async with httpx.AsyncClient(timeout=10) as client:
                wait_start = time.monotonic()
                while srv.shell.engine.num_unfinished_seqs < 8:
                    assert time.monotonic() - wait_start < DEADLINE_S
                    await asyncio.sleep(0.01)
                busy_since = time.monotonic()
                probes = 0
                while not any(s.done() for s in streams):
                    live = await client.get(srv.url + "/livez")
                    ready = await client.get(srv.url + "/readyz")
                    assert live.status_code == 200, live.text
                    assert ready.status_code == 200, ready.text
                    probes += 1
                    await asyncio.sleep(0.05)
                assert time.monotonic() - busy_since > 0.3    # busy past the threshold
                assert probes >= 3
            assert await asyncio.gather(*streams) == [80] * 8

        asyncio.run(run())
    finally:
        srv.stop()


@pytest.mark.fast
def test_full_admission_is_alive_but_not_ready_until_a_sequence_finishes():
    """Capacity 4 running + 4 queued, 8 in flight: a new request would get 503 at once, so
    the replica says it is saturated; it is still alive."""
    srv = loaded_server(FakeEngineCore(step_delay=0.01), max_num_seqs=4, max_queued_requests=4)
    try:
        async def run() -> None:
            streams = [asyncio.create_task(stream_tokens(srv.url, 60)) for _ in range(8)]
            async with httpx.AsyncClient(timeout=10) as client:
                wait_start = time.monotonic()
                while srv.shell.engine.num_unfinished_seqs < 8:
                    assert time.monotonic() - wait_start < DEADLINE_S
                    await asyncio.sleep(0.01)
                ready = await client.get(srv.url + "/readyz")
                assert ready.status_code == 503 and ready.json()["status"] == "saturated"
                assert (await client.get(srv.url + "/livez")).status_code == 200
                refused = await client.post(srv.url + "/v1/completions", json={"prompt": "x"})
                assert refused.status_code == 503
            assert await asyncio.gather(*streams) == [60] * 8

        asyncio.run(run())
        assert srv.get("/readyz").status_code == 200
    finally:
        srv.stop()


@pytest.mark.fast
def test_draining_is_alive_but_not_ready_and_in_flight_requests_finish():
    fake = FakeEngineCore(step_delay=0.01)
    srv = loaded_server(fake)
    try:
        async def run() -> None:
            first = asyncio.Event()
            stream = asyncio.create_task(stream_tokens(srv.url, 60, first))
            await asyncio.wait_for(first.wait(), DEADLINE_S)
            srv.shell.engine.stop_accepting()          # what SIGTERM starts
            async with httpx.AsyncClient(timeout=10) as client:
                live = await client.get(srv.url + "/livez")
                ready = await client.get(srv.url + "/readyz")
                health = await client.get(srv.url + "/health")
            assert not stream.done()
            assert live.status_code == 200
            assert ready.status_code == 503 and ready.json()["status"] == "draining"
            assert health.status_code == 503
            assert await stream == 60

        asyncio.run(run())
    finally:
        srv.stop()


@pytest.mark.fast
def test_a_stuck_engine_loop_is_not_alive_and_comes_back_when_it_moves():
    fake = FakeEngineCore()
    fake.step_gate = threading.Event()              # the next step blocks until set
    srv = loaded_server(fake, liveness_stall_timeout=0.3, step_stall_timeout=0.1)
    try:
        assert srv.get("/livez").status_code == 200
        request = threading.Thread(target=httpx.post, daemon=True, args=(
            srv.url + "/v1/completions",), kwargs={"json": {"prompt": "a", "max_tokens": 2},
                                                    "timeout": 30})
        request.start()
        wait_for(lambda: srv.get("/livez").status_code == 503, "/livez never said stuck")
        live = srv.get("/livez").json()
        assert live["status"] == "stuck" and "--liveness-stall-timeout" in live["reason"]
        assert srv.get("/readyz").json()["status"] == "stalled"
        fake.step_gate.set()
        wait_for(lambda: srv.get("/livez").status_code == 200, "/livez did not recover")
        request.join(DEADLINE_S)
    finally:
        fake.step_gate.set()
        srv.stop()


@pytest.mark.fast
def test_a_dead_engine_is_not_alive():
    fake = FakeEngineCore()
    srv = loaded_server(fake, max_engine_restarts=0)
    try:
        fake.fail_next_step = True
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "a"}, timeout=10)
        assert r.status_code == 503
        wait_for(lambda: srv.get("/livez").status_code == 503, "/livez never said dead")
        assert srv.get("/livez").json()["status"] == "dead"
        assert srv.get("/readyz").status_code == 503
    finally:
        srv.stop()


def test_a_model_that_is_not_there_is_one_line_and_exit_2_after_listening(tmp_path):
    """The server listens before it loads; a bad model still ends `jaxserve serve` as a bad
    option does: one line on stderr, no traceback, exit status 2."""
    root = Path(__file__).resolve().parent.parent
    done = subprocess.run(
        [sys.executable, "-m", "jaxserve.entrypoints.cli", "serve", str(tmp_path / "nope"),
         "--host", "127.0.0.1", "--port", "0", "--uvicorn-log-level", "warning"],
        capture_output=True, text=True, timeout=120, cwd=root,
        env={**os.environ, "PYTHONPATH": str(root)})
    assert done.returncode == 2, done.stderr[-2000:]
    assert "listening on http://127.0.0.1:" in done.stderr
    [line] = [l for l in done.stderr.splitlines() if l.startswith("jaxserve serve: error:")]
    assert "not found" in line and "Traceback" not in done.stderr
