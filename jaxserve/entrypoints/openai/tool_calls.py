"""Tool calling for /v1/chat/completions: what a request's tools and tool_choice mean, and
how a choice's text becomes ``tool_calls``.

    tool_choice "none"       the tools are not used (nor shown to the template)
    tool_choice "required"   ENFORCED: the output is constrained to a JSON array of
                             {"name", "parameters"} objects, one per call (one at most
                             when parallel_tool_calls is false), so any model complies
    {"type": "function", "function": {"name": N}}
                             ENFORCED: the output is constrained to N's parameters schema
    tool_choice "auto"       the model decides; a --tool-call-parser reads the calls out
                             of its text (needs --enable-auto-tool-choice, else a 400)

The legacy ``functions`` / ``function_call`` fields map onto tools / tool_choice.
`ToolCallStream` turns one choice's growing text into content and tool-call deltas; the
full response uses the same code on the final text, so streamed deltas reassemble to it.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from jaxserve.config import ServerConfig
from jaxserve.entrypoints.openai.errors import APIError
from jaxserve.entrypoints.openai.protocol import ChatCompletionRequest
from jaxserve.entrypoints.openai.tool_parsers import (
    ParsedToolCall,
    ToolParser,
    get_tool_parser,
)
from jaxserve.structured_outputs_params import StructuredOutputsParams

_AUTO_NEEDS_FLAGS = ('"auto" tool choice requires --enable-auto-tool-choice and '
                     '--tool-call-parser to be set')


@dataclass
class ToolPlan:
    """How one chat request uses tools."""
    mode: str = "none"                         # none | auto | required | named
    tools: list[dict[str, Any]] = field(default_factory=list)   # for the chat template
    function_name: str | None = None           # named mode
    constraint: StructuredOutputsParams | None = None   # required / named: the schema
    parser_name: str | None = None             # auto mode
    parallel: bool = True
    template_ignores_tools: bool = False       # set when the prompt is rendered
    legacy: bool = False                       # functions/function_call: answer in kind

    @property
    def uses_tools(self) -> bool:
        return self.mode != "none"

    def parser(self) -> ToolParser:
        """A fresh parser of this plan's output (one per choice)."""
        if self.mode == "named":
            return _NamedCallParser(self.function_name or "")
        if self.mode == "required":
            return _RequiredCallsParser()
        return get_tool_parser(self.parser_name or "", tools=self.tools)


def plan_tools(request: ChatCompletionRequest, server: ServerConfig) -> ToolPlan:
    """Resolve tools / tool_choice (or functions / function_call); APIError (400) if bad."""
    tools, choice = request.tools, request.tool_choice
    if request.functions is not None or request.function_call is not None:
        if tools is not None or choice is not None:
            raise APIError("use either tools/tool_choice or the legacy functions/"
                           "function_call, not both", param="functions")
        tools = [{"type": "function", "function": f.model_dump(exclude_none=True)}
                 for f in request.functions or ()]
        choice = request.function_call
        if isinstance(choice, dict):
            choice = {"type": "function", "function": choice}
        if choice is None:
            choice = "auto"
        plan = _plan(tools, choice, False, server)
        plan.legacy = True            # one call, as message.function_call
        return plan
    tools = [t.model_dump(exclude_none=True) for t in tools] if tools is not None else None
    return _plan(tools, choice, request.parallel_tool_calls is not False, server)


def _plan(tools: list[dict[str, Any]] | None, choice: Any, parallel: bool,
          server: ServerConfig) -> ToolPlan:
    if not tools:
        if choice not in (None, "none"):
            raise APIError("When using `tool_choice`, `tools` must be set.", param="tool_choice")
        return ToolPlan()
    if choice is None:
        choice = "auto"
    names = [t["function"]["name"] for t in tools]
    if choice == "none":
        return ToolPlan()
    if choice == "auto":
        if not (server.enable_auto_tool_choice and server.tool_call_parser):
            raise APIError(_AUTO_NEEDS_FLAGS, param="tool_choice")
        return ToolPlan("auto", tools, parser_name=server.tool_call_parser, parallel=parallel)
    if choice == "required":
        schema = _calls_schema(tools, parallel)
        return ToolPlan("required", tools, constraint=StructuredOutputsParams(json=schema),
                        parallel=parallel)
    if isinstance(choice, dict) and choice.get("type", "function") == "function" \
            and isinstance(choice.get("function"), dict) and "name" in choice["function"]:
        name = choice["function"]["name"]
        if name not in names:
            raise APIError(f"Tool '{name}' has not been passed in `tools` (known: "
                           f"{', '.join(names)}).", param="tool_choice")
        parameters = tools[names.index(name)]["function"].get("parameters") or {
            "type": "object", "properties": {}}
        return ToolPlan("named", tools, function_name=name,
                        constraint=StructuredOutputsParams(json=parameters), parallel=parallel)
    raise APIError(f"tool_choice must be 'none', 'auto', 'required' or "
                   f'{{"type": "function", "function": {{"name": ...}}}}, got {choice!r}',
                   param="tool_choice")


