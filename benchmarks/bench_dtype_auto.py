"""Is ``dtype=auto`` within a few % of the better dtype at one stream and at the batch?

float32, bfloat16 and auto, each in a fresh process (`LLM` on the embedded SmolLM2-135M,
random prompt ids), interleaved round by round on one box: a batch of --batch streams of
--output-len tokens (best of 2), then one stream (best of 3); prints tok/s and auto's ratio
to the better dtype.

    python benchmarks/bench_dtype_auto.py --rounds 2
    # a CPU without bf16 units, emulated: the rule by kind forced to none, oneDNN capped to AVX2
    python benchmarks/bench_dtype_auto.py --matrix-units none --onednn-isa AVX2

Every process shares one compilation cache and timing store (--cache-dir): auto's first
start times the step (its cost is in `startup_s`), later ones read it back. Results go to
benchmarks/results/dtype-auto-{tag}.json with the CPU's flags and the load average.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

_RUN = """
import json, logging, sys, time
import numpy as np
logging.basicConfig(level=logging.INFO)
t0 = time.perf_counter()
from jaxserve import LLM, SamplingParams
dtype, units, cache = sys.argv[1], sys.argv[2], sys.argv[5]
batch, out_len = int(sys.argv[3]), int(sys.argv[4])
llm = LLM(None, dtype=dtype, matrix_units=units, max_num_seqs=batch, skip_tokenizer_init=True,
          compilation_cache_dir=cache, compile_in_background=False)
startup = time.perf_counter() - t0
rng = np.random.default_rng(0)
prompts = [rng.integers(1, 40000, 32).tolist() for _ in range(batch)]
def run(ps, n):
    sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    t = time.perf_counter(); outs = llm.generate([{"prompt_token_ids": p} for p in ps], sp, use_tqdm=False)
    return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t)
run(prompts, 4); run(prompts[:1], 4)
# the best of a few: what the dtype can do, not what a neighbour on the box left it
batch_tok_s = max(run(prompts, out_len) for _ in range(2))
single_tok_s = max(run(prompts[:1], out_len) for _ in range(3))
print(json.dumps({"batch_tok_s": batch_tok_s, "single_tok_s": single_tok_s,
                  "startup_s": startup, "chosen": str(llm.llm_engine.setup.dtype)}))
"""


def one(dtype: str, args, cache: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    if args.onednn_isa:
        env["ONEDNN_MAX_CPU_ISA"] = args.onednn_isa
    out = subprocess.run([sys.executable, "-c", _RUN, dtype, args.matrix_units,
                          str(args.batch), str(args.output_len), cache],
                         capture_output=True, text=True, env=env, cwd=ROOT)
    if out.returncode:
        raise RuntimeError(f"{dtype} failed:\n{out.stderr[-4000:]}")
    result = json.loads(out.stdout.strip().splitlines()[-1])
    why = [line for line in out.stderr.splitlines() if "compute dtype (dtype=auto)" in line]
    result["log"] = why[-1][-600:] if why else ""
    return result


def main() -> None:
    from machine import machine_info

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--matrix-units", default="auto")
    parser.add_argument("--onednn-isa", default="", help="ONEDNN_MAX_CPU_ISA for every run")
    parser.add_argument("--cache-dir", default="", help="shared cache (default: a fresh one)")
    parser.add_argument("--tag", default="")
    args = parser.parse_args()
    cache = args.cache_dir or tempfile.mkdtemp(prefix="dtype-auto-")
    runs: dict[str, list[dict]] = {"float32": [], "bfloat16": [], "auto": []}
    loads = [os.getloadavg()[0]]
    for rnd in range(args.rounds):
        order = list(runs) if rnd % 2 == 0 else list(runs)[::-1]
        for dtype in order:
            result = one(dtype, args, cache)
            runs[dtype].append(result)
            loads.append(os.getloadavg()[0])
            print(f"round {rnd} {dtype:9s}: batch {result['batch_tok_s']:.1f} tok/s, single "
                  f"{result['single_tok_s']:.1f} tok/s, start {result['startup_s']:.1f} s "
                  f"({result['chosen']})", flush=True)
    summary = {}
    for key in ("batch_tok_s", "single_tok_s"):
        med = {d: statistics.median(r[key] for r in rs) for d, rs in runs.items()}
        summary[key] = {**med, "auto_vs_better": med["auto"] / max(med["float32"],
                                                                   med["bfloat16"])}
        print(f"{key}: " + ", ".join(f"{d} {v:.1f}" for d, v in med.items())
              + f"; auto / better dtype {summary[key]['auto_vs_better']:.3f}")
    print("auto's reason:", runs["auto"][0]["log"])
    record = {"command": " ".join(sys.argv), "machine": machine_info(),
              "load_average": loads, "summary": summary, "runs": runs,
              "onednn_max_cpu_isa": args.onednn_isa, "matrix_units": args.matrix_units}
    tag = args.tag or f"units-{args.matrix_units}" + (f"-{args.onednn_isa}"
                                                      if args.onednn_isa else "")
    path = ROOT / "benchmarks" / "results" / f"dtype-auto-{tag}.json"
    path.write_text(json.dumps(record, indent=1))
    print("wrote", path)


if __name__ == "__main__":
    main()
