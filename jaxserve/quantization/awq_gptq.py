"""AWQ and GPTQ checkpoints (int4 / int8 weight-only, group-wise): loaded packed, dequantized
inside the jitted matmul.

Both formats store ``W[i, o] = (q[i, o] - z[g(i), o]) * s[g(i), o]`` for a projection
``y = x @ W`` (i: input feature, o: output feature), with q, z unsigned `bits`-bit integers
packed into int32 words and s float16. They differ in how the words are laid out:

    AWQ (AutoAWQ "gemm" version, 4 bits)
        qweight int32 [in, out / 8]    packed along out; nibble k of word c holds output
                                       c * 8 + AWQ_ORDER[k] (the interleave [0,2,4,6,1,3,5,7])
        qzeros  int32 [G, out / 8]     packed the same way; z = the stored value
        scales  f16   [G, out]         g(i) = i // group_size
    GPTQ (AutoGPTQ / GPTQModel "gptq" format; 4 or 8 bits)
        qweight int32 [in / p, out]    packed along in: field k of row r holds input r * p + k
                                       (p = 32 / bits, field k at bits k*bits..)
        qzeros  int32 [G, out / p]     packed along out, same field order; z = stored + 1
                                       (the format stores z - 1; checkpoint_format "gptq_v2"
                                       stores z itself)
        scales  f16   [G, out]
        g_idx   int32 [in]             g(i): the group of input i (act-order `desc_act`
                                       checkpoints permute it; else i // group_size)

Internal layout (what the params tree holds, per layer; stacked on L like every kernel):
    qweight int32 [in / p, out]  GPTQ's packing along in for both formats, so one unpacking
                                 (shift, mask, reshape: elementwise, fuses in XLA on CPU and
                                 GPU) serves both, and a row-parallel split of `in` is a split
                                 of whole words
    scales  f16   [G, out]       as stored (a bfloat16 / float32 checkpoint's kept so)
    zeros   f16   [G, out]       z unpacked (integers <= 256: exact in float16)
    g_idx   int32 [in]           only where it is not i // group_size (act-order)
4-bit resident bytes: 0.5 per weight + 4 per group and column (0.13x float32 at g = 128).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

LEAVES = ("qweight", "scales", "zeros", "g_idx")
METHODS = ("awq", "gptq")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)     # nibble k of an AWQ word holds column AWQ_ORDER[k]


@dataclass(frozen=True)
class PackedIntConfig:
    """What a checkpoint's `quantization_config` says about its packed projections."""
    method: str          # "awq" or "gptq"
    bits: int
    group_size: int      # -1: one group per column (all of `in`)
    zero_offset: int     # added to the stored zeros (GPTQ's "gptq" format stores z - 1)

    @property
    def pack(self) -> int:
        return 32 // self.bits


def _field(qc: dict[str, Any], key: str, default: Any) -> Any:
    value = qc.get(key, default)
    return default if value is None else value


def checkpoint_method(qc: dict[str, Any] | None, requested: str | None, source: str
                      ) -> str | None:
    """The --quantization a checkpoint runs with: its quantization_config's quant_method
    (awq / gptq) when the flag is unset, as vLLM picks it; an explicit flag must agree.
    qc: config.json's quantization_config (None: a float checkpoint)."""
    method = str(qc.get("quant_method", "")).lower() if qc else None
    if method is None:
        if requested in METHODS:
            raise ValueError(f"quantization={requested!r} needs a {requested} checkpoint; "
                             f"{source} has no quantization_config in config.json")
        return requested
    if method not in METHODS:
        raise ValueError(f"{source}: quantization_config.quant_method={method!r} is not "
                         f"supported; supported quantized checkpoints: {', '.join(METHODS)}")
    if requested not in (None, method):
        raise ValueError(f"quantization={requested!r} does not match {source}'s "
                         f"quantization_config.quant_method={method!r}; pass "
                         f"quantization={method!r} or leave it unset")
    return method