def _calls_schema(tools: list[dict[str, Any]], parallel: bool) -> dict[str, Any]:
    """JSON schema of "a list of calls to these tools" (vLLM's for tool_choice=required).
    ``$defs`` of the tools' parameter schemas move to the top, where ``$ref`` finds them."""
    defs: dict[str, Any] = {}
    variants = []
    for tool in tools:
        function = tool["function"]
        parameters = dict(function.get("parameters") or {"type": "object", "properties": {}})
        for name, definition in parameters.pop("$defs", {}).items():
            if name in defs and defs[name] != definition:
                raise APIError(f"tools define $defs {name!r} differently; rename one",
                               param="tools")
            defs[name] = definition
        variants.append({"properties": {"name": {"type": "string",
                                                 "enum": [function["name"]]},
                                        "parameters": parameters},
                         "required": ["name", "parameters"]})
    schema: dict[str, Any] = {"type": "array", "minItems": 1,
                              "items": {"type": "object", "anyOf": variants}}
    if not parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


class _NamedCallParser(ToolParser):
    """The whole output is the arguments of one call to a known function."""

    def __init__(self, name: str) -> None:
        self.function_name = name

    def split(self, text: str, final: bool) -> tuple[str, list[ParsedToolCall]]:
        return "", [ParsedToolCall(self.function_name, text)]


class _RequiredCallsParser(ToolParser):
    """A JSON array of {"name", "parameters"} (the constraint writes the keys in that
    order): a call appears once its name is complete, and its arguments are the raw text of
    its "parameters" value as far as it is written, so they stream as generated and a call
    cut off by max_tokens is still a (partial) call, never content."""

    def split(self, text: str, final: bool) -> tuple[str, list[ParsedToolCall]]:
        decoder, calls = json.JSONDecoder(), []
        pos = len(text) - len(text.lstrip())
        if not text.startswith("[", pos):
            return (text if final else ""), []
        pos += 1
        while True:
            while pos < len(text) and text[pos] in " \t\r\n,":
                pos += 1
            if pos >= len(text) or text[pos] == "]":
                return "", calls
            try:
                obj, end = decoder.raw_decode(text, pos)
            except json.JSONDecodeError:
                partial = _partial_call(text, pos)
                if partial is not None:
                    calls.append(partial)
                return "", calls
            call = _partial_call(text, pos)
            if call is None:            # keys in another order: the object, re-serialised
                call = ParsedToolCall(obj["name"], json.dumps(obj["parameters"],
                                                              ensure_ascii=False))
            calls.append(call)
            pos = end


_CALL_HEAD = re.compile(r'\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"parameters"\s*:\s*')


def _partial_call(text: str, pos: int) -> ParsedToolCall | None:
    """The call starting at ``pos`` as far as it is written: None until its name is."""
    head = _CALL_HEAD.match(text, pos)
    if head is None:
        return None
    start = head.end()
    try:
        _, end = json.JSONDecoder().raw_decode(text, start)
    except json.JSONDecodeError:
        end = len(text)
    return ParsedToolCall(json.loads(head.group(1)), text[start:end])


def new_tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


class ToolCallStream:
    """One choice: its text so far → content and tool-call deltas in OpenAI's chunk shape."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.parser = plan.parser()
        self.sent_content = 0
        self.ids: list[str] = []                    # one per call sent so far
        self.sent_arguments: list[int] = []

    def split(self, text: str, final: bool) -> tuple[str, list[ParsedToolCall]]:
        content, calls = self.parser.split(text, final)
        if not self.plan.parallel:
            calls = calls[:1]
        return content, calls

    def deltas(self, text: str, final: bool) -> tuple[str, list[dict[str, Any]]]:
        """(new content, new tool-call deltas) since the last call."""
        content, calls = self.split(text, final)
        new_content = content[self.sent_content:]
        self.sent_content = len(content)
        out = []
        for index, call in enumerate(calls):
            if index == len(self.ids):              # first time: id, type and name
                self.ids.append(new_tool_call_id())
                self.sent_arguments.append(len(call.arguments))
                out.append({"index": index, "id": self.ids[index], "type": "function",
                            "function": {"name": call.name, "arguments": call.arguments}})
            elif len(call.arguments) > self.sent_arguments[index]:
                fragment = call.arguments[self.sent_arguments[index]:]
                self.sent_arguments[index] = len(call.arguments)
                out.append({"index": index, "function": {"arguments": fragment}})
        return new_content, out


def tool_calls_message(calls: list[ParsedToolCall]) -> list[dict[str, Any]]:
    return [{"id": new_tool_call_id(), "type": "function",
             "function": {"name": call.name, "arguments": call.arguments}} for call in calls]
