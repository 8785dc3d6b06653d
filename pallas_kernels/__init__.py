"""Paged / ragged paged attention kernels and their pure-jnp reference."""

from pallas_kernels.reference import ragged_paged_attention_reference

__all__ = ["ragged_paged_attention_reference"]
