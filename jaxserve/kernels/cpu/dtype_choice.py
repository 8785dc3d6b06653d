"""Whether float32 or bfloat16 weights decode faster on this CPU, measured on the model's own
projection shapes: what dtype=auto chooses on a CPU (engine/compute_dtype.py).

Without bf16 units a CPU still streams bf16 weights at half float32's bytes -- the decode GEMV
widens them in registers -- so at the few rows where a step only reads its weights bfloat16
is faster (SmolLM2-135M on a 2-core AVX2 EPYC: 1.65x float32 for one stream). In a batch the
products are the work, and without the units oneDNN widens bf16 to float32 for them (~10 %
slower than float32 at 64 rows there). With the units bfloat16 wins at every row count. Where
the balance falls depends on the CPU and the model's shapes, so it is timed:

- at 1, 2, 4 and 8 rows each dtype on the kernel the engine would take there (the GEMV or
  oneDNN, gemv_choice.py: those timings, stored, are the chosen dtype's GEMV choice too);
- at the batch rows (max_num_seqs, at most 64) both dtypes on oneDNN, interleaved.

The score is the geometric mean of bfloat16's time over float32's at those row counts, the
batch's ratio weighted by the doublings from 8 rows it stands for (3 at 64 rows): every
doubling of the load counts alike. bfloat16 is chosen when it scores under BF16_MARGIN -- it
rounds the weights, so a tie keeps float32.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import jax.numpy as jnp

from jaxserve.kernels.cpu import gemv_choice
from jaxserve.kernels.cpu.timings import (
    MAX_LAYERS,
    StackedProjections,
    compile_all,
    fastest_calls,
    stored_or_measured,
)

MAX_BATCH_ROWS = 64
BF16_MARGIN = 0.95
STORE = "jaxserve-dtype-batch.json"


@dataclass(frozen=True)
class DtypeChoice:
    dtype: str                                   # "float32" or "bfloat16"
    score: float                                 # bf16 / f32 time, weighted geometric mean
    timings: dict[int, tuple[float, float]]      # rows -> (float32 ms, bfloat16 ms) per layer

    def describe(self) -> str:
        ratios = ", ".join(f"{r} row{'s' if r > 1 else ''} {b / f:.2f}x"
                           for r, (f, b) in sorted(self.timings.items()))
        return (f"{self.dtype}: measured on this CPU for the model's projections, bfloat16 "
                f"takes {self.score:.2f}x float32's time (weighted over {ratios}; bfloat16 "
                f"needs < {BF16_MARGIN})")


def batch_rows_for(max_num_seqs: int) -> int:
    return max(1, min(int(max_num_seqs), MAX_BATCH_ROWS))


def score(timings: dict[int, tuple[float, float]]) -> float:
    """bfloat16's time over float32's, geometric mean over the row counts, a count above 8
    rows weighted by the doublings from 8 it stands for."""
    logs, weights = 0.0, 0.0
    for rows, (f32_ms, bf16_ms) in timings.items():
        weight = math.log2(rows / 8) if rows > 8 else 1.0
        logs += weight * math.log(bf16_ms / f32_ms)
        weights += weight
    return math.exp(logs / weights)


def choose(timings: dict[int, tuple[float, float]]) -> DtypeChoice:
    s = score(timings)
    return DtypeChoice("bfloat16" if s < BF16_MARGIN else "float32", s, dict(timings))


def load_or_measure(cache_dir: str | None, shapes: tuple[tuple[int, int], ...],
                    num_layers: int, max_num_seqs: int) -> tuple[DtypeChoice, bool]:
    """(the choice, whether every timing was read from disk)."""
    few: dict[int, list[float]] = {}
    all_stored = True
    for dtype in (jnp.float32, jnp.bfloat16):
        choice, stored = gemv_choice.load_or_measure(cache_dir, dtype, shapes, num_layers)
        all_stored &= stored
        for rows, (gemv_ms, onednn_ms) in choice.timings.items():
            # per layer: the engine runs the GEMV at <= choice.rows, oneDNN above
            few.setdefault(rows, []).append(gemv_ms if rows <= choice.rows else onednn_ms)
    timings = {rows: (f32, bf16) for rows, (f32, bf16) in few.items()}
    batch = batch_rows_for(max_num_seqs)
    if batch > max(timings):
        entry, stored = stored_or_measured(
            cache_dir, STORE, [[list(s) for s in shapes], min(int(num_layers), MAX_LAYERS),
                               batch], lambda: _measure_batch(tuple(shapes), int(num_layers),
                                                              batch))
        all_stored &= stored
        timings[batch] = (float(entry["float32"]), float(entry["bfloat16"]))
    else:                      # a small max_num_seqs: only the row counts the engine runs
        timings = {rows: t for rows, t in timings.items() if rows <= batch}
    return choose(timings), all_stored


@functools.lru_cache(maxsize=None)
def _measure_batch(shapes: tuple[tuple[int, int], ...], num_layers: int, rows: int,
                   repeats: int = 5) -> dict:
    stacks = {name: StackedProjections(name, shapes, num_layers)
              for name in ("float32", "bfloat16")}
    programs = compile_all({name: functools.partial(stack.program, rows, 0)
                            for name, stack in stacks.items()})
    # per layer: the two stacks hold different layer counts (the same bytes)
    best = fastest_calls(programs, repeats)
    return {name: best[name] / stacks[name].layers for name in stacks}
