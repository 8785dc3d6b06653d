"""POST /v1/completions: prompts (text or token ids) → one engine request each.

Choice `i * n + j` is completion `j` of prompt `i`, as in OpenAI and vLLM.
Streaming asks the engine for deltas (RequestOutputKind.DELTA) and sends, per choice,
each text delta as it comes, then a chunk carrying the finish_reason, then (if asked)
a usage chunk and `data: [DONE]`. A non-streamed request asks only for the final output.

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

from jaxserve.entrypoints.openai.errors import APIError, reraise_disconnect
from jaxserve.entrypoints.openai.logprobs_format import (
    echo_logprobs,
    legacy_logprobs,
    prompt_logprobs_json,
)
from jaxserve.entrypoints.openai.protocol import CompletionRequest, completion_response
from jaxserve.entrypoints.openai.serving_engine import (
    OpenAIServing,
    collect_finals,
    merge_streams,
    new_request_id,
    until_disconnect,
)
from jaxserve.entrypoints.openai.sse import SSE_DONE, sse, sse_error
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
        prompt_ids = await self._prompt_token_ids(prompts, request.max_tokens)
        if any(not ids for ids in prompt_ids):
            raise APIError("the prompt is empty (0 tokens)", param="prompt")
        constraint = await self.parse_constraint(structured_outputs_of(request))
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
            request.logprobs, prompt_logprobs, constraint, request.stream) for ids in prompt_ids]
        prompt_texts = [p if isinstance(p, str) else None for p in prompts]
        if request.echo:
            prompt_texts = [t if t is not None else self.tokenizer.decode(ids)
                            for t, ids in zip(prompt_texts, prompt_ids)]

        request_id, engine_id = new_request_id("cmpl", raw_request)
        created = int(time.time())
        streams = await self.start_requests(engine_id, prompt_ids, params,
                                            self.lora_for(model))
        if request.stream:
            return StreamingResponse(
                self._stream(request, request_id, model, created, streams, prompt_ids,
                             prompt_texts), media_type="text/event-stream")
        finals = await until_disconnect(raw_request, collect_finals(streams))
        return JSONResponse(self._full_response(request, request_id, model, created, finals,
                                                prompt_ids, prompt_texts))

    async def _prompt_token_ids(self, prompts: list[str | list[int]],
                                max_tokens: int | None) -> list[list[int]]:
        """Each prompt's token ids (texts tokenized, ids checked against the vocabulary).
        Tokenizing stops at the first text too long for the model: the 400 comes then."""
        texts = [p for p in prompts if isinstance(p, str)]
        encoded = await self.encode_all(texts, stop_at_tokens=self.max_model_len)
        if encoded and len(encoded[-1]) >= self.max_model_len:
            self.resolve_max_tokens(len(encoded[-1]), max_tokens, "prompt")   # raises
        it = iter(encoded)
        prompt_ids = [next(it) if isinstance(p, str) else list(p) for p in prompts]
        await self.check_token_ids_off_loop([ids for p, ids in zip(prompts, prompt_ids)
                                             if not isinstance(p, str)])
        return prompt_ids

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
                    as_ids = self.return_tokens_as_token_ids
                    logprobs = legacy_logprobs(c.token_ids, c.logprobs or [], len(echo),
                                               self.tokenizer, as_ids)
                    if request.echo:
                        logprobs = _join_logprobs(
                            echo_logprobs(prompt_ids[i], out.prompt_logprobs, self.tokenizer,
                                          as_ids), logprobs)
                choices.append({"index": i * request.n + c.index, "text": echo + text,
                                "logprobs": logprobs, "finish_reason": c.finish_reason,
                                "stop_reason": c.stop_reason,
                                "prompt_logprobs": prompt_logprobs_json(
                                    out.prompt_logprobs if asked_prompt_logprobs else None)})
        usage = self.usage(sum(map(len, prompt_ids)), completion_tokens, cached)
        return completion_response(request_id, model, choices, usage, created)

    async def _stream(self, request: CompletionRequest, request_id: str, model: str,
                      created: int, streams: list[AsyncIterator[RequestOutput]],
                      prompt_ids: list[list[int]], prompt_texts: list[str | None]
                      ) -> AsyncIterator[str]:
        """SSE chunks of the choices' deltas (each RequestOutput carries only what is new)."""
        num_choices = len(prompt_ids) * request.n
        choices = [_ChoiceStream(request.echo) for _ in range(num_choices)]
        cached = [0] * len(prompt_ids)
        num_prompt_tokens = sum(map(len, prompt_ids))

        def chunk(choice_dicts: list[dict], usage: dict | None = None) -> str:
            if usage is None and request.continuous_usage_in_stream:
                usage = self.usage(num_prompt_tokens, sum(c.num_tokens for c in choices),
                                   sum(cached))
            return sse(completion_response(request_id, model, choice_dicts, usage, created,
                                           chunk=True))
        try:
            async for i, out in merge_streams(streams):
                cached[i] = out.num_cached_tokens
                for c in out.outputs:
                    idx = i * request.n + c.index
                    choice = choices[idx]
                    if choice.finished:
                        continue
                    for body in choice.chunks(self, request, c, idx, prompt_ids[i],
                                              prompt_texts[i], out):
                        yield chunk([body])
            if request.include_usage_in_stream:
                usage = self.usage(num_prompt_tokens, sum(c.num_tokens for c in choices),
                                   sum(cached))
                yield chunk([], usage)
        except BaseException as exc:
            if reraise_disconnect(exc):
                raise
            yield sse_error(exc)
        yield SSE_DONE


