"""`--load-format dummy`: random weights in our layout for any registered HF config.

As vLLM's dummy format: benchmark or smoke-test an 8B-class engine end to end from a
`config.json` alone, no checkpoint. Values are small, non-zero and deterministic (a fixed
seed); they are cut from one random pool so building 16 GB of weights costs memcpy, not
random-number generation.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from jaxserve.models.registry import family_for, read_arch

_POOL_ELEMENTS = 1 << 22   # distinct random values; weights are windows into this pool
_SCALE = 0.02              # like HF's initializer_range: keeps a deep random net finite


def dummy_weights(hf_config: Any, dtype: np.dtype, seed: int = 0) -> dict[str, np.ndarray]:
    """Random weights of the shapes the model's family lists; norms are the family's
    `norm_center` (1 for w * x, 0 for Gemma's (1 + w) * x) + noise, so activations stay O(1)."""
    arch = read_arch(hf_config)
    family = family_for(arch.architecture)
    rng = np.random.default_rng(seed)
    pool = (rng.standard_normal(_POOL_ELEMENTS, dtype=np.float32) * _SCALE).astype(dtype)
    weights = {}
    for i, (name, shape) in enumerate(family.weight_shapes(arch).items()):
        size = int(np.prod(shape))
        # A different window per tensor, tiled when the tensor is larger than the pool.
        window = np.roll(pool, -((i * 7919) % _POOL_ELEMENTS))
        values = np.resize(window, size).reshape(shape)
        if name.endswith("norm") or name.endswith("layernorm"):
            values = (values.astype(np.float32) + family.norm_center).astype(dtype)
        weights[name] = values
    return weights
