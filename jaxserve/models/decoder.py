"""The decoder-only LM every family runs: embed → scanned layers → final norm → logits.

Flax linen. The whole forward works on one flat ("ragged") token axis: prefill chunks and
decodes of many sequences share it.

The model is built with its static execution plan (models/execution_plan.py; the runner
chooses it by platform) and called with everything else as arguments. The plan's layer loop:
  scanned  weights stacked [L, ...] under one `nn.scan` while loop: compile time flat in
           depth, but every step each layer's weights are sliced out of the stack with a
           dynamic index, and XLA copies that slice (on an H200 the 8B chain ran 10.8 ms vs
           3.8 ms unrolled). The CPU keeps it: with the plan's ``cpu_matmul`` its
           projections read the stack in place (`LayerWeights`, models/layer_matmul.py).
  unrolled the same stack, `unroll=num_layers`: straight-line layers whose slices have
           constant offsets, so the dots read the stacked weights in place (GPU, TPU).
  per-layer each layer's weights in their own buffers (`per_layer_weights` splits the
           loaded stack), a Python loop: straight-line, no slice at all. The checkpoint
           layout and the partition rules stay the stacked ones.

KV cache layout: ``[num_layers * num_blocks, block_size, Hkv, D]`` for K and for V. All
layers live in one array so the scan can carry it and update it in place; layer ``l``
owns blocks ``[l * num_blocks, (l + 1) * num_blocks)`` (layers.PagedCache).

What varies per layer rides through the scan as arrays ([L] each), not as Python
branches, so it costs no extra compile: the layer index, its sliding window (0 = full)
and which rotary table it uses (Gemma 3: local vs global base). A family supplies its
layer class and `options`, a subclass of models/arch.py's `DecoderOptions`.

Why linen and not Flax NNX (issue 11 asked for NNX if the numbers allow): not converted,
because the registry came first. Measured (benchmarks/bench_nnx_vs_linen.py, results in
benchmarks/results/nnx-vs-linen-cpu.md): the same step in NNX (split/merge around jit,
nnx.scan) compiles to the same program, so it would cost nothing per step, only some
tracing per bucket. Converting is a per-family change behind `ModelFamily.build`.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.models.arch import ModelArch
from jaxserve.models.execution_plan import ExecutionPlan, LayerLoop
from jaxserve.models.layer_matmul import LayerWeights
from jaxserve.models.layers import (
    AttentionConfig,
    Embedding,
    Linear,
    PagedCache,
    RMSNorm,
    paged_self_attention,
    soft_cap,
)
from jaxserve.step_inputs import AttentionMetadata


def layer_constants(arch: ModelArch, inv_freqs: list[np.ndarray],
                    layer_rope: list[int] | None = None) -> dict[str, np.ndarray]:
    """The per-step constants of `CausalLM`: rotary tables [R, D/2], each layer's window
    and rotary table index (int32 [L])."""
    windows = list(arch.layer_windows) or [0] * arch.num_layers
    return {"inv_freq": np.stack(inv_freqs).astype(np.float32),
            "layer_windows": np.asarray(windows, np.int32),
            "layer_rope": np.asarray(layer_rope or [0] * arch.num_layers, np.int32)}


class CausalLM(nn.Module):
    """Embeddings → scanned decoder layers → hidden states [T, H]; `logits` applies the final
    norm, the LM head and the final soft cap to the rows the caller picks (sampling rows,
    prompt-logprob positions), so the step runs the LM head only where it needs logits."""
    arch: ModelArch
    layer: Any                 # the family's decoder layer class (see `scan_layer_args`)
    cache: PagedCache
    dtype: Any = jnp.float32
    plan: ExecutionPlan = ExecutionPlan()    # the layer loop and the matmul path

    @property
    def backend(self):
        """The attention backend the layers call (tests and logs read its name)."""
        return self.cache.backend

    def setup(self) -> None:
        # Attribute names are the parameter tree's names (embed_tokens, layers, norm, lm_head).
        a, dt, opts = self.arch, self.dtype, self.arch.options
        self.embed_tokens = Embedding(a.vocab_size, a.hidden_size, dtype=dt)
        loop = self.plan.layer_loop
        if loop is LayerLoop.PER_LAYER:      # params layers_0 .. layers_{L-1}
            self.layers = [self.layer(a, self.cache, dt) for _ in range(a.num_layers)]
        else:
            self.layers = nn.scan(
                self.layer, variable_axes={"params": 0}, split_rngs={"params": True},
                in_axes=(0, nn.broadcast, nn.broadcast, nn.broadcast, nn.broadcast),
                length=a.num_layers, unroll=a.num_layers if loop is LayerLoop.UNROLLED else 1,
            )(a, self.cache, dt)
        self.norm = RMSNorm(opts.rms_norm_eps, dt, opts.norm_offset)
        if not a.tie_word_embeddings:
            self.lm_head = Linear(a.vocab_size, dtype=dt)

    def __call__(self, token_ids, positions, meta: AttentionMetadata, k_cache, v_cache,
                 constants: dict[str, jax.Array]):
        """token_ids, positions: [T] → (hidden states [T, H] before the final norm, caches)."""
        return self.run_layers(self.embed(token_ids), positions, meta, k_cache, v_cache,
                               constants)

    def embed(self, token_ids: jax.Array) -> jax.Array:
        """token_ids [T] → the residual stream's first value [T, H] float32."""
        opts = self.arch.options
        x = self.embed_tokens(token_ids)
        if opts.embed_scale is not None:
            x = x * jnp.asarray(opts.embed_scale, self.dtype)
        # The residual stream stays float32 whatever the compute dtype: each layer adds its
        # bf16 outputs to it (x + out promotes) and its norms hand bf16 to the projections.
        # SmolLM2 in bf16 against float32, teacher-forced (benchmarks/bench_quant_accuracy.py):
        # top-1 97.4 %, KL 3.0e-3 with everything bf16; 99.0 %, 9.0e-4 with this residual, the
        # projections' f32 outputs (models/linear_method.py) and the f32 logits below.
        return x.astype(jnp.float32)

    def run_layers(self, x: jax.Array, positions, meta: AttentionMetadata, k_cache, v_cache,
                   constants: dict[str, jax.Array]):
        """The layer loop of the plan over the residual stream x [T, H] float32 → (hidden
        states [T, H], caches)."""
        a = self.arch
        freqs = positions.astype(jnp.float32)[None, :, None] * constants["inv_freq"][:, None, :]
        cos, sin = jnp.cos(freqs), jnp.sin(freqs)          # [R, T, D/2]
        # Windows are traced per layer only when some layer has one; otherwise the
        # backends see a static 0 (no window code at all).
        windows = constants["layer_windows"] if a.has_sliding_layers else \
            jnp.zeros((a.num_layers,), jnp.int32)
        xs = (jnp.arange(a.num_layers, dtype=jnp.int32), windows, constants["layer_rope"])
        # Steps the plan sends to the CPU library hand the layers their weights to read in
        # place (models/layer_matmul.py); init has no weights yet.
        in_place = self.plan.reads_in_place(x.shape[0]) and not self.is_initializing()
        params, gemv_rows = self.variables.get("params", {}), self.plan.gemv_rows
        carry = (x, k_cache, v_cache)
        if self.plan.layer_loop is LayerLoop.PER_LAYER:
            for i, layer in enumerate(self.layers):
                weights = LayerWeights.single(params[f"layers_{i}"], gemv_rows) \
                    if in_place else None
                carry, _ = layer(carry, jax.tree.map(lambda v, i=i: v[i], xs), cos, sin, meta,
                                 weights)
        else:
            weights = LayerWeights(params["layers"], gemv_rows=gemv_rows) if in_place else None
            carry, _ = self.layers(carry, xs, cos, sin, meta, weights)
        return carry

    def logits(self, hidden: jax.Array) -> jax.Array:
        """hidden: [N, H] rows of `__call__`'s output → logits [N, V] float32."""
        opts = self.arch.options
        # A tied table the library streams with its GEMV takes the normed rows in float32
        # (one pass over the table).
        plan = self.plan
        streams = self.arch.tie_word_embeddings and plan.cpu_matmul and hidden.ndim == 2 \
            and self.embed_tokens.streams_logits(hidden.shape[0], plan.gemv_rows)
        if self.arch.tie_word_embeddings:
            def head(q):
                return self.embed_tokens.attend(q, small_rows_kernel=plan.cpu_matmul,
                                                gemv_rows=plan.gemv_rows)
        else:
            head = self.lm_head
        if streams:
            logits = head(self.norm(hidden, out_dtype=jnp.float32))
        else:
            # bf16 / f16 compute: the normed rows rounded once (the norm's float32 result in
            # the model's dtype), as vLLM's bf16 head takes them. Feeding the rounding error
            # through the head too (a bf16 hi + lo pair, rows doubled) cost 9 % of a 64-row
            # step for 3 % less KL vs float32 (benchmarks/results/lm-head-rows-bf16-epyc-
            # avx512bf16.md): the bf16 weights dominate that error.
            logits = head(self.norm(hidden))
        logits = logits.astype(jnp.float32)
        if opts.final_logit_soft_cap:
            logits = soft_cap(logits, opts.final_logit_soft_cap)
        return logits

    def forward_logits(self, token_ids, positions, meta: AttentionMetadata, k_cache, v_cache,
                       logits_indices, constants: dict[str, jax.Array]):
        """Forward, then logits of the tokens at ``logits_indices`` [S] → ([S, V], caches):
        init, parity checks, benchmarks."""
        hidden, k_cache, v_cache = self(token_ids, positions, meta, k_cache, v_cache, constants)
        return self.logits(hidden[logits_indices]), k_cache, v_cache

    def with_plan(self, plan: ExecutionPlan) -> "CausalLM":
        """The same model under another execution plan (tests and benchmarks compare them;
        LayerLoop.PER_LAYER takes `per_layer_weights` of the stacked params)."""
        return self.clone(plan=plan)


