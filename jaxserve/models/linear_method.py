"""The numeric formats of a `Linear` layer (vLLM's LinearBase + quant_method): one layer
class (layers.Linear: bias, LoRA), the format an object with ``apply(layer, x)``.

A format is chosen by the parameter leaves the layer holds (what the loaders and
jaxserve/quantization wrote): the first registered method whose ``matches(params)`` is true,
else `DenseMethod` (a float kernel; also what init creates). A new format (AWQ / GPTQ int4,
...) is a class with ``name``, ``matches`` and ``apply`` passed to `register_linear_method`;
nothing else changes.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Protocol

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxserve.models.layer_matmul import (
    IN_PLACE_DTYPES,
    MAX_ROWS,
    GemvOperand,
    gemv_rows_limit,
    grouped_gemv,
    int8_layer_matmul,
    layer_matmul,
    stacked_kernel,
    stacked_params,
)
from jaxserve.quantization.awq_gptq import LEAVES as AWQ_GPTQ_LEAVES
from jaxserve.quantization.awq_gptq import packed_int_matmul
from jaxserve.quantization.gguf_packed import (
    GGUF_BLOCK_ROWS,
    WEIGHTS_PER_BLOCK,
    packed_format_of,
    packed_matmul,
)


class LinearMethod(Protocol):
    name: str

    def matches(self, params: Mapping[str, Any]) -> bool:
        """Whether a layer holding these parameter leaves (name -> array) is in this format."""

    def apply(self, layer: nn.Module, x: jax.Array) -> jax.Array:
        """x [..., in] -> [..., layer.features] in layer.dtype, without bias or LoRA (the layer
        adds those); reads its leaves with ``layer.get_variable("params", name)``."""


def _int8_units() -> bool:
    """Whether this CPU multiplies int8 in hardware (VNNI / AMX-INT8): W8A8 above 8 rows."""
    from jaxserve.kernels.cpu.matmul import current_matrix_units

    return current_matrix_units().int8


def _dot(x: jax.Array, w: jax.Array) -> jax.Array:
    return jax.lax.dot_general(x, w, (((x.ndim - 1,), (0,)), ((), ())))


class DenseMethod:
    """kernel [in, out] float: nn.Dense bit for bit; on CPU under the layer scan, the stacked
    weights read in place by the oneDNN library (models/layer_matmul.py)."""
    name = "dense"

    def matches(self, params: Mapping[str, Any]) -> bool:
        return True

    def apply(self, layer: nn.Module, x: jax.Array) -> jax.Array:
        kernel = layer.param("kernel", nn.initializers.lecun_normal(),
                             (x.shape[-1], layer.features), layer.dtype)
        stacked = stacked_kernel(layer.in_place) if x.ndim == 2 \
            and x.shape[0] <= MAX_ROWS and kernel.dtype in IN_PLACE_DTYPES else None
        # Accumulated and returned in float32 at every compute dtype: a bf16 layer's outputs
        # feed the f32 residual stream and the f32 RoPE / activation math unrounded (each
        # consumer rounds once, where it needs bf16 again). SmolLM2 bf16 vs float32 with the
        # f32 residual and logits: KL 1.4e-3 with bf16 outputs, 9.0e-4 with these.
        if stacked is not None:   # CPU, <= MAX_ROWS rows: this layer's weights in place
            return layer_matmul(x, *stacked, jnp.float32, layer.in_place.gemv_rows)
        return float32_accumulating_dot(x.astype(layer.dtype), kernel)

    def gemv_operand(self, layer: nn.Module, x: jax.Array) -> GemvOperand | None:
        """This layer's weights for a grouped GEMV, where `apply` would take the GEMV."""
        if x.ndim != 2 or x.shape[0] > gemv_rows_limit(layer.in_place):
            return None
        stacked = stacked_kernel(layer.in_place)
        return GemvOperand(*stacked) if stacked is not None else None


