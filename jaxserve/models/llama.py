"""Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3, SmolLM) over a paged KV cache.

Flax linen modules; layers are stacked and run under `nn.scan`, so one
compile covers every layer. The whole forward works on one flat ("ragged")
token axis: prefill chunks and decodes of many sequences share it.

KV cache layout: ``[num_layers * num_blocks, block_size, Hkv, D]`` for K and
for V. All layers live in one array so the scan can carry it and update it in
place; layer ``l`` owns blocks ``[l * num_blocks, (l + 1) * num_blocks)``, and
the attention backend sees that layer through block tables and slot mappings
offset by ``l * num_blocks`` — no per-layer slice is ever copied.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxserve.attention.backend import AttentionBackend
from jaxserve.models.arch import ModelArch
from jaxserve.runner.step_inputs import AttentionMetadata


class RMSNorm(nn.Module):
    eps: float
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        weight = self.param("weight", nn.initializers.ones, (x.shape[-1],), self.dtype)
        xf = x.astype(jnp.float32)
        xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return weight * xf.astype(self.dtype)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate-half RoPE (HF convention). x: [T, H, D]; cos, sin: [T, D/2] float32."""
    half = x.shape[-1] // 2
    xf = x.astype(jnp.float32)
    x1, x2 = xf[..., :half], xf[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(x.dtype)


class DecoderLayer(nn.Module):
    arch: ModelArch
    backend: AttentionBackend
    num_blocks: int        # blocks per layer in the shared cache
    block_size: int
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, carry, layer_idx, cos, sin, meta: AttentionMetadata):
        x, k_cache, v_cache = carry
        a, dt = self.arch, self.dtype
        num_tokens = x.shape[0]

        def dense(features, name, bias=False):
            return nn.Dense(features, use_bias=bias, dtype=dt, param_dtype=dt, name=name)

        h = RMSNorm(a.rms_norm_eps, dt, name="input_layernorm")(x)
        q = dense(a.q_size, "q_proj", a.qkv_bias)(h).reshape(num_tokens, a.num_heads, a.head_dim)
        k = dense(a.kv_size, "k_proj", a.qkv_bias)(h).reshape(num_tokens, a.num_kv_heads,
                                                               a.head_dim)
        v = dense(a.kv_size, "v_proj", a.qkv_bias)(h).reshape(num_tokens, a.num_kv_heads,
                                                               a.head_dim)
        if a.qk_norm:
            q = RMSNorm(a.rms_norm_eps, dt, name="q_norm")(q)
            k = RMSNorm(a.rms_norm_eps, dt, name="k_norm")(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)

        block_offset = layer_idx * self.num_blocks
        slots = jnp.where(meta.slot_mapping >= 0,
                          meta.slot_mapping + block_offset * self.block_size, -1)
        k_cache, v_cache = self.backend.write_kv(k_cache, v_cache, k, v, slots)
        attn = self.backend.attention(q, k_cache, v_cache, meta.kv_lens,
                                      meta.block_tables + block_offset, meta.query_start_loc,
                                      meta.num_seqs)
        x = x + dense(a.hidden_size, "o_proj", a.o_bias)(attn.reshape(num_tokens, a.q_size))

        h = RMSNorm(a.rms_norm_eps, dt, name="post_attention_layernorm")(x)
        gate = dense(a.intermediate_size, "gate_proj")(h)
        up = dense(a.intermediate_size, "up_proj")(h)
        x = x + dense(a.hidden_size, "down_proj")(nn.silu(gate) * up)
        return (x, k_cache, v_cache), None


