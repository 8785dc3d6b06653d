"""The projections of a batched decode step: jaxserve's oneDNN calls against vLLM-CPU's.

jaxserve's plain call hands oneDNN the weights in their [in, out] layout, split by columns
over XLA's thread pool (kernels/cpu/matmul.cc); its packed call reads them as packed at
startup into oneDNN's blocked layout (kernels/cpu/packed_matmul.py, onednn_packed.cc: what a
served bf16 model on bf16 matrix units uses); vLLM's CPU build reorders each weight once at
load into oneDNN's blocked layout (`create_onednn_mm` / `onednn_mm`) and lets oneDNN thread
the call. Same shapes (SmolLM2-135M's seven projections), same dtype, same rows, stacked
over enough layers to stream from memory, interleaved round by round; ms per layer (the
streaming GEMV off: what each engine runs at these rows).

    source ../shared/peers/vllm_cpu.sh
    python benchmarks/bench_prepacked_matmul.py --vpy "$VPY" --rows 16 64 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHAPES = ((576, 576), (576, 192), (576, 192), (576, 576), (576, 1536), (576, 1536),
          (1536, 576))

_OURS = """
import json, sys
from jaxserve.kernels.cpu.timings import StackedProjections, fastest_calls
shapes, dtype, rows_list = json.loads(sys.argv[1]), sys.argv[2], json.loads(sys.argv[3])
import jax, jax.numpy as jnp, numpy as np
from jaxserve.kernels.cpu.packed_matmul import pack_stacked, packed_layer_matmul
stack = StackedProjections(dtype, [tuple(s) for s in shapes], 30)
packed = [jax.device_put(pack_stacked(np.asarray(w))) for w in stack.weights]

def packed_program(rows):
    xs = [jnp.full((rows, i), 0.5, dtype) for i, _ in shapes]
    @jax.jit
    def run(packed, xs, carry):
        def layer(l, carry):
            for (i, o), p, x in zip(shapes, packed, xs):
                carry = carry + packed_layer_matmul(x + carry.astype(x.dtype), p, l, o,
                                                    dtype)[0, 0]
            return carry
        return jax.lax.fori_loop(0, stack.layers, layer, carry)
    carry = jnp.float32(0)
    run(packed, xs, carry).block_until_ready()
    return lambda: run(packed, xs, carry).block_until_ready()

plain, out = {}, {}
for rows in rows_list:
    best = fastest_calls({"plain": stack.program(rows, 0), "packed": packed_program(rows)}, 7,
                         per=stack.layers)
    plain[rows], out[rows] = best["plain"], best["packed"]
print("RESULT " + json.dumps({"layers": stack.layers, "ms_per_layer": out,
                              "plain_ms_per_layer": plain}))
"""

_VLLM = """
import json, sys, time
import torch
from vllm import _custom_ops as ops
torch.set_num_threads(2)
shapes, dtype, rows_list, layers = (json.loads(sys.argv[1]), getattr(torch, sys.argv[2]),
                                    json.loads(sys.argv[3]), int(sys.argv[4]))
handlers = [[ops.create_onednn_mm(torch.full((k, n), 0.01, dtype=dtype), 32)
             for k, n in shapes] for _ in range(layers)]
out = {}
for rows in rows_list:
    xs = [torch.full((rows, k), 0.5, dtype=dtype) for k, _ in shapes]
    def step():
        for layer in handlers:
            for h, x in zip(layer, xs):
                ops.onednn_mm(h, x, None)
    step()
    times = []
    for _ in range(7):
        t = time.perf_counter(); step(); times.append(time.perf_counter() - t)
    out[rows] = min(times) * 1e3 / layers
print("RESULT " + json.dumps({"layers": layers, "ms_per_layer": out}))
"""


def run(cmd: list[str], env: dict) -> dict:
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    if out.returncode:
        raise RuntimeError(out.stderr[-3000:])
    line = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")][-1]
    return json.loads(line[7:])


def main() -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from machine import machine_info

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vpy", required=True, help="vLLM-CPU's python (peers/vllm_cpu.sh: $VPY)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--rows", type=int, nargs="+", default=[16, 64])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    shapes, rows = json.dumps(SHAPES), json.dumps(args.rows)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    rounds = []
    for r in range(args.rounds):
        ours = run([sys.executable, "-c", _OURS, shapes, args.dtype, rows], env)
        theirs = run([args.vpy, "-c", _VLLM, shapes, args.dtype, rows, str(ours["layers"])],
                     dict(os.environ))
        rounds.append({"jaxserve": ours["ms_per_layer"],
                       "jaxserve_plain": ours["plain_ms_per_layer"],
                       "vllm": theirs["ms_per_layer"], "load": os.getloadavg()[0]})
        print(f"round {r}: " + "; ".join(
            f"{n} rows jaxserve packed {ours['ms_per_layer'][str(n)]:.3f} ms, plain "
            f"{ours['plain_ms_per_layer'][str(n)]:.3f} ms, vLLM "
            f"{theirs['ms_per_layer'][str(n)]:.3f} ms per layer" for n in args.rows),
            flush=True)
    summary = {}
    for n in args.rows:
        summary[n] = {}
        for name in ("jaxserve", "jaxserve_plain"):
            ratios = sorted(x[name][str(n)] / x["vllm"][str(n)] for x in rounds)
            summary[n][f"{name}_over_vllm_median"] = ratios[len(ratios) // 2]
            summary[n][f"{name}_ratios"] = ratios
            print(f"{n} rows: {name} (packed unless _plain) / vLLM time "
                  f"{ratios[len(ratios) // 2]:.2f} (rounds: "
                  f"{', '.join(f'{r:.2f}' for r in ratios)})")
    if args.out:
        Path(args.out).write_text(json.dumps({"command": " ".join(sys.argv),
                                              "machine": machine_info(), "dtype": args.dtype,
                                              "rounds": rounds, "summary": summary},
                                             indent=1))
        print("wrote", args.out)


if __name__ == "__main__":
    main()
