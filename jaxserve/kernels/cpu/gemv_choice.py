"""Up to how many rows float projections take matmul.cc's streaming GEMV instead of oneDNN,
measured on this CPU for the model's own shapes (`ModelConfig.cpu_gemv_rows`, auto).

At a few rows a projection only streams its weights, and which kernel streams them faster
depends on the CPU: on a 2-core AVX2 EPYC, SmolLM2-135M's seven float32 projections x 30
layers took 23.5 ms on the GEMV against 27.2 ms on oneDNN at 1 row, 28.3 against 41.2 at 2,
about even at 4 and 45.3 against 38.6 at 8 (benchmarks/bench_layer_matmul.py); a CPU with
bf16 units moves the crossing. So the engine times both on the model's projection shapes
before it traces a step and keeps the GEMV for each row count (1, 2, 4, 8, in order) where it
saves the most: the GEMV takes every row count up to a limit (the kernel's `gemv_rows`), and
the limit chosen is the one whose row counts gain most in all.

The timing reads about MEASURED_BYTES of weights per call (more than a CPU's last-level
cache, as a decode step does), interleaves the two kernels (a shared, noisy box slows both
alike) and takes each kernel's fastest call (what it can do, not what a neighbour left it).
The choice is kept per process and shape, and on disk beside the compilation cache
(`load_or_measure`), so a restart neither pays for the timing again nor flips the choice.
"""

from __future__ import annotations

import concurrent.futures
import functools
import hashlib
import json
import logging
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp

logger = logging.getLogger(__name__)

ROW_COUNTS = (1, 2, 4, 8)
MEASURED_BYTES = 96 << 20
MARGIN = 0.95            # the GEMV must save at least 5 %: a tie keeps oneDNN
MAX_LAYERS = 16


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


def worth_measuring(dtype, shapes: tuple[tuple[int, int], ...], num_layers: int) -> bool:
    """Whether the model's projections outgrow MEASURED_BYTES. A smaller model's weights sit
    in the CPU's caches, where neither kernel streams anything and a 2 s timing would decide
    nothing a user can see: it keeps oneDNN, untimed."""
    return sum(i * o for i, o in shapes) * num_layers * jnp.dtype(dtype).itemsize \
        >= MEASURED_BYTES


def projection_shapes(arch) -> tuple[tuple[int, int], ...]:
    """[in, out] of one decoder layer's dense projections (q, k, v, o, gate, up, down)."""
    h, i = arch.hidden_size, arch.intermediate_size
    q, kv = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    return ((h, q), (h, kv), (h, kv), (q, h), (h, i), (h, i), (i, h))


def measure_gemv_rows(dtype, shapes: tuple[tuple[int, int], ...], num_layers: int,
                      repeats: int = 9) -> GemvChoice:
    """Time both kernels on `shapes` (stacked over enough layers) at each of ROW_COUNTS."""
    return _measure(jnp.dtype(dtype).name, tuple(shapes), int(num_layers), repeats)


@functools.lru_cache(maxsize=None)
def _measure(dtype_name: str, shapes: tuple[tuple[int, int], ...], num_layers: int,
             repeats: int) -> GemvChoice:
    from jaxserve.kernels.cpu.matmul import layer_matmul

    dtype = jnp.dtype(dtype_name)
    layer_bytes = sum(i * o for i, o in shapes) * dtype.itemsize
    layers = max(1, min(num_layers, MAX_LAYERS, -(-MEASURED_BYTES // layer_bytes)))
    # Values do not change the kernels' speed; they only must be real, touched memory.
    weights = [jnp.full((layers, i, o), 0.01, dtype) for i, o in shapes]

    def forward(gemv_rows: int, weights, xs, carry):
        def layer(l, carry):
            total = carry
            for x, w in zip(xs, weights):
                y = layer_matmul((x + carry).astype(dtype), w, l, jnp.float32,
                                 gemv_rows=gemv_rows)
                total = total + 1e-9 * y[0, 0]        # every call feeds the next layer
            return total
        return jax.lax.fori_loop(0, layers, layer, carry)

    def compiled(rows: int, gemv_rows: int):
        xs = [jnp.full((rows, i), 0.5, jnp.float32) for i, _ in shapes]
        return jax.jit(functools.partial(forward, gemv_rows)).lower(
            weights, xs, jnp.float32(0)).compile(), xs

    # Compiling is most of the cost: two at a time (XLA compiles without the GIL).
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        programs = {(rows, kernel): pool.submit(compiled, rows, rows if kernel == "gemv" else 0)
                    for rows in ROW_COUNTS for kernel in ("gemv", "onednn")}
    timings: dict[int, tuple[float, float]] = {}
    for rows in ROW_COUNTS:
        (fn_gemv, xs), (fn_onednn, _) = (programs[rows, "gemv"].result(),
                                        programs[rows, "onednn"].result())
        fns = {"gemv": fn_gemv, "onednn": fn_onednn}
        times: dict[str, list[float]] = {"gemv": [], "onednn": []}
        for rep in range(repeats + 1):
            for kernel in (("gemv", "onednn") if rep % 2 else ("onednn", "gemv")):
                start = time.perf_counter()
                jax.block_until_ready(fns[kernel](weights, xs, jnp.float32(0)))
                if rep:                                   # the first call warms each up
                    times[kernel].append((time.perf_counter() - start) * 1e3 / layers)
        timings[rows] = (min(times["gemv"]), min(times["onednn"]))
    return GemvChoice(choose_rows(timings), timings)


def load_or_measure(cache_dir: str | None, dtype, shapes: tuple[tuple[int, int], ...],
                    num_layers: int) -> tuple[GemvChoice, bool]:
    """(the choice, whether it was read from disk): the one stored for this CPU, dtype and
    shapes under `cache_dir`, else measured now (and stored there when it is set)."""
    key = json.dumps([_cpu_name(), jnp.dtype(dtype).name, [list(s) for s in shapes],
                      min(int(num_layers), MAX_LAYERS), MEASURED_BYTES, _kernel_source()])
    path = Path(cache_dir) / "jaxserve-gemv-rows.json" if cache_dir else None
    stored = {}
    if path is not None and path.exists():
        try:
            stored = json.loads(path.read_text())
        except (OSError, ValueError):
            stored = {}
    if key in stored:
        entry = stored[key]
        return GemvChoice(int(entry["rows"]), {int(r): tuple(t) for r, t in
                                               entry["timings"].items()}), True
    choice = measure_gemv_rows(dtype, shapes, num_layers)
    if path is not None:
        stored[key] = {"rows": choice.rows, "timings": choice.timings}
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(stored, indent=1))
            tmp.replace(path)            # atomic: two servers starting at once both read JSON
        except OSError as exc:
            logger.warning("could not store the GEMV choice in %s: %s", path, exc)
    return choice, False


def _kernel_source() -> str:
    """A digest of the kernels' source (a choice timed against an older GEMV is stale)."""
    from jaxserve.kernels.cpu.build import HERE

    digest = hashlib.sha256()
    for name in ("matmul.cc", "parallel_for.h"):
        digest.update((HERE / name).read_bytes())
    return digest.hexdigest()[:16]


def _cpu_name() -> str:
    """The CPU's model name and flags (a choice measured on one CPU is not another's)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    fields = {}
    for line in info.splitlines():
        name, _, value = line.partition(":")
        fields.setdefault(name.strip(), value.strip())
        if "flags" in fields and "model name" in fields:
            break
    return f"{fields.get('model name', '?')} | {os.cpu_count()} cpus | {fields.get('flags', '')}"
