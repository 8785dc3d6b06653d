"""Load a model (config, stacked weights, tokenizer) from a HF directory, a GGUF file or the cache.

    loaded = load_model(None)                     # the embedded SmolLM2-135M-Instruct GGUF
    loaded = load_model("/models/Qwen3-0.6B", dtype="bfloat16")
    loaded.weights["layers.q_proj.kernel"]        # [L, H, Hq*D]; layout in loader/weights.py
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from jaxserve.loader.dummy import dummy_weights
from jaxserve.loader.hub_download import HubOptions
from jaxserve.loader.resolve import ResolvedModel, default_gguf_path, resolve_model
from jaxserve.loader.weights import as_numpy_dtype, head_dim
from jaxserve.models.registry import resolve_architecture, supported_architectures
from jaxserve.quantization.awq_gptq import checkpoint_method, parse_quantization_config

logger = logging.getLogger(__name__)

SUPPORTED_ARCHITECTURES = supported_architectures()   # the registry's, not a second list

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "HubOptions",
    "LoadedModel",
    "ResolvedModel",
    "default_gguf_path",
    "head_dim",
    "load_model",
    "resolve_model",
]


@dataclass
class LoadedModel:
    """Everything the engine needs from a checkpoint. `weights` follows loader/weights.py."""
    hf_config: Any  # transformers.PretrainedConfig
    weights: dict[str, np.ndarray]
    tokenizer: Any  # transformers.PreTrainedTokenizerBase
    generation_config: dict[str, Any] = field(default_factory=dict)
    model_path: str = ""
    architecture: str = ""
    quantization: str | None = None   # the mode the weights are in (awq / gptq: the checkpoint's)


# Files any Hugging Face tokenizer directory holds at least one of.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def require_tokenizer_files(model_dir: str) -> str:
    """`model_dir`, if it holds a tokenizer; else a ValueError saying what to pass."""
    if not any((Path(model_dir) / name).is_file() for name in _TOKENIZER_FILES):
        raise ValueError(
            f"{model_dir} has no tokenizer (none of {', '.join(_TOKENIZER_FILES)}): pass "
            "tokenizer=DIR (--tokenizer), or skip_tokenizer_init=True (--skip-tokenizer-init) "
            "to run on prompt token ids (outputs then carry token ids and empty text)")
    return model_dir


def read_generation_config(model_dir: str | os.PathLike) -> dict[str, Any]:
    """Defaults from ``generation_config.json`` (temperature, top_p, eos_token_id ...), or {}."""
    path = Path(model_dir) / "generation_config.json"
    if not path.is_file():
        return {}
    try:
        values = json.loads(path.read_text())
    except ValueError as e:
        raise ValueError(f"{path}: invalid JSON ({e})") from None
    return {k: v for k, v in values.items() if k not in ("transformers_version", "_from_model_config")}


def _load_hf_config(model_dir: str) -> tuple[Any, str, dict[str, Any] | None]:
    """(transformers config, architecture, the raw quantization_config or None)."""
    import transformers

    config_path = Path(model_dir) / "config.json"
    try:
        raw = json.loads(config_path.read_text())
    except ValueError as e:
        raise ValueError(f"{config_path}: invalid JSON ({e})") from None
    architecture = resolve_architecture(raw.get("architectures"), raw.get("model_type"),
                                        str(config_path))
    config = transformers.AutoConfig.from_pretrained(model_dir, local_files_only=True)
    return config, architecture, raw.get("quantization_config")


def read_model_config(model: str | os.PathLike | None,
                      hub: HubOptions | None = None) -> tuple[Any, str]:
    """(hf_config, resolved path) of `model`, reading no weights and no tokenizer: what an
    ahead-of-time compile needs (a directory holding only config.json is enough; a Hub
    model's config.json alone is downloaded)."""
    resolved = resolve_model(model, hub, kind="config")
    if resolved.format == "gguf":
        from jaxserve.loader.gguf_loader import gguf_config, open_gguf

        return gguf_config(open_gguf(resolved.path), resolved.path), resolved.path
    if resolved.format == "orbax":
        from jaxserve.loader.orbax_checkpoint import read_checkpoint

        return read_checkpoint(resolved.path).hf_config, resolved.path
    return _load_hf_config(resolved.path)[0], resolved.path


def load_model(model: str | os.PathLike | None, dtype: np.dtype | str = "float32",
               tokenizer: str | os.PathLike | None = None,
               load_format: str = "auto", quantization: str | None = None,
               skip_tokenizer_init: bool = False, hub: HubOptions | None = None,
               tokenizer_hub: HubOptions | None = None,
               gguf_float_copy_budget: int = 0) -> LoadedModel:
    """Resolve `model` (see loader/resolve.py) and load its config, weights and tokenizer.

    dtype: the numpy dtype of every weight ("float32", "bfloat16" = ml_dtypes.bfloat16,
    "float16"). tokenizer: another tokenizer directory, .gguf or repo id; default: the model's.
    load_format: "auto" reads the weights; "dummy" makes random ones (loader/dummy.py) and
    needs only the config (a directory with config.json alone is enough).
    quantization: "gguf" keeps a GGUF file's Q8_0/Q4_0/Q4_1/Q4_K tensors packed (their weights
    entries are ``NAME.q4_1`` uint8 arrays, quantization/gguf_packed.py); "int8" and None
    load float weights (int8 is applied to the params tree by the engine). An AWQ / GPTQ
    checkpoint (config.json's quantization_config.quant_method) picks "awq" / "gptq" when
    quantization is None, keeps its projections packed (``NAME.qweight`` ...,
    quantization/awq_gptq.py), and refuses any other explicit mode.
    LoadedModel.quantization is the mode the weights are in. gguf_float_copy_budget: with
    "gguf", the packed tensors dequantized too (``NAME.kernel`` beside ``NAME.q4_1``, for
    steps of many rows) if they take at most this many bytes (gguf_loader.load_gguf_weights).
    skip_tokenizer_init: load no tokenizer (LoadedModel.tokenizer is None).
    hub, tokenizer_hub: revision, cache, token for a model / tokenizer named by its Hub id.
    """
    if quantization == "gguf" and load_format == "dummy":
        raise ValueError("quantization='gguf' keeps a GGUF file's packed tensors; it needs "
                         "load_format='auto' (dummy weights are float)")
    if load_format not in ("auto", "dummy"):
        raise ValueError(f"unknown load_format {load_format!r}; choose auto or dummy")
    from jaxserve.loader.tokenizer import load_tokenizer

    numpy_dtype = as_numpy_dtype(dtype)
    resolved = resolve_model(model, hub)
    if resolved.format == "orbax":
        raise ValueError(f"{resolved.path} is a checkpoint `jaxserve convert` wrote: its arrays "
                         "are restored onto the devices by the engine (LLM(path), `jaxserve "
                         "serve path`), not loaded as host weights; pass the source model here")
    start = time.perf_counter()
    if resolved.format == "gguf":
        from jaxserve.loader.gguf_loader import (
            gguf_config,
            gguf_tokenizer,
            load_gguf_weights,
            open_gguf,
        )

        if quantization in ("awq", "gptq"):
            raise ValueError(f"quantization={quantization!r} needs a {quantization} safetensors "
                             f"checkpoint; {resolved.path} is a GGUF file (use gguf)")
        reader = open_gguf(resolved.path)
        hf_config = gguf_config(reader, resolved.path)
        architecture = hf_config.architectures[0]
        weights = (dummy_weights(hf_config, numpy_dtype) if load_format == "dummy" else
                   load_gguf_weights(reader, hf_config, numpy_dtype, resolved.path,
                                     keep_packed=quantization == "gguf",
                                     float_copy_budget=gguf_float_copy_budget))
        loaded_tokenizer = None if skip_tokenizer_init else (
            load_tokenizer(tokenizer, hub=tokenizer_hub) if tokenizer is not None
            else gguf_tokenizer(resolved.path, reader))
        generation_config: dict[str, Any] = {}
    else:
        if quantization == "gguf":
            raise ValueError(f"{resolved.path}: quantization='gguf' needs a .gguf checkpoint; "
                             "for a float checkpoint use quantization='int8'")
        from jaxserve.loader.safetensors_loader import load_safetensors_weights

        hf_config, architecture, quant_config = _load_hf_config(resolved.path)
        quantization = checkpoint_method(quant_config, quantization, resolved.path)
        packed_int = (parse_quantization_config(quant_config)
                      if quantization in ("awq", "gptq") else None)
        if load_format == "dummy":
            if packed_int is not None:
                raise ValueError(f"{resolved.path} is a {quantization} checkpoint; "
                                 "load_format='dummy' makes float weights (use auto)")
            weights = dummy_weights(hf_config, numpy_dtype)
        else:
            weights = load_safetensors_weights(resolved.path, hf_config, numpy_dtype,
                                               packed_int)
        loaded_tokenizer = None if skip_tokenizer_init else (
            load_tokenizer(tokenizer, hub=tokenizer_hub) if tokenizer is not None
            else load_tokenizer(require_tokenizer_files(resolved.path)))
        generation_config = read_generation_config(resolved.path)
    logger.info("loaded %s (%s, %s, %.1f MiB of weights) in %.2f s", resolved.path,
                architecture, numpy_dtype.name, sum(w.nbytes for w in weights.values()) / 2**20,
                time.perf_counter() - start)
    return LoadedModel(hf_config=hf_config, weights=weights, tokenizer=loaded_tokenizer,
                       generation_config=generation_config, model_path=resolved.path,
                       architecture=architecture, quantization=quantization)
