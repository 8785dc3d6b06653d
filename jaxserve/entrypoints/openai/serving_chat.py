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
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from jaxserve.chat_templates import bundled_names, tool_aware_replacement
from jaxserve.config import ServerConfig
from jaxserve.engine.async_engine import AsyncLLMEngine
from jaxserve.entrypoints.openai.errors import APIError, reraise_disconnect
from jaxserve.entrypoints.openai.logprobs_format import chat_logprobs, prompt_logprobs_json
from jaxserve.entrypoints.openai.protocol import ChatCompletionRequest, chat_response
from jaxserve.entrypoints.openai.serving_engine import (
    INLINE_TEXT_CHARS,
    OpenAIServing,
    collect_finals,
    new_request_id,
    until_disconnect,
)
from jaxserve.entrypoints.openai.sse import SSE_DONE, sse, sse_error
from jaxserve.entrypoints.openai.structured_request import structured_outputs_of
from jaxserve.entrypoints.openai.tool_calls import (
    ToolCallStream,
    ToolPlan,
    plan_tools,
    tool_calls_message,
)
from jaxserve.entrypoints.openai.tool_parsers import (
    TOOL_PARSERS,
    ParsedToolCall,
    get_tool_parser,
    import_tool_parser_plugin,
)
from jaxserve.loader.tokenizer import apply_chat_template, read_chat_template
from jaxserve.outputs import RequestOutput
from jaxserve.reasoning import ReasoningParser, get_reasoning_parser, reasoning_end_token_id
from jaxserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

TOOLS_NOT_RENDERED = ("the chat template does not render the request's tools: the model "
                      "cannot see them.")
_PROMPT_TAIL_TOKENS = 16      # enough of the prompt's end to see a <think> or </think>

INLINE_MESSAGES = 256       # longer conversations are rendered off the event loop


