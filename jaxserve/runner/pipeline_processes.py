"""The pipeline runner across processes: each process runs its own stages of every step.

With ``--num-processes N -pp P`` (jax.distributed) every stage's devices, weights and KV
cache are in one process (pipeline_layout.py). Every process builds the same runner and
runs the same steps: the leader (process 0, which holds stage 0) through
`ModelRunner.execute`, which broadcasts each step's inputs first; the followers through
`run_step` on the inputs they receive (parallel/distributed.py). A step is then

    for each stage s:       its process runs stage s's program (the others skip it)
      s -> s + 1 crosses     StageHops: the hidden states [T, H] move with a ppermute
      processes              that every process joins (same order everywhere)
    last stage -> stage 0    StageHops again: the step's outputs (sampled tokens,
                             logprobs, prompt logprobs) and the rows' last tokens, so the
                             leader's PendingStep reads them and stage 0 resolves the next
                             step's decode tokens from them

Stages of the same process hand their hidden states over with `jax.device_put`, as in one
process. The sampling state (last tokens, penalty tables, bias and grammar inputs) lives on
the last stage, in its process only; elsewhere it is shape structs. Each process compiles its
own stages' programs and the hops; the other stages are lowered only (the last stage's
lowering gives the shapes of what the return hop carries).

Not across processes (refused in config.py): micro-batches > 1, speculative decoding.
"""

from __future__ import annotations

import functools
import logging
import time
from typing import Any

import jax
import numpy as np

from jaxserve.mesh import put_replicated
from jaxserve.runner.input_batch import StepInputs
from jaxserve.runner.penalty_state import empty_penalty_state
from jaxserve.runner.pipeline_runner import PipelineExecutables, PipelineModelRunner
from jaxserve.runner.stage_hops import StageHops
from jaxserve.runner.step_function import StepOutputs

logger = logging.getLogger(__name__)


