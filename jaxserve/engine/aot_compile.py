"""`jaxserve compile`: the engine's step for a target, compiled and memory-planned before a
device is touched, and shipped as serialized executables (runner/aot_executables.py).

    result = compile_for_target(config, "h200", "out/")      # or target=None: this CPU

No weight is read or allocated: the params are ShapeDtypeStructs from the model's
config.json (engine/abstract_model.py), placed by the same `ModelPlacement` rules as at
startup, on a mesh of compile-only devices of the target (platforms/gpu_targets.py); the
runner is built by startup's own steps (engine/runner_setup.py) for the target's platform
object (jaxserve/platforms/). The KV cache is planned by the startup rule (runner/memory.py:
device memory x --gpu-memory-utilization - weights per device - the largest bucket's
activation peak, or less where XLA's own limit for the step, 80 % of the device, leaves
less), with the peak taken from the compiled program's `memory_analysis()`
rather than an estimate: the largest bucket is compiled once with the smallest cache
(its temporaries do not depend on the cache, which is donated and updated in place),
the cache is planned, and every bucket is compiled against the planned cache.

With --pipeline-parallel-size > 1 the compile-only mesh holds pp x tp devices; each stage's
programs are compiled for its (1, tp) sub-mesh, and the plan is startup's per-stage one
(engine/pipeline_memory.py: each stage from its own program's temporaries, the stage with
the fewest blocks decides; engine/aot_pipeline.py reports it). A bucket's file then holds
one executable per stage, loaded onto each stage's devices by `serve -pp --aot-dir`.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax
import numpy as np

from jaxserve.config import EngineConfig
from jaxserve.engine.abstract_model import place_abstract_model
from jaxserve.engine.aot_manifest import (
    compiled_for_units,
    engine_fingerprint,
    expected_manifest,
    target_device_kind,
)
from jaxserve.engine.aot_pipeline import pipeline_kv_plan, stage_summaries
from jaxserve.engine.memory_plan import lora_targets_for, resident_bytes_per_device
from jaxserve.engine.model_setup import compilation_cache_path
from jaxserve.engine.runner_setup import (
    build_runner,
    gemv_rows,
    lora_slots,
    prepare_config,
    step_shape,
)
from jaxserve.models.pipeline_placement import PipelinePlacement
from jaxserve.models.registry import family_for
from jaxserve.platforms import Platform, platform_for_target
from jaxserve.runner import aot_executables as aot
from jaxserve.runner import persistent_cache_bypass
from jaxserve.runner.memory import (
    KVCacheDoesNotFit,
    KVCachePlan,
    plan_kv_cache,
    xla_base_limit_bytes,
)
from jaxserve.runner.model_runner import ModelRunner
from jaxserve.runner.pipeline_runner import PipelineExecutables

logger = logging.getLogger(__name__)


@dataclass
class AbstractEngine:
    """What the step is compiled from: the runner (abstract) and the figures the plan and
    the manifest need."""
    runner: ModelRunner
    arch: Any                       # the sharded model's ModelArch
    weight_bytes_per_device: int
    kv_dtype: Any
    dtype: Any                      # the weights' compute dtype
    max_model_len: int
    fingerprint: str                # engine_fingerprint(...)
    devices: int                    # pp x tp
    platform: Platform              # the target's
    config: EngineConfig            # resolved for the target and the model (read-only)
    info: dict[str, Any] = field(default_factory=dict)
    # pipeline parallel: the PipelinePlacement and its per-stage param structs (None: pp = 1)
    pipeline: PipelinePlacement | None = None
    stage_params: list[Any] | None = None
    lora_targets: dict | None = None        # None: LoRA off

    @property
    def num_stages(self) -> int:
        return 1 if self.pipeline is None else self.pipeline.pp


def build_abstract_engine(config: EngineConfig, target: str | None, num_blocks: int | None
                          ) -> AbstractEngine:
    """The engine's runner for `target` (None: this machine's CPU), abstract, built by
    startup's own steps (engine/runner_setup.py) for the target's platform object.
    num_blocks: the KV cache's blocks per layer (None: the fewest one max_model_len
    sequence needs)."""
    platform = platform_for_target(target)
    config = prepare_config(config, platform)
    if config.spec_decode is not None and config.spec_decode.method == "draft_model":
        raise ValueError("jaxserve compile: speculative_config method 'draft_model' is not "
                         "supported yet (ngram is)")
    tp = config.parallel_config.tensor_parallel_size
    devices = tp * config.parallel_config.pipeline_parallel_size
    # pp > 1: the stages' (1, tp) sub-meshes are cut from this mesh's devices, in order
    mesh = platform.compile_mesh(devices)
    cache_dir = compilation_cache_path(config.runner_config.compilation_cache_dir)
    placed = place_abstract_model(config, platform, mesh, cache_dir)
    shape = step_shape(config, placed, platform)
    config, placement, dtype = shape.config, placed.placement, placed.dtype
    family = family_for(placed.source_arch.architecture)
    lora_targets = lora_targets_for(config, family, placement.arch)
    weight_bytes = resident_bytes_per_device(config, placed, lora_targets)
    lora = None if lora_targets is None else lora_slots(config, family, placement, lora_targets,
                                                        dtype, abstract=True)
    pipeline = placement if isinstance(placement, PipelinePlacement) else None
    blocks = num_blocks or -(-shape.max_model_len // config.cache_config.block_size)
    runner = build_runner(shape, blocks, config.cache_config.block_size, eos=[0],
                          lora_stacks=lora, gemv_rows=gemv_rows(shape, cache_dir))
    return AbstractEngine(
        runner=runner, arch=placement.arch, weight_bytes_per_device=int(weight_bytes),
        kv_dtype=shape.kv_dtype, dtype=dtype, max_model_len=shape.max_model_len,
        fingerprint=engine_fingerprint(config, placed.source_arch, dtype, shape.kv_dtype,
                                       shape.max_model_len),
        devices=devices, platform=platform, config=config,
        info={"model": placed.model_path, "architecture": placed.source_arch.architecture,
              "dtype": np.dtype(dtype).name, "kv_cache_dtype": np.dtype(shape.kv_dtype).name,
              "quantization": placed.quantization},
        pipeline=pipeline, stage_params=None if pipeline is None else list(placed.params),
        lora_targets=lora_targets)


@dataclass
class CompiledBucket:
    shape: tuple[int, int]
    executable: Any
    compile_seconds: float
    temp_bytes: int       # the largest of its stages' (pp = 1: its own)
    io_bytes: int = 0     # arguments + outputs - aliased outputs: what XLA's limit counts
    # per pipeline stage, in stage order (pp = 1: one entry each)
    stage_temp_bytes: list[int] = field(default_factory=list)
    stage_io_bytes: list[int] = field(default_factory=list)

    def describe(self, serialized_bytes: int) -> dict[str, Any]:
        described = {"num_tokens": self.shape[0], "num_seqs": self.shape[1],
                     "compile_seconds": round(self.compile_seconds, 2),
                     "serialized_bytes": serialized_bytes, "temp_bytes": self.temp_bytes,
                     "io_bytes": self.io_bytes, "file": aot.bucket_file(self.shape)}
        if len(self.stage_temp_bytes) > 1:
            described.update(stage_temp_bytes=self.stage_temp_bytes,
                             stage_io_bytes=self.stage_io_bytes)
        return described


def _memory_figures(executable: Any) -> tuple[int, int]:
    """(temporaries, arguments + outputs - aliased outputs) of one compiled program."""
    stats = executable.memory_analysis()
    if stats is None:
        return 0, 0
    return int(stats.temp_size_in_bytes), int(stats.argument_size_in_bytes
                                              + stats.output_size_in_bytes
                                              - stats.alias_size_in_bytes)


def compile_bucket(runner: ModelRunner, shape: tuple[int, int], target: str | None
                   ) -> CompiledBucket:
    """Bucket `shape` compiled for `target`: one program, or one per pipeline stage (a
    PipelineExecutables), with XLA's memory figures for each."""
    start = time.perf_counter()
    lowered = runner.lower_step(*shape)
    options = platform_for_target(target).step_compiler_options()
    # A real compile, never JAX's persistent cache: a copy it served is written without its
    # kernels and fails in the process that loads it (runner/persistent_cache_bypass.py).
    with persistent_cache_bypass.bypassing_persistent_cache():
        if isinstance(lowered, list):          # pipeline parallel: a program per stage
            executable: Any = PipelineExecutables([stage.compile(options)
                                                   for stage in lowered])
            programs = executable.stages
        else:
            executable = lowered.compile(options)
            programs = [executable]
    seconds = time.perf_counter() - start
    temps, ios = zip(*(_memory_figures(program) for program in programs))
    logger.info("compiled step %dx%d for %s in %.1f s (temporaries %s MiB, arguments + "
                "unaliased outputs %s MiB%s)", *shape, target or "cpu", seconds,
                "/".join(f"{t / 2**20:.1f}" for t in temps),
                "/".join(f"{io / 2**20:.1f}" for io in ios),
                ", per stage" if len(programs) > 1 else "")
    return CompiledBucket(shape, executable, seconds, max(temps), max(ios), list(temps),
                          list(ios))


