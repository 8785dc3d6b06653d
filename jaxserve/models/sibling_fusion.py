"""Sibling projections' float weights stored side by side: one oneDNN call where there were
three (q|k|v) or two (gate|up).

Above the streaming GEMV's rows a decoder layer's projections each take one oneDNN call, and
the narrow ones run far under the matrix units' rate: SmolLM2's k and v (576 x 192) reach
229 GFLOP/s alone where a 576 x 3072 product reaches 807 (benchmarks/results/
profile-batch-step-bf16-epyc-avx512bf16-avxvnni.md). The same FLOPs as one call per sibling
group -- q|k|v and gate|up concatenated along the output -- take 1.10x less time at 64 rows
and 1.17x at 16 over a 30-layer stack (benchmarks/bench_projection_calls.py).

Where it applies: a GGUF served packed with its float copy (engine/gguf_packing.py: one CPU
device, the library's kernels), the copy in bfloat16 on a CPU with bf16 matrix units
(`fusion_pays`): with oneDNN capped to AVX2 (an AVX2 CPU's path) the fused float32 calls
took 1.19x the seven calls' time at 64 rows and bfloat16 broke even
(projection-calls-{f32,bf16}-onednn-avx2.json), so there each projection keeps its copy.
Each step of at most GGUF_BLOCK_ROWS rows reads the blocks
per projection as before (grouped by the GEMV already); the float copy, which only larger
steps read, is stored as ``layers.qkv_proj.kernel`` [L, in, q + k + v] and
``layers.gate_up_proj.kernel`` [L, in, 2 I] instead of one ``kernel`` per member, so the
copy costs the same bytes. `models/layers.sibling_projections` splits the fused product
back into the members' outputs (each member then adds its bias and LoRA delta as before).
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np

from jaxserve.quantization.gguf_packed import PACKED_FORMATS

# fused leaf -> its members, in the order their outputs are concatenated
SIBLING_GROUPS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"),
                  "gate_up_proj": ("gate_proj", "up_proj")}


def fusion_pays(dtype: Any, bf16_units: bool) -> bool:
    """Whether the fused copy measured faster: a bfloat16 copy on bf16 matrix units
    (`MatrixUnits.bf16` of the --matrix-units the engine serves with)."""
    return bf16_units and np.dtype(dtype) == np.dtype(jnp.bfloat16)


def fuse_packed_float_copies(params: dict[str, Any]) -> list[str]:
    """In place on a host params tree ({"params": {"layers": ...}}): each sibling group whose
    members all hold packed blocks and a stacked float ``kernel`` [L, in, out_i] of one dtype
    and input size gets the fused ``kernel``, and the members lose theirs. Returns the groups
    fused."""
    layers = params["params"].get("layers", {})
    fused = []
    for group, members in SIBLING_GROUPS.items():
        leaves = [layers.get(name, {}) for name in members]
        kernels = [leaf.get("kernel") for leaf in leaves]
        if group in layers or any(k is None or np.ndim(k) != 3 for k in kernels) \
                or not all(any(fmt in leaf for fmt in PACKED_FORMATS) for leaf in leaves) \
                or len({(k.dtype, k.shape[:2]) for k in kernels}) != 1:
            continue
        layers[group] = {"kernel": np.concatenate(kernels, axis=2)}
        for leaf in leaves:
            del leaf["kernel"]
        fused.append(group)
    return fused
