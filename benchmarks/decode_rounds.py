"""Per-step decode timing of several engines in one process, shared by the benchmarks that
compare engine settings side by side (bench_gemv_rows, bench_grouped_gemv,
bench_weight_formats).

Each round times every (engine, streams) pair once, the order rotating, so a noisy, shared
box slows them alike. Per step: (time for N tokens - time for 1) / (N - 1), greedy,
ignore_eos, on random 32-token prompts; the caller takes medians over the rounds.
"""

from __future__ import annotations

import time

import numpy as np


def random_prompts(count: int, length: int = 32, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(100, 20000, length).tolist() for _ in range(count)]


def generate_timed(llm, prompts: list[list[int]], max_tokens: int):
    """(seconds, each prompt's greedy token ids) for one `generate` of these prompts."""
    from jaxserve import SamplingParams

    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": q} for q in prompts],
                        SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0),
                        use_tqdm=False)
    return time.perf_counter() - start, [o.outputs[0].token_ids for o in outs]


def warm(llm, prompts: list[list[int]], stream_counts: list[int]) -> None:
    """Trace and compile every timed shape once."""
    for streams in stream_counts:
        generate_timed(llm, prompts[:streams], 4)


def per_step_rounds(engines: dict, prompts: list[list[int]], stream_counts: list[int],
                    tokens: int, rounds: int):
    """({(name, streams): [ms per step, one per round]}, {(name, streams): last token ids})."""
    samples: dict[tuple[str, int], list[float]] = {}
    outputs: dict[tuple[str, int], list] = {}
    pairs = [(name, streams) for streams in stream_counts for name in engines]
    for r in range(rounds):
        for name, streams in pairs[r % len(pairs):] + pairs[:r % len(pairs)]:
            one, _ = generate_timed(engines[name], prompts[:streams], 1)
            full, out = generate_timed(engines[name], prompts[:streams], tokens)
            samples.setdefault((name, streams), []).append((full - one) / (tokens - 1) * 1e3)
            outputs[name, streams] = out
    return samples, outputs
