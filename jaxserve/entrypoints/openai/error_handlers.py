"""Every error leaves the server in OpenAI's shape: the route wrapper and the app's handlers."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response

from jaxserve.engine.errors import EngineUnavailableError
from jaxserve.entrypoints.openai.errors import (
    APIError,
    ClientGone,
    engine_error,
    validation_error,
)
from jaxserve.entrypoints.openai.protocol import error_body

logger = logging.getLogger(__name__)


def handle(fn: Callable[[Request], Awaitable[Response]]) -> Callable:
    """Wrap a route: an APIError is its JSON body and status, an unavailable engine a 503
    (not a 500), a client that left (even halfway through sending its body) a bare 499."""
    async def endpoint(raw_request: Request) -> Response:
        try:
            return await fn(raw_request)
        except APIError as exc:
            return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)
        except EngineUnavailableError as exc:
            error = engine_error(exc)
            return JSONResponse(error.body(), status_code=error.status,
                                headers=error.headers)
        except (ClientGone, ClientDisconnect):
            return Response(status_code=499)
    endpoint.__name__ = fn.__name__
    endpoint.__doc__ = fn.__doc__
    return endpoint


def add_error_handlers(app: FastAPI) -> None:
    """Anything FastAPI or Starlette raises on its own still leaves in OpenAI's shape:
    a validation error is a 400 (never FastAPI's 422), an unknown route a 404 naming the
    routes served, a bug a 500."""

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(_: Request, exc: RequestValidationError) -> Response:
        error = validation_error(exc)
        return JSONResponse(error.body(), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException) -> Response:
        status = exc.status_code
        message = str(exc.detail)
        if status == 404 and message == "Not Found":
            message = (f"The route {request.method} {request.url.path} is not supported by "
                       f"this server (jaxserve serves /v1/completions, /v1/chat/completions, "
                       f"/v1/responses, /v1/models, /tokenize, /detokenize, /health, /metrics, "
                       f"/version).")
        elif status == 405:
            message = f"Method {request.method} is not allowed on {request.url.path}."
        kind = "not_found_error" if status == 404 else "invalid_request_error"
        return JSONResponse(error_body(message, kind, code=status), status_code=status,
                            headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def on_error(_: Request, exc: Exception) -> Response:
        logger.exception("unhandled error")
        return JSONResponse(error_body(f"internal error: {exc!r}", "internal_server_error"),
                            status_code=500)
