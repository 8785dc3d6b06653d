"""The whole decode step's time in float32 and in bfloat16 on this CPU, at the row counts
that decide throughput: what ``dtype=auto`` compares on a CPU without bf16 units
(compute_dtype.py holds the rule; this module only measures).

A timing of the projections alone misses what else a step reads and computes in the model's
dtype: the LM head (a fifth of SmolLM2's weights), the KV cache the attention reads (at 64
streams of 256 tokens more bytes than the weights), norms, activations and residual adds. So
the step timed here is the model's own shape, built from the kernels the engine calls:

    per layer: RMSNorm -> q, k, v projections -> paged attention over CONTEXT_TOKENS of cache
               per row -> o projection -> residual -> RMSNorm -> gate, up -> SiLU * up ->
               down -> residual
    then:      final RMSNorm -> LM head -> greedy argmax

each projection on the kernel the engine takes at that row count in that dtype (the GEMV up
to the limit gemv_choice.py measured for the dtype, oneDNN above), the KV cache in the
dtype (kv-cache-dtype auto follows the model), every layer its own weights and cache pages
(a decode step streams them from memory, as here). The layers are stacked to read about
MEASURED_BYTES of weights (kernels/cpu/timings.py) with the same share of the LM head's
vocabulary: a uniform slice of the step, whose time scaled by num_layers / layers is the
step's. The two dtypes are interleaved, fastest of a few calls.

What a cold start pays for it is mostly compiling: one program per dtype holds every row
count's slice (a branch each), and the calls stop as soon as more of them cannot change the
choice (`fastest_until_decided`); a warm start reads the stored result.
"""

from __future__ import annotations

import functools
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp

from jaxserve.kernels.cpu.timings import (
    MAX_LAYERS,
    MEASURED_BYTES,
    branch_calls,
    compile_all,
    filled,
    stored_or_measured,
)

# The cache each row's attention reads: a typical chat turn (vLLM's `bench serve` default
# random dataset is 1024 in / 128 out; the project's runs use 128 / 128). Fixed, so a stored
# timing does not depend on a request's length.
CONTEXT_TOKENS = 256
BLOCK_SIZE = 16
STORE = "jaxserve-dtype-step.json"
DTYPES = ("float32", "bfloat16")
# Rounds of calls (fastest_until_decided): at least MIN_ROUNDS, at most MAX_ROUNDS; none more
# once the choice is DECISIVE-fold from flipping and the fastest calls it rests on CONFIRMED;
# only the row counts within RELEVANT-fold of a dtype's worst ratio after MIN_ROUNDS.
MIN_ROUNDS = 2
MAX_ROUNDS = 5
DECISIVE = 1.10
RELEVANT = 1.10
CONFIRMED = 1.03