class OpenAIServingChat(OpenAIServing):

    def __init__(self, engine: AsyncLLMEngine, served_model_names: list[str],
                 server_config: ServerConfig | None = None) -> None:
        super().__init__(engine, served_model_names)
        if self.chat_template is not None:
            self.chat_template = read_chat_template(self.chat_template)
        else:
            # A model whose own template drops tools (SmolLM2, the default model) gets
            # jaxserve's tool-aware variant: it renders tool-free chats identically.
            replacement = tool_aware_replacement(getattr(self.tokenizer, "chat_template", None))
            if replacement is not None:
                logger.info("serving the bundled tool-aware variant of the model's chat "
                            "template (it renders tools; chats without tools are unchanged)")
                self.chat_template = replacement
        self._ignores_tools: dict[str | None, bool] = {}
        self.server_config = server_config or ServerConfig()
        if self.server_config.enable_auto_tool_choice and not self.server_config.tool_call_parser:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (one of "
                             f"{', '.join(sorted(TOOL_PARSERS))})")
        self.reasoning_end_id = None
        if self.server_config.reasoning_parser is not None:
            get_reasoning_parser(self.server_config.reasoning_parser)   # unknown: fail now
            self.reasoning_end_id = reasoning_end_token_id(self.server_config.reasoning_parser,
                                                           self.tokenizer)
        if self.server_config.tool_parser_plugin is not None:
            import_tool_parser_plugin(self.server_config.tool_parser_plugin)
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

    async def prepare(self, request: ChatCompletionRequest
                      ) -> tuple[ToolPlan, list[int], SamplingParams, str]:
        """(tool plan, prompt ids, sampling params, prompt tail text) of a chat request;
        shared with /v1/responses so both run the same engine path."""
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
        if plan.uses_tools:
            plan.template_ignores_tools = await self.template_ignores_tools(request)
        prompt_tail = self.tokenizer.decode(prompt_ids[-_PROMPT_TAIL_TOKENS:])
        if constraint is not None and self.reasoning_end_id is not None \
                and self.new_reasoning(prompt_tail).thinking_disabled is False:
            # The grammar starts after the thinking (vLLM's rule).
            constraint = dataclasses.replace(constraint,
                                             reasoning_end_token_id=self.reasoning_end_id)
        requested = request.max_completion_tokens
        if requested is None:
            requested = request.max_tokens
        max_tokens = self.resolve_max_tokens(len(prompt_ids), requested)
        num_top = request.top_logprobs or 0
        params = self.sampling_params(request, max_tokens, num_top if request.logprobs else None,
                                      request.prompt_logprobs, constraint, request.stream)
        return plan, prompt_ids, params, prompt_tail

    async def template_ignores_tools(self, request: Any) -> bool:
        """Whether the request's chat template renders nothing of a tool list (a probe chat
        rendered with and without one tool; the server's template is checked once, with a
        warning the first time it does not). Each such response carries an
        ``x-jaxserve-warning`` header. A request's own template (trusted by then: `render`
        refused it otherwise) is probed off the event loop and not remembered."""
        request_template = getattr(request, "chat_template", None)
        if request_template is not None:
            return await asyncio.to_thread(self._probe_ignores_tools, request_template)
        if self.chat_template not in self._ignores_tools:
            ignores = self._probe_ignores_tools(self.chat_template)
            self._ignores_tools[self.chat_template] = ignores
            if ignores:
                logger.warning(TOOLS_NOT_RENDERED + " Pass a tool-aware --chat-template (a "
                               "file, or a bundled name: %s).", ", ".join(bundled_names()))
        return self._ignores_tools[self.chat_template]

    def _probe_ignores_tools(self, template: str | None) -> bool:
        probe = [{"role": "user", "content": "probe"}]
        tool = {"type": "function", "function": {"name": "probe_tool", "parameters": {
            "type": "object", "properties": {"probe_argument": {"type": "string"}}}}}
        try:
            return (apply_chat_template(self.tokenizer, probe, chat_template=template,
                                        tools=[tool])
                    == apply_chat_template(self.tokenizer, probe, chat_template=template))
        except Exception:  # noqa: BLE001 - a template that fails the probe is not judged
            return False

    def new_reasoning(self, prompt_tail: str) -> ReasoningParser | None:
        """A fresh reasoning parser for one choice (None: --reasoning-parser not set)."""
        name = self.server_config.reasoning_parser
        return None if name is None else get_reasoning_parser(name, prompt_tail)

    async def create_chat_completion(self, request: ChatCompletionRequest,
                                     raw_request: Request) -> Response:
        model = self.model_name(request.model)
        plan, prompt_ids, params, prompt_tail = await self.prepare(request)
        request_id, engine_id = new_request_id("chatcmpl", raw_request)
        created = int(time.time())
        [stream] = await self.start_requests(engine_id, [prompt_ids], [params],
                                             self.lora_for(model))

        def new_output() -> ChoiceOutput:
            return ChoiceOutput(plan, self.new_reasoning(prompt_tail))
        headers = {"x-jaxserve-warning": TOOLS_NOT_RENDERED} \
            if plan.template_ignores_tools else None
        if request.stream:
            return StreamingResponse(
                self._stream(request, request_id, model, created, stream, len(prompt_ids),
                             plan, new_output), media_type="text/event-stream",
                headers=headers)
        [final] = await until_disconnect(raw_request, collect_finals([stream]))
        return JSONResponse(self._full_response(request, request_id, model, created, final,
                                                plan, new_output), headers=headers)

    def _full_response(self, request: ChatCompletionRequest, request_id: str, model: str,
                       created: int, final: RequestOutput, plan: ToolPlan,
                       new_output: Callable[[], ChoiceOutput]) -> dict[str, Any]:
        choices = []
        for c in sorted(final.outputs, key=lambda c: c.index):
            if c.finish_reason == "abort":
                raise APIError("the request was aborted (the server is shutting down)", 503,
                               "service_unavailable")
            logprobs = None
            if request.logprobs:
                logprobs = {"content": chat_logprobs(c.token_ids, c.logprobs or [],
                                                     request.top_logprobs or 0, self.tokenizer,
                                                     self.return_tokens_as_token_ids)}
            reasoning, content, calls = new_output().split(c.text, final=True)
            message: dict[str, Any] = {"role": "assistant",
                                       "content": content or None if calls else content}
            if reasoning is not None:       # vLLM's field, and its older name
                message["reasoning"] = message["reasoning_content"] = reasoning
            finish_reason = c.finish_reason
            if calls and plan.legacy:        # the functions API: one call, its own field
                message["function_call"] = {"name": calls[0].name,
                                            "arguments": calls[0].arguments}
                if finish_reason == "stop":
                    finish_reason = "function_call"
            elif calls:
                message["tool_calls"] = tool_calls_message(calls)
                if finish_reason == "stop":
                    finish_reason = "tool_calls"
            choices.append({"index": c.index, "message": message, "logprobs": logprobs,
                            "finish_reason": finish_reason, "stop_reason": c.stop_reason})
        usage = self.usage(len(final.prompt_token_ids),
                           sum(len(c.token_ids) for c in final.outputs), final.num_cached_tokens)
        body = chat_response(request_id, model, choices, usage, created)
        body["prompt_logprobs"] = prompt_logprobs_json(final.prompt_logprobs)   # vLLM's field
        return body

    async def _stream(self, request: ChatCompletionRequest, request_id: str, model: str,
                      created: int, stream: AsyncIterator[RequestOutput],
                      num_prompt_tokens: int, plan: ToolPlan,
                      new_output: Callable[[], ChoiceOutput]) -> AsyncIterator[str]:
        """SSE chunks of the choices' deltas (each RequestOutput carries only what is new)."""
        choices = [_ChatChoiceStream(self, request, j, plan, new_output())
                   for j in range(request.n)]
        num_cached = 0

        def chunk(choice_dicts: list[dict], usage: dict | None = None) -> str:
            if usage is None and request.continuous_usage_in_stream:
                usage = self.usage(num_prompt_tokens, sum(c.num_tokens for c in choices),
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
                usage = self.usage(num_prompt_tokens, sum(c.num_tokens for c in choices),
                                   num_cached)
                yield chunk([], usage)
        except BaseException as exc:
            if reraise_disconnect(exc):
                raise
            yield sse_error(exc)
        yield SSE_DONE


class _ChatChoiceStream:
    """One streamed choice: tokens whose logprobs are not sent yet and its ChoiceOutput
    (reasoning and tool-call parsing read the whole text so far)."""

    def __init__(self, serving: OpenAIServing, request: ChatCompletionRequest, index: int,
                 plan: ToolPlan, output: ChoiceOutput) -> None:
        self.tokenizer = serving.tokenizer
        self.tokens_as_ids = serving.return_tokens_as_token_ids
        self.request = request
        self.index = index
        self.plan = plan
        self.output = output
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
        reasoning, text, calls = self.output.feed(c.text, final=finish_reason is not None)
        if self.output.called_tools and finish_reason == "stop":
            finish_reason = "function_call" if self.plan.legacy else "tool_calls"
        bodies = []
        if reasoning:       # vLLM's field, and its older name
            bodies.append({"index": self.index, "delta": {
                "reasoning": reasoning, "reasoning_content": reasoning},
                "logprobs": self._take_logprobs(), "finish_reason": None})
        if text:
            bodies.append({"index": self.index, "delta": {"content": text},
                           "logprobs": self._take_logprobs(), "finish_reason": None})
        if calls and self.plan.legacy:      # the functions API: one call, its own field
            bodies.append({"index": self.index, "delta": {
                "function_call": dict(calls[0]["function"])},
                "logprobs": self._take_logprobs(), "finish_reason": None})
        elif calls:
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
                                self.request.top_logprobs or 0, self.tokenizer,
                                self.tokens_as_ids)
        self.pending_ids, self.pending_logprobs = [], []
        return {"content": content}


