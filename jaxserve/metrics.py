"""Prometheus metrics for the server, vLLM's set under `jaxserve:` names.

Every metric has a `model_name` label. Engine-wide gauges and counters are
read at scrape time from the snapshot the engine thread publishes after each
step (`AsyncLLMEngine.snapshot`); per-request histograms and
`request_success` are recorded from the engine's outputs as they come out.
Each app gets its own `CollectorRegistry`, so a process can build several.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from jaxserve.engine.engine_io import EngineCoreOutput
from jaxserve.engine.snapshot import EngineSnapshot

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# vLLM's buckets (seconds).
_TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
_ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0]
_REQUEST_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                    60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]


class _EngineCollector(Collector):
    """Gauges and totals from the engine's latest snapshot, read when scraped."""

    def __init__(self, snapshot: Callable[[], EngineSnapshot], model_name: str) -> None:
        self.snapshot = snapshot
        self.model_name = model_name

    def collect(self) -> Iterator[Metric]:
        snap = self.snapshot()
        labels = [self.model_name]

        def gauge(name: str, doc: str, value: float) -> Metric:
            metric = GaugeMetricFamily(name, doc, labels=["model_name"])
            metric.add_metric(labels, value)
            return metric

        def counter(name: str, doc: str, value: float) -> Metric:
            metric = CounterMetricFamily(name, doc, labels=["model_name"])
            metric.add_metric(labels, value)
            return metric

        yield gauge("jaxserve:num_requests_running", "Sequences in the running batch.",
                    snap.num_running)
        yield gauge("jaxserve:num_requests_waiting", "Sequences waiting to be scheduled.",
                    snap.num_waiting)
        yield gauge("jaxserve:num_requests_active_cap",
                    "Most sequences that may run at once (--max-num-active-seqs; "
                    "--max-num-seqs when unset).", snap.max_num_active_seqs)
        yield gauge("jaxserve:num_requests_held_by_active_cap",
                    "Waiting sequences the running cap (--max-num-active-seqs) kept out of "
                    "the latest step.", snap.num_held_by_active_cap)
        yield gauge("jaxserve:kv_cache_usage_perc",
                    "Fraction of KV-cache blocks in use (1 = full).", snap.kv_cache_usage)
        yield counter("jaxserve:prefix_cache_queries",
                      "Prompt tokens looked up in the prefix cache.", snap.prefix_cache_queries)
        yield counter("jaxserve:prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                      snap.prefix_cache_hits)
        yield counter("jaxserve:num_preemptions", "Sequences preempted (KV cache full).",
                      snap.num_preemptions)
        yield counter("jaxserve:prompt_tokens", "Prefill tokens computed.",
                      snap.num_prompt_tokens)
        yield counter("jaxserve:generation_tokens", "Tokens generated.",
                      snap.num_generation_tokens)
        if snap.spec_decode_accepted_per_pos:      # speculative decoding on
            yield counter("jaxserve:spec_decode_num_drafts",
                          "Sequence steps that verified draft tokens.",
                          snap.spec_decode_num_drafts)
            yield counter("jaxserve:spec_decode_num_draft_tokens", "Draft tokens verified.",
                          snap.spec_decode_num_draft_tokens)
            yield counter("jaxserve:spec_decode_num_accepted_tokens", "Draft tokens accepted.",
                          snap.spec_decode_num_accepted_tokens)
            per_pos = CounterMetricFamily(
                "jaxserve:spec_decode_num_accepted_tokens_per_pos",
                "Draft tokens accepted, by position in the draft.",
                labels=["model_name", "position"])
            for position, value in enumerate(snap.spec_decode_accepted_per_pos):
                per_pos.add_metric([self.model_name, str(position)], value)
            yield per_pos
        if snap.max_lora:                          # LoRA on: vLLM's lora_requests_info
            info = GaugeMetricFamily(
                "jaxserve:lora_requests_info", "Running stats on LoRA requests (the value is "
                "the time of the snapshot, as vLLM's).",
                labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters"])
            info.add_metric([str(snap.max_lora), ",".join(snap.running_lora_adapters),
                             ",".join(snap.waiting_lora_adapters)], time.time())
            yield info


class _ResilienceCollector(Collector):
    """In-process engine restarts and rejected requests, read from the AsyncLLMEngine."""

    REASONS = ("queue_full", "queue_timeout")     # errors.QueueFullError / QueueTimeoutError

    def __init__(self, engine: Any, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name

    def collect(self) -> Iterator[Metric]:
        restarts = CounterMetricFamily(
            "jaxserve:engine_restarts", "In-process engine restarts after a failed step.",
            labels=["model_name"])
        restarts.add_metric([self.model_name], self.engine.num_restarts)
        yield restarts
        rejected = CounterMetricFamily(
            "jaxserve:num_requests_rejected", "Requests refused with 503 by admission "
            "control, by reason.", labels=["model_name", "reason"])
        counts = dict(self.engine.num_rejected)
        for reason in sorted(set(self.REASONS) | set(counts)):
            rejected.add_metric([self.model_name, reason], counts.get(reason, 0))
        yield rejected


class ServerMetrics:
    """The metrics of one app: a private registry plus per-request recording."""

    def __init__(self, model_name: str, snapshot: Callable[[], EngineSnapshot]) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(snapshot, model_name))
        labels = ["model_name"]
        self.request_success = Counter(
            "jaxserve:request_success", "Finished requests, by finish reason.",
            labels + ["finished_reason"], registry=self.registry)
        self.ttft = Histogram(
            "jaxserve:time_to_first_token_seconds", "Arrival to first generated token.",
            labels, buckets=_TTFT_BUCKETS, registry=self.registry)
        self.itl = Histogram(
            "jaxserve:inter_token_latency_seconds", "Time between a request's output steps.",
            labels, buckets=_ITL_BUCKETS, registry=self.registry)
        self.e2e = Histogram(
            "jaxserve:e2e_request_latency_seconds", "Arrival to finish.", labels,
            buckets=_REQUEST_BUCKETS, registry=self.registry)
        self.queue_time = Histogram(
            "jaxserve:request_queue_time_seconds", "Arrival to first scheduled.", labels,
            buckets=_REQUEST_BUCKETS, registry=self.registry)
        self._ttft = self.ttft.labels(model_name)
        self._itl = self.itl.labels(model_name)
        self._e2e = self.e2e.labels(model_name)
        self.tpot = Histogram(
            "jaxserve:request_time_per_output_token_seconds", "A finished request's time per "
            "output token after its first (first token to finish, over the tokens after it).",
            labels, buckets=_ITL_BUCKETS, registry=self.registry)
        self._queue_time = self.queue_time.labels(model_name)
        self._tpot = self.tpot.labels(model_name)
        for reason in ("stop", "length", "abort"):
            self.request_success.labels(model_name, reason)
        self._lock = threading.Lock()
        # request id -> (time of its first token, of its last, tokens so far): inter-token
        # latency and time per output token
        self._progress: dict[str, tuple[float, float, int]] = {}

    def observe(self, outputs: list[EngineCoreOutput], now: float) -> None:
        """Record a step's outputs (called on the engine thread). A FINAL_ONLY request
        without stop strings reports once, so it has no inter-token latency samples."""
        with self._lock:
            for out in outputs:
                self._observe_one(out, now)

    def _observe_one(self, out: EngineCoreOutput, now: float) -> None:
        m = out.metrics
        num_new = sum(len(s.new_token_ids) for s in out.seqs)
        progress = self._progress.get(out.request_id)
        if num_new:
            token_time = m.last_token_time if m.last_token_time else now
            if progress is None:
                if m.first_token_time is not None:
                    self._ttft.observe(max(0.0, m.first_token_time - m.arrival_time))
                if m.first_scheduled_time is not None:
                    self._queue_time.observe(max(0.0, m.first_scheduled_time - m.arrival_time))
                progress = (token_time, token_time, num_new)
            else:
                self._itl.observe(max(0.0, token_time - progress[1]))
                progress = (progress[0], token_time, progress[2] + num_new)
            self._progress[out.request_id] = progress
        if out.finished:
            self._progress.pop(out.request_id, None)
            reasons = [s.finish_reason or "abort" for s in out.seqs]
            reason = "abort" if "abort" in reasons else reasons[0] if reasons else "abort"
            self.request_success.labels(self.model_name, reason).inc()
            self._e2e.observe(max(0.0, (m.finished_time or now) - m.arrival_time))
            if progress is not None and progress[2] > 1:
                first, last, tokens = progress
                self._tpot.observe(max(0.0, last - first) / (tokens - 1))

    def forget(self, request_ids: list[str]) -> None:
        """Requests that ended with an error and no final output (engine thread)."""
        with self._lock:
            for request_id in request_ids:
                self._progress.pop(request_id, None)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def attach_metrics(engine: Any, model_name: str) -> ServerMetrics:
    """Metrics for an AsyncLLMEngine: snapshot gauges plus an output observer."""
    metrics = ServerMetrics(model_name, lambda: engine.snapshot)
    metrics.registry.register(_ResilienceCollector(engine, model_name))
    engine.add_output_observer(metrics.observe)
    engine.add_failure_observer(metrics.forget)
    return metrics
