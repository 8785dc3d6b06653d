"""POST /v1/chat/completions: messages → chat template → one engine request with n choices.

Streaming: a first chunk per choice carrying `role`, then content deltas
(computed from the engine's cumulative outputs), then a chunk per choice with
`finish_reason` and an empty delta, then (if asked) a usage chunk, then
`data: [DONE]`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from jaxserve.engine.async_engine import AsyncLLMEngine
from jaxserve.entrypoints.openai.protocol import ChatCompletionRequest, chat_response, usage_dict
from jaxserve.entrypoints.openai.serving_engine import (
    SSE_DONE,
    APIError,
    OpenAIServing,
    chat_logprobs,
    collect_finals,
    new_request_id,
    prompt_logprobs_json,
    reraise_disconnect,
    sse,
    sse_error,
    until_disconnect,
)
from jaxserve.outputs import RequestOutput
from jaxserve.tokenizer import apply_chat_template, read_chat_template


class OpenAIServingChat(OpenAIServing):

    def __init__(self, engine: AsyncLLMEngine, served_model_names: list[str]) -> None:
        super().__init__(engine, served_model_names)
        if self.chat_template is not None:
            self.chat_template = read_chat_template(self.chat_template)

    async def render(self, request: Any, messages: list[dict[str, Any]],
                     add_generation_prompt: bool) -> list[int]:
        """Prompt token ids of a conversation; template problems are the client's 400."""
        kwargs = dict(request.chat_template_kwargs or {})
        if getattr(request, "continue_final_message", False):
            kwargs["continue_final_message"] = True
        template = getattr(request, "chat_template", None) or self.chat_template

        def run() -> list[int]:
            return apply_chat_template(self.tokenizer, messages, chat_template=template,
                                       add_generation_prompt=add_generation_prompt, **kwargs)
        try:
            if sum(len(str(m.get("content") or "")) for m in messages) > 8192:
                return await asyncio.get_running_loop().run_in_executor(None, run)
            return run()
        except APIError:
            raise
        except Exception as exc:  # noqa: BLE001 - Jinja and template errors vary
            raise APIError(f"could not apply the chat template: {exc}", param="messages") \
                from None

    async def create_chat_completion(self, request: ChatCompletionRequest,
                                     raw_request: Request) -> Response:
        model = self.model_name(request.model)
        prompt_ids = await self.render(request, request.messages_as_dicts(),
                                       request.add_generation_prompt)
        if not prompt_ids:
            raise APIError("the rendered chat prompt is empty", param="messages")
        requested = request.max_completion_tokens
        if requested is None:
            requested = request.max_tokens
        max_tokens = self.resolve_max_tokens(len(prompt_ids), requested)
        num_top = request.top_logprobs or 0
        params = self.sampling_params(request, max_tokens, num_top if request.logprobs else None,
                                      request.prompt_logprobs)

        request_id = new_request_id("chatcmpl")
        created = int(time.time())
        [stream] = await self.start_requests(request_id, [prompt_ids], [params])
        if request.stream:
            return StreamingResponse(
                self._stream(request, request_id, model, created, stream, len(prompt_ids)),
                media_type="text/event-stream")
        [final] = await until_disconnect(raw_request, collect_finals([stream]))
        return JSONResponse(self._full_response(request, request_id, model, created, final))

    def _full_response(self, request: ChatCompletionRequest, request_id: str, model: str,
                       created: int, final: RequestOutput) -> dict[str, Any]:
        choices = []
        for c in sorted(final.outputs, key=lambda c: c.index):
            if c.finish_reason == "abort":
                raise APIError("the request was aborted (the server is shutting down)", 503,
                               "service_unavailable")
            logprobs = None
            if request.logprobs:
                logprobs = {"content": chat_logprobs(c, 0, len(c.token_ids),
                                                     request.top_logprobs or 0, self.tokenizer)}
            choices.append({"index": c.index,
                            "message": {"role": "assistant", "content": c.text},
                            "logprobs": logprobs, "finish_reason": c.finish_reason,
                            "stop_reason": c.stop_reason})
        usage = usage_dict(len(final.prompt_token_ids),
                           sum(len(c.token_ids) for c in final.outputs), final.num_cached_tokens)
        body = chat_response(request_id, model, choices, usage, created)
        body["prompt_logprobs"] = prompt_logprobs_json(final.prompt_logprobs)   # vLLM's field
        return body

    async def _stream(self, request: ChatCompletionRequest, request_id: str, model: str,
                      created: int, stream: AsyncIterator[RequestOutput],
                      num_prompt_tokens: int) -> AsyncIterator[str]:
        n = request.n
        sent_chars, sent_tokens = [0] * n, [0] * n
        finished = [False] * n
        num_top = request.top_logprobs or 0
        last: RequestOutput | None = None

        def chunk(choices: list[dict], usage: dict | None = None) -> str:
            if usage is None and request.continuous_usage_in_stream:
                usage = usage_dict(num_prompt_tokens,
                                   sum(len(c.token_ids) for c in last.outputs) if last else 0,
                                   last.num_cached_tokens if last else 0)
            return sse(chat_response(request_id, model, choices, usage, created, chunk=True))

        def logprobs_since(c: Any) -> dict | None:
            if not request.logprobs or sent_tokens[c.index] >= len(c.token_ids):
                return None
            content = chat_logprobs(c, sent_tokens[c.index], len(c.token_ids), num_top,
                                    self.tokenizer)
            sent_tokens[c.index] = len(c.token_ids)
            return {"content": content}
        try:
            for j in range(n):
                yield chunk([{"index": j, "delta": {"role": "assistant", "content": ""},
                              "logprobs": None, "finish_reason": None}])
            async for out in stream:
                last = out
                for c in out.outputs:
                    if finished[c.index]:
                        continue
                    text = c.text[sent_chars[c.index]:]
                    if text:
                        sent_chars[c.index] = len(c.text)
                        yield chunk([{"index": c.index, "delta": {"content": text},
                                      "logprobs": logprobs_since(c), "finish_reason": None}])
                    if c.finish_reason is not None:
                        finished[c.index] = True
                        yield chunk([{"index": c.index, "delta": {},
                                      "logprobs": logprobs_since(c),
                                      "finish_reason": c.finish_reason,
                                      "stop_reason": c.stop_reason}])
            if request.include_usage_in_stream and last is not None:
                usage = usage_dict(num_prompt_tokens, sum(len(c.token_ids) for c in last.outputs),
                                   last.num_cached_tokens)
                yield chunk([], usage)
        except BaseException as exc:
            if reraise_disconnect(exc):
                raise
            yield sse_error(exc)
        yield SSE_DONE


