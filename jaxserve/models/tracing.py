"""One process-wide lock around every traced `model.apply`: flax module tracing is not
thread-safe.

flax.linen builds a new Module subclass each time a `setup` calls `nn.scan(...)` (the
decoder's layer stack, models/decoder.py), and its dataclass transform deletes fields from
the *base* classes' ``__dataclass_fields__`` and puts them back
(flax/linen/kw_only_dataclasses.py). A second thread that builds or binds a module in that
window fails with ``KeyError: 'parent'``. The runner traces on several threads (warmup's
pool, the background compile thread, the engine thread's prompt-logits function; data-
parallel replicas in one process), so every `model.apply` that runs under a trace goes
through `apply_model`. The apply body runs only while JAX traces, so the lock serializes
tracing alone; XLA's compiles, the long part, release the GIL and still overlap.

It is also where float32 compute is made float32: XLA's default precision for float32 dots
on recent GPUs is TF32 (a 10-bit mantissa), so a model traced with dtype float32 traces its
dots at ``highest`` precision (no effect on the CPU, where float32 dots are float32 anyway).
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any

import jax
import jax.numpy as jnp

_TRACE_LOCK = threading.RLock()


def apply_model(model: Any, *args: Any, **kwargs: Any) -> Any:
    """``model.apply(*args, **kwargs)``, never two at once in this process."""
    with _TRACE_LOCK, float32_precision(model.dtype):
        return model.apply(*args, **kwargs)


def float32_precision(dtype: Any) -> contextlib.AbstractContextManager:
    """While tracing a model of compute ``dtype``: float32 dots at full float32 precision."""
    if dtype is not None and jnp.dtype(dtype) == jnp.float32:
        return jax.default_matmul_precision("highest")
    return contextlib.nullcontext()
