"""Data parallelism: N engine-core replicas on sub-meshes behind one engine core's interface.

Each replica is a whole `EngineCore` (weights, KV cache, scheduler, runner) on
its own (1, tp) row of the ``('data', 'model')`` mesh. The front routes every
new request to the least-loaded replica (fewest unfinished requests, then the
emptiest KV cache) and steps all replicas that have work at once, on one
thread each: XLA releases the GIL while a replica's step runs, so replicas on
different devices overlap.

    core = DataParallelEngineCore(EngineConfig.from_kwargs(model=..., data_parallel_size=2))
    core.add_request(request)                               # -> the idle replica
    core.step()                                             # steps both replicas
    core.replica_stats()                                    # per-replica counters

It is an `EngineCoreInterface` like one `EngineCore`: `snapshot` sums the replicas' gauges and
counters, and `add_metrics` adds the per-replica series
(``jaxserve:replica_*{replica="0"}``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from jaxserve.config import EngineConfig
from jaxserve.engine.engine_io import EngineCoreOutput, EngineRequest
from jaxserve.engine.snapshot import EngineSnapshot, combine_snapshots
from jaxserve.mesh import describe, make_mesh, replica_meshes

logger = logging.getLogger(__name__)


class DataParallelEngineCore:
    """`data_parallel_size` EngineCore replicas behind EngineCore's interface (one caller
    thread)."""

    def __init__(self, config: EngineConfig, *, log_stats: bool | None = None,
                 mesh: Any = None) -> None:
        from jaxserve.engine.core import EngineCore

        pc = config.parallel_config
        # A replica's row holds its pipeline stages side by side (pp x tp devices; each
        # engine splits its row into stages: models/pipeline_placement.py).
        mesh = mesh if mesh is not None else make_mesh(
            pc.tensor_parallel_size * pc.pipeline_parallel_size, pc.data_parallel_size)
        logger.info("data parallel %d: one engine per row of a %s", pc.data_parallel_size,
                    describe(mesh))
        # Each replica loads the checkpoint itself (host memory x dp during startup).
        self.replicas = [EngineCore(config, log_stats=log_stats, mesh=sub_mesh)
                         for sub_mesh in replica_meshes(mesh)]
        first = self.replicas[0]
        self.config = first.config      # resolved (read-only), as each replica's
        self.mesh = mesh
        self.setup = first.setup
        self.tokenizer = first.tokenizer
        self.max_model_len = first.max_model_len
        self.vocab_size = first.vocab_size
        self.model_path = first.model_path
        self.lora_registry = None                      # config resolution refuses LoRA with dp > 1
        self.num_routed = [0] * len(self.replicas)     # requests sent to each replica
        self._owner: dict[str, int] = {}                # request id -> replica index
        self._pool = ThreadPoolExecutor(len(self.replicas), thread_name_prefix="jaxserve-dp")
        self.fault_hook: Any = None       # tests only: a step fault (engine/protocol.py)

    # -- requests ------------------------------------------------------------------------------
    def least_loaded(self) -> int:
        """Replica with the fewest unfinished requests, then the most free KV blocks."""
        return min(range(len(self.replicas)), key=lambda i: (
            self.replicas[i].get_num_unfinished_requests(),
            self.replicas[i].block_manager.usage, i))

    def snapshot(self) -> EngineSnapshot:
        """The replicas' gauges and counters, summed (KV usage: over all replicas' blocks)."""
        return combine_snapshots([replica.snapshot() for replica in self.replicas])

    def add_request(self, request: EngineRequest) -> None:
        """Queue a validated request on the least-loaded replica."""
        if request.request_id in self._owner:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        index = self.least_loaded()
        self.replicas[index].add_request(request)
        self._owner[request.request_id] = index
        self.num_routed[index] += 1

    def finish_sequences(self, sequences: Iterable[tuple[str, int]]) -> None:
        for request_id, index in sequences:
            if request_id in self._owner:
                self.replicas[self._owner[request_id]].finish_sequences([(request_id, index)])

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        by_replica: dict[int, list[str]] = {}
        for request_id in request_ids:
            if request_id in self._owner:
                by_replica.setdefault(self._owner[request_id], []).append(request_id)
        for index, ids in by_replica.items():
            self.replicas[index].abort_request(ids)

    def has_unfinished_requests(self) -> bool:
        return any(r.has_unfinished_requests() for r in self.replicas)

    def get_num_unfinished_requests(self) -> int:
        return sum(r.get_num_unfinished_requests() for r in self.replicas)

    def unscheduled_requests(self) -> dict[str, float]:
        return {k: v for r in self.replicas for k, v in r.unscheduled_requests().items()}

    def recover(self) -> None:
        """Every replica starts over: one replica's failed step fails the whole step."""
        for replica in self.replicas:
            replica.recover()
        self._owner.clear()

    # -- the loop ------------------------------------------------------------------------------
    def step(self) -> list[EngineCoreOutput]:
        """Step every replica that has work, concurrently; their outputs, replica order."""
        if self.fault_hook is not None:
            self.fault_hook()
        busy = [r for r in self.replicas if r.has_unfinished_requests()]
        if len(busy) <= 1:
            results = [r.step() for r in busy]
        else:
            results = list(self._pool.map(lambda replica: replica.step(), busy))
        outputs = [out for result in results for out in result]
        for out in outputs:
            if out.finished:
                self._owner.pop(out.request_id, None)
        return outputs

    def prompt_logits(self, prompt_token_ids: list[int], lora_request: Any = None) -> Any:
        return self.replicas[0].prompt_logits(prompt_token_ids, lora_request)

    # -- per-replica metrics -------------------------------------------------------------------
    def replica_stats(self) -> list[dict[str, float]]:
        """One dict per replica: load now and totals since start."""
        return [{
            "replica": index,
            "num_requests_routed": self.num_routed[index],
            "num_requests_running": r.scheduler.num_running,
            "num_requests_waiting": r.scheduler.num_waiting,
            "kv_cache_usage_perc": r.block_manager.usage,
            "num_steps": r.stats.num_steps,
            "prompt_tokens": r.stats.num_prompt_tokens,
            "generation_tokens": r.stats.num_generation_tokens,
        } for index, r in enumerate(self.replicas)]

    def add_metrics(self, registry: Any, model_name: str) -> None:
        """Register per-replica Prometheus series on `registry` (the server's /metrics)."""
        registry.register(ReplicaCollector(self, model_name))

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False)


