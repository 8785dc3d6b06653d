"""The runner of a pipeline-parallel engine: one compiled program per stage, chained.

Each stage (models/pipeline_placement.py) holds its layers' weights and its own layers' KV
cache on its (1, tp) sub-mesh. A step of bucket (T, S) is P executables:

    stage 0        (params_0, K_0, V_0, last_tokens copy, packed)  → hidden [T, H]
    stage 1..P-2   (params_s, K_s, V_s, packed, hidden)             → hidden
    stage P-1      the whole step of runner/step_function.py, its forward started from the
                   hidden states: final norm, LM head, sampler, penalties, prompt logprobs

Hidden states move to the next stage's devices with `jax.device_put` (XLA's device-to-device
copy; no sockets), each stage's caches are donated to its own program, and every call is
dispatched asynchronously: `run_step` returns once all P programs are queued. The sampling
state (``last_tokens``, the penalty tables) and the step's small inputs live on the last
stage; the first stage gets a copy of ``last_tokens`` for the decodes' token ids.

The scheduler and the persistent batch are the single-stage ones: block ids mean the same
on every stage (each stage's cache has ``num_blocks`` blocks per layer of its own).
"""

from __future__ import annotations

import functools
import logging
import time
from typing import Any

import jax
import numpy as np

from jaxserve.mesh import put_replicated
from jaxserve.models.pipeline_stage import stage_constants, stage_model
from jaxserve.models.registry import family_for
from jaxserve.quantization.kv import empty_cache
from jaxserve.runner.execution_plan import choose_execution_plan
from jaxserve.runner.input_batch import StepInputs
from jaxserve.runner.model_runner import ModelRunner
from jaxserve.runner.step_function import StepOutputs, stage_forward
from jaxserve.step_contract import SchedulerOutput

logger = logging.getLogger(__name__)


class PipelineExecutables:
    """Bucket (T, S)'s compiled programs, one per stage, in stage order (None for a stage of
    another process); ``extras``: what a multi-process runner keeps beside them."""

    def __init__(self, stages: list[Any], **extras: Any) -> None:
        self.stages = stages
        self.extras = extras

    def memory_analysis(self) -> Any:
        """The stage with the largest temporaries (each stage runs on its own devices)."""
        analyses = [stage.memory_analysis() for stage in self.stages if stage is not None]
        analyses = [a for a in analyses if a is not None]
        return max(analyses, key=lambda a: a.temp_size_in_bytes, default=None)

    def as_text(self) -> str:
        return "\n".join(stage.as_text() for stage in self.stages if stage is not None)


