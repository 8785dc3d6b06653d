"""Reading a request body ourselves, so every failure is a 400 in OpenAI's shape."""

from __future__ import annotations

import json
import re
from typing import TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import Request

from jaxserve.entrypoints.openai.errors import APIError, validation_error

ModelT = TypeVar("ModelT", bound=BaseModel)

MAX_BODY_BYTES = 32 << 20          # a request body larger than this is refused (400)
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
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise APIError(f"request body is not valid UTF-8: {exc}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise APIError(f"request body is not valid JSON: {exc}") from None
    if _SURROGATE_ESCAPE.search(text):      # "\ud800" decodes to a string no tokenizer takes
        try:
            json.dumps(data, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError as exc:
            raise APIError(f"request body contains an unpaired UTF-16 surrogate: {exc}") \
                from None
    if not isinstance(data, dict):
        raise APIError("request body must be a JSON object")
    try:
        return model_type.model_validate(data)
    except ValidationError as exc:
        raise validation_error(exc) from None

