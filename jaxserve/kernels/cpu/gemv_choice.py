"""Up to how many rows float projections take the streaming GEMV (gemv.h) instead of oneDNN,
measured on this CPU for the model's own shapes (`ModelConfig.cpu_gemv_rows`, auto).

At a few rows a projection only streams its weights, and which kernel streams them faster
depends on the CPU: on a 2-core AVX2 EPYC, SmolLM2-135M's seven float32 projections x 30
layers took 23.5 ms on the GEMV against 27.2 ms on oneDNN at 1 row, 28.3 against 41.2 at 2,
about even at 4 and 45.3 against 38.6 at 8 (benchmarks/bench_layer_matmul.py); a CPU with
bf16 units moves the crossing. So the engine times both on the model's projection shapes
before it traces a step and keeps the GEMV for each row count (1, 2, 4, 8, in order) where it
saves the most: the GEMV takes every row count up to a limit (the kernel's `gemv_rows`), and
the limit chosen is the one whose row counts gain most in all.

The timing (timings.py) reads more weights per call than a CPU's caches hold, interleaves the
two kernels and keeps each one's fastest call; the choice is kept per process and shape, and
on disk beside the compilation cache (`load_or_measure`), so a restart neither pays for the
timing again nor flips the choice.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax.numpy as jnp

from jaxserve.kernels.cpu.timings import (
    MAX_LAYERS,
    StackedProjections,
    fastest_calls,
    stored_or_measured,
)

ROW_COUNTS = (1, 2, 4, 8)
MARGIN = 0.95            # the GEMV must save at least 5 %: a tie keeps oneDNN
STORE = "jaxserve-gemv-rows.json"


@dataclass(frozen=True)
class GemvChoice:
    rows: int                                    # GEMV at <= rows, oneDNN above
    timings: dict[int, tuple[float, float]]      # rows -> (GEMV ms, oneDNN ms) per call

    def describe(self) -> str:
        measured = "; ".join(f"{r} row{'s' if r > 1 else ''} {g:.2f} vs {o:.2f} ms"
                             for r, (g, o) in self.timings.items())
        return (f"streaming GEMV at <= {self.rows} rows, oneDNN above" if self.rows else
                "oneDNN at every row count") + f" (GEMV vs oneDNN, measured here: {measured})"


def choose_rows(timings: dict[int, tuple[float, float]], margin: float = MARGIN) -> int:
    """The GEMV's row limit that saves the most time over the measured row counts up to it
    (a noisy tie at one count does not throw away a clear win at the next); 0 unless that
    saving is at least 1 - `margin` of oneDNN's time over those counts."""
    best, best_saved, saved, onednn_total = 0, 0.0, 0.0, 0.0
    for r in sorted(timings):
        gemv_ms, onednn_ms = timings[r]
        saved += onednn_ms - gemv_ms
        onednn_total += onednn_ms
        if saved > best_saved and saved >= (1 - margin) * onednn_total:
            best, best_saved = r, saved
    return best


def measure_gemv_rows(dtype, shapes: tuple[tuple[int, int], ...], num_layers: int,
                      repeats: int = 9) -> GemvChoice:
    """Time both kernels on `shapes` (stacked over enough layers) at each of ROW_COUNTS."""
    return _measure(jnp.dtype(dtype).name, tuple(shapes), int(num_layers), repeats)


@functools.lru_cache(maxsize=None)
def _measure(dtype_name: str, shapes: tuple[tuple[int, int], ...], num_layers: int,
             repeats: int) -> GemvChoice:
    stack = StackedProjections(dtype_name, shapes, num_layers)
    # (rows, the GEMV's limit): the GEMV takes `rows` at a limit of `rows`, oneDNN at 0
    programs = stack.programs(tuple((rows, limit) for rows in ROW_COUNTS
                                    for limit in (rows, 0)))
    timings: dict[int, tuple[float, float]] = {}
    for rows in ROW_COUNTS:
        best = fastest_calls({"gemv": programs[rows, rows], "onednn": programs[rows, 0]},
                             repeats, per=stack.layers)
        timings[rows] = (best["gemv"], best["onednn"])
    return GemvChoice(choose_rows(timings), timings)


def load_or_measure(cache_dir: str | None, dtype, shapes: tuple[tuple[int, int], ...],
                    num_layers: int) -> tuple[GemvChoice, bool]:
    """(the choice, whether it was read from disk): the one stored for this CPU, dtype and
    shapes under `cache_dir`, else measured now (and stored there when it is set)."""
    def measure() -> dict:
        choice = measure_gemv_rows(dtype, shapes, num_layers)
        return {"rows": choice.rows, "timings": choice.timings}

    entry, stored = stored_or_measured(
        cache_dir, STORE, [jnp.dtype(dtype).name, [list(s) for s in shapes],
                           min(int(num_layers), MAX_LAYERS)], measure)
    return GemvChoice(int(entry["rows"]), {int(r): tuple(t) for r, t in
                                           entry["timings"].items()}), stored
