"""POST /v1/completions: prompts (text or token ids) → one engine request each.

Choice `i * n + j` is completion `j` of prompt `i`, as in OpenAI and vLLM.
Streaming sends, per choice, text deltas computed from the engine's
cumulative outputs, then a chunk carrying the finish_reason, then (if asked)
a usage chunk and `data: [DONE]`.

Echo with logprobs reports the prompt tokens' logprobs (the engine's prompt logprobs, the
first one null) before the generated ones; `echo` with `max_tokens: 0` returns the prompt
and its logprobs and generates nothing (a prefill-only request).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from jaxserve.entrypoints.openai.protocol import CompletionRequest, completion_response, usage_dict
from jaxserve.entrypoints.openai.serving_engine import (
    SSE_DONE,
    APIError,
    OpenAIServing,
    client_request_id,
    collect_finals,
    completion_logprobs,
    echo_logprobs,
    merge_streams,
    prompt_logprobs_json,
    reraise_disconnect,
    sse,
    sse_error,
    until_disconnect,
)
from jaxserve.entrypoints.openai.structured_request import structured_outputs_of
from jaxserve.outputs import RequestOutput

MAX_CHOICES = 1024       # prompts x n in one request; more is a batch job, not a request


class OpenAIServingCompletion(OpenAIServing):

    async def create_completion(self, request: CompletionRequest, raw_request: Request
                                ) -> Response:
        model = self.model_name(request.model)
        prompts = request.prompts()
        if len(prompts) * request.n > MAX_CHOICES:
            raise APIError(f"a request may ask for at most {MAX_CHOICES} completions "
                           f"(prompts x n); got {len(prompts)} x {request.n}", param="prompt")
        prompt_ids: list[list[int]] = []
        for prompt in prompts:
            if isinstance(prompt, str):
                ids = await self.encode(prompt)
            else:
                ids = list(prompt)
                self.check_token_ids(ids)
            if not ids:
                raise APIError("the prompt is empty (0 tokens)", param="prompt")
            prompt_ids.append(ids)
        constraint = structured_outputs_of(request)
        echo_only = request.echo and request.max_tokens == 0
        # vLLM: echo with logprobs asks for as many prompt logprobs; prefill-only needs them.
        prompt_logprobs = request.prompt_logprobs
        if prompt_logprobs is None and request.echo:
            prompt_logprobs = request.logprobs
        if prompt_logprobs is None and echo_only:
            prompt_logprobs = 0
        params = [self.sampling_params(
            request, self.resolve_max_tokens(len(ids), request.max_tokens, "prompt",
                                    allow_zero=echo_only),
            request.logprobs, prompt_logprobs, constraint) for ids in prompt_ids]
        prompt_texts = [p if isinstance(p, str) else None for p in prompts]
        if request.echo:
            prompt_texts = [t if t is not None else self.tokenizer.decode(ids)
                            for t, ids in zip(prompt_texts, prompt_ids)]

        request_id = client_request_id(raw_request, "cmpl")
        created = int(time.time())
        streams = await self.start_requests(request_id, prompt_ids, params,
                                            self.lora_for(model))
        if request.stream:
            return StreamingResponse(
                self._stream(request, request_id, model, created, streams, prompt_ids,
                             prompt_texts), media_type="text/event-stream")
        finals = await until_disconnect(raw_request, collect_finals(streams))
        return JSONResponse(self._full_response(request, request_id, model, created, finals,
                                                prompt_ids, prompt_texts))

    def _full_response(self, request: CompletionRequest, request_id: str, model: str,
                       created: int, finals: list[RequestOutput], prompt_ids: list[list[int]],
                       prompt_texts: list[str | None]) -> dict[str, Any]:
        choices = []
        completion_tokens = cached = 0
        # Not when only our prefill-only echo asked for them (vLLM reports what was asked).
        asked_prompt_logprobs = request.prompt_logprobs is not None or (
            request.echo and request.logprobs is not None)
        for i, out in enumerate(finals):
            cached += out.num_cached_tokens
            for c in sorted(out.outputs, key=lambda c: c.index):
                if c.finish_reason == "abort":
                    raise APIError("the request was aborted (the server is shutting down)",
                                   503, "service_unavailable")
                completion_tokens += len(c.token_ids)
                text, logprobs = c.text, None
                echo = prompt_texts[i] if request.echo else ""
                if request.logprobs is not None:
                    logprobs = completion_logprobs(c, 0, len(c.token_ids), len(echo),
                                                   self.tokenizer)
                    if request.echo:
                        logprobs = _join_logprobs(
                            echo_logprobs(prompt_ids[i], out.prompt_logprobs, self.tokenizer),
                            logprobs)
                choices.append({"index": i * request.n + c.index, "text": echo + text,
                                "logprobs": logprobs, "finish_reason": c.finish_reason,
                                "stop_reason": c.stop_reason,
                                "prompt_logprobs": prompt_logprobs_json(
                                    out.prompt_logprobs if asked_prompt_logprobs else None)})
        usage = usage_dict(sum(map(len, prompt_ids)), completion_tokens, cached)
        return completion_response(request_id, model, choices, usage, created)

    async def _stream(self, request: CompletionRequest, request_id: str, model: str,
                      created: int, streams: list[AsyncIterator[RequestOutput]],
                      prompt_ids: list[list[int]], prompt_texts: list[str | None]
                      ) -> AsyncIterator[str]:
        n = request.n
        num_choices = len(prompt_ids) * n
        sent_chars = [0] * num_choices       # output text already sent, per choice
        sent_tokens = [0] * num_choices
        offsets = [0] * num_choices          # logprobs text_offset of the next token
        echoed = [not request.echo] * num_choices
        finished = [False] * num_choices
        completion_tokens = [0] * num_choices
        cached = [0] * len(prompt_ids)

        generated = [0] * num_choices        # tokens so far, for continuous usage stats
        continuous_usage = request.continuous_usage_in_stream

        def chunk(choices: list[dict], usage: dict | None = None) -> str:
            if usage is None and continuous_usage:
                usage = usage_dict(sum(map(len, prompt_ids)), sum(generated), sum(cached))
            return sse(completion_response(request_id, model, choices, usage, created,
                                           chunk=True))
        try:
            async for i, out in merge_streams(streams):
                cached[i] = out.num_cached_tokens
                for c in out.outputs:
                    idx = i * n + c.index
                    if finished[idx]:
                        continue
                    generated[idx] = len(c.token_ids)
                    text = c.text[sent_chars[idx]:]
                    logprobs = None
                    if not echoed[idx]:
                        echoed[idx] = True
                        text = prompt_texts[i] + text
                        if request.logprobs is not None:
                            logprobs = echo_logprobs(prompt_ids[i], out.prompt_logprobs,
                                                     self.tokenizer)
                            offsets[idx] = len(prompt_texts[i])
                    if text:
                        if request.logprobs is not None:
                            new = completion_logprobs(c, sent_tokens[idx], len(c.token_ids),
                                                      offsets[idx], self.tokenizer)
                            offsets[idx] += sum(len(t) for t in new["tokens"])
                            logprobs = _join_logprobs(logprobs, new) if logprobs else new
                            sent_tokens[idx] = len(c.token_ids)
                        sent_chars[idx] = len(c.text)
                        yield chunk([{"index": idx, "text": text, "logprobs": logprobs,
                                      "finish_reason": None, "stop_reason": None}])
                    if c.finish_reason is not None:
                        finished[idx] = True
                        completion_tokens[idx] = len(c.token_ids)
                        logprobs = None     # tokens without text (EOS) still get logprobs
                        if request.logprobs is not None and sent_tokens[idx] < len(c.token_ids):
                            logprobs = completion_logprobs(c, sent_tokens[idx], len(c.token_ids),
                                                           offsets[idx], self.tokenizer)
                        yield chunk([{"index": idx, "text": "", "logprobs": logprobs,
                                      "finish_reason": c.finish_reason,
                                      "stop_reason": c.stop_reason}])
            if request.include_usage_in_stream:
                usage = usage_dict(sum(map(len, prompt_ids)), sum(completion_tokens),
                                   sum(cached))
                yield chunk([], usage)
        except BaseException as exc:
            if reraise_disconnect(exc):
                raise
            yield sse_error(exc)
        yield SSE_DONE


def _join_logprobs(first: dict[str, Any], second: dict[str, Any]) -> dict[str, Any]:
    return {key: first[key] + second[key] for key in first}
