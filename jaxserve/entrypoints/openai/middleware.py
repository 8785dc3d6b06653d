"""The server's ASGI middleware: the key check (key_auth.py), `x-request-id`, CORS."""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware

from jaxserve.config import ServeConfig, ServerConfig
from jaxserve.entrypoints.openai.api_keys import KeyTable
from jaxserve.entrypoints.openai.key_auth import KeyAuthMiddleware
from jaxserve.entrypoints.openai.rate_limit import RateLimiter


def api_key_from(config: ServeConfig) -> list[str] | None:
    """--api-key's keys, else $JAXSERVE_API_KEY, else $VLLM_API_KEY (vLLM's), else None."""
    keys = config.server.api_key
    if isinstance(keys, str):
        keys = [keys]
    if keys:
        return list(keys)
    env = os.environ.get("JAXSERVE_API_KEY") or os.environ.get("VLLM_API_KEY")
    return [env] if env else None


def key_table_from(config: ServeConfig, api_key: str | list[str] | None = None
                   ) -> KeyTable | None:
    """The keys the server accepts (`api_key` overrides the config's), None: no auth."""
    plain = [api_key] if isinstance(api_key, str) else api_key
    if plain is None:
        plain = api_key_from(config)
    keys_file = config.server.api_keys_file
    if not plain and not keys_file:
        return None
    return KeyTable(plain or (), keys_file)


class RequestIdMiddleware:
    """Pure ASGI middleware: every response carries `x-request-id`, the client's if it sent
    one (so a proxy's or client's id can be traced through our logs), else a fresh one."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        given = next((v for k, v in scope["headers"] if k == b"x-request-id"), None)
        request_id = given or uuid.uuid4().hex.encode()

        async def send_with_id(message: dict) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", [])
                           if k.lower() != b"x-request-id"]
                message = {**message, "headers": [*headers, (b"x-request-id", request_id)]}
            await send(message)
        await self.app(scope, receive, send_with_id)


def cors_list(values: list[str]) -> list[str]:
    """vLLM takes these flags as one JSON list ('["https://a"]'); we also take plain words."""
    if len(values) == 1 and values[0].lstrip().startswith("["):
        parsed = json.loads(values[0])
        if not isinstance(parsed, list) or not all(isinstance(v, str) for v in parsed):
            raise ValueError(f"expected a JSON list of strings, got {values[0]!r}")
        return parsed
    return list(values)


def add_middleware(app: FastAPI, server: ServerConfig, keys: KeyTable | None,
                   limiter: RateLimiter | None) -> None:
    """The key check and rate limits (when keys are set), CORS, then `x-request-id`. Added
    last = outermost: preflight and error responses get CORS headers and an id too."""
    if keys is not None:
        app.add_middleware(KeyAuthMiddleware, keys=keys, limiter=limiter)
    app.add_middleware(CORSMiddleware, allow_origins=cors_list(server.allowed_origins),
                       allow_methods=cors_list(server.allowed_methods),
                       allow_headers=cors_list(server.allowed_headers),
                       allow_credentials=server.allow_credentials)
    app.add_middleware(RequestIdMiddleware)
