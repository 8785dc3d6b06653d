"""Decode speed of one model in each weight format -- float32, bfloat16, int8 (group-wise
W8A16; with float32 or bfloat16 for the rest) -- side by side in one process, on this CPU.

    python benchmarks/bench_weight_formats.py [--streams 1 8 64] [--out benchmarks/results/x.json]

Which format decodes fastest depends on the CPU and the row count (bytes to stream at a few
rows; the matrix units, or their absence, at many), so this is the measurement behind a
choice of `--dtype` / `--quantization` on a machine. Each round times every (format,
streams) pair once, the order rotating; per token: (time for N tokens - time for 1) / (N - 1)
per stream, greedy, ignore_eos, 32-token prompts; medians over rounds. Also printed: each
format's greedy agreement with float32 on the first 16 tokens of every stream (a cheap
check, not the accuracy table: benchmarks/bench_quant_accuracy.py).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

FORMATS = {"float32": dict(dtype="float32"), "bfloat16": dict(dtype="bfloat16"),
           "int8": dict(dtype="float32", quantization="int8"),
           # int8 projections with the rest (the tied LM head, embeddings) in bfloat16
           "int8+bf16": dict(dtype="bfloat16", quantization="int8")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M")
    p.add_argument("--formats", nargs="+", default=list(FORMATS), choices=list(FORMATS))
    p.add_argument("--streams", type=int, nargs="+", default=[1, 8])
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default=None)
    args = p.parse_args()

    from decode_rounds import per_step_rounds, random_prompts, warm
    from machine import machine_info

    from jaxserve import LLM

    engines = {name: LLM(args.model, max_model_len=512, max_num_seqs=max(8, *args.streams),
                         **FORMATS[name]) for name in args.formats}
    prompts = random_prompts(max(args.streams))
    for llm in engines.values():
        warm(llm, prompts, args.streams)
    samples, tokens = per_step_rounds(engines, prompts, args.streams, args.tokens, args.rounds)
    results: dict[str, dict] = {}
    for streams in args.streams:
        base = statistics.median(samples[args.formats[0], streams])
        line = [f"{streams:3d} stream(s):"]
        for name in engines:
            ms = statistics.median(samples[name, streams])
            ref = tokens.get(("float32", streams))
            agree = None if ref is None else float(np.mean(
                [a == b for x, y in zip(tokens[name, streams], ref) for a, b in zip(x[:16], y[:16])]))
            results.setdefault(name, {})[streams] = {
                "ms_per_step": ms, "tokens_per_s_per_stream": 1e3 / ms,
                "speedup_vs_" + args.formats[0]: base / ms, "greedy_agreement_vs_float32": agree,
                "samples_ms": samples[name, streams]}
            line.append(f"{name} {ms:6.1f} ms/step ({base / ms:.2f}x)")
        print("  ".join(line))
    if args.out:
        Path(args.out).write_text(json.dumps({
            "machine": machine_info(), "model": args.model or "SmolLM2-135M (embedded)",
            "tokens": args.tokens, "rounds": args.rounds, "by_format": results}, indent=2))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
