"""The embedded GGUF's float copy with q|k|v and gate|up fused (models/sibling_fusion.py)
against one copy per projection, offline, interleaved fresh processes.

Each run is a fresh process serving the default model (SmolLM2-135M Q4_1, packed by default
with its float copy) with `LLM(max_num_seqs=64, max_num_batched_tokens=512)`: --batch random
49-token prompts x --output-len greedy tokens (bench_vs_vllm.py's offline shape), after one
warm-up batch; "per-projection" disables the fusion in that process. Prints tok/s per run and
the medians; the greedy tokens of the first 16 prompts are compared between the two.

    python benchmarks/bench_sibling_fusion.py --runs 2 --out sibling-fusion-cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

_CHILD = """
import json, sys, time
import numpy as np
if sys.argv[1] == "per-projection":
    import jaxserve.models.sibling_fusion as fusion
    fusion.fuse_packed_float_copies = lambda params: []
from jaxserve import LLM, SamplingParams
batch, out_len = int(sys.argv[2]), int(sys.argv[3])
llm = LLM(None, max_num_seqs=batch, max_num_batched_tokens=512, compile_in_background=False)
rng = np.random.default_rng(0)
prompts = [[int(t) for t in rng.integers(100, 20000, 49)] for _ in range(batch)]
llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
             use_tqdm=False)
params = SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True)
start = time.perf_counter()
outs = llm.generate(prompts, params, use_tqdm=False)
seconds = time.perf_counter() - start
print("RESULT " + json.dumps({"tok_s": sum(len(o.outputs[0].token_ids) for o in outs) / seconds,
                              "tokens": [o.outputs[0].token_ids for o in outs[:16]]}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    flags = [f for f in ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni", "amx_bf16")
             if f in Path("/proc/cpuinfo").read_text().split()]
    result = {"machine": {"flags": flags, "cpus": os.cpu_count(),
                          "load_before": os.getloadavg()[0]},
              "batch": args.batch, "output_len": args.output_len, "runs": []}
    tokens = {}
    for run in range(args.runs):
        for mode in (("per-projection", "fused") if run % 2 == 0 else ("fused", "per-projection")):
            out = subprocess.run([sys.executable, "-c", _CHILD, mode, str(args.batch),
                                  str(args.output_len)], env=env, capture_output=True, text=True)
            if out.returncode:
                sys.exit(f"{mode} run failed:\n{out.stderr[-3000:]}")
            line = next(l for l in out.stdout.splitlines() if l.startswith("RESULT "))
            data = json.loads(line[len("RESULT "):])
            tokens[mode] = data.pop("tokens")
            result["runs"].append({"mode": mode, **data, "load": os.getloadavg()[0]})
            print(f"run {run}: {mode} {data['tok_s']:.1f} tok/s", flush=True)
    medians = {mode: statistics.median(r["tok_s"] for r in result["runs"] if r["mode"] == mode)
               for mode in ("per-projection", "fused")}
    result["median_tok_s"] = medians
    result["fused_over_per_projection"] = medians["fused"] / medians["per-projection"]
    result["same_greedy_tokens"] = tokens["fused"] == tokens["per-projection"]
    result["machine"]["load_after"] = os.getloadavg()[0]
    print(f"median: per-projection {medians['per-projection']:.1f}, fused {medians['fused']:.1f} "
          f"tok/s ({result['fused_over_per_projection']:.3f}x); same greedy tokens: "
          f"{result['same_greedy_tokens']}")
    if args.out:
        path = ROOT / "benchmarks" / "results" / args.out
        path.write_text(json.dumps(result, indent=1))
        print("wrote", path)


if __name__ == "__main__":
    main()
