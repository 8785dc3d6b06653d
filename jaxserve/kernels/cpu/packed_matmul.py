"""Weights prepacked once into oneDNN's blocked layout, and the matmul that reads them in
place (onednn_packed.cc).

    packed = pack_stacked(w)               # host [L, in, out] bf16 -> uint8 [L, bytes], or None
    y = packed_layer_matmul(x, packed, layer, out)    # x [T, in] -> y [T, out] float32

The layout is this CPU's (oneDNN picks it from the matrix units) and this process's thread
count's (one column range per worker of XLA's intra-op pool), so packing happens where the
model is served, after loading, and packed arrays are never saved (engine/weight_packing.py).
"""

from __future__ import annotations

import ctypes
import functools
import os
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.kernels.cpu.matmul import PACKED_TARGET, register

_DTYPES = {jnp.dtype(jnp.bfloat16): 1, jnp.dtype(jnp.float32): 0}


PARTS_PER_WORKER = 2


def packing_parts() -> int:
    """Column ranges a projection is packed in: two per CPU this process may run on (XLA's
    intra-op pool has a worker per CPU). The call's workers take ranges as they come free, so
    a worker the OS wakes late costs less of a step with two each than with one: SmolLM2's
    seven bf16 projections at 16 rows took 0.38 ms per layer in 4 ranges, 0.41 in 2, 0.46 in
    1 and 0.43 in 8 on 2 cores (0.81 / 0.86 / 1.16 / 0.83 at 64 rows; the plain call: 0.56
    and 0.98)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:       # not Linux
        cpus = os.cpu_count() or 1
    return PARTS_PER_WORKER * max(1, cpus)


@functools.lru_cache(maxsize=1)
def _library() -> ctypes.CDLL:
    lib = ctypes.CDLL(str(register()))
    lib.jaxserve_onednn_packed_bytes.restype = ctypes.c_int64
    lib.jaxserve_onednn_packed_bytes.argtypes = [ctypes.c_int64] * 3 + [ctypes.c_int32]
    lib.jaxserve_onednn_pack.restype = ctypes.c_int32
    lib.jaxserve_onednn_pack.argtypes = [ctypes.c_void_p] + [ctypes.c_int64] * 4 + [
        ctypes.c_int32, ctypes.c_int32, ctypes.c_void_p]
    return lib


def packed_bytes(n_in: int, n_out: int, dtype, parts: int | None = None) -> int:
    """Bytes one layer of [n_in, n_out] weights packs into here; 0 where oneDNN would read
    them plain (no blocked kernel for this dtype on this CPU: nothing to gain)."""
    code = _DTYPES.get(jnp.dtype(dtype))
    if code is None:
        return 0
    found = int(_library().jaxserve_onednn_packed_bytes(n_in, n_out, parts or packing_parts(),
                                                       code))
    if found < 0:
        raise RuntimeError(f"oneDNN could not lay out [{n_in}, {n_out}] {jnp.dtype(dtype)} "
                           f"weights for packing")
    return found


def pack_stacked(weights: np.ndarray, parts: int | None = None,
                 transposed: bool = False) -> np.ndarray | None:
    """Host weights [L, in, out] (``transposed``: [L, out, in], a tied embedding table as
    [1, V, H]; bfloat16 / float32) packed, uint8 [L, bytes]; None where `packed_bytes` says
    packing buys nothing here."""
    if weights.ndim != 3:
        raise ValueError(f"pack_stacked wants [L, in, out] weights; got {weights.shape}")
    layers, n_in, n_out = weights.shape
    if transposed:
        n_in, n_out = n_out, n_in
    if packed_bytes(n_in, n_out, weights.dtype, parts) == 0:
        return None
    return pack_layers(weights.__getitem__, layers, n_in, n_out, weights.dtype, parts,
                       transposed)


def pack_layers(layer: Callable[[int], np.ndarray], count: int, n_in: int, n_out: int,
                dtype, parts: int | None = None, transposed: bool = False) -> np.ndarray:
    """Host weights given a layer at a time (``layer(i)``: [in, out] of ``dtype``;
    ``transposed``: [out, in]) packed, uint8 [count, bytes]: no whole stack in one array is
    needed (a fused sibling group, concatenated one layer at a time)."""
    parts = parts or packing_parts()
    size = packed_bytes(n_in, n_out, dtype, parts)
    if size == 0:
        raise RuntimeError(f"[{n_in}, {n_out}] {jnp.dtype(dtype)} weights do not pack here")
    shape = (n_out, n_in) if transposed else (n_in, n_out)
    dst = np.zeros((count, size), np.uint8)      # zeros: the alignment gaps are defined
    for i in range(count):
        src = np.ascontiguousarray(layer(i))
        if src.shape != shape or src.dtype != jnp.dtype(dtype):
            raise ValueError(f"pack_layers: layer {i} is {src.shape} {src.dtype}, not "
                             f"{list(shape)} {jnp.dtype(dtype)}")
        if _library().jaxserve_onednn_pack(src.ctypes.data, 1, n_in, n_out, parts,
                                           _DTYPES[jnp.dtype(dtype)], int(transposed),
                                           dst[i].ctypes.data):
            raise RuntimeError(f"oneDNN failed to pack [{n_in}, {n_out}] {dtype} weights")
    return dst


def packed_layer_matmul(x: jax.Array, packed: jax.Array, layer, n_out: int,
                        dtype, parts: int | None = None) -> jax.Array:
    """x [T, in] @ W[layer] -> [T, n_out] float32, W packed by `pack_stacked` from
    [L, in, n_out] weights of ``dtype`` (x is cast to it); f32 accumulation, any T."""
    register()
    if x.ndim != 2 or packed.ndim != 2 or packed.dtype != jnp.uint8:
        raise ValueError(f"packed_layer_matmul wants x [T, in] and packed uint8 [L, bytes]; "
                         f"got {x.shape} and {packed.shape} {packed.dtype}")
    call = jax.ffi.ffi_call(PACKED_TARGET, jax.ShapeDtypeStruct((x.shape[0], n_out),
                                                                jnp.float32))
    return call(x.astype(dtype), packed, jnp.asarray(layer, jnp.int32).reshape(()),
                parts=np.int64(parts or packing_parts()))
