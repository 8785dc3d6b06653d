"""What a tool-call parser does: split model text into content and tool calls.

One method serves both the full response and streaming: ``split(text, final)`` on the
text generated so far. While not final, the content it returns may hold back a tail
that could still become a tool call, and it returns only the calls it can read so far.
Its results must only grow as the text grows (the content a prefix of the next content,
the calls a prefix of the next calls, each call's arguments a prefix of the next), so
that streamed deltas reassemble to the final response.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class ParsedToolCall:
    name: str
    arguments: str          # a JSON object, as a string (OpenAI's shape)


class ToolParser:
    """Base class; subclasses register in tool_parsers/__init__.py."""

    name = ""

    def split(self, text: str, final: bool) -> tuple[str, list[ParsedToolCall]]:
        raise NotImplementedError


def call_from_object(obj: Any, arguments_key: str = "arguments") -> ParsedToolCall | None:
    """{"name": ..., "arguments" (or "parameters"): {...}} → a call; None if not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = obj.get(arguments_key, obj.get("parameters", obj.get("arguments", {})))
    if isinstance(arguments, str):          # some models write the arguments pre-encoded
        return ParsedToolCall(obj["name"], arguments)
    return ParsedToolCall(obj["name"], json.dumps(arguments, ensure_ascii=False))


def held_back_prefix(text: str, marker: str) -> int:
    """Length of the longest tail of ``text`` that is a proper start of ``marker``."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0
