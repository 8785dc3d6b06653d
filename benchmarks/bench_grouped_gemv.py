"""Decode speed with a layer's sibling projections in one GEMV call (q/k/v, gate/up:
layers.sibling_projections) against one call per projection, side by side in one process.

    python benchmarks/bench_grouped_gemv.py                          # dtype auto, 1 2 4 streams
    python benchmarks/bench_grouped_gemv.py --dtype bfloat16 --out x.json
    python benchmarks/bench_grouped_gemv.py --quantization int8

Both engines load the same model (default: the embedded SmolLM2-135M) with the GEMV at up to
8 rows (`cpu_gemv_rows=8`, so every timed row count takes it, whatever this CPU's measured
choice is); the "one call each" engine is built, warmed and compiled with the grouping turned
off, and its compiled steps are checked to hold no grouped call (the other's to hold them).
Each round times every (engine, streams) pair once, the order rotating, so a noisy box slows
both alike. Per token: (time for N tokens - time for 1) / (N - 1), greedy, ignore_eos,
32-token prompts; medians over rounds. The two engines' greedy tokens are compared too.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--quantization", default=None)
    p.add_argument("--streams", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out", default=None)
    args = p.parse_args()

    from decode_rounds import per_step_rounds, random_prompts, warm
    from machine import machine_info

    from jaxserve import LLM
    from jaxserve.kernels.cpu.matmul import GROUP_TARGET
    from jaxserve.models import layers
    from jaxserve.runner.model_runner import wait_for_background_compiles

    prompts = random_prompts(max(args.streams))

    def build(grouped: bool):
        saved = layers.grouped_gemv
        if not grouped:
            layers.grouped_gemv = lambda x, operands, **options: None
        try:
            # A cache of its own: the serialized-executable cache's key is the package's
            # source, which the patch leaves as it is (the other engine would load these).
            llm = LLM(args.model, dtype=args.dtype, quantization=args.quantization,
                      max_model_len=512, max_num_seqs=max(8, *args.streams), cpu_gemv_rows="8",
                      compilation_cache_dir=tempfile.mkdtemp(prefix="jaxserve-bench-"))
            warm(llm, prompts, args.streams)   # trace and compile every timed shape now
            wait_for_background_compiles()
        finally:
            layers.grouped_gemv = saved
        runner = llm.llm_engine.engine_core.runner
        texts = [runner._steps[key].as_text() for key in runner._steps if key[0] <= 8]
        holds = [GROUP_TARGET in text for text in texts]
        if not texts or any(h != grouped for h in holds):
            raise SystemExit(f"grouped={grouped}: compiled steps hold the grouped call: {holds}")
        return llm

    engines = {"one call each": build(False), "grouped": build(True)}
    samples, tokens = per_step_rounds(engines, prompts, args.streams, args.tokens, args.rounds)
    results = {}
    for streams in args.streams:
        each = statistics.median(samples["one call each", streams])
        grouped = statistics.median(samples["grouped", streams])
        same = tokens["one call each", streams] == tokens["grouped", streams]
        results[streams] = {"one_call_each_ms_per_step": each, "grouped_ms_per_step": grouped,
                            "speedup": each / grouped, "same_greedy_tokens": same,
                            "samples": {name: samples[name, streams] for name in engines}}
        print(f"{streams} stream(s): one call each {each:6.1f} ms/step  grouped {grouped:6.1f} "
              f"ms/step  {each / grouped:.2f}x  same tokens: {same}")
    if args.out:
        Path(args.out).write_text(json.dumps({
            "machine": machine_info(), "model": args.model or "SmolLM2-135M (embedded)",
            "dtype": args.dtype, "quantization": args.quantization, "tokens": args.tokens,
            "rounds": args.rounds, "by_streams": results}, indent=2))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
