"""Hermes-style tool calls (Hermes, Qwen2.5/3, many others):

    some text<tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Content is the text before the first ``<tool_call>``; while streaming, a tail that may
be the start of ``<tool_call>`` is held back. An unclosed last call is read at the end
(models often stop right after the JSON). If a call's JSON is not valid when the text
is final, the whole text is content (vLLM does the same).
"""

from __future__ import annotations

import json

from jaxserve.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    ParsedToolCall,
    ToolParser,
    call_from_object,
    held_back_prefix,
)

START, END = "<tool_call>", "</tool_call>"


class HermesToolParser(ToolParser):
    name = "hermes"

    def split(self, text: str, final: bool) -> tuple[str, list[ParsedToolCall]]:
        first = text.find(START)
        if first < 0:
            return (text if final else text[:len(text) - held_back_prefix(text, START)]), []
        calls, pos = [], first
        while (start := text.find(START, pos)) >= 0:
            body_start = start + len(START)
            end = text.find(END, body_start)
            if end < 0 and not final:
                break                               # this call is still being written
            body = text[body_start:] if end < 0 else text[body_start:end]
            call = _parse(body)
            if call is None:
                if final:
                    return text, []
                break
            calls.append(call)
            if end < 0:
                break
            pos = end + len(END)
        return text[:first], calls


def _parse(body: str) -> ParsedToolCall | None:
    try:
        return call_from_object(json.loads(body.strip()))
    except json.JSONDecodeError:
        return None