def float32_accumulating_dot(x: jax.Array, kernel: jax.Array) -> jax.Array:
    """x [..., in] @ kernel [in, out] -> [..., out] float32, inputs in their own dtype.

    One row of bf16/f16 runs as two (a zero row added, its result dropped): XLA makes a
    one-row dot with a wider output a matrix-vector product and converts the whole kernel to
    float32 for it, every call -- on the H200 target every decode step of batch 1 wrote and
    read each layer's weights as f32 (tests/test_gpu_compile.py), on XLA:CPU it was 3.7x
    slower than two rows (SmolLM2's 576 x 1536 bf16). Float32 kernels keep one row (no
    conversion; XLA:CPU's one-row GEMV beats its two-row path)."""
    dims = (((x.ndim - 1,), (0,)), ((), ()))
    if math.prod(x.shape[:-1]) != 1 or kernel.dtype == jnp.float32:
        return jax.lax.dot_general(x, kernel, dims, preferred_element_type=jnp.float32)
    row = x.reshape(1, x.shape[-1])
    out = jax.lax.dot_general(jnp.concatenate([row, jnp.zeros_like(row)]), kernel,
                              (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
    return out[:1].reshape(*x.shape[:-1], kernel.shape[-1])


PACKED_LEAF = "packed_kernel"     # engine/weight_packing.py
PACKED_HEAD_LEAF = "packed_head"   # a GGUF table's float copy, packed (layers.Embedding)


def holds_packed_weights(params: Any) -> bool:
    """Whether a params tree (arrays or ShapeDtypeStructs) holds weights packed for oneDNN."""
    layers = params.get("params", {}).get("layers", {}) if isinstance(params, Mapping) else {}
    return any(isinstance(leaves, Mapping) and PACKED_LEAF in leaves
               for leaves in layers.values())


def packed_product(layer: nn.Module, x: jax.Array) -> jax.Array:
    """x [..., in] @ the layer's weights packed for oneDNN (``packed_kernel`` uint8
    [L, bytes], kernels/cpu/packed_matmul.py) -> [..., layer.features] float32. Under the
    CPU's layer scan the stack is read in place at the layer; a step without in-place
    weights (more rows than the plan's library rows) reads its layer's own slice."""
    from jaxserve.kernels.cpu.packed_matmul import packed_layer_matmul

    found = stacked_params(layer.in_place)
    if found is not None and found[0].get(PACKED_LEAF) is not None:
        packed, index = found[0][PACKED_LEAF], found[1]
    else:
        packed, index = layer.get_variable("params", PACKED_LEAF), 0
        packed = packed[None] if packed.ndim == 1 else packed
    rows = x.reshape(-1, x.shape[-1])
    y = packed_layer_matmul(rows, packed, index, layer.features, layer.dtype)
    return y.reshape(*x.shape[:-1], layer.features)


class PackedDenseMethod:
    """A float kernel packed at startup into oneDNN's blocked layout (``packed_kernel``,
    engine/weight_packing.py): read in place by the library at every row count, float32
    out as `DenseMethod`."""
    name = "onednn-packed"

    def matches(self, params: Mapping[str, Any]) -> bool:
        return PACKED_LEAF in params and packed_format_of(params) is None

    def apply(self, layer: nn.Module, x: jax.Array) -> jax.Array:
        return packed_product(layer, x)


class Int8PerChannelMethod:
    """kernel [in, out] int8 + scale [out]: (x @ kernel) * scale. On CPU under the layer
    scan, the int8 weights read in place by the library: W8A16 up to 8 rows, W8A8 with
    per-token activation scales on the int8 units (models/layer_matmul.int8_layer_matmul)."""
    name = "int8"

    def matches(self, params: Mapping[str, Any]) -> bool:
        return "scale" in params and "kernel" in params \
            and params["scale"].ndim < params["kernel"].ndim

    def apply(self, layer: nn.Module, x: jax.Array) -> jax.Array:
        kernel = layer.get_variable("params", "kernel")
        scale = layer.get_variable("params", "scale").astype(layer.dtype)
        found = stacked_params(layer.in_place) if x.ndim == 2 and x.shape[0] <= MAX_ROWS \
            else None
        if found is not None and found[0]["kernel"].ndim == 3:
            y = int8_layer_matmul(x, found[0]["kernel"], found[0]["scale"], found[1],
                                  layer.dtype, _int8_units())
            if y is not None:
                return y
        return _dot(x.astype(layer.dtype), kernel.astype(layer.dtype)) * scale

    def gemv_operand(self, layer: nn.Module, x: jax.Array) -> GemvOperand | None:
        """This layer's int8 weights and scales for a grouped GEMV (W8A16: at most 8 rows)."""
        from jaxserve.kernels.cpu.matmul import MAX_GEMV_ROWS

        found = stacked_params(layer.in_place) if x.ndim == 2 \
            and x.shape[0] <= MAX_GEMV_ROWS else None
        if found is None or found[0]["kernel"].ndim != 3:
            return None
        return GemvOperand(found[0]["kernel"], found[1], found[0]["scale"], layer.dtype)


class Int8GroupedMethod:
    """kernel [in, out] int8 + scale [in / g, out] (w8a16 group-wise): x @ (kernel * scale),
    dequantized in the jit (one fused convert-and-scale pass feeding the dot)."""
    name = "int8-grouped"

    def matches(self, params: Mapping[str, Any]) -> bool:
        return "scale" in params and "kernel" in params \
            and params["scale"].ndim == params["kernel"].ndim

    def apply(self, layer: nn.Module, x: jax.Array) -> jax.Array:
        kernel = layer.get_variable("params", "kernel")
        scale = layer.get_variable("params", "scale").astype(layer.dtype)
        operand = self.gemv_operand(layer, x)
        if operand is not None:   # CPU decode rows: the int8 weights streamed in place
            return grouped_gemv(x, [operand], min_operands=1)[0]
        n_in, n_out = kernel.shape
        w = kernel.astype(layer.dtype).reshape(scale.shape[0], -1, n_out)
        w = (w * scale[:, None, :]).reshape(n_in, n_out)
        return _dot(x.astype(layer.dtype), w)

    def gemv_operand(self, layer: nn.Module, x: jax.Array) -> GemvOperand | None:
        """This layer's int8 weights and group scales for the library's GEMV (W8A16 at most
        8 rows, the groups summed and scaled inside it), under the CPU's stacked layer scan;
        None where the group length does not fit its row blocks (a multiple of 8, or one
        group per column)."""
        from jaxserve.kernels.cpu.matmul import MAX_GEMV_ROWS, gemv_takes_groups

        found = stacked_params(layer.in_place) if x.ndim == 2 \
            and x.shape[0] <= MAX_GEMV_ROWS else None
        if found is None or found[0]["kernel"].ndim != 3 or found[0]["scale"].ndim != 3:
            return None
        if not gemv_takes_groups(found[0]["kernel"].shape[1], found[0]["scale"].shape[1]):
            return None
        return GemvOperand(found[0]["kernel"], found[1], out_dtype=layer.dtype,
                           group_scale=found[0]["scale"])


class GGUFPackedMethod:
    """q8_0 / q4_0 / q4_1 / q4_k / q5_k / q6_k uint8 [out, packed] GGUF blocks. On CPU under
    the stacked layer scan (steps of at most MAX_ROWS rows) the library's block kernel reads
    them in place, x quantized to 8 bits per block as llama.cpp does
    (kernels/cpu/gemv_gguf.h), products in float32; elsewhere XLA dequantizes the tensor
    inside the jit. A layer that also holds the blocks dequantized (``kernel`` [in, out],
    engine/gguf_packing.py) reads the blocks only at up to GGUF_BLOCK_ROWS rows, and the
    float copy (`DenseMethod`: oneDNN on the matrix units) above them."""
    name = "gguf"

    def matches(self, params: Mapping[str, Any]) -> bool:
        return packed_format_of(params) is not None

    def apply(self, layer: nn.Module, x: jax.Array) -> jax.Array:
        operand = self.gemv_operand(layer, x)
        if operand is not None:
            return grouped_gemv(x, [operand], min_operands=1)[0]
        if PACKED_LEAF in layer.variables.get("params", {}):
            return packed_product(layer, x)
        if "kernel" in layer.variables.get("params", {}):
            return _DENSE.apply(layer, x)
        fmt = packed_format_of(layer.variables.get("params", {}))
        return packed_matmul(x, layer.get_variable("params", fmt), fmt, layer.dtype)

    def gemv_operand(self, layer: nn.Module, x: jax.Array) -> GemvOperand | None:
        """This layer's stacked blocks for the library's GGUF kernel (grouped with its
        siblings: q/k/v, gate/up), under the CPU's stacked layer scan; else None."""
        params = layer.variables.get("params", {})
        fmt = packed_format_of(params)
        limit = GGUF_BLOCK_ROWS if "kernel" in params or PACKED_LEAF in params else MAX_ROWS
        found = stacked_params(layer.in_place) if x.ndim == 2 \
            and x.shape[0] <= limit and x.shape[-1] % WEIGHTS_PER_BLOCK[fmt] == 0 else None
        if found is None or found[0].get(fmt) is None or found[0][fmt].ndim != 3:
            return None
        return GemvOperand(found[0][fmt], found[1], out_dtype=jnp.float32, gguf_format=fmt)


class AwqGptqMethod:
    """qweight int32 [in/p, out] + scales, zeros (+ g_idx): AWQ / GPTQ int4, dequantized in
    the jit (jaxserve/quantization/awq_gptq.py)."""
    name = "awq-gptq"

    def matches(self, params: Mapping[str, Any]) -> bool:
        return "qweight" in params

    def apply(self, layer: nn.Module, x: jax.Array) -> jax.Array:
        names = layer.variables.get("params", {})
        return packed_int_matmul(x, {leaf: layer.get_variable("params", leaf)
                                     for leaf in AWQ_GPTQ_LEAVES if leaf in names}, layer.dtype)


_METHODS: list[Any] = [GGUFPackedMethod(), PackedDenseMethod(), AwqGptqMethod(),
                       Int8GroupedMethod(), Int8PerChannelMethod()]
_DENSE = DenseMethod()


def register_linear_method(method: Any) -> None:
    """Add a format; it is tried before the built-in ones (so it may claim leaf names they
    would also match)."""
    if any(m.name == method.name for m in _METHODS):
        raise ValueError(f"a linear method named {method.name!r} is registered already")
    _METHODS.insert(0, method)


def linear_method_for(params: Mapping[str, Any]) -> Any:
    """The method of a layer holding these parameter leaves (DenseMethod when none claims)."""
    for method in _METHODS:
        if method.matches(params):
            return method
    return _DENSE


__all__ = ["LinearMethod", "DenseMethod", "PackedDenseMethod", "AwqGptqMethod",
           "Int8PerChannelMethod", "Int8GroupedMethod", "GGUFPackedMethod",
           "register_linear_method", "linear_method_for"]
