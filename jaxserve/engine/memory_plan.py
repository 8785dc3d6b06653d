"""The startup memory plan: what the weights, penalty tables, LoRA slots, a draft model and the
widest step's activations leave of the budget for the KV cache (`runner/memory.plan_kv_cache`
does the arithmetic), and the same plan again for the compiled steps' measured peak.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any, Callable

import jax
import numpy as np

from jaxserve.config import CacheConfig, EngineConfig
from jaxserve.models.arch import ModelArch
from jaxserve.models.pipeline_placement import PipelinePlacement
from jaxserve.models.registry import family_for, read_arch
from jaxserve.platforms import Platform
from jaxserve.quantization.cost import measured_cost
from jaxserve.runner.memory import KVCachePlan, plan_kv_cache
from jaxserve.runner.penalty_state import PenaltyState

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class MemoryPlan:
    kv_plan: KVCachePlan
    lora_targets: dict | None        # None: LoRA off
    draft: dict[str, Any] | None     # load_draft's (None: no draft model)
    # The same plan for another activation peak (the compiled steps' measured one).
    replan: Callable[[int], KVCachePlan]


def plan_memory(config: EngineConfig, cc: CacheConfig, placed: Any, family: Any,
                 kv_dtype: Any, max_model_len: int, platform: Platform,
                 spec_rows: Any) -> MemoryPlan:
    """Size the KV cache from what the weights, LoRA slots, a draft model and the widest
    step's activations leave of the budget (`cc`: the cache config, an --aot-dir's block
    count applied)."""
    sc = config.scheduler_config
    arch, dtype, placement = placed.arch, placed.dtype, placed.placement
    lora_targets = lora_targets_for(config, family, arch)
    weight_bytes = resident_bytes_per_device(config, placed, lora_targets)
    # Activations: the widest step holds a few [T, max(hidden, intermediate)] tensors and the
    # logits of S rows and of the prompt-logprobs positions; leave generous room for them.
    t_max = sc.max_num_batched_tokens
    logits_rows = min(t_max, sc.max_num_seqs) + sc.max_prompt_logprobs_per_step + \
        spec_rows.max_rows * (spec_rows.num_tokens + 1)
    activation_bytes = 8 * t_max * max(arch.intermediate_size, arch.hidden_size) * 4 + \
        logits_rows * arch.vocab_size * 4 * 4
    # Pipeline stages plan per stage: the penalty tables sit on the last one.
    penalty_bytes = penalty_table_bytes(config, arch)
    draft = None
    spec = config.spec_decode
    if spec is not None and spec.method == "draft_model":
        draft = load_draft(config, arch, dtype, platform, max_model_len, spec_rows.max_rows)
        weight_bytes += draft["bytes"]       # its weights and KV come out of the same pool

    def plan(activation: int) -> KVCachePlan:
        if isinstance(placement, PipelinePlacement):   # pipeline parallel: planned per stage
            from jaxserve.engine.pipeline_memory import plan_pipeline_kv_cache

            kv_plan = plan_pipeline_kv_cache(cc, placement, getattr(placed.params, "spec",
                                                                    placed.params),
                                             kv_dtype, penalty_bytes, activation,
                                             max_model_len, dtype,
                                             stage_extra_bytes=pipeline_stage_extra_bytes(
                                                 config, placement, lora_targets, dtype))
        else:
            kv_plan = placement.agree(plan_kv_cache(cc, arch, kv_dtype, weight_bytes,
                                                    activation, max_model_len,
                                                    tp_size=placement.tp,
                                                    device=placement.device,
                                                    compute_dtype=dtype))
        if draft is not None and cc.kv_cache_memory_bytes and not cc.num_gpu_blocks_override:
            # An explicit KV budget is the target's and the draft's together.
            taken = -(-draft["kv_bytes"] // kv_plan.bytes_per_block)
            kv_plan = dataclasses.replace(kv_plan, num_blocks=max(
                kv_plan.num_blocks - taken, -(-max_model_len // kv_plan.block_size)))
        logger.info("KV cache: %d blocks x %d tokens = %d tokens in %s (%.2f GiB; budget from "
                    "%s); max concurrency at max_model_len=%d: %.1fx", kv_plan.num_blocks,
                    kv_plan.block_size, kv_plan.capacity_tokens, np.dtype(kv_dtype).name,
                    kv_plan.total_bytes / 2**30,
                    kv_plan.source, max_model_len, kv_plan.capacity_tokens / max_model_len)
        logger.info(kv_plan.describe())
        return kv_plan

    kv_plan = plan(activation_bytes)
    cost = measured_cost(placed.quantization, cc.kv_cache_dtype)
    if cost:
        logger.warning(cost)
    return MemoryPlan(kv_plan, lora_targets, draft, plan)


def lora_targets_for(config: EngineConfig, family: Any, arch: ModelArch) -> dict | None:
    """The projections LoRA adapters may target (None: LoRA off)."""
    if not config.lora_config.enable_lora:
        return None
    from jaxserve.lora.peft_loader import supported_targets

    return supported_targets(family, arch)


def penalty_table_bytes(config: EngineConfig, arch: ModelArch) -> int:
    """The sampler's penalty history tables (one row per sequence slot), on one device."""
    return PenaltyState.nbytes(config.scheduler_config.max_num_seqs + 1, arch.vocab_size)


