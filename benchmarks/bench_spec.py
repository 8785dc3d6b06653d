"""Speculative decoding on CPU: SmolLM2-135M, n-gram prompt lookup vs no speculation.

One process, two engines of the default model (speculation off; ngram, k drafts: -k, default 4), 256 output
tokens, single stream and batch 8:

  (a) repetitive: "repeat this passage with one change" / a code edit — the output copies
      the prompt, so n-gram drafts are mostly accepted;
  (b) open-ended chat — little to copy: the proposer mostly finds nothing and the
      per-request backoff keeps rejected drafts rare (what it costs is the point);
  (c) --draft-model: the default model drafting for itself (method draft_model, same k): the
      upper bound of a draft model — acceptance rate, speed-up, acceptance per position —
      merged into the same results file.

The box is shared and noisy: on/off runs are interleaved (off, on, off, on, ...) and the
median of the repeats is reported. Greedy decoding, so the outputs must be identical on
and off (checked). "batch 8 forced" runs the spec engine with drafting allowed at 8 rows,
to show where the cut (disable_by_batch_size, default 4) comes from; a benchmark-only
override of the engine's settings, the runner was built to verify 8 rows.

    python benchmarks/bench_spec.py                 # writes results/spec-cpu.json
    python benchmarks/bench_spec.py --draft-model   # adds the draft-model rows to it
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import statistics
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"

PASSAGE = (
    "The lighthouse stood on the northern cliff for two hundred years. Every night the "
    "keeper climbed the spiral stairs, trimmed the wick, and wound the clockwork that "
    "turned the great lens. Ships far out at sea saw the beam sweep across the water "
    "and knew the rocks were near. In winter the storms came from the west, and the keeper "
    "wrote in his log the height of the waves, the color of the sky, and the names of the "
    "ships that passed. When the keeper grew old, his daughter took the lamp, and she kept "
    "it burning for forty more years, until the day the electric light arrived.")
CODE = '''def moving_average(values, window):
    result = []
    for i in range(len(values)):
        start = max(0, i - window + 1)
        chunk = values[start:i + 1]
        result.append(sum(chunk) / len(chunk))
    return result


def normalize(values):
    low = min(values)
    high = max(values)
    return [(v - low) / (high - low) for v in values]
'''
REPETITIVE = [
    "Repeat the following passage exactly, word for word, but change 'northern' to "
    f"'southern':\n\n{PASSAGE}",
    "Rename the function moving_average to rolling_mean and return the complete code:\n\n"
    f"```python\n{CODE}```",
]
CHAT = [
    "Write a short story about a cat who learns to play the piano.",
    "What are some good ways to stay productive when working from home? Explain in detail.",
]


def build(spec: dict | None):
    from jaxserve import LLM

    kwargs = dict(max_num_seqs=8, max_num_batched_tokens=256, kv_cache_memory_bytes=1 << 30,
                  max_model_len=2048, compile_in_background=False)   # time steady state
    if spec:
        kwargs["speculative_config"] = spec
    return LLM(None, **kwargs)


def timed(llm, prompts, output_len):
    from jaxserve import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=output_len)
    snap = llm.llm_engine.snapshot()
    start = time.perf_counter()
    outs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params,
                    use_tqdm=False)
    elapsed = time.perf_counter() - start
    after = llm.llm_engine.snapshot()
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"tok_s": tokens / elapsed, "tokens": tokens, "seconds": elapsed,
            "outputs": [o.outputs[0].token_ids for o in outs],
            "drafts": after.spec_decode_num_drafts - snap.spec_decode_num_drafts,
            "draft_tokens": after.spec_decode_num_draft_tokens
            - snap.spec_decode_num_draft_tokens,
            "accepted": after.spec_decode_num_accepted_tokens
            - snap.spec_decode_num_accepted_tokens,
            "accepted_per_pos": [a - b for a, b in zip(after.spec_decode_accepted_per_pos,
                                                       snap.spec_decode_accepted_per_pos)]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=str(RESULTS / "spec-cpu.json"))
    parser.add_argument("--num-speculative-tokens", "-k", type=int, default=4,
                        help="k, drafts per verify step (a single stream's verify step is "
                             "padded to 8 tokens: k = 7 fills it)")
    parser.add_argument("--draft-model", action="store_true",
                        help="run only (c), the default model drafting for itself")
    args = parser.parse_args()

    if args.draft_model:
        from jaxserve.loader.resolve import default_gguf_path

        spec = {"method": "draft_model", "model": str(default_gguf_path()),
                "num_speculative_tokens": args.num_speculative_tokens, "disable_by_batch_size": 8}
    else:
        spec = {"method": "ngram", "num_speculative_tokens": args.num_speculative_tokens,
                "prompt_lookup_max": 4,
                "prompt_lookup_min": 2, "disable_by_batch_size": 8}
    off, on = build(None), build(spec)
    engine = on.llm_engine.engine_core
    default_cut = dataclasses.replace(engine.spec, disable_by_batch_size=4)
    forced_cut = engine.spec
    cases = []
    for task, prompts in (("repetitive", REPETITIVE), ("chat", CHAT)):
        if args.draft_model:
            cases.append((task, "single", prompts[:1], default_cut))
            cases.append((task, "batch8-forced", (prompts * 4)[:8], forced_cut))
            continue
        cases.append((task, "single", prompts[:1], default_cut))
        cases.append((task, "batch8", (prompts * 4)[:8], default_cut))
        cases.append((task, "batch8-forced", (prompts * 4)[:8], forced_cut))
    for llm in (off, on):                        # warm the prefix cache and allocator
        timed(llm, REPETITIVE[:1], 8)
    results = []
    for task, shape, prompts, cut in cases:
        engine.spec = cut
        runs = {"off": [], "on": []}
        for _ in range(args.repeats):
            for name, llm in (("off", off), ("on", on)):
                runs[name].append(timed(llm, prompts, args.output_len))
        same = runs["off"][0]["outputs"] == runs["on"][0]["outputs"]
        off_tps = statistics.median(r["tok_s"] for r in runs["off"])
        on_tps = statistics.median(r["tok_s"] for r in runs["on"])
        drafts = sum(r["drafts"] for r in runs["on"])
        draft_tokens = sum(r["draft_tokens"] for r in runs["on"])
        accepted = sum(r["accepted"] for r in runs["on"])
        per_pos = [sum(r["accepted_per_pos"][j] for r in runs["on"])
                   for j in range(len(runs["on"][0]["accepted_per_pos"]))]
        row = {"method": spec["method"], "task": task, "shape": shape, "num_prompts": len(prompts),
               "disable_by_batch_size": cut.disable_by_batch_size,
               "off_tok_s": [round(r["tok_s"], 2) for r in runs["off"]],
               "on_tok_s": [round(r["tok_s"], 2) for r in runs["on"]],
               "off_median_tok_s": round(off_tps, 2), "on_median_tok_s": round(on_tps, 2),
               "speedup": round(on_tps / off_tps, 3), "identical_outputs": same,
               "tokens_per_run": runs["on"][0]["tokens"],
               "drafts": drafts, "draft_tokens": draft_tokens, "accepted_tokens": accepted,
               "acceptance_rate": round(accepted / draft_tokens, 3) if draft_tokens else None,
               "mean_acceptance_length": round(1 + accepted / drafts, 3) if drafts else None,
               "acceptance_per_position": [round(a / drafts, 3) for a in per_pos]
               if drafts else None}
        results.append(row)
        print(json.dumps(row), flush=True)
    engine.spec = forced_cut
    if args.draft_model:                 # merge into the ngram run's file
        report = json.loads(Path(args.out).read_text())
        report["draft_model"] = {"speculative_config": spec, "results": results}
        report["draft_model_note"] = ("the default model drafting for itself: the upper "
                                      "bound of a draft model; a draft as costly as the "
                                      "target cannot speed anything up")
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
        print(f"merged into {args.out}")
        return
    report = {"model": "SmolLM2-135M-Instruct (GGUF, float32)", "device": "cpu",
              "machine": platform.processor() or platform.machine(),
              "output_len": args.output_len, "repeats": args.repeats,
              "speculative_config": spec, "greedy": True,
              "note": "shared 2-core box: on/off interleaved, medians of the repeats",
              "results": results}
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
