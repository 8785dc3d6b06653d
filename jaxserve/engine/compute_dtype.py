"""What ``--dtype`` means on this machine, and why, for the startup log: the one rule.

`serve`, `LLM`, `jaxserve compile` and the model sources all call `resolve_dtype`, so an
executable compiled ahead of time has the dtype the engine that loads it would choose.
Above the kernels layer because ``auto`` depends on what the CPU can do: on a CPU, for a
model whose weights outgrow its caches, which of float32 and bfloat16 decodes faster, timed
here on the model's shapes (kernels/cpu/dtype_choice.py); else its matrix units (or the kind
`ModelConfig.matrix_units` names) and whether the oneDNN matmul library loads.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from jaxserve.dtypes import dtype_by_name
from jaxserve.platforms import Platform, platform_named

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DtypeWorkload:
    """What a measured dtype=auto times on a CPU: the model's projections and batch."""
    shapes: tuple[tuple[int, int], ...]     # one layer's [in, out] (timings.projection_shapes)
    num_layers: int
    max_num_seqs: int
    # float projections read in place by one device (no quantization, tp 1): what is timed
    in_place_float: bool
    cache_dir: str | None                   # where timings are stored (None: not stored)

    @classmethod
    def of(cls, config: Any, arch: Any, cache_dir: str | None) -> DtypeWorkload:
        from jaxserve.kernels.cpu.timings import projection_shapes

        return cls(projection_shapes(arch), arch.num_layers,
                   config.scheduler_config.max_num_seqs,
                   config.model_config.quantization is None
                   and config.parallel_config.tensor_parallel_size == 1, cache_dir)


def resolve_dtype(name: str, platform: Platform | str, matrix_units: str = "auto",
                  workload: DtypeWorkload | None = None):
    """The jnp dtype for ``--dtype name`` on ``platform`` (``auto``: `auto_compute_dtype`)."""
    if name == "auto":
        return auto_compute_dtype(platform, matrix_units, workload)[0]
    return dtype_by_name(name)


def auto_compute_dtype(platform: Platform | str, matrix_units: str = "auto",
                       workload: DtypeWorkload | None = None) -> tuple[Any, str]:
    """dtype="auto": (dtype, why); `platform` an object, or its name (looked up). Where the
    platform fixes it (bfloat16 on every accelerator: `Platform.auto_dtype`), that. On a
    CPU, given the model (`workload`), a CPU without bf16 units and neither a forced ``matrix_units`` kind nor
    quantized projections: the faster of float32 and bfloat16 on its shapes, timed here once
    and stored (kernels/cpu/dtype_choice.py). Otherwise by the CPU's kind: bfloat16 where it computes
    bf16 products in hardware (AMX-BF16 or AVX512-BF16; or ``matrix_units`` names such a
    kind) and the oneDNN matmul library loads -- several times float32's speed at batch sizes
    above a few rows there; float32 elsewhere. vLLM's CPU build chooses by the kind alone."""
    platform = platform if isinstance(platform, Platform) else platform_named(platform)
    if platform.auto_dtype is not None:      # one dtype for every model there
        return platform.auto_dtype, f"{platform.name}: {jnp.dtype(platform.auto_dtype).name}"
    measured = _measured_cpu_dtype(matrix_units, workload)
    if measured is not None:
        return measured
    from jaxserve.kernels.cpu import matmul

    units = matmul.matrix_units_for(matrix_units)
    source = "this CPU" if matrix_units == "auto" else f"matrix_units={matrix_units}"
    if not units.bf16:
        # Untimed (see _measured_cpu_dtype): the decode GEMV streams bf16 weights without the
        # units (half the bytes), but batches above its few rows go through bf16 widened to
        # f32 (~10 % slower at 64 rows on an AVX2 EPYC): without a timing, keep float32.
        return jnp.float32, (f"float32: {source} has no bf16 matrix units (AMX-BF16 / "
                             f"AVX512-BF16; found: {units.describe()}); --dtype bfloat16 "
                             "decodes a few streams faster here (half the bytes to read) "
                             "and large batches slower")
    if not matmul.available():
        return jnp.float32, "float32: the oneDNN matmul library is unavailable (see warning)"
    return jnp.bfloat16, (f"bfloat16 on {source}'s matrix units ({units.describe()}) via "
                          "oneDNN: faster than float32 at every row count there (half the "
                          "bytes at decode rows, the units' products above), nothing to time")


def _measured_cpu_dtype(matrix_units: str, workload: DtypeWorkload | None
                        ) -> tuple[Any, str] | None:
    """(dtype, why) timed on this CPU, or None where the rule by kind applies: no model
    given, a forced ``matrix_units`` kind (a timing cannot emulate another CPU), quantized
    or sharded projections, several processes (each one's timing could differ), weights that
    fit the caches (nothing to stream: a timing decides nothing), no oneDNN library -- or a
    CPU with bf16 matrix units, where there is no trade to measure: bfloat16 reads half the
    bytes at decode rows and the units multiply it faster above, so it wins at every row
    count (an AMX Xeon: 0.84x float32's projection time at 1 row, 0.66x at 64, 1.35-1.4x
    the served throughput), and a timing's threshold could only turn that win into a loss.
    What is timed is a CPU without the units, where bfloat16 wins at few rows and loses
    where oneDNN widens it to float32."""
    if workload is None or matrix_units != "auto" or not workload.in_place_float:
        return None
    if jax.process_count() > 1:
        return None
    from jaxserve.kernels.cpu import matmul
    from jaxserve.kernels.cpu.timings import worth_measuring

    if matmul.matrix_units_for("auto").bf16:
        return None
    if not worth_measuring(jnp.float32, workload.shapes, workload.num_layers) or \
            not matmul.available():
        return None
    from jaxserve.kernels.cpu import dtype_choice

    try:
        choice, stored = dtype_choice.load_or_measure(workload.cache_dir, workload.shapes,
                                                      workload.num_layers,
                                                      workload.max_num_seqs)
    except Exception as exc:     # a timing that cannot run must not stop the server
        logger.warning("could not time float32 against bfloat16 on this CPU (%r): choosing "
                       "by its kind", exc)
        return None
    units = matmul.matrix_units_for("auto").describe()
    return dtype_by_name(choice.dtype), (f"{choice.describe()}; bf16 units: {units}"
                                         + ("; stored timing" if stored else ""))
