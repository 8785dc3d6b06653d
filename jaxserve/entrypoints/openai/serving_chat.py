"""POST /v1/chat/completions: messages → chat template → one engine request with n choices.

Streaming: a first chunk per choice carrying `role`, then content deltas
(the engine's RequestOutputKind.DELTA outputs), then a chunk per choice with
`finish_reason` and an empty delta, then (if asked) a usage chunk, then
`data: [DONE]`. With tools (tool_calls.py), tool-call deltas come between: a call's
first delta carries its index, id, type and name, later ones argument fragments; the
finish_reason is then "tool_calls".
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from jaxserve.config import ServerConfig
from jaxserve.engine.async_engine import AsyncLLMEngine
from jaxserve.entrypoints.openai.errors import APIError, reraise_disconnect
from jaxserve.entrypoints.openai.logprobs_format import chat_logprobs, prompt_logprobs_json
from jaxserve.entrypoints.openai.protocol import ChatCompletionRequest, chat_response, usage_dict
from jaxserve.entrypoints.openai.request_streams import (
    collect_finals,
    new_request_id,
    until_disconnect,
)
from jaxserve.entrypoints.openai.serving_engine import INLINE_TEXT_CHARS, OpenAIServing
from jaxserve.entrypoints.openai.sse import SSE_DONE, sse, sse_error
from jaxserve.entrypoints.openai.structured_request import structured_outputs_of
from jaxserve.entrypoints.openai.tool_calls import (
    ToolCallStream,
    ToolPlan,
    plan_tools,
    tool_calls_message,
)
from jaxserve.entrypoints.openai.tool_parsers import TOOL_PARSERS, get_tool_parser
from jaxserve.loader.tokenizer import apply_chat_template, read_chat_template
from jaxserve.outputs import RequestOutput

INLINE_MESSAGES = 256       # longer conversations are rendered off the event loop


class OpenAIServingChat(OpenAIServing):

    def __init__(self, engine: AsyncLLMEngine, served_model_names: list[str],
                 server_config: ServerConfig | None = None) -> None:
        super().__init__(engine, served_model_names)
        if self.chat_template is not None:
            self.chat_template = read_chat_template(self.chat_template)
        self.server_config = server_config or ServerConfig()
        if self.server_config.enable_auto_tool_choice and not self.server_config.tool_call_parser:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (one of "
                             f"{', '.join(sorted(TOOL_PARSERS))})")
        if self.server_config.tool_call_parser is not None:
            get_tool_parser(self.server_config.tool_call_parser)     # unknown name: fail now

    async def render(self, request: Any, messages: list[dict[str, Any]],
                     add_generation_prompt: bool,
                     tools: list[dict[str, Any]] | None = None) -> list[int]:
        """Prompt token ids of a conversation; template problems are the client's 400."""
        kwargs = dict(request.chat_template_kwargs or {})
        if tools:
            kwargs["tools"] = tools
        if getattr(request, "continue_final_message", False):
            kwargs["continue_final_message"] = True
        request_template = getattr(request, "chat_template", None)
        if request_template is not None and not self.server_config.trust_request_chat_template:
            raise APIError("a chat_template in the request is not allowed: this server does "
                           "not run templates from requests (start it with "
                           "--trust-request-chat-template to allow them)",
                           param="chat_template")
        template = request_template or self.chat_template

        def run() -> list[int]:
            return apply_chat_template(self.tokenizer, messages, chat_template=template,
                                       add_generation_prompt=add_generation_prompt, **kwargs)
        # A request's own template may loop for as long as it likes: never on the event loop.
        inline = request_template is None and len(messages) <= INLINE_MESSAGES and sum(
            len(str(m.get("content") or "")) for m in messages) <= INLINE_TEXT_CHARS
        try:
            return run() if inline else await asyncio.to_thread(run)
        except APIError:
            raise
        except Exception as exc:  # noqa: BLE001 - Jinja and template errors vary
            raise APIError(f"could not apply the chat template: {exc}", param="messages") \
                from None

    async def create_chat_completion(self, request: ChatCompletionRequest,
                                     raw_request: Request) -> Response:
        model = self.model_name(request.model)
        plan = plan_tools(request, self.server_config)
        constraint = structured_outputs_of(request)
        if plan.constraint is not None:
            if constraint is not None:
                raise APIError("tool_choice 'required' or a named function already constrains "
                               "the output; it cannot be combined with response_format or "
                               "structured outputs", param="tool_choice")
            constraint = plan.constraint
        constraint = await self.parse_constraint(constraint)
        messages = (request.messages_as_dicts() if len(request.messages) <= INLINE_MESSAGES
                    else await asyncio.to_thread(request.messages_as_dicts))
        prompt_ids = await self.render(request, messages,
                                       request.add_generation_prompt,
                                       plan.tools if plan.uses_tools else None)
        if not prompt_ids:
            raise APIError("the rendered chat prompt is empty", param="messages")
        requested = request.max_completion_tokens
        if requested is None:
            requested = request.max_tokens
        max_tokens = self.resolve_max_tokens(len(prompt_ids), requested)
        num_top = request.top_logprobs or 0
        params = self.sampling_params(request, max_tokens, num_top if request.logprobs else None,
                                      request.prompt_logprobs, constraint, request.stream)

        request_id, engine_id = new_request_id("chatcmpl", raw_request)
        created = int(time.time())
        [stream] = await self.start_requests(engine_id, [prompt_ids], [params],
                                             self.lora_for(model))
        if request.stream:
            return StreamingResponse(
                self._stream(request, request_id, model, created, stream, len(prompt_ids),
                             plan), media_type="text/event-stream")
        [final] = await until_disconnect(raw_request, collect_finals([stream]))
        return JSONResponse(self._full_response(request, request_id, model, created, final,
                                                plan))

    def _full_response(self, request: ChatCompletionRequest, request_id: str, model: str,
                       created: int, final: RequestOutput, plan: ToolPlan) -> dict[str, Any]:
        choices = []
        for c in sorted(final.outputs, key=lambda c: c.index):
            if c.finish_reason == "abort":
                raise APIError("the request was aborted (the server is shutting down)", 503,
                               "service_unavailable")
            logprobs = None
            if request.logprobs:
                logprobs = {"content": chat_logprobs(c.token_ids, c.logprobs or [],
                                                     request.top_logprobs or 0, self.tokenizer)}
            message: dict[str, Any] = {"role": "assistant", "content": c.text}
            finish_reason = c.finish_reason
            if plan.uses_tools:
                content, calls = ToolCallStream(plan).split(c.text, final=True)
                message["content"] = content or None if calls else content
                if calls:
                    message["tool_calls"] = tool_calls_message(calls)
                    if finish_reason == "stop":
                        finish_reason = "tool_calls"
            choices.append({"index": c.index, "message": message, "logprobs": logprobs,
                            "finish_reason": finish_reason, "stop_reason": c.stop_reason})
        usage = usage_dict(len(final.prompt_token_ids),
                           sum(len(c.token_ids) for c in final.outputs), final.num_cached_tokens)
        body = chat_response(request_id, model, choices, usage, created)
        body["prompt_logprobs"] = prompt_logprobs_json(final.prompt_logprobs)   # vLLM's field
        return body

    async def _stream(self, request: ChatCompletionRequest, request_id: str, model: str,
                      created: int, stream: AsyncIterator[RequestOutput],
                      num_prompt_tokens: int, plan: ToolPlan) -> AsyncIterator[str]:
        """SSE chunks of the choices' deltas (each RequestOutput carries only what is new)."""
        choices = [_ChatChoiceStream(self, request, j, plan) for j in range(request.n)]
        num_cached = 0

        def chunk(choice_dicts: list[dict], usage: dict | None = None) -> str:
            if usage is None and request.continuous_usage_in_stream:
                usage = usage_dict(num_prompt_tokens, sum(c.num_tokens for c in choices),
                                   num_cached)
            return sse(chat_response(request_id, model, choice_dicts, usage, created,
                                     chunk=True))
        try:
            for j in range(request.n):
                yield chunk([{"index": j, "delta": {"role": "assistant", "content": ""},
                              "logprobs": None, "finish_reason": None}])
            async for out in stream:
                num_cached = out.num_cached_tokens
                for c in out.outputs:
                    for body in choices[c.index].chunks(c):
                        yield chunk([body])
            if request.include_usage_in_stream:
                usage = usage_dict(num_prompt_tokens, sum(c.num_tokens for c in choices),
                                   num_cached)
                yield chunk([], usage)
        except BaseException as exc:
            if reraise_disconnect(exc):
                raise
            yield sse_error(exc)
        yield SSE_DONE


