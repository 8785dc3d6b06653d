"""Attention backends: who reads and writes the paged KV cache inside the jitted step.

A backend is two pure functions with the `pallas_kernels` signatures:
``write_kv(k_cache, v_cache, k, v, slot_mapping)`` and
``attention(q, k_cache, v_cache, kv_lens, block_tables, query_start_loc, num_seqs, *,
sliding_window=0, sm_scale=None, logits_soft_cap=0.0)``: the window may be a traced int32
(models pass each layer's through their layer scan); scale and soft cap are static.
`reference` is the pure-jnp implementation (lowers on every platform; the test oracle);
`cpu` is the C++ kernel of `jaxserve.attention.cpu` through the XLA FFI (compiled on first
use; CPU only); `pallas` runs our Pallas/Triton kernels and needs a GPU; `pallas-interpret`
runs the same kernels in Pallas interpret mode on any platform (slow: tests only, and only
when asked). What `auto` means on each platform, and which backends may run there, is the
platform object's rule (jaxserve/platforms/: GPU -> pallas, CPU -> cpu, TPU -> reference).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

BACKENDS = ("reference", "cpu", "pallas", "pallas-interpret")


@dataclass(frozen=True)
class AttentionBackend:
    name: str
    write_kv: Callable
    attention: Callable


def get_attention_backend(name: str) -> AttentionBackend:
    """The backend called `name` (a concrete one: what "auto" means, and whether a backend
    may run on a platform, is the platform's to say: `jaxserve.platforms`)."""
    if name == "reference":
        from pallas_kernels import write_kv
        from pallas_kernels.reference import ragged_paged_attention_reference

        return AttentionBackend("reference", write_kv, ragged_paged_attention_reference)
    if name == "cpu":
        from jaxserve.attention.cpu import paged_attention, register, write_kv

        register()  # build now: a missing compiler fails here, with advice, not mid-trace
        return AttentionBackend("cpu", write_kv, paged_attention)
    if name in ("pallas", "pallas-interpret"):
        from pallas_kernels import ragged_paged_attention, write_kv

        interpret = name == "pallas-interpret"
        attention = functools.partial(ragged_paged_attention, interpret=interpret)
        return AttentionBackend(name, write_kv, attention)
    raise ValueError(f"unknown attention backend {name!r}; choose one of {', '.join(BACKENDS)}")