class MultiProcessPipelineRunner(PipelineModelRunner):
    """`PipelineModelRunner` whose stages run in several processes (module docstring)."""

    def __init__(self, arch: Any, params: Any, backend: Any, *, pipeline: Any,
                 **kwargs: Any) -> None:
        if kwargs.get("micro_batches", 1) > 1:
            raise ValueError("pipeline_micro_batches > 1 is not supported across processes")
        if kwargs.get("num_spec_tokens", 0):
            raise ValueError("speculative decoding is not supported with "
                             "pipeline_parallel_size > 1 across processes")
        self.hops = StageHops([stage.mesh for stage in pipeline.stages])
        last = len(pipeline.stages) - 1
        if pipeline.process_of(0) == pipeline.process_of(last):
            raise ValueError("a multi-process pipeline needs its first and last stages in "
                             "different processes")
        self._samples_here = pipeline.is_local(last)   # before ModelRunner's _put calls
        super().__init__(arch, params, backend, pipeline=pipeline, **kwargs)
        # Stage 0's copy of the rows' last tokens (the return hop refreshes it every step).
        self._first_stage_tokens = put_replicated(
            np.zeros(self.batch.max_num_seqs + 1, np.int32),
            pipeline.stages[0].input_sharding) if pipeline.is_local(0) else None

    # -- the sampling state: on the last stage's process only -------------------------------
    def _put(self, tree: Any) -> Any:
        if not self._samples_here:       # the last stage is another process's: shapes only
            return self._spec(tree, self.input_sharding)
        return super()._put(tree)

    def _init_penalty_state(self, num_rows: int, vocab: int) -> Any:
        if self._samples_here:
            return super()._init_penalty_state(num_rows, vocab)
        self._empty_penalty_state = jax.jit(
            functools.partial(empty_penalty_state, num_rows, vocab),
            out_shardings=self.input_sharding)
        self.penalty_state = None
        self._history_loader = self._no_resets = None
        return self._spec(jax.eval_shape(self._empty_penalty_state), self.input_sharding)

    def _compile_history_loader(self) -> None:
        if self._samples_here:
            super()._compile_history_loader()

    def reset(self) -> None:
        raise RuntimeError("a failed step cannot be recovered across processes: restart "
                           "every process of the pipeline")

    # -- compiling ---------------------------------------------------------------------------
    def _compile(self, num_tokens: int, num_seqs: int) -> PipelineExecutables:
        """This process's stages of bucket (T, S) compiled, and every hop it takes part in.
        Every stage is lowered (each process knows every stage's output shapes); only this
        process's are compiled."""
        options = self._params_platform().step_compiler_options()
        lowered = self.lower_step(num_tokens, num_seqs)
        stages = [low.compile(options) if self.pipeline.is_local(i) else None
                  for i, low in enumerate(lowered)]
        hidden = {}                         # boundary -> the hidden states' [T, H] spec
        for i in range(self.num_stages - 1):
            if self._crosses(i):
                out = lowered[i].out_info[2]    # stage_forward's (k, v, hidden)
                hidden[i] = [jax.ShapeDtypeStruct(out.shape, out.dtype)]
                self.hops.compile(hidden[i], i, i + 1)
        info = lowered[-1].out_info         # (k, v, last_tokens, penalties, out, prompt_out)
        leaves, tree = jax.tree.flatten((info[4], info[5], info[2]))
        returned = [jax.ShapeDtypeStruct(leaf.shape, leaf.dtype) for leaf in leaves]
        self.hops.compile(returned, self.num_stages - 1, 0)
        return PipelineExecutables(stages, hidden=hidden, returned=returned, tree=tree)

    def _crosses(self, stage: int) -> bool:
        """Whether stage ``stage`` hands its hidden states to another process."""
        return self.pipeline.process_of(stage) != self.pipeline.process_of(stage + 1)

    def compiled_temp_bytes(self) -> int:
        """The largest temporaries of any process's steps: warm-up replans the KV cache from
        it, and every process must replan alike (the plan's `agree` is a collective). Called
        once per warm-up by every process, so this collective is in step too."""
        from jax.experimental import multihost_utils

        peak = np.array([super().compiled_temp_bytes()], np.int64)
        return int(np.max(multihost_utils.process_allgather(peak)))

    # -- one step ------------------------------------------------------------------------------
    def _step_and_extras(self, inputs: StepInputs) -> tuple[Any, Any, Any, Any]:
        if self._samples_here:
            return super()._step_and_extras(inputs)
        t, s = inputs.num_tokens, inputs.num_seqs
        fn = self._steps.get((t, s))
        if fn is None:
            fn = self._steps[(t, s)] = self._compile(t, s)
        return fn, None, None, None

    def run_step(self, inputs: StepInputs) -> StepOutputs | None:
        """This process's stages of the step and every hop (see the module docstring). The
        step's outputs on stage 0's devices in the leader's process; None elsewhere."""
        fn, bias_ids, bias_values, bitmask = self._step_and_extras(inputs)
        packed = inputs.packed.copy()     # each step owns its inputs (ModelRunner.run_step)
        params, k_caches, v_caches = self.params, self.k_cache, self.v_cache
        stages, hops, extras = self.pipeline.stages, self.hops, fn.extras
        hidden = None                     # the latest stage's output, where it is here
        for i in range(self.num_stages - 1):
            if self.pipeline.is_local(i):
                sharding = stages[i].input_sharding
                if i:
                    hidden = jax.device_put(hidden, sharding)
                first = self._first_stage_tokens if i == 0 else None
                start = time.perf_counter()
                k_caches[i], v_caches[i], hidden = fn.stages[i](
                    params[i], k_caches[i], v_caches[i], first,
                    put_replicated(packed, sharding), hidden if i else None,
                    None)       # no LoRA slots across processes (config.py refuses it)
                self._trace(i, start, hidden)
            if self._crosses(i):
                moved = hops.send([hidden] if hidden is not None else None,
                                  extras["hidden"][i], i, i + 1)
                hidden = moved[0] if moved is not None else None
        returned = None
        if self._samples_here:
            hidden = jax.device_put(hidden, self.input_sharding)
            start = time.perf_counter()
            (k_caches[-1], v_caches[-1], self.last_tokens, self.penalty_state, out,
             prompt_out) = fn.stages[-1](
                params[-1], k_caches[-1], v_caches[-1], self.last_tokens, self.penalty_state,
                self._put(packed), bias_ids, bias_values, bitmask, None, hidden)   # no LoRA
            self._last_tokens[0] = self.last_tokens
            self._trace(self.num_stages - 1, start, out)
            returned = jax.tree.leaves((out, prompt_out, self.last_tokens))
        moved = hops.send(returned, extras["returned"], self.num_stages - 1, 0)
        if moved is None:
            return None
        out, prompt_out, self._first_stage_tokens = jax.tree.unflatten(extras["tree"], moved)
        out[0].next_tokens.copy_to_host_async()
        return out, prompt_out
