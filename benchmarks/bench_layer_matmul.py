"""The layer projections of a decoder step, three ways, on SmolLM2-135M's shapes (CPU, f32).

    python benchmarks/bench_layer_matmul.py                 # T in 1 8 16 32 64 128 256 512
    python benchmarks/bench_layer_matmul.py --rows 64 --repeats 30

Each variant runs the seven projections of every layer (q, k, v, o, gate, up, down; hidden
576, intermediate 1536, kv 192, 30 layers) on a [T, 576] activation, chained so nothing is
dead code (no attention, no norms: only the matmuls and a few cheap elementwise ops):

  scan_xla    the layers under lax.scan over weights stacked [L, in, out], XLA's dot (the
              engine above the in-place threshold: each layer's slice is a copy)
  unrolled    a Python loop over per-layer weight buffers, XLA's dot (no slice, no copy:
              the ceiling for XLA without the copy)
  scan_kernel the scan, each projection by jaxserve_layer_matmul reading the stacked
              weights in place (models/layer_matmul.py)

The variants are timed interleaved (one call of each per round, the order rotating) so a
noisy, shared box slows them alike; prints min / p5 / median ms per forward and the ratios
of the mins against scan_xla.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

HIDDEN, INTER, KV, LAYERS = 576, 1536, 192, 30
SHAPES = {"q": (HIDDEN, HIDDEN), "k": (HIDDEN, KV), "v": (HIDDEN, KV), "o": (HIDDEN, HIDDEN),
          "gate": (HIDDEN, INTER), "up": (HIDDEN, INTER), "down": (INTER, HIDDEN)}


def layer(x, mm):
    """One layer's projections; mm(name, activation) does the matmul."""
    q, k, v = mm("q", x), mm("k", x), mm("v", x)
    kv = jnp.tile(k + v, (1, HIDDEN // KV))
    x = x + mm("o", q * 0.01 + kv * 0.01)
    h = jax.nn.silu(mm("gate", x)) * mm("up", x)
    x = x + mm("down", h) * 0.01
    return x / jnp.sqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)


def make_variants(gemv_rows: int):
    from jaxserve.models.layer_matmul import layer_matmul

    def scan_xla(x, stacked):
        def body(x, w):
            return layer(x, lambda n, a: a @ w[n]), None
        return jax.lax.scan(body, x, stacked)[0]

    def unrolled(x, per_layer):
        for w in per_layer:
            x = layer(x, lambda n, a, w=w: a @ w[n])
        return x

    def scan_kernel(x, stacked):
        def body(x, idx):
            return layer(x, lambda n, a: layer_matmul(a, stacked[n], idx, gemv_rows)), None
        return jax.lax.scan(body, x, jnp.arange(LAYERS, dtype=jnp.int32))[0]

    return {"scan_xla": jax.jit(scan_xla), "unrolled": jax.jit(unrolled),
            "scan_kernel": jax.jit(scan_kernel)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 16, 32, 64, 128, 256, 512])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--gemv-rows", type=int, default=-1,
                        help="kernel's GEMV/GEMM switch (-1: its default)")
    args = parser.parse_args()

    rng = np.random.default_rng(0)
    stacked = {n: jnp.asarray(rng.standard_normal((LAYERS, *s), np.float32) / np.sqrt(s[0]))
               for n, s in SHAPES.items()}
    per_layer = [{n: jnp.array(w[i]) for n, w in stacked.items()} for i in range(LAYERS)]
    variants = make_variants(args.gemv_rows)
    weights = {"scan_xla": stacked, "unrolled": per_layer, "scan_kernel": stacked}
    print(f"{'T':>4} " + " ".join(f"{n:>26}" for n in variants) + "   kernel/xla unrolled/xla")
    for rows in args.rows:
        x = jnp.asarray(rng.standard_normal((rows, HIDDEN), np.float32))
        outs = {n: np.asarray(f(x, weights[n])) for n, f in variants.items()}
        ref = outs["unrolled"]
        for n, o in outs.items():
            err = np.max(np.abs(o - ref)) / (np.max(np.abs(ref)) + 1e-9)
            assert err < 1e-3, (n, rows, err)
        times = {n: [] for n in variants}
        names = list(variants)
        for r in range(args.repeats):
            for n in names[r % 3:] + names[:r % 3]:
                start = time.perf_counter()
                variants[n](x, weights[n]).block_until_ready()
                times[n].append((time.perf_counter() - start) * 1e3)
        stats = {n: (min(t), np.percentile(t, 5), np.median(t)) for n, t in times.items()}
        cells = " ".join(f"{s[0]:8.2f}/{s[1]:7.2f}/{s[2]:7.2f} ms" for s in stats.values())
        base = stats["scan_xla"][0]
        print(f"{rows:>4} {cells}   {stats['scan_kernel'][0] / base:9.2f} "
              f"{stats['unrolled'][0] / base:8.2f}", flush=True)


if __name__ == "__main__":
    main()