# -- one choice's text: reasoning, content, tool calls -------------------------------------------
class ChoiceOutput:
    """One choice's growing text → reasoning, content and tool calls, for chat and Responses.

    The reasoning parser (``--reasoning-parser``) runs first; tool-call parsing sees only the
    content after the reasoning (as vLLM). ``split`` reads a final text; ``deltas`` what is
    new since its last call, from the same code, so streamed deltas reassemble to ``split``.
    ``feed`` takes the engine's DELTA outputs (only the new text) and keeps the text so far,
    which the parsers need; plain text (no reasoning parser, no tools) passes straight
    through.
    """

    def __init__(self, plan: ToolPlan | None, reasoning: ReasoningParser | None) -> None:
        self.tools = ToolCallStream(plan) if plan is not None and plan.uses_tools else None
        self.reasoning = reasoning
        self.sent_reasoning = 0
        self.sent_content = 0
        self._pieces: list[str] = []

    def _reasoning_split(self, text: str, final: bool) -> tuple[str | None, str]:
        if self.reasoning is None:
            return None, text
        return self.reasoning.split(text, final)

    def split(self, text: str, final: bool = True
              ) -> tuple[str | None, str, list[ParsedToolCall]]:
        """(reasoning or None, content, tool calls) of a whole text."""
        reasoning, content = self._reasoning_split(text, final)
        if self.tools is None:
            return reasoning, content, []
        content, calls = self.tools.split(content, final)
        return reasoning, content, calls

    def deltas(self, text: str, final: bool) -> tuple[str, str, list[dict[str, Any]]]:
        """(new reasoning, new content, new tool-call deltas in chat's chunk shape)."""
        reasoning, content = self._reasoning_split(text, final)
        reasoning = reasoning or ""
        new_reasoning = reasoning[self.sent_reasoning:]
        self.sent_reasoning = len(reasoning)
        if self.tools is None:
            new_content, calls = content[self.sent_content:], []
            self.sent_content = len(content)
        else:
            new_content, calls = self.tools.deltas(content, final)
        return new_reasoning, new_content, calls

    def feed(self, new_text: str, final: bool) -> tuple[str, str, list[dict[str, Any]]]:
        """``deltas`` of the text so far plus ``new_text`` (one DELTA output's text)."""
        self._pieces.append(new_text)
        if self.tools is None and self.reasoning is None:
            self.sent_content += len(new_text)
            return "", new_text, []
        return self.deltas(self.text, final)

    @property
    def text(self) -> str:
        """All the text fed so far."""
        if len(self._pieces) > 1:
            self._pieces = ["".join(self._pieces)]
        return self._pieces[0] if self._pieces else ""

    @property
    def called_tools(self) -> bool:
        return self.tools is not None and bool(self.tools.ids)
