"""Decode speed at a few streams with the GEMV choice measured (cpu_gemv_rows=auto) against
oneDNN at every row count (cpu_gemv_rows=0), side by side in one process.

    python benchmarks/bench_gemv_rows.py                       # dtype auto, 1 2 4 8 streams
    python benchmarks/bench_gemv_rows.py --dtype bfloat16 --matrix-units avx512 --out x.json

Both engines load the same model (default: the embedded SmolLM2-135M); each round times
every (engine, streams) pair once, the order rotating, so a noisy box slows both alike.
Per token: (time for N tokens - time for 1) / (N - 1), greedy, ignore_eos, 32-token prompts;
medians over rounds. The outputs of the two engines are compared too (same greedy tokens).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--matrix-units", default="auto")
    p.add_argument("--streams", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default=None)
    args = p.parse_args()

    from decode_rounds import per_step_rounds, random_prompts, warm
    from machine import machine_info

    from jaxserve import LLM

    engines = {setting: LLM(args.model, dtype=args.dtype, matrix_units=args.matrix_units,
                            max_model_len=512, max_num_seqs=max(8, *args.streams),
                            cpu_gemv_rows=setting) for setting in ("0", "auto")}
    chosen = engines["auto"].llm_engine.engine_core.runner.plan.gemv_rows
    prompts = random_prompts(max(args.streams))
    for llm in engines.values():
        warm(llm, prompts, args.streams)
    samples, tokens = per_step_rounds(engines, prompts, args.streams, args.tokens, args.rounds)
    results = {}
    for streams in args.streams:
        onednn = statistics.median(samples["0", streams])
        measured = statistics.median(samples["auto", streams])
        same = tokens["0", streams] == tokens["auto", streams]
        results[streams] = {"onednn_ms_per_step": onednn, "auto_ms_per_step": measured,
                            "speedup": onednn / measured, "same_greedy_tokens": same}
        print(f"{streams} stream(s): oneDNN {onednn:6.1f} ms/step  auto (GEMV <= {chosen} rows) "
              f"{measured:6.1f} ms/step  {onednn / measured:.2f}x  same tokens: {same}")
    if args.out:
        Path(args.out).write_text(json.dumps({
            "machine": machine_info(), "dtype": args.dtype, "matrix_units": args.matrix_units,
            "chosen_gemv_rows": chosen, "tokens": args.tokens, "rounds": args.rounds,
            "by_streams": results}, indent=2))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
