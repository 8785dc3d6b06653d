"""--otlp-traces-endpoint: one `llm_request` span per request, with vLLM's attribute names,
received by an OTLP collector on loopback (gRPC, vLLM's default protocol, and
http/protobuf)."""

from __future__ import annotations

import http.server
import queue
import threading
import time

import httpx
import pytest

try:                                    # tests/ as a package or as a plain directory
    from tests.test_api_keys import Server, free_port
except ImportError:
    from test_api_keys import Server, free_port

grpc = pytest.importorskip("grpc", reason="pip install 'jaxserve[otel]'")
pytest.importorskip("opentelemetry.sdk", reason="pip install 'jaxserve[otel]'")

from opentelemetry.proto.collector.trace.v1 import (  # noqa: E402
    trace_service_pb2,
    trace_service_pb2_grpc,
)

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"


class GrpcCollector(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP/gRPC trace receiver: every span it is sent lands in `spans`."""

    def __init__(self) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self.spans: queue.Queue = queue.Queue()
        self.server = grpc.server(ThreadPoolExecutor(2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    def Export(self, request, context):    # noqa: N802 (the gRPC method's name)
        for resource_spans in request.resource_spans:
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    self.spans.put(span)
        return trace_service_pb2.ExportTraceServiceResponse()


def attributes(span) -> dict:
    out = {}
    for kv in span.attributes:
        value = kv.value
        out[kv.key] = getattr(value, value.WhichOneof("value"))
    return out


def wait_for_spans(spans: queue.Queue, count: int, timeout: float = 30.0) -> list:
    got, deadline = [], time.monotonic() + timeout
    while len(got) < count:
        got.append(spans.get(timeout=max(0.01, deadline - time.monotonic())))
    return got


def test_each_request_is_one_llm_request_span_with_vllms_attributes():
    collector = GrpcCollector()
    srv = Server(otlp_traces_endpoint=f"127.0.0.1:{collector.port}")
    try:
        body = {"model": "smol", "prompt": "abc", "max_tokens": 5, "temperature": 0.5,
                "top_p": 0.9}
        parent = {"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"}
        r = httpx.post(srv.url + "/v1/completions", json=body, headers=parent, timeout=30)
        assert r.status_code == 200
        stream = httpx.post(srv.url + "/v1/chat/completions", timeout=30, json={
            "model": "smol", "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 4, "stream": True})
        assert stream.status_code == 200
        srv.app.state.tracer.provider.force_flush()
        spans = wait_for_spans(collector.spans, 2)
        by_parent = {bool(s.parent_span_id): s for s in spans}
        child, root = by_parent[True], by_parent[False]
        assert child.name == root.name == "llm_request"
        assert child.kind == child.SPAN_KIND_SERVER
        assert child.trace_id.hex() == TRACE_ID and child.parent_span_id.hex() == PARENT_ID
        attrs = attributes(child)
        assert attrs["gen_ai.usage.prompt_tokens"] == 3
        assert attrs["gen_ai.usage.completion_tokens"] == 5
        assert attrs["gen_ai.request.max_tokens"] == 5
        assert attrs["gen_ai.request.temperature"] == 0.5
        assert attrs["gen_ai.request.top_p"] == pytest.approx(0.9)
        assert attrs["gen_ai.response.model"] == "smol"
        assert attrs["gen_ai.request.id"].startswith("cmpl-")
        for name in ("gen_ai.latency.e2e", "gen_ai.latency.time_in_queue",
                     "gen_ai.latency.time_to_first_token",
                     "gen_ai.latency.time_in_model_inference"):
            assert 0 <= attrs[name] < 30, name
        assert child.end_time_unix_nano > child.start_time_unix_nano
        assert attributes(root)["gen_ai.usage.completion_tokens"] == 4    # streamed
    finally:
        srv.stop()
        collector.server.stop(0)


@pytest.mark.fast
def test_http_protobuf_protocol_reaches_an_http_collector(monkeypatch):
    received: queue.Queue = queue.Queue()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):        # noqa: N802
            body = self.rfile.read(int(self.headers["content-length"]))
            request = trace_service_pb2.ExportTraceServiceRequest.FromString(body)
            for rs in request.resource_spans:
                for ss in rs.scope_spans:
                    for span in ss.spans:
                        received.put((self.path, span))
            self.send_response(200)
            self.send_header("content-type", "application/x-protobuf")
            self.end_headers()
            self.wfile.write(trace_service_pb2.ExportTraceServiceResponse().SerializeToString())

        def log_message(self, *args):
            pass

    port = free_port()
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")
    srv = Server(otlp_traces_endpoint=f"http://127.0.0.1:{port}/v1/traces")
    try:
        r = httpx.post(srv.url + "/v1/completions", timeout=30,
                       json={"model": "smol", "prompt": "a", "max_tokens": 2})
        assert r.status_code == 200
        srv.app.state.tracer.provider.force_flush()
        path, span = received.get(timeout=30)
        assert path == "/v1/traces" and span.name == "llm_request"
        assert attributes(span)["gen_ai.usage.completion_tokens"] == 2
    finally:
        srv.stop()
        httpd.shutdown()
