"""The KV-cache plan of a pipeline-parallel engine: each stage planned from its own memory.

Stage ``s`` holds its weights and its own layers' KV cache, so a block costs it
``2 * layers_s * block_size * kv_heads/tp * head_dim * itemsize`` bytes per device and its
budget is what its devices have left after its weights. Every stage must hold the same
number of blocks (a block id means the same position on every stage), so the stage with
the fewest decides. On CPU all stages' simulated devices share the host's RAM: each stage
plans with its share of the layers of the pool (the budget and the utilization fraction),
so every stage fits the same blocks and pp stages hold pp = 1's tokens in the same RAM, as
tensor parallel already splits a pool among its devices. Across processes (a stage per
host) a process plans only its own stages, sharing its own pool among them.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from jaxserve.config import CacheConfig
from jaxserve.models.partition import per_device_bytes
from jaxserve.platforms import platform_of_device
from jaxserve.runner.memory import KVCachePlan, plan_kv_cache

logger = logging.getLogger(__name__)


def plan_pipeline_kv_cache(cc: CacheConfig, placement: Any, params: Any, kv_dtype: Any,
                           last_stage_bytes: int, activation_bytes: int, max_model_len: int,
                           compute_dtype: Any) -> KVCachePlan:
    """The plan of the stage with the fewest blocks (see the module docstring).

    placement: the PipelinePlacement; params: its placed per-stage trees (or their shape
    structs); last_stage_bytes: what only the last stage holds beside its weights (the
    sampler's penalty tables)."""
    pp = placement.pp
    shared_pool = placement.device is not None and \
        platform_of_device(placement.device).memory_is_host_ram
    # Across processes each process plans its own stages (from its own memory) and
    # `agree` takes the fewest blocks of all.
    local = [index for index in range(pp) if placement.is_local(index)]
    total_layers = sum(placement.layers[index].num_layers for index in local)
    plans = []
    for index in local:
        stage, stage_params = placement.stages[index], params[index]
        weights = per_device_bytes(stage_params) + (last_stage_bytes if index == pp - 1 else 0)
        stage_cc = cc
        if shared_pool:      # the stage's share of the one pool: its share of the layers
            share = placement.layers[index].num_layers / total_layers
            stage_cc = dataclasses.replace(
                cc, gpu_memory_utilization=cc.gpu_memory_utilization * share,
                kv_cache_memory_bytes=int(cc.kv_cache_memory_bytes * share)
                if cc.kv_cache_memory_bytes else cc.kv_cache_memory_bytes)
        plans.append(plan_kv_cache(stage_cc, stage.arch, kv_dtype, weights, activation_bytes,
                                   max_model_len, tp_size=stage.tp, device=stage.device,
                                   compute_dtype=compute_dtype))
    fewest = min(plans, key=lambda plan: plan.num_blocks)
    logger.info("pipeline KV cache: blocks per stage %s; the smallest, %d, decides "
                "(%s MiB of KV per device per stage)", [p.num_blocks for p in plans],
                fewest.num_blocks, ", ".join(
                    f"{fewest.num_blocks * p.bytes_per_block / 2**20:.1f}" for p in plans))
    return placement.agree(fewest)
