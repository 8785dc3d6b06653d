"""`jaxserve compile`: print the plan of an ahead-of-time compile (engine/aot_compile.py)."""

from __future__ import annotations

import json
import sys
from typing import Any

from jaxserve.config import EngineConfig


def run_compile(config: EngineConfig, target: str, output: str, *, as_json: bool,
                plan_only: bool = False) -> int:
    import jax

    from jaxserve.platforms import platform_for_target

    platform = platform_for_target(target)       # an unknown target: ValueError, no jax yet
    gpu_target = target if platform.device_memory_bytes is not None else None
    if gpu_target:
        # The CUDA plugin builds compile-only devices only while no GPU backend is set up.
        jax.config.update("jax_platforms", "cpu")
    from jaxserve.engine.aot_compile import compile_for_target

    summary = compile_for_target(config, gpu_target, output, plan_only=plan_only)
    sys.stdout.write(describe(summary) + "\n")
    if as_json:
        sys.stdout.write(json.dumps(summary) + "\n")
    sys.stdout.flush()
    return 0


def describe(summary: dict[str, Any]) -> str:
    gib = 2**30
    pp = summary.get("pipeline_parallel_size", 1)
    layout = f" (pp {pp} x tp {summary['tensor_parallel_size']})" if pp > 1 else ""
    written = summary["output"] if summary["buckets"][0]["file"] else "(plan only)"
    lines = [f"{summary['architecture']} for {summary['target']} x{summary['devices']}{layout} "
             f"({summary['dtype']}, KV {summary['kv_cache_dtype']}, max_model_len "
             f"{summary['max_model_len']}):",
             f"  weights {summary['weights_bytes_per_device'] / gib:.2f} GiB + activation peak "
             f"{summary['activation_peak_bytes'] / gib:.2f} GiB + KV cache "
             f"{summary['kv_cache_bytes_per_device'] / gib:.2f} GiB per device"
             + (" (the busiest stage's weights, the deciding stage's KV)" if pp > 1 else ""),
             f"  KV cache: {summary['kv_cache_blocks']} blocks x {summary['block_size']} = "
             f"{summary['kv_cache_tokens']} tokens ({summary['plan_source']})"]
    for stage in summary.get("stages", []):
        lines.append(
            f"  stage {stage['stage']}: layers {stage['layers'][0]}-{stage['layers'][1] - 1} on "
            f"devices {','.join(map(str, stage['devices']))}: weights "
            f"{stage['weights_bytes_per_device'] / gib:.2f} GiB + temporaries "
            f"{stage['temp_bytes'] / gib:.2f} GiB + KV cache "
            f"{stage['kv_cache_bytes_per_device'] / gib:.2f} GiB per device; its memory holds "
            f"{stage['own_kv_cache_blocks']} blocks"
            + (" (decides)" if stage["decides"] else "") + f", bound by {stage['bound_by']}")
    lines.append(f"  {len(summary['buckets'])} buckets compiled in "
                 f"{summary['compile_seconds']:.1f} s -> {written}")
    for b in summary["buckets"]:
        lines.append(f"    {b['num_tokens']:>5} tokens x {b['num_seqs']:>3} seqs: "
                     f"{b['compile_seconds']:6.1f} s, {b['serialized_bytes'] / 2**20:7.1f} MiB, "
                     f"temporaries {b['temp_bytes'] / 2**20:8.1f} MiB"
                     + ("" if "stage_temp_bytes" not in b else " (per stage " + ", ".join(
                         f"{t / 2**20:.1f}" for t in b["stage_temp_bytes"]) + ")"))
    return "\n".join(lines)
