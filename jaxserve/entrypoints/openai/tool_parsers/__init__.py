"""Tool-call parsers for tool_choice "auto" (``--enable-auto-tool-choice
--tool-call-parser NAME``): one module per model family's format, registered here."""

from __future__ import annotations

from jaxserve.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    ParsedToolCall,
    ToolParser,
)
from jaxserve.entrypoints.openai.tool_parsers.hermes import HermesToolParser
from jaxserve.entrypoints.openai.tool_parsers.llama3_json import Llama3JsonToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    parser.name: parser for parser in (HermesToolParser, Llama3JsonToolParser)}


def get_tool_parser(name: str) -> ToolParser:
    if name not in TOOL_PARSERS:
        raise ValueError(f"unknown tool call parser {name!r}; choose one of "
                         f"{', '.join(sorted(TOOL_PARSERS))}")
    return TOOL_PARSERS[name]()


__all__ = ["TOOL_PARSERS", "ParsedToolCall", "ToolParser", "get_tool_parser"]
