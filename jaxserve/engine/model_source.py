"""Parameters on their devices, from a model checkpoint or from a converted orbax checkpoint.

    placed = place_model(config, mesh, platform)
    placed.params        # device arrays, sharded as placed.placement says
    placed.arch          # what the sharded model runs (KV heads possibly replicated)

A Hugging Face directory or GGUF file is read into host numpy arrays, converted to the
family's params tree, quantized (int8), then placed shard by shard. A converted orbax
checkpoint (`jaxserve convert`, loader/orbax_checkpoint.py) skips all of that: each array
is restored straight onto its sharding, and neither torch nor a transformers config class
is imported on the way.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import jax
import numpy as np

from jaxserve.config import EngineConfig
from jaxserve.dtypes import dtype_by_name
from jaxserve.engine.compute_dtype import DtypeWorkload, auto_compute_dtype, resolve_dtype
from jaxserve.engine.gguf_packing import (
    float_copy_budget,
    gguf_default_quantization,
    settle_packed,
)
from jaxserve.models.arch import ModelArch
from jaxserve.models.registry import family_for, read_arch
from jaxserve.platforms import Platform
from jaxserve.quantization import check_mode
from jaxserve.quantization.int8 import quantize_params_int8

logger = logging.getLogger(__name__)


@dataclass
class PlacedModel:
    arch: ModelArch              # placement.arch
    source_arch: ModelArch       # the checkpoint's
    placement: Any               # models/placement.py ModelPlacement
    params: Any
    resident_bytes: int          # parameter bytes as stored (all devices together)
    dtype: Any                   # the float dtype of weights and activations (jnp dtype)
    quantization: str | None
    hf_config: Any
    tokenizer: Any
    generation_config: dict[str, Any]
    model_path: str
    source_format: str           # "hf", "gguf" or "orbax"
    dtype_reason: str | None = None  # why dtype=auto chose `dtype` (None: not auto)
    # Seconds per loading phase, for the startup breakdown (ModelSetup.phases).
    phases: dict[str, float] = field(default_factory=dict)


class RestoringParams:
    """Parameters being restored in a thread: their ShapeDtypeStructs (``spec``) now, the
    arrays from ``result()``. The runner builds, plans and compiles on the spec meanwhile."""

    def __init__(self, restore: Any, spec: Any, phases: dict[str, float]) -> None:
        self.spec = spec
        self._out: dict[str, Any] = {}

        def run() -> None:
            start = time.perf_counter()
            try:
                self._out["params"] = restore()
            except BaseException as e:          # re-raised by result()
                self._out["error"] = e
            phases["restore_weights"] = time.perf_counter() - start

        self._thread = threading.Thread(target=run, name="jaxserve-restore", daemon=True)
        self._thread.start()

    def result(self) -> Any:
        self._thread.join()
        if "error" in self._out:
            raise self._out["error"]
        return self._out["params"]


def place_model(config: EngineConfig, mesh: Any, platform: Platform,
                cache_dir: str | None = None) -> PlacedModel:
    """config: resolved for `platform` (Platform.resolve_config); cache_dir: where a
    measured dtype=auto stores its CPU timings (compute_dtype.py)."""
    from jaxserve.loader.hub_download import hub_options
    from jaxserve.loader.resolve import resolve_model

    # Resolved once (a model by name: found in the cache or downloaded here); the rest of
    # loading reads the local path.
    resolved = resolve_model(config.model_config.model, hub_options(config.model_config))
    if resolved.format == "orbax":
        return _restore(config, resolved.path, mesh, platform, cache_dir)
    return _load_and_place(config, resolved.path, mesh, platform, cache_dir)


def _placement(config: EngineConfig, arch: ModelArch, mesh: Any) -> Any:
    from jaxserve.models.placement import ModelPlacement

    return ModelPlacement.create(config.parallel_config, arch, mesh)


def compute_dtype(config: EngineConfig, platform: Platform, arch: Callable[[], ModelArch],
                  cache_dir: str | None) -> tuple[Any, str | None]:
    """(dtype, why dtype=auto chose it, None when not auto) of the model whose ModelArch
    `arch()` reads: what startup and `jaxserve compile` both serve in."""
    mc = config.model_config
    if mc.dtype != "auto":
        return resolve_dtype(mc.dtype, platform, mc.matrix_units), None
    # Only where auto depends on the model (a CPU times its shapes: compute_dtype.py) is its
    # config read ahead of the weights.
    workload = DtypeWorkload.of(config, arch(), cache_dir) \
        if platform.auto_dtype is None else None
    return auto_compute_dtype(platform, mc.matrix_units, workload)


def _load_and_place(config: EngineConfig, model_path: str, mesh: Any, platform: Platform,
                    cache_dir: str | None) -> PlacedModel:
    from jaxserve.loader import load_model, read_model_config
    from jaxserve.loader.hub_download import hub_options

    mc = config.model_config
    dtype, dtype_reason = compute_dtype(
        config, platform, lambda: read_arch(read_model_config(model_path)[0]), cache_dir)
    quantization, packing = gguf_default_quantization(config, model_path, mesh, platform)
    quantization = check_mode(quantization)
    if packing:
        logger.info(packing)
    loaded = load_model(model_path, dtype=np.dtype(dtype), tokenizer=mc.tokenizer,
                        load_format=mc.load_format, quantization=quantization,
                        skip_tokenizer_init=mc.skip_tokenizer_init,
                        tokenizer_hub=hub_options(mc, for_tokenizer=True),
                        gguf_float_copy_budget=float_copy_budget(quantization == "gguf"
                                                                 and bool(packing)))
    # awq / gptq: the checkpoint's own; a GGUF packed by default with nothing packable: None
    quantization = settle_packed(loaded.quantization, quantization == "gguf" and bool(packing),
                                 loaded.weights)
    source_arch = read_arch(loaded.hf_config)
    family = family_for(source_arch.architecture)
    # Sharding (jaxserve/models/placement.py): with tp > 1 each device receives only its
    # shard of every weight and its KV heads; with one device this is a plain device_put.
    placement = _placement(config, source_arch, mesh)
    if placement.arch.num_kv_heads != source_arch.num_kv_heads and \
            quantization in ("gguf", "awq", "gptq"):
        raise ValueError(f"tensor_parallel_size={placement.tp} > {source_arch.num_kv_heads} KV "
                         f"heads replicates KV heads, which packed {quantization} weights do "
                         "not support yet; choose a tensor_parallel_size <= the KV heads"
                         + (" or quantization=None / int8" if quantization == "gguf" else ""))
    host_params = family.params_from_weights(placement.prepare(loaded.weights), placement.arch)
    if quantization == "int8":
        host_params = quantize_params_int8(host_params)
    if quantization == "gguf":      # the float copy's q|k|v, gate|up: one matmul per group
        from jaxserve.kernels.cpu.matmul import matrix_units_for
        from jaxserve.models.sibling_fusion import fuse_packed_float_copies, fusion_pays

        units = matrix_units_for(mc.matrix_units)
        fused = fuse_packed_float_copies(host_params) if fusion_pays(dtype, units.bf16) \
            else []
        if fused:
            logger.info("GGUF float copy stored fused for steps of many rows: %s",
                        ", ".join(fused))
    resident_bytes = sum(np.asarray(w).nbytes for w in jax.tree.leaves(host_params))
    params = placement.place(host_params)
    del loaded.weights, host_params
    return PlacedModel(arch=placement.arch, source_arch=source_arch, placement=placement,
                       params=params, resident_bytes=resident_bytes, dtype=dtype,
                       quantization=quantization, hf_config=loaded.hf_config,
                       tokenizer=loaded.tokenizer, generation_config=loaded.generation_config,
                       model_path=loaded.model_path, dtype_reason=dtype_reason,
                       source_format="gguf" if loaded.model_path.endswith(".gguf") else "hf")


def _restored_dtype(config: EngineConfig, info: Any, platform: Platform,
                    cache_dir: str | None) -> tuple[Any, str]:
    """(dtype, why) a converted checkpoint is served in. A float checkpoint is a file
    format: ``--dtype`` (``auto`` decided here, on the serving machine, as for any model)
    and its float arrays are cast while restored. A quantized one fixes its float dtype at
    convert time (its scales and packed blocks were made from it): auto takes it, and
    another is an error rather than a silent re-quantization."""
    mc = config.model_config
    stored = dtype_by_name(info.dtype)
    if info.quantization is not None:
        if mc.dtype != "auto" and resolve_dtype(mc.dtype, platform, mc.matrix_units) != stored:
            raise ValueError(f"{info.path} was converted in {info.dtype} with quantization="
                             f"{info.quantization!r}; dtype={mc.dtype!r} needs "
                             f"`jaxserve convert --dtype {mc.dtype}`")
        return stored, f"{info.dtype}: the converted checkpoint's ({info.quantization})"
    dtype, why = compute_dtype(config, platform, lambda: read_arch(info.hf_config), cache_dir)
    why = why or f"dtype={mc.dtype}"
    if dtype != stored:
        why += f" (the checkpoint's {info.dtype} arrays cast while restored)"
    return dtype, why


def _restore(config: EngineConfig, path: str, mesh: Any, platform: Platform,
             cache_dir: str | None) -> PlacedModel:
    from jaxserve.loader.hub_download import hub_options
    from jaxserve.loader.orbax_checkpoint import (
        load_checkpoint_tokenizer,
        read_checkpoint,
        restore_params,
        restore_targets,
    )
    from jaxserve.loader.tokenizer import load_tokenizer
    from jaxserve.models.partition import kv_replication

    mc = config.model_config
    info = read_checkpoint(path)
    # The checkpoint fixes what conversion chose; asking for something else is an error
    # rather than a silent re-quantization or cast (re-run `jaxserve convert` for that).
    if mc.load_format != "auto":
        raise ValueError(f"{path} is a converted checkpoint; load_format={mc.load_format!r} "
                         "does not apply to it (use auto)")
    quantization = check_mode(mc.quantization)
    if quantization is not None and quantization != info.quantization:
        raise ValueError(f"{path} was converted with quantization={info.quantization!r}; "
                         f"quantization={quantization!r} needs a new `jaxserve convert`")
    source_arch = read_arch(info.hf_config)
    placement = _placement(config, source_arch, mesh)
    copies = kv_replication(source_arch, placement.tp)
    if copies != info.kv_head_copies:
        raise ValueError(
            f"{path} was converted at tensor_parallel_size="
            f"{info.manifest.get('converted_tensor_parallel_size')} with each of its "
            f"{source_arch.num_kv_heads} KV heads stored {info.kv_head_copies}x; "
            f"tensor_parallel_size={placement.tp} needs {copies}x: convert again at that size")
    dtype, dtype_reason = _restored_dtype(config, info, platform, cache_dir)
    family = family_for(placement.arch.architecture)
    param_spec = family.param_spec_for(placement.arch)
    target = restore_targets(info, placement.mesh, param_spec, dtype=dtype)
    resident_bytes = sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize
                         for x in jax.tree.leaves(target))
    phases: dict[str, float] = {}

    def restore() -> Any:
        return restore_params(info, placement.mesh, param_spec, target)

    # One process: orbax restores in a thread while the tokenizer loads here and the engine
    # plans its memory and compiles (or loads) the steps against
    # the params' shapes (ModelRunner waits for the arrays at the end of warm-up). Several
    # processes restore collectively, in order, here.
    if jax.process_count() == 1:
        params: Any = RestoringParams(restore, target, phases)
    else:
        start = time.perf_counter()
        params = restore()
        phases["restore_weights"] = time.perf_counter() - start
    start = time.perf_counter()
    tokenizer = None if mc.skip_tokenizer_init else (
        load_tokenizer(mc.tokenizer, hub=hub_options(mc, for_tokenizer=True))
        if mc.tokenizer is not None
        else load_checkpoint_tokenizer(path))
    phases["tokenizer"] = time.perf_counter() - start
    return PlacedModel(arch=placement.arch, source_arch=source_arch, placement=placement,
                       params=params, resident_bytes=resident_bytes, dtype=dtype,
                       quantization=info.quantization, hf_config=info.hf_config,
                       tokenizer=tokenizer, generation_config=info.generation_config,
                       model_path=str(path), source_format="orbax", phases=phases,
                       dtype_reason=dtype_reason)
