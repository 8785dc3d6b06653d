"""What `jaxserve compile -pp` plans and reports per pipeline stage (engine/aot_compile.py).

The plan is startup's (engine/pipeline_memory.py: `stage_kv_plans`, then the stage with the
fewest blocks decides), made from the target's memory and each stage's own compiled
programs' temporaries rather than startup's estimate. The report gives each stage's
layers, devices, weights per device, temporaries, KV bytes per device at the engine's block
count, the blocks its own memory would hold, and the bound that sized it (the
--gpu-memory-utilization share, or XLA's limit for the stage's program).
"""

from __future__ import annotations

from typing import Any

from jaxserve.config import EngineConfig
from jaxserve.engine.memory_plan import penalty_table_bytes, pipeline_stage_extra_bytes
from jaxserve.engine.pipeline_memory import fewest_blocks, stage_kv_plans
from jaxserve.models.partition import per_device_bytes
from jaxserve.runner.memory import KVCachePlan


def _stage_plans(engine: Any, config: EngineConfig, activation_bytes: int | list[int]
                 ) -> list[KVCachePlan]:
    # engine.config: the resolved config, batch limits settled (the widest step's tokens)
    extra = pipeline_stage_extra_bytes(engine.config, engine.pipeline, engine.lora_targets,
                                       engine.dtype)
    return stage_kv_plans(config.cache_config, engine.pipeline, engine.stage_params,
                          engine.kv_dtype, penalty_table_bytes(engine.config, engine.arch),
                          activation_bytes, engine.max_model_len, engine.dtype,
                          engine.platform.device_memory_bytes, extra)


def pipeline_kv_plan(engine: Any, config: EngineConfig, activation_bytes: int | list[int]
                     ) -> tuple[KVCachePlan, list[KVCachePlan]]:
    """(the engine's plan, each stage's own plan) for an AbstractEngine with pp > 1.
    activation_bytes: one figure for every stage, or each stage's temporaries."""
    plans = _stage_plans(engine, config, activation_bytes)
    return fewest_blocks(engine.pipeline, plans), plans


def stage_summaries(engine: Any, config: EngineConfig, plan: KVCachePlan,
                    temp_bytes: list[int], planned_with: list[int]) -> list[dict[str, Any]]:
    """Each stage's part of the plan, in stage order. plan: the engine's (its block count);
    temp_bytes: each stage's measured temporaries; planned_with: what the plan reserved."""
    stage_plans = _stage_plans(engine, config, planned_with)
    decides = min(range(len(stage_plans)), key=lambda i: stage_plans[i].num_blocks)
    summaries = []
    for index, (layers, placement, params, own) in enumerate(zip(
            engine.pipeline.layers, engine.pipeline.stages, engine.stage_params, stage_plans)):
        summaries.append({
            "stage": index, "layers": [layers.first, layers.end],
            "num_layers": layers.num_layers,
            "devices": [int(device.id) for device in placement.mesh.devices.flat],
            "weights_bytes_per_device": per_device_bytes(params),
            # beside the weights: LoRA slots, hidden states in/out, the last stage's
            # penalty tables
            "resident_bytes_per_device": own.weight_bytes,
            "temp_bytes": int(temp_bytes[index]),
            "kv_cache_bytes_per_block": own.bytes_per_block,
            "kv_cache_bytes_per_device": plan.num_blocks * own.bytes_per_block,
            "own_kv_cache_blocks": own.num_blocks,
            "bound": own.source, "bound_by": bound_label(own.source),
            "decides": index == decides})
    return summaries


def bound_label(source: str) -> str:
    """A plan's source (runner/memory.py) in a few words: which bound sized the cache."""
    if source.startswith("bound by XLA's limit"):
        return "XLA's limit"
    if source.startswith("bound by"):
        return "--gpu-memory-utilization"
    return source.split(",")[0].split(" (")[0]
