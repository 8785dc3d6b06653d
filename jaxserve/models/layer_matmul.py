"""Small-batch projections that read one layer of the stacked weights in place (CPU).

The layers run under a scan over weights stacked ``[L, in, out]``, so each step XLA slices
layer ``l``'s weights for its dot -- and on XLA:CPU that slice is a copy: every layer's
weights are copied in every step. With a few rows (a decode step of one or a few
sequences) the matmuls only stream the weights once, so the copy more than doubles their
memory traffic (measured on SmolLM2's shapes: the scan at batch 1 costs ~1.6x the same
matmuls on per-layer buffers). Here a plain float32 `Linear` with at most ``MAX_ROWS``
rows calls the C++ kernel `jaxserve_layer_matmul` (jaxserve/attention/cpu) on the stacked
weights and the layer index instead; the slice is then unused and XLA drops it.

`CausalLM` turns it on around its layer scan (``stacked_layer_weights``) when it was built
with ``small_batch_layer_matmul`` (the runner does so with the CPU attention backend on one
device); the layer body names its layer (``current_layer``); `Linear` asks
``stacked_kernel(path)``. Anything else -- more rows, quantized or bf16 weights, tensor
parallelism, other platforms -- keeps XLA's dot.
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass, replace
from typing import Any

import jax
import jax.numpy as jnp

MAX_ROWS = 8      # the kernel's row limit (each weight row updates every row's accumulator)


@dataclass(frozen=True)
class _Stacked:
    tree: Any                  # params["layers"]: the stacked [L, ...] layer weights
    layer: Any = None          # the layer being traced (an int32 scalar), None outside one


_STATE: contextvars.ContextVar[_Stacked | None] = contextvars.ContextVar(
    "jaxserve_stacked_layer_weights", default=None)


@contextlib.contextmanager
def stacked_layer_weights(tree: Any):
    """While tracing the layer scan: the stacked weights the layers may read in place."""
    token = _STATE.set(_Stacked(tree))
    try:
        yield
    finally:
        _STATE.reset(token)


@contextlib.contextmanager
def current_layer(layer: Any):
    """While tracing one layer's body: its index (a no-op outside `stacked_layer_weights`)."""
    state = _STATE.get()
    if state is None:
        yield
        return
    token = _STATE.set(replace(state, layer=layer))
    try:
        yield
    finally:
        _STATE.reset(token)


def stacked_kernel(path: tuple[str, ...]) -> tuple[jax.Array, Any] | None:
    """(stacked kernel [L, in, out], layer index) for the `Linear` at module ``path``, when the
    layer scan is being traced with stacked weights on; else None."""
    state = _STATE.get()
    if state is None or state.layer is None or "layers" not in path:
        return None
    node = state.tree
    for name in path[path.index("layers") + 1:]:
        if not hasattr(node, "get") or node.get(name) is None:
            return None
        node = node[name]
    kernel = node.get("kernel") if hasattr(node, "get") else None
    if kernel is None or kernel.ndim != 3 or kernel.dtype != jnp.float32:
        return None
    return kernel, state.layer


def layer_matmul(x: jax.Array, stacked: jax.Array, layer: Any) -> jax.Array:
    """x [T, in] @ stacked[layer] ([L, in, out] float32) -> [T, out] float32, T <= MAX_ROWS."""
    from jaxserve.attention.cpu.loader import LAYER_MATMUL_TARGET, register

    register()
    if x.ndim != 2 or x.shape[0] > MAX_ROWS or stacked.ndim != 3 or x.shape[1] != stacked.shape[1]:
        raise ValueError(f"layer_matmul wants x [T <= {MAX_ROWS}, in] and weights [L, in, out]; "
                         f"got {x.shape} and {stacked.shape}")
    call = jax.ffi.ffi_call(LAYER_MATMUL_TARGET,
                            jax.ShapeDtypeStruct((x.shape[0], stacked.shape[2]), jnp.float32))
    return call(x.astype(jnp.float32), stacked, jnp.asarray(layer, jnp.int32).reshape(()))


def small_logits(x: jax.Array, table: jax.Array) -> jax.Array:
    """x [T, H] @ table[V, H]^T ([V, H] float32, a tied embedding) -> [T, V], T <= MAX_ROWS.

    The C++ kernel `jaxserve_small_logits`: XLA:CPU hands this dot at 2..8 rows to XNNPACK,
    ~5x slower than its one-row GEMV on SmolLM2's table, and a speculative verify step's
    logits are k + 1 rows."""
    from jaxserve.attention.cpu.loader import SMALL_LOGITS_TARGET, register

    register()
    if x.ndim != 2 or x.shape[0] > MAX_ROWS or table.ndim != 2 or x.shape[1] != table.shape[1]:
        raise ValueError(f"small_logits wants x [T <= {MAX_ROWS}, H] and a table [V, H]; "
                         f"got {x.shape} and {table.shape}")
    call = jax.ffi.ffi_call(SMALL_LOGITS_TARGET,
                            jax.ShapeDtypeStruct((x.shape[0], table.shape[0]), jnp.float32))
    return call(x.astype(jnp.float32), table)
