"""A tied LM head at decode row counts on the CPU: the library's transposed GEMV, oneDNN and
XLA's dot, side by side on SmolLM2-135M's table shape (49,152 x 576), float32 and bfloat16.

    python benchmarks/bench_lm_head.py [--rows 1 2 4 8] [--out benchmarks/results/x.json]

Each variant's fastest of --repeats calls (the three interleaved per round), and the GEMV's
error against float64 (x in float32; the table as stored).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--hidden", type=int, default=576)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--out", default=None)
    args = p.parse_args()

    import jax
    import jax.numpy as jnp
    from machine import machine_info

    from jaxserve.kernels.cpu.matmul import layer_matmul

    rng = np.random.default_rng(0)
    results = {}
    for dtype in (jnp.float32, jnp.bfloat16):
        table = jnp.asarray(rng.standard_normal((args.vocab, args.hidden)), dtype)
        variants = {
            "gemv": jax.jit(lambda x, t: layer_matmul(x, t[None], 0, jnp.float32,
                                                      transposed=True, gemv_rows=8)),
            "onednn": jax.jit(lambda x, t: layer_matmul(x.astype(t.dtype), t[None], 0,
                                                        jnp.float32, transposed=True,
                                                        gemv_rows=0)),
            "xla": jax.jit(lambda x, t: jnp.dot(x.astype(t.dtype), t.T,
                                                preferred_element_type=jnp.float32)),
        }
        for rows in args.rows:
            x = jnp.asarray(rng.standard_normal((rows, args.hidden)), jnp.float32)
            times: dict[str, list[float]] = {name: [] for name in variants}
            for fn in variants.values():
                jax.block_until_ready(fn(x, table))
            for r in range(args.repeats):
                names = list(variants) if r % 2 else list(reversed(variants))
                for name in names:
                    start = time.perf_counter()
                    jax.block_until_ready(variants[name](x, table))
                    times[name].append((time.perf_counter() - start) * 1e3)
            want = np.asarray(x, np.float64) @ np.asarray(table.astype(jnp.float32), np.float64).T
            err = float(np.abs(np.asarray(variants["gemv"](x, table)) - want).max()
                        / np.abs(want).max())
            best = {name: min(t) for name, t in times.items()}
            results[f"{jnp.dtype(dtype).name} rows={rows}"] = {**{f"{k}_ms": v for k, v in
                                                                  best.items()},
                                                               "gemv_rel_err": err}
            print(f"{jnp.dtype(dtype).name:8s} {rows} row(s): GEMV {best['gemv']:6.2f} ms  "
                  f"oneDNN {best['onednn']:6.2f}  XLA {best['xla']:6.2f}  (GEMV rel err "
                  f"{err:.1e})")
    if args.out:
        Path(args.out).write_text(json.dumps({"machine": machine_info(), "vocab": args.vocab,
                                              "hidden": args.hidden, "results": results},
                                             indent=2))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
