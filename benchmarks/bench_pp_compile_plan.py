"""The compile-only memory plan of one model under several parallel layouts, per device and
per pipeline stage: `jaxserve compile --target T --plan-only` for each layout, with no GPU.

    JAX_PLATFORMS=cpu .venv-gpu/bin/python benchmarks/bench_pp_compile_plan.py \\
        configs/models/llama-3-70b --target h200 --layouts 8x1 8x2 \\
        --json benchmarks/results/pp-compile-plan-70b-h200.json

A layout is TPxPP. Each is planned by `compile_for_target` (engine/aot_compile.py), the
startup planner itself (engine/pipeline_memory.py at pp > 1): the one-token decode bucket
and the widest bucket are compiled for the target (each stage's program for its own (1, tp)
sub-mesh) and the KV cache is planned from their temporaries. Prints a markdown table:
weights, temporaries and KV cache per device, KV blocks and tokens, which bound decided,
compile seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

GIB = 2**30


def plan(model: str, target: str, tp: int, pp: int, engine_flags: dict) -> dict:
    from jaxserve.config import EngineConfig
    from jaxserve.engine.aot_compile import compile_for_target

    config = EngineConfig.from_kwargs(model=model, load_format="dummy",
                                      skip_tokenizer_init=True, tensor_parallel_size=tp,
                                      pipeline_parallel_size=pp, **engine_flags)
    start = time.perf_counter()
    summary = compile_for_target(config, target, "/nonexistent/plan-only", plan_only=True)
    summary["wall_seconds"] = round(time.perf_counter() - start, 1)
    return summary


def _bound(source: str) -> str:
    return "XLA limit" if source.startswith("bound by XLA's limit") else \
        "utilization" if source.startswith("bound by") else source


def rows(summary: dict) -> list[str]:
    """Markdown rows: the engine, then (pp > 1) one per stage."""
    tp, pp = summary["tensor_parallel_size"], summary["pipeline_parallel_size"]
    layout = f"tp{tp}" if pp == 1 else f"pp{pp} x tp{tp}"
    stages = summary.get("stages") or [{
        "stage": "-", "layers": [0, None], "num_layers": "all",
        "weights_bytes_per_device": summary["weights_bytes_per_device"],
        "temp_bytes": summary["activation_peak_bytes"],
        "kv_cache_bytes_per_device": summary["kv_cache_bytes_per_device"],
        "own_kv_cache_blocks": summary["kv_cache_blocks"],
        "bound": summary["plan_source"], "decides": True}]
    out = []
    for stage in stages:
        decides = " (decides)" if stage["decides"] and pp > 1 else ""
        out.append(
            f"| {layout} | {summary['devices']} | {stage['stage']} | {stage['num_layers']} | "
            f"{stage['weights_bytes_per_device'] / GIB:.2f} GiB | "
            f"{stage['temp_bytes'] / GIB:.2f} GiB | "
            f"{stage['kv_cache_bytes_per_device'] / GIB:.2f} GiB | "
            f"{stage['own_kv_cache_blocks']:,}{decides} | "
            f"{summary['kv_cache_blocks']:,} | {summary['kv_cache_tokens']:,} | "
            f"{_bound(stage['bound'])} | {summary['compile_seconds']:.0f} s |")
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="a directory holding the model's config.json")
    parser.add_argument("--target", default="h200")
    parser.add_argument("--layouts", nargs="+", default=["8x1", "8x2"], help="TPxPP each")
    parser.add_argument("--engine-flags", default="{}",
                        help="JSON of further EngineConfig kwargs (dtype, max_model_len, ...)")
    parser.add_argument("--json", default=None, help="write every summary here")
    args = parser.parse_args()
    if os.environ.get("JAX_PLATFORMS") != "cpu":
        sys.exit("run with JAX_PLATFORMS=cpu and the gpu-compile extras (.venv-gpu)")
    flags = json.loads(args.engine_flags)
    summaries = []
    for layout in args.layouts:
        tp, pp = (int(n) for n in layout.split("x"))
        summaries.append(plan(args.model, args.target, tp, pp, flags))
        print(f"{layout}: {summaries[-1]['wall_seconds']} s", file=sys.stderr, flush=True)
    first = summaries[0]
    probes = ", ".join(f"{b['num_tokens']}x{b['num_seqs']}" for b in first["buckets"])
    print(f"{first['architecture']} on {args.target}, {first['dtype']} weights, KV "
          f"{first['kv_cache_dtype']}, max_model_len {first['max_model_len']}, planned from "
          f"the probe buckets (tokens x seqs: {probes})\n")
    print("| layout | devices | stage | layers | weights / device | temporaries | "
          "KV cache / device | blocks its memory holds | engine's KV blocks | KV tokens | "
          "bound | compile |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for summary in summaries:
        print("\n".join(rows(summary)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": " ".join(sys.argv), "summaries": summaries}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