def step_row_counts(max_num_seqs: int, gemv_rows: int = 8, batch_cap: int = 64
                    ) -> tuple[int, ...]:
    """The rows a step is timed at: one stream, a few (half the GEMV's limit), past the
    GEMV (twice its limit, where oneDNN without bf16 units is at its worst), and the batch
    (max_num_seqs, at most `batch_cap`); only those the engine runs."""
    batch = max(1, min(int(max_num_seqs), batch_cap))
    wanted = {1, max(2, gemv_rows // 2), 2 * max(gemv_rows, 1), batch}
    return tuple(sorted(r for r in wanted if r <= batch))


class SyntheticStep:
    """One dtype's stacked decoder layers and a slice of the LM head of a model's shapes (the
    same share of the vocabulary as of the layers), and one program that runs them at each
    row count timed."""

    def __init__(self, dtype: str, shape: Any, num_layers: int):
        self.dtype, self.shape = jnp.dtype(dtype), shape
        h, i, q, kv = shape.hidden, shape.intermediate, shape.q_width, shape.kv_width
        self.projections = ((h, q), (h, kv), (h, kv), (q, h), (h, i), (h, i), (i, h))
        layer_bytes = sum(a * b for a, b in self.projections) * self.dtype.itemsize
        self.layers = max(1, min(num_layers, MAX_LAYERS, -(-MEASURED_BYTES // layer_bytes)))
        # Values do not change the kernels' speed; they only must be real, touched memory.
        self.weights = [filled((self.layers, a, b), 0.01, self.dtype)
                        for a, b in self.projections]
        self.num_layers = max(1, int(num_layers))
        vocab_rows = max(1, shape.vocab * self.layers // self.num_layers)
        self.table = filled((vocab_rows, h), 0.01, self.dtype)

    def programs(self, row_counts: tuple[int, ...], gemv_rows: int
                 ) -> dict[int, Callable[[], Any]]:
        """{rows: a call that runs a `rows`-row decode step's `layers` decoder layers and
        the same share of its LM head's vocabulary rows once}: a uniform slice of the whole
        step (it takes layers / num_layers of its time). One compiled program holds every
        row count's slice as a branch, picked by an index operand: compiling is most of a
        timing's cost, and one compile costs less than one per row count."""
        from jaxserve.attention.cpu import paged_attention
        from jaxserve.kernels.cpu.matmul import layer_matmul

        dtype, layers, s = self.dtype, self.layers, self.shape
        pages = -(-CONTEXT_TOKENS // BLOCK_SIZE)
        most = max(row_counts)
        # every layer's pages apart (the engine's one cache, offset block tables per layer);
        # a branch of r rows reads the first layers * r * pages blocks
        cache_shape = (layers * most * pages, BLOCK_SIZE, s.kv_heads, s.head_dim)

        def norm(x):
            x32 = x.astype(jnp.float32)
            return x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + 1e-6)

        def step_slice(rows, weights, table, k_cache, v_cache, x):
            wq, wk, wv, wo, wg, wu, wd = weights
            kv_lens = jnp.full((rows,), CONTEXT_TOKENS, jnp.int32)
            starts = jnp.arange(rows + 1, dtype=jnp.int32)
            tables = jnp.arange(rows * pages, dtype=jnp.int32).reshape(rows, pages)
            head_rows = rows <= gemv_rows

            def matmul(x, w, layer):
                return layer_matmul(x, w, layer, dtype, gemv_rows=gemv_rows)

            def layer(l, x):
                y = norm(x).astype(dtype)
                q, _k, _v = matmul(y, wq, l), matmul(y, wk, l), matmul(y, wv, l)
                attn = paged_attention(q.reshape(rows, s.heads, s.head_dim), k_cache,
                                       v_cache, kv_lens, tables + l * rows * pages, starts,
                                       rows)
                x = x + matmul(attn.reshape(rows, -1), wo, l)
                y = norm(x).astype(dtype)
                gated = jax.nn.silu(matmul(y, wg, l).astype(jnp.float32)) * \
                    matmul(y, wu, l).astype(jnp.float32)
                return x + matmul(gated.astype(dtype), wd, l)

            # the engine's LM head: the transposed GEMV on float32 rows up to its limit,
            # oneDNN on rows in the table's dtype above; then the greedy pick
            y = norm(jax.lax.fori_loop(0, layers, layer, x[:rows]))
            logits = layer_matmul(y if head_rows else y.astype(dtype), table[None], 0,
                                  jnp.float32, transposed=True,
                                  gemv_rows=gemv_rows if head_rows else 0)
            return jnp.sum(jnp.argmax(logits, -1))      # every row's pick, one shape

        def forward(index, weights, table, k_cache, v_cache, x):
            branches = [functools.partial(step_slice, rows) for rows in row_counts]
            return jax.lax.switch(index, branches, weights, table, k_cache, v_cache, x)

        args = (self.weights, self.table, filled(cache_shape, 0.01, dtype),
                filled(cache_shape, 0.01, dtype), filled((most, s.hidden), 0.5, dtype))
        return branch_calls(forward, len(row_counts), args, row_counts)


def load_or_measure(cache_dir: str | None, shape: Any, num_layers: int, max_num_seqs: int,
                    gemv_rows: dict[str, int]) -> tuple[dict[int, tuple[float, float]], bool]:
    """({rows: (float32 ms, bfloat16 ms) per whole step}, whether read from disk), for the
    model `shape` (compute_dtype.StepShape) of `num_layers` layers; `gemv_rows`: each
    dtype's GEMV limit (gemv_choice.py)."""
    from jaxserve.kernels.cpu.matmul import onednn_isa

    rows = step_row_counts(max_num_seqs, max(gemv_rows.values()))
    entry, stored = stored_or_measured(
        cache_dir, STORE,
        # oneDNN's ISA: ONEDNN_MAX_CPU_ISA caps it, and a capped run times other kernels
        [list(shape.key()), min(int(num_layers), MAX_LAYERS), list(rows),
         sorted(gemv_rows.items()), CONTEXT_TOKENS, onednn_isa()],
        lambda: _measure(shape, int(num_layers), rows, tuple(sorted(gemv_rows.items()))))
    return {int(r): (float(t["float32"]), float(t["bfloat16"])) for r, t in entry.items()}, \
        stored


@functools.lru_cache(maxsize=None)
def _measure(shape: Any, num_layers: int, row_counts: tuple[int, ...],
             gemv_rows: tuple[tuple[str, int], ...]) -> dict:
    """{rows: {dtype: ms per step}}: each slice's time scaled to the model's layers, the
    fastest of its calls (`fastest_until_decided`)."""
    limits = dict(gemv_rows)
    steps = {name: SyntheticStep(name, shape, num_layers) for name in DTYPES}
    programs = compile_all({name: functools.partial(step.programs, row_counts, limits[name])
                            for name, step in steps.items()})
    scale = {name: step.num_layers / step.layers for name, step in steps.items()}
    best = fastest_until_decided({(rows, name): programs[name][rows]
                                  for rows in row_counts for name in DTYPES}, scale)
    return {str(rows): {name: best[rows][name] for name in DTYPES} for rows in row_counts}


def fastest_until_decided(calls: dict[tuple[int, str], Callable[[], Any]],
                          scale: dict[str, float],
                          clock: Callable[[], float] = time.perf_counter
                          ) -> dict[int, dict[str, float]]:
    """{rows: {dtype: fastest call in ms x scale[dtype]}} of `calls` {(rows, dtype): call},
    in rounds that run every call once, the dtypes in alternating order (a shared box's
    drift slows both alike), after one untimed call each.

    Calls stop where more of them cannot change what `choose_by_step_times` picks: after
    MIN_ROUNDS, once the timings are DECISIVE (the choice is that far from flipping) and
    every fastest call the choice rests on is confirmed (a second call within CONFIRMED of
    it: a neighbour's burst rarely slows two calls alike), or after MAX_ROUNDS; and a later
    round runs only the row counts whose ratio is within RELEVANT of a dtype's worst (the
    only ones the rule reads). Near the flip, or on a box too busy for two calls to agree,
    every row count that can decide it gets every round, as before. `clock`: seconds (a
    test's fake one)."""
    from jaxserve.engine.compute_dtype import decision_margin

    for call in calls.values():         # warm up (oneDNN builds its kernels at a first call)
        jax.block_until_ready(call())
    times: dict[tuple[int, str], list[float]] = {key: [] for key in calls}
    row_counts = sorted({rows for rows, _ in calls})
    timed = list(row_counts)
    best: dict[int, dict[str, float]] = {}
    for round_ in range(MAX_ROUNDS):
        for rows in timed:
            for name in (DTYPES if round_ % 2 else DTYPES[::-1]):
                start = clock()
                jax.block_until_ready(calls[rows, name]())
                times[rows, name].append((clock() - start) * 1e3 * scale[name])
        best = {rows: {name: min(times[rows, name]) for name in DTYPES} for rows in row_counts}
        if round_ + 1 < MIN_ROUNDS:
            continue
        pairs = {rows: (t["float32"], t["bfloat16"]) for rows, t in best.items()}
        f32_worst = max(f / b for f, b in pairs.values())
        bf16_worst = max(b / f for f, b in pairs.values())
        timed = [rows for rows, (f, b) in pairs.items()
                 if f / b * RELEVANT >= f32_worst or b / f * RELEVANT >= bf16_worst]
        confirmed = all(sorted(times[rows, name])[1] <= CONFIRMED * best[rows][name]
                        for rows in timed for name in DTYPES)
        if confirmed and decision_margin(pairs) >= DECISIVE:
            break
    return best
