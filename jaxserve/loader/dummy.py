"""`--load-format dummy`: random weights in our layout for any supported HF config.

As vLLM's dummy format: benchmark or smoke-test an 8B-class engine end to end from a
`config.json` alone, no checkpoint. Values are small, non-zero and deterministic (a fixed
seed); they are cut from one random pool so building 16 GB of weights costs memcpy, not
random-number generation.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from jaxserve.models.arch import ModelArch

_POOL_ELEMENTS = 1 << 22   # distinct random values; weights are windows into this pool
_SCALE = 0.02              # like HF's initializer_range: keeps a deep random net finite


def dummy_weight_shapes(arch: ModelArch) -> dict[str, tuple[int, ...]]:
    """Every tensor the model reads, in loader/weights.py's layout."""
    L, H, I = arch.num_layers, arch.hidden_size, arch.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {
        "embed_tokens": (arch.vocab_size, H),
        "norm": (H,),
        "layers.input_layernorm": (L, H),
        "layers.post_attention_layernorm": (L, H),
        "layers.q_proj.kernel": (L, H, arch.q_size),
        "layers.k_proj.kernel": (L, H, arch.kv_size),
        "layers.v_proj.kernel": (L, H, arch.kv_size),
        "layers.o_proj.kernel": (L, arch.q_size, H),
        "layers.gate_proj.kernel": (L, H, I),
        "layers.up_proj.kernel": (L, H, I),
        "layers.down_proj.kernel": (L, I, H),
    }
    if not arch.tie_word_embeddings:
        shapes["lm_head"] = (H, arch.vocab_size)
    if arch.qkv_bias:
        shapes |= {"layers.q_proj.bias": (L, arch.q_size), "layers.k_proj.bias": (L, arch.kv_size),
                   "layers.v_proj.bias": (L, arch.kv_size)}
    if arch.o_bias:
        shapes["layers.o_proj.bias"] = (L, H)
    if arch.qk_norm:
        shapes |= {"layers.q_norm": (L, arch.head_dim), "layers.k_norm": (L, arch.head_dim)}
    return shapes


def dummy_weights(hf_config: Any, dtype: np.dtype, seed: int = 0) -> dict[str, np.ndarray]:
    """Random weights of the right shapes; norms are 1 + noise so activations stay O(1)."""
    arch = ModelArch.from_hf_config(hf_config)
    rng = np.random.default_rng(seed)
    pool = (rng.standard_normal(_POOL_ELEMENTS, dtype=np.float32) * _SCALE).astype(dtype)
    weights = {}
    for i, (name, shape) in enumerate(dummy_weight_shapes(arch).items()):
        size = int(np.prod(shape))
        # A different window per tensor, tiled when the tensor is larger than the pool.
        window = np.roll(pool, -((i * 7919) % _POOL_ELEMENTS))
        values = np.resize(window, size).reshape(shape)
        if name.endswith("norm") or name.endswith("layernorm"):
            values = (values.astype(np.float32) + 1.0).astype(dtype)
        weights[name] = values
    return weights
