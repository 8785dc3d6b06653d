"""Two versions of the CPU matmul library (jaxserve/kernels/cpu/matmul.cc) side by side in one
process: each built from its source with the library's own flags and registered under its own
FFI target, then timed interleaved on SmolLM2-135M's projection shapes stacked over 30 layers.

    mkdir -p /tmp/old && for f in matmul.cc gemv.h; do
        git show HEAD~1:jaxserve/kernels/cpu/$f > /tmp/old/$f; done
    python benchmarks/bench_matmul_ab.py /tmp/old/matmul.cc jaxserve/kernels/cpu/matmul.cc
    python benchmarks/bench_matmul_ab.py A.cc B.cc --rows 64 256 --gemv-rows 0   # oneDNN paths

A source's own directory is searched first for the headers it includes (gemv.h: the GEMV),
so copy an old version's gemv.h beside its matmul.cc (the library's headers fill the rest).

On a shared box whose memory speed moves by the minute, only such a same-process, interleaved
comparison tells a kernel change from the neighbours' load. Prints each shape's read rate
under A and B (the fastest of --repeats calls) and B's speed-up.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SHAPES = ((576, 1536), (1536, 576), (576, 576), (576, 192))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("a")
    p.add_argument("b")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4])
    p.add_argument("--gemv-rows", type=int, default=8, help="the kernel's gemv_rows attribute")
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--repeats", type=int, default=15)
    args = p.parse_args()

    import jax
    import jax.numpy as jnp

    from jaxserve.kernels.cpu import build, matmul

    lib = matmul.library()
    compiler = build.find_compiler()
    for name, source in (("a", args.a), ("b", args.b)):
        out = Path(f"/tmp/jaxserve-matmul-ab-{name}.so")
        variant = dataclasses.replace(lib, sources=(Path(source),) + tuple(lib.sources[1:]))
        subprocess.run(build.compile_command(variant, compiler, build.BASE_FLAGS
                                             + build.NATIVE_FLAGS, out),
                       check=True, capture_output=True)
        jax.ffi.register_ffi_target(f"jaxserve_matmul_ab_{name}",
                                    jax.ffi.pycapsule(ctypes.CDLL(str(out)).JaxserveMatmul),
                                    platform="cpu")
    rng = np.random.default_rng(0)

    def stack_loop(target: str, rows: int):
        def call(x, w, layer):
            return jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((rows, w.shape[2]), jnp.float32))(
                x, w, layer, gemv_rows=np.int64(args.gemv_rows), transposed_w=False)

        def loop(x, w):
            def body(carry, layer):
                y = call(x + carry.astype(x.dtype) * 0, w, layer)
                return y[:, :1], None
            carry, _ = jax.lax.scan(body, jnp.zeros((rows, 1)), jnp.arange(30, dtype=jnp.int32))
            return carry
        return jax.jit(loop)

    for dtype_name in args.dtypes:
        dtype = jnp.dtype(dtype_name)
        for fan_in, fan_out in SHAPES:
            w = jnp.asarray(rng.standard_normal((30, fan_in, fan_out)), dtype)
            for rows in args.rows:
                x = jnp.asarray(rng.standard_normal((rows, fan_in)), jnp.float32).astype(dtype)
                fns = {n: stack_loop(f"jaxserve_matmul_ab_{n}", rows) for n in ("a", "b")}
                for fn in fns.values():
                    jax.block_until_ready(fn(x, w))
                times = {"a": [], "b": []}
                for r in range(args.repeats):
                    for n in (("a", "b") if r % 2 else ("b", "a")):
                        start = time.perf_counter()
                        jax.block_until_ready(fns[n](x, w))
                        times[n].append(time.perf_counter() - start)
                a, b = min(times["a"]), min(times["b"])
                print(f"{dtype_name:8s} [{fan_in}, {fan_out}] x {rows} row(s): A "
                      f"{w.nbytes / a / 1e9:5.1f} GB/s  B {w.nbytes / b / 1e9:5.1f} GB/s  "
                      f"B {a / b:.2f}x A")


if __name__ == "__main__":
    main()
