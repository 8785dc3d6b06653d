"""int8 weight-only quantization (w8a16), per output channel.

A kernel ``W [.., in, out]`` becomes ``q int8 [.., in, out]`` and ``scale f32 [.., out]`` with
``W ~= q * scale``; the matmul runs on ``q`` cast to the activation dtype and the scale
multiplies the output (``y = (x @ q) * scale``), so the dequantized kernel is never stored.
Per output column because that is the axis a column-parallel split cuts: each device keeps
the scales of its own columns, and a row-parallel layer's scales are whole on every device.
"""

from __future__ import annotations

from typing import Any

import numpy as np

INT8_MAX = 127


def quantize_int8(kernel: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """kernel [..., in, out] float -> (q int8 [..., in, out], scale float32 [..., out]).
    Symmetric: scale = max|column| / 127; an all-zero column gets scale 1 (q = 0)."""
    w = np.asarray(kernel, np.float32)
    scale = np.abs(w).max(axis=-2) / INT8_MAX
    scale = np.where(scale > 0, scale, 1.0).astype(np.float32)
    q = np.clip(np.rint(w / scale[..., None, :]), -INT8_MAX, INT8_MAX).astype(np.int8)
    return q, scale


def quantize_params_int8(params: dict[str, Any]) -> dict[str, Any]:
    """A linen params tree -> the same tree with every projection `kernel` (the stacked
    layer kernels [L, in, out] and an untied lm_head [H, V]) int8 plus its `scale`.
    Embeddings and norms stay in their dtype (a tied lm_head is the embedding)."""
    tree = params["params"]
    modules = [m for m in tree.get("layers", {}).values() if isinstance(m, dict)]
    if isinstance(tree.get("lm_head"), dict):
        modules.append(tree["lm_head"])
    for module in modules:
        if "kernel" in module and np.asarray(module["kernel"]).dtype != np.int8:
            module["kernel"], module["scale"] = quantize_int8(module["kernel"])
    return params
