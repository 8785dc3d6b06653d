"""Turns a `SchedulerOutput` into one jitted, donated, bucketed step, dispatched async.

The runner knows tensors, never queues or `Sequence`s: it applies the scheduler's
diffs to its persistent batch (input_batch.py), packs the step's inputs into one
int32 buffer for bucket (T, S), and calls that bucket's ahead-of-time compiled
executable with the KV cache and ``last_tokens`` donated. The call returns at once
(JAX dispatch is asynchronous); `PendingStep.result()` (the end of this file) waits
for the sampled tokens. Between the two the host schedules and packs the next step, whose decodes
read this step's samples from ``last_tokens`` on the device.
"""

from __future__ import annotations

import functools
import logging
import math
import time
from typing import Any
from typing import Sequence as Seq

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.attention.backend import AttentionBackend
from jaxserve.lora.stacks import LoRAStacks, with_lora
from jaxserve.mesh import put_replicated
from jaxserve.models.arch import ModelArch
from jaxserve.models.linear_method import holds_packed_weights
from jaxserve.models.registry import family_for
from jaxserve.models.tracing import apply_model
from jaxserve.platforms import Platform, platform_of_device
from jaxserve.quantization.kv import empty_cache
from jaxserve.runner.buckets import BucketPolicy
from jaxserve.runner.execution_plan import choose_execution_plan
from jaxserve.runner.input_batch import InputBatch, PenaltyAdmissions, StepInputs
from jaxserve.runner.penalty_state import PenaltyState, empty_penalty_state, load_history
from jaxserve.runner.step_compilation import StepCompilation, wait_for_background_compiles
from jaxserve.runner.step_function import StepOutputs
from jaxserve.step_contract import (
    PromptLogprobsChunk,
    RunnerOutput,
    SampledLogprobs,
    SchedulerOutput,
)
from jaxserve.step_inputs import StepLayout

__all__ = ["ModelRunner", "PendingStep", "StepOutputs", "wait_for_background_compiles"]

logger = logging.getLogger(__name__)