class _ChatChoiceStream:
    """One streamed choice: tokens whose logprobs are not sent yet and, with tools, the
    text so far (tool-call parsing reads the whole text)."""

    def __init__(self, serving: OpenAIServing, request: ChatCompletionRequest, index: int,
                 plan: ToolPlan) -> None:
        self.tokenizer = serving.tokenizer
        self.request = request
        self.index = index
        self.tools = ToolCallStream(plan) if plan.uses_tools else None
        self.text_pieces: list[str] = []
        self.finished = False
        self.num_tokens = 0
        self.pending_ids: list[int] = []
        self.pending_logprobs: list = []

    def chunks(self, c: Any) -> list[dict[str, Any]]:
        """The chunk bodies of one delta of this choice."""
        if self.finished:
            return []
        self.num_tokens += len(c.token_ids)
        if self.request.logprobs:
            self.pending_ids += c.token_ids
            self.pending_logprobs += c.logprobs or []
        finish_reason = c.finish_reason
        if self.tools is None:
            text, calls = c.text, []
        else:
            self.text_pieces.append(c.text)
            text, calls = self.tools.deltas("".join(self.text_pieces),
                                            final=finish_reason is not None)
            if self.tools.ids and finish_reason == "stop":
                finish_reason = "tool_calls"
        bodies = []
        if text:
            bodies.append({"index": self.index, "delta": {"content": text},
                           "logprobs": self._take_logprobs(), "finish_reason": None})
        if calls:
            bodies.append({"index": self.index, "delta": {"tool_calls": calls},
                           "logprobs": self._take_logprobs(), "finish_reason": None})
        if finish_reason is not None:
            self.finished = True
            bodies.append({"index": self.index, "delta": {},
                           "logprobs": self._take_logprobs(), "finish_reason": finish_reason,
                           "stop_reason": c.stop_reason})
        return bodies

    def _take_logprobs(self) -> dict | None:
        if not self.pending_ids:
            return None
        content = chat_logprobs(self.pending_ids, self.pending_logprobs,
                                self.request.top_logprobs or 0, self.tokenizer)
        self.pending_ids, self.pending_logprobs = [], []
        return {"content": content}
