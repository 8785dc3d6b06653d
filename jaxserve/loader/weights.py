"""Our weight layout, and the helpers that fill it from any checkpoint format.

Every per-layer tensor is stacked on a leading layer axis ``L`` (so the model
can run its layers under ``jax.lax.scan``), and every projection is a kernel
``[in, out]`` so that ``y = x @ W``. Which tensors a model has, and their checkpoint
names, are its family's (models/family.py: `weight_shapes`, `layer_tensors`); a
Llama-family model, for example::

    embed_tokens                  [V, H]
    layers.input_layernorm        [L, H]
    layers.q_proj.kernel          [L, H, Hq*D]     layers.q_proj.bias  [L, Hq*D]   (Qwen2)
    layers.k_proj.kernel          [L, H, Hkv*D]    layers.k_proj.bias  [L, Hkv*D]  (Qwen2)
    layers.v_proj.kernel          [L, H, Hkv*D]    layers.v_proj.bias  [L, Hkv*D]  (Qwen2)
    layers.q_norm, layers.k_norm  [L, D]                                           (Qwen3)
    layers.o_proj.kernel          [L, Hq*D, H]     layers.o_proj.bias  [L, H]     (Llama bias)
    layers.post_attention_layernorm [L, H]
    layers.gate_proj.kernel       [L, H, I]
    layers.up_proj.kernel         [L, H, I]
    layers.down_proj.kernel       [L, I, H]
    norm                          [H]
    lm_head                       [H, V]           (only when embeddings are untied)

Checkpoint readers hand tensors over in Hugging Face orientation (``[out, in]``
for projections, ``[V, H]`` for the output head); `StackedWeights.put`
transposes and casts them into preallocated stacked arrays, one layer at a time.
"""

from __future__ import annotations

import re
from typing import Any

import ml_dtypes
import numpy as np

_DTYPES: dict[str, np.dtype] = {
    "float32": np.dtype(np.float32), "float": np.dtype(np.float32),
    "bfloat16": np.dtype(ml_dtypes.bfloat16), "bf16": np.dtype(ml_dtypes.bfloat16),
    "float16": np.dtype(np.float16), "half": np.dtype(np.float16),
}
_HF_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
_GGUF_LAYER = re.compile(r"blk\.(\d+)\.(.+)")
# buffers some old checkpoints carry that are recomputed from the config
_IGNORED_HF_SUFFIXES = ("rotary_emb.inv_freq",)


def as_numpy_dtype(dtype: np.dtype | str | type) -> np.dtype:
    """``"bfloat16"`` / ``"bf16"`` / ``np.float32`` ... -> a numpy dtype (bfloat16 is ml_dtypes')."""
    if isinstance(dtype, str):
        if dtype not in _DTYPES:
            raise ValueError(f"unsupported weights dtype {dtype!r}; choose one of {sorted(_DTYPES)}")
        return _DTYPES[dtype]
    resolved = np.dtype(dtype)
    if resolved not in set(_DTYPES.values()):
        raise ValueError(f"unsupported weights dtype {resolved}; choose float32, bfloat16 or float16")
    return resolved


def head_dim(hf_config: Any) -> int:
    """D: ``config.head_dim`` when the config sets it, else ``hidden_size // num_attention_heads``."""
    explicit = getattr(hf_config, "head_dim", None)
    return int(explicit) if explicit else hf_config.hidden_size // hf_config.num_attention_heads


def parse_name(name: str, fmt: str, family: Any) -> tuple[str, int | None] | None:
    """A checkpoint tensor name -> (our name, layer index or None); None if not ours.

    fmt: "hf" (``model.layers.3.self_attn.q_proj.weight``) or "gguf" (``blk.3.attn_q.weight``).
    family: the model's family (models/family.py), which owns the name tables.
    """
    column = 0 if fmt == "hf" else 1
    match = (_HF_LAYER if fmt == "hf" else _GGUF_LAYER).fullmatch(name)
    if match:
        suffix = match.group(2)
        for ours, names in family.layer_tensors.items():
            if names[column] == suffix:
                return f"layers.{ours}", int(match.group(1))
        return None
    for ours, names in family.global_tensors.items():
        if names[column] == name:
            return ours, None
    return None


def is_ignorable(name: str) -> bool:
    """Checkpoint tensors we may skip silently (buffers derived from the config)."""
    return name.endswith(_IGNORED_HF_SUFFIXES)


class StackedWeights:
    """Preallocated arrays of our layout, filled tensor by tensor (cast and transposed on the way in)."""

    def __init__(self, shapes: dict[str, tuple], dtype: np.dtype, source: str):
        self.dtype = dtype
        self.source = source  # a file or directory name, for error messages
        self.arrays = {name: np.empty(shape, dtype) for name, shape in shapes.items()}
        self._filled: dict[str, np.ndarray] = {
            name: np.zeros(shape[0] if name.startswith("layers.") else 1, bool)
            for name, shape in shapes.items()}

    def wants(self, name: str) -> bool:
        return name in self.arrays

    def put(self, name: str, layer: int | None, hf_array: np.ndarray, origin: str) -> None:
        """Store one checkpoint tensor (HF orientation: projections ``[out, in]``, lm_head ``[V, H]``).

        origin: the tensor's name in the checkpoint, for error messages.
        """
        stacked = self.arrays[name]
        if layer is not None and not 0 <= layer < stacked.shape[0]:
            raise ValueError(f"{self.source}: tensor {origin} has layer index {layer}, but the config "
                             f"has num_hidden_layers={stacked.shape[0]}")
        target = stacked if layer is None else stacked[layer]
        source = hf_array.T if (name.endswith(".kernel") or name == "lm_head") else hf_array
        if source.shape != target.shape:
            expected = target.shape[::-1] if source is not hf_array else target.shape
            raise ValueError(f"{self.source}: tensor {origin} has shape {tuple(hf_array.shape)}, "
                             f"expected {tuple(expected)} from the model config")
        target[...] = source  # numpy casts (float32/bf16/f16) while copying
        self._filled[name][0 if layer is None else layer] = True

    def finish(self) -> dict[str, np.ndarray]:
        """The filled arrays; raises if any tensor (or any layer of one) was never stored."""
        missing = []
        for name, filled in self._filled.items():
            if not filled.all():
                layers = np.flatnonzero(~filled).tolist()
                missing.append(name if not name.startswith("layers.") else f"{name} (layers {layers})")
        if missing:
            raise ValueError(f"{self.source}: checkpoint is missing tensors: {', '.join(missing)}")
        return self.arrays
