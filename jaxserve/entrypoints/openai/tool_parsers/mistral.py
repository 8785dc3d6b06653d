"""Mistral tool calls: ``[TOOL_CALLS]`` then a JSON array of calls,

    [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]

(the v11+ tokenizers write ``[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}`` instead,
one call per marker; both are read). Content is the text before the first marker; a
tail that may be the start of it is held back while streaming. The calls are read when
their JSON is complete (streaming sends each call once it is; the final response reads
a cut-off array as content, as vLLM does).
"""

from __future__ import annotations

import json

from jaxserve.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    ParsedToolCall,
    ToolParser,
    call_from_object,
    held_back_prefix,
)

BOT = "[TOOL_CALLS]"
ARGS = "[ARGS]"


class MistralToolParser(ToolParser):
    name = "mistral"

    def split(self, text: str, final: bool) -> tuple[str, list[ParsedToolCall]]:
        first = text.find(BOT)
        if first < 0:
            return (text if final else text[:len(text) - held_back_prefix(text, BOT)]), []
        calls: list[ParsedToolCall] = []
        complete = True
        for segment in text[first + len(BOT):].split(BOT):
            segment_calls, whole = _read_segment(segment, final)
            calls.extend(segment_calls)
            complete = complete and whole
        if final and (not calls or not complete):
            return text, []
        return text[:first], calls


def _read_segment(segment: str, final: bool) -> tuple[list[ParsedToolCall], bool]:
    """The calls of the text after one [TOOL_CALLS]; whether it parsed completely."""
    stripped = segment.strip()
    if ARGS in segment:                                      # name[ARGS]{...}
        name, _, arguments = segment.partition(ARGS)
        try:
            json.loads(arguments)
        except json.JSONDecodeError:
            return [], False
        return [ParsedToolCall(name.strip(), arguments.strip())], True
    decoder, calls, pos = json.JSONDecoder(), [], 0
    if stripped.startswith("["):
        pos = 1
    while True:
        while pos < len(stripped) and stripped[pos] in " \t\r\n,":
            pos += 1
        if pos >= len(stripped) or stripped[pos] == "]":
            return calls, pos < len(stripped) or not stripped.startswith("[")
        try:
            obj, pos = decoder.raw_decode(stripped, pos)
        except json.JSONDecodeError:
            return calls, False
        call = call_from_object(obj)
        if call is None:
            return calls, False
        calls.append(call)
