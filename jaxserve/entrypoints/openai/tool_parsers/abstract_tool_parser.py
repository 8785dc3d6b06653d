"""What a tool-call parser does: split model text into content and tool calls.

Two shapes of the same parser:

* ours, ``split(text, final)`` (below), which every built-in parser implements;
* vLLM's, ``extract_tool_calls(model_output, request)`` and
  ``extract_tool_calls_streaming(previous_text, current_text, delta_text, ...)``, which
  a ``--tool-parser-plugin`` written for vLLM implements. The base class adapts either
  to the other, so a plugin may implement whichever it has (see ``ToolParserManager``).

One method serves both the full response and streaming: ``split(text, final)`` on the
text generated so far. While not final, the content it returns may hold back a tail
that could still become a tool call, and it returns only the calls it can read so far.
Its results must only grow as the text grows (the content a prefix of the next content,
the calls a prefix of the next calls, each call's arguments a prefix of the next), so
that streamed deltas reassemble to the final response.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class ParsedToolCall:
    name: str
    arguments: str          # a JSON object, as a string (OpenAI's shape)


@dataclass
class FunctionCall:
    name: str | None = None
    arguments: str | None = None


DeltaFunctionCall = FunctionCall        # vLLM's name for a streamed piece of one


@dataclass
class ToolCall:
    """A complete call (vLLM's ``ToolCall``)."""
    function: FunctionCall
    id: str | None = None
    type: str = "function"


@dataclass
class DeltaToolCall:
    """A streamed piece of call ``index`` (vLLM's ``DeltaToolCall``)."""
    index: int
    function: FunctionCall | None = None
    id: str | None = None
    type: str | None = None


@dataclass
class DeltaMessage:
    content: str | None = None
    tool_calls: list[DeltaToolCall] = field(default_factory=list)


@dataclass
class ExtractedToolCallInformation:
    tools_called: bool
    tool_calls: list[ToolCall]
    content: str | None = None


class ToolParser:
    """Base class. Built-in parsers implement ``split``; a vLLM-style plugin implements
    ``extract_tool_calls`` (and optionally ``extract_tool_calls_streaming``) instead.

    ``tools`` is the request's tool list (OpenAI's shape), for parsers that convert
    arguments by the declared parameter types."""

    name = ""

    def __init__(self, tokenizer: Any = None) -> None:
        self.model_tokenizer = tokenizer
        self.tools: list[dict[str, Any]] | None = None
        self._stream_previous = ""                  # vLLM-style streaming adapter state
        self._stream_content = ""
        self._stream_calls: list[list[str]] = []    # [name, arguments] per call index

    def split(self, text: str, final: bool) -> tuple[str, list[ParsedToolCall]]:
        if type(self).extract_tool_calls is ToolParser.extract_tool_calls:
            raise NotImplementedError(f"{type(self).__name__} implements neither split nor "
                                      "extract_tool_calls")
        if final:
            info = self.extract_tool_calls(text, None)
            if not info.tools_called:
                return text, []
            return info.content or "", [ParsedToolCall(c.function.name or "",
                                                       c.function.arguments or "{}")
                                        for c in info.tool_calls]
        if type(self).extract_tool_calls_streaming is ToolParser.extract_tool_calls_streaming:
            return "", []                   # no streaming method: everything at the end
        return self._split_by_deltas(text)

    def _split_by_deltas(self, text: str) -> tuple[str, list[ParsedToolCall]]:
        """Accumulate a vLLM-style parser's streamed deltas into (content, calls) so far."""
        delta_text = text[len(self._stream_previous):]
        if delta_text:
            delta = self.extract_tool_calls_streaming(self._stream_previous, text, delta_text,
                                                      [], [], [], None)
            self._stream_previous = text
            if delta is not None:
                self._stream_content += _field(delta, "content") or ""
                for call in _field(delta, "tool_calls") or ():
                    index = _field(call, "index")
                    while len(self._stream_calls) <= index:
                        self._stream_calls.append(["", ""])
                    function = _field(call, "function")
                    if function is not None:
                        self._stream_calls[index][0] += _field(function, "name") or ""
                        self._stream_calls[index][1] += _field(function, "arguments") or ""
        return self._stream_content, [ParsedToolCall(name, arguments)
                                      for name, arguments in self._stream_calls if name]

    # -- vLLM's interface, derived from split() for built-in parsers ---------------------------
    def extract_tool_calls(self, model_output: str, request: Any) -> ExtractedToolCallInformation:
        content, calls = self.split(model_output, final=True)
        return ExtractedToolCallInformation(
            bool(calls), [ToolCall(FunctionCall(c.name, c.arguments)) for c in calls],
            content or None)

    def extract_tool_calls_streaming(self, previous_text: str, current_text: str,
                                     delta_text: str, previous_token_ids: Any,
                                     current_token_ids: Any, delta_token_ids: Any,
                                     request: Any) -> DeltaMessage | None:
        raise NotImplementedError


def _field(obj: Any, name: str) -> Any:
    """An attribute of a vLLM delta object, or a key of the same thing as a dict."""
    return obj.get(name) if isinstance(obj, dict) else getattr(obj, name, None)


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
