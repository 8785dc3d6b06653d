"""GGUF (llama.cpp) block formats kept packed in device memory, dequantized inside the jit.

A packed tensor is the file's own bytes: ``uint8 [.., rows, blocks * bytes_per_block]`` with
rows = output features (HF's ``[out, in]`` orientation; an embedding's rows are tokens), so
a Q4_1 weight costs 20 bytes per 32 weights (5 bits) resident, like llama.cpp. Its leaf in
the params tree is named after the format (``layers/q_proj/q4_1``), which is how
models/layers.py's `Linear` / `Embedding` know to dequantize. Dequantization follows
gguf-py's numpy reference (gguf.quants) operation for operation, so the values equal what
the dequantizing loader produces, bit for bit.

Block layouts (32 weights per block; d, m little-endian float16):
    q8_0  34 bytes: d, 32 x int8 q                      w = d * q
    q4_0  18 bytes: d, 16 bytes of nibbles              w = d * (nibble - 8)
    q4_1  20 bytes: d, m, 16 bytes of nibbles           w = d * nibble + m
    q4_k  144 bytes per 256 weights: d, dmin, 12 bytes of 6-bit scales sc_j and mins m_j of
          8 sub-blocks of 32, 128 bytes of nibbles      w = (d * sc_j) * nibble - dmin * m_j
    q5_k  176 bytes per 256: d, dmin, the same 12 bytes of scales and mins, 32 bytes qh (bit j
          of byte l: weight l's 5th bit in sub-block j), 128 bytes of nibbles as q4_k
    q6_k  210 bytes per 256: 128 bytes ql (low 4 bits), 64 bytes qh (2 high bits), 16 int8
          scales (one per 16 weights), d               w = (d * sc) * (q - 32)
Nibbles: byte j holds weight j (low 4 bits) and weight j + 16 (high 4 bits); in q4_k each
32 bytes hold sub-block 2i (low nibbles) and 2i + 1 (high nibbles).

On the CPU the kernel library reads these blocks in place (kernels/cpu/gemv_gguf.h, called
by models/linear_method.GGUFPackedMethod); this module's `dequantize` is the path elsewhere.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

BYTES_PER_BLOCK = {"q8_0": 34, "q4_0": 18, "q4_1": 20, "q4_k": 144, "q5_k": 176, "q6_k": 210}
WEIGHTS_PER_BLOCK = {"q8_0": 32, "q4_0": 32, "q4_1": 32, "q4_k": 256, "q5_k": 256, "q6_k": 256}
PACKED_FORMATS = tuple(BYTES_PER_BLOCK)
# With a float copy beside the blocks (engine/gguf_packing.py): steps of at most this many
# rows read the blocks, more the copy. On a 2-core AVX512-BF16 EPYC, all 210 projections of
# SmolLM2-135M: blocks 5.7 / 22.6 ms at 1 / 8 rows against bf16 oneDNN's 31 / 41 ms; at 16
# rows 129 against 108, at 64 rows 476 against 219 (benchmarks/results/gguf-serving-cpu.md).
GGUF_BLOCK_ROWS = 8


def packed_format_of(names: Any) -> str | None:
    """Which packed format a module's parameter names hold (None: a float or int8 one)."""
    found = [f for f in PACKED_FORMATS if f in names]
    return found[0] if found else None


def packed_columns(packed_shape: tuple[int, ...], fmt: str) -> int:
    """The unpacked row length (input features) of a packed [.., rows, bytes] tensor."""
    return packed_shape[-1] // BYTES_PER_BLOCK[fmt] * WEIGHTS_PER_BLOCK[fmt]


def _f16(two_bytes: jax.Array) -> jax.Array:
    return jax.lax.bitcast_convert_type(two_bytes, jnp.float16).astype(jnp.float32)


def _nibbles(qs: jax.Array) -> jax.Array:
    """[.., 16] uint8 -> [.., 32] float32: low nibbles then high nibbles."""
    return jnp.concatenate([qs & 0x0F, qs >> 4], axis=-1).astype(jnp.float32)


