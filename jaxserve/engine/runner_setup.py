"""From a placed model to its runner, for a platform: the steps startup (model_setup.py) and
`jaxserve compile` (aot_compile.py) share, so an executable compiled ahead of time is the
one the engine would build.

    config = prepare_config(config, platform)             # resolved once, read-only
    placed = place_model(...) or place_abstract_model(...)
    shape = step_shape(config, placed, platform)          # the model's limits, settled
    runner = build_runner(shape, num_blocks, block_size, eos, lora_stacks)
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import jax

from jaxserve.attention.backend import AttentionBackend
from jaxserve.config import EngineConfig
from jaxserve.models.arch import ModelArch
from jaxserve.models.pipeline_placement import PipelinePlacement
from jaxserve.platforms import Platform
from jaxserve.quantization.kv import resolve_kv_cache_dtype
from jaxserve.runner.execution_plan import choose_execution_plan
from jaxserve.runner.model_runner import ModelRunner

logger = logging.getLogger(__name__)


def prepare_config(config: EngineConfig, platform: Platform) -> EngineConfig:
    """The config resolved for `platform` (its defaults, ranges checked: a read-only copy),
    and the process set up as the platform's steps assume, before anything is traced."""
    resolved = platform.resolve_config(config)
    platform.configure_process(resolved)
    return resolved


def resolve_max_model_len(requested: int | None, arch: ModelArch) -> int:
    # Sliding-window layers need no cap: attention bounds what they read per layer.
    limit = arch.max_position_embeddings
    if requested is None:
        return limit
    if requested < 1 or requested > limit:
        raise ValueError(f"max_model_len must be in [1, {limit}] for this model, got {requested}")
    return requested


def settle_batch_limits(config: EngineConfig, max_model_len: int) -> EngineConfig:
    """Without chunked prefill a prompt is never split: the step's token budget (and the
    prompt-logprobs gather) must hold a whole max_model_len prompt. Returns the resolved
    config with those limits (a new one where they change)."""
    sc = config.scheduler_config
    if sc.enable_chunked_prefill:
        return config
    tokens = max(sc.max_num_batched_tokens, max_model_len)
    changes: dict[str, Any] = {"max_num_batched_tokens": tokens}
    if sc.max_prompt_logprobs_per_step:
        changes["max_prompt_logprobs_per_step"] = tokens
    if all(getattr(sc, k) == v for k, v in changes.items()):
        return config
    return config.with_changes(scheduler_config=changes)


@dataclass(frozen=True)
class StepShape:
    """What a runner is built from, beyond its KV cache's size."""
    config: EngineConfig          # resolved, with the model's batch limits settled
    placed: Any                   # model_source.PlacedModel (arrays, or abstract)
    platform: Platform
    backend: AttentionBackend     # sharded as the placement is
    kv_dtype: Any
    max_model_len: int

    @property
    def num_spec_tokens(self) -> int:
        spec = self.config.spec_decode
        return spec.num_speculative_tokens if spec is not None else 0

    @property
    def max_spec_rows(self) -> int:
        """Sequences that carry draft tokens (0: speculation off)."""
        spec, sc = self.config.spec_decode, self.config.scheduler_config
        return min(spec.disable_by_batch_size, sc.max_num_seqs) if spec is not None else 0


def step_shape(config: EngineConfig, placed: Any, platform: Platform) -> StepShape:
    """The model's limits (max_model_len, the batch limits it implies, the KV dtype) and the
    platform's attention backend for a placed model."""
    kv_dtype = resolve_kv_cache_dtype(config.cache_config.kv_cache_dtype, placed.dtype)
    max_model_len = resolve_max_model_len(config.model_config.max_model_len, placed.source_arch)
    config = settle_batch_limits(config, max_model_len)
    backend = placed.placement.shard_backend(
        platform.attention_backend(config.runner_config.attention_backend))
    return StepShape(config, placed, platform, backend, kv_dtype, max_model_len)


