"""Prefill rate by step size: 64 prompts of 128 random tokens prefilled (max_tokens=1) with
max_num_batched_tokens at each size asked, and the measured step cost of each bucket.

The served benchmark's prompts are 128 tokens, so half its work is prefill; this is the rate
that work runs at, and whether bigger steps would run it faster.

    python benchmarks/bench_prefill_chunks.py --sizes 512 1024 2048

One fresh process per size (its buckets compiled before timing); prints one line per repeat
and the StepCosts snapshot (bucket -> median seconds).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

_ONE_SIZE = """
import sys, time
import numpy as np
from jaxserve import LLM, SamplingParams
size, num_prompts, prompt_len, repeats = map(int, sys.argv[1:5])
llm = LLM(None, max_num_seqs=64, max_num_batched_tokens=size, compile_in_background=False)
def prompts(n, seed):
    rng = np.random.default_rng(seed)
    return [rng.integers(100, 20000, prompt_len).tolist() for _ in range(n)]
params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
llm.generate(prompts(8, 1), params, use_tqdm=False)
for rep in range(repeats):
    start = time.perf_counter()
    llm.generate(prompts(num_prompts, 10 + rep), params, use_tqdm=False)
    seconds = time.perf_counter() - start
    print(f"max_num_batched_tokens {size}: {num_prompts} x {prompt_len} prefilled in "
          f"{seconds:.2f} s = {num_prompts * prompt_len / seconds:.0f} tok/s", flush=True)
print("step costs (bucket: s):", {k: round(v, 4) for k, v in
      sorted(llm.llm_engine.engine_core.step_costs.snapshot().items())})
"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[512, 1024, 2048])
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    print(f"load average before: {os.getloadavg()[0]:.2f}")
    for size in args.sizes:
        out = subprocess.run([sys.executable, "-c", _ONE_SIZE, str(size), str(args.num_prompts),
                              str(args.prompt_len), str(args.repeats)],
                             capture_output=True, text=True, env=env, cwd=ROOT)
        if out.returncode:
            sys.exit(f"size {size} failed:\n{out.stderr[-3000:]}")
        print(out.stdout.strip(), flush=True)
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
