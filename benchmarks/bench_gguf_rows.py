"""All of a GGUF's layer projections at T rows: the packed blocks through the block kernel
(kernels/cpu/gemv_gguf.h) against their dequantized copy through oneDNN in float32 and
bfloat16 (what a GGUF packed by default picks between, models/linear_method.GGUFPackedMethod).

    PYTHONPATH=. python benchmarks/bench_gguf_rows.py 1 8 16 32 64 128

One jitted call per projection covering every layer (the stacked weights read in place, as
the layer scan reads them); best of 5, milliseconds for all projections of all layers.
Default model: the embedded SmolLM2-135M Q4_1 GGUF.
"""

from __future__ import annotations

import sys
import time

import jax
import jax.numpy as jnp
import numpy as np


def main() -> None:
    from jaxserve.kernels.cpu import matmul
    from jaxserve.loader import load_model
    from jaxserve.quantization.gguf_packed import dequantize, packed_format_of

    weights = load_model(None, quantization="gguf").weights
    names = [k for k in weights if k.startswith("layers.") and packed_format_of([k.split(".")[-1]])]
    fmt = {n: n.split(".")[-1] for n in names}
    layers = weights[names[0]].shape[0]
    floats = {n: np.ascontiguousarray(np.swapaxes(
        np.asarray(dequantize(jnp.asarray(weights[n]), fmt[n])), 1, 2)) for n in names}

    def time_rows(rows: int, kind: str) -> float:
        calls = []
        for n in names:
            x = jnp.asarray(np.random.default_rng(0).standard_normal((rows, floats[n].shape[1]),
                                                                    np.float32))
            if kind == "blocks":
                w = jnp.asarray(weights[n])
                f = jax.jit(lambda x, w, f=fmt[n]: sum(matmul.gguf_matmul(x, (w,), layer, f)[0].sum()
                                                       for layer in range(layers)))
            else:
                dt = jnp.float32 if kind == "float32" else jnp.bfloat16
                w = jnp.asarray(floats[n], dt)
                f = jax.jit(lambda x, w, dt=dt: sum(
                    matmul.layer_matmul(x.astype(dt), w, layer, jnp.float32, gemv_rows=0).sum()
                    for layer in range(layers)))
            calls.append((f, x, w))
        for f, x, w in calls:
            f(x, w).block_until_ready()
        best = float("inf")
        for _ in range(5):
            start = time.perf_counter()
            for f, x, w in calls:
                f(x, w).block_until_ready()
            best = min(best, time.perf_counter() - start)
        return best * 1e3

    for rows in [int(a) for a in sys.argv[1:]] or [1, 8, 16, 64]:
        ms = {kind: time_rows(rows, kind) for kind in ("blocks", "float32", "bfloat16")}
        print(f"{rows:4d} rows: " + ", ".join(f"{k} {v:7.1f} ms" for k, v in ms.items()),
              flush=True)


if __name__ == "__main__":
    main()
