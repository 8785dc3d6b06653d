"""What ``--dtype`` means on this machine, and why, for the startup log: the one rule.

`serve`, `LLM`, `jaxserve compile` and the model sources all call `resolve_dtype`, so an
executable compiled ahead of time has the dtype the engine that loads it would choose.
Above the kernels layer because ``auto`` depends on what the CPU can do: on a CPU without
bf16 units, for a model whose weights outgrow its caches, the whole decode step is timed in
both dtypes at the row counts that decide throughput (dtype_step_timing.py) and
`choose_by_step_times` picks; else its matrix units (or the kind `ModelConfig.matrix_units`
names) and whether the oneDNN matmul library loads.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from jaxserve.dtypes import dtype_by_name
from jaxserve.platforms import Platform, platform_named

logger = logging.getLogger(__name__)


# float32 is kept where it is at most this much slower than bfloat16 at every row count
# timed: bfloat16 rounds the weights, and a fresh timing's spread on a shared box is ~2 %.
FLOAT32_TIE = 0.03


@dataclass(frozen=True)
class StepShape:
    """A decode step's sizes, what dtype_step_timing.py builds its step from."""
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int

    @property
    def q_width(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.kv_heads * self.head_dim

    def key(self) -> tuple[int, ...]:
        return (self.hidden, self.intermediate, self.heads, self.kv_heads, self.head_dim,
                self.vocab)


@dataclass(frozen=True)
class DtypeWorkload:
    """What a measured dtype=auto times on a CPU: the model's step and batch."""
    shapes: tuple[tuple[int, int], ...]     # one layer's [in, out] (timings.projection_shapes)
    num_layers: int
    max_num_seqs: int
    # float projections read in place by one device (no quantization, tp 1): what is timed
    in_place_float: bool
    cache_dir: str | None                   # where timings are stored (None: not stored)
    step: StepShape | None = None           # None: derived from `shapes` (vocab unknown: 0)

    @classmethod
    def of(cls, config: Any, arch: Any, cache_dir: str | None) -> DtypeWorkload:
        from jaxserve.kernels.cpu.timings import projection_shapes

        return cls(projection_shapes(arch), arch.num_layers,
                   config.scheduler_config.max_num_seqs,
                   config.model_config.quantization in (None, "none")
                   and config.parallel_config.tensor_parallel_size == 1, cache_dir,
                   StepShape(arch.hidden_size, arch.intermediate_size, arch.num_heads,
                             arch.num_kv_heads, arch.head_dim, arch.vocab_size))


@dataclass(frozen=True)
class DtypeChoice:
    """What the rule chose from whole-step timings, and the numbers it saw."""
    dtype: str                                   # "float32" or "bfloat16"
    float32_worst: float     # float32's step time over bfloat16's, at its worst row count
    bfloat16_worst: float    # the reverse
    timings: dict[int, tuple[float, float]]      # rows -> (float32 ms, bfloat16 ms) per step

    def describe(self) -> str:
        rows = ", ".join(f"{r} row{'s' if r > 1 else ''} {f:.1f}/{b:.1f} ms"
                         for r, (f, b) in sorted(self.timings.items()))
        return (f"{self.dtype}: the whole decode step timed on this CPU, float32/bfloat16 "
                f"({rows}); at its worst float32 takes {self.float32_worst:.2f}x "
                f"bfloat16's time, bfloat16 {self.bfloat16_worst:.2f}x float32's; the one "
                f"that loses less at its worst row count, float32 on a tie within "
                f"{FLOAT32_TIE:.0%}")


def choose_by_step_times(timings: dict[int, tuple[float, float]]) -> DtypeChoice:
    """float32 or bfloat16 from whole-step times {rows: (float32 ms, bfloat16 ms)}: the dtype
    whose worst ratio to the faster one over the row counts is smaller (least worst-case
    loss, the figure `auto` is judged by: within a few % of the better dtype at one stream
    and at the batch), float32 where it is at most FLOAT32_TIE slower everywhere or loses no
    more than bfloat16 would.

    No cliff: where the choice flips, the two dtypes' worst losses are equal (or float32's
    is FLOAT32_TIE), so a timing's error of a few % moves the served speed by as much, never
    by a dtype's whole difference. A sum of step times would let the batch's long step
    outvote a 1.4x loss at one stream; a ratio against a fixed margin (bfloat16 under 0.8x)
    let a 1 % difference throw away a 1.4x win."""
    float32_worst, bfloat16_worst = _worst_ratios(timings)
    keep_float32 = float32_worst <= max(1.0 + FLOAT32_TIE, bfloat16_worst)
    return DtypeChoice("float32" if keep_float32 else "bfloat16", float32_worst,
                       bfloat16_worst, dict(timings))


def decision_margin(timings: dict[int, tuple[float, float]]) -> float:
    """How far whole-step times {rows: (float32 ms, bfloat16 ms)} are from flipping
    `choose_by_step_times`: float32's worst ratio over the most it may lose and be kept
    (FLOAT32_TIE, or bfloat16's worst), or the inverse, whichever is >= 1. 1.0: on the edge;
    1.1: every time would have to move ~5 % the right way to flip it. What lets the timing
    stop calling early (dtype_step_timing.py)."""
    float32_worst, bfloat16_worst = _worst_ratios(timings)
    ratio = float32_worst / max(1.0 + FLOAT32_TIE, bfloat16_worst)
    return max(ratio, 1.0 / ratio)


def _worst_ratios(timings: dict[int, tuple[float, float]]) -> tuple[float, float]:
    """(float32's worst step time over bfloat16's, the reverse) over the row counts."""
    if not timings:
        raise ValueError("choose_by_step_times needs at least one row count's timings")
    return (max(f / b for f, b in timings.values()),
            max(b / f for f, b in timings.values()))


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
    CPU, given the model
    (`workload`), a CPU (or forced ``matrix_units`` kind) without bf16 units and float
    projections read in place: float32 or bfloat16 by `choose_by_step_times` from the whole
    decode step timed here once in both and stored (dtype_step_timing.py). Otherwise by the
    CPU's kind: bfloat16 where it computes
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
    """(dtype, why) from whole decode steps timed on this CPU, or None where the rule by
    kind applies: no model given, quantized or sharded projections, several processes (each
    one's timing could differ), weights that fit the caches (nothing to stream: a timing
    decides nothing), no oneDNN library -- or a kind (detected, or forced by
    ``matrix_units``) with bf16 matrix units, where there is no trade to measure: bfloat16
    reads half the bytes at decode rows and the units multiply it faster above (an AMX Xeon:
    1.35-1.4x float32's served throughput at one stream and at 64). A forced kind without
    units is timed like a real one: the timing measures the kernels this process runs
    (ONEDNN_MAX_CPU_ISA=AVX2 makes them an AVX2 CPU's)."""
    if workload is None or not workload.in_place_float or workload.step is None:
        return None
    if jax.process_count() > 1:
        return None
    from jaxserve.kernels.cpu import matmul
    from jaxserve.kernels.cpu.timings import worth_measuring

    if matmul.matrix_units_for(matrix_units).bf16:
        return None
    if not worth_measuring(jnp.float32, workload.shapes, workload.num_layers) or \
            not matmul.available():
        return None
    from jaxserve.engine import dtype_step_timing
    from jaxserve.kernels.cpu import gemv_choice

    started = time.perf_counter()
    try:
        # each dtype's GEMV limit (also stored: the chosen dtype's engine reads it back)
        gemv_rows = {name: gemv_choice.load_or_measure(workload.cache_dir, name,
                                                       workload.shapes,
                                                       workload.num_layers)[0].rows
                     for name in dtype_step_timing.DTYPES}
        timings, stored = dtype_step_timing.load_or_measure(
            workload.cache_dir, workload.step, workload.num_layers, workload.max_num_seqs,
            gemv_rows)
    except Exception as exc:     # a timing that cannot run must not stop the server
        logger.warning("could not time float32 against bfloat16 on this CPU (%r): choosing "
                       "by its kind", exc)
        return None
    choice = choose_by_step_times(timings)
    units = matmul.matrix_units_for(matrix_units).describe()
    cost = "stored timing" if stored else f"timed in {time.perf_counter() - started:.1f} s"
    return dtype_by_name(choice.dtype), f"{choice.describe()}; bf16 units: {units}; {cost}"
