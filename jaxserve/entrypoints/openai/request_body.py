"""Reading a request body ourselves, so every failure is a 400 in OpenAI's shape."""

from __future__ import annotations

import asyncio
import json
import re
from typing import TypeVar

import orjson
from pydantic import BaseModel, ValidationError
from starlette.requests import Request

from jaxserve.entrypoints.openai.errors import APIError, validation_error

ModelT = TypeVar("ModelT", bound=BaseModel)

MAX_BODY_BYTES = 32 << 20          # a request body larger than this is refused (400)
INLINE_BODY_BYTES = 256 << 10      # larger bodies are parsed and validated on a worker thread
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


async def parse_body(raw_request: Request, model_type: type[ModelT]) -> ModelT:
    """Read and validate a JSON body ourselves, so every failure is a 400 in OpenAI's shape."""
    length = raw_request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > MAX_BODY_BYTES:
        raise APIError(f"request body too large ({length} bytes; the limit is "
                       f"{MAX_BODY_BYTES})")
    chunks, size = [], 0
    async for chunk in raw_request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise APIError(f"request body too large (more than {MAX_BODY_BYTES} bytes)")
        chunks.append(chunk)
    body = b"".join(chunks)
    if len(body) > INLINE_BODY_BYTES:
        return await asyncio.to_thread(_decode_body, body, model_type, True)
    return _decode_body(body, model_type)


def _decode_body(body: bytes, model_type: type[ModelT], large: bool = False) -> ModelT:
    """The validated model of a JSON body; APIError (400) for anything wrong with it.
    A large body is parsed with orjson: any JSON parser holds the GIL while it runs (stalling
    the event loop even from a worker thread), and orjson holds it 4-5x shorter. It refuses
    what the json module would also make a 400 here (lone surrogates, NaN, deep nesting) and
    integers beyond 64 bits, which no field takes."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise APIError(f"request body is not valid UTF-8: {exc}") from None
    try:
        data = orjson.loads(body) if large else json.loads(text)
    except RecursionError:
        raise APIError("request body is not valid JSON: nested too deeply") from None
    except ValueError as exc:      # JSONDecodeError, or an integer of too many digits
        raise APIError(f"request body is not valid JSON: {exc}") from None
    if _SURROGATE_ESCAPE.search(text):      # "\ud800" decodes to a string no tokenizer takes
        try:
            json.dumps(data, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError as exc:
            raise APIError(f"request body contains an unpaired UTF-16 surrogate: {exc}") \
                from None
        except RecursionError:
            raise APIError("request body is not valid JSON: nested too deeply") from None
    if not isinstance(data, dict):
        raise APIError("request body must be a JSON object")
    try:
        return model_type.model_validate(data)
    except ValidationError as exc:
        raise validation_error(exc) from None
    except RecursionError:
        raise APIError("request body is nested too deeply") from None
