"""What every OpenAI endpoint shares: model names, limits, sampling params, submitting
requests, and waiting on their engine streams (all at once, until done, or until the client
goes)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import re
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from starlette.requests import Request

from jaxserve.engine.async_engine import AsyncLLMEngine
from jaxserve.engine.errors import EngineUnavailableError
from jaxserve.engine.input_processor import RequestLimitError
from jaxserve.entrypoints.openai.errors import APIError, ClientGone, engine_error
from jaxserve.entrypoints.openai.key_auth import KeyGrant, current_grant
from jaxserve.entrypoints.openai.protocol import SamplingFields, usage_dict
from jaxserve.outputs import RequestOutput
from jaxserve.sampling_params import RequestOutputKind, SamplingParams
from jaxserve.structured_outputs.compiler import parse_grammar_cached
from jaxserve.structured_outputs_params import StructuredOutputsParams

logger = logging.getLogger(__name__)
request_logger = logging.getLogger("jaxserve.requests")

T = TypeVar("T")
# Field names a SamplingParams error message may name: the first is the 400's `param`.
_PARAM_NAMES = frozenset(f.name for f in dataclasses.fields(SamplingParams))

# Work on the event loop stalls every HTTP request and stream, so anything whose cost grows
# with the request's size runs on a worker thread once the request's *total* size passes:
INLINE_TEXT_CHARS = 8192           # characters to tokenize (all of a request's prompts)
INLINE_TOKEN_IDS = 16384           # token ids to check or detokenize
GRAMMAR_PARSE_TIMEOUT_S = 10.0     # a structured-outputs spec still parsing after this: 400
_LOGGED_PARAMS_CHARS = 2048        # DEBUG logs a request's params up to this many characters


async def off_loop_if(large: bool, fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)``: inline when small, on a worker thread when ``large`` (so the event
    loop, which serves every other request and stream, never waits on it)."""
    if not large:
        return fn(*args)
    return await asyncio.to_thread(fn, *args)



