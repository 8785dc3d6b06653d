"""Tool-call parsers for tool_choice "auto" (``--enable-auto-tool-choice
--tool-call-parser NAME``): one module per model family's format, registered here.
``--tool-parser-plugin PATH`` imports a user's file, whose parser classes register
themselves with ``@ToolParserManager.register_module("name")`` (vLLM's decorator)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

from jaxserve.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    ExtractedToolCallInformation,
    FunctionCall,
    ParsedToolCall,
    ToolCall,
    ToolParser,
)
from jaxserve.entrypoints.openai.tool_parsers.hermes import HermesToolParser
from jaxserve.entrypoints.openai.tool_parsers.llama3_json import Llama3JsonToolParser
from jaxserve.entrypoints.openai.tool_parsers.mistral import MistralToolParser
from jaxserve.entrypoints.openai.tool_parsers.pythonic import PythonicToolParser
from jaxserve.entrypoints.openai.tool_parsers.qwen3_coder import Qwen3CoderToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    parser.name: parser for parser in (HermesToolParser, Llama3JsonToolParser,
                                       MistralToolParser, PythonicToolParser,
                                       Qwen3CoderToolParser)}


class ToolParserManager:
    """vLLM's registry shape: ``@ToolParserManager.register_module("name")`` on a class."""

    tool_parsers = TOOL_PARSERS

    @classmethod
    def register_module(cls, name: str | list[str] | None = None, force: bool = True,
                        module: type | None = None) -> Any:
        def register(parser: type) -> type:
            if not (isinstance(parser, type) and issubclass(parser, ToolParser)):
                raise TypeError(f"a tool parser must subclass jaxserve's ToolParser "
                                f"(jaxserve.entrypoints.openai.tool_parsers.ToolParser), "
                                f"got {parser!r}")
            names = [name] if isinstance(name, str) else (name or [parser.__name__])
            for one in names:
                if one in TOOL_PARSERS and not force:
                    raise KeyError(f"tool parser {one!r} is already registered")
                TOOL_PARSERS[one] = parser
            return parser
        return register(module) if module is not None else register

    @classmethod
    def get_tool_parser(cls, name: str) -> type[ToolParser]:
        if name not in TOOL_PARSERS:
            raise KeyError(f"tool parser {name!r} is not registered")
        return TOOL_PARSERS[name]


def import_tool_parser_plugin(path: str) -> None:
    """Run a plugin file (it registers its parsers); a clear error if it cannot be."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise ValueError(f"--tool-parser-plugin {path!r} is not a file")
    module_name = f"jaxserve_tool_parser_plugin_{file.stem}"
    spec = importlib.util.spec_from_file_location(module_name, file)
    if spec is None or spec.loader is None:
        raise ValueError(f"--tool-parser-plugin {path!r} is not a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[module_name]
        raise ValueError(f"--tool-parser-plugin {path!r} failed to import: {exc!r}") from exc


def get_tool_parser(name: str, tokenizer: Any = None,
                    tools: list[dict[str, Any]] | None = None) -> ToolParser:
    if name not in TOOL_PARSERS:
        raise ValueError(f"unknown tool call parser {name!r}; choose one of "
                         f"{', '.join(sorted(TOOL_PARSERS))}")
    parser = TOOL_PARSERS[name](tokenizer)
    parser.tools = tools
    return parser


__all__ = ["TOOL_PARSERS", "DeltaFunctionCall", "DeltaMessage", "DeltaToolCall",
           "ExtractedToolCallInformation", "FunctionCall", "ParsedToolCall", "ToolCall",
           "ToolParser", "ToolParserManager", "get_tool_parser", "import_tool_parser_plugin"]
