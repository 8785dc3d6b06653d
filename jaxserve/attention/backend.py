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
when asked). `auto` (resolve_backend_name) picks by platform: GPU -> pallas, CPU -> cpu
(reference if it cannot be built), TPU -> reference: JAX's TPU ragged paged attention wants
another KV layout (combined K/V pages), not adapted yet.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import jax

BACKENDS = ("reference", "cpu", "pallas", "pallas-interpret")
GPU_PLATFORMS = ("gpu", "cuda", "rocm")


@dataclass(frozen=True)
class AttentionBackend:
    name: str
    write_kv: Callable
    attention: Callable


def resolve_backend_name(name: str, platform: str) -> str:
    """The concrete backend `auto` means on `platform`: GPU -> pallas; CPU -> cpu when the C++
    kernel builds here (else reference, with one warning); anything else -> reference. Every
    backend reads int8 / fp8 caches (jaxserve/quantization/kv.py)."""
    if name != "auto":
        return name
    if platform == "cpu":
        from jaxserve.attention.cpu import available  # warns once if it cannot build

        return "cpu" if available() else "reference"
    return "pallas" if platform in GPU_PLATFORMS else "reference"


def get_attention_backend(name: str, platform: str | None = None) -> AttentionBackend:
    """Resolve a backend by name (`auto` included) for `platform` (default: this process's
    devices)."""
    platform = platform or jax.default_backend()
    name = resolve_backend_name(name, platform)
    if name == "reference":
        from pallas_kernels import write_kv
        from pallas_kernels.reference import ragged_paged_attention_reference

        return AttentionBackend("reference", write_kv, ragged_paged_attention_reference)
    if name == "cpu":
        if platform != "cpu":
            raise ValueError(f"attention backend 'cpu' runs on the CPU platform only, not "
                             f"{platform!r}; use 'auto', 'pallas' or 'reference'")
        from jaxserve.attention.cpu import paged_attention, register, write_kv

        register()  # build now: a missing compiler fails here, with advice, not mid-trace
        return AttentionBackend("cpu", write_kv, paged_attention)
    if name in ("pallas", "pallas-interpret"):
        from pallas_kernels import ragged_paged_attention, write_kv

        interpret = name == "pallas-interpret"
        if not interpret and platform not in GPU_PLATFORMS:
            raise ValueError(f"attention backend 'pallas' compiles Triton kernels for a GPU; "
                             f"on {platform} use 'auto' or 'reference' ('pallas-interpret' runs "
                             "the kernels in slow interpret mode, for tests)")
        attention = functools.partial(ragged_paged_attention, interpret=interpret)
        return AttentionBackend(name, write_kv, attention)
    raise ValueError(f"unknown attention backend {name!r}; choose one of {', '.join(BACKENDS)}")
