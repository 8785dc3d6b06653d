"""Would fewer, fatter projection calls make the batched decode step faster (issue 40 part 2)?

A decoder layer's seven projections as the engine calls them above the GEMV's rows (one
oneDNN call each: q, k, v, o, gate, up, down) against the same FLOPs in four calls (q|k|v
and gate|up concatenated along the output: qkv, o, gate_up, down), over every layer of
SmolLM2-135M's shapes in one jitted loop (each layer's weights streamed from memory as in
the step, 30 layers x 7.1 MB of bf16), interleaved, fastest and median of --repeats.

    python benchmarks/bench_projection_calls.py --rows 16 64 --out projection-calls.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.kernels.cpu.matmul import layer_matmul

HIDDEN, INTER, Q, KV, LAYERS = 576, 1536, 576, 192, 30     # SmolLM2-135M
RESULTS = Path(__file__).resolve().parent / "results"


def weights(rng, dtype, shapes):
    return [jnp.asarray(rng.standard_normal((LAYERS, i, o), np.float32) * 0.02, dtype)
            for i, o in shapes]


def seven_calls(x, ws):
    wq, wk, wv, wo, wg, wu, wd = ws

    def layer(l, acc):
        h = (x + acc).astype(x.dtype)
        q, k, v = (layer_matmul(h, w, l, gemv_rows=0) for w in (wq, wk, wv))
        o = layer_matmul(q, wo, l, gemv_rows=0)
        g, u = (layer_matmul(h, w, l, gemv_rows=0) for w in (wg, wu))
        d = layer_matmul(g * u, wd, l, gemv_rows=0)
        return acc + 1e-6 * (o + d + k[:, :1] + v[:, :1]).astype(jnp.float32)
    return jax.lax.fori_loop(0, LAYERS, layer, jnp.zeros(x.shape, jnp.float32))


def four_calls(x, ws):
    wqkv, wo, wgu, wd = ws

    def layer(l, acc):
        h = (x + acc).astype(x.dtype)
        qkv = layer_matmul(h, wqkv, l, gemv_rows=0)
        q, k, v = qkv[:, :Q], qkv[:, Q:Q + KV], qkv[:, Q + KV:]
        o = layer_matmul(q, wo, l, gemv_rows=0)
        gu = layer_matmul(h, wgu, l, gemv_rows=0)
        d = layer_matmul(gu[:, :INTER] * gu[:, INTER:], wd, l, gemv_rows=0)
        return acc + 1e-6 * (o + d + k[:, :1] + v[:, :1]).astype(jnp.float32)
    return jax.lax.fori_loop(0, LAYERS, layer, jnp.zeros(x.shape, jnp.float32))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    dtype, rng = jnp.dtype(args.dtype), np.random.default_rng(0)
    seven = weights(rng, dtype, [(HIDDEN, Q), (HIDDEN, KV), (HIDDEN, KV), (Q, HIDDEN),
                                 (HIDDEN, INTER), (HIDDEN, INTER), (INTER, HIDDEN)])
    four = weights(rng, dtype, [(HIDDEN, Q + 2 * KV), (Q, HIDDEN), (HIDDEN, 2 * INTER),
                                (INTER, HIDDEN)])
    programs = {"seven calls": (jax.jit(seven_calls), seven),
                "four calls": (jax.jit(four_calls), four)}
    flags = [f for f in ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16")
             if f in Path("/proc/cpuinfo").read_text().split()]
    result = {"machine": {"cpu": platform.processor() or platform.machine(), "flags": flags,
                          "cpus": os.cpu_count(), "load_before": os.getloadavg()[0]},
              "dtype": args.dtype, "layers": LAYERS, "rows": {}}
    for rows in args.rows:
        x = jnp.asarray(rng.standard_normal((rows, HIDDEN)), dtype)
        times = {name: [] for name in programs}
        for fn, ws in programs.values():
            jax.block_until_ready(fn(x, ws))
        for i in range(args.repeats):          # interleaved, alternating order
            for name in (list(programs) if i % 2 else list(programs)[::-1]):
                fn, ws = programs[name]
                start = time.perf_counter()
                jax.block_until_ready(fn(x, ws))
                times[name].append((time.perf_counter() - start) * 1e3)
        summary = {name: {"best_ms": min(t), "median_ms": float(np.median(t))}
                   for name, t in times.items()}
        ratio = summary["seven calls"]["median_ms"] / summary["four calls"]["median_ms"]
        result["rows"][rows] = {**summary, "seven_over_four_median": ratio}
        print(f"{rows} rows, {LAYERS} layers: seven calls {summary['seven calls']['best_ms']:.2f}"
              f" / {summary['seven calls']['median_ms']:.2f} ms, four calls "
              f"{summary['four calls']['best_ms']:.2f} / {summary['four calls']['median_ms']:.2f}"
              f" ms (best / median); seven / four {ratio:.3f}", flush=True)
    result["machine"]["load_after"] = os.getloadavg()[0]
    if args.out:
        (RESULTS / args.out).write_text(json.dumps(result, indent=1))
        print("wrote", RESULTS / args.out)


if __name__ == "__main__":
    main()
