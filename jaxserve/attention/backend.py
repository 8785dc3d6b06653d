"""Attention backends: who reads and writes the paged KV cache inside the jitted step.

A backend is two pure functions with the `pallas_kernels` signatures:
``write_kv(k_cache, v_cache, k, v, slot_mapping)`` and
``attention(q, k_cache, v_cache, kv_lens, block_tables, query_start_loc, num_seqs)``.
`reference` is the pure-jnp implementation (the CPU path and the test oracle);
`pallas` runs our Pallas kernels (interpret mode off-GPU, for tests).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import jax

BACKENDS = ("reference", "pallas")


@dataclass(frozen=True)
class AttentionBackend:
    name: str
    write_kv: Callable
    attention: Callable


def get_attention_backend(name: str, platform: str | None = None) -> AttentionBackend:
    """Resolve a backend by name; `pallas` off-GPU runs the kernels in interpret mode."""
    platform = platform or jax.default_backend()
    if name == "reference":
        from pallas_kernels import write_kv
        from pallas_kernels.reference import ragged_paged_attention_reference

        return AttentionBackend("reference", write_kv, ragged_paged_attention_reference)
    if name == "pallas":
        from pallas_kernels import ragged_paged_attention, write_kv

        interpret = platform not in ("gpu", "cuda", "rocm")
        attention = functools.partial(ragged_paged_attention, interpret=interpret)
        return AttentionBackend("pallas-interpret" if interpret else "pallas", write_kv,
                                attention)
    raise ValueError(f"unknown attention backend {name!r}; choose one of {', '.join(BACKENDS)}")