def parse_quantization_config(qc: dict[str, Any]) -> PackedIntConfig:
    """A config.json `quantization_config` of quant_method awq / gptq -> PackedIntConfig;
    a ValueError naming the field and value for every variant we do not read."""
    method = str(qc.get("quant_method", "")).lower()
    if method not in METHODS:
        raise ValueError(f"quantization_config.quant_method={qc.get('quant_method')!r} is not "
                         f"supported; choose a checkpoint of {', '.join(METHODS)}")
    bits = qc.get("bits", qc.get("w_bit", 4))
    allowed_bits = (4,) if method == "awq" else (4, 8)
    if bits not in allowed_bits:
        raise ValueError(f"quantization_config.bits={bits!r} is not supported for {method}; "
                         f"supported: {', '.join(map(str, allowed_bits))}")
    group_size = qc.get("group_size", qc.get("q_group_size", 128))
    if not isinstance(group_size, int) or not (group_size == -1 or group_size > 0):
        raise ValueError(f"quantization_config.group_size={group_size!r} must be a positive "
                         "integer or -1")
    if method == "awq":
        version = str(_field(qc, "version", "gemm")).lower()
        if version != "gemm":
            raise ValueError(f"quantization_config.version={qc.get('version')!r} is not "
                             "supported for awq: only the GEMM layout ('gemm') is read "
                             "(GEMV / GEMV_fast / marlin / exllama layouts are not)")
        if not _field(qc, "zero_point", True):
            raise ValueError("quantization_config.zero_point=False is not supported for awq "
                             "(only asymmetric AWQ with qzeros is read)")
        zero_offset = 0
    else:
        fmt = str(_field(qc, "checkpoint_format", "gptq")).lower()
        if _field(qc, "is_marlin_format", False) or fmt not in ("gptq", "gptq_v2"):
            shown = "marlin" if qc.get("is_marlin_format") else qc.get("checkpoint_format")
            raise ValueError(f"quantization_config.checkpoint_format={shown!r} is not supported "
                             "for gptq; only the 'gptq' and 'gptq_v2' layouts are read")
        zero_offset = 1 if fmt == "gptq" else 0
    if qc.get("lm_head"):
        raise ValueError("quantization_config.lm_head=True (a quantized output head) is not "
                         "supported; only the decoder layers' projections may be quantized")
    if qc.get("dynamic"):
        raise ValueError("quantization_config.dynamic (per-module bits / group sizes) is not "
                         "supported")
    return PackedIntConfig(method, int(bits), int(group_size), zero_offset)


# -- repacking at load (numpy) ------------------------------------------------------------------
def unpack_int32(words: np.ndarray, bits: int, axis: int) -> np.ndarray:
    """int32 words -> their `32 / bits` unsigned fields, field k (bits k*bits..) at position
    word * p + k along `axis` (sequential order: GPTQ's, and AWQ's before un-interleaving)."""
    pack = 32 // bits
    shifts = np.arange(pack, dtype=np.uint32) * bits
    u = np.moveaxis(np.ascontiguousarray(words).view(np.uint32), axis, -1)
    fields = (u[..., None] >> shifts) & np.uint32((1 << bits) - 1)
    return np.moveaxis(fields.reshape(*u.shape[:-1], -1), -1, axis).astype(np.int32)