class PipelineModelRunner(ModelRunner):
    """`ModelRunner` over pipeline stages (see the module docstring). ``params``, ``k_cache``
    and ``v_cache`` are lists, one entry per stage; ``model`` is the last stage's."""

    def __init__(self, arch: Any, params: Any, backend: Any, *, pipeline: Any,
                 micro_batches: int = 1, **kwargs: Any) -> None:
        """pipeline: the engine's PipelinePlacement; params: its `place` result (a params tree
        per stage); micro_batches: steps of different micro-batches in flight at once
        (engine/micro_batches.py): each keeps its own device-side last tokens, so a step
        depends only on its own micro-batch's previous step. Everything else as
        ModelRunner (``lora``: a PipelineLoRAStacks, each stage's adapter slots)."""
        self.pipeline = pipeline
        # A step trace (benchmarks/bench_pipeline.py): when a list, each stage is waited for
        # and (stage, start, end) perf_counter seconds appended. Off while serving.
        self.stage_trace: list[tuple[int, float, float]] | None = None
        self.num_micro_batches = micro_batches
        super().__init__(arch, params, backend, **kwargs)
        self._micro_batch = 0         # the step being dispatched (execute sets it)
        self._fill_last_tokens()

    def _fill_last_tokens(self) -> None:
        """Zeroed device-side last tokens, one array per micro-batch (all on the last stage;
        ``last_tokens`` is micro-batch 0's)."""
        if self.abstract:
            self._last_tokens = [self.last_tokens] * self.num_micro_batches
            return
        self._last_tokens = [self.last_tokens] + [
            self._put(np.zeros(self.batch.max_num_seqs + 1, np.int32))
            for _ in range(self.num_micro_batches - 1)]

    @property
    def num_stages(self) -> int:
        return len(self.pipeline.stages)

    def _init_params(self, params: Any) -> None:
        if hasattr(params, "result"):
            raise ValueError("pipeline_parallel_size > 1 does not restore converted (orbax) "
                             "checkpoints yet; serve the Hugging Face or GGUF model")
        super()._init_params(params)

    def _init_model(self, backend: Any, gemv_rows: int) -> None:
        """A StageLM per stage, built by the family for the stage's arch with the stage's
        execution plan, attention sharded on the stage's mesh; the family's constants sliced
        to each stage's layers."""
        family = family_for(self.arch.architecture)
        constants = family.constants(self.arch)
        platform = self._params_platform()
        self.stage_models, self.stage_constants = [], []
        for index, (placement, layers) in enumerate(zip(self.pipeline.stages,
                                                        self.pipeline.layers)):
            mesh = placement.mesh
            self.plan = choose_execution_plan(platform, backend.name,
                                              1 if mesh is None else mesh.size, self.dtype,
                                              gemv_rows)
            model = family.build(placement.arch, placement.shard_backend(backend),
                                 self.num_blocks, self.block_size, self.dtype, self.plan)
            self.stage_models.append(stage_model(model, layers))
            consts = stage_constants(constants, layers)
            here = not self.abstract and self.pipeline.is_local(index)
            self.stage_constants.append(
                put_replicated(consts, placement.input_sharding) if here else consts)
        self.model = self.stage_models[-1]
        self.model_constants = self.stage_constants[-1]

    # -- the KV caches: one per stage, its own layers only ------------------------------------
    def _init_kv_cache(self, cache_shape: tuple[int, ...], kv_dtype: Any,
                       kv_sharding: Any) -> Any:
        self._k_cache = self._v_cache = None
        self._stage_zeros: list[Any] = []
        specs = []
        for index, (placement, layers) in enumerate(zip(self.pipeline.stages,
                                                        self.pipeline.layers)):
            shape = (layers.num_layers * self.num_blocks, *cache_shape[1:])
            make = functools.partial(empty_cache, shape, kv_dtype)
            if self.abstract or not self.pipeline.is_local(index):   # nothing allocated here
                specs.append(self._spec(jax.eval_shape(make), placement.kv_sharding))
                self._stage_zeros.append(None)
                continue
            zeros = jax.jit(make, out_shardings=placement.kv_sharding).lower().compile()
            self._stage_zeros.append(zeros)
            specs.append(jax.tree.map(lambda x: jax.ShapeDtypeStruct(
                x.shape, x.dtype, sharding=x.sharding), zeros.out_info))
        return specs

    def _fill_caches(self) -> None:
        self._k_cache = [zeros and zeros() for zeros in self._stage_zeros]
        self._v_cache = jax.block_until_ready([zeros and zeros() for zeros in self._stage_zeros])

    def allocate_kv_cache(self) -> None:
        if self.kv_cache_allocated or self.abstract:
            return
        start = time.perf_counter()
        self._fill_caches()
        self.startup_timings["kv_fill"] = time.perf_counter() - start

    def reset(self) -> None:
        for seq_id in list(self.batch.row_of):
            self.batch.remove(seq_id)
        self._k_cache = self._v_cache = None
        self._fill_caches()
        self.last_tokens = self._put(np.zeros(self.batch.max_num_seqs + 1, np.int32))
        self._fill_last_tokens()
        self.penalty_state = None
        self.penalty_state = self._empty_penalty_state()

    def kv_cache_bytes_per_device(self) -> list[int]:
        """Each stage's K + V bytes on one of its devices (this process's stages)."""
        sizes = []
        for k, v in zip(self.k_cache, self.v_cache):
            if k is None:
                continue
            leaves = jax.tree.leaves((k, v))
            sizes.append(sum(leaf.addressable_shards[0].data.nbytes for leaf in leaves))
        return sizes

    # -- compiling ---------------------------------------------------------------------------
    def enable_executable_cache(self, directory: str) -> None:
        logger.info("pipeline parallel: step executables are not serialized (JAX's "
                    "compilation cache still applies)")

    def _compile(self, num_tokens: int, num_seqs: int) -> PipelineExecutables:
        """Bucket (T, S)'s programs: loaded from shipped executables (--aot-dir) when there,
        else compiled stage by stage."""
        if self.executable_cache is not None:
            loaded = self.executable_cache.load((num_tokens, num_seqs))
            if loaded is not None:
                return loaded
        options = self._params_platform().step_compiler_options()
        return PipelineExecutables([lowered.compile(options)
                                    for lowered in self.lower_step(num_tokens, num_seqs)])

    def lower_step(self, num_tokens: int, num_seqs: int) -> list[Any]:
        """Bucket (T, S) lowered stage by stage (a list of `jax.stages.Lowered`)."""
        layout = self._layout(num_tokens, num_seqs)
        packed = layout.empty(self.batch.padding_row)
        k_specs, v_specs, last_tokens_spec, penalty_spec = self._state_specs
        hidden_shape = (num_tokens, self.arch.hidden_size)
        lora = self._stage_lora_stacks()
        lowered, hidden = [], None
        for i, placement in enumerate(self.pipeline.stages):
            packed_spec = jax.ShapeDtypeStruct(packed.shape, packed.dtype,
                                               sharding=placement.input_sharding)
            if hidden is not None:
                hidden = jax.ShapeDtypeStruct(hidden_shape, np.float32,
                                              sharding=placement.input_sharding)
            if i < self.num_stages - 1:
                fn = jax.jit(functools.partial(
                    stage_forward, model=self.stage_models[i],
                    model_constants=self.stage_constants[i], layout=layout),
                    donate_argnums=(1, 2))
                last = None if i else jax.ShapeDtypeStruct(
                    last_tokens_spec.shape, last_tokens_spec.dtype,
                    sharding=placement.input_sharding)
                lowered.append(fn.lower(self._param_specs[i], k_specs[i], v_specs[i], last,
                                        packed_spec, hidden, lora[i]))
                hidden = True          # the next stage starts from hidden states
                continue
            consts = self._constants(num_seqs)
            lowered.append(self._jitted(layout, self.model).lower(
                self._param_specs[i], k_specs[i], v_specs[i], last_tokens_spec, penalty_spec,
                packed_spec, consts["bias_token_ids"], consts["bias_values"],
                consts["grammar_bitmask"], lora[i], hidden))
        return lowered

    def _stage_lora_stacks(self) -> list[Any]:
        """Each stage's adapter slots (None per stage with LoRA off)."""
        stacks = self._lora_stacks()
        return [None] * self.num_stages if stacks is None else stacks

    def export_step(self, num_tokens: int, num_seqs: int, platform: str) -> Any:
        raise NotImplementedError("export_step of a pipeline-parallel engine: export each "
                                  "stage's lowered program (lower_step) instead")

    def prompt_logits(self, token_ids: list[int], block_ids: list[int],
                      lora_slot: int = 0) -> np.ndarray:
        raise NotImplementedError("prompt_logits is not implemented with "
                                  "pipeline_parallel_size > 1")

    # -- one step ------------------------------------------------------------------------------
    def execute(self, out: SchedulerOutput) -> Any:
        self._micro_batch = out.micro_batch
        return super().execute(out)

    def run_step(self, inputs: StepInputs) -> StepOutputs:
        """Dispatch every stage of bucket (T, S); returns the last stage's outputs at once."""
        fn, bias_ids, bias_values, bitmask = self._step_and_extras(inputs)
        packed = inputs.packed.copy()     # each step owns its inputs (ModelRunner.run_step)
        params, k_caches, v_caches = self.params, self.k_cache, self.v_cache
        hidden = None
        lora = self._stage_lora_stacks()
        micro_batch = self._micro_batch
        last_tokens = self._last_tokens[micro_batch]
        for i, placement in enumerate(self.pipeline.stages[:-1]):
            sharding = placement.input_sharding
            last = jax.device_put(last_tokens, sharding) if i == 0 else None
            if hidden is not None:
                hidden = jax.device_put(hidden, sharding)
            start = time.perf_counter()
            k_caches[i], v_caches[i], hidden = fn.stages[i](
                params[i], k_caches[i], v_caches[i], last, put_replicated(packed, sharding),
                hidden, lora[i])
            self._trace(i, start, hidden)
        hidden = jax.device_put(hidden, self.input_sharding)
        start = time.perf_counter()
        (k_caches[-1], v_caches[-1], last_tokens, self.penalty_state, out,
         prompt_out) = fn.stages[-1](
            params[-1], k_caches[-1], v_caches[-1], last_tokens, self.penalty_state,
            self._put(packed), bias_ids, bias_values, bitmask, lora[-1], hidden)
        self._last_tokens[micro_batch] = last_tokens
        if micro_batch == 0:
            self.last_tokens = last_tokens
        self._trace(self.num_stages - 1, start, out)
        out[0].next_tokens.copy_to_host_async()
        return out, prompt_out

    def _trace(self, stage: int, start: float, outputs: Any) -> None:
        if self.stage_trace is not None:
            jax.block_until_ready(outputs)
            self.stage_trace.append((stage, start, time.perf_counter()))


def bubble_fraction(trace: list[tuple[int, float, float]], num_stages: int) -> float:
    """The stages' idle share of a step trace: 1 - (busy seconds of all stages) / (stages x
    the trace's span). With one batch in flight it tends to (P - 1) / P."""
    if not trace:
        return 0.0
    span = max(end for _, _, end in trace) - min(start for _, start, _ in trace)
    busy = sum(end - start for _, start, end in trace)
    return 1.0 - busy / (num_stages * span) if span > 0 else 0.0