def dequantize(packed: jax.Array, fmt: str, dtype: Any = jnp.float32) -> jax.Array:
    """packed uint8 [.., rows, blocks * bytes_per_block] -> [.., rows, blocks * 32] in dtype."""
    bpb = BYTES_PER_BLOCK[fmt]
    blocks = packed.reshape(*packed.shape[:-1], packed.shape[-1] // bpb, bpb)
    d = _f16(blocks[..., 0:2])[..., None]
    if fmt == "q8_0":
        w = d * jax.lax.bitcast_convert_type(blocks[..., 2:], jnp.int8).astype(jnp.float32)
    elif fmt == "q4_0":
        w = d * (_nibbles(blocks[..., 2:]) - 8.0)
    elif fmt == "q4_1":
        w = d * _nibbles(blocks[..., 4:]) + _f16(blocks[..., 2:4])[..., None]
    elif fmt == "q6_k":   # as gguf-py's Q6_K.dequantize_blocks
        lead = blocks.shape[:-1]
        ql = blocks[..., 0:128].reshape(*lead, 2, 1, 64)
        ql = jnp.concatenate([ql & 0x0F, ql >> 4], axis=-2).reshape(*lead, 8, 32)
        qh = blocks[..., 128:192].reshape(*lead, 2, 1, 32)
        qh = jnp.concatenate([(qh >> s) & 3 for s in (0, 2, 4, 6)], axis=-2).reshape(*lead, 8, 32)
        q = (ql | (qh << 4)).astype(jnp.int8) - jnp.int8(32)        # [.., nb, 8, 32]
        sc = jax.lax.bitcast_convert_type(blocks[..., 192:208], jnp.int8).astype(jnp.float32)
        dsc = _f16(blocks[..., 208:210])[..., None] * sc               # [.., nb, 16]
        w = dsc[..., None] * q.reshape(*lead, 16, 16).astype(jnp.float32)
    else:  # q4_k / q5_k, as gguf-py's Q4_K / Q5_K.dequantize_blocks
        sc, m = _q4k_scales_mins(blocks[..., 4:16])                  # [.., nb, 8] each
        dsc = d * sc.astype(jnp.float32)                             # [.., nb, 8]
        dm = _f16(blocks[..., 2:4])[..., None] * m.astype(jnp.float32)
        qs = blocks[..., -128:].reshape(*blocks.shape[:-1], 4, 1, 32)
        nib = jnp.concatenate([qs & 0x0F, qs >> 4], axis=-2)         # [.., nb, 4, 2, 32]
        nib = nib.reshape(*blocks.shape[:-1], 8, 32)
        if fmt == "q5_k":
            qh = blocks[..., 16:48][..., None, :]                       # [.., nb, 1, 32]
            bits = jnp.arange(8, dtype=jnp.uint8)[:, None]
            nib = nib | (((qh >> bits) & 1) << 4)
        w = dsc[..., None] * nib.astype(jnp.float32) - dm[..., None]
    return w.reshape(*packed.shape[:-1], -1).astype(dtype)


def _q4k_scales_mins(scales: jax.Array) -> tuple[jax.Array, jax.Array]:
    """[.., 12] uint8 -> the 8 sub-blocks' 6-bit scales and mins (ggml's get_scale_min_k4)."""
    d, m, m_d = scales[..., 0:4], scales[..., 4:8], scales[..., 8:12]
    sc = jnp.concatenate([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = jnp.concatenate([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mn


def packed_matmul(x: jax.Array, packed: jax.Array, fmt: str, dtype: Any) -> jax.Array:
    """x [.., in] @ W.T with W the packed [out, in] weight -> [.., out] in dtype."""
    w = dequantize(packed, fmt, dtype)
    return jax.lax.dot_general(x.astype(dtype), w, (((x.ndim - 1,), (1,)), ((), ())))
