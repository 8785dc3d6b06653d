"""Qwen3-Coder tool calls (its chat template's XML-ish format):

    some text<tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call>

Parameter values are raw text; each is converted with the tool's declared JSON type
when the request says it (integer, number, boolean, object, array), else kept a string
unless it reads as JSON (vLLM's parser does the same). Content is the text before the
first ``<tool_call>``. While streaming, a call's arguments grow one whole parameter at a
time (a value is only known once ``</parameter>`` closes it), and the JSON object stays
open until ``</function>``, so every streamed arguments string is a prefix of the final.
"""

from __future__ import annotations

import json
import re
from typing import Any

from jaxserve.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    ParsedToolCall,
    ToolParser,
    held_back_prefix,
)

START, END = "<tool_call>", "</tool_call>"
_FUNCTION = re.compile(r"<function=([^>\n]+)>")
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)
_FUNCTION_END = "</function>"


class Qwen3CoderToolParser(ToolParser):
    name = "qwen3_coder"

    def split(self, text: str, final: bool) -> tuple[str, list[ParsedToolCall]]:
        first = text.find(START)
        if first < 0:
            # Qwen3-Coder sometimes drops the <tool_call> wrapper: a bare <function=...>.
            first = text.find("<function=")
            if first < 0:
                return (text if final else text[:len(text) - _held_back(text)]), []
        calls: list[ParsedToolCall] = []
        pos = first
        while (match := _FUNCTION.search(text, pos)) is not None:
            end = text.find(_FUNCTION_END, match.end())
            body = text[match.end():] if end < 0 else text[match.end():end]
            complete = end >= 0 or final
            calls.append(ParsedToolCall(match.group(1).strip(),
                                        self._arguments(match.group(1).strip(), body,
                                                        complete)))
            if end < 0:
                break
            pos = end + len(_FUNCTION_END)
        if final and not calls:
            return text, []
        return text[:first], calls

    def _arguments(self, function: str, body: str, complete: bool) -> str:
        types = self._parameter_types(function)
        parts = [f"{json.dumps(name.strip(), ensure_ascii=False)}: "
                 f"{json.dumps(_convert(value, types.get(name.strip())), ensure_ascii=False)}"
                 for name, value in _PARAMETER.findall(body)]
        text = "{" + ", ".join(parts)
        return text + "}" if complete else text

    def _parameter_types(self, function: str) -> dict[str, Any]:
        for tool in self.tools or ():
            spec = tool.get("function", tool)
            if spec.get("name") == function:
                properties = (spec.get("parameters") or {}).get("properties") or {}
                return {name: (schema or {}).get("type") for name, schema in properties.items()}
        return {}


def _held_back(text: str) -> int:
    return max(held_back_prefix(text, START), held_back_prefix(text, "<function="))


def _convert(raw: str, kind: Any) -> Any:
    """A parameter's text as the JSON value its declared type says."""
    value = raw.removeprefix("\n").removesuffix("\n")
    if kind == "string" or (isinstance(kind, list) and "string" in kind):
        return value
    stripped = value.strip()
    if kind == "integer":
        try:
            return int(stripped)
        except ValueError:
            return value
    if kind == "number":
        try:
            number = float(stripped)
            return int(number) if number.is_integer() and "." not in stripped else number
        except ValueError:
            return value
    if kind == "boolean":
        if stripped.lower() in ("true", "false"):
            return stripped.lower() == "true"
        return value
    if stripped.lower() in ("null", "none"):
        return None
    try:
        return json.loads(stripped)
    except json.JSONDecodeError:
        return value
