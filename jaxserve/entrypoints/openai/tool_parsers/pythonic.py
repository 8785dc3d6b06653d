"""Pythonic tool calls (Llama 3.2 / Llama 4, vLLM's ``pythonic``): the reply is a Python
list of calls with keyword arguments of literal values,

    [get_weather(city="San Francisco", metric="celsius"), get_time(zone="UTC")]

optionally wrapped in ``<|python_start|>`` ... ``<|python_end|>`` (Llama 4). A reply that
starts with ``[`` is held back while streaming until the list parses (each call is
sent once the whole list is readable); at the end it is calls if it parses as a list of
calls, else content. Arguments are read with ``ast`` (literals only: nothing is run).
"""

from __future__ import annotations

import ast
import json
from typing import Any

from jaxserve.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    ParsedToolCall,
    ToolParser,
)

_WRAP_START, _WRAP_END = "<|python_start|>", "<|python_end|>"


class PythonicToolParser(ToolParser):
    name = "pythonic"

    def split(self, text: str, final: bool) -> tuple[str, list[ParsedToolCall]]:
        stripped = text.strip()
        if not final and stripped and _WRAP_START.startswith(stripped):
            return "", []                           # may be the start of the wrapper
        wrapped = stripped.startswith(_WRAP_START)
        body = stripped.removeprefix(_WRAP_START).removesuffix(_WRAP_END).strip()
        if wrapped and not body and not final:
            return "", []
        if not body.startswith("["):
            return text, []
        calls = _parse_calls(body)
        if calls is None:
            return (text, []) if final else ("", [])
        return "", calls


def _parse_calls(body: str) -> list[ParsedToolCall] | None:
    try:
        tree = ast.parse(body, mode="eval")
    except SyntaxError:
        return None
    if not isinstance(tree.body, ast.List) or not tree.body.elts:
        return None
    calls = []
    for node in tree.body.elts:
        if not isinstance(node, ast.Call) or node.args:
            return None
        name = _dotted_name(node.func)
        if name is None:
            return None
        try:
            arguments = {kw.arg: _literal(kw.value) for kw in node.keywords if kw.arg}
        except ValueError:
            return None
        calls.append(ParsedToolCall(name, json.dumps(arguments, ensure_ascii=False)))
    return calls


def _dotted_name(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        prefix = _dotted_name(node.value)
        return None if prefix is None else f"{prefix}.{node.attr}"
    return None


def _literal(node: ast.expr) -> Any:
    """A literal's value; true/false/null are accepted as JSON spells them."""
    if isinstance(node, ast.Name) and node.id in ("true", "false", "null"):
        return {"true": True, "false": False, "null": None}[node.id]
    return ast.literal_eval(node)
