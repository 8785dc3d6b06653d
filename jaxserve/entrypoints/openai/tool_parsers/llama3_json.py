"""Llama 3.x JSON tool calls: the whole reply is one or more JSON objects,

    {"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": ..., ...}

optionally after ``<|python_tag|>``. A reply that starts with ``{`` (or the tag) is held
back while streaming, since it may be a call; at the end it is calls if every object
parses, else content.
"""

from __future__ import annotations

import json

from jaxserve.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    ParsedToolCall,
    ToolParser,
    call_from_object,
)

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"

    def split(self, text: str, final: bool) -> tuple[str, list[ParsedToolCall]]:
        stripped = text.lstrip()
        body = stripped.removeprefix(PYTHON_TAG).lstrip()
        maybe_call = body.startswith("{") or PYTHON_TAG.startswith(stripped)
        if not maybe_call:
            return text, []
        if not final:
            return "", []
        calls = _parse_objects(body)
        return ("", calls) if calls else (text, [])


def _parse_objects(body: str) -> list[ParsedToolCall]:
    decoder, calls, pos = json.JSONDecoder(), [], 0
    while pos < len(body):
        try:
            obj, pos = decoder.raw_decode(body, pos)
        except json.JSONDecodeError:
            return []
        call = call_from_object(obj, "parameters")
        if call is None:
            return []
        calls.append(call)
        while pos < len(body) and body[pos] in " \t\r\n;":
            pos += 1
    return calls
