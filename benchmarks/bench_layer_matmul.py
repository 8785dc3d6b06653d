"""The layer projections of a decoder step, several ways, on SmolLM2-135M's shapes (CPU).

    python benchmarks/bench_layer_matmul.py                 # T in 1 8 64 256
    python benchmarks/bench_layer_matmul.py --rows 64 --repeats 30 --out benchmarks/results/layer_matmul.json
    python benchmarks/bench_layer_matmul.py --old-lib ~/.cache/jaxserve/ffi/paged_attention-<hash>.so
                                  # adds the removed hand-written GEMM/GEMV (JaxserveLayerMatmul)

Each variant runs the seven projections of every layer (q, k, v, o, gate, up, down; hidden
576, intermediate 1536, kv 192, 30 layers) on a [T, 576] activation, chained so nothing is
dead code (no attention, no norms: only the matmuls and a few cheap elementwise ops):

  xla_scan_f32       lax.scan over weights stacked [L, in, out], XLA's dot (slices are copies)
  xla_unrolled_f32   a Python loop over per-layer buffers, XLA's dot (no copy)
  xla_unrolled_bf16  the same in bf16 (XLA's own bf16 dot, f32 accumulation)
  onednn_f32/_bf16   the scan, each projection one oneDNN call on the stacked weights in place
                     (jaxserve/kernels/cpu/matmul.cc, GEMV off)
  gemv_f32/_bf16     the scan, gemv.h's streaming GEMV (rows <= 8 only)
  old_kernel_f32     the removed hand-written kernel (--old-lib)

Timed interleaved (one call of each per round, the order rotating) so a noisy, shared box
slows them alike; prints the min ms per forward and each variant's ratio to xla_scan_f32.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
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
    xf = x.astype(jnp.float32)
    return (xf / jnp.sqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + 1e-6)).astype(x.dtype)


def scan_of(mm):
    def run(x, stacked):
        def body(x, idx):
            return layer(x, lambda n, a: mm(a, stacked[n], idx)), None
        return jax.lax.scan(body, x, jnp.arange(LAYERS, dtype=jnp.int32))[0]
    return jax.jit(run)


def make_variants(old_lib: str | None):
    from jaxserve.kernels.cpu.matmul import layer_matmul

    def xla_scan(x, stacked):
        def body(x, w):
            return layer(x, lambda n, a: a @ w[n]), None
        return jax.lax.scan(body, x, stacked)[0]

    def unrolled(x, per_layer):
        for w in per_layer:
            x = layer(x, lambda n, a, w=w: jnp.dot(a, w[n], preferred_element_type=a.dtype))
        return x

    variants = {  # name: (fn, weights kind, dtype, max rows or None)
        "xla_scan_f32": (jax.jit(xla_scan), "stacked", jnp.float32, None),
        "xla_unrolled_f32": (jax.jit(unrolled), "per_layer", jnp.float32, None),
        "xla_unrolled_bf16": (jax.jit(unrolled), "per_layer", jnp.bfloat16, None),
        "onednn_f32": (scan_of(lambda a, w, i: layer_matmul(a, w, i, gemv_rows=0)),
                       "stacked", jnp.float32, None),
        "onednn_bf16": (scan_of(lambda a, w, i: layer_matmul(a, w, i, gemv_rows=0)),
                        "stacked", jnp.bfloat16, None),
        "gemv_f32": (scan_of(lambda a, w, i: layer_matmul(a, w, i)), "stacked", jnp.float32, 8),
        "gemv_bf16": (scan_of(lambda a, w, i: layer_matmul(a, w, i)), "stacked", jnp.bfloat16, 8),
    }
    if old_lib:
        handle = ctypes.CDLL(os.path.expanduser(old_lib))
        jax.ffi.register_ffi_target("old_layer_matmul",
                                    jax.ffi.pycapsule(handle.JaxserveLayerMatmul), platform="cpu")

        def old(a, w, i):
            call = jax.ffi.ffi_call("old_layer_matmul",
                                    jax.ShapeDtypeStruct((a.shape[0], w.shape[2]), jnp.float32))
            return call(a, w, jnp.asarray(i, jnp.int32), gemv_rows=np.int64(-1))
        variants["old_kernel_f32"] = (scan_of(old), "stacked", jnp.float32, None)
    return variants


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64, 256])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--only", nargs="+", help="variant names to run (default: all)")
    parser.add_argument("--old-lib", help="a .so with the removed JaxserveLayerMatmul")
    parser.add_argument("--out", help="write the mins (ms) as JSON here")
    args = parser.parse_args()

    rng = np.random.default_rng(0)
    stacked32 = {n: rng.standard_normal((LAYERS, *s), np.float32) / np.sqrt(s[0])
                 for n, s in SHAPES.items()}
    weights = {}
    for dt in (jnp.float32, jnp.bfloat16):
        st = {n: jnp.asarray(w, dt) for n, w in stacked32.items()}
        weights[("stacked", dt)] = st
        weights[("per_layer", dt)] = [{n: jnp.array(w[i]) for n, w in st.items()}
                                      for i in range(LAYERS)]
    variants = make_variants(args.old_lib)
    if args.only:
        variants = {n: v for n, v in variants.items() if n in args.only or n == "xla_scan_f32"}
    results = {"cpu": open("/proc/cpuinfo").read().split("model name")[1].split("\n")[0].strip(": "),
               "ms": {}}
    for rows in args.rows:
        x32 = rng.standard_normal((rows, HIDDEN), np.float32)
        live = {n: v for n, v in variants.items() if v[3] is None or rows <= v[3]}
        ref = np.asarray(live["xla_unrolled_f32"][0](jnp.asarray(x32),
                                                     weights[("per_layer", jnp.float32)])) \
            if "xla_unrolled_f32" in live else None
        inputs = {}
        for n, (fn, kind, dt, _) in live.items():
            inputs[n] = (jnp.asarray(x32, dt), weights[(kind, dt)])
            out = np.asarray(fn(*inputs[n]).astype(jnp.float32))
            if ref is not None:
                err = np.max(np.abs(out - ref)) / (np.max(np.abs(ref)) + 1e-9)
                assert err < (5e-2 if dt == jnp.bfloat16 else 1e-3), (n, rows, err)
        times = {n: [] for n in live}
        names = list(live)
        for r in range(args.repeats):
            for n in names[r % len(names):] + names[:r % len(names)]:
                start = time.perf_counter()
                live[n][0](*inputs[n]).block_until_ready()
                times[n].append((time.perf_counter() - start) * 1e3)
        mins = {n: min(t) for n, t in times.items()}
        results["ms"][rows] = mins
        base = mins["xla_scan_f32"]
        print(f"T={rows:<4} " + "  ".join(f"{n} {m:7.2f} ms ({m / base:4.2f}x)"
                                          for n, m in mins.items()), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