class CausalLM(nn.Module):
    """Embeddings → scanned decoder layers → hidden states; `logits` applies the final norm and
    the LM head to the rows the caller picks (sampling rows, prompt positions)."""
    arch: ModelArch
    backend: AttentionBackend
    num_blocks: int
    block_size: int
    dtype: Any = jnp.float32

    def setup(self) -> None:
        # Attribute names are the parameter tree's names (embed_tokens, layers, norm, lm_head).
        a, dt = self.arch, self.dtype
        self.embed_tokens = nn.Embed(a.vocab_size, a.hidden_size, dtype=dt, param_dtype=dt)
        self.layers = nn.scan(
            DecoderLayer, variable_axes={"params": 0}, split_rngs={"params": True},
            in_axes=(0, nn.broadcast, nn.broadcast, nn.broadcast), length=a.num_layers,
        )(a, self.backend, self.num_blocks, self.block_size, dt)
        self.norm = RMSNorm(a.rms_norm_eps, dt)
        if not a.tie_word_embeddings:
            self.lm_head = nn.Dense(a.vocab_size, use_bias=False, dtype=dt, param_dtype=dt)

    def __call__(self, token_ids, positions, meta: AttentionMetadata, k_cache, v_cache,
                 inv_freq):
        """token_ids, positions: [T] → hidden states [T, H] (before the final norm)."""
        x = self.embed_tokens(token_ids)
        freqs = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]
        cos, sin = jnp.cos(freqs), jnp.sin(freqs)
        (x, k_cache, v_cache), _ = self.layers(
            (x, k_cache, v_cache), jnp.arange(self.arch.num_layers, dtype=jnp.int32), cos, sin,
            meta)
        return x, k_cache, v_cache

    def logits(self, hidden: jax.Array) -> jax.Array:
        """hidden: [N, H] rows of `__call__`'s output → logits [N, V] float32."""
        x = self.norm(hidden)
        if self.arch.tie_word_embeddings:
            logits = self.embed_tokens.attend(x)
        else:
            logits = self.lm_head(x)
        return logits.astype(jnp.float32)

    def forward_logits(self, token_ids, positions, meta: AttentionMetadata, k_cache, v_cache,
                       logits_indices, inv_freq):
        """Forward, then logits of the tokens at ``logits_indices`` [S] → [S, V] (init, checks)."""
        hidden, k_cache, v_cache = self(token_ids, positions, meta, k_cache, v_cache, inv_freq)
        return self.logits(hidden[logits_indices]), k_cache, v_cache


def params_from_weights(weights: dict[str, Any], arch: ModelArch) -> dict[str, Any]:
    """Map the loader's flat stacked layout (``layers.q_proj.kernel``) onto the linen tree."""
    layers: dict[str, dict[str, Any]] = {}
    params: dict[str, Any] = {"layers": layers}
    for name, value in weights.items():
        if name == "embed_tokens":
            params["embed_tokens"] = {"embedding": value}
        elif name == "norm":
            params["norm"] = {"weight": value}
        elif name == "lm_head":
            if not arch.tie_word_embeddings:
                params["lm_head"] = {"kernel": value}
        elif name.startswith("layers."):
            parts = name.split(".")[1:]
            module, leaf = parts[0], (parts[1] if len(parts) > 1 else "weight")
            layers.setdefault(module, {})[leaf] = value
        else:
            raise ValueError(f"unexpected weight {name!r}")
    missing = [k for k in ("embed_tokens", "norm") if k not in params]
    if not arch.tie_word_embeddings and "lm_head" not in params:
        missing.append("lm_head")
    if missing:
        raise ValueError(f"checkpoint is missing weights: {missing}")
    return {"params": params}


def random_params(arch: ModelArch, dtype: Any, seed: int = 0) -> dict[str, Any]:
    """Random weights of the right shapes (for benchmarks of models we cannot download)."""
    from jaxserve.attention.backend import get_attention_backend
    from jaxserve.runner.step_inputs import dummy_metadata

    model = CausalLM(arch, get_attention_backend("reference"), 1, 16, dtype)
    meta = dummy_metadata(num_tokens=1, num_seqs=1, max_blocks=1)
    cache = jnp.zeros((arch.num_layers, 16, arch.num_kv_heads, arch.head_dim), dtype)
    init = jax.jit(lambda key: model.init(key, jnp.zeros((1,), jnp.int32),
                                          jnp.zeros((1,), jnp.int32), meta, cache, cache,
                                          jnp.zeros((1,), jnp.int32),
                                          jnp.ones((arch.head_dim // 2,), jnp.float32),
                                          method=CausalLM.forward_logits))
    params = init(jax.random.key(seed))
    # Linen's default init is too large for a deep random net to stay finite; rescale.
    return jax.tree.map(lambda p: p * 0.02 if p.ndim >= 2 else p, params)
