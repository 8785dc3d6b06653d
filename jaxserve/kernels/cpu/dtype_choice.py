"""Whether float32 or bfloat16 weights decode faster on this CPU, measured on the model's own
projection shapes: what dtype=auto chooses on a CPU (engine/compute_dtype.py).

Without bf16 units a CPU still streams bf16 weights at half float32's bytes -- the decode GEMV
widens them in registers -- so at the few rows where a step only reads its weights bfloat16
is faster (SmolLM2-135M on a 2-core AVX2 EPYC: 0.5-0.7x float32's time at 1-4 rows). Above
the GEMV's rows the products are the work, and without the units oneDNN's bf16 path widens
the weights to float32 first: 1.1-1.6x float32's time at 12-64 rows there. With the units
bfloat16 wins at every row count. Where the balance falls depends on the CPU and the model's
shapes, so it is timed:

at 1, 2, 4 and 8 rows and each doubling above up to the batch (16, 32, ... max_num_seqs, at
most 64), each dtype on the kernel its engine would take there (the GEMV up to the limit
gemv_choice.py measures for it, oneDNN above), the two dtypes interleaved.

The score is the geometric mean of bfloat16's time over float32's at those row counts, each
weighted by the doublings it stands for (1 each; max_num_seqs=48's last step 0.58): every
doubling of the load counts alike. bfloat16 is chosen when it scores under BF16_MARGIN: it
rounds the weights, so it must be clearly faster, by more than a timing's noise -- fresh
timings of SmolLM2 on one AVX2 EPYC scored 0.86 to 0.97 (a near-tie there: bfloat16 0.5-0.7x
at 1-4 rows, 1.2-1.3x at 16-64), and a choice must not flip between two starts of one box.
The score leaves out a tied LM head, which goes the same way as the projections (bf16
table: the GEMV at 1-8 rows, oneDNN's widening path above)."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from jaxserve.kernels.cpu import gemv_choice
from jaxserve.kernels.cpu.timings import (
    MAX_LAYERS,
    StackedProjections,
    compile_all,
    fastest_calls,
    stored_or_measured,
)

MAX_BATCH_ROWS = 64
BF16_MARGIN = 0.8
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


def batch_row_counts(max_num_seqs: int, above: int = 8) -> tuple[int, ...]:
    """The row counts timed above `above` (the GEMV's): each doubling, then the batch."""
    batch = max(1, min(int(max_num_seqs), MAX_BATCH_ROWS))
    counts, rows = [], above * 2
    while rows < batch:
        counts.append(rows)
        rows *= 2
    return tuple(counts + [batch]) if batch > above else ()


def score(timings: dict[int, tuple[float, float]]) -> float:
    """bfloat16's time over float32's, geometric mean over the row counts, each weighted by
    the doublings from the count before it (1 for the first)."""
    logs, weights, previous = 0.0, 0.0, None
    for rows in sorted(timings):
        f32_ms, bf16_ms = timings[rows]
        weight = 1.0 if previous is None else min(1.0, math.log2(rows / previous))
        logs += weight * math.log(bf16_ms / f32_ms)
        weights += weight
        previous = rows
    return math.exp(logs / weights)


def choose(timings: dict[int, tuple[float, float]]) -> DtypeChoice:
    s = score(timings)
    return DtypeChoice("bfloat16" if s < BF16_MARGIN else "float32", s, dict(timings))


def load_or_measure(cache_dir: str | None, shapes: tuple[tuple[int, int], ...],
                    num_layers: int, max_num_seqs: int) -> tuple[DtypeChoice, bool]:
    """(the choice, whether its timing was read from disk)."""
    # Each dtype's GEMV limit first (also stored: the chosen dtype's engine reads it back).
    gemv_rows = {name: gemv_choice.load_or_measure(cache_dir, name, shapes, num_layers)[0].rows
                 for name in ("float32", "bfloat16")}
    rows = tuple(r for r in gemv_choice.ROW_COUNTS if r <= max_num_seqs) + \
        batch_row_counts(max_num_seqs, max(gemv_choice.ROW_COUNTS))
    entry, stored = stored_or_measured(
        cache_dir, STORE, [[list(s) for s in shapes], min(int(num_layers), MAX_LAYERS),
                           list(rows), gemv_rows],
        lambda: _measure(tuple(shapes), int(num_layers), rows,
                         tuple(sorted(gemv_rows.items()))))
    return choose({int(r): (float(t["float32"]), float(t["bfloat16"]))
                   for r, t in entry.items()}), stored


@functools.lru_cache(maxsize=None)
def _measure(shapes: tuple[tuple[int, int], ...], num_layers: int, row_counts: tuple[int, ...],
             gemv_rows: tuple[tuple[str, int], ...], repeats: int = 7) -> dict:
    """{rows: {dtype: ms per layer}}, each dtype on the kernel its engine takes at that row
    count (the GEMV up to its measured limit, oneDNN above), the two interleaved: timed
    apart, a shared box's drift between them moved the 1-row ratio from 0.52 to 0.72."""
    limits = dict(gemv_rows)
    stacks = {name: StackedProjections(name, shapes, num_layers) for name in limits}
    programs = compile_all({
        (rows, name): functools.partial(stack.program, rows,
                                        rows if rows <= limits[name] else 0)
        for rows in row_counts for name, stack in stacks.items()})
    result = {}
    for rows in row_counts:
        # per layer: the two stacks hold different layer counts (the same bytes)
        best = fastest_calls({name: programs[rows, name] for name in stacks}, repeats)
        result[str(rows)] = {name: best[name] / stacks[name].layers for name in stacks}
    return result