def plan_from_compiled(engine: AbstractEngine, config: EngineConfig, target: str | None,
                       activation_bytes: int | list[int]) -> KVCachePlan:
    """The startup rule (runner/memory.py), for the target's memory when there is one.
    activation_bytes: the step's temporaries, or each pipeline stage's (a list)."""
    memory = engine.platform.device_memory_bytes
    if engine.pipeline is not None:         # pp > 1: startup's per-stage plan
        return pipeline_kv_plan(engine, config, activation_bytes)[0]
    if isinstance(activation_bytes, list):
        activation_bytes = max(activation_bytes)
    return plan_kv_cache(config.cache_config, engine.arch, engine.kv_dtype,
                         engine.weight_bytes_per_device, activation_bytes,
                         engine.max_model_len, tp_size=engine.devices,
                         device_memory_bytes=memory, compute_dtype=engine.dtype)


def check_weights_fit(engine: AbstractEngine, config: EngineConfig, target: str) -> None:
    """Refuse before compiling anything when the weights alone exceed the memory share."""
    memory = engine.platform.device_memory_bytes
    share = int(config.cache_config.gpu_memory_utilization * memory)
    usable = min(share, xla_base_limit_bytes(memory))
    excess = engine.weight_bytes_per_device - usable
    if excess > 0:
        limit = (f"{config.cache_config.gpu_memory_utilization:.0%} of {target}'s "
                 f"{memory / 2**30:.1f} GiB the engine may use (--gpu-memory-utilization)"
                 if share <= usable else
                 f"{usable / 2**30:.1f} GiB XLA plans a step of {target} in (80% of its "
                 f"{memory / 2**30:.1f} GiB)")
        raise KVCacheDoesNotFit(
            f"does not fit: the weights alone take {engine.weight_bytes_per_device / 2**30:.2f}"
            f" GiB per device, {excess / 2**30:.2f} GiB more than the {limit}, before any KV "
            f"cache or activations; use more --tensor-parallel-size (now "
            f"{config.parallel_config.tensor_parallel_size}) or --pipeline-parallel-size (now "
            f"{engine.num_stages}), or int8 weights (--quantization int8)", excess)


