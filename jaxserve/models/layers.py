"""Building blocks every decoder family shares: RMSNorm variants, rotary embeddings,
paged self-attention (the call into the attention backend) and the gated MLP.

The block functions (`paged_self_attention`, `gated_mlp`) are called from inside a
linen `@nn.compact` method and create their projections in the caller's scope, so a
layer's parameters stay flat (``layers/q_proj/kernel``, not ``layers/attn/q_proj/...``):
that flat tree is the layout the loaders fill and the partition rules name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxserve.attention.backend import AttentionBackend
from jaxserve.models.layer_matmul import (
    IN_PLACE_DTYPES,
    MAX_ROWS,
    SMALL_LOGITS_MAX_ROWS,
    GemvOperand,
    LayerWeights,
    ProjectionWeights,
    grouped_gemv,
    layer_matmul,
    small_logits,
)
from jaxserve.models.linear_method import (
    PACKED_HEAD_LEAF,
    PACKED_LEAF,
    float32_accumulating_dot,
    linear_method_for,
)
from jaxserve.models.lora import lora_delta
from jaxserve.quantization.gguf_packed import (
    GGUF_BLOCK_ROWS,
    dequantize,
    packed_columns,
    packed_format_of,
    packed_matmul,
)
from jaxserve.quantization.kv import QuantizedKV, head_rotation, rotate_heads
from jaxserve.step_inputs import AttentionMetadata

ACTIVATIONS: dict[str, Callable[[jax.Array], jax.Array]] = {
    "silu": nn.silu,
    # HF's gelu_pytorch_tanh (Gemma) is the tanh approximation of GELU.
    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True),
}


class RMSNorm(nn.Module):
    """RMSNorm. weight_offset 0: ``w * norm(x)`` (Llama); 1: ``(1 + w) * norm(x)`` computed
    in float32 before the cast (Gemma stores w around 0)."""
    eps: float
    dtype: Any = jnp.float32
    weight_offset: float = 0.0

    @nn.compact
    def __call__(self, x: jax.Array, out_dtype: Any = None) -> jax.Array:
        """out_dtype: the result's dtype (default: the module's)."""
        init = nn.initializers.zeros if self.weight_offset else nn.initializers.ones
        weight = self.param("weight", init, (x.shape[-1],), self.dtype)
        out_dtype = out_dtype or self.dtype
        xf = x.astype(jnp.float32)
        xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        if self.weight_offset:
            return (xf * (self.weight_offset + weight.astype(jnp.float32))).astype(out_dtype)
        if self.dtype == jnp.float32:
            return (weight * xf).astype(out_dtype)
        # bf16 / f16: scale in f32, round once (HF rounds x first, then the product).
        return (weight.astype(jnp.float32) * xf).astype(out_dtype)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate-half RoPE (HF convention). x: [T, H, D]; cos, sin: [T, D/2] float32."""
    half = x.shape[-1] // 2
    xf = x.astype(jnp.float32)
    x1, x2 = xf[..., :half], xf[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(x.dtype)


def soft_cap(x: jax.Array, cap: float) -> jax.Array:
    """cap * tanh(x / cap): Gemma 2's attention and final-logit soft capping."""
    return cap * jnp.tanh(x / cap)


class Linear(nn.Module):
    """y = x @ W (+ b) (+ LoRA): one layer class for every numeric format. The format -- a
    float kernel (nn.Dense's parameters and numerics, bit for bit), int8 w8a16 per column or
    per group, packed GGUF blocks, whatever `register_linear_method` adds -- is a method
    object (models/linear_method.py) chosen by the parameter leaves the tree holds; init
    makes the float one. With LoRA on, the tree also holds the adapter slots ``lora_a``
    [S, in, r] and ``lora_b`` [S, r, out] (jaxserve/lora/stacks.py), and each token's delta
    from its slot (``lora_slots`` i32[T]) is added to whatever the format computed.
    ``in_place``: this layer's leaves stacked [L, ...] and its layer index, where the step's
    execution plan reads them in place with the CPU library (models/layer_matmul.py)."""
    features: int
    use_bias: bool = False
    dtype: Any = jnp.float32
    in_place: ProjectionWeights | None = None

    @nn.compact
    def __call__(self, x: jax.Array, lora_slots: jax.Array | None = None,
                 product: jax.Array | None = None) -> jax.Array:
        """product: x @ W as the format computes it, already done by the caller (a grouped
        GEMV over this layer and its siblings: `sibling_projections`)."""
        names = self.variables.get("params", {})
        y = product if product is not None else linear_method_for(names).apply(self, x)
        if self.use_bias:
            y = y + self.param("bias", nn.initializers.zeros, (self.features,), self.dtype)
        if lora_slots is not None and "lora_a" in names:
            y = y + lora_delta(x.astype(self.dtype), self.get_variable("params", "lora_a"),
                               self.get_variable("params", "lora_b"), lora_slots)
        return y

    def gemv_operand(self, x: jax.Array) -> GemvOperand | None:
        """This layer's share of a grouped GEMV over x (models/layer_matmul.grouped_gemv),
        where its format would stream its weights in place with the GEMV; else None."""
        method = linear_method_for(self.variables.get("params", {}))
        operand = getattr(method, "gemv_operand", None)
        return operand(self, x) if operand is not None else None


def sibling_projections(x: jax.Array, layers: tuple[Linear, ...],
                        lora_slots: jax.Array | None = None,
                        fused: ProjectionWeights | None = None) -> tuple[jax.Array, ...]:
    """Each layer applied to x; where all of them take the CPU's streaming GEMV (a decode
    step of a few rows), their products come from one library call: a decode layer's q/k/v
    and gate/up are small (SmolLM2's k_proj streams 0.44 MB in ~20 us) and each call of its
    own paid ~25-30 us of thunk and thread-pool wake-up beyond that. ``fused``: the layers'
    float weights stored side by side -- a GGUF's float copies (models/sibling_fusion.py),
    which steps of more than GGUF_BLOCK_ROWS rows read, or plain weights packed for oneDNN
    (engine/weight_packing.py), read at every row count -- one matmul instead of one per
    layer."""
    products = None
    if fused is None or x.ndim != 2 or x.shape[0] <= GGUF_BLOCK_ROWS:
        operands = [layer.gemv_operand(x) for layer in layers]
        if all(op is not None for op in operands):
            products = grouped_gemv(x, operands)
    if products is None and fused is not None and x.ndim == 2:
        products = _fused_products(x, fused, [layer.features for layer in layers],
                                   layers[0].dtype)
    if products is None:
        return tuple(layer(x, lora_slots) for layer in layers)
    return tuple(layer(x, lora_slots, product=p) for layer, p in zip(layers, products))


def _fused_products(x: jax.Array, fused: ProjectionWeights, features: list[int],
                    dtype: Any) -> list[jax.Array]:
    """x @ each member's float copy, from one product with their concatenation (float32)."""
    packed = fused.leaves.get(PACKED_LEAF)
    if packed is not None:            # packed for oneDNN at startup (engine/weight_packing.py)
        from jaxserve.kernels.cpu.packed_matmul import packed_layer_matmul

        y = packed_layer_matmul(x, packed, fused.layer, sum(features), dtype)
    elif x.shape[0] <= MAX_ROWS:      # read in place by the library (models/layer_matmul.py)
        kernel, layer = fused.leaves["kernel"], fused.layer
        y = layer_matmul(x, kernel, layer, jnp.float32, fused.gemv_rows)
    else:
        kernel, layer = fused.leaves["kernel"], fused.layer
        w = jax.lax.dynamic_index_in_dim(kernel, layer, 0, keepdims=False)
        y = float32_accumulating_dot(x.astype(w.dtype), w)
    ends = [sum(features[:i + 1]) for i in range(len(features))]
    return [y[:, end - width:end] for end, width in zip(ends, features)]


class Embedding(nn.Module):
    """nn.Embed's table [V, H] (`embedding`), or a GGUF-packed one (q8_0 / q4_0 / q4_1 / q4_k
    uint8 [V, packed]): lookups dequantize only the gathered rows; `attend` (the tied LM
    head) dequantizes the table inside the jit."""
    num_embeddings: int
    features: int
    dtype: Any = jnp.float32

    def setup(self) -> None:
        params = self.variables.get("params", {})
        fmt = packed_format_of(params)
        self.packed_format = fmt
        # a packed table may come with its float copy (engine/gguf_packing.py), which
        # startup may have packed for oneDNN (``packed_head``, engine/weight_packing.py):
        # then only the LM head reads it, and lookups read the blocks
        self.packed_head = fmt is not None and PACKED_HEAD_LEAF in params
        self.float_copy = fmt is not None and ("embedding" in params or self.packed_head)
        if fmt is None or (self.float_copy and not self.packed_head):
            self.embedding = self.param(
                "embedding", nn.initializers.variance_scaling(1.0, "fan_in", "normal", out_axis=0),
                (self.num_embeddings, self.features), self.dtype)

    def _packed(self) -> jax.Array:
        packed = self.get_variable("params", self.packed_format)
        if packed_columns(packed.shape, self.packed_format) != self.features:
            raise ValueError(f"packed embedding has {packed_columns(packed.shape, self.packed_format)} "
                             f"columns, expected {self.features}")
        return packed

    def __call__(self, ids: jax.Array) -> jax.Array:
        if self.packed_format is None or (self.float_copy and not self.packed_head):
            return jnp.take(self.embedding, ids, axis=0)
        return dequantize(jnp.take(self._packed(), ids, axis=0), self.packed_format, self.dtype)

    def streams_logits(self, rows: int, gemv_rows: int) -> bool:
        """Whether `attend` of this many rows takes the library's transposed GEMV (a float32 /
        bfloat16 table read once, at the memory's speed, the rows taken in float32): with
        ``small_rows_kernel`` and at most ``gemv_rows`` rows (the engine's measured limit)."""
        if self.packed_format is not None:   # GGUF blocks: the block kernel, rows in f32
            return 0 < rows <= (GGUF_BLOCK_ROWS if self.float_copy else SMALL_LOGITS_MAX_ROWS)
        return 0 < rows <= gemv_rows and self.embedding.dtype in IN_PLACE_DTYPES

    def attend(self, query: jax.Array, small_rows_kernel: bool = False,
               gemv_rows: int = 0) -> jax.Array:
        """query [N, H] -> [N, V]: query @ table.T. small_rows_kernel (CPU, one device): a
        float32 / bfloat16 table goes to the library (layer_matmul.small_logits), the table
        read in place: at most ``gemv_rows`` rows through its streaming GEMV (float32 rows
        as given: `streams_logits`), more through oneDNN -- except one row of a float32
        table, where XLA's GEMV is as fast as oneDNN."""
        packed_rows = small_rows_kernel and query.ndim == 2 and self.packed_format is not None \
            and self.streams_logits(query.shape[0], gemv_rows)
        if self.packed_head and not packed_rows:
            from jaxserve.kernels.cpu.packed_matmul import packed_layer_matmul

            rows = query.reshape(-1, query.shape[-1])
            logits = packed_layer_matmul(rows, self.get_variable("params", PACKED_HEAD_LEAF),
                                         0, self.num_embeddings, self.dtype)
            return logits.reshape(*query.shape[:-1], self.num_embeddings)
        if self.packed_format is None or (self.float_copy and not packed_rows):
            if self.packed_format is None and small_rows_kernel and query.ndim == 2 \
                    and self.streams_logits(query.shape[0], gemv_rows):
                return small_logits(query, self.embedding, gemv_rows)
            if small_rows_kernel and query.ndim == 2 \
                    and query.shape[0] <= SMALL_LOGITS_MAX_ROWS \
                    and self.embedding.dtype in IN_PLACE_DTYPES \
                    and (query.shape[0] >= 2 or self.embedding.dtype != jnp.float32):
                return small_logits(query, self.embedding)
            return jnp.dot(query.astype(self.dtype), self.embedding.T,
                           preferred_element_type=jnp.float32)
        if small_rows_kernel and query.ndim == 2 \
                and self.streams_logits(query.shape[0], gemv_rows):
            # GGUF blocks read in place by the library's block kernel (gemv_gguf.h), a dot
            # product per table row; XLA would dequantize the whole table every step.
            from jaxserve.kernels.cpu.matmul import gguf_matmul

            return gguf_matmul(query, (self._packed()[None],), 0, self.packed_format)[0]
        return packed_matmul(query, self._packed(), self.packed_format, self.dtype)


def dense(features: int, name: str, dtype: Any, bias: bool = False,
          in_place: LayerWeights | None = None) -> Linear:
    """The layer's projection ``name``; in_place: the layer's weights the step reads in place
    (None: XLA's dot on the layer's own leaves)."""
    return Linear(features, use_bias=bias, dtype=dtype, name=name,
                  in_place=in_place.projection(name) if in_place is not None else None)


@dataclass(frozen=True)
class AttentionConfig:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm_eps: float | None = None    # per-head RMSNorm of q and k before RoPE (Qwen3, Gemma 3)
    norm_offset: float = 0.0            # of those q/k norms (1.0: Gemma's (1 + w))
    sm_scale: float | None = None       # None: head_dim ** -0.5
    logits_soft_cap: float = 0.0        # 0: off (Gemma 2: attn_logit_softcapping)


@dataclass(frozen=True)
class PagedCache:
    """Where a layer's KV lives: the shared [L * num_blocks, ...] arrays, layer l at blocks
    [l * num_blocks, (l + 1) * num_blocks), seen through offset tables and slots."""
    backend: AttentionBackend
    num_blocks: int     # blocks per layer
    block_size: int


def paged_self_attention(h: jax.Array, cfg: AttentionConfig, cache: PagedCache,
                         k_cache: jax.Array, v_cache: jax.Array, layer_idx: jax.Array,
                         window: jax.Array | int, cos: jax.Array, sin: jax.Array,
                         meta: AttentionMetadata, dtype: Any,
                         in_place: LayerWeights | None = None):
    """q/k/v projections, optional q/k norms, RoPE, KV write, paged attention, o_proj.

    h: [T, hidden]; window: this layer's sliding window (0 = full; traced under the scan);
    in_place: the layer's weights its projections read in place (see `dense`).
    Returns (out [T, hidden], k_cache, v_cache).
    """
    num_tokens = h.shape[0]
    lora = meta.lora_slots     # None unless LoRA is on
    q, k, v = sibling_projections(h, (
        dense(cfg.num_heads * cfg.head_dim, "q_proj", dtype, cfg.qkv_bias, in_place),
        dense(cfg.num_kv_heads * cfg.head_dim, "k_proj", dtype, cfg.qkv_bias, in_place),
        dense(cfg.num_kv_heads * cfg.head_dim, "v_proj", dtype, cfg.qkv_bias, in_place)), lora,
        fused=in_place.projection("qkv_proj") if in_place is not None else None)
    q = q.reshape(num_tokens, cfg.num_heads, cfg.head_dim)
    k = k.reshape(num_tokens, cfg.num_kv_heads, cfg.head_dim)
    v = v.reshape(num_tokens, cfg.num_kv_heads, cfg.head_dim)
    if cfg.qk_norm_eps is not None:
        q = RMSNorm(cfg.qk_norm_eps, dtype, cfg.norm_offset, name="q_norm")(q)
        k = RMSNorm(cfg.qk_norm_eps, dtype, cfg.norm_offset, name="k_norm")(k)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    # The projections return float32 (models/linear_method.py); the cache and the attention
    # kernels take the compute dtype: one rounding, after RoPE.
    q, k, v = q.astype(dtype), k.astype(dtype), v.astype(dtype)
    # int8 / fp8 caches hold K and V rotated over the head dim (q.k and the attention are
    # unchanged; the quantization error averages over the head): jaxserve/quantization/kv.py
    rotation = head_rotation(cfg.head_dim) if isinstance(k_cache, QuantizedKV) else None
    if rotation is not None:
        q, k, v = (rotate_heads(x, rotation) for x in (q, k, v))

    block_offset = layer_idx * cache.num_blocks
    slots = jnp.where(meta.slot_mapping >= 0,
                      meta.slot_mapping + block_offset * cache.block_size, -1)
    k_cache, v_cache = cache.backend.write_kv(k_cache, v_cache, k, v, slots)
    static = {}
    if cfg.sm_scale is not None:
        static["sm_scale"] = cfg.sm_scale
    if cfg.logits_soft_cap:
        static["logits_soft_cap"] = cfg.logits_soft_cap
    attn = cache.backend.attention(q, k_cache, v_cache, meta.kv_lens,
                                   meta.block_tables + block_offset, meta.query_start_loc,
                                   meta.num_seqs, sliding_window=window, **static)
    if rotation is not None:
        attn = rotate_heads(attn, rotation.T)
    out = dense(cfg.hidden_size, "o_proj", dtype, cfg.o_bias, in_place)(
        attn.reshape(num_tokens, cfg.num_heads * cfg.head_dim), lora)
    return out, k_cache, v_cache


def gated_mlp(h: jax.Array, intermediate_size: int, hidden_size: int, activation: str,
              dtype: Any, lora_slots: jax.Array | None = None,
              in_place: LayerWeights | None = None) -> jax.Array:
    """down(act(gate(h)) * up(h)); activation: a key of ACTIVATIONS; lora_slots: i32[T]
    (meta.lora_slots) when LoRA is on; in_place: see `dense`."""
    gate, up = sibling_projections(h, (dense(intermediate_size, "gate_proj", dtype, False, in_place),
                                       dense(intermediate_size, "up_proj", dtype, False, in_place)),
                                   lora_slots, fused=in_place.projection("gate_up_proj")
                                   if in_place is not None else None)
    act = ACTIVATIONS[activation](gate.astype(jnp.float32)) * up.astype(jnp.float32)
    return dense(hidden_size, "down_proj", dtype, False, in_place)(act.astype(dtype), lora_slots)
