"""Timing the model's projection shapes on this CPU, and keeping what was measured: what the
engine's measured choices (gemv_choice.py, engine/dtype_step_timing.py) share.

A timing reads about MEASURED_BYTES of weights per call -- more than a CPU's last-level cache,
as a decode step does -- stacked over enough layers of the model's own [in, out] shapes.
Variants are interleaved (a shared, noisy box slows both alike) and each keeps its fastest
call (what it can do, not what a neighbour left it). Results are stored in a JSON file beside
the compilation cache under a key naming the CPU and the kernels' source, so a restart
neither pays for the timing again nor flips the choice, and a kernel change re-times.
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
from pathlib import Path
from typing import Any, Callable, Hashable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

logger = logging.getLogger(__name__)

MEASURED_BYTES = 96 << 20
MAX_LAYERS = 16


def worth_measuring(dtype, shapes: tuple[tuple[int, int], ...], num_layers: int) -> bool:
    """Whether the model's projections outgrow MEASURED_BYTES. A smaller model's weights sit
    in the CPU's caches, where no kernel streams anything and a timing would decide nothing
    a user can see."""
    return sum(i * o for i, o in shapes) * num_layers * jnp.dtype(dtype).itemsize \
        >= MEASURED_BYTES


def projection_shapes(arch) -> tuple[tuple[int, int], ...]:
    """[in, out] of one decoder layer's dense projections (q, k, v, o, gate, up, down)."""
    h, i = arch.hidden_size, arch.intermediate_size
    q, kv = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    return ((h, q), (h, kv), (h, kv), (q, h), (h, i), (h, i), (i, h))


class StackedProjections:
    """One dtype's weights of `shapes`, stacked over enough layers to read MEASURED_BYTES,
    and programs that run every projection of every layer at a row count."""

    def __init__(self, dtype, shapes: tuple[tuple[int, int], ...], num_layers: int):
        self.dtype, self.shapes = jnp.dtype(dtype), tuple(shapes)
        layer_bytes = sum(i * o for i, o in shapes) * self.dtype.itemsize
        self.layers = max(1, min(num_layers, MAX_LAYERS, -(-MEASURED_BYTES // layer_bytes)))
        # Values do not change the kernels' speed; they only must be real, touched memory.
        self.weights = [filled((self.layers, i, o), 0.01, self.dtype) for i, o in shapes]

    def program(self, rows: int, gemv_rows: int) -> Callable[[], Any]:
        """A compiled forward at `rows` rows (the GEMV at <= gemv_rows, else oneDNN: the
        engine's `layer_matmul`), as a call that runs it once."""
        return self.programs(((rows, gemv_rows),))[rows, gemv_rows]

    def programs(self, variants: tuple[tuple[int, int], ...]
                 ) -> dict[tuple[int, int], Callable[[], Any]]:
        """{(rows, gemv_rows): a call that runs the forward once at `rows` rows (the GEMV at
        <= gemv_rows, else oneDNN: the engine's `layer_matmul`)}, every variant a branch of
        one compiled program picked by an index operand: compiling is most of a timing's
        cost, and one compile costs less than one per variant."""
        from jaxserve.kernels.cpu.matmul import layer_matmul

        dtype, layers = self.dtype, self.layers

        def forward(rows, gemv_rows, weights, xs, carry):
            def layer(l, carry):
                total = carry
                for x, w in zip(xs, weights):
                    y = layer_matmul((x[:rows] + carry).astype(dtype), w, l, jnp.float32,
                                     gemv_rows=gemv_rows)
                    total = total + 1e-9 * y[0, 0]        # every call feeds the next layer
                return total
            return jax.lax.fori_loop(0, layers, layer, carry)

        def switch(index, weights, xs, carry):
            return jax.lax.switch(index, [functools.partial(forward, *v) for v in variants],
                                  weights, xs, carry)

        most = max(rows for rows, _ in variants)
        xs = [filled((most, i), 0.5, jnp.float32) for i, _ in self.shapes]
        carry = jax.device_put(np.float32(0))
        return branch_calls(switch, len(variants), (self.weights, xs, carry), variants)


def filled(shape: tuple[int, ...], value: float, dtype: Any) -> jax.Array:
    """An array of `value` made on the host: a jnp.full per shape would compile a program of
    its own, and a timing's setup makes dozens."""
    return jax.device_put(np.full(shape, value, dtype))


def branch_calls(switch: Callable[..., Any], branches: int, args: tuple,
                 names: Sequence[Hashable]) -> dict[Hashable, Callable[[], Any]]:
    """Compile `switch(index, *args)` (a `lax.switch` over `branches` branches) once; returns
    {names[i]: a call that runs branch i on `args`}."""
    indices = [jax.device_put(np.int32(i)) for i in range(branches)]
    compiled = jax.jit(switch).lower(indices[0], *args).compile()
    return {name: functools.partial(compiled, index, *args)
            for name, index in zip(names, indices)}


def compile_all(builders: dict[Hashable, Callable[[], Callable[[], Any]]]
                ) -> dict[Hashable, Callable[[], Any]]:
    """Each builder's program; compiling is most of a timing's cost, so two at a time (XLA
    compiles without the GIL)."""
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        futures = {key: pool.submit(build) for key, build in builders.items()}
    return {key: future.result() for key, future in futures.items()}


def fastest_calls(programs: dict[Hashable, Callable[[], Any]], repeats: int,
                  per: int = 1) -> dict[Hashable, float]:
    """Each program's fastest of `repeats` calls in ms (divided by `per`), the programs
    interleaved in alternating order; a first call warms each up untimed."""
    keys = list(programs)
    times: dict[Hashable, list[float]] = {key: [] for key in keys}
    for rep in range(repeats + 1):
        for key in (keys if rep % 2 else keys[::-1]):
            start = time.perf_counter()
            jax.block_until_ready(programs[key]())
            if rep:
                times[key].append((time.perf_counter() - start) * 1e3 / per)
    return {key: min(t) for key, t in times.items()}


def stored_or_measured(cache_dir: str | None, filename: str, key_parts: list[Any],
                       measure: Callable[[], dict]) -> tuple[dict, bool]:
    """(the JSON-able result, whether it was read from disk): the one stored in
    `cache_dir`/`filename` under `key_parts` (plus this CPU and the kernels' source), else
    `measure()`, stored there when `cache_dir` is set."""
    key = json.dumps([_cpu_name(), *key_parts, MEASURED_BYTES, _kernel_source()])
    path = Path(cache_dir) / filename if cache_dir else None
    stored = {}
    if path is not None and path.exists():
        try:
            stored = json.loads(path.read_text())
        except (OSError, ValueError):
            stored = {}
    if key in stored:
        return stored[key], True
    result = measure()
    if path is not None:
        stored[key] = result
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(stored, indent=1))
            tmp.replace(path)            # atomic: two servers starting at once both read JSON
        except OSError as exc:
            logger.warning("could not store a CPU timing in %s: %s", path, exc)
    return result, False


def _kernel_source() -> str:
    """A digest of the kernels' source (a choice timed against an older kernel is stale)."""
    from jaxserve.kernels.cpu.build import HERE

    digest = hashlib.sha256()
    for name in ("matmul.cc", "gemv.h", "bf16_bits.h", "parallel_for.h"):
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
