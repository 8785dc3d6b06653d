"""The offline figure bench_serving.py is compared with: `LLM.generate` on the same prompts.

    python benchmarks/offline_reference.py --num-prompts 64 --random-input-len 128 \\
        --random-output-len 128 --save-result [engine flags, e.g. --max-num-seqs 64]

Builds the same random token-id prompts as `bench_serving.py --dataset random`
(same seed), submits them all at once (batch = --num-prompts) and reports
output tokens/s of the whole run, after one warm-up generate.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from bench_serving import make_prompts


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--random-input-len", type=int, default=128)
    p.add_argument("--random-output-len", type=int, default=128)
    p.add_argument("--random-range-ratio", type=float, default=0.0)
    p.add_argument("--token-id-low", type=int, default=1000)
    p.add_argument("--token-id-high", type=int, default=20000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save-result", action="store_true")
    p.add_argument("--result-dir", default=str(Path(__file__).parent / "results"))
    args, engine_flags = p.parse_known_args()
    args.dataset, args.endpoint, args.prompt = "random", "/v1/completions", ""

    from jaxserve import LLM, SamplingParams
    from jaxserve.config import EngineConfig
    from jaxserve.entrypoints.cli import build_parser, config_from_args

    engine_args = build_parser().parse_args(["chat", *engine_flags])
    config = config_from_args(EngineConfig(), engine_args)
    config.model_config.model = args.model
    llm = LLM(config=config)

    prompts = make_prompts(args, random.Random(args.seed))
    params = [SamplingParams(max_tokens=out_len, temperature=0.0, ignore_eos=True)
              for _, _, out_len in prompts]
    token_prompts = [{"prompt_token_ids": prompt} for prompt, _, _ in prompts]
    llm.generate(token_prompts[:1], SamplingParams(max_tokens=8), use_tqdm=False)
    start = time.perf_counter()
    outputs = llm.generate(token_prompts, params, use_tqdm=False)
    duration = time.perf_counter() - start
    output_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    summary = {"label": "offline LLM.generate", "num_prompts": len(prompts),
               "random_input_len": args.random_input_len,
               "random_output_len": args.random_output_len, "engine_flags": engine_flags,
               "duration_s": duration, "total_output_tokens": output_tokens,
               "output_throughput": output_tokens / duration,
               "request_throughput": len(prompts) / duration}
    print(json.dumps(summary, indent=2))
    if args.save_result:
        path = Path(args.result_dir) / (f"offline-n{len(prompts)}-in{args.random_input_len}"
                                        f"-out{args.random_output_len}.json")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(summary, indent=2) + "\n")
        print(f"saved {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
