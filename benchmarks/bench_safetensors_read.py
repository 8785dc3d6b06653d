"""Our safetensors reader (loader/safetensors_loader.py) against safetensors' own safe_open
on a small bfloat16 checkpoint: whether the library returns bfloat16 to numpy, and the time
to read every tensor (median of alternating runs).

    PYTHONPATH=$PWD python benchmarks/bench_safetensors_read.py [--layers 8] [--dim 256]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import numpy as np
import safetensors
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from jaxserve.loader.safetensors_loader import SafetensorsFile


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "model.safetensors")
        gen = torch.Generator().manual_seed(0)
        tensors = {f"model.layers.{i}.w{j}": torch.randn(args.dim, args.dim, generator=gen)
                   .to(torch.bfloat16) for i in range(args.layers) for j in range(6)}
        save_file(tensors, path)
        ref = {n: t.float().numpy() for n, t in tensors.items()}
        print(f"safetensors {safetensors.__version__}; {len(tensors)} bf16 tensors, "
              f"{os.path.getsize(path) / 2**20:.1f} MiB")
        with safe_open(path, framework="numpy") as f:
            t = f.get_tensor(next(iter(tensors)))
            print(f"safe_open(framework='numpy') returns {t.dtype}; equal to torch's values:",
                  all(np.array_equal(f.get_tensor(n).astype(np.float32), ref[n]) for n in ref))

        def ours():
            f = SafetensorsFile(path)
            return [f.get(n).sum(dtype=np.float32) for n in f.names()]

        def library():
            with safe_open(path, framework="numpy") as f:
                return [f.get_tensor(n).sum(dtype=np.float32) for n in f.keys()]

        times: dict[str, list[float]] = {"ours": [], "safe_open numpy": []}
        for _ in range(args.repeats):
            for name, fn in (("ours", ours), ("safe_open numpy", library)):
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
        for name, values in times.items():
            print(f"{name:>16}: median {sorted(values)[len(values) // 2] * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
