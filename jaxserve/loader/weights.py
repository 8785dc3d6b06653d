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


def parse_name(name: str, fmt: str, family: Any) -> tuple[str, int | tuple[int, int] | None] | None:
    """A checkpoint tensor name -> (our name, index) or None if not ours. The index is the
    layer, None for a whole-model tensor, or (layer, expert) for a per-expert tensor (a
    family's checkpoint name with ``{expert}``, stacked here on an expert axis after L).

    fmt: "hf" (``model.layers.3.self_attn.q_proj.weight``) or "gguf" (``blk.3.attn_q.weight``).
    family: the model's family (models/family.py), which owns the name tables.
    """
    column = 0 if fmt == "hf" else 1
    match = (_HF_LAYER if fmt == "hf" else _GGUF_LAYER).fullmatch(name)
    if match:
        layer, suffix = int(match.group(1)), match.group(2)
        for ours, names in family.layer_tensors.items():
            patterns = names[column]
            for pattern in (patterns,) if isinstance(patterns, str) else patterns:
                if "{expert}" in pattern:
                    head, tail = pattern.split("{expert}")
                    expert = suffix[len(head):len(suffix) - len(tail)]
                    if suffix.startswith(head) and suffix.endswith(tail) and expert.isdigit():
                        return f"layers.{ours}", (layer, int(expert))
                elif pattern == suffix:
                    return f"layers.{ours}", layer
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

    def put(self, name: str, layer: int | tuple[int, int] | None, hf_array: np.ndarray,
            origin: str) -> None:
        """Store one checkpoint tensor (HF orientation: projections ``[out, in]``, lm_head
        ``[V, H]``; a stack of experts' projections ``[E, out, in]``).

        layer: parse_name's index (a layer, (layer, expert), or None). origin: the tensor's
        name in the checkpoint, for error messages.
        """
        stacked = self.arrays[name]
        index = (layer,) if isinstance(layer, int) else (layer or ())
        if index and not 0 <= index[0] < stacked.shape[0]:
            raise ValueError(f"{self.source}: tensor {origin} has layer index {index[0]}, but the "
                             f"config has num_hidden_layers={stacked.shape[0]}")
        if len(index) == 2 and not 0 <= index[1] < stacked.shape[1]:
            raise ValueError(f"{self.source}: tensor {origin} has expert index {index[1]}, but the "
                             f"config has {stacked.shape[1]} experts")
        target = stacked[index] if index else stacked
        # kernels are [in, out]: swap the last two axes (of each expert, for a stack of them)
        source = np.swapaxes(hf_array, -1, -2) if (name.endswith(".kernel") or name == "lm_head") \
            else hf_array
        if source.shape != target.shape:
            expected = (*target.shape[:-2], *target.shape[:-3:-1]) if source is not hf_array \
                else target.shape
            raise ValueError(f"{self.source}: tensor {origin} has shape {tuple(hf_array.shape)}, "
                             f"expected {tuple(expected)} from the model config")
        target[...] = source  # numpy casts (float32/bf16/f16) while copying
        filled = self._filled[name]
        if len(index) == 2 and filled.ndim == 1:
            # per-expert tensors are counted per (layer, expert) from their first one on
            filled = self._filled[name] = np.zeros(stacked.shape[:2], bool)
        filled[index or 0] = True

    def finish(self) -> dict[str, np.ndarray]:
        """The filled arrays; raises if any tensor (or any layer of one) was never stored."""
        missing = []
        for name, filled in self._filled.items():
            if not filled.all():
                if filled.ndim == 2:   # (layer, expert)
                    where = [tuple(i) for i in np.argwhere(~filled).tolist()]
                    missing.append(f"{name} ((layer, expert) {where[:8]})")
                    continue
                layers = np.flatnonzero(~filled).tolist()
                missing.append(name if not name.startswith("layers.") else f"{name} (layers {layers})")
        if missing:
            raise ValueError(f"{self.source}: checkpoint is missing tensors: {', '.join(missing)}")
        return self.arrays
