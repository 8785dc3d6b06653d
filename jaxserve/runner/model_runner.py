"""Turns the scheduler's decisions into one jitted, donated, bucketed step.

The runner knows tensors, never queues: it receives [(sequence, num_new_tokens)],
packs the inputs in numpy, pads them to a bucket, runs forward + sampling in a
single `jax.jit` call with the KV cache donated, and hands back numpy results.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import os
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from typing import Any
from typing import Sequence as Seq

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.attention.backend import AttentionBackend
from jaxserve.models.arch import ModelArch
from jaxserve.models.llama import CausalLM
from jaxserve.parallel.mesh import put_replicated
from jaxserve.runner.buckets import BucketPolicy
from jaxserve.runner.sampler import sample
from jaxserve.runner.sampling_tensors import SamplingTensorBuilder, SamplingTensors
from jaxserve.runner.step_inputs import InputBuilder, unpack

logger = logging.getLogger(__name__)


@dataclass
class StepResult:
    """Host copies of one step's sampler outputs, rows in batch order."""
    next_tokens: np.ndarray        # i32[n]
    sampled_logprobs: np.ndarray   # f32[n]
    sampled_ranks: np.ndarray      # i32[n], 1 + tokens with a higher logprob (whole vocab)
    top_token_ids: np.ndarray      # i32[n, K]
    top_logprobs: np.ndarray       # f32[n, K]


def _step(params, k_cache, v_cache, packed, sampling, *, model: CausalLM, inv_freq,
          num_tokens: int, num_seqs: int, width: int, num_top_logprobs: int,
          logits_shardings: tuple = ()):
    token_ids, positions, logits_indices, meta = unpack(packed, num_tokens, num_seqs, width)
    logits, k_cache, v_cache = model.apply(params, token_ids, positions, meta, k_cache, v_cache,
                                           logits_indices, inv_freq)
    for sharding in logits_shardings:   # tensor parallel: keep the lm_head local (logits split
        logits = jax.lax.with_sharding_constraint(logits, sharding)   # on vocab), then gather
    out = sample(logits, sampling, num_top_logprobs)
    return k_cache, v_cache, out


