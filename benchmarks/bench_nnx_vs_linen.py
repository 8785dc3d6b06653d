"""Issue 11's NNX question, time-boxed: our linen Llama step vs the same step in Flax NNX.

Same math, same attention backend; the NNX model runs as a pure function of its state
(nnx.split outside jit, nnx.merge inside), its layers under nnx.scan over nnx.vmap-built
stacked blocks. Prints trace+lower time, XLA compile time, step time (AOT executable,
caches donated) and a summary of the compiled HLO, for one bucket (64 tokens: 8 sequences
of 8-token chunks on 100 cached tokens) of a SmolLM2-135M-shaped random model. Run each
variant in its own process (in-process caches would favour the second):

  python benchmarks/bench_nnx_vs_linen.py --layers 30 --backend cpu --variant linen
  python benchmarks/bench_nnx_vs_linen.py --layers 30 --backend cpu --variant nnx

Results: benchmarks/results/nnx-vs-linen-cpu.md.
"""

from __future__ import annotations

import argparse
import pathlib
import re
import statistics
import sys
import time
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import transformers
from flax import nnx

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from jaxserve.attention.backend import get_attention_backend
from jaxserve.models.execution_plan import ExecutionPlan
from jaxserve.models.layers import apply_rope
from jaxserve.models.registry import family_for, read_arch
from jaxserve.step_inputs import AttentionMetadata

NUM_TOKENS, NUM_SEQS, BLOCK_SIZE, NUM_BLOCKS, WIDTH = 64, 8, 16, 64, 16


def smollm2_shaped(layers: int):
    config = transformers.LlamaConfig(
        hidden_size=576, intermediate_size=1536, num_hidden_layers=layers,
        num_attention_heads=9, num_key_value_heads=3, vocab_size=49152,
        tie_word_embeddings=True, rms_norm_eps=1e-5, architectures=["LlamaForCausalLM"])
    return read_arch(config)


