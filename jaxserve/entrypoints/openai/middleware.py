"""The server's ASGI middleware: the API key check, `x-request-id`, CORS."""

from __future__ import annotations

import hmac
import json
import os
import uuid
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware
from starlette.responses import JSONResponse

from jaxserve.config import ServeConfig, ServerConfig
from jaxserve.entrypoints.openai.protocol import error_body

OPEN_PATHS = frozenset({"/health", "/livez", "/readyz", "/metrics"})


def api_key_from(config: ServeConfig) -> str | None:
    return config.server.api_key or os.environ.get("JAXSERVE_API_KEY") or None


class APIKeyMiddleware:
    """Pure ASGI middleware: `Authorization: Bearer KEY` on every path but OPEN_PATHS.

    It runs before the body is read, so a request without the key gets 401 whatever
    else is wrong with it.
    """

    def __init__(self, app: Any, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS \
                or scope.get("method") == "OPTIONS":
            return await self.app(scope, receive, send)
        given = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
        if not hmac.compare_digest(given, self.expected):
            response = JSONResponse(
                error_body("Incorrect API key provided." if given else
                           "Missing API key: send 'Authorization: Bearer YOUR_KEY'.",
                           "authentication_error", code="invalid_api_key"), status_code=401)
            return await response(scope, receive, send)
        return await self.app(scope, receive, send)


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


def add_middleware(app: FastAPI, server: ServerConfig, api_key: str | None) -> None:
    """The API key check (when a key is set), CORS, then `x-request-id`. Added last =
    outermost: preflight and error responses get CORS headers and an id too."""
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)
    app.add_middleware(CORSMiddleware, allow_origins=cors_list(server.allowed_origins),
                       allow_methods=cors_list(server.allowed_methods),
                       allow_headers=cors_list(server.allowed_headers),
                       allow_credentials=server.allow_credentials)
    app.add_middleware(RequestIdMiddleware)
