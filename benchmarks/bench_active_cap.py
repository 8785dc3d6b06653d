"""What --max-num-active-seqs buys: inter-token latency against throughput, offline.

    python benchmarks/bench_active_cap.py --caps none 8 --requests 32 --output-len 48

For each cap, one engine (the embedded SmolLM2 unless --model) runs --requests greedy
requests submitted at once, twice (the first round warms up); the second round's gaps
between a request's consecutive outputs give ITL percentiles, and its wall time the output
tokens/s. --max-num-seqs stays the same for every cap (the scheduler's batch window).
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from jaxserve import LLM, SamplingParams


def run(cap: int | None, args: argparse.Namespace) -> dict:
    options = dict(max_model_len=512, max_num_seqs=args.max_num_seqs,
                   kv_cache_memory_bytes=256 << 20, dtype=args.dtype)
    if cap is not None:
        options["max_num_active_seqs"] = cap
    engine = LLM(args.model, **options).llm_engine
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    for round_ in range(2):
        last: dict[str, float] = {}
        gaps: list[float] = []
        start = time.perf_counter()
        for i in range(args.requests):
            engine.add_request(f"r{round_}-{i}", f"Tell me a story about the number {i}.",
                               params)
        while engine.has_unfinished_requests():
            for out in engine.step():
                now = time.perf_counter()
                if out.request_id in last:
                    gaps.append(now - last[out.request_id])
                last[out.request_id] = now
        wall = time.perf_counter() - start
    return {"cap": cap, "p50_itl_ms": float(np.percentile(gaps, 50) * 1e3),
            "p99_itl_ms": float(np.percentile(gaps, 99) * 1e3),
            "output_tok_s": args.requests * args.output_len / wall}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--caps", nargs="+", default=["none", "8"])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=48)
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    for cap in args.caps:
        print(json.dumps(run(None if cap == "none" else int(cap), args)), flush=True)


if __name__ == "__main__":
    main()