class _ChoiceStream:
    """One streamed choice: the echo still owed, and the tokens whose logprobs wait for
    text (a token may add no text yet: part of a character, a held-back stop prefix)."""

    def __init__(self, echo: bool) -> None:
        self.echo_pending = echo
        self.tokens_as_ids = False         # --return-tokens-as-token-ids (set by chunks)
        self.finished = False
        self.num_tokens = 0
        self.text_offset = 0               # logprobs text_offset of the next token
        self.pending_ids: list[int] = []
        self.pending_logprobs: list = []

    def chunks(self, serving: OpenAIServing, request: CompletionRequest, c: Any, idx: int,
               prompt_ids: list[int], prompt_text: str | None, out: RequestOutput
               ) -> list[dict[str, Any]]:
        """The chunk bodies of one delta of this choice."""
        tokenizer, want_logprobs = serving.tokenizer, request.logprobs is not None
        self.tokens_as_ids = serving.return_tokens_as_token_ids
        self.num_tokens += len(c.token_ids)
        if want_logprobs:
            self.pending_ids += c.token_ids
            self.pending_logprobs += c.logprobs or []
        text, logprobs, bodies = c.text, None, []
        if self.echo_pending:
            self.echo_pending = False
            text = prompt_text + text
            if want_logprobs:
                logprobs = echo_logprobs(prompt_ids, out.prompt_logprobs, tokenizer,
                                         self.tokens_as_ids)
                self.text_offset = len(prompt_text)
        if text:
            if want_logprobs:
                new = self._take_logprobs(tokenizer)
                logprobs = _join_logprobs(logprobs, new) if logprobs else new
            bodies.append({"index": idx, "text": text, "logprobs": logprobs,
                           "finish_reason": None, "stop_reason": None})
        if c.finish_reason is not None:
            self.finished = True
            # tokens without text (EOS) still get logprobs
            logprobs = self._take_logprobs(tokenizer) if self.pending_ids else None
            bodies.append({"index": idx, "text": "", "logprobs": logprobs,
                           "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
        return bodies

    def _take_logprobs(self, tokenizer: Any) -> dict[str, Any]:
        new = legacy_logprobs(self.pending_ids, self.pending_logprobs, self.text_offset,
                              tokenizer, self.tokens_as_ids)
        self.text_offset += sum(len(t) for t in new["tokens"])
        self.pending_ids, self.pending_logprobs = [], []
        return new


def _join_logprobs(first: dict[str, Any], second: dict[str, Any]) -> dict[str, Any]:
    return {key: first[key] + second[key] for key in first}
