"""API keys with model access and rate limits, TLS and --root-path, against the fake engine
(tests/fake_engine.py: the HTTP layer is real, the engine instant)."""

from __future__ import annotations

import asyncio
import hashlib
import os
import signal
import ssl
import threading
import time

import httpx
import openai
import pytest

try:                                    # tests/ as a package or as a plain directory
    from tests.fake_engine import FakeEngineCore
    from tests.test_server_fake_engine import free_port
except ImportError:
    from fake_engine import FakeEngineCore
    from test_server_fake_engine import free_port

from jaxserve.config import ServeConfig
from jaxserve.engine.async_engine import AsyncLLMEngine
from jaxserve.entrypoints.openai.api_keys import KeyTable, parse_keys_file


class Server:
    """build_app + uvicorn (TLS when asked) in a thread, on a free loopback port."""

    def __init__(self, **server_options) -> None:
        import uvicorn

        from jaxserve.entrypoints.openai.api_server import build_app, uvicorn_options

        self.engine = AsyncLLMEngine(FakeEngineCore())
        config = ServeConfig()
        config.engine.model_config.served_model_name = ["smol"]
        for name, value in server_options.items():
            setattr(config.server, name, value)
        self.app = build_app(self.engine, config)
        self.port = free_port()
        options = uvicorn_options(config.server)
        self.url = f"{'https' if 'ssl_certfile' in options else 'http'}://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port,
                                                    log_level="warning", **options))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.02)

    def client(self, key: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.engine.shutdown()


KEYS_YAML = """
keys:
  - key: sk-team-a
    models: [smol]
    requests_per_minute: 3
  - sha256: {digest_b}
    models: [other-model]
  - key: sk-tokens
    models: ["*"]
    tokens_per_minute: 40
  - key: sk-many
    requests_per_minute: 50
"""


@pytest.fixture
def keys_file(tmp_path):
    path = tmp_path / "keys.yaml"
    path.write_text(KEYS_YAML.format(digest_b=hashlib.sha256(b"sk-team-b").hexdigest()))
    return str(path)


@pytest.fixture
def server(keys_file):
    srv = Server(api_keys_file=keys_file, api_key=["sk-admin"])
    yield srv
    srv.stop()


@pytest.mark.fast
def test_unknown_key_is_401_and_a_model_the_key_may_not_use_is_404(server):
    with pytest.raises(openai.AuthenticationError) as info:
        server.client("sk-nobody").models.list()
    assert info.value.status_code == 401 and info.value.code == "invalid_api_key"
    # sk-team-b (in the file by its sha256 only) may use other-model, which is not served,
    # and not smol: smol is "not found" for it, as a model that does not exist.
    with pytest.raises(openai.NotFoundError) as info:
        server.client("sk-team-b").completions.create(model="smol", prompt="a", max_tokens=2)
    assert info.value.code == "model_not_found" and info.value.body["param"] == "model"
    with pytest.raises(openai.NotFoundError):
        server.client("sk-team-b").chat.completions.create(
            model="smol", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    with pytest.raises(openai.NotFoundError):
        server.client("sk-team-b").models.retrieve("smol")
    assert [m.id for m in server.client("sk-team-b").models.list().data] == []
    assert [m.id for m in server.client("sk-team-a").models.list().data] == ["smol"]
    assert [m.id for m in server.client("sk-admin").models.list().data] == ["smol"]
    done = server.client("sk-admin").completions.create(model="smol", prompt="a", max_tokens=2)
    assert done.usage.completion_tokens == 2
    # Probes and scrapes need no key; every other route does.
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/metrics").status_code == 200
    assert httpx.post(server.url + "/tokenize", json={"prompt": "a"}).status_code == 401
    assert httpx.get(server.url + "/version").status_code == 401


@pytest.mark.fast
def test_over_the_request_limit_is_429_with_retry_after_and_ratelimit_headers(server):
    client = server.client("sk-team-a")
    remaining = []
    for _ in range(3):
        raw = client.completions.with_raw_response.create(model="smol", prompt="a",
                                                          max_tokens=1)
        assert raw.headers["x-ratelimit-limit-requests"] == "3"
        assert raw.headers["x-ratelimit-reset-requests"].endswith("s")
        remaining.append(int(raw.headers["x-ratelimit-remaining-requests"]))
    assert remaining == [2, 1, 0]
    with pytest.raises(openai.RateLimitError) as info:
        client.completions.create(model="smol", prompt="a", max_tokens=1)
    error = info.value
    assert error.status_code == 429 and error.code == "rate_limit_exceeded"
    assert error.body["type"] == "requests"
    retry_after = int(error.response.headers["retry-after"])
    assert 1 <= retry_after <= 60
    assert error.response.headers["x-ratelimit-remaining-requests"] == "0"
    # Other keys have their own counters; unlimited keys carry no rate-limit headers.
    raw = server.client("sk-admin").models.with_raw_response.list()
    assert raw.http_response.status_code == 200
    assert "x-ratelimit-limit-requests" not in raw.headers


def test_request_limit_is_exact_under_200_concurrent_requests(server):
    async def scenario():
        async with httpx.AsyncClient(base_url=server.url, timeout=60,
                                     limits=httpx.Limits(max_connections=200)) as client:
            headers = {"Authorization": "Bearer sk-many"}
            body = {"model": "smol", "prompt": "a", "max_tokens": 1}
            responses = await asyncio.gather(*[
                client.post("/v1/completions", json=body, headers=headers)
                for _ in range(200)])
        return [r.status_code for r in responses]

    codes = asyncio.run(scenario())
    assert codes.count(200) == 50 and codes.count(429) == 150, sorted(set(codes))


@pytest.mark.fast
def test_tokens_per_minute_count_prompt_and_completion_tokens(server):
    client = server.client("sk-tokens")
    first = client.completions.with_raw_response.create(model="smol", prompt="abcd",
                                                        max_tokens=10)
    assert first.headers["x-ratelimit-remaining-tokens"] == "40"
    assert first.parse().usage.total_tokens == 14           # 4 prompt bytes + 10 tokens
    stream = client.chat.completions.create(
        model="smol", messages=[{"role": "user", "content": "hey"}], max_tokens=2,
        stream=True, stream_options={"include_usage": True})
    usage = [chunk.usage for chunk in stream if chunk.usage][-1]
    second = client.models.with_raw_response.list()
    assert int(second.headers["x-ratelimit-remaining-tokens"]) == 40 - 14 - usage.total_tokens
    assert 40 - 14 - usage.total_tokens > 0
    client.completions.create(model="smol", prompt="a", max_tokens=30)   # over 40 now
    with pytest.raises(openai.RateLimitError) as info:
        client.completions.create(model="smol", prompt="a", max_tokens=1)
    assert info.value.body["type"] == "tokens"
    assert info.value.response.headers["x-ratelimit-remaining-tokens"] == "0"


@pytest.mark.fast
def test_sighup_reloads_the_keys_file(server, keys_file):
    from jaxserve.entrypoints.openai.api_server import reload_keys_on

    with pytest.raises(openai.AuthenticationError):
        server.client("sk-new").models.list()
    with open(keys_file, "a") as f:
        f.write("  - key: sk-new\n    models: [smol]\n")
    previous = signal.signal(signal.SIGHUP, reload_keys_on(server.app.state.keys))
    try:
        os.kill(os.getpid(), signal.SIGHUP)
        deadline = time.monotonic() + 10
        while len(server.app.state.keys) != 6:
            assert time.monotonic() < deadline, "SIGHUP did not reload the keys"
            time.sleep(0.01)
    finally:
        signal.signal(signal.SIGHUP, previous)
    assert [m.id for m in server.client("sk-new").models.list().data] == ["smol"]
    # A broken file keeps the keys in force.
    with open(keys_file, "w") as f:
        f.write("keys: [ {key: 1")
    server.app.state.keys.reload()
    assert [m.id for m in server.client("sk-new").models.list().data] == ["smol"]


@pytest.mark.fast
def test_a_stored_response_is_visible_to_its_own_key_only(server):
    mine = server.client("sk-admin")
    created = mine.responses.create(model="smol", input="hi", max_output_tokens=3)
    assert mine.responses.retrieve(created.id).id == created.id
    other = server.client("sk-team-a")
    with pytest.raises(openai.NotFoundError):
        other.responses.retrieve(created.id)
    with pytest.raises(openai.NotFoundError):
        other.responses.create(model="smol", input="more", previous_response_id=created.id,
                               max_output_tokens=2)
    follow = mine.responses.create(model="smol", input="more", max_output_tokens=2,
                                   previous_response_id=created.id)
    assert follow.status in ("completed", "incomplete")


@pytest.mark.fast
def test_only_a_key_with_every_model_may_load_or_unload_adapters(keys_file):
    srv = Server(api_keys_file=keys_file, api_key=["sk-admin"],
                 allow_runtime_lora_updating=True)
    try:
        body = {"lora_name": "x", "lora_path": "/nonexistent"}
        limited = httpx.post(srv.url + "/v1/load_lora_adapter", json=body,
                             headers={"Authorization": "Bearer sk-team-a"})
        assert limited.status_code == 403
        assert limited.json()["error"]["type"] == "permission_error"
        admin = httpx.post(srv.url + "/v1/load_lora_adapter", json=body,
                           headers={"Authorization": "Bearer sk-admin"})
        assert admin.status_code == 400 and "--enable-lora" in admin.text   # past the check
        assert httpx.post(srv.url + "/v1/unload_lora_adapter", json={"lora_name": "x"},
                          headers={"Authorization": "Bearer sk-team-a"}).status_code == 403
    finally:
        srv.stop()


@pytest.mark.fast
def test_keys_file_mistakes_are_one_clear_error(tmp_path):
    path = tmp_path / "k.yaml"
    for text, words in [("keys:\n  - models: [a]\n", "exactly one of 'key' or 'sha256'"),
                        ("keys:\n  - key: a\n    rpm: 3\n", "unknown field"),
                        ("keys:\n  - sha256: abc\n", "64 hex digits"),
                        ("keys:\n  - key: a\n    requests_per_minute: -1\n", ">= 0"),
                        ("nokeys: 1\n", "'keys' list")]:
        path.write_text(text)
        with pytest.raises(ValueError, match=words):
            parse_keys_file(path)
    with pytest.raises(ValueError, match="'keys' list"):
        KeyTable((), str(path))


@pytest.mark.fast
def test_tls_serves_https_with_the_given_certificate(tmp_path):
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    import ipaddress
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=1))
            .not_valid_after(now + datetime.timedelta(hours=1))
            .add_extension(x509.SubjectAlternativeName(
                [x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
            .sign(key, hashes.SHA256()))
    cert_path, key_path = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    srv = Server(ssl_certfile=str(cert_path), ssl_keyfile=str(key_path), root_path="/llm",
                 api_key=["sk-tls"])
    try:
        assert srv.url.startswith("https://")
        with httpx.Client(verify=ssl.create_default_context(cafile=str(cert_path))) as client:
            r = client.post(srv.url + "/v1/completions", headers={"Authorization": "Bearer sk-tls"},
                            json={"model": "smol", "prompt": "a", "max_tokens": 3})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
            # --root-path: the app knows the public prefix a proxy strips (OpenAPI's servers);
            # /health stays open under it, the rest needs the key.
            docs = client.get(srv.url + "/openapi.json", headers={"Authorization": "Bearer sk-tls"})
            assert docs.json()["servers"] == [{"url": "/llm"}]
            assert client.get(srv.url + "/health").status_code == 200
            assert client.get(srv.url + "/v1/models").status_code == 401
        with pytest.raises(httpx.ConnectError):
            httpx.get(srv.url + "/health")          # not trusted without the certificate
    finally:
        srv.stop()


@pytest.mark.fast
def test_tls_needs_both_files(tmp_path):
    from jaxserve.config import ServerConfig
    from jaxserve.entrypoints.openai.api_server import uvicorn_options

    with pytest.raises(ValueError, match="go together"):
        uvicorn_options(ServerConfig(ssl_certfile=str(tmp_path)))
    with pytest.raises(FileNotFoundError, match="--ssl-keyfile"):
        uvicorn_options(ServerConfig(ssl_certfile=__file__, ssl_keyfile=str(tmp_path / "no")))
