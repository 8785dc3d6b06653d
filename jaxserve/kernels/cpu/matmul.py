"""Projections on the CPU's matrix units through oneDNN's matmul primitive (matmul.cc), read
in place from stacked ``[L, in, out]`` weights, and the CPU features that decide the dtype.

oneDNN comes from PyPI's ``onednn-cpu-gomp`` (the CPU-only build, 39 MB wheel, 55 MB
library) and ``onednn-devel-cpu-gomp`` (its headers, 0.2 MB); MKL's wheel is 229 MB and
dispatches by vendor, oneDNN by CPU feature flags (AMX, AVX512-BF16, AVX-512, AVX2), the
same code on Intel and AMD. Without oneDNN (or a compiler) `available()` is False and the
model keeps XLA's dot.

The library's own streaming GEMV (gemv.h: f32 accumulation over f32 / bf16 / int8 weights
read in place) serves int8 weights with float x at rows <= 8 (W8A16), and float weights up
to the row count the engine measured it faster than oneDNN on this CPU (gemv_choice.py; on a
2-core AVX2 EPYC: float32 and bf16 up to 8 rows).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import sys
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.kernels.cpu.build import HERE, CpuKernelBuildError, FfiTarget, KernelLibrary

logger = logging.getLogger(__name__)

TARGET = "jaxserve_matmul"
SYMBOL = "JaxserveMatmul"
GROUP_TARGET = "jaxserve_matmul_group"
GGUF_TARGET = "jaxserve_gguf_matmul"
PACKED_TARGET = "jaxserve_packed_matmul"     # onednn_packed.cc (packed_matmul.py)
# gemv_gguf.h's GgufFormat
GGUF_FORMAT_CODES = {"q8_0": 0, "q4_0": 1, "q4_1": 2, "q4_k": 3, "q5_k": 4, "q6_k": 5}
GGUF_BLOCK_WEIGHTS = {"q8_0": 32, "q4_0": 32, "q4_1": 32, "q4_k": 256, "q5_k": 256, "q6_k": 256}
MAX_GEMV_ROWS = 8
GEMV_K_BLOCK = 8      # gemv.h's kGemvKBlock: weight rows per block, never two int8 groups


def gemv_takes_groups(n_in: int, groups: int) -> bool:
    """Whether the GEMV can apply int8 group scales of `groups` groups over `n_in` input rows:
    equal groups a whole number of its row blocks long, or one group over every row."""
    return groups > 0 and n_in % groups == 0 and (
        (n_in // groups) % GEMV_K_BLOCK == 0 or groups == 1)


class CpuMatmulBuildError(CpuKernelBuildError):
    """The oneDNN matmul library could not be built or loaded."""


def onednn_prefix() -> Path | None:
    """The prefix holding oneDNN's header and library (this Python's, where pip puts the
    onednn-cpu-gomp and onednn-devel-cpu-gomp wheels), or None."""
    for prefix in (Path(sys.prefix), Path(sys.base_prefix)):
        if (prefix / "include" / "dnnl.hpp").exists() and (prefix / "lib" / "libdnnl.so.3").exists():
            return prefix
    return None


def library() -> KernelLibrary:
    prefix = onednn_prefix()
    hint = ("pip install onednn-cpu-gomp onednn-devel-cpu-gomp for the matrix units; "
            "without it projections use XLA's dot")
    if prefix is None:
        raise CpuMatmulBuildError(f"oneDNN not found under {sys.prefix}: {hint}")
    lib_dir = prefix / "lib"
    return KernelLibrary(
        name="matmul", sources=(HERE / "matmul.cc", HERE / "gemv_gguf_entry.cc",
                                HERE / "onednn_packed.cc", HERE / "gemv.h", HERE / "bf16_bits.h",
                                HERE / "gemv_gguf.h", HERE / "parallel_for.h"),
        include_dirs=(HERE, prefix / "include"),
        link_flags=(f"-L{lib_dir}", "-l:libdnnl.so.3", f"-Wl,-rpath,{lib_dir}"),
        fallback_hint=hint, error=CpuMatmulBuildError)


_FFI_TARGET = FfiTarget(TARGET, SYMBOL, library, "the oneDNN matmul library",
                        more=((GROUP_TARGET, "JaxserveMatmulGroup"),
                              (GGUF_TARGET, "JaxserveGgufMatmul"),
                              (PACKED_TARGET, "JaxservePackedMatmul")))


def register() -> Path:
    """Build (if needed), load and register the FFI target with XLA; idempotent."""
    return _FFI_TARGET.register()


def available() -> bool:
    """True when the library builds and loads here (else logs why, once)."""
    try:
        register()
        return True
    except CpuMatmulBuildError as e:
        _warn_once(str(e))
        return False


@functools.lru_cache(maxsize=1)
def _warn_once(message: str) -> None:
    logger.warning("oneDNN matmul unavailable: %s", message)


# ---------------------------------------------------------------------------
# CPU features
# ---------------------------------------------------------------------------

@dataclass(frozen=True)
class MatrixUnits:
    """What the CPU computes bf16 / int8 products on (from /proc/cpuinfo's flags)."""
    amx_bf16: bool = False
    avx512_bf16: bool = False
    amx_int8: bool = False
    avx512_vnni: bool = False
    avx_vnni: bool = False

    @property
    def bf16(self) -> bool:
        """bf16 dot products in hardware (else oneDNN converts to f32: slower than f32)."""
        return self.amx_bf16 or self.avx512_bf16

    @property
    def int8(self) -> bool:
        return self.amx_int8 or self.avx512_vnni or self.avx_vnni

    def describe(self) -> str:
        names = [n for n in ("amx_bf16", "avx512_bf16", "amx_int8", "avx512_vnni", "avx_vnni")
                 if getattr(self, n)]
        return ", ".join(names) if names else "none"


# The CPU kinds a deployment meets, by what their matrix units compute: `matrix_units=KIND`
# serves as on that kind (where this CPU lacks the units oneDNN emulates them: the same
# numbers, slower), so one box tests every kind's path.
MATRIX_UNIT_KINDS = {
    "none": MatrixUnits(),                                           # AVX2-only
    "avx512": MatrixUnits(avx512_bf16=True, avx512_vnni=True),       # AVX512-BF16 + VNNI
    "amx": MatrixUnits(amx_bf16=True, avx512_bf16=True, amx_int8=True, avx512_vnni=True),
}
_chosen: MatrixUnits | None = None


def use_matrix_units(setting: str) -> MatrixUnits:
    """Set what this process's steps assume the CPU computes on (`ModelConfig.matrix_units`:
    auto = the detected units, else a `MATRIX_UNIT_KINDS` name) and return it. Process-wide,
    as the CPU is: the engine's setup calls it before any step is traced."""
    global _chosen
    _chosen = matrix_units_for(setting)
    return _chosen


def matrix_units_for(setting: str) -> MatrixUnits:
    """The units a `matrix_units` setting means on this machine (auto: detected)."""
    if setting == "auto":
        return detect_matrix_units()
    try:
        return MATRIX_UNIT_KINDS[setting]
    except KeyError:
        raise ValueError(f"matrix_units={setting!r}: choose auto, "
                         f"{', '.join(MATRIX_UNIT_KINDS)}") from None


def current_matrix_units() -> MatrixUnits:
    """What the last `use_matrix_units` chose, else the detected units."""
    return _chosen if _chosen is not None else detect_matrix_units()


def detect_matrix_units(cpuinfo: str | None = None) -> MatrixUnits:
    """The host's matrix units, from the first `flags` line of /proc/cpuinfo (or `cpuinfo`)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return MatrixUnits()
    flags: set[str] = set()
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            break
    return MatrixUnits(amx_bf16="amx_bf16" in flags, avx512_bf16="avx512_bf16" in flags,
                       amx_int8="amx_int8" in flags, avx512_vnni="avx512_vnni" in flags,
                       avx_vnni="avx_vnni" in flags)


# ---------------------------------------------------------------------------
# The call
# ---------------------------------------------------------------------------

_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
_INT8 = jnp.dtype(jnp.int8)


def layer_matmul(x: jax.Array, stacked: jax.Array, layer, out_dtype=None, *,
                 gemv_rows: int = -1, transposed: bool = False) -> jax.Array:
    """x [T, in] @ stacked[layer] -> [T, out] in ``out_dtype`` (default x's), any T.

    stacked: [L, in, out] (``transposed``: [L, out, in], a tied embedding table [1, V, H]);
    x, stacked and the result float32 or bfloat16, accumulation float32. int8 stacked
    weights take int8 x (W8A8 on the int8 units; exact int32 sums returned as float32) or,
    for at most 8 rows, float x (W8A16: the GEMV); the caller applies the scales. ``gemv_rows``:
    the largest T that takes the streaming GEMV (-1: its limit, 8; 0: always oneDNN), for
    ``transposed`` float tables too (a dot product per table row); float x of another
    dtype than float weights only there (oneDNN takes one)."""
    register()
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    in_axis, out_axis = (2, 1) if transposed else (1, 2)
    if x.ndim != 2 or stacked.ndim != 3 or x.shape[1] != stacked.shape[in_axis]:
        raise ValueError(f"layer_matmul wants x [T, in] and weights [L, in, out] "
                         f"({'[L, out, in] ' if transposed else ''}); got {x.shape} and "
                         f"{stacked.shape}")
    int8_ok = stacked.dtype == _INT8 and (x.dtype == _INT8 or x.shape[0] <= MAX_GEMV_ROWS)
    if (x.dtype not in _DTYPES and not (int8_ok and x.dtype == _INT8)) \
            or (stacked.dtype not in _DTYPES and not int8_ok) or out_dtype not in _DTYPES:
        raise ValueError(f"layer_matmul takes float32 / bfloat16 (or int8 weights with int8 x, "
                         f"or float x of <= {MAX_GEMV_ROWS} rows); got x {x.dtype}, weights "
                         f"{stacked.dtype}, out {out_dtype}")
    gemv_limit = MAX_GEMV_ROWS if gemv_rows < 0 else min(gemv_rows, MAX_GEMV_ROWS)
    if x.dtype in _DTYPES and stacked.dtype in _DTYPES and x.dtype != stacked.dtype \
            and x.shape[0] > gemv_limit:
        raise ValueError(f"layer_matmul: {x.dtype} x with {stacked.dtype} weights takes the "
                         f"GEMV only ({x.shape[0]} rows, gemv_rows={gemv_rows}): cast x")
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((x.shape[0], stacked.shape[out_axis]),
                                                         out_dtype))
    return call(x, stacked, jnp.asarray(layer, jnp.int32).reshape(()),
                gemv_rows=np.int64(gemv_rows), transposed_w=bool(transposed))


def layer_matmul_group(x: jax.Array, stacked: tuple[jax.Array, ...], layer,
                       out_dtype=None, scales: tuple[jax.Array, ...] | None = None
                       ) -> tuple[jax.Array, ...]:
    """(x @ w[layer] for w in stacked): several projections of one x [T, in] in one call of
    the streaming GEMV (T <= 8), one pass through the thread pool for all of them.

    stacked: [L, in, out_i] weights of one dtype (float32, bfloat16, or int8 for W8A16); x
    float32 / bfloat16; results [T, out_i] in ``out_dtype`` (default x's), f32 accumulation:
    each the same numbers as `layer_matmul` with the GEMV. ``scales``: for int8 weights
    quantized group-wise, their float32 [L, in / g, out_i] scales (each group of g input
    rows summed, then scaled: quantization/int8.py); without them the caller applies
    per-column scales."""
    register()
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    stacked = tuple(stacked)
    if x.ndim != 2 or not stacked or any(w.ndim != 3 or w.shape[1] != x.shape[1] for w in stacked):
        raise ValueError(f"layer_matmul_group wants x [T, in] and weights [L, in, out_i]; got "
                         f"{x.shape} and {[w.shape for w in stacked]}")
    if x.shape[0] > MAX_GEMV_ROWS:
        raise ValueError(f"layer_matmul_group is the GEMV: at most {MAX_GEMV_ROWS} rows, got "
                         f"{x.shape[0]}")
    kinds = {w.dtype for w in stacked}
    if x.dtype not in _DTYPES or out_dtype not in _DTYPES or len(kinds) != 1 \
            or not kinds <= {*_DTYPES, _INT8}:
        raise ValueError(f"layer_matmul_group takes float32 / bfloat16 x and results and "
                         f"weights of one dtype (float32, bfloat16, int8); got x {x.dtype}, "
                         f"weights {sorted(str(k) for k in kinds)}, out {out_dtype}")
    group_size = 0
    if scales is not None:
        scales = tuple(jnp.asarray(sc, jnp.float32) for sc in scales)
        n_in = x.shape[1]
        if kinds != {_INT8} or len(scales) != len(stacked) or any(
                sc.ndim != 3 or sc.shape[0] != w.shape[0] or sc.shape[2] != w.shape[2]
                or sc.shape[1] == 0 or n_in % sc.shape[1] for sc, w in zip(scales, stacked)) \
                or len({sc.shape[1] for sc in scales}) != 1:
            raise ValueError(f"layer_matmul_group: group scales go with int8 weights, one "
                             f"[L, in / g, out_i] per weight with one g; got weights "
                             f"{[(w.shape, str(w.dtype)) for w in stacked]}, scales "
                             f"{[sc.shape for sc in scales]}")
        group_size = n_in // scales[0].shape[1]
        if not gemv_takes_groups(n_in, scales[0].shape[1]):
            raise ValueError(f"layer_matmul_group: group size {group_size} must be a multiple "
                             f"of {GEMV_K_BLOCK} (or all {n_in} input rows)")
    call = jax.ffi.ffi_call(GROUP_TARGET, tuple(
        jax.ShapeDtypeStruct((x.shape[0], w.shape[2]), out_dtype) for w in stacked))
    return tuple(call(x, jnp.asarray(layer, jnp.int32).reshape(()), *stacked,
                      *(scales or ()), group_size=np.int64(group_size)))


def gguf_matmul(x: jax.Array, packed: tuple[jax.Array, ...], layer, fmt: str
                ) -> tuple[jax.Array, ...]:
    """(x @ W[layer]^T for W in packed): GGUF blocks read in place (gemv_gguf.h).

    packed: uint8 [L, out_i, in / block * bytes_per_block] weights of one format (``fmt``:
    q8_0, q4_0, q4_1 of 32-weight blocks, quantization/gguf_packed.py's layout; q4_k, q5_k,
    q6_k of 256-weight super-blocks), x [T, in] float32 (any T; in a
    multiple of 32), results float32 [T, out_i]. x is quantized to 8 bits per 32-block
    inside the call (llama.cpp's vec_dot does the same): the products differ from the
    dequantized weights' float ones by that rounding (tests/test_gguf_kernels.py bounds it)."""
    register()
    packed = tuple(packed)
    if fmt not in GGUF_FORMAT_CODES:
        raise ValueError(f"gguf_matmul: format {fmt!r} is not one of {sorted(GGUF_FORMAT_CODES)}")
    if x.ndim != 2 or x.shape[1] % GGUF_BLOCK_WEIGHTS[fmt] or not packed or any(
            w.ndim != 3 or w.dtype != jnp.uint8 for w in packed):
        raise ValueError(f"gguf_matmul wants x [T, in] (in a multiple of "
                         f"{GGUF_BLOCK_WEIGHTS[fmt]}) and uint8 weights "
                         f"[L, out_i, bytes]; got {x.shape} and "
                         f"{[(w.shape, str(w.dtype)) for w in packed]}")
    call = jax.ffi.ffi_call(GGUF_TARGET, tuple(
        jax.ShapeDtypeStruct((x.shape[0], w.shape[1]), jnp.float32) for w in packed))
    return tuple(call(x.astype(jnp.float32), jnp.asarray(layer, jnp.int32).reshape(()), *packed,
                      fmt=np.int64(GGUF_FORMAT_CODES[fmt])))


def onednn_isa() -> int:
    """oneDNN's effective ISA enum for this CPU (for the startup log)."""
    handle = ctypes.CDLL(str(register()))
    return int(handle.jaxserve_onednn_isa())


def gguf_isa() -> str:
    """The instruction set the GGUF block kernels were compiled for here (avx512vnni, avx2,
    scalar)."""
    handle = ctypes.CDLL(str(register()))
    handle.jaxserve_gguf_isa.restype = ctypes.c_char_p
    return handle.jaxserve_gguf_isa().decode()


def onednn_native_bf16() -> bool:
    """Whether oneDNN has a bf16 matmul kernel on this CPU (AVX-512 and up)."""
    handle = ctypes.CDLL(str(register()))
    return bool(handle.jaxserve_onednn_bf16())
