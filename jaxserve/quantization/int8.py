"""int8 weight-only quantization (w8a16), group-wise along the input dim.

A kernel ``W [.., in, out]`` becomes ``q int8 [.., in, out]`` and ``scale f32
[.., in // g, out]``: every run of ``g`` consecutive input rows of one output column shares
a scale (``W[i, o] ~= q[i, o] * scale[i // g, o]``). The layer dequantizes inside the jitted
matmul (models/linear_method.py: int8 -> activation dtype, times the broadcast scale, one
fused elementwise pass feeding the dot), so the float kernel exists only as a step
temporary -- except on the CPU at decode rows (<= 8), where the library's GEMV streams the
int8 weights in place and applies each group's scale to its partial sum (a quarter of
float32's bytes; kernels/cpu/gemv.h).

Why groups, not one scale per output column: a column's scale is set by its single
largest weight, so every other weight of the column is quantized on a coarser grid than
it needs. On the default model (SmolLM2-135M, itself a Q4_1 GGUF whose blocks are 32
input rows) per-column int8 agreed with float32 on 93.7% of teacher-forced top-1 tokens;
groups of 32 input rows follow the checkpoint's own blocks (measured numbers:
benchmarks/results/quant-cpu.json). Group size: the largest of GROUP_SIZES dividing `in`
(576 = hidden of SmolLM2 is not a multiple of 128), else one group per column.
Tensor parallelism: a column-parallel split keeps every group whole (it cuts `out`); a
row-parallel split cuts `in` and the group axis with it (partition rules in
models/family.py), so `in / tp` must be a multiple of g, checked there.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

INT8_MAX = 127
GROUP_SIZES = (32,)


def group_size_for(in_features: int, group_size: int | None = None) -> int:
    """The group length along `in` (in_features itself = one scale per output column)."""
    sizes = (group_size,) if group_size else GROUP_SIZES
    for g in sizes:
        if g and in_features % g == 0:
            return g
    return in_features


def quantize_int8(kernel: np.ndarray, group_size: int | None = None
                  ) -> tuple[np.ndarray, np.ndarray]:
    """kernel [..., in, out] float -> (q int8 [..., in, out], scale f32 [..., in // g, out]).
    Symmetric: scale = max|group| / 127; an all-zero group gets scale 1 (q = 0).
    group_size=None picks from GROUP_SIZES; group_size=in gives per-column scales."""
    if isinstance(kernel, jax.ShapeDtypeStruct):     # shapes only (ahead-of-time compiles)
        *lead, n_in, n_out = kernel.shape
        g = group_size_for(n_in, group_size)
        return (jax.ShapeDtypeStruct(kernel.shape, np.int8),
                jax.ShapeDtypeStruct((*lead, n_in // g, n_out), np.float32))
    w = np.asarray(kernel, np.float32)
    n_in, n_out = w.shape[-2:]
    g = group_size_for(n_in, group_size)
    grouped = w.reshape(*w.shape[:-2], n_in // g, g, n_out)
    scale = np.abs(grouped).max(axis=-2) / INT8_MAX
    scale = np.where(scale > 0, scale, 1.0).astype(np.float32)
    q = np.clip(np.rint(grouped / scale[..., None, :]), -INT8_MAX, INT8_MAX).astype(np.int8)
    return q.reshape(w.shape), scale


def dequantize_int8(q: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """The float kernel q * scale (numpy; tests and tools)."""
    n_in, n_out = q.shape[-2:]
    groups = scale.shape[-2]
    w = q.astype(np.float32).reshape(*q.shape[:-2], groups, n_in // groups, n_out)
    return (w * scale[..., None, :]).reshape(q.shape)


def quantize_params_int8(params: dict[str, Any], group_size: int | None = None
                         ) -> dict[str, Any]:
    """A linen params tree -> the same tree with every projection `kernel` (the stacked
    layer kernels [L, in, out] and an untied lm_head [H, V]) int8 plus its `scale`.
    Embeddings and norms stay in their dtype (a tied lm_head is the embedding)."""
    tree = params["params"]
    modules = [m for m in tree.get("layers", {}).values() if isinstance(m, dict)]
    if isinstance(tree.get("lm_head"), dict):
        modules.append(tree["lm_head"])
    for module in modules:
        if "kernel" in module and np.dtype(module["kernel"].dtype) != np.int8:
            module["kernel"], module["scale"] = quantize_int8(module["kernel"], group_size)
    return params
