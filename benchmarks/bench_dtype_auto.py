"""Is ``dtype=auto`` within a few % of the better dtype at one stream and at the batch?

One process holds three engines on the embedded SmolLM2-135M -- float32, bfloat16 and auto --
and runs them interleaved round by round (a shared box's load shifts by the minute; three
processes minutes apart measured the load, not the dtype): each round a batch of --batch
streams of --output-len tokens and one stream of as many, random prompt ids, greedy. Prints
each dtype's best and median tok/s over the rounds and auto's ratio to the better dtype.

    python benchmarks/bench_dtype_auto.py --rounds 3
    # a CPU without bf16 units, emulated: the rule by kind forced to none, oneDNN capped to AVX2
    ONEDNN_MAX_CPU_ISA=AVX2 python benchmarks/bench_dtype_auto.py --matrix-units none

auto's first start on a fresh --cache-dir times the step where the rule times it (its cost is
in the startup log line printed, and in `startup_s`). Results go to
benchmarks/results/dtype-auto-{tag}.json with the CPU's flags and the load averages.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
DTYPES = ("float32", "bfloat16", "auto")


class ReasonLog(logging.Handler):
    """Keeps the engine's 'compute dtype (dtype=auto)' startup line."""

    def __init__(self):
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record):
        text = record.getMessage()
        if "compute dtype (dtype=auto)" in text:
            self.lines.append(text)


def main() -> None:
    from machine import machine_info

    from jaxserve import LLM, SamplingParams

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--matrix-units", default="auto")
    parser.add_argument("--cache-dir", default="", help="compilation cache and timing store "
                        "(default: a fresh one, so auto's timing runs)")
    parser.add_argument("--tag", default="")
    args = parser.parse_args()
    cache = args.cache_dir or tempfile.mkdtemp(prefix="dtype-auto-")
    reasons = ReasonLog()
    logging.getLogger("jaxserve").addHandler(reasons)
    logging.getLogger("jaxserve").setLevel(logging.INFO)
    loads = [os.getloadavg()[0]]
    engines, startup = {}, {}
    for name in DTYPES:
        start = time.perf_counter()
        engines[name] = LLM(None, dtype=name, matrix_units=args.matrix_units,
                            max_num_seqs=args.batch, max_model_len=256,
                            kv_cache_memory_bytes=768 << 20, skip_tokenizer_init=True,
                            compilation_cache_dir=cache, compile_in_background=False)
        startup[name] = time.perf_counter() - start
    chosen = str(np.dtype(engines["auto"].llm_engine.engine_core.setup.dtype))
    print(f"auto chose {chosen}: {reasons.lines[-1] if reasons.lines else '?'}", flush=True)
    rng = np.random.default_rng(0)
    prompts = [{"prompt_token_ids": rng.integers(1, 40000, 32).tolist()}
               for _ in range(args.batch)]

    def tok_s(llm, ps) -> float:
        params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
        t = time.perf_counter()
        outs = llm.generate(ps, params, use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t)

    for llm in engines.values():          # every bucket warmed once
        tok_s(llm, prompts[:4])
    runs: dict[str, dict[str, list[float]]] = {n: {"batch": [], "single": []} for n in DTYPES}
    for rnd in range(args.rounds):
        order = DTYPES if rnd % 2 == 0 else DTYPES[::-1]
        for name in order:
            runs[name]["batch"].append(tok_s(engines[name], prompts))
            runs[name]["single"].append(tok_s(engines[name], prompts[:1]))
        loads.append(os.getloadavg()[0])
        print(f"round {rnd}: " + "; ".join(
            f"{n} {runs[n]['batch'][-1]:.1f} / {runs[n]['single'][-1]:.1f}" for n in DTYPES)
            + f" tok/s (batch / single), load {loads[-1]:.1f}", flush=True)
    summary = {}
    for kind in ("batch", "single"):
        for stat, fn in (("best", max), ("median", statistics.median)):
            values = {n: fn(runs[n][kind]) for n in DTYPES}
            ratio = values["auto"] / max(values["float32"], values["bfloat16"])
            summary[f"{kind}_{stat}"] = {**values, "auto_vs_better": ratio}
            print(f"{kind} {stat}: " + ", ".join(f"{n} {v:.1f}" for n, v in values.items())
                  + f" tok/s; auto / better dtype {ratio:.3f}")
    record = {"command": " ".join(sys.argv), "machine": machine_info(),
              "onednn_max_cpu_isa": os.environ.get("ONEDNN_MAX_CPU_ISA", ""),
              "matrix_units": args.matrix_units, "auto_chose": chosen,
              "auto_reason": reasons.lines, "startup_s": startup, "load_average": loads,
              "summary": summary, "runs": runs}
    isa = os.environ.get("ONEDNN_MAX_CPU_ISA", "")
    tag = args.tag or f"units-{args.matrix_units}" + (f"-onednn-{isa}" if isa else "")
    path = ROOT / "benchmarks" / "results" / f"dtype-auto-{tag}.json"
    path.write_text(json.dumps(record, indent=1))
    print("wrote", path)


if __name__ == "__main__":
    main()