class OpenAIServing:
    """Model names, limits and helpers every OpenAI endpoint uses."""

    log_requests = False    # one INFO line per admitted request (--enable-log-requests)
    return_tokens_as_token_ids = False       # logprob tokens as "token_id:N"
    enable_prompt_tokens_details = True      # usage.prompt_tokens_details.cached_tokens
    tracer: Any = None                       # tracing.RequestTracer (--otlp-traces-endpoint)

    def __init__(self, engine: AsyncLLMEngine, served_model_names: list[str]) -> None:
        self.async_engine = engine
        self.served_model_names = served_model_names
        # LoRA adapters served by name (jaxserve/lora/registry.py); None: LoRA off.
        self.lora_registry = engine.lora_registry
        self.tokenizer = engine.tokenizer
        if self.tokenizer is None:
            raise ValueError("the OpenAI server needs a tokenizer (texts, chat templates, "
                             "logprob tokens); --skip-tokenizer-init is for offline "
                             "LLM.generate on prompt token ids: pass --tokenizer DIR instead")
        # The engine's request rules (jaxserve/engine/input_processor.py), asked here first
        # so a 400 names the request's field in the API's words.
        self.limits = engine.input_processor.limits
        self.max_model_len = engine.max_model_len
        self.chat_template = engine.config.model_config.chat_template

    def usage(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int
              ) -> dict[str, Any]:
        """OpenAI's usage object; prompt_tokens_details unless turned off."""
        usage = usage_dict(prompt_tokens, completion_tokens, cached_tokens)
        if not self.enable_prompt_tokens_details:
            del usage["prompt_tokens_details"]
        return usage

    # -- checks ----------------------------------------------------------------------------------
    def model_name(self, requested: str | None) -> str:
        """The name to report; raises 404 for a model this server does not serve, or that
        the request's API key may not use (the same answer: a key learns nothing of models
        beyond its own)."""
        name = requested or self.served_model_names[0]
        grant = current_grant.get()
        if grant is None or grant.may_use(name):
            if name in self.served_model_names or self.lora_for(name) is not None:
                return name
        raise APIError(f"The model `{name}` does not exist.", 404, param="model",
                       code="model_not_found")

    def lora_for(self, model: str) -> Any:
        """The LoRARequest served as ``model`` (None: the base model)."""
        if self.lora_registry is None or model in self.served_model_names:
            return None
        return self.lora_registry.lookup(model)

    def check_engine(self) -> None:
        """503 now if the engine is dead or the server is shutting down."""
        error = self.async_engine.admission_error()
        if error is not None:
            raise engine_error(error)

    def check_capacity(self) -> None:
        """503 at once (before the body is read and tokenized) when the engine is not
        taking requests or admission control has no room for even one sequence."""
        self.check_engine()
        try:
            self.async_engine.reserve(1)
        except EngineUnavailableError as exc:
            raise engine_error(exc) from None
        self.async_engine.release(1)

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        [ids] = await self.encode_all([text], add_special_tokens)
        return ids

    async def encode_all(self, texts: list[str], add_special_tokens: bool = True,
                         stop_at_tokens: int | None = None) -> list[list[int]]:
        """Token ids of each text; off the event loop when the texts are long in total.
        With ``stop_at_tokens``, the first text of at least that many tokens ends the list
        (the caller refuses the request on it without tokenizing the rest)."""
        def run() -> list[list[int]]:
            out = []
            for text in texts:
                out.append(list(self.tokenizer.encode(text,
                                                      add_special_tokens=add_special_tokens)))
                if stop_at_tokens is not None and len(out[-1]) >= stop_at_tokens:
                    break
            return out
        return await off_loop_if(sum(map(len, texts)) > INLINE_TEXT_CHARS, run)

    async def check_token_ids_off_loop(self, token_id_lists: list[list[int]],
                                       param: str = "prompt") -> None:
        """check_token_ids of every list; off the event loop when they are long in total."""
        def run() -> None:
            for ids in token_id_lists:
                self.check_token_ids(ids, param)
        await off_loop_if(sum(map(len, token_id_lists)) > INLINE_TOKEN_IDS, run)

    async def parse_constraint(self, constraint: StructuredOutputsParams | None
                               ) -> StructuredOutputsParams | None:
        """Check and parse a structured-outputs spec on a worker thread (limits, syntax: 400s),
        so the engine finds it parsed; the spec as the engine will key it."""
        if constraint is None:
            return None
        if self.async_engine.config.structured_outputs_config \
                .structured_outputs_disable_any_whitespace:
            constraint = dataclasses.replace(constraint, disable_any_whitespace=True)
        try:
            await asyncio.wait_for(asyncio.to_thread(parse_grammar_cached, constraint),
                                   GRAMMAR_PARSE_TIMEOUT_S)
        except (ValueError, RecursionError) as exc:
            raise APIError(str(exc) or "the structured outputs spec is nested too deeply",
                           param="structured_outputs") from None
        except TimeoutError:
            raise APIError(f"the structured outputs spec is too complex (not parsed within "
                           f"{GRAMMAR_PARSE_TIMEOUT_S:.0f} s)", param="structured_outputs") \
                from None
        return constraint

    def check_token_ids(self, token_ids: list[int], param: str = "prompt") -> None:
        """Every id inside the vocabulary; 400 naming ``param`` otherwise."""
        try:
            self.limits.check_token_ids(token_ids, param)
        except RequestLimitError as exc:
            raise _api_error(exc) from None

    def resolve_max_tokens(self, num_prompt_tokens: int, max_tokens: int | None,
                           input_name: str = "messages", allow_zero: bool = False) -> int:
        """Check prompt + max_tokens against max_model_len (`RequestLimits`, the API's wording);
        return max_tokens.
        `input_name` is what the client sent the input as: "messages" (chat) or "prompt".
        allow_zero: 0 means prefill only (echo of the prompt and its logprobs)."""
        try:
            return self.limits.resolve_max_tokens(num_prompt_tokens, max_tokens, input_name,
                                                  allow_zero)
        except RequestLimitError as exc:
            raise _api_error(exc) from None

    def sampling_params(self, request: SamplingFields, max_tokens: int,
                        logprobs: int | None, prompt_logprobs: int | None = None,
                        structured_outputs: StructuredOutputsParams | None = None,
                        stream: bool = False) -> SamplingParams:
        """The request's SamplingParams: outputs as deltas when streaming, else only the
        final one (vLLM's RequestOutputKind). The engine's limits are checked once, when
        the request is submitted (`start_requests`)."""
        kwargs = request.sampling_kwargs()
        try:
            return SamplingParams(
                max_tokens=max_tokens, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                structured_outputs=structured_outputs, **kwargs,
                output_kind=RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY)
        except (ValueError, TypeError) as exc:
            message = str(exc)
            named = [w for w in re.findall(r"[a-z_]+", message) if w in _PARAM_NAMES]
            raise APIError(message, param=named[0] if named else None) from None

    # -- running ---------------------------------------------------------------------------------
    async def start_requests(self, prefix: str, prompts: list[list[int]],
                             params: list[SamplingParams], lora_request: Any = None
                             ) -> list[AsyncIterator]:
        """Submit one engine request per prompt; all accepted, or none (then raise).

        Every prompt is validated and queued before waiting once for the engine to accept
        them all, so all start in the same engine step. A LoRA adapter's weights are loaded
        here, off the engine thread, when the host LRU no longer holds them."""
        self.check_engine()
        num_seqs = [p.n for p in params]
        cap = self.async_engine.max_unfinished_seqs
        if cap is not None and sum(num_seqs) > cap:
            raise APIError(f"the request asks for {sum(num_seqs)} sequences (prompts x n); "
                           f"this server admits at most {cap} at once (--max-num-seqs + "
                           "--max-queued-requests)", param="n")
        extra = {}
        if lora_request is not None:
            try:
                extra["lora_request"] = await asyncio.to_thread(self.lora_registry.get,
                                                                lora_request)
            except ValueError as exc:
                raise APIError(str(exc), param="model") from None
        try:
            self.async_engine.reserve(sum(num_seqs))     # QueueFullError: 503 + Retry-After
        except EngineUnavailableError as exc:
            raise engine_error(exc) from None
        streams = []
        handed_over = 0     # reservations passed to submit(), which owns them from then on
        try:
            for i, (token_ids, sampling_params) in enumerate(zip(prompts, params)):
                request_id = f"{prefix}-{i}"
                if self.log_requests:
                    request_logger.info("Received request %s: %d prompt tokens, %s",
                                        request_id, len(token_ids),
                                        summarize_params(sampling_params))
                    if request_logger.isEnabledFor(logging.DEBUG):
                        request_logger.debug("Request %s params: %s", request_id,
                                             _capped(repr(sampling_params)))
                handed_over = i + 1
                streams.append(self.async_engine.submit(request_id, None, sampling_params,
                                                  prompt_token_ids=token_ids,
                                                  reserved_seqs=num_seqs[i], **extra))
            await self.async_engine.wait_accepted(streams)
        except BaseException as exc:
            # Submitted requests give their sequences back as they end; the rest now.
            self.async_engine.release(sum(num_seqs[handed_over:]))
            for stream in streams:
                self.async_engine.abort(stream.request_id)
            if isinstance(exc, (ValueError, EngineUnavailableError)):
                raise engine_error(exc) from None
            raise
        outputs = [self.async_engine.stream_outputs(stream) for stream in streams]
        if self.tracer is not None:     # --otlp-traces-endpoint: a span per request
            model = lora_request.lora_name if lora_request is not None else \
                self.served_model_names[0]
            outputs = [self.tracer.traced(out, sp, model) for out, sp in zip(outputs, params)]
        grant = current_grant.get()
        if grant is not None:           # the key's tokens, charged when the response ends
            grant.prompt_tokens += sum(len(p) * sp.n for p, sp in zip(prompts, params))
            outputs = [_metered(out, grant) for out in outputs]
        return outputs


