"""Sampler compile time per sequence bucket and runtime per case (XLA:CPU).

Compile: CPU seconds (getrusage, all threads) of ``jit(sample).lower(...).compile()``
for each S, V=49152, K=20 top logprobs -- what the engine pays per step bucket.
Runtime: per case at S=64, median over --iters calls of wall time and CPU time
(CPU time is the steadier number on a shared box; XLA may use several threads).

  python benchmarks/bench_sampler.py                       # default buckets and cases
  python benchmarks/bench_sampler.py --sizes 1,64 --iters 30
  python benchmarks/bench_sampler.py --impl old=/tmp/old.py --impl new=jaxserve/runner/sampler.py
      # compare versions (a sampler.py file each), interleaved call by call
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.util
import pathlib
import resource
import statistics
import sys
import time

try:    # as the engine does on Linux: keep XLA's temporaries' pages in the heap
    _libc = ctypes.CDLL("libc.so.6")
    _libc.mallopt(-3, 2**31 - 1)
    _libc.mallopt(-1, 2**31 - 1)
except OSError:
    pass

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from jaxserve.runner.sampling_tensors import SamplingTensors

V, K, P, NB = 49152, 20, 256, 320


def cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def load_samplers(impls: list[str] | None) -> dict:
    """{name: sample} from "name=path" (or "path") entries; default: jaxserve's."""
    if not impls:
        from jaxserve.runner.sampler import sample
        return {"sampler": sample}
    samplers = {}
    for i, impl in enumerate(impls):
        name, _, path = impl.rpartition("=")
        spec = importlib.util.spec_from_file_location(f"sampler_under_test_{i}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        samplers[name or path] = module.sample
    return samplers


def neutral(rows: int) -> dict[str, np.ndarray]:
    """Greedy rows with every filter, penalty and bias off."""
    f32, i32 = np.float32, np.int32
    return {"temperature": np.zeros(rows, f32), "top_k": np.zeros(rows, i32),
            "top_p": np.ones(rows, f32), "min_p": np.zeros(rows, f32),
            "presence_penalty": np.zeros(rows, f32), "frequency_penalty": np.zeros(rows, f32),
            "repetition_penalty": np.ones(rows, f32), "seeds": np.zeros(rows, np.uint32),
            "step_index": np.zeros(rows, i32), "num_logprobs": np.full(rows, -1, i32),
            "penalty_token_ids": np.full((rows, P), -1, i32),
            "num_prompt_tokens": np.zeros(rows, i32),
            "bias_token_ids": np.full((rows, NB), -1, i32),
            "bias_values": np.zeros((rows, NB), f32), "newest_token_ids": np.full(rows, -1, i32)}


def tensors(rows: int, rng: np.random.Generator, **values) -> SamplingTensors:
    fields = neutral(rows)
    fields["seeds"] = rng.integers(0, 2**32, rows).astype(np.uint32)
    fields["step_index"] = rng.integers(0, 500, rows).astype(np.int32)
    for name, value in values.items():
        fields[name] = np.broadcast_to(np.asarray(value, fields[name].dtype),
                                       fields[name].shape).copy()
    return SamplingTensors(**fields)


def lm_logits(rng: np.random.Generator, rows: int, spread: float) -> np.ndarray:
    """LM-like rows: a noise floor plus a few strong tokens; ``spread`` scales the floor
    (larger = flatter distribution, larger top-p nucleus)."""
    x = rng.standard_normal((rows, V)) * spread
    strong = rng.integers(0, V, (rows, 16))
    np.put_along_axis(x, strong, rng.uniform(8, 14, (rows, 16)), axis=1)
    return x.astype(np.float32)


def nucleus_size(logits: np.ndarray, top_p: float) -> int:
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p = np.sort(p / p.sum(-1, keepdims=True), -1)[:, ::-1]
    return int(np.median((np.cumsum(p, -1) < top_p).sum(-1) + 1))


def cases(rows: int, rng: np.random.Generator):
    history = rng.integers(0, V, (rows, P)).astype(np.int32)
    history[:, 200:] = -1
    peaked, flat = lm_logits(rng, rows, 1.0), lm_logits(rng, rows, 2.0)
    yield "greedy", peaked, tensors(rows, rng)
    yield f"greedy+logprobs K={K}", peaked, tensors(rows, rng, num_logprobs=K)
    yield "temperature 0.8", peaked, tensors(rows, rng, temperature=0.8)
    yield f"top_p 0.9 (nucleus ~{nucleus_size(peaked, 0.9)})", peaked, \
        tensors(rows, rng, temperature=1.0, top_p=0.9)
    yield f"top_p 0.9 (nucleus ~{nucleus_size(flat, 0.9)})", flat, \
        tensors(rows, rng, temperature=1.0, top_p=0.9)
    yield "top_k 50", peaked, tensors(rows, rng, temperature=1.0, top_k=50)
    yield "top_k 50 + top_p 0.9 + min_p", peaked, \
        tensors(rows, rng, temperature=1.0, top_k=50, top_p=0.9, min_p=0.01)
    yield "penalties (+temperature)", peaked, tensors(
        rows, rng, temperature=1.0, repetition_penalty=1.1, frequency_penalty=0.5,
        presence_penalty=0.3, penalty_token_ids=history, num_prompt_tokens=100)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1,2,4,8,16,32,64,128,256")
    parser.add_argument("--rows", type=int, default=64, help="S of the runtime cases")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--impl", action="append",
                        help="[name=]path of a sampler.py to load instead of jaxserve's "
                             "(repeatable: versions are compared interleaved)")
    parser.add_argument("--skip-compile", action="store_true")
    args = parser.parse_args(argv)
    samplers = load_samplers(args.impl)
    names = list(samplers)
    fns = {name: jax.jit(lambda logits, t, sample=sample: sample(logits, t, K))
           for name, sample in samplers.items()}
    print(f"jax {jax.__version__}, {jax.devices()[0].platform}, V={V}, K={K}")

    if not args.skip_compile:
        print(f"\ncompile, CPU s (getrusage)\n{'S':>5s} " + " ".join(f"{n:>12s}" for n in names))
        totals = dict.fromkeys(names, 0.0)
        for s in (int(x) for x in args.sizes.split(",")):
            t = jax.device_put(SamplingTensors(**neutral(s)))
            row = []
            for name in names:
                lowered = fns[name].lower(jnp.zeros((s, V)), t)
                c0 = cpu_seconds()
                lowered.compile()
                seconds = cpu_seconds() - c0
                totals[name] += seconds
                row.append(f"{seconds:12.2f}")
            print(f"{s:5d} " + " ".join(row), flush=True)
        print("total " + " ".join(f"{totals[n]:12.2f}" for n in names))

    rng = np.random.default_rng(0)
    example = (jnp.zeros((args.rows, V)), jax.device_put(tensors(args.rows, rng)))
    compiled = {name: fns[name].lower(*example).compile() for name in names}
    print(f"\nruntime at S={args.rows}, V={V}: median of {args.iters} calls, ms "
          f"(wall / CPU)")
    print(f"{'case':38s} " + " ".join(f"{n:>17s}" for n in names))
    for case, logits, t in cases(args.rows, rng):
        logits, t = jax.device_put(logits), jax.device_put(t)
        walls = {n: [] for n in names}
        cpus = {n: [] for n in names}
        for name in names:                                   # warm
            jax.block_until_ready(compiled[name](logits, t))
        for _ in range(args.iters):
            for name in names:                               # interleaved
                w0, c0 = time.perf_counter(), cpu_seconds()
                jax.block_until_ready(compiled[name](logits, t))
                walls[name].append(time.perf_counter() - w0)
                cpus[name].append(cpu_seconds() - c0)
        print(f"{case:38s} " + " ".join(
            f"{1e3 * statistics.median(walls[n]):8.2f}/{1e3 * statistics.median(cpus[n]):<8.2f}"
            for n in names), flush=True)


if __name__ == "__main__":
    main()
