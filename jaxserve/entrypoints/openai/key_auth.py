"""The server's key check: which key a request carries, what it may use, and its limits.

`KeyAuthMiddleware` (pure ASGI, before the body is read) answers 401 for a missing or unknown
key and 429 for a key over its limit, and puts the key's `KeyGrant` in a context variable for
the handlers: `serving_engine.OpenAIServing.model_name` answers 404 model_not_found for a
model the key may not use (the same answer as for a model that does not exist, so a key
learns nothing about models it may not use), /v1/models lists only the key's models, and
`start_requests` meters prompt and completion tokens, charged to the key when the response
ends. Every response of a limited key carries OpenAI's x-ratelimit-* headers.
"""

from __future__ import annotations

import contextvars
import dataclasses
import logging
from collections.abc import Callable
from typing import Any

from starlette.responses import JSONResponse

from jaxserve.entrypoints.openai.api_keys import APIKey, KeyTable
from jaxserve.entrypoints.openai.protocol import error_body
from jaxserve.entrypoints.openai.rate_limit import RateLimiter, Verdict, retry_after_header

logger = logging.getLogger(__name__)

# Probes and scrapes need no key: liveness/readiness (/health, /health/...) and /metrics.
OPEN_PATHS = frozenset({"/health", "/metrics", "/ready", "/readyz", "/livez"})


@dataclasses.dataclass
class KeyGrant:
    """The key of the request being served, and the tokens its response has used."""
    key: APIKey
    prompt_tokens: int = 0
    completion_tokens: int = 0

    def may_use(self, model: str) -> bool:
        return self.key.may_use(model)


current_grant: contextvars.ContextVar[KeyGrant | None] = contextvars.ContextVar(
    "jaxserve_key_grant", default=None)


def is_open_path(path: str) -> bool:
    return path in OPEN_PATHS or path.startswith("/health/")


def _route_path(scope: dict) -> str:
    """The path the router matches: without --root-path's prefix, which uvicorn puts in
    front of every path."""
    path, root = scope["path"], scope.get("root_path", "")
    return path[len(root):] or "/" if root and path.startswith(root) else path


def _bearer(scope: dict) -> bytes | None:
    value = next((v for k, v in scope["headers"] if k == b"authorization"), None)
    if value is None:
        return None
    scheme, _, token = value.partition(b" ")
    return token.strip() if scheme.lower() == b"bearer" else value


class KeyAuthMiddleware:
    """Pure ASGI middleware: `Authorization: Bearer KEY` on every path but the open ones."""

    def __init__(self, app: Any, keys: KeyTable, limiter: RateLimiter) -> None:
        self.app = app
        self.keys = keys
        self.limiter = limiter

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http" or is_open_path(_route_path(scope)) \
                or scope.get("method") == "OPTIONS":
            return await self.app(scope, receive, send)
        presented = _bearer(scope)
        key = self.keys.lookup(presented) if presented else None
        if key is None:
            response = JSONResponse(
                error_body("Incorrect API key provided." if presented else
                           "Missing API key: send 'Authorization: Bearer YOUR_KEY'.",
                           "authentication_error", code="invalid_api_key"), status_code=401)
            return await response(scope, receive, send)
        if not key.limited:
            return await self._serve(scope, receive, send, KeyGrant(key), None)
        verdict = await self.limiter.admit(key)
        if verdict.unavailable:
            response = JSONResponse(
                error_body("rate limiting is unavailable (its backend cannot be reached); "
                           "try again shortly", "service_unavailable"),
                status_code=503, headers={"Retry-After": "1"})
            return await response(scope, receive, send)
        if verdict.refused_by is not None:
            return await self._refuse(scope, receive, send, key, verdict)
        return await self._serve(scope, receive, send, KeyGrant(key), verdict)

    async def _serve(self, scope: dict, receive: Callable, send: Callable, grant: KeyGrant,
                     verdict: Verdict | None) -> None:
        extra = verdict.headers() if verdict is not None else []

        async def send_with_headers(message: dict) -> None:
            if extra and message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *extra]}
            await send(message)

        token = current_grant.set(grant)
        try:
            await self.app(scope, receive, send_with_headers)
        finally:
            current_grant.reset(token)
            used = grant.prompt_tokens + grant.completion_tokens
            if used and grant.key.tokens_per_minute is not None:
                await self.limiter.charge_tokens(grant.key, used)

    async def _refuse(self, scope: dict, receive: Callable, send: Callable, key: APIKey,
                      verdict: Verdict) -> None:
        kind = verdict.refused_by
        limit = verdict.limit_requests if kind == "requests" else verdict.limit_tokens
        unit = "requests per min (RPM)" if kind == "requests" else "tokens per min (TPM)"
        wait = verdict.retry_after_s
        logger.info("rate limit: %s over %s (limit %s)", key.name, unit, limit)
        headers = dict((k.decode(), v.decode()) for k, v in verdict.headers())
        headers["Retry-After"] = retry_after_header(wait)
        headers["retry-after-ms"] = str(max(1, int(wait * 1000)))
        response = JSONResponse(
            error_body(f"Rate limit reached on {unit}: Limit {limit}. Please try again in "
                       f"{wait:.1f}s.", kind, code="rate_limit_exceeded"),
            status_code=429, headers=headers)
        await response(scope, receive, send)


def allowed_models(names: list[str]) -> list[str]:
    """The names (served models, adapters) the current request's key may use."""
    grant = current_grant.get()
    return names if grant is None else [n for n in names if grant.may_use(n)]