def _api_error(exc: RequestLimitError) -> APIError:
    """A broken request rule as OpenAI's 400, naming the field at fault."""
    return APIError(str(exc), param=exc.param, code=exc.code)


async def _metered(outputs: AsyncIterator[RequestOutput], grant: KeyGrant
                   ) -> AsyncIterator[RequestOutput]:
    """`outputs`, adding each output's new tokens to the key's completion tokens (a DELTA
    output carries only new tokens; a FINAL_ONLY stream yields once)."""
    async for output in outputs:
        grant.completion_tokens += sum(len(c.token_ids) for c in output.outputs)
        yield output


def summarize_params(params: SamplingParams) -> str:
    """One line of a request's sampling params for INFO logs: numbers, and the sizes (never
    the contents) of its strings, lists and schemas, so a large request logs a short line."""
    parts = [f"n={params.n}", f"max_tokens={params.max_tokens}",
             f"temperature={params.temperature:g}", f"top_p={params.top_p:g}",
             f"top_k={params.top_k}"]
    if params.seed is not None:
        parts.append("seed=set")
    if params.stop:
        parts.append(f"stop={len(params.stop)} strings/{sum(map(len, params.stop))} chars")
    if params.stop_token_ids:
        parts.append(f"stop_token_ids={len(params.stop_token_ids)}")
    if params.logit_bias:
        parts.append(f"logit_bias={len(params.logit_bias)} entries")
    if params.logprobs is not None:
        parts.append(f"logprobs={params.logprobs}")
    if params.prompt_logprobs is not None:
        parts.append(f"prompt_logprobs={params.prompt_logprobs}")
    if params.structured_outputs is not None:
        kind = params.structured_outputs.kind
        spec = getattr(params.structured_outputs, kind)
        size = len(spec) if isinstance(spec, (str, list)) else len(json.dumps(spec)) \
            if isinstance(spec, dict) else 0
        parts.append(f"structured_outputs={kind}/{size} chars")
    return " ".join(parts)