def gemv_rows(shape: StepShape, cache_dir: str | None) -> int:
    """The platform's measured matmul choice for this model: up to how many rows float
    projections take the streaming GEMV (0: never)."""
    placed = shape.placed
    return shape.platform.gemv_rows(shape.config.model_config.cpu_gemv_rows, placed.arch,
                                    placed.dtype, reads_weights_in_place(shape), cache_dir)


def reads_weights_in_place(shape: StepShape) -> bool:
    """Whether the step's plan has the CPU matmul library read the weights in place."""
    mesh = getattr(shape.placed.placement, "mesh", None)
    return choose_execution_plan(shape.platform, shape.backend.name,
                                 1 if mesh is None else mesh.size, shape.placed.dtype).cpu_matmul


def lora_slots(config: EngineConfig, family: Any, placement: Any, targets: dict, dtype: Any,
               abstract: bool = False) -> Any:
    """The device adapter slots (lora/stacks.py), split like their base kernels; abstract:
    their ShapeDtypeStructs (an ahead-of-time compile). Pipeline parallel: each stage's
    slots for its own layers on its own devices (lora/pipeline_stacks.py)."""
    from jax.sharding import PartitionSpec as P

    from jaxserve.lora.stacks import LoRAStacks

    if isinstance(placement, PipelinePlacement):
        from jaxserve.lora.pipeline_stacks import PipelineLoRAStacks

        return PipelineLoRAStacks([lora_slots(config, family, stage, targets, dtype, abstract)
                                   for stage in placement.stages], placement.layers)
    lc = config.lora_config
    specs = None
    if placement.mesh is not None:
        spec_fn = family.param_spec_for(placement.arch)
        shapes = family.weight_shapes(placement.arch)
        # a kernel left whole (tp = 1 on a one-device mesh: no spec) is [L, in, out] unsplit
        specs = {t: spec_fn(("layers", t, "kernel"), shapes[f"layers.{t}.kernel"],
                            placement.tp) or P(None, None, None) for t in targets}
    return LoRAStacks(targets, placement.arch.num_layers, lc.max_loras, lc.max_lora_rank,
                      dtype, placement.mesh, specs, abstract=abstract)


def build_runner(shape: StepShape, num_blocks: int, block_size: int, eos: list[int],
                 lora_stacks: Any = None, gemv_rows: int = 0) -> ModelRunner:
    """The runner for the placed model with a KV cache of `num_blocks` blocks per layer;
    abstract (nothing allocated) when the placed params are ShapeDtypeStructs."""
    config, placed = shape.config, shape.placed
    mc, sc, placement = config.model_config, config.scheduler_config, placed.placement
    runner_class, stages = ModelRunner, {}
    if isinstance(placement, PipelinePlacement):      # pipeline parallel
        from jaxserve.runner.pipeline_runner import PipelineModelRunner

        runner_class = PipelineModelRunner
        if placed.source_format != "abstract" and jax.process_count() > 1:
            from jaxserve.runner.pipeline_processes import MultiProcessPipelineRunner

            runner_class = MultiProcessPipelineRunner    # a stage (or several) per process
        stages = {
            "pipeline": placement,
            "micro_batches": config.parallel_config.pipeline_micro_batches or 1}
    return runner_class(
        placed.arch, placed.params, shape.backend, dtype=placed.dtype, num_blocks=num_blocks,
        block_size=block_size, max_model_len=shape.max_model_len,
        kv_cache_dtype=shape.kv_dtype, max_num_seqs=sc.max_num_seqs,
        max_num_batched_tokens=sc.max_num_batched_tokens,
        max_logprobs=mc.max_logprobs, eos_token_ids=eos,
        prompt_logprobs_cap=sc.max_prompt_logprobs_per_step,
        num_spec_tokens=shape.num_spec_tokens, max_spec_rows=shape.max_spec_rows,
        kv_sharding=placement.kv_sharding, input_sharding=placement.input_sharding,
        logits_shardings=placement.logits_shardings, lora=lora_stacks, gemv_rows=gemv_rows,
        abstract=placed.source_format == "abstract", **stages)
