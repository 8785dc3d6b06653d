"""Accuracy and cost of each quantized mode (weights x KV dtype) against float32, one run.

    PYTHONPATH=. python benchmarks/bench_quant.py [--model M] [--out benchmarks/results/quant-cpu.json]

Per mode, on the default model (or --model):
  * teacher forcing over tests/data/public_domain.txt in 128-token windows: mean and p99 KL
    of the next-token distribution vs float32, top-1 agreement, perplexity;
  * greedy continuation agreement: 8 prompts x 128 new tokens, the mean fraction of the 128
    that precede the first token differing from float32's;
  * resident bytes of weights, KV bytes per token;
  * decode tok/s at batch 1 and 64 (generated tokens / wall time, 32 new tokens each).
The JSON it writes is what `LLM(..., quantization=...)` quotes at start-up
(jaxserve/quantization/cost.py) and what the README table shows.
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from pathlib import Path

import numpy as np

from jaxserve import LLM, SamplingParams

ROOT = Path(__file__).resolve().parent.parent
TEXT = ROOT / "tests" / "data" / "public_domain.txt"
# "int8-per-column": int8 weights with one scale per output column (the layout before
# group-wise scales), measured in the same run as the group-wise default for before/after.
MODES = [(None, "auto"), ("int8-per-column", "auto"), ("int8", "auto"), ("gguf", "auto"),
         (None, "fp8"), (None, "int8"), ("int8", "fp8"), ("int8", "int8")]
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time,",
           "The three primary colors are", "Water boils at", "import numpy as np\n",
           "The best way to learn a language is", "In 1969, astronauts"]
WINDOW = 128


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def mode_name(quantization: str | None, kv: str) -> str:
    return f"weights={quantization or 'float32'} kv={'float32' if kv == 'auto' else kv}"


def measure(model: str | None, quantization: str | None, kv: str, windows, prompts,
            dtype: str = "auto"):
    from jaxserve.quantization import int8

    groups = int8.GROUP_SIZES
    if quantization == "int8-per-column":
        int8.GROUP_SIZES = ()            # no group size: one scale per output column
    try:
        llm = LLM(model, quantization=quantization and quantization.split("-")[0],
                  kv_cache_dtype=kv, dtype=dtype, max_model_len=512, max_num_seqs=64,
                  max_num_batched_tokens=128, kv_cache_memory_bytes=256 << 20,
                  compile_in_background=False)
    finally:
        int8.GROUP_SIZES = groups
    setup = llm.llm_engine.engine_core.setup
    logprobs = [log_softmax(llm.llm_engine.prompt_logits(w)) for w in windows]
    greedy = SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True)
    continuations = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    speed = {}
    for batch in (1, 64):
        params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
        batch_prompts = [prompts[i % len(prompts)] + f" ({i})" for i in range(batch)]
        start = time.perf_counter()
        outs = llm.generate(batch_prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        speed[batch] = sum(len(o.outputs[0].token_ids) for o in outs) / seconds
    result = {"weight_bytes": setup.weight_bytes,
              "kv_bytes_per_token": setup.kv_plan.bytes_per_block // setup.kv_plan.block_size,
              "decode_tok_s_batch1": speed[1], "decode_tok_s_batch64": speed[64],
              "backend": setup.runner.model.backend.name}
    del llm, setup
    gc.collect()
    return result, logprobs, continuations


def compare(windows, base_lp, lp, base_cont, cont) -> dict:
    kls, agree, nll = [], [], []
    for ids, b, m in zip(windows, base_lp, lp):
        pb = np.exp(b)
        kls.append((pb * (b - m)).sum(-1)[:-1])
        agree.append(b.argmax(-1)[:-1] == m.argmax(-1)[:-1])
        nll.append(-m[np.arange(len(ids) - 1), ids[1:]])
    kl, agree, nll = np.concatenate(kls), np.concatenate(agree), np.concatenate(nll)
    prefix = []
    for a, b in zip(base_cont, cont):
        differ = [i for i, (x, y) in enumerate(zip(a, b)) if x != y]
        prefix.append((differ[0] if differ else len(a)) / len(a))
    return {"kl_mean": float(kl.mean()), "kl_p99": float(np.percentile(kl, 99)),
            "top1_agreement": float(agree.mean()), "perplexity": float(np.exp(nll.mean())),
            "greedy_128_agreement": float(np.mean(prefix)),
            "greedy_128_identical": int(sum(p == 1.0 for p in prefix))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/quant-cpu.json"))
    parser.add_argument("--modes", default=None,
                        help="a subset, e.g. 'float32:auto,int8:fp8' (weights:kv; the first "
                             "must be float32:auto, the baseline); a subset run does not "
                             "rewrite jaxserve/quantization/measured_cost.json")
    parser.add_argument("--dtype", default="auto",
                        help="every mode's compute dtype (auto: each engine's own choice, "
                             "bfloat16 where the CPU has bf16 units; float32 pins the "
                             "baseline to the float32 model)")
    args = parser.parse_args()
    modes = MODES
    if args.modes:
        modes = [(None if w in ("float32", "none") else w, kv)
                 for w, kv in (m.split(":") for m in args.modes.split(","))]
        if modes[0] != (None, "auto"):
            parser.error("--modes must start with float32:auto (the baseline)")
    import jax

    from jaxserve.quantization import int8

    rows, base = [], None
    tokenizer = None
    for quantization, kv in modes:
        if tokenizer is None:
            from jaxserve.loader import load_model

            tokenizer = load_model(args.model, load_format="dummy").tokenizer
            ids = tokenizer.encode(TEXT.read_text())
            windows = [ids[i:i + WINDOW] for i in range(0, len(ids) - WINDOW + 1, WINDOW)]
        result, lp, cont = measure(args.model, quantization, kv, windows, PROMPTS, args.dtype)
        if base is None:
            base = (lp, cont)
        result |= compare(windows, base[0], lp, base[1], cont)
        result["mode"] = mode_name(quantization, kv)
        result["quantization"], result["kv_cache_dtype"] = quantization, kv
        rows.append(result)
        print(json.dumps(result), flush=True)
    report = {"model": args.model or "default (SmolLM2-135M-Instruct Q4_1 GGUF)",
              "platform": jax.default_backend(), "device": jax.devices()[0].device_kind,
              "text": str(TEXT.relative_to(ROOT)), "window_tokens": WINDOW,
              "teacher_forced_positions": sum(len(w) - 1 for w in windows),
              "baseline": "weights=float32 (the GGUF dequantized) kv=float32",
              "int8_weight_scales": f"group-wise, {int8.GROUP_SIZES[0]} input rows per scale "
                                    "(int8-per-column: one per output column, before)",
              "kv_scales": "int8 / fp8 KV: one 1-byte scale code per token and KV head",
              "note": "CPU box shared (2 cores, other jobs running): tok/s are contended; "
                      "compare rows of this one run only",
              "modes": rows}
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    if args.model is None and not args.modes:   # the table the engine quotes at start-up
        from jaxserve.quantization.cost import MEASURED

        MEASURED.write_text(json.dumps(report, indent=1) + "\n")
    print(markdown_table(report))


def markdown_table(report: dict) -> str:
    lines = ["| mode | KL mean | KL p99 | top-1 agree | greedy-128 agree | perplexity | "
             "weights MiB | KV B/token | tok/s b=1 | tok/s b=64 |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in report["modes"]:
        lines.append(f"| {r['mode']} | {r['kl_mean']:.2e} | {r['kl_p99']:.2e} | "
                     f"{r['top1_agreement']:.1%} | {r['greedy_128_agreement']:.1%} | "
                     f"{r['perplexity']:.2f} | {r['weight_bytes'] / 2**20:.0f} | "
                     f"{r['kv_bytes_per_token']} | {r['decode_tok_s_batch1']:.1f} | "
                     f"{r['decode_tok_s_batch64']:.0f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
