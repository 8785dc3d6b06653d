"""Cost of AWQ / GPTQ's dequantize-in-the-matmul against a float32 matmul, per layer.

    PYTHONPATH=. python benchmarks/bench_awq_gptq.py [--rows 1 64] [--iters 30]

One decoder layer's seven projections at SmolLM2-135M's shapes (hidden 576, intermediate
1536, 3 KV heads of 64; group size 64, since 576 is not a multiple of 128), jitted as one
function: float32 kernels vs the packed layouts (4-bit contiguous groups = AWQ and GPTQ
without act-order, 4-bit act-order, 8-bit). Prints microseconds per layer (median of
--iters, the modes alternating in each round so load drifts hit them alike), the ratio to
float32 and the resident bytes. Weights are random: this measures cost, not accuracy.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.quantization.awq_gptq import pack_rows, packed_int_matmul

SHAPES = {"q_proj": (576, 576), "k_proj": (576, 192), "v_proj": (576, 192),
          "o_proj": (576, 576), "gate_proj": (576, 1536), "up_proj": (576, 1536),
          "down_proj": (1536, 576)}
GROUP = 64


def packed_layer(bits: int, act_order: bool, rng) -> dict[str, dict[str, np.ndarray]]:
    layer = {}
    for name, (n_in, n_out) in SHAPES.items():
        q = rng.integers(0, 2 ** bits, (n_in, n_out))
        groups = n_in // GROUP
        leaves = {"qweight": pack_rows(q, bits),
                  "scales": (rng.random((groups, n_out)) * 0.01).astype(np.float16),
                  "zeros": rng.integers(1, 2 ** bits, (groups, n_out)).astype(np.float16)}
        if act_order:
            g_idx = np.empty(n_in, np.int32)
            g_idx[rng.permutation(n_in)] = np.arange(n_in) // GROUP
            leaves["g_idx"] = g_idx
        layer[name] = leaves
    return layer


def layer_fn(packed: bool):
    def run(params, x):
        # q, k, v, gate, up read x; o and down read inputs of their own width
        outs = []
        for name, (n_in, _) in SHAPES.items():
            xi = x[:, :n_in] if n_in <= x.shape[1] else jnp.tile(x, (1, 3))[:, :n_in]
            outs.append(packed_int_matmul(xi, params[name], jnp.float32) if packed
                        else xi @ params[name])
        return sum(o.sum() for o in outs)
    return jax.jit(run)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--iters", type=int, default=30)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    modes = {"float32": None, "int4": packed_layer(4, False, rng),
             "int4-act-order": packed_layer(4, True, rng), "int8": packed_layer(8, False, rng)}
    modes["float32"] = {n: rng.standard_normal(s).astype(np.float32) for n, s in SHAPES.items()}
    params = {m: jax.device_put(p) for m, p in modes.items()}
    fns = {m: layer_fn(m != "float32") for m in modes}
    nbytes = {m: sum(v.nbytes for v in jax.tree.leaves(p)) for m, p in modes.items()}
    print(f"{jax.devices()[0].platform}: one SmolLM2-135M layer's projections, group {GROUP}")
    for rows in args.rows:
        x = jnp.asarray(rng.standard_normal((rows, 576)).astype(np.float32))
        for m in modes:
            fns[m](params[m], x).block_until_ready()      # compile
        times: dict[str, list[float]] = {m: [] for m in modes}
        for _ in range(args.iters):
            for m in modes:
                start = time.perf_counter()
                fns[m](params[m], x).block_until_ready()
                times[m].append(time.perf_counter() - start)
        base = np.median(times["float32"])
        for m in modes:
            t = np.median(times[m])
            print(f"  rows {rows:3d}  {m:15s} {t * 1e6:8.0f} us  {t / base:5.2f}x float32  "
                  f"resident {nbytes[m] / nbytes['float32']:.3f}x")


if __name__ == "__main__":
    main()
