"""POST /v1/responses (and GET /v1/responses/{id}): OpenAI's Responses API on the chat path.

A request becomes a ChatCompletionRequest (responses_protocol.py), prepared by the chat
server (template, tools, structured outputs, reasoning gate) and run as one engine
request. The output is read by the same ChoiceOutput as chat: reasoning items, one
message with an output_text part, then function_call items. Streaming sends the
Responses event sequence (created, in_progress, per item: output_item.added, the
part/argument deltas and their .done, output_item.done; then completed, or incomplete
when max_output_tokens cut it).

``previous_response_id`` continues a stored conversation: responses are kept in memory
(unless ``store: false``), at most STORE_MAX_ENTRIES and for STORE_MAX_AGE_S seconds.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
from typing import Any

from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from jaxserve.entrypoints.openai.errors import APIError, reraise_disconnect, validation_error
from jaxserve.entrypoints.openai.key_auth import current_grant
from jaxserve.entrypoints.openai.protocol import ChatCompletionRequest
from jaxserve.entrypoints.openai.responses_protocol import (
    InputError,
    ResponsesRequest,
    chat_response_format,
    chat_tool_choice,
    chat_tools,
    input_messages,
)
from jaxserve.entrypoints.openai.serving_chat import TOOLS_NOT_RENDERED, ChoiceOutput, OpenAIServingChat
from jaxserve.entrypoints.openai.serving_engine import collect_finals, until_disconnect
from jaxserve.entrypoints.openai.sse import sse
from jaxserve.outputs import RequestOutput

STORE_MAX_ENTRIES = 1024
STORE_MAX_AGE_S = 3600.0


class ResponseStore:
    """Stored responses by id: bounded by count (oldest out first) and by age."""

    def __init__(self, max_entries: int = STORE_MAX_ENTRIES,
                 max_age_s: float = STORE_MAX_AGE_S) -> None:
        self.max_entries, self.max_age_s = max_entries, max_age_s
        self._entries: OrderedDict[str, tuple[float, dict, list[dict], bytes | None]] = \
            OrderedDict()

    def put(self, body: dict[str, Any], messages: list[dict[str, Any]],
            owner: bytes | None = None) -> None:
        """Store a response; `owner` (an API key's digest) alone may read it back."""
        self._evict()
        self._entries[body["id"]] = (time.monotonic(), body, messages, owner)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def get(self, response_id: str, owner: bytes | None = None
            ) -> tuple[dict, list[dict]] | None:
        """(body, conversation) of a stored response; None when missing, expired, or stored
        under another key (the same answer, so ids of other keys' responses leak nothing)."""
        self._evict()
        entry = self._entries.get(response_id)
        if entry is None or entry[3] != owner:
            return None
        return entry[1], entry[2]

    def _evict(self) -> None:
        cutoff = time.monotonic() - self.max_age_s
        while self._entries:
            oldest = next(iter(self._entries.values()))
            if oldest[0] >= cutoff:
                break
            self._entries.popitem(last=False)


def _key_owner() -> bytes | None:
    """The digest of the request's API key (None without keys): stored responses are
    per key."""
    grant = current_grant.get()
    return None if grant is None else grant.key.digest


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class OpenAIServingResponses:

    def __init__(self, chat: OpenAIServingChat) -> None:
        self.chat = chat
        self.store = ResponseStore()

    async def create_response(self, request: ResponsesRequest, raw_request: Request,
                              ids: tuple[str, str] | None = None) -> Response:
        """``ids``: (the response's id, the engine request's id), from new_request_id."""
        chat = self.chat
        model = chat.model_name(request.model)
        history: list[dict[str, Any]] = []
        if request.previous_response_id is not None:
            stored = self.store.get(request.previous_response_id, _key_owner())
            if stored is None:
                raise APIError(f"Response with id '{request.previous_response_id}' not found "
                               "(expired, never stored, or store was false).", 404,
                               param="previous_response_id")
            history = stored[1]
        try:
            new_messages = input_messages(request.input)
            chat_request = self._chat_request(request, history + new_messages)
        except InputError as exc:
            raise APIError(str(exc), param=exc.param) from None
        plan, prompt_ids, params, prompt_tail = await chat.prepare(chat_request)
        response_id, engine_id = ids or (_id("resp"),) * 2
        [stream] = await chat.start_requests(engine_id, [prompt_ids], [params],
                                             chat.lora_for(model))
        base = self._base(request, response_id, model)
        output = ChoiceOutput(plan, chat.new_reasoning(prompt_tail))
        conversation = history + [m for m in new_messages]
        headers = {"x-jaxserve-warning": TOOLS_NOT_RENDERED} \
            if plan.template_ignores_tools else None
        if request.stream:
            return StreamingResponse(self._stream(request, base, stream, output, conversation,
                                                  len(prompt_ids)),
                                     media_type="text/event-stream", headers=headers)
        [final] = await until_disconnect(raw_request, collect_finals([stream]))
        body = self._finish(base, final, output, conversation, request.store is not False)
        return JSONResponse(body, headers=headers)

    def retrieve(self, response_id: str) -> dict[str, Any]:
        stored = self.store.get(response_id, _key_owner())
        if stored is None:
            raise APIError(f"Response with id '{response_id}' not found.", 404,
                           param="response_id")
        return stored[0]

    # -- request ---------------------------------------------------------------------------------
    def _chat_request(self, request: ResponsesRequest, messages: list[dict[str, Any]]
                      ) -> ChatCompletionRequest:
        if request.instructions:
            messages = [{"role": "system", "content": request.instructions}, *messages]
        if not messages:
            raise InputError("input must not be empty", "input")
        fields: dict[str, Any] = {
            "messages": messages, "model": request.model,
            "max_tokens": request.max_output_tokens, "tools": chat_tools(request.tools),
            "tool_choice": chat_tool_choice(request.tool_choice),
            "parallel_tool_calls": request.parallel_tool_calls,
            "response_format": chat_response_format(request.text),
            "chat_template_kwargs": request.chat_template_kwargs,
            # Streaming asks the engine for DELTA outputs, else only the final one.
            "stream": bool(request.stream)}
        for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "seed",
                     "stop", "logit_bias"):
            fields[name] = getattr(request, name)
        try:
            return ChatCompletionRequest.model_validate(
                {k: v for k, v in fields.items() if v is not None})
        except ValidationError as exc:
            raise validation_error(exc) from None

    def _base(self, request: ResponsesRequest, response_id: str, model: str) -> dict[str, Any]:
        """The response object without output, status and usage (OpenAI's field names)."""
        return {"id": response_id, "object": "response", "created_at": int(time.time()),
                "model": model, "status": "in_progress", "output": [], "error": None,
                "incomplete_details": None, "instructions": request.instructions,
                "metadata": request.metadata or {}, "parallel_tool_calls":
                request.parallel_tool_calls is not False,
                "temperature": request.temperature, "top_p": request.top_p,
                "max_output_tokens": request.max_output_tokens,
                "previous_response_id": request.previous_response_id,
                "tool_choice": request.tool_choice or "auto", "tools": request.tools or [],
                "text": request.text or {"format": {"type": "text"}},
                "reasoning": request.reasoning or {"effort": None, "summary": None},
                "store": request.store is not False, "truncation": "disabled",
                "user": request.user, "background": False, "usage": None}

    # -- output ----------------------------------------------------------------------------------
    def _usage(self, final: RequestOutput, reasoning: str | None) -> dict[str, Any]:
        [choice] = final.outputs
        prompt, completion = len(final.prompt_token_ids), len(choice.token_ids)
        reasoning_tokens = len(self.chat.tokenizer.encode(reasoning, add_special_tokens=False)) \
            if reasoning else 0
        return {"input_tokens": prompt,
                "input_tokens_details": {"cached_tokens": final.num_cached_tokens},
                "output_tokens": completion,
                "output_tokens_details": {"reasoning_tokens": min(reasoning_tokens, completion)},
                "total_tokens": prompt + completion}

    def _finish(self, base: dict[str, Any], final: RequestOutput, output: ChoiceOutput,
                conversation: list[dict[str, Any]], store: bool,
                items: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        """The completed response body (stored unless store is false). ``items``: the
        streamed items (their ids), else built from the final text."""
        [choice] = final.outputs
        if choice.finish_reason == "abort":
            raise APIError("the request was aborted (the server is shutting down)", 503,
                           "service_unavailable")
        reasoning, content, calls = output.split(choice.text, final=True)
        if items is None:
            items = []
            if reasoning is not None:
                items.append(reasoning_item(_id("rs"), reasoning, "completed"))
            if content or not calls:
                items.append(message_item(_id("msg"), content, "completed"))
            for call in calls:
                items.append(function_call_item(_id("fc"), _id("call"), call.name,
                                                call.arguments, "completed"))
        body = {**base, "output": items, "usage": self._usage(final, reasoning)}
        if choice.finish_reason == "length":
            body["status"] = "incomplete"
            body["incomplete_details"] = {"reason": "max_output_tokens"}
        else:
            body["status"] = "completed"
        if store:
            self.store.put(body, conversation + output_messages(items), _key_owner())
        return body

    async def _stream(self, request: ResponsesRequest, base: dict[str, Any],
                      stream: AsyncIterator[RequestOutput], output: ChoiceOutput,
                      conversation: list[dict[str, Any]], num_prompt_tokens: int
                      ) -> AsyncIterator[str]:
        events = _EventWriter(base)
        yield events.send("response.created", response=dict(base))
        yield events.send("response.in_progress", response=dict(base))
        final: RequestOutput | None = None
        token_ids: list[int] = []
        try:
            async for out in stream:       # DELTA outputs: only the new tokens and text
                [choice] = out.outputs
                done = choice.finish_reason is not None
                token_ids += choice.token_ids
                reasoning, text, calls = output.feed(choice.text, final=done)
                for event in events.deltas(reasoning, text, calls):
                    yield event
                if done:
                    # The whole choice, as a FINAL_ONLY output would carry it.
                    final = dataclasses.replace(out, outputs=[dataclasses.replace(
                        choice, text=output.text, token_ids=token_ids)])
            for event in events.close_open():
                yield event
            assert final is not None
            body = self._finish(base, final, output, conversation, request.store is not False,
                                items=events.items)
            kind = "response.completed" if body["status"] == "completed" else \
                "response.incomplete"
            yield events.send(kind, response=body)
        except BaseException as exc:
            if reraise_disconnect(exc):
                raise
            error = exc if isinstance(exc, APIError) else APIError(
                f"internal error: {exc!r}", 500, "internal_server_error")
            yield events.send("error", code=error.code, message=error.message,
                              param=error.param)


# -- output items (OpenAI's shapes) -------------------------------------------------------------
def reasoning_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {"id": item_id, "type": "reasoning", "summary": [],
            "content": [{"type": "reasoning_text", "text": text}], "status": status}


def message_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    content = [] if text is None else [{"type": "output_text", "text": text,
                                        "annotations": [], "logprobs": []}]
    return {"id": item_id, "type": "message", "role": "assistant", "status": status,
            "content": content}


def function_call_item(item_id: str, call_id: str, name: str, arguments: str,
                       status: str) -> dict[str, Any]:
    return {"id": item_id, "type": "function_call", "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


def output_messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A response's output items as the chat messages a follow-up turn renders."""
    history: list[dict[str, Any]] = []
    for item in items:
        if item["type"] == "reasoning":
            history.append({"type": "reasoning", "content": item["content"]})
        elif item["type"] == "message":
            history.append({"type": "message", "role": "assistant", "content": item["content"]})
        else:
            history.append({k: item[k] for k in ("type", "call_id", "name", "arguments")})
    return input_messages(history)


class _EventWriter:
    """Streamed items and the events that build them; sequence numbers in order."""

    def __init__(self, base: dict[str, Any]) -> None:
        self.base = base
        self.sequence = 0
        self.items: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None     # the item being streamed
        self.call_items: dict[int, int] = {}          # tool-call index -> output index

    def send(self, kind: str, **fields: Any) -> str:
        event = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\n" + sse(event)

    def _open(self, item: dict[str, Any]) -> list[str]:
        events = self.close_open()
        self.items.append(item)
        self.open = item
        index = len(self.items) - 1
        shown = {**item, "status": "in_progress"}
        if item["type"] == "reasoning":
            shown["content"] = []
        elif item["type"] == "message":
            shown["content"] = []
        elif item["type"] == "function_call":
            shown["arguments"] = ""
        events.append(self.send("response.output_item.added", output_index=index, item=shown))
        part = {"reasoning": {"type": "reasoning_text", "text": ""},
                "message": {"type": "output_text", "text": "", "annotations": [],
                            "logprobs": []}}.get(item["type"])
        if part is not None:
            events.append(self.send("response.content_part.added", item_id=item["id"],
                                    output_index=index, content_index=0, part=part))
        return events

    def close_open(self) -> list[str]:
        item, self.open = self.open, None
        if item is None:
            return []
        index = self.items.index(item)
        item["status"] = "completed"
        events = []
        if item["type"] in ("reasoning", "message"):
            part = item["content"][0]
            kind = "response.reasoning_text.done" if item["type"] == "reasoning" else \
                "response.output_text.done"
            extra = {} if item["type"] == "reasoning" else {"logprobs": []}
            events.append(self.send(kind, item_id=item["id"], output_index=index,
                                    content_index=0, text=part["text"], **extra))
            events.append(self.send("response.content_part.done", item_id=item["id"],
                                    output_index=index, content_index=0, part=part))
        else:
            events.append(self.send("response.function_call_arguments.done",
                                    item_id=item["id"], output_index=index,
                                    name=item["name"], arguments=item["arguments"]))
        events.append(self.send("response.output_item.done", output_index=index, item=item))
        return events

    def _text_delta(self, kind: str, new_item: Any, event: str, delta: str,
                    **extra: Any) -> list[str]:
        """Append `delta` to the open item of `kind` (opening one first if another kind, or
        none, is open) and the event that streams it."""
        events: list[str] = []
        if self.open is None or self.open["type"] != kind:
            events += self._open(new_item())
        self.open["content"][0]["text"] += delta
        events.append(self.send(event, item_id=self.open["id"], output_index=len(self.items) - 1,
                                content_index=0, delta=delta, **extra))
        return events

    def deltas(self, reasoning: str, text: str, calls: list[dict[str, Any]]) -> list[str]:
        events: list[str] = []
        if reasoning:
            events += self._text_delta("reasoning", lambda: reasoning_item(
                _id("rs"), "", "in_progress"), "response.reasoning_text.delta", reasoning)
        if text:
            events += self._text_delta("message", lambda: message_item(
                _id("msg"), "", "in_progress"), "response.output_text.delta", text,
                logprobs=[])
        for call in calls:
            function = call.get("function", {})
            if "id" in call:                        # a new call: its item opens
                events += self._open(function_call_item(_id("fc"), _id("call"),
                                                        function.get("name", ""), "",
                                                        "in_progress"))
                self.call_items[call["index"]] = len(self.items) - 1
            item = self.items[self.call_items[call["index"]]]
            fragment = function.get("arguments") or ""
            if fragment:
                item["arguments"] += fragment
                events.append(self.send("response.function_call_arguments.delta",
                                        item_id=item["id"],
                                        output_index=self.call_items[call["index"]],
                                        delta=fragment))
        return events