class ModelRunner:
    def __init__(self, arch: ModelArch, params: Any, backend: AttentionBackend, *,
                 dtype: Any, num_blocks: int, block_size: int, max_model_len: int,
                 max_num_seqs: int, max_num_batched_tokens: int, max_logprobs: int,
                 eos_token_ids: Seq[int], kv_sharding: Any = None,
                 input_sharding: Any = None, logits_shardings: tuple = ()) -> None:
        self.arch = arch
        self.params = params
        self.dtype = dtype
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.width = math.ceil(max_model_len / block_size)
        self.buckets = BucketPolicy(max_num_batched_tokens, max_num_seqs)
        self.num_top_logprobs = max_logprobs
        self.model = CausalLM(arch, backend, num_blocks, block_size, dtype)
        # input_sharding: where step inputs go (replicated on the tp mesh; None = default
        # device). step_channel: set on a multi-host leader (jaxserve/parallel/distributed.py).
        self.input_sharding = input_sharding
        self.logits_shardings = tuple(logits_shardings)
        self.step_channel: Any = None
        self.inv_freq = self._put(arch.inv_freq())
        self.inputs = InputBuilder(block_size, self.width)
        self.sampling = SamplingTensorBuilder(self.buckets.seq_cap, max_model_len,
                                              eos_token_ids=list(eos_token_ids))
        cache_shape = (arch.num_layers * num_blocks, block_size, arch.num_kv_heads, arch.head_dim)
        zeros = jax.jit(lambda: jnp.zeros(cache_shape, dtype), out_shardings=kv_sharding)
        self.k_cache, self.v_cache = zeros(), zeros()
        self._steps = {}   # (T, S) -> jitted step (one compiled executable each)
        self._constant_cache: dict[tuple[int, str], jax.Array] = {}

    # -- compilation ---------------------------------------------------------------------------
    def _jitted(self, num_tokens: int, num_seqs: int):
        return jax.jit(functools.partial(
            _step, model=self.model, inv_freq=self.inv_freq, num_tokens=num_tokens,
            num_seqs=num_seqs, width=self.width, num_top_logprobs=self.num_top_logprobs,
            logits_shardings=self.logits_shardings), donate_argnums=(1, 2))

    def _compile(self, num_tokens: int, num_seqs: int):
        """Ahead-of-time compile one bucket; returns the executable (called directly later)."""
        packed = self.inputs.build([], num_tokens, num_seqs)
        sampling = self._to_device(self.sampling.build([], num_seqs), num_seqs)
        return self._jitted(num_tokens, num_seqs).lower(
            self.params, self.k_cache, self.v_cache, self._put(packed), sampling).compile()

    def warmup(self, progress: bool = True, max_workers: int | None = None) -> float:
        """Compile every bucket before serving, several at once (XLA compiles release the GIL;
        tracing does not, but it is the small part). Returns seconds."""
        start = time.perf_counter()
        shapes = [s for s in self.buckets.all_shapes() if s not in self._steps]
        workers = max_workers or min(len(shapes), os.cpu_count() or 1) or 1
        bar = None
        if progress:
            from tqdm import tqdm
            bar = tqdm(total=len(shapes), desc="Compiling step buckets", unit="bucket")
        with ThreadPoolExecutor(workers) as pool:
            futures = {pool.submit(self._compile, t, s): (t, s) for t, s in shapes}
            for future in as_completed(futures):
                self._steps[futures[future]] = future.result()
                if bar is not None:
                    bar.update(1)
        if bar is not None:
            bar.close()
        elapsed = time.perf_counter() - start
        logger.info("warm-up compiled %d step shapes in %.1f s", len(shapes), elapsed)
        return elapsed

    @property
    def compiled_shapes(self) -> list[tuple[int, int]]:
        return sorted(self._steps)

    # -- one step ------------------------------------------------------------------------------
    def execute(self, scheduled: list[tuple[Any, int]]) -> StepResult:
        """scheduled: [(Sequence, num_new_tokens)] in batch order → sampler output per row."""
        num_tokens = sum(n for _, n in scheduled)
        t, s = self.buckets.shape_for(num_tokens, len(scheduled))
        return self._run_bucket(scheduled, t, s)

    def _run_bucket(self, scheduled, t: int, s: int) -> StepResult:
        packed = self.inputs.build(scheduled, t, s)
        sampling = self.sampling.build([seq for seq, _ in scheduled], s)
        if self.step_channel is not None:   # multi-host leader: every process runs this step
            self.step_channel.send(t, s, packed, sampling)
        return self.run_step(packed, sampling, t, s, len(scheduled))

    def run_step(self, packed: np.ndarray, sampling: SamplingTensors, t: int, s: int,
                 n: int) -> StepResult:
        """Run bucket (t, s) on host inputs; rows [:n] of the result are live. Multi-host
        followers enter here with the inputs the leader broadcast."""
        sampling = self._to_device(sampling, s)
        fn = self._steps.get((t, s))
        if fn is None:   # only before warm-up (or for a shape warm-up skipped): compile now
            fn = self._steps[(t, s)] = self._compile(t, s)
        self.k_cache, self.v_cache, out = fn(self.params, self.k_cache, self.v_cache,
                                             self._put(packed), sampling)
        host = jax.device_get(out)
        return StepResult(np.asarray(host.next_tokens)[:n], np.asarray(host.sampled_logprobs)[:n],
                          np.asarray(host.sampled_ranks)[:n], np.asarray(host.top_token_ids)[:n],
                          np.asarray(host.top_logprobs)[:n])

    def _to_device(self, sampling: SamplingTensors, s: int) -> SamplingTensors:
        """Send this step's sampling inputs; the big per-row penalty and bias tables, when no
        row uses them, are device-resident constants instead of a fresh transfer."""
        replace = {}
        groups = [(sampling.needs_penalties, ("penalty_token_ids", "num_prompt_tokens")),
                  (sampling.needs_bias, ("bias_token_ids", "bias_values"))]
        for needed, names in groups:
            if needed:
                continue
            for name in names:
                cached = self._constant_cache.get((s, name))
                if cached is None:
                    cached = self._constant_cache[(s, name)] = self._put(
                        self.sampling.constants(s)[name])
                replace[name] = cached
        return self._put(dataclasses.replace(sampling, **replace))

    def _put(self, tree: Any) -> Any:
        """Host → device, replicated on the mesh (multi-host safe: no cross-process check)."""
        return put_replicated(tree, self.input_sharding)

    def release(self, seq_id: int) -> None:
        self.sampling.release(seq_id)

    # -- inspection (tests, notebooks): not on the serving path ---------------------------------
    def prompt_logits(self, seq: Any) -> np.ndarray:
        """Logits [num_tokens, V] of every position of `seq` (which must own enough blocks).

        Compiles a shape of its own, so use it for checks, never while serving.
        """
        n = seq.num_tokens - seq.num_computed_tokens
        t = max(16, 1 << (n - 1).bit_length())
        packed = self.inputs.build([(seq, n)], t, 1)

        def forward(params, k_cache, v_cache, packed):
            token_ids, positions, _, meta = unpack(packed, t, 1, self.width)
            return self.model.apply(params, token_ids, positions, meta, k_cache, v_cache,
                                    jnp.arange(t, dtype=jnp.int32), self.inv_freq)

        logits, self.k_cache, self.v_cache = jax.jit(forward, donate_argnums=(1, 2))(
            self.params, self.k_cache, self.v_cache, self._put(packed))
        return np.asarray(logits)[:n]
