"""Projections that read one layer's weights in place (CPU, float32 / bfloat16 / int8 / GGUF).

Under the scanned layer loop (models/execution_plan.LayerLoop.SCANNED) the weights are stacked
``[L, in, out]``, so each step XLA slices layer ``l``'s weights for its dot -- and on XLA:CPU
that slice is a copy: every layer's weights are copied in every step, on top of the dot
reading them (in bf16 the scan ran 6x slower than the same dots on per-layer buffers). With
the plan's ``cpu_matmul``, a `Linear` in a step of at most ``max_library_rows`` rows calls the
matmul library (jaxserve/kernels/cpu/matmul.py: oneDNN on the CPU's matrix units where it has
them, or at the few rows where the engine measured it faster, the streaming GEMV) on the
stacked weights and the layer index instead; the slice is then unused and XLA drops it.

How a projection gets there is explicit: `CausalLM` hands the layer loop a `LayerWeights`
(the stacked tree, or under LayerLoop.PER_LAYER the layer's own buffers as a stack of one),
the layer body names its layer (`LayerWeights.at`), and each `Linear` is built with its own
leaves (`LayerWeights.projection`). Anything else -- tensor parallelism, other platforms (the
GPU/TPU lowering never sees the call) -- has no `LayerWeights` and keeps XLA's dot.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Mapping

import jax
import jax.numpy as jnp

from jaxserve.models.execution_plan import MAX_LIBRARY_ROWS

MAX_ROWS = MAX_LIBRARY_ROWS    # steps of at most this many tokens take the library
IN_PLACE_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class ProjectionWeights:
    """One `Linear`'s leaves stacked [L, ...] (name -> array), read in place at ``layer``."""
    leaves: Mapping[str, Any]
    layer: Any                                     # int32 scalar (traced under the scan) or 0
    gemv_rows: int = field(default=0, metadata=dict(static=True))


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class LayerWeights:
    """The layer weights a layer loop reads in place: ``tree`` is params["layers"] ([L, ...]
    leaves) under the scan, or one layer's own buffers as a stack of one (`single`)."""
    tree: Mapping[str, Any]
    layer: Any = None                              # None: the layer body names it (`at`)
    gemv_rows: int = field(default=0, metadata=dict(static=True))

    @classmethod
    def single(cls, tree: Mapping[str, Any], gemv_rows: int) -> "LayerWeights":
        """One layer's own buffers ([in, out] leaves), each seen as [1, in, out] (a bitcast,
        no copy), at layer 0."""
        return cls(jax.tree.map(lambda w: w[None], tree), 0, gemv_rows)

    def at(self, layer: Any) -> "LayerWeights":
        """The weights of the layer the body runs (its index in the stack, unless fixed)."""
        return self if self.layer is not None else replace(self, layer=layer)

    def projection(self, name: str) -> ProjectionWeights | None:
        """The leaves of the layer's projection ``name`` (a flat key of the layer's tree)."""
        leaves = self.tree.get(name)
        if self.layer is None or not isinstance(leaves, Mapping):
            return None
        return ProjectionWeights(leaves, self.layer, self.gemv_rows)


def stacked_params(weights: ProjectionWeights | None) -> tuple[Any, Any] | None:
    """(the stacked [L, ...] leaves of a `Linear` built with ``weights``, layer index), or
    None for a `Linear` that reads no weights in place."""
    return None if weights is None else (weights.leaves, weights.layer)


def stacked_kernel(weights: ProjectionWeights | None) -> tuple[jax.Array, Any] | None:
    """(stacked float kernel [L, in, out], layer index) of a `Linear` built with ``weights``
    (see `stacked_params`); else None."""
    found = stacked_params(weights)
    kernel = found[0].get("kernel") if found is not None else None
    if kernel is None or kernel.ndim != 3 or kernel.dtype not in IN_PLACE_DTYPES:
        return None
    return kernel, found[1]


def gemv_rows_limit(weights: ProjectionWeights | None) -> int:
    """Up to how many rows float projections built with ``weights`` take the streaming GEMV
    (0 for one that reads no weights in place)."""
    return 0 if weights is None else weights.gemv_rows


def layer_matmul(x: jax.Array, stacked: jax.Array, layer: Any, out_dtype: Any,
                 gemv_rows: int = 0) -> jax.Array:
    """x [T, in] @ stacked[layer] ([L, in, out]) -> [T, out] in out_dtype (f32 accumulation);
    at most ``gemv_rows`` rows through the streaming GEMV, more through oneDNN."""
    from jaxserve.kernels.cpu.matmul import layer_matmul as library_matmul

    return library_matmul(x.astype(stacked.dtype), stacked, layer, out_dtype,
                          gemv_rows=gemv_rows)


@dataclass(frozen=True)
class GemvOperand:
    """One projection's share of a grouped GEMV (`grouped_gemv`): its stacked weights read in
    place, the layer, and for int8 weights (W8A16) either the stacked per-column scales
    (``scale``, applied to the product) or the group-wise ones (``group_scale`` [L, in / g,
    out], applied per group inside the GEMV), and the dtype the scaled result takes."""
    weights: jax.Array             # [L, in, out] float32 / bfloat16 / int8
    layer: Any
    scale: jax.Array | None = None
    out_dtype: Any = jnp.float32
    group_scale: jax.Array | None = None
    gguf_format: str | None = None  # weights: GGUF blocks uint8 [L, out, bytes] (gemv_gguf.h)


