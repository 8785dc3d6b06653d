"""`jaxserve convert MODEL OUT`: write a model as it sits in device memory, for fast restarts.

    convert_model(None, "smol-ckpt")                          # the embedded SmolLM2, float32 on CPU
    convert_model("/models/Qwen3-0.6B", "q-int8", quantization="int8", tensor_parallel_size=2)
    LLM("q-int8", tensor_parallel_size=2)                      # restores each shard onto its device

The weights go through exactly the steps serving applies (read, family layout, KV-head
replication for tp, int8 quantization, sharded placement); what lands on the devices is
saved with orbax (loader/orbax_checkpoint.py), with the config and tokenizer beside it.

A checkpoint is a file format, read on other machines: with no ``dtype`` it keeps the
model's own (`model_dtype`), never what ``auto`` means on the converting machine. ``auto``
is decided where the checkpoint is served (engine/model_source.py).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import jax

from jaxserve.config import EngineConfig

logger = logging.getLogger(__name__)


# The float dtypes a checkpoint may declare (config.json's torch_dtype) and keep.
_CHECKPOINT_DTYPES = ("float32", "bfloat16", "float16")


def model_dtype(hf_config: Any) -> str:
    """The dtype a model declares for its weights: config.json's ``torch_dtype`` (``dtype``
    in newer transformers) when it is float32, bfloat16 or float16, else float32 -- also
    for a GGUF, whose quantized blocks are dequantized to float32 (llama.cpp's own
    precision for them). What `convert_model` writes when no dtype is asked for."""
    declared = getattr(hf_config, "torch_dtype", None) or getattr(hf_config, "dtype", None)
    name = str(declared).removeprefix("torch.") if declared is not None else ""
    return name if name in _CHECKPOINT_DTYPES else "float32"


def convert_model(model: str | None, out: str, *, quantization: str | None = None,
                  tensor_parallel_size: int = 1, dtype: str = "model",
                  tokenizer: str | None = None, revision: str | None = None,
                  download_dir: str | None = None, hf_token: str | None = None) -> Path:
    """Load `model` as serving would (on this process's devices) and save it to `out`;
    a Hub name is fetched (revision, download_dir, hf_token: as `serve`'s flags).

    dtype: "model" (or "auto", the CLI's historical name for it): the model's own
    (`model_dtype`), the same on every machine; or float32 / bfloat16 / float16."""
    from jaxserve.engine.model_source import place_model
    from jaxserve.loader import read_model_config
    from jaxserve.loader.hub_download import hub_options
    from jaxserve.loader.orbax_checkpoint import remove_incomplete, save_checkpoint
    from jaxserve.loader.resolve import resolve_model
    from jaxserve.models.partition import kv_replication
    from jaxserve.platforms import current_platform

    if Path(out).exists() and any(Path(out).iterdir()):
        raise FileExistsError(f"{out} exists and is not empty; choose a new directory")
    own_dtype = dtype in ("model", "auto")
    # A converted checkpoint may be served anywhere: a GGUF stays packed only when asked
    # (unset would pack it for this CPU's kernels, engine/gguf_packing.py).
    config = EngineConfig.from_kwargs(model=model, quantization=quantization or "none",
                                      dtype="auto" if own_dtype else dtype,
                                      tokenizer=tokenizer, revision=revision,
                                      download_dir=download_dir, hf_token=hf_token,
                                      tensor_parallel_size=tensor_parallel_size)
    resolved = resolve_model(model, hub_options(config.model_config))
    if resolved.format == "orbax":
        raise ValueError(f"{model} is already a converted checkpoint; convert its source model")
    if own_dtype:
        config.model_config.dtype = model_dtype(read_model_config(resolved.path)[0])
    start = time.perf_counter()
    platform = current_platform()
    placed = place_model(platform.resolve_config(config), None, platform)
    loaded_at = time.perf_counter()
    try:
        path = save_checkpoint(
            out, placed.params, hf_config=placed.hf_config, tokenizer=placed.tokenizer,
            generation_config=placed.generation_config,
            dtype=jax.numpy.dtype(placed.dtype).name, quantization=placed.quantization,
            kv_head_copies=kv_replication(placed.source_arch, placed.placement.tp),
            tensor_parallel_size=placed.placement.tp, source=placed.model_path)
    except BaseException:
        remove_incomplete(out)     # never leave a directory that looks half like a checkpoint
        raise
    logger.info("converted %s to %s (%.1f MiB, %s, quantization %s, tp %d): load %.1f s, "
                "save %.1f s", placed.model_path, path, placed.resident_bytes / 2**20,
                jax.numpy.dtype(placed.dtype).name, placed.quantization, placed.placement.tp,
                loaded_at - start, time.perf_counter() - loaded_at)
    return path