def pack_rows(q: np.ndarray, bits: int) -> np.ndarray:
    """q [in, out] unsigned ints < 2**bits -> int32 [in / p, out] (the internal layout)."""
    pack = 32 // bits
    grouped = q.astype(np.uint32).reshape(q.shape[0] // pack, pack, q.shape[1])
    shifts = (np.arange(pack, dtype=np.uint32) * bits)[None, :, None]
    return np.bitwise_or.reduce(grouped << shifts, axis=1).view(np.int32)


def _check_shape(name: str, part: str, array: np.ndarray, expected: tuple[int, ...]) -> None:
    if tuple(array.shape) != expected:
        raise ValueError(f"{name}.{part} has shape {tuple(array.shape)}, expected {expected} "
                         "from the model config and quantization_config")


def repack(parts: dict[str, np.ndarray], cfg: PackedIntConfig, in_features: int,
           out_features: int, name: str) -> dict[str, np.ndarray]:
    """One projection's checkpoint tensors (qweight, qzeros, scales[, g_idx]) -> the internal
    layout (module docstring). name: the checkpoint module, for error messages."""
    missing = [p for p in ("qweight", "qzeros", "scales") if p not in parts]
    if missing:
        raise ValueError(f"{name}: {cfg.method} checkpoint lacks {', '.join(missing)}")
    pack = cfg.pack
    group = in_features if cfg.group_size == -1 else cfg.group_size
    if in_features % group or in_features % pack or out_features % pack:
        raise ValueError(f"{name}: in={in_features} / out={out_features} do not divide into "
                         f"group_size={cfg.group_size} and {pack} fields per int32")
    groups = in_features // group
    _check_shape(name, "scales", parts["scales"], (groups, out_features))
    _check_shape(name, "qzeros", parts["qzeros"], (groups, out_features // pack))
    zeros = unpack_int32(parts["qzeros"], cfg.bits, axis=1)
    if cfg.method == "awq":
        _check_shape(name, "qweight", parts["qweight"], (in_features, out_features // pack))
        # un-interleave: output c*8 + AWQ_ORDER[k] sits in field k of word c
        inverse = np.argsort(AWQ_ORDER)
        q = unpack_int32(parts["qweight"], cfg.bits, axis=1)
        q = q.reshape(in_features, -1, pack)[..., inverse].reshape(in_features, out_features)
        zeros = zeros.reshape(groups, -1, pack)[..., inverse].reshape(groups, out_features)
        qweight = pack_rows(q, cfg.bits)
    else:
        _check_shape(name, "qweight", parts["qweight"], (in_features // pack, out_features))
        qweight = np.ascontiguousarray(parts["qweight"]).view(np.int32)
    scales = np.asarray(parts["scales"])     # float16 (bfloat16 / float32 kept as stored)
    if scales.dtype not in (np.float16, np.float32) and scales.dtype.name != "bfloat16":
        scales = scales.astype(np.float16)
    out = {"qweight": qweight, "scales": scales,
           "zeros": (zeros + cfg.zero_offset).astype(np.float16)}
    g_idx = parts.get("g_idx")
    if g_idx is not None:
        _check_shape(name, "g_idx", g_idx, (in_features,))
        g_idx = np.asarray(g_idx).astype(np.int32)
        if g_idx.min() < 0 or g_idx.max() >= groups:
            raise ValueError(f"{name}.g_idx holds groups {g_idx.min()}..{g_idx.max()}, "
                             f"outside 0..{groups - 1}")
        if not np.array_equal(g_idx, np.arange(in_features) // group):
            out["g_idx"] = g_idx
    return out


# -- the jitted dequantize-and-multiply ---------------------------------------------------------
def dequantize(params: dict[str, jax.Array], in_features: int, dtype: Any) -> jax.Array:
    """The float kernel [in, out] in dtype of one projection's internal arrays (computed in
    float32, one rounding to dtype: the exact dequantized weight for float32)."""
    qweight = params["qweight"]
    pack = in_features // qweight.shape[0]
    bits = 32 // pack
    shifts = jnp.arange(pack, dtype=jnp.int32) * bits
    # arithmetic shifts of negative words fill the top with ones; the mask keeps the field
    q = (qweight[:, None, :] >> shifts[None, :, None]) & ((1 << bits) - 1)
    q = q.reshape(in_features, qweight.shape[1]).astype(jnp.float32)
    scales = params["scales"].astype(jnp.float32)
    zeros = params["zeros"].astype(jnp.float32)
    if "g_idx" in params:            # act-order: any input row may belong to any group
        g_idx = params["g_idx"]
        w = (q - jnp.take(zeros, g_idx, axis=0)) * jnp.take(scales, g_idx, axis=0)
    else:                            # contiguous groups of in / G rows
        groups = scales.shape[0]
        w = q.reshape(groups, in_features // groups, -1)
        w = ((w - zeros[:, None, :]) * scales[:, None, :]).reshape(in_features, -1)
    return w.astype(dtype)


def packed_int_matmul(x: jax.Array, params: dict[str, jax.Array], dtype: Any) -> jax.Array:
    """x [.., in] @ W -> [.., out] in dtype, W dequantized from params inside the jit."""
    w = dequantize(params, x.shape[-1], dtype)
    return jax.lax.dot_general(x.astype(dtype), w, (((x.ndim - 1,), (0,)), ((), ())))