def _capped(text: str) -> str:
    if len(text) <= _LOGGED_PARAMS_CHARS:
        return text
    return f"{text[:_LOGGED_PARAMS_CHARS]}... ({len(text)} characters in all)"


# -- waiting on a request's engine streams -------------------------------------------------------
T = TypeVar("T")


MAX_CLIENT_REQUEST_ID_CHARS = 128  # longer x-request-id headers are cut (they go into logs)


def new_request_id(prefix: str, raw_request: Request | None = None,
                   separator: str = "-") -> tuple[str, str]:
    """(the response's id, the engine requests' id prefix): ``prefix``, ``separator``, then
    the client's x-request-id header if it sent one, else a random id. With the header both
    carry it (its log lines then show it); the engine's gets a random suffix, since two
    clients may send the same id."""
    given = raw_request.headers.get("x-request-id") if raw_request is not None else None
    cleaned = "".join(c for c in (given or "")[:MAX_CLIENT_REQUEST_ID_CHARS]
                      if c.isprintable() and not c.isspace())
    if not cleaned:
        request_id = f"{prefix}{separator}{uuid.uuid4().hex}"
        return request_id, request_id
    return (f"{prefix}{separator}{cleaned}",
            f"{prefix}{separator}{cleaned}-{uuid.uuid4().hex[:8]}")


async def until_disconnect(raw_request: Request, awaitable: Awaitable[T]) -> T:
    """Await `awaitable`, cancelling it (which aborts its requests) if the client goes away."""
    task = asyncio.ensure_future(awaitable)

    async def wait_for_disconnect() -> None:
        while True:
            message = await raw_request.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(wait_for_disconnect())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
        watcher.cancel()
    if task.cancelled() or not task.done():
        raise ClientGone()
    return task.result()


async def merge_streams(streams: list[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """Interleave several async iterators, yielding (index of the iterator, item)."""
    if len(streams) == 1:
        async for item in streams[0]:
            yield 0, item
        return

    async def next_item(stream: AsyncIterator[T]) -> T:
        return await stream.__anext__()

    pending = {asyncio.ensure_future(next_item(s)): i for i, s in enumerate(streams)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for future in done:
                i = pending.pop(future)
                try:
                    item = future.result()
                except StopAsyncIteration:
                    continue
                pending[asyncio.ensure_future(next_item(streams[i]))] = i
                yield i, item
    finally:
        for future in pending:
            future.cancel()
        if pending:     # let cancelled streams finish (and abort) before closing them
            await asyncio.gather(*pending, return_exceptions=True)
        for stream in streams:
            await stream.aclose()


async def collect_finals(streams: list[AsyncIterator[RequestOutput]]) -> list[RequestOutput]:
    """Drain request streams concurrently; the final RequestOutput of each, in order."""
    finals: list[RequestOutput | None] = [None] * len(streams)
    async for i, out in merge_streams(streams):
        if out.finished:
            finals[i] = out
    assert all(f is not None for f in finals)
    return finals  # type: ignore[return-value]