def resident_bytes_per_device(config: EngineConfig, placed: Any, lora_targets: dict | None
                              ) -> int:
    """What lives as long as the weights, per device: the weights (a RestoringParams, still
    being read: from its shapes), the runner's penalty history tables, and the LoRA slots
    (whole). Startup and `jaxserve compile` plan the KV cache beside this."""
    arch, placement = placed.arch, placed.placement
    total = placement.weight_bytes_per_device(getattr(placed.params, "spec", placed.params),
                                              placed.resident_bytes)
    total += penalty_table_bytes(config, arch)
    # the adapter slots come out of the weights' share
    return total + lora_slot_bytes(config, lora_targets, arch.num_layers, placed.dtype)


def pipeline_stage_extra_bytes(config: EngineConfig, placement: Any,
                               lora_targets: dict | None, dtype: Any) -> list[int]:
    """What each pipeline stage's devices hold beside its weights, KV cache and temporaries:
    its layers' LoRA slots, and the hidden states [T, H] float32 of the widest step that it
    takes from the previous stage and hands to the next (XLA counts them among the stage
    program's arguments and outputs, beside the step I/O runner/memory.py allows for)."""
    hidden = config.scheduler_config.max_num_batched_tokens * placement.arch.hidden_size * 4
    return [lora_slot_bytes(config, lora_targets, layers.num_layers, dtype)
            + hidden * ((not layers.is_first) + (not layers.is_last))
            for layers in placement.layers]


def lora_slot_bytes(config: EngineConfig, lora_targets: dict | None, num_layers: int,
                    dtype: Any) -> int:
    """The adapter slots of `num_layers` layers, whole (0 with LoRA off): every slot (and
    the base's zero slot) at max_lora_rank, A and B of every target."""
    if lora_targets is None:
        return 0
    lc = config.lora_config
    return sum(num_layers * (lc.max_loras + 1) * lc.max_lora_rank
               * (t.in_features + t.out_features) for t in lora_targets.values()
               ) * np.dtype(dtype).itemsize


def load_draft(config: EngineConfig, arch: ModelArch, dtype: Any, platform: Platform,
                max_model_len: int, max_rows: int) -> dict[str, Any]:
    """Speculative decoding's draft model: weights on the target's device, and the size of
    its KV cache (enough for max_rows sequences of max_model_len + k, plus one spare block
    each); one device only."""
    from jaxserve.loader import HubOptions, load_model
    from jaxserve.runner.memory import bytes_per_block

    spec = config.spec_decode
    if config.parallel_config.tensor_parallel_size > 1:
        raise ValueError("speculative_config method 'draft_model' runs on one device; "
                         "tensor_parallel_size > 1 is not supported with it")
    # A draft named by its Hub id: the target's cache and token, the draft's main revision.
    mc = config.model_config
    loaded = load_model(spec.model, dtype=np.dtype(dtype),
                        hub=HubOptions(cache_dir=mc.download_dir, token=mc.hf_token))
    draft_arch = read_arch(loaded.hf_config)
    if draft_arch.vocab_size != arch.vocab_size:
        raise ValueError(f"speculative_config: the draft model's vocabulary "
                         f"({draft_arch.vocab_size}) differs from the target's "
                         f"({arch.vocab_size}); it must share the tokenizer")
    draft_len = max_model_len + spec.num_speculative_tokens
    if draft_len > draft_arch.max_position_embeddings:
        raise ValueError(f"speculative_config: the draft model's context "
                         f"({draft_arch.max_position_embeddings}) is shorter than "
                         f"max_model_len + num_speculative_tokens ({draft_len})")
    num_params = sum(int(np.prod(w.shape)) for w in loaded.weights.values())
    params = jax.device_put(
        family_for(draft_arch.architecture).params_from_weights(loaded.weights, draft_arch))
    block_size = config.cache_config.block_size
    num_blocks = max_rows * (-(-draft_len // block_size) + 1)
    kv_bytes = num_blocks * bytes_per_block(draft_arch, block_size, dtype)
    logger.info("draft model %s: %s, %.1fM parameters; its KV cache: %d blocks (%.2f GiB)",
                loaded.model_path, draft_arch.architecture, num_params / 1e6, num_blocks,
                kv_bytes / 2**30)
    return {"arch": draft_arch, "params": params, "num_blocks": num_blocks,
            "max_model_len": draft_len, "kv_bytes": kv_bytes,
            "bytes": kv_bytes + num_params * np.dtype(dtype).itemsize}

