"""--otlp-traces-endpoint: one OpenTelemetry span per engine request, as vLLM sends them.

The span is vLLM's `llm_request` (kind SERVER) with vLLM's attribute names (its
vllm/tracing/utils.py SpanAttributes): it starts at the request's arrival and ends when it
finishes; a W3C `traceparent` / `tracestate` on the HTTP request makes it a child of the
caller's trace. Spans leave through the OTLP exporter that
OTEL_EXPORTER_OTLP_TRACES_PROTOCOL names (grpc, vLLM's default, or http/protobuf), batched
off the event loop. Needs `pip install 'jaxserve[otel]'`.
"""

from __future__ import annotations

import contextvars
import logging
import os
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from jaxserve.outputs import RequestOutput
from jaxserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

SPAN_NAME = "llm_request"
TRACE_HEADERS = ("traceparent", "tracestate")

# vLLM's attribute names.
GEN_AI_USAGE_COMPLETION_TOKENS = "gen_ai.usage.completion_tokens"
GEN_AI_USAGE_PROMPT_TOKENS = "gen_ai.usage.prompt_tokens"
GEN_AI_REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
GEN_AI_REQUEST_TOP_P = "gen_ai.request.top_p"
GEN_AI_REQUEST_TEMPERATURE = "gen_ai.request.temperature"
GEN_AI_RESPONSE_MODEL = "gen_ai.response.model"
GEN_AI_REQUEST_ID = "gen_ai.request.id"
GEN_AI_REQUEST_N = "gen_ai.request.n"
GEN_AI_USAGE_NUM_SEQUENCES = "gen_ai.usage.num_sequences"
GEN_AI_LATENCY_TIME_IN_QUEUE = "gen_ai.latency.time_in_queue"
GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN = "gen_ai.latency.time_to_first_token"
GEN_AI_LATENCY_E2E = "gen_ai.latency.e2e"
GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL = "gen_ai.latency.time_in_model_prefill"
GEN_AI_LATENCY_TIME_IN_MODEL_DECODE = "gen_ai.latency.time_in_model_decode"
GEN_AI_LATENCY_TIME_IN_MODEL_INFERENCE = "gen_ai.latency.time_in_model_inference"

# The trace headers of the HTTP request being served (set by TraceHeadersMiddleware).
current_trace_headers: contextvars.ContextVar[dict[str, str] | None] = \
    contextvars.ContextVar("jaxserve_trace_headers", default=None)


class TraceHeadersMiddleware:
    """Pure ASGI middleware: keeps the request's traceparent/tracestate for its spans."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]
                   if k.decode("latin-1") in TRACE_HEADERS}
        token = current_trace_headers.set(headers or None)
        try:
            await self.app(scope, receive, send)
        finally:
            current_trace_headers.reset(token)


class RequestTracer:
    """An OTLP exporter and the tracer that writes one span per finished request."""

    def __init__(self, endpoint: str, service_name: str = "jaxserve") -> None:
        try:
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
            from opentelemetry.trace.propagation.tracecontext import (
                TraceContextTextMapPropagator,
            )
        except ImportError:
            raise ValueError("--otlp-traces-endpoint needs OpenTelemetry: pip install "
                             "'jaxserve[otel]'") from None
        self.endpoint = endpoint
        self.provider = TracerProvider(resource=Resource.create(
            {"service.name": service_name, "jaxserve.process_id": str(os.getpid())}))
        self.provider.add_span_processor(BatchSpanProcessor(span_exporter(endpoint)))
        self.tracer = self.provider.get_tracer("jaxserve.entrypoints.openai")
        self.propagator = TraceContextTextMapPropagator()
        logger.info("tracing: one span per request to %s (OTLP %s)", endpoint,
                    otlp_protocol())

    def record(self, output: RequestOutput, params: SamplingParams, model: str,
               num_completion_tokens: int, headers: dict[str, str] | None) -> None:
        """The finished request's span, from its arrival to now."""
        from opentelemetry.trace import SpanKind

        metrics = output.metrics
        now = time.time()
        arrival = metrics.arrival_time if metrics is not None else now
        attributes: dict[str, Any] = {
            GEN_AI_REQUEST_ID: output.request_id, GEN_AI_RESPONSE_MODEL: model,
            GEN_AI_USAGE_PROMPT_TOKENS: len(output.prompt_token_ids),
            GEN_AI_USAGE_COMPLETION_TOKENS: num_completion_tokens,
            GEN_AI_USAGE_NUM_SEQUENCES: len(output.outputs),
            GEN_AI_LATENCY_E2E: now - arrival,
        }
        if metrics is not None and metrics.first_scheduled_time is not None:
            scheduled = metrics.first_scheduled_time
            attributes[GEN_AI_LATENCY_TIME_IN_QUEUE] = scheduled - arrival
            if metrics.first_token_time is not None:
                attributes[GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN] = \
                    metrics.first_token_time - arrival
                attributes[GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL] = \
                    metrics.first_token_time - scheduled
                last = metrics.last_token_time or metrics.first_token_time
                attributes[GEN_AI_LATENCY_TIME_IN_MODEL_DECODE] = \
                    last - metrics.first_token_time
                attributes[GEN_AI_LATENCY_TIME_IN_MODEL_INFERENCE] = last - scheduled
        for name, value in ((GEN_AI_REQUEST_TOP_P, params.top_p),
                            (GEN_AI_REQUEST_MAX_TOKENS, params.max_tokens),
                            (GEN_AI_REQUEST_TEMPERATURE, params.temperature),
                            (GEN_AI_REQUEST_N, params.n)):
            if value:        # vLLM leaves out unset (and zero) values
                attributes[name] = value
        context = self.propagator.extract(headers) if headers else None
        span = self.tracer.start_span(SPAN_NAME, context=context, kind=SpanKind.SERVER,
                                      start_time=int(arrival * 1e9), attributes=attributes)
        span.end(end_time=int(now * 1e9))

    async def traced(self, outputs: AsyncIterator[RequestOutput], params: SamplingParams,
                     model: str) -> AsyncIterator[RequestOutput]:
        """`outputs`, recording the request's span when its final output passes."""
        headers = current_trace_headers.get()
        completion_tokens = 0
        async for output in outputs:
            completion_tokens += sum(len(c.token_ids) for c in output.outputs)
            if output.finished:
                try:
                    self.record(output, params, model, completion_tokens, headers)
                except Exception:      # a tracing fault never fails a request
                    logger.exception("could not record the span of %s", output.request_id)
            yield output

    def shutdown(self) -> None:
        """Export the spans still queued."""
        self.provider.shutdown()


def check_available() -> None:
    """ValueError (one line) when the OTLP exporter cannot be built here."""
    try:
        import opentelemetry.sdk.trace  # noqa: F401
    except ImportError:
        raise ValueError("--otlp-traces-endpoint needs OpenTelemetry: pip install "
                         "'jaxserve[otel]'") from None
    protocol = otlp_protocol()
    if protocol not in ("grpc", "http/protobuf"):
        raise ValueError(f"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL must be grpc or http/protobuf, "
                         f"got {protocol!r}")


def otlp_protocol() -> str:
    return os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "grpc")


def span_exporter(endpoint: str) -> Any:
    """vLLM's rule: OTEL_EXPORTER_OTLP_TRACES_PROTOCOL grpc (default) or http/protobuf."""
    protocol = otlp_protocol()
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        return OTLPSpanExporter(endpoint=endpoint, insecure=True)
    if protocol == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        return OTLPSpanExporter(endpoint=endpoint)
    raise ValueError(f"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL must be grpc or http/protobuf, got "
                     f"{protocol!r}")