def compile_for_target(config: EngineConfig, target: str | None, output: str | Path, *,
                       shapes: list[tuple[int, int]] | None = None,
                       plan_only: bool = False) -> dict[str, Any]:
    """Compile every bucket (or `shapes`) for `target` (None: this CPU), plan the KV cache
    from the compiled programs, write executables and manifest to `output`; returns the
    summary `jaxserve compile --json` prints. Raises KVCacheDoesNotFit when it cannot fit.
    plan_only: compile just the probes (the smallest and largest buckets) and plan; nothing
    is written."""
    # Compile-only executables never enter JAX's persistent cache; the process's own
    # setting comes back afterwards (a notebook or test goes on using its cache).
    before = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    try:
        return _compile_for_target(config, target, Path(output), shapes, plan_only)
    finally:
        jax.config.update("jax_enable_compilation_cache", before)


def _compile_for_target(config: EngineConfig, target: str | None, output: Path,
                        shapes: list[tuple[int, int]] | None,
                        plan_only: bool) -> dict[str, Any]:
    defaults = EngineConfig().to_flat_dict()
    # The options given (before defaults are resolved), for a person or a script to start
    # the matching engine (benchmarks/bench_aot_gpu.py).
    flags = {k: v for k, v in config.to_flat_dict().items()
             if v != defaults[k] and k not in ("model", "aot_dir", "load_format", "hf_token", "download_dir")}
    probe = build_abstract_engine(config, target, None)
    if probe.platform.device_memory_bytes:      # a named GPU: its memory is known now
        check_weights_fit(probe, config, target)
    wanted = sorted(shapes or probe.runner.buckets.all_shapes())
    # The largest bucket holds the most activations, but a one-sequence decode can need
    # more temporaries than a wide step (its attention splits the context differently):
    # probe both ends.
    probes = [compile_bucket(probe.runner, shape, target)
              for shape in sorted({wanted[0], wanted[-1]})]
    # The probes ran with the smallest cache; with the planned one the same programs measure
    # a few KB more (bookkeeping), so the plan keeps 1/64 + 1 MiB of room for that. Peaks
    # are per pipeline stage (one entry at pp = 1): each stage's programs run on its devices.
    peaks = _stage_peaks([p.stage_temp_bytes for p in probes])
    probed = [peak + peak // 64 + (1 << 20) for peak in peaks]
    plan = plan_from_compiled(probe, config, target, probed)
    planned_with = probed
    if plan_only:
        return _summary(probe, config, plan, target, [
            {**p.describe(0), "file": None} for p in probes], peaks, output, probed)
    for _ in range(2):
        logger.info("%s", plan.describe())
        buckets = _compile_and_write(config, target, plan, wanted, output)
        activation = _stage_peaks([b.get("stage_temp_bytes", [b["temp_bytes"]])
                                   for b in buckets])
        # The probes ran with the smallest cache; the planned one may need a little more.
        # The plan stands if the true peak leaves room for its blocks, else plan again.
        replanned = plan_from_compiled(probe, config, target, activation)
        if replanned.num_blocks >= plan.num_blocks:
            break
        logger.warning("activation peak %.1f MiB (probed %.1f MiB) leaves %d KV blocks, not %d:"
                       " compiling again for that", max(activation) / 2**20,
                       max(peaks) / 2**20, replanned.num_blocks, plan.num_blocks)
        plan, planned_with = replanned, activation
    else:
        raise RuntimeError("the activation peak kept growing with the planned cache")
    plan = dataclasses.replace(plan, activation_bytes=max(activation))
    engine = probe      # the same fingerprint, weights and devices as the compiled engine
    summary = _summary(engine, config, plan, target, buckets, activation, output,
                       planned_with)
    aot.write_manifest(output, {**summary, "engine_flags": flags, **expected_manifest(
        target_device_kind(target), engine.fingerprint, engine.devices, target,
        engine.info["dtype"], compiled_for_units(config, target))})
    return summary


def _stage_peaks(stage_temps: list[list[int]]) -> list[int]:
    """Each stage's largest temporaries over the buckets (lists in stage order)."""
    return [max(temps) for temps in zip(*stage_temps)]


def _compile_and_write(config: EngineConfig, target: str | None, plan: KVCachePlan,
                       shapes: list[tuple[int, int]], output: Path) -> list[dict[str, Any]]:
    """Compile `shapes` against the planned cache and write their executables."""
    engine = build_abstract_engine(config, target, plan.num_blocks)
    output.mkdir(parents=True, exist_ok=True)
    buckets = []
    for shape in shapes:
        compiled = compile_bucket(engine.runner, shape, target)
        data = aot.serialize_step(compiled.executable)
        aot.write_atomically(output / aot.bucket_file(shape), data)
        buckets.append(compiled.describe(len(data)))
    return buckets


def _summary(engine: AbstractEngine, config: EngineConfig, plan: KVCachePlan,
             target: str | None, buckets: list[dict[str, Any]], activation: list[int],
             output: Path, planned_with: list[int] | None = None) -> dict[str, Any]:
    """activation: each stage's measured temporaries (one entry at pp = 1); planned_with:
    the temporaries the plan reserved, where not those (the probes' plus their margin)."""
    stages = {}
    if engine.pipeline is not None:
        stages = {"stages": stage_summaries(engine, config, plan, activation,
                                            planned_with or activation)}
    return {"target": target or "cpu", "platform": engine.platform.name,
            "topology": f"1x1x{engine.devices}", "devices": engine.devices,
            "pipeline_parallel_size": engine.num_stages,
            "tensor_parallel_size": config.parallel_config.tensor_parallel_size,
            **engine.info, "max_model_len": engine.max_model_len,
            "weights_bytes_per_device": engine.weight_bytes_per_device,
            "activation_peak_bytes": max(activation),
            "device_memory_bytes": engine.platform.device_memory_bytes,
            "kv_cache_bytes_per_device": plan.total_bytes,
            "kv_cache_blocks": plan.num_blocks, "block_size": plan.block_size,
            "kv_cache_tokens": plan.capacity_tokens, "plan_source": plan.source,
            "compile_seconds": round(sum(b["compile_seconds"] for b in buckets), 2),
            "buckets": buckets, "output": str(output), **stages}
