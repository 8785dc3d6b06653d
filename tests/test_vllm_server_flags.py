"""vLLM's server flags with a meaning here: --return-tokens-as-token-ids,
--enable-prompt-tokens-details, --override-generation-config (the fake engine: the HTTP
side is real)."""

from __future__ import annotations

import types

import pytest
from starlette.testclient import TestClient

try:                                    # tests/ as a package or as a plain directory
    from tests.fake_engine import FakeEngineCore
except ImportError:
    from fake_engine import FakeEngineCore

from jaxserve.config import EngineConfig, ServeConfig
from jaxserve.engine.async_engine import AsyncLLMEngine
from jaxserve.platforms import CpuPlatform

pytestmark = pytest.mark.fast


def serve(**server_options):
    from jaxserve.entrypoints.openai.api_server import build_app

    config = ServeConfig()
    config.engine.model_config.served_model_name = ["smol"]
    for name, value in server_options.items():
        setattr(config.server, name, value)
    engine = AsyncLLMEngine(FakeEngineCore())
    return engine, TestClient(build_app(engine, config))


def test_return_tokens_as_token_ids_names_logprob_tokens_by_id():
    engine, client = serve(return_tokens_as_token_ids=True)
    try:
        with client:
            r = client.post("/v1/completions", json={"model": "smol", "prompt": "ab",
                                                     "max_tokens": 3, "logprobs": 1})
            logprobs = r.json()["choices"][0]["logprobs"]
            text = r.json()["choices"][0]["text"]
            assert logprobs["tokens"] == [f"token_id:{ord(c)}" for c in text]
            assert all(set(top) <= {f"token_id:{ord(c)}" for c in text} | {"token_id:35"}
                       for top in logprobs["top_logprobs"])
            r = client.post("/v1/chat/completions", json={
                "model": "smol", "messages": [{"role": "user", "content": "x"}],
                "max_tokens": 2, "logprobs": True, "top_logprobs": 1})
            content = r.json()["choices"][0]["logprobs"]["content"]
            assert all(item["token"].startswith("token_id:") for item in content)
            assert content[0]["bytes"] == list(content[0]["token"].encode())
    finally:
        engine.shutdown()
    engine, client = serve()
    try:
        with client:
            r = client.post("/v1/completions", json={"model": "smol", "prompt": "ab",
                                                     "max_tokens": 3, "logprobs": 1})
            assert "".join(r.json()["choices"][0]["logprobs"]["tokens"]) == \
                r.json()["choices"][0]["text"]
    finally:
        engine.shutdown()


def test_prompt_tokens_details_can_be_turned_off():
    for enabled in (True, False):
        engine, client = serve(enable_prompt_tokens_details=enabled)
        try:
            with client:
                usage = client.post("/v1/completions", json={
                    "model": "smol", "prompt": "ab", "max_tokens": 1}).json()["usage"]
                assert ("prompt_tokens_details" in usage) == enabled
        finally:
            engine.shutdown()


def test_override_generation_config_wins_over_the_models_and_is_checked():
    from jaxserve.engine.model_setup import _sampling_overrides

    config = EngineConfig.from_kwargs(override_generation_config={"temperature": 0.2})
    placed = types.SimpleNamespace(generation_config={"temperature": 0.7, "top_p": 0.8})
    assert _sampling_overrides(config, placed) == {"temperature": 0.2, "top_p": 0.8}
    config.model_config.generation_config = "vllm"
    assert _sampling_overrides(config, placed) == {"temperature": 0.2}
    bad = EngineConfig.from_kwargs(override_generation_config={"max_new_tokens": 5})
    with pytest.raises(ValueError, match="max_new_tokens"):
        CpuPlatform().resolve_config(bad)
