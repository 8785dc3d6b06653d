"""The execution plan a runner builds its model with (models/execution_plan.py), by platform.

  CPU, one device, the CPU attention backend, float32 / bfloat16, the matmul library loads:
      the scanned loop over stacked weights, projections read in place by the library
      (benchmarks/results/layer-layout-cpu.md: why stacked, not per-layer buffers)
  CPU otherwise: the scanned loop with XLA's dots
  GPU / TPU: the unrolled loop (a rolled scan copies each layer's weight slice every step:
      2.8x the weight-streaming time on an H200)
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from jaxserve.models.execution_plan import ExecutionPlan, LayerLoop
from jaxserve.models.layer_matmul import IN_PLACE_DTYPES
from jaxserve.platforms import Platform, platform_named


def choose_execution_plan(platform: Platform | str, backend_name: str, num_devices: int, dtype: Any,
                          gemv_rows: int = 0, packed_weights: bool = False) -> ExecutionPlan:
    """The plan for a model whose parameters live on ``platform`` ("cpu", "gpu"/"cuda",
    "tpu"), attended by backend ``backend_name`` over ``num_devices`` devices, computing in
    ``dtype``; gemv_rows: the measured streaming-GEMV row limit (kernels/cpu/gemv_choice.py);
    packed_weights: the parameters hold weights packed for oneDNN (engine/weight_packing.py)."""
    platform = platform if isinstance(platform, Platform) else platform_named(platform)
    if platform.unroll_layers:          # the platform's layer loop (jaxserve/platforms/)
        return ExecutionPlan(LayerLoop.UNROLLED)
    if backend_name == "cpu" and num_devices == 1 and jnp.dtype(dtype) in IN_PLACE_DTYPES \
            and _library_loads():
        return ExecutionPlan(LayerLoop.SCANNED, cpu_matmul=True, gemv_rows=gemv_rows,
                             packed_weights=packed_weights)
    return ExecutionPlan(LayerLoop.SCANNED)


def _library_loads() -> bool:
    from jaxserve.kernels.cpu.matmul import available

    return available()
