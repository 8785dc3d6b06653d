"""--rate-limit-backend redis://: two servers share one limit through a real redis-server
(started here on a free loopback port, in a temporary directory), and a Redis outage fails
open or closed as --rate-limit-fail-mode says."""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import subprocess
import time

import httpx
import pytest

try:                                    # tests/ as a package or as a plain directory
    from tests.test_api_keys import Server, free_port
except ImportError:
    from test_api_keys import Server, free_port

pytest.importorskip("redis", reason="pip install 'jaxserve[redis]'")


@pytest.fixture
def redis_url(tmp_path):
    binary = shutil.which("redis-server")
    if binary is None:
        message = "redis-server is not installed (apt-get install -y redis-server)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    port = free_port()
    process = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(tmp_path),
         "--save", "", "--appendonly", "no"], stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL)
    import redis

    client = redis.Redis(host="127.0.0.1", port=port)
    deadline = time.monotonic() + 20
    while True:
        try:
            client.ping()
            break
        except redis.exceptions.ConnectionError:
            assert process.poll() is None, "redis-server exited"
            assert time.monotonic() < deadline, "redis-server did not start"
            time.sleep(0.05)
    yield f"redis://127.0.0.1:{port}", process
    if process.poll() is None:
        process.terminate()
        process.wait(10)


@pytest.fixture
def keys_file(tmp_path):
    path = tmp_path / "keys.yaml"
    path.write_text("keys:\n"
                    "  - key: sk-shared\n    requests_per_minute: 30\n"
                    "  - key: sk-tokens\n    tokens_per_minute: 20\n"
                    "  - key: sk-free\n")
    return str(path)


def test_two_servers_enforce_one_limit_through_redis(redis_url, keys_file):
    url, _ = redis_url
    servers = [Server(api_keys_file=keys_file, rate_limit_backend=url) for _ in range(2)]
    try:
        headers = {"Authorization": "Bearer sk-shared"}
        body = {"model": "smol", "prompt": "a", "max_tokens": 1}
        # One server's requests count on the other: 15 on the first, then the second has 14
        # left after its own.
        for _ in range(15):
            assert httpx.post(servers[0].url + "/v1/completions", json=body,
                              headers=headers, timeout=30).status_code == 200
        r = httpx.post(servers[1].url + "/v1/completions", json=body, headers=headers,
                       timeout=30)
        assert r.status_code == 200 and r.headers["x-ratelimit-remaining-requests"] == "14"

        async def scenario():
            async with httpx.AsyncClient(timeout=60,
                                         limits=httpx.Limits(max_connections=100)) as client:
                return await asyncio.gather(*[
                    client.post(servers[i % 2].url + "/v1/completions", json=body,
                                headers=headers) for i in range(80)])

        responses = asyncio.run(scenario())
        codes = [r.status_code for r in responses]
        # Concurrent requests on both servers: exactly the 14 left, no over-admission.
        assert codes.count(200) == 14 and codes.count(429) == 66, sorted(set(codes))
        remaining = sorted(int(r.headers["x-ratelimit-remaining-requests"])
                           for r in responses if r.status_code == 200)
        assert remaining == list(range(14))
        refused = next(r for r in responses if r.status_code == 429)
        assert 1 <= int(refused.headers["retry-after"]) <= 60
        # Tokens charged on one server count on the other.
        tokens = {"Authorization": "Bearer sk-tokens"}
        first = httpx.post(servers[0].url + "/v1/completions", headers=tokens,
                           json={"model": "smol", "prompt": "abc", "max_tokens": 5})
        assert first.status_code == 200
        second = httpx.get(servers[1].url + "/v1/models", headers=tokens)
        assert second.headers["x-ratelimit-remaining-tokens"] == str(20 - 8)
    finally:
        for server in servers:
            server.stop()


def test_redis_outage_fails_closed_or_open_as_configured(redis_url, keys_file, caplog):
    url, process = redis_url
    closed = Server(api_keys_file=keys_file, rate_limit_backend=url)
    opened = Server(api_keys_file=keys_file, rate_limit_backend=url,
                    rate_limit_fail_mode="open")
    try:
        headers = {"Authorization": "Bearer sk-shared"}
        for server in (closed, opened):
            assert httpx.get(server.url + "/v1/models", headers=headers).status_code == 200
        process.terminate()
        process.wait(10)
        with caplog.at_level(logging.ERROR, logger="jaxserve.entrypoints.openai.rate_limit"):
            refused = httpx.get(closed.url + "/v1/models", headers=headers)
            assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
            assert refused.json()["error"]["type"] == "service_unavailable"
            assert httpx.get(closed.url + "/v1/models", headers=headers).status_code == 503
            allowed = httpx.get(opened.url + "/v1/models", headers=headers)
            assert allowed.status_code == 200
            # Keys without limits never ask Redis.
            free = {"Authorization": "Bearer sk-free"}
            assert httpx.get(closed.url + "/v1/models", headers=free).status_code == 200
        lines = [r.getMessage() for r in caplog.records if "unreachable" in r.getMessage()]
        assert len(lines) == 2, lines          # one per server per outage, not per request
        assert any("fail-mode closed" in line for line in lines)
        assert any("fail-mode open" in line for line in lines)
    finally:
        closed.stop()
        opened.stop()
