"""Server-sent events framing of streamed responses."""

from __future__ import annotations

import json
from typing import Any

from jaxserve.entrypoints.openai.errors import engine_error

# JSON leaves these raw (only U+0000-U+001F must be escaped), but Python's str.splitlines,
# httpx's and requests' iter_lines and other line readers end a line at each of them, and
# would cut a `data:` line in two when generated text holds one. Escaped, the JSON means
# the same and every event stays on one line, whatever reads it.
_LINE_BREAKS_JSON_LEAVES_RAW = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028",
                                              "\u2029": "\\u2029"})


def sse(data: dict[str, Any]) -> str:
    body = json.dumps(data, ensure_ascii=False, separators=(',', ':'))
    return f"data: {body.translate(_LINE_BREAKS_JSON_LEAVES_RAW)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def sse_error(exc: BaseException) -> str:
    return sse(engine_error(exc).body())
