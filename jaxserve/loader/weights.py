"""Our weight layout, and the helpers that fill it from any checkpoint format.

Every per-layer tensor is stacked on a leading layer axis ``L`` (so the model
can run its layers under ``jax.lax.scan``), and every projection is a kernel
``[in, out]`` so that ``y = x @ W``::

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

# our per-layer name -> (Hugging Face suffix after "model.layers.N.", GGUF suffix after "blk.N.")
LAYER_TENSORS: dict[str, tuple[str, str]] = {
    "input_layernorm": ("input_layernorm.weight", "attn_norm.weight"),
    "q_proj.kernel": ("self_attn.q_proj.weight", "attn_q.weight"),
    "q_proj.bias": ("self_attn.q_proj.bias", "attn_q.bias"),
    "k_proj.kernel": ("self_attn.k_proj.weight", "attn_k.weight"),
    "k_proj.bias": ("self_attn.k_proj.bias", "attn_k.bias"),
    "v_proj.kernel": ("self_attn.v_proj.weight", "attn_v.weight"),
    "v_proj.bias": ("self_attn.v_proj.bias", "attn_v.bias"),
    "q_norm": ("self_attn.q_norm.weight", "attn_q_norm.weight"),
    "k_norm": ("self_attn.k_norm.weight", "attn_k_norm.weight"),
    "o_proj.kernel": ("self_attn.o_proj.weight", "attn_output.weight"),
    "o_proj.bias": ("self_attn.o_proj.bias", "attn_output.bias"),
    "post_attention_layernorm": ("post_attention_layernorm.weight", "ffn_norm.weight"),
    "gate_proj.kernel": ("mlp.gate_proj.weight", "ffn_gate.weight"),
    "up_proj.kernel": ("mlp.up_proj.weight", "ffn_up.weight"),
    "down_proj.kernel": ("mlp.down_proj.weight", "ffn_down.weight"),
}
# our whole-model name -> (Hugging Face name, GGUF name)
GLOBAL_TENSORS: dict[str, tuple[str, str]] = {
    "embed_tokens": ("model.embed_tokens.weight", "token_embd.weight"),
    "norm": ("model.norm.weight", "output_norm.weight"),
    "lm_head": ("lm_head.weight", "output.weight"),
}
OPTIONAL_LAYER_TENSORS = ("q_proj.bias", "k_proj.bias", "v_proj.bias", "o_proj.bias", "q_norm",
                          "k_norm")

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


def expected_shapes(hf_config: Any, optional: set[str], with_lm_head: bool) -> dict[str, tuple]:
    """The shape of every tensor of our layout for this config.

    optional: which of `OPTIONAL_LAYER_TENSORS` the checkpoint has (biases, q/k norms).
    """
    c = hf_config
    L, H, V, I = c.num_hidden_layers, c.hidden_size, c.vocab_size, c.intermediate_size
    D = head_dim(c)
    q_width = c.num_attention_heads * D
    kv_width = (getattr(c, "num_key_value_heads", None) or c.num_attention_heads) * D
    shapes = {
        "embed_tokens": (V, H),
        "layers.input_layernorm": (L, H),
        "layers.q_proj.kernel": (L, H, q_width),
        "layers.k_proj.kernel": (L, H, kv_width),
        "layers.v_proj.kernel": (L, H, kv_width),
        "layers.o_proj.kernel": (L, q_width, H),
        "layers.post_attention_layernorm": (L, H),
        "layers.gate_proj.kernel": (L, H, I),
        "layers.up_proj.kernel": (L, H, I),
        "layers.down_proj.kernel": (L, I, H),
        "norm": (H,),
    }
    optional_shapes = {"q_proj.bias": (L, q_width), "k_proj.bias": (L, kv_width),
                       "v_proj.bias": (L, kv_width), "o_proj.bias": (L, H), "q_norm": (L, D),
                       "k_norm": (L, D)}
    for name in OPTIONAL_LAYER_TENSORS:
        if name in optional:
            shapes[f"layers.{name}"] = optional_shapes[name]
    if with_lm_head:
        shapes["lm_head"] = (H, V)
    return shapes


def parse_name(name: str, fmt: str) -> tuple[str, int | None] | None:
    """A checkpoint tensor name -> (our name, layer index or None); None if not ours.

    fmt: "hf" (``model.layers.3.self_attn.q_proj.weight``) or "gguf" (``blk.3.attn_q.weight``).
    """
    column = 0 if fmt == "hf" else 1
    match = (_HF_LAYER if fmt == "hf" else _GGUF_LAYER).fullmatch(name)
    if match:
        suffix = match.group(2)
        for ours, names in LAYER_TENSORS.items():
            if names[column] == suffix:
                return f"layers.{ours}", int(match.group(1))
        return None
    for ours, names in GLOBAL_TENSORS.items():
        if names[column] == name:
            return ours, None
    return None


def optional_tensors_present(names: list[str], fmt: str) -> set[str]:
    """Which of `OPTIONAL_LAYER_TENSORS` appear among these checkpoint tensor names."""
    found = set()
    for name in names:
        parsed = parse_name(name, fmt)
        if parsed and parsed[1] is not None and parsed[0][len("layers."):] in OPTIONAL_LAYER_TENSORS:
            found.add(parsed[0][len("layers."):])
    return found


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