_SERIES = {   # replica_stats key -> (metric name, kind, help)
    "num_requests_routed": ("jaxserve:replica_requests_routed", "counter",
                            "Requests routed to this data-parallel replica."),
    "num_requests_running": ("jaxserve:replica_num_requests_running", "gauge",
                             "Sequences in this replica's running batch."),
    "num_requests_waiting": ("jaxserve:replica_num_requests_waiting", "gauge",
                             "Sequences waiting in this replica's queue."),
    "kv_cache_usage_perc": ("jaxserve:replica_kv_cache_usage_perc", "gauge",
                            "Fraction of this replica's KV-cache blocks in use."),
    "num_steps": ("jaxserve:replica_steps", "counter", "Engine steps this replica ran."),
    "prompt_tokens": ("jaxserve:replica_prompt_tokens", "counter",
                      "Prefill tokens this replica computed."),
    "generation_tokens": ("jaxserve:replica_generation_tokens", "counter",
                          "Tokens this replica generated."),
}


class ReplicaCollector:
    """Prometheus collector: each `replica_stats` entry as a series labelled by replica."""

    def __init__(self, engine: DataParallelEngineCore, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        stats = self.engine.replica_stats()
        for key, (name, kind, doc) in _SERIES.items():
            family = (CounterMetricFamily if kind == "counter" else GaugeMetricFamily)(
                name, doc, labels=["model_name", "replica"])
            for row in stats:
                family.add_metric([self.model_name, str(row["replica"])], row[key])
            yield family
