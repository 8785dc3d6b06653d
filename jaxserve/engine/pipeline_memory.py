"""The KV-cache plan of a pipeline-parallel engine: each stage planned from its own memory.

Stage ``s`` holds its weights and its own layers' KV cache, so a block costs it
``2 * layers_s * block_size * kv_heads/tp * head_dim * itemsize`` bytes per device and its
budget is what its devices have left after its weights. Every stage must hold the same
number of blocks (a block id means the same position on every stage), so the stage with
the fewest decides. On CPU all stages' simulated devices share the host's RAM: each stage
plans with its share of the layers of the pool (the budget and the utilization fraction),
so every stage fits the same blocks and pp stages hold pp = 1's tokens in the same RAM, as
tensor parallel already splits a pool among its devices. Across processes (a stage per
host) a process plans only its own stages, sharing its own pool among them. On a GPU each
stage's devices have their own memory, and each stage's plan is the single-engine GPU rule
(runner/memory.py): the utilization share or XLA's limit for the stage's own program,
whichever leaves less. Startup and `jaxserve compile -pp` (engine/aot_compile.py) plan
with these same functions.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import Any

from jaxserve.config import CacheConfig
from jaxserve.models.partition import per_device_bytes
from jaxserve.platforms import platform_of_device
from jaxserve.runner.memory import KVCachePlan, plan_kv_cache

logger = logging.getLogger(__name__)


def stage_kv_plans(cc: CacheConfig, placement: Any, params: Any, kv_dtype: Any,
                   last_stage_bytes: int, activation_bytes: int | Sequence[int],
                   max_model_len: int, compute_dtype: Any,
                   device_memory_bytes: int | None = None,
                   stage_extra_bytes: Sequence[int] | None = None) -> list[KVCachePlan]:
    """Each stage's own plan, in stage order (see the module docstring).

    placement: the PipelinePlacement; params: its placed per-stage trees (or their shape
    structs); last_stage_bytes: what only the last stage holds beside its weights (the
    sampler's penalty tables); activation_bytes: the step's temporaries per device, one
    figure for every stage or one per stage (a compile measures each stage's program);
    device_memory_bytes: a GPU target's memory (`jaxserve compile`), None for the devices
    here; stage_extra_bytes: what else each stage holds as long as its weights (its LoRA
    slots). Raises KVCacheDoesNotFit for the first stage that cannot hold one sequence."""
    pp = placement.pp
    activations = [activation_bytes] * pp if isinstance(activation_bytes, int) else \
        list(activation_bytes)
    if len(activations) != pp:
        raise ValueError(f"activation_bytes: {len(activations)} figures for {pp} stages")
    shared_pool = not device_memory_bytes and placement.device is not None and \
        platform_of_device(placement.device).memory_is_host_ram
    extra = list(stage_extra_bytes) if stage_extra_bytes is not None else [0] * pp
    # Across processes each process plans its own stages (from its own memory) and
    # `agree` takes the fewest blocks of all.
    local = [index for index in range(pp) if placement.is_local(index)]
    total_layers = sum(placement.layers[index].num_layers for index in local)
    plans = []
    for index in local:
        stage, stage_params = placement.stages[index], params[index]
        weights = per_device_bytes(stage_params) + extra[index] + \
            (last_stage_bytes if index == pp - 1 else 0)
        stage_cc = cc
        if shared_pool:      # the stage's share of the one pool: its share of the layers
            share = placement.layers[index].num_layers / total_layers
            stage_cc = dataclasses.replace(
                cc, gpu_memory_utilization=cc.gpu_memory_utilization * share,
                kv_cache_memory_bytes=int(cc.kv_cache_memory_bytes * share)
                if cc.kv_cache_memory_bytes else cc.kv_cache_memory_bytes)
        plans.append(plan_kv_cache(stage_cc, stage.arch, kv_dtype, weights, activations[index],
                                   max_model_len, tp_size=stage.tp, device=stage.device,
                                   device_memory_bytes=device_memory_bytes,
                                   compute_dtype=compute_dtype))
    return plans


def fewest_blocks(placement: Any, plans: Sequence[KVCachePlan]) -> KVCachePlan:
    """The engine's plan from its stages' plans: the stage with the fewest blocks decides
    (every stage then holds that many), agreed across processes as a single engine's is."""
    fewest = min(plans, key=lambda plan: plan.num_blocks)
    logger.info("pipeline KV cache: blocks per stage %s; the smallest, %d, decides "
                "(%s MiB of KV per device per stage)", [p.num_blocks for p in plans],
                fewest.num_blocks, ", ".join(
                    f"{fewest.num_blocks * p.bytes_per_block / 2**20:.1f}" for p in plans))
    return placement.agree(fewest)


def plan_pipeline_kv_cache(cc: CacheConfig, placement: Any, params: Any, kv_dtype: Any,
                           last_stage_bytes: int, activation_bytes: int | Sequence[int],
                           max_model_len: int, compute_dtype: Any,
                           device_memory_bytes: int | None = None,
                           stage_extra_bytes: Sequence[int] | None = None) -> KVCachePlan:
    """The plan of the stage with the fewest blocks (`stage_kv_plans`, `fewest_blocks`)."""
    return fewest_blocks(placement, stage_kv_plans(
        cc, placement, params, kv_dtype, last_stage_bytes, activation_bytes, max_model_len,
        compute_dtype, device_memory_bytes, stage_extra_bytes))
