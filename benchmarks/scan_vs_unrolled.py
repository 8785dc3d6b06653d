"""The weight-streaming limit of a decode step's projections: one Llama-shaped matmul chain
(qkv, o, gate-up, down per layer, then the LM head) with the layers as a `lax.scan` over
stacked weights against a Python-unrolled loop of static per-layer slices. On an H200 the scan
copied each layer's slice every step (2.8x the unrolled time at batch 1); this measures it
again, ms and TB/s of weights read per call, as JSON.

    python benchmarks/scan_vs_unrolled.py out.json                 # Llama-3-8B's shapes
    python benchmarks/scan_vs_unrolled.py out.json --layers 2 --hidden 256 --intermediate 512 \\
        --vocab 1024 --batch-sizes 1,4 --iters 3                  # tiny, anywhere
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--qkv", type=int, default=6144, help="q + k + v output width")
    parser.add_argument("--intermediate", type=int, default=14336)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--batch-sizes", type=int_list, default=[1, 64, 256])
    parser.add_argument("--iters", type=int, default=30)
    args = parser.parse_args()

    import jax
    import jax.numpy as jnp

    hidden, inter = args.hidden, args.intermediate
    keys = jax.random.split(jax.random.key(0), 6)

    def weight(key, shape):
        return (jax.random.normal(key, shape, jnp.float32) * 0.02).astype(jnp.bfloat16)

    weights = {"qkv": weight(keys[0], (args.layers, hidden, args.qkv)),
               "o": weight(keys[1], (args.layers, hidden, hidden)),
               "gate_up": weight(keys[2], (args.layers, hidden, 2 * inter)),
               "down": weight(keys[3], (args.layers, inter, hidden))}
    lm_head = weight(keys[4], (hidden, args.vocab))
    num_bytes = sum(w.nbytes for w in weights.values()) + lm_head.nbytes

    def layer(x, w):
        x = x + (x @ w["qkv"])[:, :hidden] @ w["o"]
        gate_up = x @ w["gate_up"]
        return x + (jax.nn.silu(gate_up[:, :inter]) * gate_up[:, inter:]) @ w["down"], None

    @jax.jit
    def scan(x, stacked):
        return jax.lax.scan(layer, x, stacked)[0] @ lm_head

    @jax.jit
    def unrolled(x, stacked):
        for i in range(args.layers):
            x, _ = layer(x, jax.tree.map(lambda a, i=i: a[i], stacked))
        return x @ lm_head

    result = {"device": jax.devices()[0].device_kind, "jax": jax.__version__,
              "weight_bytes": num_bytes, "config": {k: v for k, v in vars(args).items()
                                                    if k != "out"}, "runs": []}
    print(f"weights {num_bytes / 1e9:.2f} GB on {result['device']}", flush=True)
    for batch in args.batch_sizes:
        x = weight(keys[5], (batch, hidden))
        for name, fn in (("scan", scan), ("unrolled", unrolled)):
            start = time.perf_counter()
            fn(x, weights).block_until_ready()
            first = time.perf_counter() - start
            start = time.perf_counter()
            for _ in range(args.iters):
                y = fn(x, weights)
            y.block_until_ready()
            seconds = (time.perf_counter() - start) / args.iters
            result["runs"].append({"batch": batch, "layer_loop": name, "ms": seconds * 1e3,
                                   "weight_tb_s": num_bytes / seconds / 1e12,
                                   "first_call_s": first})
            print(f"batch {batch} {name}: {seconds * 1e3:.2f} ms, "
                  f"{num_bytes / seconds / 1e12:.2f} TB/s (first call {first:.1f} s)", flush=True)
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
