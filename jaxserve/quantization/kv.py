"""KV-cache dtypes (`--kv-cache-dtype`, vLLM's flag) and the quantized cache layout.

    auto      the model dtype (float32 on CPU, bfloat16 on GPU)
    float32 / bfloat16 / float16
    fp8       float8 e4m3 (fp8_e4m3 is the same), 1 byte a value + a per-token-per-head scale
    int8      symmetric int8, 1 byte a value + a per-token-per-head scale

A quantized cache is a `QuantizedKV` pytree: `data` [blocks, block_size, Hkv, D] (int8 or
e4m3) and `scale` [blocks, block_size, Hkv, 1], one scale per (slot, KV head), written by
write_kv beside the values it scales. The trailing 1 keeps the scale 4-D so the cache's
sharding (heads on the model axis) and shard_map specs apply to both leaves unchanged.

Scale granularity, per token and head (not per head, static): write_kv sees each token's
K/V row as it stores it, so it can size the scale to that row's max|x| with no calibration.
int8 has a fixed range (a static scale would have to cover the largest token ever seen,
wasting levels on every other token); e4m3 keeps ~3 significant bits at any magnitude but
flushes values below 2^-6 to subnormals (fewer bits) and below 2^-9 to 0, so a static
scale of 1.0 (vLLM's default without calibrated scales) loses the small K/V rows; scaled
per row, every row's largest value lands on 127 (int8) or near 448 (fp8, see below).

Scale storage: 1 byte, a log-scale code c (int8) with scale = 2^(c / 8). A float32 scale
per head-token would cost 4 bytes next to D = 64 values: 256 / 68 = 3.76x the tokens of a
float32 cache, short of the 3.9x target; one byte gives 256 / 65 = 3.94x. Rounding the
scale up to the next 2^(1/8) costs at most 9% of int8's range (a fraction of a bit) and
nothing for fp8 (e4m3's relative precision does not depend on the scale).

fp8 scale choice: e4m3's grid repeats every octave, so the 8 codes from the smallest that
covers max|x| are 8 shifts of the grid against the row; write_kv keeps the one with the
least squared error (often the one that puts the row's outlier channel on a grid point).

Rotation: K, V (and q) of a quantized cache are stored rotated over the head dim by a
normalized Hadamard matrix (`head_rotation`, applied in models/layers.py
paged_self_attention after RoPE; the attention output is rotated back). q.k and the
attention are unchanged; the quantization error of the dot averages over the head instead
of riding on a few outlier channels. Measured (SmolLM2-135M, teacher-forced top-1 vs
float32): the error is K's (fp8 on K only 90.8%, on V only 97.1%); rotation and the scale
search together take fp8 from 91.9% to the figures in benchmarks/results/
quant-cpu-kv-rotation.json, int8 from 97.1% up as well.

Readers dequantize tile by tile inside their loops (data cast to float32 times the scale):
the reference attention, the Pallas kernel and the C++ CPU kernel. They never see the
rotation.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16", "fp8", "fp8_e4m3", "int8")
_FIXED = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16,
          "fp8": jnp.float8_e4m3fn, "fp8_e4m3": jnp.float8_e4m3fn, "int8": jnp.int8}
SCALE_STEPS_PER_OCTAVE = 8          # scale = 2 ** (code / 8), code int8
SCALE_CODE_MIN, SCALE_CODE_MAX = -128, 127
FP8_SCALE_SEARCH = 8                # fp8 rows: best of this many codes (one octave)


def is_quantized_dtype(dtype: Any) -> bool:
    """int8 and e4m3 caches carry scales; wider float caches are stored as they are."""
    return jnp.dtype(dtype) in (jnp.dtype(jnp.int8), jnp.dtype(jnp.float8_e4m3fn))


def resolve_kv_cache_dtype(name: str, model_dtype: Any) -> Any:
    """--kv-cache-dtype -> the jnp dtype of the K and V cache values."""
    if name == "auto":
        return model_dtype
    if name not in _FIXED:
        raise ValueError(f"unknown kv_cache_dtype {name!r}; choose one of "
                         f"{', '.join(KV_CACHE_DTYPES)}")
    return _FIXED[name]


def bytes_per_head_token(dtype: Any, head_dim: int) -> int:
    """Bytes one token costs in one KV head of K (or V): values plus the 1-byte scale."""
    values = head_dim * jnp.dtype(dtype).itemsize
    return values + 1 if is_quantized_dtype(dtype) else values


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedKV:
    """A quantized K (or V) cache: values and their per-(slot, head) scale codes."""
    data: jax.Array      # [num_blocks, block_size, Hkv, D] int8 | float8_e4m3fn
    scale: jax.Array     # [num_blocks, block_size, Hkv, 1] int8 code: 2 ** (code / 8)

    @property
    def shape(self):
        return self.data.shape

    @property
    def dtype(self):
        return self.data.dtype

    @property
    def ndim(self):
        return self.data.ndim


def empty_cache(shape: tuple[int, ...], dtype: Any) -> jax.Array | QuantizedKV:
    """Zeros of a cache in `dtype` (a QuantizedKV for int8 / fp8)."""
    if not is_quantized_dtype(dtype):
        return jnp.zeros(shape, dtype)
    return QuantizedKV(jnp.zeros(shape, dtype), jnp.zeros((*shape[:-1], 1), jnp.int8))


def qmax(dtype: Any) -> float:
    return 127.0 if jnp.dtype(dtype) == jnp.dtype(jnp.int8) else float(jnp.finfo(dtype).max)


def decode_scale(code: jax.Array) -> jax.Array:
    """int8 codes -> float32 scales 2 ** (code / 8)."""
    return jnp.exp2(code.astype(jnp.float32) * (1.0 / SCALE_STEPS_PER_OCTAVE))


def quantize_rows(x: jax.Array, dtype: Any) -> tuple[jax.Array, jax.Array]:
    """x [..., D] float -> (values [..., D] in dtype, codes int8 [..., 1]): each row scaled so
    its max |x| lands at (just under) the dtype's top, rounded to the 2^(1/8) code grid.

    fp8 rows then try the next FP8_SCALE_SEARCH - 1 codes too (coarser scales, so nothing
    saturates) and keep the one with the least squared error: e4m3's grid is the same in
    every octave, so the 8 codes of one octave are 8 shifts of the grid against the row,
    and the best of them often puts the row's largest values (which dominate q.k) on grid
    points. int8 keeps the smallest code (a coarser scale only widens int8's steps)."""
    x = x.astype(jnp.float32)
    top = qmax(dtype)
    amax = jnp.max(jnp.abs(x), axis=-1, keepdims=True)
    # smallest code whose scale covers amax / top; an all-zero row gets the smallest scale
    need = jnp.log2(jnp.maximum(amax, 1e-30) / top) * SCALE_STEPS_PER_OCTAVE
    code = jnp.clip(jnp.ceil(need), SCALE_CODE_MIN, SCALE_CODE_MAX)
    if jnp.dtype(dtype) == jnp.dtype(jnp.int8):
        values = jnp.clip(jnp.round(x / decode_scale(code)), -top, top).astype(jnp.int8)
        return values, code.astype(jnp.int8)

    def fp8(code):      # e4m3fn has no inf: saturate rather than overflow to NaN
        scale = decode_scale(code)
        values = jnp.clip(x / scale, -top, top).astype(dtype)
        err = jnp.sum(jnp.square(values.astype(jnp.float32) * scale - x), -1, keepdims=True)
        return values, err

    values, err = fp8(code)
    best = code
    for step in range(1, FP8_SCALE_SEARCH):
        c = jnp.minimum(code + step, SCALE_CODE_MAX)
        v, e = fp8(c)
        better = e < err      # ties keep the finer scale
        values = jnp.where(better, v, values)
        err, best = jnp.where(better, e, err), jnp.where(better, c, best)
    return values, best.astype(jnp.int8)


def head_rotation(head_dim: int) -> np.ndarray:
    """The [D, D] rotation quantized caches store K and V in: the normalized Hadamard matrix
    (Sylvester's construction, entries +-1/sqrt(n)), block-diagonal with blocks of the largest
    power of two n dividing head_dim (the whole head for 64, 128, 256). Orthogonal and
    symmetric, so it is its own inverse. See `rotate_heads`."""
    n = head_dim & -head_dim
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return np.kron(np.eye(head_dim // n), h / np.sqrt(n)).astype(np.float32)


def rotate_heads(x: jax.Array, rotation: jax.Array | np.ndarray) -> jax.Array:
    """x [..., D] @ rotation [D, D] in float32 (HIGHEST: no TF32/bf16 passes on GPU), back in
    x's dtype.

    Why quantized caches rotate (models/layers.py paged_self_attention, only when the cache
    is a QuantizedKV): K rows carry a few outlier channels (attention sinks, massive
    activations), and e4m3 keeps a fixed *relative* error per value, so a q.k dominated by
    those channels keeps their error. With k' = k R and q' = q R after RoPE, q'.k' = q.k
    exactly (R orthogonal) while the rotated rows spread every channel's energy over all D,
    so the dot's quantization error averages down; v' = v R and the attention output
    un-rotated (o = o' R^T) likewise. The kernels see plain (rotated) rows and are unchanged.
    Measured: benchmarks/results/quant-cpu-kv-rotation.json."""
    out = jnp.einsum("...d,de->...e", x.astype(jnp.float32),
                     jnp.asarray(rotation, jnp.float32), precision=jax.lax.Precision.HIGHEST)
    return out.astype(x.dtype)


def dequantize(cache: jax.Array | QuantizedKV) -> jax.Array:
    """The float32 values a reader sees (whole cache; tests and tools)."""
    if isinstance(cache, QuantizedKV):
        return cache.data.astype(jnp.float32) * decode_scale(cache.scale)
    return cache.astype(jnp.float32)


def dequantize_np(data: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """numpy twin of `dequantize`, for oracles."""
    return np.asarray(data, np.float32) * np.exp2(
        np.asarray(scale, np.float32) / SCALE_STEPS_PER_OCTAVE)