def step_inputs(rng):
    """8 sequences, each an 8-token chunk on top of 100 cached tokens."""
    q_lens, kv_lens = [8] * NUM_SEQS, [108] * NUM_SEQS
    query_start = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    tables = np.arange(NUM_SEQS * WIDTH, dtype=np.int32).reshape(NUM_SEQS, WIDTH) % NUM_BLOCKS
    positions = np.concatenate([np.arange(k - q, k) for q, k in zip(q_lens, kv_lens)])
    seq = np.repeat(np.arange(NUM_SEQS), q_lens)
    slots = tables[seq, positions // BLOCK_SIZE] * BLOCK_SIZE + positions % BLOCK_SIZE
    meta = AttentionMetadata(jnp.asarray(slots, jnp.int32), jnp.asarray(kv_lens, jnp.int32),
                             jnp.asarray(tables), jnp.asarray(query_start), jnp.int32(NUM_SEQS))
    tokens = jnp.asarray(rng.integers(0, 49152, NUM_TOKENS), jnp.int32)
    return tokens, jnp.asarray(positions, jnp.int32), meta, jnp.asarray(query_start[1:] - 1)


def linen_variant(arch, backend, rng):
    family = family_for(arch.architecture)
    weights = {name: (rng.standard_normal(shape) * 0.02).astype(np.float32)
               for name, shape in family.weight_shapes(arch).items()}
    for name in weights:
        if name.endswith("norm"):
            weights[name] += 1
    params = jax.device_put(family.params_from_weights(weights, arch))
    model = family.build(arch, backend, NUM_BLOCKS, BLOCK_SIZE, jnp.float32, ExecutionPlan())
    constants = jax.device_put(family.constants(arch))

    def step(params, k_cache, v_cache, tokens, positions, meta, logits_indices):
        return model.apply(params, tokens, positions, meta, k_cache, v_cache, logits_indices,
                           constants, method="forward_logits")

    return step, params


def nnx_variant(arch, backend, rng):
    hidden, head_dim, heads, kv_heads = arch.hidden_size, arch.head_dim, arch.num_heads, \
        arch.num_kv_heads
    eps, layers, tokens_per_step = arch.options.rms_norm_eps, arch.num_layers, NUM_TOKENS

    class RMSNorm(nnx.Module):
        def __init__(self, size: int):
            self.weight = nnx.Param(jnp.ones((size,)))

        def __call__(self, x):
            return self.weight[...] * (x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + eps))

    class Block(nnx.Module):
        def __init__(self, rngs):
            def linear(n_in, n_out):
                return nnx.Linear(n_in, n_out, use_bias=False, rngs=rngs)

            self.input_layernorm, self.post_attention_layernorm = RMSNorm(hidden), RMSNorm(hidden)
            self.q_proj, self.o_proj = linear(hidden, heads * head_dim), linear(heads * head_dim,
                                                                                 hidden)
            self.k_proj, self.v_proj = linear(hidden, kv_heads * head_dim), \
                linear(hidden, kv_heads * head_dim)
            self.gate_proj, self.up_proj = linear(hidden, arch.intermediate_size), \
                linear(hidden, arch.intermediate_size)
            self.down_proj = linear(arch.intermediate_size, hidden)

        def __call__(self, carry, layer_idx, cos, sin, meta):
            x, k_cache, v_cache = carry
            t = tokens_per_step
            h = self.input_layernorm(x)
            q = apply_rope(self.q_proj(h).reshape(t, heads, head_dim), cos, sin)
            k = apply_rope(self.k_proj(h).reshape(t, kv_heads, head_dim), cos, sin)
            v = self.v_proj(h).reshape(t, kv_heads, head_dim)
            offset = layer_idx * NUM_BLOCKS
            slots = jnp.where(meta.slot_mapping >= 0,
                              meta.slot_mapping + offset * BLOCK_SIZE, -1)
            k_cache, v_cache = backend.write_kv(k_cache, v_cache, k, v, slots)
            attn = backend.attention(q, k_cache, v_cache, meta.kv_lens,
                                     meta.block_tables + offset, meta.query_start_loc,
                                     meta.num_seqs, sliding_window=0)
            x = x + self.o_proj(attn.reshape(t, heads * head_dim))
            h = self.post_attention_layernorm(x)
            x = x + self.down_proj(jax.nn.silu(self.gate_proj(h)) * self.up_proj(h))
            return x, k_cache, v_cache

    class CausalLM(nnx.Module):
        def __init__(self, rngs):
            self.embed = nnx.Embed(arch.vocab_size, hidden, rngs=rngs)

            @nnx.split_rngs(splits=layers)
            @nnx.vmap(in_axes=(0,), out_axes=0)
            def make_layers(rngs):
                return Block(rngs)

            self.layers = make_layers(rngs)
            self.norm = RMSNorm(hidden)

        def __call__(self, tokens, positions, meta, k_cache, v_cache, logits_indices, inv_freq):
            x = self.embed(tokens)
            freqs = positions.astype(jnp.float32)[:, None] * inv_freq[None]
            cos, sin = jnp.cos(freqs), jnp.sin(freqs)

            @nnx.scan(in_axes=(nnx.Carry, 0, 0), out_axes=nnx.Carry)
            def run_layers(carry, layer, layer_idx):
                return layer(carry, layer_idx, cos, sin, meta)

            x, k_cache, v_cache = run_layers((x, k_cache, v_cache), self.layers,
                                             jnp.arange(layers))
            return self.embed.attend(self.norm(x[logits_indices])), k_cache, v_cache

    graphdef, state = nnx.split(CausalLM(nnx.Rngs(0)))
    inv_freq = jnp.asarray(arch.options.rope.inv_freq(head_dim))

    def step(state, k_cache, v_cache, tokens, positions, meta, logits_indices):
        model = nnx.merge(graphdef, state)
        return model(tokens, positions, meta, k_cache, v_cache, logits_indices, inv_freq)

    return step, state


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--backend", default="cpu")
    parser.add_argument("--variant", choices=["linen", "nnx"], required=True)
    parser.add_argument("--iters", type=int, default=30)
    args = parser.parse_args()
    arch, backend = smollm2_shaped(args.layers), get_attention_backend(args.backend)
    rng = np.random.default_rng(0)
    tokens, positions, meta, logits_indices = step_inputs(rng)
    cache = jnp.asarray(rng.standard_normal((args.layers * NUM_BLOCKS, BLOCK_SIZE,
                                             arch.num_kv_heads, arch.head_dim)) * 0.1,
                        jnp.float32)
    make = linen_variant if args.variant == "linen" else nnx_variant
    step, params = make(arch, backend, rng)

    jitted = jax.jit(step, donate_argnums=(1, 2))
    start = time.perf_counter()
    lowered = jitted.lower(params, cache, cache, tokens, positions, meta, logits_indices)
    traced = time.perf_counter()
    executable = lowered.compile()
    compiled = time.perf_counter()
    k_cache, v_cache, times = jnp.copy(cache), jnp.copy(cache), []
    for _ in range(args.iters):
        begin = time.perf_counter()
        logits, k_cache, v_cache = executable(params, k_cache, v_cache, tokens, positions, meta,
                                              logits_indices)
        logits.block_until_ready()
        times.append(time.perf_counter() - begin)
    ops = Counter(re.findall(r"= \S+ (\w[\w-]*)\(", executable.as_text()))
    print(f"{args.variant}: layers={args.layers} backend={backend.name} "
          f"trace+lower {traced - start:.2f} s, XLA compile {compiled - traced:.2f} s, "
          f"step median {statistics.median(times[2:]) * 1e3:.1f} ms "
          f"(min {min(times[2:]) * 1e3:.1f}); compiled HLO: "
          f"{len(executable.as_text().splitlines())} lines, {ops['dot']} dots, "
          f"{ops['fusion']} fusions, {ops['custom-call']} custom calls, {ops['copy']} copies")


if __name__ == "__main__":
    main()
