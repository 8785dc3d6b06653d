"""POST /v1/responses: the request model, and how its input items become chat messages.

The Responses API is served on the chat path: ``instructions`` + ``input`` (text, or
message / function_call / function_call_output / reasoning items) become chat messages,
``tools`` chat tools, ``text.format`` a response_format. Recognised fields jaxserve does
not implement are a 400 naming them; items and content parts of other types too.
"""

from __future__ import annotations

import json
from typing import Any, ClassVar

from pydantic import Field, model_validator

from jaxserve.entrypoints.openai.protocol import OpenAIBaseModel

_NOT_IMPLEMENTED = {
    "background": "background responses are not supported",
    "conversation": "conversations are not supported; use previous_response_id",
    "prompt": "stored prompt templates are not supported",
    "max_tool_calls": "max_tool_calls is not implemented",
    "top_logprobs": "logprobs on /v1/responses are not implemented (use chat completions)",
    "stream_options": "stream_options on /v1/responses are not implemented",
    "context_management": "context management is not supported",
    "prompt_cache_retention": "prompt_cache_retention is not supported",
}
# Fields accepted and echoed, with no effect on generation (they never change the output).
_ECHOED = ("metadata", "user", "safety_identifier", "prompt_cache_key", "service_tier")


class ResponsesRequest(OpenAIBaseModel):
    not_implemented: ClassVar[dict[str, str]] = _NOT_IMPLEMENTED

    model: str | None = None
    input: str | list[dict[str, Any]] = Field(default_factory=list)
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = True
    temperature: float | None = None
    top_p: float | None = None
    max_output_tokens: int | None = None
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    previous_response_id: str | None = None
    store: bool | None = True
    stream: bool = False
    include: list[str] | None = None
    truncation: str | None = None
    metadata: dict[str, Any] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    service_tier: str | None = None
    # vLLM's extras on /v1/responses
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    logit_bias: dict[str, float] | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _check(self) -> ResponsesRequest:
        if self.truncation not in (None, "disabled"):
            raise ValueError(f"truncation {self.truncation!r} is not supported (only "
                             "'disabled': a too-long input is a 400)")
        if self.include:
            raise ValueError(f"include {self.include} is not supported")
        if self.reasoning:
            set_fields = {k: v for k, v in self.reasoning.items() if v is not None}
            if set_fields:
                raise ValueError(f"reasoning {set_fields} is not supported: the model's "
                                 "reasoning is returned as reasoning items when the server "
                                 "runs with --reasoning-parser, but effort/summary cannot be "
                                 "set per request")
        for tool in self.tools or ():
            if tool.get("type") != "function":
                raise ValueError(f"tools of type {tool.get('type')!r} are not supported (only "
                                 "'function')")
        return self


class InputError(ValueError):
    """A bad input item; ``param`` says where."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def input_messages(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Chat messages for a Responses ``input``. Consecutive function_call items join one
    assistant message's tool_calls; a reasoning item goes with the assistant turn after it."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict[str, Any]] = []
    pending_reasoning: str | None = None
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        param = f"input[{i}]"
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise InputError(f"input message role must be user, system, developer or "
                                 f"assistant, got {role!r}", param)
            message = {"role": role, "content": _text(item.get("content"), param)}
            if role == "assistant" and pending_reasoning is not None:
                message["reasoning_content"], pending_reasoning = pending_reasoning, None
            messages.append(message)
        elif kind == "function_call":
            call = {"id": item.get("call_id") or item.get("id"), "type": "function",
                    "function": {"name": item.get("name"),
                                 "arguments": _arguments(item.get("arguments"))}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and \
                    (last.get("tool_calls") or not last.get("content")):
                last.setdefault("tool_calls", []).append(call)
            else:
                message = {"role": "assistant", "content": None, "tool_calls": [call]}
                if pending_reasoning is not None:
                    message["reasoning_content"], pending_reasoning = pending_reasoning, None
                messages.append(message)
        elif kind == "function_call_output":
            output = item.get("output")
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"),
                             "content": output if isinstance(output, str)
                             else _text(output, param)})
        elif kind == "reasoning":
            pending_reasoning = "".join(part.get("text", "") for part in
                                        item.get("content") or ())
        else:
            raise InputError(f"input items of type {kind!r} are not supported (message, "
                             "function_call, function_call_output and reasoning are)", param)
    return messages


def _text(content: Any, param: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for part in content:
        kind = part.get("type")
        if kind not in ("input_text", "output_text", "text"):
            raise InputError(f"content parts of type {kind!r} are not supported: this server "
                             "serves text-only models", param)
        texts.append(part.get("text", ""))
    return "".join(texts)


def _arguments(arguments: Any) -> Any:
    """Templates index into the arguments: a dict where the string parses."""
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except json.JSONDecodeError:
            return arguments
    return arguments


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    return [{"type": "function", "function": {
        k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool}}
        for tool in tools]


def chat_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if isinstance(choice, dict) and choice.get("type") == "function" and "name" in choice:
        return {"type": "function", "function": {"name": choice["name"]}}
    if isinstance(choice, dict):
        raise InputError(f"tool_choice {choice!r} is not supported (only 'none', 'auto', "
                         "'required' or a function)", "tool_choice")
    return choice


def chat_response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """A Responses ``text.format`` as chat's ``response_format``."""
    fmt = (text or {}).get("format")
    if fmt is None or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_schema":
        return {"type": "json_schema", "json_schema": {
            "name": fmt.get("name", "response"), "schema": fmt.get("schema"),
            "strict": fmt.get("strict")}}
    if fmt.get("type") == "json_object":
        return {"type": "json_object"}
    raise InputError(f"text.format type {fmt.get('type')!r} is not supported", "text.format")
