"""Errors in OpenAI's shape: what the API sends for a bad request, a dead engine, a bug."""

from __future__ import annotations

import asyncio
import re
from typing import Any

from pydantic import ValidationError
from starlette.requests import ClientDisconnect

from jaxserve.engine.errors import EngineUnavailableError
from jaxserve.entrypoints.openai.protocol import error_body


class APIError(Exception):
    """An error to send in OpenAI's shape: {"error": {message, type, param, code}}."""

    def __init__(self, message: str, status: int = 400, type: str = "invalid_request_error",
                 param: str | None = None, code: str | int | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message, self.status, self.type, self.param, self.code = (
            message, status, type, param, code)
        self.headers = headers       # e.g. Retry-After on a 503

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


class ClientGone(Exception):
    """The client disconnected before the response was ready."""


def engine_error(exc: BaseException) -> APIError:
    """Map an exception from the engine side to an API error."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, ValueError):
        return APIError(str(exc))
    if isinstance(exc, EngineUnavailableError):
        headers = None if exc.retry_after is None else {"Retry-After": str(exc.retry_after)}
        return APIError(str(exc), 503, "service_unavailable", code=exc.code, headers=headers)
    return APIError(f"internal error: {exc!r}", 500, "internal_server_error")


def validation_error(exc: ValidationError | Any) -> APIError:
    errors = exc.errors() if hasattr(exc, "errors") else []
    # Our validators' own messages ("content parts of type 'image_url' are not supported")
    # say what is wrong; the other branches of a union that also failed only bury them.
    ours = [err for err in errors if str(err.get("msg", "")).startswith("Value error, ")]
    if ours:
        errors = [{**err, "msg": err["msg"].removeprefix("Value error, ")} for err in ours]
    parts, param = [], None
    for err in errors[:5]:
        loc = ".".join(str(p) for p in err.get("loc", ()) if _field_name(p))
        param = param or loc or None
        parts.append(f"{loc}: {err.get('msg')}" if loc else str(err.get("msg")))
    return APIError("; ".join(parts) or str(exc), param=param)


_TYPE_NAMES = {"body", "str", "list", "dict", "int", "float", "bool", "none"}


def _field_name(part: Any) -> bool:
    """A location part that names a field or index, not one of pydantic's union branches."""
    if isinstance(part, int):
        return True
    return bool(re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", str(part))) and \
        str(part) not in _TYPE_NAMES and not str(part)[0].isupper()


def reraise_disconnect(exc: BaseException) -> bool:
    """True for exceptions that mean the client went away (nothing left to send)."""
    return isinstance(exc, (ClientGone, ClientDisconnect, asyncio.CancelledError,
                            GeneratorExit))
