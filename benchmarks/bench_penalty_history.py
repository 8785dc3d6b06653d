"""Host cost per decode step of the penalty history: `InputBatch.prepare` with every row
using a penalty, at 100 and 1,000 tokens produced, for several max_model_len.

Pure host numpy (no model, no device): what the engine thread pays per step to hand the
step its penalty inputs. Prints min and median microseconds over --repeats calls. Run it
with PYTHONPATH pointing at two trees to compare them (the API it uses is unchanged):

    PYTHONPATH=$PWD python benchmarks/bench_penalty_history.py --tag new
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from jaxserve.runner.input_batch import InputBatch
from jaxserve.sampling_params import SamplingParams
from jaxserve.step_contract import NewSeqData, SchedulerOutput


def decode_out(seq_ids: list[int], computed: list[int]) -> SchedulerOutput:
    return SchedulerOutput(seq_ids=list(seq_ids), num_scheduled_tokens=[1] * len(seq_ids),
                           num_computed_tokens=list(computed),
                           is_sampling=[True] * len(seq_ids),
                           total_num_scheduled_tokens=len(seq_ids),
                           num_decode_tokens=len(seq_ids))


def per_step_us(num_seqs: int, max_model_len: int, produced: int, repeats: int,
                prompt_len: int = 32, block_size: int = 16) -> list[float]:
    """Time prepare() of a decode step of num_seqs penalty rows that produced `produced`."""
    width = -(-max_model_len // block_size)
    batch = InputBatch(num_seqs, max_model_len, block_size, width)
    params = SamplingParams(repetition_penalty=1.1, frequency_penalty=0.2,
                            presence_penalty=0.1)
    rng = np.random.default_rng(0)
    length = prompt_len + produced
    new = [NewSeqData(i, rng.integers(100, 20000, length).tolist(), prompt_len,
                      list(range(-(-length // block_size))), length - 1, params, 0)
           for i in range(num_seqs)]
    seq_ids = [s.seq_id for s in new]
    out = decode_out(seq_ids, [length - 1] * num_seqs)
    out.new_seqs = new
    rows = batch.apply(out)
    batch.prepare(out, rows, num_seqs, num_seqs)     # the admission step (not timed)
    out = decode_out(seq_ids, [length - 1] * num_seqs)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        batch.prepare(out, rows, num_seqs, num_seqs)
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[16, 64, 256])
    parser.add_argument("--max-model-lens", type=int, nargs="+", default=[2048, 8192, 32768])
    parser.add_argument("--positions", type=int, nargs="+", default=[100, 1000])
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--tag", default="")
    parser.add_argument("--json", default="", help="also write the numbers here")
    args = parser.parse_args()
    results = []
    for size in args.sizes:
        for max_len in args.max_model_lens:
            row = {"num_seqs": size, "max_model_len": max_len}
            for position in args.positions:
                t = per_step_us(size, max_len, position, args.repeats)
                row[str(position)] = {"min_us": 1e6 * min(t), "p50_us": 1e6 * float(np.median(t))}
            results.append(row)
            cells = "  ".join(f"@{p}: min {row[str(p)]['min_us']:8.1f} p50 "
                              f"{row[str(p)]['p50_us']:8.1f}" for p in args.positions)
            print(f"{args.tag:4s} S={size:4d} max_model_len={max_len:6d}  {cells}  us/step",
                  flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"tag": args.tag, "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
