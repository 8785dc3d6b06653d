"""`create_engine_core(config)`: the engine core for the parallel config (LLM and `serve`).

    one process, dp = 1   EngineCore (tensor parallel over a (1, tp) mesh when tp > 1)
    one process, dp > 1   DataParallelEngineCore: dp EngineCores on the rows of a (dp, tp) mesh
    several processes     jax.distributed first; process 0 gets an EngineCore whose runner
                          broadcasts each step's inputs; every other process follows the
                          leader's steps until it stops and then exits (SystemExit(0))
"""

from __future__ import annotations

from typing import Any

from jaxserve.config import EngineConfig


def prepare_process(config: EngineConfig) -> bool:
    """Size the GPU pool and, in a multi-process run, join jax.distributed: both before JAX
    touches a device. True in a multi-process run; idempotent.

    jax.distributed installs its own SIGTERM handler (a preemption notifier) when it starts:
    a server calls this on its main thread before it installs its own, or SIGTERM would no
    longer drain it."""
    from jaxserve.parallel import distributed
    from jaxserve.runner.memory import size_gpu_pool

    # Before the first jax.devices(): the GPU pool's size is fixed when the backend starts.
    size_gpu_pool(config.cache_config.gpu_memory_utilization)
    return distributed.initialize(config.parallel_config)


def create_engine_core(config: EngineConfig, *, log_stats: bool | None = None) -> Any:
    """Build the engine core `config.parallel_config` asks for (an `EngineCoreInterface`).
    On a multi-host follower this never returns: the process serves the leader's steps, then
    raises SystemExit."""
    from jaxserve.engine.core import EngineCore
    from jaxserve.parallel import distributed

    parallel = config.parallel_config
    if prepare_process(config):
        if not distributed.is_leader():
            distributed.run_follower(config)
        core = EngineCore(config, log_stats=log_stats)
        distributed.lead(core.runner)
        return core
    if parallel.data_parallel_size > 1:
        from jaxserve.parallel.data_parallel import DataParallelEngineCore

        return DataParallelEngineCore(config, log_stats=log_stats)
    return EngineCore(config, log_stats=log_stats)
