"""What a directory of ahead-of-time executables must agree on with the engine loading it
(engine/aot_compile.py writes it, `--aot-dir` reads it): the device kind and count, the
jax / jaxlib / CUDA plugin versions, and a hash of the engine config and jaxserve source.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
from typing import Any

import jax
import numpy as np

from jaxserve.config import EngineConfig
from jaxserve.platforms.gpu_targets import load_target, plugin_version
from jaxserve.quantization import check_mode
from jaxserve.runner import aot_executables as aot
from jaxserve.runner.executable_cache import source_fingerprint

logger = logging.getLogger(__name__)


def engine_fingerprint(config: EngineConfig, source_arch: Any, dtype: Any, kv_dtype: Any,
                       max_model_len: int) -> str:
    """A hash of everything in a resolved config that shapes the compiled step (and the
    jaxserve source), the same at `jaxserve compile` and at a start with --aot-dir. The KV
    block count is not in it: a start with --aot-dir takes the manifest's."""
    mc, cc, sc = config.model_config, config.cache_config, config.scheduler_config
    pc, lc, spec = config.parallel_config, config.lora_config, config.spec_decode
    parts = {
        "arch": repr(source_arch), "dtype": np.dtype(dtype).name,
        "kv_dtype": np.dtype(kv_dtype).name, "quantization": check_mode(mc.quantization),
        "max_model_len": max_model_len, "max_logprobs": mc.max_logprobs,
        "block_size": cc.block_size, "max_num_seqs": sc.max_num_seqs,
        "max_num_batched_tokens": sc.max_num_batched_tokens,
        "max_prompt_logprobs_per_step": sc.max_prompt_logprobs_per_step,
        "tensor_parallel_size": pc.tensor_parallel_size,
        "enable_expert_parallel": pc.enable_expert_parallel,
        "pipeline": (pc.pipeline_parallel_size, pc.pp_layer_partition)
        if pc.pipeline_parallel_size > 1 else None,
        "attention_backend": config.runner_config.attention_backend,
        "spec": None if spec is None else (spec.method, spec.num_speculative_tokens,
                                           min(spec.disable_by_batch_size, sc.max_num_seqs)),
        "lora": (lc.max_loras, lc.max_lora_rank) if lc.enable_lora else None,
        "source": source_fingerprint()}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:24]


def target_device_kind(target: str | None) -> str:
    return load_target(target).device_kind if target else jax.devices()[0].device_kind


def compiled_for_units(config: EngineConfig, target: str | None) -> str | None:
    """The CPU matrix units a step for `target` is compiled for (None on a GPU target): the
    same `ModelConfig.matrix_units` rule that chose dtype=auto's meaning."""
    from jaxserve.kernels.cpu.matmul import matrix_units_for

    return None if target else matrix_units_for(config.model_config.matrix_units).describe()


def expected_manifest(device_kind: str, fingerprint: str, devices: int, target: str | None,
                      dtype: Any, matrix_units: str | None) -> dict[str, Any]:
    """The manifest fields a start with --aot-dir must match (aot.mismatch), in the order a
    mismatch is reported: the resolved dtype and matrix units come before the config hash
    (which covers them too) so a dtype=auto that resolves differently here says so."""
    import jaxlib

    return {"format": aot.FORMAT, "device_kind": device_kind, "devices": devices,
            "jax": jax.__version__, "jaxlib": jaxlib.__version__,
            "plugin": plugin_version() if target else None,
            "dtype": np.dtype(dtype).name, "matrix_units": matrix_units,
            "engine_config_hash": fingerprint}


def aot_dir_for_engine(config: EngineConfig, placed: Any, dtype: Any, kv_dtype: Any,
                       max_model_len: int) -> tuple[str | None, Any]:
    """At startup with --aot-dir: (the directory, the cache config with the manifest's KV
    block count) when its manifest matches this engine; else (None, the cache config as
    given), after one warning saying why the executables are not used."""
    directory = config.runner_config.aot_dir
    cc = config.cache_config
    try:
        manifest = aot.read_manifest(directory)
    except ValueError as e:
        logger.warning("--aot-dir not used, compiling instead: %s", e)
        return None, cc
    target = manifest.get("target")
    target = None if target in (None, "cpu") else target
    expected = expected_manifest(
        jax.devices()[0].device_kind,
        engine_fingerprint(config, placed.source_arch, dtype, kv_dtype, max_model_len),
        placed.placement.tp * config.parallel_config.pipeline_parallel_size, target, dtype,
        compiled_for_units(config, target))
    reason = aot.mismatch(manifest, expected)
    if reason is not None:
        logger.warning("--aot-dir %s not used, compiling instead: %s", directory, reason)
        return None, cc
    logger.info("--aot-dir %s: %d step executables compiled for %s; KV cache %d blocks as "
                "planned there", directory, len(manifest["buckets"]), target,
                manifest["kv_cache_blocks"])
    return directory, dataclasses.replace(cc, num_gpu_blocks_override=manifest["kv_cache_blocks"])