def grouped_gemv(x: jax.Array, operands: list[GemvOperand], *,
                 min_operands: int = 2) -> list[jax.Array] | None:
    """Several projections of one x [T, in] in one library call (q/k/v, gate/up: one pass
    through the thread pool instead of one each; jaxserve/kernels/cpu/matmul.py), each the
    same numbers its own call gives; None when they do not share a weight format and a layer
    (the caller then projects one at a time). ``min_operands=1``: one projection alone (an
    int8 group-wise layer's own GEMV)."""
    from jaxserve.kernels.cpu.matmul import MAX_GEMV_ROWS, gguf_matmul, layer_matmul_group

    kinds = {(op.weights.dtype, op.group_scale is None, op.gguf_format,
              None if op.group_scale is None else op.group_scale.shape[1]) for op in operands}
    gguf = operands[0].gguf_format if operands else None
    if len(operands) < min_operands or len(kinds) != 1 or x.ndim != 2 \
            or x.shape[0] > (MAX_ROWS if gguf else MAX_GEMV_ROWS) \
            or any(op.layer is not operands[0].layer for op in operands):
        return None
    if gguf is not None:   # GGUF blocks: any row count the layer scan reads in place
        ys = gguf_matmul(x, tuple(op.weights for op in operands), operands[0].layer, gguf)
        return [y.astype(op.out_dtype) for op, y in zip(operands, ys)]
    int8 = operands[0].weights.dtype == jnp.dtype(jnp.int8)
    grouped = operands[0].group_scale is not None
    ys = layer_matmul_group(x.astype(jnp.float32 if int8 else operands[0].weights.dtype),
                            tuple(op.weights for op in operands), operands[0].layer,
                            jnp.float32,
                            scales=tuple(op.group_scale for op in operands) if grouped else None)
    out = []
    for op, y in zip(operands, ys):
        if op.scale is not None:
            w_scale = jax.lax.dynamic_index_in_dim(op.scale, op.layer, 0, keepdims=False)
            y = y * w_scale.astype(jnp.float32)
        out.append(y.astype(op.out_dtype))
    return out


def int8_layer_matmul(x: jax.Array, stacked: jax.Array, scale: jax.Array, layer: Any,
                      out_dtype: Any, int8_units: bool) -> jax.Array | None:
    """x [T, in] @ (stacked[layer] [in, out] int8 * scale[layer] [out]), in place, or None
    where the library has no fast path (the caller keeps XLA's dot):
      T <= 8            W8A16: f32 GEMV over the int8 weights (a quarter of f32's bytes);
      T > 8, int8 units W8A8: x quantized per token (absmax / 127), int8 x int8 on VNNI /
                        AMX-INT8 (without them oneDNN's int8 path saturates 16-bit pairs)."""
    from jaxserve.kernels.cpu.matmul import MAX_GEMV_ROWS
    from jaxserve.kernels.cpu.matmul import layer_matmul as library_matmul

    w_scale = jax.lax.dynamic_index_in_dim(scale, layer, 0, keepdims=False).astype(jnp.float32)
    if x.shape[0] <= MAX_GEMV_ROWS:
        y = library_matmul(x.astype(jnp.float32), stacked, layer, jnp.float32)
        return (y * w_scale).astype(out_dtype)
    if not int8_units:
        return None
    xf = x.astype(jnp.float32)
    x_scale = jnp.maximum(jnp.max(jnp.abs(xf), axis=-1, keepdims=True), 1e-12) / 127.0
    xq = jnp.clip(jnp.round(xf / x_scale), -127, 127).astype(jnp.int8)
    y = library_matmul(xq, stacked, layer, jnp.float32, gemv_rows=0)
    return (y * x_scale * w_scale).astype(out_dtype)


SMALL_LOGITS_MAX_ROWS = 512    # logits rows that take the library (a step's sampled rows)


def small_logits(x: jax.Array, table: jax.Array, gemv_rows: int = 0) -> jax.Array:
    """x [T, H] @ table[V, H]^T (a tied embedding, f32 or bf16) -> [T, V] float32, read in
    place. At most ``gemv_rows`` rows: the library's transposed GEMV, x taken in float32 (a
    bf16 table's logits as precise as f32 rows allow, at the table's read time); more: oneDNN
    on x in the table's dtype (XLA:CPU hands this dot at 2..8 rows to XNNPACK, ~5x slower
    than its one-row GEMV on SmolLM2's table, and a speculative verify step's logits are
    k + 1 rows)."""
    from jaxserve.kernels.cpu.matmul import layer_matmul as library_matmul

    if x.ndim != 2 or table.ndim != 2 or x.shape[1] != table.shape[1]:
        raise ValueError(f"small_logits wants x [T, H] and a table [V, H]; got {x.shape} and "
                         f"{table.shape}")
    if x.shape[0] <= gemv_rows:
        return library_matmul(x.astype(jnp.float32), table[None], 0, jnp.float32,
                              transposed=True, gemv_rows=gemv_rows)
    return library_matmul(x.astype(table.dtype), table[None], 0, jnp.float32, transposed=True,
                          gemv_rows=0)
