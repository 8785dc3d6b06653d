"""Tensor parallelism as data: a PartitionSpec for every parameter and for the KV cache.

Megatron-style, on the mesh axis ``model`` (tp devices). Which parameter is split how is
the model's (its family's `partition_rules` / `param_spec`, models/family.py); for the
Llama and Gemma families:

    layers.{q,k,v,gate,up}_proj.kernel  [L, H, out]  by output columns  P(None, None, 'model')
    layers.{q,k,v}_proj.bias            [L, out]     with its columns   P(None, 'model')
    layers.{o,down}_proj.kernel         [L, in, H]   by input rows      P(None, 'model', None)
    embed_tokens.embedding              [V, H]       on vocab (else hidden)
    lm_head.kernel                      [H, V]       on vocab (else hidden)
    norms, q_norm/k_norm, o_proj.bias   replicated
    KV cache [L*num_blocks, block_size, Hkv, D]      on KV heads  P(None, None, 'model', None)

XLA inserts the collectives: one all-reduce after o_proj and one after
down_proj per layer (their partial sums), plus a small gather of the logits
for the sampler. Attention itself needs none: each device owns whole heads,
and the backend runs per shard under `shard_map` (`shard_backend`).

KV-head replication (as vLLM): when tp > num_kv_heads and tp % num_kv_heads ==
0, each KV head is copied tp / num_kv_heads times (k/v projections and the
cache then have tp heads, one per device), so every device holds the one KV
head its query heads read. Other sizes raise an error naming the valid ones.

Weights are placed shard by shard with `jax.make_array_from_callback`, so no
device ever holds a whole matrix. The loader still returns full numpy arrays
on the host (one host copy of the checkpoint); reading shards straight from
safetensors is future work.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxserve.attention.backend import AttentionBackend
from jaxserve.mesh import MODEL_AXIS
from jaxserve.models.arch import ModelArch

logger = logging.getLogger(__name__)

M = MODEL_AXIS
KV_CACHE_SPEC = P(None, None, M, None)        # [L*num_blocks, block_size, Hkv, D]
HEADS_SPEC = P(None, M, None)                 # q, k, v, attention output: [T, heads, D]


# -- which tp sizes a model supports ---------------------------------------------------------------
def valid_tp_sizes(arch: ModelArch) -> list[int]:
    """Sizes that split query heads and the MLP evenly, and KV heads evenly or by replication."""
    return [tp for tp in range(1, arch.num_heads + 1)
            if arch.num_heads % tp == 0 and arch.intermediate_size % tp == 0
            and (arch.num_kv_heads % tp == 0 or tp % arch.num_kv_heads == 0)]


def check_tp_size(arch: ModelArch, tp: int) -> None:
    if tp not in valid_tp_sizes(arch):
        raise ValueError(
            f"tensor_parallel_size={tp} does not fit this model (num_attention_heads="
            f"{arch.num_heads}, num_key_value_heads={arch.num_kv_heads}, intermediate_size="
            f"{arch.intermediate_size}); valid sizes: "
            f"{', '.join(map(str, valid_tp_sizes(arch)))}")


def kv_replication(arch: ModelArch, tp: int) -> int:
    """How many copies of each KV head tensor parallelism needs (1 = none)."""
    return tp // arch.num_kv_heads if tp > arch.num_kv_heads else 1


def arch_for_tp(arch: ModelArch, tp: int) -> ModelArch:
    """The architecture the sharded model runs: KV heads replicated up to tp if needed."""
    check_tp_size(arch, tp)
    copies = kv_replication(arch, tp)
    if copies == 1:
        return arch
    return dataclasses.replace(arch, num_kv_heads=arch.num_kv_heads * copies)


def replicate_kv_heads(weights: dict[str, np.ndarray], arch: ModelArch, tp: int,
                       kv_head_weights: Sequence[str]) -> dict[str, np.ndarray]:
    """Copy each KV head of the named tensors `kv_replication` times, in place.

    weights: the loader's flat layout (``layers.k_proj.kernel`` [L, H, Hkv*D]);
    kv_head_weights: which of them hold KV heads on their last axis (the family's). Head j of
    the result is original head j // copies, so query head h (which reads KV head
    h // (Hq / Hkv)) finds its head on the same device after the split.
    """
    copies = kv_replication(arch, tp)
    if copies == 1:
        return weights
    hkv, d = arch.num_kv_heads, arch.head_dim
    for name in kv_head_weights:
        if name in weights:
            w = weights[name]
            if isinstance(w, jax.ShapeDtypeStruct):    # shapes only (ahead-of-time compiles)
                weights[name] = jax.ShapeDtypeStruct((*w.shape[:-1], hkv * copies * d), w.dtype)
                continue
            heads = w.reshape(*w.shape[:-1], hkv, d)
            weights[name] = np.repeat(heads, copies, axis=-2).reshape(*w.shape[:-1],
                                                                      hkv * copies * d)
    logger.info("tensor parallel %d > %d KV heads: each KV head replicated %dx", tp, hkv, copies)
    return weights


# -- partition specs -----------------------------------------------------------------------------
SpecFn = Callable[[tuple[str, ...], tuple[int, ...], int], P]


def _path_names(path: tuple[Any, ...]) -> tuple[str, ...]:
    names = tuple(str(getattr(k, "key", k)) for k in path)
    return names[1:] if names and names[0] == "params" else names


def param_specs(params: Any, tp: int, param_spec: SpecFn) -> Any:
    """The tree of PartitionSpecs matching a params tree (arrays or shape structs).
    param_spec(path, shape, tp): the model family's rule for one parameter."""
    return jax.tree_util.tree_map_with_path(
        lambda path, x: param_spec(_path_names(path), tuple(x.shape), tp), params)


def shard_params(params: Any, mesh: Mesh, param_spec: SpecFn) -> Any:
    """Place a params tree of host (numpy) arrays onto `mesh`, each device getting only its
    shard (`jax.make_array_from_callback`; works unchanged across processes)."""
    tp = mesh.shape[M]
    specs = param_specs(params, tp, param_spec)

    def place(value: np.ndarray, spec: P) -> jax.Array:
        value = np.asarray(value)
        sharding = NamedSharding(mesh, spec)
        return jax.make_array_from_callback(value.shape, sharding,
                                            lambda index: np.ascontiguousarray(value[index]))

    return jax.tree.map(place, params, specs)


def per_device_bytes(params: Any) -> int:
    """Bytes of parameters held by the busiest device (for logs, KV planning and tests)."""
    totals: dict[Any, int] = {}
    for leaf in jax.tree.leaves(params):
        if not hasattr(leaf, "addressable_shards"):    # a ShapeDtypeStruct with a sharding
            nbytes = int(np.prod(leaf.sharding.shard_shape(leaf.shape))) * \
                np.dtype(leaf.dtype).itemsize
            for device in leaf.sharding.addressable_devices:
                totals[device] = totals.get(device, 0) + nbytes
            continue
        for shard in leaf.addressable_shards:
            totals[shard.device] = totals.get(shard.device, 0) + shard.data.nbytes
    return max(totals.values()) if totals else 0


def kv_cache_sharding(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, KV_CACHE_SPEC)


# -- attention per shard ---------------------------------------------------------------------------
def shard_backend(backend: AttentionBackend, mesh: Mesh) -> AttentionBackend:
    """Run the backend's write_kv and attention per device under `shard_map`.

    Each device sees its own heads: q [T, Hq/tp, D], caches [.., Hkv/tp, D]; the
    metadata (slot mapping, block tables, lengths) is replicated. No collective is
    needed: GQA groups never straddle devices (query heads and KV heads split alike).
    """
    tp = mesh.shape[M]
    if tp == 1:
        return backend
    replicated = P()
    write_kv = jax.shard_map(
        backend.write_kv, mesh=mesh,
        in_specs=(KV_CACHE_SPEC, KV_CACHE_SPEC, HEADS_SPEC, HEADS_SPEC, replicated),
        out_specs=(KV_CACHE_SPEC, KV_CACHE_SPEC), check_vma=False)
    def attention(q, k_cache, v_cache, kv_lens, block_tables, query_start_loc, num_seqs,
                  sliding_window=0, **static):
        # The window (a traced per-layer value) is one more replicated operand; scale and
        # soft cap are static and bound before shard_map.
        def per_shard(*args):
            return backend.attention(*args[:7], sliding_window=args[7], **static)

        return jax.shard_map(
            per_shard, mesh=mesh,
            in_specs=(HEADS_SPEC, KV_CACHE_SPEC, KV_CACHE_SPEC) + (replicated,) * 5,
            out_specs=HEADS_SPEC, check_vma=False,
        )(q, k_cache, v_cache, kv_lens, block_tables, query_start_loc, num_seqs,
          jnp.asarray(sliding_window, jnp.int32))

    return AttentionBackend(f"{backend.name} (shard_map over {tp} devices)", write_kv,
                            attention)
