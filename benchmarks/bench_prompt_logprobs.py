"""What prompt logprobs cost: a decode step when no request asks, and a prefill that asks.

Two engines on the default model (SmolLM2-135M-Instruct), identical but for
``max_prompt_logprobs_per_step``: 0 builds the step without the prompt-logprobs gather at
all (the program before the feature), 256 builds it with the gather behind its cond.

  decode: median wall time of engine steps while 64 sequences decode (no one asks);
  prefill: one 256-token prompt, max_tokens=1, with and without prompt_logprobs=5
           (prefix caching off, so both compute every position).

    python benchmarks/bench_prompt_logprobs.py [--decode-steps 40] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from jaxserve import LLM, SamplingParams

ENGINE = dict(max_model_len=512, max_num_seqs=64, max_num_batched_tokens=256,
              kv_cache_memory_bytes=256 << 20, enable_prefix_caching=False,
              compile_in_background=False)


def decode_step_ms(llm: LLM, num_seqs: int, num_steps: int) -> float:
    """Median ms per engine step once every sequence is decoding."""
    engine = llm.llm_engine
    rng = np.random.default_rng(0)
    params = SamplingParams(temperature=0.0, max_tokens=num_steps + 64, ignore_eos=True)
    for i in range(num_seqs):
        engine.add_request(f"d{i}", None, params,
                           prompt_token_ids=rng.integers(100, 40000, 24).tolist())
    scheduler = engine.engine_core.scheduler
    while scheduler.num_running < num_seqs or any(
            s.num_computed_tokens < s.num_prompt_tokens for s in scheduler.running):
        engine.step()
    for _ in range(4):                   # let the pipeline settle
        engine.step()
    times = []
    for _ in range(num_steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    engine.abort_request([f"d{i}" for i in range(num_seqs)])
    while engine.has_unfinished_requests():
        engine.step()
    return 1000 * statistics.median(times)


def prefill_ms(llm: LLM, prompt_logprobs: int | None, repeats: int) -> float:
    ids = np.random.default_rng(1).integers(100, 40000, 256).tolist()
    params = SamplingParams(max_tokens=1, prompt_logprobs=prompt_logprobs)
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        llm.generate([ids], params, use_tqdm=False)
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--decode-steps", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3,
                        help="alternate the two engines this many times (noisy machines)")
    args = parser.parse_args()
    engines = {cap: LLM(None, max_prompt_logprobs_per_step=cap, **ENGINE) for cap in (0, 256)}
    decode = {cap: [] for cap in engines}
    for _ in range(args.rounds):
        for cap, llm in engines.items():
            decode[cap].append(decode_step_ms(llm, 64, args.decode_steps))
    for cap in engines:
        print(f"decode, batch 64, max_prompt_logprobs_per_step={cap:3d}: "
              f"{min(decode[cap]):.2f} ms/step (best of {args.rounds} medians: "
              f"{', '.join(f'{t:.2f}' for t in decode[cap])})")
    llm = engines[256]
    for _ in range(args.rounds):
        off, on = prefill_ms(llm, None, args.repeats), prefill_ms(llm, 5, args.repeats)
        print(f"prefill 256 tokens + 1 token: {off:.1f} ms without prompt logprobs, "
              f"{on:.1f} ms with prompt_logprobs=5 (256 positions)")


if __name__ == "__main__":
    main()
