"""Server-sent events framing of streamed responses."""

from __future__ import annotations

import json
from typing import Any

from jaxserve.entrypoints.openai.errors import engine_error


def sse(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def sse_error(exc: BaseException) -> str:
    return sse(engine_error(exc).body())

