"""The mixture-of-experts block Mixtral and Qwen3-MoE share: a softmax top-k router, and the
experts as grouped matmuls over the (token, choice) pairs sorted by expert. No per-expert
Python loop: one grouped matmul per projection covers every expert (models/grouped_matmul.py:
`jax.lax.ragged_dot`, a grouped GEMM on GPU/TPU; on CPU a loop over the (row tile, expert)
items that exist, because jax's CPU ragged_dot multiplies every row by every expert).

Parameters (created in the calling layer's scope, so the tree stays flat; loader names
in the model module):
    router.kernel               [H, E]
    experts_gate_proj.kernel    [E, H, I]
    experts_up_proj.kernel      [E, H, I]
    experts_down_proj.kernel    [E, I, H]

Sharding over the mesh's `model` axis (tp devices), both under one `shard_map`:
  * tensor parallel (default): every device holds every expert's 1/tp slice of I (gate/up
    by columns, down by rows, like a dense MLP) and runs every pair;
  * expert parallel (--enable-expert-parallel): each device holds E/tp whole experts and
    runs only the pairs routed to them.
Either way a device's result is a partial sum of each token's output and one all-reduce
(psum, [T, H]) combines them -- the same collective a dense Megatron MLP ends with. Tokens
need no dispatch: between layers every device already holds all T tokens (attention is
tensor parallel and ends in an all-reduce), and the router runs replicated. An all_to_all
dispatch pays off when tokens are sharded across devices (data-parallel attention with
EP, as DeepSeek-style serving does); ours are not, so it would move ~5x the bytes
(benchmarks/bench_moe_dispatch.py; docs/parallel.md). tests/test_moe.py reads the HLO.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxserve.mesh import MODEL_AXIS
from jaxserve.models.grouped_matmul import grouped_matmul
from jaxserve.models.layers import ACTIVATIONS, dense


@dataclass(frozen=True)
class MoEConfig:
    num_experts: int
    top_k: int
    intermediate_size: int       # of one expert
    renormalize: bool            # top-k weights rescaled to sum to 1 (Mixtral; Qwen3-MoE if
                                 # norm_topk_prob)
    activation: str = "silu"


@dataclass(frozen=True)
class ExpertSharding:
    """How the experts are split over `mesh`'s model axis (a model on one device has none)."""
    mesh: Mesh
    expert_parallel: bool        # True: E/tp whole experts per device; False: I/tp of each

    def weight_specs(self) -> tuple[P, P, P]:
        """Specs of one layer's gate, up, down [E, H, I] / [E, I, H] (without the L axis)."""
        if self.expert_parallel:
            experts = P(MODEL_AXIS, None, None)
            return experts, experts, experts
        return P(None, None, MODEL_AXIS), P(None, None, MODEL_AXIS), P(None, MODEL_AXIS, None)


def route(router_logits: jax.Array, top_k: int, renormalize: bool
          ) -> tuple[jax.Array, jax.Array]:
    """router_logits [T, E] → (weights [T, k] float32, experts [T, k] int32): softmax over all
    experts in float32, the top k, renormalised to sum 1 if asked (then equal to a softmax
    over the top-k logits, Mixtral's definition)."""
    probs = jax.nn.softmax(router_logits.astype(jnp.float32), axis=-1)
    weights, experts = jax.lax.top_k(probs, top_k)
    if renormalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, experts.astype(jnp.int32)


def grouped_experts(x: jax.Array, weights: jax.Array, experts: jax.Array, w_gate: jax.Array,
                    w_up: jax.Array, w_down: jax.Array, first_expert: jax.Array | int,
                    activation: str) -> jax.Array:
    """The experts held here, applied to the pairs routed to them.

    x [T, H]; weights, experts [T, k] (the router's); w_gate, w_up [E_here, H, I_here], w_down
    [E_here, I_here, H]: experts first_expert .. first_expert + E_here - 1. Returns [T, H]:
    per token, the weighted sum of its chosen experts' outputs over the experts held here
    (pairs routed elsewhere add 0), in x's dtype.
    """
    num_tokens, top_k = experts.shape
    num_here = w_gate.shape[0]
    local = experts.reshape(-1) - first_expert                      # [T*k]
    here = (local >= 0) & (local < num_here)
    group = jnp.where(here, local, num_here)                        # other devices' pairs last
    order = jnp.argsort(group, stable=True)
    group_sizes = jnp.sum(group[None, :] == jnp.arange(num_here)[:, None], axis=1,
                          dtype=jnp.int32)                          # [E_here]
    token_of_pair = order // top_k
    xs = x[token_of_pair]                                           # [T*k, H], sorted by expert
    gate = grouped_matmul(xs, w_gate, group_sizes)
    up = grouped_matmul(xs, w_up, group_sizes)
    out = grouped_matmul(ACTIVATIONS[activation](gate) * up, w_down, group_sizes)
    # Rows past the groups (pairs routed elsewhere) are not computed: select them away
    # rather than trust their contents.
    pair_weight = jnp.where(here, weights.reshape(-1), 0.0)[order]
    out = jnp.where(here[order][:, None], out.astype(jnp.float32) * pair_weight[:, None], 0.0)
    return jnp.zeros((num_tokens, x.shape[1]), jnp.float32).at[token_of_pair].add(out) \
        .astype(x.dtype)


def sharded_experts(sharding: ExpertSharding, activation: str):
    """`grouped_experts` per device under shard_map, partial sums combined with one psum.
    Returns fn(x, weights, experts, w_gate, w_up, w_down) -> [T, H] replicated."""
    gate_spec, up_spec, down_spec = sharding.weight_specs()

    def per_device(x, weights, experts, w_gate, w_up, w_down):
        first = jax.lax.axis_index(MODEL_AXIS) * w_gate.shape[0] if sharding.expert_parallel \
            else 0
        partial = grouped_experts(x, weights, experts, w_gate, w_up, w_down, first, activation)
        return jax.lax.psum(partial, MODEL_AXIS)

    return jax.shard_map(per_device, mesh=sharding.mesh,
                         in_specs=(P(), P(), P(), gate_spec, up_spec, down_spec),
                         out_specs=P(), check_vma=False)


class _ExpertKernel(nn.Module):
    """One stacked expert projection: param `kernel` [E, in, out]."""
    shape: tuple[int, int, int]
    dtype: Any

    @nn.compact
    def __call__(self) -> jax.Array:
        return self.param("kernel", nn.initializers.lecun_normal(batch_axis=(0,)), self.shape,
                          self.dtype)


def moe_block(h: jax.Array, cfg: MoEConfig, sharding: ExpertSharding | None,
              dtype: Any, in_place: Any = None) -> jax.Array:
    """Router + experts. Call from a linen @nn.compact method; h: [T, H] → [T, H];
    in_place: the layer's weights its router reads in place (layers.dense)."""
    hidden, num_experts, inter = h.shape[-1], cfg.num_experts, cfg.intermediate_size
    router_logits = dense(num_experts, "router", dtype, False, in_place)(h)
    weights, experts = route(router_logits, cfg.top_k, cfg.renormalize)
    w_gate = _ExpertKernel((num_experts, hidden, inter), dtype, name="experts_gate_proj")()
    w_up = _ExpertKernel((num_experts, hidden, inter), dtype, name="experts_up_proj")()
    w_down = _ExpertKernel((num_experts, inter, hidden), dtype, name="experts_down_proj")()
    if sharding is None:
        return grouped_experts(h, weights, experts, w_gate, w_up, w_down, 0, cfg.activation)
    return sharded_experts(sharding, cfg.activation)(h, weights, experts, w_gate, w_up, w_down)