class ModelRunner(StepCompilation):
    """One model replica's device side: parameters, the KV cache, the persistent batch and
    the compiled step of every bucket; `execute` runs one `SchedulerOutput`."""

    # Batches in flight at once: one here; a pipeline runner keeps one per stage.
    num_micro_batches = 1

    def __init__(self, arch: ModelArch, params: Any, backend: AttentionBackend, *,
                 dtype: Any, num_blocks: int, block_size: int, max_model_len: int,
                 max_num_seqs: int, max_num_batched_tokens: int, max_logprobs: int,
                 eos_token_ids: Seq[int], prompt_logprobs_cap: int = 0,
                 num_spec_tokens: int = 0, max_spec_rows: int = 0, kv_sharding: Any = None,
                 input_sharding: Any = None, logits_shardings: tuple = (),
                 kv_cache_dtype: Any = None, lora: LoRAStacks | None = None,
                 gemv_rows: int = 0, abstract: bool = False) -> None:
        """abstract: build the step only to compile it ahead of time (engine/aot_compile.py)
        for devices that may not be here (a deviceless GPU topology): params, the KV cache
        and the step's inputs are ShapeDtypeStructs with their shardings; nothing is
        allocated and the runner cannot execute. gemv_rows: on CPU, float projections of at
        most this many rows take the streaming GEMV (kernels/cpu/gemv_choice.py)."""
        self.arch = arch
        self.abstract = abstract
        self.dtype = dtype
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.width = math.ceil(max_model_len / block_size)
        self.buckets = BucketPolicy(max_num_batched_tokens, max_num_seqs,
                                    num_spec_tokens=num_spec_tokens, max_spec_rows=max_spec_rows)
        self.num_top_logprobs = max_logprobs
        self.prompt_logprobs_cap = prompt_logprobs_cap
        # Speculative decoding: k drafts per row at most, verified for the first
        # min(S, max_spec_rows) rows of a step (the scheduler drafts only in steps that small).
        self.num_spec_tokens = num_spec_tokens
        self.max_spec_rows = max_spec_rows
        self.lora = lora    # multi-LoRA slots (None: off)
        # input_sharding: where step inputs go (replicated on the tp mesh; None = default
        # device). step_channel: set on a multi-host leader (jaxserve/parallel/distributed.py).
        self.input_sharding = input_sharding
        self.logits_shardings = tuple(logits_shardings)
        self.step_channel: Any = None
        # seconds: kv_fill (allocating the cache) and params_wait (what warm-up waited for)
        self.startup_timings: dict[str, float] = {}
        self._init_params(params)
        self._init_model(backend, gemv_rows)
        self.batch = InputBatch(max_num_seqs, max_model_len, block_size, self.width,
                                eos_token_ids=list(eos_token_ids),
                                prompt_logprobs_cap=prompt_logprobs_cap,
                                vocab_size=arch.vocab_size, lora=lora is not None)
        cache_shape = (arch.num_layers * num_blocks, block_size, arch.num_kv_heads, arch.head_dim)
        kv_dtype = kv_cache_dtype or dtype
        cache_spec = self._init_kv_cache(cache_shape, kv_dtype, kv_sharding)
        self.last_tokens = self._put(np.zeros(max_num_seqs + 1, np.int32))
        penalty_spec = self._init_penalty_state(max_num_seqs + 1, arch.vocab_size)
        # What the step is lowered against: the donated arrays' shapes and shardings, never
        # the arrays (a background compile must not read a buffer a step has just donated).
        self._state_specs = (cache_spec, cache_spec, jax.ShapeDtypeStruct(
            self.last_tokens.shape, self.last_tokens.dtype, sharding=self.last_tokens.sharding),
            penalty_spec)
        self._prompt_logits_fns: dict = {}   # padded length -> jitted forward (prompt_logits)
        self._device_constants: dict[int, dict[str, jax.Array]] = {}
        self._init_compilation()
        self._settings = {
            "arch": arch, "dtype": np.dtype(dtype).name, "kv_dtype": np.dtype(kv_dtype).name,
            "cache_shape": cache_shape, "max_model_len": max_model_len,
            "shapes": self.buckets.all_shapes(), "num_top_logprobs": max_logprobs,
            "prompt_logprobs_cap": prompt_logprobs_cap, "num_spec_tokens": num_spec_tokens,
            "max_spec_rows": max_spec_rows, "max_num_seqs": max_num_seqs,
            "eos_token_ids": list(eos_token_ids), "backend": backend.name,
            "kv_sharding": kv_sharding, "input_sharding": input_sharding,
            "logits_shardings": self.logits_shardings,
            "plan": self.plan,
            "lora": None if lora is None else jax.tree.map(
                lambda x: (x.shape, x.dtype), self._lora_stacks())}

    def _init_params(self, params: Any) -> None:
        """params: device arrays, or a RestoringParams (engine/model_source.py) whose arrays
        are still being read: the step is built and compiled on their shapes meanwhile."""
        self._params_pending = params if hasattr(params, "result") else None
        self._params = None if self._params_pending is not None else params
        self._param_specs = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
            params.spec if self._params_pending is not None else params)

    def _init_model(self, backend: AttentionBackend, gemv_rows: int) -> None:
        """The family's model module, built with its execution plan (runner/execution_plan.py),
        and the constants (rope tables, windows) its step closes over: numpy when abstract,
        embedded as constants either way."""
        family = family_for(self.arch.architecture)   # the registry's model module for this arch
        mesh = getattr(self.input_sharding, "mesh", None)
        self.plan = choose_execution_plan(self._params_platform(), backend.name,
                                          1 if mesh is None else mesh.size, self.dtype,
                                          gemv_rows, holds_packed_weights(self._param_specs))
        self.model = family.build(self.arch, backend, self.num_blocks, self.block_size,
                                  self.dtype, self.plan)
        constants = family.constants(self.arch)
        self.model_constants = constants if self.abstract else self._put(constants)

    def _params_platform(self) -> Platform:
        """The platform the parameters live on: an abstract runner's target devices, not
        this machine's."""
        for leaf in jax.tree.leaves(self._param_specs):
            sharding = getattr(leaf, "sharding", None)
            if sharding is not None:
                return platform_of_device(next(iter(sharding.device_set)))
        return platform_of_device(None)

    def _init_kv_cache(self, cache_shape: tuple[int, ...], kv_dtype: Any,
                       kv_sharding: Any) -> Any:
        """Compile the KV cache's zero-fill (int8 / fp8: a QuantizedKV of values and per-slot-
        head scales, quantization/kv.py) without running it; returns the cache's
        ShapeDtypeStructs, all the step is compiled against.

        The cache is allocated by `allocate_kv_cache`, which warm-up calls only after every
        warm-up bucket is compiled: XLA's GEMM autotuner allocates scratch while it compiles,
        and a cache sized to the memory plan would leave it none."""
        self._k_cache = self._v_cache = None
        self._zeros: Any = None   # also refills the cache in reset() after a failed step
        if self.abstract:
            return self._spec(jax.eval_shape(lambda: empty_cache(cache_shape, kv_dtype)),
                              kv_sharding)
        self._zeros = jax.jit(lambda: empty_cache(cache_shape, kv_dtype),
                              out_shardings=kv_sharding).lower().compile()
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(
            x.shape, x.dtype, sharding=x.sharding), self._zeros.out_info)

    # -- the KV cache --------------------------------------------------------------------------
    @property
    def kv_cache_allocated(self) -> bool:
        return self._k_cache is not None

    def allocate_kv_cache(self) -> None:
        """Allocate the zero-filled K and V caches (once; warm-up calls it after compiling,
        and the first use of k_cache / v_cache when there was no warm-up)."""
        if self.kv_cache_allocated or self.abstract:
            return
        start = time.perf_counter()
        self._k_cache = self._zeros()
        self._v_cache = jax.block_until_ready(self._zeros())
        self.startup_timings["kv_fill"] = time.perf_counter() - start

    def reset(self) -> None:
        """Forget every row and refill the KV cache and the device-side last tokens with
        zeros: after a failed step the donated buffers may be consumed or hold an error, so
        nothing of the old device state is trusted (the engine discards the KV contents)."""
        for seq_id in list(self.batch.row_of):
            self.batch.remove(seq_id)
        self._k_cache = self._v_cache = None       # free the old cache before the new one
        self._k_cache = self._zeros()
        self._v_cache = jax.block_until_ready(self._zeros())
        self.last_tokens = self._put(np.zeros(self.batch.max_num_seqs + 1, np.int32))
        self.penalty_state = None
        self.penalty_state = self._empty_penalty_state()

    # -- the penalty history (runner/penalty_state.py) -----------------------------------------
    def _init_penalty_state(self, num_rows: int, vocab: int) -> Any:
        """The [R + 1, V] tables, zeroed on the device and replicated like the step's inputs;
        returns their spec."""
        self._empty_penalty_state = jax.jit(
            functools.partial(empty_penalty_state, num_rows, vocab),
            out_shardings=self.input_sharding)
        self.penalty_state: PenaltyState | None = \
            None if self.abstract else self._empty_penalty_state()
        self._history_loader: Any = None     # compiled by warmup (or the first admission)
        self._no_resets: Any = None
        return self._spec(jax.eval_shape(self._empty_penalty_state), self.input_sharding)

    def _compile_history_loader(self) -> None:
        """`load_history` for one chunk shape, the tables donated."""
        if self._history_loader is not None or self.abstract:
            return
        self._no_resets = self._put(np.full(self.batch.max_num_seqs, -1, np.int32))
        entries = self._put(np.full((3, self.batch.history_chunk), -1, np.int32))
        self._history_loader = jax.jit(load_history, donate_argnums=0).lower(
            self._state_specs[3], self._no_resets, entries).compile()

    def _load_penalty_history(self, admissions: PenaltyAdmissions) -> None:
        """Reset the admitted rows' tables and count their known tokens, one dispatch per
        chunk, ordered before the step by the donated tables."""
        self._compile_history_loader()
        resets = self._put(admissions.resets)
        for chunk in admissions.chunks:
            self.penalty_state = self._history_loader(self.penalty_state, resets,
                                                      self._put(chunk))
            resets = self._no_resets

    def _wait_params(self) -> None:
        if self._params_pending is not None:
            start = time.perf_counter()
            self._params = self._params_pending.result()
            self._params_pending = None
            self.startup_timings["params_wait"] = time.perf_counter() - start

    @property
    def params(self) -> Any:
        if self._params_pending is not None:
            self._wait_params()
        return self._params

    @params.setter
    def params(self, value: Any) -> None:
        self._params, self._params_pending = value, None

    @property
    def k_cache(self) -> Any:
        self.allocate_kv_cache()
        return self._k_cache

    @k_cache.setter
    def k_cache(self, value: Any) -> None:
        self._k_cache = value

    @property
    def v_cache(self) -> Any:
        self.allocate_kv_cache()
        return self._v_cache

    @v_cache.setter
    def v_cache(self, value: Any) -> None:
        self._v_cache = value

    def _layout(self, num_tokens: int, num_seqs: int) -> StepLayout:
        return StepLayout(num_tokens, num_seqs, self.width, self.prompt_logprobs_cap,
                          self.lora is not None)

    def _lora_stacks(self) -> Any:
        return self.lora.arrays if self.lora is not None else None

    # -- one step ------------------------------------------------------------------------------
    def execute(self, out: SchedulerOutput) -> PendingStep | None:
        """Apply ``out``'s diffs and dispatch its step; None when it schedules no tokens."""
        for slot, weights in out.lora_loads.items():   # adapters the scheduler gave a slot
            self.lora.write(slot, weights)
        rows = self.batch.apply(out)
        if out.is_empty:
            return None
        t, s = self.bucket_for(out.total_num_scheduled_tokens, out.num_rows)
        inputs = self.batch.prepare(out, rows, t, s)
        if self.step_channel is not None:   # multi-host leader: every process runs this step
            self.step_channel.send(inputs)
        device_out = self.run_step(inputs)
        if inputs.prompt_logprobs_rows:      # small arrays; start their copy with the tokens'
            for leaf in jax.tree.leaves(device_out[1]):
                leaf.copy_to_host_async()
        kv_lens = self.batch.num_computed[rows] + np.asarray(out.num_scheduled_tokens)
        want_logprobs = bool((self.batch.num_logprobs[rows] >= 0).any())
        return PendingStep(self, out, rows, kv_lens, device_out, want_logprobs,
                           inputs.prompt_logprobs_rows, num_tokens=t)

    def _step_and_extras(self, inputs: StepInputs) -> tuple[Any, Any, Any, Any]:
        """Bucket (T, S)'s compiled step and its device-side extras (logit bias ids and values,
        grammar bitmask), with any penalty history loaded first: what every runner's
        `run_step` needs before it dispatches."""
        t, s = inputs.num_tokens, inputs.num_seqs
        fn = self._steps.get((t, s))
        if fn is None:   # only before warm-up (or for a shape warm-up skipped): compile now
            fn = self._steps[(t, s)] = self._compile(t, s)
        consts = self._constants(s)
        if inputs.penalty_admissions is not None:   # before the step that first reads them
            self._load_penalty_history(inputs.penalty_admissions)
        if inputs.bias_token_ids is None:
            bias_ids, bias_values = consts["bias_token_ids"], consts["bias_values"]
        else:
            bias_ids, bias_values = self._put((inputs.bias_token_ids, inputs.bias_values))
        # No constrained row: the device-resident all-ones mask, no transfer.
        bitmask = consts["grammar_bitmask"] if inputs.grammar_bitmask is None \
            else self._put(inputs.grammar_bitmask)
        return fn, bias_ids, bias_values, bitmask

    def run_step(self, inputs: StepInputs) -> StepOutputs:
        """Dispatch bucket (T, S) on host inputs; returns the step's device outputs at once.
        Multi-host followers enter here with the inputs the leader broadcast."""
        fn, bias_ids, bias_values, bitmask = self._step_and_extras(inputs)
        (self.k_cache, self.v_cache, self.last_tokens, self.penalty_state, out,
         prompt_out) = fn(
            self.params, self.k_cache, self.v_cache, self.last_tokens, self.penalty_state,
            # A copy (a few KB): `jax.device_put` may alias numpy memory on CPU and the host
            # rewrites this bucket's buffer for its next step, while any number of earlier
            # steps may still be in flight (the draft proposer dispatches several before
            # collecting): each step must own the inputs it was given.
            self._put(inputs.packed.copy()),
            bias_ids, bias_values, bitmask, self._lora_stacks())
        out[0].next_tokens.copy_to_host_async()
        return out, prompt_out

    def empty_inputs(self, num_tokens: int, num_seqs: int, *, penalty_chunks: int = 0,
                     bias: bool = False, grammar: bool = False) -> StepInputs:
        return self.batch.empty_inputs(num_tokens, num_seqs, penalty_chunks=penalty_chunks,
                                       bias=bias, grammar=grammar)

    def _constants(self, num_seqs: int) -> dict[str, jax.Array]:
        """Device-resident bias / grammar tables for steps where no row needs them."""
        consts = self._device_constants.get(num_seqs)
        if consts is None:
            consts = self._device_constants[num_seqs] = self._put(self.batch.constants(num_seqs))
        return consts

    def _put(self, tree: Any) -> Any:
        """Host → device, replicated on the mesh (multi-host safe: no cross-process check);
        an abstract runner gets the ShapeDtypeStructs such arrays would have."""
        if self.abstract:
            return self._spec(tree, self.input_sharding)
        return put_replicated(tree, self.input_sharding)

    @staticmethod
    def _spec(tree: Any, sharding: Any) -> Any:
        """ShapeDtypeStructs of ``tree``'s leaves placed with ``sharding`` (None: the default
        device, as an unsharded jax.device_put places them)."""
        sharding = sharding or jax.sharding.SingleDeviceSharding(jax.devices()[0])
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype,
                                                           sharding=sharding), tree)

    # -- inspection (tests, notebooks): not on the serving path ---------------------------------
    def prompt_logits(self, token_ids: list[int], block_ids: list[int],
                      lora_slot: int = 0) -> np.ndarray:
        """Logits [len, V] of every position of a prompt whose KV goes to ``block_ids``
        (under the adapter in ``lora_slot`` when LoRA is on).

        Compiles a shape of its own, so use it for checks, never while serving.
        """
        n = len(token_ids)
        t = max(16, 1 << (n - 1).bit_length())
        layout = self._layout(t, 1)
        buf = layout.empty(self.batch.padding_row)
        v = layout.views(buf)
        positions = np.arange(n)
        blocks = np.asarray(block_ids, np.int32)
        v["token_ids"][:n] = token_ids
        v["positions"][:n] = positions
        v["slot_mapping"][:n] = blocks[positions // self.block_size] * self.block_size \
            + positions % self.block_size
        v["query_start_loc"][1:] = n
        v["kv_lens"][0] = n
        v["num_seqs"][0] = 1
        v["block_tables"][0, :len(blocks)] = blocks
        if layout.lora:
            v["lora_slots"][:n] = lora_slot

        def forward(params, k_cache, v_cache, packed, lora_stacks):
            f = layout.unpack(packed)
            if lora_stacks is not None:
                params = with_lora(params, lora_stacks)
            return apply_model(self.model, params, f["token_ids"], f["positions"],
                               layout.metadata(f), k_cache, v_cache,
                               jnp.arange(t, dtype=jnp.int32), self.model_constants,
                               method="forward_logits")

        # One jitted function per padded length: a fresh closure each call would trace and
        # compile again for every prompt (parity tests call this once per prompt).
        if t not in self._prompt_logits_fns:
            self._prompt_logits_fns[t] = jax.jit(forward, donate_argnums=(1, 2))
        logits, self.k_cache, self.v_cache = self._prompt_logits_fns[t](
            self.params, self.k_cache, self.v_cache, self._put(buf), self._lora_stacks())
        return np.asarray(logits)[:n]


# -- a dispatched step ---------------------------------------------------------------------------
class PendingStep:
    """A dispatched step; `result()` waits for its samples and returns a RunnerOutput."""

    def __init__(self, runner: ModelRunner, out: SchedulerOutput, rows: np.ndarray,
                 kv_lens: np.ndarray, device_out: StepOutputs, want_logprobs: bool,
                 prompt_logprobs_rows: tuple[tuple[int, int, int, int], ...] = (), *,
                 num_tokens: int = 0) -> None:
        self._runner, self._out, self._rows, self._kv_lens = runner, out, rows, kv_lens
        self.num_tokens = num_tokens     # the token bucket it runs in (the engine's step costs)
        (self._sampler_out, self._num_emitted), self._prompt_out = device_out
        self._want_logprobs = want_logprobs
        self._prompt_logprobs_rows = prompt_logprobs_rows
        self._result: RunnerOutput | None = None

    def result(self) -> RunnerOutput:
        if self._result is None:
            n = self._out.num_rows
            width = self._runner.num_spec_tokens + 1     # tokens per row in the outputs
            all_tokens = np.asarray(self._sampler_out.next_tokens)[:n * width]
            logprobs = None
            if self._want_logprobs:
                o = jax.device_get(self._sampler_out)
                logprobs = SampledLogprobs(np.asarray(o.sampled_logprobs)[:n * width],
                                           np.asarray(o.sampled_ranks)[:n * width],
                                           np.asarray(o.top_token_ids)[:n * width],
                                           np.asarray(o.top_logprobs)[:n * width])
            emitted = None
            if self._num_emitted is None:
                tokens = all_tokens.tolist()
                self._runner.batch.record_sampled(self._out.seq_ids, self._rows,
                                                  self._kv_lens, self._out.is_sampling, tokens)
            else:
                grid = all_tokens.reshape(n, width)
                counts = np.asarray(self._num_emitted)[:n]
                tokens = grid[:, 0].tolist()
                emitted = [grid[i, :counts[i]].tolist() for i in range(n)]
                drafts = np.asarray([len(self._out.draft_token_ids.get(s, ()))
                                     for s in self._out.seq_ids], np.int64)
                self._runner.batch.record_emitted(self._out.seq_ids, self._rows,
                                                  self._kv_lens - drafts,
                                                  self._out.is_sampling, grid, counts)
            self._result = RunnerOutput(tokens, logprobs, self._prompt_logprobs(),
                                        emitted_token_ids=emitted, logprobs_stride=width)
            self._sampler_out = self._prompt_out = self._num_emitted = None
        return self._result

    def _prompt_logprobs(self) -> dict[int, PromptLogprobsChunk]:
        if not self._prompt_logprobs_rows:
            return {}
        o = jax.device_get(self._prompt_out)
        batch = self._runner.batch
        chunks = {}
        for i, first, slot, count in self._prompt_logprobs_rows:
            row, end = self._rows[i], slot + count
            chunks[i] = PromptLogprobsChunk(
                first, batch.token_ids[row, first:first + count].copy(),
                np.asarray(o.logprobs[slot:end]), np.asarray(o.ranks[slot:end]),
                np.asarray(o.top_token_ids[slot:end]), np.asarray(o.top_logprobs[slot:end]))
        return chunks

