"""Projections that read one layer of the stacked weights in place (CPU, float32).

The layers run under a scan over weights stacked ``[L, in, out]``, so each step XLA slices
layer ``l``'s weights for its dot -- and on XLA:CPU that slice is a copy: every layer's
weights are copied in every step, on top of the dot reading them. Here a plain float32
`Linear` in a step of at most ``MAX_ROWS`` rows calls the C++ kernel `jaxserve_layer_matmul`
(jaxserve/attention/cpu/layer_matmul.cc) on the stacked weights and the layer index
instead; the slice is then unused and XLA drops it. The kernel picks its own algorithm by
row count: up to 8 rows a GEMV that streams the weights once (a decode of a few
sequences: pure memory traffic, where the copy more than doubled the cost), above that a
cache- and register-blocked GEMM (decode batches, prefill chunks).

Measured on SmolLM2-135M's shapes (benchmarks/bench_layer_matmul.py: the seven projections
of 30 layers, 2 shared cores), the kernel in the scan against XLA's dot in the scan: ~0.6x
the time at 1 row, ~0.75-0.85x at 16-128 rows (as fast as or faster than XLA's dot on
per-layer buffers, the no-copy ceiling for XLA), ~0.95x at 256-512. ``MAX_ROWS`` is the
engine's largest default token bucket (512); bigger steps keep XLA's dot, unmeasured.

`CausalLM` turns it on around its layer scan (``stacked_layer_weights``) when it was built
with ``small_batch_layer_matmul`` (the runner does so with the CPU attention backend on one
device) and the step has at most ``MAX_ROWS`` tokens; the layer body names its layer
(``current_layer``); `Linear` asks ``stacked_kernel(path)``. Anything else -- quantized or
bf16 weights, tensor parallelism, other platforms (the GPU/TPU lowering never sees the
kernel) -- keeps XLA's dot.
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass, replace
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

MAX_ROWS = 512    # steps of at most this many tokens take the kernel (see above)


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


def layer_matmul(x: jax.Array, stacked: jax.Array, layer: Any, gemv_rows: int = -1) -> jax.Array:
    """x [T, in] @ stacked[layer] ([L, in, out] float32) -> [T, out] float32, any T.

    ``gemv_rows``: the largest T the kernel runs as a GEMV (-1: its own limit, 8); larger T
    take the blocked GEMM. Tests force one or the other; the engine leaves it."""
    from jaxserve.attention.cpu.loader import LAYER_MATMUL_TARGET, register

    register()
    if x.ndim != 2 or stacked.ndim != 3 or x.shape[1] != stacked.shape[1]:
        raise ValueError(f"layer_matmul wants x [T, in] and weights [L, in, out]; "
                         f"got {x.shape} and {stacked.shape}")
    call = jax.ffi.ffi_call(LAYER_MATMUL_TARGET,
                            jax.ShapeDtypeStruct((x.shape[0], stacked.shape[2]), jnp.float32))
    return call(x.astype(jnp.float32), stacked, jnp.asarray(layer, jnp.int32).reshape(()),
                gemv_rows=np.int64(gemv_rows))


SMALL_LOGITS_MAX_ROWS = 8    # the small-logits kernel's row limit


def small_logits(x: jax.Array, table: jax.Array) -> jax.Array:
    """x [T, H] @ table[V, H]^T ([V, H] float32, a tied embedding) -> [T, V], T <=
    SMALL_LOGITS_MAX_ROWS.

    The C++ kernel `jaxserve_small_logits`: XLA:CPU hands this dot at 2..8 rows to XNNPACK,
    ~5x slower than its one-row GEMV on SmolLM2's table, and a speculative verify step's
    logits are k + 1 rows."""
    from jaxserve.attention.cpu.loader import SMALL_LOGITS_TARGET, register

    register()
    if x.ndim != 2 or x.shape[0] > SMALL_LOGITS_MAX_ROWS or table.ndim != 2 \
            or x.shape[1] != table.shape[1]:
        raise ValueError(f"small_logits wants x [T <= {SMALL_LOGITS_MAX_ROWS}, H] and a table "
                         f"[V, H]; "
                         f"got {x.shape} and {table.shape}")
    call = jax.ffi.ffi_call(SMALL_LOGITS_TARGET,
                            jax.ShapeDtypeStruct((x.shape[0], table.shape[0]), jnp.float32))
    return call(x.astype(jnp.float32), table)