def per_layer_weights(params: Any) -> Any:
    """params with the stacked ``layers`` [L, ...] split into ``layers_0`` .. ``layers_{L-1}``
    (LayerLoop.PER_LAYER's tree): one buffer per layer weight, copied once."""
    stacked = params["layers"]
    num_layers = jax.tree.leaves(stacked)[0].shape[0]
    out = {k: v for k, v in params.items() if k != "layers"}
    for i in range(num_layers):
        out[f"layers_{i}"] = jax.tree.map(lambda w, i=i: w[i], stacked)
    return out


def layer_inputs(arch: ModelArch, xs, cos, sin):
    """Unpack one layer's scan slice: (layer_idx, window, cos [T, D/2], sin [T, D/2]).
    window is a Python 0 when no layer of the model slides (the backends skip window code)."""
    layer_idx, window, rope_idx = xs
    if not arch.has_sliding_layers:
        window = 0
    if cos.shape[0] == 1:
        return layer_idx, window, cos[0], sin[0]
    return layer_idx, window, cos[rope_idx], sin[rope_idx]


class DecoderLayer(nn.Module):
    """A family's layer (CausalLM's `layer`) has these fields, in this order: CausalLM
    builds it as ``layer(arch, cache, dtype)`` under its layer loop; its ``__call__(carry,
    xs, cos, sin, meta, in_place)`` returns ((x, k_cache, v_cache), None). ``in_place``: a
    `LayerWeights` its projections read in place (``in_place.at(layer_idx)``), or None."""
    arch: ModelArch
    cache: PagedCache
    dtype: Any = jnp.float32


