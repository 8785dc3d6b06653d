"""Paged / ragged paged attention kernels and their pure-jnp reference."""

from pallas_kernels.ragged_paged_attention import ragged_paged_attention
from pallas_kernels.reference import ragged_paged_attention_reference
from pallas_kernels.write_kv import write_kv

__all__ = ["ragged_paged_attention", "ragged_paged_attention_reference", "write_kv"]
