"""Startup: load weights, place them, size the KV cache, build the runner, warm up.

Everything here happens once, before the first request, and is logged so a
person can read what the server is about to do.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from dataclasses import dataclass
from typing import Any, Callable

import jax
import numpy as np
from jax.experimental.compilation_cache import compilation_cache

from jaxserve import load_progress
from jaxserve.config import EngineConfig
from jaxserve.engine.memory_plan import MemoryPlan, plan_memory
from jaxserve.engine.runner_setup import (
    StepShape,
    build_runner,
    gemv_rows,
    lora_slots,
    prepare_config,
    reads_weights_in_place,
    step_shape,
)
from jaxserve.engine.weight_packing import pack_for_serving
from jaxserve.loader.hub_download import HubOptions
from jaxserve.models.arch import ModelArch
from jaxserve.models.registry import family_for
from jaxserve.platforms import Platform, current_platform
from jaxserve.runner.host_malloc import keep_freed_memory_in_heap
from jaxserve.runner.memory import KVCachePlan
from jaxserve.runner.model_runner import ModelRunner

logger = logging.getLogger(__name__)

@dataclass
class ModelSetup:
    arch: ModelArch
    tokenizer: Any
    runner: ModelRunner
    kv_plan: KVCachePlan
    max_model_len: int
    dtype: Any
    eos_token_ids: list[int]
    default_sampling_overrides: dict[str, Any]
    model_path: str
    num_params: int
    weight_bytes: int         # resident parameter bytes (all devices), quantized as stored
    warmup_seconds: float
    load_seconds: float
    draft_proposer: Any = None       # speculative decoding's draft model (DraftModelProposer)
    # Seconds per startup phase, for bench_offline.py --startup: load (an orbax restart's
    # tokenizer, with restore_weights in a thread alongside), runner (attention backend,
    # model), warmup (compiles, then kv_fill: allocating the KV cache; params_wait: what it
    # waited for the restore_weights thread).
    phases: dict[str, float] = dataclasses.field(default_factory=dict)
    lora_registry: Any = None        # jaxserve.lora.registry.LoRARegistry (None: LoRA off)
    # The config as resolved for the platform and the model (read-only): what the scheduler
    # and every other part read.
    config: EngineConfig | None = None


def compilation_cache_path(directory: str | None) -> str | None:
    """`RunnerConfig.compilation_cache_dir` resolved: None when off, else the directory
    (where the CPU's measured choices are stored too: kernels/cpu/timings.py)."""
    if directory == "off":
        return None
    return directory or os.path.join(os.path.expanduser("~"), ".cache", "jaxserve", "jax")


def enable_compilation_cache(directory: str | None) -> str | None:
    """Turn on JAX's persistent compilation cache (so a second start skips compiles)."""
    directory = compilation_cache_path(directory)
    if directory is None:
        return None
    os.makedirs(directory, exist_ok=True)
    if jax.config.jax_compilation_cache_dir != directory:
        jax.config.update("jax_compilation_cache_dir", directory)
        # JAX decides once per process, at its first compile, whether a persistent cache is
        # in use: a notebook (or test) that compiled anything before this engine would
        # otherwise never read or write this directory.
        compilation_cache.reset_cache()
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return directory


def eos_ids(tokenizer: Any, generation_config: dict) -> list[int]:
    """generation_config's EOS ids and the tokenizer's (None under skip_tokenizer_init)."""
    ids = generation_config.get("eos_token_id")
    ids = list(ids) if isinstance(ids, (list, tuple)) else ([ids] if ids is not None else [])
    if tokenizer is not None and tokenizer.eos_token_id is not None and \
            tokenizer.eos_token_id not in ids:
        ids.append(tokenizer.eos_token_id)
    return [int(i) for i in ids]


_GEN_CONFIG_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def setup_model(config: EngineConfig, mesh: Any = None, *,
                target_platform: Platform | None = None, warmup: bool = True) -> ModelSetup:
    """mesh: a data-parallel replica's (1, tp) sub-mesh (jaxserve/parallel); default: one
    device, or a (1, tp) mesh when tensor_parallel_size > 1.

    target_platform: build the step for another platform than the devices here (dtype and
    attention backend follow it), to export it (runner.export_step) rather than run it;
    implies warmup=False."""
    from jaxserve.engine.model_source import place_model

    platform = target_platform or current_platform()
    warmup = warmup and target_platform is None
    config = prepare_config(config, platform)
    cache_dir = _prepare_process(config)

    t0 = time.perf_counter()
    load_progress.report("load")
    # Read + convert + place, or (a converted checkpoint) restore straight onto the devices.
    placed = place_model(config, mesh, platform, cache_dir)
    dtype, placement = placed.dtype, placed.placement
    family = family_for(placed.source_arch.architecture)
    shape = step_shape(config, placed, platform)
    if target_platform is None:       # the layout is this machine's (engine/weight_packing.py)
        pack_for_serving(config, placed, reads_weights_in_place(shape))
    config, kv_dtype, max_model_len = shape.config, shape.kv_dtype, shape.max_model_len
    num_params = sum(int(np.prod(s)) for s in family.weight_shapes(placed.source_arch).values())
    arch = placed.arch
    load_seconds = time.perf_counter() - t0
    phases = {**placed.phases, "load": load_seconds}
    _log_model(config, placed, num_params, platform, load_seconds)

    aot_dir, cc = None, config.cache_config
    if config.runner_config.aot_dir:     # shipped executables: take their KV block count
        from jaxserve.engine.aot_manifest import aot_dir_for_engine

        aot_dir, cc = aot_dir_for_engine(config, placed, dtype, kv_dtype, max_model_len)
    spec_rows = _spec_rows(shape)
    memory = plan_memory(config, cc, placed, family, kv_dtype, max_model_len, platform,
                          spec_rows)
    kv_plan = memory.kv_plan

    t_runner = time.perf_counter()
    eos = eos_ids(placed.tokenizer, placed.generation_config)
    backend = shape.backend
    lora_stacks = lora_registry = None
    if memory.lora_targets is not None:
        lora_stacks, lora_registry = _setup_lora(config, family, placement, memory.lora_targets,
                                                 dtype)
    gemv = gemv_rows(shape, cache_dir)

    def build(kv_plan: KVCachePlan) -> ModelRunner:
        runner = build_runner(shape, kv_plan.num_blocks, kv_plan.block_size, eos, lora_stacks,
                              gemv)
        _attach_executable_cache(runner, placement, aot_dir, cache_dir)
        return runner

    runner = build(kv_plan)
    phases["runner"] = time.perf_counter() - t_runner
    logger.info("attention backend %s; %d step buckets (tokens %s); compilation cache %s",
                backend.name, len(runner.buckets.all_shapes()), runner.buckets.token_buckets,
                cache_dir or "off")
    warmup_seconds = 0.0
    if warmup:
        load_progress.report("compile", 0.0)
        runner, kv_plan, warmup_seconds = _warm_up(config, runner, kv_plan, memory, build)
    phases["warmup"] = warmup_seconds
    phases.update(runner.startup_timings)
    phases.update(placed.phases)     # restore_weights and tokenizer: their threads are done
    draft_proposer = None
    if memory.draft is not None:
        draft_proposer, draft_warmup = _draft_proposer(config, memory.draft, backend, dtype,
                                                       kv_plan.block_size, eos, spec_rows,
                                                       warmup)
        warmup_seconds += draft_warmup
    return ModelSetup(arch=arch, tokenizer=placed.tokenizer, runner=runner, kv_plan=kv_plan,
                      max_model_len=max_model_len, dtype=dtype, eos_token_ids=eos,
                      default_sampling_overrides=_sampling_overrides(config, placed),
                      model_path=placed.model_path,
                      num_params=num_params, weight_bytes=placed.resident_bytes,
                      warmup_seconds=warmup_seconds,
                      load_seconds=load_seconds, draft_proposer=draft_proposer,
                      lora_registry=lora_registry, phases=phases, config=config)


def _prepare_process(config: EngineConfig) -> str | None:
    """Turn on the compilation cache (returns its directory, None when off) and, where the
    devices' memory is host RAM, keep freed memory in the heap."""
    cache_dir = enable_compilation_cache(config.runner_config.compilation_cache_dir)
    if current_platform().memory_is_host_ram:     # this process's devices, not a target's
        keep_freed_memory_in_heap()
    return cache_dir


def _attach_executable_cache(runner: ModelRunner, placement: Any, aot_dir: str | None,
                             cache_dir: str | None) -> None:
    """Shipped AOT executables (--aot-dir), else serialized step executables beside JAX's
    compilation cache (a warm start skips tracing too; single-process only)."""
    if aot_dir is not None:
        from jaxserve.models.pipeline_placement import PipelinePlacement
        from jaxserve.runner.aot_executables import AotExecutables, execution_devices

        stage_devices = [execution_devices(stage.mesh) for stage in placement.stages] \
            if isinstance(placement, PipelinePlacement) else None
        runner.executable_cache = AotExecutables(aot_dir, execution_devices(placement.mesh),
                                                 stage_devices)
    elif cache_dir is not None and jax.process_count() == 1:
        runner.enable_executable_cache(os.path.join(cache_dir, "jaxserve-executables"))


def _warm_up(config: EngineConfig, runner: ModelRunner, kv_plan: KVCachePlan,
             memory: MemoryPlan, build: Callable[[KVCachePlan], ModelRunner]
             ) -> tuple[ModelRunner, KVCachePlan, float]:
    """Compile the warm-up buckets, then allocate the KV cache (runner warmup's order: the
    compiler and its GEMM autotuner run while memory holds only the weights); the rest
    compile in the background if configured. Returns (runner, plan, seconds).

    The plan reserved an estimate of the step's activations; the compiled steps report
    their real temporaries (memory_analysis). Where those are larger, the same rule plans
    again with them, and if that leaves fewer blocks the runner is rebuilt for them and
    compiled again (the step's signature holds the cache's shape) before any cache exists."""
    start = time.perf_counter()
    # --enforce-eager: only the two buckets the memory plan needs now; each other bucket is
    # compiled by the first step that needs it (runner.execute), none in the background.
    eager = config.runner_config.enforce_eager
    background = eager or (config.runner_config.compile_in_background
                           and jax.process_count() == 1)
    rest = runner.compile_warmup_buckets(progress=True, background=background)
    peak = runner.compiled_temp_bytes()
    if peak > kv_plan.activation_bytes:
        replanned = memory.replan(peak)
        if replanned.num_blocks < kv_plan.num_blocks:
            logger.warning("the compiled steps need %.1f MiB of temporaries, more than the "
                           "%.1f MiB planned: %d KV blocks, not %d; compiling again for them",
                           peak / 2**20, kv_plan.activation_bytes / 2**20,
                           replanned.num_blocks, kv_plan.num_blocks)
            kv_plan, runner = replanned, build(replanned)
            rest = runner.compile_warmup_buckets(progress=True, background=background)
    if eager and rest:
        logger.info("--enforce-eager: %d step buckets compile on first use instead of at "
                    "start", len(rest))
        rest = []
    runner.finish_warmup(rest, start)
    return runner, kv_plan, time.perf_counter() - start


def _log_model(config: EngineConfig, placed: Any, num_params: int, platform: Platform,
               load_seconds: float) -> None:
    mc = config.model_config
    dtype, resident_bytes = placed.dtype, placed.resident_bytes
    devices = jax.devices()
    if mc.dtype == "auto":
        logger.info("compute dtype (dtype=auto): %s", placed.dtype_reason)
    logger.info("model %s: %s, %.1fM parameters, dtype %s, quantization %s (%.1f MiB of "
                "weights, %.2fx %s), on %d %s device(s) (%s) [%.1f s]",
                placed.model_path, placed.arch.architecture, num_params / 1e6,
                np.dtype(dtype).name, placed.quantization, resident_bytes / 2**20,
                resident_bytes / (num_params * np.dtype(dtype).itemsize), np.dtype(dtype).name,
                len(devices), platform.name, devices[0].device_kind, load_seconds)


@dataclass(frozen=True)
class _SpecRows:
    """Speculative decoding's shape of a step (zeros when it is off)."""
    num_tokens: int      # draft tokens per sequence
    max_rows: int        # sequences that carry drafts


def _spec_rows(shape: StepShape) -> _SpecRows:
    return _SpecRows(shape.num_spec_tokens, shape.max_spec_rows)


def _draft_proposer(config: EngineConfig, draft: dict[str, Any], backend: Any, dtype: Any,
                    block_size: int, eos: list[int], spec_rows: _SpecRows,
                    warmup: bool) -> tuple[Any, float]:
    """Speculative decoding's draft model runner and proposer; (proposer, warm-up seconds)."""
    from jaxserve.engine.block_manager import BlockManager
    from jaxserve.engine.draft_model import DraftModelProposer

    sc = config.scheduler_config
    draft_runner = ModelRunner(
        draft["arch"], draft["params"], backend, dtype=dtype,
        num_blocks=draft["num_blocks"], block_size=block_size,
        max_model_len=draft["max_model_len"], max_num_seqs=spec_rows.max_rows,
        max_num_batched_tokens=sc.max_num_batched_tokens, max_logprobs=0,
        eos_token_ids=eos)
    seconds = draft_runner.warmup(progress=True) if warmup else 0.0
    proposer = DraftModelProposer(
        draft_runner, BlockManager(draft["num_blocks"], block_size),
        spec_rows.num_tokens, sc.max_num_batched_tokens)
    return proposer, seconds


def _sampling_overrides(config: EngineConfig, placed: Any) -> dict[str, Any]:
    """Default sampling parameters from generation_config.json (vLLM's --generation-config
    auto; none with "vllm"), then --override-generation-config's values over them."""
    overrides = {}
    if config.model_config.generation_config != "vllm":
        overrides = {k: v for k, v in placed.generation_config.items() if k in _GEN_CONFIG_KEYS}
    if overrides:
        logger.info("default sampling params from generation_config.json: %s", overrides)
    forced = config.model_config.override_generation_config   # keys checked when resolved
    if forced:
        overrides.update(forced)
        logger.info("default sampling params after --override-generation-config: %s",
                    overrides)
    return overrides



def _setup_lora(config: EngineConfig, family: Any, placement: Any, targets: dict,
                dtype: Any) -> tuple[Any, Any]:
    """The device adapter slots (split like their base kernels) and the adapter registry."""
    from jaxserve.lora.registry import LoRARegistry

    lc = config.lora_config
    stacks = lora_slots(config, family, placement, targets, dtype)
    registry = LoRARegistry(family, placement.source_arch, max_lora_rank=lc.max_lora_rank,
                            max_cpu_loras=lc.max_cpu_loras, tp=placement.tp,
                            hub=HubOptions(cache_dir=config.model_config.download_dir,
                                           token=config.model_config.hf_token))
    logger.info("LoRA: %d slots of rank %d on %s (%.1f MiB); %d adapters in host memory",
                lc.max_loras, lc.max_lora_rank, ", ".join(targets), stacks.nbytes / 2**20,
                lc.max_cpu_loras)
    return stacks, registry