def attention_config(arch: ModelArch, *, qkv_bias: bool = False, o_bias: bool = False,
                     qk_norm: bool = False, **extra: Any) -> AttentionConfig:
    """The attention of one of `arch`'s layers; q/k norms (qk_norm) use the options'
    rms_norm_eps; extra: AttentionConfig's other fields (Gemma's scale and soft cap)."""
    return AttentionConfig(arch.num_heads, arch.num_kv_heads, arch.head_dim, arch.hidden_size,
                           qkv_bias=qkv_bias, o_bias=o_bias,
                           qk_norm_eps=arch.options.rms_norm_eps if qk_norm else None, **extra)


def pre_norm_layer(layer: nn.Module, carry, xs, cos, sin, meta, attn: AttentionConfig,
                   feed_forward: Any, in_place: LayerWeights | None = None):
    """The Llama-style layer body: x += attn(input_layernorm(x)); x += feed_forward(
    post_attention_layernorm(x)). Called from a family layer's compact ``__call__`` (its
    submodules are the layer's: input_layernorm, the attention projections,
    post_attention_layernorm, then whatever ``feed_forward(h, weights)`` builds: a gated MLP,
    experts; ``weights``: this layer's `LayerWeights` or None)."""
    x, k_cache, v_cache = carry
    a, eps, dt = layer.arch, layer.arch.options.rms_norm_eps, layer.dtype
    layer_idx, window, cos, sin = layer_inputs(a, xs, cos, sin)
    weights = in_place.at(layer_idx) if in_place is not None else None
    h = RMSNorm(eps, dt, name="input_layernorm")(x)
    out, k_cache, v_cache = paged_self_attention(h, attn, layer.cache, k_cache, v_cache,
                                                 layer_idx, window, cos, sin, meta, dt, weights)
    x = x + out
    h = RMSNorm(eps, dt, name="post_attention_layernorm")(x)
    x = x + feed_forward(h, weights)
    return (x, k_cache, v_cache), None
